"""The shared cross-level suite: every level's greedy output equals the Hugging Face oracle.

Hypothesis generates workloads (prompts, lengths, batch composition, max_tokens) and
each registered level draws its own knobs (batch limits, KV budgets, block sizes, ...)
from the same `data` object. A level joins the ladder with one `register(...)` line.

Float64 everywhere: batching changes the order of floating-point reductions, so in
float32 a request run alone and the same request in a batch can differ by an ulp, and a
near-tie can flip a greedy token (the "batch invariance" problem). In float64 a flip would
need a tie within ~1e-15, so equality here is a proof-like check, not luck.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, build_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

import level0_naive
import level1_paged
import level2_continuous
import level3_prefix
import level4_speculative
from level0_naive import SamplingParams

LEVELS: list = []


def register(name: str, make) -> None:
    """`make(path, need_tokens, data) -> an engine with .generate(prompts, params, progress=...)`.

    `need_tokens` is the largest prompt + max_tokens in the workload, so a level can size
    tight KV budgets that still admit every request alone.
    """
    LEVELS.append(pytest.param(make, id=name, marks=getattr(pytest.mark, name.split("-")[0])))


def kv_bytes(path: Path, tokens: int, dtype_bytes: int = 8) -> int:
    """What `tokens` cost in the cache of the checkpoint at `path`; for an EAGLE head, also the target's feature
    it files per token (level 4's `draft_kv_bytes_per_token`)."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes
    if "EagleLlamaForCausalLM" in (cfg.get("architectures") or []):
        per_token += cfg["hidden_size"] * dtype_bytes
    return tokens * per_token


def make_level0(path, need_tokens, data):
    budget = kv_bytes(
        path, need_tokens * data.draw(st.sampled_from([1, 2, 5, 100]), label="kv budget (x largest request)")
    )
    return level0_naive.LLM(
        path, dtype="float64", max_num_seqs=data.draw(st.integers(1, 8), label="max_num_seqs"), kv_cache_memory=budget
    )


def make_level1(path, need_tokens, data, backend="torch"):
    bs = data.draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
    # from "the largest request alone, at its longest" (forces evictions mid-batch) to roomy
    blocks = -(-need_tokens // bs) * data.draw(st.sampled_from([1, 2, 4, 100]), label="kv budget (x largest request)")
    return level1_paged.LLM(path, dtype="float64", block_size=bs, kv_cache_memory=kv_bytes(path, blocks * bs),
                            max_num_seqs=data.draw(st.integers(1, 8), label="max_num_seqs"), attention_backend=backend)  # fmt: skip


class Staggered:
    """Drives an `LLMEngine` through add_request/step: hypothesis picks the arrival order,
    the step at which each request arrives, and (under policy="priority") priorities."""

    def __init__(self, engine, data):
        self.engine, self.data = engine, data

    def generate(self, prompts, params, progress=False):
        draw, n = self.data.draw, len(prompts)
        order = draw(st.permutations(range(n)), label="arrival order")
        arrive = sorted(zip(draw(st.lists(st.integers(0, 6), min_size=n, max_size=n), label="arrival steps"), order))
        priorities = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n), label="priorities")
        finals, step = {}, 0
        while arrive or self.engine.has_unfinished_requests():
            while arrive and arrive[0][0] <= step:
                i = arrive.pop(0)[1]
                self.engine.add_request(str(i), prompts[i], params[i], priority=priorities[i])
            for out in self.engine.step():
                if out.finished:
                    assert out.request_id not in finals, "a request finished twice"
                    finals[out.request_id] = out
            step += 1
        return [finals[str(i)] for i in range(n)]


def make_level2(path, need_tokens, data, engine_class=level2_continuous.LLMEngine, kv_models=(), **extra):
    """`kv_models`: more checkpoints whose KV caches share the budget (level 4's draft)."""
    bs = data.draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
    blocks = -(-need_tokens // bs) * data.draw(st.sampled_from([1, 2, 4, 100]), label="kv budget (x largest request)")
    budget = sum(kv_bytes(p, blocks * bs) for p in (path, *kv_models))
    engine = engine_class(path, dtype="float64", block_size=bs, kv_cache_memory=budget,
                          max_num_seqs=data.draw(st.integers(1, 8), label="max_num_seqs"),
                          max_num_batched_tokens=data.draw(st.sampled_from([1, 3, 8, 64, 2048]), label="token budget"),
                          policy=data.draw(st.sampled_from(["fcfs", "priority"]), label="policy"), **extra)  # fmt: skip
    return Staggered(engine, data)


class WarmCache:
    """Runs a drawn subset of the prompts first (filling the prefix cache, maybe evicting),
    then the real workload, so hits come from earlier requests' prompts *and* outputs."""

    def __init__(self, inner, data):
        self.inner, self.data = inner, data

    def generate(self, prompts, params, progress=False):
        warm = self.data.draw(st.lists(st.sampled_from(range(len(prompts))), max_size=3), label="warm-up prompts")
        if warm:
            self.inner.generate([prompts[i] for i in warm], [params[i] for i in warm])
        return self.inner.generate(prompts, params)


def make_level3(path, need_tokens, data):
    caching = data.draw(st.booleans(), label="enable_prefix_caching")
    return WarmCache(make_level2(path, need_tokens, data, level3_prefix.LLMEngine, enable_prefix_caching=caching), data)


@functools.cache
def draft_checkpoint() -> Path:
    """A smaller random llama with the suite's vocabulary: a draft that agrees with no target."""
    path = Path(tempfile.mkdtemp(prefix="draft-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)  # nothing left in the temporary folder
    return build_checkpoint(path, "llama", seed=7, hidden_size=32, head_dim=8, num_hidden_layers=1)


@functools.cache
def eagle_checkpoint(target: Path) -> Path:
    """A random EAGLE head for `target` (level4_speculative/eagle.py's EagleModel, saved as
    models/train_eagle.py saves a trained one): the target's shape with one layer, no embeddings or LM head."""
    from safetensors.torch import save_file

    from level0_naive.loader import load_model, model_config_from_hf
    from level4_speculative.eagle import EagleModel

    path = Path(tempfile.mkdtemp(prefix="eagle-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    hf = {**json.loads((Path(target) / "config.json").read_text()), "num_hidden_layers": 1,
          "architectures": ["EagleLlamaForCausalLM"]}  # fmt: skip
    torch.manual_seed(5)
    head = EagleModel(model_config_from_hf(hf), load_model(target, torch.float32).model)
    save_file({k: v.contiguous() for k, v in head.state_dict().items() if not k.startswith(("embed_tokens.", "lm_head."))},
              str(path / "model.safetensors"))  # fmt: skip
    (path / "config.json").write_text(json.dumps(hf))
    return path


def make_level4(path, need_tokens, data):
    """Level 3's workloads plus speculation: k from 1 to 5, a draft model (a random one, or the
    target itself, which must then be accepted every time), a random EAGLE head (dense targets) or the
    n-gram proposer."""
    k = data.draw(st.integers(1, 5), label="num_speculative_tokens")
    dense = json.loads((Path(path) / "config.json").read_text())["model_type"] in ("llama", "qwen2", "qwen3")
    methods = ["random draft", "target as draft", "ngram"] + (["eagle"] if dense else [])
    method = data.draw(st.sampled_from(methods), label="proposer")
    draft = draft_checkpoint() if method == "random draft" else eagle_checkpoint(path) if method == "eagle" else path
    spec = {"num_speculative_tokens": k, "model": str(draft)}
    if method == "eagle":
        spec["method"] = "eagle"
    if method == "ngram":
        draft, spec = (
            None,
            {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        )
    caching = data.draw(st.booleans(), label="enable_prefix_caching")
    engine = make_level2(path, need_tokens, data, level4_speculative.LLMEngine, kv_models=[draft] if draft else [],
                         enable_prefix_caching=caching, speculative_config=spec)  # fmt: skip
    return (AllAccepted if method == "target as draft" else WarmCache)(engine, data)


class AllAccepted(WarmCache):
    """Draft = target: every draft token is the target's argmax, under preemption, chunked
    prefill and prefix hits too (a KV slot off by one would lower the rate, not change the text)."""

    def generate(self, prompts, params, progress=False):
        outs = super().generate(prompts, params)
        stats = self.inner.engine.spec_stats
        assert stats.num_accepted_tokens == stats.num_draft_tokens, "draft = target, yet a draft token was rejected"
        return outs


register("level0", make_level0)
register("level1", make_level1)
register("level2", make_level2)
register("level3", make_level3)
register("level4", make_level4)


@st.composite
def workloads(draw):
    """1-6 (prompt, max_tokens) pairs. Prompts share prefixes of random lengths with a
    common stem (so on, and one token off, every block boundary), or are random."""
    stem = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=40), label="shared stem")
    out = []
    for _ in range(draw(st.integers(1, 6), label="requests")):
        k = draw(st.integers(0, len(stem)), label="shared prefix length")
        tail = draw(st.lists(st.integers(0, VOCAB - 1), min_size=0 if k else 1, max_size=12), label="own tokens")
        out.append((stem[:k] + tail, draw(st.integers(1, 14), label="max_tokens")))
    return out


@pytest.mark.parametrize("make", LEVELS)
@given(workload=workloads(), arch=st.sampled_from(["llama", "qwen3"]), data=st.data())
def test_greedy_output_equals_the_oracle(make, workload, arch, data, checkpoint_factory, oracle):
    check_against_oracle(make, workload, arch, data, checkpoint_factory, oracle)


@pytest.mark.parametrize("make", LEVELS)
@settings(max_examples=6)
@given(workload=workloads(), arch=st.sampled_from(["mixtral", "qwen2_moe", "qwen3_moe"]), data=st.data())
def test_moe_greedy_output_equals_the_oracle(make, workload, arch, data, checkpoint_factory, oracle):
    """Mixtures of experts (features/moe/layer.py) at every level: routing is per token, so no
    batching, chunking, preemption, prefix hit or speculation may change a token."""
    check_against_oracle(make, workload, arch, data, checkpoint_factory, oracle)


@pytest.mark.level1
@settings(max_examples=3)
@given(workload=workloads(), data=st.data())
def test_triton_backend_equals_the_oracle(workload, data, checkpoint_factory, oracle):
    """The Triton kernel (under TRITON_INTERPRET=1 on a CPU: slow, so a few examples)."""
    check_against_oracle(
        functools.partial(make_level1, backend="triton"), workload, "llama", data, checkpoint_factory, oracle
    )


def check_against_oracle(make, workload, arch, data, checkpoint_factory, oracle):
    path = checkpoint_factory(arch)
    need = max(len(p) + n for p, n in workload)
    engine = make(path, need, data)
    prompts = [p for p, _ in workload]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in workload]
    outputs = engine.generate(prompts, params, progress=False)
    for (prompt, n), out in zip(workload, outputs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == oracle.greedy(path, prompt, n)


# --- level 5: the same oracle, with the target split over processes ---------------------------------
LAYOUTS = {  # name: (tensor_parallel_size, pipeline_parallel_size, speculate with the random draft)
    "tp2": (2, 1, False),
    "pp2": (1, 2, False),
    "tp2-pp2": (2, 2, False),
    "tp2-spec": (2, 1, True),
    "pp2-spec": (1, 2, True),  # the drafts of each micro-batch in flight are kept apart
}
MOE_LAYOUTS = {  # mixtures of experts (features/moe/parallel.py): every expert sliced, or whole experts per rank
    "moe-tp2": (2, 1, False),
    "moe-ep2": (2, 1, False),  # enable_expert_parallel: tokens go to their experts' ranks (all-to-all)
    "moe-ep2-pp2": (2, 2, False),
}
_level5_engine: dict = {}  # at most one multi-rank engine per process: (key, engine)


def level5_engine(path, layout: str):
    """One engine per (checkpoint, layout), kept across examples (starting ranks takes seconds), with a
    tight KV budget (preemption), a small token budget (chunked prefill) and prefix caching on."""
    key = (str(path), layout)
    if _level5_engine.get("key") != key:
        if "engine" in _level5_engine:
            _level5_engine.pop("engine").shutdown()
        import level5_multigpu

        tp, pp, spec = {**LAYOUTS, **MOE_LAYOUTS}[layout]
        draft = draft_checkpoint() if spec else None
        kv = kv_bytes(path, 4 * 12) * 2 + (kv_bytes(draft, 4 * 12) if draft else 0)  # per rank: the heads are split
        _level5_engine["engine"] = level5_multigpu.LLMEngine(
            path, dtype="float64", block_size=4, kv_cache_memory=kv, max_num_batched_tokens=8, max_num_seqs=4,
            tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_timeout_s=60,
            enable_expert_parallel="-ep" in layout,
            speculative_config={"model": str(draft), "num_speculative_tokens": 3} if spec else None)  # fmt: skip
        _level5_engine["key"] = key
    return _level5_engine["engine"]


@pytest.fixture(scope="module")
def level5_cleanup():
    yield
    if "engine" in _level5_engine:
        _level5_engine.pop("engine").shutdown()
        _level5_engine.clear()


@pytest.mark.level5
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ["llama", "llama3"])  # llama3: one KV head, replicated on both TP ranks
@settings(max_examples=4)
@given(workload=workloads(), data=st.data())
def test_level5_greedy_output_equals_the_oracle(
    layout, arch, workload, data, checkpoint_factory, oracle, level5_cleanup
):
    """The suite's vocabulary (97) does not divide by 2: the vocab-parallel layers pad it."""
    check_level5(layout, arch, workload, data, checkpoint_factory, oracle)


def check_level5(layout, arch, workload, data, checkpoint_factory, oracle):
    path = checkpoint_factory(arch)
    engine = level5_engine(path, layout)
    need = max(len(p) + n for p, n in workload)
    if -(-need // 4) > engine.num_blocks:
        return  # larger than this fixed pool: the other levels cover budgets that fit
    check_against_oracle(lambda *a: Staggered(engine, data), workload, arch, data, checkpoint_factory, oracle)
    assert (
        not engine.in_flight and engine.kv.num_free_blocks == engine.num_blocks
    )  # every block back (cached ones count)


@pytest.mark.level5
@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])  # qwen2_moe: a shared expert, and a dense layer
@settings(max_examples=4)
@given(workload=workloads(), data=st.data())
def test_level5_moe_greedy_output_equals_the_oracle(layout, arch, workload, data, checkpoint_factory, oracle,
                                                     level5_cleanup):  # fmt: skip
    """Expert parallelism (whole experts per rank, tokens dispatched and combined by all-to-all) and
    tensor parallelism (every expert sliced, one all-reduce) give the oracle's tokens."""
    check_level5(layout, arch, workload, data, checkpoint_factory, oracle)


@pytest.mark.level5
@settings(max_examples=4)
@given(workload=workloads(), data=st.data())
def test_level5_moe_uneven_experts_equal_the_oracle(workload, data, checkpoint_factory, oracle, level5_cleanup):
    """5 experts over 2 expert-parallel ranks: rank 0 holds experts 0-2, rank 1 experts 3-4 (vLLM's
    determine_expert_map), so the ranks get unequal rows in the all-to-all; the tokens are still the oracle's."""
    five = lambda arch: checkpoint_factory(arch, num_local_experts=5)  # noqa: E731
    check_level5("moe-ep2", "mixtral", workload, data, five, oracle)
