"""Incremental detokenization: each new token is decoded once; stop strings are searched only in new text.

What it is: `IncrementalDetokenizer`, one per sequence. It keeps two offsets into the
sequence's output tokens, as vLLM does:

    tokens        t0 t1 t2 | t3 t4 | t5 t6        (| marks where text was last emitted)
                            ^prefix ^read
    prefix_text = decode(t3 t4)          text already emitted for these tokens
    new_text    = decode(t3 t4 t5 t6)    the same window plus what is new
    delta       = new_text[len(prefix_text):]

Decoding a short window instead of the whole output makes each token's cost independent of
the output's length (decoding everything every step is O(L^2) over a request). The window
starts at the last cut, made only where the text so far is complete: if `new_text` ends in
U+FFFD, the newest bytes start a multi-byte character (the built-in tokenizer is byte-level:
"€" is three tokens), and nothing is emitted until it completes. At each cut, decode(all) ==
decode(before) + decode(after), so the concatenated deltas equal the one-shot decode;
`finish()` emits whatever was held back (bytes that never became a character, shown as U+FFFD,
as the one-shot decode shows them).

`find_stop(text, stops, checked)` is the one stop-string rule, shared by the streaming and
one-shot paths: the occurrence that *ends* first, after `checked` characters already searched.
An occurrence that straddles tokens is found the step its last character arrives.

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
        if self.read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.token_ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""  # a special token that decodes to nothing, or an incomplete character
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """The sequence ended: emit what was held back (it will never complete)."""
        self.update()
        rest = self._decode(self.prefix_offset, len(self.token_ids))[
            len(self._decode(self.prefix_offset, self.read_offset)) :
        ]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += rest
        return rest

    def truncate(self, length: int) -> None:
        """A stop string ended the sequence: keep only the first `length` characters."""
        self.text = self.text[:length]
        self.prefix_offset = self.read_offset = len(self.token_ids)  # nothing more is ever emitted


def find_stop(text: str, stops: list[str], checked: int = 0) -> tuple[int, str] | None:
    """The stop string that ends first in `text`, among occurrences ending after `checked`.

    Returns (start index, stop string) or None; ties (two stops ending at the same character) go
    to the one listed first. Searching from `checked - len(stop) + 1` also finds an occurrence
    that began in text searched before."""
    best = None
    for stop in stops:
        at = text.find(stop, max(0, checked - len(stop) + 1))
        if at != -1 and (best is None or at + len(stop) < best[0] + len(best[1])):
            best = (at, stop)
    return best


def stop_holdback(stops: list[str], include_stop_str_in_output: bool) -> int:
    """Characters a running streaming output holds back: they may yet start a stop string cut from it."""
    if not stops or include_stop_str_in_output:
        return 0
    return max(len(s) for s in stops) - 1
