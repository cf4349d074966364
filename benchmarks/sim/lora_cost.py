"""LoRA's cost in a simulated step: the adapters' matmuls, and their weights read once per step.

What it is: `SimAdapter`, a request's adapter as the simulator knows it (an id, a rank, the
projections it targets: no path, no weights), and `lora_cost`, the seconds a step's adapters add,
a roofline term like cost.py's others. A row on adapter a, of rank r, adds to every projection it
targets (in -> out) of every layer Punica's two matmuls:

    shrink   x [n, in] . A^T [in, r]  -> [n, r]        expand   [n, r] . B^T [r, out] -> [n, out]

    FLOPs        2 * n * r * (in + out)                 per row, projection and layer
    weights      r * (in + out) * b                     per DISTINCT adapter in the step, projection and
                                                        layer: a BGMV kernel gathers each row's A and B,
                                                        and the rows of one adapter find them in the cache
    activations  n * (in + out) * b                     x read by the shrink, the delta added into y by
                                                        the expand (the [n, r] between them is noise)

    t_lora = max(FLOPs / (peak * eff_c), (weights + activations) / (bandwidth * eff_m))

At rank 8 the arithmetic intensity is about 2r / b = 8 FLOPs per byte, far under an A100's ridge
(about 150): the term is memory-bound, and what grows it is the number of distinct adapters a step
reads, not the rows. Bringing an adapter from host memory (PCIe) is not a step's cost: the
engine that keeps slots says when one is loaded (benchmarks/sim/lora.py).

What it is not: a kernel model (S-LoRA's MBGMV, Punica's BGMV and SGMV reach less than the
bandwidth on such skinny matmuls, and launch two kernels per projection and layer: the step's
fixed overhead is all the simulator has for launches), or tensor-parallel LoRA beyond dividing
by tp (S-LoRA's tensor parallelism schedules its own small collectives).

Reference: Chen et al., "Punica" (MLSys 2024), its BGMV kernel; Sheng et al., "S-LoRA"
(MLSys 2024), its MBGMV kernel and unified paging; features/lora/punica.py (the same delta, computed).
"""

from __future__ import annotations

from dataclasses import dataclass

# cost.py imports this file, so this file imports nothing of cost.py: `hw` below is a cost.Hardware and
# `shape` a cost.ModelShape, by their attributes only

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # features/lora's seven
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # S-LoRA's adapters (its LoraLayerWeight: q, k, v, o)


@dataclass(frozen=True)
class SimAdapter:
    """What a `LoRARequest` says of an adapter, for the simulator: its identity (`lora_int_id`, what the
    scheduler's admission rule and level 3's block names read), and what a cost needs: its rank and targets."""

    lora_int_id: int
    rank: int
    targets: tuple[str, ...] = ALL

    def __post_init__(self):
        if self.lora_int_id < 1 or self.rank < 1:
            raise ValueError(f"SimAdapter(lora_int_id={self.lora_int_id}, rank={self.rank}): both must be >= 1")
        if bad := [t for t in self.targets if t not in ALL]:
            raise ValueError(f"SimAdapter targets {bad}: not among {', '.join(ALL)}")

    @property
    def lora_name(self) -> str:
        return f"sim-{self.lora_int_id}"


def projections(shape) -> dict[str, tuple[int, int]]:
    """module -> (in, out) of the base model's projections (features/lora/adapter.py `shapes`; a test holds
    them equal). A two-matrix MLP (OPT) has no gate."""
    h, ff = shape.hidden, shape.intermediate
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, ff),
            "up_proj": (h, ff), "down_proj": (ff, h)}  # fmt: skip
    if not shape.gated_mlp:
        del dims["gate_proj"]
    return dims


def width(shape, adapter: SimAdapter) -> int:
    """sum of (in + out) over the adapter's targets in one layer: its A and B hold rank * width values."""
    dims = projections(shape)
    if missing := [t for t in adapter.targets if t not in dims]:
        raise ValueError(f"adapter {adapter.lora_int_id} targets {missing}, which {shape.name} does not have")
    return sum(sum(dims[t]) for t in adapter.targets)


def adapter_bytes(shape, adapter: SimAdapter) -> int:
    """One adapter's A and B over every layer (what a slot holds, what a load from host memory moves)."""
    return adapter.rank * width(shape, adapter) * shape.num_layers * shape.dtype_bytes


def lora_cost(hw, shape, rows: list[tuple[int, SimAdapter | None]], tp: int = 1) -> float:
    """The seconds a step's adapters add: rows are (new tokens, adapter or None: the base model) per
    scheduled request; 0 when no row has an adapter."""
    on = [(n, a) for n, a in rows if a is not None and n]
    if not on:
        return 0.0
    L, b = shape.num_layers, shape.dtype_bytes
    w = {a.lora_int_id: (a, width(shape, a)) for _, a in on}  # the distinct adapters, each with its width
    flops = sum(2 * n * a.rank * w[a.lora_int_id][1] for n, a in on) * L / tp
    weights = sum(a.rank * wd for a, wd in w.values()) * L * b / tp  # each distinct adapter's A and B, once
    act = sum(n * w[a.lora_int_id][1] for n, a in on) * L * b / tp
    T = sum(n for n, _ in rows)
    w_bw = (hw.weight_bytes_per_s or hw.bytes_per_s) * hw.memory_efficiency  # the weights' own rate, as cost.py's
    return max(flops / (hw.flops_at(T) * hw.compute_efficiency),
               weights / w_bw + act / (hw.bytes_per_s * hw.memory_efficiency))  # fmt: skip
