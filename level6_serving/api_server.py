"""The HTTP server: FastAPI routes, API keys, errors in OpenAI's shape, and a shutdown that drains.

What it is: `build_app(engine, ...)`, the ASGI app, and `Server`, uvicorn with a
SIGTERM (or Ctrl-C) that drains instead of cutting streams:

    SIGTERM ─> stop accepting (uvicorn closes the listening socket; /health says 503, and a
               request on a kept-alive connection gets 503 + Retry-After)
            ─> requests in flight run to their end, for up to --drain-timeout seconds
            ─> whatever is left is aborted: its stream ends with finish_reason "abort" + [DONE]
            ─> the engine thread stops; the process exits 0 (a second Ctrl-C quits at once,
               skipping the engine's shutdown: exit status 130)

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (`serving.py`),
`GET /v1/models`, `GET /health`, `GET /version`, `POST /tokenize`, `POST /detokenize`,
`GET /metrics` (`metrics.py`). With `api_key`, every route but `/health`, `/metrics` and
`/version` needs `Authorization: Bearer <key>` (401 otherwise), checked by a plain ASGI
middleware (Starlette's BaseHTTPMiddleware would sit between a stream and its
disconnect). Every error, a 404 for an unknown route included, is
`{"error": {"message", "type", "param", "code"}}`; an exception inside one request is a
500 for that request only.

`ServerThread` runs the same server on a background thread, on a port the OS picks:
what the tests, the docs and `benchmarks.serving` use.

What it is not: a production gateway (no TLS, no rate limits per key, no CORS).

Reference: vLLM `entrypoints/openai/api_server.py` (routes, `--api-key`, /health,
/version, /tokenize); uvicorn's graceful shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import socket
import threading
from importlib import metadata

import uvicorn
from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import metrics
from .async_engine import AsyncLLMEngine, EngineDeadError
from .protocol import APIError, DetokenizeRequest, TokenizeRequest, parse_body
from .serving import OpenAIServing

log = logging.getLogger("level6_serving")

OPEN_PATHS = ("/health", "/metrics", "/version")  # load balancers and Prometheus need no key


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>`, on every path but OPEN_PATHS."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):  # constant time: no timing oracle
                err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                               code="invalid_api_key")  # fmt: skip
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncLLMEngine, served_model_names: list[str], *, api_key: str | None = None,
              max_num_waiting: int = 1024, max_n: int | None = None) -> FastAPI:  # fmt: skip
    """The ASGI app over a (not yet started) AsyncLLMEngine; the app's lifespan starts and stops it."""
    serving = OpenAIServing(engine, served_model_names, max_num_waiting, max_n or engine.engine.config.max_num_seqs)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            drain = getattr(app.state, "drain_task", None)
            if drain is not None:  # uvicorn may get here first; the drain's count is logged before the engine stops
                await drain
            await engine.shutdown()  # aborts what is left and joins the engine thread

    app = FastAPI(title="inference-ladder level 6", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.serving, app.state.engine = serving, engine
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError):
        return JSONResponse(APIError(503, str(e)).body(), status_code=503)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        log.exception("request %s %s failed", request.method, request.url.path)
        return JSONResponse(APIError(500, f"internal error: {e!r}").body(), status_code=500)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await serving.completions(raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await serving.chat(raw)

    @app.get("/v1/models")
    async def models():
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "inference-ladder",
                 "root": str(engine.engine.loaded.path), "max_model_len": engine.max_model_len}
                for name in served_model_names]  # fmt: skip
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        ok = engine.is_running and not serving.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/version")
    async def version():
        try:
            v = metadata.version("inference-ladder")
        except metadata.PackageNotFoundError:
            v = "unknown"
        return {"version": v}

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        req: TokenizeRequest = parse_body(TokenizeRequest, await raw.body())
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            try:
                ids = engine.inputs.apply_chat_template([m.as_template_input() for m in req.messages])
            except ValueError as e:
                raise APIError(400, str(e), "messages") from None
        else:
            ids = engine.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        req: DetokenizeRequest = parse_body(DetokenizeRequest, await raw.body())
        serving.check_model(req.model)
        vocab = engine.engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", "tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.get("/metrics")
    async def prometheus():
        records = await engine.get_metrics()  # a snapshot taken on the engine thread, between steps
        return Response(metrics.render(records, served_model_names[0]), media_type=metrics.CONTENT_TYPE)

    return app


class Server(uvicorn.Server):
    """uvicorn, but SIGTERM / Ctrl-C drain the engine and the process exits 0.

    (uvicorn's own handler re-raises the signal after its shutdown, so the process would
    die by SIGTERM, exit status 143, however cleanly it drained.)"""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float):
        super().__init__(config)
        self.app, self.drain_timeout = app, drain_timeout
        self.drain_task: asyncio.Task | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

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
        serving: OpenAIServing = self.app.state.serving
        serving.draining = True
        self.should_exit = True  # uvicorn closes the listening socket and waits for open responses
        log.info("draining: %d requests in flight, up to %.1f s", serving.engine.num_unfinished, self.drain_timeout)

        async def drain():
            aborted = await serving.engine.drain(self.drain_timeout)
            log.info("drained (%d requests aborted at the deadline)", aborted)

        self.drain_task = self.app.state.drain_task = asyncio.ensure_future(drain())


def make_server(app: FastAPI, drain_timeout: float = 30.0, log_level: str = "info", access_log: bool = True) -> Server:
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=int(drain_timeout) + 10)  # a backstop after the drain  # fmt: skip
    return Server(config, app, drain_timeout)


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
