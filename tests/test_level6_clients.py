"""Level 6 against real clients: guidellm, the `openai` SDK sending every nullable field as null,
and a schema fuzzer over `/openapi.json`.

What it is: the issue's "real clients" checks, each against a real uvicorn on a free 127.0.0.1
port (a `ServerThread` of this process, so the test can see the bodies that arrived):

  - guidellm (0.8.1), streaming: the exact request bodies it sends for completions and chat,
    recorded once in `tests/data/guidellm_requests.json`, are replayed and must give a 200
    SSE stream ending in `[DONE]`, with the usage so far in every chunk (guidellm asks for
    `continuous_usage_stats`) and exactly `max_tokens` tokens (it sends `ignore_eos`). Where
    guidellm is installed, a bounded `guidellm run` (8 requests per endpoint) runs as well
    and must report 0 errored requests and 16 tokens for each, and the bodies it sent must
    still be the recorded ones (its version moved on, or its bodies did: re-record, below);
  - the `openai` SDK: every parameter of `completions.create` and `chat.completions.create`
    that may be None, enumerated from the SDK's own signature (a field a newer SDK adds is
    covered without editing this file), sent as JSON null, gives the text of the same request
    without them, streamed and not; and the spec's other spellings (`max_tokens: 101.0`,
    `"stream": null`, `include_obfuscation`, a chat message's `"refusal": null`);
  - schemathesis: generated valid and invalid bodies for every operation of `/openapi.json`,
    a bounded and derandomized run, with every check schemathesis has for a single request: no
    5xx, every status, content type and JSON body as the document says, every invalid body
    rejected, and every valid body accepted, save a 400 whose code the operation lists as a
    rule no JSON schema can state (`x-refusals`: a prompt's length in tokens, a grammar that
    does not compile; protocol.REFUSALS). A 400 with any other code is a hole in the document.

The guidellm checks use a random checkpoint whose every token is an end-of-sequence token:
without `ignore_eos` each request ends after one token, so reaching `max_tokens` proves the
flag was honoured, not luck.

Re-recording the guidellm bodies (a new guidellm version):
    LEVEL6_RECORD_GUIDELLM=1 python -m pytest -q tests/test_level6_clients.py -k guidellm_run

What it is not: a speed test, or a check of what the text says (test_level6.py compares the
server with offline generation). guidellm and schemathesis are optional: without them their
tests are skipped, saying which package is missing.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import types
import typing
from pathlib import Path

import httpx
import pytest
from level6_helpers import NAME, serve, sse_events

from level6_serving.metrics import parse, value

pytestmark = pytest.mark.level6

# max_model_len 128 keeps every request a fuzzer can make cheap: at most 128 tokens each.
ENGINE = dict(dtype="float64", max_model_len=128, seed=0, kv_cache_memory=16 << 20, max_num_seqs=4)
DATA = Path(__file__).resolve().parent / "data" / "guidellm_requests.json"
GUIDELLM_VERSION = "0.8.1"  # the version the bodies in DATA were recorded with


class Seen(list):
    """What a server received, in order of arrival: one dict per request (method, path, body, status)."""

    def bodies(self, path: str) -> list[tuple[dict, int | None]]:
        return [(json.loads(r["body"]), r["status"]) for r in self if r["method"] == "POST" and r["path"] == path]


class BodyRecorder:
    """ASGI middleware, outermost: remembers each request's raw body and status, to see what a client sent.

    Both are written before the client can see any answer (the body is read before the status
    line goes out), so a client that has its response finds its request here, finished or not."""

    def __init__(self, app, seen: Seen):
        self.app, self.seen = app, seen

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = {"method": scope["method"], "path": scope["path"], "body": b"", "status": None}
        self.seen.append(record)

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                record["body"] += message.get("body", b"")
            return message

        async def recording_send(message):
            if message["type"] == "http.response.start":
                record["status"] = message["status"]
            await send(message)

        await self.app(scope, recording_receive, recording_send)


@contextlib.contextmanager
def recording_server(ckpt: Path, **app_kw):
    """A server (level6_helpers.serve) with this file's ENGINE; `seen` has the requests that arrived."""
    seen = Seen()
    recorder = (BodyRecorder, {"seen": seen})  # added last: the outermost, it sees the body as it arrived
    with serve(ckpt, ENGINE, middleware=(recorder,), timeout=60, **app_kw) as s:
        s.seen = seen
        yield s


@pytest.fixture(scope="module")
def server(ckpt):
    """The random checkpoint test_level6.py uses, with the small context above."""
    with recording_server(ckpt, max_num_waiting=32) as s:
        yield s


@pytest.fixture(scope="module")
def eos_ckpt(checkpoint_factory):
    """Every token is an end-of-sequence token: only `ignore_eos` lets a request go past one token."""
    return checkpoint_factory("llama", tokenizer=True, eos_token_id=list(range(259)))


@pytest.fixture(scope="module")
def eos_server(eos_ckpt):
    with recording_server(eos_ckpt) as s:
        yield s


def post_stream(url: str, path: str, body: dict) -> tuple[list[dict], str]:
    """POST a streaming body; the JSON chunks (checked: 200, SSE, [DONE] last, no error) and their text."""
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        raw = r.read()
        assert r.status_code == 200, raw[:500]
        assert r.headers["content-type"].startswith("text/event-stream")
    data = sse_events(raw)
    assert data[-1] == "[DONE]" and "[DONE]" not in data[:-1]
    chunks = [json.loads(d) for d in data[:-1]]
    assert not [c for c in chunks if "error" in c], chunks  # guidellm counts such a stream as an errored request
    chat = "chat" in path
    text = "".join((c["delta"].get("content") or "") if chat else c["text"] for ch in chunks for c in ch["choices"])
    return chunks, text


# --- guidellm: the bodies it sends, replayed --------------------------------------------------------
def recorded() -> dict:
    return json.loads(DATA.read_text())


def replay_cases() -> list:
    if not DATA.exists():  # not recorded yet (see the docstring): nothing to replay
        return []
    return [pytest.param(variant, i, id=f"{variant}-{i}")
            for variant, v in recorded()["variants"].items() for i in range(len(v["bodies"]))]  # fmt: skip


@pytest.mark.parametrize("variant, i", replay_cases())
def test_guidellm_s_recorded_bodies_stream_as_it_expects(eos_server, variant, i):
    v = recorded()["variants"][variant]
    path, body = v["path"], v["bodies"][i]
    assert body["stream"] is True and body["ignore_eos"] is True and body["stream_options"]["continuous_usage_stats"]
    want = body.get("max_completion_tokens", body.get("max_tokens"))
    chunks, text = post_stream(eos_server.url, path, body)
    # continuous_usage_stats: guidellm reads the usage of the latest chunk that has one, so every chunk has it
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages), [c for c in chunks if c["usage"] is None][:2]
    assert len({u["prompt_tokens"] for u in usages}) == 1
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done), done
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    last = chunks[-1]  # include_usage: the final chunk has no choices, and the totals
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == want
    content = [c["choices"][0] for c in chunks if c["choices"]]
    assert [c["finish_reason"] for c in content][-1] == "length" and text
    # The control: without ignore_eos this checkpoint stops after one token, so `want` was the flag's doing.
    chunks, _ = post_stream(eos_server.url, path, {k: v for k, v in body.items() if k != "ignore_eos"})
    assert chunks[-1]["usage"]["completion_tokens"] == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


# --- guidellm: a bounded live run -----------------------------------------------------------------
# What `guidellm run` is asked to do: per endpoint, 8 requests (4 at a time) of 32 synthetic prompt
# tokens and 16 output tokens, streamed. The chat run adds an 8-token shared prefix, which guidellm
# sends as a system message (its user message is a list of text parts).
GUIDELLM_RUNS = {
    "completions": ("/v1/completions", "prompt_tokens=32,output_tokens=16"),
    "chat": ("/v1/chat/completions", "prompt_tokens=32,output_tokens=16,prefix_tokens=8"),
}
GUIDELLM_REQUESTS = 8


def guidellm_command(url: str, path: str, data: str, tokenizer: str, output: str) -> list[str]:
    return ["guidellm", "run",
            "--backend", f"kind=openai_http,target={url},model={NAME},request_format={path}",
            "--profile", "kind=concurrent,streams=4",
            "--constraint", f"kind=max_requests,count={GUIDELLM_REQUESTS}",
            "--data", f"kind=synthetic_text,{data}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",  # a local directory: nothing downloads
            "--data-loader", "kind=pytorch,prefetch_factor=16",  # not 4096 prompts made ahead for 8 requests
            "--output", f"kind=json,path={output}",
            "--disable-console-interactive"]  # fmt: skip


def run_bounded(cmd: list[str], timeout: float, log: Path, env: dict) -> int:
    """Run `cmd` in a session of its own (guidellm spawns worker processes) and leave nothing behind."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent,
                                start_new_session=True)  # fmt: skip
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`{' '.join(cmd[:3])} ...` ran past {timeout:.0f} s:\n{log.read_text()[-3000:]}")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the run and any worker it left
            proc.wait()


def without_text(body):
    """A body with its prompt texts blanked: what guidellm sends apart from the synthetic words."""
    if isinstance(body, dict):
        return {k: "<text>" if k in ("prompt", "text", "content") and isinstance(v, str) else without_text(v)
                for k, v in body.items()}  # fmt: skip
    if isinstance(body, list):
        return [without_text(v) for v in body]
    return body


@pytest.mark.skipif(importlib.util.find_spec("guidellm") is None,
                    reason=f"guidellm is not installed (pip install guidellm=={GUIDELLM_VERSION}); "
                           "its recorded bodies are still replayed")  # fmt: skip
@pytest.mark.parametrize("variant", list(GUIDELLM_RUNS))
def test_guidellm_run_reports_no_errors(eos_server, eos_ckpt, variant, tmp_path):
    path, data = GUIDELLM_RUNS[variant]
    output = tmp_path / "benchmarks.json"
    cmd = guidellm_command(eos_server.url, path, data, str(eos_ckpt), str(output))
    # One worker process, not 10 (2 cores); offline, so a missing local file is an error, not a download.
    env = {**os.environ, "GUIDELLM__MAX_WORKER_PROCESSES": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}  # fmt: skip
    before = len(eos_server.seen.bodies(path))
    rc = run_bounded([sys.executable, "-m", *cmd], 300, tmp_path / "guidellm.log", env)
    assert rc == 0, (tmp_path / "guidellm.log").read_text()[-3000:]
    bench = json.loads(output.read_text())["benchmarks"][0]
    totals, state = bench["metrics"]["request_totals"], bench["scheduler_state"]
    assert (totals["errored"], totals["incomplete"]) == (0, 0), totals
    assert (state["errored_requests"], state["cancelled_requests"], state["created_requests"]) == (0, 0, GUIDELLM_REQUESTS)
    # guidellm 0.8.1 can write its report while its worker's word that the last request finished is still on the
    # way (seen once under load: created 8, processed 7, processing 1, none errored or cancelled): such a request
    # is in flight in guidellm's books, not lost; every request is one or the other, and the server's own log of
    # all 8 bodies, each answered 200, is checked below.
    assert totals["successful"] + state["processing_requests"] == GUIDELLM_REQUESTS, state
    assert totals["successful"] >= 1, totals
    for r in bench["requests"]["successful"]:  # what guidellm read from our usage
        assert r["output_metrics"]["text_tokens"] == 16 and r["input_metrics"]["text_tokens"] > 0, r
    sent = eos_server.seen.bodies(path)[before:]
    assert len(sent) == GUIDELLM_REQUESTS and all(status == 200 for _, status in sent)
    bodies = [body for body, _ in sent]
    version = importlib.metadata.version("guidellm")
    if os.environ.get("LEVEL6_RECORD_GUIDELLM"):  # re-record: these bodies become the replayed ones
        variants = recorded()["variants"] if DATA.exists() else {}
        doc = {"guidellm_version": version}
        doc["note"] = ("The request bodies guidellm sent, as the server received them, recorded by "
                       "LEVEL6_RECORD_GUIDELLM=1 python -m pytest tests/test_level6_clients.py -k guidellm_run; "
                       "replayed by test_guidellm_s_recorded_bodies_stream_as_it_expects. GUIDELLM__MAX_WORKER_PROCESSES=1.")  # fmt: skip
        shown = guidellm_command("http://127.0.0.1:PORT", path, data, "CHECKPOINT_DIR", "benchmarks.json")
        variants[variant] = {"path": path, "command": shown, "bodies": sorted(bodies, key=json.dumps)}
        doc["variants"] = variants
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps(doc, indent=1) + "\n")
        return
    # Still what was recorded, apart from the synthetic words: else the replay above tests old bodies.
    want = recorded()["variants"][variant]
    assert want["path"] == path
    canonical = lambda bs: sorted(json.dumps(without_text(b), sort_keys=True) for b in bs)  # noqa: E731
    assert canonical(bodies) == canonical(want["bodies"]), (
        f"guidellm {version} sends other bodies than {recorded()['guidellm_version']} did: "
        f"re-record (this file's docstring says how). Now: {bodies[0]}"
    )


# --- the openai SDK with every nullable field null ------------------------------------------------
TRANSPORT = {"extra_headers", "extra_query", "extra_body", "timeout"}  # options of the call, not JSON fields
# Nullable in the SDK but this server's gaps, reported (excluded here so the rest stays checked):
KNOWN_GAPS = {
    # completions: `prompt` is the input itself; OpenAI's schema makes it nullable (default
    # "<|endoftext|>"), this server (as vLLM) answers "prompt": null with a 400.
    "prompt",
}


def accepts_none(annotation) -> bool:
    """Whether a parameter's annotation admits None (`Optional[X] | Omit`, `Union[..., None]`)."""
    if isinstance(annotation, str):  # a name the SDK imports only for type checkers: read the text
        return re.search(r"\bNone\b|\bOptional\[", annotation) is not None
    if annotation is type(None):
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(accepts_none(a) for a in typing.get_args(annotation))
    return False


def nullable_params(method, given: dict) -> list[str]:
    try:  # the SDK's annotations are strings (`from __future__ import annotations`): evaluate them
        params = inspect.signature(method, eval_str=True).parameters
    except NameError:
        params = inspect.signature(method).parameters
    names = [n for n, p in params.items() if n != "self" and n not in TRANSPORT and accepts_none(p.annotation)]
    return [n for n in names if n not in given and n not in KNOWN_GAPS]


def sent_body(server, path: str) -> dict:
    return server.seen.bodies(path)[-1][0]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_openai_sdk_with_every_nullable_field_null(server, endpoint, stream):
    c = server.client
    if endpoint == "completions":
        create, path = c.completions.create, "/v1/completions"
        base = dict(model=NAME, prompt="ROMEO:\n", max_tokens=12, temperature=0)
        text = lambda r: r.choices[0].text if not stream else "".join(ch.choices[0].text for ch in r if ch.choices)
    else:
        create, path = c.chat.completions.create, "/v1/chat/completions"
        base = dict(model=NAME, messages=[{"role": "user", "content": "Who art thou?"}], max_completion_tokens=12,
                    temperature=0)  # fmt: skip
        text = lambda r: (r.choices[0].message.content if not stream
                          else "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices))  # fmt: skip
    if stream:
        base["stream"] = True
    nulls = nullable_params(create, base)
    assert {"n", "stop", "seed", "logprobs", "stream_options", "top_p"} <= set(nulls), nulls  # the enumeration works
    want = text(create(**base))
    got = text(create(**base, **dict.fromkeys(nulls)))
    assert got == want and len(want) > 0
    body = sent_body(server, path)
    assert {k: body[k] for k in nulls} == dict.fromkeys(nulls), "the SDK sent them as null (else this proves nothing)"


def test_the_spec_s_other_spellings_are_accepted(server):
    c = server.client
    # max_tokens 101.0: JSON Schema's integer; ignore_eos so all 101 are made (128 - 101 leaves room for the prompt)
    r = c.completions.create(model=NAME, prompt="ROMEO:\n", temperature=0, extra_body={"max_tokens": 101.0,
                                                                                         "ignore_eos": True})  # fmt: skip
    assert sent_body(server, "/v1/completions")["max_tokens"] == 101.0
    assert r.usage.completion_tokens == 101 and r.choices[0].finish_reason == "length"
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 101.0,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 101, r.text
    message = r.json()["choices"][0]["message"]
    assert "refusal" in message and message["refusal"] is None and message["role"] == "assistant"
    # "stream": null, "n": null, "echo": null: their defaults (one JSON answer, one choice, no echo)
    raw = {"model": NAME, "prompt": "ROMEO:\n", "max_tokens": 8, "temperature": 0, "stream": None, "n": None,
           "echo": None}  # fmt: skip
    r = httpx.post(server.url + "/v1/completions", json=raw, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    plain = c.completions.create(model=NAME, prompt="ROMEO:\n", max_tokens=8, temperature=0).choices[0].text
    assert [ch["text"] for ch in r.json()["choices"]] == [plain]
    # include_obfuscation: OpenAI's padding against length side channels, accepted and ignored
    for path, extra in (("/v1/completions", {"prompt": "ROMEO:\n"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):  # fmt: skip
        body = {"model": NAME, "max_tokens": 6, "temperature": 0, "stream": True, **extra,
                "stream_options": {"include_usage": True, "include_obfuscation": True}}  # fmt: skip
        chunks, _ = post_stream(server.url, path, body)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
        assert all(ch["usage"] is None for ch in chunks[:-1])


# --- schemathesis over /openapi.json --------------------------------------------------------------
# Every answer gets every check: /openapi.json documents /health's empty body, /metrics' text, and a
# stream's events (in OpenAPI 3.1 the schema of text/event-stream is one event's: {"data": ...}).
EXAMPLES = {"POST /v1/completions": 40, "POST /v1/chat/completions": 40}  # generation: the dear ones
OTHER_EXAMPLES = 20  # tokenize, detokenize, and the GETs (which have no parameters: one example each)
# Bodies the server supports, each answered 200: generated ones mostly set some field to a value the
# server refuses (a 400, as documented), so these make sure every 200 shape meets its schema too.
VERSE = [{"role": "system", "content": "Speak verse."}, {"role": "user", "content": "Who art thou?"}]
SUPPORTED = {
    "POST /v1/completions": [
        {"model": NAME, "prompt": "ROMEO:\n", "max_tokens": 5},
        {"prompt": ["ROMEO:\n", "JULIET:\n"], "n": 2, "max_tokens": 4, "logprobs": 2, "seed": 1, "stop": ["\n"]},
        {"prompt": [5, 77, 3], "echo": True, "max_tokens": 3, "temperature": 0},
        {"prompt": "ROMEO:\n", "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
    ],
    "POST /v1/chat/completions": [
        {"model": NAME, "messages": VERSE, "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 2},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 4, "n": 2},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True},
    ],
    "POST /tokenize": [{"prompt": "ROMEO:\n"}, {"messages": [{"role": "user", "content": "Hi"}]}],
    "POST /detokenize": [{"tokens": [82, 79, 77]}],
}


@pytest.mark.skipif(importlib.util.find_spec("schemathesis") is None,
                    reason="schemathesis is not installed (pip install schemathesis)")  # fmt: skip
def test_schemathesis_finds_no_5xx_and_no_schema_violation(server):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        positive_data_acceptance,
        response_schema_conformance,
        status_code_conformance,
    )

    from benchmarks.clients.schemathesis_hooks import listed_refusal

    doc = httpx.get(server.url + "/openapi.json", timeout=30).json()

    def positive_data_accepted_or_listed_refusal(ctx, response, case):
        """schemathesis' positive-data check, save a 400 whose `code` the operation's 400 lists in x-refusals."""
        try:
            return positive_data_acceptance(ctx, response, case)
        except AssertionError:  # schemathesis' failures are AssertionErrors
            if listed_refusal(case, response) is None:
                raise

    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              negative_data_rejection, positive_data_accepted_or_listed_refusal]  # fmt: skip

    def call_and_validate(case, checks):
        response = case.call(base_url=server.url, timeout=60)
        case.validate_response(response, checks=checks)
        return response

    schema = schemathesis.openapi.from_dict(doc)
    operations = {op.label: op for op in (result.ok() for result in schema.get_all_operations())}
    assert set(SUPPORTED) <= set(operations), sorted(operations)
    for label, bodies in SUPPORTED.items():
        for body in bodies:
            response = call_and_validate(operations[label].Case(body=body), checks)
            assert response.status_code == 200, (label, body, response.text[:300])
    statuses: dict[str, list[int]] = {}

    def fuzzer(op, mode, checks):
        """One bounded, derandomized hypothesis run of `op`'s generated cases (`mode`: valid or not)."""
        key = f"{op.label} {mode.value}"

        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES.get(op.label, OTHER_EXAMPLES), deadline=None, derandomize=True,
                  database=None, phases=[Phase.explicit, Phase.generate],  # no shrinking: bounded time
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        def fuzz(case):
            statuses.setdefault(key, []).append(call_and_validate(case, checks).status_code)

        return fuzz

    for op in operations.values():
        # Negative data needs something to break: an operation with no body and no parameters has none.
        has_input = bool(op.body or list(op.iter_parameters()))
        for mode in [schemathesis.GenerationMode.POSITIVE] + [schemathesis.GenerationMode.NEGATIVE] * has_input:
            fuzzer(op, mode, checks)()
    # Some generated requests reached the engine, not only the validation.
    assert 200 in [s for label in EXAMPLES for s in statuses[f"{label} positive"]], statuses
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert server.engine.num_unfinished == 0  # every fuzzed request ended
    metrics = parse(httpx.get(server.url + "/metrics", timeout=30).text)
    assert value(metrics, "vllm:kv_cache_usage_perc") == 0.0  # and let go of its blocks
