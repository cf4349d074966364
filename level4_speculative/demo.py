"""`python -m level4_speculative.demo`: the built-in draft proposes, the target verifies.

What it is: the same prompts, greedy, through level 3 and level 4 (the built-in pair:
a 6M-parameter target and its 0.5M distilled draft; `--method eagle`: the target's 1.1M EAGLE
head instead, eagle.py) at batch 1 and at a larger batch.
It prints

  - the generated text, each token colored by where it came from: an accepted draft
    token (green), a recovered token after a rejection (yellow), a bonus token after a
    fully accepted draft (cyan); without colours (piped, or NO_COLOR) the recovered
    tokens are [bracketed] and the bonus ones {braced}; and whether level 3 and level 4
    wrote the same text;
  - the acceptance per draft position against Leviathan's alpha**i, where alpha is the
    measured per-token acceptance probability;
  - the costs measured on this machine, c_draft (one draft forward, per token) and
    c_verify(k) (a verifying step without its drafting), both as fractions of a level-3
    step, and the measured speedup against Leviathan's prediction
        S = E[N] / (k * c_draft + c_verify(k)),   E[N] = (1 - alpha**(k+1)) / (1 - alpha);
  - a plot of the speedup over level 3 against k, measured and predicted, on an axis
    from 0 with level 3 at 1.0x (to a folder outside the
    repository, printed at the end; `--plot PATH` to choose; `python -m ladder.figures`
    regenerates the committed `docs/img/level4_speedup.png`);
  - the noise: the level-3 run is timed three times, and its spread bounds every measured
    speedup (error bars on the plot); a change from one k to the next within it is named
    as noise, not read as a trend.

What it is not: a benchmark across workloads (`benchmarks/` is). On a CPU a tiny model's
step is mostly per-call overhead, so the draft costs far more than its 8 % of the FLOPs:
the demo measures that instead of assuming it.

Reference: Leviathan, Kalman, Matias (ICML 2023), section 3.3 and figure 2.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ladder.cli import demo_parser, plot_flag, positive_int, run_demo, save_figure
from ladder.models import BUILTIN_DRAFT, BUILTIN_EAGLE, default_model
from level0_naive.sampling_params import SamplingParams
from level3_prefix.engine import LLM as PrefixLLM

from .engine import LLM, SpecDecodeStats

PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo!", "KING RICHARD III:\nNow is the winter", "First Citizen:\n"]
COLORS = {"accepted": "green", "recovered": "yellow", "bonus": "cyan", "plain": "default"}
MARKS = {"accepted": "{}", "recovered": "[{}]", "bonus": "{{{}}}", "plain": "{}"}  # the same, without colour
PLAIN_LEGEND = ("   accepted draft tokens unmarked, [recovered] after a rejection, {bonus} after a fully accepted "
                "draft (the first token of each request comes from its prefill)")  # fmt: skip
COSTS = """\
  c_draft:  a draft forward per draft token, over a level-3 step (batch 1)
  c_verify: a level-4 step minus its drafting (the target checks k + 1
            tokens at once), over the same level-3 step
  E[N]:     tokens per step predicted, (1 - alpha**(k+1)) / (1 - alpha)
  S:        speedup predicted, E[N] / (k c_draft + c_verify); meas.: measured"""
REPEATS = 3  # timings of the level-3 run: their spread is the noise every measured speedup carries


def parser():
    p = demo_parser(__doc__, "level4_speculative.demo")
    p.add_argument(
        "--draft-model", default=None, help="the draft checkpoint (default: the built-in tiny-shakespeare-draft, or "
        "with --method eagle the built-in tiny-shakespeare-eagle)"
    )
    p.add_argument("--method", default="draft_model", choices=["draft_model", "eagle"],
                   help="a draft model, or an EAGLE head over the target's features (eagle.py)")
    p.add_argument(
        "-k", "--num-speculative-tokens", type=positive_int, default=4, help="draft tokens per step (default 4)"
    )
    p.add_argument("--max-k", type=positive_int, default=6, help="the largest k of the tokens/s sweep (default 6)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="the larger batch (default 16)")
    plot_flag(p, "level4_speedup.png", "the speedup plot")
    p.set_defaults(max_tokens=96, temperature=0.0)
    return p


def main(argv=None) -> dict:
    return run_demo(parser(), argv, run, plot="level4_speedup.png", model_flags=("model", "draft_model"))


def timed_generate(llm, prompts, params) -> tuple[list, float]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, progress=False)
    return outs, time.perf_counter() - t0


def trace_kinds(llm) -> dict[str, list[str]]:
    """Wrap the scheduler's update_from_output to note where each emitted token came from."""
    scheduler, kinds = llm.llm_engine.scheduler, {}
    inner = scheduler.update_from_output

    def traced(sched, out):
        verified = {id(r): r.num_logits(n) - 1 for r, n in sched.scheduled}  # guesses the step verified
        for req, tokens in zip(out.requests, out.token_ids):
            k, a = verified[id(req)], len(tokens) - 1
            tags = ["accepted"] * a + (["recovered" if a < k else "bonus"] if k else ["plain"])
            kinds.setdefault(req.request_id, []).extend(tags)
        return inner(sched, out)

    scheduler.update_from_output = traced
    return kinds


def matmul_parameters(model_dir) -> int | None:
    """The weights a token is multiplied by (two FLOPs each) in a dense model: every parameter but an untied
    embedding table, which is only looked up (a tied one is the output layer too); a mixture of experts would be
    overcounted (each token uses k of its experts). None where `model_dir` is not a folder."""
    folder = Path(model_dir)
    if not folder.is_dir():
        return None
    from safetensors import safe_open

    tied = json.loads((folder / "config.json").read_text()).get("tie_word_embeddings", False)
    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            for name in st.keys():
                if tied or "embed_tokens" not in name:
                    total += math.prod(st.get_slice(name).get_shape())
    return total


def leviathan(alpha: float, k: int, c_draft: float, c_verify: float) -> tuple[float, float]:
    """(E[N], predicted speedup S) for i.i.d. acceptance with probability alpha."""
    e_n = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
    return e_n, e_n / (k * c_draft + c_verify)


def run(args, console: Console) -> dict:
    model = args.model or default_model()
    draft = args.draft_model or (BUILTIN_EAGLE if args.method == "eagle" else BUILTIN_DRAFT)

    def spec(k: int) -> dict:
        return {"method": args.method, "model": str(draft), "num_speculative_tokens": k}

    prompts = PROMPTS
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    common = dict(dtype=args.dtype, device=args.device, seed=args.seed)
    console.print(f"[bold]level 4[/]: target {model}, {'EAGLE head' if args.method == 'eagle' else 'draft'} {draft}; {len(prompts)} prompts, {args.max_tokens} tokens each, "
                  f"temperature {args.temperature:g}")  # fmt: skip

    # batch 1: one request at a time, level 3 against level 4 at every k (the first run warms up)
    base = PrefixLLM(model, max_num_seqs=1, **common)
    timed_generate(base, prompts[:1], SamplingParams(max_tokens=8))
    steps0 = base.stats.steps  # the warm-up's steps are not the timed run's
    times3 = []
    for _ in range(REPEATS):  # the same run again: what it varies by is noise
        ref, t = timed_generate(base, prompts, params)
        times3.append(t)
    t3 = statistics.median(times3)
    # A speedup divides two timings, each off by up to half the spread: twice that bounds it.
    noise = (max(times3) - min(times3)) / t3
    tokens = sum(len(o.outputs[0].token_ids) for o in ref)
    step3 = sum(times3) / (base.stats.steps - steps0)  # seconds per level-3 step at batch 1
    del base
    sweep = {}
    for k in range(1, args.max_k + 1):
        llm = LLM(
            model, max_num_seqs=1, speculative_config=spec(k), **common
        )
        kinds = trace_kinds(llm) if k == args.num_speculative_tokens else None
        timed_generate(llm, prompts[:1], SamplingParams(max_tokens=8))
        s = llm.llm_engine.spec_stats = SpecDecodeStats(
            accepted_per_pos=[0] * k, drafted_per_pos=[0] * k
        )  # forget the warm-up
        steps0 = llm.stats.steps
        outs, t4 = timed_generate(llm, prompts, params)
        steps, drafting = llm.stats.steps - steps0, s.draft_seconds
        c_draft = drafting / max(s.num_draft_tokens, 1) / step3  # one draft forward per draft token
        c_verify = (t4 - drafting) / steps / step3  # a step without its drafting
        sweep[k] = dict(outs=outs, seconds=t4, speedup=t3 / t4, c_draft=c_draft, c_verify=c_verify, kinds=kinds,
                        stats=llm.spec_decode_stats(), llm=llm if k == args.num_speculative_tokens else None)  # fmt: skip
        # An engine reaches its KV pool (1 GiB on a CPU) through reference cycles: collect each one dropped, or
        # the sweep holds max_k pools at once.
        del llm
        gc.collect()
    k = args.num_speculative_tokens
    main_run = sweep[k]
    s = main_run["stats"]
    alpha = s.per_token_acceptance  # Leviathan's alpha (vLLM's acceptance rate divides by all proposed tokens)
    same = [o.outputs[0].token_ids for o in main_run["outs"]] == [o.outputs[0].token_ids for o in ref]

    show_text(console, main_run, args, same)
    show_positions(console, s, alpha)
    table = Table(title=f"batch 1: measured vs Leviathan (alpha = {alpha:.3f} per token)")
    for col in ("k", "c_draft", "c_verify", "E[N]", "N meas.", "S pred.", "S meas.", "error"):  # fits 80 columns
        table.add_column(col, justify="right", no_wrap=True)
    for kk, r in sweep.items():
        e_n, pred = leviathan(alpha, kk, r["c_draft"], r["c_verify"])
        measured_len = r["stats"].mean_acceptance_length
        r.update(predicted=pred)
        table.add_row(str(kk), f"{r['c_draft']:.2f}", f"{r['c_verify']:.2f}", f"{e_n:.2f}", f"{measured_len:.2f}", f"{pred:.2f}x",
                      f"[bold]{r['speedup']:.2f}x[/]", f"{100 * (r['speedup'] / pred - 1):+.0f} %")  # fmt: skip
    console.print(table)
    console.print(COSTS, style="dim", markup=False, highlight=False)
    weights = matmul_parameters(model), matmul_parameters(draft)
    if None not in weights:  # what c_draft would be if a forward cost only its FLOPs
        console.print(f"FLOPs per token: target {weights[0] / 1e6:.2f}M weights, draft {weights[1] / 1e6:.2f}M: the draft "
                      f"is {100 * weights[1] / weights[0]:.1f} % of a target forward's FLOPs")  # fmt: skip
    else:
        console.print("FLOPs per token: not counted for a model given by name (give its folder to count them)")
    within = show_noise(console, sweep, times3, noise)

    # a larger batch: speculation helps less when the target is already busy
    bs = args.batch_size
    many = [prompts[i % len(prompts)] for i in range(bs)]
    big3 = PrefixLLM(model, max_num_seqs=bs, **common)
    timed_generate(big3, many[:2], SamplingParams(max_tokens=8))
    _, tb3 = timed_generate(big3, many, params)
    del big3
    gc.collect()
    big4 = LLM(model, max_num_seqs=bs, speculative_config=spec(k), **common)
    timed_generate(big4, many[:2], SamplingParams(max_tokens=8))
    _, tb4 = timed_generate(big4, many, params)
    big_tokens = bs * args.max_tokens
    console.print(f"[bold]batch 1[/]: level 3 {tokens / t3:.0f} tok/s, level 4 (k={k}) {tokens / main_run['seconds']:.0f} tok/s: "
                  f"[bold green]{main_run['speedup']:.2f}x[/] (predicted {main_run['predicted']:.2f}x)")  # fmt: skip
    console.print(f"[bold]batch {bs}[/]: level 3 {big_tokens / tb3:.0f} tok/s, level 4 (k={k}) {big_tokens / tb4:.0f} tok/s: "
                  f"[bold]{tb3 / tb4:.2f}x[/] (on a CPU a step's cost grows with its tokens, so verifying k + 1 per request "
                  f"costs more when the batch is already big)")  # fmt: skip
    plot(args.plot, sweep, tokens / t3, alpha, noise)
    console.print(f"identical text at level 3 and level 4: {same};  plot: {args.plot}")
    return {"speedup": main_run["speedup"], "predicted": main_run["predicted"], "alpha": alpha, "identical": same,
            "batch_speedup": tb3 / tb4, "sweep": {kk: {x: r[x] for x in ("speedup", "predicted", "c_draft", "c_verify")} for kk, r in sweep.items()},
            "per_position": s.per_position(), "noise": noise, "within_noise": within, "plot": args.plot}  # fmt: skip


def show_noise(console: Console, sweep: dict, times3: list[float], noise: float) -> list[int]:
    """Say how far a measured speedup can move by chance, and which steps of the sweep are within that.
    Returns the k whose measured speedup is within the noise of k - 1's."""
    ks = sorted(sweep)
    speedup = {k: sweep[k]["speedup"] for k in ks}
    within = [k for k in ks[1:] if abs(speedup[k] - speedup[k - 1]) <= noise * speedup[k - 1]]
    spread = ", ".join(f"{t:.2f}" for t in times3)
    console.print(f"noise: the level-3 run took {spread} s ({len(times3)} runs), so a measured speedup is good to "
                  f"about \u00b1{100 * noise:.0f} % (the plot's error bars).", highlight=False)  # fmt: skip
    if within:
        steps = ", ".join(f"{k - 1} to {k}" for k in within)
        console.print(f"within noise: the change from k = {steps}; read no trend into it.", highlight=False)
    else:
        console.print("every change from one k to the next is larger than the noise.", highlight=False)
    return within


def show_text(console: Console, run: dict, args, same: bool) -> None:
    tok = run["llm"].get_tokenizer()
    plain = console.no_color or console.color_system is None  # piped: a colour legend would mean nothing
    for out in run["outs"][:2]:
        text = Text(out.prompt, style="dim")
        for t, kind in zip(out.outputs[0].token_ids, run["kinds"][out.request_id]):
            piece = tok.decode([t])
            text.append(MARKS[kind].format(piece) if plain else piece, style=COLORS[kind])
        console.print(text)
    if plain:
        console.print(PLAIN_LEGEND, markup=False, highlight=False)
        return
    legend = Text("  ")
    for kind, color in COLORS.items():
        if kind != "plain":
            legend.append(f" {kind} ", style=f"black on {color}")
            legend.append(" ")
    legend.append(" (the first token of each request comes from its prefill)", style="italic")
    console.print(legend)


def show_positions(console: Console, s, alpha: float) -> None:
    t = Table(title="acceptance by draft position i")
    t.add_column("i", justify="right")
    t.add_column("P(d_i accepted)", justify="right")
    t.add_column("alpha**i", justify="right")
    for i, rate in enumerate(s.per_position(), 1):
        t.add_row(str(i), f"{rate:.3f}", f"{alpha**i:.3f}")
    console.print(t)
    console.print(f"vLLM's acceptance rate (accepted / proposed): {s.acceptance_rate:.3f};  "
                  f"mean acceptance length (bonus included): {s.mean_acceptance_length:.2f}")  # fmt: skip


def plot(path: Path, sweep: dict, base_tps: float, alpha: float, noise: float = 0.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted(sweep)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    measured, predicted = [sweep[k]["speedup"] for k in ks], [sweep[k]["predicted"] for k in ks]
    ax.errorbar(ks, measured, yerr=[noise * m for m in measured], fmt="o-", color="tab:green", capsize=3,
                label=f"level 4, measured (\u00b1{100 * noise:.0f} %: the noise)")  # fmt: skip
    ax.plot(ks, predicted, "s--", color="tab:gray", label=f"Leviathan's S (alpha {alpha:.2f})")
    ax.axhline(1.0, color="tab:red", label=f"level 3, no speculation (1.0x = {base_tps:.0f} tok/s)")
    # From 0: a speed-up read off a clipped axis looks many times larger than it is.
    ax.set_ylim(0, 1.15 * max(1.0, *(m * (1 + noise) for m in measured), *predicted))
    ax.yaxis.set_major_formatter("{x:.2f}x")
    ax.set_xticks(ks)
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("speed-up over level 3, batch 1")
    ax.set_title("Speculative decoding with the built-in pair: measured and predicted")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path, dpi=120)


if __name__ == "__main__":
    main()
