"""`python -m level6_serving.disagg_demo`: a prefill instance, a decode instance and the proxy, on this machine.

What it is: disaggregated prefill and decode end to end, in about a minute on a laptop CPU:

  1. start two level-6 servers, each pinned to its own core where there are two: the prefill
     instance (a TCPConnector, kv_role kv_producer) and the decode instance (kv_consumer); and
     the proxy (`python -m level6_serving.disagg`) in this process;
  2. send one long-prompt request the way the proxy does, half by half, and draw its timeline:
     the prompt computed on the prefill instance, its blocks fetched over TCP by the decode
     instance (bytes, milliseconds), then the tokens generated there;
  3. send the same request through the proxy with the `openai` client, and once more to the
     decode instance alone (which then computes the prompt itself): the same greedy text;
  4. read both instances' counters (ladder:kv_transfer_*) and the proxy's.

What it is not: a benchmark (`python -m benchmarks.disagg` compares disaggregated with colocated
serving), or fast: on a CPU a KV transfer goes through a socket on loopback; a GPU deployment
moves it by RDMA or NVLink (docs/kv_connectors.md).
"""

from __future__ import annotations

import json
import os
import re
import time

import httpx
from rich.console import Console

from ladder.cli import demo_parser, int_at_least, run_demo

from .api_server import ServerThread
from .disagg import build_disagg_app
from .metrics import parse, value
from .process import ServerProcess

LEXICON = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
           "JULIET: O Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse thy name. ")  # fmt: skip


def parser():
    p = demo_parser(__doc__, "level6_serving.disagg_demo")
    p.add_argument("--prompt-tokens", type=int_at_least(16), default=1200,
                   help="the long prompt's length in tokens (the built-in model's tokenizer: one per character)")
    return p


def instance(args, role: str, cores: set[int] | None, max_len: int) -> ServerProcess:
    """A level-6 server with a TCPConnector in `role`, on `cores` (the demo's own greedy requests
    ignore --temperature: the three answers are compared)."""
    kv = {"kv_connector": "TCPConnector", "kv_role": role, "kv_port": 0}
    return ServerProcess(["--model", args.model or "tiny-shakespeare", "--max-model-len", str(max_len), "--dtype",
                          args.dtype, "--device", args.device, "--kv-transfer-config", json.dumps(kv),
                          "--enforce-eager"], cpus=cores)  # fmt: skip


def counters(url: str) -> dict:
    return parse(httpx.get(url + "/metrics", timeout=30).text)


WIDTH = 30  # characters of the timeline


def bar(t0: float, t1: float, start: float, scale: float) -> str:
    a = min(round((t0 - start) * scale), WIDTH - 1)
    b = min(max(round((t1 - start) * scale), a + 1), WIDTH)
    return " " * a + "█" * (b - a) + " " * (WIDTH - b)


def without_model(key: str) -> str:
    """A Prometheus series' name and labels, less the model_name label every series of the server has."""
    return re.sub(r'model_name="[^"]*",?', "", key).replace(",}", "}").replace("{}", "")


def run(args, console: Console) -> None:
    model = args.model or "tiny-shakespeare"
    args.max_tokens = args.max_tokens or 32
    prompt = (LEXICON * (args.prompt_tokens // len(LEXICON) + 1))[: args.prompt_tokens]
    max_len = args.prompt_tokens + args.max_tokens + 16
    cores = sorted(os.sched_getaffinity(0))
    pin = [{cores[0]}, {cores[1]}] if len(cores) >= 2 else [None, None]
    console.print(f"[bold]1.[/] starting a prefill and a decode instance ({model}), "
                  + (f"on cores {cores[0]} and {cores[1]}" if pin[0] else "sharing this machine's one core"))
    with instance(args, "kv_producer", pin[0], max_len) as prefill, instance(args, "kv_consumer", pin[1], max_len) as decode:
        console.print(f"   prefill {prefill.url}   decode {decode.url}")
        name = httpx.get(prefill.url + "/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}

        console.print(f"\n[bold]2.[/] one request of {args.prompt_tokens} prompt tokens, in the proxy's two halves")
        before = counters(decode.url)
        t0 = time.perf_counter()
        first = httpx.post(prefill.url + "/v1/completions", timeout=300, json={
            **body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()  # fmt: skip
        t1 = time.perf_counter()
        params = first["kv_transfer_params"]
        console.print(f"   the prefill instance's kv_transfer_params: the blocks wait at {params['remote_host']}:"
                      f"{params['remote_port']} under transfer_id {params['transfer_id'][:8]}...")
        t_first, pieces = None, []
        with httpx.stream("POST", decode.url + "/v1/completions", timeout=300,
                          json={**body, "stream": True, "kv_transfer_params": params}) as stream:  # fmt: skip
            for line in stream.iter_lines():
                if line.startswith("data: {"):
                    t_first = t_first or time.perf_counter()
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
        t3 = time.perf_counter()
        after = counters(decode.url)
        moved, fetch = (value(after, name) - value(before, name) for name in ("ladder:kv_transfer_bytes_total",
                                                                              "ladder:kv_transfer_seconds_total"))
        scale = WIDTH / (t3 - t0)
        console.print(f"   prefill   |{bar(t0, t1, t0, scale)}| {1e3 * (t1 - t0):6.0f} ms  prompt; blocks kept")
        console.print(f"   KV fetch  |{bar(t1, t1 + fetch, t0, scale)}| {1e3 * fetch:6.1f} ms  {moved / 1e6:.2f} MB over TCP")
        console.print(f"   decode    |{bar(t1, t_first, t0, scale)}| {1e3 * (t_first - t1):6.0f} ms  to token 1, fetch included")
        console.print(f"             |{bar(t_first, t3, t0, scale)}| {1e3 * (t3 - t_first):6.0f} ms  {args.max_tokens - 1} more tokens")

        console.print("\n[bold]3.[/] the same request through the proxy, and to the decode instance alone")
        app = build_disagg_app([prefill.url], [decode.url])
        with ServerThread(app) as proxy:
            import openai

            client = openai.OpenAI(base_url=proxy + "/v1", api_key="-", max_retries=0, timeout=300)
            fields = {k: v for k, v in body.items() if k != "ignore_eos"}
            via_proxy = client.completions.create(**fields, extra_body={"ignore_eos": True}).choices[0].text
            proxy_counts = httpx.get(proxy + "/metrics").text
            client.close()
        alone = httpx.post(decode.url + "/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
        same = "".join(pieces) == via_proxy == alone
        console.print(f"   {'the same' if same else 'DIFFERENT'} greedy text all three ways: {alone[:24]!r}...")

        console.print("\n[bold]4.[/] the counters")
        for url, who in ((prefill.url, "prefill"), (decode.url, "decode")):
            for key, n in counters(url).items():
                if key.startswith("ladder:kv_transfer") and n:
                    console.print(f"   {who:7}  {without_model(key)} {n:g}")
        for key, n in parse(proxy_counts).items():
            if key.startswith("ladder:disagg_requests"):
                console.print(f"   proxy    {key} {n:g}")
    if not same:
        raise SystemExit("the answers differ (a bug: docs/kv_connectors.md says why they must not)")


def main(argv=None) -> None:
    run_demo(parser(), argv, run)


if __name__ == "__main__":
    main()
