"""A rank: what every process of a tp x pp layout builds, and the loop a worker rank runs.

What it is: `ParallelSpec`, the plain values every rank needs (sent to each process once);
`build_rank`, which loads this rank's shard and sizes its KV cache (every rank agrees on
the fewest blocks any of them can hold); `RankWorker`, level 1's `Worker` over this rank's
`StageModel`; and `serve`, the loop of every rank but the driver:

    loop:  msg = receive()                      (stage 0: the driver's broadcast; stage s: from stage s-1)
           pass msg on to stage s+1             (isend, before running it: the next stage can start listening)
           Execute(mi, mb)      -> forward: hidden states on to stage s+1, or the logits to rank 0
           CollectiveRPC(m, a)  -> worker.m(*a), the answer to rank 0
           Shutdown()           -> return

`rank_main` is a spawned (or torchrun-started) process's entry point: it joins the process
group, builds its rank and serves until told to stop.

What it is not: the driver (rank 0: `executor.py`), or how the messages travel (`transport.py`).

Reference: vLLM `v1/executor/multiproc_executor.py` (`WorkerProc.worker_busy_loop`) and
`v1/worker/gpu_worker.py`.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ladder import rooms
from ladder.models import resolve_path
from level0_naive.config import CacheConfig, EngineConfig, resolve_kv_budget
from level0_naive.loader import model_config_from_hf
from level1_paged.block_table import blocks_in_budget
from level1_paged.model_input import ModelInput
from level1_paged.worker import Worker

from .layers import ShardReader
from .model import StageModel, kv_bytes_per_token_of_rank, partition_layers
from .parallel_state import Comm, CommStats, Topology, alpha_beta, init_process_group, local_gpu
from .transport import CollectiveRPC, Execute, Shutdown, echo, isend_object, isend_tensor, p2p_alpha_beta, receive


@dataclass(frozen=True, kw_only=True)
class ParallelSpec:
    """What every rank needs to build its part: plain values, sent to each process once."""

    model: str  # the checkpoint's directory
    dtype: torch.dtype
    device_type: str  # "cpu" | "cuda"
    tp: int
    pp: int
    partition: list[int] | None  # layers per stage (None: as even as possible)
    block_size: int
    attention_backend: str
    ops: str  # level 0's `ops=` (ladder/rooms.py), resolved on each rank
    batch_invariant: bool  # fixed-order ops, attention and all-reduce on every rank
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    backend: str  # "gloo" | "nccl"
    timeout_s: float
    extra_bytes_rank0: int = 0  # the draft model's KV, which lives with the driver
    ranks_started_by: str = "mp"  # "mp" | "torchrun" | "ray"
    expert_parallel: bool = False  # MoE layers: whole experts per rank, tokens sent to them (features/moe)
    lora: tuple[int, int, int, bool] | None = None  # enable_lora: (max_loras, max_lora_rank, max_cpu_loras,
    # fully_sharded_loras) (features/lora)
    quantization: str | None = None  # each rank's projections quantized after loading (features/quantization)
    kv_cache_dtype: str = "auto"  # each rank's cache in 8 bits (level 1's setting, the same room)
    calculate_kv_scales: bool = False
    compilation: object = None  # a CompilationConfig that compiles (features/compilation): each rank its shard

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        model: str,
        dtype: torch.dtype,
        device_type: str,
        extra_bytes_rank0: int = 0,
        compilation: object = None,
    ) -> ParallelSpec:
        """An engine's config, plus what the engine resolved: the checkpoint's path, the dtype, the device,
        the compilation (level 1's `compilation_for`: None runs eager)."""
        par, cache, lora = config.parallel, config.cache, config.lora
        backend = par.distributed_backend
        if backend == "auto":  # several ranks on one GPU (oversubscribed): NCCL refuses them, gloo does not
            backend = "nccl" if device_type == "cuda" and not par.oversubscribe_gpus else "gloo"
        return cls(
            model=model,
            dtype=dtype,
            device_type=device_type,
            tp=par.tensor_parallel_size,
            pp=par.pipeline_parallel_size,
            partition=par.pipeline_partition,
            block_size=cache.block_size,
            attention_backend=cache.attention_backend,
            ops=config.model.ops,
            batch_invariant=config.model.batch_invariant,
            kv_cache_memory=cache.kv_cache_memory,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            backend=backend,
            timeout_s=par.distributed_timeout_s,
            extra_bytes_rank0=extra_bytes_rank0,
            ranks_started_by=par.distributed_executor_backend or "mp",
            expert_parallel=par.enable_expert_parallel,
            lora=(lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras, lora.fully_sharded_loras)
            if lora.enable_lora else None,
            quantization=config.model.quantization,
            kv_cache_dtype=cache.kv_cache_dtype,
            calculate_kv_scales=cache.calculate_kv_scales,
            compilation=compilation,
        )


@dataclass
class Timeline:
    """(micro-batch, start, end) of this rank's last forwards: bounded."""

    events: deque = field(default_factory=lambda: deque(maxlen=512))


class RankWorker(Worker):
    """Level 1's Worker over this rank's `StageModel`: its layers, its heads, its KV cache; with
    enable_lora, its shard of every adapter slot (`lora`: the room's, which carries out the step's
    `lora_step`, the driver's decision, before each forward). Its methods are what `collective_rpc`
    can call on every rank.

    With `compilation` (features/compilation) the rank compiles its shard: its runner is the room's
    compiled one, whose start-up compile runs here, on every rank of a stage alike (the warm-up's
    forwards all-reduce: every TP rank must run the same ones). A later stage's input, the previous
    stage's hidden states, is the graph's per-token input beside the tokens (`StageModel.step_inputs`)."""

    def __init__(self, model: StageModel, comm: Comm, num_blocks: int, block_size: int, attention_backend: str,
                 batch_invariant: bool = False, lora=None, kv_cache_dtype: str = "auto", calculate_kv_scales: bool = False,
                 compilation=None):  # fmt: skip
        super().__init__(model, num_blocks, block_size, attention_backend, batch_invariant, compilation, kv_cache_dtype,
                         calculate_kv_scales)  # fmt: skip
        self.comm, self.lora = comm, lora
        self.timeline = Timeline()

    @torch.inference_mode()
    def execute(self, model_input: ModelInput, hidden: torch.Tensor | None = None, mb: int = 0) -> torch.Tensor | None:
        """Hidden states [T, d] for the next stage; on the last stage the logits [S, V] (TP rank 0) or None."""
        t0 = time.perf_counter()
        if self.lora is not None:  # the driver's adapters for this step (an input without any: the base model)
            self.lora.apply(getattr(model_input, "lora_step", None))
        mi = model_input.to(self.device)
        attn = mi.attention_backend(self.cache, self.impl, self.scale)
        self.model.hidden_in = hidden  # a later stage's input (None on stage 0)
        compiled = getattr(self.runner, "hidden_states", None)  # the compiled runner's graph (None: level 0's, eager)
        if compiled is not None:
            out = compiled(mi.input_ids, mi.positions, attn)
        else:
            out = self.model(mi.input_ids, mi.positions, attn, hidden)
        self.model.hidden_in = None
        if self.model.last:
            if self.runner.keep_hidden:  # (level 4's EAGLE head, on the driver: the last stage's hidden states)
                self.runner.hidden = out
            out = self.model.compute_logits(out[mi.logits_indices])
        self.timeline.events.append((mb, t0, time.perf_counter()))
        return out

    def compilation_state(self) -> tuple[str | None, int, int, int] | None:
        """(why this rank runs eager after all, or None; graphs; pieces; steps run through them) of its compiled
        runner; None: eager."""
        r = self.runner
        backend = getattr(r, "backend", None)
        return None if backend is None else (r.eager_reason, backend.counters.graphs, backend.counters.pieces, r.compiled_steps)

    def stats(self) -> tuple[CommStats, list]:
        """This rank's message counters and forward timeline."""
        return self.comm.stats.settle(), list(self.timeline.events)

    def record_calls(self, on: bool) -> list[tuple[str, float]]:
        """Start (on) or stop recording every message's (kind, seconds); returns what was recorded."""
        self.comm.stats.settle()  # the calls timed on the device join the record first
        done, self.comm.stats.record = self.comm.stats.record or [], [] if on else None
        return done

    def calibrate(self) -> dict:
        """Every rank's part of measuring alpha and beta: stage 0's collectives (TP, and EP's), rank 0
        and stage 1's first rank do round trips (PP). Rank 0's answer holds the numbers."""
        topo, out = self.comm.topo, {}
        if topo.tp > 1 and topo.is_first_stage:
            for kind in ("all_reduce", "all_to_all", "all_to_all_counts", "all_gather"):  # the last three: EP's
                out[kind] = alpha_beta(self.comm, kind=kind)
        if topo.pp > 1 and topo.rank == 0:
            out["p2p"] = p2p_alpha_beta(self.comm, topo.rank_of(1, 0))
        elif topo.pp_rank == 1 and topo.tp_rank == 0:
            echo(0, device=self.comm.device)
        return out


def build_rank(spec: ParallelSpec, comm: Comm) -> RankWorker:
    """Load this rank's shard, agree on the block count (the fewest any rank can hold), allocate its cache."""
    topo = comm.topo
    device = torch.device(f"cuda:{local_gpu(topo)}" if spec.device_type == "cuda" else "cpu")
    comm.device = device  # its timings wait for this device, its calibration sends this device's tensors
    path = resolve_path(spec.model)
    cfg = model_config_from_hf(json.loads((path / "config.json").read_text()))
    layers = partition_layers(cfg.num_layers, spec.pp, spec.partition)[topo.pp_rank]
    ops = rooms.ops(spec.ops, spec.batch_invariant, device, spec.dtype)
    stage = StageModel(cfg, ShardReader(path, spec.dtype, device), comm, layers, ops, spec.expert_parallel)
    rooms.quantize(stage, spec.quantization)  # its shards, as a whole model's weights are (int4's groups: of its shard)
    head_bytes = rooms.kv_head_bytes(spec.kv_cache_dtype, cfg.head_dim)  # an 8-bit cache's (None: the dtype's)
    per_token = kv_bytes_per_token_of_rank(cfg, spec.tp, topo.tp_rank, len(layers), spec.dtype, head_bytes)
    per_token += spec.extra_bytes_rank0 if topo.rank == 0 else 0
    budget = resolve_kv_budget(CacheConfig(spec.kv_cache_memory, spec.gpu_memory_utilization), device)
    capacity = torch.tensor([blocks_in_budget(budget, spec.block_size, per_token)], dtype=torch.int64, device=device)
    if topo.world > 1:
        dist.all_reduce(capacity, op=dist.ReduceOp.MIN)
    num_blocks = int(capacity.item())
    if num_blocks < 1:
        raise ValueError(f"the KV budget of some rank holds no block of {spec.block_size} tokens")
    lora = None if spec.lora is None else rooms.lora_slots(stage, *spec.lora)  # every adapted layer's shard of the slots
    worker = RankWorker(stage, comm, num_blocks, spec.block_size, spec.attention_backend, spec.batch_invariant, lora,
                        spec.kv_cache_dtype, spec.calculate_kv_scales, spec.compilation)  # fmt: skip
    comm.stats = CommStats()  # the counters start with the engine's traffic (a compile's warm-up all-reduces)
    return worker


# --- a worker rank's life ---------------------------------------------------------------------------
def serve(worker: RankWorker, comm: Comm, spec: ParallelSpec) -> None:
    """Receive messages in order, pass them on, run them; return on `Shutdown`."""
    topo, pending = comm.topo, []
    prev = topo.rank_of(topo.pp_rank - 1, topo.tp_rank) if not topo.is_first_stage else None
    nxt = topo.rank_of(topo.pp_rank + 1, topo.tp_rank) if not topo.is_last_stage else None
    hidden_size = worker.model.full_config.hidden_size
    while True:
        # Last message's sends are done once their receivers took them; gloo reports a send's
        # completion only through wait(), and the receivers always get to them (stages run in order).
        for work, _ in pending:
            work.wait()
        pending = []
        msg = receive(comm)
        if nxt is not None:
            pending += isend_object(comm, msg, nxt)
        match msg:
            case Execute(model_input=mi, mb=mb):
                shape = (len(mi.input_ids), hidden_size)
                hidden = None if prev is None else comm.recv(shape, spec.dtype, prev, worker.device)
                out = worker.execute(mi, hidden, mb)
                if nxt is not None:
                    pending += isend_tensor(comm, out, nxt)
                elif topo.tp_rank == 0:
                    pending += isend_tensor(comm, out, 0)
            case CollectiveRPC(method=method, args=args):
                pending += isend_object(comm, getattr(worker, method)(*args), 0)
            case Shutdown():
                for work, _ in pending:
                    work.wait()
                return
            case _:
                raise TypeError(f"rank {topo.rank} got a message it does not know: {msg!r}")


def rank_main(rank: int, spec: ParallelSpec, init_method: str, started=None) -> None:
    """Entry point of a worker process; `started` (a pipe's end) tells the driver it got this far."""
    if started is not None:
        started.send(rank)
        started.close()
    torch.set_num_threads(1)  # one thread per rank: ranks share the cores
    topo = Topology(spec.tp, spec.pp, rank)
    init_process_group(spec.backend, init_method, topo, spec.timeout_s)
    try:
        comm = Comm(topo, fixed_order=spec.batch_invariant)
        worker = build_rank(spec, comm)
        serve(worker, comm, spec)
    except Exception:  # the driver sees the closed connection; this says why
        traceback.print_exc()
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
