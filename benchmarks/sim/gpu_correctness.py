"""The GPU check's correctness parts: the features that only a real CUDA device can break.

What it is: three checks `benchmarks.sim.gpu_check` runs on the built-in pair (models/tiny-shakespeare and
its draft: trained, so the text, the drafts' acceptance and the grammars' outputs mean something, and small,
so each check takes seconds). Each fills a `figures` dict as it goes (what it measured survives a failure
or a timeout), returns a one-line summary, and fails with an AssertionError that says what was wrong:

  prompt_logprobs       levels 0-3, `SamplingParams(prompt_logprobs=K)`: every prompt token's logprob beside
                        Hugging Face's log-softmax of the same prompt, same dtype, same device (float32 to
                        1e-3 nats; on CUDA also bfloat16, loosely: its rounding differs between two
                        implementations, garbage is nats off);
  sampled_speculation   level 4 with the built-in draft at temperature 0.8, seeded: every request gets its
                        tokens, the drafts are judged (acceptance in (0, 1]); figures: the acceptance rate,
                        tokens/s, and whether the same seeds give the same tokens again;
  structured_outputs    levels 3 and 4, a JSON schema and a regex, greedy and sampled: every output parses,
                        fits and stops. It needs a grammar engine (xgrammar, else llguidance): without one it
                        is skipped (`Skip`), with one line.

What it is not: the tests. tests/test_prompt_logprobs.py, test_level4.py and test_structured_outputs.py
prove these properly (float64 oracles, chi-square); here each runs once on the device's own code paths
(CUDA tensors, the compiled Triton kernel, the device's random generators), where a crash or garbage shows.

Reference: vLLM's `tests/v1/sample/test_logprobs.py`, `tests/v1/spec_decode/`, `tests/v1/structured_output/`
(the same three features, checked on a GPU).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import time

from .fail_soft import Skip

LEVELS = ("level0_naive", "level1_paged", "level2_continuous", "level3_prefix")
PROMPTS = ["ROMEO:\nBut soft, what light through yonder window breaks?\n",
           "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n"]  # fmt: skip
K = 2  # prompt logprobs: the top-k alternatives asked for beside each prompt token
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.5}  # nats, the largest |ours - HF's| a prompt token may show
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
REGEX = r"[A-Z][a-z]{2,6} of [A-Z][a-z]{2,6}"
# Each LLM's KV budget: without one, an LLM on CUDA takes 90 % of the card, and the next one, made while the
# last is not yet collected, finds none left. 256 MiB holds about 40,000 of the tiny model's tokens.
KV_BYTES = 256 << 20


def builtin_pair() -> tuple[str, str]:
    from ladder.models import BUILTIN, BUILTIN_DRAFT

    if not ((BUILTIN / "config.json").is_file() and (BUILTIN_DRAFT / "config.json").is_file()):
        raise Skip("the built-in models (models/tiny-shakespeare*) are not in this checkout")
    return str(BUILTIN), str(BUILTIN_DRAFT)


def prompt_logprobs(figures: dict, device: str, dtypes: tuple[str, ...]) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    target, _ = builtin_pair()
    failed = []
    for dtype in dtypes:
        hf = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, dtype)).to(device).eval()
        oracle: dict[tuple, torch.Tensor] = {}  # prompt ids -> [P, V] log-softmax, row p predicts token p + 1
        for level in LEVELS:
            name = f"{level}/{dtype}"
            try:  # each level on its own: one level's crash leaves the others' figures
                mod = importlib.import_module(level)
                t0 = time.perf_counter()
                llm = mod.LLM(target, dtype=dtype, device=device, kv_cache_memory=KV_BYTES)
                outs = llm.generate(PROMPTS, mod.SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=K),
                                    progress=False)  # fmt: skip
                seconds = time.perf_counter() - t0
                worst = 0.0
                for out in outs:
                    ids = tuple(out.prompt_token_ids)
                    if ids not in oracle:
                        with torch.inference_mode():
                            logits = hf(torch.tensor([ids], device=device)).logits[0]  # [P, V]
                        oracle[ids] = torch.log_softmax(logits.float(), -1).cpu()
                    worst = max(worst, logprob_error(out.prompt_logprobs, ids, oracle[ids]))
                figures[name] = {"max_abs_error": worst, "seconds": seconds}
                if worst > TOLERANCE[dtype]:
                    failed.append(f"{name} {worst:.3g} nats from HF")
            except AssertionError as e:
                figures[name] = {"error": str(e)}
                failed.append(f"{name}: {e}")
            except Exception as e:  # noqa: BLE001 - a crash at one level is this part's finding, not the end of it
                figures[name] = {"error": f"{type(e).__name__}: {e}"}
                failed.append(f"{name}: {type(e).__name__}: {e}")
        del hf
    assert not failed, "; ".join(failed)
    return ", ".join(f"{n} {f['max_abs_error']:.1e}" for n, f in figures.items()) + " nats max |error| vs HF"


def logprob_error(plp, ids: tuple, oracle) -> float:
    """The largest |ours - oracle| over the prompt's tokens and their top-K; the output's shape checked too."""
    assert plp is not None and len(plp) == len(ids) and plp[0] is None, "prompt_logprobs: the wrong shape"
    worst = 0.0
    for p in range(1, len(ids)):
        entry, row = plp[p], oracle[p - 1]
        assert ids[p] in entry and len(entry) >= K, f"prompt token {p}: its own id or the top-{K} is missing"
        worst = max(worst, *(abs(lp.logprob - row[t].item()) for t, lp in entry.items()))
    return worst


def sampled_speculation(figures: dict, device: str, dtype: str, n: int = 8, length: int = 64) -> str:
    import level4_speculative as l4

    target, draft = builtin_pair()
    llm = l4.LLM(target, dtype=dtype, device=device, kv_cache_memory=KV_BYTES,
                 speculative_config={"model": draft, "num_speculative_tokens": 4})  # fmt: skip
    params = [l4.SamplingParams(max_tokens=length, temperature=0.8, seed=i, ignore_eos=True) for i in range(n)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, progress=False)
    seconds = time.perf_counter() - t0
    stats = llm.spec_decode_stats()  # read before the repeat: the counters accumulate per LLM
    figures.update(acceptance_rate=stats.acceptance_rate, mean_acceptance_length=stats.mean_acceptance_length,
                   draft_tokens=stats.num_draft_tokens, seconds=seconds,
                   output_tokens_per_s=sum(len(o.outputs[0].token_ids) for o in outs) / seconds)  # fmt: skip
    again = llm.generate(prompts, params, progress=False)
    # A figure, not a criterion: seeded sampling repeats on one device and batch, unless a kernel's
    # reduction order varies between runs, which is worth knowing but not a failure of speculation
    figures["repeatable"] = [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]
    lengths = sorted({len(o.outputs[0].token_ids) for o in outs})
    assert lengths == [length], f"output lengths {lengths}, asked for {length} (ignore_eos)"
    assert stats.num_draft_tokens > 0, "no draft was ever judged: speculation did not run"
    assert 0 < stats.acceptance_rate <= 1, f"acceptance rate {stats.acceptance_rate}"
    return (f"acceptance {stats.acceptance_rate:.2f} (mean length {stats.mean_acceptance_length:.2f}), "
            f"{figures['output_tokens_per_s']:.0f} tok/s, repeatable {figures['repeatable']}")  # fmt: skip


def grammar_backend() -> str:
    """xgrammar for everything when it is here (`auto`), else llguidance for everything (`guidance`)."""
    if importlib.util.find_spec("xgrammar") is not None:
        return "auto"
    if importlib.util.find_spec("llguidance") is not None:
        return "guidance"
    raise Skip("no grammar engine here (xgrammar or llguidance; carry a wheel in .wheels)")


def structured_outputs(figures: dict, device: str, dtype: str) -> str:
    backend = grammar_backend()
    target, draft = builtin_pair()
    from level0_naive import StructuredOutputsParams

    specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX)]
    figures["backend"] = backend
    bad = []
    for level in ("level3_prefix", "level4_speculative"):
        try:  # each level on its own, as in prompt_logprobs
            figures[level] = grammar_run(level, specs, target, draft, backend, device, dtype)
            bad += [f"{level}: {text!r}" for text in figures[level].pop("wrong")]
        except Exception as e:  # noqa: BLE001 - recorded; the other level still runs
            figures[level] = {"error": f"{type(e).__name__}: {e}"}
            bad.append(f"{level}: {type(e).__name__}: {e}")
    assert not bad, "; ".join(bad)
    levels = [lv for lv in figures if lv != "backend"]
    return f"{backend}: " + ", ".join(f"{lv} {figures[lv]['valid']}/{figures[lv]['of']} valid" for lv in levels)


def grammar_run(level: str, specs: list, target: str, draft: str, backend: str, device: str, dtype: str) -> dict:
    """One level's outputs under each spec, greedy and at temperature 1: how many obey, and the ones that do not."""
    mod = importlib.import_module(level)
    spec = {"speculative_config": {"model": draft, "num_speculative_tokens": 3}} if level.startswith("level4") else {}
    llm = mod.LLM(target, dtype=dtype, device=device, kv_cache_memory=KV_BYTES, structured_outputs_backend=backend,
                  **spec)  # fmt: skip
    params = [mod.SamplingParams(max_tokens=80, temperature=t, seed=i, structured_outputs=s)
              for i, (t, s) in enumerate((t, s) for t in (0.0, 1.0) for s in specs)]  # fmt: skip
    t0 = time.perf_counter()
    outs = [o.outputs[0] for o in llm.generate([PROMPTS[0]] * len(params), params, progress=False)]
    seconds = time.perf_counter() - t0
    wrong = [o.text for o, p in zip(outs, params) if not obeys(o, p.structured_outputs)]
    return {"valid": len(outs) - len(wrong), "of": len(outs), "seconds": seconds, "wrong": wrong,
            "output_tokens_per_s": sum(len(o.token_ids) for o in outs) / seconds}  # fmt: skip


def obeys(out, spec) -> bool:
    """The output stopped by itself and fits its spec (SCHEMA checked by hand: no jsonschema on the device)."""
    if out.finish_reason != "stop":
        return False
    if spec.regex is not None:
        return re.fullmatch(spec.regex, out.text) is not None
    try:
        obj = json.loads(out.text)
    except ValueError:
        return False
    return (isinstance(obj, dict) and set(obj) == {"name", "age"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 8 and type(obj["age"]) is int and 0 <= obj["age"] <= 120)  # fmt: skip
