"""Orthonormal Hadamard rotation of a head's channels before quantising (static, data-free).

Source: QuaRot (Ashkboos et al. 2024, arXiv 2404.00456, §3-4: a Hadamard rotation spreads a
few outlier channels over all of them, so a per-token range quantises the rest finer);
RotateKV (Su et al. 2025, arXiv 2501.16383, §3) rotates 2-bit keys as well. Keys are quantised
per channel (KIVI), where outlier channels already get their own range, so whether a rotation
pays differs for keys and values: docs/QUANTIZATION.md measures both.

``M = H_n / sqrt(n)`` with ``H_n`` the Sylvester Hadamard matrix (``H_1 = [1]``,
``H_2n = [[H_n, H_n], [H_n, -H_n]]``): symmetric and orthonormal (``M @ M = I``), so
``(x @ M) @ M = x`` and ``(q @ M) . (k @ M) = q . k``: a cache stores ``x @ M`` and folds the
second ``M`` into the read (the query of a score, the output of ``probabilities @ values``),
never rotating a stored token back.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.errors import JaxkvError


@functools.cache
def hadamard(n: int) -> np.ndarray:
    """float32[n, n]: the orthonormal Sylvester Hadamard matrix ``H_n / sqrt(n)`` (symmetric).

    Raises:
      JaxkvError: ``n`` not a power of two (a head_dim of 64, 128 or 256 is; 96 is not).
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 or n & (n - 1):
        raise JaxkvError(f"a Hadamard rotation needs a head_dim that is a power of two (8, 16, ..., 256): got {n!r}")
    m = np.ones((1, 1))
    while m.shape[0] < n:
        m = np.block([[m, m], [m, -m]])
    out = (m / np.sqrt(n)).astype(np.float32)
    out.setflags(write=False)
    return out


def rotate(x, m):
    """float32 ``x[..., H] @ m[H, H]`` at full precision (no TF32/bf16 passes on accelerators)."""
    return jnp.einsum("...h,hd->...d", x.astype(jnp.float32), m, precision=lax.Precision.HIGHEST)
