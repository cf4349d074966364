"""Engine statistics: how much KV memory was reserved vs. really used, and how fast.

What it is: counters every level fills in the same way, so their numbers line up in one table,
and fixed-bucket histograms of request latencies. KV waste is sampled once per model step:

    waste = 1 - (sum over steps of bytes holding real tokens)
              / (sum over steps of bytes reserved)

a time average of Kwon et al.'s (SOSP 2023) "fraction of KV memory that holds real
token states" (figure 2). Everything here is a number or a fixed-size histogram: an
engine that runs for a million steps holds no more statistics than one that ran ten.

What it is not: a profiler or an exporter (`metrics()` turns this into vLLM-named metrics).
Later levels fill the fields level 0 leaves at 0 (`preemptions`: level 1's evictions, level 2's
preemptions; level 2's `schedule_seconds`), and level 6 serves the metrics to Prometheus.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ladder.metrics import E2E_BUCKETS, ITL_BUCKETS, TOKEN_BUCKETS, TTFT_BUCKETS, Buckets, Counter, Metric


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # tokens fed through prefill (a token fed twice counts twice)
    generated_tokens: int = 0
    preemptions: int = 0
    peak_running: int = 0
    running_sum: int = 0  # sum over steps of running sequences (for the mean)
    kv_reserved_sum: int = 0  # sum over steps of bytes reserved
    kv_used_sum: int = 0  # sum over steps of bytes holding real tokens
    kv_reserved_peak: int = 0
    kv_used_peak: int = 0
    busy_time: float = 0.0  # seconds spent inside generate()
    step_seconds: float = 0.0  # summed over steps
    schedule_seconds: float = 0.0  # deciding who runs + bookkeeping + batch building, summed
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests (a few keys)
    ttft: Buckets = field(default_factory=lambda: Buckets(TTFT_BUCKETS))
    itl: Buckets = field(default_factory=lambda: Buckets(ITL_BUCKETS))
    e2e: Buckets = field(default_factory=lambda: Buckets(E2E_BUCKETS))
    request_prompt_tokens: Buckets = field(default_factory=lambda: Buckets(TOKEN_BUCKETS))
    request_generation_tokens: Buckets = field(default_factory=lambda: Buckets(TOKEN_BUCKETS))

    def record_step(self, running: int, kv_reserved: int, kv_used: int, seconds: float) -> None:
        self.steps += 1
        self.peak_running = max(self.peak_running, running)
        self.running_sum += running
        self.kv_reserved_sum += kv_reserved
        self.kv_used_sum += kv_used
        self.kv_reserved_peak = max(self.kv_reserved_peak, kv_reserved)
        self.kv_used_peak = max(self.kv_used_peak, kv_used)
        self.step_seconds += seconds

    def record_finished(self, seq) -> None:
        """One sample ended: its reason, and its latencies into the histograms."""
        m = seq.metrics
        self.finished[seq.finish_reason] = self.finished.get(seq.finish_reason, 0) + 1
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        self.request_prompt_tokens.observe(len(seq.prompt_token_ids))
        self.request_generation_tokens.observe(len(seq.output_token_ids))

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

    def metrics(self) -> list[Metric]:
        """The counters and histograms every level has, with vLLM's names."""
        out: list[Metric] = [
            Counter("vllm:prompt_tokens", value=self.prompt_tokens),
            Counter("vllm:generation_tokens", value=self.generated_tokens),
            Counter("vllm:num_preemptions", value=self.preemptions),
        ]
        # finished_reason "stop", "length" or "abort", as vLLM labels it
        out += [Counter("vllm:request_success", {"finished_reason": r}, n) for r, n in sorted(self.finished.items())]
        out += [
            self.ttft.metric("vllm:time_to_first_token_seconds"),
            self.itl.metric("vllm:inter_token_latency_seconds"),
            self.e2e.metric("vllm:e2e_request_latency_seconds"),
            self.request_prompt_tokens.metric("vllm:request_prompt_tokens"),
            self.request_generation_tokens.metric("vllm:request_generation_tokens"),
        ]
        return out


class Timer:
    """`with Timer() as t: ...; t.seconds`"""

    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
