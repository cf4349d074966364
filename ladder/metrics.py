"""Metrics as vLLM's offline API returns them: a list of named counters, gauges, histograms.

What it is: the four record types of vLLM's `vllm.v1.metrics.reader` (`Counter`,
`Gauge`, `Histogram`, `Vector`), each with a `name` and `labels`, and `Buckets`, a
fixed-size histogram accumulator (its memory never grows, however long the engine
runs). `LLM.get_metrics()` returns a list of these with vLLM's names
(`vllm:prompt_tokens`, `vllm:num_preemptions`, `vllm:time_to_first_token_seconds`, ...),
every level's engine from its statistics (level0_naive/stats.py); level 6 serves the same
numbers on `/metrics` in Prometheus' text format, where a counter's name gains a `_total` suffix.

What it is not: an exporter. Nothing here talks to Prometheus.

Reference: vLLM `v1/metrics/reader.py` and `v1/metrics/loggers.py` (names, buckets).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int | float = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    values: list[int] = field(default_factory=list)  # one count per position (spec decode)


@dataclass
class Histogram(Metric):
    count: int = 0
    sum: float = 0.0
    buckets: dict[str, int] = field(default_factory=dict)  # upper bound -> cumulative count ("+Inf" last)


# vLLM's bucket bounds (seconds / tokens)
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
               1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# fmt: on


class Buckets:
    """A histogram accumulator with fixed bounds: O(1) memory, O(log buckets) per observation."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is (bounds[-1], +inf)
        self.count, self.sum = 0, 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def metric(self, name: str, labels: dict | None = None) -> Histogram:
        cumulative, running = {}, 0
        for bound, c in zip([*map(str, self.bounds), "+Inf"], self.counts):
            running += c
            cumulative[bound] = running
        return Histogram(name, dict(labels or {}), self.count, self.sum, cumulative)

    def quantile(self, q: float) -> float:
        """An upper bound of the q-quantile (the bucket edge it falls under), for quick reading."""
        target, running = q * self.count, 0
        for bound, c in zip(self.bounds, self.counts):
            running += c
            if running >= target:
                return bound
        return float("inf")
