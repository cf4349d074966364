"""The device slots: every adapted projection's stacked A and B, what its layer reads, and each step's mapping.

What it is: `LoRASlots`, the half of LoRA that lives beside the model's weights (manager.py is the half
that decides: which adapters, which slot, which rows). It wraps each adapted projection in a LoRALinear
(layers.py) and holds, per projection, `max_loras` slots:

    A [S, P*R, in]   B [S, out, P*R]   scale [S]      (R = max_lora_rank; P = the base model's
                                                       projections this layer computes at once)

A layer may compute several of the base model's projections (level 5 fuses q, k and v into one
matmul, gate and up into another) and only a shard of each (tensor parallelism). Each projection it
computes is a `Piece`: which outputs (B's rows) and which inputs (A's columns) of it this layer
holds. Piece j of a fused layer takes ranks [j*R, (j+1)*R) of the slot, and its outputs' rows of B:
B is block-diagonal, so one shrink and one expand do every piece (each output row meets only its
own projection's ranks, the zeros in between add nothing):

    qkv on rank 0 of 2:   A = [A_q; A_k; A_v]  (whole: a column-parallel layer reads all of x)
                          B = [B_q rows of rank 0's heads    0     0  ]
                              [  0   B_k rows of its KV heads      0  ]
                              [  0     0   B_v rows of its KV heads   ]
    o on rank 0 of 2:     A = A_o's columns of rank 0's heads, B = B_o whole (row-parallel: the rank's
                          partial delta joins its partial output before the all-reduce sums them)

The unsharded model (levels 2-4) is the case of one piece per projection, whole.

`LoRAStep` is a step's adapters as plain values (the mapping, and which adapter goes into which
slot), what level 5's driver sends its ranks with each step's input; `apply` carries it out.

What it is not: the scheduler's side (manager.py: admission, placement, the host cache of the engine),
or S-LoRA's unified paging (a slot holds the largest rank).

Reference: vLLM `vllm/lora/layers/` (`MergedQKVParallelLinearWithLoRA`, `RowParallelLinearWithLoRA`:
slices of A and B per rank), `vllm/lora/punica_wrapper/`; S-LoRA (MLSys 2024) section 5, tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adapter import TARGETS, Adapter, shapes
from .layers import LoRALinear, RowParallelLoRALinear
from .punica import delta_gathered, delta_loop, delta_segmented, delta_stacked, segments
from .request import LoRAConfig


def delta_cpu(x, A, B, scale, idx):
    """Punica's BGMV as one compiled loop on a CPU (cpu_ops.py, cpu_lora.cpp): the multiplications each row
    needs, nothing copied. The slots call it adding into the base output (`add_delta`); this is its twin for
    the tests' and the demo's table of paths."""
    from .cpu_ops import delta_cpu as kernel

    return kernel(x, A, B, scale, idx)


def delta_triton(x, A, B, scale, idx):
    """Punica's BGMV as two Triton kernels (triton_ops.py), imported on first use: triton is Linux-only,
    and its import chooses the interpreter on a machine without CUDA (slow: a test's, not a CPU's path)."""
    from .triton_ops import delta_triton as kernels

    return kernels(x, A, B, scale, idx)


# the slots' paths. The default ("auto", `default_path`) is the compiled loop on a CPU where it builds and the
# stacked matmuls elsewhere (punica.py says why); the Triton kernels are opt-in (`llm.llm_engine.lora.path =
# "triton"`) until a GPU has run them
DELTAS = {"cpu": delta_cpu, "stacked": delta_stacked, "segmented": delta_segmented, "gathered": delta_gathered,
          "loop": delta_loop, "triton": delta_triton}  # fmt: skip


def compiled_loop_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Can the compiled loop (cpu_ops.py) take these slots: CPU tensors of a dtype it has, and a compiler here?"""
    from . import cpu_ops  # (imported on first use: it builds a C++ file)

    return device.type == "cpu" and dtype in cpu_ops.SUFFIX and cpu_ops.available()


def default_path(device: torch.device, dtype: torch.dtype, sharded: bool) -> str:
    """What path="auto" means: the compiled loop where it runs, unless S-LoRA's split needs the shrink and the
    expand apart (sharded); else the stacked matmuls."""
    return "cpu" if not sharded and compiled_loop_runs(device, dtype) else "stacked"


@dataclass(frozen=True)
class Piece:
    """One of the base model's projections inside a layer: the outputs and inputs of it the layer holds."""

    module: str  # the base model's name for it ("q_proj")
    rows: tuple[int, int]  # [first, last) of its outputs: B's rows
    cols: tuple[int, int]  # [first, last) of its inputs: A's columns


@dataclass(frozen=True)
class Shard:
    """S-LoRA's split of one layer's slots over the tensor-parallel ranks (sharded.py): this rank, of how many,
    and the ranks (LoRA's) of each piece it holds (column layers; 0 for a row layer's, split by outputs)."""

    comm: object  # level 5's Comm: the all-gather and all-reduce of the shrink
    rank: int
    size: int
    lora_ranks: int = 0  # R / tp


@dataclass(frozen=True)
class Target:
    """An adapted layer: where it sits in the model, the pieces it computes, and whether it is row-parallel."""

    owner: object  # the module holding it (a layer's attention or MLP)
    name: str  # its attribute there
    pieces: tuple[Piece, ...]
    row_parallel: bool = False  # its output is this rank's partial sum, all-reduced after the delta joins it
    by_ranks: Shard | None = None  # S-LoRA's column layer: A holds this rank's share of each piece's ranks
    by_outputs: Shard | None = None  # S-LoRA's row layer: B holds this rank's outputs (its piece's rows)


def whole_targets(model) -> dict[tuple[int, str], Target]:
    """(layer, module) -> Target for a whole model (levels 2-4): the seven projections, one piece each."""
    out, dims = {}, shapes(model.config)
    for i, layer in enumerate(model.model.layers):
        for module, parent in TARGETS.items():
            n_in, n_out = dims[module]
            out[i, module] = Target(getattr(layer, parent), module, (Piece(module, (0, n_out), (0, n_in)),))
    return out


@dataclass(frozen=True)
class LoRAStep:
    """A step's adapters as plain values (picklable; level 5 sends it to its ranks with the step's input)."""

    mapping: list[int]  # [T] each row's slot, -1: the base model
    # (slot, adapter) to put in a slot before the forward: the weights the engine read and checked when the
    # request was added, so a rank never reads a file in a step (the folder may be gone by then)
    loads: tuple[tuple[int, Adapter], ...] = ()


class LoRASlots:
    """Every adapted layer's slots (the module docstring draws them), the delta path they use, and the step's
    mapping; `load` puts an adapter in a slot, `set_mapping` says which slot each row of the step reads."""

    def __init__(self, model, config: LoRAConfig, path: str = "auto", targets: dict | None = None):
        """`targets`: the adapted layers (None: a whole model's seven projections; level 5's ranks pass their
        stage's fused, sharded ones: sharded.py)."""
        self.model_config = getattr(model, "full_config", model.config)  # a rank's stage: the whole model's shapes
        if self.model_config.moe is not None:
            raise ValueError("enable_lora with a mixture-of-experts model is not built (its experts' linears)")
        self.config = config
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        targets = whole_targets(model) if targets is None else targets
        S, R = config.max_loras, config.max_lora_rank
        self.targets = targets
        self.A, self.B = {}, {}  # key -> [S, P*R, in], [S, out, P*R] (S-LoRA's column layer: A [S, P*R/tp, in])
        self.flat = {}  # key -> views [in, S*P*R] of A and [S*P*R, out] of B: the stacked path's operands
        self.where = {}  # (layer, module) of the base model -> (key, piece number, first output row) here
        for key, t in targets.items():
            n_in = t.pieces[0].cols[1] - t.pieces[0].cols[0]
            n_out, W = sum(p.rows[1] - p.rows[0] for p in t.pieces), len(t.pieces) * R
            Wa = len(t.pieces) * t.by_ranks.lora_ranks if t.by_ranks else W  # A's rows here
            self.A[key] = torch.zeros(S, Wa, n_in, dtype=self.dtype, device=self.device)
            Bt = torch.zeros(S, W, n_out, dtype=self.dtype, device=self.device)  # B's storage: each rank's outputs
            self.B[key] = Bt.transpose(1, 2)  # a view of it: [S, out, W]
            self.flat[key] = (self.A[key].view(S * Wa, n_in).T, Bt.view(S * W, n_out))  # views: a slot's load shows
            at = 0
            for j, piece in enumerate(t.pieces):
                self.where[key[0], piece.module] = (key, j, at, piece)
                at += piece.rows[1] - piece.rows[0]
            wrapper = RowParallelLoRALinear if t.row_parallel else LoRALinear
            setattr(t.owner, t.name, wrapper(getattr(t.owner, t.name), key, self))
        self.widths = sorted({A.shape[1] for A in self.A.values()})  # P*R of the layers: R, 2R, 3R at level 5
        self.scale = torch.zeros(S, dtype=self.dtype, device=self.device)
        self.path = path  # which delta (punica.py, cpu_ops.py, triton_ops.py) the projections use: the setter checks it
        self.mapping: torch.Tensor | None = None  # [T] this step's slot per row
        self.keep: dict[int, torch.Tensor] = {}  # the stacked path's, per width W: [T, S*W] each row's slot's scale
        self.segs = None  # the segmented path's: punica.segments(mapping, scale), once per step
        self.active = False  # does this step run any adapter?

    # --- the delta, every adapted layer's ---------------------------------------------------------
    def add_delta(self, key, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] (the base projection's output) plus this step's delta for x [T, in], by the slots'
        path. The compiled loop (the CPU's default) is one C call that adds into y. The stacked one is three
        ops (where each op's dispatch counts): the shrink, this step's row mask in place (computed once per
        width for every projection), and the expand added to y in the same call (addmm)."""
        if self._path == "cpu":
            kernel = self.kernels[key]
            if kernel.takes(x, y) and len(self.mapping) == len(x):  # (the mapping: int64, set_mapping's)
                return kernel.run(x, self.mapping, y)  # y += the delta, in one compiled call
        if self._path in ("stacked", "cpu"):  # (the compiled loop's strays: a dtype or layout it does not take)
            A_flat, B_flat = self.flat[key]  # [in, S*W], [S*W, out]
            shrunk = (x @ A_flat).mul_(self._masks()[self.A[key].shape[1]])  # [T, S*W]
            t = self.targets[key]
            if t.by_ranks is not None or t.by_outputs is not None:
                return self._add_sharded(t, shrunk, B_flat, y)
            return torch.addmm(y, shrunk, B_flat)  # y + [T, out]
        if self.path == "segmented":  # its segments made once for the step, the delta added into y
            return delta_segmented(x, self.A[key], self.B[key], self.scale, self.mapping, self.segs, out=y)
        return y + DELTAS[self.path](x, self.A[key], self.B[key], self.scale, self.mapping).to(y.dtype)

    def _add_sharded(self, t: Target, shrunk: torch.Tensor, B_flat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """S-LoRA's split (sharded.py): a column layer's shrink [T, S*P*R/tp] gathered from every rank into
        [T, S*P*R], its ranks in their places; a row layer's partial shrink [T, S*P*R] summed over the ranks and
        expanded into this rank's outputs, its slice of the partial output y."""
        if t.by_ranks is not None:
            sh, T = t.by_ranks, shrunk.shape[0]
            parts = sh.comm.all_gather_rows(shrunk[None], [1] * sh.size)  # [tp, T, S*P*Rl]
            S, P = self.config.max_loras, len(t.pieces)
            # rank q's part holds ranks [q*Rl, (q+1)*Rl) of every slot's every piece: put them side by side
            full = parts.view(sh.size, T, S, P, sh.lora_ranks).permute(1, 2, 3, 0, 4).reshape(T, -1)  # [T, S*P*R]
            return torch.addmm(y, full, B_flat)
        shrunk = t.by_outputs.comm.all_reduce(shrunk, kind="lora_all_reduce")  # [T, S*W], the whole shrink
        o0, o1 = t.pieces[0].rows
        y[:, o0:o1].addmm_(shrunk, B_flat)  # this rank's outputs; the layer's all-reduce adds the others'
        return y

    def _masks(self) -> dict[int, torch.Tensor]:
        """The stacked path's row masks, once a step: width W -> [T, S*W], each row's slot's scale in its slot's
        W columns, zeros in the others': made by the step's first projection that needs them (with the compiled
        loop, only one it cannot take)."""
        if not self.keep:
            S, on = self.config.max_loras, torch.nonzero(self.mapping >= 0).squeeze(-1)
            keep = torch.zeros(len(self.mapping), S, dtype=self.dtype, device=self.device)
            keep[on, self.mapping[on]] = self.scale[self.mapping[on]]
            self.keep = {W: keep.repeat_interleave(W, dim=1) for W in self.widths}  # [T, S*W] each
        return self.keep

    @property
    def path(self) -> str:
        return self._path

    @path.setter
    def path(self, path: str) -> None:
        """`path="auto"` is `default_path`'s choice. Refused here, not in the first step's forward: an unknown
        path, the compiled loop where it cannot run (not a CPU, a dtype it does not take, no compiler), or the
        Triton kernels on tensors no kernel can launch on (a CPU without Triton's interpreter)."""
        sharded = any(t.by_ranks or t.by_outputs for t in self.targets.values())
        if path == "auto":
            path = default_path(self.device, self.dtype, sharded)
        if path not in DELTAS:
            raise ValueError(f"LoRA path {path!r}: one of auto, {', '.join(DELTAS)}")
        if path != "stacked" and sharded:
            raise ValueError(f"LoRA path {path!r} with fully_sharded_loras: only the stacked path splits its shrink "
                             "from its expand for the messages between them")  # fmt: skip
        if path == "cpu":
            from . import cpu_ops

            if not compiled_loop_runs(self.device, self.dtype):
                raise ValueError(f"LoRA path 'cpu' needs CPU tensors of float32, bfloat16 or float64 and a C++ compiler "
                                 f"(here: {self.device.type}, {self.dtype}, {cpu_ops.LIBRARY.error or 'built'}); the "
                                 "others: stacked, segmented, gathered, loop")  # fmt: skip
            self.kernels = {key: cpu_ops.SlotKernel(self.A[key], self.B[key], self.scale) for key in self.A}
        if path == "triton" and self.device.type != "cuda":
            from . import triton_ops

            if not triton_ops.interpreted():
                raise ValueError("LoRA path 'triton' on a CPU needs Triton's interpreter (TRITON_INTERPRET=1 before "
                                 "triton is first imported); the CPU's paths: cpu, stacked, segmented, gathered, loop")  # fmt: skip
        self._path = path

    # --- each step ------------------------------------------------------------------------------
    def clear(self) -> None:
        """The next forward runs no adapter."""
        self.mapping, self.keep, self.segs, self.active = None, {}, None, False

    def set_mapping(self, rows: list[int]) -> None:
        """Each row's slot for the next forward (-1: the base model), and what the path makes of it once."""
        self.mapping = torch.tensor(rows, dtype=torch.long, device=self.device)  # [T]
        self.active = any(r >= 0 for r in rows)
        self.keep, self.segs = {}, None  # (the stacked path's masks: made by its first projection, `_masks`)
        if self.path == "segmented" and self.active:
            self.segs = segments(self.mapping, self.scale)

    @torch.inference_mode()
    def load(self, slot: int, adapter: Adapter) -> None:
        """The adapter's A and B into `slot` of every layer (its pieces: their rows and columns here)."""
        R = self.config.max_lora_rank
        for key in self.A:
            self.A[key][slot].zero_()
            self.B[key][slot].zero_()
        for (layer, module), (a, b) in adapter.weights.items():  # a [r, in], b [out, r]
            if (layer, module) not in self.where:
                continue  # a layer of another pipeline stage
            key, j, at, piece = self.where[layer, module]
            (c0, c1), (o0, o1), r = piece.cols, piece.rows, adapter.rank
            sh = self.targets[key].by_ranks
            if sh is not None:  # S-LoRA's column layer: this rank's share of the ranks, [q*Rl, (q+1)*Rl)
                Rl = sh.lora_ranks
                mine = a[sh.rank * Rl : min((sh.rank + 1) * Rl, r), c0:c1]  # [<= Rl, in] (none past the rank r)
                self.A[key][slot, j * Rl : j * Rl + mine.shape[0]].copy_(mine)
            else:
                self.A[key][slot, j * R : j * R + r].copy_(a[:, c0:c1])  # [r, in here] into piece j's ranks
            self.B[key][slot, at : at + o1 - o0, j * R : j * R + r].copy_(b[o0:o1])  # its rows, its ranks
        self.scale[slot] = adapter.scale

    def apply(self, step: LoRAStep | None) -> None:
        """A step's adapters as the driver decided them (level 5's ranks): each new one's shard copied into
        its slot, then the mapping; None: the base model alone."""
        if step is None:
            return self.clear()
        for slot, adapter in step.loads:
            self.load(slot, adapter)
        self.set_mapping(step.mapping)


__all__ = ["LoRASlots", "LoRAStep", "Piece", "Shard", "Target", "DELTAS", "whole_targets"]
