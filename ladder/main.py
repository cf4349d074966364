"""`ladder`: one console command for the tools you would otherwise start with `python -m`.

What it is: the entry point `pip install` puts on the PATH (pyproject's [project.scripts]),
the way vLLM users type `vllm serve`. Each subcommand is exactly a `python -m` form, run
with the same arguments:

    ladder serve ...   =  python -m level6_serving ...        (the OpenAI-compatible server;
                                                             `ladder serve Qwen/Qwen3-0.6B`, as `vllm serve`)
    ladder bench ...   =  python -m benchmarks.throughput ...  (every engine on the workloads)
    ladder labs ...    =  python -m labs ...                   (start, check, experiment)
    ladder watch ...   =  python -m benchmarks.watch ...       (the live dashboard over an offline or simulated run)
    ladder trace ...   =  python -m benchmarks.trace ...       (one step's call paths, each frame's level or room)
    ladder disagg ...  =  python -m level6_serving.disagg ...  (the proxy over prefill and decode instances)
    ladder demo N ...  =  python -m levelN_xxx.demo ...        (level N's demo, N = 0..6)

`python -m ladder ...` is the same command without the install's PATH entry.

What it is not: a second set of flags. The tool's own parser reads everything after the
subcommand; only the name its `--help` and errors show changes, to `ladder serve` and so on.
"""

from __future__ import annotations

import argparse
import contextlib
import runpy
import sys

COMMANDS = {"serve": "level6_serving", "bench": "benchmarks.throughput", "labs": "labs", "watch": "benchmarks.watch",
            "trace": "benchmarks.trace", "disagg": "level6_serving.disagg"}  # fmt: skip
DEMOS = {str(n): f"{name}.demo" for n, name in enumerate(["level0_naive", "level1_paged", "level2_continuous",
         "level3_prefix", "level4_speculative", "level5_multigpu", "level6_serving"])}  # fmt: skip

USAGE = """usage: ladder {serve,bench,labs,watch,trace,disagg,demo N} [ARGS ...]

  serve    python -m level6_serving: the OpenAI-compatible server (level 6); `ladder serve MODEL`
           takes a directory, a built-in name or a hub id (downloaded on first use), as `vllm serve`
  bench    python -m benchmarks.throughput: every engine and HF generate on the benchmark workloads
  labs     python -m labs: the classroom labs (start, check, experiment)
  watch    python -m benchmarks.watch: the live dashboard over an offline run or a simulated GPU
  trace    python -m benchmarks.trace: one step's call paths, from LLMEngine.step to the attention call
  disagg   python -m level6_serving.disagg: one endpoint over prefill and decode instances (KV over TCP)
  demo N   python -m levelN_xxx.demo: level N's demo, N = 0..6

`ladder COMMAND --help` shows that command's flags.
"""


@contextlib.contextmanager
def named(module: str, command: str):
    """While a tool runs, a parser that calls itself `python -m <module>...` calls itself
    `ladder <command>...` instead. The tools set `prog` themselves (so that `python -m` shows
    the right name), and a parser is built inside each tool's main(): renaming at construction
    is the one place to do it without giving every tool a parameter."""
    init, old = argparse.ArgumentParser.__init__, f"python -m {module}"

    def renamed(self, *args, prog=None, **kwargs):
        if prog is not None and (prog == old or prog.startswith(old + " ")):
            prog = f"ladder {command}{prog[len(old) :]}"
        init(self, *args, prog=prog, **kwargs)

    argparse.ArgumentParser.__init__ = renamed
    try:
        yield
    finally:
        argparse.ArgumentParser.__init__ = init


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        if not rest or rest[0] not in DEMOS:
            print(f"ladder demo: give a level number, one of {', '.join(DEMOS)} (e.g. ladder demo 3)", file=sys.stderr)
            return 2
        module, command, rest = DEMOS[rest[0]], f"demo {rest[0]}", rest[1:]
    elif command in COMMANDS:
        module = COMMANDS[command]
    else:
        print(f"ladder: unknown command {command!r}\n{USAGE}", end="", file=sys.stderr)
        return 2
    sys.argv = [f"ladder {command}", *rest]
    with named(module, command):
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # exactly `python -m module`
    return 0


if __name__ == "__main__":
    sys.exit(main())
