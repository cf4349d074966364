"""Engine statistics: how much KV memory was reserved vs. really used, and how fast.

What it is: counters every level fills in the same way, so their numbers line up in
one table. KV waste is sampled once per model step:

    waste = 1 - (sum over steps of bytes holding real tokens)
              / (sum over steps of bytes reserved)

a time average of the PagedAttention paper's "fraction of KV memory that holds real
token states" (figure 2). What it is not: a profiler or a metrics exporter (level 6
exports Prometheus metrics).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # tokens fed through prefill (recomputation included)
    generated_tokens: int = 0
    preemptions: int = 0
    peak_running: int = 0
    running_sum: int = 0  # sum over steps of running sequences (for the mean)
    kv_reserved_sum: int = 0  # sum over steps of bytes reserved
    kv_used_sum: int = 0  # sum over steps of bytes holding real tokens
    kv_reserved_peak: int = 0
    kv_used_peak: int = 0
    busy_time: float = 0.0  # seconds spent inside generate()
    step_times: list[float] = field(default_factory=list)

    def record_step(self, running: int, kv_reserved: int, kv_used: int, seconds: float) -> None:
        self.steps += 1
        self.peak_running = max(self.peak_running, running)
        self.running_sum += running
        self.kv_reserved_sum += kv_reserved
        self.kv_used_sum += kv_used
        self.kv_reserved_peak = max(self.kv_reserved_peak, kv_reserved)
        self.kv_used_peak = max(self.kv_used_peak, kv_used)
        self.step_times.append(seconds)

    @property
    def kv_waste(self) -> float:
        """Fraction of reserved KV memory (time-averaged) that held no token."""
        return 1.0 - self.kv_used_sum / self.kv_reserved_sum if self.kv_reserved_sum else 0.0

    @property
    def mean_running(self) -> float:
        return self.running_sum / self.steps if self.steps else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.generated_tokens / self.busy_time if self.busy_time else 0.0

    def as_dict(self) -> dict:
        return {
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "preemptions": self.preemptions,
            "peak_running": self.peak_running,
            "mean_running": self.mean_running,
            "kv_waste": self.kv_waste,
            "kv_reserved_peak": self.kv_reserved_peak,
            "kv_used_peak": self.kv_used_peak,
            "busy_time": self.busy_time,
            "output_tokens_per_s": self.output_tokens_per_s,
        }


class Timer:
    """`with Timer() as t: ...; t.seconds`"""

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
