"""The stop rules: after each new token, does its sample end, and why? Where EOS and stop strings are checked.

What it is: `check_stop(seq, token)`, which `Sequence.append_token` (outputs.py) calls for
every token that joins a sample, at every level, in this order:

    the sample's constraint is complete (a room's: ladder/rooms.py)   "stop", stop_reason None
    once min_tokens are out:
        an EOS token (unless ignore_eos)                               "stop", stop_reason None
        one of stop_token_ids                                          "stop", stop_reason the id
        a stop string ends in the newly decoded text                   "stop", stop_reason the string
    max_tokens reached, or the context (max_model_len) is full         "length"

A stop string cuts the text before it (after it, with `include_stop_str_in_output`). It is
searched for only in the text the new token added (and the few characters before it that a
string could straddle): each token costs the string's length, not the text's. Text decoded
before `min_tokens` is never searched, as in vLLM.

What it is not: a place that decides anything else. A rule that fires sets `finish_reason`
(and `stop_reason`) on the sample; the engine frees it and the output processor reports it.

Reference: vLLM `v1/core/sched/utils.py` (`check_stop`) and `vllm/v1/engine/detokenizer.py`
(stop strings); the OpenAI API's `stop` and `finish_reason`.
"""

from __future__ import annotations

from .detokenizer import find_stop


def check_stop(seq, token: int) -> None:
    """`token` just joined `seq` (an outputs.Sequence): end the sample if a rule above fires."""
    p, n_out = seq.params, len(seq.output_token_ids)
    if seq.constraint is not None and seq.constraint.is_terminated():  # the constrained output is complete
        seq.finish_reason, seq.stop_reason = "stop", None
        return
    if n_out >= p.min_tokens:
        if not p.ignore_eos and token in seq.eos_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", None
            return
        if token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
            return
    if p.stop and check_stop_strings(seq, search=n_out >= p.min_tokens):
        return
    if (p.max_tokens is not None and n_out >= p.max_tokens) or seq.num_tokens >= seq.max_len:
        seq.finish_reason = "length"


def check_stop_strings(seq, search: bool) -> bool:
    """Decode the new token and look for a stop string ending in the new text only (as vLLM does,
    text produced before `min_tokens` is never searched)."""
    checked = len(seq.detok.text)
    if not seq.detok.update() or not search:
        return False
    return cut_at_stop(seq, checked)


def cut_at_stop(seq, checked: int) -> bool:
    """If a stop string ends past the first `checked` characters: cut the text there and stop the sample."""
    hit = find_stop(seq.detok.text, seq.params.stop, checked)
    if hit is None:
        return False
    at, stop = hit
    seq.detok.truncate(at + len(stop) if seq.params.include_stop_str_in_output else at)
    seq.finish_reason, seq.stop_reason = "stop", stop
    return True


__all__ = ["check_stop", "check_stop_strings", "cut_at_stop"]
