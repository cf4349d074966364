"""Level 5 on Ray (`distributed_executor_backend="ray"`, level5_multigpu/ray_executor.py).

What it is: a local Ray cluster of several processes, started the way docs/level5_multigpu.md
says (`ray start --head`, its GCS, raylet and workers), for this module only, and stopped after
it (`ray stop`: nothing left running); start-up bounded by START_TIMEOUT_S.
  - the equivalence suite with the ranks as Ray actors, TP=2 x PP=2 (three actors and the driver),
    greedy, float64, against the oracle (hypothesis, as test_equivalence.py's level-5 runs);
  - a rank actor of three (TP=2 x PP=2) killed from outside: the next step raises WorkerDiedError
    within the engine's timeout, `check_health` names the actor, and afterwards none of the three
    actor processes is left and the placement group is removed.
Skipped, saying why, where the `ray` package is not installed (`.ci/run` installs it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st

ray = pytest.importorskip("ray", reason="the ray package is not installed (pip install 'ray>=2.40')")

from hypothesis import given  # noqa: E402
from test_equivalence import Staggered, check_against_oracle, kv_bytes, workloads  # noqa: E402

from level0_naive import SamplingParams  # noqa: E402
from level5_multigpu import LLMEngine, WorkerDiedError  # noqa: E402

pytestmark = pytest.mark.level5
START_TIMEOUT_S = 120
RAY = [sys.executable, "-m", "ray.scripts.scripts"]  # the `ray` command, from this interpreter's environment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    """`ray start --head` with 4 CPU slots on a free port; RAY_ADDRESS points this process at it."""
    port = free_port()
    # A throwaway cluster on localhost: without Ray's token authentication (which a real cluster keeps).
    saved = {k: os.environ.get(k) for k in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    os.environ["RAY_AUTH_MODE"] = "disabled"
    start = subprocess.run([*RAY, "start", "--head", "--port", str(port), "--num-cpus", "4", "--include-dashboard",
                            "false", "--disable-usage-stats"], capture_output=True, text=True,
                           timeout=START_TIMEOUT_S)  # fmt: skip
    assert start.returncode == 0, start.stderr[-2000:]
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    try:
        yield os.environ["RAY_ADDRESS"]
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([*RAY, "stop", "--force"], capture_output=True, timeout=120)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def engine(cluster, checkpoint_factory):
    path = checkpoint_factory("llama")
    e = LLMEngine(path, dtype="float64", block_size=4, kv_cache_memory=kv_bytes(path, 4 * 12) * 2,
                  max_num_batched_tokens=8, max_num_seqs=4, tensor_parallel_size=2, pipeline_parallel_size=2,
                  distributed_executor_backend="ray", distributed_timeout_s=60)  # fmt: skip
    yield path, e
    e.shutdown()


@settings(max_examples=4)
@given(workload=workloads(), data=st.data())
def test_ray_actors_give_the_oracles_tokens(engine, workload, data, checkpoint_factory, oracle):
    path, e = engine
    assert all(type(p).__name__ == "RayRank" for p in e.executor.procs) and len(e.executor.procs) == 3
    need = max(len(p) + n for p, n in workload)
    if -(-need // 4) > e.num_blocks:
        return  # larger than this fixed pool: the other levels cover budgets that fit
    check_against_oracle(lambda *a: Staggered(e, data), workload, "llama", data, checkpoint_factory, oracle)
    assert not e.in_flight and e.kv.num_free_blocks == e.num_blocks


def test_a_killed_actor_is_reported_and_nothing_is_left(cluster, engine, checkpoint_factory):
    engine[1].shutdown()  # one multi-rank engine per process: the equivalence test's goes first
    path = checkpoint_factory("llama")
    e = LLMEngine(path, dtype="float64", tensor_parallel_size=2, pipeline_parallel_size=2,
                  distributed_executor_backend="ray", distributed_timeout_s=30, max_model_len=64)  # fmt: skip
    ranks = list(e.executor.procs)  # three actors: one is killed, the other two must not outlive the engine
    group = e.executor.procs.group
    e.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    while e.has_unfinished_requests():
        e.step()
    os.kill(ranks[0].pid, signal.SIGKILL)  # the actor's process, from outside (as an OOM killer would)
    t0 = time.monotonic()
    e.add_request("b", [4, 5, 6], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    with pytest.raises(WorkerDiedError):
        while e.has_unfinished_requests():
            e.step()
    assert time.monotonic() - t0 < 30  # within the engine's timeout
    with pytest.raises(WorkerDiedError, match="rank1 \\(Ray actor\\)"):  # by now Ray has seen it die: named
        e.check_health()
    e.shutdown()
    deadline = time.monotonic() + 30
    for r in ranks:
        while time.monotonic() < deadline:
            try:
                os.kill(r.pid, 0)
            except ProcessLookupError:
                break  # gone
            time.sleep(0.1)
        else:
            pytest.fail(f"{r.name} (pid {r.pid}) outlived its engine")
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"
