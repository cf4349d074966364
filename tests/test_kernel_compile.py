"""Every Triton kernel compiles for sm_80 and sm_90 at the engine's shapes, without a GPU.

What this is
    benchmarks/kernel_compile.py compiles level 1's attention and cache-write kernels ahead
    of time for A100 (sm_80) and H100 (sm_90) with the installed Triton and its ptxas, and
    these tests fail if a kernel stops compiling or asks for more shared memory than the
    target has. The grid is a slice of the docs' one (``python -m benchmarks.kernel_compile``):
    every shape and dtype, a block size each; fp64 where the installed Triton compiles it,
    and where it does not, fp64 must fail to compile (so the engine's refusal,
    ``_check_fp64_supported``, names the right version). Two planted configs show the checks
    can fail: a 512-key tile that no target can hold, and a 24-key tile tl.arange refuses.
    The LoRA room's shrink and expand (features/lora/triton_ops.py) compile too, every dtype, and
    the attention over an 8-bit KV cache: int8 everywhere, fp8 from sm_89 (where the engine allows it).

What this deliberately is not
    Not a run on a GPU (tests/test_level1_kernel.py runs the kernels, interpreted on a CPU),
    and not a check of registers or spills, which are reported, not limited (a spill is slow,
    not wrong).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton (Linux)")

from benchmarks import kernel_compile as kc  # noqa: E402
from level1_paged import triton_attention as ta  # noqa: E402

pytestmark = pytest.mark.level1

TARGETS = (80, 90)
DTYPES = ("float16", "bfloat16", "float32", "float64")
# The draft model's attention is the tiny model's kernel (same group, same head dim): left out.
SHAPES = [s for s in kc.SHAPES if s[0] != "tiny-shakespeare-draft"]
# The cache write at its narrowest row (2 x 64 values) and its widest (32 x 80, padded to 4096).
WRITE_KV_SHAPES = [s for s in SHAPES if s[0] in ("tiny-shakespeare", "Phi-2 (head dim 80)")]
# features/lora/triton_ops.py on the 1B Llama's q_proj (in = out = 2048): rank 8 (an 8-wide tile) and 16.
LORA = [kc.Config(kernel, arch, dtype, "Llama-3.2-1B", 32, 8, 64, rank=8 if arch == 80 else 16)
        for kernel in ("lora_shrink", "lora_expand") for arch in TARGETS for dtype in DTYPES]  # fmt: skip
# The attention over an 8-bit cache (KV_QUANT), bfloat16, at the narrowest and widest head: fp8 needs sm_89+.
KV8 = [kc.Config("attention", arch, "bfloat16", name, hq, hkv, d, kv=kv) for arch in TARGETS for kv in ("fp8", "int8")
       for name, hq, hkv, d in SHAPES if name in ("tiny-shakespeare", "Llama-3.1-8B (head dim 128)")]  # fmt: skip
OVERSIZED = kc.Config("attention", 90, "float16", "planted: 512-key tile", 16, 1, 128, 16, tile=512)
UNCOMPILABLE = kc.Config("attention", 80, "float16", "planted: 24-key tile", 4, 2, 64, 16, tile=24)  # not a power of 2


def _engine_grid() -> list[kc.Config]:
    configs = []
    for arch in TARGETS:
        for dtype in DTYPES:
            for i, (name, hq, hkv, d) in enumerate(SHAPES):
                configs.append(kc.Config("attention", arch, dtype, name, hq, hkv, d, block_size=(16, 32)[i % 2]))
            configs += [kc.Config("write_kv", arch, dtype, name, hq, hkv, d) for name, hq, hkv, d in WRITE_KV_SHAPES]
    return configs + KV8


@pytest.fixture(scope="module")
def results() -> dict[kc.Config, kc.Result]:
    configs = _engine_grid() + [OVERSIZED, UNCOMPILABLE]
    return {r.config: r for r in kc.compile_all(configs)}


def test_the_grid_is_what_was_asked_for(results):
    engine = [c for c in results if c not in (OVERSIZED, UNCOMPILABLE)]
    assert len(engine) == len(TARGETS) * len(DTYPES) * (len(SHAPES) + len(WRITE_KV_SHAPES)) + len(KV8) == 64
    assert {c.arch for c in engine} == set(TARGETS)
    assert {c.block_size for c in engine if c.kernel == "attention"} == {16, 32}
    assert {c.head_dim for c in engine} == {48, 64, 80, 128}


def test_every_kernel_compiles_within_shared_memory(results):
    fp64 = kc.fp64_supported()
    for config, r in results.items():
        if config in (OVERSIZED, UNCOMPILABLE) or (config.dtype == "float64" and not fp64):
            continue
        if config.kv == "fp8" and config.arch < 89:
            continue  # test_fp8_kv_compiles_exactly_where_the_engine_allows_it
        assert r.error is None, f"{config} does not compile: {r.error}"
        assert r.shared is not None and not r.over_limit, f"{config}: {r.shared} B > {kc.SMEM_LIMIT[config.arch]} B"
        if config.kernel == "attention":
            assert r.shared > 0  # tl.dot stages its operands in shared memory: 0 would mean a misread
        if fp64:  # Triton >= 3.5 exposes ptxas's log: the parse must find its figures
            assert r.registers is not None and 0 < r.registers <= 255 and r.spills is not None, config


def test_the_lora_kernels_compile_within_shared_memory():
    """Every dtype, fp64 too: no tl.dot in them (a row's matrix-vector product is a tl.sum), so the
    attention kernel's fp64 limit (_check_fp64_supported) is not theirs."""
    for r in kc.compile_all(LORA):
        assert r.error is None and r.shared is not None and not r.over_limit, (r.config, r.error, r.shared)


def test_fp64_compiles_exactly_where_the_engine_allows_it(results):
    fp64 = [r for c, r in results.items() if c.dtype == "float64" and c.kernel == "attention"]
    assert len(fp64) == len(TARGETS) * len(SHAPES)
    if kc.fp64_supported():
        assert all(r.error is None for r in fp64), [r.error for r in fp64 if r.error]
    else:  # an older Triton: the front end refuses fp64 in tl.dot, as _check_fp64_supported says
        assert all(r.error and "fp64" in r.error for r in fp64), [r.error for r in fp64]


def test_fp8_kv_compiles_exactly_where_the_engine_allows_it(results):
    """Triton converts float8 e4m3 on sm_89 and later only (triton_attention.FP8_CAPABILITY): the kernel over an fp8
    cache compiles for an H100 and not for an A100, where the launch refuses it (below); int8 compiles on both."""
    for config in KV8:
        r = results[config]
        allowed = config.kv == "int8" or (config.arch // 10, config.arch % 10) >= ta.FP8_CAPABILITY
        assert (r.error is None) == allowed, (config, r.error)
        assert allowed or "fp8e4nv not supported" in r.error, r.error  # Triton's own reason, reported
        if allowed:
            assert r.shared and not r.over_limit, (config, r.shared)


@pytest.mark.parametrize("capability, triton_knows_fp8, refusal", [
    ((8, 0), True, r"a GPU of compute capability >= 8\.9 \(this one: virtual GPU\)"),  # an A100
    ((9, 0), False, r"a Triton with float8e4nv \(installed: 2\.1\.0\)"),  # an H100, a Triton before 2.2
])  # fmt: skip
def test_the_launch_refuses_an_fp8_cache_where_triton_cannot_convert_it(monkeypatch, capability, triton_knows_fp8,
                                                                       refusal):  # fmt: skip
    """The kernel refuses in one line, naming what is missing and kv_cache_dtype='int8'; and the cache's reader does
    not ask it there (features/quantization/kv.py then reads through the copy), while int8 is read in place."""
    from virtual_gpu import on_cuda, virtual_gpu

    monkeypatch.setattr(ta, "FP8_IN_TRITON", triton_knows_fp8)
    monkeypatch.setattr(ta.triton, "__version__", "2.1.0")
    with virtual_gpu(monkeypatch) as mode:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
        q, k_cache, v_cache = on_cuda(mode, (torch.zeros(1, 2, 16, dtype=torch.bfloat16),
                                             *(torch.zeros(2, 4, 1, 16, dtype=torch.uint8) for _ in range(2))))
        meta = on_cuda(mode, (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                              torch.tensor([[0]], dtype=torch.int32)))  # fmt: skip
        with pytest.raises(RuntimeError, match=rf"fp8 KV cache .* needs {refusal}; use kv_cache_dtype='int8'"):
            ta.paged_attention_triton_8bit(q, k_cache, v_cache, *meta, 0.25, "fp8")
        assert not ta.reads_in_place(q, "fp8") and ta.reads_in_place(q, "int8")


def test_an_oversized_tile_is_reported_over_the_limit(results):
    r = results[OVERSIZED]
    assert r.error is None, r.error
    assert r.over_limit and r.shared > kc.SMEM_LIMIT[90], r.shared


def test_a_kernel_that_does_not_compile_is_reported(results):
    assert results[UNCOMPILABLE].error is not None


def test_the_table_names_every_target_and_flags_what_is_over(results):
    text = kc.table(list(results.values()))
    assert "sm_80 (A100; 163 KB)" in text and "sm_90 (H100; 227 KB)" in text
    assert "**over the limit**" in text and "**fails**" in text


@pytest.mark.parametrize("version, refused", [("3.3.1", True), ("3.4.0", True), ("3.5.0", False), ("3.10.0", False)])
def test_fp64_is_refused_on_an_older_triton(monkeypatch, version, refused):
    monkeypatch.setattr(ta.triton, "__version__", version)
    if refused:
        with pytest.raises(RuntimeError, match=rf"needs triton>=3\.5 \(installed: {version}\)"):
            ta._check_fp64_supported()
    else:
        ta._check_fp64_supported()


def test_the_launch_refuses_fp64_on_a_gpu_with_an_older_triton(monkeypatch):
    """The refusal is on the launch path (on tests/virtual_gpu.py's stand-in GPU: the launch stops first)."""
    from virtual_gpu import on_cuda, virtual_gpu

    monkeypatch.setattr(ta.triton, "__version__", "3.4.0")
    with virtual_gpu(monkeypatch) as mode:
        q, k_cache, v_cache = on_cuda(mode, (torch.zeros(1, 2, 16, dtype=torch.float64),
                                             *(torch.zeros(2, 4, 1, 16, dtype=torch.float64) for _ in range(2))))
        meta = on_cuda(mode, (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                              torch.tensor([[0]], dtype=torch.int32)))  # fmt: skip
        with pytest.raises(RuntimeError, match=r"needs triton>=3\.5 \(installed: 3\.4\.0\)"):
            ta.paged_attention_triton(q, k_cache, v_cache, *meta, 0.25)
