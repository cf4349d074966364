"""The benchmark's pictures, drawn from a results JSON (never from live objects).

What it is: `make_all(data, img_dir)` writes

  bench_throughput.png   output tokens/s per engine, per workload; labels (upright, so
                         neighbours never overlap): x HF
  bench_latency_cdf.png  CDFs of TTFT and end-to-end latency per engine (what fraction of
                         requests finished within t seconds: further left is better)
  bench_kv_waste.png     time-averaged KV waste per engine, and peak KV reserved vs used
  bench_roofline.png     the matmul roofline over batch size, and where each engine sits
                         (achieved model FLOP/s at its mean batch)
  bench_prefix_ttft.png  level 3's TTFT with the prefix cache on and off (when level 3 ran)
  bench_poisson.png      p99 TTFT and p99 end-to-end latency against the request rate, per
                         engine (when `poisson` ran): static batching's head-of-line
                         blocking against continuous batching's next-step join

Because the plots read only the JSON, `--plots-from results.json` redraws them anywhere.
A `--quick` run's plots say in their titles that they are a smoke run.

What it is not: interactive, or styled beyond what makes them readable.

Reference: the PagedAttention paper's figures 2 (KV waste) and 12 (throughput).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _engines(data: dict) -> list[str]:
    seen: dict[str, None] = {}
    for wl in data["workloads"].values():
        seen.update(dict.fromkeys(wl["results"]))
    return list(seen)


def _colors(names: list[str]) -> dict[str, str]:
    cmap = plt.get_cmap("tab10")
    return {n: cmap(i % 10) for i, n in enumerate(names)}


def _once(seen: set[str], name: str) -> str | None:
    """A legend label the first time a name is drawn, then None (one legend entry each)."""
    if name in seen:
        return None
    seen.add(name)
    return name


SMOKE = "smoke run (--quick): tiny workloads, not the committed results"


def _subtitle(data: dict) -> str:
    """The run's model, dtype, machine and date, and, for a --quick run, that it says nothing."""
    m, c = data["machine"], data["config"]
    line = f"{c['model_name']}, {c['dtype']}, {m['cpu'][:40]} x{m['torch_threads']} threads, {m['date'][:10]}"
    return f"{line}\n{SMOKE}" if c.get("quick") else line


def _offline(data: dict) -> list[str]:
    """The workloads whose requests all arrive at once (tokens/s at a fixed request rate say nothing)."""
    return [w for w, wl in data["workloads"].items() if "sweep" not in wl]


def throughput(data: dict, path: Path) -> None:
    names, wls = _engines(data), _offline(data)
    col, width = _colors(names), 0.8 / max(len(names), 1)
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(wls)) + 1.5, 4))
    seen: set[str] = set()
    for i, n in enumerate(names):
        for j, w in enumerate(wls):
            f = data["workloads"][w]["results"].get(n)
            if f is None:
                continue
            x = j + (i - (len(names) - 1) / 2) * width
            ax.bar(x, f["output_tokens_per_s"], width, color=col[n], label=_once(seen, f["label"]))
            if f.get("vs_hf") and n != "hf":  # upright, a label is wider than its bar and runs into the next
                ax.annotate(f"{f['vs_hf']:.1f}x", (x, f["output_tokens_per_s"]), xytext=(0, 2), textcoords="offset points",
                            rotation=90, ha="center", va="bottom", fontsize=7)  # fmt: skip
    ax.margins(y=0.12)  # room above the tallest bar for its label
    ax.set_xticks(range(len(wls)), wls)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Throughput by level (labels: x HF generate)\n{_subtitle(data)}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # outside: never over a bar or its label
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def latency_cdf(data: dict, path: Path) -> None:
    wls, col = list(data["workloads"]), _colors(_engines(data))
    fig, axes = plt.subplots(2, len(wls), figsize=(3.6 * len(wls), 6), squeeze=False)
    for j, w in enumerate(wls):
        for n, f in data["workloads"][w]["results"].items():
            for row, key in enumerate(("ttft", "e2e")):
                xs = np.sort(f["samples"][key])
                axes[row][j].plot(xs, np.arange(1, len(xs) + 1) / len(xs), color=col[n], label=f["label"])
        axes[0][j].set_title(w, fontsize=9)
        axes[1][j].set_xlabel("seconds since the batch was submitted")
    axes[0][0].set_ylabel("fraction of requests\nwith first token by t")
    axes[1][0].set_ylabel("fraction of requests\nfinished by t")
    handles = {}
    for ax in axes.flat:  # one legend entry per engine, whichever workloads it ran
        handles.update({lab: h for h, lab in zip(*ax.get_legend_handles_labels())})
    axes[0][0].legend(handles.values(), handles.keys(), fontsize=7)
    fig.suptitle(f"Latency CDFs (TTFT top, end-to-end bottom; left is better)\n{_subtitle(data)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def kv_waste(data: dict, path: Path) -> None:
    names, wls = _engines(data), _offline(data)
    col, width = _colors(names), 0.8 / max(len(names), 1)
    focus = "spread" if "spread" in data["workloads"] else wls[0]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    seen: set[str] = set()
    for i, n in enumerate(names):
        for j, w in enumerate(wls):
            f = data["workloads"][w]["results"].get(n)
            if f is not None:
                a.bar(
                    j + (i - (len(names) - 1) / 2) * width,
                    100 * f["kv_waste"],
                    width,
                    color=col[n],
                    label=_once(seen, f["label"]),
                )
    a.set_xticks(range(len(wls)), wls)
    a.set_ylabel("KV waste, % of reserved (time-averaged)")
    a.legend(fontsize=7)
    res = data["workloads"][focus]["results"]
    xs = np.arange(len(res))
    b.bar(
        xs, [f["kv_reserved_peak_bytes"] / 2**20 for f in res.values()], 0.6, color="lightgray", label="peak reserved"
    )
    b.bar(
        xs,
        [f["kv_used_peak_bytes"] / 2**20 for f in res.values()],
        0.35,
        color=[col[n] for n in res],
        label="peak holding tokens",
    )
    b.axhline(data["workloads"][focus]["kv_cache_memory"] / 2**20, color="k", ls="--", lw=1, label="budget (levels)")
    b.set_xticks(xs, [f["label"] for f in res.values()], rotation=20, fontsize=7)
    b.set_ylabel("MiB")
    b.set_title(f"{focus}: peak KV memory", fontsize=9)
    b.set_ylim(top=1.3 * b.get_ylim()[1])  # room for the legend above the bars
    b.legend(fontsize=7, loc="upper center", ncols=3)
    fig.suptitle(f"KV memory waste by level\n{_subtitle(data)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def roofline(data: dict, path: Path) -> None:
    roof, col = data["roofline"], _colors(_engines(data))
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    bs = [s["batch"] for s in roof["sweep"]]
    ax.plot(bs, [s["flops_per_s"] / 1e9 for s in roof["sweep"]], "k-o", label="matmul chain (model shapes)")
    ax.axhline(roof["peak_flops_per_s"] / 1e9, color="k", ls=":", lw=1)
    focus = "spread" if "spread" in data["workloads"] else next(iter(data["workloads"]))
    for n, f in data["workloads"][focus]["results"].items():
        ax.scatter(
            max(f["mean_running"], 1),
            f["mfu"] * roof["peak_flops_per_s"] / 1e9,
            color=col[n],
            s=50,
            zorder=3,
            label=f"{f['label']} ({100 * f['mfu']:.0f} %)",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (engines: mean running requests)")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"{focus}: useful model FLOP/s vs the machine's matmul limit\n{_subtitle(data)}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def prefix_ttft(data: dict, path: Path) -> bool:
    pairs = [
        (w, wl["results"])
        for w, wl in data["workloads"].items()
        if "level3_prefix" in wl["results"] and "level3_prefix:nocache" in wl["results"]
    ]
    if not pairs:
        return False
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.5 * len(pairs), 3.8), squeeze=False)
    for ax, (w, res) in zip(axes[0], pairs):
        stats = ("mean", "p50", "p99")
        xs = np.arange(len(stats))
        for k, (n, name) in enumerate((("level3_prefix:nocache", "cache off"), ("level3_prefix", "cache on"))):
            ax.bar(
                xs + (k - 0.5) * 0.38,
                [res[n]["ttft_s"][s] for s in stats],
                0.38,
                label=name,
                color="tab:gray" if k == 0 else "tab:green",
            )
        cut = res["level3_prefix"].get("ttft_cut_vs_cache_off")
        ax.set_title(f"{w}: mean TTFT cut {100 * cut:.0f} %" if cut is not None else w, fontsize=9)
        ax.set_xticks(xs, stats)
        ax.set_ylabel("TTFT, seconds")
        ax.legend(fontsize=7)
    fig.suptitle(f"Level 3: time to first token with and without the prefix cache\n{_subtitle(data)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def poisson(data: dict, path: Path) -> bool:
    wl = data["workloads"].get("poisson")
    if not wl or "sweep" not in wl:
        return False
    col = _colors(_engines(data))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in (
        (axes[0], "ttft_s", "p99 time to first token"),
        (axes[1], "e2e_s", "p99 end-to-end latency"),
    ):
        for n, runs in wl["sweep"].items():
            ax.plot([f["request_rate"] for f in runs], [f[key]["p99"] for f in runs], "-o", color=col[n],
                    label=runs[0]["label"])  # fmt: skip
        ax.axvline(wl["reference_rate"], color="0.6", ls=":", lw=1)
        ax.set_xlabel(f"request rate, req/s ({wl['capacity_rps']:.2f}: level 1's capacity)")
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=9)
    axes[0].axhline(wl["ttft_slo_s"], color="k", ls="--", lw=1, label=f"SLO {wl['ttft_slo_s']:g} s")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Poisson arrivals: latency against load (dotted: the tables' rate)\n{_subtitle(data)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def make_all(data: dict, img_dir: Path, prefix: str = "bench_") -> list[Path]:
    img_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, draw in (
        ("throughput", throughput),
        ("latency_cdf", latency_cdf),
        ("kv_waste", kv_waste),
        ("roofline", roofline),
        ("prefix_ttft", prefix_ttft),
        ("poisson", poisson),
    ):
        path = img_dir / f"{prefix}{name}.png"
        if draw(data, path) is not False:
            written.append(path)
    return written
