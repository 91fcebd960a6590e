"""Attention of a chunk of queries over a `KVCache` layer plus the chunk itself.

The cache is read as segments (sinks, window or KIVI residual, KIVI quantised ring, the
chunk's own keys). Each segment's scores are computed separately and one softmax runs
over all of them, so the cache is never concatenated (no per-step copy of it). Masks
come from per-slot absolute positions (DESIGN §2), so every query of a chunk attends to
exactly its own retained set and chunked prefill equals token-by-token decode.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
from jax import lax

from jaxkv.cache import rotation
from jaxkv.cache.kv import LayerKV, Step
from jaxkv.cache.retention import Mass
from jaxkv.cache.rope import Rope, apply_rope, as_rope, rope_blocks
from jaxkv.cache.spec import CacheSpec
from jaxkv.cache.storage import Segment
from jaxkv.errors import JaxkvError


def attend(step: Step, layer: LayerKV, q, k, v, *args, rope: Rope | None = None, theta: float | None = None,
           scale: float | None = None, softcap: float | None = None, mass: bool = False):
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
        warnings.warn("attend(spec, view, layer, ...) is deprecated: use attend(step, layer, ...) with "
                      "cache.begin (docs/custom_models.md)", DeprecationWarning, stacklevel=2)
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
    segments.append((Segment(rotate_keys([ring_k.astype(dtype)], step.ring_pos), [ring_v], step.ring_pos), "ring"))
    segments.append((Segment(rotate_keys([k_store], step.q_pos), [v], step.q_pos), "chunk"))

    group = n_heads // n_kv
    qg = q.reshape(b, t, n_kv, group, h)
    q_main = apply_rope(qg, step.q_rot[:, :, None, None], rope=rope)
    q_sink = apply_rope(qg, step.q_rot_sink[:, :, None, None], rope=rope) if policy.rope_at_rank else q_main
    scale = 1.0 / jnp.sqrt(jnp.float32(h)) if scale is None else jnp.float32(scale)

    # queries as [B, K, G*T, H]; keys are the dot's first operand, contracted over their
    # minor axis H: the layout the cache stores them in.
    q_main = jnp.transpose(q_main, (0, 2, 3, 1, 4)).reshape(b, n_kv, group * t, h)
    q_sink = jnp.transpose(q_sink, (0, 2, 3, 1, 4)).reshape(b, n_kv, group * t, h) if policy.rope_at_rank else q_main
    dims = (((3,), (3,)), ((0, 1), (0, 1)))
    scores = []
    for seg, kind in segments:
        qq = q_sink if kind in ("sink", "keep") else q_main
        if seg.key_rotation is not None:  # keys stored as k @ M: (q @ M) . (k @ M) = q . k
            qq = rotation.rotate(qq, seg.key_rotation).astype(dtype)
        keys = seg.keys
        if len(keys) > 1 and group * t >= h:
            # a prefill chunk: its scores [S, G*T] outweigh the keys [S, H], so one score tensor
            # from the blocks joined beats one per block (int2: four)
            keys = [jnp.concatenate([block.astype(dtype) for block in keys], axis=-1)]
        width = keys[0].shape[-1]
        s = sum(
            lax.dot_general(block.astype(dtype), qq[..., j * width : (j + 1) * width], dims, preferred_element_type=jnp.float32)
            for j, block in enumerate(keys)
        )  # [B, K, S, G*T]
        s = jnp.swapaxes(s, 2, 3).reshape(b, n_kv, group, t, -1) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        visible = policy.kept_visible if kind == "keep" else policy.visible
        mask = visible(step.q_pos[:, :, None], seg.pos[:, None, :])  # [B, T, S]
        scores.append(jnp.where(mask[:, None, None], s, -jnp.inf))
    s = jnp.concatenate(scores, axis=-1)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # padding queries see nothing: avoid inf - inf
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)

    outs, offset = [], 0
    received = {}  # kind -> float32[B, S], the attention mass the segment's slots received
    for seg, kind in segments:
        size = seg.pos.shape[1]
        if mass and retention is not None and kind != "sink":
            received[kind] = retention.reduce_queries(p[..., offset : offset + size], step.q_pos)
        ps = p[..., offset : offset + size].astype(dtype)
        parts = [
            jnp.einsum("bkgts,bksh->bkgth", ps, block.astype(dtype), preferred_element_type=jnp.float32)
            for block in seg.values
        ]
        part = jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
        if seg.value_rotation is not None:  # values stored as v @ M: (p @ v M) @ M.T = p @ v
            part = rotation.rotate(part, seg.value_rotation.T)
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
    zeros = lambda n: jnp.zeros((b, n), jnp.float32)  # noqa: E731
    return out, k_store, v, Mass(
        ring=received.get("ring", zeros(step.ring_pos.shape[1])),
        keep=received.get("keep", zeros(0 if step.keep_pos is None else step.keep_pos.shape[1])),
        chunk=received.get("chunk", zeros(t)),
        store=received.get("store", zeros(0 if step.store_pos is None else step.store_pos.shape[1])),
    )

