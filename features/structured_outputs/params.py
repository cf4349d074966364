"""What a request asks for: vLLM's `StructuredOutputsParams`, one field of `SamplingParams`.

What it is: exactly one of `json` (a JSON schema), `regex`, `choice` (a list of strings),
`grammar` (EBNF, xgrammar's dialect), `json_object` (any JSON object), checked when the object
is made (a `ValueError` naming the field), and the key a compiled grammar is cached under.
A level's `SamplingParams(structured_outputs=...)` takes one; every level exports the class
(`from level3_prefix import StructuredOutputsParams`) through `ladder/rooms.py`.

What it is not: the compiler (`manager.py`) or the masks (`grammar.py`, `mask.py`).

Reference: vLLM `vllm/sampling_params.py` (`StructuredOutputsParams`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

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
        # A flag is a bool: 0.0 or "" would pass for False below (0.0 == False), and a request that sent a
        # number where a boolean belongs must be refused, not read as "not set" (schemathesis sent one)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"StructuredOutputsParams.json_object must be true or false (got {self.json_object!r})")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("StructuredOutputsParams.disable_any_whitespace must be true or false "
                             f"(got {self.disable_any_whitespace!r})")  # fmt: skip
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


__all__ = ["StructuredOutputsParams", "KINDS"]
