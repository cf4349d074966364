"""The one transformer of the ladder: the Llama family as Hugging Face checkpoints store it.

What it is: Llama 2/3 (with Llama-3 and linear RoPE scaling), Mistral, Qwen2/2.5 (QKV
bias) and Qwen3 (per-head q/k RMSNorm), with grouped-query attention, RoPE, RMSNorm,
SwiGLU and tied or untied embeddings. Parameter names equal Hugging Face's, so a
checkpoint's state dict loads as it is (see `loader.py`). A checkpoint whose MLPs are
mixtures of experts brings its layer in `ModelConfig.moe` (a room's: ladder/rooms.py).

What it is not: it never owns a KV cache and never decides how attention reads one. Every
layer hands its new q, k, v to an *attention backend* object the engine passes in (`attn(layer,
q, k, v) -> out`; level 0's is a contiguous slab per request). Likewise every linear layer,
norm, RoPE and SwiGLU computes through an *ops* object (`ops.py`), which `Transformer.set_ops`
swaps, so compiled or fixed-order kernels replace PyTorch's without an edit here. The file never
changes per level: level 1 passes a paged cache, and level 5's sharded layers override `Attention.qkv`.

One flattened batch per forward, as in vLLM V1: the new tokens of every sequence are
concatenated into `input_ids [T]` with their absolute `positions [T]`; which token
belongs to which sequence is the attention backend's business, not the model's.

Reference: the Hugging Face `modeling_llama.py` / `modeling_qwen3.py` (the oracle our
tests compare against), and nanoGPT's `model.py` for the style.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .ops import DEFAULT_OPS, Ops, apply_rope  # noqa: F401 (apply_rope: HF's RoPE, ops.py)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture hyper-parameters we read from a checkpoint's `config.json`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...} or None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: bias on q, k, v only
    o_bias: bool = False  # Llama/Qwen3 `attention_bias`: bias on o as well
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    moe: object | None = None  # a mixture of experts' settings, which build its layers' MLPs (a room's); None: dense


class AttentionBackend(Protocol):
    """What a layer needs from the engine: store this step's k, v and attend."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]."""
        ...


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed by `self.ops.rms_norm` (in float32, as HF does: see ops.py)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: Ops = DEFAULT_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)  # [..., dim]


class Linear(nn.Linear):
    """`nn.Linear` (the same parameters, so the same checkpoint names) whose matmul is `self.ops.linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__(in_features, out_features, bias=bias)
        self.ops: Ops = DEFAULT_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias)  # [T, in] -> [T, out]


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] of RoPE, with the checkpoint's scaling applied.

    In float32 exactly as Hugging Face computes them, even for a float64 model: the angles are part
    of the function the checkpoint was trained with, and matching the oracle bit for bit keeps our
    float64 equality tests free of near-tie flips."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # [D/2]
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = scaling["factor"]
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        out = torch.where(wavelen > old_len / lo, inv_freq / factor, blended)
        return torch.where(wavelen < old_len / hi, inv_freq, out)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)")


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.nh, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.nh * self.d, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, self.nkv * self.d, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, self.nkv * self.d, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.nh * self.d, cfg.hidden_size, bias=cfg.o_bias)
        self.ops: Ops = DEFAULT_OPS  # for RoPE (ops.apply_rope: HF's "rotate half" pairs (i, i + D/2))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, Hq*D], k, v [T, Hkv*D] (a method, so a subclass can fuse the three)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x, cos, sin, attn: AttentionBackend) -> torch.Tensor:
        T = x.shape[0]  # x [T, hidden]
        q, k, v = self.qkv(x)
        q = q.view(T, self.nh, self.d)  # [T, Hq, D]
        k = k.view(T, self.nkv, self.d)  # [T, Hkv, D]
        v = v.view(T, self.nkv, self.d)  # [T, Hkv, D]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rope(q, k, cos, sin)  # [T, Hq, D], [T, Hkv, D]
        out = attn(self.layer, q, k, v)  # [T, Hq, D]; the backend also stores k, v
        return self.o_proj(out.reshape(T, self.nh * self.d))  # [T, hidden]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), the middle computed by `self.ops.silu_mul`. Also each
    expert of a mixture, `intermediate_size` then the expert's width."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None):
        super().__init__()
        ff = intermediate_size or cfg.intermediate_size
        self.gate_proj = Linear(cfg.hidden_size, ff, bias=cfg.mlp_bias)
        self.up_proj = Linear(cfg.hidden_size, ff, bias=cfg.mlp_bias)
        self.down_proj = Linear(ff, cfg.hidden_size, bias=cfg.mlp_bias)
        self.ops: Ops = DEFAULT_OPS

    def forward(self, x):
        return self.down_proj(self.ops.silu_mul(self.gate_proj(x), self.up_proj(x)))  # [T, ff] -> [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg) if cfg.moe is None else cfg.moe.mlp(cfg, layer, MLP, Linear)  # [T, hidden] -> same

    def forward(self, x, cos, sin, attn):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)  # pre-norm residual
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """HF's `model.*` submodule: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """`Transformer(cfg)(input_ids [T], positions [T], attn) -> hidden [T, hidden]`."""

    def __init__(self, cfg: ModelConfig, ops: Ops = DEFAULT_OPS):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # RoPE angles are a pure function of the config, computed in float32 as HF does
        # and cast per forward. A buffer, not a parameter: never read from a checkpoint.
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)  # [D/2]
        self.set_ops(ops)

    def set_ops(self, ops: Ops) -> None:
        """Route every linear, norm, RoPE and SwiGLU of this model through `ops` (see ops.py)."""
        self.ops = ops
        for module in self.modules():
            if hasattr(module, "ops"):  # Linear, RMSNorm, Attention, MLP, and any other module with one
                module.ops = ops

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        angles = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [T, D/2]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rope(positions, x.dtype)  # [T, D/2] each
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)
        return self.model.norm(x)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32 or wider (sampling wants it)."""
        logits = self.lm_head(hidden)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))
