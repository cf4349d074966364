"""`speculative_config`, as vLLM takes it: a dict (or this dataclass) passed to `LLM(...)`.

    LLM(model, speculative_config={"model": "tiny-shakespeare-draft", "num_speculative_tokens": 4})
    LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})

What it is: the parsed, validated form, with vLLM's names and defaults, and level 4's part of the
engine's config (`config.speculative`, None without speculation): a "model" without
a "method" means a draft model; "ngram" without lookup sizes uses 5 and 5, and one size
given sets the other; `disable_by_batch_size` (vLLM V0's knob) turns drafting off in
steps whose running batch is larger, where the target is busy enough on its own. A bad
value is a `ValueError` that names the key.

`"eagle"` with `"model": "tiny-shakespeare-eagle"`: a head over the target's features (eagle.py).

What it is not: EAGLE-3, Medusa or MTP (vLLM's other methods).

Reference: vLLM `vllm/config/speculative.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from level0_naive.config import Part

METHODS = ("draft_model", "ngram", "eagle")


@dataclass
class SpeculativeConfig(Part):
    num_speculative_tokens: int
    method: str | None = None  # "draft_model" | "ngram" | "eagle"; None: "draft_model" when a model is given
    model: str | None = None  # the draft checkpoint (a directory, a built-in name, a cached hub id)
    prompt_lookup_min: int | None = None  # ngram: the shortest suffix to look up
    prompt_lookup_max: int | None = None  # ngram: the longest
    disable_by_batch_size: int | None = None  # no drafts in a step with more running requests than this

    def __post_init__(self):
        if self.method is None:
            self.method = "draft_model" if self.model is not None else None
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method={self.method!r} must be one of {', '.join(METHODS)} (or give a 'model')"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r} must be an integer >= 1")
        d = self.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or d < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size={d!r} must be an integer >= 1 (or absent)")
        if self.method in ("draft_model", "eagle") and not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method!r} (the draft checkpoint"
                             f"{', an EAGLE head' if self.method == 'eagle' else ''})")  # fmt: skip
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(
                    f"speculative_config.prompt_lookup_min={lo!r} and prompt_lookup_max={hi!r} must be integers with 1 <= min <= max"
                )
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    @classmethod
    def parse(cls, value) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or a SpeculativeConfig, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        return cls(**value)

    # As a part of the engine's config (level0_naive/config.py): `LLM(..., speculative_config=...)`, or None.
    @classmethod
    def setting_names(cls) -> list[str]:
        return ["speculative_config"]

    @classmethod
    def from_settings(cls, speculative_config=None) -> SpeculativeConfig | None:
        return cls.parse(speculative_config)
