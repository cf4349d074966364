"""Lab 0b: structured outputs, the mask step (the room's `features/structured_outputs/grammar.py`).

What it is: the lab's definition (see `labs/spec.py`): `ReferenceGrammar.allowed` (which
tokens may come next, the plain way: every token tried against a partial match) and
`Grammar.mask_after` (a speculative draft's look-ahead: consume the guesses, ask, roll
back) in `features/structured_outputs/grammar.py`; the checks (the structured-output tests, where the
reference masker is compared with xgrammar token for token, and `labs/lab0b_checks.py`);
two planted bugs; the experiment (`labs/lab0b_experiment.py`: the reference masker's cost
against xgrammar's, and outputs the student's masker constrained).

What it is not: the handout (docs/labs/lab0b_structured.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

S = "tests/test_structured_outputs.py::"
OWN = "labs/lab0b_checks.py::"

PARTS = (
    Part(
        "ReferenceGrammar.allowed",
        """\
bool [V]: which tokens may come next (docs/structured_outputs.md, "From a grammar to a mask").
  Nothing after a stop token (self.stopped). Otherwise, for every token id t of the vocabulary:
  a stop token (t in self.stop_ids) is allowed iff the text so far already fully matches
  (self.pattern.fullmatch(self._text(self.tokens))); any other token iff the text with it could still
  become a full match (self._could_match(self._text(self.tokens + [t]))) and does not end in half a
  character ("\\ufffd" as its last character: a byte-level token in the middle of a UTF-8 sequence).""",
    ),
    Part(
        "Grammar.mask_after",
        """\
bool [V]: what may follow the accepted tokens and then `extra` (a draft's guesses, not yet verified).
  Consume the guesses with self.accept one by one, counting how many it took; stop at one it refuses.
  If it refused one, or a guess was a stop token (self.is_terminated() after them), every token is
  allowed (torch.ones(vocab_size, dtype=torch.bool)): nothing after such a guess is ever emitted.
  Otherwise the answer is self.allowed(). Either way, roll back exactly the guesses you consumed
  (self.rollback(took)), even if something raised: the state must be as you found it.""",
    ),
)

CHECKS = (
    Check("stop-rule", "the stop token is allowed exactly when the text is complete",
          (OWN + "test_stop_is_allowed_exactly_when_the_text_is_complete",),
          "A stop token ends the output: allow it only if pattern.fullmatch(text so far) succeeds, not for a "
          "partial match.",
          rule="The output may end only where it is a complete match of the grammar."),
    Check("partial-match", "a token is allowed exactly when the text can still match",
          (OWN + "test_a_token_is_allowed_exactly_when_the_text_can_still_match",),
          "Try each token: decode the tokens so far plus it, and keep it if fullmatch(text, partial=True) is not None.",
          rule="A token may come next only if some continuation of the text with it is a full match."),
    Check("same-as-the-engines",
          "the reference masker allows what xgrammar and llguidance allow, at every step of random walks",
          (S + "test_the_reference_masker_and_the_engines_allow_the_same_tokens",),
          "Compare your mask with the engine's on the failing step: a stop token allowed too early, a byte-level token "
          "that is half a character, or a token kept that no continuation can complete.",
          rule="Two correct maskers of one grammar allow the same tokens at every step."),
    Check("rollback", "a draft's look-ahead leaves the state as it found it",
          (OWN + "test_mask_after_answers_for_guesses_and_leaves_the_state_alone",
           S + "test_the_batched_mask_equals_the_row_by_row_one",
           S + "test_speculation_changes_no_structured_output"),
          "Count the guesses you consumed and roll back exactly that many, on every path (a try/finally).",
          rule="Asking what may follow unverified guesses must not change what the grammar has accepted."),
    Check("engine", "an engine with the reference masker writes matching outputs",
          (OWN + "test_an_engine_with_the_reference_masker_writes_matching_outputs",),
          "structured_outputs_backend='reference' runs your masker inside the sampler: check the two parts above.",
          rule="Every sampled token must keep the output a prefix of a match, and the output must end complete."),
)  # fmt: skip

BUGS = (
    Bug("stop-always-allowed", "features.structured_outputs.grammar",
        "                mask[t] = complete\n",
        "                mask[t] = True\n", ("stop-rule", "same-as-the-engines")),
    Bug("no-rollback", "features.structured_outputs.grammar",
        "        finally:\n            self.rollback(took)\n",
        "        finally:\n            pass\n", ("rollback",)),
)  # fmt: skip

LAB = Lab(
    id="0b",
    topic="structured outputs: from a grammar to a token mask",
    handout="lab0b_structured.md",
    modules=(Module("features.structured_outputs.grammar", PARTS),),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment("labs.lab0b_experiment", (), ("--steps", "5")),
    minutes=60,
)
