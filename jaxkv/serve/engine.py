"""The serving engine: a request queue, ``slots`` cache rows, and one scheduling step.

Continuous batching over fixed shapes whose cost follows the work (vLLM's scheduler, llama.cpp's
unified batch): the engine holds one batched KV cache of ``slots`` rows, each row one request's
bounded cache, and a scheduler thread that repeats one :meth:`Engine.step`:

1. *admit*: queued requests take free slots (FIFO). Each row starts from the longest prefix of
   its tokens held in the :class:`~jaxkv.serve.prefix.PrefixStore` (a one-row cache written into
   the row), or empty;
2. *prefill*: one compiled call appends the next chunk of every waiting prompt (ragged rows, in
   arrival order, as many as fit ``max_num_batched_tokens`` after one token per decoding row),
   its rows gathered from the batched cache and written back (:mod:`jaxkv.cache.rows`), so a
   new prompt never waits behind more than one step's budget of other prompts. A prompt's
   state is stored in the prefix store where it ends (and where it leaves a shared prefix);
3. *decode*: one compiled call of up to ``block`` steps over the decoding rows only, compacted
   into the smallest of a few row buckets (powers of two up to ``slots``, all compiled at
   :meth:`Engine.warm_up`), running the decode loop :func:`jaxkv.sample` runs
   (:func:`jaxkv.decode.loop.decode_steps`): each row samples its next token from its own logits with its own
   settings (temperature, top-k, top-p, PRNG key: arrays, not static arguments, so no request
   compiles anything), and every step hands its tokens to the host inside the call
   (``io_callback``): they reach their streams as they are sampled (``stream_interval`` tokens
   per event), and the host ends rows (EOS, a stop string, ``max_tokens``, cancel) and ends the
   call early when a prompt waits. One client on a 64-slot engine runs 1-row steps.

A request leaves at EOS, a stop string, its ``max_tokens``, a full cache, or :meth:`Request.cancel`
(a client that went away), and its slot is free at the next step. A row's tokens depend on
its own prompt and settings alone, never on what shares the batch: greedy output equals
:func:`jaxkv.sample` of the same prompt and cache (its token ids, and the text it streams to
``on_text``: a completion's first piece keeps its leading space, which ``Generation.text``,
decoded alone, drops), sampled output with the same ``seed`` too
(:func:`jaxkv.decode.sampler.sample_rows`). Host callbacks need a backend that runs them (CPU
and GPU do).

Usage without HTTP::

    engine = Engine(model, CacheSpec(sink=4, window=252), slots=8)
    engine.start()                                   # warm-up compiles, then the scheduler thread
    request = engine.submit(ids, SamplingParams(max_tokens=64))
    for event in request.events():
        print(event.text, end="")
    engine.shutdown()
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.cache.rows import batch_axes, put_rows, take_rows
from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.decode import loop, parallel
from jaxkv.decode.prompt import check_token_ids, stop_strings
from jaxkv.decode.sampler import SEED_LIMIT, SamplingRows
from jaxkv.decode.text import TextStream
from jaxkv.errors import INT32_LIMIT, JaxkvError, check_int
from jaxkv.io import LoadedModel
from jaxkv.models.step import forward
from jaxkv.serve.prefix import PrefixStore, tree_bytes

__all__ = [
    "ContextLengthError",
    "Engine",
    "EngineStopped",
    "Event",
    "QueueFullError",
    "Request",
    "SamplingParams",
    "check_request",
]

log = logging.getLogger("jaxkv.serve")

FINISH_REASONS = ("stop", "length", "cancelled", "interrupted", "error")
CHECKPOINT_MIN = 16
"""A prompt that shares at least this many more tokens with a stored prefix than the longest
stored prefix of it stores its state at the branch point too (a shared system prompt)."""


class QueueFullError(JaxkvError):
    """The engine's bounded queue is full: retry later (HTTP 429)."""


class EngineStopped(JaxkvError):
    """The engine is shutting down or stopped: no new requests (HTTP 503)."""


class ContextLengthError(JaxkvError):
    """A prompt plus ``max_tokens`` beyond a full cache's ``max_len`` (HTTP 400,
    ``context_length_exceeded``).

    Attributes:
      prompt_tokens: the prompt's tokens. max_tokens: the tokens asked for. limit: the cache's tokens.
    """

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int):
        self.prompt_tokens, self.max_tokens, self.limit = prompt_tokens, max_tokens, limit
        super().__init__(
            f"prompt of {prompt_tokens} tokens + max_tokens={max_tokens} is beyond the cache's "
            f"{limit} tokens (max_len): ask for at most {max(limit - prompt_tokens, 0)} tokens, or serve "
            "with a bounded cache (a StreamingLLM window)"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """One request's generation settings (OpenAI's names).

    Attributes:
      max_tokens: tokens to generate at most, >= 1.
      temperature: >= 0, 0 = greedy. top_k: None (all tokens) or >= 1. top_p: None or in (0, 1].
      seed: PRNG seed in ``[0, 2**32)``: the same seed draws the same tokens as
        ``jaxkv.sample(..., seed=seed)``.
      stop: stop strings: generation ends when the text contains one (not returned).
      ignore_eos: do not stop at EOS (llama-server's and vLLM's extension).
    Raises:
      JaxkvError: a value outside those ranges, naming the field.
    """

    max_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        check_int("max_tokens", self.max_tokens, 1, INT32_LIMIT)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise JaxkvError(f"temperature={t!r}: expected a finite number >= 0 (0 = greedy)")
        if self.top_k is not None:
            check_int("top_k", self.top_k, 1, INT32_LIMIT)
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise JaxkvError(f"top_p={p!r}: expected a number in (0, 1]")
        check_int("seed", self.seed, 0, SEED_LIMIT)
        object.__setattr__(self, "stop", stop_strings(self.stop))


def check_request(prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int, token_limit: int | None) -> list:
    """The checks of :meth:`Engine.submit` before a request queues (also made by the Ray Serve
    ingress, :mod:`jaxkv.serve.cluster`, before it picks a replica); returns the ids as a list.

    Raises:
      JaxkvError: ``params`` not :class:`SamplingParams`, an empty prompt, ids outside
        ``[0, vocab_size)``; ContextLengthError: a prompt plus ``max_tokens`` beyond ``token_limit``
        (a full cache's ``max_len``; None: a bounded cache, any length).
    """
    if not isinstance(params, SamplingParams):
        raise JaxkvError(f"params={params!r}: expected SamplingParams")
    ids = list(prompt_ids)
    if not ids:
        raise JaxkvError("prompt: expected at least one token")
    check_token_ids(ids, vocab_size)
    if token_limit is not None and len(ids) + params.max_tokens > token_limit:
        raise ContextLengthError(len(ids), params.max_tokens, token_limit)
    return ids


@dataclasses.dataclass(frozen=True)
class Event:
    """What a request's stream receives after each engine step that concerned it.

    Attributes:
      token_ids: ids generated since the last event (an EOS that stopped generation included).
      text: text generated since the last event (EOS never; a stop string and what follows never).
      finish_reason: None while running; else ``stop`` (EOS or a stop string), ``length``
        (``max_tokens``, or a full cache), ``cancelled`` (:meth:`Request.cancel`),
        ``interrupted`` (the engine shut down first) or ``error`` (``error`` says why).
      prompt_tokens: tokens of the prompt. cached_tokens: of those, taken from the prefix store.
      completion_tokens: tokens generated so far.
      error: the error message of an ``error`` finish, else None.
    """

    token_ids: list
    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: str | None = None


class Request:
    """A submitted request (made by :meth:`Engine.submit`): its stream of :class:`Event` s.

    Attributes:
      id: a unique string. prompt_ids: the prompt's ids. params: its :class:`SamplingParams`.
      token_ids: ids generated so far. text: text so far. finish_reason: None while running.
      cached_tokens: prompt tokens taken from the prefix store (known once it is admitted).
      submitted: ``time.monotonic()`` at submission.
    """

    _ids = itertools.count()

    def __init__(self, prompt_ids: Sequence[int], params: SamplingParams, on_event: Callable[[Event], None] | None):
        self.id = f"req-{next(self._ids)}"
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.cached_tokens = 0
        self.submitted = time.monotonic()
        self.cancelled = threading.Event()
        self._queue: queue.SimpleQueue | None = None if on_event is not None else queue.SimpleQueue()
        self._on_event = on_event if on_event is not None else self._queue.put

    def cancel(self) -> None:
        """Stop this request (a client that went away): its slot is free at the engine's next
        step, and a last event with finish reason ``cancelled`` follows (unless it had ended)."""
        self.cancelled.set()

    def events(self, timeout: float | None = None) -> Iterator[Event]:
        """The events as they arrive, up to the last (blocking; only without ``on_event``).

        Raises:
          JaxkvError: a request made with ``on_event``; TimeoutError: no event for ``timeout`` s.
        """
        if self._queue is None:
            raise JaxkvError("Request.events(): this request delivers its events to its on_event callback")
        while True:
            try:
                event = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no event for {timeout} s") from None
            yield event
            if event.finish_reason is not None:
                return

    def result(self, timeout: float | None = None) -> Request:
        """Wait for the last event (see :meth:`events`); returns this request, finished."""
        for _ in self.events(timeout):
            pass
        return self

    def _emit(self, token_ids: list, text: str, finish_reason: str | None = None, error: str | None = None) -> None:
        self.token_ids.extend(token_ids)
        self.text += text
        self.finish_reason = finish_reason
        self._on_event(
            Event(
                token_ids=token_ids,
                text=text,
                finish_reason=finish_reason,
                prompt_tokens=len(self.prompt_ids),
                cached_tokens=self.cached_tokens,
                completion_tokens=len(self.token_ids),
                error=error,
            )
        )


@dataclasses.dataclass
class _Slot:
    """A request in its row of the batched cache: prefilling (``todo`` not empty, or later
    ``segments``), then decoding (``stream`` set)."""

    request: Request
    todo: list  # prompt tokens of the current segment still to append
    segments: list  # later segments (token-id lists), a state stored after each
    held: list  # the tokens the row's cache holds
    stream: TextStream | None = None
    pending: list = dataclasses.field(default_factory=list)  # text pieces not yet sent
    new: list = dataclasses.field(default_factory=list)  # token ids not yet sent
    reason: str | None = None  # the finish reason, once decided

    @property
    def decoding(self) -> bool:
        return self.stream is not None


_ENGINES: weakref.WeakValueDictionary[int, Engine] = weakref.WeakValueDictionary()
"""The engines by id, for :func:`_deliver` (a decode call names its engine by an int32 array)."""
_ENGINE_IDS = itertools.count()


class Engine:
    """Continuous batching over ``slots`` rows (see the module docstring).

    Args:
      model: a :class:`~jaxkv.io.LoadedModel` with a tokenizer.
      spec: every row's cache (:class:`~jaxkv.CacheSpec` or :class:`~jaxkv.LayerSpecs`): a
        bounded (StreamingLLM / KIVI) cache serves any prompt length; a full one
        (``max_len``) refuses a prompt plus ``max_tokens`` beyond it.
      slots: rows of the batched cache (requests served at once), >= 1; a multiple of the
        mesh's ``data`` size.
      max_queue: requests waiting for a slot at most, >= 0 (beyond: :class:`QueueFullError`).
      prefix_cache_bytes: bytes of stored prefix states at most (0 = no prefix reuse).
      prefill_chunk: prompt tokens per row per step at most (capped by the spec's ``max_chunk``).
      block: decode steps per compiled call at most. A call ends early, after the step in
        which it happens, when a request waits to be prefilled or a row finishes while
        others wait, so the call's length never delays a prompt by more than one step.
      max_num_batched_tokens: the token budget of a scheduling step (vLLM's name): every decoding
        row's next token first, then waiting prompts' chunks in the rest of the budget; one
        prompt's chunk alone may take the whole budget (so prompts go on prefilling while many
        rows decode), and no chunk is longer. >= 1.
      stream_interval: tokens per event a decoding row delivers at most (vLLM's name): 1 sends
        every token as it is sampled; N > 1 batches N tokens into one event, >= 1.
      mesh: a :func:`jaxkv.decode.parallel.make_mesh` mesh: slots shard over its ``data``
        axis (as ``jaxkv batch``), the parameters as :func:`~jaxkv.decode.parallel.shard_model`
        places them; every call then runs all ``slots`` rows (no compaction).
    Raises:
      JaxkvError: bad sizes, a model without a tokenizer, a cache that does not fit memory.
    """

    def __init__(
        self,
        model: LoadedModel,
        spec: CacheSpec | LayerSpecs,
        *,
        slots: int = 4,
        max_queue: int = 64,
        prefix_cache_bytes: int = 256 << 20,
        prefill_chunk: int = loop.PREFILL_CHUNK,
        block: int = 16,
        max_num_batched_tokens: int = loop.PREFILL_CHUNK,
        stream_interval: int = 1,
        mesh=None,
    ):
        if model.tokenizer is None:
            raise JaxkvError("Engine: the model has no tokenizer (give one with load_model(..., tokenizer=PATH))")
        self.slots = check_int("slots", slots, 1, INT32_LIMIT)
        if slots % parallel.data_size(mesh):
            raise JaxkvError(f"slots={slots}: expected a multiple of the mesh's data size {parallel.data_size(mesh)}")
        self.max_queue = check_int("max_queue", max_queue, 0, INT32_LIMIT)
        self.prefill_chunk = check_int("prefill_chunk", prefill_chunk, 1, INT32_LIMIT)
        self.block = check_int("block", block, 1, 256)
        self.max_num_batched_tokens = check_int("max_num_batched_tokens", max_num_batched_tokens, 1, INT32_LIMIT)
        self.stream_interval = check_int("stream_interval", stream_interval, 1, INT32_LIMIT)
        specs = getattr(spec, "specs", (spec,))
        if any(s.policy.retention is not None and s.policy.retention.observes_prompt for s in specs):
            raise JaxkvError(
                "Engine: keep_score=snapkv observes each whole prompt before caching it, which chunks "
                "interleaved with decoding cannot do: serve with h2o, tova or recent"
            )
        self.mesh = mesh
        self.model = model if mesh is None else parallel.shard_model(model, mesh)
        self.spec = loop.model_cache_spec(model.config, spec)
        self.prefix = PrefixStore(prefix_cache_bytes)
        self._graphdef, self._state = nnx.split(self.model.model)
        self._cache = loop.new_cache(model.config, spec, slots, mesh=mesh)
        config = model.config
        self._axes = batch_axes(
            self.spec, n_layers=config.n_layers, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim
        )
        self._row_sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        self._empty_row = self._new_row()
        self._row_tree = jax.tree.structure(self._empty_row)
        vocab = config.vocab_size
        self._logits = self._placed(np.zeros((slots, vocab), np.float32), rows=True)
        self._empty_logits = self._row_placed(jnp.zeros((1, vocab), jnp.float32))
        # the compiled batch sizes: powers of two below slots, and slots (a mesh: slots only)
        self.row_buckets = (slots,) if mesh is not None else tuple(sorted({*_powers_of_two(slots), slots}))
        cap = min(loop.chunk_len(self.spec, INT32_LIMIT, self.prefill_chunk), self.max_num_batched_tokens)
        self.chunk_buckets = tuple(t for t in _powers_of_two(cap + 1) if t >= min(PREFILL_MIN, cap))
        if not self.chunk_buckets or self.chunk_buckets[-1] != cap:  # cap itself (a window of 252: chunks of 252)
            self.chunk_buckets += (cap,)
        self._rows: list[_Slot | None] = [None] * slots
        self._temperature = np.zeros(slots, np.float32)
        self._top_k = np.full(slots, vocab, np.int32)
        self._top_p = np.ones(slots, np.float32)
        self._keys = np.zeros((slots, 2), np.uint32)
        self._steps = np.zeros(slots, np.int32)
        self._call_rows: np.ndarray | None = None  # the slots of the decode call running now
        self._call_error: BaseException | None = None
        self._queue: collections.deque[Request] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None
        self.ready = False
        self.counts = collections.Counter()  # prompt / cached / completion tokens, steps, rows, seconds
        self.kv_bytes = tree_bytes(self._cache)
        self._id = next(_ENGINE_IDS)
        _ENGINES[self._id] = self

    # ---- the public API --------------------------------------------------------------------------
    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, on_event: Callable[[Event], None] | None = None
    ) -> Request:
        """Queue a request; its events go to ``on_event`` (called from the engine's thread) or,
        without one, to :meth:`Request.events`.

        Args:
          prompt_ids: the prompt's token ids (at least one), as the model reads them (BOS,
            chat template: :func:`jaxkv.decode.encode_prompt` for a text,
            :func:`jaxkv.decode.prompt.encode_messages` for a message list).
          params: the request's :class:`SamplingParams`.
        Raises:
          JaxkvError: an empty prompt or ids outside the vocabulary; ContextLengthError (a
            JaxkvError): a prompt plus ``max_tokens`` beyond a full cache's ``max_len`` (before any work);
          QueueFullError: ``max_queue`` requests already wait; EngineStopped: after :meth:`shutdown`.
        """
        ids = check_request(prompt_ids, params, self.model.config.vocab_size, self.spec.token_limit)
        request = Request(ids, params, on_event)
        with self._wake:
            if self._stopping:
                raise EngineStopped("the server is shutting down: no new requests")
            if len(self._queue) >= self.max_queue + self._free_slots():
                raise QueueFullError(
                    f"{len(self._queue)} requests are waiting (max_queue={self.max_queue}): retry later"
                )
            self._queue.append(request)
            self._wake.notify()
        return request

    def start(self) -> Engine:
        """:meth:`warm_up`, then run :meth:`step` in a background thread until :meth:`shutdown`."""
        self.warm_up()
        self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 10.0) -> None:
        """Take no new requests; give those queued or running up to ``timeout`` seconds to finish,
        then end them with finish reason ``interrupted``; return once the scheduler has stopped."""
        with self._wake:
            self._stopping = True
            self._deadline = time.monotonic() + timeout
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        else:  # never started: nothing runs; end what is queued
            self._interrupt_all()

    @property
    def alive(self) -> bool:
        """Whether the scheduler thread runs: started (:meth:`start`) and not shut down."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def stats(self) -> dict:
        """Counters and gauges for metrics: ``queue_depth``, ``busy_slots``, ``slots``, ``kv_bytes``,
        ``prefix_hits``, ``prefix_misses``, ``prefix_bytes``, ``prefix_entries``,
        ``prompt_tokens_total``, ``cached_tokens_total``, ``completion_tokens_total``,
        ``decode_steps_total``, ``decode_rows_total`` (rows the compiled decode steps ran, padding
        included: a step over 3 busy rows runs 4), ``decode_calls_total``, ``decode_seconds_total``,
        ``prefill_tokens_total``, ``prefill_rows_total`` (rows the prefill calls ran, padding
        included), ``prefill_calls_total``, ``prefill_seconds_total``."""
        c = self.counts
        return dict(
            queue_depth=len(self._queue),
            busy_slots=sum(r is not None for r in self._rows),
            slots=self.slots,
            kv_bytes=self.kv_bytes,
            prefix_hits=self.prefix.hits,
            prefix_misses=self.prefix.misses,
            prefix_bytes=self.prefix.nbytes,
            prefix_entries=len(self.prefix),
            prompt_tokens_total=c["prompt"],
            cached_tokens_total=c["cached"],
            completion_tokens_total=c["completion"],
            decode_steps_total=c["steps"],
            decode_rows_total=c["decode_rows"],
            decode_calls_total=c["decode_calls"],
            decode_seconds_total=c["decode_s"],
            prefill_tokens_total=c["prefilled"],
            prefill_rows_total=c["prefill_rows"],
            prefill_calls_total=c["prefill_calls"],
            prefill_seconds_total=c["prefill_s"],
        )

    def warm_up(self) -> float:
        """Compile every program the engine runs: the prefill call for every (rows, chunk)
        shape the scheduler can pick, the decode call for every row bucket, insert, extract,
        so that no request compiles anything (each run once on rows that append nothing);
        returns the seconds it took. Sets :attr:`ready`."""
        t0 = time.perf_counter()
        with loop.count_compiles("serve"):
            self._reset_row(0, self._empty_row, self._empty_logits)
            for rows, t in self._prefill_shapes():
                self._prefill_call(
                    np.arange(rows, dtype=np.int32), np.zeros((rows, t), np.int32), np.zeros(rows, np.int32)
                )
            self._extract(0)
            for rows in self.row_buckets:
                self._decode(np.arange(rows, dtype=np.int32), np.zeros(rows, bool))
            jax.block_until_ready(self._cache)
        self.ready = True
        return time.perf_counter() - t0

    def step(self) -> bool:
        """One scheduling step: admit queued requests into free slots, one prefill call of the
        waiting prompts' chunks under the token budget, one decode call over the decoding rows
        (events delivered as tokens are sampled). Returns whether there was work."""
        self._admit()
        worked = self._prefill()
        if any(r is not None and r.decoding for r in self._rows):
            self._generate()
            worked = True
        return worked

    # ---- scheduling ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._queue and not any(r is not None for r in self._rows):
                    self._wake.wait()
                if self._stopping and (time.monotonic() >= self._deadline or self._idle()):
                    break
            try:
                with loop.count_compiles("serve"):
                    self.step()
            except Exception as e:  # noqa: BLE001 - a bug must not hang every client: end them, keep serving
                log.exception("jaxkv serve: a step failed; its requests end with an error")
                self._fail_all(f"{type(e).__name__}: {e}")
        self._interrupt_all()

    def _idle(self) -> bool:
        return not self._queue and all(r is None for r in self._rows)

    def _free_slots(self) -> int:
        return sum(r is None for r in self._rows)

    def _admit(self) -> None:
        """Queued requests into free slots (FIFO), each row starting from the longest stored
        prefix of its prompt (or empty), with a stored state at the point where it leaves the
        longest prefix it shares with a stored one (a shared system prompt)."""
        while True:
            with self._wake:
                if not self._queue or None not in self._rows:
                    return
                request = self._queue.popleft()
            if request.cancelled.is_set():
                request._emit([], "", "cancelled")
                continue
            slot = self._rows.index(None)
            try:
                self._rows[slot] = self._start(request, slot)
            except Exception as e:
                request._emit([], "", "error", f"{type(e).__name__}: {e}")
                raise

    def _start(self, request: Request, slot: int) -> _Slot:
        ids = request.prompt_ids
        hit = self.prefix.lookup(ids)
        held = 0 if hit is None else len(hit.tokens)
        if hit is None:
            self._reset_row(slot, self._empty_row, self._empty_logits)
        else:
            self._reset_row(slot, hit.cache, hit.logits)
        branch = self.prefix.branch(ids[:-1])
        cuts = [branch] if branch >= held + CHECKPOINT_MIN else []
        segments = [list(ids[a:b]) for a, b in zip([held, *cuts], [*cuts, len(ids)]) if b > a]
        request.cached_tokens = held
        self.counts["prompt"] += len(ids)
        self.counts["cached"] += held
        row = _Slot(request=request, todo=segments[0] if segments else [], segments=segments[1:], held=list(ids[:held]))
        if not row.todo:  # the whole prompt was stored: decode from its logits
            self._start_decoding(slot, row)
        return row

    def _prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (rows, chunk) shape :meth:`_plan_prefill` can pick."""
        shapes = []
        for t in self.chunk_buckets:
            for rows in self.row_buckets:
                if rows == self.row_buckets[0] or rows * t <= self.max_num_batched_tokens:
                    shapes.append((rows, t))
        return shapes

    def _plan_prefill(self, n_decoding: int) -> tuple[list[int], int]:
        """The slots that prefill in this step and the chunk length T: every prompt waiting (in
        the order they came) while rows x the smallest chunk bucket fit the budget left after one
        token per decoding row (at least that bucket), T the smallest chunk bucket that covers
        their longest part and fits (a one-row call: any bucket, up to the whole budget), else
        the largest that fits."""
        budget = max(self.max_num_batched_tokens - n_decoding, self.chunk_buckets[0])
        waiting = sorted(
            (s for s, r in enumerate(self._rows) if r is not None and r.todo),
            key=lambda s: self._rows[s].request.submitted,
        )
        chosen: list[int] = []
        for slot in waiting:
            if chosen and _bucket(self.row_buckets, len(chosen) + 1) * self.chunk_buckets[0] > budget:
                break
            chosen.append(slot)
        if not chosen:
            return [], 0
        rows = _bucket(self.row_buckets, len(chosen))
        want = max(len(self._rows[s].todo) for s in chosen)
        fits = [t for t in self.chunk_buckets if rows == self.row_buckets[0] or rows * t <= budget]
        t = next((t for t in fits if t >= want), fits[-1])
        return chosen, t

    def _prefill(self) -> bool:
        """One compiled prefill call over the waiting prompts' next chunks (:meth:`_plan_prefill`)."""
        for slot, row in enumerate(self._rows):
            if row is not None and row.todo and row.request.cancelled.is_set():
                self._release(slot, "cancelled")
        chosen, t = self._plan_prefill(sum(r is not None and r.decoding for r in self._rows))
        if not chosen:
            return False
        rows = _bucket(self.row_buckets, len(chosen))
        index = self._call_index(chosen, rows, prefer_decoding=True)
        at = [int(np.flatnonzero(index == s)[0]) for s in chosen]  # each chosen slot's row in the call
        n = np.zeros(rows, np.int32)
        n[at] = self.spec.policy.plan_chunk(
            [len(self._rows[s].held) for s in chosen], [len(self._rows[s].todo) for s in chosen], t
        )
        tokens = np.zeros((rows, t), np.int32)
        for j, slot in zip(at, chosen):
            tokens[j, : n[j]] = self._rows[slot].todo[: n[j]]
        t0 = time.perf_counter()
        self._prefill_call(index, tokens, n)
        jax.block_until_ready(self._logits)
        self.counts["prefill_s"] += time.perf_counter() - t0
        self.counts["prefill_calls"] += 1
        self.counts["prefill_rows"] += rows
        self.counts["prefilled"] += int(n.sum())
        for j, slot in zip(at, chosen):
            row = self._rows[slot]
            row.held += row.todo[: n[j]]
            del row.todo[: n[j]]
            if row.todo:
                continue
            self.prefix.put(row.held, *self._extract(slot))  # a branch point, or the prompt's end
            if row.segments:
                row.todo = row.segments.pop(0)
            else:
                self._start_decoding(slot, row)
        return True

    def _prefill_call(self, index: np.ndarray, tokens: np.ndarray, n: np.ndarray) -> None:
        """One compiled :func:`_prefill_rows` call on the batched cache and logits (in place):
        ``tokens: int32[R, T]`` (``n: int32[R]`` valid per row) appended to rows ``index: int32[R]``."""
        self._cache, self._logits = _prefill_rows(
            self._graphdef,
            self._state,
            self._cache,
            self._logits,
            *(self._placed(x) for x in (index, tokens, n)),
            axes=self._axes,
        )

    def _start_decoding(self, slot: int, row: _Slot) -> None:
        p = row.request.params
        vocab = self.model.config.vocab_size
        self._temperature[slot] = p.temperature
        self._top_k[slot] = min(p.top_k or vocab, vocab)
        self._top_p[slot] = 1.0 if p.top_p is None else p.top_p
        self._keys[slot] = (0, p.seed)  # jax.random.PRNGKey(seed) of a seed < 2**32, made without a device call
        self._steps[slot] = 0
        row.stream = TextStream(self.model.tokenizer, row.request.prompt_ids, row.pending.append, stop=p.stop)

    def _call_index(self, chosen: list[int], rows: int, *, prefer_decoding: bool) -> np.ndarray:
        """int32[rows]: the slots of a compiled call over the ``chosen`` ones, filled up with
        other distinct slots that append nothing (free slots first, then busy ones of the other
        kind); a call over every slot takes them in order (it runs on the cache itself, :func:`_take`)."""
        if rows == self.slots:
            return np.arange(rows, dtype=np.int32)
        taken = set(chosen)
        free = [s for s, r in enumerate(self._rows) if r is None and s not in taken]
        busy = [s for s, r in enumerate(self._rows) if r is not None and s not in taken]
        busy.sort(key=lambda s: self._rows[s].decoding != prefer_decoding)
        return np.array(chosen + (free + busy)[: rows - len(chosen)], np.int32)

    def _generate(self) -> None:
        """One decode call over the decoding rows, compacted into the smallest row bucket that
        holds them: up to :attr:`block` steps, each step's tokens delivered as it is sampled
        (:meth:`_deliver`); then the rows that finished are released."""
        decoding = [s for s, r in enumerate(self._rows) if r is not None and r.decoding]
        rows = _bucket(self.row_buckets, len(decoding))
        index = self._call_index(decoding, rows, prefer_decoding=False)
        active = np.isin(index, decoding)
        t0 = time.perf_counter()
        self._decode(index, active)
        self.counts["decode_s"] += time.perf_counter() - t0
        self.counts["decode_calls"] += 1
        if self._call_error is not None:
            error, self._call_error = self._call_error, None
            raise error
        for slot in decoding:
            row = self._rows[slot]
            if row.reason is not None:
                self._finish(slot, row)

    def _decode(self, index: np.ndarray, active: np.ndarray) -> None:
        """Run the decode call over slots ``index`` (``active`` rows sample and append; the
        others append nothing), and wait for it."""
        self._call_rows = index
        sampling = SamplingRows(
            temperature=self._temperature[index], top_k=self._top_k[index], top_p=self._top_p[index]
        )
        try:
            self._cache, self._logits = _decode_rows(
                self._graphdef,
                self._state,
                self._cache,
                self._logits,
                *(
                    self._placed(x)
                    for x in (np.int32(self._id), index, active, sampling, self._keys[index], self._steps[index])
                ),
                block=self.block,
                axes=self._axes,
            )
            jax.block_until_ready(self._logits)
        finally:
            self._call_rows = None

    def _deliver(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The host's part of every decode step (called from inside the compiled call):
        ``tokens: int32[R]`` sampled by the call's rows (-1: an inactive row) are checked (EOS,
        stop strings, ``max_tokens``, cancel) and sent as events. Returns ``(stop bool[R]: rows
        that end now, go bool[]: whether the call takes another step)``: it ends early when a
        prompt waits for its prefill, or a row ended while a request waits for a slot."""
        index = self._call_rows
        stop = np.zeros(len(tokens), bool)
        eos = self.model.tokenizer.eos_id
        self.counts["steps"] += 1
        self.counts["decode_rows"] += len(tokens)
        for j in np.flatnonzero(tokens >= 0):
            slot = int(index[j])
            row = self._rows[slot]
            request, p, token = row.request, row.request.params, int(tokens[j])
            self._steps[slot] += 1
            self.counts["completion"] += 1
            row.new.append(token)
            if row.stream.on_block(np.array([[token]])) or (token == eos and not p.ignore_eos):
                row.reason = "stop"  # a stop string or EOS (tokens after a stop string are dropped)
            elif len(request.token_ids) + len(row.new) >= p.max_tokens:
                row.reason = "length"
            elif request.cancelled.is_set():
                row.reason = "cancelled"
            if row.reason is not None:
                stop[j] = True
            elif len(row.new) >= self.stream_interval:
                text = "".join(row.pending)
                row.pending.clear()
                new, row.new = row.new, []
                request._emit(new, text)
        waiting = any(r is not None and r.todo for r in self._rows) or (
            bool(self._queue) and (stop.any() or None in self._rows)
        )
        return stop, np.bool_(not (waiting or self._stopping))

    def _finish(self, slot: int, row: _Slot) -> None:
        """End a row that finished in the last decode call: store its state, free its slot,
        send its last event."""
        request = row.request
        if row.reason != "cancelled":  # the state after the prompt and every token but the last (not appended)
            self.prefix.put((request.prompt_ids + request.token_ids + row.new)[:-1], *self._extract(slot))
        row.stream.flush()  # (nothing after a stop string)
        self._rows[slot] = None
        request._emit(row.new, "".join(row.pending), row.reason)

    def _release(self, slot: int, reason: str, error: str | None = None) -> None:
        """Free ``slot`` and end its request with ``reason``; a decoding row's last event carries
        the tokens and text it had not yet sent (``stream_interval`` > 1)."""
        row, self._rows[slot] = self._rows[slot], None
        if row is not None and row.request.finish_reason is None:
            if row.decoding:
                row.stream.flush()
            row.request._emit(row.new, "".join(row.pending), reason, error)

    def _interrupt_all(self, reason: str = "interrupted", error: str | None = None) -> None:
        """End every queued, prefilling and decoding request with ``reason``."""
        with self._wake:
            waiting, self._queue = list(self._queue), collections.deque()
        for request in waiting:
            request._emit([], "", reason, error)
        for slot in range(self.slots):
            self._release(slot, reason, error)

    def _fail_all(self, error: str) -> None:
        """After a failed step: end everything in flight with ``error`` and start from a new cache."""
        self._interrupt_all("error", error)
        self._cache = loop.new_cache(self.model.config, self.spec, self.slots, mesh=self.mesh)
        self._logits = self._placed(np.zeros((self.slots, self.model.config.vocab_size), np.float32), rows=True)

    # ---- placement -------------------------------------------------------------------------------
    def _new_row(self):
        """An empty one-row cache (replicated over the mesh, if any)."""
        return self._row_placed(loop.new_cache(self.model.config, self.spec, 1))

    def _row_placed(self, tree):
        return tree if self._row_sharding is None else jax.device_put(tree, self._row_sharding)

    def _reset_row(self, slot: int, row, logits) -> None:
        """Write a one-row cache and its logits ``float32[1, V]`` into row ``slot`` (not consumed)."""
        index = self._placed(np.array([slot], np.int32))
        self._cache, self._logits = _put_row(self._cache, self._logits, row, logits, index, axes=self._axes)

    def _extract(self, slot: int):
        """``(one-row cache, logits float32[1, V])``: copies of row ``slot`` of the batch, placed
        as :meth:`_new_row` places a row (so that a prefill from it needs no other program)."""
        index = self._placed(np.array([slot], np.int32))
        leaves, logits = _take_row(self._cache, self._logits, index, axes=self._axes)
        return self._row_placed((jax.tree.unflatten(self._row_tree, leaves), logits))

    def _placed(self, x: np.ndarray, *, rows: bool = False):
        """A host array on the device(s): its leading (slot) axis over the mesh's ``data`` axis."""
        if self.mesh is None or not rows:
            return jax.device_put(x)
        return jax.device_put(x, NamedSharding(self.mesh, PartitionSpec("data", *([None] * (x.ndim - 1)))))


PREFILL_MIN = 16
"""The shortest prefill chunk bucket: a prompt's last few tokens are padded to it, so that the
(rows, chunk) shapes compiled stay few."""


def _powers_of_two(n: int) -> list[int]:
    """1, 2, 4, ... below ``n``."""
    return [1 << k for k in range(max(n - 1, 0).bit_length()) if 1 << k < n]


def _bucket(buckets: tuple[int, ...], n: int) -> int:
    """The smallest of ``buckets`` >= ``n``."""
    return next(b for b in buckets if b >= n)


def _deliver(ident, tokens):
    """The host callback of :func:`_decode_rows`: the engine ``ident``'s :meth:`Engine._deliver`;
    an error in it stops the call (the engine raises it after the call)."""
    engine = _ENGINES[int(ident)]
    try:
        return engine._deliver(np.asarray(tokens))
    except BaseException as e:  # noqa: BLE001 - raised by the engine thread once the call returns
        engine._call_error = e
        return np.ones(len(tokens), bool), np.bool_(False)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("axes",), donate_argnames=("cache", "logits"))
def _prefill_rows(graphdef, state, cache, logits, index, tokens, n, *, axes):
    """Append ``tokens: int32[R, T]`` (``n: int32[R]`` valid per row; 0 = the row appends
    nothing) to the rows ``index: int32[R]`` of the batched cache (gathered, run, written back);
    those rows' logits ``float32[B, V]`` become the logits after their last appended token."""
    part, old = _take(cache, index, axes), _take(logits, index, (0,))
    new, part = forward(graphdef, state, tokens, n, part, last_only=True)
    return _put(cache, index, part, axes), _put(logits, index, jnp.where((n > 0)[:, None], new[:, 0], old), (0,))


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("block", "axes"), donate_argnames=("cache", "logits"))
def _decode_rows(graphdef, state, cache, logits, ident, index, active, sampling, keys, steps, *, block, axes):
    """The decode loop (:func:`jaxkv.decode.loop.decode_steps`, up to ``block`` steps) over the
    rows ``index: int32[R]`` of the batched cache, gathered once and written back once: each
    ``active: bool[R]`` row samples under its own rule (``sampling``, its own key ``keys:
    uint32[R, 2]`` at its sampling step ``steps: int32[R]``), the host takes every step's tokens
    and says which rows end and whether to go on (:func:`_deliver`, engine ``ident``). Inactive
    rows append nothing and keep their logits; a row that ends does not append its last token.
    Returns ``(cache, logits)``."""
    part, part_logits = _take(cache, index, axes), _take(logits, index, (0,))
    rows = index.shape[0]
    start = loop.LoopState(
        logits=part_logits,
        done=~active,
        reason=jnp.zeros((rows,), jnp.int32),
        generated=jnp.zeros((rows,), jnp.int32),
        step=steps,
        limit=jnp.int32(block),
    )
    budget = jnp.full((rows,), INT32_LIMIT - 1, jnp.int32)  # the host ends rows (max_tokens, EOS, stop strings)
    part, end, _ = loop.decode_steps(
        graphdef,
        state,
        part,
        start,
        budget,
        sampling,
        keys,
        block=block,
        eos_id=None,
        host=_deliver,
        host_args=(ident,),
    )
    return _put(cache, index, part, axes), _put(logits, index, end.logits, (0,))


def _take(tree, index, axes):
    """Rows ``index: int32[R]`` of a batched pytree for a compiled call; a call over every row
    (``R == B``, ``index`` then ``arange(B)``) runs on the tree itself: a gather and write-back of
    all 16 rows of SmolLM2's sink 4 + window 252 fp32 cache took 128 ms on a 2-core AMD EPYC,
    more than a 16-row decode step (1 row: 3 ms)."""
    whole = index.shape[0] == jax.tree.leaves(tree)[0].shape[axes[0]]
    return tree if whole else take_rows(tree, index, axes)


def _put(tree, index, rows, axes):
    """:func:`_take`'s inverse: ``tree`` with rows ``index`` replaced by ``rows``."""
    whole = index.shape[0] == jax.tree.leaves(tree)[0].shape[axes[0]]
    return rows if whole else put_rows(tree, index, rows, axes)


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnames=("cache", "logits"))
def _put_row(cache, logits, row, row_logits, index, *, axes):
    """Write a one-row cache and its logits ``float32[1, V]`` into row ``index: int32[1]`` of the
    batched ones (JetStream's insert), in place."""
    return put_rows(cache, index, row, axes), put_rows(logits, index, row_logits.astype(logits.dtype), (0,))


@functools.partial(jax.jit, static_argnames=("axes",))
def _take_row(cache, logits, index, *, axes):
    """Row ``index: int32[1]`` of the batched cache and logits: the one-row cache's leaves
    (flattened) and ``float32[1, V]`` (copies)."""
    return jax.tree.leaves(take_rows(cache, index, axes)), jnp.take(logits, index, axis=0)
