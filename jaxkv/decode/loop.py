"""The one compiled decode loop, chunked prefill, and the plumbing every caller shares.

Decoding runs as one compiled ``lax.while_loop`` per block of tokens with the cache
donated (updated in place); the host only sees each finished block, to print it.
Prefill streams the prompt through the cache in chunks whose every query attends to its
own retained set (DESIGN §2), so a prompt longer than a StreamingLLM cache is fine.

Public pieces, used by :func:`jaxkv.generate`, chat, batch decoding and perplexity alike:

* :func:`new_cache`: an empty cache shaped for a model (optionally born sharded on a mesh);
* :func:`plan_chunks`: the planned-chunk iterator (``spec.policy.plan_chunk``, padded to one static
  length T) that prefill and :func:`jaxkv.eval.token_nll` both stream with;
* :func:`prefill`, :func:`decode`, and :func:`prefill_and_decode` (the two, timed);
* :func:`lower_decode` / :func:`compile_decode`: the decode loop lowered or compiled for a cache,
  for audits and tests; :func:`compile_counts` counts real (backend) compilations per program.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import os
import pickle
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.experimental import io_callback

from jaxkv.cache.kv import KVCache, cache_bytes
from jaxkv.cache.memory import element_bits
from jaxkv.cache.retention import OBSERVE, pooled
from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.decode import parallel
from jaxkv.decode.sampler import Sampler, SamplingRows, prng_keys, sample_rows, step_keys
from jaxkv.errors import INT32_LIMIT, CacheFullError, JaxkvError
from jaxkv.io import LoadedModel
from jaxkv.models import ggml
from jaxkv.models.step import forward

FINISH_REASONS = ("running", "eos", "length", "cache_full", "stop")
STREAM_S = 0.1
"""Seconds of decoding per block while text streams (``decode(..., stream_s=STREAM_S)``): about
ten pieces of text a second, each block still one call of the compiled loop."""
_RUNNING, _EOS, _LENGTH, _CACHE_FULL, _STOP = range(5)


# ---- the cache a model needs ---------------------------------------------------------------------
def new_cache(config, spec: CacheSpec | LayerSpecs, batch: int, *, mesh=None) -> KVCache:
    """An empty cache of ``batch`` rows for a model's ``config`` (layers L, KV heads K, head dim H).

    A model with local sliding-window layers (Mistral, Gemma 2/3, Phi-3) gets the per-layer
    cache its config asks for (:meth:`~jaxkv.LlamaConfig.cache_spec`): local layers keep their
    trained window, the others what ``spec`` says.

    Args:
      config: the model's config (a :class:`~jaxkv.LlamaConfig`: ``n_layers``, ``n_kv_heads``,
        ``head_dim``; ``cache_spec`` when it has one).
      spec: the cache spec (or :class:`~jaxkv.LayerSpecs`, one per layer). batch: B rows.
      mesh: a :func:`jaxkv.decode.parallel.make_mesh` mesh: the cache is born sharded on it (None = one device).
    Raises:
      JaxkvError: a spec the shapes do not fit, or B / K that do not split over the mesh.
    """
    spec, sizes = _model_cache(config, spec, batch)
    if mesh is not None:
        return parallel.create_cache(spec, mesh, **sizes)
    return KVCache.create(spec, **sizes)


def new_cache_bytes(config, spec: CacheSpec | LayerSpecs, batch: int) -> int:
    """Bytes :func:`new_cache` would allocate (every leaf; counted from shapes, nothing allocated,
    the memory not checked). Raises: JaxkvError: as :func:`new_cache`."""
    spec, sizes = _model_cache(config, spec, batch)
    return cache_bytes(spec, **sizes)


def new_cache_bits(config, spec: CacheSpec | LayerSpecs) -> tuple[float | None, float]:
    """Effective bits per K/V element of the cache :func:`new_cache` would make: ``(bits in
    the quantised store or None, bits of the whole cache)``, as
    :func:`jaxkv.cache.memory.element_bits` counts them (from shapes, nothing allocated).
    Raises: JaxkvError: as :func:`new_cache`."""
    spec, sizes = _model_cache(config, spec, 1)
    return element_bits(jax.eval_shape(lambda: KVCache._empty(spec, **sizes)))


def model_cache_spec(config, spec: CacheSpec | LayerSpecs) -> CacheSpec | LayerSpecs:
    """The spec of the cache :func:`new_cache` makes for a model's ``config`` from ``spec``: its
    local sliding-window layers' windows applied (:meth:`~jaxkv.LlamaConfig.cache_spec`); the
    spec a saved cache of it holds. Raises: JaxkvError: as :func:`new_cache`."""
    return config.cache_spec(spec) if hasattr(config, "cache_spec") else spec


def _model_cache(config, spec: CacheSpec | LayerSpecs, batch: int):
    """The (per-layer) spec and the sizes of a model's cache of ``batch`` rows."""
    sizes = dict(batch=batch, n_layers=config.n_layers, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim)
    return model_cache_spec(config, spec), sizes


def full_cache_len(n_tokens: int, step: int = 256) -> int:
    """Slots of a default full cache for ``n_tokens``: rounded up to a multiple of ``step`` so
    that prompts of similar length share one compiled decode step."""
    return step * -(-n_tokens // step)


def placed(x) -> jax.Array:
    """A host value (NumPy array or scalar, its dtype kept) on the default device, placed by
    ``jax.device_put``: ``jnp.asarray``, ``jnp.zeros`` or ``jnp.int32`` of a host value each run
    a small XLA program, which a fresh process traces, lowers and looks up in the compilation
    cache (~10-40 ms apiece on the project's CPU) before its first token."""
    return jax.device_put(x)


def to_host(x) -> np.ndarray:
    """``x`` as a NumPy array on this host. A global array that spans other processes' devices
    (several hosts after ``jax.distributed.initialize()``) is all-gathered first."""
    if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# ---- counting real compilations ------------------------------------------------------------------
_COMPILES: Counter = Counter()
_CACHE_LOADS: Counter = Counter()  # of those, executables JAX's persistent cache loaded
_PROGRAM = threading.local()


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""JAX's monitoring event (with a duration) of one backend compile, or of one executable loaded
from the persistent compilation cache."""
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
"""JAX's monitoring event of one executable loaded from the persistent compilation cache."""


def _on_event(event: str, *args, **kwargs) -> None:
    program = getattr(_PROGRAM, "name", None)
    if program is not None and event == COMPILE_EVENT:
        _COMPILES[program] += 1
    elif program is not None and event == CACHE_HIT_EVENT:
        _CACHE_LOADS[program] += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)
jax.monitoring.register_event_listener(_on_event)


@contextlib.contextmanager
def count_compiles(program: str):
    """Inside this context, every XLA backend compilation counts as one of ``program`` (see :func:`compile_counts`)."""
    outer = getattr(_PROGRAM, "name", None)
    _PROGRAM.name = program
    try:
        yield
    finally:
        _PROGRAM.name = outer


def compile_counts() -> dict[str, int]:
    """Backend compilations so far in this process, per program: ``decode`` (the decode loop),
    ``prefill`` (a prefill chunk), ``nll`` (a scoring chunk of :func:`jaxkv.eval.token_nll`),
    ``serve`` (any other program the serving engine's thread compiles: its decode step, insert,
    extract, copies, eager operations); an executable JAX's persistent compilation cache loads counts too (one event covers both).

    Counted from JAX's own compile events, so a program that re-traces and re-compiles (a
    shape or a static argument that changes per call) shows here however it is invoked.
    """
    return {name: _COMPILES[name] for name in ("decode", "prefill", "nll", "serve")}


def _signature(args, *static) -> tuple:
    """What a jitted call's executable depends on: the static arguments and, per leaf of
    ``args``, shape, dtype, sharding and weak type."""
    leaves, tree = jax.tree.flatten(args)
    return (
        *static,
        tree,
        jax.config.jax_enable_x64,
        tuple((x.shape, x.dtype, getattr(x, "sharding", None), getattr(x, "weak_type", False)) for x in leaves),
    )


# ---- planned chunks ------------------------------------------------------------------------------
def chunk_len(spec: CacheSpec, longest: int, chunk: int) -> int:
    """Static chunk length T: a power of two >= 2 covering ``longest`` tokens, capped at ``chunk``
    and the spec's ``max_chunk``, so that few shapes (and compiles) occur."""
    return min(spec.max_chunk, chunk, 1 << max(longest - 1, 1).bit_length())


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One planned chunk of B rows.

    Attributes:
      offsets: int64[B], where each row's part of this chunk starts in its sequence.
      n: int32[B], tokens of each row in this chunk (0 = the row appends nothing).
      remaining: int64[B], tokens each row had left before this chunk.
    """

    offsets: np.ndarray
    n: np.ndarray
    remaining: np.ndarray

    def take(self, rows: Sequence[Sequence[int]], t: int, shift: int = 0) -> np.ndarray:
        """int32[B, T]: ``rows[b][offsets[b] + shift :][: n[b]]``, zero-padded to T."""
        out = np.zeros((len(rows), t), np.int32)
        for b, row in enumerate(rows):
            start = self.offsets[b] + shift
            out[b, : self.n[b]] = row[start : start + self.n[b]]
        return out


def plan_chunks(spec: CacheSpec, lengths, counts, t: int) -> Iterator[Chunk]:
    """Chunks that append ``counts[b]`` tokens to each row of a cache holding ``lengths[b]``.

    Each chunk is planned by :meth:`jaxkv.cache.policy.Policy.plan_chunk` (never crossing the sink
    boundary nor a KIVI flush), so every query of a chunk attends to exactly its retained set.

    Args:
      spec: the cache spec. lengths: int[B] tokens already appended. counts: int[B] to append.
      t: the static chunk length T (:func:`chunk_len`).
    Yields:
      :class:`Chunk` s until every row has appended its tokens.
    """
    lengths = np.array(lengths, np.int64)
    remaining = np.array(counts, np.int64)
    offsets = np.zeros_like(remaining)
    while np.any(remaining > 0):
        n = np.asarray(spec.policy.plan_chunk(lengths, remaining, t), np.int32)
        if not np.any(n > 0):  # plan_chunk always makes progress; guard against an infinite loop
            raise AssertionError(f"plan_chunk planned 0 tokens at lengths {lengths} for {spec.describe()}")
        yield Chunk(offsets=offsets.copy(), n=n, remaining=remaining.copy())
        lengths += n
        offsets += n
        remaining -= n


# ---- prefill -------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=(0,), donate_argnames=("cache",))
def prefill_chunk(graphdef, state, tokens, n, cache):
    """Append ``tokens: int32[B, T]`` (``n: int32[B]`` valid per row) to a donated cache.

    Returns ``(logits float32[B, 1, V] after each row's last appended token, cache)``.
    """
    return forward(graphdef, state, tokens, n, cache, last_only=True)


PREFILL_CHUNK = 512
"""Default tokens per compiled prefill call (capped by the spec's ``max_chunk``: a window of 252
prefills in calls of 252). SmolLM2-135M (fp32, 2-core AMD EPYC, a full cache, the ring read in
blocks of :data:`~jaxkv.cache.attention.RING_BLOCK`): 512 prefilled 512-token prompts 23 %
faster than 256 (two rounds) and 2,048-token prompts 2-27 % (four; each call copies every
layer's weights out of the layer scan's stacks once); 1,024 was no faster at 2,048 tokens. The
price: a call's scores and keys grow with T (SmolLM2 fp32: 33 -> 59 MiB of XLA temporaries;
docs/PERFORMANCE.md)."""


def prefill(model: LoadedModel, cache: KVCache, prompts: Sequence[Sequence[int]], *, chunk: int = PREFILL_CHUNK):
    """Stream each row's prompt into the cache, in chunks.

    An empty cache whose keep tier observes the prompt (``keep_score="snapkv"``) is filled by
    SnapKV's observation pass and replay instead (:func:`_observed_prefill`; the logits are
    full attention's); a cache holding earlier turns streams as any other (tokens that leave
    the window then carry no score).

    Args:
      model: a :class:`LoadedModel`.
      cache: an empty (or partly filled) cache with ``B = len(prompts)`` rows (consumed).
      prompts: B lists of token ids (ragged), each non-empty.
      chunk: tokens per compiled call (capped at the spec's ``max_chunk``; bucketed to a
        power of two so few shapes are compiled).
    Returns:
      ``(cache, logits float32[B, V])``: the logits after each row's last prompt token.
    Raises:
      CacheFullError: a prompt longer than a full cache's ``max_len``.
    """
    spec = cache.spec
    lengths = to_host(cache.length).astype(np.int64)
    observes = [s.policy.retention.observes_prompt for s in getattr(spec, "specs", (spec,)) if s.policy.retention]
    if any(observes) and not np.any(lengths):
        return _observed_prefill(model, cache, prompts, chunk=chunk)
    return collections.deque(prefill_steps(model, cache, prompts, chunk=chunk), maxlen=1)[0]  # the last chunk's


def prefill_steps(
    model: LoadedModel, cache: KVCache, prompts: Sequence[Sequence[int]], *, chunk: int = PREFILL_CHUNK
) -> Iterator[tuple[KVCache, jax.Array]]:
    """:func:`prefill` one compiled chunk at a time (no SnapKV observation pass), so that a
    caller can run other work between chunks (the serving engine decodes its other rows).

    Args and raises: as :func:`prefill` (the cache is consumed; the check happens before the first chunk).
    Yields:
      ``(cache, logits float32[B, V])`` after each chunk: the cache as it is now (the next chunk
      consumes it) and the logits after each row's last token appended so far (a row's final
      value once its prompt has ended). The last pair is :func:`prefill`'s result.
    """
    spec = cache.spec
    lengths = to_host(cache.length).astype(np.int64)
    counts = np.array([len(p) for p in prompts], np.int64)
    if spec.token_limit is not None and np.any(lengths + counts > spec.token_limit):
        worst = int(np.max(lengths + counts))
        raise CacheFullError(f"prompt of {worst} tokens does not fit a full cache of max_len={spec.token_limit}")
    t = chunk_len(spec, int(np.max(counts)), chunk)
    graphdef, state = nnx.split(model.model)
    last, run = None, None
    for c in plan_chunks(spec, lengths, counts, t):
        tokens, n = placed(c.take(prompts, t)), placed(c.n)
        if run is None:  # one signature for every chunk
            run, _ = _compile_prefill(model, graphdef, (state, tokens, n, cache))
        logits, cache = run(state, tokens, n, cache)
        if last is None:
            last = logits[:, 0]
        else:  # the rows whose prompt ended in this chunk
            last = jnp.where(placed((c.n > 0) & (c.remaining == c.n))[:, None], logits[:, 0], last)
        yield cache, last


def _observed_prefill(model: LoadedModel, cache: KVCache, prompts: Sequence[Sequence[int]], *, chunk: int):
    """SnapKV's prefill (Li et al. 2024, arXiv 2404.14469, §4.2-4.3) of an empty ``cache`` whose
    keep tier is ``snapkv``: each prompt is prefilled with full attention into an observer
    cache (:meth:`CacheSpec.observer`), the attention its last :data:`~jaxkv.cache.retention.OBSERVE`
    tokens give every earlier token is summed over layers, heads and those queries and max-pooled
    (:func:`~jaxkv.cache.retention.pooled`), and the prompt's keys and values are replayed into
    ``cache`` in order, each leaving the window with that score: the tier keeps the highest.
    The logits are the full-attention prefill's. Returns ``(cache, logits float32[B, V])``."""
    if not isinstance(cache, KVCache):
        raise JaxkvError(
            "keep_score=snapkv with per-layer cache specs (a model with local attention layers, or "
            "--kv-boost-layers) is not supported: use h2o, tova or recent there"
        )
    counts = np.array([len(p) for p in prompts], np.int64)
    observer = new_cache(model.config, cache.spec.observer(full_cache_len(int(np.max(counts)))), cache.batch)
    split = [max(len(p) - OBSERVE, 0) for p in prompts]
    if any(split):
        observer, _ = prefill(model, observer, [p[:s] for p, s in zip(prompts, split)], chunk=chunk)
    observer = observer.replace(keep=observer.keep.replace(ring_score=jnp.zeros_like(observer.keep.ring_score)))
    observer, logits = prefill(model, observer, [p[s:] for p, s in zip(prompts, split)], chunk=chunk)
    score = pooled(observer.keep.ring_score, observer.length)
    t = chunk_len(cache.spec, int(np.max(counts)), chunk)
    for c in plan_chunks(cache.spec, np.zeros_like(counts), counts, t):
        cache = _replay_chunk(
            cache, observer.ring_k, observer.ring_v, score, placed(c.offsets.astype(np.int32)), placed(c.n), t
        )
    return cache, logits


@functools.partial(jax.jit, static_argnums=(6,), donate_argnames=("cache",))
def _replay_chunk(cache, ring_k, ring_v, score, offsets, n, t):
    """Append slots ``offsets[b] + j`` (j < ``n[b]``) of an observer cache's keys/values
    ``[L, B, K, S, H]`` and scores ``float32[B, S]`` to ``cache`` (a SnapKV replay)."""
    idx = jnp.minimum(offsets[:, None] + jnp.arange(t, dtype=jnp.int32)[None], score.shape[1] - 1)
    take = lambda x: jnp.take_along_axis(x, idx[None, :, None, :, None], axis=3)  # noqa: E731
    cache, step = cache.begin(n, t)
    read = cache.storage.read  # bf16 held as int16 bit patterns: their values, not a cast
    return cache.commit(
        step, take(read(ring_k)), take(read(ring_v)), token_score=jnp.take_along_axis(score, idx, axis=1)
    )


def warm_prefill(model: LoadedModel, cache: KVCache, n_prompt: int, chunk: int = PREFILL_CHUNK) -> float:
    """Compile the prefill call for prompts of up to ``n_prompt`` tokens into ``cache`` (not
    consumed; nothing runs); returns the seconds it took (about 0 for a signature compiled
    before in this process)."""
    t = chunk_len(cache.spec, n_prompt, chunk)
    graphdef, state = nnx.split(model.model)
    tokens = placed(np.zeros((cache.batch, t), np.int32))
    return _compile_prefill(model, graphdef, (state, tokens, placed(np.zeros((cache.batch,), np.int32)), cache))[1]


def _compile_prefill(model, graphdef, args):
    """The compiled :func:`prefill_chunk` for ``args = (state, tokens, n, cache)`` and the
    seconds it took, kept per signature as the decode loop's are (:func:`_compile`): compiling
    ahead of the first chunk runs nothing (warming by calling the jitted function ran a whole
    chunk of the model: 0.5 s of a SmolLM2 first token)."""
    return _kept("prefill", _signature(args, graphdef), lambda: prefill_chunk.lower(graphdef, *args), _storable(model))


# ---- the decode loop -----------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoopState:
    """What the decode loop carries between steps and blocks (a pytree).

    Attributes:
      logits: float32[B, V], the logits of each row's next token (a finished row keeps those its
        last token was sampled from).
      done: bool[B]. reason: int32[B], index into :data:`FINISH_REASONS`.
      generated: int32[B], tokens sampled so far. step: int32[B], each row's sampling step
        (its PRNG stream position; a finished row's stops counting).
      limit: int32[], steps the next block takes at most (its static ``block`` caps it): a
        traced count, so that streaming blocks of any size share one compiled loop.
    """

    logits: jax.Array
    done: jax.Array
    reason: jax.Array
    generated: jax.Array
    step: jax.Array
    limit: jax.Array = dataclasses.field(default_factory=lambda: placed(np.int32(INT32_LIMIT - 1)))

    @classmethod
    def start(cls, logits, step: int = 0) -> LoopState:
        """The state before the first sampled token, from ``logits: float32[B, V]`` (every row at
        sampling step ``step``; no limit below ``block``)."""
        batch = logits.shape[0]
        return cls(
            logits=logits,
            done=placed(np.zeros((batch,), bool)),
            reason=placed(np.zeros((batch,), np.int32)),
            generated=placed(np.zeros((batch,), np.int32)),
            step=placed(np.full((batch,), step, np.int32)),
        )


def decode_steps(graphdef, state, cache, loop, max_new, sampling, rng, *, block, eos_id, host=None, host_args=()):
    """The decode loop: up to ``block`` steps (fewer: ``loop.limit``) in one ``lax.while_loop``,
    every row that is not done sampling its next token under its own rule and appending it.
    Traceable: :func:`decode_block` jits it, the serving engine's decode call runs it over the
    rows it gathers.

    Each step, a row that is not done samples (:func:`~jaxkv.decode.sampler.sample_rows`, its key
    from :func:`~jaxkv.decode.sampler.step_keys`) and ends with reason ``length`` when it has
    sampled ``max_new`` tokens, ``eos`` on ``eos_id``, ``cache_full`` when a full cache cannot
    take the token, ``stop`` when ``host`` says so; a row that goes on appends its token (the
    model step runs under a ``lax.cond``, skipped once no row appends). A finished row's last
    token is not appended: its logits stay those it was sampled from.

    Args:
      graphdef, state: the model (``nnx.split``). cache: B rows. loop: the :class:`LoopState`.
      max_new: int32[B] token budgets. sampling: the rows' rules
        (:class:`~jaxkv.decode.sampler.SamplingRows`), or None when every row is greedy (the
        loop then holds an argmax alone, no sampling code to compile). rng: a PRNG key shared
        by the rows or one per row ``[B, 2]``. block: static steps at most. eos_id: static stop
        token or None.
      host: None, or a host function called every step with ``*host_args`` and the step's
        tokens ``int32[B]`` (-1: a row that is done) through ``jax.experimental.io_callback``;
        it returns ``(stop bool[B]: rows that end now, go bool[]: whether to take another step)``.
    Returns:
      ``(cache, loop, tokens int32[B, block])`` (-1 = no token).
    """
    batch = loop.done.shape[0]
    limit = cache.spec.token_limit
    signature = (jax.ShapeDtypeStruct((batch,), jnp.bool_), jax.ShapeDtypeStruct((), jnp.bool_))

    def cond(carry):
        i, go, _, loop, _ = carry
        return (i < jnp.minimum(loop.limit, block)) & go & ~jnp.all(loop.done)

    def body(carry):
        i, go, cache, loop, out = carry
        active = ~loop.done
        if sampling is None:  # every row greedy: the loop compiles no sampling code
            token = jnp.argmax(loop.logits, axis=-1).astype(jnp.int32)
        else:
            token = sample_rows(loop.logits, sampling, step_keys(rng, loop.step))
        token = jnp.where(active, token, -1)
        out = lax.dynamic_update_slice(out, token[:, None], (jnp.int32(0), i))
        generated = loop.generated + active
        reason = jnp.where(active & (generated >= max_new), _LENGTH, loop.reason)
        if eos_id is not None:
            reason = jnp.where(active & (token == eos_id), _EOS, reason)
        if limit is not None:  # a full cache: the token cannot be fed back
            reason = jnp.where(active & (reason == _RUNNING) & (cache.length >= limit), _CACHE_FULL, reason)
        if host is not None:
            stop, go = io_callback(host, signature, *host_args, token)
            reason = jnp.where(active & stop & (reason == _RUNNING), _STOP, reason)
        done = loop.done | (reason != _RUNNING)
        feed = ~done

        def run(cache):
            logits, cache = forward(graphdef, state, jnp.maximum(token, 0)[:, None], feed.astype(jnp.int32), cache)
            return jnp.where(feed[:, None], logits[:, 0], loop.logits), cache

        logits, cache = lax.cond(jnp.any(feed), run, lambda c: (loop.logits, c), cache)
        loop = LoopState(
            logits=logits, done=done, reason=reason, generated=generated, step=loop.step + active, limit=loop.limit
        )
        return i + 1, go, cache, loop, out

    out = jnp.full((batch, block), -1, jnp.int32)
    _, _, cache, loop, out = lax.while_loop(cond, body, (jnp.int32(0), jnp.bool_(True), cache, loop, out))
    return cache, loop, out


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("block", "eos_id"), donate_argnames=("cache",))
def decode_block(graphdef, state, cache, loop, max_new, sampling, rng, *, block, eos_id):
    """:func:`decode_steps` compiled, the cache donated: returns ``(cache, loop, tokens
    int32[B, block])``. Use :func:`lower_decode` / :func:`compile_decode` rather than calling it."""
    return decode_steps(graphdef, state, cache, loop, max_new, sampling, rng, block=block, eos_id=eos_id)


def _decode_args(model, cache: KVCache, logits, sampler, max_new_tokens, seed, step):
    """The traced arguments of :func:`decode_block` after the graphdef."""
    graphdef, state = nnx.split(model.model if isinstance(model, LoadedModel) else model)
    vocab = model.config.vocab_size
    if logits is None:
        logits = placed(np.zeros((cache.batch, vocab), np.float32))
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * cache.batch
    sampling = SamplingRows.of(sampler, cache.batch, vocab)
    sampling = None if not np.any(sampling.temperature > 0) else placed(sampling)
    loop = LoopState.start(logits, step)
    max_new = placed(np.asarray(max_new_tokens, np.int32))
    return graphdef, (state, cache, loop, max_new, sampling, prng_keys(seed, cache.batch))


def lower_decode(
    model,
    cache: KVCache,
    logits=None,
    *,
    sampler: Sampler | Sequence[Sampler] = Sampler(),
    block: int = 32,
    eos_id: int | None = None,
    max_new_tokens: int | Sequence[int] = 1,
    seed=0,
    step: int = 0,
):
    """The decode loop lowered for ``cache``'s spec and shapes: a ``jax.stages.Lowered``.

    ``.as_text()`` is its StableHLO (what :mod:`jaxkv.eval.audit` scans), ``.compile()``
    compiles it (``.compile().as_text()``: the optimised HLO). Nothing is run and the cache is
    not consumed.

    Args:
      model: a :class:`LoadedModel` or a Flax NNX model with a ``config`` (the tiny test models).
      cache: a cache of B rows (its values do not matter). logits: float32[B, V] (None = zeros).
      block, eos_id: the loop's static settings; sampler, max_new_tokens, seed, step: as in
        :func:`decode` (traced: every sampler shares one program).
    """
    graphdef, args = _decode_args(model, cache, logits, sampler, max_new_tokens, seed, step)
    return decode_block.lower(graphdef, *args, block=block, eos_id=eos_id)


def compile_decode(
    model,
    cache: KVCache,
    logits=None,
    *,
    sampler: Sampler | Sequence[Sampler] = Sampler(),
    block: int = 32,
    eos_id: int | None = None,
    max_new_tokens: int | Sequence[int] = 1,
    seed=0,
    step: int = 0,
):
    """``(compiled, seconds)``: the decode loop compiled for these arguments' shapes, dtypes and
    shardings and the static ``block`` and ``eos_id`` (see :func:`lower_decode`).

    The executable is kept (the last few signatures): a second call with the same signature
    neither traces, lowers nor compiles (:func:`compile_counts` shows it), so ``seconds`` is
    then near 0 and a warm :func:`decode` starts its first block at once.
    ``compiled(state, cache, loop, max_new, sampling, rng)`` runs one block.
    """
    graphdef, args = _decode_args(model, cache, logits, sampler, max_new_tokens, seed, step)
    return _compile(model, graphdef, args, block, eos_id)


_EXECUTABLES: dict = {}
_EXECUTABLES_KEPT = 16  # decode loops and prefill chunks
EXECUTABLE_STORE: str | None = None
"""Folder where compiled decode loops and prefill chunks of jaxkv's model families are kept
across processes (None: not kept). :func:`jaxkv.cli.use_compile_cache` sets it beside JAX's
persistent compilation cache, which still traces and lowers a program to find it (~1 s of a
SmolLM2 first token); a stored executable is found by its signature alone. Executables are
pickles: keep the folder as private as JAX's cache."""


def _compile(model, graphdef, args, block, eos_id):
    """The compiled decode loop and the seconds it took; kept per signature (``lower`` alone
    re-traces the whole model, ~0.3 s for SmolLM2, on every call)."""
    return _kept(
        "decode",
        _signature(args, graphdef, block, eos_id),
        lambda: decode_block.lower(graphdef, *args, block=block, eos_id=eos_id),
        _storable(model),
    )


def _kept(program: str, signature: tuple, lower, stored: bool):
    """``(compiled, seconds)``: the executable of ``program`` for ``signature``, compiled from
    ``lower()`` unless kept from an earlier call; kept as the most recently used (the last
    :data:`_EXECUTABLES_KEPT`, decode loops and prefill chunks together) and, if ``stored``,
    in :data:`EXECUTABLE_STORE` (read back there before compiling). Only an executable this
    process compiled is stored: one JAX's persistent cache loaded serialises without its
    compiled code (jax 0.10.2 CPU: "Function ... not found" in the process that loads it)."""
    t0 = time.perf_counter()
    key = (program, *signature)
    compiled = _EXECUTABLES.pop(key, None)
    path = _stored_path(key) if compiled is None and stored and EXECUTABLE_STORE else None
    if path:
        compiled = _load_executable(path)
    if compiled is None:
        before = _COMPILES[program], _CACHE_LOADS[program]
        with count_compiles(program):
            compiled = lower().compile()
        if path and _COMPILES[program] > before[0] and _CACHE_LOADS[program] == before[1]:  # compiled here
            _store_executable(path, compiled)
    _EXECUTABLES[key] = compiled
    while len(_EXECUTABLES) > _EXECUTABLES_KEPT:
        _EXECUTABLES.pop(next(iter(_EXECUTABLES)))
    return compiled, time.perf_counter() - t0


def _storable(model) -> bool:
    """Whether ``model``'s programs may be stored: a model of a jaxkv family, whose code the
    stored executables' key covers (:func:`_code_digest`); not a user's own Flax module."""
    return isinstance(model, LoadedModel) and type(model.model).__module__.startswith("jaxkv.")


def _stored_path(key: tuple) -> str:
    """The file of ``key``'s executable in :data:`EXECUTABLE_STORE`: named by a SHA-256 of the
    key's text (static arguments, pytree structures, shapes, dtypes, shardings) and of
    everything else the compiled program depends on (:func:`_code_digest`)."""
    digest = hashlib.sha256(f"{key!r}\n{_code_digest()}".encode()).hexdigest()
    return os.path.join(EXECUTABLE_STORE, f"{key[0]}-{digest[:40]}.pkl")


@functools.cache
def _code_digest() -> str:
    """This process's code and settings a compiled program depends on: jaxkv's source (the ggml
    shim's included), the jax, jaxlib and flax versions, the backend and its devices,
    ``XLA_FLAGS`` and every ``jax.config`` value."""
    import flax
    import jaxlib

    h = hashlib.sha256()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(f for f in files if f.endswith((".py", ".cc"))):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(os.path.relpath(f.name, root).encode() + f.read())
    backend = jax.devices()[0].client
    h.update(
        repr(
            (
                jax.__version__,
                jaxlib.__version__,
                flax.__version__,
                backend.platform,
                backend.platform_version,
                [(d.id, d.device_kind) for d in jax.devices()],
                os.environ.get("XLA_FLAGS"),
                sorted((k, repr(v)) for k, v in jax.config.values.items()),
            )
        ).encode()
    )
    return h.hexdigest()


def _load_executable(path: str):
    """The executable stored at ``path``, or None: none there, or one this jax cannot load
    (damaged: warned about and removed, so that the next compile of it stores it again)."""
    from jax.experimental import serialize_executable

    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError:  # none there (a folder that cannot be read or written: storing says so)
        return None
    if ggml.TARGET.encode() in blob:  # its custom call is registered when a trace first needs it: now
        ggml.available()
    try:
        return serialize_executable.deserialize_and_load(*pickle.loads(blob))
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file: compile instead, and drop it
        warnings.warn(f"jaxkv: compiling instead of loading {path} ({type(e).__name__}: {e}); removed", stacklevel=3)
        with contextlib.suppress(OSError):
            os.remove(path)
        return None


def _store_executable(path: str, compiled) -> None:
    """Write ``compiled`` to ``path`` (atomically). A backend that cannot serialise its
    executables (jax.experimental.serialize_executable raises) stores nothing; a folder that
    cannot be written is warned about (decoding goes on)."""
    from jax.experimental import serialize_executable

    try:
        blob = pickle.dumps(serialize_executable.serialize(compiled))
    except (ValueError, NotImplementedError, TypeError, pickle.PicklingError):
        return
    written = None
    try:
        os.makedirs(EXECUTABLE_STORE, exist_ok=True)
        with tempfile.NamedTemporaryFile("wb", dir=EXECUTABLE_STORE, suffix=".tmp", delete=False) as f:
            written = f.name
            f.write(blob)
        os.replace(written, path)
    except OSError as e:  # a read-only or full disk: the next process compiles again
        warnings.warn(f"jaxkv: compiled program not stored in {EXECUTABLE_STORE} ({e})", stacklevel=3)
        if written:
            with contextlib.suppress(OSError):
                os.remove(written)


@dataclasses.dataclass(frozen=True)
class BatchGeneration:
    """What :func:`generate` returns, one entry per row.

    Attributes:
      token_ids: B lists of generated ids (a stopping EOS included).
      finish_reasons: B of ``eos``, ``length``, ``cache_full`` (or a reason :func:`decode`'s
        ``on_block`` gave: ``stop``, ``interrupted``).
      cache: the final :class:`KVCache` (B rows).
      prefill_s, decode_s, compile_s: wall seconds of prefill, decode (compile excluded) and compiling.
      logits: float32[B, V], the logits the first generated token of each row was drawn from
        (None from :func:`decode`, which did not compute them).
    """

    token_ids: list
    finish_reasons: list
    cache: KVCache
    prefill_s: float
    decode_s: float
    compile_s: float
    logits: jax.Array | None = None


def decode(
    model: LoadedModel,
    cache: KVCache,
    logits,
    *,
    max_new_tokens: Sequence[int],
    sampler: Sampler | Sequence[Sampler] = Sampler(),
    seed: int | Sequence[int] = 0,
    step: int = 0,
    block: int = 32,
    eos_id: int | None = None,
    on_block: Callable[[np.ndarray], bool | str | None] | None = None,
    stream_s: float | None = None,
) -> BatchGeneration:
    """Sample from a prefilled cache until every row stops (EOS, its token budget, or a full cache).

    Args:
      model: a :class:`LoadedModel`. cache: the prefilled :class:`KVCache` (B rows; consumed).
      logits: float32[B, V], the logits after each row's last appended token (from :func:`prefill`).
      max_new_tokens: B token budgets (>= 1).
      sampler: the next-token rule, or B rules (one per row; traced, so any mix shares one
        compiled loop; rows all greedy run a loop without sampling code).
      seed: PRNG seed (the rows draw from its split), or B seeds (one per row: a row draws what
        it would draw alone with its seed).
      step: the position in the PRNG stream (continue a conversation with the previous call's
        ``step + tokens sampled``).
      block: decode steps per compiled call. eos_id: stop token (None = never stop on a token).
      on_block: called with each block's tokens, int32[B, block] (-1 = no token). A true
        return value ends decoding there: the rows still running finish with that reason (a
        string, e.g. ``interrupted``; True means ``stop``, for a stop string).
      stream_s: None: every block decodes ``block`` steps. Seconds: stream the tokens, as text
        is printed: the first block decodes one step (the first token reaches ``on_block``
        one decode step after prefill), each later one as many as the blocks so far took per
        step fit in ``stream_s`` seconds (1 to ``block``; the same compiled loop, its step
        count traced: :attr:`LoopState.limit`). :data:`STREAM_S` is ten blocks a second.
    Returns:
      a :class:`BatchGeneration` (``prefill_s`` 0). The last sampled token of each row is
      *not* in the cache: feed it first when continuing.
    """
    graphdef, args = _decode_args(model, cache, logits, sampler, max_new_tokens, seed, step)
    compiled, compile_s = _compile(model, graphdef, args, block, eos_id)
    state, cache, loop, max_new, sampling, rng = args
    ids: list[list[int]] = [[] for _ in range(cache.batch)]
    decode_s, stopped, steps = 0.0, None, 0
    while True:
        if stream_s is not None:  # steps so far at their mean seconds per step: how many fit in stream_s
            limit = 1 if steps == 0 else min(block, max(1, int(stream_s * steps / max(decode_s, 1e-9))))
            loop = dataclasses.replace(loop, limit=placed(np.int32(limit)))
        t1 = time.perf_counter()
        cache, loop, out = compiled(state, cache, loop, max_new, sampling, rng)
        out = to_host(out)
        decode_s += time.perf_counter() - t1
        steps += int(np.max(np.sum(out >= 0, axis=1)))
        for row, toks in zip(ids, out):
            row.extend(int(i) for i in toks if i >= 0)
        if on_block is not None and (stopped := on_block(out)):
            stopped = "stop" if stopped is True else stopped
            break
        if bool(np.all(to_host(loop.done))):
            break
    reasons = [
        FINISH_REASONS[int(r)] if done or not stopped else stopped
        for r, done in zip(to_host(loop.reason), to_host(loop.done))
    ]
    return BatchGeneration(
        token_ids=ids, finish_reasons=reasons, cache=cache, prefill_s=0.0, decode_s=decode_s, compile_s=compile_s
    )


def prefill_and_decode(
    model: LoadedModel,
    cache: KVCache,
    prompts: Sequence[Sequence[int]],
    *,
    warm: bool = False,
    **kwargs,
) -> BatchGeneration:
    """:func:`prefill` the prompts into ``cache`` (timed), then :func:`decode` (``kwargs``).

    Args:
      cache: B rows, empty or holding earlier turns (consumed).
      prompts: B non-empty lists of token ids, appended after what each row holds.
      warm: compile the prefill first (:func:`warm_prefill`), so that ``prefill_s`` excludes
        compiling and ``compile_s`` includes it.
    Returns:
      a :class:`BatchGeneration` with ``prefill_s`` and ``logits`` set.
    Raises:
      CacheFullError: a prompt that does not fit a full cache.
    """
    compile_s = warm_prefill(model, cache, max(len(p) for p in prompts)) if warm else 0.0
    t0 = time.perf_counter()
    cache, logits = prefill(model, cache, prompts)
    logits.block_until_ready()
    prefill_s = time.perf_counter() - t0
    result = decode(model, cache, logits, **kwargs)
    return dataclasses.replace(result, prefill_s=prefill_s, compile_s=result.compile_s + compile_s, logits=logits)
