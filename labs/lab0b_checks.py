"""Lab 0b's own checks: the reference masker and the draft's look-ahead, on small grammars.

What it is: pytest tests that `python -m labs check 0b` runs next to the structured-output
tests: the stop token is allowed exactly when the text is a complete match; a token is
allowed exactly when the text with it can still become one; `mask_after` answers for a
draft's guesses and leaves the state as it found it; an engine with the reference backend
writes outputs that match.

What it is not: the comparison with xgrammar (tests/test_structured_outputs.py has it).
"""

from __future__ import annotations

import regex
import torch

from features.structured_outputs import StructuredOutputManager, StructuredOutputsParams
from ladder.models import default_model
from level0_naive.loader import load_tokenizer

EOS = 257


def reference(spec: StructuredOutputsParams):
    tok = load_tokenizer(default_model())
    return StructuredOutputManager(tok, 259, [EOS], "reference").grammar(spec), tok


def test_stop_is_allowed_exactly_when_the_text_is_complete():
    g, tok = reference(StructuredOutputsParams(choice=["no", "nor"]))
    for text, complete in (("", False), ("n", False), ("no", True), ("nor", True)):
        for t in list(text.encode())[len(g.tokens) :]:
            assert g.accept(t), f"{text!r}: the grammar refused a token of a valid prefix"
        assert bool(g.allowed()[EOS]) == complete, f"after {text!r}: the stop token allowed={not complete}"


def test_a_token_is_allowed_exactly_when_the_text_can_still_match():
    g, tok = reference(StructuredOutputsParams(regex=r"[ab]{1,2}c"))
    mask = g.allowed()
    assert sorted(mask.nonzero().flatten().tolist()) == sorted(b"ab"), "first token: a or b, nothing else"
    assert g.accept(ord("a"))
    assert sorted(g.allowed().nonzero().flatten().tolist()) == sorted(b"abc")
    assert g.accept(ord("b"))
    assert g.allowed().nonzero().flatten().tolist() == [ord("c")], "two of [ab] already: only c may follow"


def test_mask_after_answers_for_guesses_and_leaves_the_state_alone():
    g, tok = reference(StructuredOutputsParams(choice=["ROMEO", "ROSALINE"]))
    assert g.accept(ord("R"))
    before, accepted = g.allowed(), g.num_accepted
    after_o = g.mask_after(list(b"O"), 259)
    assert after_o.nonzero().flatten().tolist() == sorted(b"MS"), "after 'RO': M or S"
    assert g.num_accepted == accepted and torch.equal(g.allowed(), before), "the guesses were not rolled back"
    assert g.mask_after(list(b"X"), 259).all(), "after a guess the grammar refuses, every token is allowed (never used)"
    assert g.num_accepted == accepted


def test_an_engine_with_the_reference_masker_writes_matching_outputs():
    from level2_continuous import LLM, SamplingParams

    llm = LLM(default_model(), structured_outputs_backend="reference", max_model_len=256)
    specs = [
        StructuredOutputsParams(choice=["TYBALT", "MERCUTIO"]),
        StructuredOutputsParams(regex=r"[0-9]{2}-[a-z]{2}"),
    ]
    outs = llm.generate(["ROMEO:\n"] * 2, [SamplingParams(max_tokens=12, temperature=0.8, seed=1, structured_outputs=s)
                                          for s in specs], progress=False)  # fmt: skip
    assert outs[0].outputs[0].text in ("TYBALT", "MERCUTIO")
    assert regex.fullmatch(r"[0-9]{2}-[a-z]{2}", outs[1].outputs[0].text)
