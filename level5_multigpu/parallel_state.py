"""Who is who among the ranks, their process groups, and every message they exchange, counted.

What it is: `Topology` (rank r is pipeline stage r // tp, tensor-parallel rank r % tp) and
`Comm`, one rank's view of torch.distributed: its TP group (the ranks of its stage) and
the point-to-point neighbours of the pipeline, with the few collectives the model needs:

    all_reduce(x)          sum over the TP group (RowParallelLinear, VocabParallelEmbedding)
    gather_to_first(x)     vocabulary shards of the logits -> TP rank 0 of the last stage
    broadcast_object(o)    the step's ModelInput, from TP rank 0 to its stage
    send / recv            hidden states (and the ModelInput) to the next stage; logits to the driver

    world 4, tp 2, pp 2:     stage 0: ranks 0 1  (TP group {0, 1})   rank 0 is the driver
                             stage 1: ranks 2 3  (TP group {2, 3})   rank 2 sends the logits back
                             pipeline pairs: 0 -> 2, 1 -> 3

Every call goes through `CommStats`: calls, bytes and seconds per kind of message, so the
engine can report what a token costs in communication, and `alpha_beta()` fits the
latency-bandwidth model t = alpha + beta * bytes to this machine's all-reduce and send.

Under `torch.compile` (a rank compiling its shard: features/compilation) the all-reduce inside the
model is one opaque op, `torch.ops.ladder.all_reduce(x, comm, kind)`, as attention is: Dynamo
cannot trace a process group, a clock or the counters, so the graph sees a call with a fake
implementation ("a tensor like x") and the real one runs this class's all-reduce, timed and
counted as in eager. The Comm is named by a string (a graph's arguments are tensors and plain
values), looked up in a table of the live ones. vLLM does the same (`torch.ops.vllm.all_reduce`).

What it is not: a general collective library (no reduce-scatter, no sequence parallelism,
no overlap of communication with compute).

Reference: Megatron-LM `parallel_state.py`; vLLM `distributed/parallel_state.py`.
"""

from __future__ import annotations

import datetime
import itertools
import os
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    tp: int
    pp: int
    rank: int

    @property
    def world(self) -> int:
        return self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp + tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


@dataclass
class CommStats:
    """kind -> [calls, bytes, seconds], a handful of keys whatever the run length; and, only while
    `record` is a list (a benchmark sets it, `RankWorker.record_calls`), every call's (kind, seconds)
    in order, so that ranks can be compared call by call."""

    by_kind: dict[str, list[float]] = field(default_factory=dict)
    record: list[tuple[str, float]] | None = None
    pending: list = field(default_factory=list, repr=False)  # on a GPU: (kind, bytes, start, end) events not read yet

    def add(self, kind: str, nbytes: int, seconds: float) -> None:
        entry = self.by_kind.setdefault(kind, [0, 0, 0.0])
        entry[0] += 1
        entry[1] += nbytes
        entry[2] += seconds
        if self.record is not None:
            self.record.append((kind, seconds))

    def settle(self) -> CommStats:
        """Read the CUDA events of the calls timed on the device (`Comm._timed`), waiting only for the
        last; what reads the counters calls this first. Returns self."""
        for kind, nbytes, start, end in self.pending:
            end.synchronize()
            self.add(kind, nbytes, start.elapsed_time(end) / 1e3)  # milliseconds -> seconds
        self.pending.clear()
        return self

    @property
    def calls(self) -> int:
        return int(sum(v[0] for v in self.by_kind.values()))

    @property
    def bytes(self) -> int:
        return int(sum(v[1] for v in self.by_kind.values()))

    @property
    def seconds(self) -> float:
        return sum(v[2] for v in self.by_kind.values())


def counters(stats: dict, kinds) -> dict[str, dict[int, list]]:
    """`comm_stats()`'s answer -> kind -> rank -> [calls, bytes, seconds], copied (rank 0's are live
    objects, so a reading taken before a run would otherwise move with it)."""
    return {k: {r: list(s.by_kind.get(k, [0, 0, 0.0])) for r, (s, _) in stats.items()} for k in kinds}


def waited(records: list[list[tuple[str, float]]], kind: str) -> tuple[float, float]:
    """Every rank's record of one group's calls (the same calls, in the same order on each rank) ->
    (seconds of `kind` the ranks spent on the wire, seconds they spent waiting for a peer), per rank.

    A collective ends for everyone together, so the rank that arrives last spends only the transfer
    inside it; the others also wait for it (load imbalance: one rank's experts got more rows). Per
    call, the least time any rank spent in it is the transfer; the mean less that is the waiting.
    The records must be of one group (one pipeline stage's TP ranks); unequal counts raise."""
    per_call = list(zip(*[[s for k, s in r if k == kind] for r in records], strict=True))
    wire = sum(min(c) for c in per_call)
    mean = sum(sum(c) / len(c) for c in per_call)
    return wire, mean - wire


def sync(device: torch.device) -> None:
    """Wait for `device`'s queued work (a CUDA stream runs behind the host); nothing to wait for on a CPU.
    Only where a measurement is the point (the calibration): it costs a GPU its overlap of host and device."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_COMMS: weakref.WeakValueDictionary[str, Comm] = weakref.WeakValueDictionary()  # name -> a live Comm (the op's)
_NAMES = itertools.count()


def all_reduce_real(x: torch.Tensor, comm: str, kind: str) -> torch.Tensor:
    """`ladder.all_reduce`, run when the compiled code reaches it: the named Comm's all-reduce of a copy
    of x (an op's output must not be its input)."""
    return _COMMS[comm].all_reduce(x.clone(), kind)


def all_reduce_fake(x: torch.Tensor, comm: str, kind: str) -> torch.Tensor:
    """What Dynamo and Inductor run while tracing: a sum over ranks has x's shape, dtype and device."""
    return torch.empty_like(x)


all_reduce_op = torch.library.custom_op("ladder::all_reduce", all_reduce_real, mutates_args=())
all_reduce_op.register_fake(all_reduce_fake)


class Comm:
    def __init__(self, topo: Topology, fixed_order: bool = False):
        """`fixed_order` (batch_invariant=True): an all-reduce sums the ranks' parts in rank order."""
        self.topo, self.fixed_order = topo, fixed_order
        self.name = f"comm{next(_NAMES)}"  # what a compiled graph calls this Comm's all-reduce by
        _COMMS[self.name] = self
        self.device = torch.device("cpu")  # the rank's tensors' device; build_rank sets it
        self.stats = CommStats()
        # Every rank creates every group, in the same order (torch.distributed requires it).
        self.tp_group = None
        for stage in range(topo.pp):
            ranks = [topo.rank_of(stage, t) for t in range(topo.tp)]
            group = dist.new_group(ranks) if topo.world > 1 else None
            if stage == topo.pp_rank:
                self.tp_group, self.tp_src = group, ranks[0]

    def _timed(self, kind: str, nbytes: int, fn):
        if self.device.type == "cuda":
            # An NCCL call returns once queued, so the host's clock would time the queueing. Two events on
            # the device's own clock time the call; they are read when the counters are (`settle`), so
            # the host never stops here and keeps running ahead of the GPU.
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self.stats.pending.append((kind, nbytes, start, end))
            return out
        t0 = time.perf_counter()
        out = fn()
        self.stats.add(kind, nbytes, time.perf_counter() - t0)
        return out

    # --- tensor parallelism: within a stage ----------------------------------------------------
    def all_reduce(self, x: torch.Tensor, kind: str = "all_reduce") -> torch.Tensor:
        """The sum of every TP rank's x, on every TP rank (counted under `kind`: a mixture of experts'
        is "moe_all_reduce", so its share of the traffic can be read apart from attention's).

        A library's all-reduce adds the parts in an order it picks by message size (gloo's
        ring cuts the tensor into one chunk per rank), so with three or more ranks a row's
        sum can depend on how many rows the message has. With `fixed_order`, and more than
        two ranks, every rank gathers all the parts and adds them in rank order (two parts
        add the same either way: a + b == b + a).

        Traced by Dynamo, it is the opaque op (module docstring), which returns the sum in a new
        tensor: use the returned tensor, not x."""
        if self.topo.tp > 1 and torch.compiler.is_compiling():
            return torch.ops.ladder.all_reduce(x, self.name, kind)
        if self.topo.tp > 2 and self.fixed_order:
            parts = [torch.empty_like(x) for _ in range(self.topo.tp)]
            self._timed("all_gather", _nbytes(x), lambda: dist.all_gather(parts, x.contiguous(), group=self.tp_group))
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            x.copy_(total)
        elif self.topo.tp > 1:
            self._timed(kind, _nbytes(x), lambda: dist.all_reduce(x, group=self.tp_group))
        return x

    # --- expert parallelism: tokens to their experts' ranks and back (features/moe/parallel.py) -
    def exchange_counts(self, counts: list[int]) -> list[int]:
        """Tell each TP rank q how many rows it will get from this one (counts[q]); returns how many
        this rank gets from each. (The all-to-all of the rows needs the sizes before it starts.)"""
        send = [torch.tensor([c], dtype=torch.int64) for c in counts]
        recv = [torch.empty(1, dtype=torch.int64) for _ in counts]
        self._timed("all_to_all_counts", 8 * (len(counts) - 1), lambda: dist.all_to_all(recv, send, group=self.tp_group))
        return [int(t) for t in recv]

    def all_to_all(self, parts: list[torch.Tensor], recv_rows: list[int]) -> torch.Tensor:
        """Send parts[q] to TP rank q; receive recv_rows[q] rows from each; return them concatenated in
        rank order. Counted: the bytes sent to other ranks (a rank's own part never leaves it)."""
        me, x = self.topo.tp_rank, torch.cat(parts)  # one buffer, split by destination (sizes may differ, or be 0)
        out = torch.empty((sum(recv_rows), *x.shape[1:]), dtype=x.dtype, device=x.device)
        sent = sum(_nbytes(p) for q, p in enumerate(parts) if q != me)
        self._timed("all_to_all", sent, lambda: dist.all_to_all_single(
            out, x, output_split_sizes=recv_rows, input_split_sizes=[len(p) for p in parts], group=self.tp_group))
        return out

    def all_gather_rows(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every TP rank's rows (sizes[q] of them from rank q), concatenated in rank order, on every rank.
        gloo gathers equal sizes, so each slice travels padded to the largest."""
        buf = torch.zeros((max(sizes), *x.shape[1:]), dtype=x.dtype, device=x.device)
        buf[: x.shape[0]] = x
        parts = [torch.empty_like(buf) for _ in sizes]
        self._timed("all_gather", _nbytes(buf) * (len(sizes) - 1),
                    lambda: dist.all_gather(parts, buf, group=self.tp_group))  # fmt: skip
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every TP rank's x [N, d_i] along the last dim on TP rank 0; others get None."""
        if self.topo.tp == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.topo.tp)] if self.topo.tp_rank == 0 else None
        self._timed("gather", _nbytes(x), lambda: dist.gather(x, parts, dst=self.tp_src, group=self.tp_group))
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_object(self, obj=None):
        """TP rank 0 of this stage sends obj (a pickled ModelInput) to the others of its stage."""
        if self.topo.tp == 1:
            return obj
        box = [obj]
        self._timed(
            "broadcast_object", 0, lambda: dist.broadcast_object_list(box, src=self.tp_src, group=self.tp_group)
        )
        return box[0]

    # --- pipeline parallelism: between stages -----------------------------------------------------
    def recv(self, shape, dtype, src: int, device) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=device)
        self._timed("recv", _nbytes(x), lambda: dist.recv(x, src=src))
        return x


def check_gpus(device: torch.device, world: int, oversubscribe: bool, executor: str | None = None) -> None:
    """One GPU per rank on this machine, or a one-line error before any rank starts. (Several ranks on one
    GPU work only with gloo, and slowly: `oversubscribe_gpus=True` asks for it, in tests; NCCL refuses it.)
    Ray places its actors on the cluster's GPUs, wherever they are: not this machine's to count."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # torchrun: the ranks of this machine
    if executor == "ray" or device.type != "cuda" or oversubscribe:
        return
    if local > (n := torch.cuda.device_count()):
        raise ValueError(f"{local} ranks (tensor_parallel_size x pipeline_parallel_size) need {local} GPUs, but "
                         f"{n} are visible: use fewer ranks, or oversubscribe_gpus=True to share them (tests)")  # fmt: skip


def local_gpu(topo: Topology) -> int:
    """This rank's GPU on its machine: torchrun's LOCAL_RANK, else (one machine) the rank. It wraps
    round the visible GPUs only when `check_gpus` was told to allow it."""
    return int(os.environ.get("LOCAL_RANK", topo.rank)) % max(torch.cuda.device_count(), 1)


def init_process_group(backend: str, init_method: str, topo: Topology, timeout_s: float) -> None:
    if backend == "nccl":
        # NCCL moves only CUDA tensors; the pickled messages and the calibration live on the CPU,
        # so they take gloo: one group, a backend per device type. And each rank's own GPU
        # first, or NCCL's objects all land on cuda:0. (Written, not run: no GPU was at hand.)
        torch.cuda.set_device(local_gpu(topo))
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, init_method=init_method, rank=topo.rank, world_size=topo.world,
                            timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip


def alpha_beta(comm: Comm, sizes=(1, 256, 4096, 65536, 262144), repeats: int = 50,
               kind: str = "all_reduce") -> dict[str, float]:  # fmt: skip
    """Fit t = alpha + beta * bytes to this group's `kind` of message (all_reduce, all_to_all, its
    list form all_to_all_counts, or all_gather) over a few sizes (every rank of the TP group must call
    it together), its bytes counted as `Comm.stats` counts them. Returns seconds and seconds per byte.

    Each call is timed alone and, as `waited` reads a real run, its time is the least any rank spent
    in it (the last to arrive waited for no one); per size, the mean over `repeats` calls, since a
    run's total is a sum of calls, their slow ones included (on a shared 2-core machine a gloo
    call's median is a third of its mean). The sizes take turns, so a slow minute spreads over all."""
    tp, g, dev = comm.topo.tp, comm.tp_group, comm.device  # the model's tensors' device: NCCL's, on GPUs
    calls, xs, measured = [], [], []
    for n in sizes:
        n = max(n // tp, 1) * tp if kind.startswith("all_to_all") else n  # all_to_all: equal parts
        measured.append(n)
        x = torch.ones(n, dtype=torch.float32, device=dev)
        parts = [torch.empty(n, dtype=torch.float32, device=dev) for _ in range(tp)]
        ins, outs = list(x.chunk(tp)), [torch.empty(n // tp, device=dev) for _ in range(tp)]
        run, nbytes = {  # what one call does, and the bytes Comm counts for it
            "all_reduce": (lambda x=x: dist.all_reduce(x, group=g), 4.0 * n),
            "all_to_all": (lambda x=x, o=parts[0]: dist.all_to_all_single(o, x, group=g), 4.0 * n * (tp - 1) / tp),
            "all_to_all_counts": (lambda i=ins, o=outs: dist.all_to_all(o, i, group=g), 4.0 * n * (tp - 1) / tp),
            "all_gather": (lambda x=x, o=parts: dist.all_gather(o, x, group=g), 4.0 * n * (tp - 1)),
        }[kind]
        run()  # warm up this size
        calls.append(run)
        xs.append(nbytes)
    mine = torch.empty(repeats, len(sizes), dtype=torch.float64)
    for i in range(repeats):
        for j, run in enumerate(calls):
            sync(dev)
            t0 = time.perf_counter()
            run()
            sync(dev)  # the call returned once queued; it is done when the device says so
            mine[i, j] = time.perf_counter() - t0
    everyone = [torch.empty_like(mine) for _ in range(tp)]
    dist.all_gather(everyone, mine, group=g)
    ts = torch.stack(everyone).amin(0).mean(0).tolist()  # [sizes]: per call the least, then the mean
    return fit_alpha_beta(measured, xs, ts)


def fit_alpha_beta(sizes, xs: list[float], ts: list[float]) -> dict:
    """t = alpha + beta * bytes through the measured (bytes, seconds) pairs, by least squares on the
    *relative* error: plain least squares would fit the largest message and leave a one-number
    message, whose cost is all alpha, wrong by a factor. Neither may be negative."""
    w = [1.0 / t**2 for t in ts]  # minimise sum w (alpha + beta x - t)^2
    s1, sx, sxx = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * x * x for wi, x in zip(w, xs))
    st, sxt = sum(wi * t for wi, t in zip(w, ts)), sum(wi * x * t for wi, x, t in zip(w, xs, ts))
    spread = s1 * sxx - sx * sx  # 0 when every message had one size (the row counts): no slope to fit
    beta = max((s1 * sxt - sx * st) / spread, 0.0) if spread > 1e-12 * s1 * sxx else 0.0
    alpha = (st - beta * sx) / s1
    if alpha < 0:  # refit the slope alone through the origin
        alpha, beta = 0.0, sxt / sxx
    return {"alpha_s": alpha, "beta_s_per_byte": beta, "sizes": list(sizes), "times_s": ts}


def predicted_seconds(fit: dict, calls: int, nbytes: int) -> float:
    """What the latency-bandwidth model says `calls` messages of `nbytes` in all should take."""
    return calls * fit["alpha_s"] + nbytes * fit["beta_s_per_byte"]
