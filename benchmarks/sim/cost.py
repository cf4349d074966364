"""The cost model: how long one engine step takes on a GPU that is not here.

What it is: three small pieces of data and one function.

    Hardware     peak FLOP/s, memory bandwidth, memory, the link between GPUs (gpus.json),
                 and how much of the peaks a step reaches (the efficiencies)
    ModelShape   what a checkpoint's config.json says about its size (models/*/config.json):
                 parameters per layer, KV bytes per token, FLOPs per token
    step_time    one step's seconds, from what the scheduler decided: for each scheduled
                 request (tokens already cached c, new tokens n)

A step is a roofline sum over operator classes, each the slower of its compute and its
memory traffic, plus a fixed per-step overhead:

    linears    FLOPs 2 * T * P (T new tokens in the step, P weights per rank)
               bytes  P * b (the weights, read once per step, whatever T, at their own rate where
                      it differs: a CPU's cache may hold them; b: 8 or 4 bits and their scales for
                      quantized weights) + activations
    attention  FLOPs 4 * Hq * D * L * sum_i n_i * (c_i + (n_i + 1) / 2)  (QK^T and PV, causal)
               bytes  sum_i (c_i + n_i) * kv_bytes_per_token  (each request reads its whole KV; on a
                      machine with `kv_reuse`, a block another request of the step already read
                      comes from the cache: its bytes are not counted again)
    lm head    FLOPs 2 * S * V * H for the S rows that sample, its weights V * H * b (at the weights' rate)
    TP         2 all-reduces per layer of T * H * b bytes: alpha + bytes * 2 (tp - 1) / tp / link
    PP         pp - 1 sends of the activations, T * H * b bytes each: alpha + bytes / link; this sum
               is one step alone, its stages one after another (the simulated executor,
               clock.py, gives each stage a clock of its own: level 5's micro-batches overlap)
    LoRA       the adapters' shrink and expand, each distinct adapter's A and B read once (lora_cost.py);
               0 without adapters
    overhead   seconds per step (the CPU's scheduling and kernel launches), per request, per new
               token and per context token in it, a context token whose block was already read in
               the step (a shared prefix) at its own rate (only the first on a GPU unless calibrated),
               and per chunk after a prefix hit (a CPU's attention takes those one row at a time)

    t_step = sum over classes of max(FLOPs / (peak * eff_c), bytes / (bandwidth * eff_m)) + comm + overhead
             (the weights' bytes over their own rate where the hardware has one: `weight_bytes_per_s`)

So a decode step at a small batch costs the weights' read (memory-bound), a large prefill
costs its FLOPs (compute-bound), and the KV reads grow with every request's context.

What it is not: a kernel model. It knows no tile shapes, occupancy, CUDA graphs or launch
latencies beyond the overhead term; docs/what_if.md says what that leaves out.

Reference: Vidur (Agrawal et al., MLSys 2024) for operator-class costs; the roofline model
(Williams et al., 2009); "LLM Inference Unveiled" (Yuan et al., 2024) for the FLOP and byte counts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from .lora_cost import SimAdapter, lora_cost

HERE = Path(__file__).parent
# features.cpu_kernels.attention.LONG_QUERY (a test holds them equal; this file stays free of torch): a query of
# more tokens over a longer cache goes to SDPA row by row
CACHED_CHUNK = 8


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # peak FLOP/s in the serving dtype
    bytes_per_s: float  # memory bandwidth
    memory_bytes: int
    link_bytes_per_s: float = 0.0  # GPU to GPU, per direction (TP's all-reduce)
    link_latency_s: float = 10e-6  # alpha: one collective's fixed cost
    compute_efficiency: float = 0.7  # what a step's matmuls reach of the peak (an assumption on GPUs)
    memory_efficiency: float = 0.8  # what its reads reach of the bandwidth
    step_overhead_s: float = 2e-3  # per step, whatever its size (scheduling, launches)
    seq_overhead_s: float = 0.0  # per request in the step (a CPU engine's per-row Python and dispatch)
    token_overhead_s: float = 0.0  # per new token (a CPU's elementwise ops, slower than its bandwidth says)
    context_overhead_s: float = 0.0  # per token of context attended over (a CPU's attention, below its roofline)
    shared_context_overhead_s: float | None = None  # per context token read again in a step (None: as above)
    # per chunk after a prefix hit (more than CACHED_CHUNK new tokens over a longer cached context): a CPU
    # sends such a row to SDPA alone, one gather and call per row and layer (features/cpu_kernels/attention.py)
    cached_chunk_overhead_s: float = 0.0
    kv_reuse: bool = False  # a KV block read again in one step comes from the cache (a CPU: a tiny model's
    # shared prefix fits in it); GPUs: False, every request's KV from HBM (paged attention reads per request)
    # the rate the weights are read at once a step, where it is not `bytes_per_s` (None: it is): a CPU's
    # last-level cache holds a tiny model's weights from one step to the next (24 MB, a 32 MB L3: 1.5-2.5x
    # DRAM's rate, benchmarks/roofline.py `weight_bandwidth`), while its KV cache streams from DRAM
    weight_bytes_per_s: float | None = None
    # measured matmul rates by tokens in the step, ((tokens, FLOP/s), ...) ascending: a CPU's rate climbs
    # tenfold from 1 row to 1,024 (benchmarks/roofline.py); None: `flops` at any size
    flops_curve: tuple[tuple[int, float], ...] | None = None

    def flops_at(self, tokens: int) -> float:
        """The matmul rate at this many rows: the curve, log-linear between its points, flat past its ends."""
        if not self.flops_curve:
            return self.flops
        pts = self.flops_curve
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (t0, f0), (t1, f1) in zip(pts, pts[1:]):
            if tokens <= t1:
                x = (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
                return f0 + x * (f1 - f0)
        return pts[-1][1]


def gpu(name: str, **overrides) -> Hardware:
    """A GPU from gpus.json (a100-40gb, a100-80gb, h100-80gb, h200, l4)."""
    specs = json.loads((HERE / "gpus.json").read_text())
    if name not in specs or name.startswith("_"):
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(k for k in specs if not k.startswith('_'))}")
    s = specs[name]
    hw = Hardware(s["name"], s["bf16_flops"], s["hbm_bytes_per_s"], int(s["memory_bytes"]), s["link_bytes_per_s"])
    return replace(hw, **overrides)


def gpu_names() -> list[str]:
    return [k for k in json.loads((HERE / "gpus.json").read_text()) if not k.startswith("_")]


@dataclass(frozen=True)
class ModelShape:
    """The sizes a cost needs, read from a Hugging Face config.json (llama, mistral, qwen2/3 and opt)."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_len: int
    gated_mlp: bool  # SwiGLU's three matrices (llama) or two (opt)
    eos_token_id: int
    tied_embeddings: bool = False  # the LM head is the embedding (OPT's default): one V x H matrix, not two
    dtype_bytes: int = 2
    # quantization (features/quantization): the linears' weights in `weight_bits` (8 or 4; None: the dtype's),
    # the KV cache at `kv_bytes_per_value` (fp8: 1; int8: 1 + 4 / head_dim, its scales; None: the dtype's)
    weight_bits: int | None = None
    kv_bytes_per_value: float | None = None

    @classmethod
    def from_hf(cls, hf: dict, name: str = "") -> ModelShape:
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos = (eos or [0])[0] if isinstance(eos, list) or eos is None else eos  # a list, one id, or none: 0
        return cls(
            name=name or hf.get("_name_or_path", hf["model_type"]), num_layers=hf["num_hidden_layers"],
            hidden=hf["hidden_size"], num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate=hf.get("intermediate_size") or hf["ffn_dim"], vocab=hf["vocab_size"],
            max_len=hf.get("max_position_embeddings", 2048), gated_mlp=hf["model_type"] != "opt",
            eos_token_id=eos, tied_embeddings=hf.get("tie_word_embeddings", hf["model_type"] == "opt"),
        )  # fmt: skip

    @property
    def layer_params(self) -> int:
        """Weights of one layer's linears (biases and norms are noise at this size)."""
        h, d = self.hidden, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o; k, v
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate
        return attn + mlp

    @property
    def params(self) -> int:
        """Every weight: the layers, the embedding and the LM head (one matrix when they are tied)."""
        return self.num_layers * self.layer_params + (1 if self.tied_embeddings else 2) * self.vocab * self.hidden

    @property
    def linear_bytes_per_weight(self) -> float:
        """A layer weight's bytes: the dtype's, or 8 or 4 bits plus their scales (int8: one per output
        channel, noise; int4: a scale and a zero in the dtype per group of 128)."""
        if self.weight_bits is None:
            return self.dtype_bytes
        return self.weight_bits / 8 + (2 * self.dtype_bytes / 128 if self.weight_bits == 4 else 0)

    @property
    def weight_bytes(self) -> int:
        """The layers' linears at their own width, the embedding and LM head in the dtype (quantization keeps them)."""
        head = (1 if self.tied_embeddings else 2) * self.vocab * self.hidden * self.dtype_bytes
        return int(self.num_layers * self.layer_params * self.linear_bytes_per_weight + head)

    @property
    def kv_bytes_per_token(self) -> int:
        per_value = self.dtype_bytes if self.kv_bytes_per_value is None else self.kv_bytes_per_value
        return int(2 * self.num_layers * self.num_kv_heads * self.head_dim * per_value)


def quantized(shape: ModelShape, quantization: str | None = None, kv_cache_dtype: str = "auto") -> ModelShape:
    """The shape with an engine's `quantization=` and `kv_cache_dtype=` (features/quantization's formats)."""
    bits = {"int8": 8, "int4": 4}.get(quantization)
    kv = {"fp8": 1.0, "int8": 1 + 4 / shape.head_dim}.get(kv_cache_dtype)  # int8: a float32 scale per head
    return replace(shape, weight_bits=bits, kv_bytes_per_value=kv)


def model_dir(name: str) -> Path:
    """The directory of a shipped shape (models/<name>/config.json)."""
    path = HERE / "models" / name
    if not (path / "config.json").is_file():
        known = sorted(p.name for p in (HERE / "models").iterdir() if (p / "config.json").is_file())
        raise ValueError(f"unknown model {name!r}; known: {', '.join(known)}")
    return path


def model_shape(name: str) -> ModelShape:
    return ModelShape.from_hf(json.loads((model_dir(name) / "config.json").read_text()), name)


def kv_budget(hw: Hardware, shape: ModelShape, tp: int = 1, gpu_memory_utilization: float = 0.9,
              activation_reserve: float = 0.05) -> int:  # fmt: skip
    # (tp: the GPUs the weights are split over, tensor x pipeline parallel)
    """KV bytes per rank: vLLM's rule, `utilization * memory - weights - activations`, the activations'
    peak taken as a share of the memory (vLLM profiles it with a dummy forward at the largest batch)."""
    free = hw.memory_bytes * (gpu_memory_utilization - activation_reserve) - shape.weight_bytes / tp
    if free <= 0:
        raise ValueError(f"{shape.name} ({shape.weight_bytes / 1e9:.1f} GB) does not fit {tp} x {hw.name}")
    return int(free)


@dataclass(frozen=True)
class StepCost:
    """One step's seconds by class (what step_time sums)."""

    linear: float
    attention: float
    lm_head: float
    comm: float
    overhead: float
    send: float = 0.0  # one of PP's sends between stages (comm holds pp - 1 of them): what a pipeline's executor needs
    lora: float = 0.0  # the adapters' matmuls and weights (lora_cost.py)

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.lm_head + self.comm + self.overhead + self.lora


def step_cost(hw: Hardware, shape: ModelShape, chunks: list[tuple[int, int]], num_sampled: int,
              tp: int = 1, pp: int = 1, shared: int = 0,
              adapters: list[SimAdapter | None] | None = None) -> StepCost:  # fmt: skip
    """chunks: (tokens already cached, new tokens) per scheduled request; num_sampled: logits rows;
    shared: of the context tokens, those in blocks another request of the step read first
    (`repeated_context`); adapters: each chunk's adapter (None: the base model), or None: no LoRA."""
    b, L, h = shape.dtype_bytes, shape.num_layers, shape.hidden
    T = sum(n for _, n in chunks)
    flops, bw = hw.flops_at(T) * hw.compute_efficiency, hw.bytes_per_s * hw.memory_efficiency
    w_bw = (hw.weight_bytes_per_s or hw.bytes_per_s) * hw.memory_efficiency  # the weights' own rate
    # linears: weights once per step, activations in and out of each matmul (q/k/v/o and the MLP's)
    w = L * shape.layer_params / tp
    act = T * L * b * (6 * h + (3 if shape.gated_mlp else 2) * shape.intermediate / tp)
    linear = max(2 * T * w / flops, w * shape.linear_bytes_per_weight / w_bw + act / bw)
    # attention: QK^T and PV over each request's context (causal inside its new tokens), its KV read once
    per_token = 4 * shape.num_heads * shape.head_dim * L / tp
    attn_flops = sum(per_token * n * (c + (n + 1) / 2) for c, n in chunks)
    kv_read = (sum(c + n for c, n in chunks) - (shared if hw.kv_reuse else 0)) * shape.kv_bytes_per_token / tp
    attention = max(attn_flops / flops, kv_read / bw) if chunks else 0.0
    head_w = shape.vocab * h / tp
    lm_head = max(2 * num_sampled * head_w / flops, head_w * b / w_bw) if num_sampled else 0.0
    comm = 0.0
    if tp > 1:  # two all-reduces per layer (after attention, after the MLP), ring: 2 (tp - 1) / tp of the bytes
        nbytes = T * h * b * 2 * (tp - 1) / tp
        comm = 2 * L * (hw.link_latency_s + nbytes / hw.link_bytes_per_s)
    send = 0.0
    if pp > 1:  # each stage hands its activations to the next, point to point
        send = hw.link_latency_s + T * h * b / hw.link_bytes_per_s
        comm += (pp - 1) * send
    context = sum(c + n for c, n in chunks)
    overhead = hw.step_overhead_s + hw.seq_overhead_s * len(chunks) + hw.token_overhead_s * T
    again = hw.context_overhead_s if hw.shared_context_overhead_s is None else hw.shared_context_overhead_s
    overhead += hw.context_overhead_s * (context - shared) + again * shared
    if hw.cached_chunk_overhead_s:
        overhead += hw.cached_chunk_overhead_s * cached_chunks(chunks)
    lora = lora_cost(hw, shape, [(n, a) for (_, n), a in zip(chunks, adapters)], tp) if adapters else 0.0
    return StepCost(linear, attention, lm_head, comm, overhead, send, lora)


def cached_chunks(chunks: list[tuple[int, int]]) -> int:
    """Of a step's (cached, new) rows, the chunks after a prefix hit: more than CACHED_CHUNK new tokens over a
    longer cached context (what `Hardware.cached_chunk_overhead_s` is paid for)."""
    return sum(1 for c, n in chunks if n > CACHED_CHUNK and c > n)


def step_time(hw: Hardware, shape: ModelShape, chunks: list[tuple[int, int]], num_sampled: int, tp: int = 1,
              pp: int = 1) -> float:  # fmt: skip
    return step_cost(hw, shape, chunks, num_sampled, tp, pp).total


def repeated_context(tables: list[list[int]], contexts: list[int], block_size: int) -> int:
    """Of a step's context tokens (contexts[i] for the request with block table tables[i]), those whose
    block an earlier request of the step also reads: a shared prefix counts once, then as repeats."""
    seen, again = set(), 0
    for table, ctx in zip(tables, contexts):
        for i, block in enumerate(table[: -(-ctx // block_size)]):
            if block in seen:
                again += min(block_size, ctx - i * block_size)
            seen.add(block)
    return again
