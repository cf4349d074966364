"""The LoRA manager: which adapters a step runs, in which slot, on which rows; the host cache; the admission rule.

What it is: `LoRAManager`, what `enable_lora=True` gives an engine (through ladder/rooms.py). It decides;
the device slots (slots.py: every projection's stacked A and B) carry out:

    host cache     up to max_cpu_loras adapters read from disk (adapter.py), least recently used
                   dropped first; a request's adapter is read and checked when it is added, so a
                   bad one is refused then, in one line
    admission      `admits(req, running)`: a request joins the running batch only if the distinct
                   adapters of the running requests and its own are at most max_loras (so every
                   step's adapters fit the slots, and no running request's adapter is ever evicted)
    prepare_step   before each forward: the step's adapters put in slots (a slot whose adapter the
                   step does not need, least recently used, is overwritten), and the mapping [T],
                   each row's slot (-1: the base model)

    step with rows  A A A | B | - | A      (requests on adapters 7, 9, none, 7)
    slots           0: adapter 7   1: adapter 9
    mapping         [0 0 0 1 -1 0]  -> every projection: y = x W^T + delta(x, slots, mapping)

With the model in this process (levels 2-4, level 5 on one rank) the manager owns the slots and fills
them itself. Over ranks (level 5) the slots are the ranks' (each holds its shard of every slot: slots.py
draws it) and the manager keeps only the books: `take_step()` is the step as plain values (the mapping,
and the weights of each adapter newly put in a slot, as read when its request was added), sent with the
step's input, and every rank carries it out: no rank reads a file in a step.

What it is not: used by a draft model, or asynchronous (an adapter is copied into its slot inside the
step that first needs it).

Reference: vLLM `vllm/lora/worker_manager.py` (`LRUCacheWorkerLoRAManager`), `vllm/lora/models.py`
(`LoRAModelManager.activate_adapter`, `set_adapter_mapping`); S-LoRA's unified paging (not built:
here a slot holds the largest rank).
"""

from __future__ import annotations

import time
from collections import OrderedDict

from ladder.metrics import Gauge

from .adapter import Adapter, load_adapter
from .request import LoRAConfig, LoRARequest
from .slots import LoRASlots, LoRAStep


class LoRAManager:
    """One engine's adapters: the host cache, the admission rule, which adapter is in which slot and each
    step's mapping (the module docstring draws them); `slots`: the device slots, or None where the ranks
    hold them (level 5)."""

    def __init__(self, model_config, config: LoRAConfig, dtype, slots: LoRASlots | None = None):
        self.config, self.model_config, self.dtype, self.slots = config, model_config, dtype, slots
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> its slot, least recently used first
        self.host: OrderedDict[int, Adapter] = OrderedDict()  # adapter id -> its weights, LRU first
        self.requests: dict[int, LoRARequest] = {}  # every adapter id ever read -> its request: one id, one folder
        self.step: LoRAStep | None = None  # the last step's, as plain values (take_step)
        self._loads: list[tuple[int, Adapter]] = []  # this step's (slot, adapter) so far
        self.loads = 0  # adapters copied into a slot

    @property
    def path(self) -> str:
        """The delta the projections use (slots.py's DELTAS); over ranks "auto": each rank's default (slots.py's
        `default_path`: the compiled loop on a CPU, the stacked matmuls under S-LoRA's split or on a GPU)."""
        return self.slots.path if self.slots is not None else "auto"

    @path.setter
    def path(self, path: str) -> None:
        if self.slots is None:
            raise ValueError("choosing the LoRA path over ranks is not built (every rank runs its default: 'auto')")
        self.slots.path = path

    # --- requests ---------------------------------------------------------------------------------
    def adapter(self, request) -> Adapter:
        """The request's adapter from host memory, read from disk (and checked) if it is not there. An id
        keeps the folder it was first read from for the engine's life: a slot may still hold its weights
        after the host cache dropped them, so a second folder under the same id would run the first's."""
        known = self.requests.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: lora_int_id={request.lora_int_id} is already "
                             f"{known.lora_path}, not {request.lora_path} (one id, one adapter)")  # fmt: skip
        hit = self.host.get(request.lora_int_id)
        if hit is not None:
            self.host.move_to_end(request.lora_int_id)
            return hit
        adapter = load_adapter(request, self.model_config, self.config.max_lora_rank, self.dtype)
        self.requests[request.lora_int_id] = request
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
        self.step = None
        if self.slots is not None:
            self.slots.clear()

    def prepare_step(self, scheduled: list) -> None:
        """(request, new tokens) per scheduled chunk, in the step's row order -> the mapping, every
        adapter of the step in a slot first (the slots' here, or the step's record for the ranks)."""
        wanted = {r.lora_request.lora_int_id: r.lora_adapter for r, _ in scheduled if r.lora_request is not None}
        self._loads = []
        self.place(wanted)
        rows = [self.slot_of[r.lora_request.lora_int_id] if r.lora_request is not None else -1
                for r, n in scheduled for _ in range(n)]  # fmt: skip
        self.step = LoRAStep(rows, tuple(self._loads))
        if self.slots is not None:
            self.slots.set_mapping(rows)

    def take_step(self) -> LoRAStep | None:
        """The last prepared step (its mapping and its slots' loads), once: what level 5 sends its ranks."""
        step, self.step = self.step, None
        return step

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

    def _load(self, adapter: Adapter, slot: int) -> None:
        """What `place` calls for an adapter not in a slot: its weights into the slot (and into the step's
        record: over ranks, every rank copies its shard of them in)."""
        if self.slots is not None:
            self.slots.load(slot, adapter)
        self._loads.append((slot, adapter))
        self.slot_of[adapter.lora_int_id] = slot
        self.loads += 1


__all__ = ["LoRAManager"]
