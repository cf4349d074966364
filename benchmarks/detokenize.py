"""`python -m benchmarks.detokenize`: what turning one new token into text costs, against output length.

What it is: a side-by-side measurement, in one process, of the two ways a step can keep
a request's text and stop strings current while it generates a long output:

  full         decode the whole output again and search it for the stop strings (what
               the engine did before the incremental detokenizer: O(L) per token, so
               O(L^2) over a request);
  incremental  `IncrementalDetokenizer.update()` plus `find_stop` over the new tail only,
               as `Sequence.append_token` does now (independent of L).

It feeds the same 2,000 tokens of built-in-model-style text (bytes of the Shakespeare
prompts, with multi-byte characters mixed in) one at a time and reports the mean cost
of a token at several output lengths.

What it is not: a test. Nothing fails on a number.
"""

from __future__ import annotations

import argparse
import time

from ladder.cli import LadderParser
from ladder.models import default_model
from level0_naive.detokenizer import IncrementalDetokenizer, find_stop

WINDOW = 50  # each figure is the mean cost of the tokens in a window this long


def sample_tokens(n: int) -> list[int]:
    text = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is the sun. \u00e9t\u00e9 \u20ac "
    data = text.encode()
    return [data[i % len(data)] for i in range(n)]


def measure(tokenizer, tokens: list[int], stops: list[str], marks: list[int]) -> dict[str, dict[int, float]]:
    """Mean microseconds per token in the window of WINDOW tokens ending at each mark."""
    out: dict[str, dict[int, float]] = {"full": {}, "incremental": {}}
    # full re-decode, as before
    ids: list[int] = []
    times = []
    for t in tokens:
        ids.append(t)
        t0 = time.perf_counter()
        text = tokenizer.decode(ids, skip_special_tokens=True)
        for s in stops:
            text.find(s)
        times.append(time.perf_counter() - t0)
    out["full"] = {m: 1e6 * sum(times[m - WINDOW : m]) / WINDOW for m in marks}
    # incremental
    ids = []
    detok = IncrementalDetokenizer(tokenizer, ids)
    times = []
    for t in tokens:
        ids.append(t)
        t0 = time.perf_counter()
        checked = len(detok.text)
        if detok.update():
            find_stop(detok.text, stops, checked)
        times.append(time.perf_counter() - t0)
    out["incremental"] = {m: 1e6 * sum(times[m - WINDOW : m]) / WINDOW for m in marks}
    return out


def output_length(text: str) -> int:
    """`--tokens`: at least one window, or there is nothing to report."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < WINDOW:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an integer >= {WINDOW} (each figure is a {WINDOW}-token mean)"
        )
    return n


def main(argv=None) -> dict:
    p = LadderParser(
        prog="python -m benchmarks.detokenize",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--tokens", type=output_length, default=2000, help=f"output length, >= {WINDOW} (default 2000)")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model())
    marks = sorted({m for m in (100, 500, 1000, 2000, args.tokens) if WINDOW <= m <= args.tokens})
    res = measure(tokenizer, sample_tokens(args.tokens), ["\n\n", "THE END"], marks)
    print(f"microseconds to turn one new token into text and search it for 2 stop strings ({args.tokens}-token output)")
    print(f"{'output length':>14} {'full re-decode':>16} {'incremental':>12} {'ratio':>7}")
    for m in marks:
        f, i = res["full"][m], res["incremental"][m]
        print(f"{m:>14} {f:>16.1f} {i:>12.1f} {f / i:>6.1f}x")
    return res


if __name__ == "__main__":
    main()
