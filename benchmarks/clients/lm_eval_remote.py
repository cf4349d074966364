"""lm-evaluation-harness (`lm_eval`) over `local-completions`, with the server's own tokenizer, run by hand.

    python -m benchmarks.clients.lm_eval_remote

What it is: one `python -m level6_serving` (the built-in tiny Shakespeare model, a free
127.0.0.1 port, --max-model-len 512) and the unmodified `lm_eval run` CLI against it:

    lm_eval run --model local-completions
                --model_args base_url=URL/v1/completions,model=tiny-shakespeare,tokenizer_backend=remote,...
                --include_path benchmarks/clients/lm_eval_tasks
                --tasks shakespeare_mc,shakespeare_gen,shakespeare_ppl

`tokenizer_backend=remote` makes lm_eval tokenize through the server (GET /tokenizer_info,
POST /tokenize, /detokenize, as it does with vLLM) and send token ids as prompts. No task's data
is on this machine and nothing may be downloaded (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE), so the
tasks are three small ones of our own over 8 Shakespeare lines (lm_eval_tasks/): one of each kind
of request lm_eval makes, loglikelihood (multiple choice: echo + logprobs), generate_until and
loglikelihood_rolling (perplexity). It prints lm_eval's table, and the server's count of the
answers it gave by status; it exits 1 if lm_eval failed, or the server answered anything but 2xx.

What it is not: a measure of the model (8 lines; the tiny model's scores mean little), or a
check of the numbers against another implementation (tests/test_level6.py compares the server
with offline generation).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from level6_serving.process import ServerProcess

REPO = Path(__file__).resolve().parents[2]
TASKS = "shakespeare_mc,shakespeare_gen,shakespeare_ppl"
MAX_MODEL_LEN = 512


def lm_eval_command(url: str, model: str) -> list[str]:
    model_args = (f"base_url={url}/v1/completions,model={model},tokenizer_backend=remote,"
                  f"max_length={MAX_MODEL_LEN},num_concurrent=2,max_retries=1")  # fmt: skip
    return ["lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
            "--include_path", "benchmarks/clients/lm_eval_tasks", "--tasks", TASKS]  # fmt: skip


def answered(log: str) -> dict[str, int]:
    """The server's access log, counted: 'METHOD PATH STATUS' -> how many."""
    counts: dict[str, int] = {}
    for m in re.finditer(r'"(GET|POST) (\S+) HTTP/[\d.]+" (\d{3})', log):
        key = f"{m[1]} {m[2]} {m[3]}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def main() -> int:
    if shutil.which("lm_eval") is None:
        print("lm_eval is not installed: pip install 'lm_eval[api]>=0.4,<0.5'", file=sys.stderr)
        return 2
    # Offline: a tokenizer or data set that is not on disk is an error, not a download.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with ServerProcess(["--max-model-len", str(MAX_MODEL_LEN)]) as server:
        cmd = lm_eval_command(server.url, "tiny-shakespeare")
        print("$", " ".join(cmd), flush=True)
        start = time.perf_counter()
        # Its own session, so a Ctrl-C here (or an error) stops lm_eval and any worker it started.
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
        try:
            rc = proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        took = time.perf_counter() - start
        counts = answered(server.tail(chars=10_000_000))
    print(f"\nlm_eval exited {rc} after {took:.0f} s; the server answered:")
    for key, n in sorted(counts.items()):
        print(f"  {n:6d}  {key}")
    bad = {k: n for k, n in counts.items() if not k.split()[-1].startswith("2")}
    if bad:
        print(f"not 2xx: {bad}")
    return 1 if rc != 0 or bad or not counts else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as Ctrl-C: stop what it started on the way out
    sys.exit(main())
