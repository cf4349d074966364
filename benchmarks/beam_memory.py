"""`python -m benchmarks.beam_memory`: the KV blocks that sharing saves, beside the PagedAttention paper's.

What it is: the paper's memory figure (Kwon et al., SOSP 2023, section 6.3, figure 15) on the
built-in model at level 3, block size 16. Two ways one prompt becomes several sequences:

  beam search        `LLM.beam_search`, widths 2, 4, 6: beams fork from their parents every step
  parallel sampling  `n` = 2, 4, 6 samples at temperature 1: they fork after the prompt

and two length mixes with the means of the paper's traces (its table 1):

  alpaca-like    prompts 8-31 tokens (mean 19), outputs 20-96 (mean 58)
  sharegpt-like  prompts 32-290 (mean 161), outputs 64-612 (mean 338)

Prompts are slices of `texts/sonnets.txt` (the model is byte-level: a token is a character);
every output runs to its length (`ignore_eos`). After every step the benchmark counts the
blocks the live sequences hold with sharing (distinct blocks) and without (the sum of their
block tables: each sequence with a private copy of everything), and reports

    saved = 1 - sum over steps of blocks held / sum over steps of blocks without sharing

the paper's "memory saving" (blocks averaged over time). All requests of a mix are submitted
at once, as the paper's offline figure; a wider KV cache changes nothing here (there is room).

What it is not: a timing (nothing here is timed), or the paper's model (OPT-13B) and traces:
its numbers depend on lengths and on how fast beams agree, and ours are a tiny model's.

Reference: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023, section 6.3 and figure 15.
"""

from __future__ import annotations

import argparse
import random

import torch

from benchmarks.workloads import TEXTS
from ladder.cli import save_json
from ladder.models import default_model

BLOCK_SIZE = 16
MIXES = {  # name: (prompt lengths, output lengths), uniform and inclusive
    "alpaca-like": ((8, 31), (20, 96)),
    "sharegpt-like": ((32, 290), (64, 612)),
}
PAPER = {  # the paper's range over widths / n = 2, 4, 6 (section 6.3)
    ("beam search", "alpaca-like"): "37.6-55.2 %",
    ("beam search", "sharegpt-like"): "44.3-66.3 %",
    ("parallel sampling", "alpaca-like"): "6.1-9.8 %",
    ("parallel sampling", "sharegpt-like"): "16.2-30.5 %",
}
WIDTHS = (2, 4, 6)


def requests(mix: str, num: int, seed: int = 0) -> list[tuple[str, int]]:
    """(prompt text, output length) per request, seeded."""
    (plo, phi), (olo, ohi) = MIXES[mix]
    rng, text = random.Random(seed), " ".join(TEXTS.read_text().split())
    out = []
    for _ in range(num):
        n = rng.randint(plo, phi)
        start = rng.randrange(len(text) - n)
        out.append((text[start : start + n], rng.randint(olo, ohi)))
    return out


class BlockCount:
    """Sums, over steps, the blocks held with sharing (distinct) and without (every table in full)."""

    def __init__(self):
        self.shared = self.unshared = 0

    def add(self, tables) -> None:
        tables = list(tables)
        self.shared += len({b for t in tables for b in t})
        self.unshared += sum(len(t) for t in tables)

    @property
    def saved(self) -> float:
        return 1 - self.shared / self.unshared if self.unshared else 0.0


def beam_search_saving(llm, reqs: list[tuple[str, int]], width: int) -> float:
    """One search per request (each with its own length), all of them counted together."""
    from level3_prefix.beam_search import BeamSearchParams, beam_search

    count, kv = BlockCount(), llm.llm_engine.kv
    for prompt, max_tokens in reqs:
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True)
        beam_search(llm.llm_engine, [prompt], params, on_step=lambda beams: count.add(kv.block_table(b) for b in beams))
    return count.saved


def sampling_saving(model: str, reqs: list[tuple[str, int]], n: int, dtype: str) -> float:
    from level0_naive import SamplingParams
    from level3_prefix import LLM

    count = BlockCount()
    observe = lambda record, snap: count.add(r.block_ids for r in snap.requests if r.status == "running")  # noqa: E731
    llm = LLM(model, dtype=dtype, block_size=BLOCK_SIZE, observers=[observe], enable_prefix_caching=False)
    params = [SamplingParams(n=n, max_tokens=t, min_tokens=t, ignore_eos=True, temperature=1.0, seed=i)
              for i, (_, t) in enumerate(reqs)]  # fmt: skip
    llm.generate([p for p, _ in reqs], params, progress=False)
    return count.saved


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.beam_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in model)")
    p.add_argument("--requests", type=int, default=8, help="requests per mix")
    p.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    p.add_argument("--widths", nargs="+", type=int, default=list(WIDTHS))
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    from level3_prefix import LLM

    torch.manual_seed(0)
    model = args.model or str(default_model())
    rows = []
    for mix in args.mixes:
        reqs = requests(mix, args.requests)
        llm = LLM(model, dtype=args.dtype, block_size=BLOCK_SIZE, enable_prefix_caching=False)
        for w in args.widths:
            rows.append({"method": "beam search", "mix": mix, "width": w, "saved": beam_search_saving(llm, reqs, w)})
        for n in args.widths:
            rows.append({"method": "parallel sampling", "mix": mix, "width": n,
                         "saved": sampling_saving(model, reqs, n, args.dtype)})  # fmt: skip
    print(f"KV blocks saved by sharing (block size {BLOCK_SIZE}, {args.requests} requests per mix)")
    print(
        f"{'method':18s} {'mix':14s} " + " ".join(f"{'w/n=' + str(w):>8s}" for w in args.widths) + "   paper (2, 4, 6)"
    )
    for method in ("beam search", "parallel sampling"):
        for mix in args.mixes:
            cells = [r for r in rows if r["method"] == method and r["mix"] == mix]
            print(f"{method:18s} {mix:14s} " + " ".join(f"{100 * r['saved']:7.1f}%" for r in cells)
                  + f"   {PAPER[method, mix]}")  # fmt: skip
    result = {"block_size": BLOCK_SIZE, "requests": args.requests, "rows": rows}
    save_json(result, "beam_memory.json")
    return result


if __name__ == "__main__":
    main()
