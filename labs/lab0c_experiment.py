"""Lab 0c's experiment: what each sampling setting does to the text, diversity against likelihood.

    python -m labs experiment 0c YOUR_FILE [--samples 8] [--max-tokens 64] [--prompt TEXT]

What it is: the built-in model at level 2 (whose sampler runs *your* `filter_logits_batch`; its
penalties run `Penalties.batch`, which the lab's "batch" check holds equal to your
`apply_penalties`), `--samples` seeded samples of one prompt under each of a row of settings,
all in one batch, each exactly `--max-tokens` long (`min_tokens`: no sample ends early on an
EOS, so every setting is measured over the same number of tokens). Per setting:

    log p / token   the mean log-probability of the sampled tokens under the model's raw
                    distribution (before temperature, filters and penalties): how likely the
                    model itself finds the text (0 is certain; greedy is the highest a
                    token-by-token choice gets)
    distinct-2      distinct token pairs over all pairs, across every sample: how varied
    repeated-4      the share of each sample's 4-token windows it had already produced:
                    loops and repeats
    text            the first sample's opening

What it is not: a measure of quality (a 6M-parameter model, a few samples), or of speed.

Reference: Holtzman et al., "The Curious Case of Neural Text Degeneration" (ICLR 2020: top-p);
Nguyen et al., "Turning Up the Heat: Min-p Sampling" (2024); Keskar et al., CTRL (2019: the
repetition penalty).
"""

from __future__ import annotations

import argparse

from ladder.cli import LadderParser, positive_int
from ladder.models import default_model

SETTINGS = [  # (label, SamplingParams fields)
    ("greedy", dict(temperature=0.0)),
    ("T 1.0", dict(temperature=1.0)),
    ("T 1.0 top-k 10", dict(temperature=1.0, top_k=10)),
    ("T 1.0 top-p 0.9", dict(temperature=1.0, top_p=0.9)),
    ("T 1.0 min-p 0.1", dict(temperature=1.0, min_p=0.1)),
    ("T 1.5 min-p 0.1", dict(temperature=1.5, min_p=0.1)),
    ("T 0.7 rep 1.3", dict(temperature=0.7, repetition_penalty=1.3)),
    ("T 0.7 freq 0.5", dict(temperature=0.7, frequency_penalty=0.5)),
]


def parser() -> argparse.ArgumentParser:
    p = LadderParser(prog="python -m labs experiment 0c YOUR_FILE", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="checkpoint or built-in name (default: the built-in model)")
    p.add_argument("--samples", type=positive_int, default=8, help="seeded samples per setting (default 8)")
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per sample (default 64)")
    p.add_argument("--prompt", default="ROMEO:\n", help="the prompt of every sample")
    return p


def repeated(tokens: list[int], n: int = 4) -> tuple[int, int]:
    """(windows of n tokens already seen earlier in the same sample, all windows)."""
    seen, again = set(), 0
    for i in range(len(tokens) - n + 1):
        w = tuple(tokens[i : i + n])
        again += w in seen
        seen.add(w)
    return again, max(0, len(tokens) - n + 1)


def main(argv=None) -> list[dict]:
    args = parser().parse_args(argv)
    from level2_continuous import LLM, SamplingParams

    llm = LLM(str(args.model or default_model()))
    params = [SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, seed=s, logprobs=0, **kw)
              for _, kw in SETTINGS for s in range(args.samples)]  # fmt: skip
    outs = llm.generate([args.prompt] * len(params), params, use_tqdm=False)
    rows = []
    for i, (label, _) in enumerate(SETTINGS):
        samples = [o.outputs[0] for o in outs[i * args.samples : (i + 1) * args.samples]]
        pairs = [tuple(s.token_ids[j : j + 2]) for s in samples for j in range(len(s.token_ids) - 1)]
        again, windows = map(sum, zip(*(repeated(s.token_ids) for s in samples)))
        tokens = sum(len(s.token_ids) for s in samples)
        rows.append({"setting": label, "logprob": sum(s.cumulative_logprob for s in samples) / tokens,
                     "distinct2": len(set(pairs)) / max(1, len(pairs)), "repeated4": again / max(1, windows),
                     "text": samples[0].text})  # fmt: skip
    print(f"\n{args.samples} samples of {args.max_tokens} tokens per setting, prompt {args.prompt!r}")
    print(f"{'setting':>16} {'log p / token':>14} {'distinct-2':>11} {'repeated-4':>11}  text")
    for r in rows:
        print(f"{r['setting']:>16} {r['logprob']:>14.2f} {r['distinct2']:>11.2f} {r['repeated4']:>11.2f}  "
              f"{r['text'][:36]!r}")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
