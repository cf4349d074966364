"""The GPU check (benchmarks/sim/gpu_check.sh) runs on the device's package set, and leaves no model behind.

What it is:
  - the dry run (`--device cpu --small`) through the script itself, in a virtual environment that holds
    only what the GPU machine is promised: torch, triton, transformers, pytest, hypothesis and what they
    require (their metadata's closure, read here), the standard library and the project; so an import of
    anything else (fastapi, matplotlib, a grammar engine) on the check's path fails here as it would there.
    It exits 0, writes gpu_check.json with every part and the rows predicted beside the measured ones, skips
    structured outputs in one line (no grammar engine in that set), and deletes its model;
  - the script stopped by a signal while it builds its model: it stops at once and deletes the model; its
    kernel tests, cut by a one-second limit, are reported as a timeout and the script goes on;
  - the check's parts fail soft: an error, a failed assertion, a skip, a part past its cap and one that
    would not fit in the budget each leave one line and their figures, and the next part runs.

What it is not: the check on a GPU (that needs the device), or a test of the figures (tests/test_simulator.py
checks the predicted steps against the real ones). rich is importable in the venv: transformers requires
typer, which requires rich (and the levels' progress bar imports it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import venv
from importlib import metadata
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "sim" / "gpu_check.sh"
DEVICE_PACKAGES = ("torch", "triton", "transformers", "pytest", "hypothesis")  # what the GPU machine promises
QUICK_KERNEL_TESTS = "tests/test_level1_kernel.py -k write_kv_cache_touches_only_named_slots"


def closure(roots) -> list[metadata.Distribution]:
    """The installed distributions `roots` require, transitively (markers evaluated here, extras left out)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, todo, dists = set(), list(roots), []
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # required on another platform, or optional in practice: absent here too
        dists.append(dist)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return dists


@pytest.fixture(scope="module")
def device_env(tmp_path_factory) -> dict:
    """The environment of a process whose `python` sees only the device's packages: a venv whose
    site-packages links each top-level entry (package, module, dist-info) of the closure's distributions."""
    root = tmp_path_factory.mktemp("device-venv")
    venv.EnvBuilder(symlinks=True, with_pip=False).create(root)
    python = root / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
    for dist in closure(DEVICE_PACKAGES):
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "__pycache__")}:
            src = Path(dist.locate_file(top))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PATH=f"{root / 'bin'}{os.pathsep}{env['PATH']}", PYTHONNOUSERSITE="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", GPU_CHECK_WHEELS=str(root / "no-wheels"))  # fmt: skip
    probe = "import importlib.util as u; print([m for m in ('fastapi', 'matplotlib', 'xgrammar', 'llguidance') if u.find_spec(m)])"
    seen = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert seen.strip() == "[]", f"the venv sees packages the device does not promise: {seen}"
    return env


def test_the_dry_run_finishes_on_the_devices_packages_and_deletes_its_model(device_env, tmp_path):
    out = tmp_path / "out"
    env = {**device_env, "OUT": str(out), "GPU_CHECK_ARGS": "--device cpu --small", "GPU_CHECK_TOTAL": "400",
           "GPU_CHECK_KERNEL_TESTS": QUICK_KERNEL_TESTS}  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr + ((out / "gpu_check.txt").read_text() if (out / "gpu_check.txt").is_file() else "")
    assert done.returncode == 0, log[-6000:]
    assert time.monotonic() - t0 < 400
    from benchmarks.sim.gpu_check import PARTS, SIMULATED

    result = json.loads((out / "gpu_check.json").read_text())
    assert set(result) >= {"machine", "gpu", "parts", "rows", "summary", "measured", "elapsed_s", "budget_s"}
    assert list(result["parts"]) == ["kernel_tests", *PARTS]
    status = {name: part["status"] for name, part in result["parts"].items()}
    skipped = {"structured_outputs": "skipped", "compiled_step": "skipped"}  # no grammar engine; no GPU
    assert status == {**dict.fromkeys(status, "pass"), **skipped}, log[-6000:]
    skipped = [line for line in done.stdout.splitlines() if "structured_outputs" in line]
    assert len(skipped) == 1 and "no grammar engine" in skipped[0], done.stdout
    assert {r["level"] for r in result["rows"]} == set(SIMULATED)
    assert set(result["summary"]) == {"tok_s_median", "tok_s_worst", "ttft_median", "ttft_worst"}
    figures = result["parts"]["throughput"]["figures"]["uniform"]
    assert set(figures) == {"hf", "level0_naive", "level2_continuous", "level3_prefix"}
    assert "level1_paged" in result["parts"]["throughput_level1"]["figures"]["uniform"]
    assert 0 < result["parts"]["sampled_speculation"]["figures"]["acceptance_rate"] <= 1
    assert result["parts"]["kernel_tests"]["figures"]["passed"] > 0
    assert not list(out.glob("llama-*")), "the model was left behind"
    assert "== gpu_check summary" in done.stdout


def test_a_signal_stops_the_script_at_once_and_deletes_the_model(device_env, tmp_path):
    """TERM while the model is being built (the kernel tests before it cut by a 1 s limit): the script ends
    within seconds (it waits in `wait`, which the signal interrupts), and its trap deletes the model."""
    out = tmp_path / "out"
    env = {**device_env, "OUT": str(out), "GPU_CHECK_ARGS": "--device cpu --small --parts model,throughput",
           "GPU_CHECK_KERNEL_TIMEOUT": "1"}  # fmt: skip
    proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "llama-small" / "config.json").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, "the model never appeared"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143
    assert "kernel tests: exit 124" in stdout, stdout
    assert not list(out.glob("llama-*")), "the model was left behind"


def test_each_part_fails_soft_and_the_clock_skips_or_cuts(tmp_path, capsys):
    from benchmarks.sim.fail_soft import Check, Skip

    def error(figures):
        figures["before"] = 1
        raise RuntimeError("boom")

    def wrong(figures):
        assert 1 + 1 == 3, "arithmetic"

    def absent(figures):
        raise Skip("no such package")

    def hang(figures):
        figures["started"] = True
        time.sleep(30)

    check = Check(tmp_path, budget=20, start=time.monotonic())
    check.part("error", error, needs=0, cap=None)
    check.part("fail", wrong, needs=0, cap=None)
    check.part("skip", absent, needs=0, cap=None)
    if threading.current_thread() is threading.main_thread():  # the alarm is a signal: the main thread's alone
        check.part("hang", hang, needs=0, cap=0.5)
    check.part("too_big", lambda f: "never", needs=60, cap=None)
    check.part("ok", lambda f: "fine", needs=0, cap=None)
    parts = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    expect = {
        "error": "error",
        "fail": "fail",
        "skip": "skipped",
        "hang": "timeout",
        "too_big": "skipped",
        "ok": "pass",
    }
    assert {n: p["status"] for n, p in parts.items()} == {n: s for n, s in expect.items() if n in parts}
    assert parts["error"]["figures"] == {"before": 1} and "RuntimeError: boom" in parts["error"]["line"]
    assert "arithmetic" in parts["fail"]["line"] and parts["ok"]["line"] == "fine"
    if "hang" in parts:
        assert parts["hang"]["figures"] == {"started": True} and parts["hang"]["seconds"] < 5
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("part ")]
    assert len(lines) == len(parts)
