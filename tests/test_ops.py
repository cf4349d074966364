"""The ops seam (level0_naive/ops.py): every linear and norm of the model goes through it.

What it is:
  - the default ops change nothing: logits equal, bit for bit, a forward written with
    `torch.nn.functional` and HF's RMSNorm formula and no ops object (float32 and bfloat16,
    where a different kernel or order would show);
  - a swapped-in `Ops` is the one used: a counting subclass sees exactly layers x 7
    projections + the LM head linears and layers x 2 (+ 2 q/k norms) + 1 norms per forward,
    and the logits stay identical; a float64-linear subclass changes them (slightly);
    `set_ops(DEFAULT_OPS)` brings the exact logits back;
  - level 5's sharded model goes through the same seam: 4 fused linears per layer + the head;
  - the compiled CPU fast path (`cpu_ops.CpuOps`) against its default twin: RoPE bit for bit
    in every dtype (strided q|k slices too), RMSNorm within a few ulps (its own fixed sum
    order) and row by row the same bits however many rows come with it; a whole model's
    logits within float32 noise and its greedy text unchanged; `ops=` resolved as documented.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB

from features.cpu_kernels import ops as cpu_ops
from level0_naive import load_model
from level0_naive.kv_cache import Slab, SlabAttention
from level0_naive.model import apply_rope
from level0_naive.ops import DEFAULT_OPS, Ops

pytestmark = pytest.mark.level0

PROMPTS = [[5, 17, 3, 90, 41, 8, 2], [60, 1, 33]]


def forward(model, dtype, fn=None) -> torch.Tensor:
    """One flattened forward over PROMPTS (fresh slabs): logits [sum(len), V]; `fn` replaces the model's."""
    slabs = [Slab(model.config, len(p), dtype, "cpu") for p in PROMPTS]
    attn = SlabAttention(slabs, torch.tensor([0, len(PROMPTS[0]), len(PROMPTS[0]) + len(PROMPTS[1])]))
    ids = torch.tensor([t for p in PROMPTS for t in p])  # [T]
    pos = torch.tensor([i for p in PROMPTS for i in range(len(p))])  # [T]
    with torch.no_grad():
        return (fn or (lambda *a: model.compute_logits(model(*a))))(ids, pos, attn)


def plain_forward(net, ids, pos, attn) -> torch.Tensor:
    """Level 0's forward with torch.nn.functional and HF's RMSNorm, no ops object anywhere."""

    def norm(x, m):  # HF's LlamaRMSNorm.forward
        x32 = x.to(torch.float32)
        return m.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + m.eps)).to(x.dtype)

    def lin(x, m):
        return F.linear(x, m.weight, m.bias)

    x = net.model.embed_tokens(ids)  # [T, hidden]
    T, (cos, sin) = x.shape[0], net.rope(pos, x.dtype)
    for layer in net.model.layers:
        a, m, h = layer.self_attn, layer.mlp, norm(x, layer.input_layernorm)
        q, k, v = (lin(h, p).view(T, -1, a.d) for p in (a.q_proj, a.k_proj, a.v_proj))  # [T, H, D]
        if hasattr(a, "q_norm"):
            q, k = norm(q, a.q_norm), norm(k, a.k_norm)
        out = attn(a.layer, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)  # [T, Hq, D]
        x = x + lin(out.reshape(T, -1), a.o_proj)
        h = norm(x, layer.post_attention_layernorm)
        x = x + lin(F.silu(lin(h, m.gate_proj)) * lin(h, m.up_proj), m.down_proj)
    logits = lin(norm(x, net.model.norm), net.lm_head)  # [T, V]
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


class CountingOps(Ops):
    """The default ops, counting their calls."""

    def __init__(self):
        self.calls = {"linear": 0, "rms_norm": 0, "rope": 0}

    def linear(self, x, weight, bias=None):
        self.calls["linear"] += 1
        return super().linear(x, weight, bias)

    def rms_norm(self, x, weight, eps):
        self.calls["rms_norm"] += 1
        return super().rms_norm(x, weight, eps)

    def rope(self, q, k, cos, sin):
        self.calls["rope"] += 1
        return super().rope(q, k, cos, sin)


class Float64LinearOps(Ops):
    """Every matmul in float64, cast back: a different rounding, so float32 logits move a little."""

    def linear(self, x, weight, bias=None):
        y = super().linear(x.double(), weight.double(), None if bias is None else bias.double())
        return y.to(x.dtype)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain, QKV bias + tied head, q/k norms
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_ops_are_bit_identical_to_plain_torch(arch, dtype, checkpoint_factory):
    model = load_model(checkpoint_factory(arch), dtype).model
    assert all(m.ops is DEFAULT_OPS for m in model.modules() if hasattr(m, "ops"))
    ours = forward(model, dtype)
    assert torch.equal(ours, forward(model, dtype, lambda *a: plain_forward(model, *a)))
    assert ours.shape == (sum(map(len, PROMPTS)), VOCAB)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_swapped_in_ops_is_used_by_every_linear_and_norm(arch, checkpoint_factory):
    model = load_model(checkpoint_factory(arch), torch.float32).model
    cfg, want = model.config, forward(model, torch.float32)
    counting = CountingOps()
    model.set_ops(counting)
    assert model.ops is counting
    got = forward(model, torch.float32)
    L = cfg.num_layers
    norms = 2 * L + 1 + (2 * L if cfg.qk_norm else 0)  # input, post-attention (+ q, k) per layer; final
    assert counting.calls == {"linear": 7 * L + 1, "rms_norm": norms, "rope": L}  # q k v o gate up down per layer; head
    assert torch.equal(got, want), "counting delegates to the defaults: the logits must not move"

    model.set_ops(Float64LinearOps())
    moved = forward(model, torch.float32)
    assert not torch.equal(moved, want), "float64 matmuls round differently: the logits must move"
    torch.testing.assert_close(moved, want, rtol=1e-4, atol=1e-4)

    model.set_ops(DEFAULT_OPS)
    assert torch.equal(forward(model, torch.float32), want)


class OneRank:
    """The Comm of a 1-rank world: collectives are the identity."""

    def __init__(self):
        from level5_multigpu.parallel_state import Topology

        self.topo = Topology(1, 1, 0)

    def all_reduce(self, x):
        return x

    def gather_to_first(self, x):
        return x


@pytest.mark.level5
def test_level5_sharded_layers_go_through_the_seam(checkpoint_factory):
    from level5_multigpu.layers import ShardReader
    from level5_multigpu.model import StageModel

    path = checkpoint_factory("qwen2")  # biases on q, k, v; tied head
    loaded = load_model(path, torch.float32)
    want, cfg, counting = forward(loaded.model, torch.float32), loaded.config, CountingOps()
    reader = ShardReader(path, torch.float32, "cpu")
    got = forward(StageModel(cfg, reader, OneRank(), range(cfg.num_layers), ops=counting), torch.float32)
    L = cfg.num_layers
    assert counting.calls == {
        "linear": 4 * L + 1,
        "rms_norm": 2 * L + 1,
        "rope": L,
    }  # [q|k|v], o, [gate|up], down; head
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fused matmuls may round differently


# --- the CPU fast path (features/cpu_kernels/ops.py) -----------------------------------------------
needs_cpu_ops = pytest.mark.skipif(
    not cpu_ops.LIBRARY.available(), reason=f"cpu_ops.cpp did not build: {cpu_ops.LIBRARY.error}"
)


@contextlib.contextmanager
def no_torch_fallback():
    """While active, CpuOps' default twins raise: a test inside it exercised the compiled kernels."""

    def refuse(*args, **kwargs):
        raise AssertionError("CpuOps fell back to the torch formula")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Ops, "rms_norm", refuse)
        m.setattr(Ops, "rope", refuse)
        yield


@needs_cpu_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cpu_rope_is_bit_identical_to_the_default(dtype):
    """Contiguous q and k, and q, k as column slices of one [T, (Hq + 2 Hkv) D] tensor (level 5's q|k|v)."""
    g = torch.Generator().manual_seed(0)
    T, hq, hkv, d = 37, 4, 2, 64
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g).to(dtype)  # [T, (Hq + 2 Hkv) D]
    angles = torch.randn(T, d // 2, generator=g) * 50  # [T, D/2]: large angles, as far positions have
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    sliced = qkv[:, : hq * d].view(T, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(T, hkv, d)
    cases = [sliced, (sliced[0].contiguous(), sliced[1].contiguous())]
    wants = [DEFAULT_OPS.rope(q, k, cos, sin) for q, k in cases]
    with no_torch_fallback():  # the compiled path, not its fallback, is what equals PyTorch here
        for (q, k), want in zip(cases, wants):
            assert all(torch.equal(a, b) for a, b in zip(cpu_ops.CpuOps().rope(q, k, cos, sin), want))


@needs_cpu_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_rms_norm_is_close_to_the_default_and_row_invariant(dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 256, generator=g) * 3).to(dtype)  # [T, hidden]
    w = torch.randn(256, generator=g).to(dtype)
    ops = cpu_ops.CpuOps()
    want = DEFAULT_OPS.rms_norm(x, w, 1e-5)
    with no_torch_fallback():
        got = ops.rms_norm(x, w, 1e-5)
        rows = [ops.rms_norm(x[:n], w, 1e-5) for n in (1, 3, 17)]
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(got, want, rtol=4 * ulp, atol=4 * ulp)
    for r in rows:  # the first n rows alone: the same bits as among 64
        assert torch.equal(r, got[: len(r)])
    heads = x.view(64, 4, 64)  # [T, H, D]: Qwen3's per-head q/k norm
    torch.testing.assert_close(ops.rms_norm(heads, w[:64], 1e-6), DEFAULT_OPS.rms_norm(heads, w[:64], 1e-6),
                               rtol=4 * ulp, atol=4 * ulp)  # fmt: skip


@needs_cpu_ops
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_model_on_the_cpu_fast_path_matches_the_default(arch, checkpoint_factory):
    """float32 logits within noise; float64 (the equivalence tests' dtype) bit for bit, since
    CpuOps keeps HF's float32 RMSNorm formula there and its RoPE is exact."""
    path = checkpoint_factory(arch)
    for dtype in (torch.float32, torch.float64):
        default = load_model(path, dtype).model
        fast = load_model(path, dtype, ops=cpu_ops.CpuOps()).model
        want, got = forward(default, dtype), forward(fast, dtype)
        if dtype == torch.float64:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_ops_setting_resolves_as_documented(monkeypatch, caplog):
    cpu = torch.device("cpu")
    assert cpu_ops.resolve_ops("torch", cpu) is DEFAULT_OPS
    with pytest.raises(ValueError, match="ops='fast' is not one of"):
        cpu_ops.resolve_ops("fast", cpu)
    if cpu_ops.LIBRARY.available():
        assert isinstance(cpu_ops.resolve_ops("auto", cpu), cpu_ops.CpuOps)

    def no_compiler():
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(cpu_ops.LIBRARY, "build", no_compiler)
    cpu_ops.LIBRARY.reset()
    try:
        with caplog.at_level("WARNING", logger="features.cpu_kernels.native"):
            assert cpu_ops.resolve_ops("auto", cpu) is DEFAULT_OPS  # a missing compiler is never an error ...
            assert cpu_ops.resolve_ops("auto", cpu) is DEFAULT_OPS
        with pytest.raises(RuntimeError, match="ops='cpu'.*command not found"):  # ... unless asked for by name
            cpu_ops.resolve_ops("cpu", cpu)
    finally:
        cpu_ops.LIBRARY.reset()
    lines = [r.getMessage() for r in caplog.records if r.name == "features.cpu_kernels.native"]
    assert len(lines) == 1 and "cpu_ops.cpp" in lines[0] and "command not found" in lines[0]
