"""The OpenAI protocol of ``jaxkv serve``: request and response bodies as pydantic models,
OpenAI's error shape, and the finish-reason vocabulary a client sees.

A request body is read by :func:`parse_body` (UTF-8 JSON, an object, no NaN or infinities,
no lone surrogates: :class:`ApiError` otherwise) and validated by a request model
(:class:`ChatCompletionRequest`, :class:`CompletionRequest`), whose one conversion,
``to_sampling_params()``, gives the engine's :class:`~jaxkv.serve.engine.SamplingParams`.
A :class:`pydantic.ValidationError` becomes the same :class:`ApiError` as any other refusal
(:meth:`ApiError.from_validation`): ``param`` the field at fault (``messages[0].content[0].type``),
``code`` OpenAI's (``invalid_type``, ``invalid_value``, ``missing_required_parameter``,
``unsupported_parameter``, ``unsupported_value``).

Decisions where OpenAI's contract is silent follow llama-server or vLLM: unknown fields are
ignored; ``top_k`` (an extension) of 0 or -1 means off; OpenAI features this server lacks
(tools, log probabilities, ``n`` > 1, ...) are refused by name rather than ignored.
"""

from __future__ import annotations

import json
import math
import secrets
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo, field_validator
from pydantic import model_serializer as _model_serializer
from pydantic_core import PydanticCustomError

from jaxkv.decode.sampler import SEED_LIMIT
from jaxkv.errors import INT32_LIMIT
from jaxkv.serve.engine import SamplingParams

__all__ = [
    "FINISH_REASONS",
    "MAX_STOP",
    "ApiError",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "CompletionRequest",
    "CompletionResponse",
    "ErrorResponse",
    "ModelCard",
    "ModelList",
    "Usage",
    "parse_body",
]

FINISH_REASONS = {"stop": "stop", "length": "length", "interrupted": "length", "cancelled": "stop"}
"""The engine's finish reason -> the one a client sees (the only place they are mapped).
``interrupted`` (the server shut down mid-request) reads as ``length``: the reply was cut
short, not finished by the model. ``cancelled`` follows a client's disconnect, so no client
ever sees it. The engine's ``error`` is no finish reason for a client: a 500 (non-streaming)
or an error object in the stream (then ``[DONE]``)."""

MAX_STOP = 4  # OpenAI: "up to 4 sequences"


# ---- errors ---------------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    """The ``error`` object of OpenAI's error body."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class ApiError(Exception):
    """An error answered in OpenAI's shape (:class:`ErrorResponse`).

    Attributes:
      status: the HTTP status. message: what is wrong and what would be accepted.
      param: the request field at fault (``messages[1].content``), or None.
      code: OpenAI's machine-readable code (``invalid_api_key``, ``model_not_found``, ...), or None.
      type: ``invalid_request_error`` for 4xx, ``server_error`` for 5xx unless given.
      headers: extra response headers (``Retry-After``).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        """The error's response body."""
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))

    @classmethod
    def from_validation(cls, error: ValidationError) -> ApiError:
        """The 400 of a request model's first validation error: ``param`` its field's path
        (``messages[0].content[0].type``), ``code`` OpenAI's for its kind (see :data:`_CODES`;
        our own validators raise their code as the error type), the message naming the value
        and what is accepted (the field's ``description``)."""
        first = error.errors(include_url=False)[0]
        loc, kind = first["loc"], first["type"]
        param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".") or None
        code = (
            kind
            if kind in _OWN_CODES
            else _CODES.get(kind, "invalid_type" if kind.endswith("_type") else "invalid_value")
        )
        where = param or "body"
        if kind == "missing":
            message = f"{where}: required"
        elif kind in _OWN_CODES:
            message = f"{where}: {first['msg']}"
        else:
            model = _REQUEST_MODELS.get(error.title)
            field = model.model_fields.get(loc[0]) if model is not None and len(loc) == 1 else None
            if field is not None and field.description:
                why = f"expected {field.description}"
            else:  # pydantic's own message (but for an object, where it names our class)
                why = "expected an object" if kind == "model_type" else first["msg"]
            message = f"{where}: {_shown(first['input'])} is not valid: {why[0].lower()}{why[1:]}"
        return cls(400, message, param=param, code=code)


_OWN_CODES = {
    "invalid_type",
    "invalid_value",
    "missing_required_parameter",
    "unsupported_parameter",
    "unsupported_value",
}
"""The codes our validators raise as their :class:`PydanticCustomError` type."""
_CODES = {
    "missing": "missing_required_parameter",
    "model_type": "invalid_type",
    "model_attributes_type": "invalid_type",
}
"""Pydantic's error types -> OpenAI's codes, beyond the rule: ``*_type`` -> ``invalid_type``,
any other (a range, a literal, a length) -> ``invalid_value``."""


def _shown(value) -> str:
    """A value as an error message shows it: JSON for a scalar, its kind for an array or object."""
    if isinstance(value, (dict, list)):
        return f"an {'empty ' if not value else ''}{'object' if isinstance(value, dict) else 'array'}"
    return json.dumps(value)


def _refuse(code: str, message: str) -> PydanticCustomError:
    """A validation error whose type is OpenAI's ``code`` (``message`` shown as is: no context, no formatting)."""
    return PydanticCustomError(code, message)


# ---- the request body ----------------------------------------------------------------------------


class _NonFinite:
    """What a NaN, Infinity or -Infinity of the body parses to (refused by :func:`_check_values`)."""

    def __init__(self, text: str):
        self.text = text


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object: UTF-8, valid JSON (no NaN or infinities, no numbers
    beyond a double's range, no lone surrogates anywhere), not nested too deeply.

    Raises:
      ApiError: 400 naming what is wrong (code ``invalid_json``, ``invalid_value`` for a lone
        surrogate; ``param`` the field holding a bad value).
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(
            400, f"request body is not valid UTF-8 (byte {e.start}): send JSON encoded as UTF-8", code="invalid_json"
        ) from None
    try:
        body = json.loads(text, parse_constant=_NonFinite)
        if not isinstance(body, dict):
            raise ApiError(400, f"request body must be a JSON object, got {_shown(body)}", code="invalid_json")
        _check_values(body, "")
    except json.JSONDecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, "request body is nested too deeply", code="invalid_json") from None
    return body


def _check_values(value, path: str) -> None:
    """Refuse NaN, Infinity, -Infinity, numbers too large for a double (1e999) and strings that
    are not Unicode text (a lone surrogate such as ``"\\ud800"``) anywhere in ``value``."""
    if isinstance(value, _NonFinite) or (isinstance(value, float) and not math.isfinite(value)):
        shown = value.text if isinstance(value, _NonFinite) else "a number beyond a double's range"
        raise ApiError(
            400,
            f"{path or 'body'}: {shown} is not valid JSON (numbers must be finite)",
            param=path or None,
            code="invalid_json",
        )
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(
                400,
                f"{path}: not Unicode text (a lone surrogate \\u{ord(value[e.start]):04x} at character {e.start})",
                param=path,
                code="invalid_value",
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_values(k, path or "body")
            _check_values(v, f"{path}.{k}" if path else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_values(v, f"{path}[{i}]")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- requests -------------------------------------------------------------------------------------

_STRICT = ConfigDict(strict=True, extra="ignore")  # true is no number, "5" no integer; unknown fields ignored


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage."""

    model_config = _STRICT
    include_usage: bool | None = Field(None, description="a boolean")


_UNSUPPORTED = {  # field: (the values accepted, why any other is refused)
    "tools": ((None, []), "tool and function calling is not supported by this server"),
    "functions": ((None, []), "tool and function calling is not supported by this server"),
    "tool_choice": ((None, "none"), "tool calling is not supported by this server"),
    "function_call": ((None, "none"), "function calling is not supported by this server"),
    "logprobs": ((None, False, 0), "log probabilities are not supported by this server"),
    "top_logprobs": ((None, False, 0), "log probabilities are not supported by this server"),
    "response_format": ((None, {"type": "text"}), 'only {"type": "text"} is supported (no JSON mode or schemas)'),
    "logit_bias": ((None, {}), "logit biases are not supported by this server"),
    "presence_penalty": ((None, 0), "repetition penalties are not implemented (only 0)"),
    "frequency_penalty": ((None, 0), "repetition penalties are not implemented (only 0)"),
    "echo": ((None, False), "echoing the prompt is not supported by this server"),
    "best_of": ((None, 1), "only 1 is supported"),
    "suffix": ((None, ""), "insertion (a suffix) is not supported by this server"),
}


def _accepted(value, allowed) -> bool:
    # true == 1 in Python: a boolean matches only a boolean
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed)


class _SamplingRequest(BaseModel):
    """The fields both endpoints share: the model, the sampling settings, streaming, and the
    OpenAI features refused by name (:data:`_UNSUPPORTED`). Field order is validation order."""

    model_config = _STRICT
    prompt_field: ClassVar[str]
    """The field the prompt comes from (``messages`` or ``prompt``)."""

    model: str | None = Field(None, description="a string")
    max_tokens: int | None = Field(None, ge=1, le=INT32_LIMIT - 1, description=f"an integer in [1, {INT32_LIMIT - 1}]")
    temperature: float | None = Field(None, ge=0, le=2, description="a number in [0, 2]")
    top_p: float | None = Field(None, gt=0, le=1, description="a number in (0, 1]")
    top_k: int | None = Field(None, ge=-1, le=INT32_LIMIT - 1, description="an integer >= 1 (0 or -1: off)")
    seed: int | None = Field(None, ge=0, le=SEED_LIMIT - 1, description=f"an integer in [0, {SEED_LIMIT - 1}]")
    stop: Any = Field(
        None, validate_default=True, description=f"a string or an array of up to {MAX_STOP} non-empty strings"
    )
    ignore_eos: bool | None = Field(None, description="a boolean")
    stream: bool | None = Field(None, description="a boolean")
    stream_options: StreamOptions | None = Field(None, description='an object {"include_usage": boolean}')
    n: int | None = Field(None, description="1")
    tools: Any = None
    functions: Any = None
    tool_choice: Any = None
    function_call: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    response_format: Any = None
    logit_bias: dict | None = Field(None, description="an object")
    presence_penalty: float | None = Field(None, description="a number (only 0 is supported)")
    frequency_penalty: float | None = Field(None, description="a number (only 0 is supported)")

    @field_validator("stop")
    @classmethod
    def _stop(cls, value) -> tuple[str, ...]:
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise _refuse("invalid_type", f"{_shown(value)} is not valid: expected a string or an array of strings")
        if len(items) > MAX_STOP:
            raise _refuse("invalid_value", f"{len(items)} stop sequences given; at most {MAX_STOP} are allowed")
        for s in items:
            if not isinstance(s, str) or not s:
                raise _refuse("invalid_value", f"{_shown(s)} is not valid: expected non-empty strings")
        return tuple(items)

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):
            raise _refuse("invalid_value", "only allowed when stream is true")
        return value

    @field_validator("n")
    @classmethod
    def _n(cls, value):
        if value not in (None, 1):
            raise _refuse("unsupported_value", f"{value} is not supported: this server returns one choice per request")
        return value

    @field_validator(*_UNSUPPORTED, check_fields=False)
    @classmethod
    def _unsupported(cls, value, info: ValidationInfo):
        allowed, why = _UNSUPPORTED[info.field_name]
        if not _accepted(value, allowed):
            raise _refuse("unsupported_parameter", f"{_shown(value)} is not supported: {why}")
        return value

    @property
    def max_tokens_field(self) -> str:
        """The field ``max_tokens`` came from (a context-length error names it)."""
        return "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        """The ``max_tokens`` the request gives (None: the server's default)."""
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, *, default_max_tokens: int) -> SamplingParams:
        """The engine's settings for this request: OpenAI's defaults (temperature 1), ``top_k`` 0
        or -1 and ``top_p`` 1 as off, a fresh random seed when sampling without one.

        Args:
          default_max_tokens: ``max_tokens`` when the request gives none, >= 1.
        Raises:
          JaxkvError: a ``default_max_tokens`` below 1 (every request field is in range once validated).
        """
        temperature = 1.0 if self.temperature is None else float(self.temperature)
        seed = self.seed if self.seed is not None else (secrets.randbelow(SEED_LIMIT) if temperature > 0 else 0)
        return SamplingParams(
            max_tokens=default_max_tokens if self.requested_max_tokens is None else self.requested_max_tokens,
            temperature=temperature,
            top_k=self.top_k if self.top_k is not None and self.top_k >= 1 else None,
            top_p=None if self.top_p in (None, 1) else float(self.top_p),
            seed=seed,
            stop=self.stop,
            ignore_eos=bool(self.ignore_eos),
        )


class TextPart(BaseModel):
    """A content part of a chat message: text only (``{"type": "text", "text": ...}``)."""

    model_config = _STRICT
    type: Literal["text"]
    text: str


_TEXT_PARTS = TypeAdapter(list[TextPart])


class ChatMessage(BaseModel):
    """A chat message: ``content`` a string, or text parts joined by newlines (as vLLM joins them)."""

    model_config = _STRICT
    role: Literal["system", "user", "assistant"]
    content: Any

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, value) -> str:
        if isinstance(value, str):
            return value
        if isinstance(value, list):  # errors inside a part keep its path (content[0].type)
            return "\n".join(part.text for part in _TEXT_PARTS.validate_python(value))
        raise _refuse("invalid_type", f"{_shown(value)} is not valid: expected a string or an array of text parts")


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``: ``messages`` (at least one), ``max_completion_tokens``
    (wins over ``max_tokens``), and the shared fields."""

    prompt_field: ClassVar[str] = "messages"
    messages: list[ChatMessage] = Field(min_length=1, description="an array of at least one message")
    max_completion_tokens: int | None = Field(
        None, ge=1, le=INT32_LIMIT - 1, description=f"an integer in [1, {INT32_LIMIT - 1}]"
    )

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict]:
        """``messages`` as the chat template reads them, ``[{"role", "content": str}]``."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``: one ``prompt`` (a string, token ids, or a list holding one of
    them), and the shared fields (``echo``, ``best_of`` > 1 and ``suffix`` refused by name)."""

    prompt_field: ClassVar[str] = "prompt"
    prompt: Any = Field(description="a string, an array of token ids, or an array holding one of them")
    echo: Any = None
    best_of: Any = None
    suffix: Any = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value) -> str | list[int]:
        if value is None:
            raise _refuse("missing_required_parameter", "required")
        if isinstance(value, str) or (isinstance(value, list) and value and all(_is_int(t) for t in value)):
            return value
        if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
            raise _refuse("unsupported_value", f"{len(value)} prompts given; this server takes one prompt per request")
        if isinstance(value, list) and len(value) == 1:
            (one,) = value
            if isinstance(one, str) or (isinstance(one, list) and one and all(_is_int(t) for t in one)):
                return one
        raise _refuse(
            "invalid_type", f"{_shown(value)} is not valid: expected {cls.model_fields['prompt'].description}"
        )


_REQUEST_MODELS = {m.__name__: m for m in (ChatCompletionRequest, CompletionRequest)}
"""A validation error's title -> its model (for the fields' descriptions in messages)."""


# ---- responses ------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    """``usage.prompt_tokens_details``: ``cached_tokens``, the prompt tokens taken from the prefix cache."""

    cached_tokens: int


class Usage(BaseModel):
    """A reply's token counts."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, event) -> Usage:
        """The usage of an engine :class:`~jaxkv.serve.engine.Event` (the last of a request)."""
        return cls(
            prompt_tokens=event.prompt_tokens,
            completion_tokens=event.completion_tokens,
            total_tokens=event.prompt_tokens + event.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=event.cached_tokens),
        )


class _Response(BaseModel):
    """The fields every completion body and chunk has."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: None = None


class AssistantMessage(BaseModel):
    """A chat reply's message."""

    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletionResponse(_Response):
    """A non-streamed chat completion (``object`` ``chat.completion``)."""

    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    """A streamed chat chunk's delta: the fields set only (``{}`` in the last choice chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @_model_serializer(mode="wrap")
    def _set_only(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    """A streamed chat chunk (``object`` ``chat.completion.chunk``); ``usage`` null but in the
    usage chunk (which has no choices), and left out without ``stream_options.include_usage``."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    """A completion, whole or one streamed chunk (``object`` ``text_completion`` for both, as
    OpenAI sends them); ``usage`` as :class:`ChatCompletionChunk`'s when streamed."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """An entry of ``/v1/models``; ``jaxkv`` says how it is served (``cache``: the cache spec's
    description, ``slots``: requests decoded together, ``max_tokens_per_request``: a full
    cache's tokens per request, prompt and reply, or None for a bounded cache)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "jaxkv"
    jaxkv: dict


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
