"""The OpenAI-compatible HTTP layer over :class:`jaxkv.serve.engine.Engine` (an ASGI app).

:func:`create_app` returns a Starlette app with ``POST /v1/chat/completions``,
``POST /v1/completions`` (both streaming over SSE or not), ``GET /v1/models``,
``GET /health`` and ``GET /metrics``. It is thin: it validates a request's JSON itself
(every error is OpenAI's ``{"error": {"message", "type", "param", "code"}}``, never a
framework's own shape), turns it into prompt ids and :class:`SamplingParams`, submits it
to the engine and relays the engine's events. docs/SERVING.md describes what is accepted
and what is refused.

Decisions where OpenAI's contract is silent follow llama-server or vLLM: unknown fields are
ignored; ``top_k`` (an extension) of 0 or -1 means off; the engine's ``interrupted``
(server shutdown) is reported as ``length``; ``/health`` and ``/metrics`` need no API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import math
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxkv.decode.prompt import encode_prompt
from jaxkv.decode.sampler import SEED_LIMIT
from jaxkv.errors import INT32_LIMIT, JaxkvError
from jaxkv.serve.engine import EngineStopped, QueueFullError, SamplingParams

__all__ = ["DEFAULT_MAX_TOKENS", "FINISH_REASONS", "MAX_BODY_BYTES", "ApiError", "create_app"]

DEFAULT_MAX_TOKENS = 256
"""Tokens generated when a request gives no ``max_tokens`` (less when a full cache holds fewer)."""

MAX_BODY_BYTES = 32 << 20
"""Largest request body accepted (413 beyond it)."""

FINISH_REASONS = {"stop": "stop", "length": "length", "interrupted": "length", "cancelled": "stop"}
"""The engine's finish reason -> the one a client sees. ``interrupted`` (the server shut down
mid-request) reads as ``length``: the reply was cut short, not finished by the model.
``cancelled`` follows a client's disconnect, so no client ever sees it. An ``error`` finish
is a 500 (non-streaming) or an error object in the stream (then ``[DONE]``)."""

MAX_STOP = 4  # OpenAI: "up to 4 sequences"
ROLES = ("system", "user", "assistant")
_STREAM_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class ApiError(Exception):
    """An error answered in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

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

    def body(self) -> dict:
        """The JSON body of the error response."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as a Starlette response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# ---- request body: JSON, fields ----------------------------------------------------------------


class _NonFinite:
    """What a NaN, Infinity or -Infinity of the body parses to (refused by :func:`_check_finite`)."""

    def __init__(self, text: str):
        self.text = text


async def _read_json(request: Request) -> dict:
    """The request body as a JSON object: UTF-8, valid JSON (no NaN or infinities), at most
    :data:`MAX_BODY_BYTES`.

    Raises:
      ApiError: 400 (413 for a body too large) naming what is wrong.
    """
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"request body is larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(
            400, f"request body is not valid UTF-8 (byte {e.start}): send JSON encoded as UTF-8", code="invalid_json"
        ) from None
    try:
        body = json.loads(text, parse_constant=_NonFinite)
        if not isinstance(body, dict):
            raise ApiError(400, f"request body must be a JSON object, got {_json_type(body)}", code="invalid_json")
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


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bad(name: str, value, expected: str, code: str = "invalid_value") -> ApiError:
    shown = json.dumps(value) if not isinstance(value, (dict, list)) else _json_type(value)
    return ApiError(400, f"{name}: {shown} is not valid: expected {expected}", param=name, code=code)


def _int_field(body: dict, name: str, lo: int, hi: int, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise _bad(name, value, f"an integer in [{lo}, {hi}]", "invalid_type")
    if not lo <= value <= hi:
        raise _bad(name, value, f"an integer in [{lo}, {hi}]")
    return value


def _bool_field(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, value, "a boolean", "invalid_type")
    return value


def _number_field(body: dict, name: str, default, check: Callable[[float], bool], expected: str):
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise _bad(name, value, expected, "invalid_type")
    if not check(value):
        raise _bad(name, value, expected)
    return float(value)


def _unsupported(name: str, why: str) -> ApiError:
    return ApiError(400, f"{name}: {why}", param=name, code="unsupported_parameter")


def _refuse_unsupported(body: dict, *, chat: bool) -> None:
    """Refuse by name the OpenAI features this server does not implement (rather than ignore them)."""
    for name in ("tools", "functions"):
        if body.get(name) not in (None, []):
            raise _unsupported(name, "tool and function calling is not supported by this server")
    if body.get("tool_choice") not in (None, "none"):
        raise _unsupported("tool_choice", "tool calling is not supported by this server")
    if body.get("function_call") not in (None, "none"):
        raise _unsupported("function_call", "function calling is not supported by this server")
    for name in ("logprobs", "top_logprobs"):  # chat: logprobs a boolean; completions: an integer
        if body.get(name) not in (None, False, 0):
            raise _unsupported(name, "log probabilities are not supported by this server")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise _unsupported("response_format", 'only {"type": "text"} is supported (no JSON mode or schemas)')
    n = body.get("n")
    if n is not None:
        if not _is_int(n):
            raise _bad("n", n, "1", "invalid_type")
        if n != 1:
            raise ApiError(
                400,
                f"n: {n} is not supported: this server returns one choice per request (n=1)",
                param="n",
                code="unsupported_value",
            )
    logit_bias = body.get("logit_bias")
    if logit_bias is not None:
        if not isinstance(logit_bias, dict):
            raise _bad("logit_bias", logit_bias, "an object", "invalid_type")
        if logit_bias:
            raise _unsupported("logit_bias", "logit biases are not supported by this server")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and not _is_number(value):
            raise _bad(name, value, "a number (only 0 is supported)", "invalid_type")
        if value:
            raise _unsupported(name, f"{value} is not supported: repetition penalties are not implemented (only 0)")
    if not chat:
        if body.get("echo") not in (None, False):
            raise _unsupported("echo", "echoing the prompt is not supported by this server")
        best_of = body.get("best_of")
        if best_of is not None and (not _is_int(best_of) or best_of != 1):
            raise _unsupported("best_of", f"{json.dumps(best_of)} is not supported (only 1)")
        if body.get("suffix") not in (None, ""):
            raise _unsupported("suffix", "insertion (a suffix) is not supported by this server")


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list):
        raise _bad("stop", stop, f"a string or an array of up to {MAX_STOP} strings", "invalid_type")
    if len(items) > MAX_STOP:
        raise ApiError(
            400,
            f"stop: {len(items)} stop sequences given; at most {MAX_STOP} are allowed",
            param="stop",
            code="invalid_value",
        )
    for s in items:
        if not isinstance(s, str) or not s:
            raise _bad("stop", s, "non-empty strings")
    return tuple(items)


@dataclasses.dataclass(frozen=True)
class _Parsed:
    """A validated request: prompt ids (and the field they came from), sampling fields, streaming options."""

    prompt_ids: list[int]
    prompt_field: str
    max_tokens: int | None
    max_tokens_field: str
    temperature: float
    top_k: int | None
    top_p: float | None
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool


def _common_fields(body: dict, *, chat: bool) -> dict:
    """The sampling and streaming fields both endpoints share, validated (prompt apart)."""
    _refuse_unsupported(body, chat=chat)
    max_tokens_field = "max_tokens"
    max_tokens = _int_field(body, "max_tokens", 1, INT32_LIMIT - 1)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens_field = "max_completion_tokens"
        max_tokens = _int_field(body, "max_completion_tokens", 1, INT32_LIMIT - 1)
    temperature = _number_field(body, "temperature", 1.0, lambda t: 0 <= t <= 2, "a number in [0, 2]")
    top_p = _number_field(body, "top_p", None, lambda p: 0 < p <= 1, "a number in (0, 1]")
    top_k = body.get("top_k")
    if top_k is not None:
        if not _is_int(top_k):
            raise _bad("top_k", top_k, "an integer >= 1 (0 or -1: off)", "invalid_type")
        if top_k < -1 or top_k > INT32_LIMIT - 1:
            raise _bad("top_k", top_k, "an integer >= 1 (0 or -1: off)")
        top_k = top_k if top_k >= 1 else None
    seed = _int_field(body, "seed", 0, SEED_LIMIT - 1)
    stream = _bool_field(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("stream_options", options, "an object", "invalid_type")
        if not stream:
            raise ApiError(
                400, "stream_options: only allowed when stream is true", param="stream_options", code="invalid_value"
            )
        usage = options.get("include_usage")
        if usage is not None and not isinstance(usage, bool):
            raise _bad("stream_options.include_usage", usage, "a boolean", "invalid_type")
        include_usage = bool(usage)
    return dict(
        max_tokens=max_tokens,
        max_tokens_field=max_tokens_field,
        temperature=temperature,
        top_k=top_k,
        top_p=None if top_p == 1 else top_p,
        seed=seed,
        stop=_stops(body),
        ignore_eos=_bool_field(body, "ignore_eos"),
        stream=stream,
        include_usage=include_usage,
    )


def _messages(body: dict) -> list[dict]:
    """``messages`` as ``[{"role", "content": str}]`` for the chat template."""
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "messages: required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise _bad("messages", messages, "an array of messages", "invalid_type")
    if not messages:
        raise ApiError(
            400, "messages: an empty array; give at least one message", param="messages", code="invalid_value"
        )
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, m, 'an object {"role": ..., "content": ...}', "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(
                400,
                f"{where}.role: {json.dumps(role)} is not supported: expected one of {', '.join(ROLES)}",
                param=f"{where}.role",
                code="invalid_value",
            )
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                pwhere = f"{where}.content[{j}]"
                if not isinstance(part, dict) or part.get("type") != "text":
                    shown = part.get("type") if isinstance(part, dict) else part
                    raise ApiError(
                        400,
                        f"{pwhere}.type: {json.dumps(shown) if isinstance(shown, str) else _json_type(shown)} "
                        'is not supported: only text parts {"type": "text", "text": ...}',
                        param=f"{pwhere}.type",
                        code="invalid_value",
                    )
                if not isinstance(part.get("text"), str):
                    raise _bad(f"{pwhere}.text", part.get("text"), "a string", "invalid_type")
                texts.append(part["text"])
            content = "\n".join(texts)  # as vLLM joins text parts
        elif not isinstance(content, str):
            raise _bad(f"{where}.content", content, "a string or an array of text parts", "invalid_type")
        out.append({"role": role, "content": content})
    return out


def _completion_prompt(body: dict):
    """``prompt`` as text or a list of token ids (one prompt only)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "prompt: required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, str):
        return prompt
    expected = "a string, an array of token ids, or an array holding one of them"
    if not isinstance(prompt, list) or not prompt:
        raise _bad("prompt", prompt, expected, "invalid_type")
    if all(_is_int(t) for t in prompt):
        return prompt
    if len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(
            400,
            f"prompt: {len(prompt)} prompts given; this server takes one prompt per request",
            param="prompt",
            code="unsupported_value",
        )
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if len(prompt) == 1 and isinstance(prompt[0], list) and prompt[0] and all(_is_int(t) for t in prompt[0]):
        return prompt[0]
    raise _bad("prompt", prompt, expected, "invalid_type")


# ---- metrics ------------------------------------------------------------------------------------


class _EngineCollector:
    """Gauges and counters read from ``engine.stats()`` at scrape time."""

    GAUGES = (
        ("queue_depth", "jaxkv_queue_depth", "requests waiting for a decode slot"),
        ("busy_slots", "jaxkv_busy_slots", "decode slots serving a request"),
        ("slots", "jaxkv_slots", "decode slots (requests decoded together)"),
        ("kv_bytes", "jaxkv_kv_cache_bytes", "bytes of the batched KV cache"),
        ("prefix_entries", "jaxkv_prefix_cache_entries", "prompts held by the prefix cache"),
        ("prefix_bytes", "jaxkv_prefix_cache_bytes", "bytes held by the prefix cache"),
    )
    COUNTERS = (
        ("prefix_hits", "jaxkv_prefix_cache_hits", "requests whose prompt started with a cached prefix"),
        ("prefix_misses", "jaxkv_prefix_cache_misses", "requests whose prompt found no cached prefix"),
        ("prompt_tokens_total", "jaxkv_prompt_tokens", "prompt tokens of submitted requests"),
        ("cached_tokens_total", "jaxkv_cached_tokens", "prompt tokens taken from the prefix cache"),
        ("completion_tokens_total", "jaxkv_completion_tokens", "tokens generated"),
        ("prefill_tokens_total", "jaxkv_prefill_tokens", "prompt tokens prefilled (not from the prefix cache)"),
        ("prefill_seconds_total", "jaxkv_prefill_seconds", "seconds spent prefilling"),
        ("decode_steps_total", "jaxkv_decode_steps", "batched decode steps run"),
        ("decode_seconds_total", "jaxkv_decode_seconds", "seconds spent in batched decode steps"),
    )

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        try:
            stats = self.engine.stats()
        except Exception:  # an engine that cannot report (yet) leaves its metrics out of this scrape
            return
        for key, name, doc in self.GAUGES:
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=stats[key])
        for key, name, doc in self.COUNTERS:
            if key in stats:
                yield CounterMetricFamily(name, doc, value=stats[key])


class _Metrics:
    """The app's own Prometheus registry: request counts by status, finish reasons, latencies."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "jaxkv_requests", "HTTP requests to /v1/* by response status", ["status"], registry=self.registry
        )
        self.finished = Counter(
            "jaxkv_finished_requests",
            "requests the engine ended, by its finish reason",
            ["reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "jaxkv_time_to_first_token_seconds",
            "seconds from a request's arrival to its first generated token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=self.registry,
        )
        self.itl = Histogram(
            "jaxkv_inter_token_latency_seconds",
            "seconds between generated tokens of a request (a block of k tokens: its gap / k, k times)",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(engine))


# ---- one request's events -----------------------------------------------------------------------


class _Call:
    """A submitted request whose events (from the engine's thread) arrive on an asyncio queue."""

    def __init__(self, engine, prompt_ids: list[int], params: SamplingParams, metrics: _Metrics, arrived: float):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.metrics, self.arrived, self.last = metrics, arrived, None
        self.finished = False
        self.request = engine.submit(prompt_ids, params, on_event=self._on_event)

    def _on_event(self, event) -> None:  # the engine's thread
        t = time.perf_counter()
        with contextlib.suppress(RuntimeError):  # the event loop is gone (the server is exiting)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (t, event))

    async def events(self) -> AsyncIterator:
        """The request's events, the last one with a finish reason."""
        while not self.finished:
            t, event = await self.queue.get()
            n = len(event.token_ids)
            if n:
                if self.last is None:
                    self.metrics.ttft.observe(t - self.arrived)
                else:
                    for _ in range(n):
                        self.metrics.itl.observe((t - self.last) / n)
                self.last = t
            if event.finish_reason is not None:
                self.finished = True
                self.metrics.finished.labels(event.finish_reason).inc()
            yield event

    def cancel(self) -> None:
        """Cancel the request unless it has finished (a client gone)."""
        if not self.finished:
            self.request.cancel()


class _CallResponse:
    """An ASGI response fed by a :class:`_Call`: streamed (SSE) or sent whole once finished.

    A client that disconnects (an ``http.disconnect`` message, or a send that fails) cancels
    the request, so its decode slot is freed at the engine's next step.
    """

    def __init__(self, call: _Call, chunks: AsyncIterator[bytes], *, stream: bool):
        self.call, self.chunks, self.stream = call, chunks, stream

    async def __call__(self, scope, receive, send) -> None:
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            self.call.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            if self.stream:
                await send({"type": "http.response.start", "status": 200, "headers": _STREAM_HEADERS})
                async for chunk in self.chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                try:
                    body = b"".join([c async for c in self.chunks])
                except ApiError as e:  # the engine ended the request with an error
                    await e.response()(scope, receive, send)
                    return
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body, "more_body": False})
        except OSError:  # the client went away mid-send
            pass
        finally:
            watcher.cancel()
            self.call.cancel()
            await self.chunks.aclose()


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def _usage(event) -> dict:
    return {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "total_tokens": event.prompt_tokens + event.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": event.cached_tokens},
    }


# ---- the app ------------------------------------------------------------------------------------


class _Shutdown:
    """``engine.shutdown(timeout)`` once, in a thread: begun by a signal or the lifespan's end."""

    def __init__(self, engine, timeout: float):
        self.engine, self.timeout = engine, timeout
        self.lock = threading.RLock()  # a second signal may arrive inside the first one's handler
        self.thread: threading.Thread | None = None

    @property
    def begun(self) -> bool:
        return self.thread is not None

    def begin(self) -> threading.Thread:
        """Start shutting the engine down (no-op if begun): new requests get 503, in-flight ones
        up to the timeout, then end with finish reason ``interrupted``."""
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self.engine.shutdown, args=(self.timeout,), name="jaxkv-serve-shutdown", daemon=True
                )
                self.thread.start()
            return self.thread


def create_app(
    engine,
    *,
    model_name: str,
    api_key: str | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    shutdown_timeout: float = 10.0,
) -> Starlette:
    """The OpenAI-compatible ASGI app serving ``engine``.

    The caller starts the engine (``engine.start()``, e.g. in a thread while the app already
    answers ``/health`` with 503); the app's lifespan shutdown shuts it down. ``app.state.shutdown``
    has ``begin()``, which starts the engine's shutdown at once (the ``jaxkv serve`` command
    calls it on SIGTERM/SIGINT, so in-flight streams end with a finish reason before uvicorn
    waits for their connections to close).

    Args:
      engine: a :class:`jaxkv.serve.engine.Engine` (or anything with its interface).
      model_name: the model id clients pass as ``model`` (omitted: this one; another: 404).
      api_key: when given, every ``/v1/*`` request needs ``Authorization: Bearer API_KEY``
        (else 401, code ``invalid_api_key``); ``/health`` and ``/metrics`` stay open.
      default_max_tokens: tokens generated when a request gives no ``max_tokens`` (for a full
        cache: at most what still fits after the prompt).
      shutdown_timeout: seconds in-flight requests get once shutdown begins.
    Returns:
      a Starlette app: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
      ``GET /v1/models/{model}``, ``GET /health``, ``GET /metrics``.
    """
    metrics = _Metrics(engine)
    shutdown = _Shutdown(engine, shutdown_timeout)
    tokenizer = engine.model.tokenizer
    vocab = engine.model.config.vocab_size
    token_limit = getattr(engine.spec, "token_limit", None)  # None: a StreamingLLM cache takes any length
    created = int(time.time())

    def check_model(body: dict) -> None:
        model = body.get("model")
        if model is None:
            return
        if not isinstance(model, str):
            raise _bad("model", model, "a string", "invalid_type")
        if model != model_name:
            raise ApiError(
                404,
                f"The model `{model}` does not exist: this server serves `{model_name}`",
                param="model",
                code="model_not_found",
            )

    def encode_messages(messages: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(messages)
        ids = tokenizer.encode(text, add_bos=False)
        return ids or ([tokenizer.bos_id] if tokenizer.bos_id is not None else [])

    async def parse(body: dict, *, chat: bool) -> _Parsed:
        check_model(body)
        fields = _common_fields(body, chat=chat)
        if chat:
            messages, prompt_field = _messages(body), "messages"
            if tokenizer.chat_template is None:
                raise ApiError(
                    400,
                    f"model `{model_name}` has no chat template: use /v1/completions with a prompt",
                    param="messages",
                    code="model_not_supported",
                )
            try:
                ids = await run_in_threadpool(encode_messages, messages)
            except JaxkvError as e:
                raise ApiError(400, str(e), param="messages") from None
        else:
            prompt, prompt_field = _completion_prompt(body), "prompt"
            if isinstance(prompt, str):
                try:
                    ids = await run_in_threadpool(encode_prompt, tokenizer, prompt)
                except JaxkvError as e:
                    raise ApiError(400, f"prompt: {e}", param="prompt") from None
            else:
                bad = next((t for t in prompt if not 0 <= t < vocab), None)
                if bad is not None:
                    raise ApiError(
                        400,
                        f"prompt: token id {bad} is outside the vocabulary [0, {vocab})",
                        param="prompt",
                        code="invalid_value",
                    )
                ids = list(prompt)
        if not ids:
            raise ApiError(400, f"{prompt_field}: the prompt encodes to no tokens", param=prompt_field)
        if token_limit is not None and len(ids) >= token_limit:
            what = "messages are" if chat else "prompt is"
            raise ApiError(
                400,
                f"This server's cache holds {token_limit} tokens per request (prompt and reply); "
                f"the {what} {len(ids)} tokens. Shorten the prompt, or serve with a larger (or a "
                "bounded, StreamingLLM) cache.",
                param=prompt_field,
                code="context_length_exceeded",
            )
        return _Parsed(prompt_ids=ids, prompt_field=prompt_field, **fields)

    def submit(p: _Parsed, arrived: float) -> _Call:
        max_tokens = p.max_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens
            if token_limit is not None:
                max_tokens = max(1, min(max_tokens, token_limit - len(p.prompt_ids)))
        seed = p.seed if p.seed is not None else (secrets.randbelow(SEED_LIMIT) if p.temperature > 0 else 0)
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=p.temperature,
                top_k=p.top_k,
                top_p=p.top_p,
                seed=seed,
                stop=p.stop,
                ignore_eos=p.ignore_eos,
            )
            return _Call(engine, p.prompt_ids, params, metrics, arrived)
        except QueueFullError as e:
            raise ApiError(
                429, f"the server is busy: {e}", code="rate_limit_exceeded", headers={"Retry-After": "1"}
            ) from None
        except EngineStopped:
            raise ApiError(503, "the server is shutting down", code="server_shutting_down") from None
        except JaxkvError as e:
            too_long = p.max_tokens is not None and token_limit is not None
            raise ApiError(
                400,
                str(e),
                param=p.max_tokens_field if too_long else p.prompt_field,
                code="context_length_exceeded" if too_long else None,
            ) from None

    async def completion(request: Request, *, chat: bool):
        arrived = time.perf_counter()
        body = await _read_json(request)
        p = await parse(body, chat=chat)
        if shutdown.begun:
            raise ApiError(503, "the server is shutting down", code="server_shutting_down")
        if not engine.ready:
            raise ApiError(
                503,
                "the model is loading (warming up); retry shortly",
                code="model_loading",
                headers={"Retry-After": "1"},
            )
        call = submit(p, arrived)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        obj = "chat.completion" if chat else "text_completion"
        base = {
            "id": rid,
            "object": obj + (".chunk" if chat and p.stream else ""),
            "created": int(time.time()),
            "model": model_name,
            "system_fingerprint": None,
        }
        return _CallResponse(call, (stream_chunks if p.stream else whole)(call, base, p, chat), stream=p.stream)

    async def whole(call: _Call, base: dict, p: _Parsed, chat: bool) -> AsyncIterator[bytes]:
        texts, last = [], None
        async for event in call.events():
            texts.append(event.text)
            last = event
        if last.finish_reason == "error":
            raise ApiError(500, f"the engine failed while serving this request: {last.error}")
        text = "".join(texts)
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None}}
            if chat
            else {"index": 0, "text": text}
        )
        choice.update(logprobs=None, finish_reason=FINISH_REASONS.get(last.finish_reason, "stop"))
        yield json.dumps(
            {**base, "choices": [choice], "usage": _usage(last)}, ensure_ascii=False, separators=(",", ":")
        ).encode()

    async def stream_chunks(call: _Call, base: dict, p: _Parsed, chat: bool) -> AsyncIterator[bytes]:
        extra = {"usage": None} if p.include_usage else {}

        def chunk(text: str | None, finish: str | None = None, role: bool = False) -> bytes:
            if chat:
                delta = {} if text is None else {"content": text}
                if role:
                    delta = {"role": "assistant", "content": ""}
                choice = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": text or ""}
            choice.update(logprobs=None, finish_reason=finish)
            return _sse({**base, "choices": [choice], **extra})

        if chat:
            yield chunk("", role=True)
        last = None
        async for event in call.events():
            last = event
            if event.text:
                yield chunk(event.text)
        if last.finish_reason == "error":  # as vLLM streams an error: one error object, then [DONE]
            yield _sse(ApiError(500, f"the engine failed while serving this request: {last.error}").body())
            yield b"data: [DONE]\n\n"
            return
        yield chunk(None, FINISH_REASONS.get(last.finish_reason, "stop"))
        if p.include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(last)})
        yield b"data: [DONE]\n\n"

    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    async def completions(request: Request):
        return await completion(request, chat=False)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "jaxkv"}

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request):
        name = request.path_params["model"]
        if name != model_name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist: this server serves `{model_name}`",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(model_card())

    async def health(request: Request):
        if shutdown.begun:
            return JSONResponse({"status": "stopping"}, status_code=503)
        if not engine.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_endpoint(request: Request):
        data = await run_in_threadpool(generate_latest, metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    async def api_error(request: Request, exc: ApiError):
        return exc.response()

    async def http_error(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return ApiError(exc.status_code, message, headers=dict(exc.headers or {})).response()

    async def server_error(request: Request, exc: Exception):
        return ApiError(500, f"internal server error: {type(exc).__name__}: {exc}").response()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await run_in_threadpool(shutdown.begin().join)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics_endpoint, methods=["GET"]),
        ],
        exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    app.state.shutdown = shutdown
    app.state.metrics = metrics
    app.add_middleware(_ApiMiddleware, metrics=metrics, api_key=api_key)
    return app


class _ApiMiddleware:
    """For ``/v1/*``: the API key check (401 in OpenAI's shape) and the request counter by status."""

    def __init__(self, app, *, metrics: _Metrics, api_key: str | None):
        self.app, self.metrics = app, metrics
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            return await self.app(scope, receive, send)
        counted = False

        async def counting_send(message):
            nonlocal counted
            if message["type"] == "http.response.start" and not counted:
                counted = True
                self.metrics.requests.labels(str(message["status"])).inc()
            await send(message)

        if self.expected is not None:
            given = dict(scope["headers"]).get(b"authorization")
            if given is None or not hmac.compare_digest(given, self.expected):
                error = ApiError(
                    401,
                    "You didn't provide an API key: send `Authorization: Bearer YOUR_KEY`"
                    if given is None
                    else "Incorrect API key provided",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await error.response()(scope, receive, counting_send)
        await self.app(scope, receive, counting_send)
