"""Lab 0's own checks: causal attention over a contiguous slab, without a model.

What it is: pytest tests that `python -m labs check 0` runs next to level 0's own tests.
Random q, k, v in float64 stand in for a model's layers; the truth is computed here by a
different route (an explicit lower-triangular mask, GQA as an index, one head at a time),
so a mistake in the student's `causal_attention` cannot also be in the truth.

What it is not: a test of the model (level 0's tests compare its logits with Hugging Face).

Reference: tests/test_level1_kernel.py's `dense_attention` (the same idea, for paged caches).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch

from level0_naive.kv_cache import Slab, SlabAttention, causal_attention


def truth(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int) -> torch.Tensor:
    """q [n, Hq, D] at positions context_len.., k, v [S, Hkv, D]: one head at a time, in float64."""
    n, hq, d = q.shape
    s, hkv = k.shape[0], k.shape[1]
    out = torch.empty(n, hq, d, dtype=torch.float64)
    visible = torch.ones(n, s, dtype=torch.bool).tril(context_len)  # row i sees keys 0 .. context_len + i
    for h in range(hq):
        kv = h // (hq // hkv)
        scores = q[:, h].double() @ k[:, kv].double().T / d**0.5  # [n, S]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[:, h] = probs @ v[:, kv].double()
    return out


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def test_causal_attention_equals_dense_attention():
    for seed, (n, ctx, hq, hkv, d) in enumerate([(1, 0, 4, 4, 8), (5, 0, 4, 2, 8), (3, 6, 8, 2, 16), (1, 9, 6, 3, 4)]):
        q, k, v = (
            rand(n, hq, d, seed=seed),
            rand(ctx + n, hkv, d, seed=100 + seed),
            rand(ctx + n, hkv, d, seed=200 + seed),
        )
        got = causal_attention(q, k, v, ctx)
        assert got.shape == (n, hq, d), f"expected [n, Hq, D] = {(n, hq, d)}, got {tuple(got.shape)}"
        torch.testing.assert_close(got.double(), truth(q, k, v, ctx), rtol=1e-10, atol=1e-10,
                                   msg=f"n={n} new queries over {ctx} cached keys, Hq={hq}, Hkv={hkv}")  # fmt: skip
    q32, k32 = rand(3, 4, 8, seed=7, dtype=torch.float32), rand(5, 2, 8, seed=8, dtype=torch.float32)
    got = causal_attention(q32, k32, k32, 2)
    assert got.dtype == torch.float32, f"float32 in, {got.dtype} out: return q's dtype"
    torch.testing.assert_close(got.double(), truth(q32, k32, k32, 2), rtol=1e-5, atol=1e-5)


def test_a_decode_sees_the_whole_context():
    """One new token at position 6 attends to all 7 keys: equal weights when every score is equal."""
    q = torch.zeros(1, 2, 4, dtype=torch.float64)  # scores all 0: the softmax is uniform over what is visible
    k = rand(7, 2, 4, seed=3)
    v = torch.arange(7, dtype=torch.float64)[:, None, None].expand(7, 2, 4).contiguous()  # key j carries value j
    got = causal_attention(q, k, v, 6)
    assert torch.allclose(got, torch.full_like(got, 3.0)), (
        f"a decode at position 6 should average the values of keys 0..6 (= 3.0), got {got[0, 0, 0].item():.3f}: "
        "the mask hides keys it should see"
    )


def cfg(layers=2, hkv=2, d=8):
    return SimpleNamespace(num_layers=layers, num_kv_heads=hkv, head_dim=d)


def test_prefill_then_decodes_equal_one_forward():
    """Prefill 4 tokens, then 3 decodes, through one slab and 2 layers: every step's output equals
    attention over the whole sequence so far, the slab holds every K/V, and `used` counts tokens."""
    layers, hq, hkv, d, total = 2, 4, 2, 8, 7
    q = [rand(total, hq, d, seed=10 + i) for i in range(layers)]
    k = [rand(total, hkv, d, seed=20 + i) for i in range(layers)]
    v = [rand(total, hkv, d, seed=30 + i) for i in range(layers)]
    slab = Slab(cfg(layers, hkv, d), 10, torch.float64, "cpu")
    for start, end in [(0, 4), (4, 5), (5, 6), (6, 7)]:
        attn = SlabAttention([slab], torch.tensor([0, end - start]))
        for layer in range(layers):
            got = attn(layer, q[layer][start:end], k[layer][start:end], v[layer][start:end])
            want = truth(q[layer][start:end], k[layer][:end], v[layer][:end], start)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10,
                                       msg=f"layer {layer}, tokens {start}..{end - 1} (slab.used was {start})")  # fmt: skip
        assert slab.used == start, f"slab.used changed during the forward: {slab.used}, expected {start} until commit()"
        attn.commit()
        assert slab.used == end, f"after commit() the slab holds {end} tokens, slab.used is {slab.used}"
    for layer in range(layers):
        assert torch.equal(slab.k[layer, :total], k[layer]) and torch.equal(slab.v[layer, :total], v[layer]), (
            f"layer {layer}'s slab does not hold the K/V of tokens 0..{total - 1} at their positions"
        )


def test_sequences_in_one_batch_stay_apart():
    """One flattened batch: a 3-token chunk of a sequence with 2 cached tokens, and a decode of one with 5."""
    hq, hkv, d = 4, 2, 8
    c = cfg(1, hkv, d)
    ka, va, kb, vb = (rand(n, hkv, d, seed=s) for n, s in [(5, 1), (5, 2), (6, 3), (6, 4)])
    qa, qb = rand(3, hq, d, seed=5), rand(1, hq, d, seed=6)
    a, b = Slab(c, 8, torch.float64, "cpu"), Slab(c, 8, torch.float64, "cpu")
    a.k[0, :2], a.v[0, :2], a.used = ka[:2], va[:2], 2
    b.k[0, :5], b.v[0, :5], b.used = kb[:5], vb[:5], 5
    qsl = torch.tensor(list(itertools.accumulate([3, 1], initial=0)))
    attn = SlabAttention([a, b], qsl)
    got = attn(0, torch.cat([qa, qb]), torch.cat([ka[2:], kb[5:]]), torch.cat([va[2:], vb[5:]]))
    torch.testing.assert_close(got[:3], truth(qa, ka, va, 2), rtol=1e-10, atol=1e-10, msg="sequence 0 (rows 0..2)")
    torch.testing.assert_close(got[3:], truth(qb, kb, vb, 5), rtol=1e-10, atol=1e-10, msg="sequence 1 (row 3)")
    attn.commit()
    assert (a.used, b.used) == (5, 6), f"after commit: used {(a.used, b.used)}, expected (5, 6)"
