"""Shared pieces of every level's demo: the default model, the command line, the workload.

What it is: the built-in model's location (`models/tiny-shakespeare`, trained by
`models/train_tiny.py`), a fallback random-weight checkpoint built with `transformers`
and loaded through the real loader when the built-in one is missing, the common
command-line flags, and a seeded mixed-length workload.

What it is not: part of the engine. Nothing under `levelN/engine.py` imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import random
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BUILTIN = REPO / "models" / "tiny-shakespeare"
BUILTIN_DRAFT = REPO / "models" / "tiny-shakespeare-draft"
FALLBACK = Path.home() / ".cache" / "inference-ladder" / "random-llama"

PROMPTS = [
    "ROMEO:\n", "JULIET:\n", "First Citizen:\n", "KING RICHARD III:\n", "HAMLET:\n",
    "MENENIUS:\nWhat work's, my countrymen, in hand?", "DUKE VINCENTIO:\n", "LADY MACBETH:\n",
    "QUEEN MARGARET:\n", "PETRUCHIO:\nGood morrow, Kate;", "BRUTUS:\n", "ISABELLA:\n",
    "GLOUCESTER:\nNow is the winter of our discontent", "CORIOLANUS:\n", "PROSPERO:\n", "MIRANDA:\n",
]  # fmt: skip


def default_model() -> Path:
    """The built-in model if it exists; else a small random Llama saved once to a cache dir."""
    if (BUILTIN / "config.json").is_file():
        return BUILTIN
    if not (FALLBACK / "config.json").is_file():
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=259, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)  # fmt: skip
        LlamaForCausalLM(cfg).save_pretrained(FALLBACK)
        train_tiny_module().save_tokenizer(FALLBACK)
    return FALLBACK


def train_tiny_module():
    """`models/train_tiny.py` (a script, not a package), for its byte-level tokenizer."""
    import importlib.util
    import sys

    if "train_tiny" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_tiny", REPO / "models" / "train_tiny.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_tiny"] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules["train_tiny"]


def demo_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=None, help="a Hugging Face checkpoint directory (default: the built-in tiny Shakespeare model)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 | float64")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on output tokens per request")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest for a tiny model, and on a busy machine)")
    p.add_argument("--no-progress", action="store_true")
    return p


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


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay out, save (making the folder) and close a demo's matplotlib figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def spread_lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """n output lengths spread evenly-at-random between lo and hi (seeded)."""
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def prompts_for(n: int) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] for i in range(n)]
