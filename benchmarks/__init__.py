"""The cross-level benchmark: the same workloads through every level and Hugging Face.

What it is: `python -m benchmarks.throughput` runs named, seeded workloads
(`workloads.py`) through each importable level and through `transformers`'
`generate` (`engines.py`), in one process, and reports vLLM-style figures
(requests/s, tokens/s, TTFT, TPOT, KV memory) as ratios, next to the machine's
matmul limit (`roofline.py`). Results go to a rich table, a JSON file under
`benchmarks/results/`, and PNGs under `docs/img/` (`plots.py`).

What it is not: a test of speed. Tests (`tests/test_benchmarks.py`) check that the
harness runs and writes well-formed JSON; the numbers are for people to read.

Reference: vLLM's `benchmarks/benchmark_throughput.py` and `vllm bench serve`.
"""
