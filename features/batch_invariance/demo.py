"""`python -m features.batch_invariance.demo`: one request, alone and among others, with and without batch invariance.

What it is: two experiments with the built-in model in float32 on the CPU (the mode's
kernels are C++), each run twice, with
PyTorch's kernels (the default) and with `batch_invariant=True` (this room's ops.py and the
compiled attention kernel for every query):

  1. The engine. N copies of one prompt (greedy, logprobs on), each generated in a batch of
     its own: with 0, 1, 2, ... other requests of varied lengths, the copy at a different
     place in it. The table counts the distinct logprob sequences and the distinct
     completions among the N copies (1 and 1 means every copy got the same bits), and the
     seconds each mode took: the mode's cost. Both engines are built and warmed up before
     either is timed, and the modes take turns batch by batch, so neither pays for the first
     run's start-up (once charged to the default mode alone, which made the mode look 0.4x).
  2. The model. One decode step of one sequence, alone and among 15 others; after each
     layer, the largest difference in that sequence's hidden state between the two runs.
     The picture (`--plot`) shows where the runs part: at the first matmul, in the default
     mode (PyTorch's matmul picks its algorithm by the number of rows), and nowhere with
     the mode.

What it is not: the proof (tests/test_batch_invariance.py holds the property under
preemption, chunked prefill, prefix hits and speculation), or a benchmark
(`python -m benchmarks.throughput --engines level3_prefix,level3_prefix:invariant` measures
the cost on a workload; `python -m benchmarks.profile --batch-invariant`, inside a step).

Reference: He, "Defeating Nondeterminism in LLM Inference" (Thinking Machines, 2025): 1,000
identical requests gave 80 distinct completions before, 1 after.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ladder.cli import demo_parser, plot_flag, positive_int, run_demo, save_figure
from ladder.models import default_model
from level0_naive.sampling_params import SamplingParams
from level1_paged.engine import LLM
from level1_paged.model_input import ModelInput

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
MODES = {"default": False, "batch_invariant": True}


def parser():
    p = demo_parser(__doc__, "features.batch_invariance.demo")
    p.add_argument("--copies", type=positive_int, default=12, help="copies of the prompt, each in its own batch (12)")
    plot_flag(p, "batch_invariance_layers.png", "the layer-by-layer picture")
    return p


def main(argv=None) -> dict:
    return run_demo(parser(), argv, run, plot="batch_invariance_layers.png")


def run(args, console: Console) -> dict:
    model = args.model or default_model()
    max_tokens = args.max_tokens or 48
    console.print(f"[bold]batch invariance[/]: {args.copies} copies of one prompt, each in a different batch, "
                  f"{max_tokens} greedy tokens, float32, model {model}")  # fmt: skip
    g = torch.Generator().manual_seed(args.seed)
    llms = {mode: LLM(model, dtype="float32", device="cpu", batch_invariant=invariant, seed=args.seed, max_num_seqs=64)
            for mode, invariant in MODES.items()}  # fmt: skip
    vocab = llms["default"].llm_engine.model_config.vocab_size  # the same other requests for both modes
    others = [[int(t) for t in torch.randint(0, min(vocab, 256), (int(n),), generator=g)]
              for n in torch.randint(4, 120, (max(args.copies, 15),), generator=g)]  # fmt: skip
    results = copies_in_batches(llms, others, args.copies, max_tokens)
    layers = {mode: one_step_alone_and_among(llm, others[:15]) for mode, llm in llms.items()}
    del llms
    print_table(console, results)
    print_layers(console, layers)
    plot(args.plot, layers)
    console.print(f"plot saved to {args.plot}")
    return {"results": results, "layers": layers, "plot": args.plot}


def copies_in_batches(llms: dict, others: list[list[int]], copies: int, max_tokens: int) -> dict:
    """Per mode: copy i of the prompt among i other requests, at place i // 2 of the batch.

    Every engine runs a batch first, untimed (the first run of a process and of an engine pays for
    start-up: threads, allocations, the mode's compiled kernels), then the modes take turns batch by
    batch, so a machine that slows down or speeds up meanwhile does so for both."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, ignore_eos=True)
    for llm in llms.values():  # the shared warm-up
        llm.generate([PROMPT, *others[:2]], SamplingParams(max_tokens=4, ignore_eos=True), progress=False)
    seconds, logprobs, texts = dict.fromkeys(llms, 0.0), {m: [] for m in llms}, {m: [] for m in llms}
    for i in range(copies):
        batch = others[:i]
        at = i // 2
        for mode, llm in llms.items():
            t0 = time.perf_counter()
            outs = llm.generate(batch[:at] + [PROMPT] + batch[at:], params, progress=False)
            seconds[mode] += time.perf_counter() - t0
            c = outs[at].outputs[0]
            logprobs[mode].append(tuple(d[t].logprob for d, t in zip(c.logprobs, c.token_ids)))
            texts[mode].append(c.text)
    return {m: dict(seconds=seconds[m], logprob_sequences=len(set(logprobs[m])), completions=len(set(texts[m])),
                    text=texts[m][0]) for m in llms}  # fmt: skip


@torch.inference_mode()
def one_step_alone_and_among(llm, others: list[list[int]]) -> list[tuple[str, float]]:
    """(layer, max |hidden alone - hidden among 15 others|) for one decode step of the prompt."""
    engine = llm.llm_engine
    worker, bs = engine.worker, engine.config.cache.block_size
    prompt = engine.tokenizer(PROMPT)["input_ids"]
    seqs = [prompt] + others  # sequence 0 is the one watched
    width = max(-(-(len(s) + 1) // bs) for s in seqs)
    tables = [list(range(i * width, (i + 1) * width)) for i in range(len(seqs))]  # blocks of their own
    prefill = worker.execute(ModelInput.build([(s, 0) for s in seqs], tables, bs, [1] * len(seqs)))  # [16, V]
    nxt = prefill.argmax(-1).tolist()  # each sequence's next token: the decode step's input
    model, seen = worker.model, []
    names = ["embedding"] + [f"layer {i}" for i in range(len(model.model.layers))] + ["final norm"]
    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, a, out: seen.append(out))]
    hooks += [layer.register_forward_hook(lambda m, a, out: seen.append(out)) for layer in model.model.layers]
    hooks += [model.model.norm.register_forward_hook(lambda m, a, out: seen.append(out))]
    runs = []
    try:
        for rows in ([0], list(range(len(seqs)))):  # alone, then as row 0 of 16 (the same K/V slot)
            seen.clear()
            step = [([nxt[i]], len(seqs[i])) for i in rows]
            logits = worker.execute(ModelInput.build(step, [tables[i] for i in rows], bs, [1] * len(rows)))
            runs.append([t[0].clone() for t in seen] + [logits[0]])  # sequence 0's row of each
    finally:
        for h in hooks:
            h.remove()
    return [(name, (a.double() - b.double()).abs().max().item()) for name, a, b in zip(names + ["logits"], *runs)]


def print_table(console: Console, results: dict) -> None:
    t = Table(title="the same prompt in different batches (greedy, float32)")
    t.add_column("mode")
    t.add_column("distinct logprob sequences", justify="right")
    t.add_column("distinct completions", justify="right")
    t.add_column("seconds", justify="right")
    for mode, r in results.items():
        t.add_row(mode, str(r["logprob_sequences"]), str(r["completions"]), f"{r['seconds']:.1f}")
    base = results["default"]["seconds"]
    console.print(t)
    console.print(f"cost of the mode here: {results['batch_invariant']['seconds'] / base:.2f}x the default's time, "
                  f"both warmed up first (one run of this demo; python -m benchmarks.throughput --engines level3_prefix,level3_prefix:invariant "
                  f"measures it properly)")  # fmt: skip


def print_layers(console: Console, layers: dict) -> None:
    t = Table(title="one decode step: max |hidden alone - hidden among 15 others|")
    t.add_column("after")
    for mode in layers:
        t.add_column(mode, justify="right")
    for i, (name, _) in enumerate(layers["default"]):
        t.add_row(name, *(f"{layers[m][i][1]:.2e}" if layers[m][i][1] else "0 (same bits)" for m in layers))
    console.print(t)


def plot(path: Path, layers: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, _ in layers["default"]]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    floor = 1e-10  # where "identical" is drawn on the log scale
    for (mode, rows), color, marker in zip(layers.items(), ["tab:red", "tab:green"], ["o", "s"]):
        ys = [max(d, floor) for _, d in rows]
        ax.plot(range(len(rows)), ys, marker=marker, color=color, label=mode)
    ax.axhline(floor, color="gray", lw=0.8, ls=":")
    ax.text(len(names) - 1, floor * 2, "same bits", ha="right", va="bottom", fontsize=8, color="gray")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("max |alone - among 15 others|")
    ax.set_title("one decode step of one sequence, alone and as one of 16 rows (float32)")
    ax.legend(loc="center right", fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
