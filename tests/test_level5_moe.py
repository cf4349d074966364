"""Level 5 with a mixture of experts (features/moe/parallel.py): where the experts live, what travels.

What it is (the greedy equivalence against the oracle, TP=2, EP=2 and EP=2 x PP=2 on Mixtral and
Qwen2-MoE checkpoints, is in test_equivalence.py):
  - sharding: under TP every expert's gate/up rows and down columns, gathered over the ranks,
    give back the checkpoint's tensors; under EP each rank holds whole experts, every expert
    exactly once over the ranks (Mixtral's w1/w3/w2 read under their own names), and the
    router and a shared expert on every rank;
  - the messages: an EP run sends its MoE traffic as all-to-alls and an all-gather and no
    all-reduce of the MoE block; a TP run the opposite; EP's all-to-all bytes equal the rows
    its routing sends to the other rank (counted here from the router's own choices), both ways;
    every call recorded on both ranks in the same order, and `waited` splitting their time into
    the transfer (per call, the least any rank spent) and the wait; `fit_alpha_beta` recovers a
    known alpha and beta, and a constant-size message's alpha alone;
  - the expert map (`expert_ranges`): contiguous, the remainder on the first ranks, none on the
    last ones when experts are fewer than ranks; an uneven EP stage loads exactly its range, and
    a rank holding no expert still serves (level 0's tokens).
"""

from __future__ import annotations

import pytest
import torch
from test_level5 import NoComm, full

from features.moe.parallel import ExpertParallelMoE, TensorParallelMoE, expert_ranges
from level0_naive import SamplingParams
from level0_naive.loader import checkpoint_name, load_metadata
from level5_multigpu import LLM
from level5_multigpu.layers import ShardReader
from level5_multigpu.model import StageModel
from level5_multigpu.parallel_state import Topology, fit_alpha_beta, waited

pytestmark = pytest.mark.level5

GREEDY = dict(temperature=0, ignore_eos=True)


def stage(path, tp: int, rank: int, ep: bool) -> StageModel:
    cfg = load_metadata(path).config
    return StageModel(cfg, ShardReader(path, torch.float64, "cpu"), NoComm(Topology(tp, 1, rank)),
                      range(cfg.num_layers), expert_parallel=ep)  # fmt: skip


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_tp_slices_every_expert_and_ep_places_whole_ones(checkpoint_factory, arch):
    path = checkpoint_factory(arch)
    cfg = load_metadata(path).config
    mtype = "mixtral" if arch == "mixtral" else "qwen2_moe"
    ck = lambda name: full(path, checkpoint_name(name, mtype))  # noqa: E731
    for ep in (False, True):
        ranks = [stage(path, 2, r, ep) for r in range(2)]
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}.mlp"
            blocks = [s.model.layers[i].mlp for s in ranks]
            if not cfg.moe.is_moe_layer(i):  # qwen2_moe's layer 1 is dense: level 5's ParallelMLP
                assert not any(isinstance(b, (TensorParallelMoE, ExpertParallelMoE)) for b in blocks)
                continue
            assert all(isinstance(b, ExpertParallelMoE if ep else TensorParallelMoE) for b in blocks)
            for b in blocks:
                assert torch.equal(b.gate.weight, ck(f"{p}.gate.weight"))  # the router: on every rank
            if ep:
                held = {b.first + j: e for b in blocks for j, e in enumerate(b.experts)}
                assert sorted(held) == list(range(cfg.moe.num_experts))  # each expert once
                for e, expert in held.items():
                    gate, up = expert.gate_up.weight.chunk(2)
                    assert torch.equal(gate, ck(f"{p}.experts.{e}.gate_proj.weight"))
                    assert torch.equal(up, ck(f"{p}.experts.{e}.up_proj.weight"))
                    assert torch.equal(expert.down_proj.weight, ck(f"{p}.experts.{e}.down_proj.weight"))
            else:
                for e in range(cfg.moe.num_experts):
                    gate, up = zip(*(b.experts[e].gate_up.weight.chunk(2) for b in blocks))
                    assert torch.equal(torch.cat(gate), ck(f"{p}.experts.{e}.gate_proj.weight"))
                    assert torch.equal(torch.cat(up), ck(f"{p}.experts.{e}.up_proj.weight"))
                    down = torch.cat([b.experts[e].down_proj.weight for b in blocks], dim=1)
                    assert torch.equal(down, ck(f"{p}.experts.{e}.down_proj.weight"))
            if cfg.moe.shared_expert_intermediate_size:
                w = [b.shared_expert.down_proj.weight for b in blocks]
                want = ck(f"{p}.shared_expert.down_proj.weight")
                assert torch.equal(w[0], want) and torch.equal(w[1], want) if ep else torch.equal(torch.cat(w, 1), want)


def moe_traffic(llm) -> dict:
    out = {}
    for _, (stats, _) in llm.comm_stats().items():
        for kind, (calls, nbytes, _) in stats.by_kind.items():
            c, b = out.get(kind, (0, 0))
            out[kind] = (c + calls, b + nbytes)
    return out


def test_ep_sends_tokens_and_tp_sums_activations(checkpoint_factory):
    path = checkpoint_factory("mixtral")
    cfg = load_metadata(path).config
    prompt = [5, 9, 13, 17, 21, 25, 29]  # one prefill of 7 tokens: rank 0 routes 4 of them, rank 1 three
    with LLM(path, dtype="float64", tensor_parallel_size=2, enable_expert_parallel=True, max_model_len=64) as llm:
        llm.llm_engine.executor.collective_rpc("record_calls", True)
        llm.generate([prompt], SamplingParams(max_tokens=1, **GREEDY), progress=False)
        records = llm.llm_engine.executor.collective_rpc("record_calls", False)
        ep = moe_traffic(llm)
        assert llm.llm_engine.executor.collective_rpc("record_calls", False) == [[], []]  # recording stopped
    # Both ranks made the same MoE calls in the same order, as many as the counters say.
    moe_kinds = {"all_to_all_counts", "all_to_all", "all_gather"}
    sequences = [[k for k, _ in r if k in moe_kinds] for r in records]
    assert sequences[0] == sequences[1] and sequences[0].count("all_to_all") * 2 == ep["all_to_all"][0]
    assert waited(records, "all_to_all")[0] > 0  # the calls were recorded with their times
    with LLM(path, dtype="float64", tensor_parallel_size=2, max_model_len=64) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=1, **GREEDY), progress=False)
        tp = moe_traffic(llm)
    assert "moe_all_reduce" not in ep and {"all_to_all", "all_gather"} <= set(ep)
    assert "moe_all_reduce" in tp and "all_to_all" not in tp and "all_gather" not in tp
    assert tp["moe_all_reduce"][0] == 2 * cfg.num_layers  # one per MoE layer, on each of the two ranks
    assert ep["all_to_all"][0] == 3 * 2 * cfg.num_layers  # per layer and rank: the rows, their expert ids, back
    # The rows that leave a rank, by the router's own choices (level 0 routes the same tokens the same way).
    from level0_naive.kv_cache import Slab, SlabAttention
    from level0_naive.loader import load_model

    ref = load_model(path, torch.float64)
    ids = torch.tensor(prompt)
    ref.model(ids, torch.arange(len(prompt)), SlabAttention([Slab(ref.config, 7, torch.float64, "cpu")],
                                                            torch.tensor([0, 7])))  # fmt: skip
    off_rank = 0
    for layer in ref.model.model.layers:
        choices = layer.mlp.last_ids  # [7, k]
        owner_of_token = torch.tensor([0] * 4 + [1] * 3)[:, None]  # rows 0-3 on rank 0, 4-6 on rank 1
        off_rank += int((choices // (cfg.moe.num_experts // 2) != owner_of_token).sum())
    row, eid = cfg.hidden_size * 8, 8  # a float64 row, an int64 expert id
    assert ep["all_to_all"][1] == off_rank * (row + eid) + off_rank * row  # dispatch (rows + ids), combine (rows)


@pytest.mark.parametrize("experts, ranks, want", [
    (4, 2, [[0, 1], [2, 3]]),
    (5, 2, [[0, 1, 2], [3, 4]]),  # the remainder on the first ranks, as vLLM's determine_expert_map
    (8, 3, [[0, 1, 2], [3, 4, 5], [6, 7]]),
    (7, 4, [[0, 1], [2, 3], [4, 5], [6]]),
    (3, 3, [[0], [1], [2]]),
    (2, 3, [[0], [1], []]),  # fewer experts than ranks: the last ranks hold none
])  # fmt: skip
def test_expert_map(experts, ranks, want):
    assert [list(h) for h in expert_ranges(experts, ranks)] == want


@pytest.mark.parametrize("experts", [5, 3, 1])
def test_uneven_experts_load_by_the_map(checkpoint_factory, experts):
    """Each rank reads exactly its range's experts from the checkpoint (Mixtral's names);
    with 1 expert on 2 ranks, rank 1 holds none (the old code refused any E % tp != 0)."""
    path = checkpoint_factory("mixtral", num_local_experts=experts, num_experts_per_tok=min(2, experts))
    cfg = load_metadata(path).config
    ck = lambda name: full(path, checkpoint_name(name, "mixtral"))  # noqa: E731
    ranks = [stage(path, 2, r, ep=True) for r in range(2)]
    for i in range(cfg.num_layers):
        blocks = [s.model.layers[i].mlp for s in ranks]
        held = [list(range(b.first, b.first + len(b.experts))) for b in blocks]
        assert held == [list(h) for h in expert_ranges(experts, 2)]
        for b, ids in zip(blocks, held):
            for e, expert in zip(ids, b.experts):
                w = ck(f"model.layers.{i}.mlp.experts.{e}.down_proj.weight")
                assert torch.equal(expert.down_proj.weight, w)


def test_a_rank_without_experts_routes_and_sends_only(checkpoint_factory):
    """1 expert on 2 ranks: rank 1 holds none, sends all its rows to rank 0 and gets them back
    (an all-to-all with zero rows one way); the tokens equal level 0's."""
    import level0_naive

    path = checkpoint_factory("mixtral", num_local_experts=1, num_experts_per_tok=1)
    prompts, params = [[5, 9, 13, 17, 21, 25, 29], [3, 4]], SamplingParams(max_tokens=4, **GREEDY)
    ref = level0_naive.LLM(path, dtype="float64")
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params, progress=False)]
    with LLM(path, dtype="float64", tensor_parallel_size=2, enable_expert_parallel=True, max_model_len=64) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, progress=False)]
    assert got == want


def test_wire_time_is_the_least_any_rank_spent_per_call():
    # Two ranks, three calls of one kind (and another kind between, ignored): rank 0 came last to
    # the first two calls, rank 1 to the third.
    rank0 = [("all_to_all", 1.0), ("all_gather", 9.0), ("all_to_all", 2.0), ("all_to_all", 5.0)]
    rank1 = [("all_to_all", 3.0), ("all_gather", 9.0), ("all_to_all", 6.0), ("all_to_all", 1.0)]
    wire, wait = waited([rank0, rank1], "all_to_all")
    assert wire == 1.0 + 2.0 + 1.0
    assert wait == (2.0 + 4.0 + 3.0) - wire  # the ranks' mean time in the calls, less the transfer


def test_alpha_beta_fit():
    sizes, xs = [1, 2, 3, 4], [4.0, 1e3, 1e5, 1e6]
    fit = fit_alpha_beta(sizes, xs, [1e-3 + 2e-9 * x for x in xs])  # exactly linear: recovered exactly
    assert fit["alpha_s"] == pytest.approx(1e-3) and fit["beta_s_per_byte"] == pytest.approx(2e-9)
    # On relative errors the small messages keep alpha when a large one was slow (a descheduled call):
    # here plain least squares would put alpha 31 % high (1.31 ms), this fit within 5 %.
    xs = [4.0, 1024.0, 16384.0, 262144.0, 1048576.0]
    noisy = [(2.0 if x == 262144.0 else 1.0) * (1e-3 + 2e-9 * x) for x in xs]
    assert fit_alpha_beta([1] * 5, xs, noisy)["alpha_s"] == pytest.approx(1e-3, rel=0.05)
    same = fit_alpha_beta([1, 1], [8.0, 8.0], [1e-3, 3e-3])  # one size (the row counts): alpha alone
    assert same["beta_s_per_byte"] == 0 and 1e-3 < same["alpha_s"] < 3e-3
