"""The demos run, and the docs' code blocks run (DESIGN: "Docs are executable").

What it is: each level's `demo.main([...])` on a tiny random checkpoint with a small
workload, writing its PNG to a temporary directory (and, where a picture or a table was
hard to read, that it now reads: an axis from 0, a legend, labels that do not overprint,
headers whole at 80 columns, a legend line for every column, the noise named; and where a demo
measured unfairly or held every engine it built, that it no longer does); and every ```python block of the
level docs, run in order in one namespace per document, with `default_model()` pointed
at the tiny checkpoint (the docs call `default_model()`, which is the built-in model when
a reader runs them). Blocks marked ```text are pictures or output, and are not run.

What it is not: a check of the demos' numbers on the real model (those are measured and
written down in the docs with the command that gave them), or of speed.
"""

from __future__ import annotations

import re
import time
import weakref

import pytest

from ladder.models import REPO

pytestmark = pytest.mark.docs

DOCS = ["docs/level0_naive.md", "docs/level1_paged.md", "docs/level2_continuous.md", "docs/level1_kernel.md", "docs/engine_core.md", "docs/level3_prefix.md",
        "docs/level4_speculative.md", "docs/level5_multigpu.md", "docs/level6_serving.md", "docs/benchmarks.md",
        "docs/batch_invariance.md", "docs/structured_outputs.md", "docs/beam_search.md", "docs/what_if.md",
        "docs/compiled_step.md", "docs/kv_connectors.md"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(checkpoint_factory):
    return checkpoint_factory("llama", tokenizer=True)


def test_level0_demo(tiny, capsys):
    from level0_naive import demo

    stats = demo.main(["--model", str(tiny), "--requests", "5", "--max-tokens", "12", "--no-progress"])
    out = capsys.readouterr().out
    assert "request 0" in out and "KV waste" in out  # completions, then the waste table
    assert stats.generated_tokens > 0 and 0 < stats.kv_waste < 1


def test_level1_demo(tiny, tmp_path, capsys):
    from level1_paged import demo

    plot = tmp_path / "level1_memory.png"
    res = demo.main(["--model", str(tiny), "--requests", "8", "--max-tokens", "40", "--budget-requests", "2",
                     "--block-size", "4", "--snapshot-step", "8", "--plot", str(plot), "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    assert plot.stat().st_size > 10_000
    assert "block tables" in out
    s0, s1 = res["level0"], res["level1"]
    assert s0.generated_tokens == s1.generated_tokens  # same workload, exact lengths
    assert s1.kv_waste < s0.kv_waste
    assert s1.peak_running > s0.peak_running


def test_level2_demo(tiny, tmp_path):
    from level2_continuous import demo

    plot = tmp_path / "level2_timeline.png"
    res = demo.main(["--model", str(tiny), "--requests", "8", "--batch-size", "3", "--max-tokens", "64",
                     "--long-fraction", "0.3", "--plot", str(plot), "--no-progress"])  # fmt: skip
    assert plot.stat().st_size > 10_000
    assert 0 < res["scheduler_share"] < 1
    assert res["level2"]["steps"] < res["level1"]["steps"]  # seats are refilled, so fewer steps


def test_level3_demo(checkpoint_factory, tmp_path, capsys):
    from level3_prefix import demo

    model = checkpoint_factory(
        "llama", tokenizer=True, max_position_embeddings=1024
    )  # the system prompt is ~650 tokens
    plot = tmp_path / "level3_ttft.png"
    res = demo.main(
        ["--model", str(model), "--max-tokens", "4", "--block-size", "8", "--plot", str(plot), "--no-progress"]
    )
    out = capsys.readouterr().out
    assert (
        plot.stat().st_size > 10_000
        and "blocks shared between 5 running requests" in out
        and "all 5 are running" in out
    )
    assert res["identical"]  # caching changes the time, never the tokens
    assert res["hit_rate"] > 0.85  # the system prompt came from the cache (the TTFT cut is measured, not asserted)


def test_beam_demo(tiny, capsys):
    """The beams best first, the block tables with shared blocks, and the samples' fork."""
    from level3_prefix import beam_demo

    res = beam_demo.main(["--model", str(tiny), "--max-tokens", "12", "--beam-width", "3", "--block-size", "4"])
    out = capsys.readouterr().out
    assert "beam 2  score" in out and "without sharing" in out and "sample 0 prefills the prompt" in out
    scores = [s.score for s in res["sequences"]]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    assert 0 < res["beam_saved"] < 1 and res["copied"] > 0 and res["forked_tokens"] > 0


def test_batch_invariance_demo(tiny, tmp_path):
    """Copies of one prompt in different batches: one logprob sequence with the mode; one decode step
    alone and among 15 others parts at a matmul in the default mode and nowhere with the mode."""
    from features.batch_invariance import demo as invariance

    plot = tmp_path / "layers.png"
    res = invariance.main(["--model", str(tiny), "--copies", "4", "--max-tokens", "6", "--plot", str(plot)])
    assert res["results"]["batch_invariant"]["logprob_sequences"] == 1
    assert all(d == 0 for _, d in res["layers"]["batch_invariant"])
    assert dict(res["layers"]["default"])["embedding"] == 0  # a gather is exact (where PyTorch's matmuls part
    # depends on its BLAS: the committed picture shows where they do on the machine that drew it)
    assert plot.stat().st_size > 10_000


def test_batch_invariance_demo_times_both_modes_after_a_shared_warm_up(tiny, tmp_path, monkeypatch):
    """An engine's first batch pays a start-up cost (here a second, made up); neither mode's time may hold it
    (the default mode once did alone, and the mode's cost read 0.40x)."""
    from features.batch_invariance import demo as invariance

    START_UP = 1.0

    class SlowFirstBatch(invariance.LLM):
        def generate(self, *a, **k):
            if not getattr(self, "warm", False):
                self.warm = True
                time.sleep(START_UP)
            return super().generate(*a, **k)

    monkeypatch.setattr(invariance, "LLM", SlowFirstBatch)
    plot = tmp_path / "layers.png"
    res = invariance.main(["--model", str(tiny), "--copies", "2", "--max-tokens", "3", "--plot", str(plot)])
    assert all(r["seconds"] < START_UP for r in res["results"].values()), res["results"]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


@pytest.mark.parametrize("doc", DOCS)
def test_doc_code_blocks_run(doc, tiny, monkeypatch, collect_before_each_engine):
    import ladder.models

    monkeypatch.setattr(ladder.models, "default_model", lambda: tiny)
    blocks = python_blocks((REPO / doc).read_text())
    assert blocks, f"{doc} has no ```python block"
    namespace: dict = {"__name__": "__doc__"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{doc} python block {i + 1}", "exec"), namespace)


def saved_figures(monkeypatch, module) -> list:
    """Every figure `module` hands to `save_figure`, still saved as before (then closed: readable)."""
    figs, save = [], module.save_figure
    monkeypatch.setattr(module, "save_figure", lambda fig, *a, **k: (figs.append(fig), save(fig, *a, **k)))
    return figs


def overlaps(fig, artists) -> list:
    """Pairs of artists whose drawn boxes come within 4 pixels: labels that read as one (`1.1x1.1x`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # a closed figure has lost its canvas: draw it on a new one
    canvas.draw()
    boxes = [a.get_window_extent(canvas.get_renderer()).padded(2) for a in artists]
    return [(i, j) for i, a in enumerate(boxes) for j, b in enumerate(boxes) if i < j and a.overlaps(b)]


def test_level4_demo(tiny, tmp_path, capsys, monkeypatch):
    from level4_speculative import demo

    monkeypatch.setenv("COLUMNS", "80")  # a terminal (or pipe) of 80 columns
    monkeypatch.delenv("FORCE_COLOR", raising=False)  # captured output has no colours, as a pipe has none
    figs = saved_figures(monkeypatch, demo)
    alive = []  # the most engines alive at once: each holds a KV pool of 1 GiB
    engines = []
    for name in ("LLM", "PrefixLLM"):
        cls = getattr(demo, name)

        def counted(*a, _cls=cls, **k):
            engines.append(weakref.ref(llm := _cls(*a, **k)))
            alive.append(sum(r() is not None for r in engines))
            return llm

        monkeypatch.setattr(demo, name, counted)
    plot = tmp_path / "level4_speedup.png"
    res = demo.main(["--model", str(tiny), "--max-tokens", "16", "--max-k", "3", "-k", "2", "--batch-size", "3",
                     "--temperature", "0", "--dtype", "float64", "--plot", str(plot), "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    assert max(alive) <= 3, alive  # the sweep drops each engine it measured (it held them all: 6 GiB)
    assert "noise: the level-3 run took" in out
    assert "within noise: the change from k =" in out or "larger than the noise" in out
    assert res["noise"] >= 0 and all(k in res["sweep"] for k in res["within_noise"])
    assert figs[0].axes[0].containers, "the measured speedups have error bars: the noise"
    assert plot.stat().st_size > 10_000 and "alpha**i" in out and "predicted" in out
    assert "c_verify" in out and "\u2026" not in out  # whole headers: rich cuts a squeezed one to "c_verif…"
    assert "c_draft:" in out and "c_verify:" in out  # and the cost columns are explained
    assert "[recovered]" in out and "{bonus}" in out  # captured means no colours: the legend is in the marks
    assert figs[0].axes[0].get_ylim()[0] == 0  # a speed-up axis starts at 0
    assert res["identical"]  # float64: speculation never changes a greedy token
    assert set(res["sweep"]) == {1, 2, 3} and all(r["c_draft"] > 0 and r["c_verify"] > 0 for r in res["sweep"].values())
    assert len(res["per_position"]) == 2 and 0 <= res["alpha"] <= 1


def test_level4_demo_with_the_eagle_head(tmp_path, capsys, monkeypatch):
    """`--method eagle`: the built-in target (the head is trained over it) with its head: the same text as level 3,
    and the head's drafts accepted far more often than chance (its card: 0.83 at the first position)."""
    from level4_speculative import demo

    saved_figures(monkeypatch, demo)
    res = demo.main(["--method", "eagle", "--max-tokens", "24", "--max-k", "2", "-k", "2", "--batch-size", "2",
                     "--dtype", "float64", "--plot", str(tmp_path / "eagle.png"), "--no-progress"])  # fmt: skip
    out = capsys.readouterr().out
    assert "EAGLE head" in out and res["identical"]
    assert res["per_position"][0] > 0.6, res["per_position"]


def test_level5_pipeline_picture_has_a_legend_and_no_label_over_another(tmp_path, monkeypatch):
    """Forwards of every width, some far narrower than their number: those go unnumbered."""
    from level5_multigpu import demo

    figs = saved_figures(monkeypatch, demo)
    timeline = {}
    for rank in (0, 1):
        t, events = 0.004 * rank, []
        for mb in range(100, 124):
            width = (0.0005, 0.002, 0.008)[mb % 3]
            events.append((mb, t, t + width))
            t += width + 0.001 * (mb % 2)
        timeline[rank] = events
    demo.plot(tmp_path / "pipeline.png", timeline)
    ax = figs[0].axes[0]
    assert ax.get_legend() is not None and ax.texts and not overlaps(figs[0], ax.texts)


def test_level6_clients_table_says_how_many_it_shows():
    from level6_serving.demo import client_table

    results, arrivals = [(3, "abc")] * 20, [[0.01, 0.02]] * 20
    few, many = client_table(results[:3], arrivals), client_table(results, arrivals, limit=16)
    assert few.row_count == 3 and "all 3 clients" in few.title
    assert many.row_count == 16 and "16 of 20 clients" in many.title


def test_level5_table_legend_names_every_column(monkeypatch):
    """Each column of level 5's cost table is explained under it, by its header (`alpha-beta` and `alpha` were not)."""
    from rich.console import Console

    from level5_multigpu import demo

    row = dict(tps=100.0, calls=2.0, bytes=4096.0, all_reduce_s=0.5, predicted_s=0.4, alpha_us=900.0)
    console = Console(record=True, width=120)
    demo.show_table(console, {"TP=2 PP=1": row})
    text = console.export_text()
    headers = re.search(r"\n(.*layout.*)\n", text).group(1)
    legend = text.split(headers, 1)[1]
    for col in ("layout", "tok/s", "msgs/tok", "bytes/tok", "rank 0 all-reduce", "alpha-beta", "alpha"):
        assert col in headers and re.search(rf"^\s+{re.escape(col)}:", legend, re.M), f"no legend line for {col!r}"


def test_lora_demo_writes_one_prompt_four_ways_in_one_batch(capsys):
    """The built-in model and its three committed adapters (models/tiny-shakespeare-loras/): four different
    continuations, every adapter in a slot, the last step's rows on slots -1 (the base model), 0, 1, 2, and
    the same text one at a time, on every path and over 2 tensor-parallel ranks (the demo's float64)."""
    from features.lora import demo

    res = demo.main(["--quick", "--tp", "2"])
    out = capsys.readouterr().out
    assert len(set(res["texts"].values())) == 4, res["texts"]  # each adapter changes the greedy text
    assert sorted(res["mapping"]) == [-1, 0, 1, 2] and res["same"], res
    assert {"loop", "gathered", "stacked"} <= set(res["seconds"]) and "adapter capitals" in out
    assert "over 2 tensor-parallel ranks (level 5): the same text: True" in out


def test_quant_demo_fits_4x_the_blocks_and_more_requests_in_8_bits(tmp_path, monkeypatch, capsys):
    """The 8-bit KV cache's demo on the built-in model: one budget holds exactly 4x float32's blocks in fp8 and
    3.75x in int8, so more requests run at once (and none is preempted); a text that differs from float32's
    is said to differ. The scheduling depends only on token counts (ignore_eos), so these numbers are exact;
    which texts match is not asserted (a near tie decides it: the demo prints how near)."""
    from features.quantization import demo as quant_demo

    monkeypatch.setenv("INFERENCE_LADDER_OUT", str(tmp_path))
    res = quant_demo.main(["--quick"])
    out = capsys.readouterr().out
    blocks, peak, pre = res["blocks"], res["peak_running"], res["preemptions"]
    assert blocks["fp8"] == 4 * blocks["float32"] and blocks["int8"] > 3 * blocks["float32"], blocks
    assert peak["fp8"] > peak["float32"] and peak["int8"] > peak["float32"], peak
    assert res["mean_running"]["int8"] > res["mean_running"]["float32"], res["mean_running"]
    assert pre["float32"] > 0 == pre["fp8"] == pre["int8"], pre
    for name in ("fp8", "int8"):
        assert res["same_text"][name] == (res["texts"][name] == res["texts"]["float32"])
    assert ("not float32's text" in out) == (not all(res["same_text"].values()))
    assert res["picture"] == tmp_path / "quant_demo.png" and res["picture"].stat().st_size > 10_000
    assert f"picture: {res['picture']}" in out.replace("\n", "")
    small = quant_demo.main(["--quick", "--no-plot", "--requests", "2", "--max-tokens", "4"])
    assert small["picture"] is None and "picture:" not in capsys.readouterr().out
