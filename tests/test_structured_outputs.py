"""Structured outputs: `SamplingParams(structured_outputs=...)` keeps every output inside its grammar.

What it is:
  - JSON schemas (nested objects, arrays, enums, bounded integers, strings with patterns and
    lengths): every output, greedy and sampled, parses and validates with `jsonschema`, and
    ends with "stop"; `choice` outputs are one of the choices; `regex` outputs match; with the
    default backend (xgrammar, llguidance for a pattern with a length) and with llguidance alone;
  - the readable reference masker and each engine (xgrammar, llguidance) allow the same tokens
    at every step of random walks through `choice` and regex grammars;
  - with speculation on (a random draft model, n-grams), greedy outputs equal speculation off
    (float64); under preemption and chunked prefill (level 2's tight budgets) they equal a
    roomy run: the grammar's state survives recomputation;
  - a bad schema is a ValueError naming the field; exactly one kind must be set.

What it is not: the server's `response_format` (tests/test_level6.py) or a speed test
(`python -m benchmarks.grammar`).
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import regex

import level2_continuous
import level3_prefix
import level4_speculative
from features.structured_outputs import StructuredOutputManager
from level0_naive import SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar", reason="structured outputs use xgrammar")

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "role": {"enum": ["king", "queen", "fool"]}},
     "required": ["name", "age", "role"], "additionalProperties": False},
    {"type": "object", "properties": {"lines": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                                                "minItems": 1, "maxItems": 3},
                                      "act": {"type": "object", "properties": {"number": {"type": "integer", "minimum": 1,
                                                                                          "maximum": 5},
                                                                               "scene": {"type": "integer", "minimum": 1,
                                                                                         "maximum": 9}},
                                              "required": ["number", "scene"], "additionalProperties": False}},
     "required": ["lines", "act"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    # a pattern with lengths: xgrammar would drop the lengths, so auto compiles it with llguidance
    {"type": "object", "properties": {"title": {"type": "string", "pattern": "^[A-Z][a-z]+$", "minLength": 3, "maxLength": 7},
                                      "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$",
                                                                          "maxLength": 3}, "maxItems": 2}},
     "required": ["title", "tags"], "additionalProperties": False},
]  # fmt: skip
CHOICES = ["ROMEO", "JULIET", "friar Laurence"]
# [0-9], not \d: llguidance's \d is Rust's, every Unicode digit (it allows the first byte of U+0660), xgrammar's
# is ASCII's, and the reference masker never allows half a character
REGEXES = [r"[A-Z][a-z]{2,6} of [A-Z][a-z]{2,6}", r"(yes|no|maybe)!{1,3}", r"[0-9]{1,3}-[0-9]{2}"]


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    return checkpoint_factory("llama", tokenizer=True)  # the built-in byte-level vocabulary: text in, text out


def run(llm, specs: list[StructuredOutputsParams], temperature: float = 0.0, max_tokens: int = 120):
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i, structured_outputs=s)
              for i, s in enumerate(specs)]  # fmt: skip
    return [o.outputs[0] for o in llm.generate(["ROMEO:\nWho art thou?\n"] * len(specs), params, progress=False)]


@pytest.mark.level3
@pytest.mark.parametrize("temperature,backend", [(0.0, "auto"), (1.0, "auto"), (1.0, "guidance")])
def test_json_choice_and_regex_outputs_obey_their_grammar(model, temperature, backend):
    llm = level3_prefix.LLM(model, dtype="float32", structured_outputs_backend=backend)
    outs = run(llm, [StructuredOutputsParams(json=s) for s in SCHEMAS] + [StructuredOutputsParams(json_object=True)]
               + [StructuredOutputsParams(choice=CHOICES)] + [StructuredOutputsParams(regex=r) for r in REGEXES],
               temperature)  # fmt: skip
    for out, schema in zip(outs, SCHEMAS):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    obj = outs[len(SCHEMAS)]
    assert obj.finish_reason != "stop" or isinstance(json.loads(obj.text), dict)  # json_object: any object
    assert outs[len(SCHEMAS) + 1].text in CHOICES and outs[len(SCHEMAS) + 1].finish_reason == "stop"
    for out, pattern in zip(outs[len(SCHEMAS) + 2 :], REGEXES):
        assert regex.fullmatch(pattern, out.text), (pattern, out.text)
        assert out.finish_reason == "stop"


@pytest.mark.level0
@pytest.mark.parametrize("engine", ["xgrammar", "guidance"])
@pytest.mark.parametrize("spec", [StructuredOutputsParams(choice=CHOICES), *(StructuredOutputsParams(regex=r) for r in REGEXES)],
                         ids=["choice", *REGEXES])  # fmt: skip
def test_the_reference_masker_and_the_engines_allow_the_same_tokens(model, spec, engine):
    """Random walks through the grammar: at every step both allow exactly the same tokens (stop included)."""
    from level0_naive.loader import load_tokenizer

    tok = load_tokenizer(model)
    managers = [StructuredOutputManager(tok, 259, [257], backend) for backend in (engine, "reference")]
    rng = random.Random(0)
    for walk in range(3):
        grammars = [m.grammar(spec) for m in managers]
        for _ in range(40):
            masks = [g.allowed() for g in grammars]
            assert masks[0].tolist() == masks[1].tolist(), f"walk {walk}: the masks differ"
            allowed = masks[0].nonzero().flatten().tolist()
            if not allowed:
                break
            t = rng.choice(allowed)
            assert all(g.accept(t) for g in grammars)
            if grammars[0].is_terminated():
                assert grammars[1].is_terminated()
                break


@pytest.mark.level0
def test_the_batched_mask_equals_the_row_by_row_one(model):
    """GrammarMask.batch (one bitmask for every xgrammar and llguidance row) against its __call__, row by row:
    rows at their accepted tokens, rows with guesses past them (a draft's), a reference grammar, and a row
    with no grammar."""
    import torch

    from features.structured_outputs import GrammarMask
    from level0_naive.loader import load_tokenizer
    from level0_naive.logits_processors import SamplingState

    tok = load_tokenizer(model)
    xgr, ref, llg = (StructuredOutputManager(tok, 259, [257], b) for b in ("xgrammar", "reference", "guidance"))
    specs = [StructuredOutputsParams(json=SCHEMAS[0]), StructuredOutputsParams(choice=CHOICES)]
    states = []
    for spec, manager, extra in [(specs[0], xgr, []), (specs[0], xgr, list(b'{"na')), (specs[1], xgr, list(b"RO")),
                                 (specs[1], ref, list(b"JU")), (specs[0], llg, []), (specs[1], llg, list(b"fri")),
                                 (None, None, [])]:  # fmt: skip
        grammar = manager.grammar(spec) if manager else None
        accepted = list(b'{"name": "') if spec is specs[0] and not extra else []
        for t in accepted:
            assert grammar.accept(t)
        params = SamplingParams(temperature=0, structured_outputs=spec)
        states.append(SamplingState(params, [1, 2], accepted + extra, None, [257], grammar))
    logits = torch.randn(len(states), 259, dtype=torch.float64)
    mask = GrammarMask()
    loop = torch.stack([mask(logits[i], st) if mask.applies(st.params) else logits[i] for i, st in enumerate(states)])
    assert torch.equal(mask.batch(logits, states), loop)
    assert torch.isinf(loop[:6]).any(-1).all() and not torch.isinf(loop[6]).any()  # every grammar row masked
    assert loop[:6, 256].isinf().all() and loop[:6, 258].isinf().all()  # <bos> and <pad>: never in a grammar's output


@pytest.mark.level4
def test_speculation_changes_no_structured_output(model, checkpoint_factory):
    """float64, greedy: level 4 with a random draft model, with n-grams and with a random EAGLE head writes
    what level 3 writes (a head's guesses are masked by the grammar as a draft model's are)."""
    from test_equivalence import eagle_checkpoint

    draft = checkpoint_factory("llama", seed=7, tokenizer=True, hidden_size=32, head_dim=8, num_hidden_layers=1)
    specs = [StructuredOutputsParams(json=SCHEMAS[0]), StructuredOutputsParams(choice=CHOICES),
             StructuredOutputsParams(regex=REGEXES[0]), StructuredOutputsParams(json=SCHEMAS[3])]  # (llguidance's)
    want = [o.text for o in run(level3_prefix.LLM(model, dtype="float64"), specs)]
    for spec in ({"model": str(draft), "num_speculative_tokens": 3},
                 {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
                 {"method": "eagle", "model": str(eagle_checkpoint(model)), "num_speculative_tokens": 3}):  # fmt: skip
        llm = level4_speculative.LLM(model, dtype="float64", speculative_config=spec)
        assert [o.text for o in run(llm, specs)] == want
    assert llm.spec_decode_stats().num_draft_tokens > 0


@pytest.mark.level2
def test_preemption_and_chunked_prefill_keep_the_grammar_state(model):
    """A KV budget of two requests and a token budget of 5: preemptions and recomputation; the outputs
    equal a roomy run's."""
    specs = [StructuredOutputsParams(json=SCHEMAS[i % 2]) for i in range(5)]
    roomy = [o.text for o in run(level2_continuous.LLM(model, dtype="float64"), specs)]
    bytes_per_token = 2 * 2 * 2 * 16 * 8  # k and v x layers x KV heads x head_dim x float64
    tight = level2_continuous.LLM(model, dtype="float64", block_size=4, max_num_batched_tokens=5,
                                  kv_cache_memory=2 * 140 * bytes_per_token)  # fmt: skip
    assert [o.text for o in run(tight, specs)] == roomy
    assert tight.llm_engine.stats.preemptions > 0


@pytest.mark.level0
def test_bad_specs_are_value_errors_naming_the_field(model):
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match=r"json_object must be true or false \(got 0.0\)"):  # not "unset"
        StructuredOutputsParams(json_object=0.0, choice=["a"])
    with pytest.raises(ValueError, match="disable_any_whitespace must be true or false"):
        StructuredOutputsParams(choice=["a"], disable_any_whitespace=None)
    llm = level2_continuous.LLM(model, dtype="float32")
    for spec, field in [(StructuredOutputsParams(json={"type": "nonsense"}), "json"),
                        (StructuredOutputsParams(regex="(unclosed"), "regex"),
                        (StructuredOutputsParams(grammar="root ::= "), "grammar")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"structured_outputs.{field} is not valid: [A-Z][^/]*$"):  # no C++ path
            llm.generate(["x"], SamplingParams(structured_outputs=spec), progress=False)
    with pytest.raises(ValueError, match="structured_outputs=.* must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    guidance = level2_continuous.LLM(model, dtype="float32", structured_outputs_backend="guidance")
    for spec, field in [(StructuredOutputsParams(json={"type": "nonsense"}), "json"),
                        (StructuredOutputsParams(regex="(unclosed"), "regex"),
                        (StructuredOutputsParams(json="{not json"), "json")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"structured_outputs.{field} is not valid: "):
            guidance.generate(["x"], SamplingParams(structured_outputs=spec), progress=False)
    # xgrammar drops minLength/maxLength beside a pattern (the output then runs to max_tokens and does not
    # validate: 0 of 17 with the built-in model): the xgrammar backend refuses it, naming where; auto
    # compiles it with llguidance instead (see test_json_choice_and_regex_outputs_obey_their_grammar)
    bounded = {"type": "object", "properties": {"title": {"type": "string", "pattern": "^[A-Z][a-z]+$", "maxLength": 9},
                                                "pattern": {"type": "string"}}}  # fmt: skip
    spec = StructuredOutputsParams(json=bounded)
    xgr = level2_continuous.LLM(model, dtype="float32", structured_outputs_backend="xgrammar")
    with pytest.raises(ValueError, match=r"structured_outputs.json is not supported by xgrammar: the schema.properties.title"):
        xgr.generate(["x"], SamplingParams(structured_outputs=spec), progress=False)
    assert llm.llm_engine.request_preparer.backend_for(spec) == "guidance"
    del bounded["properties"]["title"]["maxLength"]  # a pattern alone, and a property named "pattern": xgrammar's
    assert llm.llm_engine.request_preparer.backend_for(StructuredOutputsParams(json=bounded)) == "xgrammar"
