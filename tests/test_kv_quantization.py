"""The KV cache in 8 bits (features/quantization/kv.py, `kv_cache_dtype="fp8" | "int8"`): round trips within the
format's bound; the pool holds what the smaller element buys; and every level gives Hugging Face's greedy tokens
when HF's attention reads keys and values through the same round trip (an attention function registered with
transformers, so the oracle shares no code with the engine's cache), in float64, under preemption, chunked
prefill and prefix hits; every attention backend reads the cache alike; level 1 and level 3 agree in float32
with batch invariance on; a bad setting is a one-line error.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import Oracle
from hypothesis import given, settings
from hypothesis import strategies as st
from test_equivalence import Staggered, kv_bytes, workloads

import level1_paged
import level2_continuous
import level3_prefix
import level4_speculative
from features.quantization import Fp8KV, Int8KV
from level0_naive import SamplingParams

pytestmark = pytest.mark.level3

FP8_MAX = 448.0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # in place vs copy


def read_both_ways(fmt, attend, dtype: torch.dtype, g: torch.Generator, D: int):
    """An 8-bit cache written at random (slots out of order), read by `attend`'s in-place reader and by the torch
    backend over the dequantized copy: decodes and a 3-token chunk, GQA (4 query heads on 2), blocks out of order.
    -> (format, caches, meta, q, in place [5, Hq, D], copy)."""
    from level1_paged.attention_ref import paged_attention_torch

    f, (N, bs, H, Hq) = fmt(), (12, 4, 2, 4)
    caches = [torch.zeros(N, bs, H, f.head_bytes(D), dtype=torch.uint8) for _ in range(2)]
    write, in_place = f.wrap(attend)
    _, copied = f.wrap(paged_attention_torch)
    write(*(torch.randn(N * bs, H, D, generator=g).to(dtype) * 3 for _ in range(2)), *caches,
          torch.randperm(N * bs, generator=g))  # fmt: skip
    meta = (torch.tensor([0, 1, 4, 5], dtype=torch.int32), torch.tensor([9, 13, 2], dtype=torch.int32),
            torch.tensor([[7, 1, 2, 0], [3, 11, 5, 6], [9, 0, 0, 0]], dtype=torch.int32))  # fmt: skip
    q = torch.randn(5, Hq, D, generator=g).to(dtype)
    return f, caches, meta, q, in_place(q, *caches, *meta, 0.25), copied(q, *caches, *meta, 0.25)


# CPU tensors through Triton's interpreter, which a CUDA machine's process does not run (its triton is compiled):
# there tests/test_level1_kernel.py's test_triton_8bit_kv_native_gpu runs the kernel for real instead.
on_the_interpreter = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                        reason="the Triton interpreter (CPU tensors); the native test runs on CUDA")


def round_trip(fmt, x: torch.Tensor) -> torch.Tensor:
    cache = torch.zeros(1, dtype=torch.uint8)  # a stand-in for a layer's cache (fp8 keys its scale by it)
    return fmt.dequantize(fmt.quantize(x, cache), x.dtype, cache)


@st.composite
def kv(draw):
    """[T, H, D] float64 with zeros, outliers and subnormals."""
    t, h, d = draw(st.integers(1, 5)), draw(st.integers(1, 3)), draw(st.sampled_from([4, 16, 33]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(t, h, d, generator=g, dtype=torch.float64) * draw(st.sampled_from([1e-3, 1.0, 30.0]))
    kind = draw(st.sampled_from(["plain", "zero head", "outlier", "subnormal"]))
    if kind == "zero head":
        x[0, 0] = 0
    elif kind == "outlier":
        x[0, 0, 0] = 400.0
    elif kind == "subnormal":
        x[-1, -1] = 1e-310
    return x


@settings(max_examples=60, deadline=None)
@given(x=kv(), bf16=st.booleans())
def test_int8_kv_round_trip_within_half_a_step_per_token_and_head(x, bf16):
    """float64, and bfloat16 (the CUDA default: its rounding must still happen in float32)."""
    if bf16:
        x = x.clamp(-1e30, 1e30).to(torch.bfloat16)
        back = round_trip(Int8KV(), x).double()
        assert (back.float().to(torch.bfloat16).double() == back).all()  # (in bfloat16, as the cache gives it back)
        x = x.double()
        step = x.abs().amax(-1, keepdim=True) / 127
        assert ((back - x).abs() <= step / 2 * (1 + 2**-8) + x.abs() * 2**-8 + 1e-300).all()  # + bf16's own rounding
        return
    back = round_trip(Int8KV(), x)
    step = (x.abs().amax(-1, keepdim=True).float() / 127).to(x.dtype)  # [T, H, 1]
    assert ((back - x).abs() <= step / 2 * (1 + 1e-6) + 1e-300).all()
    assert not back[x.abs().amax(-1) == 0].any()


@settings(max_examples=60, deadline=None)
@given(x=kv())
def test_fp8_kv_round_trip_within_e4m3s_bound(x):
    """scale 1 (vLLM's default): within |x| < 448 the error is at most half a unit of e4m3's 3-bit mantissa
    (2^-4 relative), or half its smallest subnormal (2^-10) near zero."""
    back = round_trip(Fp8KV(), x)
    assert ((back - x).abs() <= x.abs() * 2**-4 + 2**-10).all()


def test_the_pool_holds_what_the_smaller_element_buys(checkpoint_factory):
    """The same kv_cache_memory: fp8 stores a byte per value (4x float32's blocks), int8 a byte plus a
    float32 scale per head (head_dim 16: 64 / 20 = 3.2x)."""
    path = checkpoint_factory("llama")
    budget = kv_bytes(path, 16 * 40, dtype_bytes=4)  # 40 blocks of 16 float32 tokens
    blocks = {dt: level3_prefix.LLM(path, dtype="float32", kv_cache_dtype=dt, kv_cache_memory=budget).llm_engine.num_blocks
              for dt in ("auto", "fp8", "int8")}  # fmt: skip
    assert blocks == {"auto": 40, "fp8": 160, "int8": 128}, blocks


class QuantizedKVOracle(Oracle):
    """conftest's oracle (HF greedy, no KV cache, memoised), its attention reading keys and values through the
    format's round trip."""

    def model(self, key: tuple):
        from transformers import AttentionInterface, AutoModelForCausalLM
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if key not in self.models:
            path, fmt_name = key
            fmt = {"int8": Int8KV, "fp8": Fp8KV}[fmt_name]()

            def attention(module, query, key, value, *args, **kwargs):  # key, value [B, Hkv, T, D]
                def rounded(t):  # each token and head of each row (a beam search's batch is its beams)
                    b, h, n, d = t.shape
                    return round_trip(fmt, t.transpose(1, 2).reshape(b * n, h, d)).reshape(b, n, h, d).transpose(1, 2)

                k, v = rounded(key), rounded(value)
                return sdpa_attention_forward(module, query, k, v, *args, **kwargs)

            AttentionInterface.register(f"ladder_{fmt_name}_kv", attention)
            self.models[key] = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float64, attn_implementation=f"ladder_{fmt_name}_kv").eval()  # fmt: skip
        return self.models[key]

    def greedy(self, path, fmt_name: str, prompt: list[int], n: int) -> list[int]:
        return super().greedy((path, fmt_name), prompt, n)


@pytest.fixture(scope="module")
def kv_oracle():
    return QuantizedKVOracle()


@settings(max_examples=8, deadline=None)
@given(workload=workloads(), data=st.data())
def test_every_level_gives_hf_greedy_tokens_through_the_same_round_trip(workload, data, checkpoint_factory, kv_oracle):
    """Levels 1-4 (n-gram speculation at 4), int8 or fp8, a pool from the largest request alone (preemption) to
    plenty, a drawn token budget (chunked prefill), levels 3-4 twice over (prefix hits), the torch backend, the oracle one or
    the compiled CPU kernel: HF's tokens with its keys and values rounded the same way."""
    fmt = data.draw(st.sampled_from(["int8", "fp8"]), label="kv_cache_dtype")
    arch = data.draw(st.sampled_from(["llama", "qwen3"]), label="arch")
    level = data.draw(
        st.sampled_from([level1_paged, level2_continuous, level3_prefix, level4_speculative]), label="level"
    )
    path = checkpoint_factory(arch)
    need, bs = max(len(p) + n for p, n in workload) + 2, data.draw(st.sampled_from([1, 4, 16]), label="block_size")
    blocks = -(-need // bs) * data.draw(st.sampled_from([1, 3]), label="kv budget (x largest request)")
    head_bytes = 16 + 4 if fmt == "int8" else 16  # head_dim 16
    budget = kv_bytes(path, blocks * bs, dtype_bytes=1) * head_bytes // 16
    kwargs = dict(dtype="float64", block_size=bs, kv_cache_memory=budget, kv_cache_dtype=fmt,
                  attention_backend=data.draw(st.sampled_from(["torch", "cpu", "ref"]), label="attention backend"))  # fmt: skip
    if level is level1_paged:
        llm = level.LLM(path, **kwargs)
        outs = llm.generate([p for p, _ in workload], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                                       for _, n in workload], progress=False)  # fmt: skip
        rounds = [outs]
    else:
        if level is level4_speculative:
            kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
        engine = level.LLMEngine(path, max_num_batched_tokens=data.draw(st.sampled_from([3, 2048]), label="token budget"),
                                 **kwargs)  # fmt: skip
        assert engine.num_blocks == blocks
        runner = Staggered(engine, data)
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in workload]
        rounds = [
            runner.generate([p for p, _ in workload], params) for _ in range(1 if level is level2_continuous else 2)
        ]
    for outs in rounds:
        for (prompt, n), out in zip(workload, outs):
            assert out.outputs[0].token_ids == kv_oracle.greedy(path, fmt, prompt, n)


@on_the_interpreter
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_level3_on_the_triton_kernel_gives_hf_greedy_tokens_through_the_same_round_trip(fmt, checkpoint_factory,
                                                                                      kv_oracle, monkeypatch):  # fmt: skip
    """The engine on attention_backend="triton" (interpreted here) reads its 8-bit cache in place, not through the
    copy: float64, three prompts sharing a stem, twice over (the second round's prefixes are hits)."""
    pytest.importorskip("triton", reason="the Triton kernel needs triton (Linux)")
    from conftest import VOCAB

    from level1_paged import triton_attention

    launches, launch = [], triton_attention._launch
    monkeypatch.setattr(triton_attention, "_launch", lambda *a: launches.append(a[8]) or launch(*a))  # a[8]: kv_quant

    path = checkpoint_factory("llama")
    g = torch.Generator().manual_seed(1)
    stem = torch.randint(VOCAB, (9,), generator=g).tolist()
    prompts = [stem + torch.randint(VOCAB, (k,), generator=g).tolist() for k in (1, 4, 7)]
    llm = level3_prefix.LLM(path, dtype="float64", block_size=4, kv_cache_dtype=fmt, attention_backend="triton")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    for _ in range(2):
        for prompt, out in zip(prompts, llm.generate(prompts, params, progress=False)):
            assert out.outputs[0].token_ids == kv_oracle.greedy(path, fmt, prompt, 5)
    assert launches and set(launches) == {triton_attention.KV_QUANT[fmt]}, "every step read 8 bits in place"


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_beams_fork_and_copy_8_bit_blocks_with_their_scales(fmt, checkpoint_factory, kv_oracle):
    """The fork: beam search on level 3 shares blocks between beams and copies a shared partial block before a beam
    writes into it (copy-on-write); the copy is the block's bytes, int8's scales with them. Hugging Face's beams
    through the same round trip, float64, blocks of 4 so beams fork inside blocks."""
    from test_beam_search import MAX_TOKENS, check_against_hf, prompts_for

    from level3_prefix import BeamSearchParams

    path = checkpoint_factory("llama")
    llm = level3_prefix.LLM(path, dtype="float64", block_size=4, kv_cache_dtype=fmt)
    outs = llm.beam_search(prompts_for(), BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS))
    check_against_hf(outs, kv_oracle.model((path, fmt)), prompts_for(), 3, MAX_TOKENS)
    assert llm.llm_engine.kv.num_copied > 0  # beams forked inside partial blocks and copied them


def test_level1_and_level3_agree_in_float32_with_batch_invariance(checkpoint_factory):
    """The issue's exactness: in float32 the batch-invariant ops and attention make a request's tokens its own
    whatever its batch, and the 8-bit cache keeps it so (a token's K and V round the same in any batch)."""
    path = checkpoint_factory("llama")
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], [4, 4, 4, 4, 4, 4, 4], [30, 31]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    for fmt in ("fp8", "int8"):
        texts = [[o.outputs[0].token_ids for o in lv.LLM(path, dtype="float32", kv_cache_dtype=fmt, batch_invariant=True)
                  .generate(prompts, params, progress=False)] for lv in (level1_paged, level3_prefix)]  # fmt: skip
        assert texts[0] == texts[1], fmt


def test_a_bad_kv_cache_dtype_is_a_one_line_error(checkpoint_factory):
    path = checkpoint_factory("llama")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp4' is not one of: auto, fp8, int8$"):
        level3_prefix.LLM(path, kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' has none to calibrate$"):
        level3_prefix.LLM(path, kv_cache_dtype="int8", calculate_kv_scales=True)
    import level0_naive

    with pytest.raises(TypeError, match=r"unknown setting\(s\) kv_cache_dtype"):  # level 0's cache is contiguous
        level0_naive.LLM(path, kv_cache_dtype="int8")


def test_blocks_offloaded_and_brought_back_carry_their_scales(checkpoint_factory, kv_oracle):
    """int8: a block carries its scales, so the offloading connector's copies (pool -> host -> pool) need nothing
    of their own: a pool of 12 blocks, 8 prompts sharing their first 4 blocks, twice (the second round's
    prefixes come back from the host tier), HF's tokens through the same round trip."""
    import random

    from conftest import VOCAB

    path, bs = checkpoint_factory("llama"), 4
    rng = random.Random(0)
    stem = [rng.randrange(VOCAB) for _ in range(16)]
    prompts = [stem + [rng.randrange(VOCAB) for _ in range(9 + i % 3)] for i in range(8)]
    per_block = kv_bytes(path, bs, dtype_bytes=1) * 20 // 16  # int8 with head_dim 16: 20 bytes a head
    config = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu_bytes_to_use": 64 * per_block}}
    llm = level3_prefix.LLM(path, dtype="float64", block_size=bs, kv_cache_memory=12 * per_block, kv_cache_dtype="int8",
                            kv_transfer_config=config)  # fmt: skip
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for _ in range(2):
        for prompt, out in zip(prompts, llm.generate(prompts, params, progress=False)):
            assert out.outputs[0].token_ids == kv_oracle.greedy(path, "int8", prompt, 6)
    assert llm.llm_engine.kv_connector_stats()["hits_host_tokens"] > 0, "some prefix came back from the host tier"
    llm.llm_engine.connector.close()


@on_the_interpreter
@pytest.mark.parametrize("fmt", [Int8KV, lambda: Fp8KV(calculate_scales=True)], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=dtype_name)
def test_the_triton_kernel_reads_8_bits_in_place_as_the_copy_does(fmt, dtype):
    """Level 1's Triton kernel (KV_QUANT; interpreted here) over the same 8-bit cache as the torch backend over the
    dequantized copy: decodes and a 3-token chunk, GQA, blocks out of order, head_dim 16 and 20 (int8's scale at
    byte 20 of a 24-byte slot), fp8 with its calibrated scales (not 1.0, so a kernel that forgot them fails)."""
    pytest.importorskip("triton", reason="the Triton kernel needs triton (Linux)")
    from level1_paged.triton_attention import paged_attention_triton

    assert paged_attention_triton.quantized is not None  # so wrap() reads in place, not through the copy
    g = torch.Generator().manual_seed(0)
    for D in (16, 20):
        f, caches, _, _, fast, ref = read_both_ways(fmt, paged_attention_triton, dtype, g, D)
        if f.name == "fp8":
            assert all(abs(f.scale(c) - 1.0) > 0.01 for c in caches)
        # fp32/fp64: the same products in the same dtype; fp16/bf16: the copy rounds K and V to 16 bits, the kernel not
        assert (fast.double() - ref.double()).abs().max() <= TOLERANCE[dtype] * ref.double().abs().max(), (D, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=dtype_name)
def test_the_compiled_kernel_widens_every_e4m3_byte_as_torch_does(dtype):
    """The CPU kernel's table of e4m3's values: every byte but the two NaNs, subnormals and both zeros included,
    read back exactly. One key per sequence, so each output row is its value's bytes."""
    from features.cpu_kernels import attention as cpu

    if not cpu.available():
        pytest.skip(f"the CPU kernel does not build here: {cpu.build_error()}")
    every = torch.tensor([b if b not in (0x7F, 0xFF) else 0 for b in range(256)], dtype=torch.uint8)
    v_cache = every.view(16, 1, 1, 16)  # [N, bs 1, Hkv 1, D 16]: block i holds bytes 16i .. 16i + 15
    k_cache = torch.zeros_like(v_cache)
    ones = torch.ones(16, dtype=torch.int32)
    meta = (torch.arange(17, dtype=torch.int32), ones, torch.arange(16, dtype=torch.int32)[:, None])
    out = cpu.paged_attention_cpu_8bit(torch.randn(16, 1, 16).to(dtype), k_cache, v_cache, *meta, 0.25, "fp8")
    assert torch.equal(out[:, 0], every.view(torch.float8_e4m3fn).view(16, 16).to(dtype))


@pytest.mark.parametrize("fmt", [Int8KV, Fp8KV], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=dtype_name)
def test_the_compiled_kernel_reads_8_bits_in_place_as_the_copy_does(fmt, dtype):
    """The CPU kernel's 8-bit entry points (scores times each key's scale, weights times each value's) against the
    torch backend over the dequantized copy: decodes and a 3-token chunk, GQA (4 query heads on 2), blocks out
    of order, head_dim 16 and 20 (int8's slot then 24 bytes: its scale's bytes at an offset of 20); and in float32
    and float64 bit for bit against the kernel's own float walk over the dequantized cache (a block widened in
    place holds the very values the copy holds)."""
    from features.cpu_kernels import attention as cpu

    if not cpu.available():
        pytest.skip(f"the CPU kernel does not build here: {cpu.build_error()}")
    g = torch.Generator().manual_seed(0)
    for D in (16, 20):
        f, caches, meta, q, fast, ref = read_both_ways(fmt, cpu.paged_attention_cpu, dtype, g, D)
        assert (fast.double() - ref.double()).abs().max() <= TOLERANCE[dtype] * ref.double().abs().max(), (D, dtype)
        if dtype != torch.bfloat16:  # bit for bit: the same kernel's float walk over the dequantized cache
            k, v = (f.dequantize(c, dtype, c).contiguous() for c in caches)
            assert torch.equal(fast, cpu.paged_attention_cpu(q, k, v, *meta, 0.25)), (D, dtype)
