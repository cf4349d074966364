"""What every command-line tool of the ladder shares: flags that refuse nonsense up front.

What it is: `demo_parser()` (the flags every demo has), argparse types that reject a bad
value with one line naming the flag (`positive_int`, `at_least_one`, `fraction`, ...),
`model_source_flags` (`--revision`, `--download-dir`: where a hub id comes from),
`check_device_and_models` (an unavailable device or model is an error before any weight is
loaded; a hub id is downloaded there, with its progress bar),
`torch_threads`, where pictures and results go (`output_dir`, `plot_path`: outside the
tracked tree unless asked), `save_figure`, and the demos' prompts and seeded lengths.

What it is not: an engine. No level's `engine.py` imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import os
import random
import tempfile
from pathlib import Path

from .models import REPO, resolve_path

DOCS_IMG = REPO / "docs" / "img"

PROMPTS = [
    "ROMEO:\n", "JULIET:\n", "First Citizen:\n", "KING RICHARD III:\n", "HAMLET:\n",
    "MENENIUS:\nWhat work's, my countrymen, in hand?", "DUKE VINCENTIO:\n", "LADY MACBETH:\n",
    "QUEEN MARGARET:\n", "PETRUCHIO:\nGood morrow, Kate;", "BRUTUS:\n", "ISABELLA:\n",
    "GLOUCESTER:\nNow is the winter of our discontent", "CORIOLANUS:\n", "PROSPERO:\n", "MIRANDA:\n",
]  # fmt: skip


# --- argparse types: a bad value is one line that names the flag (exit code 2) ---------------
def _number(kind, ok, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    parse.__name__ = what  # argparse shows the type's name in some messages
    return parse


positive_int = _number(int, lambda v: v >= 1, "an integer >= 1")
nonneg_int = _number(int, lambda v: v >= 0, "an integer >= 0")
nonneg_float = _number(float, lambda v: v >= 0, "a number >= 0")
positive_float = _number(float, lambda v: v > 0, "a number > 0")
at_least_one = _number(float, lambda v: v >= 1, "a number >= 1")  # a count that may be fractional
fraction = _number(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def int_at_least(n: int):
    """An integer flag with a floor of its own (`int_at_least(64)`)."""
    return _number(int, lambda v: v >= n, f"an integer >= {n}")


class LadderParser(argparse.ArgumentParser):
    """argparse, but a bad flag is answered in one line (`--help` still shows everything)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def prog(module: str) -> str:
    """What `--help` shows as the command: `python -m level2_continuous.demo`, not `demo.py`."""
    return f"python -m {module}"


def demo_parser(description: str, module: str) -> argparse.ArgumentParser:
    p = LadderParser(prog=prog(module), description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="a Hugging Face checkpoint directory, a built-in name (tiny-shakespeare, "
                        "tiny-shakespeare-draft) or a hub id such as Qwen/Qwen3-0.6B (downloaded on first use); "
                        "default: the built-in tiny Shakespeare model")  # fmt: skip
    model_source_flags(p)
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "float64"],
        help="weights and KV cache dtype",
    )
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA if available, else CPU"
    )
    p.add_argument(
        "--max-tokens", type=positive_int, default=None, help="output tokens per request (default: the demo's own)"
    )
    p.add_argument(
        "--temperature", type=nonneg_float, default=0.8, help="sampling temperature; 0 is greedy (default 0.8)"
    )
    p.add_argument(
        "--seed", type=nonneg_int, default=0, help="seeds the workload and every sampled request (default 0)"
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=1,
        help="torch CPU threads (default 1: fastest for a tiny model, and on a busy machine)",
    )
    p.add_argument("--no-progress", action="store_true", help="draw no progress bar")
    return p


def model_source_flags(p: argparse.ArgumentParser) -> None:
    """`--revision` and `--download-dir`, vLLM's names: where a hub id given as `--model` comes from."""
    p.add_argument("--revision", default=None,
                   help="with a hub id: the branch, tag or commit to load (default: main)")  # fmt: skip
    p.add_argument("--download-dir", default=None,
                   help="with a hub id: download into this folder instead of the Hugging Face cache "
                        "(HF_HOME, HF_HUB_CACHE; HF_TOKEN for gated models, HF_HUB_OFFLINE=1 for the cache only)")  # fmt: skip


def parse_demo_args(parser: argparse.ArgumentParser, argv=None, model_flags=("model",)) -> argparse.Namespace:
    """Parse, then check what argparse cannot, before any weight loads: that the device
    exists and that every model flag names a model (a hub id is downloaded here, with its bar).
    With `--revision` or `--download-dir`, `args.model` becomes the snapshot's directory: a demo
    passes `args.model` alone to `LLM`, and a directory holds exactly one revision."""
    args = parser.parse_args(argv)
    found = check_device_and_models(parser, args, model_flags)
    if "model" in found and (getattr(args, "revision", None) or getattr(args, "download_dir", None)):
        args.model = str(found["model"])
    return args


def check_device_and_models(parser: argparse.ArgumentParser, args: argparse.Namespace,
                            model_flags=("model",)) -> dict[str, Path]:  # fmt: skip
    """A one-line error for an unusable device or model; else each model flag's directory. `--revision`
    and `--download-dir` apply to `--model` only (a draft is its own repository, as in vLLM)."""
    problem = device_problem(args.device)
    if problem:
        parser.error(f"argument --device: {problem}")
    found = {}
    for name in model_flags:
        value = getattr(args, name, None)
        if value is not None:
            source = (getattr(args, "revision", None), getattr(args, "download_dir", None)) if name == "model" else ()
            try:
                found[name] = resolve_path(value, *source)
            except ValueError as e:
                parser.error(f"argument --{name.replace('_', '-')}: {e}")
    return found


def device_problem(device: str) -> str | None:
    """Why `device` cannot be used here, or None."""
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            built = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            return f"{device!r} is not available ({built}); use --device cpu or auto"
    return None


@contextlib.contextmanager
def torch_threads(n: int):
    """Run a demo with n torch CPU threads, and put the old count back afterwards.

    Why 1 by default: a tiny model's matmuls are a few microseconds of work, and on a
    machine with other busy processes, OpenMP threads spin waiting for each other;
    measured here, 2 threads ran the demos 10-25x slower than 1.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --- pictures and other outputs -------------------------------------------------------------------
def output_dir() -> Path:
    """Where the files a run tells its user about go unless told otherwise (a demo's picture, a
    benchmark's JSON and plots): `$INFERENCE_LADDER_OUT`, else `inference-ladder-USER` in the
    system's temporary folder.

    Outside the repository, so a run never modifies a tracked file. Stable, so the path a demo
    printed still opens after it exits and a rerun replaces its own picture instead of piling up
    new ones. One per user: a folder another user made first is not writable by you.

    Scratch files nobody is told to open (a server's log) do not belong here: their owner keeps
    them in a `tempfile.TemporaryDirectory` of its own and removes it when it ends.
    """
    env = os.environ.get("INFERENCE_LADDER_OUT")
    return Path(env) if env else Path(tempfile.gettempdir()) / f"inference-ladder-{_user()}"


def cache_dir() -> Path:
    """Where a run keeps what it builds once and reuses (a benchmark's random 100M checkpoint, 400 MB):
    `inference-ladder-USER-cache` in the system's temporary folder. Never `output_dir()`, which may be a
    student's lab folder (`python -m labs experiment` points it there)."""
    return Path(tempfile.gettempdir()) / f"inference-ladder-{_user()}-cache"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a container's user id with no name
        return str(os.getuid()) if hasattr(os, "getuid") else "user"


def plot_path(requested: Path | None, name: str) -> Path:
    """`--plot PATH` if given, else `output_dir() / name`."""
    return Path(requested) if requested else output_dir() / name


def plot_flag(p: argparse.ArgumentParser, name: str, what: str) -> None:
    """A demo's `--plot PATH`: where it saves `what` (default: `name` in `output_dir()`, outside the repository)."""
    p.add_argument("--plot", type=Path, default=None,
                   help=f"where to save {what} (default: {name} in a folder outside the repository)")  # fmt: skip


def run_demo(p: argparse.ArgumentParser, argv, run, plot: str | None = None, model_flags=("model",), width=None):
    """A demo's `main`: parse (the device and every model flag checked before any weight loads), put the
    picture where `--plot` says (default file name `plot`), and `run(args, console)` on `--threads` threads."""
    from rich.console import Console

    args = parse_demo_args(p, argv, model_flags)
    if plot is not None:
        args.plot = plot_path(args.plot, plot)
    with torch_threads(args.threads):
        return run(args, Console(width=width))


def save_json(result, name: str) -> Path:
    """Write a run's result as `output_dir() / name` (making the folder), say where, and return the path."""
    import json

    path = output_dir() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"json: {path}")
    return path


def save_result(result, out: str | None, name: str) -> Path:
    """A benchmark's JSON: to `out` (its --out) if given, else `save_json(result, name)` in the output folder."""
    if not out:
        return save_json(result, name)
    import json

    Path(out).write_text(json.dumps(result, indent=1))
    return Path(out)


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay out, save (making the folder) and close a demo's matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


# --- the demos' workload --------------------------------------------------------------------------
def spread_lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """n output lengths spread evenly-at-random between lo and hi (seeded)."""
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def prompts_for(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]
