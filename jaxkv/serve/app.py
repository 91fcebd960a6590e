"""The OpenAI-compatible HTTP layer over :class:`jaxkv.serve.engine.Engine` (an ASGI app).

:func:`create_app` returns a Starlette app with ``POST /v1/chat/completions``,
``POST /v1/completions`` (both streaming over SSE or not), ``GET /v1/models``,
``GET /health`` and ``GET /metrics``. It is thin: a request body is validated by the
pydantic models of :mod:`jaxkv.serve.protocol` and turned into prompt ids and
:class:`~jaxkv.serve.engine.SamplingParams`, submitted to the engine, and the engine's events
are relayed. One exception handler answers every refusal in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}`` (never a framework's own).
docs/SERVING.md describes what is accepted and what is refused.

The handlers are module-level functions; what they share (the engine, the model's name, the
metrics, the shutdown) is :class:`Serving`, at ``app.state.serving``. ``/health`` and
``/metrics`` need no API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import threading
import time
import uuid
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jaxkv.decode.prompt import check_token_ids, encode_messages, encode_prompt
from jaxkv.errors import JaxkvError
from jaxkv.serve.engine import ContextLengthError, EngineStopped, QueueFullError, SamplingParams
from jaxkv.serve.protocol import (
    FINISH_REASONS,
    ApiError,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Delta,
    ModelCard,
    ModelList,
    Usage,
    parse_body,
)

__all__ = ["DEFAULT_MAX_TOKENS", "MAX_BODY_BYTES", "METRICS", "Serving", "create_app"]

DEFAULT_MAX_TOKENS = 256
"""Tokens generated when a request gives no ``max_tokens`` (less when a full cache holds fewer)."""

MAX_BODY_BYTES = 32 << 20
"""Largest request body accepted (413 beyond it)."""

_STREAM_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


# ---- metrics ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Metric:
    """One ``/metrics`` metric.

    Attributes:
      name: its Prometheus name (a counter's ``_total`` is added by prometheus_client).
      kind: ``counter``, ``gauge`` or ``histogram``.
      doc: its help text.
      key: for an engine metric, its key in ``engine.stats()`` (read at each scrape); for the
        app's own, its key in :class:`_Metrics` (``metrics["ttft"]``).
      engine: whether the engine reports it (else the app counts it).
      labels: label names. buckets: a histogram's buckets, seconds.
    """

    name: str
    kind: str
    doc: str
    key: str
    engine: bool = True
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


METRICS = (
    Metric("jaxkv_requests", "counter", "HTTP requests to /v1/* by response status", "requests", False, ("status",)),
    Metric(
        "jaxkv_finished_requests",
        "counter",
        "requests the engine ended, by its finish reason",
        "finished",
        False,
        ("reason",),
    ),
    Metric(
        "jaxkv_time_to_first_token_seconds",
        "histogram",
        "seconds from a request's arrival to its first generated token",
        "ttft",
        False,
        buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    ),
    Metric(
        "jaxkv_inter_token_latency_seconds",
        "histogram",
        "seconds between successive chunks of generated tokens of a request, as the client sees them (vLLM's ITL)",
        "itl",
        False,
        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
    ),
    Metric(
        "jaxkv_replicas",
        "gauge",
        "live engine replicas (jaxkv serve --ray: the other metrics are summed over those that reported; absent without --ray)",
        "replicas",
    ),
    Metric("jaxkv_queue_depth", "gauge", "requests waiting for a decode slot", "queue_depth"),
    Metric("jaxkv_busy_slots", "gauge", "decode slots serving a request", "busy_slots"),
    Metric("jaxkv_slots", "gauge", "decode slots (requests decoded together)", "slots"),
    Metric("jaxkv_kv_cache_bytes", "gauge", "bytes of the batched KV cache", "kv_bytes"),
    Metric("jaxkv_prefix_cache_entries", "gauge", "prompts held by the prefix cache", "prefix_entries"),
    Metric("jaxkv_prefix_cache_bytes", "gauge", "bytes held by the prefix cache", "prefix_bytes"),
    Metric("jaxkv_prefix_cache_hits", "counter", "requests whose prompt started with a cached prefix", "prefix_hits"),
    Metric("jaxkv_prefix_cache_misses", "counter", "requests whose prompt found no cached prefix", "prefix_misses"),
    Metric("jaxkv_prompt_tokens", "counter", "prompt tokens of submitted requests", "prompt_tokens_total"),
    Metric("jaxkv_cached_tokens", "counter", "prompt tokens taken from the prefix cache", "cached_tokens_total"),
    Metric("jaxkv_completion_tokens", "counter", "tokens generated", "completion_tokens_total"),
    Metric(
        "jaxkv_prefill_tokens", "counter", "prompt tokens prefilled (not from the prefix cache)", "prefill_tokens_total"
    ),
    Metric("jaxkv_prefill_seconds", "counter", "seconds spent prefilling", "prefill_seconds_total"),
    Metric("jaxkv_prefill_calls", "counter", "compiled prefill calls run", "prefill_calls_total"),
    Metric("jaxkv_prefill_rows", "counter", "rows the prefill calls ran, padding rows included", "prefill_rows_total"),
    Metric("jaxkv_decode_steps", "counter", "batched decode steps run", "decode_steps_total"),
    Metric("jaxkv_decode_seconds", "counter", "seconds spent in batched decode steps", "decode_seconds_total"),
    Metric("jaxkv_decode_calls", "counter", "compiled decode calls run", "decode_calls_total"),
    Metric(
        "jaxkv_decode_rows",
        "counter",
        "rows the decode steps ran, padding rows of a row bucket included (busy rows: completion tokens)",
        "decode_rows_total",
    ),
)
"""Every metric of ``/metrics`` (docs/SERVING.md lists them): the one table of their names."""


class _EngineCollector:
    """The engine's metrics of :data:`METRICS`, read from ``engine.stats()`` at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        try:
            stats = self.engine.stats()
        except Exception:  # an engine that cannot report (yet) leaves its metrics out of this scrape
            return
        for m in METRICS:
            if m.engine and m.key in stats:
                family = GaugeMetricFamily if m.kind == "gauge" else CounterMetricFamily
                yield family(m.name, m.doc, value=stats[m.key])


class _Metrics:
    """The app's own Prometheus registry: its metrics of :data:`METRICS` by key
    (``metrics["requests"]``), and the engine's through :class:`_EngineCollector`."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self._own = {}
        for m in METRICS:
            if m.engine:
                continue
            if m.kind == "histogram":
                self._own[m.key] = Histogram(m.name, m.doc, buckets=m.buckets, registry=self.registry)
            else:
                self._own[m.key] = Counter(m.name, m.doc, m.labels, registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def __getitem__(self, key: str):
        return self._own[key]


# ---- what the handlers share --------------------------------------------------------------------


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


@dataclasses.dataclass
class Serving:
    """What the handlers share (``app.state.serving``).

    Attributes:
      engine: the :class:`~jaxkv.serve.engine.Engine`. model_name: the model id clients pass.
      default_max_tokens: ``max_tokens`` of a request that gives none (a full cache: at most what fits).
      metrics: the app's registry. shutdown: ``begin()`` starts the engine's shutdown.
      created: the model card's ``created``, seconds since the epoch.
    """

    engine: object
    model_name: str
    default_max_tokens: int
    metrics: _Metrics
    shutdown: _Shutdown
    created: int

    @property
    def token_limit(self) -> int | None:
        """Tokens per request (prompt and reply) of a full cache; None: a bounded cache takes any length."""
        return getattr(self.engine.spec, "token_limit", None)

    def check_model(self, name: str | None) -> None:
        """Raise a 404 (``model_not_found``) for a model other than this one (None: this one)."""
        if name is not None and name != self.model_name:
            raise ApiError(
                404,
                f"The model `{name}` does not exist: this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )

    def model_card(self) -> ModelCard:
        """The served model as ``/v1/models`` lists it, with how it is served (``jaxkv``)."""
        return ModelCard(
            id=self.model_name,
            created=self.created,
            jaxkv={
                "cache": self.engine.spec.describe(),
                "slots": self.engine.slots,
                "max_tokens_per_request": self.token_limit,
            },
        )

    def submit(self, ids: list[int], body: ChatCompletionRequest | CompletionRequest, arrived: float) -> _Call:
        """Submit a validated request to the engine.

        Raises:
          ApiError: 400 ``context_length_exceeded`` (the engine's :class:`ContextLengthError`: ``param``
            the prompt's field when the prompt alone fills the cache, else the ``max_tokens`` field),
          429 ``rate_limit_exceeded`` (queue full, with ``Retry-After``), 503 ``server_shutting_down``.
        """
        default = self.default_max_tokens
        if self.token_limit is not None:
            default = max(1, min(default, self.token_limit - len(ids)))
        params = body.to_sampling_params(default_max_tokens=default)
        try:
            return _Call(self.engine, ids, params, self.metrics, arrived)
        except ContextLengthError as e:
            if e.prompt_tokens >= e.limit:
                what = "messages are" if body.prompt_field == "messages" else "prompt is"
                raise ApiError(
                    400,
                    f"This server's cache holds {e.limit} tokens per request (prompt and reply); the {what} "
                    f"{e.prompt_tokens} tokens. Shorten the prompt, or serve with a larger (or a bounded, "
                    "StreamingLLM) cache.",
                    param=body.prompt_field,
                    code="context_length_exceeded",
                ) from None
            raise ApiError(
                400, f"{body.max_tokens_field}: {e}", param=body.max_tokens_field, code="context_length_exceeded"
            ) from None
        except QueueFullError as e:
            raise ApiError(
                429, f"the server is busy: {e}", code="rate_limit_exceeded", headers={"Retry-After": "1"}
            ) from None
        except EngineStopped:
            raise ApiError(503, "the server is shutting down", code="server_shutting_down") from None


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
        with contextlib.suppress(RuntimeError):  # the event loop is gone (the server is exiting)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def events(self) -> AsyncIterator:
        """The request's events, the last one with a finish reason."""
        while not self.finished:
            event = await self.queue.get()
            t = time.perf_counter()  # the chunk goes out now
            if event.token_ids:
                if self.last is None:
                    self.metrics["ttft"].observe(t - self.arrived)
                else:
                    self.metrics["itl"].observe(t - self.last)
                self.last = t
            if event.finish_reason is not None:
                self.finished = True
                self.metrics["finished"].labels(event.finish_reason).inc()
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
                    await _error_json(e)(scope, receive, send)
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


def _sse(body: BaseModel, *, exclude: set[str] | None = None) -> bytes:
    return b"data: " + body.model_dump_json(exclude=exclude).encode() + b"\n\n"


def _engine_failed(event) -> ApiError:
    return ApiError(500, f"the engine failed while serving this request: {event.error}")


# ---- the two completion endpoints ---------------------------------------------------------------


class _Completions:
    """``POST /v1/completions``: a prompt's ids, and the completion's bodies."""

    request_model = CompletionRequest
    id_prefix = "cmpl"

    async def prompt_ids(self, serving: Serving, body: CompletionRequest) -> list[int]:
        """The ids of ``prompt`` (text encoded as :func:`jaxkv.sample` encodes it, or ids checked)."""
        try:
            if isinstance(body.prompt, str):
                return await run_in_threadpool(encode_prompt, serving.engine.model.tokenizer, body.prompt)
            check_token_ids(body.prompt, serving.engine.model.config.vocab_size)
            return list(body.prompt)
        except JaxkvError as e:
            raise ApiError(400, f"prompt: {e}", param="prompt", code="invalid_value") from None

    def response(self, head: dict, text: str, finish: str, usage: Usage) -> CompletionResponse:
        return CompletionResponse(**head, choices=[CompletionChoice(text=text, finish_reason=finish)], usage=usage)

    def first_chunk(self, head: dict) -> CompletionResponse | None:
        return None

    def chunk(self, head: dict, text: str | None, finish: str | None = None) -> CompletionResponse:
        return CompletionResponse(**head, choices=[CompletionChoice(text=text or "", finish_reason=finish)])

    def usage_chunk(self, head: dict, usage: Usage) -> CompletionResponse:
        return CompletionResponse(**head, choices=[], usage=usage)


class _ChatCompletions:
    """``POST /v1/chat/completions``: the messages' ids (the chat template), and the chat's bodies."""

    request_model = ChatCompletionRequest
    id_prefix = "chatcmpl"

    async def prompt_ids(self, serving: Serving, body: ChatCompletionRequest) -> list[int]:
        """The ids of ``messages`` rendered by the model's chat template (:func:`encode_messages`)."""
        tokenizer = serving.engine.model.tokenizer
        if tokenizer.chat_template is None:
            raise ApiError(
                400,
                f"model `{serving.model_name}` has no chat template: use /v1/completions with a prompt",
                param="messages",
                code="model_not_supported",
            )
        try:
            return await run_in_threadpool(encode_messages, tokenizer, body.conversation())
        except JaxkvError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None

    def response(self, head: dict, text: str, finish: str, usage: Usage) -> ChatCompletionResponse:
        choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=finish)
        return ChatCompletionResponse(**head, choices=[choice], usage=usage)

    def first_chunk(self, head: dict) -> ChatCompletionChunk:
        return ChatCompletionChunk(**head, choices=[ChatChunkChoice(delta=Delta(role="assistant", content=""))])

    def chunk(self, head: dict, text: str | None, finish: str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(**head, choices=[ChatChunkChoice(delta=Delta(content=text), finish_reason=finish)])

    def usage_chunk(self, head: dict, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(**head, choices=[], usage=usage)


_COMPLETIONS, _CHAT = _Completions(), _ChatCompletions()


async def _read_body(request: Request) -> bytes:
    """The request body, at most :data:`MAX_BODY_BYTES` (413 beyond)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"request body is larger than {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _complete(request: Request, endpoint: _Completions | _ChatCompletions) -> _CallResponse:
    """Validate, encode and submit a completion request; its response relays the engine's events."""
    arrived = time.perf_counter()
    serving: Serving = request.app.state.serving
    body = endpoint.request_model.model_validate(parse_body(await _read_body(request)))
    serving.check_model(body.model)
    ids = await endpoint.prompt_ids(serving, body)
    if serving.shutdown.begun:
        raise ApiError(503, "the server is shutting down", code="server_shutting_down")
    if not serving.engine.ready:
        raise ApiError(
            503, "the model is loading (warming up); retry shortly", code="model_loading", headers={"Retry-After": "1"}
        )
    call = serving.submit(ids, body, arrived)
    head = {"id": f"{endpoint.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": serving.model_name}
    chunks = _stream(call, endpoint, head, body.include_usage) if body.stream else _whole(call, endpoint, head)
    return _CallResponse(call, chunks, stream=bool(body.stream))


async def _whole(call: _Call, endpoint, head: dict) -> AsyncIterator[bytes]:
    """The one JSON body of a non-streamed reply, once it has finished (an engine error: ApiError 500)."""
    texts, last = [], None
    async for event in call.events():
        texts.append(event.text)
        last = event
    if last.finish_reason == "error":
        raise _engine_failed(last)
    body = endpoint.response(head, "".join(texts), FINISH_REASONS[last.finish_reason], Usage.of(last))
    yield body.model_dump_json().encode()


async def _stream(call: _Call, endpoint, head: dict, include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE events of a streamed reply: a chunk per event with text, the finish reason's chunk
    (with ``include_usage``: a usage chunk), ``[DONE]``; an engine error: one error object, then
    ``[DONE]`` (as vLLM streams an error)."""
    exclude = None if include_usage else {"usage"}
    first = endpoint.first_chunk(head)
    if first is not None:
        yield _sse(first, exclude=exclude)
    last = None
    async for event in call.events():
        last = event
        if event.text:
            yield _sse(endpoint.chunk(head, event.text), exclude=exclude)
    if last.finish_reason == "error":
        yield _sse(_engine_failed(last).body())
    else:
        yield _sse(endpoint.chunk(head, None, FINISH_REASONS[last.finish_reason]), exclude=exclude)
        if include_usage:
            yield _sse(endpoint.usage_chunk(head, Usage.of(last)))
    yield b"data: [DONE]\n\n"


# ---- handlers -----------------------------------------------------------------------------------


async def chat_completions(request: Request) -> _CallResponse:
    """``POST /v1/chat/completions`` (:class:`~jaxkv.serve.protocol.ChatCompletionRequest`)."""
    return await _complete(request, _CHAT)


async def completions(request: Request) -> _CallResponse:
    """``POST /v1/completions`` (:class:`~jaxkv.serve.protocol.CompletionRequest`)."""
    return await _complete(request, _COMPLETIONS)


async def models(request: Request) -> JSONResponse:
    """``GET /v1/models``: the one model served."""
    return JSONResponse(ModelList(data=[request.app.state.serving.model_card()]).model_dump())


async def model(request: Request) -> JSONResponse:
    """``GET /v1/models/{model}``: the model's card, or 404 for another name."""
    serving: Serving = request.app.state.serving
    serving.check_model(request.path_params["model"])
    return JSONResponse(serving.model_card().model_dump())


async def health(request: Request) -> JSONResponse:
    """``GET /health``: 200 ``ok``, or 503 ``loading`` (warming up) / ``stopping`` (shutting down)."""
    serving: Serving = request.app.state.serving
    if serving.shutdown.begun:
        return JSONResponse({"status": "stopping"}, status_code=503)
    if not serving.engine.ready:
        return JSONResponse({"status": "loading"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    """``GET /metrics``: :data:`METRICS` in Prometheus' text format."""
    data = await run_in_threadpool(generate_latest, request.app.state.serving.metrics.registry)
    return Response(data, media_type=CONTENT_TYPE_LATEST)


def _error_json(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body().model_dump(), status_code=error.status, headers=error.headers)


async def _error_response(request: Request, exc: Exception) -> JSONResponse:
    """The one error mapping: an :class:`ApiError` as it is, a request body's ValidationError as
    its 400 (:meth:`ApiError.from_validation`), Starlette's 404/405 in OpenAI's shape too."""
    if isinstance(exc, ValidationError):
        exc = ApiError.from_validation(exc)
    elif isinstance(exc, HTTPException):
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        exc = ApiError(exc.status_code, message, headers=dict(exc.headers or {}))
    return _error_json(exc)


async def _server_error(request: Request, exc: Exception) -> JSONResponse:
    return _error_json(ApiError(500, f"internal server error: {type(exc).__name__}: {exc}"))


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{model:path}", model, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]


@contextlib.asynccontextmanager
async def _lifespan(app):
    yield
    await run_in_threadpool(app.state.serving.shutdown.begin().join)


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
    answers ``/health`` with 503); the app's lifespan shutdown shuts it down.
    ``app.state.serving`` is its :class:`Serving`; ``app.state.serving.shutdown.begin()``
    starts the engine's shutdown at once (the ``jaxkv serve`` command calls it on
    SIGTERM/SIGINT, so in-flight streams end with a finish reason before uvicorn waits for
    their connections to close).

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
    serving = Serving(
        engine=engine,
        model_name=model_name,
        default_max_tokens=default_max_tokens,
        metrics=_Metrics(engine),
        shutdown=_Shutdown(engine, shutdown_timeout),
        created=int(time.time()),
    )
    app = Starlette(
        routes=ROUTES,
        exception_handlers={
            ApiError: _error_response,
            ValidationError: _error_response,
            HTTPException: _error_response,
            Exception: _server_error,
        },
        lifespan=_lifespan,
    )
    app.state.serving = serving
    app.add_middleware(_ApiMiddleware, metrics=serving.metrics, api_key=api_key)
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
                self.metrics["requests"].labels(str(message["status"])).inc()
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
                return await _error_json(error)(scope, receive, counting_send)
        await self.app(scope, receive, counting_send)
