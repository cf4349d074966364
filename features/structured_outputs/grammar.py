"""A grammar's state per sequence: which tokens may come next, and the three engines that answer it.

What it is: `Grammar`, the state of one sample's output after the tokens it has accepted,
which is also the request's constraint that level 0's stop rules read (`accept`,
`is_terminated`), and the three maskers behind it (`structured_outputs_backend`):

    output so far  {"name": "Ro          grammar: a JSON object {"name": string, ...}
    allowed next   letters, '"' ...      everything else -inf: the sampler cannot leave it

  - `XGrammar`: xgrammar (MLC's; what vLLM uses by default). Chosen over llguidance by
    measurement here (`python -m benchmarks.grammar`): 3-15 us per token for the mask
    against 29-42 us, for a compile of 1-50 ms against 1-2 ms; a mask is paid every
    token, a compile once per schema.
  - `LLGuidance`: llguidance (vLLM's "guidance"), which `auto` uses for what xgrammar would
    compile inexactly: a JSON string with a `pattern` and a length (xgrammar drops the length).
  - `ReferenceGrammar`: `choice` and regular expressions in plain Python, to be read: a
    token is allowed if the text with it could still become a full match (the `regex`
    package's partial matching), a stop token if the text already is one. One decode and
    one match per vocabulary entry per step: slow, exact, and the tests compare the two.

The state advances as tokens are appended (level 0's `Sequence.append_token` calls `accept`);
a speculative draft asks for the masks of positions past what was accepted by consuming its
guesses and rolling them back (`mask_after`), so rejected guesses leave nothing behind; a
preempted request keeps its state (recomputing a prompt accepts nothing). A request finishes
with "stop" once its grammar has accepted a stop token (`is_terminated`).

What it is not: a grammar engine (xgrammar and llguidance are), or structural tags and tool parsers.

Reference: vLLM `v1/structured_output/` (`backend_xgrammar.py`, `backend_guidance.py`);
Willard & Louf, "Efficient Guided Generation for Large Language Models" (2023).
"""

from __future__ import annotations

import torch


class Grammar:
    """One sequence's grammar state. `num_accepted` output tokens consumed so far."""

    num_accepted: int = 0

    def accept(self, token: int) -> bool:
        """Consume one token; False (and no change) if the grammar forbids it."""
        raise NotImplementedError

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""
        raise NotImplementedError

    def allowed(self) -> torch.Tensor:
        """bool [V]: the tokens that may come next."""
        raise NotImplementedError

    def is_terminated(self) -> bool:
        """A stop token was accepted: nothing may follow."""
        raise NotImplementedError

    def mask_after(self, extra: list[int], vocab_size: int) -> torch.Tensor:
        """bool [V]: what may follow the accepted tokens and then `extra` (a speculative draft's guesses),
        which are consumed only for the question and rolled back. After a guess the grammar forbids, or
        after a stop token, every token is allowed: nothing after such a guess is ever emitted (a
        forbidden guess is rejected, its own row forbidding it; a stop token ends the request)."""
        took = 0
        for t in extra:
            if not self.accept(t):
                break
            took += 1
        try:
            if took < len(extra) or (extra and self.is_terminated()):
                return torch.ones(vocab_size, dtype=torch.bool)
            return self.allowed()
        finally:
            self.rollback(took)


class BitmaskGrammar(Grammar):
    """A grammar engine's matcher behind a packed bitmask (32 tokens per int32, bit i % 32 of word i // 32:
    xgrammar's and llguidance's layout alike). `banned` [V] (or None): tokens refused whatever the grammar
    says (see StructuredOutputManager.grammar)."""

    def __init__(self, vocab_size: int, banned: torch.Tensor | None):
        self.vocab_size, self.banned = vocab_size, banned
        self.bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)  # [1, ceil(V / 32)]
        self.num_accepted = 0

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this state's allowed tokens into row `row` of `bitmask` [B, ceil(V / 32)] (the batched
        path: GrammarMask fills every row, then unpacks them all at once)."""
        raise NotImplementedError

    def allowed(self) -> torch.Tensor:
        self.fill(self.bitmask, 0)
        return unpack(self.bitmask, self.vocab_size)[0] & ~self.banned_or_none()

    def banned_or_none(self) -> torch.Tensor:
        return torch.zeros(self.vocab_size, dtype=torch.bool) if self.banned is None else self.banned


class XGrammar(BitmaskGrammar):
    """xgrammar's matcher (what vLLM uses by default)."""

    def __init__(self, matcher, vocab_size: int, banned: torch.Tensor | None = None):
        super().__init__(vocab_size, banned)
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        ok = self.matcher.accept_token(token)
        self.num_accepted += ok
        return ok

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)
            self.num_accepted -= n

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.matcher.is_terminated():  # a stop token was accepted: nothing follows
            bitmask[row] = 0
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


class LLGuidance(BitmaskGrammar):
    """llguidance's matcher (vLLM's "guidance" backend), for what xgrammar cannot compile exactly. Two
    differences from xgrammar are handled here: a token the grammar forbids puts its matcher in an error
    state for good, so a token is checked (`validate_tokens`) before it is consumed; and the matcher knows
    one EOS token and treats it specially once the grammar is complete, so stop tokens are kept out of it:
    a stop token is allowed when the grammar is accepting, and accepting one only sets `stopped`."""

    def __init__(self, matcher, vocab_size: int, stop_ids: list[int], banned: torch.Tensor | None = None):
        super().__init__(vocab_size, banned)
        self.matcher, self.stop_ids, self.stopped = matcher, list(stop_ids), False

    def accept(self, token: int) -> bool:
        if self.stopped:
            return False
        if token in self.stop_ids:
            ok = self.stopped = self.matcher.is_accepting()
        else:
            ok = self.matcher.validate_tokens([token]) == 1 and self.matcher.consume_token(token)
        self.num_accepted += ok
        return ok

    def rollback(self, n: int) -> None:
        if n and self.stopped:
            self.stopped, n, self.num_accepted = False, n - 1, self.num_accepted - 1
        if n:
            self.matcher.rollback(n)
            self.num_accepted -= n

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch as lgt

        if self.stopped:
            bitmask[row] = 0
            return
        lgt.fill_next_token_bitmask(self.matcher, bitmask, row)
        accepting = self.matcher.is_accepting()
        for t in self.stop_ids:  # our stop tokens, not the matcher's one EOS
            word, bit = divmod(t, 32)
            value = (int(bitmask[row, word]) & 0xFFFFFFFF) & ~(1 << bit) | (accepting << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # back to a signed int32

    def is_terminated(self) -> bool:
        return self.stopped


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [B, W] int32 -> bool [B, V]: token i is bit i % 32 of word i // 32."""
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [B, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


class ReferenceGrammar(Grammar):
    """`choice` or a regular expression, the plain way: try every token (see the module docstring)."""

    def __init__(self, pattern: str, tokenizer, vocab_size: int, stop_ids: list[int]):
        import regex

        self.pattern, self.tokenizer, self.vocab_size = regex.compile(pattern), tokenizer, vocab_size
        self.stop_ids, self.tokens, self.stopped = set(stop_ids), [], False

    @property
    def num_accepted(self) -> int:
        return len(self.tokens) + self.stopped

    def _text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _could_match(self, text: str) -> bool:
        return self.pattern.fullmatch(text, partial=True) is not None

    def allowed(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        if self.stopped:
            return mask
        complete = self.pattern.fullmatch(self._text(self.tokens)) is not None
        for t in range(self.vocab_size):
            if t in self.stop_ids:
                mask[t] = complete
            else:
                text = self._text(self.tokens + [t])
                mask[t] = "\ufffd" not in text[-1:] and self._could_match(text)  # (half a character: no)
        return mask

    def accept(self, token: int) -> bool:
        if self.stopped or not self.allowed()[token]:
            return False
        if token in self.stop_ids:
            self.stopped = True
        else:
            self.tokens.append(token)
        return True

    def rollback(self, n: int) -> None:
        for _ in range(n):
            if self.stopped:
                self.stopped = False
            else:
                self.tokens.pop()

    def is_terminated(self) -> bool:
        return self.stopped


__all__ = ["Grammar", "BitmaskGrammar", "XGrammar", "LLGuidance", "ReferenceGrammar", "unpack"]
