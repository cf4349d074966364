"""Lab 0d: tokens into text, one at a time, and the stop strings (level 0's `detokenizer.py`).

What it is: the lab's definition (see `labs/spec.py`): in `level0_naive/detokenizer.py`,
`IncrementalDetokenizer.update` (the text a new token adds, from a short window, never half a
character), `IncrementalDetokenizer.finish` (what was held back, when the sequence ends) and
`find_stop` (the stop string that ends first, searched only where new text can complete one);
the checks (tests/test_engine_core.py's deltas against the one-shot decode and stop strings
against their definition, and the stop strings of levels 0, 4 and 6); three planted bugs; the
experiment (`python -m benchmarks.detokenize`: the cost of a token's text against output
length, the whole output decoded again against your incremental one).

What it is not: the tokenizer (the checkpoint's own `decode`), `stop_holdback` (read, not
written), the sequence that calls these (`outputs.py`) or the handout
(docs/labs/lab0d_detokenizer.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

E = "tests/test_engine_core.py::"

PARTS = (
    Part(
        "IncrementalDetokenizer.update",
        """\
Nothing new (read_offset is at the end of self.token_ids): "". Otherwise decode (self._decode) the window
from prefix_offset to read_offset, prefix_text (already emitted), and from prefix_offset to the end, new_text.
If new_text is no longer than prefix_text, or ends in REPLACEMENT (the newest bytes start a character that has
not completed), emit nothing yet. Else the delta is new_text past len(prefix_text); move the window
(prefix_offset to read_offset, read_offset to the end), append the delta to self.text and return it.""",
    ),
    Part(
        "IncrementalDetokenizer.finish",
        """\
The sequence ended: update() once more; then the rest is the decode from prefix_offset to the end past the
length of the decode from prefix_offset to read_offset (held-back bytes that never became a character, which
decode as REPLACEMENT, as the one-shot decode shows them). Move both offsets to the end, append the rest to
self.text and return it.""",
    ),
    Part(
        "find_stop",
        """\
(start index, stop) of the stop string whose occurrence ends first in text, or None. Only occurrences that end
after the first `checked` characters count, and one of them may begin before `checked` (it straddles the old
text and the new): start each search early enough for that. Two stops that end at the same character: the one
listed first.""",
    ),
)

CHECKS = (
    Check("incremental", "the deltas concatenate to the one-shot decode, and none ends inside a character",
          (E + "test_incremental_deltas_concatenate_to_the_one_shot_decode",),
          "update: return '' while the window's text ends in REPLACEMENT (the built-in tokenizer is byte-level: "
          "one character can be up to four tokens); finish: emit the held-back rest, REPLACEMENTs and all.",
          rule="Whatever the tokens, the text streamed so far is always a prefix of the final text, and at the "
               "end it is the final text."),
    Check("stops", "a stop string is found the step its last character arrives, the first to end wins",
          (E + "test_stop_strings_straddling_tokens_cut_as_the_one_shot_path",
           "tests/test_level0.py::test_stop_strings_are_honoured_and_removed"),
          "find_stop: search each stop from max(0, checked - len(stop) + 1), so an occurrence that began in "
          "text searched before and ends in the new text is found; compare where occurrences end.",
          rule="Streaming or not, the output stops at the same place: the first occurrence of any stop string "
               "to end, even one that straddles two tokens."),
    Check("engines", "speculative decoding and the server cut at the same stop",
          ("tests/test_level4.py::test_stop_strings_cut_inside_an_accepted_run",
           "tests/test_level6.py::test_stop_as_offline"),
          "If stops passes, look at finish() and at the window after a cut: several tokens can arrive in one "
          "step (level 4 accepts a run of them).",
          rule="A stop string ends the output wherever it falls, also inside a run of accepted draft tokens, "
               "and a server's stream says what the offline engine says."),
)  # fmt: skip

BUGS = (
    Bug("half-a-character", "level0_naive.detokenizer",
        "        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):\n",
        "        if len(new_text) <= len(prefix_text):\n", ("incremental",)),
    Bug("held-back-lost", "level0_naive.detokenizer",
        "        self.text += rest\n        return rest\n",
        '        return ""\n', ("incremental",)),
    Bug("no-straddling", "level0_naive.detokenizer",
        "        at = text.find(stop, max(0, checked - len(stop) + 1))\n",
        "        at = text.find(stop, checked)\n", ("stops",)),
)  # fmt: skip

LAB = Lab(
    id="0d",
    topic="incremental detokenization and stop strings: tokens into text, one at a time",
    handout="lab0d_detokenizer.md",
    modules=(Module("level0_naive.detokenizer", PARTS),),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment("benchmarks.detokenize", (), ("--tokens", "100")),
    minutes=45,
)
