"""The serving engine: a request queue, fixed decode slots, and one scheduling step.

Continuous batching over fixed shapes (JetStream's prefill / insert / generate): the engine
holds one batched KV cache of ``slots`` rows, each row one request's bounded cache, and a
scheduler thread that repeats one :meth:`Engine.step`:

1. *admit*: queued requests take free slots (FIFO). Each starts from the longest prefix of
   its tokens held in the :class:`~jaxkv.serve.prefix.PrefixStore` (a copy of that one-row
   cache), or from an empty one-row cache;
2. *prefill*: the oldest admitted request appends one compiled chunk of its prompt to its
   one-row cache (:func:`jaxkv.decode.loop.prefill_steps`), so that a long prompt is spread
   over many steps and never freezes the streams already decoding. A finished prompt's
   cache is stored as a prefix state and *inserted* into its row of the batched cache (one
   batch-row update of the cache pytree);
3. *generate*: one compiled call of ``block`` decode steps over every row (one step while a
   prompt waits, so that its prefill is not held up): each running row samples its next
   token from its own logits with its own settings (temperature, top-k, top-p, PRNG key:
   arrays, not static arguments, so no request compiles anything after :meth:`Engine.warm_up`)
   and appends it, until its EOS or budget; idle rows append nothing.

A request leaves at EOS, a stop string, its ``max_tokens``, a full cache, or :meth:`Request.cancel`
(a client that went away), and its slot is free at the next step. A row's tokens depend on
its own prompt and settings alone, never on what shares the batch: greedy output equals
:func:`jaxkv.sample` of the same prompt and cache (its token ids, and the text it streams to
``on_text``: a completion's first piece keeps its leading space, which ``Generation.text``,
decoded alone, drops), sampled output with the same ``seed`` too
(:func:`jaxkv.decode.sampler.sample_rows`).

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
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.cache.kv import KVCache
from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.decode import loop, parallel
from jaxkv.decode.prompt import check_token_ids, stop_strings
from jaxkv.decode.sampler import SEED_LIMIT, sample_rows
from jaxkv.decode.text import TextStream
from jaxkv.errors import INT32_LIMIT, JaxkvError, check_int
from jaxkv.io import LoadedModel
from jaxkv.models.step import forward
from jaxkv.serve.prefix import PrefixStore, tree_bytes

__all__ = ["ContextLengthError", "Engine", "EngineStopped", "Event", "QueueFullError", "Request", "SamplingParams"]

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
class _Prefill:
    """An admitted request whose prompt is being prefilled into its one-row cache."""

    request: Request
    slot: int
    segments: list  # token-id lists still to append, in order; a state is stored after each
    done: list  # the tokens the cache holds so far
    cache: object
    logits: jax.Array | None
    steps: Iterator | None = None


@dataclasses.dataclass
class _Row:
    """A request decoding in its slot."""

    request: Request
    stream: TextStream
    pending: list  # text pieces since the last event


class Engine:
    """Continuous batching over ``slots`` fixed decode rows (see the module docstring).

    Args:
      model: a :class:`~jaxkv.io.LoadedModel` with a tokenizer.
      spec: every row's cache (:class:`~jaxkv.CacheSpec` or :class:`~jaxkv.LayerSpecs`): a
        bounded (StreamingLLM / KIVI) cache serves any prompt length; a full one
        (``max_len``) refuses a prompt plus ``max_tokens`` beyond it.
      slots: rows of the decode batch (requests decoding at once), >= 1; a multiple of the
        mesh's ``data`` size.
      max_queue: requests waiting for a slot at most, >= 0 (beyond: :class:`QueueFullError`).
      prefix_cache_bytes: bytes of stored prefix states at most (0 = no prefix reuse).
      prefill_chunk: tokens per compiled prefill call (capped by the spec's ``max_chunk``).
      block: decode steps per compiled call while no prompt waits (one call's host round trip
        shared by ``block`` tokens; a request arriving meanwhile waits for the call to end).
      max_num_batched_tokens: tokens per scheduling step at most (vLLM's name): every decoding
        row's next token first, then waiting prompts' chunks in the rest of the budget, >= 1.
      stream_interval: tokens per event a decoding row delivers at most (vLLM's name): 1 sends
        every token as it is sampled; N > 1 batches N tokens into one event, >= 1.
      mesh: a :func:`jaxkv.decode.parallel.make_mesh` mesh: slots shard over its ``data``
        axis (as ``jaxkv batch``), the parameters as :func:`~jaxkv.decode.parallel.shard_model` places them.
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
        block: int = 8,
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
        self._axes = _batch_axes(model.config, spec)
        self._row_tree = jax.tree.structure(loop.new_cache(model.config, spec, 1))
        self._row_sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        vocab = model.config.vocab_size
        self._logits = self._placed(np.zeros((slots, vocab), np.float32), rows=True)
        self._rows: list[_Row | _Prefill | None] = [None] * slots
        self._active = np.zeros(slots, bool)
        self._temperature = np.zeros(slots, np.float32)
        self._top_k = np.full(slots, vocab, np.int32)
        self._top_p = np.ones(slots, np.float32)
        self._keys = np.zeros((slots, 2), np.uint32)
        self._steps = np.zeros(slots, np.int32)
        self._queue: collections.deque[Request] = collections.deque()
        self._prefills: collections.deque[_Prefill] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None
        self.ready = False
        self.counts = collections.Counter()  # prompt / cached / completion tokens, steps, seconds
        self.kv_bytes = tree_bytes(self._cache)

    # ---- the public API --------------------------------------------------------------------------
    def submit(
        self, prompt_ids: Sequence[int], params: SamplingParams, on_event: Callable[[Event], None] | None = None
    ) -> Request:
        """Queue a request; its events go to ``on_event`` (called from the engine's thread) or,
        without one, to :meth:`Request.events`.

        Args:
          prompt_ids: the prompt's token ids (at least one), as the model reads them (BOS,
            chat template: :func:`jaxkv.decode.encode_prompt`).
          params: the request's :class:`SamplingParams`.
        Raises:
          JaxkvError: an empty prompt or ids outside the vocabulary; ContextLengthError (a
            JaxkvError): a prompt plus ``max_tokens`` beyond a full cache's ``max_len`` (before any work);
          QueueFullError: ``max_queue`` requests already wait; EngineStopped: after :meth:`shutdown`.
        """
        if not isinstance(params, SamplingParams):
            raise JaxkvError(f"params={params!r}: expected SamplingParams")
        ids = list(prompt_ids)
        if not ids:
            raise JaxkvError("prompt: expected at least one token")
        check_token_ids(ids, self.model.config.vocab_size)
        limit = self.spec.token_limit
        if limit is not None and len(ids) + params.max_tokens > limit:
            raise ContextLengthError(len(ids), params.max_tokens, limit)
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

    def stats(self) -> dict:
        """Counters and gauges for metrics: ``queue_depth``, ``busy_slots``, ``slots``, ``kv_bytes``,
        ``prefix_hits``, ``prefix_misses``, ``prefix_bytes``, ``prefix_entries``,
        ``prompt_tokens_total``, ``cached_tokens_total``, ``completion_tokens_total``,
        ``decode_steps_total``, ``decode_seconds_total``, ``prefill_tokens_total``, ``prefill_seconds_total``."""
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
            decode_seconds_total=c["decode_s"],
            prefill_tokens_total=c["prefilled"],
            prefill_seconds_total=c["prefill_s"],
        )

    def warm_up(self) -> float:
        """Compile every program the engine runs: prefill chunks of every length (each run once,
        a prompt of two chunks too, into scratch rows), insert, extract, the copy and the decode
        step, so that no request compiles anything; returns the seconds it took. Sets :attr:`ready`."""
        t0 = time.perf_counter()
        cap = loop.chunk_len(self.spec, INT32_LIMIT, self.prefill_chunk)
        lengths = [2**k for k in range(1, cap.bit_length()) if 2**k < cap] + [cap, cap + 1]
        limit = self.spec.token_limit
        with loop.count_compiles("serve"):
            for n in [n for n in lengths if limit is None or n < limit]:
                row, logits = loop.prefill(self.model, self._new_row(), [[0] * n], chunk=self.prefill_chunk)
            self._cache, self._logits = _insert(
                self._cache, self._logits, _copy(row), logits, np.int32(0), axes=self._axes
            )
            self._extract(0)
            self._decode(1)
        self.ready = True
        return time.perf_counter() - t0

    def step(self) -> bool:
        """One scheduling step: admit queued requests into free slots, one prefill chunk, one
        decode call over the busy rows, events delivered. Returns whether there was work."""
        self._admit()
        worked = self._prefill_one()
        if self._active.any():
            self._generate()
            worked = True
        return worked or bool(self._prefills)

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
                self._rows[slot] = job = self._start(request, slot)
            except Exception as e:
                request._emit([], "", "error", f"{type(e).__name__}: {e}")
                raise
            self._prefills.append(job)

    def _start(self, request: Request, slot: int) -> _Prefill:
        """The prefill job of ``request``: from the longest stored prefix, with a stored state at
        the point where it leaves the longest prefix it shares with a stored one."""
        ids = request.prompt_ids
        hit = self.prefix.lookup(ids)
        held = 0 if hit is None else len(hit.tokens)
        if hit is None:
            cache, logits = self._new_row(), None
        elif held == len(ids):  # the whole prompt: no prefill, insert the stored state as is
            cache, logits = hit.cache, hit.logits
        else:
            cache, logits = _copy(hit.cache), None
        branch = self.prefix.branch(ids[:-1])
        cuts = [branch] if branch >= held + CHECKPOINT_MIN else []
        segments = [ids[a:b] for a, b in zip([held, *cuts], [*cuts, len(ids)]) if b > a]
        request.cached_tokens = held
        self.counts["prompt"] += len(ids)
        self.counts["cached"] += held
        return _Prefill(
            request=request, slot=slot, segments=segments, done=list(ids[:held]), cache=cache, logits=logits
        )

    def _prefill_one(self) -> bool:
        """One compiled prefill chunk of the oldest admitted request (or its insertion)."""
        while self._prefills:
            job = self._prefills[0]
            if job.request.cancelled.is_set():
                self._prefills.popleft()
                self._release(job.slot, "cancelled")
                continue
            if job.steps is None and job.segments:
                job.steps = loop.prefill_steps(self.model, job.cache, [job.segments[0]], chunk=self.prefill_chunk)
            if job.steps is not None:
                t0 = time.perf_counter()
                try:
                    job.cache, job.logits = next(job.steps)
                    job.logits.block_until_ready()
                    self.counts["prefill_s"] += time.perf_counter() - t0
                    return True
                except StopIteration:
                    job.done += job.segments.pop(0)
                    job.steps = None
                    if job.segments:  # a branch point: a copy stored, the next segment consumes the cache
                        self.prefix.put(job.done, _copy(job.cache), job.logits)
                        continue
                    self.prefix.put(job.done, job.cache, job.logits)  # the prompt's end (insert reads it)
            self._prefills.popleft()
            self._insert(job)
            return True
        return False

    def _insert(self, job: _Prefill) -> None:
        """Write a prefilled one-row cache into its slot and start decoding there."""
        request, slot, p = job.request, job.slot, job.request.params
        self.counts["prefilled"] += len(request.prompt_ids) - request.cached_tokens
        self._cache, self._logits = _insert(
            self._cache, self._logits, job.cache, job.logits, np.int32(slot), axes=self._axes
        )
        self._active[slot] = True
        self._temperature[slot] = p.temperature
        self._top_k[slot] = min(p.top_k or self.model.config.vocab_size, self.model.config.vocab_size)
        self._top_p[slot] = 1.0 if p.top_p is None else p.top_p
        self._keys[slot] = (0, p.seed)  # jax.random.PRNGKey(seed) of a seed < 2**32, made without a device call
        self._steps[slot] = 0
        pending: list[str] = []
        stream = TextStream(self.model.tokenizer, request.prompt_ids, pending.append, stop=p.stop)
        self._rows[slot] = _Row(request=request, stream=stream, pending=pending)

    def _generate(self) -> None:
        """One decode call over the busy rows: :attr:`block` steps, or one while a prompt waits
        for its prefill (so that it starts after one step); each row's tokens checked and delivered."""
        steps = 1 if self._queue or self._prefills else self.block
        t0 = time.perf_counter()
        tokens = self._decode(steps)
        self.counts["decode_s"] += time.perf_counter() - t0
        self.counts["steps"] += steps
        eos = self.model.tokenizer.eos_id
        for slot in np.flatnonzero(self._active):
            row = self._rows[slot]
            request, p = row.request, row.request.params
            fed = [int(t) for t in tokens[slot] if t >= 0]  # every token the row appended in this call
            self._steps[slot] += len(fed)
            self.counts["completion"] += len(fed)
            new, reason = [], None
            for token in fed:
                new.append(token)
                if row.stream.on_block(np.array([[token]])) or (token == eos and not p.ignore_eos):
                    reason = "stop"  # a stop string or EOS (tokens after a stop string are dropped)
                elif len(request.token_ids) + len(new) >= p.max_tokens:
                    reason = "length"
                if reason is not None:
                    break
            if reason is None and request.cancelled.is_set():
                reason = "cancelled"
            if reason is not None:
                row.stream.flush()  # (nothing after a stop string)
            text = "".join(row.pending)
            row.pending.clear()
            if reason is None:
                request._emit(new, text)
                continue
            if reason != "cancelled":  # the state after the prompt and every token the row appended
                self.prefix.put(request.prompt_ids + request.token_ids + fed, *self._extract(slot))
            self._active[slot] = False
            self._rows[slot] = None
            request._emit(new, text, reason)

    def _decode(self, steps: int) -> np.ndarray:
        """Run ``steps`` decode steps on every row (idle rows append nothing); int32[slots, block]
        tokens, -1 after a row's EOS or budget (and past ``steps``)."""
        remaining = np.zeros(self.slots, np.int32)
        for slot in np.flatnonzero(self._active):
            remaining[slot] = self._rows[slot].request.params.max_tokens - len(self._rows[slot].request.token_ids)
        ignore_eos = np.array([isinstance(r, _Row) and r.request.params.ignore_eos for r in self._rows])
        self._cache, self._logits, tokens = _decode_step(
            self._graphdef,
            self._state,
            self._cache,
            self._logits,
            *(
                self._placed(x, rows=True)
                for x in (
                    self._active,
                    self._temperature,
                    self._top_k,
                    self._top_p,
                    self._keys,
                    self._steps,
                    remaining,
                    ignore_eos,
                )
            ),
            self._placed(np.int32(steps)),
            block=self.block,
            eos_id=self.model.tokenizer.eos_id,
        )
        return loop.to_host(tokens)

    def _release(self, slot: int, reason: str, error: str | None = None) -> None:
        """Free ``slot`` and end its request with ``reason``."""
        row, self._rows[slot] = self._rows[slot], None
        self._active[slot] = False
        if row is not None and row.request.finish_reason is None:
            row.request._emit([], "", reason, error)

    def _interrupt_all(self, reason: str = "interrupted", error: str | None = None) -> None:
        """End every queued, prefilling and running request with ``reason``."""
        with self._wake:
            waiting, self._queue = list(self._queue), collections.deque()
        for request in waiting:
            request._emit([], "", reason, error)
        self._prefills.clear()
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

    def _extract(self, slot: int):
        """``(one-row cache, logits float32[1, V])``: copies of row ``slot`` of the batch, placed
        as :meth:`_new_row` places a row (so that a prefill from it needs no other program)."""
        leaves, logits = _extract(self._cache, self._logits, np.int32(slot), axes=self._axes)
        return self._row_placed((jax.tree.unflatten(self._row_tree, leaves), logits))

    def _placed(self, x: np.ndarray, *, rows: bool = False):
        """A host array on the device(s): its leading (slot) axis over the mesh's ``data`` axis."""
        if self.mesh is None or not rows:
            return jax.device_put(x)
        return jax.device_put(x, NamedSharding(self.mesh, PartitionSpec("data", *([None] * (x.ndim - 1)))))


def _batch_axes(config, spec) -> tuple[int, ...]:
    """Per leaf of a model's cache (flattened), the axis of its rows B: where a 2-row and a
    1-row cache's shapes differ."""
    one, two = (
        jax.tree.leaves(
            jax.eval_shape(
                lambda b=b: KVCache._empty(
                    loop.model_cache_spec(config, spec),
                    batch=b,
                    n_layers=config.n_layers,
                    n_kv_heads=config.n_kv_heads,
                    head_dim=config.head_dim,
                )
            )
        )
        for b in (1, 2)
    )
    return tuple(next(i for i, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n) for a, b in zip(one, two))


@functools.partial(
    jax.jit, static_argnums=(0,), static_argnames=("block", "eos_id"), donate_argnames=("cache", "logits")
)
def _decode_step(
    graphdef,
    state,
    cache,
    logits,
    active,
    temperature,
    top_k,
    top_p,
    keys,
    step,
    remaining,
    ignore_eos,
    steps,
    *,
    block,
    eos_id,
):
    """Up to ``steps: int32[]`` (at most ``block``) decode steps over every row, in one
    ``lax.while_loop`` (a traced count: one program for any count), the model step under a
    ``lax.cond`` as in :func:`jaxkv.decode.loop.decode_block` (without it, SmolLM2 int8 on a
    2-core CPU took ~45 ms more per call, a loop of 4 steps twice the time per step): each active row samples its next token from
    ``logits: float32[B, V]`` with its own settings (:func:`~jaxkv.decode.sampler.sample_rows`,
    at its sampling step ``step: int32[B]``) and appends it, until its ``remaining: int32[B]``
    budget is spent or it samples ``eos_id`` (unless ``ignore_eos: bool[B]``); idle rows append
    nothing and keep their logits. Returns ``(cache, logits, tokens int32[B, block])``, -1 where
    a row appended nothing."""

    def cond(carry):
        i, _, _, active, *_ = carry
        return (i < steps) & jnp.any(active)

    def body(carry):
        i, cache, logits, active, step, remaining, out = carry
        token = sample_rows(logits, temperature, top_k, top_p, keys, step)

        def run(cache):
            new, cache = forward(graphdef, state, token[:, None], active.astype(jnp.int32), cache)
            return jnp.where(active[:, None], new[:, 0], logits), cache

        logits, cache = jax.lax.cond(jnp.any(active), run, lambda c: (logits, c), cache)
        out = jax.lax.dynamic_update_slice(out, jnp.where(active, token, -1)[:, None], (jnp.int32(0), i))
        step, remaining = step + active, remaining - active
        ended = (remaining <= 0) if eos_id is None else (remaining <= 0) | ((token == eos_id) & ~ignore_eos)
        return i + 1, cache, logits, active & ~ended, step, remaining, out

    out = jnp.full((active.shape[0], block), -1, jnp.int32)
    _, cache, logits, *_, out = jax.lax.while_loop(
        cond, body, (jnp.int32(0), cache, logits, active, step, remaining, out)
    )
    return cache, logits, out


@functools.partial(jax.jit, static_argnames=("axes",), donate_argnames=("cache", "logits"))
def _insert(cache, logits, row, row_logits, slot, *, axes):
    """Write a one-row cache and its logits ``float32[1, V]`` into row ``slot`` of the batched ones
    (JetStream's insert): every leaf's row axis (``axes``, per flattened leaf) updated in place."""
    leaves, tree = jax.tree.flatten(cache)
    rows = jax.tree.leaves(row)
    leaves = [
        jax.lax.dynamic_update_slice_in_dim(x, r.astype(x.dtype), slot, axis=a) for x, r, a in zip(leaves, rows, axes)
    ]
    return jax.tree.unflatten(tree, leaves), jax.lax.dynamic_update_slice_in_dim(logits, row_logits, slot, axis=0)


@functools.partial(jax.jit, static_argnames=("axes",))
def _extract(cache, logits, slot, *, axes):
    """Row ``slot`` of the batched cache and logits: the one-row cache's leaves (flattened) and
    ``float32[1, V]`` (copies)."""
    rows = [jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=a) for x, a in zip(jax.tree.leaves(cache), axes)]
    return rows, jax.lax.dynamic_slice_in_dim(logits, slot, 1, axis=0)


@jax.jit
def _copy(tree):
    """A copy of every leaf (a stored prefix state is copied before a prefill consumes it)."""
    return jax.tree.map(jnp.copy, tree)
