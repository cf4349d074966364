"""The contestants: every level's `LLM`, and Hugging Face `generate`, behind one `run()`.

What it is: `make_engine("level2_continuous" | "level3_prefix:nocache" | "hf", ...)`
returns an object whose `run(workload)` plays the workload (round by round, for chat)
and returns a `RunResult`: one record per request (prompt and output length, TTFT,
end-to-end latency) plus the engine's KV and batching counters.

  levels  a fresh `LLM` per run (stats accumulate per LLM; chat's turns share one, so
          level 3 can reuse the previous turn's blocks); every level gets the same
          `kv_cache_memory`. The model runner's (or worker's) `forward` is wrapped with
          a timer, so the report can say what share of the wall time the model took.
  hf      `AutoModelForCausalLM.generate`, the way a user batches it: fixed-size batches
          in arrival order, left padding, greedy. One `generate` call cannot give each
          row its own length, so a batch runs to its longest request
          (`min_new_tokens = max_new_tokens = longest`) and each row is cut to its own
          length. Extra tokens count as waste, not as output. A logits processor
          timestamps every step, which gives each row its TTFT and finish time. Its
          KV figures are computed (batch x padded length per step), not measured.

With arrivals (the `poisson` workload, `run(workload, rate=...)`) each request enters when
its time comes: level 2 on gets it through `add_request` and it joins at the next `step()`;
the static batchers (levels 0 and 1, and HF) start a batch of whatever has arrived and run
it to its end, and whoever arrives meanwhile waits for the next one, as a static-batching
server would. TTFT and end-to-end latency count from the request's arrival.

What it is not: a fairness referee for memory. HF is given a batch size (default 16,
what the KV budget holds at the workload's worst case), not a byte budget.

Reference: vLLM `benchmarks/benchmark_throughput.py` (`run_vllm`, `run_hf`).
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from dataclasses import dataclass, field

import torch

from features.compilation.config import FROZEN_GEMM

from .workloads import Request, Workload

LABELS = {
    "hf": "HF generate",
    "level0_naive": "L0 naive",
    "level1_paged": "L1 paged",
    "level2_continuous": "L2 continuous",
    "level3_prefix": "L3 prefix",
    "level3_prefix:nocache": "L3 (cache off)",
    "level4_speculative": "L4 speculative",
    "level4_speculative:ngram": "L4 (n-gram)",
    "level4_speculative:eagle": "L4 (EAGLE)",
    "level4_speculative:eagle+frozen": "L4 (EAGLE, frozen)",
    "level3_prefix:offload": "L3 + host tier",
    **{
        f"{m}:invariant": f"{lbl} (invariant)"
        for m, lbl in [
            ("level1_paged", "L1"),
            ("level2_continuous", "L2"),
            ("level3_prefix", "L3"),
            ("level4_speculative", "L4"),
        ]
    },
    **{
        f"{m}:{variant}": f"{lbl} ({variant})"
        for m, lbl in [
            ("level1_paged", "L1"),
            ("level2_continuous", "L2"),
            ("level3_prefix", "L3"),
            ("level4_speculative", "L4"),
        ]
        for variant in ("compiled", "eager", "frozen")
    },
}  # `:invariant`: the level with batch_invariant=True (docs/batch_invariance.md), to measure what the mode costs;
# `:compiled`: with compilation_config=3, torch.compile (docs/compiled_step.md; the default on a CPU, so
# the same as the plain name there, and what a GPU run compares); `:eager`: with enforce_eager=True;
# `:frozen`: compiled with the weights frozen and Inductor's own GEMMs (FROZEN_GEMM, features/compilation/config.py);
# `:offload`: level 3 with the offloading connector's host tier (docs/kv_connectors.md); `:eagle`: level 4
# with the built-in target's EAGLE head instead of the draft model (level4_speculative/eagle.py; the target as the engine's, the head eager by default)
# Level 4's k in the harness: the best of 2..5 for the built-in pair on the latency workload, measured
# side by side (2026-12-02, Xeon, one thread: 1.48x / 1.40x / 1.37x / 1.34x level 3's tokens/s for
# k = 2 / 3 / 4 / 5). On a CPU a verifying forward costs more per extra token than on a GPU (one
# matmul over 3 rows takes 1.1x the time of one row, over 5 rows 1.5x: oneDNN leaves its matrix-vector
# kernel), so a short guess wins here; `python -m level4_speculative.demo --max-k 6` shows the costs.
NUM_SPECULATIVE_TOKENS = 2
# Level 4 drafts only while at most this many requests run (vLLM's `disable_by_batch_size`):
# measured with the built-in pair on a CPU, speculation pays 1.52x at batch 1 (k = 2) and breaks
# even near batch 16 (0.97x at k = 4: `python -m level4_speculative.demo`); past that, verifying
# k + 1 tokens per request costs more than it saves, so a busy engine decodes plainly.
DISABLE_BY_BATCH_SIZE = 8


def label(name: str) -> str:
    return LABELS.get(name, name)


@dataclass
class RunResult:
    engine: str
    records: list[dict] = field(default_factory=list)  # per request: prompt_len, output_len, ttft, e2e
    duration: float = 0.0  # seconds inside generate, summed over rounds
    stats: dict = field(default_factory=dict)  # KV and batching counters
    forward_seconds: float | None = None  # time inside the model's forward (levels only)
    schedule_seconds: float | None = None  # level 2+: scheduler + metadata building


def _records(outs, round_start: float | list[float]) -> list[dict]:
    """One record per output; times from `round_start` (one for all, or each request's own arrival)."""
    starts = round_start if isinstance(round_start, list) else [round_start] * len(outs)
    return [
        {
            "prompt_len": len(o.prompt_token_ids),
            "output_len": len(o.outputs[0].token_ids),
            "ttft": o.metrics.first_token_time - t0,
            "e2e": o.metrics.finished_time - t0,
        }
        for o, t0 in zip(outs, starts)
    ]


def arrived(times: list[float], start: int, now: float) -> int:
    """The end of the run of requests from `start` whose arrival time has come."""
    end = start
    while end < len(times) and times[end] <= now:
        end += 1
    return end


def wait_until(t: float) -> None:
    time.sleep(max(0.0, t - time.perf_counter()))


def static_batches(times: list[float], limit: int | None = None):
    """A static-batching server's loop: wait for the next arrival, then yield (start, end), the
    requests that have arrived by now (at most `limit`); the caller runs them to their end
    before asking for the next batch, so whoever arrives meanwhile waits."""
    nxt = 0
    while nxt < len(times):
        wait_until(times[nxt])
        end = arrived(times, nxt, time.perf_counter())
        end = end if limit is None else min(end, nxt + limit)
        yield nxt, end
        nxt = end


class LevelEngine:
    def __init__(
        self,
        name: str,
        model: str,
        dtype: str,
        device: str,
        kv_cache_memory: int,
        max_num_seqs: int,
        seed: int,
        progress: bool,
        draft_model: str | None = None,
    ):
        module, _, variant = name.partition(":")
        variants = set(variant.split("+"))  # "eagle+frozen": both
        self.name, self.module = name, importlib.import_module(module)
        # max_model_len -1: every position the checkpoint has; the workloads run past the built-in
        # model's 256-token training window (shared-prefix: a 384-token prefix), and speed does not care
        self.kwargs = dict(dtype=dtype, device=device, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                           seed=seed, max_model_len=-1)  # fmt: skip
        if "nocache" in variants:
            self.kwargs["enable_prefix_caching"] = False
        if "invariant" in variants:
            self.kwargs["batch_invariant"] = True
        if "compiled" in variants:
            self.kwargs["compilation_config"] = 3
        if "eager" in variants:
            self.kwargs["enforce_eager"] = True
        # the weights frozen into the graph, Inductor's own GEMMs (features/compilation/config.py)
        if "frozen" in variants:
            self.kwargs["compilation_config"] = {"inductor_compile_config": FROZEN_GEMM}
        if "offload" in variants:  # a host tier below the pool (docs/kv_connectors.md): 1 GiB, more than any run fills
            self.kwargs["kv_transfer_config"] = {"kv_connector": "OffloadingConnector",
                                                 "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}  # fmt: skip
        if module == "level4_speculative":  # a draft model when there is one with the same vocabulary, else n-grams
            spec = {"num_speculative_tokens": NUM_SPECULATIVE_TOKENS}
            if "eagle" in variants:  # the built-in target's trained head (models/train_eagle.py)
                spec.update(method="eagle", model="tiny-shakespeare-eagle", disable_by_batch_size=DISABLE_BY_BATCH_SIZE)
            elif "ngram" in variants or draft_model is None:
                spec.update(method="ngram", prompt_lookup_min=2, prompt_lookup_max=4)
            else:
                spec.update(model=str(draft_model), disable_by_batch_size=DISABLE_BY_BATCH_SIZE)
            self.kwargs["speculative_config"] = spec
        self.model, self.progress = model, progress

    def new_llm(self, **overrides):
        return self.module.LLM(self.model, **{**self.kwargs, **overrides})

    def warmup(self) -> None:
        """One tiny generate on a throwaway LLM: first-call costs stay out of the timing."""
        llm = self.new_llm()
        params = self.module.SamplingParams(max_tokens=4, min_tokens=4, ignore_eos=True, temperature=0)
        llm.generate([[40] * 8, [41] * 12], [params, params], progress=False)

    def params(self, reqs: list[Request]) -> list:
        SP = self.module.SamplingParams
        return [SP(max_tokens=r.max_tokens, min_tokens=r.max_tokens, ignore_eos=True, temperature=0) for r in reqs]

    def run(self, workload: Workload, rate: float | None = None) -> RunResult:
        llm = self.new_llm()
        res = RunResult(self.name, forward_seconds=0.0)
        engine = llm.llm_engine
        worker = getattr(engine, "worker", None)  # level 1 on: the Worker has the model runner
        runner = worker.runner if worker is not None else engine.runner
        inner = runner.forward
        # CUDA is asynchronous: forward() returns once its kernels are queued, so an unsynchronized timer
        # counts the launches, and the kernels' time lands in whatever waits next (the sampler's .tolist()).
        # A synchronize before each clock read charges every forward exactly its own kernels. (A CPU runs
        # each op to its end before the next line: nothing to wait for.)
        sync = (lambda: torch.cuda.synchronize(engine.device)) if engine.device.type == "cuda" else (lambda: None)

        def timed_forward(*args, **kwargs):  # an instance attribute: the engine code is untouched
            sync()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                sync()
                res.forward_seconds += time.perf_counter() - t0

        runner.forward = timed_forward

        def run_round(reqs: list[Request]) -> list[list[int]]:
            t0 = time.perf_counter()
            outs = llm.generate([r.prompt for r in reqs], self.params(reqs), progress=self.progress)
            res.duration += time.perf_counter() - t0
            # arrival_time is when generate() received the request: the round's start.
            res.records += _records(outs, min(o.metrics.arrival_time for o in outs))
            return [list(o.outputs[0].token_ids) for o in outs]

        if workload.arrivals is None:
            workload.play(run_round)
        else:
            self.play_arrivals(llm, workload, rate, res)
        s = llm.stats
        res.stats = {k: v for k, v in s.as_dict().items() if k not in ("busy_time", "output_tokens_per_s")}
        if hasattr(engine, "scheduler"):
            res.schedule_seconds = s.schedule_seconds
        if hasattr(llm, "prefix_stats"):
            res.stats["prefix"] = llm.prefix_stats()
        if hasattr(llm, "spec_decode_stats"):
            sp = llm.spec_decode_stats()
            res.stats["spec"] = {
                "method": self.kwargs["speculative_config"].get("method", "draft_model"),
                "k": NUM_SPECULATIVE_TOKENS,
                "disable_by_batch_size": self.kwargs["speculative_config"].get("disable_by_batch_size"),
                "acceptance_rate": sp.acceptance_rate,  # vLLM's: accepted / proposed
                "per_token_acceptance": sp.per_token_acceptance,  # Leviathan's alpha
                "mean_acceptance_length": sp.mean_acceptance_length,
                "per_position": sp.per_position(),
            }
        return res

    def play_arrivals(self, llm, workload: Workload, rate: float, res: RunResult) -> None:
        """Each request enters at its arrival time (`workload.arrivals` / `rate`, from now)."""
        reqs, params, engine = workload.first, self.params(workload.first), llm.llm_engine
        start = time.perf_counter()
        times = [start + a / rate for a in workload.arrivals]
        done: dict[int, object] = {}
        if hasattr(engine, "add_request"):  # continuous batching: an arrival joins at the next step
            nxt = 0
            while nxt < len(reqs) or engine.has_unfinished_requests():
                end = arrived(times, nxt, time.perf_counter())
                for i in range(nxt, end):
                    engine.add_request(str(i), reqs[i].prompt, params[i], arrival_time=times[i])
                nxt = end
                if engine.has_unfinished_requests():
                    done.update((int(o.request_id), o) for o in engine.step() if o.finished)
                else:
                    wait_until(times[nxt])
        else:  # static batching: whoever has arrived is the next batch; later arrivals wait for it to end
            for a, b in static_batches(times):
                outs = llm.generate([r.prompt for r in reqs[a:b]], params[a:b], progress=False)
                done.update(zip(range(a, b), outs))
        res.duration = time.perf_counter() - start
        order = sorted(done)
        res.records = _records([done[i] for i in order], [times[i] for i in order])


class StepClock:
    """A logits processor that only writes down when each generation step happened."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


class HFEngine:
    name = "hf"

    def __init__(self, model: str, dtype: str, device: str, batch_size: int, progress: bool):
        from transformers import AutoModelForCausalLM

        from ladder.models import resolve_path
        from level0_naive.config import resolve_device, resolve_dtype

        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        path = resolve_path(model)  # a built-in name is no hub id: from_pretrained needs its directory
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(self.device).eval()
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.bytes_per_token = 2 * cfg.num_hidden_layers * n_kv * head_dim * self.dtype.itemsize
        eos = self.model.generation_config.eos_token_id
        self.eos = eos if eos is not None else cfg.eos_token_id
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else self.eos
        self.pad = (pad[0] if isinstance(pad, list) else pad) if pad is not None else 0
        self.batch_size, self.progress = batch_size, progress

    def warmup(self) -> None:
        self._generate([Request([40] * 8, 4), Request([41] * 12, 4)], StepClock())

    @torch.inference_mode()
    def _generate(self, batch: list[Request], clock: StepClock) -> torch.Tensor:
        from transformers import GenerationConfig, LogitsProcessorList

        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor(
            [[self.pad] * (width - len(r.prompt)) + r.prompt for r in batch], device=self.device
        )  # [B, P]
        mask = torch.tensor(
            [[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=self.device
        )  # [B, P]
        n = max(r.max_tokens for r in batch)
        gen = GenerationConfig(
            max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=self.pad, eos_token_id=self.eos
        )
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, generation_config=gen, logits_processor=LogitsProcessorList([clock])
        )
        return out[:, width:]  # [B, n]

    def run(self, workload: Workload, rate: float | None = None) -> RunResult:
        from ladder.progress import GenerateProgress

        res = RunResult(self.name)
        kv = {
            "prefill": 0,
            "steps": 0,
            "reserved_sum": 0,
            "used_sum": 0,
            "reserved_peak": 0,
            "used_peak": 0,
            "running_sum": 0,
            "peak_running": 0,
        }

        def run_round(reqs: list[Request]) -> list[list[int]]:
            answers = []
            start = time.perf_counter()
            with GenerateProgress(len(reqs), enabled=self.progress, description="hf generate") as bar:
                for i in range(0, len(reqs), self.batch_size):
                    batch = reqs[i : i + self.batch_size]
                    clock = StepClock()
                    new = self._generate(batch, clock)  # [B, n]
                    answers += [new[j, : r.max_tokens].tolist() for j, r in enumerate(batch)]
                    res.records += [{"prompt_len": len(r.prompt), "output_len": r.max_tokens, "ttft": clock.times[0] - start,
                                     "e2e": clock.times[r.max_tokens - 1] - start} for r in batch]  # fmt: skip
                    self._account(kv, batch, len(clock.times))
                    bar.update(finished=len(batch), new_tokens=sum(r.max_tokens for r in batch))
            res.duration += time.perf_counter() - start
            return answers

        if workload.arrivals is None:
            workload.play(run_round)
        else:  # static batches of whoever has arrived, at most batch_size
            reqs, start = workload.first, time.perf_counter()
            times = [start + a / rate for a in workload.arrivals]
            for a, b in static_batches(times, self.batch_size):
                batch, clock = reqs[a:b], StepClock()
                self._generate(batch, clock)
                res.records += [{"prompt_len": len(r.prompt), "output_len": r.max_tokens, "ttft": clock.times[0] - t,
                                 "e2e": clock.times[r.max_tokens - 1] - t} for r, t in zip(batch, times[a:b])]  # fmt: skip
                self._account(kv, batch, len(clock.times))
            res.duration = time.perf_counter() - start
        steps = max(kv["steps"], 1)
        res.stats = {
            "steps": kv["steps"], "prompt_tokens": kv["prefill"],
            "generated_tokens": sum(r["output_len"] for r in res.records), "preemptions": 0,
            "peak_running": kv["peak_running"], "mean_running": kv["running_sum"] / steps,
            "kv_waste": 1 - kv["used_sum"] / kv["reserved_sum"] if kv["reserved_sum"] else 0.0,
            "kv_reserved_peak": kv["reserved_peak"], "kv_used_peak": kv["used_peak"],
        }  # fmt: skip
        return res

    def _account(self, kv: dict, batch: list[Request], steps: int) -> None:
        """KV after step s: every row holds the padded prompt + s tokens; real ones are
        its own prompt + min(s, its length). Padding and run-to-longest are the waste."""
        width, bpt = max(len(r.prompt) for r in batch), self.bytes_per_token
        kv["prefill"] += width * len(batch)  # padding is computed too
        for s in range(1, steps + 1):
            reserved = len(batch) * (width + s) * bpt
            used = sum(len(r.prompt) + min(s, r.max_tokens) for r in batch) * bpt
            kv["steps"] += 1
            kv["reserved_sum"] += reserved
            kv["used_sum"] += used
            kv["reserved_peak"] = max(kv["reserved_peak"], reserved)
            kv["used_peak"] = max(kv["used_peak"], used)
            kv["running_sum"] += len(batch)
            kv["peak_running"] = max(kv["peak_running"], len(batch))


def make_engine(
    name: str,
    model: str,
    *,
    dtype: str,
    device: str,
    kv_cache_memory: int,
    max_num_seqs: int,
    hf_batch_size: int,
    seed: int,
    progress: bool,
    draft_model: str | None = None,
):
    if name == "hf":
        return HFEngine(model, dtype, device, hf_batch_size, progress)
    return LevelEngine(name, model, dtype, device, kv_cache_memory, max_num_seqs, seed, progress, draft_model)


def available_levels() -> list[str]:
    """The level packages that import (a level joins once it lands)."""
    found = []
    for module in ("level0_naive", "level1_paged", "level2_continuous", "level3_prefix", "level4_speculative"):
        if importlib.util.find_spec(module) is None:  # a level not written yet
            continue
        importlib.import_module(module)  # a level that exists but fails to import is an error, not a skip
        found.append(module)
    return found
