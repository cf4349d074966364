"""Ranks as Ray actors: `distributed_executor_backend="ray"`, for a cluster the user already runs.

What it is: the one part of the executor that differs from the `mp` backend, who starts the
ranks. `spawn_ranks` places ranks 1 .. tp*pp-1 with a placement group (one bundle per rank: a GPU
each on CUDA, a CPU each here), starts a `RankActor` in each bundle and has it run the very
`rank_main` an `mp` process runs: the same rendezvous (`tcp://` at the driver's node address),
the same rank loop, the same messages over `torch.distributed`. The driver is still rank 0, in the
caller's process; Ray only starts, places and watches the others.

    ray start --head                               # machine A (or nothing: a local cluster is started)
    ray start --address A:6379                     # machine B joins
    python -m level6_serving --tensor-parallel-size 2 --pipeline-parallel-size 2 \\
        --distributed-executor-backend ray         # on A: 3 actors placed on A and B, rank 0 here

It connects to a running cluster (`RAY_ADDRESS`, or the one `ray start` left on this machine) or,
with none, starts a local one for this process. A `RayRank` answers what the executor asks of a
rank process (alive? its exit code? kill it, wait for it), so a dead actor is reported exactly as
a dead `mp` process is: `WorkerDiedError` naming it, the engine marked dead, `/health` 503; and
shutting down kills every actor and removes the placement group, so nothing is left behind.

On CUDA (written, not run: no GPU was at hand) the driver uses its machine's first GPU, outside
Ray's accounting, so Ray must not hand that GPU to an actor: start that node with one GPU fewer
(`ray start --head --num-gpus N-1`), as vLLM reserves a bundle for its driver.

What it is not: Ray's own collective library or compiled graphs (vLLM's Ray backend uses Ray for
placement and its own NCCL groups for tensors, as this does with gloo/NCCL), or autoscaling.

Reference: vLLM `v1/executor/ray_distributed_executor.py` and `ray_utils.py` (placement groups,
one bundle per device); Ray docs, "Placement Groups".
"""

from __future__ import annotations

import logging
import os

from .rank import ParallelSpec, rank_main

log = logging.getLogger("level5_multigpu")


def connect(num_cpus: int) -> None:
    """Join the cluster that `ray start` (or RAY_ADDRESS) names; with none, start a local one."""
    import ray

    if ray.is_initialized():
        return
    try:
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level=logging.WARNING, log_to_driver=False)
    except ConnectionError:  # no cluster running: one for this process, as vLLM does
        ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)


def node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


class RayRank:
    """A rank actor, seen as the executor sees an `mp` process (is_alive, exitcode, kill, join)."""

    def __init__(self, rank: int, actor, run_ref, pid: int):
        self.rank, self.actor, self.ref, self.pid = rank, actor, run_ref, pid
        self.name = f"rank{rank} (Ray actor)"
        self._exitcode: int | None = None

    def is_alive(self) -> bool:
        import ray

        if self._exitcode is None and not ray.is_initialized():
            self._exitcode = 1  # the session is gone (the interpreter is exiting): so are its actors
        if self._exitcode is None:
            done, _ = ray.wait([self.ref], timeout=0)
            if done:
                try:
                    ray.get(self.ref)
                    self._exitcode = 0  # it returned: told to shut down
                except Exception:  # noqa: BLE001 - the actor died (killed, or rank_main's os._exit(1))
                    self._exitcode = 1
        return self._exitcode is None

    @property
    def exitcode(self) -> int | None:
        self.is_alive()
        return self._exitcode

    def kill(self) -> None:
        import ray

        if ray.is_initialized():
            ray.kill(self.actor, no_restart=True)

    def join(self, timeout: float | None = None) -> None:
        import ray

        if ray.is_initialized():
            ray.wait([self.ref], timeout=timeout)
        self.is_alive()


class RayRanks(list):
    """The rank actors, and the placement group they live in (removed when they are killed)."""

    def __init__(self, ranks: list[RayRank], group):
        super().__init__(ranks)
        self.group = group

    def wait_for_exit(self, timeout: float) -> None:
        import ray

        if self and ray.is_initialized():
            ray.wait([r.ref for r in self], num_returns=1, timeout=timeout)

    def close(self) -> None:
        import ray

        if self.group is not None and ray.is_initialized():
            ray.util.remove_placement_group(self.group)
            self.group = None


def spawn_ranks(spec: ParallelSpec, init_method: str) -> RayRanks:
    """Ranks 1 .. tp*pp-1 as actors in one placement group, each running `rank_main`; returns once every
    actor has started (a placement the cluster cannot satisfy fails within the timeout, naming it)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world = spec.tp * spec.pp
    connect(num_cpus=world)
    device = {"GPU": 1} if spec.device_type == "cuda" else {"CPU": 1}
    group = placement_group([dict(device) for _ in range(1, world)], strategy="PACK")
    try:
        ray.get(group.ready(), timeout=spec.timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise RuntimeError(f"the Ray cluster could not place {world - 1} ranks ({device} each) within "
                           f"{spec.timeout_s:.0f} s: `ray status` shows what it has") from None  # fmt: skip

    @ray.remote(num_cpus=device.get("CPU", 0), num_gpus=device.get("GPU", 0))
    class RankActor:
        def ready(self) -> int:
            return os.getpid()

        def run(self, rank: int, spec: ParallelSpec, init_method: str) -> None:
            rank_main(rank, spec, init_method)  # until Shutdown; on an error it exits the actor's process

    actors = [RankActor.options(name=None, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=r - 1)).remote() for r in range(1, world)]  # fmt: skip
    try:
        pids = ray.get([a.ready.remote() for a in actors], timeout=spec.timeout_s)
    except BaseException:
        for a in actors:
            ray.kill(a, no_restart=True)
        ray.util.remove_placement_group(group)
        raise
    ranks = [RayRank(r, a, a.run.remote(r, spec, init_method), pid) for r, a, pid in zip(range(1, world), actors, pids)]
    return RayRanks(ranks, group)
