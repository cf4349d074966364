"""The Executor Protocol (level1_paged/executor.py): one test, every executor.

What it is: the single-process `Worker` (levels 1-4) and level 5's `MultiprocExecutor` with
TP = 2 and with PP = 2 (real processes on gloo) each satisfy the runtime-checkable Protocol;
`execute` gives a single-process worker's logits (float64: the all-reduce's other order of
sums moves them by ~1e-15); two `submit`s then two `collect`s give the same logits, oldest
first; `num_blocks` is a positive int; `collective_rpc` answers once per rank; `shutdown`
ends every rank and can be called again.

What it is not: the engine over these executors (test_level5.py, test_equivalence.py).
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from level0_naive.config import EngineConfig
from level0_naive.loader import load_model
from level1_paged.executor import Executor
from level1_paged.model_input import ModelInput
from level1_paged.worker import Worker
from level5_multigpu.engine import ParallelEngine
from level5_multigpu.executor import MultiprocExecutor
from level5_multigpu.rank import ParallelSpec

BLOCK = 4
A = ModelInput.build([([1, 2, 3, 4, 5], 0), ([6, 7], 0)], [[0, 1], [2]], BLOCK, [1, 1])  # two prefills
B = ModelInput.build([([8, 9, 10], 0)], [[3]], BLOCK, [3])  # another sequence, three logits rows


def single_process_worker(path) -> Worker:
    return Worker(load_model(path, dtype=torch.float64).model, 8, BLOCK, "torch")


def make_executor(path, tp: int, pp: int):
    if tp * pp == 1:
        return single_process_worker(path)
    config = EngineConfig(str(path), ParallelEngine.config_parts, dtype="float64", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                  block_size=BLOCK, attention_backend="torch", kv_cache_memory=1 << 20,
                                  distributed_timeout_s=60)  # fmt: skip
    return MultiprocExecutor(ParallelSpec.from_config(config, model=str(path), dtype=torch.float64, device_type="cpu"))


def rank_processes() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("rank")]


@pytest.mark.parametrize(
    "tp,pp",
    [
        pytest.param(1, 1, id="worker", marks=pytest.mark.level1),
        pytest.param(2, 1, id="tp2", marks=pytest.mark.level5),
        pytest.param(1, 2, id="pp2", marks=pytest.mark.level5),
    ],
)
def test_every_executor_satisfies_the_protocol(checkpoint_factory, tp, pp):
    path = checkpoint_factory("llama")
    reference = single_process_worker(path)
    want_a, want_b = reference.execute(A), reference.execute(B)
    assert not isinstance(object(), Executor)  # the check is not vacuous
    executor = make_executor(path, tp, pp)
    try:
        assert isinstance(executor, Executor)
        assert isinstance(executor.num_blocks, int) and executor.num_blocks >= 4  # A and B use blocks 0-3
        a, b = executor.execute(A), executor.execute(B)
        assert a.shape == (2, want_a.shape[1]) and b.shape == (3, want_b.shape[1])
        torch.testing.assert_close(a, want_a, rtol=0, atol=1e-10)
        torch.testing.assert_close(b, want_b, rtol=0, atol=1e-10)
        first = executor.submit(A)
        assert executor.submit(B) == first + 1  # numbered in submission order
        assert torch.equal(executor.collect(), a) and torch.equal(executor.collect(), b)  # oldest first
        sizes = executor.collective_rpc("kv_cache_bytes")
        assert len(sizes) == tp * pp and all(isinstance(s, int) and s > 0 for s in sizes)
        whole = reference.kv_cache_bytes() // reference.num_blocks * executor.num_blocks
        assert sum(sizes) == whole if tp == 1 else sum(sizes) >= whole  # TP may replicate KV heads
        executor.check_health()
    finally:
        executor.shutdown()
    executor.shutdown()  # again: nothing happens
    executor.check_health()  # shut down on purpose: healthy, not dead
    assert not rank_processes()
