"""Teacher-forced perplexity through the KV cache, and the sliding-window recomputation oracle.

:func:`token_nll` streams a text through a :class:`~jaxkv.cache.spec.CacheSpec` cache in
planned chunks (``Policy.plan_chunk``: a chunk never crosses the sink boundary nor a KIVI
flush), so every token's negative log-likelihood is computed with exactly what the cache
holds at that moment: the same numbers as feeding the text one token at a time (DESIGN
§2), at the speed of chunked prefill. This is what the prior Swift implementation could
not measure (it scored KIVI only by greedy prefix match).

:func:`recompute_nll` is the StreamingLLM paper's "sliding window with re-computation"
baseline (Xiao et al. 2023, arXiv 2309.17453, Fig. 1(c), §4.1): for every token, the last
``window`` tokens are re-encoded from scratch, so no state is ever evicted or stale. It is
the quality oracle a bounded cache of the same size is compared against (Fig. 3), at
O(N * W) token evaluations instead of O(N).

Conventions: ``nll`` is ``float64[N - 1]`` in nats; ``nll[i]`` is the NLL of
``tokens[i + 1]`` given the logits of the query at position ``i`` (the position whose
retained set conditions the prediction). Position ranges in :func:`perplexity_by_range`
are ranges of ``i``.
"""

from __future__ import annotations

import functools
import io
import math
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.decode import check_token_ids, chunk_len, count_compiles, new_cache, plan_chunks
from jaxkv.decode.loop import placed
from jaxkv.errors import CacheFullError, JaxkvError, check_int
from jaxkv.files import atomic_write
from jaxkv.io import LoadedModel
from jaxkv.models.step import forward

DEFAULT_EDGES = (0, 512, 1024, 2048, 4096, 8192)


def _target_nll(logits, targets, n):
    """float32[B, T]: ``-log softmax(logits)[target]`` for the first ``n[b]`` queries of each row, 0 beyond.

    ``logits: float32[B, T, V]``, ``targets: int32[B, T]``, ``n: int32[B]``. Runs inside
    the jitted step, so only ``[B, T]`` floats reach the host.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    valid = jnp.arange(targets.shape[1], dtype=jnp.int32)[None, :] < n[:, None]
    return jnp.where(valid, -picked, 0.0)


@functools.partial(jax.jit, static_argnums=(0,), donate_argnames=("cache",))
def nll_chunk(graphdef, state, tokens, targets, n, cache):
    """One streamed chunk: append ``tokens[B, T]`` (``n[b]`` valid) and score ``targets[B, T]``.

    Returns ``(nll float32[B, T], cache)``; the cache is donated (updated in place).
    """
    logits, cache = forward(graphdef, state, tokens, n, cache)
    return _target_nll(logits, targets, n), cache


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("config",))
def _recompute_batch(graphdef, state, tokens, n, targets, *, config):
    """Score B independent contexts from scratch: ``tokens[B, T]`` (``n[b]`` valid) -> nll float32[B].

    Each row gets a fresh full cache of T slots, so its context sits at positions
    ``0..n[b]-1``; the NLL is that of ``targets[b]`` after the row's last context token.
    ``config``: the model's (hashable) config.
    """
    b, t = tokens.shape
    cache = new_cache(config, CacheSpec(max_len=t), b)
    logits, _ = forward(graphdef, state, tokens, n, cache, last_only=True)  # [B, 1, V]
    return _target_nll(logits, targets[:, None], jnp.minimum(n, 1))[:, 0]


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("config", "kv_hook"))
def _causal_batch(graphdef, state, tokens, *, config, kv_hook):
    """One causal pass over ``tokens[B, T]`` with a fresh full cache of T slots -> nll float32[B, T - 1]."""
    b, t = tokens.shape
    cache = new_cache(config, CacheSpec(max_len=t), b)
    logits, _ = forward(graphdef, state, tokens, jnp.full((b,), t, jnp.int32), cache, kv_hook=kv_hook)
    return _target_nll(logits[:, :-1], tokens[:, 1:], jnp.full((b,), t - 1, jnp.int32))


def _as_ids(model: LoadedModel, tokens: Sequence[int], what: str) -> np.ndarray:
    """int32[N] ids, checked: at least two tokens, every id inside the vocabulary."""
    ids = np.asarray(tokens)
    if ids.ndim != 1:
        raise JaxkvError(f"{what}: expected a flat sequence of token ids, got an array of shape {ids.shape}")
    if len(ids) < 2:
        raise JaxkvError(
            f"{what}: the text has {len(ids)} token{'s' if len(ids) != 1 else ''}; perplexity needs at least 2 "
            "(one to condition on, one to score)"
        )
    if not np.issubdtype(ids.dtype, np.integer):
        raise JaxkvError(f"{what}: token ids must be integers, got dtype {ids.dtype}")
    check_token_ids(ids, model.config.vocab_size, f"{what}: token id")
    return ids.astype(np.int32)


def _bar(progress: bool, total: int, desc: str):
    return tqdm(
        total=total, desc=desc, unit="tok", disable=not progress, file=sys.stderr, dynamic_ncols=True, leave=False
    )


def token_nll(
    model: LoadedModel,
    tokens: Sequence[int],
    *,
    cache: CacheSpec | LayerSpecs | None = None,
    chunk: int = 128,
    progress: bool = False,
    start: int = 0,
) -> np.ndarray:
    """Teacher-forced negative log-likelihood of every token after the first, through a KV cache.

    The text is one stream (batch of one row) appended to a fresh cache in chunks planned
    by :meth:`jaxkv.cache.policy.Policy.plan_chunk`, so each query attends to exactly its retained
    set (sinks, window, KIVI residual and quantised groups) as token-by-token decoding
    would: a StreamingLLM or KIVI cache is evaluated as it would be used, not simulated.
    Every chunk is padded to one static length T, so the step compiles once per
    (model, spec, T); the log-softmax and the gather of the target run inside the jitted
    step, so only ``float32[1, T]`` comes back to the host per chunk.

    Args:
      model: a :class:`~jaxkv.io.LoadedModel` (only ``model.model`` and ``model.config`` are used).
      tokens: N int token ids, N >= 2 (usually starting with BOS).
      cache: the cache to evaluate (or :class:`~jaxkv.LayerSpecs`, one per layer); None = a full
        fp32 cache of ``max_len = N`` slots.
      chunk: tokens per compiled call (capped at ``cache.max_chunk``, rounded to a power of
        two when the text is shorter); it changes speed, not results (beyond float32
        summation order, ~1e-6 nats).
      progress: show a tqdm progress bar on stderr.
      start: the absolute position of the first token (a stream that began ``start`` tokens
        earlier, see :meth:`~jaxkv.cache.kv.KVCache.starting_at`); needs a StreamingLLM cache.
    Returns:
      ``float64[N - 1]``, nats: ``nll[i] = -log p(tokens[i+1] | what the cache holds after
      tokens[i] is appended)``, the model's logits computed in float32.
    Raises:
      JaxkvError: fewer than 2 tokens (the message gives the count), ids outside the
      vocabulary, a bad ``chunk`` or ``start``; CacheFullError: a full cache with ``max_len < N - 1``.

    Source: StreamingLLM (Xiao et al. 2023, arXiv 2309.17453) §4.1 and Fig. 3 evaluate
    language modelling on long texts exactly this way (per-token NLL while streaming).
    """
    ids = _as_ids(model, tokens, "token_nll")
    chunk = check_int("chunk", chunk, 1)
    n_in = len(ids) - 1  # the last token is only a target
    spec = cache if cache is not None else CacheSpec(max_len=len(ids))
    if spec.token_limit is not None and n_in > spec.token_limit:
        raise CacheFullError(
            f"token_nll: {len(ids)} tokens need {n_in} cache slots, but the full cache has max_len={spec.token_limit}"
        )
    kv = new_cache(model.config, spec, 1)
    if start:
        kv = kv.starting_at(start)
    spec = kv.spec  # per-layer when the model has local layers
    t = chunk_len(spec, n_in, chunk)
    graphdef, state = nnx.split(model.model)
    out = np.empty(n_in, np.float64)

    with _bar(progress, n_in, "ppl") as bar:

        def collect(pending):
            i, n, nll = pending
            out[i : i + n] = np.asarray(nll)[0, :n]  # sliced on the host: no eager XLA program per shape
            bar.update(n)

        pending = None
        for c in plan_chunks(spec, [start], [n_in], t):
            tokens, targets = c.take([ids], t), c.take([ids], t, shift=1)
            with count_compiles("nll"):
                nll, kv = nll_chunk(graphdef, state, placed(tokens), placed(targets), placed(c.n), kv)
            if pending is not None:  # read the previous chunk while this one runs
                collect(pending)
            pending = (int(c.offsets[0]), int(c.n[0]), nll)
        collect(pending)
    return out


def recompute_contexts(n_tokens: int, window: int, sink: int = 0):
    """Host-side plan of :func:`recompute_nll`: which positions each prediction re-encodes.

    For the target ``j = i + 1`` (``i = 0..N-2``) the context is the first ``min(sink, j)``
    positions and then ``[max(sink, j - window), j)``, re-encoded at positions ``0, 1, ...``.

    Returns:
      ``(index int32[N-1, T], length int32[N-1])`` with ``T = min(sink + window, N - 1)``;
      entries of ``index`` beyond ``length`` are 0 (padding).
    """
    j = np.arange(1, n_tokens, dtype=np.int64)[:, None]
    t = min(sink + window, n_tokens - 1)
    a = np.arange(t, dtype=np.int64)[None, :]
    s = np.minimum(sink, j)
    start = np.maximum(sink, j - window)
    length = s + np.maximum(j - start, 0)
    index = np.where(a < s, a, start + (a - s))
    index = np.where(a < length, index, 0)
    return index.astype(np.int32), length[:, 0].astype(np.int32)


def recompute_nll(
    model: LoadedModel,
    tokens: Sequence[int],
    *,
    window: int,
    sink: int = 0,
    batch: int = 32,
    positions: Sequence[int] | None = None,
    progress: bool = False,
) -> np.ndarray:
    """Sliding window with re-computation: each token scored from its last ``window`` tokens, re-encoded.

    The StreamingLLM paper's oracle baseline (Fig. 1(c), Fig. 3): to predict ``tokens[j]``
    the model encodes ``tokens[max(0, j - window) : j]`` from scratch at positions
    ``0..window-1`` (fewer at the start) and takes the logits of the last one. Nothing is
    ever evicted from a KV state, so it shows how well a model does with ``window`` tokens
    of context, within its trained positions. With ``sink = S0 > 0`` the first ``S0`` tokens
    are kept in front of the window (re-encoded at positions ``0..S0-1``, the window after
    them); ``sink = 0`` is the paper's baseline.

    Cost: O(N * W) token evaluations (O(N * W^2) attention), against O(N) for
    :func:`token_nll`; ``batch`` windows run per compiled call, each with a fresh full
    cache of ``T = min(S0 + W, N - 1)`` slots (one compile per T and batch).

    Args:
      model: a :class:`~jaxkv.io.LoadedModel`.
      tokens: N >= 2 token ids.
      window: W >= 1, context tokens re-encoded per prediction (after the sinks).
      sink: S0 >= 0, first tokens always in the context.
      batch: windows per compiled call (memory grows with batch * T^2 * heads).
      positions: score only these query positions ``i`` (the NLL of ``tokens[i + 1]``),
        e.g. a uniform sample of a long text; None = every ``i`` in ``0..N-2``.
      progress: tqdm progress bar on stderr.
    Returns:
      ``float64[N - 1]`` nats (``float64[len(positions)]`` with ``positions``), same
      convention as :func:`token_nll`; equal to the full cache's NLL (to float32 rounding)
      when ``sink + window >= N - 1``.
    Raises:
      JaxkvError: fewer than 2 tokens (count given), ids outside the vocabulary, bad sizes,
      a position outside ``[0, N - 2]`` (named).
    """
    ids = _as_ids(model, tokens, "recompute_nll")
    window = check_int("window", window, 1)
    sink = check_int("sink", sink, 0)
    batch = check_int("batch", batch, 1)
    index, length = recompute_contexts(len(ids), window, sink)
    if positions is None:
        sel = np.arange(len(length))
    else:
        sel = np.asarray(positions, np.int64).reshape(-1)
        bad = (sel < 0) | (sel >= len(length))
        if bad.any():
            raise JaxkvError(
                f"recompute_nll: position {int(sel[bad][0])} is outside [0, {len(length) - 1}] "
                f"(query positions of {len(ids)} tokens)"
            )
    rows = len(sel)
    b = max(1, min(batch, rows))
    graphdef, state = nnx.split(model.model)
    out = np.empty(rows, np.float64)
    with _bar(progress, rows, "recompute") as bar:
        for r0 in range(0, rows, b):
            r1 = min(r0 + b, rows)
            tok = np.zeros((b, index.shape[1]), np.int32)
            n = np.zeros((b,), np.int32)
            tgt = np.zeros((b,), np.int32)
            tok[: r1 - r0] = ids[index[sel[r0:r1]]]
            n[: r1 - r0] = length[sel[r0:r1]]
            tgt[: r1 - r0] = ids[sel[r0:r1] + 1]
            nll = _recompute_batch(
                graphdef, state, jnp.asarray(tok), jnp.asarray(n), jnp.asarray(tgt), config=model.config
            )
            out[r0:r1] = np.asarray(nll, np.float64)[: r1 - r0]
            bar.update(r1 - r0)
    return out


def teacher_forced_nll(model: LoadedModel, rows, *, kv_hook=None) -> np.ndarray:
    """NLL of every token after the first of each row, in one causal pass through a full fp32 cache.

    Each row is its own text at positions ``0..T-1`` (a fresh full cache of T slots; no
    chunking, no eviction), scored in one compiled call per (model, B, T, kv_hook): what
    :func:`token_nll` gives with its default cache, for a batch of equal-length rows, and
    the place to try a change of the keys and values the cache would store (``kv_hook``,
    e.g. :class:`jaxkv.eval.FakeQuantKV`) without a cache layout for it.

    Args:
      model: a :class:`~jaxkv.models.LoadedModel`.
      rows: int token ids ``[B, T]`` (or one row ``[T]``), T >= 2, inside the vocabulary.
      kv_hook: None, or a static (hashable) callable ``(k, v) -> (k, v)`` applied to every
        layer's keys (before RoPE) and values ``float32[B, T, K, H]`` before attention (see
        :func:`jaxkv.forward`).
    Returns:
      ``float64[B, T - 1]`` nats (``[T - 1]`` for one row): ``nll[b, i] = -log p(rows[b, i + 1]
      | rows[b, :i + 1])``.
    Raises:
      JaxkvError: rows not of rank 1 or 2, fewer than 2 tokens per row, ids outside the vocabulary.
    """
    ids = np.asarray(rows)
    if ids.ndim not in (1, 2):
        raise JaxkvError(f"teacher_forced_nll: expected token ids [B, T] or [T], got an array of shape {ids.shape}")
    batch = np.stack([_as_ids(model, r, "teacher_forced_nll") for r in np.atleast_2d(ids)])
    graphdef, state = nnx.split(model.model)
    nll = _causal_batch(graphdef, state, jnp.asarray(batch), config=model.config, kv_hook=kv_hook)
    out = np.asarray(nll, np.float64)
    return out if ids.ndim == 2 else out[0]


def paired_ratio(nll_a, nll_b, positions) -> dict:
    """Perplexity ratio of two runs on the same tokens, paired: ``exp(mean(a - b))`` over ``positions``.

    Args:
      nll_a, nll_b: per-token NLL in nats indexed by query position (e.g. :func:`token_nll`
        of two caches, or a cache against :func:`recompute_nll` at sampled ``positions``;
        entries elsewhere are never read).
      positions: int indices into both arrays.
    Returns:
      ``{"ratio": float, "lo": float, "hi": float, "n": int}``: the ratio and its 95 %
      interval ``exp(mean +- 1.96 * SE)`` from the paired standard error of the per-token
      differences (``lo = hi = nan`` for a single position).
    Raises:
      JaxkvError: no positions.
    """
    d = np.asarray(nll_a)[positions] - np.asarray(nll_b)[positions]
    if len(d) == 0:
        raise JaxkvError("paired_ratio: no positions to compare")
    se = float(np.std(d, ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    m = float(np.mean(d))
    return dict(ratio=math.exp(m), lo=math.exp(m - 1.96 * se), hi=math.exp(m + 1.96 * se), n=int(len(d)))


def perplexity(nll) -> float:
    """``exp(mean(nll))``: perplexity from per-token NLL in nats.

    Raises:
      JaxkvError: an empty array.
    """
    nll = np.asarray(nll, np.float64)
    if nll.size == 0:
        raise JaxkvError("perplexity: no token NLLs to average (empty array)")
    return float(math.exp(float(np.mean(nll))))


def perplexity_by_range(nll, edges: Sequence[int] | None = None) -> list[tuple[int, int, float, int]]:
    """Perplexity per position range, e.g. ``[0, 512), [512, 1024), [1024, 2048), ...``.

    Args:
      nll: ``float[N-1]`` from :func:`token_nll`; index ``i`` is the query position.
      edges: increasing range bounds; None = ``0, 512, 1024, 2048, ...`` doubling until
        the last covers ``len(nll)``. Entries outside ``[edges[0], edges[-1])`` are not counted.
    Returns:
      ``[(lo, hi, ppl, count), ...]`` for each non-empty range, ``count = min(hi, len) - lo``
      tokens, ``ppl = exp(mean(nll[lo:hi]))``.
    Raises:
      JaxkvError: edges not strictly increasing non-negative integers.
    """
    nll = np.asarray(nll, np.float64)
    if edges is None:
        edges = list(DEFAULT_EDGES)
        while edges[-1] < len(nll):
            edges.append(edges[-1] * 2)
    edges = [int(e) for e in edges]
    if len(edges) < 2 or edges[0] < 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise JaxkvError(f"perplexity_by_range: edges={edges}: expected at least two strictly increasing integers >= 0")
    out = []
    for lo, hi in zip(edges, edges[1:]):
        part = nll[lo:hi]
        if part.size:
            out.append((lo, hi, perplexity(part), int(part.size)))
    return out


def write_nll(path, nll) -> None:
    """Write per-token NLL (nats) to ``path``, atomically: NumPy ``.npy`` if the name ends in
    ``.npy``, else one number per line (``%.9g``).

    Raises:
      OSError: the file cannot be written (nothing is left behind).
    """
    buf = io.BytesIO()
    if str(path).endswith(".npy"):
        np.save(buf, np.asarray(nll))
    else:
        np.savetxt(buf, np.asarray(nll), fmt="%.9g")
    atomic_write(path, buf.getvalue(), private=False)
