"""The machine's limit: how many FLOP/s this CPU (or GPU) sustains on the model's matmuls.

What it is: two halves of a roofline argument.

  1. Work. A token fed through the model costs, in multiply-add FLOPs (2 per MAC),
         body      2 x (q, k, v, o, gate, up, down weights)            per layer, x layers
         lm_head   2 x hidden x vocab                                  only where a token is sampled
         attention 2 x 2 x context x (heads x head_dim)                per layer (q.k^T and p.v)
     (`models/train_tiny.py: matmul_flops_per_token` is the same sum.) The useful work of
     a request with P prompt tokens and n outputs is P + n - 1 fed tokens at positions
     0 .. P+n-2, and n lm_head rows. Padding, running past a request's end and
     recomputation after preemption are not useful work; a prefix-cache hit skips work a
     cache-less engine would do, so level 3 may beat its own share (the figure is
     "fraction of what the machine could do on this workload without caching").
  2. Speed. Time the model's own shapes, fused the way the fastest engine could fuse
     them, at a sweep of batch sizes:
         x [B, hidden] @ W_qkv^T [hidden, q+2kv] -> @ W_o^T -> @ W_gate_up^T [hidden, 2 ffn] -> @ W_down^T -> @ lm_head^T
     and report the best of several timed windows at each size (each window is
     sustained work, 0.25 s of back-to-back chains; on a shared machine a neighbour
     only ever slows a window down, so the best one is the least disturbed). The peak
     over the sweep is the machine's limit for this model.

Throughput as a fraction of that limit (MFU, model FLOPs utilisation) says how much of
the hardware an engine turns into tokens. Decode at batch 1 is matrix-vector work and
memory-bound: no engine reaches the peak there, which is why batching matters.

  3. The ceiling at a batch (`ceiling_tokens_per_s`): a decode step of B tokens cannot take
     less than the model's matmuls at batch B (the sweep's rate, interpolated in log B)
     plus reading its B sequences' KV cache at the machine's read bandwidth
     (`kv_read_bandwidth`). The peak above is reached only at batches no engine runs
     at; this floor is the honest "how far from the limit" at the batch an engine had.

Beside them, the read rate at the weights' size (`weight_bandwidth` in the results): what the
simulator's calibration (benchmarks/sim/validate.py) reads the weights at, once a step.

What it is not: a cycle-accurate model, or a memory roofline for the weights in the ceiling
above (a CPU's small-batch decode is partly bound by reading them, which the timed matmuls
include; the ceiling does not use `weight_bandwidth`).

Reference: Williams, Waterman, Patterson, "Roofline" (CACM 2009); the PaLM paper's MFU
(Chowdhery et al. 2022, appendix B).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass
class Dims:
    hidden: int
    layers: int
    q_width: int  # heads x head_dim
    kv_width: int  # kv heads x head_dim
    ffn: int
    vocab: int

    @classmethod
    def from_checkpoint(cls, path: str) -> Dims:
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(path)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        n_kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        return cls(
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads * head_dim,
            n_kv * head_dim,
            c.intermediate_size,
            c.vocab_size,
        )

    @property
    def body_flops(self) -> int:
        """Per fed token: every projection of every layer (2 FLOPs per multiply-add)."""
        d = self.hidden
        return 2 * self.layers * (d * self.q_width + 2 * d * self.kv_width + self.q_width * d + 3 * d * self.ffn)

    @property
    def lm_head_flops(self) -> int:
        return 2 * self.hidden * self.vocab

    @property
    def params(self) -> int:
        """Non-embedding matmul parameters plus the lm_head (the FLOP-bearing ones)."""
        return (self.body_flops + self.lm_head_flops) // 2

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """KV-cache bytes one token takes in every layer (K and V), at `itemsize` bytes per element."""
        return 2 * self.layers * self.kv_width * itemsize

    def attention_flops(self, context: int) -> int:
        return 4 * context * self.q_width * self.layers

    def flops_per_token(self, context: int) -> int:
        """One decode token at `context` positions, the way a roofline counts it."""
        return self.body_flops + self.lm_head_flops + self.attention_flops(context)


def useful_flops(dims: Dims, lengths: list[tuple[int, int]]) -> int:
    """FLOPs a cache-less, padding-free engine needs for requests of (prompt, output) lengths."""
    total = 0
    for p, n in lengths:
        fed = p + n - 1  # the last output token is sampled, never fed
        total += dims.body_flops * fed + dims.lm_head_flops * n + dims.attention_flops(1) * fed * (fed + 1) // 2
    return total


def mean_decode_context(lengths: list[tuple[int, int]]) -> float:
    """The mean context a decode token attends over, across the workload's output tokens."""
    ctx = [p + i for p, n in lengths for i in range(1, n)]
    return statistics.mean(ctx) if ctx else 0.0


@torch.inference_mode()
def matmul_flops_per_s(
    dims: Dims, batch: int, dtype: torch.dtype, device: torch.device, window: float, repeats: int,
    inductor: dict | None = None,
) -> float:  # fmt: skip
    """Best-window FLOP/s of the model's fused matmul chain at batch size `batch`. `inductor`: the chain
    compiled with those Inductor settings (`FROZEN_GEMM`: the weights frozen, Inductor's own GEMMs, so
    the rate an engine compiled that way can reach), not ATen's calls."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def w(out_f: int, in_f: int) -> torch.Tensor:
        return (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(dtype=dtype, device=device)

    d = dims.hidden
    w_qkv, w_o = w(dims.q_width + 2 * dims.kv_width, d), w(d, dims.q_width)  # [q+2kv, d], [d, q]
    w_gu, w_down, w_head = w(2 * dims.ffn, d), w(d, dims.ffn), w(dims.vocab, d)  # [2f, d], [d, f], [V, d]
    x = torch.randn(batch, d, generator=g).to(dtype=dtype, device=device)  # [B, d]
    flops = 2 * batch * (w_qkv.numel() + w_o.numel() + w_gu.numel() + w_down.numel() + w_head.numel())

    model = _Chain(dims, w_qkv, w_o, w_gu, w_down, w_head)

    def chain() -> None:
        model(x)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if inductor is not None:
        chain = _compiled_chain(model, x, inductor)
    chain()  # warm up: first-call allocation and kernel selection
    sync()
    rates = []
    for _ in range(repeats):
        n, start = 0, time.perf_counter()
        while True:
            chain()
            n += 1
            if n % 8 == 0 or device.type != "cuda":
                sync()
                if time.perf_counter() - start >= window:
                    break
        sync()
        rates.append(n * flops / (time.perf_counter() - start))
    return max(rates)


class _Chain(torch.nn.Module):
    """The timed chain (see `matmul_flops_per_s`), its weights parameters as a model's are."""

    def __init__(self, dims: Dims, *weights: torch.Tensor):
        super().__init__()
        self.dims = dims
        self.w_qkv, self.w_o, self.w_gu, self.w_down, self.w_head = (torch.nn.Parameter(w, requires_grad=False)
                                                                      for w in weights)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = F.linear(x, self.w_qkv)  # [B, q+2kv]
        h = F.linear(qkv[:, : self.dims.q_width], self.w_o)  # [B, d]
        gu = F.linear(h, self.w_gu)  # [B, 2f]
        h = F.linear(gu[:, : self.dims.ffn], self.w_down)  # [B, d]
        return F.linear(h, self.w_head)  # [B, V]


def _compiled_chain(model: _Chain, x: torch.Tensor, inductor: dict):
    """`model(x)` through torch.compile with Inductor's settings `inductor`, compiled now, in inference mode
    as an engine's step (with `freezing` the weights become constants, as the runner's do: Dynamo reads it
    while it traces, so the settings are patched around that first call, not only Inductor's compile)."""
    import torch._inductor.config

    compiled = torch.compile(model, dynamic=False, fullgraph=True)
    with torch.inference_mode(), torch._inductor.config.patch(inductor):
        compiled(x)

    def run() -> None:
        with torch.inference_mode():
            compiled(x)

    return run


def measure(
    dims: Dims, dtype: torch.dtype, device: torch.device, batches: list[int], window: float = 0.25, repeats: int = 5
) -> dict:
    """The sweep, its peak, and the model's per-token costs, as plain JSON-ready data."""
    sweep = [{"batch": b, "flops_per_s": matmul_flops_per_s(dims, b, dtype, device, window, repeats)} for b in batches]
    return {
        "dims": asdict(dims),
        "params": dims.params,
        "dtype": str(dtype).removeprefix("torch."),
        "sweep": sweep,
        "peak_flops_per_s": max(s["flops_per_s"] for s in sweep),
        "body_flops_per_token": dims.body_flops,
        "lm_head_flops_per_token": dims.lm_head_flops,
        "attention_flops_per_token_per_context": dims.attention_flops(1),
    }


DRAM_PROBE_BYTES = 256 << 20  # larger than most CPUs' last-level cache (and a GPU's L2): read from DRAM (HBM)


CPU = torch.device("cpu")


def kv_read_bandwidth(nbytes: int = DRAM_PROBE_BYTES, repeats: int = 5, device: torch.device = CPU) -> float:
    """Bytes/s `device` reads a tensor much larger than its caches at: on a CPU the best of `repeats`
    single reads; on a GPU, where one 256 MB read takes under a tenth of a millisecond, of 20 ms windows."""
    return read_bandwidth(nbytes, repeats, window=0.0 if device.type == "cpu" else 0.02, device=device)


def read_bandwidth(nbytes: int, repeats: int = 5, window: float = 0.02, device: torch.device = CPU) -> float:
    """Bytes/s `device` reads `nbytes` at, read again and again: the best of `repeats` windows of at
    least `window` seconds (one read of a few MB is a fraction of a millisecond: too short to time alone).
    DRAM's rate for a tensor larger than the caches, more for one the last-level cache holds from one read
    to the next (a tiny model's 24 MB of weights, on a 2-core EPYC VM with a 32 MB L3: 1.5-2.5x DRAM's).
    On a GPU the reads are queued and the window closes when they have run (not run on a GPU yet)."""
    x = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    finish = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    x.sum()
    finish()
    best = 0.0
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < window or n == 0:
            x.sum()
            n += 1
        finish()
        best = max(best, n * x.numel() * 4 / (time.perf_counter() - t0))
    return best


def weight_bandwidth(weight_bytes: int, device: torch.device = CPU) -> float:
    """The rate a step reads the weights at, measured at their size (at most DRAM_PROBE_BYTES: a large
    model's read is DRAM's (HBM's), and measuring it at its own size would allocate that size again).
    On a GPU a model of a few MB is read in about a kernel launch's time: its figure is the launches'."""
    return read_bandwidth(min(weight_bytes, DRAM_PROBE_BYTES), device=device)


def rate_at(sweep: list[dict], batch: float) -> float:
    """The matmul FLOP/s at `batch`, interpolated in log2(batch) between the sweep's points."""
    pts = sorted((math.log2(s["batch"]), s["flops_per_s"]) for s in sweep)
    x = math.log2(max(batch, 1.0))
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, r0), (x1, r1) in zip(pts, pts[1:]):
        if x <= x1:
            return r0 + (r1 - r0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


def step_floor(dims: Dims, flops_per_s: float, batch: float, context: float, bytes_per_token: int,
               bandwidth: float) -> tuple[float, float]:  # fmt: skip
    """The two halves of a decode step's floor, in seconds: the matmuls of `batch` tokens at
    `flops_per_s`, and reading `batch` sequences' KV cache of `context` tokens at `bandwidth`."""
    return batch * (dims.body_flops + dims.lm_head_flops) / flops_per_s, batch * context * bytes_per_token / bandwidth


def ceiling_tokens_per_s(dims: Dims, sweep: list[dict], batch: float, context: float, bytes_per_token: int,
                         bandwidth: float) -> float:  # fmt: skip
    """Decode tokens/s at the floor for a batch of `batch` sequences of `context` tokens each:
    B tokens / (matmuls at B, at the sweep's rate there + the KV bytes at the read bandwidth)."""
    b = max(batch, 1.0)
    return b / sum(step_floor(dims, rate_at(sweep, b), b, context, bytes_per_token, bandwidth))
