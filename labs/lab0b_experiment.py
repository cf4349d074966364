"""Lab 0b's experiment: what a mask costs, the plain way and xgrammar's, and outputs under your masker.

    python -m labs experiment 0b YOUR_FILE [--steps 30] [--regex PATTERN ...]

What it is: for a `choice` and two regular expressions, with the built-in byte-level
tokenizer: the time per token of your `ReferenceGrammar` (every vocabulary entry decoded
and matched) against xgrammar's (a precompiled automaton), along the same random walk
(`--regex` adds patterns of your own, a longer one say);
then the built-in model's outputs under your masker (`structured_outputs_backend="reference"`).

What it is not: a test; times drift on a shared machine, the outputs do not.
"""

from __future__ import annotations

import argparse
import random
import time

from ladder.cli import LadderParser, positive_int
from ladder.models import default_model

SPECS = [("choice", ["ROMEO", "JULIET", "friar Laurence"]), ("regex", r"[A-Z][a-z]{2,6} of [A-Z][a-z]{2,6}"),
         ("regex", r"(yes|no|maybe)!{1,3}")]  # fmt: skip


def main(argv=None) -> dict:
    p = LadderParser(prog="python -m labs experiment 0b YOUR_FILE", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--steps", type=positive_int, default=30, help="tokens per random walk (default 30)")
    p.add_argument("--regex", action="append", default=[], metavar="PATTERN",
                   help="one more regular expression to time and generate under (repeatable)")  # fmt: skip
    args = p.parse_args(argv)
    specs = SPECS + [("regex", r) for r in args.regex]
    from features.structured_outputs import StructuredOutputManager, StructuredOutputsParams
    from level0_naive.loader import load_tokenizer
    from level2_continuous import LLM, SamplingParams

    tok = load_tokenizer(default_model())
    vocab = 259  # the built-in model's vocab_size (a byte-level tokenizer)
    managers = {b: StructuredOutputManager(tok, vocab, [257], b) for b in ("reference", "xgrammar")}
    out = {}
    print(f"vocabulary: {vocab} tokens; your masker decodes and matches each of them at every step")
    for kind, value in specs:
        spec = StructuredOutputsParams(**{kind: value})
        times = {}
        for name, manager in managers.items():
            g, rng, spent, n = manager.grammar(spec), random.Random(0), 0.0, 0
            while n < args.steps and not g.is_terminated():
                t0 = time.perf_counter()
                allowed = g.allowed().nonzero().flatten().tolist()
                spent += time.perf_counter() - t0
                if not allowed:
                    break
                g.accept(rng.choice(allowed))
                n += 1
            times[name] = spent / max(n, 1) * 1e6
        out[f"{kind} {value}"] = times
        print(
            f"{kind} {value!s:40.40}  your masker {times['reference']:9.0f} us/token   xgrammar {times['xgrammar']:6.1f} us/token"
            f"   {times['reference'] / times['xgrammar']:5.0f}x slower"
        )
    llm = LLM(default_model(), structured_outputs_backend="reference", max_model_len=256)
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=i, structured_outputs=StructuredOutputsParams(**{k: v}))
              for i, (k, v) in enumerate(specs)]  # fmt: skip
    for (kind, value), o in zip(specs, llm.generate(["ROMEO:\n"] * len(specs), params, progress=False)):
        print(f"under your masker, {kind} {value!s:.30}: {o.outputs[0].text!r} ({o.outputs[0].finish_reason})")
    return out


if __name__ == "__main__":
    main()
