"""The swap: a student's file loaded under the reference module's name, in a process of its own.

What it is: the machinery behind `python -m labs check` and `python -m labs run`, always
started as `python -m labs.runner ...` in a subprocess, so a swap never leaks into the
process that asked for it.

  - `SwapFinder` (labs/swap.py) is an import hook placed first on `sys.meta_path`. Asked for, say,
    `level2_continuous.scheduler`, it answers with the student's file, before anything
    has imported the reference one. The module keeps its dotted name, so the student's
    relative imports (`from .request import Request`) and everyone else's
    `from level2_continuous.scheduler import Scheduler` get the student's code.
  - The swaps travel in the environment (`LABS_SWAP`, JSON `{module: path}`), with
    `labs/site` first on PYTHONPATH: its `sitecustomize` installs them at the start of a
    Python process a swapped run starts with that environment, so a server started with
    `subprocess` (a DP test's replicas and router, a benchmark's server) runs the
    student's code too (not one started with `-I`, `-S` or a PYTHONPATH of its own).
    This file also installs them when it is imported, and it is the `__main__` of every
    process the labs start, so the ranks level 5 spawns with multiprocessing (which
    import the parent's main module as `__mp_main__` before anything else) have them
    even where `site` is off.
  - `python -m labs.runner module NAME ARGS...` runs a demo or an experiment as
    `python -m NAME ARGS...` would, under the swaps of the environment.
  - `python -m labs.runner plan PLAN.json` runs the variants of a plan, each a pytest
    selection or a module run with its own swaps. The heavy third-party imports (torch,
    transformers, pytest, hypothesis, triton, and pytest's installed plugins) happen once,
    in this process, and are frozen out of the garbage collector's walks; each variant
    runs in a `fork()` of it that installs its swaps and imports the levels afresh. A
    student's check is a plan of one variant; the labs' own tests run dozens in one plan.
    Results are written as JSON lines as each test ends, so a variant that hangs and is
    killed at its timeout still reports what ran.

What it is not: a sandbox. A student's code runs with the student's rights, as their
own tests would.

Reference: PEP 451 (`MetaPathFinder.find_spec`); the multiprocessing docs on the spawn
start method ("the parent's main module is imported in the child").
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import re
import runpy
import signal
import sys
import time
from pathlib import Path

from labs.swap import REPO, install, swapped_env, swaps_from_env

# Installed on import: in `python -m labs.runner` itself, and in every process multiprocessing
# spawns from it (they import this module as `__mp_main__` first).
if __name__ in ("__main__", "__mp_main__"):
    install(swaps_from_env())


# --- a module run: python -m NAME ARGS, under the swaps ----------------------------------------------
def run_module(name: str, args: list[str]) -> int:
    """Run `name` as `python -m name args` would. `sys.modules['__main__']` stays this module,
    so processes spawned by the module's code install the swaps too."""
    sys.argv = [name, *args]
    try:
        runpy.run_module(name, run_name="__main__", alter_sys=False)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


# --- a pytest selection, with each test's outcome written as it ends --------------------------------
def matches(nodeid: str, spec: str) -> bool:
    """`spec` names a test, a parametrised family (`test_x` matches `test_x[a]`) or a whole file."""
    return nodeid == spec or nodeid.startswith(spec + "[") or nodeid.startswith(spec + "::")


# A test's limits. CPU time, not the wall clock, is what an endless loop burns, and a busy machine does not stretch it
# (a correct kernel lost its points to a 60 s wall-clock limit at load 10 on 2 cores). The wall clock still bounds
# a test that hangs without computing (a deadlock), with a margin (300 s) that the slowest test reaches only on a
# machine twenty times slower than a quiet one.
TEST_TIMEOUT = 60.0  # seconds of CPU time one test may use (the slowest use about 15)
WALL_MARGIN = 5.0  # ... and of wall-clock time, this many times more
AFTER_A_TIMEOUT = 10.0  # ... and each later test's CPU time, once one ran out: an endless loop usually recurs


class CheckTimeout(BaseException):
    """Raised in a test that ran out of time. Not an Exception, so that hypothesis reports it at once
    instead of replaying the (endless) example to shrink it."""


def recorder(selection: list[str], path: str, test_timeout: float = TEST_TIMEOUT, stop_checks: list | None = None):
    """A pytest plugin: keep only the selected tests, and write one JSON line per outcome. Made here,
    not at import, so that a process that only imports this module (a spawned rank) never loads pytest.

    `stop_checks` (the tests of each check, one list per check): a test is skipped once every check it
    belongs to has a failure. For runs that only need to know *that* each check fails (the labs' own
    tests of starters and planted bugs); a student's check runs every test, so it lists every failure."""
    import pytest

    class Recorder:
        def __init__(self):
            self.out = open(path, "a", buffering=1)
            self.timeout = test_timeout
            self.failed: set[int] = set()  # the checks (indices into stop_checks) that already failed

        def _checks_of(self, nodeid: str) -> list[int]:
            return [i for i, specs in enumerate(stop_checks or []) if any(matches(nodeid, s) for s in specs)]

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_setup(self, item):
            """Before any fixture is built: a test whose every check has already failed cannot change a result."""
            checks = self._checks_of(item.nodeid)
            if checks and all(i in self.failed for i in checks):
                pytest.skip("not run: its check had already failed")

        def _write(self, **record) -> None:
            self.out.write(json.dumps(record) + "\n")

        def pytest_collection_modifyitems(self, session, config, items):
            keep = [it for it in items if any(matches(it.nodeid, s) for s in selection)]
            dropped = [it for it in items if it not in keep]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
            items[:] = keep

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_call(self, item):
            """A test that runs past its time fails with a message (a student's endless loop), instead of
            hanging the whole check until the variant's timeout."""

            def expire(signum, frame):
                seconds, self.timeout = self.timeout, min(self.timeout, AFTER_A_TIMEOUT)
                if signum == signal.SIGPROF:
                    raise CheckTimeout(f"still computing after {seconds:.0f} s of CPU time: an endless loop?")
                raise CheckTimeout(f"still running after {WALL_MARGIN * seconds:.0f} s without using its CPU time: "
                                   "a deadlock, or a machine far too busy (see `uptime`; rerun when it is quieter)")  # fmt: skip

            timers = {signal.SIGPROF: (signal.ITIMER_PROF, self.timeout),  # CPU time, every thread of this process
                      signal.SIGALRM: (signal.ITIMER_REAL, WALL_MARGIN * self.timeout)}  # fmt: skip
            old = {sig: signal.signal(sig, expire) for sig in timers}
            for which, seconds in timers.values():
                signal.setitimer(which, seconds)
            try:
                yield
            finally:
                for (which, _), (sig, handler) in zip(timers.values(), old.items()):
                    signal.setitimer(which, 0)
                    signal.signal(sig, handler)

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(self, item, call):
            """A failure's arguments, frame by frame, while its traceback is alive: what hypothesis's falsifying
            example left empty (pytest's own report shows them only for the first and the last frame)."""
            report = (yield).get_result()
            if report.failed and call.excinfo is not None:
                report.labs_frames = frame_arguments(call.excinfo.tb)

        def pytest_collectreport(self, report):
            if report.failed:
                self._write(collect=report.nodeid, message=_short(report))

        def pytest_runtest_logreport(self, report):
            if report.failed:
                self.failed.update(self._checks_of(report.nodeid))
            if report.when == "call" or report.outcome != "passed":
                self._write(nodeid=report.nodeid, when=report.when, outcome=report.outcome, message=_short(report))

    return Recorder()


def _short(report) -> str:
    """The line a person needs: the exception and its message (the full trace is in the log)."""
    if report.passed:
        return ""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return failure_message(crash.message, getattr(report, "labs_frames", []))
    if isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        return str(report.longrepr[2])[:600]
    text = str(report.longrepr).strip().splitlines()
    return (text[-1] if text else "")[:600]


# What hypothesis appends to a failure for the test's author: a decorator or a seed to paste into the test,
# which the student does not own (their file is the module under test), so a check's message leaves it out.
_FOR_THE_AUTHOR = ("You can reproduce this example by temporarily adding", "@reproduce_failure(", "@seed(",
                   "--hypothesis-seed")  # fmt: skip
_EMPTY_ARG = re.compile(r"^(\w+)=(?=,|$)")  # `seed=,`: hypothesis's explain phase printed no value
_AUTHOR_COMMENT = re.compile(r"\s+# (or any other generated value|.* varied together\.?)$")


def frame_arguments(tb, width: int = 100) -> list[dict]:
    """{argument: repr, cut to `width`} of each frame of a traceback, outermost first."""
    frames = []
    while tb is not None:
        code, values = tb.tb_frame.f_code, tb.tb_frame.f_locals
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        frames.append({n: _cut(values[n], width) for n in names if n in values})
        tb = tb.tb_next
    return frames


def _cut(value, width: int) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails is still a value
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def failure_message(message: str, frames: list[dict] = (), limit: int = 600) -> str:
    """A failed test's message as a check prints it: the exception's first line, then hypothesis's falsifying
    example on one line with its values (`Falsifying example: test_x(seed=3, K=2)`; a value hypothesis left
    empty is taken from the test's own arguments, `frames` (one {name: repr} per frame of the failure's traceback,
    `frame_arguments`)), then the rest; without the lines that tell the test's author how to replay the example."""
    lines = [line for line in message.splitlines() if not any(s in line for s in _FOR_THE_AUTHOR)]
    example = None
    for i, line in enumerate(lines):
        head = re.match(r"^Falsifying (?:explicit )?example: (\w+)\((.*)$", line.strip())
        if head is None:  # a stateful test's example is its steps, one a line: kept as they are
            continue
        name, first = head.groups()
        if first.rstrip().endswith(")"):  # already on one line
            j, body = i, [first.rstrip()[:-1]]
        else:  # one argument a line, up to a lone ")"
            j = next((k for k in range(i + 1, len(lines)) if lines[k].strip() == ")"), len(lines))
            body = [first, *lines[i + 1 : j]]
        example = f"Falsifying example: {name}({_arguments(body, frames)})"
        del lines[i : j + 1]
        break
    while lines and not lines[-1].strip():
        lines.pop()
    if example is None:
        return "\n".join(lines)[:limit]
    first, rest = lines[:1], lines[1:]
    return "\n".join([*(f[: limit - len(example) - 1] for f in first), example, *rest])[:limit]


def _arguments(body: list[str], frames: list[dict]) -> str:
    """`seed=,  # or any other generated value` / `K=2,` lines -> `seed=3, K=2`: hypothesis's comments dropped,
    an empty value filled from the frame whose arguments are the example's (the test function's)."""
    args = [_AUTHOR_COMMENT.sub("", b.strip()) for b in body if b.strip() and not b.strip().startswith("#")]
    names = {m.group(1) for a in args if (m := re.match(r"^(\w+)=", a))}
    own = next((f for f in reversed(frames) if names and names <= set(f)), {})
    filled = [_EMPTY_ARG.sub(lambda m: f"{m.group(1)}={own.get(m.group(1), '?')}", a) for a in args]
    return " ".join(filled).rstrip(",")


def run_pytest(selection: list[str], results: str, stop_checks: list | None = None) -> int:
    import pytest

    files = list(dict.fromkeys(s.split("::")[0] for s in selection))
    args = [
        *files,
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--rootdir",
        str(REPO),
        "-W",
        "ignore",
        "--durations",
        "12",
    ]
    return int(pytest.main(args, plugins=[recorder(selection, results, stop_checks=stop_checks)]))


# --- a plan: many variants, each in a fork of one warm process ---------------------------------------
PRELOAD = [
    "numpy", "torch", "torch.distributed", "torch.multiprocessing", "safetensors", "tokenizers", "rich",
    "pytest", "hypothesis", "hypothesis.stateful", "scipy.stats", "transformers", "triton", "triton.language",
]  # fmt: skip
PRELOAD_ATTRS = [("transformers", n) for n in ("LlamaForCausalLM", "LlamaConfig", "AutoModelForCausalLM",
                                               "Qwen3ForCausalLM", "Qwen3Config")]  # fmt: skip


def preload() -> None:
    """Import what every variant needs and no swap touches, once, before forking."""
    if "TRITON_INTERPRET" not in os.environ:
        import torch

        if not torch.cuda.is_available():  # as tests/conftest.py: before triton's first import
            os.environ["TRITON_INTERPRET"] = "1"
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - optional: a variant that needs it will say so
            pass
    for mod, attr in PRELOAD_ATTRS:
        try:
            getattr(sys.modules[mod], attr)
        except Exception:  # noqa: BLE001
            pass
    # pytest imports every installed plugin (the `pytest11` entry points: hypothesis's, schemathesis's,
    # anyio's, ...) at the start of each session: about 5 s here, once per variant unless done first.
    from importlib.metadata import entry_points

    for ep in entry_points(group="pytest11"):
        try:
            ep.load()
        except Exception:  # noqa: BLE001 - a broken plugin breaks pytest itself, which will say so
            pass
    # What is loaded now lives as long as the process: out of the collector's sight, so that each
    # variant's `gc.collect()` (pytest calls it five times as a session ends) walks only its own objects.
    gc.freeze()


def _child(variant: dict) -> int:
    """In the fork: own process group, output to the log, the swaps, then the work."""
    os.setpgid(0, 0)
    log = os.open(variant["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(REPO)
    swaps = variant.get("swaps", {})
    os.environ.update(swapped_env(swaps, os.environ))  # for the processes it starts
    install(swaps)
    for module in swaps:  # a student's file that does not even import: say so, once, clearly
        try:
            importlib.import_module(module)
        except BaseException as e:  # noqa: BLE001
            with open(variant["results"], "a") as f:
                f.write(json.dumps({"import_error": module, "message": f"{type(e).__name__}: {e}"[:600]}) + "\n")
            import traceback

            traceback.print_exc()
            return 3
    if variant.get("no_shrink"):
        no_shrink_profile()
    if variant["kind"] == "pytest":
        return run_pytest(variant["tests"], variant["results"], variant.get("stop_checks"))
    if variant["kind"] == "probe":
        return probe(variant["module"])
    return run_module(variant["module"], variant.get("argv", []))


def no_shrink_profile() -> None:
    """For runs that only need to know *that* a check fails (the labs' own tests of starters and
    planted bugs): tests/conftest.py's "ci" profile without hypothesis's shrinking, which can take
    longer than the test. A student's check keeps shrinking: a minimal failing example is a hint."""
    from hypothesis import HealthCheck, Phase, settings

    settings.register_profile("labs-no-shrink", max_examples=15, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                              derandomize=True, database=None,
                              phases=[Phase.explicit, Phase.reuse, Phase.generate])  # fmt: skip
    settings.load_profile("labs-no-shrink")
    os.environ["HYPOTHESIS_PROFILE"] = "labs-no-shrink"  # what tests/conftest.py loads


def _fork(variant: dict) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _child(variant)
        except BaseException:  # noqa: BLE001
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)
    return pid


def run_plan(plan: dict) -> list[dict]:
    """Run every variant (`jobs` at a time); return {name, exit_code, seconds, timed_out} per variant."""
    preload()
    pending, running, done = list(plan["variants"]), {}, {}
    jobs = max(1, int(plan.get("jobs", 1)))
    try:
        while pending or running:
            while pending and len(running) < jobs:
                v = pending.pop(0)
                for key in ("results", "log"):
                    Path(v[key]).parent.mkdir(parents=True, exist_ok=True)
                    Path(v[key]).touch()
                running[_fork(v)] = (v, time.monotonic())
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid in running:
                v, t0 = running.pop(pid)
                done[v["name"]] = dict(name=v["name"], exit_code=os.waitstatus_to_exitcode(status),
                                       seconds=round(time.monotonic() - t0, 2), timed_out=False)  # fmt: skip
                _reap_group(pid)
                continue
            for pid, (v, t0) in list(running.items()):
                if time.monotonic() - t0 > v.get("timeout", 900):
                    _reap_group(pid)
                    os.waitpid(pid, 0)
                    running.pop(pid)
                    done[v["name"]] = dict(name=v["name"], exit_code=-9, seconds=round(time.monotonic() - t0, 2),
                                           timed_out=True)  # fmt: skip
            time.sleep(0.02)
    finally:  # Ctrl-C: each variant is a process group of its own, which the terminal's SIGINT never reaches
        for pid in running:
            _reap_group(pid)
        gc.unfreeze()  # an orderly exit: frozen objects are never freed, and some bindings print "leaked" then
    return [done[v["name"]] for v in plan["variants"]]


def _reap_group(pgid: int) -> None:
    """Whatever the variant left behind (a rank that outlived its driver) goes with it."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --- a self-check of the swap: which file does a spawned process import? -------------------------------
def module_file(name: str) -> str:
    return importlib.import_module(name).__file__


def probe(name: str) -> int:
    """Print the file `name` comes from here, in a process spawned by multiprocessing (level 5's way),
    and in a `python` started with subprocess (how a test or a benchmark starts a server)."""
    import multiprocessing
    import subprocess

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        child = pool.apply(module_file, (name,))
    code = f"import importlib; print(importlib.import_module({name!r}).__file__)"
    started = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    print(f"this process: {module_file(name)}")
    print(f"a spawned process: {child}")
    print(f"a started process: {started}")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "probe":
        return probe(argv[1])
    if len(argv) >= 2 and argv[0] == "module":
        return run_module(argv[1], argv[2:])
    if len(argv) == 2 and argv[0] == "plan":
        plan = json.loads(Path(argv[1]).read_text())
        summary = run_plan(plan)
        Path(plan["summary"]).write_text(json.dumps(summary, indent=1))
        return 0
    print("usage: python -m labs.runner module NAME [ARGS...] | plan PLAN.json | probe MODULE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
