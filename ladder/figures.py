"""`python -m ladder.figures`: regenerate the committed pictures under `docs/img/`.

What it is: the one documented way to rewrite a tracked picture. Each demo, run on its
own, saves its picture outside the repository (so trying a demo never modifies the
tree); this command runs the demos with the settings the docs describe and points
their `--plot` at `docs/img/`, and redraws the benchmark plots from the committed
results. `--only level2` (repeatable) picks some.

    python -m ladder.figures                 # all of them (a few minutes on a CPU)
    python -m ladder.figures --only level3   # docs/img/level3_ttft.png

What it is not: a benchmark run (`python -m benchmarks.throughput ... --out
benchmarks/results/latest.json --plots` refreshes the results the benchmark plots draw).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from .cli import DOCS_IMG, LadderParser
from .models import REPO

FIGURES = {
    "level1": ["level1_paged.demo", "level1_memory.png"],
    "level2": ["level2_continuous.demo", "level2_timeline.png"],
    "level3": ["level3_prefix.demo", "level3_ttft.png"],
    "level4": ["level4_speculative.demo", "level4_speedup.png"],
    "level5": ["level5_multigpu.demo", "level5_pipeline.png"],
}
BENCH = "benchmarks"


def commands(names: list[str]) -> list[list[str]]:
    out = []
    for name in names:
        if name == BENCH:
            results = REPO / "benchmarks" / "results" / "latest.json"
            out.append(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.throughput",
                    "--plots-from",
                    str(results),
                    "--img-dir",
                    str(DOCS_IMG),
                ]
            )
        else:
            module, picture = FIGURES[name]
            out.append([sys.executable, "-m", module, "--no-progress", "--plot", str(DOCS_IMG / picture)])
    return out


def parser() -> argparse.ArgumentParser:
    p = LadderParser(
        prog="python -m ladder.figures", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--only", action="append", choices=[*FIGURES, BENCH], help="regenerate only these (repeatable; default: all)"
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    for cmd in commands(args.only or [*FIGURES, BENCH]):
        print(" ".join(cmd[1:]) if args.dry_run else f"running: {' '.join(cmd[1:])}", flush=True)
        if not args.dry_run:
            subprocess.run(cmd, check=True, cwd=REPO)


if __name__ == "__main__":
    main()
