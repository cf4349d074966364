"""Mixtures of experts (features/moe/layer.py): routing, the two expert paths, the permutation.

What it is:
  - routing ties: two experts with identical router rows tie on every token; our top-k picks
    what Hugging Face's picks (the logits still equal theirs to 1e-12), and the tie is real;
  - `moe_naive` (a token and an expert at a time) equals `moe_grouped` (sorted by expert, one
    matmul per expert) on random routings, float64, including experts no token chose;
  - `dispatch` then `combine` is the identity for random routings (a property test): every slot
    appears once, rows come back to their own tokens, weighted;
  - a Mixtral checkpoint's w1/w3/w2 names map to the model's and back.
The logits of random Mixtral, Qwen2-MoE and Qwen3-MoE checkpoints against transformers' are in
test_level0.py (ARCHS); the greedy equivalence at levels 0-4 in test_equivalence.py; expert
parallelism at level 5 in test_level5_moe.py.

What it is not: a speed test (`python -m benchmarks.parallel --moe` compares the two paths).
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from features.moe.config import MoEConfig
from features.moe.layer import SparseMoE, combine, dispatch, route
from level0_naive.loader import checkpoint_name, load_model, our_name
from level0_naive.model import MLP, Linear, ModelConfig

pytestmark = pytest.mark.level0


def small_moe(num_experts=4, k=2, d=16, ff=24, seed=0, shared=0) -> SparseMoE:
    moe = MoEConfig(num_experts=num_experts, num_experts_per_tok=k, moe_intermediate_size=ff, norm_topk_prob=True,
                    shared_expert_intermediate_size=shared)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=d, intermediate_size=ff, num_layers=1, num_heads=2,
                      num_kv_heads=2, head_dim=8, moe=moe)  # fmt: skip
    torch.manual_seed(seed)
    moe = SparseMoE(cfg, MLP, Linear).to(torch.float64)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return moe


@pytest.mark.parametrize("shared", [0, 20])
@pytest.mark.parametrize("T", [1, 5, 64])
def test_the_naive_and_the_grouped_paths_are_equal(T, shared):
    moe = small_moe(num_experts=6, k=2, shared=shared)
    x = torch.randn(T, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(T))
    grouped = moe(x)
    moe.grouped = False
    naive = moe(x)
    torch.testing.assert_close(grouped, naive, rtol=1e-12, atol=1e-12)
    if T == 1:
        assert len(set(moe.last_ids[0].tolist())) == 2  # one token: four of six experts get nothing


@st.composite
def routings(draw):
    """(E, k, choices): T tokens, each with k distinct experts of E (so some experts may get none)."""
    e = draw(st.integers(1, 7), label="experts")
    k = draw(st.integers(1, min(e, 3)), label="k")
    t = draw(st.integers(1, 12), label="tokens")
    return e, k, [draw(st.permutations(range(e)))[:k] for _ in range(t)]


@given(routing=routings(), seed=st.integers(0, 2**16))
def test_dispatch_then_combine_is_the_identity(routing, seed):
    """Rows sorted by expert (experts that get no token included), then put back: each token gets
    exactly the weighted sum of its own k rows."""
    E, k, choices = routing
    T = len(choices)
    ids = torch.tensor(choices)  # [T, k], k distinct experts per token
    g = torch.Generator().manual_seed(seed)
    weights = torch.rand(T, k, dtype=torch.float64, generator=g)
    x = torch.randn(T, 3, dtype=torch.float64, generator=g)
    order, counts = dispatch(ids, E)
    assert sorted(order.tolist()) == list(range(T * k)) and sum(counts) == T * k and len(counts) == E
    experts_in_order = ids.reshape(-1)[order].tolist()
    assert experts_in_order == sorted(experts_in_order)  # grouped by expert
    assert experts_in_order == [e for e in range(E) for _ in range(counts[e])]
    rows = x[order // k]  # [T*k, 3], what the experts would receive
    back = combine(rows, order, weights, T)  # identity experts: out[t] = sum_j w[t, j] * x[t]
    torch.testing.assert_close(back, x * weights.sum(1, keepdim=True), rtol=1e-13, atol=1e-13)


def test_routing_is_softmax_top_k_in_float32_then_renormalised():
    logits = torch.tensor([[2.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    w, ids = route(logits, 2, True, torch.float64)
    assert ids.tolist() == [[0, 1]] or ids.tolist() == [[0, 2]]  # a tie between 1 and 2: topk's choice
    p = torch.softmax(logits.float(), -1)[0]
    assert w.dtype == torch.float64
    torch.testing.assert_close(w[0, 0].item(), (p[0] / (p[0] + p[1])).item())


def test_top_k_ties_are_broken_as_hugging_face_breaks_them(checkpoint_factory, oracle, tmp_path):
    """Router rows 1 and 2 made identical: experts 1 and 2 tie on every token. Where the pair
    straddles the top-2 boundary, top-k's tie-break picks which expert runs (their weights differ,
    so the other pick would change the logits)."""
    src = checkpoint_factory("mixtral")
    path = tmp_path / "tied"
    path.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (path / f.name).write_bytes(f.read_bytes())
    state = load_file(src / "model.safetensors")
    for i in range(2):
        gate = state[f"model.layers.{i}.block_sparse_moe.gate.weight"]
        gate[2] = gate[1]
        gate[0] *= 0.01  # experts 1 and 2 are among the top two for most tokens
    save_file(state, path / "model.safetensors")
    loaded = load_model(path, torch.float64)
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3))
    from test_level0 import our_logits

    ours = our_logits(loaded, [prompt.tolist()])[0]
    ids = loaded.model.model.layers[0].mlp.last_ids  # [40, 2], this prompt's routing in layer 0
    decided = ((ids == 1) | (ids == 2)).sum(1) == 1  # one of the tied pair in, the other out: the tie decided it
    assert decided.sum() >= 3, ids
    theirs = oracle.model(path)(prompt[None]).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_mixtral_names_map_both_ways():
    name = "model.layers.3.block_sparse_moe.experts.7.w1.weight"
    ours = our_name(name, "mixtral")
    assert ours == "model.layers.3.mlp.experts.7.gate_proj.weight"
    assert checkpoint_name(ours, "mixtral") == name
    assert our_name("model.layers.3.block_sparse_moe.gate.weight", "mixtral") == "model.layers.3.mlp.gate.weight"
    assert checkpoint_name("model.layers.0.mlp.experts.0.down_proj.weight", "qwen3_moe").endswith("down_proj.weight")
