"""The cache's row API: the batch axis of every leaf, and reading / writing a set of rows.

A batched cache (:class:`~jaxkv.cache.KVCache` or :class:`~jaxkv.cache.LayeredCache`) holds B
independent rows (streams); every leaf has exactly one B axis, not always the leading one
(keys and values are ``[L, B, K, S, H]``, lengths ``[B]``, slot positions ``[B, S]``). A
serving engine moves rows between a big batch and the compiled calls of a few batch sizes
(:func:`take_rows` gathers, :func:`put_rows` writes back); a prefix store keeps one-row caches.

``put_rows`` writes row by row with ``lax.dynamic_update_slice`` in a ``fori_loop`` (no
scatter, which jax-metal does not run in the decode path: DESIGN §4).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxkv.cache.kv import KVCache
from jaxkv.cache.spec import CacheSpec, LayerSpecs

__all__ = ["batch_axes", "put_rows", "take_rows"]


@functools.lru_cache(maxsize=64)
def batch_axes(spec: CacheSpec | LayerSpecs, *, n_layers: int, n_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """Per leaf of the cache of ``spec`` (in ``jax.tree.leaves`` order), the axis of its rows B.

    Found from the shapes (nothing allocated) of a 1-row and a 2-row cache: the one axis where
    they differ.

    Args:
      spec: the cache's spec (as the model runs it: :func:`jaxkv.decode.loop.model_cache_spec`).
      n_layers: L. n_kv_heads: K. head_dim: H.
    Returns:
      one int per leaf.
    """

    def shapes(batch):
        empty = jax.eval_shape(
            lambda: KVCache._empty(spec, batch=batch, n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim)
        )
        return [x.shape for x in jax.tree.leaves(empty)]

    return tuple(
        next(i for i, (m, n) in enumerate(zip(a, b)) if m != n) for a, b in zip(shapes(1), shapes(2), strict=True)
    )


def take_rows(tree, index: jax.Array, axes: tuple[int, ...]):
    """Rows ``index: int32[R]`` of a batched pytree (a cache, or logits ``[B, V]`` with ``axes=(0,)``):
    the same pytree with R rows, in ``index`` order (a copy). Traceable (use under ``jax.jit``)."""
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, [jnp.take(x, index, axis=a) for x, a in zip(leaves, axes, strict=True)])


def put_rows(tree, index: jax.Array, rows, axes: tuple[int, ...]):
    """``tree`` with its rows ``index: int32[R]`` replaced by the R rows of ``rows`` (same
    structure; distinct indices in ``[0, B)``). Traceable; donate ``tree`` to update it in place."""
    leaves, treedef = jax.tree.flatten(tree)
    parts = jax.tree.leaves(rows)

    def put(r, leaves):
        return [
            lax.dynamic_update_slice_in_dim(x, lax.dynamic_slice_in_dim(p, r, 1, axis=a).astype(x.dtype), index[r], a)
            for x, p, a in zip(leaves, parts, axes, strict=True)
        ]

    return jax.tree.unflatten(treedef, lax.fori_loop(0, index.shape[0], put, leaves))
