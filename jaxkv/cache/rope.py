"""Rotary position embedding (RoPE, Su et al. 2021) in the rotate-half layout.

Angles are computed in float32 from int32 positions every time they are needed; stored
keys are never re-rotated (DESIGN §2).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


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
    inv_freq = (1.0 / (theta ** (np.arange(half, dtype=np.float64) * 2.0 / x.shape[-1]))).astype(np.float32)
    angle = jnp.asarray(positions, jnp.int32)[..., None].astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
