"""`python -m benchmarks.quality`: what 8- and 4-bit weights cost in accuracy, measured, not assumed.

What it is: for the model in float32, with its weights in 8 and 4 bits (`quantization="int8"`, `"int4"`:
the packed kernels where they run) and with its KV cache in 8 bits (`kv_cache_dtype="fp8"`, scales 1.0,
and `"int8"`) (features/quantization, level 3):

    held-out loss   nats per byte (and its perplexity) on `--windows` windows of 255 bytes from the
                    corpus's last 10 %, the part the built-in models were not trained on
                    (models/train_tiny.py's split), read through the engine's prompt logprobs
    agreement       over `--prompts` prompts (32 held-out bytes each; random ids for a random model),
                    float32's greedy continuation of 32 tokens; the share of those tokens that the
                    quantized model also ranks first given the same prefix (teacher-forced: each token
                    judged on float32's text, so one early difference does not condemn the rest), and
                    the share of prompts whose own greedy continuation is the same all through

Two models: the built-in one (both measures; the corpus is ../shared/corpus/tinyshakespeare.txt
beside the repository, or `--corpus`) and a random-weight ~100M Llama (agreement only: its text
means nothing).

What it is not: a speed figure (`python -m benchmarks.quantization`), or a task benchmark (a 6M model
has none worth the name; lm-eval's harness runs against the server for that).
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

from ladder.cli import LadderParser, positive_int, save_result, torch_threads
from ladder.models import resolve_path

SETTINGS = {
    "float32": {},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
    "int8-kv": {"kv_cache_dtype": "int8"},
}  # label -> the engine's settings
CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "tinyshakespeare.txt"


def held_out(corpus: Path) -> bytes:
    data = corpus.read_bytes()
    return data[int(0.9 * len(data)) :]  # models/train_tiny.py's validation split: the last 10 % of bytes


def loss_per_byte(llm, windows: list[list[int]]) -> float:
    from level0_naive import SamplingParams

    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0), progress=False)
    lps = [next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs[1:]]  # each byte given those before
    return -sum(lps) / len(lps)


def agreement(llm, prompts: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(share of reference tokens ranked first given the reference's prefix, share of identical continuations)."""
    from level0_naive import SamplingParams

    n = len(reference[0])
    forced = llm.generate([p + r for p, r in zip(prompts, reference)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                          progress=False)  # fmt: skip
    ranks = [next(iter(d.values())).rank for o in forced for d in o.prompt_logprobs[-n:]]
    own = llm.generate(
        prompts, SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True), progress=False
    )
    same = sum(o.outputs[0].token_ids == r for o, r in zip(own, reference)) / len(prompts)
    return sum(r == 1 for r in ranks) / len(ranks), same


def measure(path: str, prompts: list[list[int]], windows: list[list[int]] | None) -> dict:
    import level3_prefix
    from level0_naive import SamplingParams

    out = {}
    engines = {
        label: level3_prefix.LLM(path, dtype="float32", enforce_eager=True, **kw) for label, kw in SETTINGS.items()
    }
    greedy = SamplingParams(max_tokens=32, min_tokens=32, temperature=0, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in engines["float32"].generate(prompts, greedy, progress=False)]
    for label, llm in engines.items():
        row = out[label] = {}
        if windows is not None:
            row["loss_nats_per_byte"] = loss_per_byte(llm, windows)
            row["perplexity"] = math.exp(row["loss_nats_per_byte"])
        if label != "float32":
            row["token_agreement"], row["same_continuation"] = agreement(llm, prompts, reference)
    return out


def main(argv=None) -> dict:
    from rich.console import Console

    from .quantization import model_100m

    p = LadderParser(prog="python -m benchmarks.quality", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--corpus", type=Path, default=CORPUS, help="the corpus whose last 10 %% is held out")
    p.add_argument("--models", nargs="+", default=["tiny", "100m"], help="tiny, 100m (agreement only), or paths")
    p.add_argument("--prompts", type=positive_int, default=200, help="agreement prompts (default 200)")
    p.add_argument(
        "--windows",
        type=positive_int,
        default=64,
        help="255-byte held-out windows (default 64; the built-in model reads 256 tokens)",
    )
    p.add_argument("--out", default=None, help="where the JSON goes (default: the output folder)")
    args = p.parse_args(argv)
    rng, console = random.Random(0), Console()
    text = held_out(args.corpus) if args.corpus.is_file() else None
    if text is None:
        console.print(f"no corpus at {args.corpus}: the built-in model's loss and held-out prompts are skipped")
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "models": {}}
    with torch_threads(1):
        for name in args.models:
            path = model_100m() if name == "100m" else str(resolve_path("tiny-shakespeare" if name == "tiny" else name))
            trained = name != "100m" and text is not None  # the built-in tokenizer's ids are the bytes
            if trained:
                starts = [rng.randrange(len(text) - 32) for _ in range(args.prompts)]
                prompts = [list(text[s : s + 32]) for s in starts]
                windows = [list(text[i * 255 : (i + 1) * 255]) for i in range(min(args.windows, len(text) // 255))]
            else:
                prompts, windows = [[rng.randrange(3, 250) for _ in range(32)] for _ in range(args.prompts)], None
            r = result["models"][name] = measure(path, prompts, windows)
            for label in SETTINGS:
                row = r[label]
                loss = (
                    f"held-out {row['loss_nats_per_byte']:.4f} nats/byte (ppl {row['perplexity']:.3f})"
                    if windows
                    else ""
                )
                agree = (f"agreement {row['token_agreement']:.3%} of tokens, {row['same_continuation']:.1%} of "
                         "continuations whole" if label != "float32" else "the reference")  # fmt: skip
                console.print(f"{name} {label}: {loss}{'; ' if loss else ''}{agree}")
    save_result(result, args.out, "quality.json")
    return result


if __name__ == "__main__":
    main()
