"""`python -m ladder.figures`: regenerate the committed pictures under `docs/img/`.

What it is: the one documented way to rewrite a tracked picture. Each demo, run on its
own, saves its picture outside the repository (so trying a demo never modifies the
tree); this command runs the demos with the settings the docs describe and points
their `--plot` at `docs/img/`, runs `benchmarks.parallel` for `bench_parallel.png` (a
TP/PP comparison of its own; its JSON goes outside the repository) and `benchmarks.profile`
for `profile_level3_prefix.png` (where a decode step's time goes), `benchmarks.thrash` for
`level2_thrash.png` (admission headroom against the thrash), and redraws the
throughput benchmark's plots from the committed results (`latest.json`,
`roofline_100m.json`). `--only level2` (repeatable) picks some.

    python -m ladder.figures                 # all of them (several minutes on a CPU)
    python -m ladder.figures --only level3   # docs/img/level3_ttft.png
    python -m ladder.figures --dry-run       # the commands, and so the pictures, without running them

What it is not: a throughput benchmark run (`python -m benchmarks.throughput ... --out
benchmarks/results/latest.json --plots --img-dir docs/img` refreshes the results the
benchmark plots draw, and the plots; without `--img-dir` its plots go outside the repository).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from .cli import DOCS_IMG, LadderParser
from .models import REPO

FIGURES = {  # name: (module, picture, its other flags); each takes `--plot PATH`
    "level1": ("level1_paged.demo", "level1_memory.png", ["--no-progress"]),
    "level2": ("level2_continuous.demo", "level2_timeline.png", ["--no-progress"]),
    "level3": ("level3_prefix.demo", "level3_ttft.png", ["--no-progress"]),
    "level4": ("level4_speculative.demo", "level4_speedup.png", ["--no-progress"]),
    "level5": ("level5_multigpu.demo", "level5_pipeline.png", ["--no-progress"]),
    "moe": ("features.moe.demo", "moe_routing.png", ["--no-progress"]),
    "invariance": ("features.batch_invariance.demo", "batch_invariance_layers.png", ["--no-progress"]),
    "parallel": ("benchmarks.parallel", "bench_parallel.png", []),
    "profile": ("benchmarks.profile", "profile_level3_prefix.png", []),
    "thrash": ("benchmarks.thrash", "level2_thrash.png", []),
}
BENCH = "benchmarks"
BENCH_RESULTS = [  # (committed results, picture prefix): bench_throughput.png, bench_100m_roofline.png, ...
    ("benchmarks/results/latest.json", "bench_"),
    ("benchmarks/results/roofline_100m.json", "bench_100m_"),
]


def commands(names: list[str]) -> list[list[str]]:
    out = []
    for name in names:
        if name == BENCH:  # redrawn from the committed results: no benchmark runs
            for results, prefix in BENCH_RESULTS:
                out.append([sys.executable, "-m", "benchmarks.throughput", "--plots-from", str(REPO / results),
                            "--img-dir", str(DOCS_IMG), "--img-prefix", prefix])  # fmt: skip
        else:
            module, picture, flags = FIGURES[name]
            out.append([sys.executable, "-m", module, *flags, "--plot", str(DOCS_IMG / picture)])
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
        shown = " ".join(["python", *cmd[1:]])
        print(shown if args.dry_run else f"running: {shown}", flush=True)
        if not args.dry_run:
            subprocess.run(cmd, check=True, cwd=REPO)


if __name__ == "__main__":
    main()
