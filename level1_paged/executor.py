"""The executor seam: what an engine calls to run a step's forward, whoever runs it.

What it is: `Executor`, a Protocol (structural: nothing has to inherit from it; `isinstance`
checks that the names are there). The `Worker` (worker.py) satisfies it in one process, where
`submit` runs the forward at once:

    engine ──ModelInput──> execute(mi) ──────────────────────> logits [S, V]
           ──ModelInput──> submit(mi) ... submit(mi') ...      (an executor may keep several in flight)
                           collect() ────────────────────────> logits of the oldest one submitted
           collective_rpc("kv_cache_bytes") ─────────────────> [worker 0's answer, worker 1's, ...]

`collective_rpc(method, *args)` calls the worker method of that name on every worker (one in
one process) and returns the answers in order: the one door for everything that is not a
forward (statistics, calibration, a test's question). `num_blocks` is the number of KV blocks
every worker's cache holds (the engine hands out exactly these); `check_health` raises if a
worker is gone; `shutdown` ends the workers (idempotent). Level 5's `MultiprocExecutor`
implements it over tp x pp ranks, with a pipeline's forwards in flight between `submit` and `collect`.

What it is not: the batching or the sampler (they stay with the engine, in its process), or a
base class: a remote executor is anything with these six names.

Reference: vLLM `v1/executor/abstract.py` (`Executor`: `execute_model`, `collective_rpc`,
`check_health`, `shutdown`) and `uniproc_executor.py`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from .model_input import ModelInput


@runtime_checkable
class Executor(Protocol):
    num_blocks: int  # KV blocks in every worker's cache

    def execute(self, model_input: ModelInput) -> torch.Tensor:
        """One forward, start to end -> logits [S, V] (S = len(model_input.logits_indices))."""
        ...

    def submit(self, model_input: ModelInput) -> int:
        """Start a forward; returns its number (in submission order). `collect` hands back its logits."""
        ...

    def collect(self) -> torch.Tensor:
        """The logits [S, V] of the oldest forward submitted and not yet collected."""
        ...

    def collective_rpc(self, method: str, *args: Any) -> list:
        """Call the worker method `method(*args)` on every worker; their answers, in order."""
        ...

    def check_health(self) -> None:
        """Raise if a worker has died (cheap: sends nothing)."""
        ...

    def shutdown(self) -> None:
        """Stop every worker and free what they hold; calling it again does nothing."""
        ...
