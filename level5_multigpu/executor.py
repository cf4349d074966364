"""The driver's side of the executor: it starts the ranks, sends them work, collects the logits.

What it is: `MultiprocExecutor`, level 1's `Executor` Protocol (level1_paged/executor.py)
over tp x pp ranks: what level 2's engine calls instead of a `Worker`. The driver
process is rank 0: it runs the scheduler, the KV manager, sampling and every request's
generator, and it is also the worker of stage 0, TP rank 0. The other ranks are
processes (spawned by its constructor with `mp`, or started by `torchrun`) that run
`serve()` (`rank.py`); what goes between them is three typed messages (`transport.py`):

    driver (rank 0)                       stage 0, rank 1              stage 1, ranks 2, 3
    schedule, prepare ModelInput
    broadcast Execute(mi, mb) ────────>   receive it
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
counts its messages (`CommStats`); `collective_rpc("stats")` brings them to the driver.

A rank that dies makes the driver raise, naming it, within `distributed_timeout_s`
(gloo notices a closed connection at once; a hung rank is caught by the timeout); the
driver's exit, in turn, closes every connection, so no worker outlives it. A rank that
dies before it starts (spawn runs the user's main module again in every new process, and
a script without `if __name__ == "__main__":` builds its engine there) is caught by a
start-up handshake instead, and the error names the guard.

With `distributed_executor_backend="ray"` the ranks are Ray actors instead of processes
(`ray_executor.py`: placed with a placement group on a running cluster, or a local one); the
rest of this file does not change.

What it is not: a multi-node launcher of its own: across machines every rank is started by
`torchrun` or by Ray (see docs/level5_multigpu.md for the commands).

Reference: vLLM `v1/executor/multiproc_executor.py` and `v1/worker/gpu_worker.py`.
"""

from __future__ import annotations

import datetime
import multiprocessing
import time
import weakref
from collections import deque
from multiprocessing.connection import wait as wait_for_any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from level1_paged.model_input import ModelInput

from .parallel_state import Comm, CommStats, Topology, init_process_group
from .rank import ParallelSpec, build_rank, rank_main
from .transport import CollectiveRPC, Execute, Message, Shutdown, free_port, isend_tensor, recv_object, send_down


def _kill(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=5)
    close = getattr(procs, "close", None)  # Ray's ranks: their placement group goes too
    if close is not None:
        close()


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


def spawn_ranks(spec: ParallelSpec, init_method: str) -> list:
    """Start ranks 1 .. tp * pp - 1 as processes running `rank_main`; return once each has reached it."""
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe(duplex=False) for _ in range(1, spec.tp * spec.pp)]  # (reader, writer) per rank
    procs = [ctx.Process(target=rank_main, args=(r, spec, init_method, pipes[r - 1][1]), daemon=True, name=f"rank{r}")
             for r in range(1, spec.tp * spec.pp)]  # fmt: skip
    for p, (_, writer) in zip(procs, pipes):
        p.start()
        writer.close()  # the rank holds the only writing end now: its death reads as end-of-file
    try:
        _wait_until_started(procs, [reader for reader, _ in pipes], spec.timeout_s)
    except BaseException:
        _kill(procs)
        raise
    return procs


class MultiprocExecutor:
    """The `Executor` of tp x pp ranks: this process is rank 0; the constructor starts the others."""

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
            if self.topo.world > 1:
                # The driver is a rank too: one thread, like the others. With torch's default (one
                # per core) it would fight the workers for the cores, and every all-reduce waits
                # for the slowest rank. `_abandon` puts the caller's thread count back.
                torch.set_num_threads(1)
                if spec.ranks_started_by == "torchrun":
                    init_method = "env://"  # torchrun started every rank: they are waiting in rank_main
                elif spec.ranks_started_by == "ray":  # actors on the cluster's nodes: the driver's node address
                    from . import ray_executor

                    ray_executor.connect(num_cpus=self.topo.world)
                    init_method = f"tcp://{ray_executor.node_address()}:{free_port()}"
                    self.procs = ray_executor.spawn_ranks(spec, init_method)
                else:
                    init_method = f"tcp://127.0.0.1:{free_port()}"
                    self.procs = spawn_ranks(spec, init_method)
                self._finalizer = weakref.finalize(self, _kill, self.procs)  # no orphan even if nobody calls shutdown()
                self._guard(lambda: init_process_group(spec.backend, init_method, self.topo, spec.timeout_s))
                self.owns_group = True  # only this executor may destroy it (a stale one's __del__ must not)
            self.comm = Comm(self.topo, fixed_order=spec.batch_invariant)
            self.worker = self._guard(lambda: build_rank(spec, self.comm))  # every rank agrees on num_blocks here
        except BaseException:  # a rank that failed to load, a bad config: leave no process or group behind
            self._abandon()
            raise
        self.num_blocks = self.worker.num_blocks
        self.device = self.worker.device
        self.in_flight: deque = deque()  # per micro-batch: its logits (pp = 1), or (rows to receive, its sends)
        self.next_mb = 0
        self.vocab_size = self.worker.model.full_config.vocab_size
        self.logits_dtype = torch.promote_types(spec.dtype, torch.float32)

    @property
    def runner(self):
        """The driver's own rank's runner: where level 4's EAGLE proposer finds the step's hidden states (the
        driver is TP rank 0 of the last stage when pipeline_parallel_size is 1, the only layout it is built for)."""
        return self.worker.runner

    # --- the Executor Protocol -----------------------------------------------------------------------
    def execute(self, model_input: ModelInput) -> torch.Tensor:
        """One micro-batch, start to end (tensor parallelism only, or an idle pipeline)."""
        self.submit(model_input)
        return self.collect()

    def submit(self, model_input: ModelInput) -> int:
        """Start a micro-batch; with a pipeline, return before the later stages finish it."""
        mb, self.next_mb = self.next_mb, self.next_mb + 1
        sends = self._send_down(Execute(model_input, mb))
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
        logits = torch.empty((rows, self.vocab_size), dtype=self.logits_dtype, device=self.device)
        src = self.topo.rank_of(self.topo.pp - 1, 0)
        self.comm._timed("recv", logits.numel() * logits.element_size(), lambda: self._wait(dist.irecv(logits, src=src)))
        for work, _ in sends:  # stage 1 took them before it could answer
            self._wait(work)
        return logits

    def collective_rpc(self, method: str, *args) -> list:
        """`RankWorker.method(*args)` on every rank, this one included (so a method may use the
        collectives of its stage); the answers in rank order. Only between micro-batches."""
        assert not self.in_flight, "call collective_rpc only when no micro-batch is in flight"
        if self.topo.world == 1:
            return [self._guard(lambda: getattr(self.worker, method)(*args))]
        sends = self._send_down(CollectiveRPC(method, args))
        answers = [self._guard(lambda: getattr(self.worker, method)(*args))]
        answers += [self._guard(lambda r=r: recv_object(self.comm, r)) for r in range(1, self.topo.world)]
        for work, _ in sends:
            self._wait(work)
        return answers

    def shutdown(self) -> None:
        """Tell every rank to stop, wait for them, and free this process's process group."""
        if self.topo.world > 1 and not self.closed:
            try:
                while self.in_flight:  # the last stage waits to hand these over before it can listen
                    self.collect()
                for work, _ in self._send_down(Shutdown()):
                    work.wait()
            except Exception:  # a rank is already gone: nothing more to tell it
                pass
            for p in self.procs:
                p.join(timeout=10)
        self._abandon()

    # --- what level 5's engine asks besides ----------------------------------------------------------
    def comm_stats(self) -> dict[int, tuple[CommStats, list]]:
        """Every rank's message counters and forward timeline (only between micro-batches)."""
        return dict(enumerate(self.collective_rpc("stats")))

    def calibrate(self) -> dict:
        """alpha and beta of this machine's all-reduce (TP) and point-to-point send (PP)."""
        return self.collective_rpc("calibrate")[0] if self.topo.world > 1 else {}

    def _abandon(self) -> None:
        """No more messages: kill whoever is left and release the process group (idempotent)."""
        self.closed = True
        _kill(self.procs)
        if self.threads_before is not None:  # once: a later call (the engine's __del__, run by the garbage
            # collector while another engine runs, or compiles) must not change that one's thread count
            torch.set_num_threads(self.threads_before)
            self.threads_before = None
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self.owns_group = False

    # --- plumbing ----------------------------------------------------------------------------------
    def _send_down(self, msg: Message) -> list:
        """A message to every rank (see `transport.send_down`); a dead rank becomes WorkerDiedError."""
        return self._guard(lambda: send_down(self.comm, msg))

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
            lost = any(word in str(e).lower() for word in ("closed", "timed out", "reset by peer", "broken pipe"))
            exiting = []  # the sentinels of ranks whose process is exiting
            if lost and not self._dead():  # gloo saw the socket close before the kernel let us reap the rank
                if hasattr(self.procs, "wait_for_exit"):  # Ray's actors: Ray hears of the death a little later
                    self.procs.wait_for_exit(timeout=min(10.0, self.spec.timeout_s))
                else:  # a dying process's sockets and its sentinel close together, at once
                    exiting = wait_for_any([p.sentinel for p in self.procs], timeout=1.0)
            for p in self.procs:  # reap whoever exited, so its exit code is known. A closed sentinel is not yet
                # a reapable process: is_alive() says True until the kernel finishes its exit (milliseconds,
                # more on a loaded machine), so join it, which waits for exactly that
                if not p.is_alive() or getattr(p, "sentinel", None) in exiting:
                    p.join(timeout=5.0)
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
