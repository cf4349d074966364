"""The swap itself: an import hook that answers a reference module's name with a student's file.

What it is: `SwapFinder` (placed first on `sys.meta_path` by `install`), the environment that
carries the swaps to other processes (`LABS_SWAP`, JSON `{module: path}`, and `labs/site` first
on PYTHONPATH: `swapped_env`), and nothing else, so that `labs/site/sitecustomize.py` can load it
at the start of any Python process without importing the runner (which `python -m labs.runner`
then runs as `__main__`: imported twice, it would hold two finder classes).

What it is not: the runner (`labs/runner.py`: plans, pytest, module runs) or a sandbox.

Reference: PEP 451 (`MetaPathFinder.find_spec`).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENV = "LABS_SWAP"
SITE = REPO / "labs" / "site"  # its sitecustomize installs the swaps in a Python process started under them


class SwapFinder(importlib.abc.MetaPathFinder):
    """Finds the swapped modules at their students' paths; everything else is someone else's."""

    def __init__(self, swaps: dict[str, str]):
        self.swaps = dict(swaps)

    def find_spec(self, fullname, path=None, target=None):
        where = self.swaps.get(fullname)
        if where is None:
            return None
        return importlib.util.spec_from_file_location(fullname, where)


def install(swaps: dict[str, str]) -> None:
    """Put the swaps first on the import path; refuse if a swapped module is already imported
    (then the reference would be the one in use, silently)."""
    if not swaps or any(isinstance(f, SwapFinder) and f.swaps == swaps for f in sys.meta_path):
        return  # nothing to swap, or already done (by labs/site/sitecustomize.py at start-up)
    late = sorted(m for m in swaps if m in sys.modules)
    if late:
        raise RuntimeError(f"labs: {', '.join(late)} was imported before the swap could replace it")
    sys.meta_path.insert(0, SwapFinder(swaps))
    sys.dont_write_bytecode = True  # no __pycache__ next to a student's file


def swaps_from_env() -> dict[str, str]:
    return json.loads(os.environ.get(ENV) or "{}")


def swapped_env(swaps: dict[str, str], env: dict[str, str]) -> dict[str, str]:
    """`env` for a process that runs under `swaps` and passes them on to the Python processes it starts."""
    path = [str(SITE), str(REPO), *filter(None, [env.get("PYTHONPATH")])]
    return {**env, ENV: json.dumps(swaps), "PYTHONPATH": os.pathsep.join(path)}
