"""`/metrics`: the engine's metric records in Prometheus' text format, with vLLM's names and types.

What it is: `render(records, model_name)`, which turns one snapshot of
`LLMEngine.get_metrics()` (taken on the engine thread, between steps) into the
exposition format. prometheus-client does the formatting, so a counter named
`vllm:prompt_tokens` comes out as `vllm:prompt_tokens_total`, as vLLM's does:

    # HELP vllm:generation_tokens_total Number of generation tokens processed.
    # TYPE vllm:generation_tokens_total counter
    vllm:generation_tokens_total{model_name="tiny-shakespeare"} 1234.0
    vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="tiny-shakespeare"} 17.0

Every series carries `model_name` (the served name), as vLLM's do, so one dashboard can
watch several servers. The spec-decode vector becomes one counter series per draft
position (`position` label).

What it is not: a registry that lives for the process. Each scrape builds a fresh one
from the snapshot (no global state; the engine's counters are the source of truth).

Reference: vLLM `v1/metrics/loggers.py` (PrometheusStatLogger), docs/design/metrics.md.
"""

from __future__ import annotations

from collections import defaultdict

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ladder.metrics import Counter, Gauge, Histogram, Metric, Vector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

HELP = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:num_preemptions": "Cumulative number of preemptions from the engine.",
    "vllm:request_success": "Count of successfully processed requests.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "vllm:spec_decode_num_accepted_tokens_per_pos": "Accepted tokens per draft position.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:request_prompt_tokens": "Number of prefill tokens processed per request.",
    "vllm:request_generation_tokens": "Number of generation tokens processed per request.",
    "vllm:lora_requests_info": "Running stats on LoRA requests: the adapters running and waiting, max_loras.",
    "ladder:kv_offload_hits": "Prompt tokens a KV connector's tier handed back instead of their compute, per tier.",
    "ladder:kv_offload_bytes": "Bytes a KV connector moved, per tier and direction (save: into it, load: out).",
    "ladder:kv_offload_seconds": "Seconds spent moving blocks out of a KV connector's tier, per tier.",
    "ladder:kv_offload_blocks": "Blocks a KV connector's tier holds now, per tier.",
    "ladder:kv_transfer": "KV transfers between a prefill and a decode instance, by role and outcome (a consumer's "
                          "failed ones were computed instead).",
    "ladder:kv_transfer_bytes": "Bytes of KV a TCP connector sent (producer) or received (consumer).",
    "ladder:kv_transfer_seconds": "Seconds a consumer's fetches took, connection to last block.",
    "ladder:kv_transfer_parcels_waiting": "Finished prefills whose blocks wait in a producer's outbox for their consumer.",
}


class _Snapshot:
    """A prometheus-client collector over one list of metric records."""

    def __init__(self, records: list[Metric], model_name: str):
        self.records, self.model_name = records, model_name

    def collect(self):
        by_name: dict[str, list[Metric]] = defaultdict(list)
        for m in self.records:
            by_name[m.name].append(m)
        for name, group in by_name.items():
            label_names = ["model_name", *group[0].labels]
            doc = HELP.get(name, name)
            first = group[0]
            if isinstance(first, Vector):
                fam = CounterMetricFamily(name, doc, labels=[*label_names, "position"])
                for m in group:
                    for pos, v in enumerate(m.values):
                        fam.add_metric([self.model_name, *m.labels.values(), str(pos)], v)
            elif isinstance(first, Histogram):
                fam = HistogramMetricFamily(name, doc, labels=label_names)
                for m in group:
                    fam.add_metric([self.model_name, *m.labels.values()], list(m.buckets.items()), m.sum)
            else:
                kind = CounterMetricFamily if isinstance(first, Counter) else GaugeMetricFamily
                assert isinstance(first, (Counter, Gauge)), f"unknown metric record {first!r}"
                fam = kind(name, doc, labels=label_names)
                for m in group:
                    fam.add_metric([self.model_name, *m.labels.values()], m.value)
            yield fam


def render(records: list[Metric], model_name: str) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(records, model_name))
    return generate_latest(registry)


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {"name{labels}": value} (for tests, the demo and the benchmark)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def value(samples: dict[str, float], name: str) -> float:
    """The sum of every series of `name` (whatever its labels)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def aborted(samples: dict[str, float]) -> float:
    """Requests finished with finish_reason "abort" (their clients left, or the server stopped them)."""
    return sum(v for k, v in samples.items()
               if k.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in k)  # fmt: skip
