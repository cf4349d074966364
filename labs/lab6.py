"""Lab 6: the streaming endpoint of an OpenAI-compatible server, and aborts on disconnect.

What it is: the lab's definition (see `labs/spec.py`): in `level6_serving/serving.py`, the
Server-Sent Events of `/v1/completions` (`OpenAIServing.events`, the stream both endpoints
share, and `completion_events`, what a completions stream sends; the chat stream's
`chat_events` stays as the worked example), the merging of several requests'
streams, and the three places where a client that leaves must abort its requests at once
(`merge_streams` cancelling its pumps, `EventStream` abandoning its streams however the
response ends, `unless_disconnected` racing a plain response against the disconnect); then, in
`level6_serving/async_engine.py`, `RequestStream._due`, `--stream-interval`'s rule (wake the
reader for a choice's first text, then every N tokens, for a finished choice, and at the end).
The checks are level 6's own tests (a real uvicorn, the official `openai` client, raw
HTTP) and `labs/lab6_checks.py`; the experiment (`labs/lab6_experiment.py`) serves the
built-in model with the student's file in a server process and measures latency
against request rate with `benchmarks.serving`.

What it is not: the rest of the engine's asyncio wrapper (`async_engine.py`: the engine thread,
the hand-over) or the HTTP app (`api_server.py`), or the handout (docs/labs/lab6_serving.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

L6 = "tests/test_level6.py::"
OWN = "labs/lab6_checks.py::"

PARTS = (
    Part(
        "merge_streams",
        """\
(prompt index, output) pairs from several request streams, as the outputs come: a fast prompt does not
wait for a slow one. One stream: iterate it with `async for` (leaving that loop early abandons the
request). Several: one task per stream (asyncio.create_task) pumps its outputs into an asyncio.Queue as
(i, output), then a marker (i, None) when it ends, or (i, exception) if it raised; read the queue until
every stream has ended, yielding outputs and re-raising an exception. In a `finally`, cancel every pump
task: when the reader stops early (the client left), a cancelled pump leaves its `async for`, which
abandons its request, and the engine aborts it and frees its blocks.""",
    ),
    Part(
        "EventStream.__call__",
        """\
Send the response (await super().__call__(scope, receive, send)), and however that ends (done, the client
gone, cancelled: a `finally`), abandon every stream in self.streams (s.abandon(); a finished one ignores
it). The body generator cannot do this alone: a client that leaves before the first byte means the
generator never started, so its own cleanup never runs.""",
    ),
    Part(
        "unless_disconnected",
        """\
A non-streaming response takes as long as the whole answer. Run `work` (the coroutine that builds it) as a
task, and race it (asyncio.wait, FIRST_COMPLETED) against a task that waits for the client to leave (loop
on `await raw.receive()` until a message of type "http.disconnect"). If the response is ready, return it.
If the client left first, cancel the work, abandon every stream (the engine aborts the requests now, not
when the answer would have been done) and return Response(status_code=499) (nobody will read it). If this
handler is itself cancelled while waiting, do the same and re-raise. Always cancel the watcher.""",
    ),
    Part(
        "OpenAIServing.events",
        """\
The SSE events of a stream, for both endpoints. completion_events and chat_events (below) pass what differs:
`opening`, the choices sent before any output (the echo; chat: the role), and `choice(index, c)`, the choice
that carries the delta c. Every chunk is sse({**ctx, "choices": [one choice], **extra}), where extra =
stream_usage(*req.usage_in_stream(), prompt tokens of every stream, completion tokens so far).
  First one chunk per opening choice. Then for each (i, out) of merge_streams(streams), each completion c of
  out.outputs: index = i * req.num_samples + c.index (OpenAI's numbering); count c's tokens for the usage;
  skip c if its choice already finished, or if it brings nothing (no text, no finish reason, and no tokens
  with logprobs_asked); otherwise one chunk with choice(index, c).
  With include_usage, a last chunk {**ctx, "choices": [], "usage": usage(prompt tokens, completion tokens)}.
  An exception once the response has started goes into the stream: yield sse(stream_error(e)).
  Always end with sse("[DONE]").""",
    ),
    Part(
        "OpenAIServing.completion_events",
        """\
What a /v1/completions stream sends; chat_events below does the same for chat, read it first. Return
self.events(ctx, req, streams, opening, choice, logprobs_asked=req.logprobs is not None).
  n = req.num_samples; a choice's index = prompt index * n + sample index.
  opening: if echo, one choice per index with its prompt's text (echo[index // n]), logprobs and
  finish_reason None.
  choice(index, c) = completion_choice(index, c, req.logprobs, offsets[index]); offsets[index] starts at the
  echo's length and grows after each chunk by the text length of the tokens its logprobs name.""",
    ),
)

STREAM_PARTS = (
    Part(
        "RequestStream._due",
        """\
put() merges each step's delta into self._pending (an error waits in self._error, read after it), then asks
this (only when self.stream_interval > 1) whether to wake the reader now. Yes for an error or a finished
output (the last one never waits). Otherwise yes if any choice c of self._pending.outputs has
self.stream_interval new tokens (len(c.token_ids): tokens, not characters), or has finished
(c.finish_reason), or has text while none of its text has gone out yet (c.index not in self._started;
get() adds a choice once it reads text for it): a client's time to first token must not wait for the
interval. A token that shows no text yet (the start of a stop string, half a character) is not that.""",
    ),
)

CHECKS = (
    Check("framing", "a stream is framed as OpenAI frames it (raw bytes)",
          (L6 + "test_stream_is_framed_as_openai_frames_it",),
          "Every event is `data: <json>` and a blank line (sse()), the chunks carry the choice index, text, "
          "finish_reason and stop_reason, and the stream ends with `data: [DONE]`.",
          rule="The stream follows OpenAI's server-sent events byte for byte, from the first event to its "
               "terminator."),
    Check("same-text", "streamed, unstreamed and offline give the same text; deltas never split a character",
          (L6 + "test_completion_streamed_equals_unstreamed_equals_offline",
           L6 + "test_stream_deltas_concatenate_to_the_one_shot_decode"),
          "Send each completion's delta text as it comes (c.text), once per choice, and nothing after a choice "
          "finished; the concatenated deltas must equal the non-streamed text.",
          rule="A client gets the same text streamed, unstreamed or offline: each delta is sent once, nothing after "
               "a choice has finished, and no character is split."),
    Check("choices", "n samples, several prompts, echo, stop and logprobs stream as offline",
          (L6 + "test_echo_and_several_prompts", L6 + "test_n_and_seed_sample_as_offline",
           L6 + "test_stop_as_offline", L6 + "test_logprobs_as_offline"),
          "index = prompt index * n + c.index; echo sends the prompt first, one event per choice; logprobs' "
          "text_offset counts from the start of the choice's text (the echo included).",
          rule="Every choice of every prompt streams what the offline engine produces for it, under its own index, "
               "with echo, stop and logprobs as offline."),
    Check("merge", "several streams merge as outputs come; leaving early abandons them all",
          (OWN + "test_merge_streams",),
          "merge_streams: one pump task per stream into a queue, (i, None) when a stream ends, the exception "
          "re-raised; in a finally, cancel the pumps, so that a reader who stops early aborts every request.",
          rule="Merged streams deliver each output as it comes and pass errors on; when the reader stops, every "
               "source stops."),
    Check("left-before-first-byte", "a client gone before the first byte still aborts its requests",
          (OWN + "test_a_client_gone_before_the_first_byte_aborts",),
          "EventStream.__call__: abandon every stream in a finally around super().__call__: when the client "
          "leaves before the body starts, the body generator never runs, so its cleanup cannot abort anything.",
          rule="A client that leaves before the response has started still aborts its requests."),
    Check("disconnect", "clients that leave (mid-stream, or waiting for a plain response) abort their requests",
          (OWN + "test_clients_that_leave_abort_their_requests",),
          "Closing the body generator must reach the request streams: iterate them with `async for` (their "
          "finally abandons) and cancel merge_streams' pumps when it is closed; a non-streaming response must "
          "race the work against http.disconnect (unless_disconnected), cancel it and abandon the streams.",
          rule="A client that leaves, at any moment, streaming or not, aborts its requests: nothing keeps generating "
               "for nobody."),
    Check("concurrency", "100 concurrent streams get their solo runs' texts; the counters add up",
          (L6 + "test_100_concurrent_streams_equal_their_solo_runs_and_counters_add_up",),
          "With include_usage, every chunk carries usage None and a last chunk carries the usage; nothing may "
          "block the event loop while a stream waits for its next output.",
          rule="Concurrent streams each get what they would get alone, the usage counters add up, and nothing blocks "
               "the event loop."),
    Check("interval", "--stream-interval: first text at once, then every N tokens; a finish, the end, errors at once",
          (L6 + "test_a_stream_interval_wakes_the_reader_for_first_text_every_n_tokens_a_finish_and_an_error",
           L6 + "test_a_stream_interval_sends_fewer_events_of_the_same_tokens"),
          "RequestStream._due: True if self._error or item.finished; else any(...) over item.outputs of: "
          "len(c.token_ids) >= self.stream_interval, c.finish_reason is not None, or c.text and c.index not in "
          "self._started.",
          rule="Fewer events never delay a choice's first visible text, a finished choice, the end of a stream or "
               "an error, and never lose or reorder a token."),
)  # fmt: skip

BUGS = (
    Bug(
        "merge-never-cancels",
        "level6_serving.serving",
        "            t.cancel()  # an unfinished stream is abandoned, so its request is aborted\n",
        "            pass  # the pumps are left to run\n",
        ("merge",),
    ),
    Bug(
        "abandon-only-in-the-body",
        "level6_serving.serving",
        "        try:\n            await super().__call__(scope, receive, send)\n        finally:\n"
        "            for s in self.streams:\n                s.abandon()  # nothing for a finished request\n",
        "        await super().__call__(scope, receive, send)\n",
        ("left-before-first-byte",),
    ),
    Bug(
        "first-token-waits",
        "level6_serving.async_engine",
        "                   or (c.text and c.index not in self._started) for c in item.outputs)  # fmt: skip\n",
        "                   for c in item.outputs)  # fmt: skip\n",
        ("interval",),
    ),
)

LAB = Lab(
    id="6",
    topic="the streaming server: Server-Sent Events, and aborts on disconnect",
    handout="lab6_serving.md",
    modules=(Module("level6_serving.serving", PARTS), Module("level6_serving.async_engine", STREAM_PARTS)),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment("labs.lab6_experiment", (), ("--quick", "--rates", "8", "--num-prompts", "4")),
    minutes=135,
)
