"""guidellm streaming through the data-parallel router while one replica is killed, run by hand.

    python -m benchmarks.clients.guidellm_router

What it is: `python -m level6_serving --data-parallel-size 2 --router round-robin` (the
built-in tiny Shakespeare model; the router and two replica processes, free 127.0.0.1 ports)
and the unmodified `guidellm run` CLI streaming completions through the router: 4 streams at
once, 48 requests of 32 synthetic prompt tokens and 64 output tokens (`ignore_eos`), the
tokenizer read from the model's own folder (HF_HUB_OFFLINE: nothing downloads). Once KILL_AFTER
requests have ended (the router's count), one replica process gets SIGKILL. From then on the router sends
everything to the live replica (a dead process is seen before a request is routed; a refused
connection is sent on to the next replica, and so is a request it had accepted but not yet begun
to answer: outcome "retried"). A stream the killed replica had started cannot be saved (router.py):
it ends with an error event and `data: [DONE]`, and guidellm counts it as errored. So the run
must show exactly as many errored requests as the router counted "failed" (its
`ladder:dp_requests_total`), none incomplete, and every other request successful; it prints
guidellm's totals, the errors it recorded, and the router's counts, and exits 1 if they disagree
or guidellm failed.

What it is not: a speed measurement (three processes and guidellm share 2 cores), or a
supervisor test: the killed replica is not restarted (router.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from ladder.models import default_model
from level6_serving.process import ServerProcess

REQUESTS, STREAMS, KILL_AFTER = 48, 4, 12
SERVER_ARGS = ["--data-parallel-size", "2", "--router", "round-robin", "--max-model-len", "256"]


def guidellm_command(url: str, tokenizer: str, output: str) -> list[str]:
    return ["guidellm", "run",
            "--backend", f"kind=openai_http,target={url},model=tiny-shakespeare,request_format=/v1/completions",
            "--profile", f"kind=concurrent,streams={STREAMS}",
            "--constraint", f"kind=max_requests,count={REQUESTS}",
            "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=64",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",  # a local folder: nothing downloads
            "--data-loader", "kind=pytorch,prefetch_factor=16",
            "--output", f"kind=json,path={output}",
            "--disable-console-interactive"]  # fmt: skip


def router_counts(url: str) -> dict[str, float]:
    """The router's own lines of /metrics: requests by replica and outcome, and the live replicas."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(ladder:dp_\w+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def replica_pids(router_pid: int) -> list[int]:
    """The router's child processes that are servers: its replicas."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == router_pid and b"level6_serving" in cmdline:
            pids.append(int(stat.parent.name))
    return sorted(pids)


def kill_one_replica_midway(server: ServerProcess, stop: threading.Event, killed: dict) -> None:
    """Wait until KILL_AFTER requests have ended (the router's count), then SIGKILL one replica."""
    while not stop.wait(0.2):
        sent = sum(v for k, v in router_counts(server.url).items() if k.startswith("ladder:dp_requests_total"))
        if sent >= KILL_AFTER:
            pid = replica_pids(server.proc.pid)[-1]
            os.kill(pid, signal.SIGKILL)
            killed.update(pid=pid, after=sent, at=time.strftime("%H:%M:%S"))
            print(f"{killed['at']} SIGKILL to replica process {pid} after {sent:.0f} requests had ended", flush=True)
            return


def run(cmd: list[str], env: dict) -> int:
    """`cmd` in a session of its own (guidellm starts worker processes); nothing of it left afterwards."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait()
    finally:  # its worker processes too, even after it exited
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> int:
    if shutil.which("guidellm") is None:
        print("guidellm is not installed: pip install 'guidellm>=0.8.1,<0.9'", file=sys.stderr)
        return 2
    # One guidellm worker process (2 cores); offline, so a missing local file is an error, not a download.
    env = {**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="guidellm-router-") as tmp, ServerProcess(SERVER_ARGS) as server:
        print(f"router {server.url}, replica processes {replica_pids(server.proc.pid)}", flush=True)
        output = Path(tmp) / "benchmarks.json"
        cmd = guidellm_command(server.url, str(default_model()), str(output))
        print("$", " ".join(cmd), flush=True)
        stop, killed = threading.Event(), {}
        killer = threading.Thread(target=kill_one_replica_midway, args=(server, stop, killed), daemon=True)
        start = time.perf_counter()
        killer.start()
        try:
            rc = run(cmd, env)
        finally:
            stop.set()
            killer.join()
        took = time.perf_counter() - start
        counts = router_counts(server.url)
        router_log = server.tail(chars=10_000_000)
        bench = json.loads(output.read_text())["benchmarks"][0] if output.exists() else None

    print(f"\nguidellm exited {rc} after {took:.0f} s")
    print("router:", ", ".join(f"{k} {v:g}" for k, v in counts.items()))
    for line in router_log.splitlines():
        if "out of rotation" in line or "answers again" in line:
            print("router log:", line)
    if bench is None:
        print("guidellm wrote no report")
        return 1
    totals, state = bench["metrics"]["request_totals"], bench["scheduler_state"]
    print("guidellm request_totals:", json.dumps(totals))
    print("guidellm scheduler_state:", json.dumps({k: v for k, v in state.items() if k.endswith("_requests")}))
    for r in bench["requests"].get("errored") or []:
        print("guidellm errored request:", json.dumps((r.get("info") or {}).get("error") or r)[:400])
    failed = sum(v for k, v in counts.items() if 'outcome="failed"' in k)
    problems = []
    if rc != 0:
        problems.append(f"guidellm exited {rc}")
    if not killed:
        problems.append("no replica was killed (the run ended first)")
    if totals["errored"] != failed:
        problems.append(f"guidellm counted {totals['errored']} errored requests, the router {failed:g} failed")
    if totals["incomplete"] != 0 or totals["successful"] + totals["errored"] + state["processing_requests"] != REQUESTS:
        problems.append(f"not every request of {REQUESTS} ended in success or a counted error: {totals}")
    print("\n" + ("; ".join(problems) if problems else
                  f"OK: {totals['successful']} successful, {totals['errored']} errored (each one in flight on the "
                  "killed replica when it died, as the router counted), 0 incomplete"))  # fmt: skip
    return 1 if problems else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as Ctrl-C: stop what it started on the way out
    sys.exit(main())
