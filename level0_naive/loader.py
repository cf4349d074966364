"""Load a Hugging Face checkpoint directory into our `Transformer`, with its tokenizer.

What it is: `load_model(model, dtype, device)` reads `config.json`, single or sharded `*.safetensors`
(via `model.safetensors.index.json`), `tokenizer.json` / `tokenizer_config.json` (chat template included)
and `generation_config.json` from the directory that ladder/models.py's `resolve_path` finds (a hub id is
downloaded there on first use). Weights stored in bf16/fp16 are upcast to the requested dtype.

What it is not: the downloader, nor a reader of quantised formats or `pytorch_model.bin` pickles (loading
pickles runs code). Level 5's ranks read only their own weight slices (`load_metadata`, `checkpoint_name`).

Reference: transformers' `from_pretrained` conventions; vLLM's `model_loader/`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ladder import rooms
from ladder.models import resolve_path

from .model import ModelConfig, Transformer, rope_inv_freq
from .ops import DEFAULT_OPS, Ops

# model_type -> what differs from plain Llama. A room adds more (ladder/rooms.py: the mixtures of experts).
SUPPORTED = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
}


def our_name(name: str, model_type: str) -> str:
    """A checkpoint's tensor name -> the model's: the same, unless the type's room renames it."""
    room = rooms.architecture(model_type)
    return name if room is None else room.our_name(name, model_type)


def checkpoint_name(name: str, model_type: str) -> str:
    """The model's tensor name -> the checkpoint's: `our_name` backwards."""
    room = rooms.architecture(model_type)
    return name if room is None else room.checkpoint_name(name, model_type)


@dataclass
class LoadedModel:
    model: Transformer | None  # None: metadata only (`load_metadata`)
    config: ModelConfig
    tokenizer: object | None  # a transformers tokenizer, or None when the checkpoint has none
    eos_token_ids: list[int]
    path: Path
    hf_config: dict
    generation_config: dict


def model_config_from_hf(hf: dict) -> ModelConfig:
    """Translate a Hugging Face `config.json` dict into our `ModelConfig`."""
    mtype = hf.get("model_type")
    room = rooms.architecture(mtype)
    if mtype not in SUPPORTED and room is None:
        arch = (hf.get("architectures") or [mtype])[0]
        known = ", ".join([*SUPPORTED, *rooms.ARCHITECTURES])
        raise ValueError(f"unsupported architecture {arch!r} (model_type={mtype!r}); supported model types: {known}")
    # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` + `rope_scaling`.
    rope = dict(hf.get("rope_parameters") or {})
    rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if not rope:
        rope = dict(hf.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        rope = None
    heads = hf["num_attention_heads"]
    extra = SUPPORTED[mtype] if room is None else room.ARCHITECTURES[mtype]
    max_pos = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window") if hf.get("use_sliding_window", mtype in ("mistral", "mixtral")) else None
    if window:
        # Sliding windows are not implemented; within the window attention is full, so the context
        # is capped at the window instead.
        max_pos = min(max_pos, window)
    attention_bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=extra.get("qkv_bias", False) or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=extra.get("qk_norm", False),
        moe=None if room is None else room.config_from_hf(hf, mtype),
    )


def tensor_files(path: Path) -> dict[str, Path]:
    """Each tensor name of a checkpoint -> the safetensors file that holds it (one file, or the shards an
    index names): what a reader of a few tensors needs, without loading any."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state = {}
        for shard in shards:
            state.update(load_file(path / shard))
        return state
    single = path / "model.safetensors"
    if single.is_file():
        return load_file(single)
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path}")


def load_tokenizer(path: Path):
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def eos_ids(hf: dict, gen: dict, tokenizer) -> list[int]:
    """EOS ids from generation_config.json, then config.json, then the tokenizer."""
    for source in (gen.get("eos_token_id"), hf.get("eos_token_id"), getattr(tokenizer, "eos_token_id", None)):
        if source is not None:
            return [source] if isinstance(source, int) else list(source)
    return []


def load_metadata(model: str | os.PathLike) -> LoadedModel:
    """Everything but the weights: config, tokenizer, EOS ids (`model` is None)."""
    path = resolve_path(model)
    hf = json.loads((path / "config.json").read_text())
    cfg = model_config_from_hf(hf)
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    tokenizer = load_tokenizer(path)
    return LoadedModel(None, cfg, tokenizer, eos_ids(hf, gen, tokenizer), path, hf, gen)


def load_model(model: str | os.PathLike, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               ops: Ops = DEFAULT_OPS) -> LoadedModel:  # fmt: skip
    """The checkpoint's weights, config and tokenizer; its model computes through `ops` (ops.py)."""
    meta = load_metadata(model)
    path, cfg, hf = meta.path, meta.config, meta.hf_config
    with torch.device("meta"):
        net = Transformer(cfg, ops)  # no memory yet; weights arrive below
    state = {our_name(k, hf["model_type"]): v for k, v in load_state_dict(path).items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = set(net.state_dict()) - set(state), set(state) - set(net.state_dict())
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    unexpected = {k for k in unexpected if not k.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the {hf['model_type']} layout: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    state = {k: v.to(dtype=dtype, device=device) for k, v in state.items() if k in net.state_dict()}
    net.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    net.inv_freq = rope_inv_freq(cfg).to(device)  # built on "meta" above, so it holds no values yet
    net.eval()
    meta.model = net
    return meta
