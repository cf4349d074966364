"""The engine core: incremental detokenization, streaming outputs, abort, bounded memory, layering.

What it is: the tests of the seams levels 4-6 build on.

  - The incremental detokenizer, property-tested with the built-in byte-level tokenizer
    on random byte sequences (invalid UTF-8 and multi-byte characters split across
    tokens included): the concatenated deltas equal the one-shot decode, and no partial
    text ever shows half a character.
  - Stop strings, found token by token, cut the text exactly where the definition (the
    stop that ends first, written here independently) cuts the one-shot decode.
  - A streamed run (DELTA outputs) concatenates to exactly the offline `generate`.
  - `abort_request` gives one final output and frees blocks before it returns.
  - 4,000 steps of a running engine grow no container.
  - The import graph: no level imports a level above it; no engine inherits a method
    nobody calls.
"""

from __future__ import annotations

import ast
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_equivalence import kv_bytes

import level2_continuous
import level3_prefix
from ladder.models import REPO, builtin_path
from level0_naive import RequestOutputKind, SamplingParams
from level0_naive.detokenizer import IncrementalDetokenizer, find_stop
from level0_naive.outputs import Sequence


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_path("tiny-shakespeare"))


# Byte strings with multi-byte characters, invalid bytes and the three special tokens.
pieces = st.one_of(
    st.text(min_size=1, max_size=3).map(lambda s: list(s.encode())),  # any characters, 1-4 bytes each
    st.lists(st.integers(0x80, 0xFF), min_size=1, max_size=3),  # continuation / invalid bytes
    st.sampled_from([[256], [257], [258]]),  # <bos>, <eos>, <pad>: skipped in the text
)
token_streams = st.lists(pieces, max_size=20).map(lambda ps: [t for p in ps for t in p])


@pytest.mark.level0
@given(tokens=token_streams)
def test_incremental_deltas_concatenate_to_the_one_shot_decode(tokenizer, tokens):
    out: list[int] = []
    detok = IncrementalDetokenizer(tokenizer, out)
    whole = tokenizer.decode(tokens, skip_special_tokens=True)
    text = ""
    for t in tokens:
        out.append(t)
        text += detok.update()
        assert whole.startswith(text), (
            "a delta ended inside a character (or emitted text the final decode does not have)"
        )
    text += detok.finish()
    assert text == whole == detok.text


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The definition: scan end positions left to right; the first stop that ends there wins
    (ties: the one listed first)."""
    for end in range(len(text) + 1):
        for s in stops:
            if text[:end].endswith(s):
                return end - len(s), s
    return None


@pytest.mark.level0
@given(tokens=token_streams, data=st.data(), include=st.booleans())
def test_stop_strings_straddling_tokens_cut_as_the_one_shot_path(tokenizer, tokens, data, include):
    whole = tokenizer.decode(tokens, skip_special_tokens=True)
    stops = data.draw(st.lists(st.text(min_size=1, max_size=4) | st.sampled_from(sorted({whole[i : i + 3] for i in range(len(whole))} or {"x"})),
                               min_size=1, max_size=3), label="stops")  # fmt: skip
    stops = [s for s in stops if s]
    params = SamplingParams(max_tokens=None, stop=stops, include_stop_str_in_output=include, ignore_eos=True)
    seq = Sequence(0, "r", 0, None, [1], params, 10_000, [], None, tokenizer)
    for t in tokens:
        seq.append_token(t)
        if seq.is_finished:
            break
    if not seq.is_finished:
        seq.finish("length")
    assert find_stop(whole, stops) == first_stop(whole, stops)  # the rule is the definition
    hit = first_stop(whole, stops)
    if hit is None:
        assert seq.text == whole and seq.stop_reason is None
    else:
        at, stop = hit
        assert seq.stop_reason == stop and seq.finish_reason == "stop"
        assert seq.text == whole[: at + len(stop) if include else at]
        # Nothing after the stop is kept: one token earlier, the text emitted so far (complete
        # characters: a trailing U+FFFD may still be the start of one) did not show it yet.
        emitted = tokenizer.decode(seq.output_token_ids[:-1], skip_special_tokens=True).rstrip("\ufffd")
        assert first_stop(emitted, stops) is None


# --- the engine's outputs ------------------------------------------------------------------------
ENGINES = [
    pytest.param(level2_continuous, marks=pytest.mark.level2, id="level2"),
    pytest.param(level3_prefix, marks=pytest.mark.level3, id="level3"),
]


def stream(engine, prompts, params) -> dict[str, dict]:
    """Run requests through step() in DELTA mode; concatenate what each one streamed."""
    got = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
        got[str(i)] = {"text": [""] * sp.n, "tokens": [[] for _ in range(sp.n)], "finals": 0, "reasons": [None] * sp.n}
    while engine.has_unfinished_requests():
        for out in engine.step():
            g = got[out.request_id]
            assert g["finals"] == 0, "output after the final one"
            for c in out.outputs:
                g["text"][c.index] += c.text
                g["tokens"][c.index] += c.token_ids
                g["reasons"][c.index] = c.finish_reason
            g["finals"] += out.finished
    return got


@pytest.mark.parametrize("level", ENGINES)
def test_a_streamed_run_concatenates_to_the_offline_generate(level, checkpoint_factory):
    """Random-weight model with the byte tokenizer: sampled bytes are often invalid UTF-8
    and multi-byte characters, stop strings straddle tokens."""
    path = checkpoint_factory("llama", tokenizer=True)
    prompts = ["ROMEO:\n", "JULIET: \u00e9t\u00e9 \u20ac", [72, 195, 169, 226, 130], "A"]
    kinds = [
        dict(temperature=1.0, seed=1, max_tokens=40),
        dict(temperature=0.9, seed=2, max_tokens=30, stop=["e", "\u00e9t"], n=2),
        dict(temperature=1.0, seed=3, max_tokens=25, stop=["ab", "zz"], include_stop_str_in_output=True, logprobs=2),
        dict(temperature=0, max_tokens=20),
    ]
    offline = level.LLM(path, dtype="float64").generate(prompts, [SamplingParams(**k) for k in kinds], progress=False)
    engine = level.LLMEngine(path, dtype="float64")
    got = stream(engine, prompts, [SamplingParams(**k, output_kind=RequestOutputKind.DELTA) for k in kinds])
    for i, off in enumerate(offline):
        g = got[str(i)]
        assert g["finals"] == 1
        for c in off.outputs:
            assert (
                g["text"][c.index] == c.text
                and g["tokens"][c.index] == c.token_ids
                and g["reasons"][c.index] == c.finish_reason
            )
    assert any("\ufffd" in c.text for o in offline for c in o.outputs), "the workload should exercise invalid UTF-8"


@pytest.mark.parametrize("level", ENGINES)
def test_output_kinds(level, llama_dir):
    engine = level.LLMEngine(llama_dir, dtype="float64")
    engine.add_request("cum", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    engine.add_request(
        "final", [4, 5], SamplingParams(max_tokens=4, temperature=0, output_kind=RequestOutputKind.FINAL_ONLY)
    )
    seen = {"cum": [], "final": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append((len(out.outputs[0].token_ids), out.finished))
    assert seen["cum"] == [(1, False), (2, False), (3, False), (4, True)]
    assert seen["final"] == [(4, True)]


@pytest.mark.parametrize("level", ENGINES)
def test_abort_gives_one_final_output_and_frees_blocks_at_once(level, llama_dir):
    engine = level.LLMEngine(llama_dir, dtype="float64", block_size=4)
    engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=50, temperature=0))
    engine.add_request("b", [6, 7], SamplingParams(max_tokens=3, temperature=0, n=2))
    engine.step()
    engine.step()
    free_before = engine.kv.num_free_blocks
    engine.abort_request("a")
    assert engine.kv.num_free_blocks > free_before, "blocks are free before abort_request returns"
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.outputs[0].finish_reason) for o in finals].count(("a", "abort")) == 1
    a = next(o for o in finals if o.request_id == "a")
    assert len(a.outputs[0].token_ids) == 2 and a.finished
    engine.abort_request(["a", "b", "never-added"])  # finished or unknown: harmless
    assert engine.step() == [] and not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    assert [m.value for m in engine.get_metrics() if m.name == "vllm:num_requests_running"] == [0]


def container_sizes(root, skip_types) -> dict[str, int]:
    """The largest list, dict, set or deque held in each attribute of our classes, over every
    object reachable from `root` ("Scheduler.waiting": 3). Tensors, modules, tokenizers and
    requests (each bounded by its max_tokens, and gone when it finishes) are not descended
    into; a container inside a container (one request's block table in the table of
    tables) is per-entry, and only the outer one is measured."""
    sizes, seen, todo = {}, set(), [(root, "root", True)]
    while todo:  # iterative: the block pool's free queue is a linked list as long as the pool
        obj, path, held_by_attribute = todo.pop()
        if id(obj) in seen or isinstance(
            obj, (str, bytes, int, float, torch.Tensor, torch.nn.Module, torch.Generator, *skip_types)
        ):
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple, set, frozenset, dict)) or type(obj).__name__ == "deque":
            if held_by_attribute:
                sizes[path] = max(sizes.get(path, 0), len(obj))
            items = obj.items() if isinstance(obj, dict) else enumerate(obj)
            todo += [(v, path, False) for _, v in list(items)[:64]]  # the size is the point; a sample is walked
            continue
        if not (type(obj).__module__ or "").startswith(("level", "ladder")):
            continue
        attrs = dict(getattr(obj, "__dict__", {}))
        attrs.update({s: getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)})
        todo += [(v, f"{type(obj).__name__}.{name}", True) for name, v in attrs.items()]
    return sizes


@pytest.mark.parametrize("level", ENGINES)
def test_four_thousand_steps_grow_no_container(level, llama_dir):
    """About 35 requests finish between the two snapshots: a leak of one item per request or per step
    shows as growth well past the margin of 4."""
    engine = level.LLMEngine(
        llama_dir, dtype="float64", block_size=4, max_num_seqs=4, kv_cache_memory=kv_bytes(llama_dir, 4 * 400)
    )
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, stop_token_ids=[3]) for n in (150, 220, 310)]
    submitted, snapshots = 0, {}
    for step in range(1, 4_001):
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < 4:
            engine.add_request(f"r{submitted}", [1 + submitted % 80, 2, 3], params[submitted % 3])
            submitted += 1
        engine.step()
        if step % 2_000 > 1_750 and step % 25 == 0 or step % 2_000 == 0:
            # The largest each container got over the last 250 steps of each half (a request's life):
            # a free list rises and falls with the requests running, a leak only rises.
            sizes = container_sizes(engine, (Sequence, type(engine.tokenizer)))
            window = snapshots.setdefault(-(-step // 2_000) * 2_000, {})
            for p, n in sizes.items():
                window[p] = max(window.get(p, 0), n)
    assert engine.stats.steps == 4_000 and submitted > 40
    grew = {
        p: (snapshots[2_000].get(p, 0), n) for p, n in snapshots[4_000].items() if n > snapshots[2_000].get(p, 0) + 4
    }
    assert not grew, f"containers that grew between step 2,000 and 4,000: {grew}"


# --- the shape of the code -------------------------------------------------------------------------
LEVELS = [
    "level0_naive",
    "level1_paged",
    "level2_continuous",
    "level3_prefix",
    "level4_speculative",
    "level5_multigpu",
    "level6_serving",
]


def imports_of(path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_no_level_imports_a_level_above_it():
    for rank, level in enumerate(LEVELS):
        for path in sorted((REPO / level).glob("*.py")) if (REPO / level).is_dir() else []:
            above = imports_of(path) & set(LEVELS[rank + 1 :])
            assert not above, f"{path.relative_to(REPO)} imports {sorted(above)}, a level above it"
    for path in sorted((REPO / "ladder").glob("*.py")):
        assert not imports_of(path) & set(LEVELS), (
            f"{path.relative_to(REPO)} imports a level: ladder/ sits below them all"
        )


def test_no_engine_inherits_a_method_nobody_calls():
    """Continuous engines do not inherit static batching, and every method an engine
    inherits is called somewhere: by the ladder's code for its internals, by a user
    (the tests, benchmarks and docs stand in for them) for its public API."""
    import level0_naive.engine
    import level1_paged.engine

    engines = [
        level0_naive.engine.NaiveEngine,
        level1_paged.engine.PagedEngine,
        level2_continuous.LLMEngine,
        level3_prefix.LLMEngine,
    ]
    for cls in engines[2:]:
        assert level0_naive.engine.NaiveEngine not in cls.__mro__, (
            f"{cls.__module__}.{cls.__name__} inherits static batching"
        )
    files = [
        p
        for d in [*LEVELS, "benchmarks", "tests"]
        if (REPO / d).is_dir()
        for p in (REPO / d).glob("*.py")
        if p.name != "test_engine_core.py"
    ]
    source = "\n".join(p.read_text() for p in [*files, *(REPO / "docs").glob("*.md"), REPO / "README.md"])
    for cls in engines:
        for klass in cls.__mro__[1:]:
            if klass is object:
                continue
            for name, member in vars(klass).items():
                if not callable(member) or name.startswith("__"):
                    continue
                assert re.search(rf"\.{name}\b(?!\s*=)", source), (
                    f"{cls.__name__} inherits {klass.__name__}.{name}, which nothing calls"
                )
