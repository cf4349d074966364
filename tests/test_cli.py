"""The first hour of a newcomer: flags that refuse nonsense, demos that leave the tree clean,
the built-in models by name from anywhere.

What it is:
  - every command line answers a bad flag with exit code 2 and one line that names the
    flag, before any weight is loaded. Each command runs as `python -m` runs it (runpy, as
    `__main__`), in a child forked from one warm interpreter that imported torch and
    transformers once (the labs' runner, `python -m labs.runner plan`): 41 fresh
    interpreters cost minutes of the suite on 2 cores. Three of them also run as real
    subprocesses, what a user types, and must say exactly what their forked twins say;
  - each demo, and the benchmark's quick mode with `--plots`, run with their default picture
    and results paths leave `git status` exactly as it was, and nothing in the temporary
    folder (a server's scratch log is removed with it, also when it fails to start);
  - piped at 80 columns (what a log or `| less` gets), the demos' output still reads: whole
    table headers, a legend without colours, and no pointer to a server that has stopped;
  - `LLM("tiny-shakespeare")` works from a directory that is not the repository;
  - `--help` names the command as it is typed (`python -m ...`), and every flag has help.

What it is not: a check of the demos' numbers (tests/test_demos.py runs them).
"""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from labs import grading
from ladder.models import REPO

pytestmark = pytest.mark.docs

DEMOS = [
    "level0_naive.demo",
    "level1_paged.demo",
    "level2_continuous.demo",
    "level3_prefix.demo",
    "level4_speculative.demo",
    "level5_multigpu.demo",
    "level6_serving.demo",
]

BAD_FLAGS = [  # (command, arguments, the flag the one-line message must name)
    ("level0_naive.demo", ["--requests", "0"], "--requests"),
    ("level0_naive.demo", ["--max-tokens", "0"], "--max-tokens"),
    ("level0_naive.demo", ["--device", "cuda"], "--device"),
    ("level0_naive.demo", ["--device", "tpu"], "--device"),
    ("level0_naive.demo", ["--model", "no/such/model"], "--model"),
    ("level0_naive.demo", ["--temperature", "-1"], "--temperature"),
    ("level0_naive.demo", ["--threads", "zero"], "--threads"),
    ("level1_paged.demo", ["--block-size", "0"], "--block-size"),
    ("level1_paged.demo", ["--budget-requests", "-2"], "--budget-requests"),
    ("level1_paged.demo", ["--budget-requests", "0.5"], "--budget-requests"),  # less than one request: never runs
    ("level2_continuous.demo", ["--long-fraction", "1.5"], "--long-fraction"),
    ("level2_continuous.demo", ["--batch-size", "0"], "--batch-size"),
    ("level3_prefix.demo", ["--dtype", "int3"], "--dtype"),
    ("level4_speculative.demo", ["-k", "0"], "--num-speculative-tokens"),
    ("level4_speculative.demo", ["--draft-model", "nowhere"], "--draft-model"),
    ("level5_multigpu.demo", ["--pipeline-partition", "9,9"], "--pipeline-partition"),
    ("level5_multigpu.demo", ["--requests", "-1"], "--requests"),
    ("features.moe.demo", ["--requests", "0"], "--requests"),
    ("benchmarks.parallel", ["--tp-batches", "1,x"], "--tp-batches"),
    ("level6_serving", ["--port", "99999"], "--port"),
    ("level6_serving", ["--max-num-seqs", "0"], "--max-num-seqs"),
    ("level6_serving", ["--model", "nope"], "--model"),
    ("benchmarks.throughput", ["--engines", "hf,level0"], "--engines"),
    ("benchmarks.throughput", ["--engines", "level3_prefix:nocahce"], "--engines"),
    ("benchmarks.throughput", ["--num-requests", "0"], "--num-requests"),
    ("benchmarks.throughput", ["--threads", "0"], "--threads"),
    ("benchmarks.throughput", ["--workload", "nope"], "--workload"),
    ("benchmarks.throughput", ["--model", "nope"], "--model"),
    ("benchmarks.throughput", ["--markdown", "missing.json"], "--markdown"),
    ("benchmarks.detokenize", ["--tokens", "10"], "--tokens"),  # shorter than one 50-token window
    ("ladder.figures", ["--only", "level9"], "--only"),
    ("level6_serving.disagg", ["--prefill", "http://a", "--decode", "http://b", "--prefill-timeout", "0"],
     "--prefill-timeout"),
]


HELP = [*DEMOS, "benchmarks.throughput", "benchmarks.parallel", "ladder.figures", "level6_serving.disagg"]
REAL = [0, 19, 22]  # BAD_FLAGS run as real subprocesses too: a demo, the server, the benchmark


def run(module: str, args: list[str], cwd=REPO, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def forked(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """{name: (exit code, output)} of every bad-flag and --help command, each `python -m`'d in a child
    of one warm `python -m labs.runner plan` process (stdout and stderr together, in order)."""
    work = tmp_path_factory.mktemp("cli")
    variants = [grading.module_variant(f"bad-{i}", {}, m, a, work, timeout=300) for i, (m, a, _) in enumerate(BAD_FLAGS)]
    variants += [grading.module_variant(f"help-{m}", {}, m, ["--help"], work, timeout=300) for m in HELP]
    summary = grading.run_plan(variants, work, jobs=2)
    log = lambda v: Path(v["log"]).read_text() if Path(v["log"]).is_file() else ""  # noqa: E731
    return {v["name"]: (summary[v["name"]]["exit_code"], log(v)) for v in variants}


@pytest.mark.parametrize("i", range(len(BAD_FLAGS)), ids=[f"{m} {' '.join(a)}" for m, a, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_that_names_it(forked, i):
    flag = BAD_FLAGS[i][2]
    code, out = forked[f"bad-{i}"]
    assert code == 2, out[-2000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line (and nothing that ran before the flag was refused), got:\n{out}"
    assert flag in lines[0] and "Traceback" not in out


@pytest.mark.parametrize("i", REAL, ids=[f"{BAD_FLAGS[i][0]} {' '.join(BAD_FLAGS[i][1])}" for i in REAL])
def test_a_real_process_says_what_its_forked_twin_says(forked, i):
    """The fork is `python -m` as a user types it: the same exit code, the one line on stderr, nothing on stdout."""
    module, args, _ = BAD_FLAGS[i]
    res = run(module, args)
    code, out = forked[f"bad-{i}"]
    assert (res.returncode, res.stderr.strip()) == (code, out.strip())
    assert res.stdout == "", "nothing ran before the flag was refused"


@pytest.mark.parametrize("module", HELP)
def test_help_shows_the_command_and_explains_every_flag(forked, module):
    import importlib

    code, out = forked[f"help-{module}"]
    assert code == 0 and out.startswith(f"usage: python -m {module}"), out[-2000:]
    parser = importlib.import_module(module).parser()
    undocumented = [a.option_strings[-1] for a in parser._actions if a.option_strings and not a.help]
    assert not undocumented, f"flags without help: {undocumented}"


def test_the_benchmark_turns_builtin_names_into_directories():
    """`--model tiny-shakespeare` passes the flag check, so it must also reach HF's
    `from_pretrained` and the roofline's `AutoConfig` as a directory, not as a hub id;
    the built-in draft follows the built-in target whichever name it is given by."""
    from benchmarks import roofline
    from benchmarks.throughput import model_paths, parse_args
    from ladder.models import BUILTIN, BUILTIN_DRAFT

    for name in ("tiny-shakespeare", "models/tiny-shakespeare", str(BUILTIN)):
        assert model_paths(parse_args(["--model", name])) == (str(BUILTIN), str(BUILTIN_DRAFT)), name
    args = parse_args(["--model", "tiny-shakespeare-draft", "--draft-model", "tiny-shakespeare-draft"])
    assert model_paths(args) == (str(BUILTIN_DRAFT), str(BUILTIN_DRAFT))
    assert roofline.Dims.from_checkpoint(model_paths(args)[0]).vocab > 0  # what crashed on the bare name


def git_status() -> str:
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO, capture_output=True, text=True
    ).stdout


SMALL = {  # the demos' own defaults for every path, with a tiny workload so the test is quick
    "level0_naive.demo": ["--requests", "3", "--max-tokens", "8"],
    "level1_paged.demo": ["--requests", "4", "--max-tokens", "24", "--snapshot-step", "4"],
    "level2_continuous.demo": ["--requests", "4", "--max-tokens", "24", "--batch-size", "2"],
    "level3_prefix.demo": ["--max-tokens", "2"],
    "level4_speculative.demo": ["--max-tokens", "12", "--max-k", "2", "-k", "2", "--batch-size", "2"],
    "level5_multigpu.demo": ["--max-tokens", "4", "--requests", "2"],
    "features.moe.demo": ["--max-tokens", "4", "--requests", "2"],
    "level6_serving.demo": ["--max-tokens", "6", "--clients", "2"],
    "level6_serving.disagg_demo": ["--max-tokens", "6", "--prompt-tokens", "200"],
}


def test_demos_and_the_quick_benchmark_leave_the_tree_clean(tmp_path):
    """Each demo with its default picture path, and `benchmarks.throughput --quick --plots` with
    its default results and picture paths: nothing tracked (or untracked) in the repository
    changes, and nothing is left in the temporary folder. Their output is read as a pipe at
    80 columns gets it."""
    if subprocess.run(["git", "rev-parse"], cwd=REPO, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    before = git_status()
    env_out, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    import os

    env = {**os.environ, "INFERENCE_LADDER_OUT": str(env_out), "TMPDIR": str(tmp), "COLUMNS": "80"}
    env.pop("FORCE_COLOR", None)  # piped means no colours, as a user's pipe does
    commands = {module: [sys.executable, "-m", module, "--no-progress", *args] for module, args in SMALL.items()}
    commands["benchmark"] = [sys.executable, "-m", "benchmarks.throughput", "--quick", "--plots", "--workload", "spread",
                             "--num-requests", "3", "--engines", "level0_naive,level2_continuous", "--no-progress"]  # fmt: skip
    # Two at a time (each spends seconds importing torch, or waiting on its server): about half the wall time.
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(commands, pool.map(lambda cmd: subprocess.run(cmd, cwd=REPO, env=env, capture_output=True,
                                                                      text=True, timeout=600), commands.values())))  # fmt: skip
    outputs = {}
    for module in SMALL:
        res = runs[module]
        assert res.returncode == 0, f"{module}: {res.stderr[-3000:]}"
        if module not in ("level0_naive.demo", "level6_serving.disagg_demo"):  # (they draw no picture)
            assert str(env_out) in res.stdout.replace("\n", ""), f"{module} did not say where its picture went"
        outputs[module] = res.stdout
    res = runs["benchmark"]
    assert res.returncode == 0, res.stderr[-3000:]
    assert "smoke run" in res.stdout and "the issue" not in res.stdout
    assert "1 torch thread" in res.stdout  # it says what it chose
    assert (env_out / "quick.json").is_file() and (env_out / "bench_throughput.png").is_file()  # not docs/img
    assert git_status() == before, "a default run changed the repository"
    # torch makes its own per-user cache there whenever it imports dynamo: torch's, reused, not a run's file
    left = sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))
    assert not left, f"left in the temporary folder: {left}"

    level4 = outputs["level4_speculative.demo"]  # piped: no colours, so the marks carry the legend
    assert "[recovered]" in level4 and "{bonus}" in level4 and "\u2026" not in level4  # no header cut to "c_verif…"
    assert "c_draft:" in level4 and "c_verify:" in level4  # the cost columns are explained
    level5 = outputs["level5_multigpu.demo"]  # (tests/test_demos.py runs no level-5 demo of its own: 40 s)
    assert "identical text in all four layouts: True" in level5
    assert (env_out / "level5_pipeline.png").stat().st_size > 10_000
    moe = outputs["features.moe.demo"]
    assert "identical text in all three layouts: True" in moe and "all_to_all" in moe
    assert (env_out / "moe_routing.png").stat().st_size > 10_000
    level6 = outputs["level6_serving.demo"]
    url = re.search(r"server up at (http://\S+)", level6)[1]
    assert level6.count(url) == 1, "it offered the demo's own server (stopped at the end) to try"
    assert "python -m level6_serving" in level6[level6.index("SIGTERM") :]  # how to start one instead
    assert "all 2 clients" in level6  # the table says how many of the clients it shows
    disagg = outputs["level6_serving.disagg_demo"]
    assert "the same greedy text all three ways" in disagg and 'outcome="received"' in disagg


def test_a_server_that_fails_to_start_says_why_and_leaves_no_file(tmp_path, monkeypatch):
    """The log's tail is in the error, and the scratch folder the log was in is gone."""
    import tempfile

    from level6_serving.process import ServerProcess

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where TemporaryDirectory puts it
    with pytest.raises(RuntimeError, match="exited with status 2") as e:
        with ServerProcess(["--max-num-seqs", "0"], startup_timeout=60):
            pass
    assert "--max-num-seqs" in str(e.value)  # the server's own one-line reason, from its log
    assert not list(tmp_path.iterdir())


def test_builtin_models_resolve_by_name_from_any_directory(tmp_path):
    code = (
        "from level0_naive import LLM, SamplingParams\n"
        "for name in ('tiny-shakespeare', 'models/tiny-shakespeare', 'tiny-shakespeare-draft'):\n"
        "    out = LLM(name, max_model_len=64).generate(['ROMEO:\\n'], SamplingParams(max_tokens=4, temperature=0), progress=False)\n"
        "    print(name, len(out[0].outputs[0].token_ids))\n"
    )
    explicit_code = code.replace("'tiny-shakespeare', ", f"{str(REPO / 'models' / 'tiny-shakespeare')!r}, ")
    with ThreadPoolExecutor(max_workers=2) as pool:  # the two runs at once: about half the wall time
        res, explicit = pool.map(lambda c: subprocess.run([sys.executable, "-c", c], cwd=tmp_path, capture_output=True,
                                                          text=True, timeout=300), [code, explicit_code])  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == [
        "tiny-shakespeare",
        "4",
        "models/tiny-shakespeare",
        "4",
        "tiny-shakespeare-draft",
        "4",
    ]
    assert explicit.returncode == 0 and explicit.stdout.count(" 4") == 3  # explicit paths keep working
