"""Building blocks shared by the model families: RMSNorm, the pre-norm residual step,
Q/K/V projections, the gated MLP (SwiGLU, GeGLU), and the RoPE layout conversion of checkpoints.

Pure functions of arrays (the weights are passed in), so a family module holds its weights
as it likes (jaxkv's Llama stacks them on a leading L axis and scans over layers). Axis
letters are those of DESIGN §1: B batch rows, T tokens, D model width, N query heads,
K key/value heads, H head dim, F MLP hidden width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.models.weights import as_vector, dense


def rms_norm(x, weight, eps: float):
    """RMSNorm over the last axis, computed in float32: ``x / rms(x) * weight``.

    Args:
      x: ``[..., D]`` activations (any float dtype).
      weight: ``[D]`` scale.
      eps: added to the mean square before the square root.
    Returns:
      ``[..., D]`` in ``x.dtype`` (one row computed as a vector: :func:`~jaxkv.models.weights.as_vector`).
    """
    xf = as_vector(x).astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype).reshape(x.shape)


def pre_norm_residual(x, norm_weight, eps: float, sublayer):
    """One pre-norm residual step: ``x + y`` where ``(y, aux) = sublayer(rms_norm(x))``.

    Args:
      x: ``[B, T, D]`` the residual stream.
      norm_weight: ``[D]`` the RMSNorm weight applied before the sublayer.
      eps: the RMSNorm epsilon.
      sublayer: ``h [B, T, D] -> (y [B, T, D], aux)``; ``aux`` is passed through (for
        attention, the keys and values to store; None for an MLP).
    Returns:
      ``(x + y, aux)``.
    """
    y, aux = sublayer(rms_norm(x, norm_weight, eps))
    return x + y, aux


def qkv_projection(h, wq, wk, wv, *, n_heads: int, n_kv_heads: int, head_dim: int, bias=None):
    """Queries, keys and values of a chunk, split into heads.

    Args:
      h: ``[B, T, D]`` normed activations.
      wq: ``[D, N*H]``; wk, wv: ``[D, K*H]`` projections (``x @ W`` orientation), in any
        weight format (:func:`jaxkv.models.weights.dense`).
      n_heads, n_kv_heads, head_dim: N, K, H.
      bias: None, or ``(bq [N*H], bk [K*H], bv [K*H])`` added after the projections (Qwen2).
    Returns:
      ``q [B, T, N, H]``, ``k [B, T, K, H]``, ``v [B, T, K, H]`` in the dtype of ``h @ W``
      (keys before RoPE: ``attend`` rotates them).
    """
    b, t = h.shape[:2]
    q, k, v = dense(h, wq), dense(h, wk), dense(h, wv)
    if bias is not None:
        bq, bk, bv = bias
        q, k, v = q + bq, k + bk, v + bv
    q = q.reshape(b, t, n_heads, head_dim)
    k = k.reshape(b, t, n_kv_heads, head_dim)
    v = v.reshape(b, t, n_kv_heads, head_dim)
    return q, k, v


def gated_mlp(h, w_gate, w_up, w_down, activation=jax.nn.silu):
    """The gated MLP: ``(activation(h @ w_gate) * (h @ w_up)) @ w_down`` (Shazeer 2020,
    arXiv 2002.05202): SwiGLU with ``silu`` (Llama), GeGLU with tanh-approximated GELU (Gemma).

    Args:
      h: ``[B, T, D]`` normed activations.
      w_gate, w_up: ``[D, F]``; w_down: ``[F, D]``, in any weight format
        (:func:`jaxkv.models.weights.dense`).
      activation: the gate's elementwise activation.
    Returns:
      ``[B, T, D]``.
    """
    gate, up = as_vector(dense(h, w_gate)), as_vector(dense(h, w_up))  # one row: vectors (as_vector)
    return dense(activation(gate) * up, w_down).reshape(*h.shape[:-1], -1)


swiglu = gated_mlp  # the SwiGLU MLP: gated_mlp's default activation (the name of jaxkv <= 0.1)


def interleaved_to_rotate_half(w: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """Permute Q/K output channels from the interleaved-pair RoPE layout to rotate-half.

    jaxkv's one internal RoPE convention is rotate-half (Hugging Face's): within a head,
    channel ``i`` pairs with channel ``i + H/2``. llama2.c and llama.cpp's Llama GGUF files
    store Q/K in the interleaved-pair layout (channel ``2i`` pairs with ``2i+1``); their
    loaders permute with this function at load time.

    Args:
      w: ``[..., n_heads * head_dim]`` weights whose last axis is the Q or K output channel.
    Returns:
      the same weights with, inside each head, channels ``0, 2, 4, ..., 1, 3, 5, ...``, so
      that pair ``(2i, 2i+1)`` of the checkpoint becomes pair ``(i, i + H/2)``. Attention
      scores are unchanged because Q and K are permuted alike.
    """
    perm = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    idx = (np.arange(n_heads)[:, None] * head_dim + perm[None, :]).reshape(-1)
    return w[..., idx]
