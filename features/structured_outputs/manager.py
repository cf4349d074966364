"""The compiler side of structured outputs: a request's spec compiled once, a fresh grammar per sample.

What it is: `StructuredOutputManager`, one per engine, made for its tokenizer (through
`ladder/rooms.py`, with `structured_outputs_backend=`). It is the request preparer level 0's
`InputProcessor` runs on every request: a request whose `SamplingParams.structured_outputs` is
set has its spec compiled (cached by the spec's key; a bad schema is a `ValueError` naming the
field, before the request is numbered), and each of its samples gets its own `Grammar` as its
constraint (`Sequence.constraint`). The sampler then masks what the constraint forbids
(`mask.py`), and level 0's stop rules end the sample when it is complete.

Backends: "auto" (xgrammar, and llguidance for a JSON schema xgrammar would compile inexactly:
a string with a `pattern` and a length, as vLLM's auto falls back to guidance), "xgrammar",
"guidance" (llguidance for everything) or "reference" (choice and regex only, in plain Python).

What it is not: a mask (`grammar.py`) or a parser of the server's `response_format` (level 6).

Reference: vLLM `v1/structured_output/__init__.py` (StructuredOutputManager).
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from .grammar import Grammar, LLGuidance, ReferenceGrammar, XGrammar
from .params import StructuredOutputsParams


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

    def __call__(self, group: list, i: int) -> None:
        """The request preparer (level 0's InputProcessor calls it on every checked request): compile the
        spec of a request that has one (once, cached), and give each of its samples a fresh grammar."""
        spec = group[0].params.structured_outputs
        if spec is None:
            return
        for seq in group:
            seq.constraint = self.grammar(spec)

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


__all__ = ["StructuredOutputManager", "BACKENDS", "schema_dict", "pattern_with_length"]
