"""Weight quantization (features/quantization): the formats' round trip within half a step, the packed kernels
equal to the reference to the activations' rounding, and engines with quantized weights giving Hugging Face's
greedy tokens on the dequantized weights, at every level, in float64 (where the reference path runs, bit for bit
the dequantized matrix through F.linear); a bad setting is a one-line error.

Level 5's ranks quantize their own shards: a row-parallel layer's int8 scales are each shard's (its columns'
largest value), so the oracle there is a checkpoint dequantized shard by shard (its 8-bit KV cache too:
tests/test_kv_quantization.py's oracle).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import VOCAB
from hypothesis import given, settings
from hypothesis import strategies as st
from test_kv_quantization import kv_oracle  # noqa: F401 (a fixture: HF reading K and V through the round trip)

import level0_naive
import level2_continuous
import level3_prefix
import level4_speculative
from features.quantization import GROUP, Int4Weight, Int8Weight, QuantizedOps
from level0_naive import SamplingParams

pytestmark = pytest.mark.level3

SIZES = dict(hidden_size=128, intermediate_size=256, head_dim=32)  # every input size a multiple of int4's group
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@st.composite
def weights(draw, group: int = 1):
    """A float32 matrix with what breaks a careless quantizer: zero rows, one huge outlier, subnormals."""
    out = draw(st.integers(1, 6))
    n_in = group * draw(st.integers(1, 3)) if group > 1 else draw(st.integers(1, 40))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    w = torch.randn(out, n_in, generator=g) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
    kind = draw(st.sampled_from(["plain", "zero row", "outlier", "subnormal", "constant group"]))
    if kind == "zero row":
        w[0] = 0
    elif kind == "outlier":
        w[0, draw(st.integers(0, n_in - 1))] = 1e4
    elif kind == "subnormal":
        w[-1] = torch.finfo(torch.float32).tiny / 4 * torch.sign(w[-1])
    elif kind == "constant group":
        w[0, :] = 0.5
    return w.to(draw(st.sampled_from([torch.float32, torch.bfloat16])))  # (16 bits: the rounding stays in 32)


@settings(max_examples=60, deadline=None)
@given(w=weights())
def test_int8_round_trip_within_half_a_step(w):
    q = Int8Weight(w)
    err = (q.dequantize(torch.float32) - w.float()).abs()  # [out, in]
    slack = w.float().abs().amax(1, keepdim=True) * 2**-22  # q * s itself rounds in float32
    assert (err <= q.scale[:, None] / 2 + slack + 1e-30).all()
    assert q.q.dtype == torch.int8 and q.q.abs().max() <= 127
    assert not q.dequantize()[w.float().abs().amax(1) == 0].any(), "an all-zero row must stay zero"


@settings(max_examples=60, deadline=None)
@given(w=weights(group=GROUP))
def test_int4_round_trip_within_half_a_step_per_group(w):
    q = Int4Weight(w)
    out, n_in = w.shape
    err = (q.dequantize(torch.float32) - w.float()).abs().reshape(out, n_in // GROUP, GROUP)
    slack = w.float().abs().reshape(out, n_in // GROUP, GROUP).amax(-1, keepdim=True) * 2**-21  # float32's own rounding
    assert (err <= q.scale[..., None] / 2 + slack + 1e-30).all()
    assert q.q.max() <= 15


@pytest.mark.parametrize("fmt,shape", [(Int8Weight, (48, 64)), (Int8Weight, (33, 192)), (Int4Weight, (32, 256)),
                                       (Int4Weight, (64, 128))])  # fmt: skip
def test_the_packed_kernel_equals_the_reference_to_the_activations_rounding(fmt, shape):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(*shape, generator=g), torch.randn(5, shape[1], generator=g)
    q = fmt(w)
    assert q.kernel, "this CPU's torch has the kernel for this shape"
    fast, ref = q.matmul(x, use_kernel=True), q.matmul(x, use_kernel=False)
    bound = (x.abs() @ q.dequantize().abs().T) * 2**-7  # bfloat16 activations (and scales): ~8 bits
    assert ((fast - ref).abs() <= bound).all()
    assert not torch.equal(fast, ref), "the kernel ran (its bfloat16 rounding shows)"
    # shapes the kernels would misread run the reference: int8's `in` not a multiple of 64, int4's `out` of 16
    assert not (fmt(torch.randn(5, 200)) if fmt is Int8Weight else fmt(torch.randn(20, 128))).kernel


def dequantized_checkpoint(path, out, method: str, tp: int = 1):
    """The checkpoint with each projection replaced by its quantize-dequantize round trip (shard by shard of the
    row-parallel ones' columns, as `tp` ranks quantize them): the oracle's weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    fmt = {"int8": Int8Weight, "int4": Int4Weight}[method]
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.split(".")[-1] in PROJECTIONS:
                w = module.weight
                parts = w.chunk(tp, dim=1) if name.endswith(("o_proj", "down_proj")) else [w]
                module.weight.copy_(torch.cat([fmt(p).dequantize() for p in parts], dim=1))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def oracle_checkpoints(checkpoint_factory, tmp_path_factory):
    made = {}

    def get(arch: str, method: str, tp: int = 1):
        if (arch, method, tp) not in made:
            base = checkpoint_factory(arch, **SIZES)
            made[arch, method, tp] = (
                base,
                dequantized_checkpoint(base, tmp_path_factory.mktemp(f"dq-{arch}-{method}"), method, tp),
            )
        return made[arch, method, tp]

    return get


PROMPTS = [[random.Random(i).randrange(VOCAB) for _ in range(3 + i)] for i in range(5)]


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("level", [level0_naive, level2_continuous, level3_prefix, level4_speculative])
def test_a_quantized_engine_gives_hf_greedy_tokens_on_the_dequantized_weights(
    level, method, oracle_checkpoints, oracle
):
    """float64: the reference path (the kernels take 16-bit activations), the dequantized matrix through F.linear,
    as HF's Linear does; qwen3 at level 4 (qk-norm; n-gram speculation), llama elsewhere."""
    arch = "qwen3" if level is level4_speculative else "llama"
    base, dq = oracle_checkpoints(arch, method)
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    llm = level.LLM(base, dtype="float64", quantization=method,
                    **({"speculative_config": ngram} if level is level4_speculative else {}))  # fmt: skip
    model = llm.llm_engine.loaded.model
    assert isinstance(model.ops, QuantizedOps)
    assert isinstance(model.model.layers[0].mlp.down_proj.weight, (Int8Weight, Int4Weight))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), progress=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == oracle.greedy(dq, prompt, 8)
    # and the quantization ran: the prompt's logprobs move (the greedy tokens of a random model may not)
    lp = SamplingParams(max_tokens=1, prompt_logprobs=0)
    quantized, plain = (e.generate(PROMPTS[4:], lp, progress=False)[0].prompt_logprobs[1:]
                        for e in (llm, level.LLM(base, dtype="float64")))  # fmt: skip
    moved = [abs(next(iter(a.values())).logprob - next(iter(b.values())).logprob) for a, b in zip(quantized, plain)]
    assert max(moved) > 1e-6, moved


def test_bad_settings_are_one_line_errors(checkpoint_factory):
    small = checkpoint_factory("llama")  # hidden 64: not a multiple of int4's group
    for kwargs, words in [
        ({"quantization": "int4"}, "has 64 inputs, not a multiple of the group (128)"),
        ({"quantization": "fp4"}, "quantization='fp4' is not one of: int8, int4"),
        ({"quantization": "int8", "batch_invariant": True}, "quantization with batch_invariant=True is not built"),
        ({"quantization": "int8", "compilation_config": 3}, "compilation_config with quantization is not built"),
    ]:
        with pytest.raises(ValueError) as e:
            level3_prefix.LLM(small, dtype="float32", **kwargs)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.level5
def test_ranks_quantize_their_shards_and_hold_their_heads_in_8_bits(oracle_checkpoints, kv_oracle):  # noqa: F811
    """tp 2 x pp 2, int8 weights and an int8 KV cache (one engine for both: ranks are slow to start): each rank's
    shard quantized (a row-parallel layer's scales are its columns'), the oracle's checkpoint dequantized shard by
    shard the same way and its attention reading K and V through the cache's round trip; each rank's cache holds
    its layers' and heads' bytes. int4 whose shard is not a whole group is refused before a rank starts."""
    import level5_multigpu

    base, dq = oracle_checkpoints("llama", "int8", tp=2)
    with level5_multigpu.LLM(base, dtype="float64", quantization="int8", kv_cache_dtype="int8", tensor_parallel_size=2,
                             pipeline_parallel_size=2, distributed_timeout_s=100) as llm:  # fmt: skip
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), progress=False)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == kv_oracle.greedy(dq, "int8", prompt, 8)
    with pytest.raises(ValueError, match=r"o_proj has 64 inputs per rank, not a multiple of the group \(128\)"):
        level5_multigpu.LLM(base, dtype="float64", quantization="int4", tensor_parallel_size=2)


def test_the_built_in_model_keeps_95_percent_of_its_greedy_tokens():
    """The issue's thresholds, on the built-in model with natural text (32-byte windows of the committed sonnets,
    24 tokens each, teacher-forced as benchmarks/quality.py measures): int8 weights, the fp8 and int8 KV caches
    keep >= 95 % of float32's greedy tokens; int4 weights are measured (94.9 % on 200 held-out prompts,
    docs/quantization.md) and here held to >= 85 %."""
    from pathlib import Path

    from benchmarks.quality import agreement
    from ladder.models import default_model

    text = (Path(__file__).resolve().parents[1] / "benchmarks" / "texts" / "sonnets.txt").read_bytes()
    prompts = [list(text[i : i + 32]) for i in range(0, len(text) - 32, (len(text) - 32) // 48)][:48]
    path = str(default_model())
    greedy = SamplingParams(max_tokens=24, min_tokens=24, temperature=0, ignore_eos=True)
    reference = [
        o.outputs[0].token_ids
        for o in level3_prefix.LLM(path, dtype="float32").generate(prompts, greedy, progress=False)
    ]
    floors = {("quantization", "int8"): 0.95, ("kv_cache_dtype", "fp8"): 0.95, ("kv_cache_dtype", "int8"): 0.95,
              ("quantization", "int4"): 0.85}  # fmt: skip
    for (key, value), floor in floors.items():
        share, _ = agreement(level3_prefix.LLM(path, dtype="float32", **{key: value}), prompts, reference)
        assert share >= floor, (key, value, share)
        assert share < 1 or key == "kv_cache_dtype", (key, value, "the weights' rounding changed nothing: did it run?")
