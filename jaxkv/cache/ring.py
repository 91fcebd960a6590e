"""Ring-buffer arithmetic: which positions a query sees, their RoPE ranks, exact slot writes.

Everything here is int32 (DESIGN §1: unsigned index dtypes crash jax-metal) and works on
per-row arrays, so rows of one batch wrap at different steps.

Retained set (DESIGN §2). After token ``q`` is appended, it attends to the sinks
``{p < S0}`` and the contiguous run ``[window_start(q), q]``:

* full cache: ``window_start = 0``;
* StreamingLLM, float storage: ``window_start = max(S0, q - W + 1)``;
* StreamingLLM + KIVI: the last ``W`` flushed tokens plus the residual. The residual is
  flushed lazily, when it is full and a new token arrives, so after token ``q`` the
  flushed count is ``F(q) = R * floor((q - S0) / R)`` and ``window_start = S0 + max(0, F(q) - W)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.cache.spec import CacheSpec


def window_start(spec: CacheSpec, q):
    """First non-sink position query ``q`` attends to (int32, same shape as ``q``)."""
    s0 = spec.sink
    if not spec.bounded:
        return jnp.zeros_like(q)
    if spec.quantized:
        flushed = spec.residual * (jnp.maximum(q - s0, 0) // spec.residual)
        return s0 + jnp.maximum(flushed - spec.window, 0)
    return jnp.maximum(s0, q - spec.window + 1)


def visible(spec: CacheSpec, q, p):
    """bool mask: query at position ``q`` attends to key at position ``p`` (``-1`` = empty/padding).

    ``q`` and ``p`` broadcast against each other, e.g. ``q[B, T, 1]`` with ``p[B, 1, S]``.
    """
    return (q >= 0) & (p >= 0) & (p <= q) & ((p < spec.sink) | (p >= window_start(spec, q)))


def rank(spec: CacheSpec, q):
    """Rank of query ``q`` in its own retained set (StreamingLLM §3.2 position in the cache).

    Sinks are ranks ``0..S0-1``, then the window oldest first, so ``rank(q) = q`` for
    ``q < S0`` and ``S0 + q - window_start(q)`` otherwise.
    """
    return jnp.where(q < spec.sink, q, spec.sink + q - window_start(spec, q))


def write_ring(buf, new, start, n, *, batch_axis: int, slot_axis: int, batch_parallel: bool = False):
    """Write each row's first ``n[b]`` chunk entries into a ring at slots ``start[b], start[b]+1, ...`` (mod ring).

    Args:
      buf: the ring, e.g. ``k: [L, B, K, R, H]`` (batch_axis=1, slot_axis=3) or ``pos: int32[B, R]``
        (batch_axis=0, slot_axis=1).
      new: same layout as ``buf`` with ``T`` entries on ``slot_axis``; entries ``>= n[b]`` are ignored.
      start: int32[B], ring slot of each row's first entry, in ``[0, R)``.
      n: int32[B], entries to write per row, ``0 <= n[b] <= min(T, R)``.

    Returns:
      the updated ring. Each row is written with at most two ``lax.dynamic_update_slice``
      calls at exact in-range slots: the part up to the ring end, and the part that wraps
      to slot 0 (skipped statically when ``T == 1``). Slots not written keep their contents.
      No scatter, no reliance on index clamping.

    ``batch_parallel=False`` (default) writes the rows one after another in a
    ``lax.fori_loop``: no scatter (jax-metal safe), but a loop over a *sharded* batch axis
    makes the SPMD partitioner all-gather the whole buffer. ``batch_parallel=True`` applies
    the same row update under ``jax.vmap``, which lowers to a gather/scatter with batching
    dimensions that every device runs on its own rows (no communication); use it when the
    batch axis is sharded (:mod:`jaxkv.parallel`).
    """
    ring, chunk = buf.shape[slot_axis], new.shape[slot_axis]
    block = min(ring, chunk)
    pad_cfg = [(0, 0)] * new.ndim
    pad_cfg[slot_axis] = (block, block)
    padded = jnp.pad(new.astype(buf.dtype), pad_cfg)  # zeros around the chunk: shifted reads stay in range
    mask_shape = [1] * buf.ndim
    mask_shape[slot_axis] = block
    j = lax.broadcasted_iota(jnp.int32, mask_shape, slot_axis)

    def row_update(buf, b, o, m, row_new):  # row_new: the padded chunk of row b, batch axis of size 1

        def put(buf, slot0, src0, valid):
            # block slot slot0 + j <- chunk entry src0 + j where valid, else keep the slot
            idx = [jnp.int32(0)] * buf.ndim
            idx[batch_axis], idx[slot_axis] = b, slot0
            sizes = list(buf.shape)
            sizes[batch_axis], sizes[slot_axis] = 1, block
            old = lax.dynamic_slice(buf, idx, sizes)
            src = lax.dynamic_slice_in_dim(row_new, src0 + block, block, slot_axis)
            return lax.dynamic_update_slice(buf, jnp.where(valid, src, old), idx)

        # part 1: slots [o, min(o + m, R)); the block starts at a = min(o, R - block) <= o
        a = jnp.minimum(o, ring - block)
        d = o - a
        buf = put(buf, a, -d, (j >= d) & (j < d + jnp.minimum(m, ring - o)))
        if chunk > 1:
            # part 2: entries [R - o, m) wrap to slots [0, m - R + o)
            e = ring - o
            buf = put(buf, jnp.int32(0), jnp.minimum(e, block), j < m - e)
        return buf

    if batch_parallel:
        def one_row(buf_row, new_row, o, m):  # the batch axis removed by vmap; restored as size 1
            grow = lambda x: jnp.expand_dims(x, batch_axis)  # noqa: E731
            return jnp.squeeze(row_update(grow(buf_row), jnp.int32(0), o, m, grow(new_row)), batch_axis)

        return jax.vmap(one_row, in_axes=(batch_axis, batch_axis, 0, 0), out_axes=batch_axis)(buf, padded, start, n)
    return lax.fori_loop(
        0, start.shape[0],
        lambda b, buf: row_update(buf, b, start[b], n[b], lax.dynamic_slice_in_dim(padded, b, 1, batch_axis)),
        buf,
    )


def plan_chunk(spec: CacheSpec, length: np.ndarray, remaining: np.ndarray, chunk: int) -> np.ndarray:
    """Host-side: how many tokens each row appends in the next prefill call.

    A chunk never crosses the sink/window boundary, never holds more window tokens than
    the ring, and under KIVI never crosses a residual flush, so every query of the chunk
    sees the same quantised groups it would see token by token (DESIGN §2).

    Args:
      length: int[B], tokens already in each row. remaining: int[B], tokens left to append.
      chunk: T, the static chunk length of the compiled call (``<= spec.max_chunk``).
    Returns:
      int32[B] tokens per row, ``0 <= n <= min(remaining, chunk)``.
    """
    length = np.asarray(length, np.int64)
    n = np.minimum(np.asarray(remaining, np.int64), chunk)
    s0 = spec.sink
    in_sink = length < s0
    n = np.where(in_sink, np.minimum(n, s0 - length), n)
    if spec.quantized:
        u = np.maximum(length - s0, 0)
        n = np.where(in_sink, n, np.minimum(n, spec.residual - u % spec.residual))
    return n.astype(np.int32)
