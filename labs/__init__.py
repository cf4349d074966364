"""The classroom labs: one per level, a starter to fill in, one command that checks it, an experiment.

What it is: `python -m labs` (`labs/cli.py`) and what it stands on: each lab's definition
(`labs/lab<id>.toml`, course content a teacher edits without touching Python, read by
`labs/spec.py`: the functions a student writes, the checks and their hints, the planted
bugs the checks must catch, the experiment), the lab's own checks
(`labs/lab<id>_checks.py`), its experiment (`labs/lab<id>_experiment.py` where no demo
does the job), the starters (`labs/starters.py`: made from the reference module when
`python -m labs start` asks, never committed), and the swap that runs a student's file
inside the real engine (`labs/runner.py`). The handouts are in docs/labs/.

What it is not: imported by any level. Importing this package imports no level either,
so a swap can still come first.

Reference: minitorch (tasks checked by per-task test markers), Stanford CS336 (adapters
and hidden tests), nbgrader (autograded notebooks).
"""
