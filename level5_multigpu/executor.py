"""The executor: one driver, one worker per rank, and the messages between them.

What it is: `Executor`, what level 2's engine calls instead of a `Worker`. The driver
process is rank 0: it runs the scheduler, the KV manager, sampling and every request's
generator, and it is also the worker of stage 0, TP rank 0. The other ranks are
processes (spawned here with `mp`, or started by `torchrun`) that run `serve()`:

    driver (rank 0)                       stage 0, rank 1              stage 1, ranks 2, 3
    schedule, prepare ModelInput
    broadcast it to stage 0 ──────────>   receive it
    isend it to stage 1 ────────────────────────────────────────────>  receive it
    stage-0 forward (TP all-reduces) <──> stage-0 forward
    isend hidden [T, d] ───────────────────────────────────────────>   stage-1 forward (TP all-reduces)
                                          isend hidden (rank 1 -> 3) >  rank 2 gathers the logits
    ... schedule the next micro-batch ...                              isend logits [S, V] -> rank 0
    collect: recv logits <─────────────────────────────────────────────
    sample, update (only the driver knows about requests)

Sends are `isend`: gloo's `send` waits for the receiver, and a pipeline whose stages
each wait to hand over their result would deadlock. Each stage handles micro-batches in
the order they were submitted, which is also why a block freed by an abort can be
reused at once: any later write to it comes later on every stage.

With pipeline_parallel_size = p the engine keeps p micro-batches in flight (`submit`
several, then `collect` the oldest), so while stage 1 runs micro-batch A, stage 0 runs
B. Every rank times its forwards (a ring buffer: the demo's pipeline picture) and
counts its messages (`CommStats`).

A rank that dies makes the driver raise, naming it, within `distributed_timeout_s`
(gloo notices a closed connection at once; a hung rank is caught by the timeout); the
driver's exit, in turn, closes every connection, so no worker outlives it. A rank that
dies before it starts (spawn runs the user's main module again in every new process, and
a script without `if __name__ == "__main__":` builds its engine there) is caught by a
start-up handshake instead, and the error names the guard.

What it is not: Ray, or a multi-node launcher of its own: across machines every rank is
started by `torchrun` (see docs/level5_multigpu.md for the commands).

Reference: vLLM `v1/executor/multiproc_executor.py` and `v1/worker/gpu_worker.py`.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
import pickle
import socket
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ladder.models import resolve_path
from level0_naive.config import EngineConfig, resolve_kv_budget
from level0_naive.loader import model_config_from_hf
from level1_paged.paged_cache import PagedAttention
from level1_paged.worker import ModelInput, Worker

from .layers import ShardReader
from .model import StageModel, kv_bytes_per_token_of_rank, partition_layers
from .parallel_state import Comm, CommStats, Topology, alpha_beta, fit_alpha_beta, init_process_group, local_gpu


@dataclass
class ParallelSpec:
    """What every rank needs to build its part: plain values, sent to each process once."""

    model: str
    dtype: torch.dtype
    device_type: str  # "cpu" | "cuda"
    tp: int
    pp: int
    partition: list[int] | None
    block_size: int
    attention_backend: str
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    backend: str  # "gloo" | "nccl"
    timeout_s: float
    extra_bytes_rank0: int = 0  # the draft model's KV, which lives with the driver
    ranks_started_by: str = "mp"  # "mp" | "torchrun"


@dataclass
class Timeline:
    """(micro-batch, start, end) of this rank's last forwards: bounded."""

    events: deque = field(default_factory=lambda: deque(maxlen=512))


class RankWorker(Worker):
    """Level 1's Worker over this rank's `StageModel`: its layers, its heads, its KV cache."""

    def __init__(self, model: StageModel, num_blocks: int, block_size: int, attention_backend: str):
        super().__init__(model, num_blocks, block_size, attention_backend)
        self.timeline = Timeline()

    @torch.inference_mode()
    def execute(self, model_input: ModelInput, hidden: torch.Tensor | None = None, mb: int = 0) -> torch.Tensor | None:
        """Hidden states [T, d] for the next stage; on the last stage the logits [S, V] (TP rank 0) or None."""
        t0 = time.perf_counter()
        mi = model_input.to(self.device)
        out = self.model(
            mi.input_ids, mi.positions, PagedAttention(self.cache, mi, self.impl, self.scale), hidden=hidden
        )
        if self.model.last:
            out = self.model.compute_logits(out[mi.logits_indices])
        self.timeline.events.append((mb, t0, time.perf_counter()))
        return out


def build_rank(spec: ParallelSpec, comm: Comm) -> tuple[RankWorker, int]:
    """Load this rank's shard, agree on the block count (the fewest any rank can hold), allocate its cache."""
    topo = comm.topo
    device = torch.device(f"cuda:{local_gpu(topo)}" if spec.device_type == "cuda" else "cpu")
    path = resolve_path(spec.model)
    cfg = model_config_from_hf(json.loads((path / "config.json").read_text()))
    layers = partition_layers(cfg.num_layers, spec.pp, spec.partition)[topo.pp_rank]
    stage = StageModel(cfg, ShardReader(path, spec.dtype, device), comm, layers)
    per_token = kv_bytes_per_token_of_rank(cfg, spec.tp, topo.tp_rank, len(layers), spec.dtype)
    per_token += spec.extra_bytes_rank0 if topo.rank == 0 else 0
    budget = resolve_kv_budget(EngineConfig(spec.model, kv_cache_memory=spec.kv_cache_memory,
                                            gpu_memory_utilization=spec.gpu_memory_utilization), device)  # fmt: skip
    capacity = torch.tensor([budget // (spec.block_size * per_token)], dtype=torch.int64, device=device)
    if topo.world > 1:
        dist.all_reduce(capacity, op=dist.ReduceOp.MIN)
    num_blocks = int(capacity.item())
    if num_blocks < 1:
        raise ValueError(f"the KV budget of some rank holds no block of {spec.block_size} tokens")
    return RankWorker(stage, num_blocks, spec.block_size, spec.attention_backend), num_blocks


# --- objects over point-to-point links: a length, then the pickled bytes ------------------------
def isend_object(comm: Comm, obj, dst: int) -> list:
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    comm.stats.add("send_object", data.numel(), 0.0)
    return [(dist.isend(size, dst=dst), size), (dist.isend(data, dst=dst), data)]  # keep the buffers alive


def recv_object(comm: Comm, src: int):
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src=src)
    data = torch.empty(int(size), dtype=torch.uint8)
    dist.recv(data, src=src)
    comm.stats.add("recv_object", data.numel(), 0.0)
    return pickle.loads(data.numpy().tobytes())


def isend_tensor(comm: Comm, x: torch.Tensor, dst: int) -> list:
    x = x.contiguous()
    t0 = time.perf_counter()
    work = dist.isend(x, dst=dst)
    comm.stats.add("send", x.numel() * x.element_size(), time.perf_counter() - t0)
    return [(work, x)]


def p2p_alpha_beta(comm: Comm, peer: int, sizes=(1, 256, 4096, 65536), repeats: int = 20) -> dict:
    """Round trips of a float32 tensor to `peer` and back (it echoes): t(one way) = alpha + beta * bytes."""
    xs, ts = [], []
    for n in sizes:
        x, y = torch.ones(n), torch.empty(n)
        t0 = time.perf_counter()
        for _ in range(repeats):
            w = dist.isend(x, dst=peer)
            dist.recv(y, src=peer)
            w.wait()
        xs.append(4.0 * n)
        ts.append((time.perf_counter() - t0) / repeats / 2)
    return fit_alpha_beta(sizes, xs, ts)


def _echo(peer: int, sizes=(1, 256, 4096, 65536), repeats: int = 20) -> None:
    for n in sizes:
        y = torch.empty(n)
        for _ in range(repeats):
            dist.recv(y, src=peer)
            dist.isend(y, dst=peer).wait()


# --- a worker rank's life ---------------------------------------------------------------------------
def serve(worker: RankWorker, comm: Comm, spec: ParallelSpec) -> None:
    """Receive messages in order, run them, pass them on; return on "shutdown"."""
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
        msg = comm.broadcast_object(None) if topo.is_first_stage else recv_object(comm, prev)
        kind = msg[0]
        if nxt is not None:
            pending += isend_object(comm, msg, nxt)
        if kind == "execute":
            mi, mb = msg[1], msg[2]
            hidden = (
                None if prev is None else comm.recv((len(mi.input_ids), hidden_size), spec.dtype, prev, worker.device)
            )
            out = worker.execute(mi, hidden, mb)
            if nxt is not None:
                pending += isend_tensor(comm, out, nxt)
            elif topo.tp_rank == 0:
                pending += isend_tensor(comm, out, 0)
        elif kind == "stats":
            pending += isend_object(comm, (topo.rank, comm.stats, list(worker.timeline.events)), 0)
        elif kind == "calibrate":
            if topo.tp > 1 and topo.is_first_stage:
                alpha_beta(comm)  # together with the driver and the rest of stage 0
            if topo.pp_rank == 1 and topo.tp_rank == 0:
                _echo(0)
        elif kind == "shutdown":
            for work, _ in pending:
                work.wait()
            return


def rank_main(rank: int, spec: ParallelSpec, init_method: str, started=None) -> None:
    """Entry point of a worker process; `started` (a pipe's end) tells the driver it got this far."""
    if started is not None:
        started.send(rank)
        started.close()
    torch.set_num_threads(1)  # one thread per rank: ranks share the cores
    topo = Topology(spec.tp, spec.pp, rank)
    init_process_group(spec.backend, init_method, topo, spec.timeout_s)
    try:
        comm = Comm(topo)
        worker, _ = build_rank(spec, comm)
        serve(worker, comm, spec)
    except Exception:  # the driver sees the closed connection; this says why
        traceback.print_exc()
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=5)


# --- the driver's side ------------------------------------------------------------------------------
class WorkerDiedError(RuntimeError):
    """A rank stopped answering: the engine cannot go on (its KV shards are gone)."""


NO_MAIN_GUARD = (
    "Python's spawn start method runs the main module again in every new process, so a script that "
    "builds a multi-rank LLM at module level builds it again in each rank. Create the engine under "
    '`if __name__ == "__main__":` (the "Safe importing of main module" rule of the multiprocessing docs).'
)


def _bootstrapping() -> bool:
    """True while this process is a spawned child still running its parent's main module (its own
    target has not started): the flag Python's `spawn._check_not_importing_main` reads."""
    return getattr(multiprocessing.current_process(), "_inheriting", False)


def _wait_until_started(procs: list, readers: list, timeout_s: float) -> None:
    """Wait until every rank has reached `rank_main` (it sends its rank down its pipe), as vLLM's
    `WorkerProc.wait_for_ready` does. A rank that dies before that (while spawn re-imports the
    main module) never joins the rendezvous, which would wait out its whole timeout for it; here
    its pipe reads end-of-file at once (the driver closed its copy of the writing end)."""
    waiting = dict(zip(readers, procs))
    deadline = time.monotonic() + timeout_s
    while waiting:
        ready = wait_for_any(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            names = ", ".join(p.name for p in waiting.values())
            raise WorkerDiedError(f"{names} did not start within {timeout_s:.0f} s")
        for conn in ready:
            p = waiting.pop(conn)
            try:
                conn.recv()
            except EOFError:
                p.join(timeout=5)
                raise WorkerDiedError(
                    f"{p.name} (pid {p.pid}, exit code {p.exitcode}) exited before it ran any rank code "
                    f"(its error is printed above). The usual cause: {NO_MAIN_GUARD}"
                ) from None
            finally:
                conn.close()


class Executor:
    def __init__(self, spec: ParallelSpec):
        self.spec, self.closed, self.owns_group = spec, False, False
        self.died: str | None = None  # why the ranks are gone, once they are
        self.topo = Topology(spec.tp, spec.pp, 0)
        self.procs: list = []
        self.threads_before = torch.get_num_threads()
        if self.topo.world > 1 and spec.ranks_started_by == "mp" and _bootstrapping():
            raise RuntimeError(
                f"a rank process, running the script again as it starts, reached its LLM(...). {NO_MAIN_GUARD}"
            )
        if self.topo.world > 1 and dist.is_initialized():
            raise RuntimeError(
                "a multi-rank engine is already running in this process: shut it down first (one per process)"
            )
        try:
            self._start(spec)
        except BaseException:  # a rank that failed to load, a bad config: leave no process or group behind
            self._abandon()
            raise

    def _start(self, spec: ParallelSpec) -> None:
        if self.topo.world > 1:
            # The driver is a rank too: one thread, like the others. With torch's default (one
            # per core) it would fight the workers for the cores, and every all-reduce waits
            # for the slowest rank. `_abandon` puts the caller's thread count back.
            torch.set_num_threads(1)
            if spec.ranks_started_by == "torchrun":
                init_method = "env://"
            else:
                init_method = f"tcp://127.0.0.1:{free_port()}"
                ctx = mp.get_context("spawn")
                pipes = [ctx.Pipe(duplex=False) for _ in range(1, self.topo.world)]  # (reader, writer) per rank
                self.procs = [ctx.Process(target=rank_main, args=(r, spec, init_method, pipes[r - 1][1]), daemon=True,
                                          name=f"rank{r}") for r in range(1, self.topo.world)]  # fmt: skip
                for p, (_, writer) in zip(self.procs, pipes):
                    p.start()
                    writer.close()  # the rank holds the only writing end now: its death reads as end-of-file
                _wait_until_started(self.procs, [reader for reader, _ in pipes], spec.timeout_s)
            self._finalizer = weakref.finalize(self, _kill, self.procs)  # no orphan even if nobody calls shutdown()
            self._guard(lambda: init_process_group(spec.backend, init_method, self.topo, spec.timeout_s))
            self.owns_group = True  # only this executor may destroy it (a stale one's __del__ must not)
        self.comm = Comm(self.topo)
        self.worker, self.num_blocks = self._guard(lambda: build_rank(spec, self.comm))
        self.device = self.worker.device
        self.in_flight: deque = deque()  # per micro-batch: its logits (pp = 1), or (rows to receive, its sends)
        self.next_mb = 0
        vocab = self.worker.model.full_config.vocab_size
        self.logits_shape = lambda rows: (rows, vocab)
        self.logits_dtype = torch.promote_types(spec.dtype, torch.float32)

    # --- what the engine calls ---------------------------------------------------------------------
    def execute(self, model_input: ModelInput) -> torch.Tensor:
        """One micro-batch, start to end (tensor parallelism only, or an idle pipeline)."""
        self.submit(model_input)
        return self.collect()

    def submit(self, model_input: ModelInput) -> int:
        """Start a micro-batch; with a pipeline, return before the later stages finish it."""
        mb, self.next_mb = self.next_mb, self.next_mb + 1
        msg = ("execute", model_input, mb)
        sends = self._send_down(msg)
        out = self._guard(lambda: self.worker.execute(model_input, None, mb))
        if self.topo.pp > 1:
            sends += isend_tensor(self.comm, out, self.topo.rank_of(1, 0))
            self.in_flight.append((len(model_input.logits_indices), sends))
        else:
            self.in_flight.append(out)
        return mb

    def collect(self) -> torch.Tensor:
        """The logits [S, V] of the oldest micro-batch in flight."""
        item = self.in_flight.popleft()
        if self.topo.pp == 1:
            return item
        rows, sends = item
        logits = torch.empty(self.logits_shape(rows), dtype=self.logits_dtype, device=self.device)
        t0 = time.perf_counter()
        self._wait(dist.irecv(logits, src=self.topo.rank_of(self.topo.pp - 1, 0)))
        self.comm.stats.add("recv", logits.numel() * logits.element_size(), time.perf_counter() - t0)
        for work, _ in sends:  # stage 1 took them before it could answer
            self._wait(work)
        return logits

    def comm_stats(self) -> dict[int, tuple[CommStats, list]]:
        """Every rank's message counters and forward timeline (only between micro-batches)."""
        assert not self.in_flight, "ask for stats only when no micro-batch is in flight"
        out = {0: (self.comm.stats, list(self.worker.timeline.events))}
        if self.topo.world > 1:
            sends = self._send_down(("stats",))
            for r in range(1, self.topo.world):
                rank, stats, events = self._guard(lambda r=r: recv_object(self.comm, r))
                out[rank] = (stats, events)
            for work, _ in sends:
                self._wait(work)
        return out

    def calibrate(self) -> dict:
        """alpha and beta of this machine's all-reduce (TP) and point-to-point send (PP)."""
        assert not self.in_flight
        out = {}
        if self.topo.world == 1:
            return out
        sends = self._send_down(("calibrate",))
        if self.topo.tp > 1:
            out["all_reduce"] = self._guard(lambda: alpha_beta(self.comm))
        if self.topo.pp > 1:
            out["p2p"] = self._guard(lambda: p2p_alpha_beta(self.comm, self.topo.rank_of(1, 0)))
        for work, _ in sends:
            self._wait(work)
        return out

    def shutdown(self) -> None:
        """Tell every rank to stop, wait for them, and free this process's process group."""
        if self.topo.world > 1 and not self.closed:
            try:
                while self.in_flight:  # the last stage waits to hand these over before it can listen
                    self.collect()
                for work, _ in self._send_down(("shutdown",)):
                    work.wait()
            except Exception:  # a rank is already gone: nothing more to tell it
                pass
            for p in self.procs:
                p.join(timeout=10)
        self._abandon()

    def _abandon(self) -> None:
        """No more messages: kill whoever is left and release the process group (idempotent)."""
        self.closed = True
        _kill(self.procs)
        torch.set_num_threads(self.threads_before)
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False

    # --- plumbing ----------------------------------------------------------------------------------
    def _send_down(self, msg) -> list:
        """A message to every rank: broadcast to stage 0, sent on to stage 1 (which passes it on).
        Returns the sends still in progress (wait on them once the message has surely arrived)."""
        self._guard(lambda: self.comm.broadcast_object(msg))
        return isend_object(self.comm, msg, self.topo.rank_of(1, 0)) if self.topo.pp > 1 else []

    def _dead(self) -> list[str]:
        return [f"{p.name} (pid {p.pid}, exit code {p.exitcode})" for p in self.procs if not p.is_alive()]

    def check_health(self) -> None:
        """Raise WorkerDiedError if a rank this executor spawned has exited (cheap: no message is
        sent, so a server can ask while the engine is idle). Ranks started by torchrun are not
        this process's children: their death shows at the next step instead."""
        if self.closed and self.died is None:
            return  # shut down on purpose: its ranks exited because they were told to
        if self.died is None and self._dead():
            self.died = f"a worker rank died: {', '.join(self._dead())}; the engine cannot continue"
            self._abandon()  # the survivors wait in serve() for a message that cannot come: end them now
        if self.died is not None:  # (after the first failure the others were killed: keep its reason)
            raise WorkerDiedError(self.died)

    def _guard(self, fn):
        """Run a step that talks to other ranks; a dead rank becomes one clear error, not a hang."""
        try:
            return fn()
        except Exception as e:
            lost = "closed" in str(e).lower() or "timed out" in str(e).lower()
            if lost and not self._dead():  # gloo saw the socket close before the kernel let us reap the rank
                wait_for_any([p.sentinel for p in self.procs], timeout=1.0)
            for p in self.procs:  # reap whoever exited, so its exit code is known
                if not p.is_alive():
                    p.join(timeout=0.5)
            dead = self._dead()
            if dead or lost:
                self.died = f"a worker rank failed: {', '.join(dead) or str(e)[:200]}; the engine cannot continue"
                self._abandon()
                raise WorkerDiedError(self.died) from e
            raise

    def _wait(self, work) -> None:
        """One wait, as long as the timeout (gloo cannot resume a wait that timed out; a dead peer
        ends it at once with a closed connection)."""
        self._guard(lambda: work.wait(timeout=datetime.timedelta(seconds=self.spec.timeout_s)))
