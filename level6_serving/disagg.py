"""Disaggregated prefill and decode: one OpenAI endpoint over prefill instances and decode instances.

What it is: the proxy of `python -m level6_serving.disagg --prefill URL... --decode URL...` (and
`ladder disagg ...`). Each instance is an ordinary level-6 server, started with a TCPConnector
(features/kv_connectors/tcp.py): prefill ones with kv_role "kv_producer", decode ones with
"kv_consumer". Each request crosses both:

    client ──> proxy ── the request, max_tokens=1, not streamed, kv_transfer_params=
                        {"do_remote_decode": true, "transfer_id": t} ──> a prefill instance
                        (it computes the prompt, keeps its blocks for t, answers with where they are)
                  <──── its kv_transfer_params {"do_remote_prefill": true, "remote_host", "remote_port", t}
               proxy ── the client's request as it came, plus those kv_transfer_params ──> a decode
                        instance (it fetches the blocks over TCP, loads them, computes the prompt's last
                        tokens and generates); its answer, streamed or whole, goes back to the client

Instances are picked in turn (round-robin over the live ones). Faults, and how each ends:

    a prefill instance refuses, times out (--prefill-timeout) or answers with an error
        -> the request goes to a decode instance without kv_transfer_params: it computes the prompt
           itself, and the client sees no error (counted: outcome "prefill_failed"); an instance that
           refused a connection leaves the prefill rotation
    a decode instance refuses a connection -> the next live one (the request never started there)
    a decode instance breaks off an answer -> the client gets a 502 naming it (or, in a stream, an
           error event and [DONE]), never a second answer: it may have run; it leaves the rotation
    no live decode instance -> 503
    a transfer that fails between the two (cut, corrupt, refused layouts) -> the decode instance
           computes the prompt (tcp.py counts it in its ladder:kv_transfer_total)

An instance out of rotation comes back when its /health answers again (checked every HEALTH_S).
Requests the pair cannot split go to a decode instance whole (outcome "whole"): several prompts in
one completion, beam search, prompt logprobs.

What it is not: a scheduler that balances prefill against decode load (DistServe places instances
by the workload's SLOs; Dynamo's planner moves GPUs between the pools), or a router across machines
with its own discovery: the instances' addresses are given.

Reference: vLLM `examples/online_serving/disaggregated_serving/` (its toy proxy: max_tokens=1 to the
prefill side, kv_transfer_params carried to the decode side); DistServe (Zhong et al., OSDI 2024).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections import Counter

import httpx
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ladder.cli import LadderParser, positive_float

from .http_client import post
from .metrics import CONTENT_TYPE

log = logging.getLogger("ladder.disagg")

HEALTH_S = 2.0  # how often an instance out of rotation is asked whether it is back


class Pool:
    """One side's instances, in turn, skipping those out of rotation."""

    def __init__(self, role: str, urls: list[str]):
        self.role, self.urls = role, [u.rstrip("/") for u in urls]
        self.alive = dict.fromkeys(self.urls, True)
        self._turn = itertools.cycle(self.urls)

    def live(self) -> list[str]:
        return [u for u in self.urls if self.alive[u]]

    def next(self) -> str | None:
        for _ in self.urls:
            url = next(self._turn)
            if self.alive[url]:
                return url
        return None

    def mark_dead(self, url: str, why: str) -> None:
        if self.alive[url]:
            self.alive[url] = False
            log.error("%s instance %s is out of rotation: %s; %d live", self.role, url, why, len(self.live()))


def error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "disagg_error", "param": None, "code": code}},
                        status_code=status)  # fmt: skip


def splittable(body: dict, path: str) -> bool:
    """Can this request's prompt be computed on one instance and its tokens on another?"""
    if body.get("use_beam_search") or body.get("prompt_logprobs") is not None:
        return False
    if path.endswith("/completions") and not path.endswith("/chat/completions"):
        prompt = body.get("prompt")
        return isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))
    return True


def prefill_body(body: dict) -> dict:
    """The request as the prefill instance gets it: one token, not streamed, its blocks kept for a consumer."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens", "min_tokens",
                                                       "n", "best_of")}  # fmt: skip
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True,
                                                               "transfer_id": uuid.uuid4().hex})  # fmt: skip
    return out


def build_disagg_app(prefill: list[str], decode: list[str], prefill_timeout: float = 30.0) -> FastAPI:
    """The proxy over instances at these URLs (already up)."""
    pools = {"prefill": Pool("prefill", prefill), "decode": Pool("decode", decode)}
    outcomes: Counter = Counter()  # disaggregated | prefill_failed | whole | decode_failed | no_decode
    client: httpx.AsyncClient | None = None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal client
        client = httpx.AsyncClient(timeout=httpx.Timeout(prefill_timeout, connect=5.0),
                                   limits=httpx.Limits(max_connections=None))  # fmt: skip
        task = asyncio.ensure_future(watch())
        try:
            yield
        finally:
            task.cancel()
            await client.aclose()

    async def watch():
        while True:
            await asyncio.sleep(HEALTH_S)
            for pool in pools.values():
                for url in pool.urls:
                    if not pool.alive[url] and await healthy(url):
                        pool.alive[url] = True
                        log.warning("%s instance %s answers again: back in rotation", pool.role, url)

    async def healthy(url: str) -> bool:
        try:
            return (await client.get(url + "/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    app = FastAPI(title="inference-ladder disaggregated prefill/decode proxy", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)  # fmt: skip
    app.state.pools, app.state.outcomes = pools, outcomes

    async def prefilled(path: str, body: dict, headers: dict) -> dict | None:
        """A prefill instance's kv_transfer_params for this request, or None (the decode side computes it)."""
        url = pools["prefill"].next()
        if url is None:
            return None
        try:
            resp = await client.post(url + path, json=prefill_body(body), headers=headers)
        except httpx.ConnectError as e:
            pools["prefill"].mark_dead(url, f"it refused a connection ({e!r})")
            return None
        except httpx.HTTPError as e:  # too slow, or it broke off: the decode side computes the prompt
            log.warning("prefill instance %s failed a request (%r); the decode instance computes it", url, e)
            return None
        try:
            params = resp.json().get("kv_transfer_params") if resp.status_code == 200 else None
        except ValueError:
            params = None
        if not params:
            log.warning("prefill instance %s answered %d without kv_transfer_params (is it a kv_producer?); the "
                        "decode instance computes the prompt", url, resp.status_code)  # fmt: skip
        return params

    async def forward(raw: Request, path: str) -> Response:
        raw_body = await raw.body()
        try:
            body = json.loads(raw_body)
        except ValueError:
            body = None
        headers = {k: v for k, v in raw.headers.items() if k.lower() in ("authorization", "content-type")}
        outcome = "whole"
        if not pools["decode"].live():  # nothing could use a prefill's blocks
            outcomes["no_decode"] += 1
            return error(503, "no decode instance is alive", "no_decode_instance")
        if isinstance(body, dict) and splittable(body, path):
            params = await prefilled(path, body, headers)
            outcome = "disaggregated" if params else "prefill_failed"
            if params:
                raw_body = json.dumps({**body, "kv_transfer_params": params}).encode()
        return await decoded(path, raw_body, headers, outcome)

    async def decoded(path: str, body: bytes, headers: dict, outcome: str) -> Response:
        """A live decode instance's answer, relayed; the next one if a connection is refused."""
        while (url := pools["decode"].next()) is not None:
            pieces = post(url + path, body, headers)
            try:
                status, got = await anext(pieces), await anext(pieces)
            except ConnectionRefusedError as e:  # nothing reached it: the request never started there
                await pieces.aclose()
                pools["decode"].mark_dead(url, f"it refused a connection ({e!r})")
                continue
            except (OSError, asyncio.IncompleteReadError, StopAsyncIteration) as e:
                await pieces.aclose()
                return failed(url, e)
            keep = {k: v for k, v in got.items() if k in ("content-type", "retry-after")}
            if not got.get("content-type", "").startswith("text/event-stream"):
                try:  # a whole answer is read whole first: a decode instance that breaks off is a 502, never half
                    whole = b"".join([piece async for piece in pieces])
                except (OSError, asyncio.IncompleteReadError) as e:
                    return failed(url, e)
                outcomes[outcome] += 1
                return Response(whole, status_code=status, headers=keep)
            outcomes[outcome] += 1
            return StreamingResponse(relay(url, pieces), status_code=status, headers=keep)
        outcomes["no_decode"] += 1
        return error(503, "no decode instance is alive", "no_decode_instance")

    def failed(url: str, e: BaseException) -> Response:
        outcomes["decode_failed"] += 1
        pools["decode"].mark_dead(url, f"it broke off an answer ({e!r})")
        return error(502, f"decode instance {url} failed before answering in full ({e!r}); it is out of rotation",
                     "decode_failed")  # fmt: skip

    async def relay(url: str, pieces):
        try:
            async for piece in pieces:
                yield piece
        except (OSError, asyncio.IncompleteReadError) as e:
            outcomes["decode_failed"] += 1
            pools["decode"].mark_dead(url, f"it broke off a stream ({e!r})")
            err = {"error": {"message": f"decode instance {url} failed mid-stream ({e!r}); it is out of rotation",
                             "type": "disagg_error", "param": None, "code": "decode_failed"}}  # fmt: skip
            yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await pieces.aclose()

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await forward(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await forward(raw, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        for url in pools["decode"].live():
            with contextlib.suppress(httpx.HTTPError):
                resp = await client.get(url + "/v1/models")
                return Response(resp.content, status_code=resp.status_code, media_type="application/json")
        return error(503, "no decode instance is alive", "no_decode_instance")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if pools["decode"].live() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        lines = ["# HELP ladder:disagg_requests_total Requests through the proxy, by how they ended.",
                 "# TYPE ladder:disagg_requests_total counter"]  # fmt: skip
        lines += [f'ladder:disagg_requests_total{{outcome="{o}"}} {n}' for o, n in sorted(outcomes.items())]
        lines += ["# HELP ladder:disagg_instances_alive Instances in rotation, per side.",
                  "# TYPE ladder:disagg_instances_alive gauge"]  # fmt: skip
        lines += [f'ladder:disagg_instances_alive{{side="{s}"}} {len(p.live())}' for s, p in pools.items()]
        return Response("\n".join(lines) + "\n", media_type=CONTENT_TYPE)

    return app


def check_models(prefill: list[str], decode: list[str]) -> None:
    """Every instance serves the same model name, or SystemExit with one line naming two that differ."""
    names = {}
    for url in prefill + decode:
        try:
            names[url] = [m["id"] for m in httpx.get(url.rstrip("/") + "/v1/models", timeout=10).json()["data"]]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise SystemExit(f"disagg: {url} does not answer /v1/models ({e!r}); is it a level-6 server?") from None
    first = prefill[0]
    for url, served in names.items():
        if served != names[first]:
            raise SystemExit(f"disagg: {first} serves {names[first]}, {url} serves {served}: one model on both sides")


def parser() -> argparse.ArgumentParser:
    p = LadderParser(prog="python -m level6_serving.disagg", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill instances: level-6 servers started with a kv_producer TCPConnector")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode instances: level-6 servers started with a kv_consumer TCPConnector")
    p.add_argument("--host", default="127.0.0.1", help="the address the proxy listens on")
    p.add_argument("--port", type=int, default=8000, help="the port the proxy listens on")
    p.add_argument("--prefill-timeout", type=positive_float, default=30.0,
                   help="seconds a prefill instance has to answer before the decode side computes the prompt")
    return p


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    check_models(args.prefill, args.decode)
    uvicorn.run(build_disagg_app(args.prefill, args.decode, args.prefill_timeout), host=args.host, port=args.port,
                log_level="warning")  # fmt: skip


if __name__ == "__main__":
    main()


__all__ = ["build_disagg_app", "Pool", "splittable", "prefill_body", "check_models", "main"]
