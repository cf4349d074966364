"""`AsyncLLMEngine`: the engine core on its own thread, and one channel per request for asyncio.

What it is: vLLM's `AsyncLLM` shape over the (synchronous, not thread-safe) `LLMEngine`.
Every engine call happens on one background thread, the engine loop; the asyncio event
loop (the HTTP server's) never waits on a forward pass:

    event loop (HTTP handlers)                          engine thread (owns the LLMEngine)
    ──────────────────────────                          ──────────────────────────────────
    add_request(): tokenize, ── ("add", ids, params) ──> drain every queued command:
      register a RequestStream       command queue         add_request / abort_request / call(fn)
      await the acknowledgement <── future ───────────    step() if anything is unfinished
    async for out in stream  <── _dispatch(outputs) ──    (DELTA outputs: only what is new)
      (merged while behind)     call_soon_threadsafe,
    consumer gone ── ("abort", id) ──>                    one per step, at most 4 unread

- Tokenizing, chat templating and the server's own decoding run on one front-end thread
  (`tokenize`, `apply_chat_template`, `decode`), never on the event loop, with the front
  end's own copy of the tokenizer (as vLLM's front-end process has its own), through the
  engine's own validation code (`InputProcessor`), so a bad prompt is refused before it is
  queued and a 5 MB prompt does not stall `/health`. One thread, not a pool: a Hugging Face
  tokenizer is not safe to call from two threads at once ("Already borrowed"). A text longer
  than `max_prompt_chars` could not fit `max_model_len` whatever it tokenizes to, and is
  refused before it is tokenized at all.
- A `RequestStream` holds at most one pending output: a new delta is merged into it
  (text and tokens concatenated) when the consumer has not read the last one. A slow
  client costs one output's memory, however far behind it falls, and gets bigger deltas.
- `stream_interval` (vLLM's `--stream-interval`): the consumer is woken for a choice's first
  visible text at once, then only when a choice has `stream_interval` new tokens pending, or
  has finished, or the request has. Every wake-up is work on the event loop (an SSE event
  formatted and written, a router relaying it, a client parsing it); at 1 (the default) a
  step's token is an event of its own, at 10 a stream sends about a tenth of the events, and
  the same text. An error wakes the consumer at once too, after what was pending.
- The engine thread hands outputs over once per step, and waits when the event loop has
  not run the last few hand-overs: a starved event loop slows the engine down instead of
  letting callbacks pile up.
- Cancelling the consumer (an HTTP client that disconnects) aborts the request: its
  blocks are free after the engine thread's next command drain, at most one step later.
- An exception in `step()` fails the requests in flight (each gets the error) and aborts
  them; if every KV block is free afterwards and `engine.check_health()` passes, the engine
  keeps serving; otherwise it is marked dead (`/health` says 503) and the engine thread ends:
  every open stream and queued command gets `EngineDeadError`. While idle, the engine thread
  calls `check_health()` every HEALTH_CHECK_S, so a worker rank that dies while nothing runs
  is noticed within that time too, not at the next request.

What it is not: a multi-process engine (vLLM runs its EngineCore in another process and
talks over ZMQ; one thread is enough to keep the event loop free, though both share the
GIL), and not HTTP-aware (`api_server.py` and `serving.py` are).

Reference: vLLM `v1/engine/async_llm.py` (AsyncLLM.generate, abort on cancellation),
`v1/engine/output_processor.py` (RequestOutputCollector: merging delta outputs; `--stream-interval`,
vllm-project/vllm#27869, buffers there too).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

import torch

from level0_naive.inputs import InputProcessor
from level0_naive.loader import load_metadata

from .base import LLMEngine, RequestOutput, RequestOutputKind, SamplingParams

log = logging.getLogger("level6_serving")

MAX_UNREAD_HANDOVERS = 4  # engine steps whose outputs the event loop has not dispatched yet
HEALTH_CHECK_S = 0.5  # an idle engine thread checks its workers this often


class EngineDeadError(RuntimeError):
    """The engine failed in a way it could not recover from; nothing more will run."""


class PromptTooLongError(ValueError):
    """A prompt refused by its length in characters, before it was tokenized."""


class EngineStepError(RuntimeError):
    """`step()` raised while this request was in flight; the request was aborted."""


def merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Fold a later DELTA output into an unread one: texts, tokens and logprobs concatenate."""
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            continue
        old.text += c.text
        old.token_ids += c.token_ids
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    into.finished, into.metrics = new.finished, new.metrics


class RequestStream:
    """One request's channel. The event loop puts, the consumer iterates; never more than one
    output is pending (later ones are merged into it), and an error is read after it."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], on_abandon: Callable[[str], None],
                 stream_interval: int = 1):  # fmt: skip
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self._on_abandon = on_abandon
        self.stream_interval = stream_interval
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._started: set[int] = set()  # choices whose first text has gone out (stream_interval > 1)
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        if self._error is not None:
            return  # an error is final
        if isinstance(item, BaseException):
            self._error = item  # read after what is pending: the tokens computed before it are not lost
        elif self._pending is None:
            self._pending = item
        else:
            merge_delta(self._pending, item)
        if self.stream_interval == 1 or self._due():
            self._ready.set()

    def _due(self) -> bool:
        """With `stream_interval` > 1: wake the consumer now? For an error or the last output, yes. Else for
        a choice with text pending when none of its text has gone out yet (its first visible token: time to
        first token never waits), a choice that finished, or `stream_interval` new tokens in a choice."""
        item = self._pending
        if self._error is not None or item.finished:
            return True
        return any(len(c.token_ids) >= self.stream_interval or c.finish_reason is not None
                   or (c.text and c.index not in self._started) for c in item.outputs)  # fmt: skip

    async def get(self) -> RequestOutput:
        await self._ready.wait()
        item, self._pending = self._pending, None
        if item is None:  # nothing pending: the error
            self.finished = True
            raise self._error
        if self._error is None:
            self._ready.clear()
        if self.stream_interval > 1:
            self._started.update(c.index for c in item.outputs if c.text)
        self.finished = item.finished
        return item

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """Outputs until the request finishes. Leaving early (break, an exception, a cancelled
        task) abandons the request: the engine aborts it and frees its blocks."""
        try:
            while not self.finished:
                yield await self.get()
        finally:
            self.abandon()

    def abandon(self) -> None:
        """The reader is gone before the end: abort the request (nothing if it had finished)."""
        if not self.finished:
            self.finished = True
            self._on_abandon(self.request_id)


class AsyncLLMEngine:
    """`LLMEngine` for asyncio: `generate()` yields delta outputs; the engine runs on a thread."""

    def __init__(self, engine: LLMEngine, stream_interval: int = 1):
        self.engine, self.stream_interval = engine, check_stream_interval(stream_interval)
        # What the server reports, read once from the engine's public attributes (never changed after
        # it is built): handlers read these, not the engine, which belongs to the engine thread.
        self.model_path, self.model_config = engine.model_path, engine.model_config
        self.max_model_len, self.max_num_seqs = engine.max_model_len, engine.config.scheduler.max_num_seqs
        self.engine_name = type(engine).__module__  # which level's engine this wraps, e.g. "level5_multigpu.engine"
        # The front end's own tokenizer and metadata (the engine thread decodes with the engine's): the
        # same files, so the same token ids, and no object is shared between the two threads.
        front = load_metadata(engine.model_path)
        self.tokenizer = front.tokenizer
        self.tokenizer.model_max_length = engine.max_model_len  # as the engine's (no warning past 256)
        self.inputs = InputProcessor(front, engine.max_model_len, 0, torch.device("cpu"), engine.sequence_class,
                                     engine.check_fits)  # fmt: skip
        self.max_prompt_chars = max_model_len_in_chars(self.tokenizer, engine.max_model_len)
        self._frontend = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Commands with a future are put under this lock while `_accepting`: the engine thread clears
        # it, under the lock, before its last drain, so no future is ever put where nobody reads it.
        self._queue_lock, self._accepting = threading.Lock(), True
        self._streams: dict[str, RequestStream] = {}  # event loop only
        self._handovers = threading.Semaphore(MAX_UNREAD_HANDOVERS)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._num_adding = 0  # sequences sent to the engine thread, not yet acknowledged (event loop only)
        self.num_waiting_in_engine = 0  # written by the engine thread after each drain and step
        self.dead: BaseException | None = None
        self.died: asyncio.Event | None = None  # set on the event loop once the engine is dead

    @classmethod
    def from_engine_args(cls, model: str, stream_interval: int = 1, **engine_kwargs) -> AsyncLLMEngine:
        check_stream_interval(stream_interval)  # before the engine loads (and, with TP, starts its ranks)
        return cls(LLMEngine(model, **engine_kwargs), stream_interval)

    # --- lifecycle (call from the event loop) ------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine loop is already running")
        if not self._accepting:
            raise RuntimeError(
                "this AsyncLLMEngine was shut down (its ranks and tokenizer thread are gone): make a new one"
            )
        self._loop = asyncio.get_running_loop()
        self.died = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort whatever is left, stop the engine thread and wait for it."""
        if self._thread is None:
            return
        self._commands.put(("stop",))
        await asyncio.to_thread(self._thread.join, 30)
        self._thread = None
        self._frontend.shutdown(wait=False, cancel_futures=True)
        close = getattr(self.engine, "shutdown", None)  # level 5: stop the ranks (level 4 has none)
        if close is not None:
            await asyncio.to_thread(close)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    # --- the front end: tokenizer work on its own thread ----------------------------------------
    async def run_on_frontend(self, fn, *args):
        """`fn(*args)` on the front-end thread: tokenizer work, or anything else too big for the
        event loop (parsing a large request body, checking millions of token ids)."""
        return await asyncio.get_running_loop().run_in_executor(self._frontend, fn, *args)

    async def tokenize(self, prompt: str | list[int], i: int = 0) -> list[int]:
        """The prompt's token ids, checked (ValueError names prompt `i`), off the event loop."""
        if isinstance(prompt, str) and len(prompt) > self.max_prompt_chars:
            raise PromptTooLongError(
                f"prompt {i} has {len(prompt)} characters: more than any {self.max_model_len}-token "
                f"context holds with this tokenizer ({self.max_prompt_chars}); it was not tokenized"
            )
        if not isinstance(prompt, str) and len(prompt) < 4096:
            return self._tokenize(prompt, i)  # a short id list: checking it costs less than a hop
        return await self.run_on_frontend(self._tokenize, prompt, i)

    def _tokenize(self, prompt: str | list[int], i: int) -> list[int]:
        try:
            return self.inputs.tokenize(prompt, i)
        except ValueError as e:  # level 0's refusal of a prompt with no room left, said as the API says it
            if str(e).endswith("leaves no room to generate"):
                raise PromptTooLongError(str(e)) from None
            raise

    async def apply_chat_template(self, messages: list[dict]) -> list[int]:
        chars = sum(len(m["content"]) for m in messages)
        if chars > self.max_prompt_chars:
            raise PromptTooLongError(
                f"the messages have {chars} characters: more than any {self.max_model_len}-token "
                f"context holds with this tokenizer ({self.max_prompt_chars})"
            )
        return await self.run_on_frontend(self.inputs.apply_chat_template, messages)

    async def decode(self, token_ids: list[int]) -> str:
        return await self.run_on_frontend(self.tokenizer.decode, token_ids)

    # --- requests ------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Sequences queued and not yet running: in the engine's waiting queue or on their way."""
        return self._num_adding + self.num_waiting_in_engine

    async def num_waiting_now(self) -> int:
        """`num_waiting` once every command queued before this call has run (an abort included): exact
        where `num_waiting` may lag by a step. A round trip to the engine thread: only for a refusal."""
        in_engine = await self.call(lambda engine: engine.num_waiting())
        return self._num_adding + in_engine

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          lora_request=None) -> RequestStream:  # fmt: skip
        """Validate, queue, and wait until the engine has the request (a ValueError from the
        engine, e.g. a request that could never fit the KV cache, is raised here). `lora_request`:
        its LoRA adapter (an engine with enable_lora=True), or None."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead}")
        if self._thread is None:
            raise RuntimeError("AsyncLLMEngine.start() was not called")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival = time.perf_counter()  # TTFT counts from here, not from when the engine thread gets to it
        ids = await self.tokenize(prompt)  # ValueError names the prompt; nothing is queued
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
        stream = RequestStream(request_id, ids, self._abandon, self.stream_interval)
        self._streams[request_id] = stream
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._num_adding += params.n
        self._submit(("add", request_id, ids, params, arrival, lora_request, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self._abandon(request_id)  # it may have reached the engine all the same
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finally:
            self._num_adding -= params.n
        return stream

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       lora_request=None) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """Yield the request's DELTA outputs; closing or cancelling the iteration aborts it."""
        stream = await self.add_request(request_id, prompt, params, lora_request)
        # The stream's own iteration, which abandons the request if left early; `aclosing`, because
        # closing this generator at its `yield` would not close that one (the garbage collector would, later).
        async with contextlib.aclosing(aiter(stream)) as outputs:
            async for out in outputs:
                yield out

    def abort(self, request_id: str | list[str]) -> None:
        """Stop requests from outside (a drain, an operator): each stream still gets its final
        output, with finish_reason "abort". Unknown and finished ids are harmless."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._commands.put(("abort", ids))

    def _abandon(self, request_id: str) -> None:
        """The consumer is gone: forget its stream and free the request's blocks."""
        self._streams.pop(request_id, None)
        self._commands.put(("abort", [request_id]))

    async def call(self, fn: Callable[[LLMEngine], object]):
        """Run `fn(engine)` on the engine thread, between steps (metrics, cache resets)."""
        if not self.is_running:
            raise EngineDeadError(f"the engine is not running{f': {self.dead}' if self.dead else ''}")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", fn, done))
        return await asyncio.wrap_future(done)

    def _submit(self, cmd: tuple) -> None:
        """Queue a command whose last item is a future; once the engine thread has stopped
        reading (it died, or was stopped), answer the future here instead."""
        with self._queue_lock:
            if self._accepting:
                self._commands.put(cmd)
                return
        if cmd[-1].set_running_or_notify_cancel():
            cmd[-1].set_exception(EngineDeadError(f"the engine is dead: {self.dead!r}" if self.dead else
                                                  "the engine has stopped"))  # fmt: skip

    async def get_metrics(self) -> list:
        """The engine's metrics, read between steps. A dead engine's thread has ended, so nothing
        else touches the engine any more: its last counters are read here directly (Prometheus
        keeps seeing them, and an operator sees what it had done before it died)."""
        if self.dead is not None and self._thread is not None and not self._thread.is_alive():
            return self.engine.get_metrics()
        return await self.call(lambda engine: engine.get_metrics())

    async def drain(self, timeout: float) -> int:
        """Let the requests in flight finish for up to `timeout` seconds, then abort the rest
        (their streams end with finish_reason "abort"). Returns how many were aborted."""
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._streams)
        if left:
            self.abort(left)
            deadline = time.monotonic() + 5.0
            while self._streams and time.monotonic() < deadline and self.is_running:
                await asyncio.sleep(0.02)
        return len(left)

    # --- the event loop side of the hand-over --------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        self._handovers.release()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # abandoned: its final "abort" output has no reader
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, error: BaseException) -> None:
        self._fail(list(self._streams), error)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(error)

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # --- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_until_stopped()  # returns on "stop", or once the engine is dead
        except BaseException as e:  # a bug outside step(): nothing can be trusted any more
            self.dead = e
            log.exception("the engine loop died")
        finally:  # every open stream and whatever is still queued gets an answer, not a hang
            why = "the engine has stopped" if self.dead is None else f"the engine is dead: {self.dead!r}"
            if self.dead is not None:
                self._to_loop(self._fail_all, EngineDeadError(why))
                self._to_loop(self.died.set)
            with self._queue_lock:  # from here on `_submit` answers for us: this drain is the last
                self._accepting = False
            while True:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
                if cmd[0] in ("add", "call") and cmd[-1].set_running_or_notify_cancel():
                    cmd[-1].set_exception(EngineDeadError(why))

    def _loop_until_stopped(self) -> None:
        engine, stopping = self.engine, False
        while not stopping or engine.has_unfinished_requests():
            commands = []
            if not engine.has_unfinished_requests() and not stopping:
                try:  # idle: sleep until there is something to do, checking the workers now and then
                    commands.append(self._commands.get(timeout=HEALTH_CHECK_S))
                except queue.Empty:
                    try:
                        engine.check_health()
                    except Exception as e:  # noqa: BLE001 - a dead worker: nothing more can run
                        self.dead = e
                        log.error("the engine is dead: %s", e)
                        return
                    continue
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in commands:
                stopping |= self._execute(cmd)
            if stopping:
                engine.abort_request(engine.unfinished_request_ids())
            self.num_waiting_in_engine = engine.num_waiting()
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # noqa: BLE001 - a bug in one step must not kill the server silently
                self._recover(e)
                if self.dead is not None:  # not recovered: stepping again would fail again, forever
                    return
                continue
            self.num_waiting_in_engine = engine.num_waiting()
            if outputs:
                while not self._handovers.acquire(timeout=1.0):  # the event loop is behind: wait for it
                    if self._loop.is_closed():
                        return
                self._to_loop(self._dispatch, outputs)

    def _execute(self, cmd: tuple) -> bool:
        """One command, on the engine thread. Returns True for "stop"."""
        kind = cmd[0]
        if self.dead is not None and kind in ("add", "call"):
            if cmd[-1].set_running_or_notify_cancel():
                cmd[-1].set_exception(EngineDeadError(f"the engine is dead: {self.dead}"))
        elif kind == "add":
            _, rid, ids, params, arrival, lora, done = cmd
            if done.set_running_or_notify_cancel():  # False: the caller went away before we got here
                try:
                    self.engine.add_request(rid, ids, params, arrival_time=arrival, lora_request=lora)
                    done.set_result(None)
                except Exception as e:  # noqa: BLE001 - the caller gets it (ValueError: 400; else: 500)
                    done.set_exception(e)
        elif kind == "abort":
            self.engine.abort_request(cmd[1])
        elif kind == "call":
            _, fn, done = cmd
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001
                    done.set_exception(e)
        return kind == "stop"

    def _recover(self, error: Exception) -> None:
        """`step()` raised: fail and abort every request in flight; keep serving if the KV pool
        is whole again, else declare the engine dead."""
        ids = self.engine.unfinished_request_ids()
        log.exception("engine step failed; aborting the %d requests in flight", len(ids))
        self._to_loop(self._fail, ids, EngineStepError(f"the engine failed while running this request: {error!r}"))
        try:
            self.engine.abort_request(ids)
            self.engine.check_health()  # a dead worker rank: the KV pool may look whole, yet nothing can run
            self.engine.step()  # flushes the aborted requests' final outputs (nobody reads them)
            whole = self.engine.num_free_blocks() == self.engine.num_blocks
        except Exception as e:  # noqa: BLE001
            error, whole = e, False
        if not whole:
            self.dead = error
            log.error("the engine could not recover (KV blocks lost, a dead worker or a second failure): it is dead")


def check_stream_interval(n: int) -> int:
    if n < 1:
        raise ValueError(f"stream_interval={n} must be at least 1 (1: every token an event)")
    return n


def max_model_len_in_chars(tokenizer, max_model_len: int) -> int:
    """The longest text that could still fit `max_model_len` tokens: every token covers at most
    the longest vocabulary entry's characters (a byte-level entry's length counts its bytes,
    which are at least its characters), doubled for normalizers that fold two characters
    into one. Anything longer is refused without being tokenized."""
    longest = max((len(piece) for piece in tokenizer.get_vocab()), default=1)
    return 2 * max_model_len * max(longest, 1)
