"""The modelled GPU's clock, and the executor that moves it: a forward pass is time, not arithmetic.

What it is:

    SimClock            the engine's clock: seconds that only the cost model (and the arrivals) move
    SimStep             what the executor is told of a step: (cached, new) tokens per request, logits rows
    SimulatedExecutor   the executor seam (level1_paged/executor.py): `execute(step)` advances the clock
                        by the cost model's time for the step and returns no logits; with pp pipeline
                        stages each stage keeps a clock of its own (`submit`, `through_the_stages`,
                        `collect`), so level 5's micro-batches overlap as they do on ranks
    StepTrace           one step as it ran (when, its cost, batch, tokens, KV held), kept with keep_trace

The simulated engines (engines.py) hand their steps to it in place of a worker; lab 5c has the
student write `through_the_stages`.

What it is not: the cost model (cost.py says what a step costs) or an engine (engines.py: what
runs, when, and with which tokens).

Reference: Huang et al., "GPipe" (NeurIPS 2019), figure 2: the stages' timelines.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from .cost import Hardware, ModelShape, StepCost, step_cost


class SimClock:
    """The engine's clock: seconds that only the cost model (and the arrivals) move."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class SimStep:
    """What the executor needs to know of a step: (tokens already cached, new tokens) per request, and how
    many logits rows the LM head computes."""

    chunks: list[tuple[int, int]]
    num_sampled: int
    shared: int = 0  # context tokens in blocks another request of the step read first (a shared prefix)
    adapters: list | None = None  # each chunk's SimAdapter (lora_cost.py) or None; None: no LoRA in the step


@dataclass
class StepTrace:
    start: float
    cost: StepCost
    batch: int  # requests in the step
    tokens: int  # new tokens in the step
    allocated: int  # KV tokens reserved or in allocated blocks as the step ran
    stored: int  # of them, tokens whose K/V are stored


class SimulatedExecutor:
    """Satisfies level 1's `Executor` Protocol; a forward is a cost and no logits.

    With `pp` pipeline stages each stage has a clock of its own (when it is done with what it was
    given): `submit` pays the step's overhead on the driver's clock (the engine's), then each stage
    runs its share of the layers (the last one also the LM head) once it is free and the previous
    stage's activations have arrived; `collect` waits for the oldest step's last stage. A level that
    calls `execute` (submit, then collect) runs its stages one after another; level 5's batch queue
    (`SimulatedPipeline`) submits pp micro-batches before it collects one, and their stages overlap:

        stage 0 |A0|B0|C0|          each box one micro-batch's layers on that stage; a send between
        stage 1    |A1|B1|C1|       boxes costs alpha + activations / link"""

    def __init__(self, num_blocks: int, hardware: Hardware, shape: ModelShape, clock: SimClock, tp: int = 1,
                 keep_trace: bool = False, pp: int = 1):  # fmt: skip
        self.num_blocks, self.hardware, self.shape, self.clock, self.tp = num_blocks, hardware, shape, clock, tp
        self.pp = pp
        self.trace: list[StepTrace] | None = [] if keep_trace else None
        self.probe = lambda: (0, 0)  # the engine's (allocated, stored) KV tokens, for the trace
        self.stage_free = [0.0] * pp  # when each stage finishes what it has been given (the engine's seconds)
        self._in_flight: deque[float] = deque()  # per step submitted, oldest first: when its last stage is done
        self.steps = 0

    def execute(self, step: SimStep) -> None:
        self.submit(step)
        return self.collect()

    def submit(self, step: SimStep) -> int:
        cost = step_cost(self.hardware, self.shape, step.chunks, step.num_sampled, self.tp, self.pp, step.shared,
                         step.adapters)  # fmt: skip
        if self.trace is not None:
            tokens = sum(n for _, n in step.chunks)
            self.trace.append(StepTrace(self.clock.now, cost, len(step.chunks), tokens, *self.probe()))
        done = self.clock.now + cost.total  # one stage: the step's whole cost, as one sum
        if self.pp > 1:
            done = self.through_the_stages(cost)
        self._in_flight.append(done)
        return self.steps + len(self._in_flight) - 1

    def through_the_stages(self, cost: StepCost) -> float:
        """When the last of pp stages is done with a step that costs `cost` (engine seconds), each stage taking
        its share as soon as it is free (`self.stage_free`, updated here) and the step has reached it; the
        driver's overhead is paid on the engine's clock first."""
        layers = cost.linear + cost.attention + cost.lora + cost.comm - (self.pp - 1) * cost.send  # with TP's
        per_stage = layers / self.pp
        self.clock.advance(cost.overhead)  # the driver schedules and launches, then hands it to stage 0
        t = self.clock.now
        for s in range(self.pp):
            t = max(t, self.stage_free[s]) + per_stage + (cost.lm_head if s == self.pp - 1 else 0.0)
            self.stage_free[s] = t
            t += cost.send if s < self.pp - 1 else 0.0  # the activations to the next stage
        return t

    def collect(self) -> None:
        self.clock.now = max(self.clock.now, self._in_flight.popleft())
        self.steps += 1
        return None

    def collective_rpc(self, method: str, *args: Any) -> list:
        return [getattr(self, method)(*args)]

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
