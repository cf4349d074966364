"""The compiled step (features/compilation): the same greedy tokens as eager and as the oracle, one
graph for every batch, attention the split point, and a failure to compile said in one line.

Costs: Inductor compiles each model twice (T = 1 and a symbolic T), about 10-20 s cold on 2 cores
for the suite's small checkpoints, then from its on-disk cache (except FROZEN_GEMM's test, which its
cache cannot hold: 20-50 s at every run, the GEMMs timed when Inductor's autotuning cache is cold). So the equivalence test builds
one compiled engine per level and runs hypothesis' workloads through it (the knobs that need a
new engine are drawn once per engine: a tight pool for preemption, a small token budget for
chunked prefill); the structural tests use the `eager` backend (Dynamo's graph, no compiler).
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import VOCAB
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_equivalence import AllAccepted, Staggered, WarmCache, eagle_checkpoint, kv_bytes, workloads

import level1_paged
import level2_continuous
import level3_prefix
import level4_speculative
from features.compilation import CompilationConfig, parse
from level0_naive import SamplingParams
from level1_paged.attention_backend import AttentionImpl
from level1_paged.model_input import ModelInput

pytestmark = pytest.mark.compilation
EAGER_BACKEND = {"backend": "eager"}  # Dynamo's graph run op by op: the structure, without Inductor's minutes


def greedy(llm_or_engine, prompts, max_tokens=8):
    params = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True) for _ in prompts]
    return [o.outputs[0].token_ids for o in llm_or_engine.generate(prompts, params, progress=False)]


def runner_of(llm):
    return llm.llm_engine.worker.runner


# --- the setting ---------------------------------------------------------------------------------------


def test_the_setting_takes_vllms_forms_and_refuses_bad_ones_naming_the_field():
    assert not parse(None).compiled and not parse(0).compiled
    assert parse(3).compiled and parse({}).compiled and parse({"level": 0}).compiled is False
    assert not parse(3, enforce_eager=True).compiled  # vLLM's switch wins
    assert parse({"cudagraph_capture_sizes": [8, 1, 4]}).capture_sizes("cpu") == [1, 4, 8]
    assert parse(3).capture_sizes("cpu") == [] and parse(3).capture_sizes("cuda")[:4] == [1, 2, 4, 8]
    assert parse(3).split_at("cpu") == [] and parse(3).split_at("cuda") == ["ladder.attention"]
    for bad, field in [(2, "level"), ({"backend": "tvm"}, "backend"), ({"splitting_ops": ["x"]}, "splitting_ops"),
                       ({"cudagraph_capture_sizes": [0]}, "cudagraph_capture_sizes"), ({"levle": 3}, "levle"),
                       ("fast", "compilation_config")]:  # fmt: skip
        with pytest.raises(ValueError, match=field):
            parse(bad)
    assert isinstance(parse(CompilationConfig(level=3)), CompilationConfig)


@pytest.mark.level1
def test_an_engine_refuses_what_is_not_built_in_one_line(llama_dir):
    with pytest.raises(ValueError, match="level=5"):
        level1_paged.LLM(llama_dir, dtype="float64", compilation_config=5)
    with pytest.raises(ValueError, match="batch_invariant=True is not built"):
        level3_prefix.LLM(llama_dir, dtype="float32", batch_invariant=True, compilation_config=3)
    eager = level3_prefix.LLM(llama_dir, dtype="float64", compilation_config=3, enforce_eager=True)
    assert type(runner_of(eager)).__name__ == "ModelRunner"  # enforce_eager: nothing compiled


def test_the_default_compiles_on_a_cpu_only_where_compilation_is_built(monkeypatch):
    from types import SimpleNamespace

    import level1_paged.engine as paged
    from level1_paged.engine import CompilationSettings, compilation_for

    def config(device="cpu", batch_invariant=False, **settings):
        return SimpleNamespace(compilation=CompilationSettings(**settings),
                               model=SimpleNamespace(device=device, batch_invariant=batch_invariant))  # fmt: skip

    monkeypatch.delenv("LADDER_COMPILE_LEVEL")  # the suite's own default (conftest.py) off: a user's
    assert compilation_for(config()).compiled and compilation_for(config(device="auto")).compiled
    # where it is not built, the default is eager and says nothing; asked for, it is refused in one line
    assert compilation_for(config(batch_invariant=True)) is None
    assert compilation_for(config(), parallel=True).compiled  # over ranks: each rank compiles its shard
    with pytest.raises(ValueError, match="batch_invariant=True is not built"):
        compilation_for(config(batch_invariant=True, compilation_config=3))
    assert compilation_for(config(enforce_eager=True)) is None and compilation_for(config(compilation_config=0)) is None
    monkeypatch.setattr(paged, "resolve_device", lambda device: torch.device("cuda"))
    assert compilation_for(config(device="cuda")) is None  # a GPU: eager until its CUDA-graph path has run on one
    assert compilation_for(config(device="cuda", compilation_config=3)).compiled  # asked for: compiled
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 on a GPU is not built"):
        compilation_for(config(device="cuda", compilation_config=3), parallel=True)
    monkeypatch.setenv("LADDER_COMPILE_LEVEL", "0")  # the switch the suite and the labs set
    monkeypatch.setattr(paged, "resolve_device", lambda device: torch.device("cpu"))
    assert compilation_for(config()) is None


@pytest.mark.level3
def test_by_default_an_moe_model_runs_eager_without_a_word(checkpoint_factory, monkeypatch, caplog):
    monkeypatch.delenv("LADDER_COMPILE_LEVEL")  # a user's default: compiled on this CPU
    moe = level3_prefix.LLM(checkpoint_factory("mixtral"), dtype="float32")
    assert type(runner_of(moe)).__name__ == "ModelRunner"  # its routing's data-dependent sizes: not traced
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.level4
def test_by_default_eagles_head_runs_eager_beside_the_compiled_target(llama_dir, monkeypatch, caplog):
    """The default compiles the target and leaves the head eager (compiled, it was slower per pass on a CPU:
    features/compilation/__init__.py); asked for, both compile (the test above)."""
    monkeypatch.delenv("LADDER_COMPILE_LEVEL")  # a user's default: compiled on this CPU
    spec = {"method": "eagle", "model": str(eagle_checkpoint(llama_dir)), "num_speculative_tokens": 2}
    llm = level4_speculative.LLM(llama_dir, dtype="float32", speculative_config=spec)
    assert type(runner_of(llm)).__name__ == "CompiledRunner" and runner_of(llm).eager_reason is None
    assert type(llm.llm_engine.proposer.worker.runner).__name__ == "ModelRunner"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.level5
@pytest.mark.parametrize("tp,pp,setting", [(2, 1, 3), (1, 2, EAGER_BACKEND)], ids=["tp2-inductor", "pp2-eager-backend"])
def test_each_rank_compiles_its_shard_and_gives_the_eager_tokens(llama_dir, tp, pp, setting):
    """Level 5: every rank compiles its shard, its all-reduces an opaque op in the graph (timed and counted as
    eager's), a later pipeline stage's input (the hidden states) a graph input beside the tokens; the same
    greedy tokens as the eager ranks in float64, two graphs a rank over batches of changing sizes."""
    import level5_multigpu
    from level5_multigpu.parallel_state import counters

    def all_reduces(llm):  # calls per rank so far
        return {r: calls for r, (calls, _, _) in counters(llm.comm_stats(), ("all_reduce",))["all_reduce"].items()}

    prompts = [[5 + i] * (3 + 5 * i) for i in range(5)]  # prefills of 3-23 tokens, then decodes of 1-3 rows
    tokens, states, reduces = {}, {}, {}
    for name, cc in (("eager", 0), ("compiled", setting)):
        with level5_multigpu.LLM(llama_dir, dtype="float64", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                 max_num_seqs=3, compilation_config=cc) as llm:  # fmt: skip
            before = all_reduces(llm)
            tokens[name] = greedy(llm, prompts, max_tokens=6)
            reduces[name] = {r: n - before[r] for r, n in all_reduces(llm).items()}
            states[name] = llm.llm_engine.executor.collective_rpc("compilation_state")
    assert states["eager"] == [None] * (tp * pp)
    assert [s[:3] for s in states["compiled"]] == [(None, 2, 2)] * (tp * pp)  # no recompile, no fallback
    forwards = len(prompts) + 5 * len(prompts)  # at least: each request's prefill and 5 decodes, 3 at a time at most
    assert all(s[3] >= forwards / 3 for s in states["compiled"])  # every rank's steps went through its graph
    assert tokens["compiled"] == tokens["eager"]
    # the op's real side is the Comm's all-reduce: the compiled ranks send (and count) the eager ones' messages
    assert reduces["compiled"] == reduces["eager"] and (tp == 1 or min(reduces["eager"].values()) > 0)


@pytest.mark.level5
def test_a_rank_whose_compile_fails_runs_eager_in_step_with_its_compiled_peer(llama_dir, monkeypatch):
    """Rank 0's (the driver's) second graph fails to compile, rank 1's does not: rank 0 runs the rest of its
    warm-up eager, sending the all-reduces rank 1's graph sends, and the tokens are the eager ranks'. (Without
    those eager forwards the ranks wait for messages that never come: tried, the run hangs.)"""
    import level5_multigpu
    from features.compilation import piecewise

    def run(cc):
        with level5_multigpu.LLM(llama_dir, dtype="float64", tensor_parallel_size=2, max_num_seqs=3,
                                 compilation_config=cc) as llm:  # fmt: skip
            return greedy(llm, prompts, max_tokens=6), llm.llm_engine.executor.collective_rpc("compilation_state")

    prompts = [[5 + i] * (3 + 5 * i) for i in range(5)]
    eager, _ = run(0)
    compile_piece, graphs = piecewise.Backend.compile_piece, []

    def second_fails(self, *args, **kwargs):  # patched in this process only: the spawned rank 1 compiles as written
        graphs.append(1)
        if len(graphs) == 2:
            raise RuntimeError("a compile that fails on rank 0 only")
        return compile_piece(self, *args, **kwargs)

    monkeypatch.setattr(piecewise.Backend, "compile_piece", second_fails)
    tokens, (rank0, rank1) = run(EAGER_BACKEND)
    assert "fails on rank 0 only" in rank0[0] and rank1[:3] == (None, 2, 2) and rank1[3] > 0
    assert tokens == eager


@pytest.mark.level6
def test_the_server_takes_vllms_flags_and_refuses_a_bad_one_naming_it(capsys):
    from level6_serving.__main__ import engine_kwargs, parse_args

    kw = engine_kwargs(parse_args(["--compilation-config", '{"level": 3, "backend": "eager"}', "--enforce-eager"]))
    assert kw["compilation_config"] == {"level": 3, "backend": "eager"} and kw["enforce_eager"] is True
    assert engine_kwargs(parse_args(["-O", "3"]))["compilation_config"] == 3
    with pytest.raises(SystemExit):
        parse_args(["--compilation-config", '{"levle": 3}'])
    assert "argument --compilation-config: compilation_config has no field(s) levle" in capsys.readouterr().err


# --- the graph -----------------------------------------------------------------------------------------


@pytest.mark.level3
def test_attention_is_the_split_point_and_nothing_breaks_the_graph(llama_dir):
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    llm = level3_prefix.LLM(
        llama_dir, dtype="float64", compilation_config={**EAGER_BACKEND, "splitting_ops": ["ladder.attention"]}
    )
    assert runner_of(llm).eager_reason is None, runner_of(llm).eager_reason  # it traced (the reason if not)
    c = runner_of(llm).backend.counters
    layers = llm.llm_engine.loaded.model.config.num_layers
    assert c.graphs == 2  # T = 1 and a symbolic T, both at start-up
    assert c.splits == layers  # one split per layer's attention
    assert c.pieces == 2 * (layers + 1)  # per graph: the pieces between attention calls, compiled
    assert sum(counters["graph_break"].values()) == breaks  # the opaque op: Dynamo traced every layer whole
    one = level3_prefix.LLM(llama_dir, dtype="float64", compilation_config=EAGER_BACKEND)  # a CPU's default: no split
    assert runner_of(one).backend.counters.pieces == 2 and runner_of(one).backend.counters.splits == 0


@pytest.mark.level3
def test_no_recompile_as_batch_sizes_and_contexts_change_at_every_step(llama_dir):
    """Requests arriving every step, chunked prefills of several sizes, decodes of a growing
    batch: T and every context length change each step, and the two start-up graphs serve all."""
    engine = level3_prefix.LLMEngine(llama_dir, dtype="float64", compilation_config=EAGER_BACKEND,
                                     max_num_batched_tokens=7, block_size=4, kv_cache_memory=kv_bytes(llama_dir, 400))  # fmt: skip
    counters = engine.worker.runner.backend.counters
    assert engine.worker.runner.eager_reason is None, engine.worker.runner.eager_reason
    assert counters.graphs == 2
    g = torch.Generator().manual_seed(0)
    for i in range(12):
        prompt = torch.randint(0, VOCAB, (1 + 3 * i % 11,), generator=g).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    steps = {len(r.request_ids) for r in engine.step_log}
    assert len(steps) >= 4  # the batch really changed (and so did T: chunks of up to 7 tokens besides)
    assert counters.graphs == 2  # not one more


# --- the tokens ----------------------------------------------------------------------------------------

ENGINES: dict = {}  # (level, arch) -> (compiled engine wrapped for generate, per-example data-free): built once


def compiled_engine(level: str, path, data):
    """One compiled (Inductor, float64) engine per level and model, reused by every example."""
    key = (level, str(path))
    if key not in ENGINES:
        common = dict(dtype="float64", compilation_config=3, max_num_seqs=4, policy="fcfs")
        tight = kv_bytes(path, 60)  # 15 blocks of 4: the workloads' longest request is 54 tokens, so four preempt
        if level == "level1":
            ENGINES[key] = level1_paged.LLM(path, dtype="float64", compilation_config=3, block_size=4, max_num_seqs=3,
                                            kv_cache_memory=kv_bytes(path, 64))  # fmt: skip
        elif level == "level2":  # continuous batching: preemption (a small pool), chunked prefill (7 tokens a step)
            ENGINES[key] = level2_continuous.LLMEngine(path, block_size=4, kv_cache_memory=tight, max_num_batched_tokens=7,
                                                       **common)  # fmt: skip
        elif level == "level3":  # preemption (a small pool), chunked prefill (7 tokens a step), prefix hits
            ENGINES[key] = level3_prefix.LLMEngine(path, block_size=4, kv_cache_memory=tight, max_num_batched_tokens=7,
                                                   **common)  # fmt: skip
        else:  # level 4: the target itself as the draft (every draft accepted), k = 3, both compiled
            spec = {"num_speculative_tokens": 3, "model": str(path)}
            ENGINES[key] = level4_speculative.LLMEngine(path, block_size=4, kv_cache_memory=2 * tight,
                                                        speculative_config=spec, **common)  # fmt: skip
    engine = ENGINES[key]
    if level == "level1":
        return engine
    wrapped = Staggered(engine, data)
    if level == "level2":
        return wrapped
    return AllAccepted(wrapped, data) if level == "level4" else WarmCache(wrapped, data)


@pytest.mark.level3
@pytest.mark.parametrize("level", ["level1", "level2", "level3", "level4"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload=workloads(), data=st.data())
def test_compiled_greedy_output_equals_the_oracle(level, workload, data, checkpoint_factory, oracle):
    path = checkpoint_factory("llama")
    engine = compiled_engine(level, path, data)
    prompts = [p for p, _ in workload]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in workload]
    for (prompt, n), out in zip(workload, engine.generate(prompts, params, progress=False)):
        assert out.outputs[0].token_ids == oracle.greedy(path, prompt, n)
    inner = getattr(engine, "llm_engine", None) or getattr(engine, "inner", engine)
    inner = getattr(inner, "engine", inner)
    runners = [inner.worker.runner]
    if level == "level4":  # the draft model's runner, compiled too
        runners.append(inner.proposer.worker.runner)
    for runner in runners:
        assert runner.eager_reason is None, runner.eager_reason  # it really ran compiled
        assert runner.backend.counters.graphs == 2


@pytest.mark.level1
def test_float32_logits_match_eager_and_padding_rows_write_nowhere(llama_dir):
    """One step's batch through an eager and a compiled worker over the same weights and the same
    starting cache: logits within float32's rounding, and the two caches equal, padding rows (3
    tokens run as 4) written nowhere."""
    eager = level1_paged.LLM(llama_dir, dtype="float32", block_size=4, kv_cache_memory=kv_bytes(llama_dir, 64, 4))
    compiled = level1_paged.LLM(llama_dir, dtype="float32", block_size=4, kv_cache_memory=kv_bytes(llama_dir, 64, 4),
                                compilation_config={"cudagraph_capture_sizes": [4, 8]})  # fmt: skip
    # it runs compiled (a fallback to eager would pass the rest)
    assert runner_of(compiled).eager_reason is None, runner_of(compiled).eager_reason
    assert runner_of(compiled).padded(3) == 4 and runner_of(compiled).padded(9) == 9
    mi = ModelInput.build([([5, 6, 7], 0)], [[2]], 4, [3])  # 3 tokens in block 2: slots 8, 9, 10
    worker, rows = compiled.llm_engine.worker, []
    write, attend = worker.impl.write_kv, worker.impl.attend
    worker.impl = AttentionImpl(lambda k, *a: (rows.append(k.shape[0]), write(k, *a))[1],
                                lambda q, *a: (rows.append(q.shape[0]), attend(q, *a))[1])  # fmt: skip
    a, b = eager.llm_engine.worker.execute(mi), worker.execute(mi)
    assert rows == [3, 3] * len(worker.cache.k)  # each layer's write and attention saw the 3 real rows, not 4
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    for ca, cb in zip(eager.llm_engine.worker.cache.k + eager.llm_engine.worker.cache.v,
                      compiled.llm_engine.worker.cache.k + compiled.llm_engine.worker.cache.v):  # fmt: skip
        torch.testing.assert_close(cb, ca, rtol=1e-4, atol=1e-5)
        # slot 11 (after the 3 real rows' slots) and block 0 (a padding row's position 0) untouched
        assert cb[2, 3].abs().sum() == 0 and cb[0].abs().sum() == 0


@pytest.mark.level1
def test_frozen_gemms_give_eagers_logits_and_do_not_see_a_weight_changed_later(llama_dir):
    """FROZEN_GEMM (an opt-in inductor_compile_config): the weights become constants of the graph and
    Inductor times its own GEMMs against ATen's for each linear (which wins is the machine's call, so
    not asserted; a wrong kernel would show in the logits). One step's logits are eager's within
    float32's rounding; and a weight changed in place afterwards changes the eager model's logits but
    not the frozen graph's, which is what frozen means, and proves the runner made Dynamo trace with
    freezing on (without it the weights stay inputs of the graph and the change shows: tried)."""
    from features.compilation.config import FROZEN_GEMM

    kw = dict(dtype="float32", block_size=4, kv_cache_memory=kv_bytes(llama_dir, 64, 4))
    eager = level1_paged.LLM(llama_dir, enforce_eager=True, **kw)
    frozen = level1_paged.LLM(llama_dir, compilation_config={"inductor_compile_config": FROZEN_GEMM}, **kw)
    assert runner_of(frozen).eager_reason is None, runner_of(frozen).eager_reason
    mi = ModelInput.build([([5, 6, 7], 0)], [[2]], 4, [3])
    a, b = eager.llm_engine.worker.execute(mi), frozen.llm_engine.worker.execute(mi)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    for llm in (eager, frozen):
        with torch.no_grad():
            llm.llm_engine.worker.model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
    a2, b2 = eager.llm_engine.worker.execute(mi), frozen.llm_engine.worker.execute(mi)
    assert (a2 - a).abs().max() > 1e-3  # the change matters to the eager model
    torch.testing.assert_close(b2, b, rtol=0, atol=0)  # and the frozen graph does not see it


@pytest.mark.level4
def test_eagle_reads_the_compiled_targets_features_as_the_eager_ones(llama_dir):
    """The head drafts from the target's hidden states, the compiled graph's output when the target is
    compiled: every forward of the head gets the same features as over the eager target (float64, but
    for the RoPE angles' rounding; the check that has teeth: this random head's drafts are rarely accepted,
    so equal tokens and counts alone would not catch stale features), and the output is the same. Asked for, the head runs compiled too, its features a graph input (not a constant baked into
    the graph: the drafts would then all read the first step's), padded with the tokens to a capture
    size where there are some (the eager backend's run: batches of 3 and 9 rows run at 4 and 16)."""
    spec = {"method": "eagle", "model": str(eagle_checkpoint(llama_dir)), "num_speculative_tokens": 3}
    prompts, seen = [[1, 2, 3, 4, 5], [9, 8, 7], [4] * 11], {}
    modes = {"eager": {"enforce_eager": True}, "compiled": {"compilation_config": 3},
             "padded": {"compilation_config": {"backend": "eager", "cudagraph_capture_sizes": [4, 8, 16]}}}  # fmt: skip
    for name, extra in modes.items():
        llm = level4_speculative.LLM(llama_dir, dtype="float64", block_size=4, speculative_config=spec, **extra)
        proposer = llm.llm_engine.proposer
        head, run, features = proposer.head, proposer._run, []

        def spy(*args, _run=run, _head=head, _features=features, **kwargs):
            out = _run(*args, **kwargs)
            _features.append(_head.features.clone())
            return out

        proposer._run = spy
        stats = lambda s: (s.num_draft_tokens, s.num_accepted_tokens)  # noqa: E731
        seen[name] = (greedy(llm, prompts, 10), features, stats(llm.spec_decode_stats()))
        if name != "eager":
            runner, head_runner = runner_of(llm), llm.llm_engine.proposer.worker.runner
            graphs = 1 if name == "padded" else 2  # (padded, one token runs at 4: no graph of its own for T = 1)
            assert runner.eager_reason is None and runner.backend.counters.graphs == graphs  # the target ran compiled
            assert head_runner.eager_reason is None and head_runner.backend.counters.graphs == graphs  # and the head
            assert head_runner.padded(3) == (4 if name == "padded" else 3)
    tokens, eager_features, counts = seen.pop("eager")
    assert counts[0] > 0  # (drafted, accepted)
    for compiled_tokens, compiled_features, compiled_counts in seen.values():
        assert compiled_tokens == tokens and compiled_counts == counts
        assert len(compiled_features) == len(eager_features) > 3
        for a, b in zip(compiled_features, eager_features):  # (compiled RoPE's cos, sin: float32's, 1e-7 apart)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
            assert a.abs().sum() > 0  # (features, not the zeros a missing one reads)


@pytest.mark.level3
def test_a_step_under_a_dispatch_mode_runs_eager_and_the_next_compiled(llama_dir):
    """torch.compile refuses to run under a TorchDispatchMode (benchmarks.profile counts aten ops with one):
    that step runs eager, and compiling is not given up."""
    from benchmarks.profile import CountOps

    engine = level3_prefix.LLMEngine(llama_dir, dtype="float64", compilation_config=EAGER_BACKEND)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()
    counted = CountOps()
    with counted:
        engine.step()
    assert counted.count > 50  # the eager model's ops, seen one by one
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.worker.runner.eager_reason is None and engine.worker.runner.backend.counters.graphs == 2


# --- failing to compile ----------------------------------------------------------------------------------


@pytest.mark.level3
def test_without_a_cpp_compiler_the_engine_runs_eager_and_says_so_once(llama_dir, monkeypatch, caplog):
    """...and the fallback is exactly enforce_eager's engine: the ops it swapped for compiling are given back."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "force_disable_caches", True)  # a cache hit would need no compiler
    monkeypatch.setattr(inductor_config.cpp, "cxx", ("/nonexistent/g++",))
    with caplog.at_level(logging.WARNING, logger="features.compilation.runner"):
        llm = level3_prefix.LLM(llama_dir, dtype="float64", compilation_config=3)
    said = [r.getMessage() for r in caplog.records if "running the model eager" in r.getMessage()]
    assert len(said) == 1 and "\n" not in said[0]
    assert runner_of(llm).eager_reason is not None
    plain = level3_prefix.LLM(llama_dir, dtype="float64")
    assert type(llm.llm_engine.worker.model.ops) is type(plain.llm_engine.worker.model.ops)  # noqa: E721
    assert greedy(llm, [[1, 2, 3]]) == greedy(plain, [[1, 2, 3]])


@pytest.mark.level3
def test_a_model_dynamo_cannot_trace_runs_eager_and_says_why(llama_dir, monkeypatch, caplog):
    """A data-dependent branch (on a token's value) is a graph break: with the graph asked whole,
    Dynamo refuses it, and the engine falls back in one line instead of recompiling per value."""
    from level0_naive.model import Transformer

    plain = Transformer.rope

    def branchy(self, positions, dtype):
        if int(positions.max()) > 1000:  # data-dependent: Dynamo cannot trace past it
            positions = positions % 1000
        return plain(self, positions, dtype)

    monkeypatch.setattr(Transformer, "rope", branchy)
    with caplog.at_level(logging.WARNING, logger="features.compilation.runner"):
        llm = level3_prefix.LLM(llama_dir, dtype="float64", compilation_config=EAGER_BACKEND)
    assert runner_of(llm).eager_reason is not None
    assert any("running the model eager" in r.getMessage() for r in caplog.records)
    assert greedy(llm, [[4, 5]], 3) == greedy(level3_prefix.LLM(llama_dir, dtype="float64"), [[4, 5]], 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_give_the_eager_tokens(llama_dir):
    eager = level3_prefix.LLM(llama_dir, dtype="float32", device="cuda")
    compiled = level3_prefix.LLM(llama_dir, dtype="float32", device="cuda",
                                 compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})  # fmt: skip
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    assert greedy(compiled, prompts, 12) == greedy(eager, prompts, 12)
    wrapped = runner_of(compiled).backend.wrapped
    # The T = 1 graph's pieces run at size 1 only, the symbolic graph's at 2, 4 and 8: every piece
    # captured at least one size, and every size was captured
    assert wrapped and all(p.graphs for p in wrapped)
    assert set().union(*(p.graphs for p in wrapped)) == {1, 2, 4, 8}
