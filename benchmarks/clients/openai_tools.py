"""The `openai` SDK's streamed tool calls against the server, run by hand.

    python -m benchmarks.clients.openai_tools

What it is: one `python -m level6_serving` (the built-in tiny Shakespeare model, a free
127.0.0.1 port) and the unmodified SDK's `chat.completions.create(..., tools=..., stream=True)`
three ways. The chunks are put together by the SDK's own accumulator (`ChatCompletionStreamState`,
what `client.chat.completions.stream()` uses); every call must be of an offered function, its
arguments a JSON object with the schema's required keys, with an id and type "function":

    tool_choice "required", parallel_tool_calls=False   exactly one call, finish_reason "tool_calls"
    tool_choice a named function                         one call, finish_reason "stop" (as OpenAI's)
    tool_choice "required", parallel calls allowed       this model never closes the list: "length",
                                                         the unfinished list as content, no calls

It prints what each run assembled and exits 1 if any check failed.

What it is not: a test of the model's judgement (the tiny model knows no weather; the grammar
only makes its answer a well-formed call), or of tool_choice "auto" (this server has no parser
that finds a call in free text).
"""

from __future__ import annotations

import json
import signal
import sys
import time

from openai import LengthFinishReasonError, OpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

from level6_serving.process import ServerProcess


def function(name: str, description: str, properties: dict) -> dict:
    schema = {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


# Enums and small integers keep the tiny model's constrained answers short.
TOOLS = [
    function(
        "get_weather",
        "The weather in a city",
        {"city": {"enum": ["London", "Verona", "Elsinore"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    ),
    function(
        "count_lines",
        "How many lines a play has",
        {"play": {"enum": ["Hamlet", "Macbeth"]}, "act": {"type": "integer", "minimum": 1, "maximum": 5}},
    ),
]
REQUIRED_KEYS = {t["function"]["name"]: set(t["function"]["parameters"]["required"]) for t in TOOLS}
RUNS = {  # name -> (extra arguments, the finish_reason it must give, how many calls it may give)
    "required, parallel_tool_calls=False": (
        {"tool_choice": "required", "parallel_tool_calls": False},
        "tool_calls",
        [1],
    ),
    "named get_weather": ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "stop", [1]),
    # Unbounded, this byte-level model writes call after call and never closes the list (seen at
    # temperature 0 and 1, 300 tokens): the server then finishes with "length" and sends the unfinished
    # list as content, no tool_calls (serving.py's chat_events). Run to show that, not to pass as a call.
    "required (parallel calls allowed)": ({"tool_choice": "required"}, "length", [0]),
}


def streamed(client: OpenAI, model: str, extra: dict) -> tuple[object, int, int]:
    """One streamed request: the completion the SDK assembles from its chunks, how many chunks came, and
    how many of them carried a tool-call delta."""
    state, chunks, call_chunks = ChatCompletionStreamState(), 0, 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the weather in Verona?"}],
        tools=TOOLS, max_tokens=200, temperature=0, stream=True, **extra)  # fmt: skip
    for chunk in stream:
        state.handle_chunk(chunk)
        chunks += 1
        call_chunks += any(c.delta.tool_calls for c in chunk.choices)
    try:
        return state.get_final_completion(), chunks, call_chunks
    except LengthFinishReasonError as e:  # the SDK's word for an answer cut at max_tokens: show what came
        return e.completion, chunks, call_chunks


def problems(choice, want_finish: str, counts) -> list[str]:
    found = []
    if choice.finish_reason != want_finish:
        found.append(f"finish_reason {choice.finish_reason!r}, not {want_finish!r}")
    calls = choice.message.tool_calls or []
    if want_finish == "length" and not (choice.message.content or "").startswith('[{"name": '):
        found.append("the unfinished answer is not the start of a list of calls")
    if len(calls) not in counts:
        found.append(f"{len(calls)} tool calls")
    for call in calls:
        if call.function.name not in REQUIRED_KEYS:
            found.append(f"a call of {call.function.name!r}, which was not offered")
            continue
        try:
            args = json.loads(call.function.arguments)
        except ValueError as e:
            found.append(f"{call.function.name}'s arguments are not JSON ({e}): {call.function.arguments!r}")
            continue
        if not isinstance(args, dict) or REQUIRED_KEYS[call.function.name] - set(args):
            found.append(f"{call.function.name}'s arguments lack required keys: {args!r}")
        if not call.id or call.type != "function":
            found.append(f"a call without an id or type 'function': {call!r}")
    return found


def main() -> int:
    failed = 0
    with ServerProcess(["--max-model-len", "512"]) as server:
        client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        print(f"server {server.url}, model {model}")
        for name, (extra, finish, counts) in RUNS.items():
            start = time.perf_counter()
            completion, chunks, call_chunks = streamed(client, model, extra)
            choice = completion.choices[0]
            found = problems(choice, finish, counts)
            failed += bool(found)
            print(f"\n{name}: {chunks} chunks ({call_chunks} with tool-call deltas) in {time.perf_counter() - start:.1f} s, "
                  f"finish_reason {choice.finish_reason!r}, content {choice.message.content!r}")  # fmt: skip
            for call in choice.message.tool_calls or []:
                print(f"  tool call {call.id} {call.function.name}({call.function.arguments})")
            print("  " + ("; ".join(found) if found else "OK"))
    print(f"\n{len(RUNS) - failed} of {len(RUNS)} runs OK")
    return 1 if failed else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as Ctrl-C: stop what it started on the way out
    sys.exit(main())
