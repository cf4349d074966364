"""The built-in models: found by name from any directory, the way hub ids are.

What it is: `models/tiny-shakespeare` (the target), `models/tiny-shakespeare-draft`
(the draft for speculative decoding) and `models/tiny-shakespeare-moe` (a mixture of
experts, Mixtral's layout), trained by `models/train_tiny.py` and committed.
`builtin_path("tiny-shakespeare")` (also "models/tiny-shakespeare") gives their
absolute directory, so `LLM("tiny-shakespeare")` works wherever Python runs; an explicit
path that exists always wins. `default_model()` is what a demo uses without `--model`:
the built-in target, or, in a checkout without it, a small random Llama saved once to
a cache directory through `transformers.save_pretrained` (nothing is downloaded).

`resolve_path(model)` is where every level's loader looks: a local directory, a
built-in name, or a hub id already in the local Hugging Face cache.

What it is not: a downloader or a registry of other models.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO / "models"
BUILTIN_NAMES = ("tiny-shakespeare", "tiny-shakespeare-draft", "tiny-shakespeare-moe")
BUILTIN = MODELS_DIR / "tiny-shakespeare"
BUILTIN_DRAFT = MODELS_DIR / "tiny-shakespeare-draft"
BUILTIN_MOE = MODELS_DIR / "tiny-shakespeare-moe"
FALLBACK = Path.home() / ".cache" / "inference-ladder" / "random-llama"


def builtin_path(name: str) -> Path | None:
    """The directory of a built-in model named `name` or `models/name`, if it is on disk."""
    key = str(name).removeprefix("models/").rstrip("/")
    if key not in BUILTIN_NAMES:
        return None
    path = MODELS_DIR / key
    return path if (path / "config.json").is_file() else None


def resolve_path(model: str | os.PathLike) -> Path:
    """A local directory, a built-in model's name, or a hub id already in the local HF cache."""
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise ValueError(f"model directory {path} has no config.json")
    builtin = builtin_path(str(model))
    if builtin is not None:
        return builtin
    tried = [str(path.resolve()), f"the built-in models ({', '.join(BUILTIN_NAMES)})"]
    if "/" in str(model) and not str(model).startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(str(model), local_files_only=True))
        except Exception:  # not in the cache (the hub library says why; we only list where)
            from huggingface_hub.constants import HF_HUB_CACHE

            tried.append(f"{HF_HUB_CACHE} (local Hugging Face cache, hub id {model!r})")
    raise ValueError(
        f"model {str(model)!r} not found; looked in: " + "; ".join(tried) + " (nothing is downloaded at run time)"
    )


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
        spec = importlib.util.spec_from_file_location("train_tiny", MODELS_DIR / "train_tiny.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_tiny"] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules["train_tiny"]
