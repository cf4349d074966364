"""Quantization on the GPU what-if (benchmarks/sim/cost.py's widths, benchmarks/sim/quantization.py): int4 weights
are a little over a quarter of bf16's bytes and leave the KV the difference; fp8 KV halves a token's bytes, so the
simulated engine's pool (sized by the real level-1 setting) holds twice the blocks; a batch-1 decode, which reads
every weight, gets faster with int4 and not with fp8; and the benchmark's table runs.
"""

from __future__ import annotations

import pytest

from benchmarks.sim.clock import SimClock
from benchmarks.sim.cost import gpu, kv_budget, model_shape, quantized, step_cost
from benchmarks.sim.serve import make_engine

pytestmark = pytest.mark.bench

HW, SHAPE = gpu("a100-80gb"), model_shape("llama-2-7b")


def test_the_widths_move_the_bytes_and_the_budget():
    int4, fp8 = quantized(SHAPE, "int4"), quantized(SHAPE, kv_cache_dtype="fp8")
    head = 2 * SHAPE.vocab * SHAPE.hidden * 2  # embedding and LM head stay bf16
    layers = SHAPE.weight_bytes - head
    assert int4.weight_bytes - head == int(layers * (0.5 + 4 / 128) / 2)  # 4 bits + a bf16 scale and zero per 128
    assert kv_budget(HW, int4) - kv_budget(HW, SHAPE) == pytest.approx(SHAPE.weight_bytes - int4.weight_bytes, abs=1)
    assert fp8.kv_bytes_per_token * 2 == SHAPE.kv_bytes_per_token
    assert quantized(SHAPE, kv_cache_dtype="int8").kv_bytes_per_token == int(
        SHAPE.kv_bytes_per_token / 2 * (1 + 4 / 128)
    )
    one = [(512, 1)]
    t = {name: step_cost(HW, s, one, 1).total for name, s in (("bf16", SHAPE), ("int4", int4), ("fp8", fp8))}
    assert t["int4"] < t["bf16"] / 2, t  # a batch-1 decode is the weights' read
    assert t["fp8"] < t["bf16"] and t["fp8"] > 0.95 * t["bf16"], t  # its KV read is small beside the weights


def test_the_simulated_pool_is_sized_by_the_real_setting():
    plain = make_engine("vllm", "llama-2-7b", HW, SimClock())
    fp8 = make_engine("vllm", "llama-2-7b", HW, SimClock(), kv_cache_dtype="fp8")
    int4 = make_engine("vllm", "llama-2-7b", HW, SimClock(), quantization="int4")
    assert fp8.num_blocks in (2 * plain.num_blocks, 2 * plain.num_blocks + 1)
    assert int4.num_blocks > plain.num_blocks and fp8.shape.kv_bytes_per_value == 1.0 and int4.shape.weight_bits == 4


def test_the_benchmark_prints_its_table(tmp_path, capsys):
    from benchmarks.sim import quantization

    res = quantization.main(["--models", "llama-2-7b", "--gpus", "h100-80gb", "--requests", "40", "--out",
                             str(tmp_path / "q.json")])["runs"]["llama-2-7b/h100-80gb"]  # fmt: skip
    assert set(res) == {"bf16", "fp8 KV", "int4 weights", "int4 + fp8 KV"}
    assert res["fp8 KV"]["kv_tokens"] == 2 * res["bf16"]["kv_tokens"]
    assert res["int4 weights"]["batch1_decode_ms"] < res["bf16"]["batch1_decode_ms"] / 2
    assert (
        all(r["tokens_per_s"] > 0 for r in res.values()) and "ShareGPT-like requests at once" in capsys.readouterr().out
    )
