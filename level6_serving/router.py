"""Data parallelism: several engine replicas behind one OpenAI endpoint, and the router that picks one.

What it is: `--data-parallel-size N` (`python -m level6_serving`) starts N replicas, each the
ordinary level-6 server in a process of its own (its own engine, possibly TP/PP, its own port
on localhost), and serves the same API in front of them:

    client ──> this process: the router                      replica 0 (its own process, engine, KV cache)
               read the body, pick a replica by policy ────> replica 1 ...
               stream its answer back as it comes
               /metrics: each replica's, labelled replica="i", and their sum (replica="all"; a share's mean)

    round-robin     the next live replica in turn
    least-loaded    the live replica with the fewest requests in flight from this router (its
                    running + waiting, as far as this router has put them there)
    prefix-aware    the replica most likely to hold the prompt's first blocks in its prefix cache:
                    each replica remembers the chained hashes of the 64-character chunks of the
                    prompts it was sent (bounded, least recently used forgotten first); a request
                    goes to the replica that matches most leading chunks, unless that replica has
                    BALANCE_SLACK more requests in flight than the least loaded (then the least
                    loaded, as SGLang's cache-aware router balances); no match: least loaded

A replica that stops answering is taken out of rotation and reported (/health stays 200 while one
replica lives; `ladder:dp_replicas_alive`): at once when its process exits (the router started it,
and polls it before each request), when it refuses a connection or breaks off an answer, after
HEALTH_FAILURES failed /health checks in a row otherwise, and it comes back if it answers again
(unless its process has exited). A refused connection means the request never started, so it goes
to the next live replica (outcome "refused" in `ladder:dp_requests_total`, never a 502). So does a
request whose replica's process died before any of its answer reached the client (outcome
"retried": the router started that process and sees it exit, so the request cannot run twice). A
request a replica was serving when it died otherwise fails cleanly: a 502 in OpenAI's error shape
(a replica that broke off and still runs; a whole answer is read before it is sent on, so a
truncated one is a 502 too), or, when its stream has started, an error event and `data: [DONE]`. A request's place in its replica's count is given back
once, however it ends (a client that leaves included).

What it is not: vLLM's in-process data parallelism (its API server talks to N engine cores over
ZMQ and balances on their own queue lengths), a router across machines, or a supervisor: a dead
replica is not restarted.

Reference: SGLang's router (`sgl-router`: cache-aware routing with an approximate radix tree per
worker, load-balance thresholds); vLLM `v1/engine/core_client.py` (DPLBAsyncMPClient).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import subprocess
from collections import OrderedDict, defaultdict

import httpx
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .http_client import post
from .metrics import CONTENT_TYPE

log = logging.getLogger("level6_serving")

POLICIES = ("round-robin", "least-loaded", "prefix-aware")
CHUNK_CHARS = 64  # the prefix-aware router's unit: a prompt's first characters, in chunks of this many
MAX_CHUNKS_PER_REPLICA = 100_000  # remembered chunk hashes per replica (LRU)
BALANCE_SLACK = 8  # prefix-aware: this many more in flight than the least loaded, and the match is ignored
HEALTH_S = 0.5  # how often the router checks that its replicas are up
HEALTH_FAILURES = 3  # checks in a row that must fail before a replica leaves rotation
EXIT_WAIT_S = 2.0  # a replica that broke off an answer: how long its process may take to be seen exiting


class Replica:
    def __init__(self, index: int, url: str, process=None):
        self.index, self.url = index, url
        self.process = process  # its Popen when this process started it (polled: a death is seen at once), or None
        self.alive = True
        self.in_flight = 0  # requests this router has sent and not yet seen end
        self.sent = 0  # requests this router has sent it, in all
        self.chunks: OrderedDict[bytes, None] = OrderedDict()  # prefix-aware: chunk hashes it was sent, LRU


def chunk_hashes(text: str) -> list[bytes]:
    """The chained hashes of `text`'s whole 64-character chunks (chunk i's hash covers chunks 0..i, as
    level 3 names its blocks: two prompts share hash i exactly when they share their first i+1 chunks)."""
    out, prev = [], b""
    for i in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        prev = hashlib.blake2b(prev + text[i : i + CHUNK_CHARS].encode(), digest_size=16).digest()
        out.append(prev)
    return out


class Router:
    """The policy: which live replica gets the next request. Pure bookkeeping (no I/O), so the tests
    can replay a recorded workload through it."""

    def __init__(self, replicas: list[Replica], policy: str = "prefix-aware"):
        if policy not in POLICIES:
            raise ValueError(f"router policy {policy!r} must be one of {', '.join(POLICIES)}")
        self.replicas, self.policy = replicas, policy
        self._turn = itertools.count()

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def choose(self, prompt_text: str) -> Replica:
        """The replica for a request whose prompt reads `prompt_text`; raises LookupError if none is alive."""
        live = self.live()
        if not live:
            raise LookupError("no replica is alive")
        if self.policy == "round-robin":
            return live[next(self._turn) % len(live)]
        least = min(live, key=lambda r: (r.in_flight, r.sent))
        if self.policy == "least-loaded":
            return least
        hashes = chunk_hashes(prompt_text)
        best, best_match = least, 0
        for r in live:
            match = next((i for i, h in enumerate(hashes) if h not in r.chunks), len(hashes))
            if match > best_match or (match == best_match and match and r.in_flight < best.in_flight):
                best, best_match = r, match
        if best_match == 0 or best.in_flight - least.in_flight >= BALANCE_SLACK:
            best = least  # nothing to reuse, or the holder of the prefix is too busy
        self.remember(best, hashes)
        return best

    @staticmethod
    def remember(replica: Replica, hashes: list[bytes]) -> None:
        for h in hashes:
            replica.chunks[h] = None
            replica.chunks.move_to_end(h)
        while len(replica.chunks) > MAX_CHUNKS_PER_REPLICA:
            replica.chunks.popitem(last=False)


def prompt_text(body: dict) -> str:
    """What the prefix-aware router hashes: the prompt (its first one), or the chat messages in order."""
    if "messages" in body and isinstance(body["messages"], list):
        return "".join(f"{m.get('role', '')}:{m.get('content', '')}\n" for m in body["messages"] if isinstance(m, dict))
    p = body.get("prompt", "")
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        p = p[0]  # several prompts: the first decides
    if isinstance(p, list):
        return ",".join(map(str, p))  # token ids hash as text too
    return p if isinstance(p, str) else ""


def error(status: int, message: str, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "replica_error" if status >= 500 else "invalid_request_error",
                                   "param": None, "code": code}}, status_code=status)  # fmt: skip


class Release:
    """A replica's in-flight count, given back once, with the request's outcome counted (a request can
    end in its relay, before its relay ever runs, or in the handler: whichever comes first counts)."""

    def __init__(self, replica: Replica, counts: dict):
        self.replica, self.counts, self.released = replica, counts, False
        replica.in_flight += 1
        replica.sent += 1

    def __call__(self, outcome: str) -> None:
        if not self.released:
            self.released = True
            self.replica.in_flight -= 1
            self.counts[self.replica.index, outcome] += 1


class Answer:
    """A replica's answer as the router holds it: whose (`replica`, and `done` to give its place back), the
    status and headers to send on, and the body: `whole` (read already), or `pieces` still to come (a stream)."""

    def __init__(self, replica: Replica, done: Release, status: int, headers: dict, pieces, whole: bytes | None = None):
        self.replica, self.done, self.status, self.headers, self.pieces, self.whole = (
            replica, done, status, headers, pieces, whole)  # fmt: skip

    def take(self, other: Answer) -> None:
        """Go on with another replica's answer (the first one's died before its stream began)."""
        self.replica, self.done, self.pieces = other.replica, other.done, other.pieces


class Refusal(Exception):
    """No replica can answer this request: the response to send instead (a 502 or a 503)."""

    def __init__(self, response: JSONResponse):
        self.response = response


class Relayed(StreamingResponse):
    """A streamed answer that releases its replica however the response ends: Starlette cancels a
    StreamingResponse whose client has gone, sometimes before its body generator has started (whose
    own `finally` then never runs). `answer` is read at the end: the replica answering by then."""

    def __init__(self, content, answer: Answer):
        super().__init__(content, status_code=answer.status, headers=answer.headers)
        self.answer = answer

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.answer.done("ok")  # a no-op if the relay already counted a failure
            await self.answer.pieces.aclose()


def build_router_app(urls: list[str], policy: str, api_key: str | None = None,
                     max_request_body_bytes: int = 8 << 20, processes: list | None = None) -> FastAPI:  # fmt: skip
    """The front end over replicas at `urls` (already up). Requests go through as they are (the API key too:
    each replica checks it); only what the router itself answers (/health, /metrics) is open. `processes`:
    the replicas' Popen objects, when this process is their parent (`python -m level6_serving`)."""
    replicas = [Replica(i, u, p) for i, (u, p) in enumerate(zip(urls, processes or [None] * len(urls)))]
    router = Router(replicas, policy)
    client: httpx.AsyncClient | None = None
    counts: dict[tuple[int, str], int] = defaultdict(int)  # (replica, outcome) -> requests

    async def watch():
        """Take a replica out of rotation after HEALTH_FAILURES /health checks in a row fail, and put it
        back once it answers again (a slow moment is not a death; a dead process never answers)."""
        failures = defaultdict(int)
        while True:
            check_processes()
            for r in replicas:
                if r.process is not None and r.process.poll() is not None:
                    continue  # gone for good: no /health check brings it back
                if await healthy(r):
                    failures[r.index] = 0
                    if not r.alive:
                        r.alive = True
                        log.warning("replica %d (%s) answers again: back in rotation", r.index, r.url)
                else:
                    failures[r.index] += 1
                    if failures[r.index] >= HEALTH_FAILURES:
                        mark_dead(r, f"{HEALTH_FAILURES} /health checks in a row failed")
            await asyncio.sleep(HEALTH_S)

    async def healthy(r: Replica) -> bool:
        try:
            return (await client.get(r.url + "/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    def check_processes() -> None:
        """A replica whose process has exited leaves rotation now, before a request is sent to it (a waitpid
        that does not wait: microseconds, so every request can afford it)."""
        for r in replicas:
            if r.alive and r.process is not None and r.process.poll() is not None:
                mark_dead(r, f"its process exited (status {r.process.returncode})")

    async def exited(r: Replica) -> bool:
        """Whether a replica that broke off a connection is dead: its process (when this one started it) exits
        within EXIT_WAIT_S. A killed process closes its sockets first and is reaped just after; the margin is
        for a busy machine."""
        if r.process is None:
            return False
        try:
            await asyncio.to_thread(r.process.wait, EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            return False
        return True

    def mark_dead(r: Replica, why: str) -> None:
        if r.alive:
            r.alive = False
            log.error("replica %d (%s) is out of rotation: %s; %d live", r.index, r.url, why, len(router.live()))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal client
        client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), limits=httpx.Limits(max_connections=None))
        task = asyncio.ensure_future(watch())
        try:
            yield
        finally:
            task.cancel()
            await client.aclose()

    app = FastAPI(title="inference-ladder data-parallel router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.router, app.state.replicas = router, replicas

    async def forward(raw: Request, path: str) -> Response:
        body = await raw.body()
        if len(body) > max_request_body_bytes:
            return error(413, f"the request body is larger than this server accepts ({max_request_body_bytes} bytes)")
        try:
            parsed = json.loads(body) if body else {}
        except ValueError:
            parsed = {}  # the replica answers the 400 in its own words
        text = prompt_text(parsed if isinstance(parsed, dict) else {})
        headers = {k: v for k, v in raw.headers.items() if k.lower() in ("authorization", "content-type")}
        try:
            now = await answer_from_a_replica(path, body, headers, text)
        except Refusal as e:
            return e.response
        if now.whole is not None:
            return Response(now.whole, status_code=now.status, headers=now.headers)

        async def relay():
            started = False  # has the client had a byte of the body? Until then, another replica may answer
            while True:
                try:
                    async for piece in now.pieces:
                        started = True
                        yield piece
                    return
                except (OSError, asyncio.IncompleteReadError, ValueError) as e:  # the replica went away mid-answer
                    await now.pieces.aclose()
                    if not started and await exited(now.replica):  # the client has the headers, nothing else
                        now.done("retried")
                        mark_dead(now.replica, f"its process exited before its stream began ({e!r})")
                        try:
                            again = await answer_from_a_replica(path, body, headers, text)
                        except Refusal as refusal:
                            yield f"data: {refusal.response.body.decode()}\n\ndata: [DONE]\n\n".encode()
                            return
                        now.take(again)
                        if again.whole is not None:  # not a stream (an error: overloaded, ...): said as an event
                            yield b"data: " + again.whole + b"\n\ndata: [DONE]\n\n"
                            return
                        continue
                    now.done("failed")
                    mark_dead(now.replica, f"it dropped a response ({e!r})")
                    err = {"error": {"message": f"replica {now.replica.index} failed mid-stream: {e!r}",
                                     "type": "replica_error", "param": None, "code": "replica_failed"}}  # fmt: skip
                    yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
                    return

        return Relayed(relay(), now)

    async def answer_from_a_replica(path: str, body: bytes, headers: dict, text: str) -> Answer:
        """A live replica's answer to a request: its status and headers, then its body whole or (a stream) its
        pieces to come. A replica that refuses the connection, or whose process dies before it answers, is
        taken out of rotation and the next live one is asked. Raises Refusal: no replica alive (503), or one
        that broke off and may still be running the request (502: sending it again could run it twice)."""
        while True:
            check_processes()
            try:
                r = router.choose(text)
            except LookupError:
                raise Refusal(error(503, "no replica is alive", "no_replica")) from None
            done = Release(r, counts)  # the in-flight count comes back exactly once, however this request ends
            pieces = post(r.url + path, body, headers)  # status, headers, then the body's pieces
            try:
                status, got = await anext(pieces), await anext(pieces)
                keep = {k: v for k, v in got.items() if k in ("content-type", "retry-after")}
                if got.get("content-type", "").startswith("text/event-stream"):
                    return Answer(r, done, status, keep, pieces)
                # a whole answer: read it all first, so a replica that breaks off is never half an answer
                whole = b"".join([piece async for piece in pieces])
                done("ok")
                return Answer(r, done, status, keep, pieces, whole)
            except ConnectionRefusedError as e:  # nothing reached it, so the request never started: send it again
                done("refused")
                await pieces.aclose()
                mark_dead(r, f"it refused a connection ({e!r})")
            except (OSError, asyncio.IncompleteReadError, ValueError, StopAsyncIteration) as e:
                await pieces.aclose()
                if await exited(r):  # nothing of it reached the client, and its replica can no longer run it
                    done("retried")
                    mark_dead(r, f"its process exited while answering ({e!r})")
                    continue
                done("failed")  # it may still be running there: sending it again could run it twice
                mark_dead(r, f"it failed a request ({e!r})")
                raise Refusal(error(502, f"replica {r.index} failed before answering in full: {e!r}",
                                    "replica_failed")) from None  # fmt: skip
            except BaseException:  # the client left while we waited (a cancelled handler): nothing to send
                done("abandoned")
                await pieces.aclose()
                raise

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await forward(raw, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await forward(raw, "/v1/chat/completions")

    def passthrough(path: str, method: str):
        """A route any live replica answers the same (the model list, the tokenizer)."""

        async def route(raw: Request) -> Response:
            check_processes()
            headers = {k: v for k, v in raw.headers.items() if k.lower() in ("authorization", "content-type")}
            for r in router.live():
                try:
                    resp = await client.request(method, r.url + path, content=await raw.body(), headers=headers)
                except httpx.ConnectError as e:  # the request never reached it: ask the next one
                    mark_dead(r, f"it refused a connection ({e!r})")
                    continue
                except httpx.HTTPError as e:
                    mark_dead(r, f"a request could not reach it ({e!r})")
                    return error(502, f"replica {r.index} failed: {e!r}", "replica_failed")
                return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))
            return error(503, "no replica is alive", "no_replica")

        app.add_api_route(path, route, methods=[method])

    for path, method in (("/v1/models", "GET"), ("/version", "GET"), ("/tokenize", "POST"), ("/detokenize", "POST"),
                         ("/tokenizer_info", "GET"), ("/openapi.json", "GET")):  # fmt: skip
        passthrough(path, method)  # /openapi.json: the replicas' API is this endpoint's API

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if router.live() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        texts = await asyncio.gather(*(replica_metrics(r) for r in replicas))
        lines = merge_metrics(texts)
        lines.append("# TYPE ladder:dp_replicas_alive gauge")
        lines.append(f"ladder:dp_replicas_alive {len(router.live())}")
        lines.append("# TYPE ladder:dp_requests_total counter")
        for (i, outcome), n in sorted(counts.items()):
            lines.append(f'ladder:dp_requests_total{{replica="{i}",outcome="{outcome}"}} {n}')
        return Response("\n".join(lines) + "\n", media_type=CONTENT_TYPE)

    async def replica_metrics(r: Replica) -> str | None:
        if not r.alive:
            return None
        try:
            return (await client.get(r.url + "/metrics", timeout=10.0)).text
        except httpx.HTTPError:
            return None

    return app


def merge_metrics(texts: list[str | None]) -> list[str]:
    """Each replica's samples with a `replica="i"` label, then their sum per series (`replica="all"`; the
    mean for a share, `*_perc`), family by family: a family's `# HELP`/`# TYPE` lines once, then all its
    samples together (the text format wants a family's lines in one group). A replica that did not
    answer is left out."""
    families: dict[str, dict] = {}  # family -> {"head": [lines], "samples": [lines], "sums": {series: [sum, n]}}
    for i, text in enumerate(texts):
        if text is None:
            continue
        family = None
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                f = families.setdefault(family, {"head": [], "samples": [], "sums": {}})
                if line not in f["head"]:
                    f["head"].append(line)
                continue
            if line.startswith("#"):
                continue
            series, _, value = line.rpartition(" ")
            name, _, labels = series.partition("{")
            labels = labels.rstrip("}")
            if family is None or not name.startswith(family):  # a sample with no header of its own
                family = name
            f = families.setdefault(family, {"head": [], "samples": [], "sums": {}})
            f["samples"].append(f'{name}{{replica="{i}"{"," + labels if labels else ""}}} {value}')
            total = f["sums"].setdefault((name, labels), [0.0, 0])
            total[0] += float(value)
            total[1] += 1
    out = []
    for f in families.values():
        out += f["head"] + f["samples"]
        for (name, labels), (total, n) in f["sums"].items():
            value = total / n if name.endswith("_perc") else total
            out.append(f'{name}{{replica="all"{"," + labels if labels else ""}}} {value}')
    return out
