"""`/v1/completions` and `/v1/chat/completions`: requests in, JSON or Server-Sent Events out.

What it is: `OpenAIServing`, the part of the server that speaks OpenAI. For one request:

    body ─parse_body─> CompletionRequest ─> model known? n allowed? n x prompts within the queue's size?
         ─> prompt fits (in characters, then tokenized on the front-end thread)? queue not full?
         ─> AsyncLLMEngine.add_request (one engine request per prompt; n samples each)
         ─> stream: one SSE event per choice per engine output, then usage, then [DONE]
            or not: the deltas concatenated into one JSON response

Both endpoints turn engine outputs into a response in one place, `OpenAIServing.events` (a
stream) and `OpenAIServing.response` (one JSON): the numbering of choices, which deltas are
sent, the usage. Each endpoint says only what differs: the text a choice starts with (the
echo), the chunks a stream opens with (the echo; chat: the role), and how one choice looks
(`text` and the legacy logprobs; chat: `delta` or `message`, and chat's logprobs).

A stream is framed exactly as OpenAI frames it, one `data: {json}\\n\\n` per event:

    data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant",
           "content": ""}, "finish_reason": null}], ...}                 (chat: the role first)
    data: {... "choices": [{"index": 0, "delta": {"content": "Romeo"}, "finish_reason": null}]}
    data: {... "choices": [{"index": 0, "delta": {"content": " is"}, "finish_reason": "length"}]}
    data: {... "choices": [], "usage": {"prompt_tokens": 5, ...}}        (stream_options.include_usage)
    data: [DONE]

With `stream_options.continuous_usage_stats` (vLLM's), every chunk carries the usage so far.

The text of each event is the engine's delta output, so it never splits a character
and never shows the start of a stop string that is then cut. Choice `index` is
`prompt_index * n + sample_index`, as OpenAI numbers them.

A client that disconnects cancels its handler (Starlette cancels a streaming response;
`unless_disconnected` races a plain one against the disconnect), the cancellation
reaches the request's stream, and the stream aborts the request in the engine.

What it is not: the HTTP app (routes, auth, metrics, shutdown live in `api_server.py`).

Reference: vLLM `entrypoints/openai/serving_completion.py`, `serving_chat.py`; the OpenAI
API reference for the chunk objects.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .async_engine import AsyncLLMEngine, EngineDeadError, PromptTooLongError, RequestStream
from .base import CompletionOutput, RequestOutput, SamplingParams
from .beam_search import BeamSearchParams, SearchAborted, beam_search, gather_or_cancel
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body, refused

log = logging.getLogger("level6_serving")


def sse(obj: dict | str) -> str:
    """One Server-Sent Event: `data: <json>` and a blank line. The JSON is ASCII (other characters
    are escaped), so no U+2028 or U+0085 in a generated text can look like a line break to a
    client that splits lines the way Python's `str.splitlines` does."""
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; closing this closes them all."""
    if len(streams) == 1:  # the common case: no tasks
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                q.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()  # an unfinished stream is abandoned, so its request is aborted


class PromptOnly:
    """`max_tokens: 0` with `echo` (OpenAI's legacy way to score a prompt): the engine generates one
    token, since a request must generate something, and this stream hides it: each output keeps the
    prompt's logprobs and loses its token, text and logprobs; it finishes at "length"."""

    def __init__(self, stream: RequestStream):
        self.stream, self.prompt_token_ids = stream, stream.prompt_token_ids

    def abandon(self) -> None:
        self.stream.abandon()

    async def __aiter__(self):
        async for out in self.stream:
            yield dataclasses.replace(out, outputs=[dataclasses.replace(
                c, text="", token_ids=[], logprobs=None if c.logprobs is None else [], cumulative_logprob=None,
                stop_reason=None, finish_reason=c.finish_reason and "length") for c in out.outputs])  # fmt: skip


class EventStream(StreamingResponse):
    """An SSE response that aborts its requests however it ends: a client that left before
    the first byte means the body generator never even started, so its own cleanup never runs."""

    def __init__(self, events, streams: list[RequestStream]):
        super().__init__(events, media_type="text/event-stream")
        self.streams = streams

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self.streams:
                s.abandon()  # nothing for a finished request


async def unless_disconnected(raw: Request, work, streams: list[RequestStream]) -> Response:
    """Run a non-streaming handler, but cancel it (aborting its requests) if the client leaves."""

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        for s in streams:
            s.abandon()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    for s in streams:  # also when the handler was cancelled before it ever ran
        s.abandon()
    return Response(status_code=499)  # nginx's "client closed request": nobody is there to read it


class Choice:
    """One choice of a non-streaming response, accumulated from deltas (and its prompt's logprobs,
    from the output that carried them)."""

    def __init__(self, text: str = ""):
        self.text, self.token_ids, self.logprobs = text, [], []
        self.finish_reason: str | None = None
        self.stop_reason = None
        self.prompt: tuple[list[int], list] | None = None  # (prompt ids, prompt logprobs) once they came

    def add(self, c: CompletionOutput, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt = (out.prompt_token_ids, out.prompt_logprobs)
        self.text += c.text
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs or []
        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason


def _top(entry: dict, n: int) -> list:
    """The top-n (token id, Logprob) of one position, most likely first."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= n), key=lambda x: x[1].rank)


class TextOffsets:
    """`text_offset`s: where each token starts in the choice's text, in characters (as OpenAI's legacy
    completions count them: indices into the returned text), the echoed prompt and the output alike.
    A token that is part of a character ("€" is three byte tokens) decodes to U+FFFD, one character
    that is not in the text: so its bytes are fed to a UTF-8 decoder, and a token starts where the
    characters completed before it end ("€ab" -> 0, 0, 0, 1, 2). Kept per choice across chunks."""

    def __init__(self, tokenizer, start: int = 0):
        self.tokenizer, self.chars = tokenizer, start
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # holds a character's first bytes

    def next(self, token_id: int, decoded: str) -> int:
        at = self.chars
        raw = token_bytes(self.tokenizer, token_id, decoded) if self.tokenizer else decoded.encode()
        self.chars += len(self.utf8.decode(raw))
        return at


def completion_logprobs(token_ids: list[int], entries: list[dict], n: int, offsets: TextOffsets) -> dict:
    """The legacy completions shape: parallel lists, `text_offset` counted from the choice's start."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, entry in zip(token_ids, entries):
        chosen = entry[tok]
        out["tokens"].append(chosen.decoded_token)
        out["token_logprobs"].append(chosen.logprob)
        out["top_logprobs"].append({lp.decoded_token: lp.logprob for _, lp in _top(entry, n)})
        out["text_offset"].append(offsets.next(tok, chosen.decoded_token or ""))
    return out


def completion_choice(index: int, c: CompletionOutput | Choice, num_lp: int | None, offsets: TextOffsets,
                      prompt: dict | None = None) -> dict:  # fmt: skip
    """One choice of /v1/completions: a chunk's (`c` a delta) or a whole response's (`c` a Choice);
    `offsets` goes on from where `c`'s text starts in the choice's. `prompt` (from `prompt_part`, once the
    prompt's logprobs came) adds vLLM's `prompt_logprobs` and, for `echo` with `logprobs`, the
    echoed text in front with its tokens' logprobs opening the list."""
    lp = None if num_lp is None else completion_logprobs(c.token_ids, c.logprobs or [], num_lp, offsets)
    ch = {"index": index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason,
          "stop_reason": c.stop_reason}  # fmt: skip
    if prompt is not None:
        ch["prompt_logprobs"] = prompt["prompt_logprobs"]
        if prompt["echo"] is not None:
            ch["text"] = prompt["echo"] + c.text
            if lp is not None:
                ch["logprobs"] = {k: prompt["logprobs"][k] + lp[k] for k in lp}
    return ch


def prompt_part(ids: list[int], entries: list, num_lp: int | None, echo: str | None, first_text: str,
                tokenizer=None) -> dict:  # fmt: skip
    """What a choice adds once its prompt's logprobs came: vLLM's `prompt_logprobs` (a list, None for
    the first token, else {token id: {logprob, rank, decoded_token}}), and with an `echo`, the echoed
    text and its tokens in the legacy logprobs shape (the first token's logprob null; `first_text` is
    its decoded text)."""
    part = {"echo": echo, "prompt_logprobs": [
        None if e is None else {str(t): {"logprob": x.logprob, "rank": x.rank, "decoded_token": x.decoded_token}
                                for t, x in e.items()} for e in entries]}  # fmt: skip
    if echo is not None and num_lp is not None:
        offsets = TextOffsets(tokenizer)
        offsets.next(ids[0], first_text)
        rest = completion_logprobs(ids[1:], entries[1:], num_lp, offsets)
        part["logprobs"] = {"tokens": [first_text] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                            "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}  # fmt: skip
    return part


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte: printable bytes stand for themselves,
    the others are shifted to U+0100 on (as in Llama 3, Qwen and the built-in tokenizer)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tokenizer, token_id: int, decoded: str) -> bytes:
    """A token's own bytes. Its decoded text says, unless that is U+FFFD: a token that is part
    of a character (one byte of "€") decodes to the replacement character, whose UTF-8 is
    not the token's. Then the vocabulary entry does: SentencePiece's byte fallback `<0x82>`,
    or a string in the byte-level alphabet. Any other vocabulary gets the decoded text's bytes."""
    if "\ufffd" not in decoded:
        return decoded.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token_id) or ""
    if m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
        return bytes([int(m[1], 16)])
    if piece and all(ch in BYTE_LEVEL for ch in piece):
        return bytes(BYTE_LEVEL[ch] for ch in piece)
    return decoded.encode("utf-8")


def chat_logprobs(token_ids: list[int], entries: list[dict], n: int, tokenizer) -> dict:
    """The chat shape: one object per token, with its bytes and its top alternatives."""

    def item(tok: int, lp) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(token_bytes(tokenizer, tok, text))}

    return {"content": [{**item(tok, entry[tok]), "top_logprobs": [item(t, lp) for t, lp in _top(entry, n)]}
                        for tok, entry in zip(token_ids, entries)]}  # fmt: skip


LARGE_BODY = 64 << 10  # bytes: a body this big is parsed on the front-end thread, not the event loop


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str], max_num_waiting: int, max_n: int):
        self.engine, self.names = engine, served_model_names
        self.max_num_waiting, self.max_n = max_num_waiting, max_n
        self.draining = False
        self.loras: dict = {}  # served LoRA adapters: the `model` name a client sends -> its LoRARequest

    def kv_transfer(self, req: CompletionRequest | ChatCompletionRequest, num_prompts: int) -> dict:
        """vLLM's `kv_transfer_params` in a prefill instance's answer: where its consumer fetches the
        prompt's KV (features/kv_connectors/tcp.py); {} for any other request or instance."""
        connector = getattr(self.engine.engine, "connector", None)
        asked = req.kv_transfer_params or {}
        if connector is None or not hasattr(connector, "response_params") or not asked.get("do_remote_decode"):
            return {}
        if num_prompts != 1:
            return {}  # (one transfer id per request: only the first prompt's blocks would be kept under it)
        params = connector.response_params(asked, "")
        return {} if params is None else {"kv_transfer_params": params}

    # --- checks before anything is queued ------------------------------------------------------
    async def parse(self, model, raw: Request):
        body = await raw.body()
        if len(body) < LARGE_BODY:
            return parse_body(model, body)
        return await self.engine.run_on_frontend(parse_body, model, body)

    def check_model(self, name: str | None) -> str:
        if name is not None and name not in self.names and name not in self.loras:
            served = ", ".join([*self.names, *self.loras])
            raise APIError(404, f"The model `{name}` does not exist (served: {served})", "model",
                           "model_not_found")  # fmt: skip
        return name or self.names[0]

    def check_n(self, n: int) -> None:
        if not 1 <= n <= self.max_n:
            raise APIError(400, f"n={n} must be between 1 and {self.max_n} (the server's --max-num-seqs)", "n")

    def check_size(self, n: int, num_prompts: int) -> None:
        """A request bigger than the whole queue could never be admitted: 400, before any prompt
        is tokenized (10,000 prompts would otherwise be tokenized on the event loop first)."""
        if n * num_prompts > self.max_num_waiting:
            raise refused("too_many_sequences", f"this request asks for {n * num_prompts} sequences (n={n} x "
                          f"{num_prompts} prompts); the server queues at most {self.max_num_waiting} "
                          "(--max-num-waiting)", "n" if num_prompts == 1 else "prompt")  # fmt: skip

    async def admit(self, num_seqs: int) -> None:
        """Backpressure: a bounded queue. Beyond it, 503 and Retry-After, never an unbounded wait.
        A request that fits the queue alone (`check_size`) is always admitted to an empty one."""
        if self.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
        if not self.engine.is_running:
            raise engine_unavailable(self.engine)
        waiting = self.engine.num_waiting
        if waiting + num_seqs > self.max_num_waiting:
            # The count is the engine's after its last step: an abandoned request's abort may still be in the
            # command queue. Before refusing, count again once every command queued so far has run (a client
            # that sends one request at a time must never see "overloaded").
            waiting = await self.engine.num_waiting_now()
        if waiting + num_seqs > self.max_num_waiting:
            raise APIError(503, f"the server is overloaded: {waiting} sequences are waiting "
                                f"(--max-num-waiting {self.max_num_waiting}); retry later", None, "overloaded",
                           {"Retry-After": "1"})  # fmt: skip

    def check_context(self, ids: list[int], max_tokens: int | None, field: str) -> None:
        limit = self.engine.max_model_len
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
                                f"completion). Please reduce the length of the prompt or of {field}.", field,
                           "context_length_exceeded")  # fmt: skip

    async def add_all(self, request_id: str, prompts: list[list[int]], params: SamplingParams,
                      structured_field: str | None = None, lora=None) -> list[RequestStream]:  # fmt: skip
        """One engine request per prompt; if one is refused, the others are aborted. A structured output the
        engine cannot compile is a 400 that names the API field it came from (`structured_field`)."""
        streams = []
        try:
            for i, ids in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await self.engine.add_request(rid, ids, params, lora))
        except BaseException as e:
            for s in streams:
                s.abandon()
            if isinstance(e, ValueError) and str(e).startswith("structured_outputs") and structured_field:
                raise refused("invalid_constraint", f"{structured_field}: {e}", structured_field) from None
            refusal = self.refusal(e)
            if refusal is not None:
                raise refusal from None
            raise
        return streams

    def refusal(self, e: BaseException) -> APIError | None:
        """The engine's refusal of a request as the API says it: a dead engine is a 503, a ValueError of the
        engine's own checks (e.g. more KV blocks than the pool holds) a 400; anything else None."""
        if isinstance(e, EngineDeadError):
            return engine_unavailable(self.engine)
        if isinstance(e, ValueError):
            if "KV blocks" in str(e):
                return refused("exceeds_kv_cache", str(e), "max_tokens")
            return APIError(400, str(e), "prompt", too_long(e))
        return None

    # --- engine outputs to a response: what both endpoints share -------------------------------
    async def events(self, ctx: dict, req: CompletionRequest | ChatCompletionRequest, streams: list[RequestStream],
                     opening: list[dict], choice, logprobs_asked: bool):  # fmt: skip
        """The SSE events of a stream: the `opening` choices (completions: the echo; chat: the role),
        then one chunk per delta `c` of an output `out` with the endpoint's `choice(index, c, out)`,
        the usage, `[DONE]`.
        Choice `index` = prompt index * n + c.index. A delta is not sent if its choice has finished,
        or if it brings nothing (no text, no finish reason, and no logprobs asked for); its tokens
        count all the same."""
        n = req.num_samples
        include_usage, continuous = req.usage_in_stream()
        prompt_tokens = sum(len(s.prompt_token_ids) for s in streams)
        done, completion_tokens = set(), 0
        extra = lambda: stream_usage(include_usage, continuous, prompt_tokens, completion_tokens)  # noqa: E731
        try:
            for first in opening:
                yield sse({**ctx, "choices": [first], **extra()})
            async for i, out in merge_streams(streams):
                for c in out.outputs:
                    index = i * n + c.index
                    completion_tokens += len(c.token_ids)
                    if index in done or not (c.text or c.finish_reason or (logprobs_asked and c.token_ids)):
                        continue
                    if c.finish_reason is not None:
                        done.add(index)
                    if (ch := choice(index, c, out)) is not None:  # None: the endpoint holds this delta back
                        yield sse({**ctx, "choices": [ch], **extra()})
            if include_usage:
                yield sse({**ctx, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        except Exception as e:  # noqa: BLE001 - the status line is sent: the error goes in the stream
            yield sse(stream_error(e))
        yield sse("[DONE]")

    async def response(self, ctx: dict, req: CompletionRequest | ChatCompletionRequest, streams: list[RequestStream],
                       starts: list[str], choice) -> Response:  # fmt: skip
        """A non-streaming response: each choice's deltas concatenated onto its start (prompt `i`'s
        `starts[i]`: the echo, or ""), shaped by the endpoint's `choice(index, ch)`, and the usage."""
        n = req.num_samples
        choices = [Choice(starts[index // n]) for index in range(len(streams) * n)]
        async for i, out in merge_streams(streams):
            for c in out.outputs:
                choices[i * n + c.index].add(c, out)
        prompt_tokens = sum(len(s.prompt_token_ids) for s in streams)
        completion_tokens = sum(len(ch.token_ids) for ch in choices)
        return JSONResponse({**ctx, "choices": [choice(index, ch) for index, ch in enumerate(choices)],
                             "usage": usage(prompt_tokens, completion_tokens)})  # fmt: skip

    async def beam_response(self, ctx: dict, prompts: list[list[int]], params: BeamSearchParams, choice) -> Response:
        """`use_beam_search`: a search per prompt (beam_search.py), all at once; prompt i's hypotheses, best
        first, are choices i * n ... i * n + n - 1, each shaped by the endpoint's `choice(index, seq)`."""
        if ctx["model"] in self.loras:
            raise APIError(400, "use_beam_search with a LoRA adapter is not supported", "use_beam_search")
        try:
            outs = await gather_or_cancel(beam_search(self.engine, f"{ctx['id']}-{i}", ids, params)
                                          for i, ids in enumerate(prompts))  # fmt: skip
        except SearchAborted as e:  # a drain gave up waiting, or an operator aborted a step
            raise APIError(503, str(e), None, None, {"Retry-After": "5"}) from None
        except (EngineDeadError, ValueError) as e:
            raise self.refusal(e) from None
        W = params.beam_width
        choices = [choice(i * W + j, seq) for i, out in enumerate(outs) for j, seq in enumerate(out.sequences)]
        completion_tokens = sum(len(seq.output_token_ids) for out in outs for seq in out.sequences)
        return JSONResponse({**ctx, "choices": choices,
                             "usage": usage(sum(map(len, prompts)), completion_tokens)})  # fmt: skip

    # --- /v1/completions -----------------------------------------------------------------------
    async def completions(self, raw: Request) -> Response:
        req: CompletionRequest = await self.parse(CompletionRequest, raw)
        req.validate_request()
        model = self.check_model(req.model)
        lora = self.loras.get(model)  # resolved once: an unload meanwhile cannot turn it into the base model
        self.check_n(req.num_samples)
        prompts = req.prompts()
        self.check_size(req.num_samples, len(prompts))
        ids = []
        for i, p in enumerate(prompts):
            try:
                ids.append(await self.engine.tokenize(p, i))
            except ValueError as e:
                raise APIError(400, str(e), "prompt", too_long(e)) from None
        max_tokens = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default for completions
        prompt_only = max_tokens == 0 and bool(req.echo) and not req.use_beam_search  # score the prompt: PromptOnly
        max_tokens += prompt_only
        beams = req.beam_search_params(max_tokens) if req.use_beam_search else None
        params = None if beams else req.sampling_params(max_tokens, "max_tokens", req.logprobs, req.num_prompt_logprobs)
        for x in ids:
            self.check_context(x, max_tokens, "max_tokens")
        await self.admit(req.num_samples * len(ids))
        ctx = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
               "model": model}  # fmt: skip
        if beams:
            choice = lambda index, seq: {"index": index, "text": seq.text, "logprobs": None,  # noqa: E731
                                         "finish_reason": seq.finish_reason, "stop_reason": None}  # fmt: skip
            return await unless_disconnected(raw, self.beam_response(ctx, ids, beams, choice), [])
        # Before add_all: a decode that fails here leaves no request running without a reader.
        echo = [p if isinstance(p, str) else await self.engine.decode(x) for p, x in zip(prompts, ids)] if req.echo \
            else ["" for _ in prompts]  # fmt: skip
        streams = await self.add_all(ctx["id"], ids, params, req.structured()[1], lora)
        ctx |= self.kv_transfer(req, len(ids))
        if prompt_only:
            streams = [PromptOnly(s) for s in streams]
        if req.stream:
            return EventStream(self.completion_events(ctx, req, streams, echo), streams)
        return await unless_disconnected(raw, self.completion_response(ctx, req, streams, echo), streams)

    def completion_events(self, ctx: dict, req: CompletionRequest, streams, echo: list[str]):
        """First each choice's echo, if any; then its text deltas, whose logprobs' `text_offset`
        goes on from the choice's text so far (the echo included). With prompt logprobs, the echo
        waits for them: the first delta carries the echo, its tokens' logprobs and vLLM's
        `prompt_logprobs` (the output that completes the prompt also brings its first token)."""
        n, num_lp, with_prompt = req.num_samples, req.logprobs, req.num_prompt_logprobs is not None
        offsets = [TextOffsets(self.engine.tokenizer, len(echo[index // n])) for index in range(len(streams) * n)]
        sent_prompt: set[int] = set()

        def choice(index: int, c: CompletionOutput, out: RequestOutput) -> dict:
            part = None
            if with_prompt and index not in sent_prompt and out.prompt_logprobs is not None:
                sent_prompt.add(index)
                part = self.prompt_part(out, req, echo[index // n])
            return completion_choice(index, c, num_lp, offsets[index], part)

        opening = [] if with_prompt else [{"index": index, "text": echo[index // n], "logprobs": None,
                                           "finish_reason": None}
                                          for index in range(len(streams) * n) if echo[index // n]]  # fmt: skip
        return self.events(ctx, req, streams, opening, choice, num_lp is not None or with_prompt)

    def completion_response(self, ctx: dict, req: CompletionRequest, streams, echo: list[str]):
        n, num_lp, tok = req.num_samples, req.logprobs, self.engine.tokenizer
        if req.num_prompt_logprobs is None:
            choice = lambda index, ch, *_: completion_choice(index, ch, num_lp, TextOffsets(tok, len(echo[index // n])))  # noqa: E731
            return self.response(ctx, req, streams, echo, choice)

        def choice(index: int, ch: Choice) -> dict:  # the echo goes in front with the prompt's logprobs
            ids, entries = ch.prompt
            part = prompt_part(ids, entries, num_lp, echo[index // n] if req.echo else None,
                               tok.decode(ids[:1]) if tok else "", tok)  # fmt: skip
            return completion_choice(index, ch, num_lp, TextOffsets(tok, len(echo[index // n])), part)

        return self.response(ctx, req, streams, ["" for _ in echo], choice)

    def prompt_part(self, out: RequestOutput, req: CompletionRequest, echo: str) -> dict:
        first = self.engine.tokenizer.decode(out.prompt_token_ids[:1]) if self.engine.tokenizer else ""
        return prompt_part(out.prompt_token_ids, out.prompt_logprobs, req.logprobs, echo if req.echo else None, first,
                           self.engine.tokenizer)  # fmt: skip

    # --- /v1/chat/completions ------------------------------------------------------------------
    async def chat(self, raw: Request) -> Response:
        req: ChatCompletionRequest = await self.parse(ChatCompletionRequest, raw)
        req.validate_request()
        model = self.check_model(req.model)
        lora = self.loras.get(model)  # resolved once (see completions)
        self.check_n(req.num_samples)
        self.check_size(req.num_samples, 1)
        try:
            ids = await self.engine.apply_chat_template([m.as_template_input() for m in req.messages])
        except ValueError as e:
            raise APIError(400, str(e), "messages", too_long(e)) from None
        if len(ids) >= self.engine.max_model_len:
            raise APIError(400, f"the conversation has {len(ids)} tokens; max_model_len={self.engine.max_model_len} "
                                "leaves no room to generate", "messages", "context_length_exceeded")  # fmt: skip
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.use_beam_search:  # a search needs a length: None is until the context is full
            beams = req.beam_search_params(self.engine.max_model_len - len(ids) if max_tokens is None else max_tokens)
        else:
            beams, params = None, req.sampling_params(max_tokens, field, req.num_logprobs)  # None: until full
        self.check_context(ids, max_tokens, field)
        await self.admit(req.num_samples)
        ctx = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
        if beams:
            choice = lambda index, seq: {  # noqa: E731
                "index": index, "message": {"role": "assistant", "content": seq.text, "refusal": None},
                "logprobs": None, "finish_reason": seq.finish_reason, "stop_reason": None}  # fmt: skip
            return await unless_disconnected(raw, self.beam_response({**ctx, "object": "chat.completion"}, [ids],
                                                                     beams, choice), [])  # fmt: skip
        streams = await self.add_all(ctx["id"], [ids], params, req.structured()[1], lora)
        ctx |= self.kv_transfer(req, 1)
        if req.stream:
            return EventStream(self.chat_events(ctx, req, streams), streams)
        return await unless_disconnected(raw, self.chat_response(ctx, req, streams), streams)

    def chat_events(self, ctx: dict, req: ChatCompletionRequest, streams):
        """First the role, in a chunk of its own for every choice; then content deltas (`{}` for
        one without text), with chat's logprobs. A chunk has no stop_reason; the response does.
        A tool call streams as OpenAI's do: a named function's arguments as they come (the first
        delta names the call); "required"'s calls, a JSON list until it ends, in the last chunk
        (an unfinished list stays content, as in the response)."""
        num_lp, tok = req.num_logprobs, self.engine.tokenizer
        calls = req.tool_constraint() != []
        first = {"role": "assistant", "content": None if calls else ""}  # OpenAI's: a tool call has no content
        role = [{"index": index, "delta": first, "logprobs": None, "finish_reason": None}
                for index in range(req.num_samples)]  # fmt: skip
        held = ["" for _ in role]  # "required": the text so far, parsed when it ends
        named: dict[int, str] = {}  # a named function's call id, once its first delta went out

        def delta(index: int, c: CompletionOutput) -> tuple[dict, str | None]:
            if not calls:
                return {"content": c.text} if c.text else {}, c.finish_reason
            if req.tool_choice != "required":
                if not c.text:
                    return {}, c.finish_reason
                call = {"index": 0, "function": {"arguments": c.text}}
                if index not in named:
                    named[index] = f"call_{uuid.uuid4().hex[:24]}"
                    call = {**call, "id": named[index], "type": "function",
                            "function": {"name": req.tool_choice["function"]["name"], "arguments": c.text}}  # fmt: skip
                return {"tool_calls": [call]}, c.finish_reason
            held[index] += c.text
            if c.finish_reason is None:
                return {}, None
            parsed = tool_calls(req, held[index]) if c.finish_reason == "stop" else None
            if parsed is None:
                return {"content": held[index]}, c.finish_reason
            return {"tool_calls": [{"index": i, **call} for i, call in enumerate(parsed)]}, "tool_calls"

        def choice(index: int, c: CompletionOutput, out: RequestOutput) -> dict:
            lp = None if num_lp is None else chat_logprobs(c.token_ids, c.logprobs or [], num_lp, tok)
            d, finish = delta(index, c)
            if not (d or finish or lp):
                return None  # "required"'s text held back, and no logprobs to send: no chunk
            return {"index": index, "delta": d, "logprobs": lp, "finish_reason": finish}

        return self.events({**ctx, "object": "chat.completion.chunk"}, req, streams, role, choice, num_lp is not None)

    def chat_response(self, ctx: dict, req: ChatCompletionRequest, streams):
        num_lp, tok = req.num_logprobs, self.engine.tokenizer
        calls = req.tool_constraint() != []  # the output is a tool call (tool_choice "required" or a name)

        def choice(index: int, ch: Choice) -> dict:
            message = {"role": "assistant", "content": ch.text, "refusal": None}
            finish = ch.finish_reason
            parsed = tool_calls(req, ch.text) if calls and finish == "stop" else None
            if parsed is not None:
                message["content"], message["tool_calls"] = None, parsed
                finish = "tool_calls" if req.tool_choice == "required" else "stop"  # OpenAI: a forced name says stop
            return {"index": index, "message": message,
                    "logprobs": None if num_lp is None else chat_logprobs(ch.token_ids, ch.logprobs, num_lp, tok),
                    "finish_reason": finish, "stop_reason": ch.stop_reason}  # fmt: skip

        return self.response({**ctx, "object": "chat.completion"}, req, streams, [""], choice)


def tool_calls(req: ChatCompletionRequest, text: str) -> list[dict] | None:
    """The OpenAI tool calls a constrained output stands for: a named function's arguments, or
    ("required") a list of {"name", "parameters"}, one call each; None if the text is not one
    (a stop string cut it short: the grammar only promises what it finished)."""
    try:
        out = json.loads(text)
    except ValueError:
        return None
    if req.tool_choice == "required":
        pairs = [(call["name"], call["parameters"]) for call in out]
    else:
        pairs = [(req.tool_choice["function"]["name"], out)]
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}} for name, args in pairs]  # fmt: skip


def tokenizer_info(tokenizer) -> dict:
    """`GET /tokenizer_info`, as vLLM serves it: the tokenizer's own settings (its `init_kwargs`, what its
    tokenizer_config.json says, file paths left out, added tokens as their text), its class, its chat template."""

    def plain(x):
        if hasattr(x, "content"):  # an AddedToken
            return x.content
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x if x is None or isinstance(x, (str, int, float, bool)) else str(x)

    info = {k: plain(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
            if k not in ("vocab_file", "merges_file")}  # fmt: skip
    info["tokenizer_class"] = type(tokenizer).__name__
    if getattr(tokenizer, "chat_template", None):
        info["chat_template"] = tokenizer.chat_template
    return info


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def too_long(e: ValueError) -> str | None:
    return "context_length_exceeded" if isinstance(e, PromptTooLongError) else None


def stream_usage(include_usage: bool, continuous: bool, prompt_tokens: int, completion_tokens: int) -> dict:
    """The `usage` of one chunk: none unless asked; null until the last chunk (OpenAI); with
    vLLM's `continuous_usage_stats`, the counts so far."""
    if not include_usage:
        return {}
    return {"usage": usage(prompt_tokens, completion_tokens) if continuous else None}


def engine_unavailable(engine: AsyncLLMEngine) -> APIError:
    """503 + Retry-After for a dead or stopped engine: a supervisor restarts the process, and a
    client that retries later reaches the new one. The message says why (which rank, its exit code)."""
    why = f"the engine is dead: {engine.dead}" if engine.dead is not None else "the engine is not running"
    return APIError(503, why, None, "engine_dead" if engine.dead is not None else None, {"Retry-After": "5"})


def stream_error(e: Exception) -> dict:
    """An error after the response started: it travels as an event (the status line is long gone)."""
    if isinstance(e, APIError):
        return e.body()
    log.error("request failed while streaming: %r", e)
    return APIError(500, f"the request failed: {e}").body()
