"""Multi-LoRA over level 5's ranks (features/lora/sharded.py): every rank holds its shard of every adapter,
the shards put together are the adapter, and mixed adapters over tp x pp ranks give PEFT's greedy tokens
with no message more than the base model's.

  - the shards (one process, no messages: StageModels built as test_level5 builds them): on every rank
    of tp 2 and 4, pp 1 and 2, each projection's A and B in a slot, put back together from the ranks
    (q, k, v, gate, up by their rows of B; o and down by their columns of A), equal the adapter's, KV
    heads replicated included, and a fused layer's B is block-diagonal (zeros off its pieces' blocks);
  - the engine: tp 2 (one KV head, replicated) and tp 2 x pp 2 (QKV biases, tied embeddings), three
    adapters and the base model mixed, two slots (so slots are reused), float64: PEFT's tokens; the
    messages by kind are the same count as the same batch without adapters (the delta rides the base's
    all-reduce);
  - S-LoRA's split (`fully_sharded_loras=True`): each rank's share (R/tp of a column layer's ranks, a row
    layer's outputs) put together is the adapter; over tp 2, PEFT's tokens for exactly two all-gathers and
    two all-reduces more per layer and step; a rank tp cannot split is a one-line error, and the server's
    flag reaches the engine.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from conftest import VOCAB
from test_equivalence import draft_checkpoint, kv_bytes
from test_level5 import NoComm
from test_lora import adapters, peft_oracle  # noqa: F401 (fixtures)

from features.lora import LoRAConfig, LoRARequest, LoRASlots
from features.lora.adapter import load_adapter, shapes
from features.lora.sharded import stage_targets
from level0_naive import SamplingParams
from level0_naive.loader import load_metadata
from level5_multigpu import LLM
from level5_multigpu.layers import ShardReader
from level5_multigpu.model import StageModel, partition_layers
from level5_multigpu.parallel_state import Topology

pytestmark = pytest.mark.level5


def put_back(full: torch.Tensor, part: torch.Tensor, where: tuple, what: str) -> None:
    """full[where] = part, which another rank may have written already (a replicated KV head): then the same."""
    seen = full[where]
    assert torch.isnan(seen).all() or torch.equal(seen, part), f"two ranks disagree on {what}"
    full[where] = part


@pytest.mark.parametrize("arch,tp", [("llama", 2), ("llama3", 2), ("qwen2", 2), ("llama", 4)])
def test_the_ranks_shards_put_together_are_the_adapter(arch, tp, checkpoint_factory, adapters):  # noqa: F811
    path, R, slot = checkpoint_factory(arch), 8, 1
    cfg = load_metadata(path).config
    for request, pp in itertools.product(adapters(arch), (1, 2)):
        adapter = load_adapter(request, cfg, R, torch.float64)
        r = adapter.rank
        got = {(i, m): (torch.full((r, n_in), torch.nan, dtype=torch.float64),
                        torch.full((n_out, r), torch.nan, dtype=torch.float64))
               for i in range(cfg.num_layers) for m, (n_in, n_out) in shapes(cfg).items()}  # fmt: skip
        for s, layers in enumerate(partition_layers(cfg.num_layers, pp)):
            for t in range(tp):
                stage = StageModel(
                    cfg, ShardReader(path, torch.float64, "cpu"), NoComm(Topology(tp, pp, s * tp + t)), layers
                )
                slots = LoRASlots(stage, LoRAConfig(max_loras=2, max_lora_rank=R), targets=stage_targets(stage))
                slots.load(slot, adapter)
                rest = {key: (slots.A[key][slot].clone(), slots.B[key][slot].clone()) for key in slots.A}
                for (layer, module), (key, j, at, piece) in slots.where.items():
                    (c0, c1), (o0, o1) = piece.cols, piece.rows
                    A_full, B_full = got[layer, module]
                    put_back(A_full, slots.A[key][slot, j * R : j * R + r], (slice(None), slice(c0, c1)), f"{module} A")
                    put_back(
                        B_full, slots.B[key][slot, at : at + o1 - o0, j * R : j * R + r], slice(o0, o1), f"{module} B"
                    )
                    rest[key][0][j * R : (j + 1) * R] = 0  # piece j's ranks (beyond r: zeros, checked below)
                    rest[key][1][at : at + o1 - o0, j * R : (j + 1) * R] = 0
                for key, (A_rest, B_rest) in rest.items():
                    assert not A_rest.any() and not B_rest.any(), f"{key}: something outside its pieces' blocks"
                for A in slots.A.values():  # ranks r..R of every piece: zeros (the padding of a smaller rank)
                    P = A.shape[1] // R
                    assert all(not A[slot, j * R + r : (j + 1) * R].any() for j in range(P))
                assert slots.scale[slot] == adapter.scale
        for (layer, module), (A_got, B_got) in got.items():
            assert not A_got.isnan().any() and not B_got.isnan().any(), f"no rank holds part of {module} {layer}"
            a, b = adapter.weights.get((layer, module), (torch.zeros_like(A_got), torch.zeros_like(B_got)))
            assert torch.equal(A_got, a) and torch.equal(B_got, b), (request.lora_name, pp, layer, module)


def calls_by_kind(llm) -> dict[str, int]:
    stats, _ = llm.comm_stats()[0]
    return {kind: calls for kind, (calls, _, _) in stats.by_kind.items()}


@pytest.mark.parametrize("arch,tp,pp,hard", [("llama3", 2, 1, False), ("qwen2", 2, 2, True)])
def test_adapters_over_ranks_give_peft_greedy_tokens(arch, tp, pp, hard, checkpoint_factory, adapters, peft_oracle):  # noqa: F811
    """tp 2, and then its messages: a batch on two adapters sends exactly what the same batch on the base
    model sends. tp 2 x pp 2 the hard way: a draft model (it runs without adapters, on the driver; the
    ranks verify with them), a KV budget of 24 tokens per rank (preemption), 8 tokens a step (chunked
    prefill), and the batch run twice (prefix hits)."""
    base, pool = checkpoint_factory(arch), adapters(arch)
    loras = [pool[0], pool[1], None, pool[2], pool[0], None, pool[1]]
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))] for _ in loras]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    draft = draft_checkpoint()  # its KV lives with rank 0, in rank 0's budget
    settings = dict(block_size=4, kv_cache_memory=kv_bytes(base, 24) // (tp * pp) + kv_bytes(draft, 24),
                    max_num_batched_tokens=8, speculative_config={"model": str(draft), "num_speculative_tokens": 2})  # fmt: skip
    settings = settings if hard else {}
    with LLM(base, dtype="float64", tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_lora=True, max_loras=2,
             max_lora_rank=8, distributed_timeout_s=100, **settings) as llm:  # fmt: skip
        for _ in range(2 if hard else 1):
            outs = llm.generate(prompts, params, lora_request=loras, progress=False)
            for prompt, lora, out in zip(prompts, loras, outs):
                assert out.outputs[0].token_ids == peft_oracle.greedy(base, lora and lora.lora_path, prompt, 5), lora
        assert llm.llm_engine.lora.loads >= 3, "two slots for three adapters: some slot was reused"
        if hard:
            assert sum(r.preempted for r in llm.llm_engine.step_log), "the KV budget was meant to preempt"
            return
        calls = []  # (the same steps either way: every prompt fits the first step, no draft, no preemption)
        for two in ([pool[0], pool[1], None] * 3)[: len(prompts)], None:
            before = calls_by_kind(llm)
            llm.generate(prompts, params, lora_request=two, progress=False)
            calls.append({k: n - before.get(k, 0) for k, n in calls_by_kind(llm).items()})
    assert calls[0] == calls[1], "LoRA over ranks sent messages of its own"
    assert calls[0]["all_reduce"] > 0


def test_over_a_pipeline_no_rank_reads_a_file_and_no_micro_batch_takes_anothers_slot(
    checkpoint_factory, adapters, peft_oracle, tmp_path  # noqa: F811
):
    """pp 2, one slot, two adapters in alternating requests: the admission rule counts the requests in flight, so
    a request waits while another adapter's runs (first come, first served: four runs of one adapter, four
    loads, as at level 3; counting only the schedulable ones, the two micro-batches took the slot from each other
    every step); and an adapter whose folder is deleted after its requests were added still runs (the ranks get
    the weights the driver read)."""
    import shutil

    base, pool = checkpoint_factory("llama"), adapters("llama")
    copy = LoRARequest("gone", 9, str(shutil.copytree(pool[0].lora_path, tmp_path / "gone")))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14, 15]]
    loras = [copy, pool[1], copy, pool[1]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(base, dtype="float64", pipeline_parallel_size=2, enable_lora=True, max_loras=1, max_lora_rank=8,
             distributed_timeout_s=100) as llm:  # fmt: skip
        engine = llm.llm_engine
        for i, (prompt, lora) in enumerate(zip(prompts, loras)):
            engine.add_request(str(i), prompt, params, lora_request=lora)
        shutil.rmtree(tmp_path / "gone")  # read and checked when added: the ranks never look for it
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        assert engine.lora.loads == 4, engine.lora.loads
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        path = pool[0].lora_path if lora is copy else lora.lora_path
        assert outs[str(i)].outputs[0].token_ids == peft_oracle.greedy(base, path, prompt, 6)


# --- S-LoRA's split: fully_sharded_loras=True ------------------------------------------------------------------
@pytest.mark.parametrize("arch,tp", [("llama3", 2), ("qwen2", 2), ("llama", 4)])
def test_fully_sharded_ranks_hold_a_tp_th_of_each_adapter_and_together_all_of_it(  # noqa: F811
    arch, tp, checkpoint_factory, adapters  # noqa: F811
):
    """S-LoRA's split (sharded.py): a column layer's A holds R/tp of each piece's ranks (rank t: [t*R/tp,
    (t+1)*R/tp)), a row layer's B only the rank's outputs; put back together over the ranks, every projection's
    A and B are the adapter's, and no rank holds more than its share."""
    path, R, slot = checkpoint_factory(arch), 8, 0
    cfg = load_metadata(path).config
    Rl = R // tp
    for request in adapters(arch):
        adapter = load_adapter(request, cfg, R, torch.float64)
        r = adapter.rank
        got = {(i, m): (torch.full((r, n_in), torch.nan, dtype=torch.float64),
                        torch.full((n_out, r), torch.nan, dtype=torch.float64))
               for i in range(cfg.num_layers) for m, (n_in, n_out) in shapes(cfg).items()}  # fmt: skip
        for t in range(tp):
            stage = StageModel(cfg, ShardReader(path, torch.float64, "cpu"), NoComm(Topology(tp, 1, t)),
                               range(cfg.num_layers))  # fmt: skip
            slots = LoRASlots(stage, LoRAConfig(max_loras=1, max_lora_rank=R),
                              targets=stage_targets(stage, fully_sharded=True, max_lora_rank=R))  # fmt: skip
            slots.load(slot, adapter)
            for (layer, module), (key, j, at, piece) in slots.where.items():
                (c0, c1), (o0, o1) = piece.cols, piece.rows
                A_full, B_full = got[layer, module]
                target = slots.targets[key]
                if target.by_ranks is not None:  # column layer: this rank's share of the ranks, whole B rows here
                    assert slots.A[key].shape[1] == len(target.pieces) * Rl
                    lo, hi = t * Rl, min((t + 1) * Rl, r)
                    if lo < hi:
                        put_back(A_full, slots.A[key][slot, j * Rl : j * Rl + hi - lo], (slice(lo, hi), slice(c0, c1)),
                                 f"{module} A")  # fmt: skip
                else:  # row layer: whole ranks of its columns, B only its outputs
                    assert target.by_outputs is not None and o1 - o0 < cfg.hidden_size
                    put_back(A_full, slots.A[key][slot, j * R : j * R + r], (slice(None), slice(c0, c1)), f"{module} A")
                put_back(B_full, slots.B[key][slot, at : at + o1 - o0, j * R : j * R + r], slice(o0, o1), f"{module} B")
        for (layer, module), (A_got, B_got) in got.items():
            assert not A_got.isnan().any() and not B_got.isnan().any(), f"no rank holds part of {module} {layer}"
            a, b = adapter.weights.get((layer, module), (torch.zeros_like(A_got), torch.zeros_like(B_got)))
            assert torch.equal(A_got, a) and torch.equal(B_got, b), (request.lora_name, layer, module)


def test_fully_sharded_adapters_give_peft_greedy_tokens_for_four_small_messages_a_layer(  # noqa: F811
    checkpoint_factory, adapters, peft_oracle  # noqa: F811
):
    """tp 2 (one KV head, replicated), S-LoRA's split: PEFT's tokens for three adapters and the base model mixed
    over two slots; against the same batch on the base model, each step sends exactly two all-gathers (the column
    layers' shrinks) and two all-reduces (the row layers') more per layer, and nothing else."""
    base, pool = checkpoint_factory("llama3"), adapters("llama3")
    loras = [pool[0], pool[1], None, pool[2], pool[0], None, pool[1]]
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))] for _ in loras]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    layers = load_metadata(base).config.num_layers
    with LLM(base, dtype="float64", tensor_parallel_size=2, enable_lora=True, max_loras=2, max_lora_rank=8,
             fully_sharded_loras=True, distributed_timeout_s=100) as llm:  # fmt: skip
        outs = llm.generate(prompts, params, lora_request=loras, progress=False)
        for prompt, lora, out in zip(prompts, loras, outs):
            assert out.outputs[0].token_ids == peft_oracle.greedy(base, lora and lora.lora_path, prompt, 5), lora
        calls, steps = [], []
        for two in ([pool[0], pool[1], None] * 3)[: len(prompts)], None:
            before, n = calls_by_kind(llm), len(llm.llm_engine.step_log)
            llm.generate(prompts, params, lora_request=two, progress=False)
            calls.append({k: c - before.get(k, 0) for k, c in calls_by_kind(llm).items()})
            steps.append(len(llm.llm_engine.step_log) - n)
    assert steps[0] == steps[1] > 0
    more = {k: calls[0].get(k, 0) - calls[1].get(k, 0) for k in calls[0].keys() | calls[1].keys()}
    assert {k: n for k, n in more.items() if n} == {"all_gather": 2 * layers * steps[0],
                                                    "lora_all_reduce": 2 * layers * steps[0]}, more  # fmt: skip


def test_fully_sharded_needs_a_rank_the_ranks_can_split(checkpoint_factory):
    from level6_serving.__main__ import engine_kwargs, parse_args

    flags = ["--model", "tiny-shakespeare", "--enable-lora", "--tensor-parallel-size", "2", "--fully-sharded-loras"]
    assert engine_kwargs(parse_args(flags))["fully_sharded_loras"] is True
    assert engine_kwargs(parse_args(flags[:-1]))["fully_sharded_loras"] is False
    with pytest.raises(ValueError, match=r"fully_sharded_loras: max_lora_rank=6 must be a multiple of tensor_parallel_size=4"):
        LLM(checkpoint_factory("llama"), dtype="float64", tensor_parallel_size=4, enable_lora=True, max_lora_rank=6,
            fully_sharded_loras=True)  # fmt: skip
