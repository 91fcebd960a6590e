"""Exact slot writes into ring buffers (DESIGN §2 "Ring buffer").

Everything here is int32 (DESIGN §1: unsigned index dtypes crash jax-metal) and works on
per-row arrays, so rows of one batch wrap at different steps. Which slot a position goes
to is the policy's business (:mod:`jaxkv.cache.policy`); this module only writes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


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
    batch axis is sharded (:mod:`jaxkv.decode.parallel`).
    """
    ring, chunk = buf.shape[slot_axis], new.shape[slot_axis]
    block = min(ring, chunk)
    new = new.astype(buf.dtype)
    mask_shape = [1] * buf.ndim
    mask_shape[slot_axis] = block
    j = lax.broadcasted_iota(jnp.int32, mask_shape, slot_axis)

    def entries(row_new, src0):
        # chunk entries src0 + j, j in [0, block), gathered at indices clipped here into [0, T) (so
        # XLA's own clamping never engages): the entries a write keeps are always in range, the
        # others are masked out. (The chunk zero-extended by a block on each side, read at an
        # offset, held [.., 3T, ..] for all layers at once: 70 MB of SmolLM2's prefill at T = 512.)
        if chunk == 1:  # src0 is 0: the entry itself
            return row_new
        idx = jnp.clip(src0 + jnp.arange(block, dtype=jnp.int32), 0, chunk - 1)
        return jnp.take(row_new, idx, axis=slot_axis, mode="clip")

    def row_update(buf, b, o, m, row_new):  # row_new: the chunk of row b, batch axis of size 1

        def put(buf, slot0, src0, valid):
            # block slot slot0 + j <- chunk entry src0 + j where valid, else keep the slot
            idx = [jnp.int32(0)] * buf.ndim
            idx[batch_axis], idx[slot_axis] = b, slot0
            sizes = list(buf.shape)
            sizes[batch_axis], sizes[slot_axis] = 1, block
            old = lax.dynamic_slice(buf, idx, sizes)
            src = entries(row_new, src0)
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

        return jax.vmap(one_row, in_axes=(batch_axis, batch_axis, 0, 0), out_axes=batch_axis)(buf, new, start, n)
    return lax.fori_loop(
        0,
        start.shape[0],
        lambda b, buf: row_update(buf, b, start[b], n[b], lax.dynamic_slice_in_dim(new, b, 1, batch_axis)),
        buf,
    )
