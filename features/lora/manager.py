"""The LoRA manager: adapters in device slots and in host memory, the layers that read them, each step's mapping.

What it is: `LoRAManager`, what `enable_lora=True` gives an engine (through ladder/rooms.py):

    install        every q, k, v, o, gate, up and down projection of every layer becomes a
                   LoRALinear (layers.py) reading this manager's slots
    slots          max_loras device slots per projection: A [S, R, in] and B [S, out, R] (R =
                   max_lora_rank, a smaller rank zero-padded; a projection an adapter does not
                   target stays zero) and each slot's scale
    host cache     up to max_cpu_loras adapters read from disk (adapter.py), least recently used
                   dropped first; a request's adapter is read and checked when it is added, so a
                   bad one is refused then, in one line
    admission      `admits(req, running)`: a request joins the running batch only if the distinct
                   adapters of the running requests and its own are at most max_loras (so every
                   step's adapters fit the slots, and no running request's adapter is ever evicted)
    prepare_step   before each forward: the step's adapters put in slots (a slot whose adapter the
                   step does not need, least recently used, is overwritten), and the mapping [T],
                   each row's slot (-1: the base model), set where the layers read it

    step with rows  A A A | B | - | A      (requests on adapters 7, 9, none, 7)
    slots           0: adapter 7   1: adapter 9
    mapping         [0 0 0 1 -1 0]  -> every projection: y = x W^T + delta(x, slots, mapping)

What it is not: tensor-parallel, used by a draft model, or asynchronous (an adapter is copied into
its slot inside the step that first needs it).

Reference: vLLM `vllm/lora/worker_manager.py` (`LRUCacheWorkerLoRAManager`), `vllm/lora/models.py`
(`LoRAModelManager.activate_adapter`, `set_adapter_mapping`); S-LoRA's unified paging (not built:
here a slot holds the largest rank).
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from ladder.metrics import Gauge

from .adapter import TARGETS, Adapter, load_adapter, shapes
from .layers import LoRALinear
from .punica import delta_gathered, delta_loop, delta_segmented, delta_stacked, segments
from .request import LoRAConfig


def delta_triton(x, A, B, scale, idx):
    """Punica's BGMV as two Triton kernels (triton_ops.py), imported on first use: triton is Linux-only,
    and its import chooses the interpreter on a machine without CUDA (slow: a test's, not a CPU's path)."""
    from .triton_ops import delta_triton as kernels

    return kernels(x, A, B, scale, idx)


# the manager's paths. The default is the stacked matmuls everywhere (punica.py says why on a CPU); the kernels are
# opt-in (`llm.llm_engine.lora.path = "triton"`) until a GPU has run them
DELTAS = {"stacked": delta_stacked, "segmented": delta_segmented, "gathered": delta_gathered, "loop": delta_loop,
          "triton": delta_triton}  # fmt: skip


class LoRAManager:
    """One engine's adapters: the device slots every projection reads, the host cache, the admission
    rule, and each step's mapping (the module docstring draws them); `path` picks the delta (DELTAS)."""

    def __init__(self, model, config: LoRAConfig, path: str = "stacked"):
        cfg = model.config
        if cfg.moe is not None:
            raise ValueError("enable_lora with a mixture-of-experts model is not built (its experts' linears)")
        self.config, self.model_config = config, cfg
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        S, R = config.max_loras, config.max_lora_rank
        self.A, self.B = {}, {}  # (layer, module) -> [S, R, in], [S, out, R]
        self.flat = {}  # (layer, module) -> views [in, S*R] of A and [S*R, out] of B: the stacked path's operands
        for layer in range(cfg.num_layers):
            for module, (n_in, n_out) in shapes(cfg).items():
                key = (layer, module)
                self.A[key] = torch.zeros(S, R, n_in, dtype=self.dtype, device=self.device)
                B_flat = torch.zeros(n_out, S * R, dtype=self.dtype, device=self.device)  # B's storage
                self.B[key] = B_flat.view(n_out, S, R).permute(1, 0, 2)  # a view of it: [S, out, R]
                self.flat[key] = (self.A[key].view(S * R, n_in).T, B_flat.T)  # views: a slot's load shows in them
        self.scale = torch.zeros(S, dtype=self.dtype, device=self.device)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> its slot, least recently used first
        self.host: OrderedDict[int, Adapter] = OrderedDict()  # adapter id -> its weights, LRU first
        self.paths: dict[int, str] = {}  # every adapter id ever read -> its folder: one id, one adapter, for good
        self.path = path  # which delta (punica.py, triton_ops.py) the projections use: checked by the setter
        self.mapping: torch.Tensor | None = None  # [T] this step's slot per row
        self.keep: torch.Tensor | None = None  # [T, S*R] the stacked path's: each row's own slot's scale, else 0
        self.segs = None  # the segmented path's: punica.segments(mapping, scale), once per step
        self.active = False  # does this step run any adapter?
        self.loads = 0  # adapters copied into a slot
        self._install(model)

    def _install(self, model) -> None:
        for i, layer in enumerate(model.model.layers):
            for module, parent in TARGETS.items():
                owner = getattr(layer, parent)
                setattr(owner, module, LoRALinear(getattr(owner, module), (i, module), self))

    def add_delta(self, key: tuple[int, str], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [T, out] (the base projection's output) plus this step's delta for x [T, in], by the manager's
        path. The stacked one is three ops (a projection's whole LoRA cost on a CPU, where each op's
        dispatch counts): the shrink, this step's row mask in place (computed once for every
        projection), and the expand added to y in the same call (addmm)."""
        if self.path == "stacked":
            A_flat, B_flat = self.flat[key]  # [in, S*R], [S*R, out]
            return torch.addmm(y, (x @ A_flat).mul_(self.keep), B_flat)  # [T, S*R] -> y + [T, out]
        if self.path == "segmented":  # its segments made once for the step, the delta added into y
            return delta_segmented(x, self.A[key], self.B[key], self.scale, self.mapping, self.segs, out=y)
        return y + DELTAS[self.path](x, self.A[key], self.B[key], self.scale, self.mapping).to(y.dtype)

    @property
    def path(self) -> str:
        return self._path

    @path.setter
    def path(self, path: str) -> None:
        """Refused here, not in the first step's forward: an unknown path, or the Triton kernels on tensors no
        kernel can launch on (a CPU without Triton's interpreter)."""
        if path not in DELTAS:
            raise ValueError(f"LoRA path {path!r}: one of {', '.join(DELTAS)}")
        if path == "triton" and self.device.type != "cuda":
            from . import triton_ops

            if not triton_ops.interpreted():
                raise ValueError("LoRA path 'triton' on a CPU needs Triton's interpreter (TRITON_INTERPRET=1 before "
                                 "triton is first imported); the CPU's paths: stacked, segmented, gathered, loop")  # fmt: skip
        self._path = path

    # --- requests ---------------------------------------------------------------------------------
    def adapter(self, request) -> Adapter:
        """The request's adapter from host memory, read from disk (and checked) if it is not there. An id
        keeps the folder it was first read from for the engine's life: a slot may still hold its weights
        after the host cache dropped them, so a second folder under the same id would run the first's."""
        known = self.paths.get(request.lora_int_id)
        if known is not None and known != request.lora_path:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: lora_int_id={request.lora_int_id} is already "
                             f"{known}, not {request.lora_path} (one id, one adapter)")  # fmt: skip
        hit = self.host.get(request.lora_int_id)
        if hit is not None:
            self.host.move_to_end(request.lora_int_id)
            return hit
        adapter = load_adapter(request, self.model_config, self.config.max_lora_rank, self.dtype)
        self.paths[request.lora_int_id] = request.lora_path
        self.host[request.lora_int_id] = adapter
        while len(self.host) > self.config.max_cpu_loras:
            self.host.popitem(last=False)
        return adapter

    def prepare(self, group: list, i: int) -> None:
        """A request's preparer (level 0's InputProcessor): its adapter read and checked now, so a bad one
        is refused when it is added, never in a step."""
        if group[0].lora_request is not None:
            adapter = self.adapter(group[0].lora_request)
            for seq in group:  # kept with the request: a step never reads a file (the host cache may drop it)
                seq.lora_adapter = adapter

    def admits(self, req, running: list) -> bool:
        """Would the running requests and `req` use at most max_loras distinct adapters?"""
        if req.lora_request is None:
            return True
        ids = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
        return len(ids | {req.lora_request.lora_int_id}) <= self.config.max_loras

    def metrics(self, running: list, waiting: list) -> list:
        """vLLM's `vllm:lora_requests_info`: one gauge whose labels name the adapters of the running and the
        waiting requests (comma-separated) and max_loras; its value is when it was read (a Unix time)."""
        names = [",".join(sorted({r.lora_request.lora_name for r in reqs if r.lora_request is not None}))
                 for reqs in (running, waiting)]  # fmt: skip
        labels = {"max_lora": str(self.config.max_loras), "running_lora_adapters": names[0],
                  "waiting_lora_adapters": names[1]}  # fmt: skip
        return [Gauge("vllm:lora_requests_info", labels, value=time.time())]

    # --- each step ------------------------------------------------------------------------------
    def clear(self) -> None:
        """The next forward runs no adapter (a forward that is not a scheduled step: level 3's beam search)."""
        self.mapping, self.keep, self.segs, self.active = None, None, None, False

    def prepare_step(self, scheduled: list) -> None:
        """(request, new tokens) per scheduled chunk, in the step's row order -> the mapping, every
        adapter of the step in a slot first."""
        wanted = {r.lora_request.lora_int_id: r.lora_adapter for r, _ in scheduled if r.lora_request is not None}
        self.place(wanted)
        rows = [self.slot_of[r.lora_request.lora_int_id] if r.lora_request is not None else -1
                for r, n in scheduled for _ in range(n)]  # fmt: skip
        self.active = bool(wanted)
        self.mapping = torch.tensor(rows, dtype=torch.long, device=self.device)
        if self.path == "stacked" and self.active:
            S, R, on = self.config.max_loras, self.config.max_lora_rank, torch.nonzero(self.mapping >= 0).squeeze(-1)
            keep = torch.zeros(len(rows), S, dtype=self.dtype, device=self.device)
            keep[on, self.mapping[on]] = self.scale[self.mapping[on]]
            self.keep = keep.repeat_interleave(R, dim=1)  # [T, S*R]
        if self.path == "segmented" and self.active:
            self.segs = segments(self.mapping, self.scale)

    def place(self, wanted: dict) -> None:
        """A step's adapters, {id: what `_load` takes}, each put in a slot unless it is in one (the least
        recently used slot the step does not need is overwritten); the admission rule keeps them <= max_loras."""
        if len(wanted) > self.config.max_loras:  # the admission rule makes this impossible
            raise RuntimeError(f"a step with {len(wanted)} adapters and max_loras={self.config.max_loras} (a bug)")
        for lora_id, adapter in wanted.items():
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
            else:
                self._load(adapter, self._free_slot(set(wanted)))

    def _free_slot(self, keep: set[int]) -> int:
        used = set(self.slot_of.values())
        for slot in range(self.config.max_loras):
            if slot not in used:
                return slot
        victim = next(i for i in self.slot_of if i not in keep)  # least recently used that this step does not need
        return self.slot_of.pop(victim)

    @torch.inference_mode()
    def _load(self, adapter: Adapter, slot: int) -> None:
        r = adapter.rank
        for key in self.A:
            self.A[key][slot].zero_()
            self.B[key][slot].zero_()
            if key in adapter.weights:
                a, b = adapter.weights[key]
                self.A[key][slot, :r].copy_(a)  # [r, in] into [R, in]
                self.B[key][slot, :, :r].copy_(b)  # [out, r] into [out, R]
        self.scale[slot] = adapter.scale
        self.slot_of[adapter.lora_int_id] = slot
        self.loads += 1


__all__ = ["LoRAManager"]
