"""`python -m benchmarks.grammar`: what a structured output costs, and why the ladder uses xgrammar.

What it is: two measurements, one torch thread.

  1. The engines: xgrammar and llguidance (when installed) on the same JSON schema, with
     the built-in byte-level tokenizer and two BPE tokenizers trained here on Tiny
     Shakespeare (8,192 and 32,000 tokens, so the vocabulary size shows): the tokenizer's
     setup, the schema's compile time, and the time per token of a mask and an accept,
     along a random walk through the grammar to its end.
  2. The engine's step: level 3 decoding a batch of 32 requests with a JSON schema against
     the same batch unconstrained (same prompts, greedy), milliseconds per decode step,
     alternating runs, the best of `--repeats`. The compile is timed apart (it happens once,
     at `add_request`, and is cached per schema).

What it is not: a test (nothing fails on a number), or a benchmark of the grammar engines
on GPU batches (vLLM fills masks on a thread pool beside the forward; here they are in line).

Reference: vLLM `benchmarks/benchmark_serving_structured_output.py`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from ladder.cli import save_json
from ladder.models import default_model

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["king", "queen", "fool"]},
    "lines": {"type": "array", "items": {"type": "string", "pattern": "^[A-Za-z ]{1,20}$"}, "maxItems": 3}},
    "required": ["name", "age", "role", "lines"], "additionalProperties": False}  # fmt: skip


def bpe_tokenizer(vocab: int, corpus: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer, t.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    t.train([corpus], trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")


def walk(fill, allowed_ids, accept, done, steps: int = 300) -> tuple[int, float]:
    """Follow random allowed tokens to the grammar's end: (tokens, seconds spent filling masks)."""
    rng, n, spent = random.Random(0), 0, 0.0
    while not done() and n < steps:
        t0 = time.perf_counter()
        fill()
        spent += time.perf_counter() - t0
        accept(rng.choice(allowed_ids()))
        n += 1
    return n, spent


def allowed_ids(mask: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a one-row bitmask [1, ceil(V / 32)] allows."""
    return [i for i in range(vocab_size) if (int(mask[0, i // 32]) >> (i % 32)) & 1]


def measure_xgrammar(name: str, tok) -> dict:
    import xgrammar as xgr

    V, t0 = len(tok), time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=V), max_threads=1)
    setup, t0 = time.perf_counter() - t0, time.perf_counter()
    m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
    compile_s, mask = time.perf_counter() - t0, xgr.allocate_token_bitmask(1, V)
    n, s = walk(lambda: m.fill_next_token_bitmask(mask), lambda: allowed_ids(mask, V), m.accept_token, m.is_terminated)
    return dict(tokenizer=name, engine="xgrammar", setup_ms=setup * 1e3, compile_ms=compile_s * 1e3,
                mask_us=s / n * 1e6, tokens=n)  # fmt: skip


def measure_llguidance(name: str, tok) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lgt

    V, t0 = len(tok), time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=V)
    setup, t0 = time.perf_counter() - t0, time.perf_counter()
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    compile_s, mask = time.perf_counter() - t0, lgt.allocate_token_bitmask(1, V)
    n, s = walk(lambda: lgt.fill_next_token_bitmask(m, mask, 0), lambda: allowed_ids(mask, V), m.consume_token,
                m.is_stopped)  # fmt: skip
    return dict(tokenizer=name, engine="llguidance", setup_ms=setup * 1e3, compile_ms=compile_s * 1e3,
                mask_us=s / n * 1e6, tokens=n)  # fmt: skip


def engines(tokenizers: dict) -> list[dict]:
    """Each installed engine on each tokenizer (an engine that is not installed is skipped)."""
    rows = []
    for name, tok in tokenizers.items():
        for measure in (measure_xgrammar, measure_llguidance):
            try:
                rows.append(measure(name, tok))
            except ImportError:
                pass
    return rows


def step_cost(model: str, batch: int, steps: int, repeats: int) -> dict:
    """ms per decode step of level 3 with every request under the schema, and without."""
    from level3_prefix import LLMEngine, SamplingParams, StructuredOutputsParams

    out = {"compile_ms": None, "plain_ms": float("inf"), "masked_ms": float("inf")}
    spec = StructuredOutputsParams(json=SCHEMA)
    for rep in range(repeats):
        for masked in (False, True) if rep % 2 == 0 else (True, False):
            engine = LLMEngine(model, max_model_len=512, max_num_seqs=batch, seed=0)
            if masked and out["compile_ms"] is None:
                t0 = time.perf_counter()
                engine.request_preparer.compile(spec)
                out["compile_ms"] = (time.perf_counter() - t0) * 1e3
            for i in range(batch):
                engine.add_request(str(i), f"ROMEO {i}:\n", SamplingParams(
                    max_tokens=steps + 4, temperature=0, ignore_eos=not masked, structured_outputs=spec if masked else None))  # fmt: skip
            engine.step()  # the prefills
            t0, n = time.perf_counter(), 0
            while n < steps and engine.has_unfinished_requests():
                engine.step()
                n += 1
            key = "masked_ms" if masked else "plain_ms"
            out[key] = min(out[key], (time.perf_counter() - t0) / max(n, 1) * 1e3)
    out["ratio"] = out["masked_ms"] / out["plain_ms"]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grammar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    p.add_argument("--corpus", default=None, help="text to train the BPE tokenizers on (default: skip them)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per run")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from level0_naive.loader import load_tokenizer

    model = args.model or str(default_model())
    tokenizers = {"built-in (259)": load_tokenizer(Path(model))}
    if args.corpus:
        tokenizers |= {f"BPE {v}": bpe_tokenizer(v, args.corpus) for v in (8192, 32000)}
    result = {"engines": engines(tokenizers), "step": step_cost(model, args.batch, args.steps, args.repeats)}
    for r in result["engines"]:
        print(f"{r['tokenizer']:16s} {r['engine']:10s} setup {r['setup_ms']:7.1f} ms  compile {r['compile_ms']:6.1f} ms  "
              f"mask {r['mask_us']:6.1f} us/token ({r['tokens']} tokens)")  # fmt: skip
    s = result["step"]
    print(f"level 3, batch {args.batch}: {s['plain_ms']:.2f} ms per decode step plain, {s['masked_ms']:.2f} ms with a JSON "
          f"schema on every request ({s['ratio']:.2f}x); the schema's compile: {s['compile_ms']:.1f} ms, once")  # fmt: skip
    save_json(result, "grammar.json")
    return result


if __name__ == "__main__":
    main()
