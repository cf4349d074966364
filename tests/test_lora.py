"""Multi-LoRA (features/lora): requests on different adapters and on the base model, mixed in one
batch, give HF PEFT's greedy tokens; the gathered path equals the loop; two adapters never share a
KV block; a step never holds more adapters than slots, and no running request's adapter leaves its
slot; a bad adapter is refused in one line.

The oracle is PEFT's own model (`PeftModel.from_pretrained` over the HF checkpoint), greedy with no
KV cache, in float64, on random adapters of different ranks and targets saved with `save_pretrained`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, Oracle
from hypothesis import given
from hypothesis import strategies as st
from test_equivalence import Staggered, draft_checkpoint, kv_bytes, workloads

import level1_paged
import level2_continuous
import level3_prefix
import level4_speculative
from features.lora import cpu_ops, delta_gathered, delta_loop, delta_segmented, delta_stacked
from features.lora.slots import delta_cpu
from level0_naive import SamplingParams
from level3_prefix import LoRARequest  # (the room lends it to every level)

pytestmark = pytest.mark.level3
# the compiled loop (cpu_ops.py) where a C++ compiler builds it: the other paths are tested without one
COMPILED = ["cpu"] if cpu_ops.available() else []
needs_compiler = pytest.mark.skipif(not cpu_ops.available(), reason=f"cpu_lora.cpp did not build: {cpu_ops.LIBRARY.error}")

# (seed, rank, alpha, targets, rslora) per adapter: every projection targeted by some adapter
SPECS = [(1, 4, 8, ["q_proj", "v_proj", "down_proj"], False), (2, 8, 8, ["k_proj", "o_proj", "gate_proj", "up_proj"], False),
         (3, 2, 4, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True)]  # fmt: skip


def save_adapter(base: Path, out: Path, seed: int, rank: int, alpha: int, targets: list[str], rslora: bool) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                                            init_lora_weights=False))  # fmt: skip
    for name, w in peft.named_parameters():
        if "lora_" in name:
            w.data.normal_(0, 0.3)  # large enough that every adapter changes the greedy tokens
    peft.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(checkpoint_factory, tmp_path_factory):
    """{arch: [LoRARequest, ...]}, built on first use per architecture."""
    made = {}

    def get(arch: str) -> list[LoRARequest]:
        if arch not in made:
            base = checkpoint_factory(arch)
            made[arch] = [LoRARequest(f"a{i}", i + 1, str(save_adapter(base, tmp_path_factory.mktemp(f"lora-{arch}"), *spec)))
                          for i, spec in enumerate(SPECS)]  # fmt: skip
        return made[arch]

    return get


class PeftOracle(Oracle):
    """PEFT's greedy tokens: conftest's oracle (no KV cache, memoised per model and prompt) over the base model
    with an adapter (None: the base model alone)."""

    def model(self, key: tuple[Path, str | None]):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        if key not in self.models:
            base, adapter = key
            m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
            self.models[key] = (m if adapter is None else PeftModel.from_pretrained(m, adapter)).eval()
        return self.models[key]

    def greedy(self, base: Path, adapter: str | None, prompt: list[int], n: int) -> list[int]:
        return super().greedy((base, adapter), prompt, n)


@pytest.fixture(scope="module")
def peft_oracle():
    return PeftOracle()


class WithAdapters:
    """Staggered's add_request with each request's adapter; after every step: at most max_loras adapters
    in the slots' use, and every running request's adapter in a slot."""

    def __init__(self, engine, loras):
        self.engine, self.loras = engine, loras
        add, step = engine.add_request, engine.step
        engine.add_request = lambda rid, *a, **kw: add(rid, *a, lora_request=self.loras[int(rid)], **kw)
        engine.step = lambda: self._checked(step())

    def _checked(self, outputs):
        lora, running = self.engine.lora, self.engine.scheduler.running
        ids = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
        assert len(ids) <= lora.config.max_loras, "more adapters running than slots"
        stepped = {r.lora_request.lora_int_id for r in running if r.lora_request is not None and r.num_computed_tokens}
        assert stepped <= set(lora.slot_of), "a running request's adapter left its slot"
        return outputs


@given(workload=workloads(), arch=st.sampled_from(["llama", "qwen3", "qwen2"]), data=st.data())
def test_mixed_adapters_give_peft_greedy_tokens(workload, arch, data, checkpoint_factory, adapters, peft_oracle):
    """Levels 2, 3 and 4 (n-gram or a draft model, which runs without adapters: the target verifies
    with them); requests on each adapter and on none; slots from 1 (every step one adapter) to
    all; a pool from the largest request alone (preemption), a drawn token budget (chunked prefill),
    prefix hits (level 3, twice the same workload), arrivals at drawn steps; every CPU delta path (the compiled loop and punica.py's)."""
    path, pool = checkpoint_factory(arch), adapters(arch)
    loras = data.draw(st.lists(st.sampled_from([None, *pool]), min_size=len(workload), max_size=len(workload)),
                      label="adapters")  # fmt: skip
    level = data.draw(st.sampled_from([level2_continuous, level3_prefix, level4_speculative]), label="level")
    spec = {} if level is not level4_speculative else {"speculative_config": data.draw(st.sampled_from([
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
        {"model": str(draft_checkpoint()), "num_speculative_tokens": 2}]), label="speculation")}  # fmt: skip
    need, bs = max(len(p) + n for p, n in workload) + 2, data.draw(st.sampled_from([1, 4, 16]), label="block_size")
    blocks = -(-need // bs) * data.draw(st.sampled_from([1, 2, 100]), label="kv budget (x largest request)")
    draft = spec.get("speculative_config", {}).get("model")  # its KV shares the budget (+2: k guesses)
    budget = sum(kv_bytes(p, blocks * bs) for p in (path, *([draft] if draft else [])))
    engine = level.LLMEngine(path, dtype="float64", block_size=bs, kv_cache_memory=budget,
                             max_num_seqs=data.draw(st.integers(1, 6), label="max_num_seqs"),
                             max_num_batched_tokens=data.draw(st.sampled_from([1, 5, 2048]), label="token budget"),
                             enable_lora=True, max_loras=data.draw(st.integers(1, 3), label="max_loras"),
                             max_lora_rank=8, **spec)  # fmt: skip
    engine.lora.path = data.draw(st.sampled_from([*COMPILED, "stacked", "segmented", "gathered", "loop"]), label="delta path")
    runner = Staggered(WithAdapters(engine, loras).engine, data)
    prompts, params = [p for p, _ in workload], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                                 for _, n in workload]  # fmt: skip
    for _ in range(1 if level is level2_continuous else 2):  # levels 3-4's second round hits their own prefixes
        for (prompt, n), lora, out in zip(workload, loras, runner.generate(prompts, params)):
            assert out.outputs[0].token_ids == peft_oracle.greedy(path, lora and lora.lora_path, prompt, n)


@pytest.mark.parametrize("path", ["loop", "gathered", "segmented", "stacked", pytest.param("cpu", marks=needs_compiler), "triton"])
def test_each_path_gives_peft_greedy_tokens_in_one_mixed_batch(path, checkpoint_factory, adapters, peft_oracle):
    """No draw: one batch of rows on every adapter and on none, neighbours on different adapters,
    two slots for three adapters (so slots are reused), on each delta path (lab 2c's check; the Triton
    kernels under the interpreter on a CPU)."""
    base, pool = checkpoint_factory("llama"), adapters("llama")
    loras = [pool[0], pool[1], None, pool[2], pool[0], None, pool[1]]
    rng = random.Random(1)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 9))] for _ in loras]
    llm = level2_continuous.LLM(base, dtype="float64", enable_lora=True, max_loras=2, max_lora_rank=8)
    llm.llm_engine.lora.path = path
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), lora_request=loras,
                        progress=False)  # fmt: skip
    for prompt, lora, out in zip(prompts, loras, outs):
        assert out.outputs[0].token_ids == peft_oracle.greedy(base, lora and lora.lora_path, prompt, 5), (path, lora)


@given(T=st.integers(1, 9), S=st.integers(1, 4), R=st.integers(1, 5), data=st.data())
def test_every_delta_equals_the_loop(T, S, R, data):
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000), label="seed"))
    x, A, B = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((T, 6), (S, R, 6), (S, 5, R)))
    scale = torch.rand(S, generator=g, dtype=torch.float64)
    idx = torch.tensor(data.draw(st.lists(st.integers(-1, S - 1), min_size=T, max_size=T), label="slots"))
    deltas = (delta_loop, delta_gathered, delta_segmented, delta_stacked, *([delta_cpu] if COMPILED else []))
    loop, *others = (f(x, A, B, scale, idx) for f in deltas)
    for other in others:
        torch.testing.assert_close(other, loop, rtol=1e-12, atol=1e-12)
    assert not loop[idx < 0].any()  # the base model's rows get nothing


@needs_compiler
@given(T=st.integers(1, 70), S=st.integers(1, 5), R=st.integers(1, 20), n_in=st.integers(1, 150),
       n_out=st.integers(1, 150), dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]), data=st.data())  # fmt: skip
def test_the_compiled_delta_adds_the_loops_delta(T, S, R, n_in, n_out, dtype, data):
    """cpu_ops.py's kernel, added into a base output, on rows not a multiple of its four, outputs not a multiple of
    its chunk of 64, rows that are column slices of wider tensors (strided), rows on no adapter, slots no row uses:
    y + the loop's delta, to rounding (bfloat16: computed in float32 and rounded once, as the kernel does)."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 1000), label="seed"))
    pad = data.draw(st.integers(0, 3), label="columns around x's and y's rows")
    wide_x, wide_y = (torch.randn(T, n + 2 * pad, generator=g).to(dtype) for n in (n_in, n_out))
    x, y = wide_x[:, pad : pad + n_in], wide_y[:, pad : pad + n_out]  # [T, in], [T, out]: rows n + 2 pad apart
    A = torch.randn(S, R, n_in, generator=g).to(dtype)
    B = torch.randn(S, R, n_out, generator=g).to(dtype).transpose(1, 2)  # [S, out, R], as the slots keep it
    scale = torch.rand(S, generator=g).to(dtype)
    idx = torch.tensor(data.draw(st.lists(st.integers(-1, S - 1), min_size=T, max_size=T), label="slots"))
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    want = (y.to(wide) + delta_loop(*(t.to(wide) for t in (x, A, B, scale)), idx)).to(dtype)
    before = wide_y.clone()
    kernel = cpu_ops.SlotKernel(A, B, scale)
    assert kernel.takes(x, y)
    assert kernel(x, idx, y) is y
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(y, want, rtol=tol, atol=tol * (1 + want.abs().max().item()))
    if pad:  # nothing outside the rows' own columns is touched
        assert torch.equal(wide_y[:, :pad], before[:, :pad]) and torch.equal(wide_y[:, pad + n_out :], before[:, pad + n_out :])
    assert torch.equal(y[idx < 0], before[:, pad : pad + n_out][idx < 0])  # the base model's rows: untouched


@needs_compiler
def test_the_default_path_is_the_compiled_loop_where_it_builds(checkpoint_factory, adapters, monkeypatch):
    """"auto": the compiled loop on a CPU with a compiler, and in a step every projection runs it (none falls
    back to the stacked matmuls); the stacked matmuls without a compiler and for float16 slots, which the
    kernel does not take (the same delta: the engine still serves); a strided row goes the stacked way."""
    path, (a1, a2, _) = checkpoint_factory("llama"), adapters("llama")
    calls = []
    monkeypatch.setattr(cpu_ops.SlotKernel, "run", lambda self, x, idx, out, run=cpu_ops.SlotKernel.run:
                        calls.append(len(x)) or run(self, x, idx, out))  # fmt: skip
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm = level2_continuous.LLM(path, dtype="float64", enable_lora=True, max_loras=2, max_lora_rank=8)
    assert llm.llm_engine.lora.path == "cpu"
    outs = llm.generate([[1, 2, 3], [4, 5]], params, lora_request=[a1, a2], progress=False)
    adapted = len(llm.llm_engine.lora.slots.kernels)  # projections with slots, every layer's
    assert len(calls) == 3 * adapted and calls[:adapted] == [5] * adapted  # three steps (a prefill of 5 rows)
    kernel = next(iter(llm.llm_engine.lora.slots.kernels.values()))
    assert not kernel.takes(torch.zeros(kernel.n_in, 2, dtype=torch.float64).T, torch.zeros(2, kernel.n_out, dtype=torch.float64))
    half = level2_continuous.LLM(path, dtype="float16", enable_lora=True, max_loras=2, max_lora_rank=8)
    assert half.llm_engine.lora.path == "stacked" and not hasattr(half.llm_engine.lora.slots, "kernels")
    assert len(half.generate([[1, 2, 3]], params, lora_request=a1, progress=False)[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="LoRA path 'cpu' needs CPU tensors of float32, bfloat16 or float64"):
        half.llm_engine.lora.path = "cpu"
    monkeypatch.setattr(cpu_ops, "available", lambda: False)
    llm = level2_continuous.LLM(path, dtype="float64", enable_lora=True, max_loras=2, max_lora_rank=8)
    assert llm.llm_engine.lora.path == "stacked"
    assert [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5]], params, lora_request=[a1, a2],
                                                         progress=False)] == [o.outputs[0].token_ids for o in outs]  # fmt: skip
    with pytest.raises(ValueError, match="LoRA path 'cpu' needs CPU tensors .* C\\+\\+ compiler"):
        llm.llm_engine.lora.path = "cpu"


STEMS = [[random.Random(i).randrange(VOCAB) for _ in range(12)] for i in range(2)]


@given(runs=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 12), st.lists(st.integers(1, 2), max_size=5),
                               st.integers(0, 3)), min_size=1, max_size=8))  # fmt: skip
def test_two_adapters_never_share_a_kv_block(runs, checkpoint_factory, adapters):
    """Prompts that share prefixes, each on an adapter or on none (3), one after another on level 3 with a
    pool that never evicts: a prompt's prefix hits are exactly the longest run of whole blocks it shares
    with an earlier prompt *on the same adapter* (never the last token): no block crosses adapters."""
    path, pool = checkpoint_factory("llama"), adapters("llama")
    bs, params = 4, SamplingParams(max_tokens=1, temperature=0)
    llm = level3_prefix.LLM(path, dtype="float64", block_size=bs, enable_lora=True, max_loras=3, max_lora_rank=8)
    seen: dict[int, list[list[int]]] = {}
    for stem, cut, tail, which in runs:
        prompt, lora = STEMS[stem][:cut] + tail or [1], (pool + [None])[which]
        want = 0
        for earlier in seen.get(which, []):  # whole blocks of computed prompt tokens in common, within the usable ones
            blocks = 0
            while (blocks + 1) * bs <= min(len(earlier), len(prompt) - 1) and \
                    earlier[:(blocks + 1) * bs] == prompt[:(blocks + 1) * bs]:  # fmt: skip
                blocks += 1
            want = max(want, blocks * bs)
        before = llm.llm_engine.prefix_stats()["prefix_cache_hits"]
        llm.generate([prompt], params, lora_request=lora, progress=False)
        assert llm.llm_engine.prefix_stats()["prefix_cache_hits"] - before == want, (prompt, which, seen)
        seen.setdefault(which, []).append(prompt)


def test_a_merged_adapter_gives_the_same_tokens(checkpoint_factory, adapters, peft_oracle):
    """PEFT's `merge_and_unload()` (W + scale B A folded into the weights, a plain model) gives the tokens the
    engine gives with the adapter in a slot, and PeftModel's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base, pool = checkpoint_factory("llama"), adapters("llama")
    llm = level2_continuous.LLM(base, dtype="float64", enable_lora=True, max_loras=3, max_lora_rank=8)
    prompt = [random.Random(5).randrange(VOCAB) for _ in range(7)]
    outs = llm.generate([prompt] * 3, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), lora_request=pool,
                        progress=False)  # fmt: skip
    for lora, out in zip(pool, outs):
        merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64),
                                           lora.lora_path).merge_and_unload().eval()  # fmt: skip
        ids = merged.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, use_cache=False)[0, 7:]
        assert out.outputs[0].token_ids == ids.tolist() == peft_oracle.greedy(base, lora.lora_path, prompt, 6)


def test_a_bad_adapter_or_a_wrong_engine_is_refused_in_one_line(checkpoint_factory, adapters, tmp_path):
    path, (a1, a2, _) = checkpoint_factory("llama"), adapters("llama")
    llm = level3_prefix.LLM(path, dtype="float64", enable_lora=True, max_loras=1, max_lora_rank=4)
    bad_config = tmp_path / "lm_head"
    bad_config.mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (bad_config / f).write_bytes((Path(a1.lora_path) / f).read_bytes())
    conf = json.loads((bad_config / "adapter_config.json").read_text())
    (bad_config / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    for lora, words in [
        (LoRARequest("gone", 9, str(tmp_path / "nothing")), "no adapter_config.json there"),
        (a2, "rank r=8 is above max_lora_rank=4"),
        (LoRARequest("dora", 7, str(bad_config)), "use_dora=True is not supported"),
    ]:
        with pytest.raises(ValueError) as e:
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1), lora_request=lora, progress=False)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    wrong_base = level3_prefix.LLM(checkpoint_factory("llama", hidden_size=48), dtype="float64", enable_lora=True,
                                   max_lora_rank=8)  # fmt: skip
    with pytest.raises(ValueError, match=r"is \(64, 4\), the base model needs \(48, 4\)"):
        wrong_base.generate([[1, 2]], SamplingParams(max_tokens=1), lora_request=a1, progress=False)
    with pytest.raises(ValueError, match="this engine has no LoRA"):
        level3_prefix.LLM(path, dtype="float64").generate([[1]], lora_request=a1, progress=False)
    with pytest.raises(TypeError, match=r"unknown setting\(s\) enable_lora"):  # level 1 does not batch: no LoRA
        level1_paged.LLM(path, dtype="float64", enable_lora=True)
    with pytest.raises(ValueError, match="lora_int_id=0 must be an integer >= 1"):
        LoRARequest("zero", 0, a1.lora_path)
    llm.generate([[1, 2]], SamplingParams(max_tokens=1), lora_request=a1, progress=False)  # id 1 is a1 now
    with pytest.raises(ValueError, match="lora_int_id=1 is already"):  # one id, one adapter
        llm.generate([[1, 2]], SamplingParams(max_tokens=1), lora_request=LoRARequest("b", 1, a2.lora_path),
                     progress=False)  # fmt: skip
    a3 = next(a for a in adapters("llama") if a.lora_int_id == 3)  # rank 2: fits max_lora_rank=4
    llm.generate([[1, 2]], SamplingParams(max_tokens=1), lora_request=a3, progress=False)  # the one host entry: a3
    with pytest.raises(ValueError, match="lora_int_id=1 is already"):  # a1 left the host cache, and its id stays a1's
        llm.generate([[1, 2]], SamplingParams(max_tokens=1), lora_request=LoRARequest("c", 1, a3.lora_path),
                     progress=False)  # fmt: skip
    with pytest.raises(ValueError, match="LoRA path 'fast': one of auto, cpu, stacked"):
        llm.llm_engine.lora.path = "fast"
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "adapter_config.json").write_text("[1, 2]")
    (garbage / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="unreadable"):
        llm.generate([[1]], SamplingParams(max_tokens=1), lora_request=LoRARequest("g", 5, str(garbage)), progress=False)
    for refused, words in [({"batch_invariant": True}, "batch_invariant=True is not built"),
                           ({"kv_transfer_config": {"kv_connector": "TCPConnector", "kv_role": "kv_consumer"}},
                            "TCPConnector with enable_lora=True is not built")]:  # fmt: skip
        with pytest.raises(ValueError, match=words):
            level3_prefix.LLM(path, dtype="float64", enable_lora=True, **refused)


def test_beam_search_on_a_lora_engine_runs_the_base_model(checkpoint_factory, adapters):
    """After a step on an adapter, beam search (which runs its own forwards) gets the base model's beams."""
    from level3_prefix import BeamSearchParams

    path, (a1, *_) = checkpoint_factory("llama"), adapters("llama")
    prompt, params = [5, 9, 2, 7], BeamSearchParams(beam_width=3, max_tokens=4)
    plain = level3_prefix.LLM(path, dtype="float64").beam_search([prompt], params)
    lora = level3_prefix.LLM(path, dtype="float64", enable_lora=True, max_lora_rank=8)
    lora.generate([prompt], SamplingParams(max_tokens=2), lora_request=a1, progress=False)  # leaves a mapping
    got = lora.beam_search([prompt], params)
    assert [s.tokens for s in got[0].sequences] == [s.tokens for s in plain[0].sequences]


def test_the_adapters_running_and_waiting_are_a_gauge(checkpoint_factory, adapters):
    """vLLM's `vllm:lora_requests_info`: with one slot, a request on a0 runs and one on a1 waits; the
    gauge's labels name them (and max_loras), and change as the batch does."""
    path, (a0, a1, _) = checkpoint_factory("llama"), adapters("llama")
    llm = level2_continuous.LLM(path, dtype="float64", enable_lora=True, max_loras=1, max_lora_rank=8)
    engine, params = llm.llm_engine, SamplingParams(max_tokens=3, temperature=0)

    def info():
        (g,) = [m for m in engine.get_metrics() if m.name == "vllm:lora_requests_info"]
        return g.labels

    assert info() == {"max_lora": "1", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    engine.add_request("r0", [5, 6, 7], params, lora_request=a0)
    engine.add_request("r1", [5, 6, 8], params, lora_request=a1)
    engine.add_request("r2", [5, 6, 9], params)
    engine.step()
    assert info() == {"max_lora": "1", "running_lora_adapters": "a0", "waiting_lora_adapters": "a1"}
    while engine.has_unfinished_requests():
        engine.step()
        labels = info()
        assert "," not in labels["running_lora_adapters"]  # one slot: never two adapters at once
    assert info()["running_lora_adapters"] == ""
