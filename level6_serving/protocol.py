"""The OpenAI request bodies, validated, and OpenAI's error shape.

What it is: pydantic models of `POST /v1/completions`, `/v1/chat/completions`, `/tokenize`
and `/detokenize` (OpenAI's field names, plus vLLM's sampling extensions that benchmark
clients and the `openai` client's `extra_body` send: `top_k`, `min_p`, `min_tokens`,
`stop_token_ids`, `ignore_eos`, `repetition_penalty`, `stream_options.continuous_usage_stats`,
...), their translation into a `SamplingParams`, and `APIError`, which every failure becomes:

    HTTP 400  {"error": {"message": "max_tokens=0 must be an integer >= 1 (or None)",
                         "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Types follow OpenAI's published schema, which is JSON Schema: `"max_tokens": "5"` is a 400,
not a 5, but `101.0` is the integer 101 (JSON Schema's integers are numbers with no
fraction), and every optional field may be `null`, meaning its default. Numbers must be
finite, and finite in float32, the engine's arithmetic (`1e308` would be `inf` there), so
`Infinity`, `NaN` and `1e308` are 400s naming their field. A field neither OpenAI's schema
nor vLLM's extensions know is a 400 that names it ("Unrecognized request argument
supplied"). Every field OpenAI's schema allows is accepted, in one of three ways:

- honoured: sampling, stopping, streaming, logprobs, `n`, `seed`, `echo` (with `logprobs`, the
  echoed prompt's tokens get theirs: SamplingParams.prompt_logprobs), usage; vLLM's
  `use_beam_search` (with `n` the beam width, `length_penalty`, `ignore_eos`,
  `include_stop_str_in_output`: `beam_search_params`; a field that only shapes sampling or
  streaming must then keep its default, `BEAM_NEUTRAL`);
- ignored, because it cannot change what this server returns (`IGNORED`: `user`, `store`,
  `metadata`, `service_tier`, `priority`, ...), listed in docs/level6_serving.md;
- accepted at its neutral value only (`NEUTRAL_ONLY`: `tools`, `logit_bias`, `response_format`
  other than text, `audio`, ...): anything else is a 400 that says the server does not support it.

The models' JSON schemas (`/openapi.json`, through `openapi.py`) say what the handlers check,
so that a body the document admits is one the server accepts: ranges, non-empty prompts, a
NEUTRAL_ONLY field's neutral value only (`SCHEMA`), token ids within the vocabulary and `n`
within --max-num-seqs (`BOUND`, filled in by openapi.py), and some checks between fields
(`rules()`: stream_options needs stream, beam search's neutral fields, max_tokens 0 needs echo).
Not said there, because no JSON schema can say it: `REFUSALS`, the 400s a body the schema
admits may still get (a prompt's length in tokens, a regex or grammar the engine cannot
compile, more than one field constraining the output, ...). Each carries its own `code`, and
each operation's 400 in `/openapi.json` lists the codes it may send (`x-refusals`): a client,
or schemathesis' positive-data check in the tests, can tell "the schema let a mistake through"
(code null) from "a rule between fields or against the model" (a listed code).

What it is not: the response builder (`serving.py`) or a complete OpenAI schema (no
images or audio; tools only as tool_choice's constrained call).

Reference: the OpenAI API reference and its OpenAPI document (completions, chat, error
codes); vLLM `entrypoints/openai/protocol.py`.
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from level3_prefix.beam_search import BeamSearchParams

from .base import RequestOutputKind, SamplingParams, StructuredOutputsParams

MAX_LOGPROBS = 20  # vLLM's default max_logprobs (OpenAI allows 5 for completions, 20 for chat)
FLOAT32_MAX = 3.4028234663852886e38


class APIError(Exception):
    """A failure as OpenAI reports it: an HTTP status and `{"error": {...}}` (4xx: the client's
    mistake, `invalid_request_error`; 5xx: ours, `server_error`)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# The 400s a schema-valid body may still get: rules no JSON schema can state (a length in tokens, what a compiler
# accepts, a comparison of two fields). Each has its own `code`; every other 400 has code null, so a body the
# document admits and the server refuses with code null is a hole in the document (the fuzzing test looks for one).
REFUSALS = {
    "context_length_exceeded": "the prompt's tokens, with max_tokens, do not fit max_model_len",
    "exceeds_kv_cache": "the prompt and max_tokens need more KV blocks than the whole pool holds",
    "too_many_sequences": "n times the number of prompts is more than the server queues (--max-num-waiting)",
    "invalid_constraint": "a regex, grammar, JSON schema or tool's parameters the structured-output engine refuses",
    "conflicting_constraints": "two fields constrain the output (response_format, guided_*, structured_outputs, tools)",
    "min_tokens_over_max_tokens": "min_tokens is more than max_tokens",
    "best_of_not_n": "best_of is set and differs from n (no best-of search here)",
    "unknown_tool": "tool_choice names a function that is not among tools",
}


def refused(code: str, message: str, param: str | None) -> APIError:
    """A 400 for one of REFUSALS."""
    assert code in REFUSALS, code
    return APIError(400, message, param, code)


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
        loc = [x for x in loc if not x.startswith("function-")]  # the name pydantic gives an Annotated validator
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
        msg = UNION_HELP.get(field) or UNION_HELP.get(loc[0] if loc else "") or err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {msg[0].lower() + msg[1:]} (got {err.get('input')!r:.80})", param) from None


def _integral(value):
    """JSON Schema's integer: 101.0 is 101 (a float with a fraction stays a float, and fails)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _finite32(value: float) -> float:
    if not abs(value) <= FLOAT32_MAX:
        raise ValueError(f"must be a finite number, within float32's range (|x| <= {FLOAT32_MAX:.3g})")
    return value


Int = Annotated[int, BeforeValidator(_integral)]
Float = Annotated[float, AfterValidator(_finite32)]

# What the handlers check, said in the JSON schema too (`/openapi.json`: a client generator or a fuzzer then
# sends what the server accepts). Validation stays in the handlers, whose 400s name the field. BOUND marks a
# maximum the served model or the server's settings set: openapi.py fills it in when the document is made
# ("vocab": the last token id; "max_n": --max-num-seqs; "max_tokens": max_model_len - 1), and BOUND_LENGTH a
# string's maxLength.
BOUND = "x-server-bound"
BOUND_LENGTH = "x-server-max-length"  # the same for a string's maxLength ("prompt_chars": what max_model_len holds)
TokenId = Annotated[Int, Field(json_schema_extra={"minimum": 0, BOUND: "vocab"})]  # checked: [0, vocab_size)
NonEmpty = {"minLength": 1}  # an empty prompt is refused
NULL = {"type": "null"}


def nullable(**schema) -> dict:
    return {"anyOf": [schema, NULL]}


LOGPROBS = nullable(type="integer", minimum=0, maximum=MAX_LOGPROBS)
EMPTY_OBJECT = {"anyOf": [{"type": "object", "maxProperties": 0}, NULL]}  # NEUTRAL_ONLY `not v`
EMPTY_ARRAY = {"anyOf": [{"type": "array", "maxItems": 0}, NULL]}
NONE_OR_AUTO = {"anyOf": [{"enum": ["none", "auto"]}, NULL]}
NAMED = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}
# vLLM's structured_outputs (StructuredOutputsParams' fields): exactly one kind set
STRUCTURED_OUTPUTS = {
    "type": "object", "additionalProperties": False,
    "properties": {"json": nullable(type="object"), "regex": nullable(type="string", format="regex"),
                   "choice": nullable(type="array", minItems=1, items={"type": "string", **NonEmpty}),
                   "grammar": nullable(type="string"), "json_object": nullable(type="boolean"),
                   "disable_any_whitespace": {"type": "boolean"}},
    "oneOf": [*({"required": [k], "properties": {k: {"not": NULL}}} for k in ("json", "regex", "choice", "grammar")),
              {"required": ["json_object"], "properties": {"json_object": {"const": True}}}],
}  # fmt: skip
# chat's tools and tool_choice (OpenAI's function tools; a tool's parameters is a JSON schema)
TOOL = {"type": "object", "required": ["type", "function"], "properties": {"type": {"const": "function"}, "function": {
    **NAMED, "properties": {"name": {"type": "string"}, "description": nullable(type="string"),
                            "parameters": {"type": "object"}, "strict": nullable(type="boolean")}}}}  # fmt: skip
TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required"]}, NULL, {
    "type": "object", "required": ["type", "function"], "properties": {"type": {"const": "function"}, "function": NAMED}}]}  # fmt: skip


def _document(schema: dict, cls) -> None:
    """A model's JSON schema says its SCHEMA (a field's checks: a field accepted at its neutral value only
    admits only that value) and its `rules()` (checks between fields): each "`field` is `unless`, or the body is
    `then`" (anyOf, not if/then: schemathesis cannot generate from several if/thens at once)."""
    for name, field_schema in getattr(cls, "SCHEMA", {}).items():
        schema["properties"][name] = {**field_schema, "title": schema["properties"][name].get("title", name)}
    rules = [{"anyOf": [{"properties": {f: unless}}, then]}
             for f, unless, then in (cls.rules() if hasattr(cls, "rules") else [])]  # fmt: skip
    # Not said: at most one of ONLY_ONE (a rule of 5 branches beside these is more than schemathesis generates from).
    if rules:  # the fields' schema first, then each rule (schemathesis generates from this form, not from
        base = dict(schema)  # the same rules beside "properties")
        schema.clear()
        schema["allOf"] = [base, *rules]


def at_neutral(fields: dict) -> dict:
    """A rule's `then`: each of `fields` absent or at its neutral value (the schema given)."""
    return {"properties": fields}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, json_schema_extra=_document)
    REFUSALS: ClassVar[tuple] = ()  # the codes of REFUSALS this body may get (listed in /openapi.json)


class StreamOptions(Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage so far in every chunk (guidellm sends it)
    include_obfuscation: bool | None = None  # OpenAI pads chunks against length side channels; ignored here


# Accepted and ignored: none of these can change the tokens or the shape of the answer here.
IGNORED = {
    "user": "an end-user id for abuse monitoring",
    "store": "OpenAI's stored completions",
    "metadata": "tags for stored completions",
    "service_tier": "OpenAI's processing tiers",
    "safety_identifier": "an end-user id for abuse monitoring",
    "prompt_cache_key": "a routing hint; prefix caching here is automatic",
    "prompt_cache_retention": "a routing hint; prefix caching here is automatic",
    "prompt_cache_options": "a routing hint; prefix caching here is automatic",
    "priority": "vLLM's priority scheduling; this scheduler is first come, first served",
    "spaces_between_special_tokens": "special tokens are skipped from the text here",
    "prediction": "a latency hint (predicted outputs); the tokens are the same either way",
    "reasoning_effort": "for reasoning models; the built-in models do not reason",
    "verbosity": "for OpenAI's GPT-5 models",
}


class SamplingFields(Strict):
    """What completions and chat share: the model, sampling, stopping, streaming."""

    model: str | None = None  # optional here (curl users); the openai client always sends it
    max_tokens: Int | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    n: Int | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: bool | None = None
    min_tokens: Int | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # IGNORED (above): accepted, with no effect
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    priority: Int | None = None
    spaces_between_special_tokens: bool | None = None
    # structured outputs (one of them at most): OpenAI's response_format, vLLM's guided_* (its older names,
    # which the seeds' examples send) and its structured_outputs
    response_format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None  # {"json": ...} | {"regex": ...} | {"choice": [...]} | ...
    # NEUTRAL_ONLY (below): OpenAI fields this server does not implement, accepted at their neutral value
    logit_bias: dict[str, Float] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    prompt_logprobs: Int | None = None  # vLLM's: the prompt's logprobs (/v1/completions; chat: its neutral value only)
    # vLLM's beam search (beam_search.py): n is the beam width
    use_beam_search: bool | None = None
    length_penalty: Float | None = None  # a finished beam's score: cum_logprob / len(output) ** length_penalty
    # vLLM's disaggregated prefill (features/kv_connectors/tcp.py, level6_serving/disagg.py): to a prefill
    # instance {"do_remote_decode": true, "transfer_id": ...}; to a decode instance what the prefill answered
    kv_transfer_params: dict[str, Any] | None = None

    NEUTRAL_ONLY: ClassVar[dict] = {
        "logit_bias": lambda v: not v,
        "tools": lambda v: not v,
        "tool_choice": lambda v: v in (None, "none", "auto"),
        "prompt_logprobs": lambda v: v is None,
    }
    SCHEMA: ClassVar[dict] = {
        "logit_bias": EMPTY_OBJECT, "tools": EMPTY_ARRAY, "tool_choice": NONE_OR_AUTO, "prompt_logprobs": NULL,
        # SamplingParams' checks and the server's bounds
        "max_tokens": nullable(type="integer", minimum=1, **{BOUND: "max_tokens"}),
        "n": nullable(type="integer", minimum=1, **{BOUND: "max_n"}),
        "temperature": nullable(type="number", minimum=0, maximum=FLOAT32_MAX),
        "top_p": nullable(type="number", exclusiveMinimum=0, maximum=1),
        "top_k": nullable(type="integer", minimum=-1),
        "min_p": nullable(type="number", minimum=0, maximum=1),
        "min_tokens": nullable(type="integer", minimum=0, **{BOUND: "max_tokens"}),
        "seed": nullable(type="integer", minimum=-(2**63), maximum=2**63 - 1),
        "stop": {"anyOf": [{"type": "string", **NonEmpty}, {"type": "array", "items": {"type": "string", **NonEmpty}},
                           NULL]},
        "stop_token_ids": nullable(type="array", items={"type": "integer", "minimum": 0, BOUND: "vocab"}),
        "presence_penalty": nullable(type="number", minimum=-2, maximum=2),
        "frequency_penalty": nullable(type="number", minimum=-2, maximum=2),
        "repetition_penalty": nullable(type="number", minimum=1e-2, maximum=FLOAT32_MAX),
        "length_penalty": nullable(type="number", minimum=-FLOAT32_MAX, maximum=FLOAT32_MAX),
        "guided_regex": nullable(type="string", format="regex"),
        "guided_choice": nullable(type="array", minItems=1, items={"type": "string", **NonEmpty}),
        "guided_json": nullable(type="object"),  # a JSON schema (a string holding one is accepted too)
        "structured_outputs": nullable(**STRUCTURED_OUTPUTS),
        "response_format": {"anyOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "properties": {"type": {"const": "json_schema"},
             "json_schema": {"type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}}},
            NULL]},
    }  # fmt: skip
    # the fields that constrain the output (at most one may: `structured`)
    ONLY_ONE: ClassVar[tuple] = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                 "structured_outputs")  # fmt: skip
    # What has no meaning in a beam search (nothing is drawn, nothing streams): only the default is accepted
    BEAM_NEUTRAL: ClassVar[dict] = {
        "stream": lambda v: not v,
        "stop": lambda v: not v,
        "stop_token_ids": lambda v: not v,
        "min_tokens": lambda v: not v,
        "top_p": lambda v: v in (None, 1),
        "top_k": lambda v: v in (None, 0, -1),
        "min_p": lambda v: not v,
        "presence_penalty": lambda v: not v,
        "frequency_penalty": lambda v: not v,
        "repetition_penalty": lambda v: v in (None, 1),
        "prompt_logprobs": lambda v: v is None,
    }

    @classmethod
    def rules(cls) -> list[tuple[str, dict, dict]]:
        """The checks between fields, for the JSON schema: (field, its values that ask nothing more (absent too),
        what the body must be otherwise)."""
        beam = {"stream": {"enum": [False, None]}, "stop": EMPTY_ARRAY, "stop_token_ids": EMPTY_ARRAY,
                "min_tokens": {"enum": [0, None]}, "top_p": {"enum": [1, None]}, "top_k": {"enum": [0, -1, None]},
                "min_p": {"enum": [0, None]}, "presence_penalty": {"enum": [0, None]},
                "frequency_penalty": {"enum": [0, None]}, "repetition_penalty": {"enum": [1, None]},
                "prompt_logprobs": NULL, "n": nullable(type="integer", minimum=1, maximum=MAX_LOGPROBS // 2),
                **{f: NULL for f in cls.ONLY_ONE if f != "response_format"}, **cls.BEAM_SCHEMA,
                "response_format": {"anyOf": [NULL, {"properties": {"type": {"const": "text"}}}]}}  # fmt: skip
        return [("stream_options", NULL, {"required": ["stream"], "properties": {"stream": {"const": True}}}),
                ("use_beam_search", {"enum": [False, None]}, at_neutral(beam))]  # fmt: skip

    BEAM_SCHEMA: ClassVar[dict] = {}  # an endpoint's own BEAM_NEUTRAL fields, as schemas

    @property
    def num_samples(self) -> int:
        return 1 if self.n is None else self.n

    def usage_in_stream(self) -> tuple[bool, bool]:
        """(a usage chunk at the end, usage so far in every chunk), as asked; as in vLLM, the
        second only with the first."""
        o = self.stream_options
        include = bool(o and o.include_usage)
        return include, include and bool(o.continuous_usage_stats)

    def check_unsupported(self) -> None:
        for name, neutral in self.NEUTRAL_ONLY.items():
            if not neutral(getattr(self, name)):
                raise APIError(400, f"{name} is not supported by this server (only its default)", name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
        if (self.kv_transfer_params or {}).get("do_remote_decode") and (self.stream or self.num_samples != 1):
            raise APIError(400, "kv_transfer_params with do_remote_decode asks for one prefill: stream must be false "
                                "and n 1", "kv_transfer_params")  # fmt: skip

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's structured-output spec and the API field it came from (a 400 names that field
        when the engine cannot compile it); at most one of the fields may ask."""
        asked = []
        rf = self.response_format
        if rf is not None and rf.get("type") != "text":
            if rf.get("type") == "json_object":
                asked.append(({"json_object": True}, "response_format"))
            elif rf.get("type") == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise APIError(400, "response_format.json_schema.schema must be a JSON schema (an object)",
                                   "response_format.json_schema.schema")  # fmt: skip
                asked.append(({"json": schema}, "response_format"))  # strict or not: the schema is always enforced
            else:
                raise APIError(400, f"response_format.type={rf.get('type')!r} must be text, json_object or json_schema",
                               "response_format")  # fmt: skip
        for field, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):  # fmt: skip
            if getattr(self, field) is not None:
                asked.append(({kind: getattr(self, field)}, field))
        if self.structured_outputs is not None:
            flag = self.structured_outputs.get("disable_any_whitespace", False)
            if not isinstance(flag, bool):  # (the schema's type; the params class would take any value)
                raise APIError(400, "structured_outputs.disable_any_whitespace must be a boolean", "structured_outputs")
            asked.append((self.structured_outputs, "structured_outputs"))
        asked += self.tool_constraint()
        if len(asked) > 1:
            raise refused("conflicting_constraints", f"only one of {', '.join(f for _, f in asked)} may constrain the "
                                                     "output", asked[1][1])  # fmt: skip
        if not asked:
            return None, None
        spec, field = asked[0]
        try:
            return StructuredOutputsParams(**spec), field
        except TypeError as e:  # an unknown key: the schema says which there are
            raise APIError(400, f"{field}: {e}", field) from None
        except ValueError as e:
            raise refused("invalid_constraint", f"{field}: {e}", field) from None

    def tool_constraint(self) -> list[tuple[dict, str]]:
        """Chat's tool_choice as a structured-output spec (none here; chat overrides)."""
        return []

    def sampling_params(self, max_tokens: int | None, max_tokens_field: str, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:  # fmt: skip
        """The engine's SamplingParams; its ValueError becomes a 400 naming the API field."""
        pick = lambda value, default: default if value is None else value  # noqa: E731
        try:
            return SamplingParams(
                n=self.num_samples, max_tokens=max_tokens, min_tokens=pick(self.min_tokens, 0),
                temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0), top_k=pick(self.top_k, 0),
                min_p=pick(self.min_p, 0.0), seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                ignore_eos=bool(self.ignore_eos), presence_penalty=pick(self.presence_penalty, 0.0),
                frequency_penalty=pick(self.frequency_penalty, 0.0),
                repetition_penalty=pick(self.repetition_penalty, 1.0), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                include_stop_str_in_output=bool(self.include_stop_str_in_output),
                skip_special_tokens=pick(self.skip_special_tokens, True), output_kind=RequestOutputKind.DELTA,
                structured_outputs=self.structured()[0], extra_args=self.extra_args(),
            )  # fmt: skip
        except ValueError as e:
            m = re.match(r"SamplingParams\.(\w+)=(.*)", str(e))
            if not m:
                raise APIError(400, str(e)) from None
            field = {"max_tokens": max_tokens_field, "logprobs": self.logprobs_field}.get(m[1], m[1])
            if m[1] == "min_tokens" and "max_tokens" in m[2]:  # a rule between two fields
                raise refused("min_tokens_over_max_tokens", f"{field}={m[2]}", field) from None
            raise APIError(400, f"{field}={m[2]}", field) from None

    logprobs_field: ClassVar[str] = "logprobs"  # the API field that becomes SamplingParams.logprobs

    def extra_args(self) -> dict | None:
        """SamplingParams.extra_args: the kv_transfer_params (a prefill's get a transfer id if they have none)."""
        if not self.kv_transfer_params:
            return None
        if self.kv_transfer_params.get("do_remote_decode"):
            self.kv_transfer_params.setdefault("transfer_id", uuid.uuid4().hex)
        return {"kv_transfer_params": dict(self.kv_transfer_params)}

    def beam_search_params(self, max_tokens: int | None) -> BeamSearchParams:
        """`use_beam_search`: n beams (at most MAX_LOGPROBS / 2: each step asks the engine for a beam's
        2n best next tokens) searched to `max_tokens`. A field that shapes sampling or streaming must
        keep its default: a 400 names the first that does not, rather than ignore it."""
        for name, neutral in self.BEAM_NEUTRAL.items():
            if not neutral(getattr(self, name)):
                raise APIError(400, f"{name} is not supported with use_beam_search", name)
        spec, field = self.structured()
        if spec is not None:
            raise APIError(400, f"{field} is not supported with use_beam_search", field)
        if self.num_samples > MAX_LOGPROBS // 2:
            raise APIError(400, f"n={self.num_samples} beams: with use_beam_search n is the beam width, at most "
                                f"{MAX_LOGPROBS // 2} (each step reads 2n logprobs per beam; the server reports "
                                f"{MAX_LOGPROBS})", "n")  # fmt: skip
        try:
            return BeamSearchParams(self.num_samples, max_tokens, bool(self.ignore_eos), 0.0,
                                    1.0 if self.length_penalty is None else self.length_penalty,
                                    bool(self.include_stop_str_in_output))  # fmt: skip
        except ValueError as e:
            raise APIError(400, str(e).replace("BeamSearchParams.", ""), None) from None


class CompletionRequest(SamplingFields):
    prompt: (Annotated[str, Field(json_schema_extra=NonEmpty)]
             | Annotated[list[Annotated[str, Field(json_schema_extra=NonEmpty)]], Field(json_schema_extra={"minItems": 1})]
             | Annotated[list[TokenId], Field(json_schema_extra={"minItems": 1})]
             | Annotated[list[Annotated[list[TokenId], Field(json_schema_extra={"minItems": 1})]],
                         Field(json_schema_extra={"minItems": 1})])  # fmt: skip
    echo: bool | None = None
    logprobs: Int | None = None  # top-N logprobs per token (OpenAI: at most 5; here MAX_LOGPROBS)
    best_of: Int | None = None  # accepted only as n (no best-of search)
    suffix: str | None = None  # no insertion: must be absent

    # vLLM's prompt_logprobs is honoured here (the response's choices carry them, as vLLM's do)
    NEUTRAL_ONLY: ClassVar[dict] = {k: v for k, v in SamplingFields.NEUTRAL_ONLY.items() if k != "prompt_logprobs"}
    SCHEMA: ClassVar[dict] = {**{k: v for k, v in SamplingFields.SCHEMA.items() if k != "prompt_logprobs"},
                              "suffix": {"anyOf": [{"type": "string", "maxLength": 0}, NULL]},
                              "logprobs": LOGPROBS, "prompt_logprobs": LOGPROBS,
                              "max_tokens": nullable(type="integer", minimum=0, **{BOUND: "max_tokens"}),
                              "best_of": nullable(const=1)}  # best_of == n: said for the default n  # fmt: skip
    BEAM_NEUTRAL: ClassVar[dict] = {**SamplingFields.BEAM_NEUTRAL, "logprobs": lambda v: v is None,
                                    "echo": lambda v: not v}  # fmt: skip

    BEAM_SCHEMA: ClassVar[dict] = {"logprobs": NULL, "echo": {"enum": [False, None]}}
    REFUSALS: ClassVar[tuple] = ("context_length_exceeded", "exceeds_kv_cache", "too_many_sequences",
                                 "invalid_constraint", "conflicting_constraints", "min_tokens_over_max_tokens",
                                 "best_of_not_n")  # fmt: skip

    @classmethod
    def rules(cls) -> list[tuple[str, dict, dict]]:  # max_tokens 0: the prompt scored (echo), not searched
        return super().rules() + [("max_tokens", {"anyOf": [NULL, {"minimum": 1}]}, {"required": ["echo"], "properties": {
            "echo": {"const": True}, "use_beam_search": {"enum": [False, None]}}})]  # fmt: skip

    @property
    def num_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: vLLM's field, or, for `echo` with `logprobs`, the same top-N
        as the completion's (the echoed prompt's tokens get logprobs too, as OpenAI's did)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo and self.logprobs is not None else None

    def validate_request(self) -> None:
        self.check_unsupported()
        if self.best_of is not None and self.best_of != self.num_samples:
            raise refused("best_of_not_n", "best_of is not supported (only best_of == n)", "best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", "suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs={self.logprobs} must be between 0 and {MAX_LOGPROBS}", "logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"prompt_logprobs={self.prompt_logprobs} must be between 0 and {MAX_LOGPROBS}",
                           "prompt_logprobs")  # fmt: skip

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
    refusal: str | None = None  # an assistant turn that refused: its text stands in for content
    tool_calls: list[dict[str, Any]] | None = None  # no tools here: must be empty
    function_call: dict[str, Any] | None = None  # the deprecated form of tool_calls: must be absent
    audio: dict[str, Any] | None = None  # no audio here: must be absent

    SCHEMA: ClassVar[dict] = {"tool_calls": EMPTY_ARRAY, "function_call": EMPTY_OBJECT, "audio": EMPTY_OBJECT}

    def as_template_input(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": self.role, "content": text or self.refusal or ""}


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(json_schema_extra={"minItems": 1})]
    max_completion_tokens: Int | None = None  # OpenAI's newer name for max_tokens; it wins if both are set
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    parallel_tool_calls: bool | None = None  # false: tool_choice "required" makes exactly one call
    prediction: dict[str, Any] | None = None  # IGNORED
    reasoning_effort: str | None = None  # IGNORED
    verbosity: str | None = None  # IGNORED
    modalities: list[str] | None = None  # NEUTRAL_ONLY: text
    audio: dict[str, Any] | None = None  # NEUTRAL_ONLY
    web_search_options: dict[str, Any] | None = None  # NEUTRAL_ONLY
    functions: list[dict[str, Any]] | None = None  # NEUTRAL_ONLY (the deprecated form of tools)
    moderation: dict[str, Any] | None = None  # NEUTRAL_ONLY: OpenAI's moderation of input and output
    function_call: str | dict[str, Any] | None = None  # NEUTRAL_ONLY
    logprobs_field: ClassVar[str] = "top_logprobs"
    NEUTRAL_ONLY: ClassVar[dict] = {
        **{k: v for k, v in SamplingFields.NEUTRAL_ONLY.items() if k not in ("tools", "tool_choice")},
        "modalities": lambda v: v in (None, ["text"]),
        "audio": lambda v: v is None,
        "web_search_options": lambda v: v is None,
        "functions": lambda v: not v,
        "function_call": lambda v: v in (None, "none", "auto"),
        "moderation": lambda v: v is None,
    }
    SCHEMA: ClassVar[dict] = {
        **{k: v for k, v in SamplingFields.SCHEMA.items() if k not in ("tools", "tool_choice")},
        "modalities": {"anyOf": [{"type": "array", "items": {"const": "text"}, "minItems": 1, "maxItems": 1}, NULL]},
        "audio": NULL, "web_search_options": NULL, "functions": EMPTY_ARRAY, "function_call": NONE_OR_AUTO,
        "moderation": NULL, "top_logprobs": LOGPROBS, "tools": nullable(type="array", items=TOOL),
        "tool_choice": TOOL_CHOICE,
        "max_completion_tokens": nullable(type="integer", minimum=1, **{BOUND: "max_tokens"}),
    }  # fmt: skip
    BEAM_NEUTRAL: ClassVar[dict] = {**SamplingFields.BEAM_NEUTRAL, "logprobs": lambda v: not v,
                                    "top_logprobs": lambda v: v is None}  # fmt: skip

    BEAM_SCHEMA: ClassVar[dict] = {"logprobs": {"enum": [False, None]}, "top_logprobs": NULL,
                                   "tool_choice": NONE_OR_AUTO}  # fmt: skip
    REFUSALS: ClassVar[tuple] = ("context_length_exceeded", "exceeds_kv_cache", "too_many_sequences",
                                 "invalid_constraint", "conflicting_constraints", "min_tokens_over_max_tokens",
                                 "unknown_tool")  # fmt: skip

    @classmethod
    def rules(cls) -> list[tuple[str, dict, dict]]:
        return super().rules() + [
            ("top_logprobs", NULL, {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}),
            ("tool_choice", NONE_OR_AUTO, {"required": ["tools"],
             "properties": {"tools": {"type": "array", "minItems": 1}}})]  # fmt: skip

    def tool_constraint(self) -> list[tuple[dict, str]]:
        """tool_choice "required" or a named function: the output is a tool call, constrained by the tools'
        parameter schemas (vLLM's way without a tool parser). "none" and "auto" constrain nothing (there is
        no parser to find a call in free text: ask for "required" or a name)."""
        choice = self.tool_choice
        if choice in (None, "none", "auto"):
            return []
        tools = {t["function"]["name"]: t["function"] for t in self.tools or []}
        if choice == "required":
            if not tools:
                raise APIError(400, "tool_choice 'required' needs tools", "tools")
            one_of = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": f.get("parameters") or {}},
                       "required": ["name", "parameters"], "additionalProperties": False} for name, f in tools.items()]  # fmt: skip
            # parallel_tool_calls false: exactly one call. Without the bound a small model may go on
            # writing calls until max_tokens, and an unfinished array is no tool call at all.
            one = {"maxItems": 1} if self.parallel_tool_calls is False else {}
            return [({"json": {"type": "array", "minItems": 1, **one, "items": {"anyOf": one_of}}}, "tool_choice")]
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if name not in tools:
            raise refused("unknown_tool", f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return [({"json": tools[name].get("parameters") or {"type": "object"}}, "tool_choice")]

    def validate_request(self) -> None:
        self.check_unsupported()
        if not self.messages:
            raise APIError(400, "messages must hold at least one message", "messages")
        for i, t in enumerate(self.tools or []):
            if not (isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
                    and isinstance(t["function"].get("name"), str)):  # fmt: skip
                raise APIError(400, f"tools.{i} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                               "tools")  # fmt: skip
            f = t["function"]  # the schema's other fields of a function tool, each of its own type when present
            for key, ok, what in (("description", lambda v: v is None or isinstance(v, str), "a string"),
                                  ("parameters", lambda v: isinstance(v, dict), "an object (a JSON schema)"),
                                  ("strict", lambda v: v is None or isinstance(v, bool), "a boolean")):  # fmt: skip
                if key in f and not ok(f[key]):
                    raise APIError(400, f"tools.{i}.function.{key} must be {what}", "tools")
        for i, m in enumerate(self.messages):
            for name in ("tool_calls", "function_call", "audio"):
                if getattr(m, name):
                    raise APIError(400, f"messages.{i}.{name} is not supported by this server (no tools or audio)",
                                   f"messages.{i}.{name}")  # fmt: skip
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
    # exactly one of prompt and messages (null is absent)
    model_config = ConfigDict(json_schema_extra=lambda schema, cls: schema.update(oneOf=[
        {"required": [f], "properties": {f: {"not": NULL}}} for f in ("prompt", "messages")]))  # fmt: skip
    model: str | None = None
    prompt: Annotated[str, Field(json_schema_extra={BOUND_LENGTH: "prompt_chars"})] | None = None
    messages: Annotated[list[ChatMessage], Field(json_schema_extra={"minItems": 1})] | None = None
    add_special_tokens: bool | None = None
    REFUSALS: ClassVar[tuple] = ("context_length_exceeded",)  # messages: a length in characters, summed


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId]
