# Lab 0d: your copy of level0_naive/detokenizer.py.
# Fill in every function that raises NotImplementedError (search for TODO), then run
#     python -m labs check 0d THIS_FILE
# Made by `python -m labs starters` from the reference; everything else is the reference, unchanged.
"""Incremental detokenization: each new token is decoded once, and stop strings are searched
only where new text appeared.

What it is: `IncrementalDetokenizer`, one per sequence. It keeps two offsets into the
sequence's output tokens, as vLLM does:

    tokens        t0 t1 t2 | t3 t4 | t5 t6        (| marks where text was last emitted)
                            ^prefix ^read
    prefix_text = decode(t3 t4)          text already emitted for these tokens
    new_text    = decode(t3 t4 t5 t6)    the same window plus what is new
    delta       = new_text[len(prefix_text):]

Decoding a short window instead of the whole output makes each token's cost independent
of how long the output is (decoding everything every step is O(L^2) over a request).
The window starts at the last cut, and a cut is made only where the text so far is
complete: if `new_text` ends in U+FFFD the newest bytes are the start of a multi-byte
character (the built-in tokenizer is byte-level: "€" is three tokens), so nothing is
emitted until it completes. At each cut, decode(all) == decode(before) + decode(after),
so the concatenated deltas equal the one-shot decode; `finish()` emits whatever was
held back (bytes that never became a valid character, shown as U+FFFD, as the one-shot
decode shows them).

`find_stop(text, stops, checked)` is the one stop-string rule, shared by the streaming
path and the one-shot path: the occurrence that *ends* first, after `checked`
characters that were already searched. An occurrence that straddles tokens is found
the step its last character arrives.

What it is not: a tokenizer. Decoding is the checkpoint's own `tokenizer.decode`.

Reference: vLLM `v1/engine/detokenizer.py` (IncrementalDetokenizer, check_stop_strings),
`transformers/generation/streamers.py` (TextStreamer's held-back text).
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that are not (yet) a character


class IncrementalDetokenizer:
    def __init__(self, tokenizer, token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.token_ids = token_ids  # the sequence's own output list, read, never written
        self.prefix_offset = 0  # first token of the decode window
        self.read_offset = 0  # tokens before this have their text in self.text
        self.text = ""  # complete characters emitted so far

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def update(self) -> str:
        """Decode the tokens appended since the last call; return the new complete text (maybe "")."""
        # TODO (lab 0d): IncrementalDetokenizer.update
        # Nothing new (read_offset is at the end of self.token_ids): "". Otherwise decode (self._decode) the window
        # from prefix_offset to read_offset, prefix_text (already emitted), and from prefix_offset to the end, new_text.
        # If new_text is no longer than prefix_text, or ends in REPLACEMENT (the newest bytes start a character that has
        # not completed), emit nothing yet. Else the delta is new_text past len(prefix_text); move the window
        # (prefix_offset to read_offset, read_offset to the end), append the delta to self.text and return it.
        raise NotImplementedError("lab 0d: write IncrementalDetokenizer.update")

    def finish(self) -> str:
        """The sequence ended: emit what was held back (it will never complete)."""
        # TODO (lab 0d): IncrementalDetokenizer.finish
        # The sequence ended: update() once more; then the rest is the decode from prefix_offset to the end past the
        # length of the decode from prefix_offset to read_offset (held-back bytes that never became a character, which
        # decode as REPLACEMENT, as the one-shot decode shows them). Move both offsets to the end, append the rest to
        # self.text and return it.
        raise NotImplementedError("lab 0d: write IncrementalDetokenizer.finish")

    def truncate(self, length: int) -> None:
        """A stop string ended the sequence: keep only the first `length` characters."""
        self.text = self.text[:length]
        self.prefix_offset = self.read_offset = len(self.token_ids)  # nothing more is ever emitted


def find_stop(text: str, stops: list[str], checked: int = 0) -> tuple[int, str] | None:
    """The stop string that ends first in `text`, among occurrences ending after `checked`.

    Returns (start index, stop string) or None. Ties (two stops ending at the same
    character) go to the one listed first. Searching from `checked - len(stop) + 1`
    finds an occurrence that began in text searched before but ends in the new part.
    """
    # TODO (lab 0d): find_stop
    # (start index, stop) of the stop string whose occurrence ends first in text, or None. Only occurrences that end
    # after the first `checked` characters count, and one of them may begin before `checked` (it straddles the old
    # text and the new): start each search early enough for that. Two stops that end at the same character: the one
    # listed first.
    raise NotImplementedError("lab 0d: write find_stop")


def stop_holdback(stops: list[str], include_stop_str_in_output: bool) -> int:
    """Characters a streaming output must hold back while running: they may yet turn out to
    be the start of a stop string that is cut from the output."""
    if not stops or include_stop_str_in_output:
        return 0
    return max(len(s) for s in stops) - 1
