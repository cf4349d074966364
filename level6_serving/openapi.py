"""`/openapi.json`: the routes as they really are, request bodies and responses included.

What it is: the routes read their bodies themselves (`protocol.parse_body`, so every error
is OpenAI's shape and names its field), which leaves FastAPI nothing to describe. This file
puts the pydantic models of `protocol.py` into the document (`body()` for one route,
`schema()` for the whole), plus response models written only to describe what `serving.py`
returns, so a client generator or a schema fuzzer (`schemathesis`, in the tests) sees the
real contract: which fields, which types, which statuses.

The request schemas say what the handlers check (`protocol.py` puts it in its models: a
prompt is not empty, a field the server only accepts at its neutral value admits only that
value, exactly one of /tokenize's prompt and messages), and a token id's bound, the served
model's vocabulary, is filled in here when the document is made: so a fuzzer's valid
requests are ones the server accepts (schemathesis' positive-data check, in the tests).

What it is not: validation. Requests are validated by `protocol.py` alone; the response
models here are documentation, checked against real responses by the fuzzing test.

Reference: FastAPI's `openapi_extra`; OpenAI's published OpenAPI document.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from . import protocol


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # vLLM's, when the request asked for them


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: dict[str, str]  # {"name": ..., "arguments": a JSON string}


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None  # with tool_choice "required" or a named function


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizerInfo(BaseModel):
    """vLLM's /tokenizer_info: the tokenizer's settings (whatever its tokenizer_config.json holds) and class."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    chat_template: str | None = None


class Version(BaseModel):
    version: str


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body: the name clients will put in `model`, and the PEFT folder (other
    keys are ignored, as the handler ignores them)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)


class ErrorBody(BaseModel):
    message: str
    type: Literal["invalid_request_error", "server_error"]
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


MODELS = [protocol.CompletionRequest, protocol.ChatCompletionRequest, protocol.TokenizeRequest,
          protocol.DetokenizeRequest, CompletionResponse, ChatCompletionResponse, TokenizeResponse,
          DetokenizeResponse, ModelList, Version, ErrorResponse, TokenizerInfo, LoadLoRAAdapterRequest,
          UnloadLoRAAdapterRequest]  # fmt: skip

ERRORS = {
    "400": "a malformed or unsupported request (the error names the field)",
    "401": "a missing or wrong API key (--api-key)",
    "404": "an unknown model",
    "413": "a body over --max-request-body-bytes",
    "503": "overloaded, shutting down, or the engine is dead (Retry-After says when to come back)",
}


def ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def body(request: str, response: str, stream: bool = False) -> dict:
    """A route's `openapi_extra`: its JSON body and its answers."""
    ok = {"application/json": {"schema": ref(response)}}
    if stream:  # "stream": true answers with Server-Sent Events; in OpenAPI 3.1 the schema is one event's
        ok["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],
                                              "properties": {"data": {"type": "string"}}}}  # fmt: skip
    errors = {code: {"description": why, "content": {"application/json": {"schema": ref("ErrorResponse")}}}
              for code, why in ERRORS.items()}  # fmt: skip
    refusals = getattr(protocol, request).REFUSALS
    if refusals:  # what a body this document admits may still get: each its own `code` (protocol.REFUSALS)
        errors["400"]["x-refusals"] = {code: protocol.REFUSALS[code] for code in refusals}
        errors["400"]["description"] += ("; a body this document admits may still be refused by a rule no JSON "
                                         "schema states, with one of the codes in x-refusals")  # fmt: skip
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
            "responses": {"200": {"description": "OK", "content": ok}, **errors}}  # fmt: skip


def lora_route(request: str) -> dict:
    """The LoRA routes' `openapi_extra` (vLLM's endpoints, in the document only where the server has LoRA): a
    JSON body, a plain-text success, and the errors the handlers give."""
    errors = {"400": "no LoRA on this server, a malformed body, a name already served, or a bad adapter",
              "401": ERRORS["401"], "404": "unload: no adapter of that name is served"}  # fmt: skip
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
            "responses": {"200": {"description": "OK", "content": {"text/plain": {"schema": {"type": "string"}}}},
                          **{code: {"description": why, "content": {"application/json": {"schema": ref("ErrorResponse")}}}
                             for code, why in errors.items()}}}  # fmt: skip


def answer(response: str) -> dict:
    """A GET route's `openapi_extra`: its JSON answer."""
    return {"responses": {"200": {"description": "OK", "content": {"application/json": {"schema": ref(response)}}}}}


def fill_bounds(node, bounds: dict) -> None:
    """protocol.BOUND marks a maximum the server sets (a token id's: the served model's vocabulary); it
    becomes `maximum` (BOUND_LENGTH: `maxLength`), or goes (an app with no engine of its own to say it)."""
    if isinstance(node, dict):
        for marker, keyword in ((protocol.BOUND, "maximum"), (protocol.BOUND_LENGTH, "maxLength")):
            if (which := node.pop(marker, None)) in bounds:
                node[keyword] = bounds[which]
        for v in node.values():
            fill_bounds(v, bounds)
    elif isinstance(node, list):
        for v in node:
            fill_bounds(v, bounds)


def schema(app) -> dict:
    """The whole document, made once per app."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                          description="OpenAI-compatible completions and chat, served by inference-ladder's level 6")  # fmt: skip
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for model in MODELS:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
        serving = getattr(app.state, "serving", None)
        fill_bounds(components, {} if serving is None else {
            "vocab": serving.engine.model_config.vocab_size - 1, "max_n": serving.max_n,
            "max_tokens": serving.engine.max_model_len - 1, "prompt_chars": serving.engine.max_prompt_chars})  # fmt: skip
        app.openapi_schema = doc
    return app.openapi_schema
