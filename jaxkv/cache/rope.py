"""Rotary position embedding (RoPE, Su et al. 2021) in the rotate-half layout.

Angles are computed in float32 from int32 positions every time they are needed; stored
keys are never re-rotated (DESIGN §2).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def rope_blocks(blocks: list, positions, *, theta: float) -> list:
    """Rotate ``x`` given as an even number of equal channel blocks, at integer ``positions``.

    Args:
      blocks: ``n`` (even) arrays ``[..., H/n]`` whose concatenation along the last axis is
        ``x[..., H]`` (the KIVI channel blocks, :func:`jaxkv.cache.kivi.dequantize_affine`).
      positions, theta: as :func:`apply_rope`.
    Returns:
      the ``n`` rotated blocks (block ``j`` pairs with block ``j + n/2``, as channel ``i``
      pairs with ``i + H/2``), each in its input dtype; nothing is concatenated.
    """
    n = len(blocks)
    width = blocks[0].shape[-1]
    h = n * width
    inv_freq = (1.0 / (theta ** (np.arange(h // 2, dtype=np.float64) * 2.0 / h))).astype(np.float32)
    angle = jnp.asarray(positions, jnp.int32)[..., None].astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    out = [None] * n
    for j in range(n // 2):
        c, s = cos[..., j * width : (j + 1) * width], sin[..., j * width : (j + 1) * width]
        x1, x2 = blocks[j].astype(jnp.float32), blocks[j + n // 2].astype(jnp.float32)
        out[j] = (x1 * c - x2 * s).astype(blocks[j].dtype)
        out[j + n // 2] = (x2 * c + x1 * s).astype(blocks[j].dtype)
    return out


def apply_rope(x, positions, *, theta: float):
    """Rotate ``x`` at integer ``positions``.

    Args:
      x: ``[..., H]`` float array (any float dtype; the rotation is computed in float32).
      positions: int32 array broadcastable to ``x.shape[:-1]``; negative values are allowed
        (only relative angles matter to attention).
      theta: the RoPE base (10000 for Llama 2, 100000 for SmolLM2).
    Returns:
      ``[..., H]`` in ``x.dtype``: channel ``i`` and ``i + H/2`` rotated by
      ``position * theta ** (-2i / H)``.
    """
    half = x.shape[-1] // 2
    return jnp.concatenate(rope_blocks([x[..., :half], x[..., half:]], positions, theta=theta), axis=-1)
