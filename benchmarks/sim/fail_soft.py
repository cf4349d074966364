"""Parts that fail soft against one deadline: what keeps the GPU check (`gpu_check.py`) going to its end.

What it is: `Check.part(name, fn, needs, cap)` runs `fn(figures)` and turns whatever happens into one
status and one line, printed, and saved with the figures `fn` filled so far into `gpu_check.json`:

    pass      fn returned (its return value, if any, is the line)
    fail      an AssertionError: the part ran and found something wrong
    error     any other exception (its traceback goes to stderr and into the JSON)
    skipped   `Skip` (a package or an earlier part's output is absent), or the budget has less left than
              the part `needs` before it starts
    timeout   the alarm: the part ran past the deadline or its own `cap`

and the next part runs. The alarm is SIGALRM (`signal.setitimer`), so it interrupts Python, not a
kernel in flight: a part stuck inside one call is cut when the call returns, or by gpu_check.sh's
`timeout` around the whole process, which is why the script gives the process more time than its budget.

What it is not: a sandbox. A part that corrupts the CUDA context leaves it corrupt for the parts after
it (each will say so in its own line), and memory is only handed back (`release_memory`), not checked.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path


class Skip(Exception):
    """A part that cannot run here (a package or a model is absent): reported in one line, not a failure."""


class OutOfTime(BaseException):
    """The alarm's: a BaseException, so no `except Exception` inside a part (the benchmark has some) swallows it."""


@contextmanager
def alarm(seconds: float):
    """Raise OutOfTime in this thread after `seconds` (only the main thread gets signals; elsewhere: no limit)."""
    if threading.current_thread() is not threading.main_thread() or math.isinf(seconds):
        yield
        return

    def ring(signum, frame):
        raise OutOfTime

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Check:
    """The parts, one after another against one deadline; `result` is gpu_check.json, saved after each part."""

    def __init__(self, out: Path, budget: float | None, start: float):
        self.out, self.start, self.deadline = out, start, (start + budget if budget else math.inf)
        self.result: dict = {"schema": 2, "budget_s": budget, "parts": {}, "rows": [], "summary": {}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def part(self, name: str, fn, needs: float, cap: float | None) -> bool:
        """Run `fn(figures)` (it may return a one-line summary); True when it passed."""
        entry = {"status": "skipped", "seconds": 0.0, "figures": {}, "line": ""}
        self.result["parts"][name] = entry
        left, t0 = self.left(), time.monotonic()
        if left < needs:
            entry["line"] = f"{max(left, 0):.0f} s of the budget left, it needs about {needs}"
        else:
            try:
                with alarm(min(left, cap or math.inf)):
                    entry["line"] = fn(entry["figures"]) or ""
                entry["status"] = "pass"
            except Skip as e:
                entry["line"] = str(e)
            except OutOfTime:
                entry.update(status="timeout", line=f"cut after {time.monotonic() - t0:.0f} s (the budget, or its cap)")
            except (Exception, SystemExit) as e:  # noqa: BLE001 - recorded, and the next part runs
                entry.update(status="fail" if isinstance(e, AssertionError) else "error",
                             line=f"{type(e).__name__}: {e}".replace("\n", " ")[:400],
                             traceback=traceback.format_exc(limit=-8))  # fmt: skip
                print(entry["traceback"], file=sys.stderr)
            entry["seconds"] = round(time.monotonic() - t0, 2)
            release_memory()
        print(part_line(name, entry), flush=True)
        self.save()
        return entry["status"] == "pass"

    def save(self) -> None:
        self.result["elapsed_s"] = round(time.monotonic() - self.start, 1)
        (self.out / "gpu_check.json").write_text(json.dumps(self.result, indent=1, default=str))


def part_line(name: str, entry: dict) -> str:
    return f"part {name:20s} {entry['status']:8s} {entry['seconds']:6.1f} s  {entry['line']}"


def release_memory() -> None:
    """What one part's engines held goes back before the next part sizes its own (a cycle can hold an LLM)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
