"""The OpenAI request bodies, validated, and OpenAI's error shape.

What it is: pydantic models of `POST /v1/completions`, `/v1/chat/completions`, `/tokenize`
and `/detokenize` (OpenAI's field names, plus vLLM's sampling extensions that the
`openai` client sends through `extra_body`: `top_k`, `min_p`, `min_tokens`,
`stop_token_ids`, `ignore_eos`, `repetition_penalty`, ...), their translation into a
`SamplingParams`, and `APIError`, which every failure becomes:

    HTTP 400  {"error": {"message": "max_tokens=0 must be an integer >= 1 (or None)",
                         "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Types are strict, as OpenAI's are: `"max_tokens": "5"` is a 400, not a 5. A field the
API does not know is a 400 that names it ("Unrecognized request argument supplied"); a
few OpenAI fields this server does not implement (`logit_bias`, `tools`, ...) are
accepted at their neutral value only, so a client that always sends them still works.

What it is not: the response builder (`serving.py`) or a complete OpenAI schema (no
tools, images, audio or JSON mode).

Reference: the OpenAI API reference (completions, chat, error codes); vLLM
`entrypoints/openai/protocol.py`.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from .base import RequestOutputKind, SamplingParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs (OpenAI allows 5 for completions, 20 for chat)


class APIError(Exception):
    """A failure as OpenAI reports it: an HTTP status and `{"error": {...}}`."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             500: "server_error", 503: "server_error"}  # fmt: skip

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}  # fmt: skip


UNION_HELP = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of text parts",
}


def parse_body(model: type[BaseModel], body: bytes) -> BaseModel:
    """Validate a request body; the first problem becomes a 400 that names its field."""
    try:
        return model.model_validate_json(body or b"null")
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"] if not (isinstance(x, str) and ("[" in x or x in ("str", "int")))]
        param = ".".join(loc) or None
        if err["type"] == "json_invalid":
            raise APIError(400, f"the request body is not valid JSON ({err['msg']})") from None
        if err["type"] == "model_type":
            raise APIError(400, "the request body must be a JSON object") from None
        if err["type"] == "extra_forbidden":
            raise APIError(400, f"Unrecognized request argument supplied: {param}", param) from None
        if err["type"] == "missing":
            raise APIError(400, f"{param} is required", param) from None
        field = loc[-1] if loc else ""
        msg = UNION_HELP.get(field) or UNION_HELP.get(loc[0] if loc else "") or err["msg"][0].lower() + err["msg"][1:]
        raise APIError(400, f"{param}: {msg} (got {err.get('input')!r:.80})", param) from None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """What completions and chat share: the model, sampling, stopping, streaming."""

    model: str | None = None  # optional here (curl users); the openai client always sends it
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted; nothing is done with it
    # OpenAI fields this server does not implement: accepted at their neutral value only.
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        neutral = {
            "logit_bias": not self.logit_bias,
            "response_format": self.response_format in (None, {"type": "text"}),
            "tools": not self.tools,
            "tool_choice": self.tool_choice in (None, "none", "auto") and not self.tools,
        }
        for name, ok in neutral.items():
            if not ok:
                raise APIError(400, f"{name} is not supported by this server", name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")

    def sampling_params(self, max_tokens: int | None, max_tokens_field: str, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams; its ValueError becomes a 400 naming the API field."""
        pick = lambda value, default: default if value is None else value  # noqa: E731
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=pick(self.temperature, 1.0),
                top_p=pick(self.top_p, 1.0), top_k=pick(self.top_k, 0), min_p=pick(self.min_p, 0.0), seed=self.seed,
                stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                presence_penalty=pick(self.presence_penalty, 0.0), frequency_penalty=pick(self.frequency_penalty, 0.0),
                repetition_penalty=pick(self.repetition_penalty, 1.0), logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens, output_kind=RequestOutputKind.DELTA,
            )  # fmt: skip
        except ValueError as e:
            m = re.match(r"SamplingParams\.(\w+)=(.*)", str(e))
            if not m:
                raise APIError(400, str(e)) from None
            field = {"max_tokens": max_tokens_field, "logprobs": self.logprobs_field}.get(m[1], m[1])
            raise APIError(400, f"{field}={m[2]}", field) from None

    logprobs_field: ClassVar[str] = "logprobs"  # the API field that becomes SamplingParams.logprobs


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None  # top-N logprobs per token (OpenAI: at most 5; here MAX_LOGPROBS)
    best_of: int | None = None  # accepted only as n (no best-of search)
    suffix: str | None = None  # no insertion: must be absent

    def validate_request(self) -> None:
        self.check_unsupported()
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported (only best_of == n)", "best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", "suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs={self.logprobs} must be between 0 and {MAX_LOGPROBS}", "logprobs")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs needs the prompt's logprobs, which this engine does not compute",
                           "echo")  # fmt: skip

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", "prompt")
        return list(p)


class ContentPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": self.role, "content": text}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; it wins if both are set
    logprobs: bool = False
    top_logprobs: int | None = None
    parallel_tool_calls: bool | None = None
    logprobs_field: ClassVar[str] = "top_logprobs"

    def validate_request(self) -> None:
        self.check_unsupported()
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", "messages")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError(400, "top_logprobs needs logprobs to be true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise APIError(400, f"top_logprobs={self.top_logprobs} must be between 0 and {MAX_LOGPROBS}",
                               "top_logprobs")  # fmt: skip

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]
