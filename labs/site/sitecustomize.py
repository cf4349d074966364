"""The labs' swap in every Python process a swapped run starts, however it starts it.

What it is: Python imports a module named `sitecustomize` at start-up, from the first folder of its
path that has one. A swapped run (`labs/runner.py`) puts this folder first on PYTHONPATH beside
LABS_SWAP, so a process started with `subprocess` (`python -m level6_serving` behind a DP test's
router, a benchmark's server) installs the student's files before it imports anything else, as a
process spawned by multiprocessing already did. Then it runs the `sitecustomize` that this one hides,
if the environment has one.

What it is not: anything outside the labs' own runs: no other process has this folder on its path.
"""

import importlib.machinery
import importlib.util
import os
import sys

from labs.swap import install, swaps_from_env

install(swaps_from_env())

_here = os.path.dirname(os.path.abspath(__file__))
_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here]
)
if _next is not None and _next.loader is not None:
    _next.loader.exec_module(importlib.util.module_from_spec(_next))
