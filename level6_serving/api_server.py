"""The HTTP server: FastAPI routes, API keys, errors in OpenAI's shape, and a shutdown that drains.

What it is: `build_app(engine, ...)`, the ASGI app, and `Server`, uvicorn with a
SIGTERM (or Ctrl-C) that drains instead of cutting streams:

    SIGTERM ─> stop accepting (uvicorn closes the listening socket; /health says 503, and a
               request on a kept-alive connection gets 503 + Retry-After)
            ─> requests in flight run to their end, for up to --drain-timeout seconds
            ─> whatever is left is aborted: its stream ends with finish_reason "abort" + [DONE]
            ─> the engine thread stops; the process exits 0 (a second Ctrl-C quits at once,
               skipping the engine's shutdown: exit status 130; a request still waiting for
               its answer gets 503 "the server is shutting down", ShutdownAnswers)

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (`serving.py`),
`GET /v1/models`, `GET /health`, `GET /version`, `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`,
`GET /metrics` (`metrics.py`), `GET /openapi.json` and `/docs`, which describe the real
request bodies (`openapi.py`), and the live dashboard, `GET /dashboard` and its event stream
(`dashboard.py`; off with `dashboard_on=False`). With `api_key`, every route but OPEN_PATHS
needs `Authorization: Bearer <key>` (401 otherwise): the dashboard's page loads without it
and asks for the key, which its event stream and prompts then send. Every error, a 404 for an unknown route
included, is `{"error": {"message", "type", "param", "code"}}`.

Three plain ASGI middlewares wrap the routes (Starlette's BaseHTTPMiddleware would sit
between a stream and its disconnect), outermost first:

    (ShutdownAnswers, outside them all, added by Server: a handler cancelled because the server
    quits at once answers 503, "the server is shutting down", not uvicorn's plain-text 500)
    BodySizeLimit   a body over max_request_body_bytes: 413 before it is read (Content-Length),
                    or as soon as the bytes received pass it (chunked); memory stays bounded
    APIKeyMiddleware
    InternalErrors  an exception inside one request: a 500 for that request only, on a
                    connection that stays usable (Starlette's own handler re-raises after its
                    500, and uvicorn then drops the kept-alive connection without a word)

A dead engine (a worker rank killed, a step that could not be recovered) makes `/health`
503 at once, and every request 503 with `Retry-After` and the reason (which rank, its exit
code); with `exit_on_engine_death` the server then drains and the process exits 1, so a
supervisor restarts it.

`ServerThread` runs the same server on a background thread, on a port the OS picks:
what the tests, the docs and `benchmarks.serving` use. Both serve an app with no engine of its
own too (the data-parallel router, `benchmarks.watch`'s dashboard): their drain is then plain
uvicorn's graceful shutdown.

What it is not: a production gateway (no TLS, no rate limits per key, no CORS).

Reference: vLLM `entrypoints/openai/api_server.py` (routes, `--api-key`, /health,
/version, /tokenize); uvicorn's graceful shutdown.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import itertools
import json
import logging
import secrets
import signal
import socket
import threading
from importlib import metadata

import uvicorn
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from ladder import rooms

from . import dashboard, metrics, openapi
from .async_engine import AsyncLLMEngine, EngineDeadError
from .defaults import KEEP_ALIVE_S, MAX_REQUEST_BODY_BYTES
from .protocol import APIError, DetokenizeRequest, TokenizeRequest
from .serving import OpenAIServing, engine_unavailable, tokenizer_info, too_long

log = logging.getLogger("level6_serving")

# load balancers, Prometheus, readers; the dashboard's page, which holds no data and asks for the key itself
OPEN_PATHS = ("/health", "/metrics", "/version", "/openapi.json", "/docs", *dashboard.PAGES)


class BodyTooLarge(Exception):
    """Raised inside `receive` once a chunked body passes the limit (BodySizeLimit answers 413)."""


class TrackedSend:
    """An ASGI `send` that remembers whether the response has started: before, an error can still
    be answered with a response of its own; after, the status line is gone."""

    def __init__(self, send):
        self.send, self.started = send, False

    async def __call__(self, message) -> None:
        self.started |= message["type"] == "http.response.start"
        await self.send(message)


def respond(error: APIError, scope, receive, send, close: bool = False):
    headers = {**(error.headers or {}), **({"Connection": "close"} if close else {})}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)


class BodySizeLimit:
    """413 for a body over `max_bytes`, read no further than the limit."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server accepts ({self.max_bytes} bytes; "
                             "--max-request-body-bytes)", None, "request_too_large")  # fmt: skip

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await respond(self.too_large(), scope, receive, send, close=True)  # the body is never read
        received, tracked = 0, TrackedSend(send)

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge
            return message

        try:
            await self.app(scope, counting_receive, tracked)
        except BodyTooLarge:
            if tracked.started:
                raise
            await respond(self.too_large(), scope, receive, send, close=True)


class InternalErrors:
    """An unexpected exception: logged, and a 500 in OpenAI's shape for that request alone."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        tracked = TrackedSend(send)
        try:
            await self.app(scope, receive, tracked)
        except BodyTooLarge:
            raise  # BodySizeLimit's to answer
        except ClientDisconnect:
            return  # the client left in the middle of its upload: nobody to answer, nothing to log
        except Exception as e:
            log.exception("request %s %s failed", scope.get("method"), scope.get("path"))
            if tracked.started:  # a stream already under way: nothing can be said any more; the connection ends
                raise
            await respond(APIError(500, f"internal error: {e!r}"), scope, receive, send)


class ShutdownAnswers:
    """Outside everything, under uvicorn: a request cut off because the server quits at once (a second
    Ctrl-C: uvicorn stops waiting, and asyncio cancels the handlers still running) gets a 503 in
    OpenAI's shape, "the server is shutting down", if its response has not started (uvicorn's own
    answer to a cancelled handler is a plain-text 500). Only while the server is exiting: a
    cancellation at any other time is not ours to answer."""

    def __init__(self, app, server: uvicorn.Server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        tracked = TrackedSend(send)
        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if tracked.started or not self.server.should_exit:
                raise
            # Not re-raised: the answer is whole, and uvicorn would log a traceback for it.
            err = APIError(503, "the server is shutting down", code="server_shutting_down")
            await respond(err, scope, receive, send, close=True)


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>`, on every path but OPEN_PATHS. The scheme's name is
    case-insensitive (RFC 7235: `bearer`, `BEARER`); the key is not."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
            if not (secrets.compare_digest(given.strip(), self.expected)  # constant time: no timing oracle
                    and scheme.lower() == b"bearer"):  # fmt: skip
                err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")  # fmt: skip
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLMEngine, served_model_names: list[str], *, api_key: str | None = None,
              max_num_waiting: int = 1024, max_n: int | None = None,
              max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES, dashboard_on: bool = True,
              lora_modules: dict[str, str] | None = None) -> FastAPI:  # fmt: skip
    """The ASGI app over a (not yet started) AsyncLLMEngine; the app's lifespan starts and stops it.
    `dashboard_on`: serve the live dashboard at /dashboard (dashboard.py). `lora_modules`: {name: PEFT
    folder} of the LoRA adapters served from the start (an engine with enable_lora=True); a request's
    `model` picks one by name; /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time."""
    serving = OpenAIServing(engine, served_model_names, max_num_waiting, max_n or engine.max_num_seqs)
    lora_ids, loading = itertools.count(1), set()  # adapter ids never reused; names being loaded
    for name, path in (lora_modules or {}).items():  # read and checked now (the engine thread has not started)
        if getattr(engine.engine, "lora", None) is None:
            raise ValueError("lora_modules needs an engine with enable_lora=True")
        if name in served_model_names:
            raise ValueError(f"{name!r} is the served model's own name")
        serving.loras[name] = rooms.export("LoRARequest")(name, next(lora_ids), path)
        engine.engine.lora.adapter(serving.loras[name])
    hub = None
    if dashboard_on:  # the feed joins the engine's observers before the engine thread starts
        feed = dashboard.DashboardFeed().attach(engine.engine)
        info = dashboard.engine_info(engine.engine, served_model_names[0], "server", completions=True)
        # Streams end when the server drains; a dead engine's page keeps its last frame (refreshes fail quietly).
        hub = dashboard.DashboardHub(feed, info, refresh=lambda: engine.call(feed.capture),
                                     closing=lambda: serving.draining)  # fmt: skip

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if hub is not None:
            hub.start(asyncio.get_running_loop())
        engine.start()
        try:
            yield
        finally:
            drain = getattr(app.state, "drain_task", None)
            if drain is not None:  # uvicorn may get here first; the drain's count is logged before the engine stops
                await drain
            await engine.shutdown()  # aborts what is left and joins the engine thread

    app = FastAPI(title="inference-ladder level 6", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving, app.state.engine, app.state.dashboard = serving, engine, hub
    app.openapi = lambda: openapi.schema(app)
    app.add_middleware(InternalErrors)  # added first: the innermost of the three
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError):
        err = engine_unavailable(engine)
        return JSONResponse(err.body(), status_code=503, headers=err.headers)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException):  # 404, 405 (its Allow header kept), ...
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code,
                            headers=e.headers)  # fmt: skip

    @app.post("/v1/completions", openapi_extra=openapi.body("CompletionRequest", "CompletionResponse", stream=True))
    async def completions(raw: Request) -> Response:
        return await serving.completions(raw)

    @app.post("/v1/chat/completions",
              openapi_extra=openapi.body("ChatCompletionRequest", "ChatCompletionResponse", stream=True))  # fmt: skip
    async def chat_completions(raw: Request) -> Response:
        return await serving.chat(raw)

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)

    @app.get("/v1/models", openapi_extra=openapi.answer("ModelList"))
    async def models():
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "inference-ladder",
                 "root": str(engine.model_path), "max_model_len": engine.max_model_len}
                for name in served_model_names]  # fmt: skip
        data += [{"id": name, "object": "model", "created": 0, "owned_by": "inference-ladder", "root": lora.lora_path,
                  "parent": served_model_names[0], "max_model_len": engine.max_model_len}
                 for name, lora in serving.loras.items()]  # fmt: skip
        return {"object": "list", "data": data}

    async def lora_body(raw: Request, *keys: str) -> dict:
        if getattr(engine.engine, "lora", None) is None:
            raise APIError(400, "this server has no LoRA (start it with --enable-lora)", None)
        try:
            body = json.loads(await raw.body())
        except ValueError:
            body = None
        if not isinstance(body, dict) or not all(isinstance(body.get(k), str) and body.get(k) for k in keys):
            raise APIError(400, f"the body must be a JSON object with {' and '.join(keys)} (strings)", keys[0])
        return body

    has_lora = getattr(engine.engine, "lora", None) is not None  # (the LoRA routes are documented only then)

    @app.post("/v1/load_lora_adapter", include_in_schema=has_lora, openapi_extra=openapi.lora_route("LoadLoRAAdapterRequest"))
    async def load_lora_adapter(raw: Request):
        """vLLM's: {"lora_name", "lora_path"} -> the adapter, read and checked now, served under its name."""
        body = await lora_body(raw, "lora_name", "lora_path")
        name = body["lora_name"]
        if name in serving.loras or name in served_model_names or name in loading:
            raise APIError(400, f"a model named {name!r} is already served", "lora_name")
        lora = rooms.export("LoRARequest")(name, next(lora_ids), body["lora_path"])
        loading.add(name)  # claimed before the wait: a second load of the name meanwhile is refused
        try:
            await engine.call(lambda e: e.lora.adapter(lora))  # read and checked on the engine's thread
        except ValueError as e:
            raise APIError(400, str(e), "lora_path") from None
        finally:
            loading.discard(name)
        serving.loras[name] = lora
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", include_in_schema=has_lora,
              openapi_extra=openapi.lora_route("UnloadLoRAAdapterRequest"))  # fmt: skip
    async def unload_lora_adapter(raw: Request):
        """vLLM's: {"lora_name"} -> no longer served (requests already running on it finish)."""
        name = (await lora_body(raw, "lora_name"))["lora_name"]
        if serving.loras.pop(name, None) is None:
            raise APIError(404, f"no LoRA adapter named {name!r} is served", "lora_name", "model_not_found")
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    @app.get("/health", response_class=Response, responses={200: {"description": "serving", "content": None},
             503: {"description": "shutting down, or the engine is dead", "content": None}})  # fmt: skip
    async def health():
        ok = engine.is_running and not serving.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/version", openapi_extra=openapi.answer("Version"))
    async def version():
        try:
            v = metadata.version("inference-ladder")
        except metadata.PackageNotFoundError:
            v = "unknown"
        return {"version": v}

    @app.post("/tokenize", openapi_extra=openapi.body("TokenizeRequest", "TokenizeResponse"))
    async def tokenize(raw: Request):
        req: TokenizeRequest = await serving.parse(TokenizeRequest, raw)
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            try:
                ids = await engine.apply_chat_template([m.as_template_input() for m in req.messages])
            except ValueError as e:
                raise APIError(400, str(e), "messages", too_long(e)) from None
        else:
            if len(req.prompt) > engine.max_prompt_chars:
                raise APIError(400, f"prompt has {len(req.prompt)} characters; this server tokenizes at most "
                                    f"{engine.max_prompt_chars} (what {engine.max_model_len} tokens can hold)",
                               "prompt")  # fmt: skip
            special = req.add_special_tokens is not False
            ids = await engine.run_on_frontend(lambda: engine.tokenizer(req.prompt, add_special_tokens=special))
            ids = ids["input_ids"]
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.get("/tokenizer_info", openapi_extra=openapi.answer("TokenizerInfo"))
    async def show_tokenizer_info():
        """vLLM's: the tokenizer's configuration, as its tokenizer_config.json would say it (lm-evaluation-harness'
        `tokenizer_backend=remote` reads it)."""
        if engine.tokenizer is None:
            raise APIError(404, "this model has no tokenizer (it was loaded without one)")
        return tokenizer_info(engine.tokenizer)

    @app.post("/detokenize", openapi_extra=openapi.body("DetokenizeRequest", "DetokenizeResponse"))
    async def detokenize(raw: Request):
        req: DetokenizeRequest = await serving.parse(DetokenizeRequest, raw)
        serving.check_model(req.model)
        vocab = engine.model_config.vocab_size
        # On the front-end thread: an 8 MiB body holds millions of ids, and checking them takes a while.
        bad = await engine.run_on_frontend(lambda: [t for t in req.tokens if not 0 <= t < vocab][:5])
        if bad:
            raise APIError(400, f"tokens {bad} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": await engine.decode(req.tokens)}

    if hub is not None:
        dashboard.add_routes(app, hub, needs_key=bool(api_key))

    @app.get("/metrics", response_class=PlainTextResponse)  # Prometheus' text format
    async def prometheus():
        records = await engine.get_metrics()  # a snapshot taken on the engine thread, between steps
        return Response(metrics.render(records, served_model_names[0]), media_type=metrics.CONTENT_TYPE)

    return app


class Server(uvicorn.Server):
    """uvicorn, but SIGTERM / Ctrl-C drain the engine and the process exits 0.

    (uvicorn's own handler re-raises the signal after its shutdown, so the process would
    die by SIGTERM, exit status 143, however cleanly it drained.)"""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float, exit_on_engine_death: bool = False):
        config.app = ShutdownAnswers(config.app, self)  # before uvicorn loads it (in serve())
        super().__init__(config)
        self.app, self.drain_timeout, self.exit_on_engine_death = app, drain_timeout, exit_on_engine_death
        self.drain_task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.engine_died = False  # the process should exit non-zero: the engine died under it
        self._watch: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)  # runs the app's lifespan, which starts the engine
        if self.exit_on_engine_death and not self.should_exit:
            self._watch = asyncio.ensure_future(self._exit_when_the_engine_dies())

    async def shutdown(self, sockets=None) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await super().shutdown(sockets)

    async def _exit_when_the_engine_dies(self) -> None:
        engine: AsyncLLMEngine = self.app.state.engine
        await engine.died.wait()
        log.error("the engine is dead (%s): draining, then exiting with status 1", engine.dead)
        self.engine_died = True
        self.drain()

    @contextlib.contextmanager
    def capture_signals(self):
        self.loop = asyncio.get_running_loop()
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only (a ServerThread is stopped with drain())
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig, frame) -> None:
        if self.should_exit:
            self.force_exit = sig == signal.SIGINT  # a second Ctrl-C: stop waiting
            return
        self.loop.call_soon_threadsafe(self.drain)

    def drain(self) -> None:
        """Stop accepting, let requests finish (up to drain_timeout), abort the rest, exit."""
        if self.drain_task is not None:
            return
        serving: OpenAIServing | None = getattr(self.app.state, "serving", None)
        if serving is None:  # an app with no engine of its own (the data-parallel router, a dashboard alone)
            self.should_exit = True  # uvicorn stops accepting and waits for open responses
            return
        serving.draining = True
        self.should_exit = True  # uvicorn closes the listening socket and waits for open responses
        log.info("draining: %d requests in flight, up to %.1f s", serving.engine.num_unfinished, self.drain_timeout)

        async def drain():
            aborted = await serving.engine.drain(self.drain_timeout)
            log.info("drained (%d requests aborted at the deadline)", aborted)

        self.drain_task = self.app.state.drain_task = asyncio.ensure_future(drain())


def make_server(app: FastAPI, drain_timeout: float = 30.0, log_level: str = "info", access_log: bool = True,
                timeout_keep_alive: float = KEEP_ALIVE_S, exit_on_engine_death: bool = False) -> Server:  # fmt: skip
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_keep_alive=timeout_keep_alive,
                            timeout_graceful_shutdown=int(drain_timeout) + 10)  # a backstop after the drain  # fmt: skip
    return Server(config, app, drain_timeout, exit_on_engine_death)


def freeze_startup_heap() -> int:
    """Collect once, then freeze what is alive (`gc.freeze`): the imports, the model and the engine leave
    every later full collection's walk, which holds the GIL (0.2 s -> 2 ms here: docs/level6_serving.md).
    A cycle among frozen objects is never collected: fine for what lives as long as the server. Called
    by `python -m level6_serving` before it serves, not by `ServerThread` (a test's or a notebook's
    process is not the server's to freeze). Returns how many objects were frozen.

    Unfrozen again at exit: the interpreter's last collection skips frozen objects, so Triton's
    nanobind objects would still be alive when nanobind checks for leaks, and it would print some 30
    lines of `nanobind: leaked ...` after every clean shutdown (atexit runs before that check)."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: one the OS picks, so two servers never race for a port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, reuse_port=False)


class ServerThread:
    """`with ServerThread(app) as url:` runs the server on a background thread, on a free port."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, drain_timeout: float = 10.0):
        self.sock = bind(host, port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = make_server(app, drain_timeout, log_level="warning", access_log=False)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, name="uvicorn",
                                       daemon=True)  # fmt: skip

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread died while starting (see the log above)")
            self.thread.join(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout: float = 30.0) -> None:
        if self.thread.is_alive() and self.server.loop is not None:
            self.server.loop.call_soon_threadsafe(self.server.drain)
            self.thread.join(timeout)
        self.sock.close()
