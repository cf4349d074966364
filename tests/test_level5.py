"""Level 5: the shards, the pipeline's micro-batches, a dying rank, and what the messages cost.

What it is (the equivalence suite in test_equivalence.py runs the layouts against the oracle):
  - sharding round trip: gathering every rank's shards gives back the checkpoint's tensors
    exactly (QKV by heads with KV heads replicated, gate/up per segment, a padded vocabulary);
  - micro-batches: no request is ever in two micro-batches in flight, and the pipeline fills
    (pp of them in flight, never more); an abort while its request is in flight frees its
    blocks at once, no token joins it afterwards, and everyone else's answers stay exact;
  - a rank killed mid-run makes the driver raise WorkerDiedError quickly, and no process is
    left behind; a script that builds its engine without `if __name__ == "__main__":` fails
    at once with an error naming the guard (spawn re-runs it in every rank), and with the
    guard the same script works;
  - the message counters match the model: two all-reduces per layer, one for the embedding,
    one gather of the logits, with the bytes the shapes say.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors import safe_open

import level3_prefix
from level0_naive import SamplingParams
from level0_naive.loader import load_metadata
from level5_multigpu import LLM, LLMEngine, WorkerDiedError
from level5_multigpu.layers import ShardReader, kv_heads_of_rank, padded_vocab
from level5_multigpu.model import StageModel, partition_layers
from level5_multigpu.parallel_state import Topology

pytestmark = pytest.mark.level5

GREEDY = dict(temperature=0, ignore_eos=True)


class NoComm:
    """What a StageModel needs of a Comm to be built (loading only; no message is sent)."""

    def __init__(self, topo: Topology):
        self.topo = topo


def full(path, name: str) -> torch.Tensor:
    reader = ShardReader(path, torch.float64, "cpu")
    with safe_open(reader.files[name], "pt") as f:
        return f.get_tensor(name).to(torch.float64)


@pytest.mark.parametrize("arch,tp", [("llama", 2), ("llama3", 2), ("qwen2", 2), ("qwen3", 2), ("llama", 4)])
def test_gathering_the_shards_gives_back_the_checkpoint(checkpoint_factory, arch, tp):
    """llama3 has 1 KV head (replicated on 2 ranks), llama with tp 4 has 2 (each on 2 ranks);
    qwen2 has QKV biases and tied embeddings; the vocabulary (97) needs padding."""
    path = checkpoint_factory(arch)
    cfg = load_metadata(path).config
    for pp in (1, 2):
        ranges = partition_layers(cfg.num_layers, pp)
        shards = {(s, t): StageModel(cfg, ShardReader(path, torch.float64, "cpu"), NoComm(Topology(tp, pp, s * tp + t)), ranges[s])
                  for s in range(pp) for t in range(tp)}  # fmt: skip
        d, V = cfg.head_dim, cfg.vocab_size
        for s, layers in enumerate(ranges):
            for local, i in enumerate(layers):
                p = f"model.layers.{i}"
                attn = [shards[s, t].model.layers[local].self_attn for t in range(tp)]
                q, k, v = zip(*(a.qkv_proj.weight.split(a.qkv_proj.sizes) for a in attn))
                assert torch.equal(torch.cat(q), full(path, f"{p}.self_attn.q_proj.weight"))
                heads = {}  # each KV head once, whichever rank holds it
                for t in range(tp):
                    k0, k1 = kv_heads_of_rank(cfg.num_kv_heads, tp, t)
                    for j, h in enumerate(range(k0, k1)):
                        heads[h] = (k[t][j * d : (j + 1) * d], v[t][j * d : (j + 1) * d])
                assert sorted(heads) == list(range(cfg.num_kv_heads))
                assert torch.equal(
                    torch.cat([heads[h][0] for h in sorted(heads)]), full(path, f"{p}.self_attn.k_proj.weight")
                )
                assert torch.equal(
                    torch.cat([heads[h][1] for h in sorted(heads)]), full(path, f"{p}.self_attn.v_proj.weight")
                )
                if arch == "qwen2":
                    qb = torch.cat([a.qkv_proj.bias.split(a.qkv_proj.sizes)[0] for a in attn])
                    assert torch.equal(qb, full(path, f"{p}.self_attn.q_proj.bias"))
                o = torch.cat([a.o_proj.weight for a in attn], dim=1)
                assert torch.equal(o, full(path, f"{p}.self_attn.o_proj.weight"))
                mlps = [shards[s, t].model.layers[local].mlp for t in range(tp)]
                gate, up = zip(*(m.gate_up.weight.chunk(2) for m in mlps))
                assert torch.equal(torch.cat(gate), full(path, f"{p}.mlp.gate_proj.weight"))
                assert torch.equal(torch.cat(up), full(path, f"{p}.mlp.up_proj.weight"))
                assert torch.equal(
                    torch.cat([m.down_proj.weight for m in mlps], dim=1), full(path, f"{p}.mlp.down_proj.weight")
                )
        emb = torch.cat([shards[0, t].model.embed_tokens.weight for t in range(tp)])  # [Vp, hidden]
        assert emb.shape[0] == padded_vocab(V, tp) and torch.equal(emb[:V], full(path, "model.embed_tokens.weight"))
        assert not emb[V:].any(), "padding rows must be zeros"
        head = torch.cat([shards[pp - 1, t].lm_head.weight for t in range(tp)])[:V]
        name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        assert torch.equal(head, full(path, name))
        assert all(shards[s, t].model.embed_tokens is None for s in range(1, pp) for t in range(tp))  # not loaded there


def alive_children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("rank")]


PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]]


def one_process_answers(checkpoint_factory) -> list:
    """PROMPTS' greedy answers from level 3 in one process: what every layout must write."""
    path = checkpoint_factory("llama")
    return level3_prefix.LLM(path, dtype="float64").generate(
        PROMPTS, SamplingParams(max_tokens=12, **GREEDY), progress=False
    )


def pp2_with_submits_checked(checkpoint_factory):
    """A PP=2 engine (2 requests per micro-batch) whose executor's submit records how many micro-batches
    were already in flight, and fails if one of them shares a request with another; PROMPTS added."""
    llm = LLM(checkpoint_factory("llama"), dtype="float64", pipeline_parallel_size=2, max_num_seqs=2, distributed_timeout_s=60)
    engine: LLMEngine = llm.llm_engine
    submit, seen = engine.worker.submit, []

    def checked_submit(model_input):
        groups = [{id(r) for r, _ in sched.scheduled} for sched, *_ in engine.in_flight]
        assert all(not (a & b) for i, a in enumerate(groups) for b in groups[i + 1 :]), (
            "a request in two micro-batches"
        )
        seen.append(len(engine.in_flight))
        return submit(model_input)

    engine.worker.submit = checked_submit
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(max_tokens=12, **GREEDY))
    return llm, engine, seen


def test_micro_batches_are_disjoint_and_fill_the_pipeline(checkpoint_factory):
    """Four requests, two per micro-batch: the next micro-batch is submitted while the first is in flight
    (the pipeline fills: pp of them at once, never more), no request is in two, and every answer is the
    one-process engine's."""
    want, (llm, engine, seen) = one_process_answers(checkpoint_factory), pp2_with_submits_checked(checkpoint_factory)
    with llm:
        finals = {}
        while engine.has_unfinished_requests():
            finals.update((out.request_id, out) for out in engine.step() if out.finished)
        assert max(seen) <= 1, f"{max(seen) + 1} micro-batches in flight with pipeline_parallel_size=2"
        assert max(seen) == 1, "never two micro-batches in flight: stage 0 idles while stage 1 works"
        assert seen.count(1) >= 10, f"the pipeline was full at only {seen.count(1)} of {len(seen)} submits"
        for i, w in enumerate(want):
            assert finals[str(i)].outputs[0].token_ids == w.outputs[0].token_ids
        assert engine.kv.num_free_blocks == engine.num_blocks and not engine.in_flight
    assert not alive_children()


def test_an_abort_in_flight_frees_its_blocks_at_once_and_is_skipped(checkpoint_factory):
    """Request 1 aborted while its micro-batch is in flight: its blocks are free at once, it ends with
    finish_reason "abort" and no token of that micro-batch, and the others' answers stay exact."""
    want, (llm, engine, _) = one_process_answers(checkpoint_factory), pp2_with_submits_checked(checkpoint_factory)
    with llm:
        aborted, finals = None, {}
        while engine.has_unfinished_requests():
            finals.update((out.request_id, out) for out in engine.step() if out.finished)
            in_flight = {r.request_id: r for sched, *_ in engine.in_flight for r, _ in sched.scheduled}
            if aborted is None and "1" in in_flight and len(in_flight["1"].output_token_ids) >= 2:
                req, free, aborted = in_flight["1"], engine.kv.num_free_blocks, list(in_flight["1"].output_token_ids)
                engine.abort_request("1")  # while its micro-batch is in flight
                assert engine.kv.num_free_blocks > free, "its blocks are free at once"
        assert aborted is not None, "request 1 was never in flight between two steps: nothing to abort there"
        assert finals["1"].outputs[0].finish_reason == "abort"
        assert finals["1"].outputs[0].token_ids == aborted
        assert req.output_token_ids == aborted, "its micro-batch came back and a token joined it after the abort"
        for i in ("0", "2", "3"):
            assert finals[i].outputs[0].token_ids == want[int(i)].outputs[0].token_ids
        assert engine.kv.num_free_blocks == engine.num_blocks and not engine.in_flight
    assert not alive_children()


def test_a_killed_rank_makes_the_driver_raise_and_leaves_no_process(checkpoint_factory):
    path = checkpoint_factory("llama")
    llm = LLM(path, dtype="float64", tensor_parallel_size=2, pipeline_parallel_size=2, distributed_timeout_s=30)
    procs = llm.llm_engine.executor.procs
    assert len(procs) == 3 and all(p.is_alive() for p in procs)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, **GREEDY), progress=False)  # it works...
    os.kill(procs[2].pid, signal.SIGKILL)  # ...until rank 3 dies
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank"):
        llm.generate([[4, 5, 6]], SamplingParams(max_tokens=20, **GREEDY), progress=False)
    assert time.monotonic() - t0 < 30
    llm.shutdown()
    for p in procs:
        p.join(timeout=10)
    assert not any(p.is_alive() for p in procs) and not alive_children()


@pytest.mark.parametrize("guarded", [False, True])
def test_a_script_without_the_main_guard_fails_at_once_naming_it(checkpoint_factory, tmp_path, guarded):
    """Spawn runs the user's script again in each new rank; unguarded, the rank builds the
    engine again and dies while starting. That used to be a 2-minute wait for the rendezvous."""
    body = textwrap.dedent(f"""\
        llm = LLM({str(checkpoint_factory("llama"))!r}, dtype="float64", tensor_parallel_size=2, distributed_timeout_s=100)
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), progress=False)
        print("tokens", out[0].outputs[0].token_ids)
        llm.shutdown()
    """)  # fmt: skip
    if guarded:
        body = 'if __name__ == "__main__":\n' + textwrap.indent(body, "    ")
    script = tmp_path / "script.py"
    script.write_text("from level5_multigpu import LLM, SamplingParams\n\n" + body)
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - t0
    if guarded:
        assert run.returncode == 0 and "tokens [" in run.stdout, run.stderr[-2000:]
    else:
        assert run.returncode != 0 and seconds < 60, (seconds, run.stderr[-2000:])  # not the 100 s rendezvous timeout
        assert 'if __name__ == "__main__":' in run.stderr.splitlines()[-1], run.stderr[-2000:]  # the last line says it


def test_message_accounting_matches_the_model(checkpoint_factory):
    """TP = 2, one request, 4 prompt tokens + 3 decode steps (the last sampled token is never fed):
    per forward, 2 all-reduces per layer + 1 for the embedding, [T, hidden] each, and one gather
    of the logits row; both ranks count the same."""
    path = checkpoint_factory("llama")
    cfg = load_metadata(path).config
    with LLM(path, dtype="float64", tensor_parallel_size=2, distributed_timeout_s=60) as llm:
        llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, **GREEDY), progress=False)
        stats = llm.comm_stats()
        metrics = {
            (m.name, m.labels.get("kind")): m.value for m in llm.get_metrics() if m.name.startswith("ladder:comm")
        }
    tokens = [4, 1, 1, 1]  # tokens per forward
    assert (
        metrics[("ladder:comm_calls", "all_reduce")] == stats[0][0].by_kind["all_reduce"][0]
    )  # the engine's metrics say it too
    for rank in (0, 1):
        ar = stats[rank][0].by_kind["all_reduce"]
        assert ar[0] == len(tokens) * (2 * cfg.num_layers + 1)
        assert ar[1] == sum(t * cfg.hidden_size * 8 for t in tokens) * (2 * cfg.num_layers + 1)  # float64
        assert stats[rank][0].by_kind["gather"][0] == len(tokens)
    assert len(stats[1][1]) == len(tokens)  # rank 1's timeline: one forward per step


def test_micro_batches_keep_admission_order_and_fill_from_the_front(checkpoint_factory):
    """The documented assignment, PP = 2: each micro-batch is level 2's schedule over the requests not
    in flight, so it takes the idle running requests from the front of the running list (admission
    order) while the token budget lasts; and whatever was in flight keeps its place in that list, so
    FCFS still preempts the latest admitted. Outputs stay exact under other orders; this pins it."""
    path = checkpoint_factory("llama")
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12], [13, 14]]
    with LLM(path, dtype="float64", pipeline_parallel_size=2, block_size=4, max_num_batched_tokens=3,
             distributed_timeout_s=60) as llm:  # fmt: skip
        engine: LLMEngine = llm.llm_engine
        schedule, admitted, checked, problems = engine.schedule, [], [], []

        def checked_schedule():  # records what is wrong: an assert here would leave a micro-batch in flight
            busy = {id(r) for sched, *_ in engine.in_flight for r, _ in sched.scheduled}
            idle = [r for r in engine.scheduler.running if id(r) not in busy]
            sched = schedule()
            for r in [r for r in admitted if r not in engine.scheduler.running]:  # finished or preempted
                admitted.remove(r)
            admitted.extend(r for r in engine.scheduler.running if r not in admitted)
            if engine.scheduler.running != admitted:
                problems.append(
                    f"the running list left admission order: {[r.request_id for r in engine.scheduler.running]}"
                )
                admitted[:] = engine.scheduler.running
            if not sched.preempted:
                ran = [r for r, _ in sched.scheduled if any(r is x for x in idle)]
                if ran != idle[: len(ran)]:
                    problems.append("a micro-batch skipped an idle request ahead of one it took")
            checked.append(len(sched.scheduled))
            return sched

        engine.schedule = checked_schedule
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=6, **GREEDY))
        while engine.has_unfinished_requests():
            engine.step()
    assert not problems, problems[:3]
    assert len(checked) > 10 and max(checked) >= 2
    assert not alive_children()
