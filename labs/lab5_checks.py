"""Lab 5's own checks: tensor-parallel layers on simulated ranks, threads of one process.

What it is: pytest tests that `python -m labs check 5` runs next to level 5's own tests.
`SimComm` gives each "rank" (a thread) the collectives `level5_multigpu.parallel_state.Comm`
has, meeting at a barrier: `all_reduce` sums every rank's tensor (in rank order, in place,
as torch.distributed does), `gather_to_first` concatenates on rank 0. So a layer's
forward runs exactly as on real ranks, in milliseconds and with no process to clean up,
and a rank that skips a collective is reported instead of hanging. The whole model is
checked on 2 and 4 simulated ranks against level 0's, on a random Llama with biases on
every projection (o_proj, gate/up/down), which the usual checkpoints do not have.

What it is not: a test of gloo or of the executor (level 5's tests run two real processes).

Reference: Megatron-LM section 3 (the f and g operators); vLLM `tests/distributed/`.
"""

from __future__ import annotations

import threading

import pytest
import torch

from level0_naive.kv_cache import causal_attention
from level5_multigpu.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    kv_heads_of_rank,
)
from level5_multigpu.parallel_state import CommStats, Topology

WAIT_S = 30.0


class Group:
    """What the ranks of one simulated TP group share: a barrier and one slot per rank."""

    def __init__(self, tp: int):
        self.tp, self.slots = tp, [None] * tp
        self.barrier = threading.Barrier(tp, timeout=WAIT_S)

    def exchange(self, rank: int, kind: str, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = (kind, x)
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()  # everyone has read before anyone writes the next round
        kinds = {k for k, _ in got}
        if len(kinds) > 1:
            raise RuntimeError(f"the ranks called different collectives at the same time: {sorted(kinds)}")
        return [t for _, t in got]


class SimComm:
    """One rank's view: the parts of `Comm` the layers use, over a `Group` of threads."""

    def __init__(self, group: Group, rank: int):
        self.group, self.topo, self.stats = group, Topology(group.tp, 1, rank), CommStats()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.group.exchange(self.topo.rank, "all_reduce", x.detach().clone())
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        self.stats.add("all_reduce", x.numel() * x.element_size(), 0.0)
        x.copy_(total)
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        parts = self.group.exchange(self.topo.rank, "gather", x.detach().contiguous().clone())
        self.stats.add("gather", x.numel() * x.element_size(), 0.0)
        return torch.cat(parts, dim=-1) if self.topo.rank == 0 else None


def on_ranks(tp: int, fn) -> list:
    """fn(rank, comm) on tp threads at once; its results in rank order, or the first rank's error."""
    group = Group(tp)
    comms = [SimComm(group, r) for r in range(tp)]
    results, errors = [None] * tp, [None] * tp

    def run(r):
        try:
            results[r] = fn(r, comms[r])
        except threading.BrokenBarrierError:
            errors[r] = RuntimeError(f"rank {r} waited {WAIT_S:.0f} s at a collective the other ranks never "
                                     f"reached: every rank must make the same calls in the same order")  # fmt: skip
            group.barrier.abort()
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors[r] = e
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=4 * WAIT_S)
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    return [*results, comms]


def rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_column_parallel_is_a_slice():
    w, b, x = rand(8, 6, seed=1), rand(8, seed=2), rand(3, 6, seed=3)
    full = x @ w.T + b
    *outs, comms = on_ranks(2, lambda r, c: ColumnParallelLinear(w[4 * r : 4 * r + 4], b[4 * r : 4 * r + 4])(x))
    for r, y in enumerate(outs):
        torch.testing.assert_close(y, full[:, 4 * r : 4 * r + 4], msg=f"rank {r}'s output columns")
    assert all(c.stats.calls == 0 for c in comms), "a column-parallel linear communicates nothing"


def test_row_parallel_sums_and_adds_the_bias_once():
    w, b, x = rand(6, 8, seed=4), rand(6, seed=5), rand(3, 8, seed=6)
    full = x @ w.T + b
    for tp in (2, 4):
        k = 8 // tp
        cols = lambda r, k=k: slice(k * r, k * (r + 1))  # noqa: E731  rank r's input features
        *outs, comms = on_ranks(tp, lambda r, c, cols=cols: RowParallelLinear(w[:, cols(r)], b, c)(x[:, cols(r)]))
        for r, y in enumerate(outs):
            torch.testing.assert_close(y, full, msg=f"tp={tp}, rank {r}: the sum of the partial products, plus b once")
        assert all(c.stats.by_kind.get("all_reduce", [0])[0] == 1 for c in comms), "exactly one all-reduce per rank"
    *outs, _ = on_ranks(2, lambda r, c: RowParallelLinear(w[:, 4 * r : 4 * r + 4], None, c)(x[:, 4 * r : 4 * r + 4]))
    torch.testing.assert_close(outs[0], x @ w.T, msg="without a bias")


def test_vocab_parallel_embedding_and_lm_head():
    vocab, hidden = 97, 8
    w = rand(vocab, hidden, seed=7)
    padded = torch.cat([w, torch.zeros(1, hidden, dtype=w.dtype)])  # 98 rows: 49 per rank
    ids = torch.tensor([0, 48, 49, 96, 5, 60])
    h = rand(3, hidden, seed=8)

    def rank(r, c):
        shard = padded[49 * r : 49 * (r + 1)].clone()
        emb = VocabParallelEmbedding(shard, 49 * r, 49 * (r + 1), c)(ids)
        logits = ParallelLMHead(shard, vocab, c)(h)
        return emb, logits

    *outs, _ = on_ranks(2, rank)
    for r, (emb, _) in enumerate(outs):
        torch.testing.assert_close(emb, w[ids], msg=f"rank {r}'s embedding after the all-reduce")
    assert outs[1][1] is None, "the LM head returns None off TP rank 0"
    logits = outs[0][1]
    assert logits is not None and logits.shape == (3, vocab), "rank 0: [N, vocab], the padding column dropped"
    torch.testing.assert_close(logits, h @ w.T, msg="the gathered logits")


def test_kv_heads_of_each_rank():
    assert [kv_heads_of_rank(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)], "4 KV heads on 2 ranks: split"
    assert [kv_heads_of_rank(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)], (
        "2 KV heads on 4 ranks: each head on 2 consecutive ranks"
    )
    assert [kv_heads_of_rank(1, 2, r) for r in range(2)] == [(0, 1), (0, 1)], "1 KV head: on every rank"
    with pytest.raises(ValueError):
        kv_heads_of_rank(2, 3, 0)  # 3 ranks cannot share 2 heads evenly


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory):
    """A random Llama (float64) with a bias on every projection, saved the Hugging Face way."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True,
                                   mlp_bias=True, tie_word_embeddings=False, max_position_embeddings=64,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))  # biases start at zero: give them values
    path = tmp_path_factory.mktemp("biased-llama")
    model.save_pretrained(path)
    return path


def test_whole_model_on_simulated_ranks(biased_llama):
    from level0_naive.loader import load_metadata, load_model
    from level5_multigpu.layers import ShardReader
    from level5_multigpu.model import StageModel

    dense = lambda layer, q, k, v: causal_attention(q, k, v, 0)  # noqa: E731  a fresh prompt: no cache needed
    ids, pos = torch.tensor([3, 17, 42, 96, 5, 60, 11]), torch.arange(7)
    whole = load_model(biased_llama, torch.float64).model
    with torch.inference_mode():
        want = whole.compute_logits(whole(ids, pos, dense))
    cfg = load_metadata(biased_llama).config
    for tp in (2, 4):

        def rank(r, c, tp=tp):
            stage = StageModel(cfg, ShardReader(biased_llama, torch.float64, "cpu"), c, range(cfg.num_layers))
            with torch.inference_mode():
                return stage.compute_logits(stage(ids, pos, dense))

        *outs, comms = on_ranks(tp, rank)
        assert outs[0] is not None and all(o is None for o in outs[1:]), "logits on TP rank 0 only"
        torch.testing.assert_close(outs[0], want, rtol=1e-9, atol=1e-9, msg=f"tp={tp}: logits against one rank")
        calls = comms[0].stats.by_kind.get("all_reduce", [0])[0]
        assert calls == 2 * cfg.num_layers + 1, f"tp={tp}: {calls} all-reduces in one forward, expected 2 per layer + 1"
