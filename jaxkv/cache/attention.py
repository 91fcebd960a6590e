"""Attention of a chunk of queries over a `KVCache` layer plus the chunk itself.

The cache is read as segments (sinks, window or KIVI residual, KIVI quantised ring, the
chunk's own keys). Each segment's scores are computed separately, so the cache is never
concatenated (no per-step copy of it): a decode step takes one softmax over all of them, a
prefill chunk one per segment (the ring in blocks, those no query sees skipped), combined. Masks
come from per-slot absolute positions (DESIGN §2), so every query of a chunk attends to
exactly its own retained set and chunked prefill equals token-by-token decode.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.cache import rotation
from jaxkv.cache.kv import LayerKV, Step
from jaxkv.cache.retention import Mass
from jaxkv.cache.rope import Rope, apply_rope, as_rope, rope_blocks
from jaxkv.cache.spec import CacheSpec
from jaxkv.cache.storage import Segment
from jaxkv.errors import JaxkvError

RING_BLOCK = 256
"""Slots of the ring a prefill chunk (T > 1) reads as one segment: a block that no query of the
chunk sees (empty slots of a cache being filled, a full cache's slots past the prompt) is
skipped under ``lax.cond`` (:func:`_prefill_softmax`). A decode step (T = 1) reads the ring as
one segment."""


def attend(
    step: Step,
    layer: LayerKV,
    q,
    k,
    v,
    *args,
    rope: Rope | None = None,
    theta: float | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    mass: bool = False,
):
    """Grouped-query attention of a chunk over one layer of the cache and itself.

    Args:
      step: from :meth:`KVCache.begin` (shared by all layers).
      layer: one layer of :meth:`KVCache.layers` (the L axis removed).
      q: ``[B, T, N, H]`` queries before RoPE. k, v: ``[B, T, K, H]`` the chunk's keys
        (before RoPE) and values; ``N % K == 0``.
      rope: the layer's :class:`~jaxkv.cache.rope.Rope` (its frequencies, scaling included);
        or ``theta``, the base of plain RoPE.
      scale: the score scale (default ``1/sqrt(H)``; Gemma: ``query_pre_attn_scalar**-0.5``).
      softcap: None, or ``c`` to cap scores as ``c * tanh(s / c)`` before the softmax
        (Gemma 2's attention logit soft-capping).
      mass: also return the attention mass each stored slot received (a cache whose keep
        tier ranks tokens by attention, ``spec.policy.retention.attention_scored``).
    Returns:
      ``(out[B, T, N, H], k_store[B, K, T, H], v_store[B, K, T, H])``: the attention
      output in ``q.dtype``, and the chunk's keys/values as the cache stores them (keys
      after RoPE in ``absolute`` mode, before RoPE in ``cache`` mode): stack them on L
      for :meth:`KVCache.commit`. With ``mass=True`` a fourth entry, the
      :class:`~jaxkv.cache.retention.Mass` of the window, keep tier, chunk and KIVI store slots
      (float32[B, S] each; zeros when the cache keeps no tier), also for :meth:`KVCache.commit`.
    Raises:
      JaxkvError: neither or both of ``rope`` and ``theta``, a rope of another head dim, or
        a ``softcap`` that is not positive.

    The deprecated form ``attend(spec, view, layer, q, k, v, theta=...)`` (the six-call
    protocol) is still accepted.
    """
    if isinstance(step, CacheSpec):  # attend(spec, view, layer, q, k, v)
        warnings.warn(
            "attend(spec, view, layer, ...) is deprecated: use attend(step, layer, ...) with "
            "cache.begin (docs/custom_models.md)",
            DeprecationWarning,
            stacklevel=2,
        )
        step, layer, q, k, v = layer, q, k, v, args[0]
    policy, storage = step.spec.policy, step.spec.storage
    b, t, n_heads, h = q.shape
    rope = as_rope(rope, theta, h)
    if softcap is not None and not softcap > 0:
        raise JaxkvError(f"attend: softcap={softcap!r}, expected a positive number or None")
    n_kv = k.shape[2]
    dtype = q.dtype
    k = jnp.swapaxes(k, 1, 2)  # [B, K, T, H]
    v = jnp.swapaxes(v, 1, 2)
    pre_rope = policy.keys_pre_rope  # keys stored before RoPE, rotated here
    shift = step.k_shift[:, None, None]

    def rotate(blocks, pos):  # blocks: channel blocks of keys [B, K, S, H/n]; pos int32[B, 1, S]
        if len(blocks) == 1:  # split into halves: rotated keys are never concatenated
            half = blocks[0].shape[-1] // 2
            blocks = [blocks[0][..., :half], blocks[0][..., half:]]
        return rope_blocks(blocks, pos, rope=rope)

    def rotate_keys(blocks, pos):  # pos int32[B, S]: window keys at their rank (their position if absolute)
        return rotate(blocks, pos[:, None, :] - shift) if pre_rope else blocks

    k_store = k if pre_rope else apply_rope(k, step.q_pos[:, None, :], rope=rope)

    # segments: (Segment, kind); a Segment's keys and values are lists of channel blocks
    # (KIVI int4/int2: one per packed bit field) so that no dequantised or rotated segment of a
    # decode step is ever concatenated along H. Sinks and keep tier see the queries at their rank.
    segments = []
    if step.sink_pos is not None:
        sk = [storage.read(layer.sink_k).astype(dtype)]
        if pre_rope:  # a sink's rank is its position
            sk = rotate(sk, step.sink_pos[:, None, :])
        segments.append((Segment(sk, [storage.read(layer.sink_v)], step.sink_pos), "sink"))
    retention = policy.retention
    if layer.keep is not None:
        seg = retention.segment(layer.keep, step.keep_pos, dtype)
        if pre_rope:  # at its rank in the cache (positions="cache"), else its position
            seg = seg._replace(keys=rotate(seg.keys, step.keep_rot[:, None, :]))
        segments.append((seg, "keep"))
    if layer.store is not None:
        for seg in storage.segments(layer.store, step.store_pos, dtype):
            segments.append((seg._replace(keys=rotate_keys(seg.keys, seg.pos)), "store"))
    ring_k, ring_v = storage.read(layer.ring_k), storage.read(layer.ring_v)
    size = ring_k.shape[2]
    block = size if t == 1 else RING_BLOCK  # a prefill chunk reads the ring in blocks, skipping those it cannot see
    for a in range(0, size, block):
        pos = step.ring_pos[:, a : a + block]
        keys = rotate_keys([ring_k[:, :, a : a + block].astype(dtype)], pos)
        segments.append((Segment(keys, [ring_v[:, :, a : a + block]], pos), "ring"))
    segments.append((Segment(rotate_keys([k_store], step.q_pos), [v], step.q_pos), "chunk"))

    group = n_heads // n_kv
    qg = q.reshape(b, t, n_kv, group, h)
    q_main = apply_rope(qg, step.q_rot[:, :, None, None], rope=rope)
    q_sink = apply_rope(qg, step.q_rot_sink[:, :, None, None], rope=rope) if policy.rope_at_rank else q_main
    scale = 1.0 / jnp.sqrt(jnp.float32(h)) if scale is None else jnp.float32(scale)

    # queries as [B, K, G*T, H]; queries and keys contracted over their minor axis H, the layout
    # the cache stores keys in (a decode step's dot takes the keys first, a prefill chunk's the queries).
    q_main = jnp.transpose(q_main, (0, 2, 3, 1, 4)).reshape(b, n_kv, group * t, h)
    q_sink = jnp.transpose(q_sink, (0, 2, 3, 1, 4)).reshape(b, n_kv, group * t, h) if policy.rope_at_rank else q_main
    dims = (((3,), (3,)), ((0, 1), (0, 1)))

    def segment_scores(seg, kind):  # float32[B, K, G, T, S], -inf where the query does not see the slot
        qq = q_sink if kind in ("sink", "keep") else q_main
        if seg.key_rotation is not None:  # keys stored as k @ M: (q @ M) . (k @ M) = q . k
            qq = rotation.rotate(qq, seg.key_rotation).astype(dtype)
        keys = seg.keys
        if len(keys) > 1 and group * t >= h:
            # a prefill chunk: its scores [S, G*T] outweigh the keys [S, H], so one score tensor
            # from the blocks joined beats one per block (int2: four)
            keys = [jnp.concatenate([block.astype(dtype) for block in keys], axis=-1)]
        width = keys[0].shape[-1]
        if t == 1:  # the keys first: [B, K, S, G]
            s = sum(
                lax.dot_general(
                    block.astype(dtype), qq[..., j * width : (j + 1) * width], dims, preferred_element_type=jnp.float32
                )
                for j, block in enumerate(keys)
            )
            s = jnp.swapaxes(s, 2, 3)
        else:  # a prefill chunk: the queries first, [B, K, G*T, S] in the layout the softmax reads
            s = sum(
                lax.dot_general(
                    qq[..., j * width : (j + 1) * width], block.astype(dtype), dims, preferred_element_type=jnp.float32
                )
                for j, block in enumerate(keys)
            )
        s = s.reshape(b, n_kv, group, t, -1) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        return jnp.where(segment_mask(seg, kind)[:, None, None], s, -jnp.inf)

    def segment_mask(seg, kind):  # bool[B, T, S]
        visible = policy.kept_visible if kind == "keep" else policy.visible
        return visible(step.q_pos[:, :, None], seg.pos[:, None, :])

    def segment_output(ps, seg):  # probabilities [B, K, G, T, S] @ the segment's values: float32[B, K, G, T, H]
        parts = [
            jnp.einsum("bkgts,bksh->bkgth", ps.astype(dtype), block.astype(dtype), preferred_element_type=jnp.float32)
            for block in seg.values
        ]
        part = jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        if seg.value_rotation is not None:  # values stored as v @ M: (p @ v M) @ M.T = p @ v
            part = rotation.rotate(part, seg.value_rotation.T)
        return part

    def finite(m):  # a row that sees nothing has max -inf: subtract 0 there (exp(-inf) = 0, no inf - inf)
        return jnp.where(jnp.isfinite(m), m, 0.0)

    if t > 1 and not mass:
        out = _prefill_softmax(segments, segment_scores, segment_mask, segment_output, finite)
        out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n_heads, h).astype(dtype)
        return out, k_store, v

    s = jnp.concatenate([segment_scores(seg, kind) for seg, kind in segments], axis=-1)
    p = jnp.exp(s - finite(jnp.max(s, axis=-1, keepdims=True)))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)

    outs, offset = [], 0
    received = {}  # kind -> float32[B, S], the attention mass the segment's slots received
    for seg, kind in segments:
        size = seg.pos.shape[1]
        if mass and retention is not None and kind != "sink":
            received.setdefault(kind, []).append(retention.reduce_queries(p[..., offset : offset + size], step.q_pos))
        part = segment_output(p[..., offset : offset + size], seg)
        outs.append(jnp.transpose(part, (0, 3, 1, 2, 4)).reshape(b, t, n_heads * h))  # the output's layout
        offset += size
    # The segments' sum, as a product with ones: XLA CPU then writes the attention output as one
    # array. Added elementwise, the sum fused into the output projection's one-token dot,
    # recomputed for every output row and indexed through [K, G, H] there (SmolLM2 int8:
    # 0.36 ms a layer for wo, 0.07 for wq of the same shape; docs/PERFORMANCE.md).
    out = jnp.tensordot(jnp.ones(len(outs), jnp.float32), jnp.stack(outs), axes=1)
    out = out.reshape(b, t, n_heads, h).astype(dtype)
    if not mass:
        return out, k_store, v

    def got(kind, n):  # the segment's blocks joined, or zeros
        return jnp.concatenate(received[kind], axis=-1) if kind in received else jnp.zeros((b, n), jnp.float32)

    return (
        out,
        k_store,
        v,
        Mass(
            ring=got("ring", step.ring_pos.shape[1]),
            keep=got("keep", 0 if step.keep_pos is None else step.keep_pos.shape[1]),
            chunk=got("chunk", t),
            store=got("store", 0 if step.store_pos is None else step.store_pos.shape[1]),
        ),
    )


def _prefill_softmax(segments, segment_scores, segment_mask, segment_output, finite):
    """A prefill chunk's attention output ``float32[B, K, G, T, H]``, one segment at a time:
    each segment's softmax over its own slots (its row maxima ``m_i``, sums ``l_i`` and
    unnormalised output ``o_i``), combined as ``sum_i exp(m_i - m) o_i / sum_i exp(m_i - m) l_i``
    with ``m = max_i m_i`` (the blockwise softmax of FlashAttention, Dao et al. 2022, §3.1).
    A block of the ring that no query of the chunk sees (empty slots of a cache being filled)
    is skipped under ``lax.cond``: no scores, no exponentials, no product with its values."""
    stats = []
    for seg, kind in segments:

        def partial(seg=seg, kind=kind):
            s = segment_scores(seg, kind)
            m = jnp.max(s, axis=-1, keepdims=True)
            p = jnp.exp(s - finite(m))
            return m, jnp.sum(p, axis=-1, keepdims=True), segment_output(p, seg)

        if kind == "ring":
            m_shape, l_shape, o_shape = (x.shape for x in jax.eval_shape(partial))

            def unseen(m_shape=m_shape, l_shape=l_shape, o_shape=o_shape):  # what a block no row sees adds: nothing
                return jnp.full(m_shape, -jnp.inf), jnp.zeros(l_shape), jnp.zeros(o_shape)

            stats.append(lax.cond(jnp.any(segment_mask(seg, kind)), partial, unseen))
        else:
            stats.append(partial())
    m = finite(functools.reduce(jnp.maximum, [m_i for m_i, _, _ in stats]))
    weights = [jnp.exp(m_i - m) for m_i, _, _ in stats]  # 0 for a segment the row does not see
    denom = sum(w * l_i for w, (_, l_i, _) in zip(weights, stats))
    out = sum(w * o_i for w, (_, _, o_i) in zip(weights, stats))
    return out / jnp.where(denom > 0, denom, 1.0)
