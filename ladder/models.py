"""Models by name: the built-in ones from any directory, and hub ids, downloaded on first use.

What it is: `models/tiny-shakespeare` (the target), `models/tiny-shakespeare-draft`
(the draft for speculative decoding) and `models/tiny-shakespeare-moe` (a mixture of
experts, Mixtral's layout), trained by `models/train_tiny.py` and committed.
`builtin_path("tiny-shakespeare")` (also "models/tiny-shakespeare") gives their
absolute directory, so `LLM("tiny-shakespeare")` works wherever Python runs; an explicit
path that exists always wins. `default_model()` is what a demo uses without `--model`:
the built-in target, or, in a checkout without it, a small random Llama saved once to
a cache directory through `transformers.save_pretrained` (nothing is downloaded).

`resolve_path(model, revision, download_dir)` is where every level's loader looks: a local
directory, a built-in name, or a hub id ("Qwen/Qwen3-0.6B"), downloaded on first use into
the Hugging Face cache (or `download_dir`) with a progress bar, as vLLM does: only what the
loader reads (`HUB_FILES`). `HF_TOKEN`, `HF_HUB_OFFLINE` and `HF_ENDPOINT` mean what they
mean to huggingface_hub. An unknown or gated repository, or no network, is one line saying
which and what to do (`hub_error`).

What it is not: a registry of other models, or a second cache (huggingface_hub's is the one).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO / "models"
BUILTIN_NAMES = ("tiny-shakespeare", "tiny-shakespeare-draft", "tiny-shakespeare-moe", "tiny-shakespeare-eagle")
BUILTIN = MODELS_DIR / "tiny-shakespeare"
BUILTIN_DRAFT = MODELS_DIR / "tiny-shakespeare-draft"
BUILTIN_MOE = MODELS_DIR / "tiny-shakespeare-moe"
BUILTIN_EAGLE = MODELS_DIR / "tiny-shakespeare-eagle"  # an EAGLE head over BUILTIN (models/train_eagle.py)
FALLBACK = Path.home() / ".cache" / "inference-ladder" / "random-llama"


def builtin_path(name: str) -> Path | None:
    """The directory of a built-in model named `name` or `models/name`, if it is on disk."""
    key = str(name).removeprefix("models/").rstrip("/")
    if key not in BUILTIN_NAMES:
        return None
    path = MODELS_DIR / key
    return path if (path / "config.json").is_file() else None


# What the loader reads (level0_naive/loader.py), and nothing else: a repository's
# pytorch_model.bin, onnx/ and original/ copies of the same weights can be several times larger.
HUB_FILES = ["*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
             "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
             "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja"]  # fmt: skip


def is_hub_id(model: str | os.PathLike) -> bool:
    """Whether `model` has the form of a hub repository id, "org/name" ("./x/y" and "a/b/c" do not)."""
    text = str(model)
    return text.count("/") == 1 and not text.startswith((".", "/", "~")) and not text.endswith("/")


def resolve_path(model: str | os.PathLike, revision: str | None = None, download_dir: str | None = None) -> Path:
    """A local directory, a built-in model's name, or a hub id: downloaded on first use, then from the cache."""
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise ValueError(f"model directory {path} has no config.json")
    builtin = builtin_path(str(model))
    if builtin is not None:
        return builtin
    if is_hub_id(model):
        return download(str(model), revision, download_dir)
    raise ValueError(f"model {str(model)!r} not found; looked in: {path.resolve()}; the built-in models "
                     f"({', '.join(BUILTIN_NAMES)}); and it is not a hub id (org/name)")  # fmt: skip


def download(repo_id: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The snapshot directory of `repo_id` at `revision` (default main), fetched if the cache lacks it."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=download_dir, allow_patterns=HUB_FILES))
    except Exception as e:
        error = hub_error(e, repo_id, revision, download_dir)
        if error is e:
            raise
        raise error from e


def hub_error(e: Exception, repo_id: str, revision: str | None, download_dir: str | None) -> Exception:
    """huggingface_hub's exception as one line that says what went wrong and what to do (its own
    messages run to several lines and name the library's internals). Anything else passes as is."""
    from huggingface_hub import constants, errors, get_token

    where = f"{constants.ENDPOINT}/{repo_id}"
    if isinstance(e, errors.GatedRepoError):  # before RepositoryNotFoundError: it is a subclass
        token = "the token given has no access to it" if get_token() else "no token was given"  # HF_TOKEN, or a login
        return ValueError(f"model {repo_id!r} is gated and {token}: accept its terms at {where}, then set HF_TOKEN "
                          f"to a token of that account (https://huggingface.co/settings/tokens)")  # fmt: skip
    if isinstance(e, errors.RepositoryNotFoundError):  # the hub answers a private one the same way
        return ValueError(f"model {repo_id!r} not found: no such local directory, and no repository {where} "
                          f"(check the spelling; a private one needs HF_TOKEN)")  # fmt: skip
    if isinstance(e, errors.RevisionNotFoundError):
        return ValueError(f"model {repo_id!r} has no revision {revision!r} on the hub ({where}): give a branch, "
                          f"tag or commit it has")  # fmt: skip
    if isinstance(e, errors.HFValidationError):
        return ValueError(f"model {repo_id!r} is not a local directory, and not a valid hub id (org/name)")
    cache = download_dir or constants.HF_HUB_CACHE
    if isinstance(e, errors.LocalEntryNotFoundError) and constants.HF_HUB_OFFLINE:
        return ValueError(f"model {repo_id!r} not found in the cache ({cache}), and HF_HUB_OFFLINE=1 forbids "
                          f"downloading it: unset HF_HUB_OFFLINE once, or give a local directory")  # fmt: skip
    if isinstance(e, (errors.LocalEntryNotFoundError, errors.HfHubHTTPError, OSError)):
        cause = e.__cause__ or e
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:120]
        return ValueError(f"model {repo_id!r} not found in the cache ({cache}), and the hub ({constants.ENDPOINT}) "
                          f"could not be reached ({reason}): check the network, a proxy or HF_ENDPOINT, or "
                          f"give a local directory")  # fmt: skip
    return e


def pinned(model: str, revision: str | None, download_dir: str | None) -> str:
    """What `ModelSettings.model` holds: the model as given, or, where a revision or download
    directory must reach the loader, its snapshot's directory (the loader takes the model alone,
    as a directory holds exactly one revision)."""
    if revision is None and download_dir is None:
        return model
    return str(resolve_path(model, revision, download_dir))


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


def train_eagle_module():
    """`models/train_eagle.py` (a script, not a package): the EAGLE head's trainer, for its reference head and measures."""
    import importlib.util
    import sys

    if "train_eagle" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_eagle", MODELS_DIR / "train_eagle.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["train_eagle"] = module
        spec.loader.exec_module(module)
    return sys.modules["train_eagle"]


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
