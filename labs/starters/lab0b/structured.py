# Lab 0b: your copy of level0_naive/structured.py.
# Fill in every function that raises NotImplementedError (search for TODO), then run
#     python -m labs check 0b THIS_FILE
# Made by `python -m labs starters` from the reference; everything else is the reference, unchanged.
"""Structured outputs: a grammar decides which tokens may come next, and the sampler obeys it.

What it is: vLLM's `StructuredOutputsParams` (exactly one of `json` (a JSON schema), `regex`,
`choice` (a list of strings), `grammar` (EBNF), `json_object`), and the three parts that
make it work:

    StructuredOutputManager   compiles a request's spec once (cached), for this tokenizer;
                              each sample gets its own matcher (`Grammar`)
    Grammar (per sequence)    the grammar's state after the tokens it has accepted;
                              `allowed()` -> bool [V]: the tokens that keep the output valid
    GrammarMask (sampler.py)  a logits processor: disallowed tokens to -inf before sampling

    output so far  {"name": "Ro          grammar: a JSON object {"name": string, ...}
    allowed next   letters, '"' ...      everything else -inf: the sampler cannot leave it

The state advances as tokens are appended (`Sequence.append_token`); a speculative draft
asks for the masks of positions past what was accepted by consuming its guesses and rolling
them back (`mask_after`), so rejected guesses leave nothing behind; a preempted request keeps
its state (recomputing a prompt accepts nothing). A request finishes with "stop" once its
grammar has accepted a stop token.

Three maskers behind `Grammar` (`structured_outputs_backend`):
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

What it is not: a grammar engine (xgrammar and llguidance are), or structural tags and tool parsers.

Reference: vLLM `v1/structured_output/` (`__init__.py`: StructuredOutputManager,
`backend_xgrammar.py`, `backend_guidance.py`), `sampling_params.StructuredOutputsParams`; Willard & Louf,
"Efficient Guided Generation for Large Language Models" (2023).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """vLLM's names: set exactly one. `json`: a JSON schema (dict or string); `regex`; `choice`: the
    output is one of these strings; `grammar`: EBNF (xgrammar's dialect, `root ::= ...`);
    `json_object`: any JSON object."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON without whitespace between its tokens (vLLM's name; its default is False: any whitespace). On by
    # default here: a small model that may write whitespace tends to write nothing else (measured: the
    # built-in model filled 120 tokens with newlines after "{").
    disable_any_whitespace: bool = True

    def __post_init__(self):
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"StructuredOutputsParams: set exactly one of {', '.join(KINDS)} (got {set_ or 'none'})")
        if self.choice is not None and not (
            isinstance(self.choice, list) and self.choice and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """What a compiled grammar is cached under."""
        value = getattr(self, self.kind)
        return (self.kind, json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value,
                self.disable_any_whitespace)  # fmt: skip


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
        # TODO (lab 0b): Grammar.mask_after
        # bool [V]: what may follow the accepted tokens and then `extra` (a draft's guesses, not yet verified).
        #   Consume the guesses with self.accept one by one, counting how many it took; stop at one it refuses.
        #   If it refused one, or a guess was a stop token (self.is_terminated() after them), every token is
        #   allowed (torch.ones(vocab_size, dtype=torch.bool)): nothing after such a guess is ever emitted.
        #   Otherwise the answer is self.allowed(). Either way, roll back exactly the guesses you consumed
        #   (self.rollback(took)), even if something raised: the state must be as you found it.
        raise NotImplementedError("lab 0b: write Grammar.mask_after")


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
        # TODO (lab 0b): ReferenceGrammar.allowed
        # bool [V]: which tokens may come next (docs/structured_outputs.md, "From a grammar to a mask").
        #   Nothing after a stop token (self.stopped). Otherwise, for every token id t of the vocabulary:
        #   a stop token (t in self.stop_ids) is allowed iff the text so far already fully matches
        #   (self.pattern.fullmatch(self._text(self.tokens))); any other token iff the text with it could still
        #   become a full match (self._could_match(self._text(self.tokens + [t]))) and does not end in half a
        #   character ("\ufffd" as its last character: a byte-level token in the middle of a UTF-8 sequence).
        raise NotImplementedError("lab 0b: write ReferenceGrammar.allowed")

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


def pattern_with_length(schema, path: str = "the schema") -> str | None:
    """Where a string schema has both a `pattern` and a length bound, or None. xgrammar compiles such a
    string from its pattern alone (it warns and drops the lengths), so an unbounded pattern runs to
    max_tokens and the output does not validate: refused instead, naming the place."""
    if isinstance(schema, dict):
        lengths = (isinstance(schema.get(k), int) for k in ("minLength", "maxLength"))
        if isinstance(schema.get("pattern"), str) and any(lengths):  # (not a property named "pattern")
            return path
        items = schema.items()
    elif isinstance(schema, list):
        items = ((f"[{i}]", v) for i, v in enumerate(schema))
    else:
        return None
    for key, value in items:
        found = pattern_with_length(value, f"{path}.{key}" if not key.startswith("[") else f"{path}{key}")
        if found is not None:
            return found
    return None


def choice_regex(choices: list[str]) -> str:
    """The output is exactly one of `choices`: their alternation, each escaped."""
    import regex

    return "(?:" + "|".join(regex.escape(c) for c in choices) + ")"


def choice_ebnf(choices: list[str]) -> str:
    """The same as an EBNF grammar: a JSON string literal is an EBNF one (quotes and escapes alike)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


BACKENDS = ("auto", "xgrammar", "guidance", "reference")


class StructuredOutputManager:
    """Compiles specs for one tokenizer (each once: the cache), and makes a `Grammar` per sequence.

    backend: "auto" (xgrammar, and llguidance for a JSON schema xgrammar would compile inexactly: a
    string with a `pattern` and a length, as vLLM's auto falls back to guidance), "xgrammar", "guidance"
    (llguidance for everything) or "reference" (choice and regex only)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int], backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"structured_outputs_backend={backend!r} is not one of: {', '.join(BACKENDS)}")
        self.tokenizer, self.vocab_size, self.stop_ids, self.backend = tokenizer, vocab_size, list(stop_ids), backend
        self._compiler = self._llg_tokenizer = None
        self._compiled: dict[tuple, tuple[str, Any]] = {}
        self._control: torch.Tensor | None = None
        self._special: torch.Tensor | None = None

    def compiler(self):
        """xgrammar's compiler for this tokenizer (built once)."""
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError as e:
                raise ValueError("structured outputs need xgrammar (pip install xgrammar)") from e
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_ids)  # fmt: skip
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def llg_tokenizer(self):
        """llguidance's view of this tokenizer (built once)."""
        if self._llg_tokenizer is None:
            try:
                import llguidance.hf
            except ImportError as e:
                raise ValueError("the guidance backend needs llguidance (pip install llguidance)") from e
            self._llg_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
        return self._llg_tokenizer

    def compile(self, spec: StructuredOutputsParams) -> tuple[str, Any]:
        """(backend, compiled grammar) of `spec` (cached), or a ValueError naming the field that is wrong."""
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer, and the model has none")
        key = spec.key()
        if key not in self._compiled:
            self._compiled[key] = self._compile(spec)
        return self._compiled[key]

    def backend_for(self, spec: StructuredOutputsParams) -> str:
        """The backend this spec compiles with (see the class docstring)."""
        if self.backend != "auto":
            return self.backend
        if spec.kind == "json" and pattern_with_length(schema_dict(spec.json)) is not None:
            return "guidance"
        return "xgrammar"

    def _compile(self, spec: StructuredOutputsParams) -> tuple[str, Any]:
        kind, backend = spec.kind, self.backend_for(spec)
        if backend == "reference":
            if kind not in ("choice", "regex"):
                raise ValueError(f"structured_outputs.{kind} needs the xgrammar or guidance backend (the reference "
                                 "does choice, regex)")  # fmt: skip
            return backend, choice_regex(spec.choice) if kind == "choice" else spec.regex
        if backend == "guidance":
            return backend, self._compile_guidance(spec)
        if kind == "json" and (where := pattern_with_length(schema_dict(spec.json))) is not None:
            raise ValueError(
                f"structured_outputs.json is not supported by xgrammar: {where} has 'pattern' with "
                "'minLength'/'maxLength', and xgrammar would ignore the lengths (use the auto or guidance backend, "
                "or write the lengths into the pattern, e.g. ^[a-z]{1,5}$)"
            )
        c = self.compiler()
        try:
            if kind in ("json", "json_object"):  # json_object: any JSON object (a schema that says only that)
                schema = json.dumps(schema_dict(spec.json) if kind == "json" else {"type": "object"})
                return backend, c.compile_json_schema(schema, any_whitespace=not spec.disable_any_whitespace)
            if kind == "regex":
                return backend, c.compile_regex(spec.regex)
            if kind == "choice":
                return backend, c.compile_grammar(choice_ebnf(spec.choice))
            return backend, c.compile_grammar(spec.grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and ValueError with the reason
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            first = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)  # "[04:21:39] /project/cpp/x.cc:82: " is noise here
            raise ValueError(f"structured_outputs.{kind} is not valid: {first}") from None

    def _compile_guidance(self, spec: StructuredOutputsParams) -> str:
        """llguidance's grammar text for `spec`, checked against this tokenizer (its matchers build per sequence)."""
        import llguidance

        kind, tok = spec.kind, self.llg_tokenizer()
        try:
            if kind in ("json", "json_object"):
                schema = schema_dict(spec.json) if kind == "json" else {"type": "object"}
                # xgrammar's layout without whitespace: {"a": 1, "b": [1, 2]}, so both engines write the same JSON
                defaults = {"whitespace_flexible": not spec.disable_any_whitespace, "item_separator": ", ",
                            "key_separator": ": "}  # fmt: skip
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
            elif kind == "choice":
                grammar = llguidance.grammar_from("choice", json.dumps(spec.choice))
            else:
                grammar = llguidance.grammar_from(kind, spec.regex if kind == "regex" else spec.grammar)
            error = llguidance.LLMatcher.validate_grammar(grammar, tok)
        except Exception as e:  # noqa: BLE001 - llguidance raises ValueError with the reason
            error = str(e)
        if error:
            first = error.strip().splitlines()[0]
            raise ValueError(f"structured_outputs.{kind} is not valid: {first}")
        return grammar

    def control_tokens(self) -> torch.Tensor:
        """bool [V]: tokens whose text holds a control character (below U+0020)."""
        if self._control is None:
            texts = [self.tokenizer.decode([t]) if t < len(self.tokenizer) else "" for t in range(self.vocab_size)]
            self._control = torch.tensor([any(ord(ch) < 32 for ch in text) for text in texts])
        return self._control

    def special_tokens(self) -> torch.Tensor:
        """bool [V]: the tokenizer's special tokens that are not stop tokens (<bos>, <pad>, ...)."""
        if self._special is None:
            self._special = torch.zeros(self.vocab_size, dtype=torch.bool)
            ids = [t for t in self.tokenizer.all_special_ids if t < self.vocab_size and t not in self.stop_ids]
            self._special[ids] = True
        return self._special

    def grammar(self, spec: StructuredOutputsParams) -> Grammar:
        """A fresh state for one sequence."""
        backend, compiled = self.compile(spec)
        if backend == "reference":
            return ReferenceGrammar(compiled, self.tokenizer, self.vocab_size, self.stop_ids)
        # Refused whatever the grammar says, by either engine: special tokens other than the stop tokens
        # (xgrammar reads the built-in vocabulary's "<pad>" as five characters a JSON string may hold, and a
        # detokenizer drops it); and for JSON, control characters: xgrammar's strings admit those other than CR
        # and LF, which JSON (RFC 8259) and json.loads refuse unescaped, and without whitespace between tokens
        # no JSON token needs one.
        json_like = spec.kind in ("json", "json_object") and spec.disable_any_whitespace
        banned = self.special_tokens() | self.control_tokens() if json_like else self.special_tokens()
        if backend == "guidance":
            import llguidance

            return LLGuidance(llguidance.LLMatcher(self.llg_tokenizer(), compiled), self.vocab_size, self.stop_ids, banned)
        import xgrammar as xgr

        return XGrammar(xgr.GrammarMatcher(compiled), self.vocab_size, banned)


def schema_dict(schema: str | dict) -> dict:
    """A JSON schema as a dict (a string is parsed; a ValueError names the field if it is not JSON)."""
    if isinstance(schema, dict):
        return schema
    try:
        return json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.json is not valid: not JSON ({e})") from None


__all__ = ["StructuredOutputsParams", "StructuredOutputManager", "Grammar", "BitmaskGrammar", "XGrammar", "LLGuidance",
           "ReferenceGrammar", "KINDS", "BACKENDS"]
