"""The benchmark harness runs and its JSON is well formed. Never its speed.

The harness runs in `--quick` mode on a tiny random checkpoint, in this process, over
two workloads (spread: one round; chat: several rounds on one LLM), with every level
that imports plus Hugging Face. Checked: the keys, the types, positive numbers, one
entry per selected engine, exact output-token counts, plots and the markdown table; and
that the plots go outside the repository unless `--img-dir` says otherwise, say when they
are a smoke run, and print no label over another.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import plots, report, roofline, throughput
from benchmarks.engines import available_levels
from benchmarks.workloads import NAMES, make_workload
from ladder.cli import output_dir
from ladder.models import REPO, train_tiny_module

pytestmark = pytest.mark.bench


def test_workloads_are_seeded_and_shaped():
    for name in NAMES:
        a, b = make_workload(name, 16, 259, seed=3), make_workload(name, 16, 259, seed=3)
        assert [r.prompt for r in a.first] == [r.prompt for r in b.first] and a.rounds() == b.rounds()
        assert all(0 <= t < 259 for r in a.first for t in r.prompt)
    spread = make_workload("spread", 128, 259)
    assert all(8 <= r.max_tokens <= 512 for r in spread.first) and spread.num_requests == 128
    shared = make_workload("shared-prefix", 32, 259)
    head = shared.first[0].prompt[:384]
    assert all(r.prompt[:384] == head and 384 / len(r.prompt) >= 0.9 for r in shared.first)
    chat = make_workload("chat", 32, 259)
    rounds = chat.rounds()
    assert len(rounds) == 4 and chat.num_requests == 32
    for prev, cur in zip(rounds, rounds[1:]):  # each turn's prompt holds the whole previous exchange
        assert all(p2 > p1 + n1 for (p1, n1), (p2, _) in zip(prev, cur))


def test_poisson_and_natural_text_workloads(checkpoint_factory):
    from transformers import AutoTokenizer

    from benchmarks.workloads import TEXTS

    poisson = make_workload("poisson", 128, 259)
    times = poisson.arrivals
    assert len(times) == poisson.num_requests == 64 and times[0] == 0 and all(b > a for a, b in zip(times, times[1:]))
    assert 0.7 < times[-1] / (len(times) - 1) < 1.3  # a mean gap of about 1 s: rate 1 request/s before scaling
    assert make_workload("spread", 16, 259).arrivals is None  # everything else arrives at once
    tok = AutoTokenizer.from_pretrained(checkpoint_factory("llama", tokenizer=True))
    lines = [line for line in TEXTS.read_text().splitlines() if line.strip()]
    latency = make_workload("latency", 128, 259, encode=tok.encode)
    assert latency.natural_text and [r.prompt for r in latency.first] == [tok.encode(line) for line in lines]
    assert not make_workload("latency", 128, 259).natural_text  # no tokenizer: random ids, as before


def test_the_ceiling_interpolates_the_measured_sweep():
    dims = roofline.Dims(hidden=64, layers=2, q_width=64, kv_width=32, ffn=128, vocab=100)
    sweep = [{"batch": 1, "flops_per_s": 1e9}, {"batch": 4, "flops_per_s": 3e9}, {"batch": 16, "flops_per_s": 5e9}]
    assert roofline.rate_at(sweep, 4) == 3e9 and roofline.rate_at(sweep, 2) == 2e9  # halfway in log2
    assert roofline.rate_at(sweep, 0.5) == 1e9 and roofline.rate_at(sweep, 64) == 5e9  # flat outside the sweep
    per_token = dims.body_flops + dims.lm_head_flops
    got = roofline.ceiling_tokens_per_s(dims, sweep, 4, context=100, bytes_per_token=8, bandwidth=1e9)
    assert got == pytest.approx(4 / (4 * per_token / 3e9 + 4 * 100 * 8 / 1e9))
    longer = roofline.ceiling_tokens_per_s(dims, sweep, 4, context=1000, bytes_per_token=8, bandwidth=1e9)
    assert longer < got  # more KV to read, a lower ceiling


@pytest.mark.parametrize("engine", ["hf", "level1_paged", "level2_continuous"])
def test_arrivals_are_waited_for_and_latency_counts_from_them(checkpoint_factory, engine):
    """Static batching (HF, level 1) and continuous batching (level 2) on a Poisson workload: every
    request is answered with its exact length, and none starts before it arrived (TTFT > 0)."""
    from benchmarks.engines import make_engine

    model = str(checkpoint_factory("llama", tokenizer=True))
    wl = make_workload("poisson", 6, 259, quick=True)
    eng = make_engine(engine, model, dtype="float32", device="cpu", kv_cache_memory=2**22, max_num_seqs=8,
                      hf_batch_size=4, seed=0, progress=False)  # fmt: skip
    res = eng.run(wl, rate=40.0)  # 6 requests within about 0.15 s
    assert sorted((r["prompt_len"], r["output_len"]) for r in res.records) == sorted(wl.rounds()[0])
    assert all(0 < r["ttft"] <= r["e2e"] for r in res.records)
    assert res.duration >= wl.arrivals[-1] / 40.0  # it waited for the last arrival


def test_flops_match_the_training_script(checkpoint_factory):
    from transformers import AutoConfig

    path = checkpoint_factory("llama", tokenizer=True)
    dims = roofline.Dims.from_checkpoint(str(path))
    ref = train_tiny_module().matmul_flops_per_token(AutoConfig.from_pretrained(path), 100)
    assert dims.flops_per_token(100) == ref["total"]
    # One request, prompt 3, output 2: fed tokens at positions 0, 1, 2, 3; two lm_head rows.
    assert roofline.useful_flops(dims, [(3, 2)]) == 4 * dims.body_flops + 2 * dims.lm_head_flops + dims.attention_flops(
        1 + 2 + 3 + 4
    )


def test_quick_run_writes_well_formed_json(checkpoint_factory, tmp_path, capsys, monkeypatch):
    model = checkpoint_factory("llama", tokenizer=True)
    out, img = tmp_path / "quick.json", tmp_path / "img"
    sizes, measure = [], roofline.weight_bandwidth  # what the weights' read rate is measured at, and where
    monkeypatch.setattr(roofline, "weight_bandwidth",
                        lambda nbytes, device: sizes.append((nbytes, device.type)) or measure(nbytes, device))  # fmt: skip
    kv_devices, kv_measure = [], roofline.kv_read_bandwidth  # and the KV's
    monkeypatch.setattr(roofline, "kv_read_bandwidth",
                        lambda device: kv_devices.append(device.type) or kv_measure(device=device))  # fmt: skip
    threads = torch.get_num_threads()
    try:
        throughput.main(["--quick", "--model", str(model), "--workload", "spread", "--workload", "chat", "--num-requests", "6",
                         "--no-progress", "--threads", "1", "--out", str(out), "--plots", "--img-dir", str(img)])  # fmt: skip
    finally:
        torch.set_num_threads(threads)  # --threads is process-wide; leave the session as it was
    data = json.loads(out.read_text())

    assert {"schema", "machine", "config", "roofline", "workloads", "goals"} <= data.keys()
    m = data["machine"]
    assert isinstance(m["cpu"], str) and m["cores"] >= 1 and m["torch"] == torch.__version__ and m["date"][:2] == "20"
    assert data["roofline"]["peak_flops_per_s"] > 0 and all(s["flops_per_s"] > 0 for s in data["roofline"]["sweep"])
    itemsize = torch.empty(0, dtype=getattr(torch, data["roofline"]["dtype"])).element_size()
    device = torch.device(data["config"]["device"]).type
    assert sizes == [(roofline.Dims.from_checkpoint(str(model)).params * itemsize, device)]  # the weights' size, the run's device
    assert kv_devices == [device]
    assert data["roofline"]["weight_bandwidth"] > 0
    assert data["config"]["quick"] is True

    levels = available_levels()
    assert {"level0_naive", "level1_paged", "level2_continuous"} <= set(levels)
    assert list(data["workloads"]) == ["spread", "chat"]
    for name, wl in data["workloads"].items():
        expected = ["hf", *levels] + (["level3_prefix:nocache"] if name == "chat" and "level3_prefix" in levels else [])
        assert list(wl["results"]) == expected
        want = make_workload(name, 6, 259, quick=True)
        assert wl["num_requests"] == want.num_requests and wl["kv_cache_memory"] > 0
        for engine, f in wl["results"].items():
            assert f["num_requests"] == want.num_requests, engine
            assert f["output_tokens"] == sum(n for rnd in want.rounds() for _, n in rnd), engine  # exact lengths
            for key in (
                "duration_s",
                "requests_per_s",
                "output_tokens_per_s",
                "total_tokens_per_s",
                "mfu",
                "ceiling_tokens_per_s",
                "of_ceiling",
            ):
                assert isinstance(f[key], float) and f[key] > 0 and math.isfinite(f[key]), (engine, key)
            for key in ("ttft_s", "tpot_s", "e2e_s"):
                assert set(f[key]) == {"mean", "p50", "p99"} and all(v >= 0 for v in f[key].values()), (engine, key)
            assert f["e2e_s"]["mean"] >= f["ttft_s"]["mean"] > 0
            assert f["kv_reserved_peak_bytes"] >= f["kv_used_peak_bytes"] > 0 and 0 <= f["kv_waste"] < 1
            assert f["peak_running"] >= 1 and f["steps"] >= 1 and isinstance(f["preemptions"], int)
            assert len(f["samples"]["e2e"]) == want.num_requests
            assert f["vs_hf"] > 0 and f["vs_level0"] > 0
    assert all({"goal", "measured", "target", "met"} <= g.keys() for g in data["goals"])
    assert {p.name for p in img.glob("bench_*.png")} >= {
        "bench_throughput.png",
        "bench_latency_cdf.png",
        "bench_kv_waste.png",
        "bench_roofline.png",
    }

    assert plots.SMOKE in plots._subtitle(data)  # a --quick run's plots say so in their titles

    capsys.readouterr()
    throughput.main(["--markdown", str(out)])
    md = capsys.readouterr().out
    assert "| engine | req/s | out tok/s" in md and "HF generate" in md and "L0 naive" in md

    readme = tmp_path / "README.md"
    readme.write_text("# title\n\n<!-- results:start -->\nold table\n<!-- results:end -->\n\n## after\n")
    report.write_readme(data, readme)
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# title") and text.endswith("## after\n")
    assert "| engine | out tok/s | x L0 | x HF |" in text and text.count("L0 naive") == len(data["workloads"])


def test_hf_sweep_and_poisson_rates_in_one_run(checkpoint_factory, tmp_path):
    model = checkpoint_factory("llama", tokenizer=True)
    out = tmp_path / "q.json"
    threads = torch.get_num_threads()
    try:
        throughput.main(["--quick", "--model", str(model), "--workload", "uniform", "--workload", "poisson",
                         "--num-requests", "4", "--engines", "hf,level1_paged,level2_continuous", "--hf-sweep", "2,4",
                         "--rate-multiples", "0.5,0.9,3", "--repeats", "2", "--no-progress", "--out", str(out)])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    data = json.loads(out.read_text())
    sweep = data["workloads"]["uniform"]["hf_sweep"]
    assert [f["batch_size"] for f in sweep] == [2, 4] and all(f["output_tokens_per_s"] > 0 for f in sweep)
    wl = data["workloads"]["poisson"]
    cap = wl["capacity_rps"]
    assert wl["capacity_engine"] == "level1_paged" and cap > 0
    assert wl["rates"] == [round(m * cap, 3) for m in (0.5, 0.9, 3)] and wl["reference_rate"] == wl["rates"][1]
    for name in ("hf", "level1_paged", "level2_continuous"):
        assert [f["request_rate"] for f in wl["sweep"][name]] == wl["rates"]
        assert wl["results"][name]["request_rate"] == wl["reference_rate"]
        for f in wl["sweep"][name]:  # each rate ran twice; the least delayed run is kept
            assert len(f["repeat_e2e_mean_s"]) == len(f["repeat_ttft_mean_s"]) == 2
            kept = f["repeat_e2e_mean_s"].index(min(f["repeat_e2e_mean_s"]))  # its TTFT is the same run's
            assert f["e2e_s"]["mean"] == f["repeat_e2e_mean_s"][kept] and f["ttft_s"]["mean"] == f["repeat_ttft_mean_s"][kept]
    goals = {g["goal"].split(":")[0] for g in data["goals"]}
    assert {"uniform, same KV budget", "uniform", "poisson at %.2f req/s" % wl["reference_rate"]} <= goals


def test_thrash_picture_shows_headroom_cutting_preemptions(checkpoint_factory, tmp_path):
    from benchmarks import thrash

    threads = torch.get_num_threads()
    try:
        runs = thrash.main(["--model", str(checkpoint_factory("llama", tokenizer=True)), "--headroom", "0", "2",
                            "--num-requests", "48", "--plot", str(tmp_path / "t.png")])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    h0, h2 = runs
    assert h0["prompt_tokens"] == 48 * 32 and len(h0["running"]) == h0["steps"] == len(h0["prefilled"])
    assert h0["preemptions"] > 0 and h2["preemptions"] < h0["preemptions"]  # the thrash, and its cure
    assert h0["prefilled"][-1] > h2["prefilled"][-1] >= h0["prompt_tokens"]  # recomputation on top of the prompts
    assert (tmp_path / "t.png").stat().st_size > 10_000
    try:  # --measure: the tokens/s table that chose the default
        rows = thrash.main(["--model", str(checkpoint_factory("llama", tokenizer=True)), "--measure", "uniform",
                            "--headroom", "0", "1", "--repeats", "1", "--num-requests", "8"])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert [(r["workload"], r["headroom"]) for r in rows] == [("uniform", 0), ("uniform", 1)]
    assert all(r["output_tokens_per_s"] > 0 for r in rows)


def test_plots_go_outside_the_repository_unless_asked():
    assert throughput.img_dir(throughput.parser().parse_args(["--plots"])) == output_dir()
    explicit = throughput.parser().parse_args(["--plots-from", __file__, "--img-dir", "docs/img"])
    assert throughput.img_dir(explicit) == Path("docs/img")


def test_throughput_bar_labels_do_not_overprint(tmp_path, monkeypatch):
    """The committed results, whose close ratios once printed as `1.1x1.1x`."""
    from test_demos import overlaps

    figs = []
    monkeypatch.setattr(plots.plt, "close", figs.append)  # keep the figure to measure it
    plots.throughput(json.loads((REPO / "benchmarks/results/latest.json").read_text()), tmp_path / "t.png")
    monkeypatch.undo()
    ax = figs[0].axes[0]
    assert len(ax.texts) > 10 and not overlaps(figs[0], [*ax.texts, ax.get_legend()])
    plots.plt.close(figs[0])


@pytest.mark.level5
def test_parallel_benchmark_writes_well_formed_json(checkpoint_factory, tmp_path, capsys):
    """Every layout once, tiny: a TP=2 run carries its all-reduce count, time and the model's prediction."""
    from benchmarks import parallel

    out = tmp_path / "parallel.json"
    data = parallel.main(["--model", str(checkpoint_factory("llama")), "--max-tokens", "3", "--pp-batch", "2",
                          "--tp-batches", "1", "--repeats", "1", "--dtype", "float64", "--eager-ranks", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))
    layouts = [(r["tp"], r["pp"], r["batch"], r["backend"]) for r in data["runs"]]
    assert layouts == [(1, 1, 2, "mp"), (1, 2, 2, "mp"), (1, 1, 1, "mp"), (2, 1, 1, "mp"), (1, 2, 2, "eager"), (2, 1, 1, "eager")]
    assert all(r["tokens_per_s"] > 0 and len(r["rounds_tokens_per_s"]) == 1 for r in data["runs"])
    tp2 = data["runs"][3]
    assert tp2["all_reduce_calls"] > 0 and tp2["all_reduce_bytes"] > 0 and tp2["predicted_all_reduce_s"] > 0
    assert all(r["vs_mp"] > 0 for r in data["runs"][4:])  # the eager ranks against the default
    printed = capsys.readouterr().out
    assert "model error" in printed and "TP=2 PP=1 eager" in printed and "the eager ranks' tokens/s" in printed


def test_the_disaggregation_benchmark_moves_each_requests_kv(checkpoint_factory, tmp_path):
    """The disaggregated layout, tiny: every request's blocks crossed (bytes per request > 0), every stream timed."""
    from benchmarks import disagg

    out = tmp_path / "disagg.json"
    data = disagg.main(["--model", str(checkpoint_factory("llama", tokenizer=True)), "--layouts", "disagg",
                        "--decoders", "2", "--decode-tokens", "8", "--long", "2", "--prompt-tokens", "64",
                        "--gap", "0.05", "--out", str(out)])  # fmt: skip
    assert json.loads(out.read_text()) == json.loads(json.dumps(data))
    (row,) = data["rows"]
    assert row["layout"] == "disagg" and 0 < row["gaps"] <= 2 * 7 and row["output_tok_s"] > 0  # (a chunk may carry 2)
    assert row["kv_bytes_per_request"] > 0 and row["kv_fetch_ms_per_request"] > 0


def test_profile_takes_a_decode_step_apart(checkpoint_factory, tmp_path):
    """`python -m benchmarks.profile`: every part of the step is timed, the parts and what lies
    between them add up to the step, the forward's parts are there, and the ceiling is beside it."""
    from benchmarks import profile

    model = checkpoint_factory("llama")
    data = profile.main(["--model", str(model), "--batches", "1,4", "--steps", "3",
                         "--plot", str(tmp_path / "profile_level3_prefix.png"), "--out", str(tmp_path / "p.json")])  # fmt: skip
    assert json.loads((tmp_path / "p.json").read_text())["rows"] == data["rows"]
    assert (tmp_path / "profile_level3_prefix.png").stat().st_size > 0
    assert [r["batch"] for r in data["rows"]] == [1, 4]
    for r in data["rows"]:
        assert set(r["ms"]) == set(profile.PARTS)
        assert math.isclose(sum(r["ms"].values()), r["step_ms"], rel_tol=1e-9)
        assert all(r["ms"][p] > 0 for p in ("schedule", "input", "linears", "attention", "glue", "sampling", "outputs"))
        assert r["ms"]["between"] >= 0, "the parts are disjoint pieces of the step"
        assert r["aten_ops_per_step"] > 10 and r["matmul_ms"] > 0 and r["kv_ms"] > 0
        assert 0 < r["of_ceiling"] and r["ceiling_tok_per_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="level 2's auto backend is compiled Triton on a real GPU, "
                                                       "which cannot launch on the virtual GPU's CPU memory")
def test_the_forward_timer_waits_for_the_gpu(checkpoint_factory, monkeypatch):
    """On CUDA a forward returns once its kernels are queued: the benchmark's timer synchronises before
    each clock read, one pair per forward (on tests/virtual_gpu.py's stand-in GPU; none on a CPU)."""
    from virtual_gpu import virtual_gpu

    from benchmarks.engines import make_engine

    model = str(checkpoint_factory("llama", tokenizer=True))
    wl = make_workload("uniform", 2, 259, quick=True)
    for device in ("cuda", "cpu"):
        syncs = []
        with virtual_gpu(monkeypatch):
            monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, s=syncs: s.append(1))
            eng = make_engine("level2_continuous", model, dtype="float32", device=device, kv_cache_memory=2**22,
                              max_num_seqs=8, hf_batch_size=4, seed=0, progress=False)  # fmt: skip
            res = eng.run(wl)
        assert res.forward_seconds > 0 and res.stats["steps"] > 0
        assert len(syncs) == (2 * res.stats["steps"] if device == "cuda" else 0)  # level 2: a forward a step


def test_the_lora_benchmark_runs_and_keeps_every_repeats_ratios(checkpoint_factory, tmp_path, capsys, monkeypatch):
    """`python -m benchmarks.lora` on a tiny random checkpoint: the three layouts' tokens/s, the best-of
    ratios, and each repeat's own pair of ratios (its runs side by side), so the spread is on record; with two
    paths, each one's figures, the first's the headline."""
    from benchmarks import lora
    from features.lora import cpu_ops

    monkeypatch.setattr(lora, "cache_dir", lambda: tmp_path)  # its random adapters, not in the shared cache

    out = tmp_path / "lora.json"
    res = lora.main(["--model", str(checkpoint_factory("llama")), "--adapters", "2", "--rank", "2", "--requests", "4",
                     "--max-tokens", "3", "--repeats", "2", "--paths", "auto,stacked", "--out", str(out)])  # fmt: skip
    saved = json.loads(out.read_text())
    auto = "auto (cpu)" if cpu_ops.available() else "auto (stacked)"  # (the compiled loop, where it builds)
    assert list(res["by_path"]) == [auto, "stacked"]  # the headline is the first path's
    assert res["by_path"][auto]["mixed"] == res["tokens_per_s"]["mixed"] != res["by_path"]["stacked"]["mixed"]
    assert saved["per_repeat"] == res["per_repeat"] and len(res["runs"]) == 2
    assert set(res["tokens_per_s"]) == {"mixed", "one_at_a_time", "base", "base_one_at_a_time"}
    assert math.isclose(res["base_batching"], res["tokens_per_s"]["base"] / res["tokens_per_s"]["base_one_at_a_time"])
    assert all(v > 0 for run in res["runs"] for v in run.values())
    assert res["tokens_per_s"]["mixed"] == max(run["mixed"] for run in res["runs"])
    for (a, b), run in zip(zip(*res["per_repeat"].values()), res["runs"]):
        assert math.isclose(a, run["mixed"] / run["one_at_a_time"]) and math.isclose(b, run["mixed"] / run["base"])
    assert "each repeat's own ratios" in " ".join(capsys.readouterr().out.split())  # (rich wraps the line)


def test_the_quantization_benchmarks_run_and_report_what_ran(tmp_path, capsys):
    """`python -m benchmarks.quantization` and `python -m benchmarks.quality` on the built-in model, tiny: every
    setting's tokens/s and its packed-kernel count; the held-out loss (a small corpus of our own: its last 10 %
    held out) and the agreement shares, which for float32 against itself would be 1 and are fractions here."""
    from benchmarks import quality, quantization

    ran = quantization.main(["--models", "tiny", "--quick", "--requests", "1", "--repeats", "1", "--kv",
                             "--kv-requests", "2", "3", "--spread-requests", "4", "--out", str(tmp_path / "q.json")])
    speed = ran["models"]["tiny"]
    for budget in (2, 3):  # each budget's three pools: 4x the blocks in fp8, a little fewer in int8 (its scales)
        pools = ran["kv"][budget]["pools"]
        assert pools["fp8"]["blocks"] // 4 == pools["auto"]["blocks"] and pools["auto"]["blocks"] < pools["int8"]["blocks"] < pools["fp8"]["blocks"]
        assert all(v > 0 for v in ran["kv"][budget]["tokens_per_s"].values())
    assert set(speed["tokens_per_s"]) == {"None", "int8", "int4"} and all(v > 0 for v in speed["tokens_per_s"].values())
    k8, k4 = speed["kernels"]["int8"], speed["kernels"]["int4"]
    assert (k8["projections"], k8["packed_kernel"]) == (42, 42)  # 6 layers x 7, every shape fits
    assert k4["quantized_bytes"] < 1.1 * k8["quantized_bytes"]  # int4 with its kernel: a byte a weight too (docs)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(("ROMEO:\nBut soft, what light through yonder window breaks?\n\n" * 80))
    res = quality.main(["--models", "tiny", "--corpus", str(corpus), "--prompts", "6", "--windows", "2",
                        "--out", str(tmp_path / "quality.json")])["models"]["tiny"]  # fmt: skip
    for q in ("int8", "int4", "fp8-kv", "int8-kv"):
        assert 0 < res[q]["token_agreement"] <= 1 and 0 <= res[q]["same_continuation"] <= 1
        assert res[q]["loss_nats_per_byte"] > 0 and math.isclose(res[q]["perplexity"], math.exp(res[q]["loss_nats_per_byte"]))
    assert res["float32"]["loss_nats_per_byte"] != res["int4"]["loss_nats_per_byte"]
    assert "continuations whole" in " ".join(capsys.readouterr().out.split())
