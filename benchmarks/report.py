"""From raw runs to the figures people read: summaries, ratios, goals, tables.

What it is: pure functions over plain data. `summarise` turns one `RunResult` into
vLLM's benchmark figures (requests/s, output and total tokens/s, TTFT / TPOT / end-to-end
latency mean, p50, p99, KV memory, MFU, and the share of the ceiling at the batch the
engine ran at: `roofline.ceiling_tokens_per_s`); `add_ratios` divides by level 0
and by Hugging Face measured in the same process; `goals` checks the project's targets;
`rich_table` and `markdown` print them. Everything reads the JSON's own structure, so
`--markdown results.json` works long after the run.

What it is not: the runner (`throughput.py`) or the plots (`plots.py`).

Reference: vLLM `benchmarks/benchmark_serving.py` (`calculate_metrics`): TPOT is
(e2e - ttft) / (output tokens - 1), averaged over requests with more than one token.
"""

from __future__ import annotations

import numpy as np

from .engines import RunResult, label
from .roofline import Dims, ceiling_tokens_per_s, mean_decode_context, useful_flops

LEVEL0, HF, L3, L3_OFF, L4 = "level0_naive", "hf", "level3_prefix", "level3_prefix:nocache", "level4_speculative"


def _dist(xs: list[float]) -> dict:
    if not xs:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    a = np.asarray(xs)
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


def summarise(res: RunResult, dims: Dims, roof: dict) -> dict:
    """`roof`: `roofline.measure`'s dict plus `bandwidth` (KV read, bytes/s) and `bytes_per_token`."""
    recs, dur, peak_flops = res.records, max(res.duration, 1e-9), roof["peak_flops_per_s"]
    lengths = [(r["prompt_len"], r["output_len"]) for r in recs]
    out_tok, prompt_tok = sum(n for _, n in lengths), sum(p for p, _ in lengths)
    ttft = [r["ttft"] for r in recs]
    e2e = [r["e2e"] for r in recs]
    tpot = [(r["e2e"] - r["ttft"]) / (r["output_len"] - 1) for r in recs if r["output_len"] > 1]
    s = res.stats
    context = mean_decode_context(lengths)
    ceiling = ceiling_tokens_per_s(dims, roof["sweep"], max(float(s["mean_running"]), 1.0), context,
                                   roof["bytes_per_token"], roof["bandwidth"])  # fmt: skip
    fig = {
        "label": label(res.engine),
        "num_requests": len(recs),
        "prompt_tokens": prompt_tok,
        "output_tokens": out_tok,
        "duration_s": dur,
        "requests_per_s": len(recs) / dur,
        "output_tokens_per_s": out_tok / dur,
        "total_tokens_per_s": (out_tok + prompt_tok) / dur,
        "ttft_s": _dist(ttft),
        "tpot_s": _dist(tpot),
        "e2e_s": _dist(e2e),
        "kv_reserved_peak_bytes": int(s["kv_reserved_peak"]),
        "kv_used_peak_bytes": int(s["kv_used_peak"]),
        "kv_waste": float(s["kv_waste"]),
        "peak_running": int(s["peak_running"]),
        "mean_running": float(s["mean_running"]),
        "preemptions": int(s["preemptions"]),
        # Prompt positions the engine pushed through the model: more than prompt_tokens after
        # recompute (preemption) or padding (HF), fewer with prefix-cache hits (level 3).
        "prefill_tokens_computed": int(s["prompt_tokens"]),
        "steps": int(s["steps"]),
        "mfu": useful_flops(dims, lengths) / dur / peak_flops,
        # The floor at the mean batch this engine ran at (matmuls at that batch + its KV reads):
        # what "how far from the limit" means at the batch it had, not at the sweep's best batch.
        "ceiling_tokens_per_s": ceiling,
        "of_ceiling": out_tok / dur / ceiling,
        "forward_share": None if res.forward_seconds is None else res.forward_seconds / dur,
        "schedule_share": None if res.schedule_seconds is None else res.schedule_seconds / dur,
        "samples": {k: [round(x, 6) for x in v] for k, v in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e))},
    }
    for key in ("prefix", "spec"):
        if key in s:
            fig[key] = s[key]
    return fig


def add_ratios(results: dict[str, dict]) -> None:
    """Output tokens/s of each engine over level 0's and HF's, from the same process."""
    for fig in results.values():
        for key, base in (("vs_level0", LEVEL0), ("vs_hf", HF)):
            ref = results.get(base)
            fig[key] = fig["output_tokens_per_s"] / ref["output_tokens_per_s"] if ref else None
    if L3 in results and L3_OFF in results:
        off = results[L3_OFF]["ttft_s"]["mean"]
        results[L3]["ttft_cut_vs_cache_off"] = 1 - results[L3]["ttft_s"]["mean"] / off if off else None


def goals(workloads: dict) -> list[dict]:
    """The project's performance targets, each with what was measured (None: not run)."""
    out = []

    def goal(name: str, value, target: str, ok) -> None:
        out.append({"goal": name, "measured": value, "target": target, "met": None if value is None else bool(ok)})

    spread = workloads.get("spread", {}).get("results", {})
    levels = {k: v for k, v in spread.items() if k.startswith("level") and not k.endswith(":nocache")}
    tps = {k: v["output_tokens_per_s"] for k, v in spread.items()}
    if levels and HF in spread:
        best = max(levels, key=lambda k: tps[k])
        r = tps[best] / tps[HF]
        goal(f"spread: best level ({label(best)}) output tok/s vs HF", r, ">= 3x", r >= 3)
    if "level1_paged" in spread:
        w = spread["level1_paged"]["kv_waste"]
        goal("spread: L1 KV waste", w, "< 4 %", w < 0.04)
    if "level2_continuous" in spread:
        l2 = spread["level2_continuous"]
        if "level1_paged" in spread:
            r = tps["level2_continuous"] / tps["level1_paged"]
            goal("spread: L2 / L1 output tok/s", r, ">= 2x", r >= 2)
            a, b = l2["e2e_s"]["mean"], spread["level1_paged"]["e2e_s"]["mean"]
            goal("spread: L2 mean latency / L1 mean latency", a / b, "< 1", a < b)
        if LEVEL0 in spread:
            r = tps["level2_continuous"] / tps[LEVEL0]
            goal("spread: L2 / L0 output tok/s", r, ">= 3x", r >= 3)
    latency = workloads.get("latency", {}).get("results", {})
    if L4 in latency and L3 in latency:
        r = latency[L4]["output_tokens_per_s"] / latency[L3]["output_tokens_per_s"]
        goal("latency (batch 1): L4 / L3 output tok/s", r, ">= 1.5x", r >= 1.5)
    if L4 in spread and L3 in spread:
        r = spread[L4]["output_tokens_per_s"] / spread[L3]["output_tokens_per_s"]
        goal("spread (a large batch): L4 / L3 output tok/s", r, ">= 0.9x", r >= 0.9)
    shared = workloads.get("shared-prefix", {}).get("results", {})
    if L3 in shared and L3_OFF in shared:
        cut = shared[L3].get("ttft_cut_vs_cache_off")
        goal("shared-prefix: L3 mean TTFT cut by the prefix cache", cut, ">= 80 %", cut is not None and cut >= 0.8)
    uniform = workloads.get("uniform", {}).get("results", {})
    ulevels = {k: v["output_tokens_per_s"] for k, v in uniform.items() if k.startswith("level")}
    if ulevels and HF in uniform:
        best = max(ulevels, key=ulevels.get)
        r = ulevels[best] / uniform[HF]["output_tokens_per_s"]
        goal(f"uniform, same KV budget: best level ({label(best)}) / HF", r, ">= 1.5x", r >= 1.5)
        sweep = workloads["uniform"].get("hf_sweep")
        if sweep:
            b = max(sweep, key=lambda f: f["output_tokens_per_s"])
            r = ulevels[best] / b["output_tokens_per_s"]
            more = b["kv_reserved_peak_bytes"] / workloads["uniform"]["kv_cache_memory"]
            goal(f"uniform: best level / HF at its best batch ({b['batch_size']}, {more:.1f}x the memory)", r, ">= 1.3x",
                 r >= 1.3)  # fmt: skip
            same = workloads["uniform"].get("level_at_hf_best")
            if same:
                r = same["output_tokens_per_s"] / b["output_tokens_per_s"]
                goal(f"uniform: {label(same['engine'])} / HF at its best batch ({b['batch_size']}), same memory", r,
                     ">= 1.3x", r >= 1.3)  # fmt: skip
    arrivals = workloads.get("poisson")
    if arrivals and arrivals.get("sweep"):
        sw, ref = arrivals["sweep"], arrivals["reference_rate"]
        at = {k: next((f for f in v if f["request_rate"] == ref), None) for k, v in sw.items()}
        if at.get("level1_paged") and at.get("level2_continuous"):
            r = at["level2_continuous"]["e2e_s"]["p99"] / at["level1_paged"]["e2e_s"]["p99"]
            goal(f"poisson at {ref:.2f} req/s: L2 / L1 p99 end-to-end latency", r, "<= 0.5x", r <= 0.5)
            slo = arrivals["ttft_slo_s"]
            best = {k: max((f["request_rate"] for f in v if f["ttft_s"]["p99"] <= slo), default=0.0)
                    for k, v in sw.items()}  # fmt: skip
            if best["level1_paged"] > 0:
                r = best["level2_continuous"] / best["level1_paged"]
                goal(f"poisson: highest rate with p99 TTFT <= {slo:g} s, L2 / L1", r, ">= 1.5x", r >= 1.5)
            else:
                goal(f"poisson: highest rate with p99 TTFT <= {slo:g} s, L2 / L1 (L1 meets it at no rate tried)",
                     None, ">= 1.5x", None)  # fmt: skip
    # Only where no cache skips work (a prefix hit would count as free FLOPs).
    best = [(v["of_ceiling"], w, k) for w, wl in workloads.items() if w in ("uniform", "spread")
            for k, v in wl["results"].items() if k.startswith("level")]  # fmt: skip
    if best:
        f, w, k = max(best)
        goal(f"best level's tok/s / the ceiling at its mean batch ({label(k)}, {w})", f, ">= 60 %", f >= 0.6)
    return out


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"


COLUMNS = [
    ("engine", lambda f: f["label"]),
    ("req/s", lambda f: f"{f['requests_per_s']:.2f}"),
    ("out tok/s", lambda f: f"{f['output_tokens_per_s']:.0f}"),
    ("total tok/s", lambda f: f"{f['total_tokens_per_s']:.0f}"),
    ("x L0", lambda f: _x(f.get("vs_level0"))),
    ("x HF", lambda f: _x(f.get("vs_hf"))),
    ("TTFT mean/p50/p99 s", lambda f: "{mean:.2f} / {p50:.2f} / {p99:.2f}".format(**f["ttft_s"])),
    ("TPOT mean/p50/p99 ms", lambda f: " / ".join(f"{1e3 * f['tpot_s'][k]:.1f}" for k in ("mean", "p50", "p99"))),
    ("e2e mean s", lambda f: f"{f['e2e_s']['mean']:.2f}"),
    (
        "KV peak reserved / used",
        lambda f: f"{_fmt_bytes(f['kv_reserved_peak_bytes'])} / {_fmt_bytes(f['kv_used_peak_bytes'])}",
    ),
    ("KV waste", lambda f: f"{100 * f['kv_waste']:.1f} %"),
    ("batch mean/peak", lambda f: f"{f['mean_running']:.1f} / {f['peak_running']}"),
    ("preempt", lambda f: str(f["preemptions"])),
    ("prefill computed", lambda f: f"{f['prefill_tokens_computed'] / max(f['prompt_tokens'], 1):.2f}x"),
    ("of ceiling", lambda f: "-" if "of_ceiling" not in f else f"{100 * f['of_ceiling']:.0f} %"),  # older JSONs: -
]


def rows(wl: dict) -> list[list[str]]:
    return [[fn(f) for _, fn in COLUMNS] for f in wl["results"].values()]


THROUGHPUT_COLS = (
    "engine",
    "req/s",
    "out tok/s",
    "total tok/s",
    "x L0",
    "x HF",
    "batch mean/peak",
    "preempt",
    "prefill computed",
    "of ceiling",
)


def extra_rows(wl: dict) -> tuple[list[str], list[list[str]]] | None:
    """The sweep beside a workload's main table: HF's batch sizes (uniform), or the request rates (poisson)."""
    if "hf_sweep" in wl:
        same = wl.get("level_at_hf_best")  # the best level given the memory of HF's fastest batch

        def at_same_memory(f: dict) -> str:
            if not same or same["batch_size"] != f["batch_size"]:
                return "-"
            return f"{label(same['engine'])}: {same['output_tokens_per_s']:.0f} ({_x(same['output_tokens_per_s'] / f['output_tokens_per_s'])})"

        return (["HF batch size", "out tok/s", "best level / this", "best level at this memory", "batch mean",
                 "KV peak reserved"],
                [[str(f["batch_size"]), f"{f['output_tokens_per_s']:.0f}",
                  _x(max(v["output_tokens_per_s"] for k, v in wl["results"].items() if k.startswith("level"))
                     / f["output_tokens_per_s"]), at_same_memory(f),
                  f"{f['mean_running']:.1f}", _fmt_bytes(f["kv_reserved_peak_bytes"])] for f in wl["hf_sweep"]])  # fmt: skip
    if "sweep" in wl:
        names = list(wl["sweep"])
        head = ["req/s", *[f"{wl['sweep'][n][0]['label']} p99 TTFT / e2e s" for n in names]]
        body = [[f"{r:.2f}" + (" (tables)" if r == wl["reference_rate"] else ""),
                 *[f"{wl['sweep'][n][i]['ttft_s']['p99']:.2f} / {wl['sweep'][n][i]['e2e_s']['p99']:.2f}" for n in names]]
                for i, r in enumerate(wl["rates"])]  # fmt: skip
        return head, body
    return None


def rich_tables(name: str, wl: dict) -> list:
    """Two tables (throughput; latency and memory) so each fits a terminal."""
    from rich.table import Table

    title = (
        f"{name}: {wl['description']} ({wl['num_requests']} requests, KV budget {_fmt_bytes(wl['kv_cache_memory'])})"
    )
    tables = []
    for t_title, keep in (
        (title, lambda c: c in THROUGHPUT_COLS),
        (f"{name}: latency and KV memory", lambda c: c == "engine" or c not in THROUGHPUT_COLS),
    ):
        t = Table(title=t_title)
        idx = [i for i, (col, _) in enumerate(COLUMNS) if keep(col)]
        for i in idx:
            t.add_column(COLUMNS[i][0], justify="left" if i == 0 else "right")
        for r in rows(wl):
            t.add_row(*[r[i] for i in idx])
        tables.append(t)
    extra = extra_rows(wl)
    if extra:
        t = Table(
            title=f"{name}: "
            + ("HF generate at other batch sizes" if "hf_sweep" in wl else "p99 latency by request rate")
        )
        for i, col in enumerate(extra[0]):
            t.add_column(col, justify="left" if i == 0 else "right")
        for r in extra[1]:
            t.add_row(*r)
        tables.append(t)
    return tables


def markdown(data: dict) -> str:
    """The README's results tables, regenerated from a results JSON."""
    m, c = data["machine"], data["config"]
    lines = [f"Measured {m['date']} on {m['cpu']} ({m['cores']} cores, torch {m['torch']}, {m['device']}), "
             f"model `{c['model_name']}` ({data['roofline']['params'] / 1e6:.1f}M matmul params, {c['dtype']}); "
             f"matmul peak {data['roofline']['peak_flops_per_s'] / 1e9:.1f} GFLOP/s"
             + (f", memory read {data['roofline']['bandwidth'] / 1e9:.1f} GB/s" if "bandwidth" in data["roofline"] else "")
             + ". "
             f"`{c['command']}`", ""]  # fmt: skip
    for name, wl in data["workloads"].items():
        lines += [
            f"**{name}** — {wl['description']}, {wl['num_requests']} requests, KV budget {_fmt_bytes(wl['kv_cache_memory'])}",
            "",
        ]
        lines.append("| " + " | ".join(col for col, _ in COLUMNS) + " |")
        lines.append("|" + "|".join(["---"] + ["--:"] * (len(COLUMNS) - 1)) + "|")
        lines += ["| " + " | ".join(r) + " |" for r in rows(wl)]
        lines.append("")
        extra = extra_rows(wl)
        if extra:
            lines.append("| " + " | ".join(extra[0]) + " |")
            lines.append("|" + "|".join(["---"] + ["--:"] * (len(extra[0]) - 1)) + "|")
            lines += ["| " + " | ".join(r) + " |" for r in extra[1]]
            lines.append("")
    if data.get("goals"):
        lines += ["| goal | measured | target | met |", "|---|--:|---|---|"]
        for g in data["goals"]:
            v = g["measured"]
            shown = "-" if v is None else (f"{100 * v:.1f} %" if "%" in g["target"] else f"{v:.2f}")
            lines.append(
                f"| {g['goal']} | {shown} | {g['target']} | {'-' if g['met'] is None else ('yes' if g['met'] else 'no')} |"
            )
    return "\n".join(lines)


README_COLS = (
    "engine",
    "out tok/s",
    "x L0",
    "x HF",
    "TTFT mean/p50/p99 s",
    "KV waste",
    "batch mean/peak",
    "preempt",
    "prefill computed",
)


def readme_summary(data: dict) -> str:
    """The compact results tables the README shows (the full ones: `markdown`)."""
    m, c = data["machine"], data["config"]
    idx = [i for i, (col, _) in enumerate(COLUMNS) if col in README_COLS]
    lines = [f"Measured {m['date'][:10]} on {m['cpu']} ({m['cores']} cores, torch {m['torch']}, {m['device']}, "
             f"{m.get('torch_threads', '?')} torch thread), model `{c['model_name']}`, by `{c['command']}`. "
             "All engines in one process on the same seeded workload and the same KV budget; "
             "every figure and the full tables are in [docs/benchmarks.md](docs/benchmarks.md).", ""]  # fmt: skip
    for name, wl in data["workloads"].items():
        lines += [f"**{name}**: {wl['description']}, {wl['num_requests']} requests", ""]
        lines.append("| " + " | ".join(COLUMNS[i][0] for i in idx) + " |")
        lines.append("|" + "|".join(["---"] + ["--:"] * (len(idx) - 1)) + "|")
        lines += ["| " + " | ".join(r[i] for i in idx) + " |" for r in rows(wl)]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_readme(data: dict, readme) -> None:
    """Replace what lies between the README's results markers with `readme_summary`."""
    text = readme.read_text()
    start, end = "<!-- results:start -->\n", "<!-- results:end -->"
    a, b = text.index(start) + len(start), text.index(end)
    readme.write_text(text[:a] + readme_summary(data) + text[b:])
