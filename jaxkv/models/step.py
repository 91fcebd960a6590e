"""The pure model step, for any family's module: ``nnx.merge`` the parameters, run one chunk.

jaxkv never keeps the cache inside an NNX module: callers ``nnx.split`` a model once and
``jax.jit`` :func:`forward` with the graphdef static and the cache donated.
"""

from __future__ import annotations

from flax import nnx


def forward(graphdef, state, tokens, n, cache, *, last_only: bool = False, kv_hook=None):
    """The pure model step: ``nnx.merge`` the parameters, run the chunk, return logits and the new cache.

    Works for any model module with ``__call__(tokens, n, cache, *, last_only)`` (every
    family of :mod:`jaxkv.models`, or your own; see ``docs/custom_models.md``).

    Args:
      graphdef, state: ``nnx.split(model)``.
      tokens: int32[B, T] token ids; entries at and beyond ``n[b]`` are padding.
      n: int32[B] tokens to append per row (0 = the row sits this step out).
      cache: the KV cache (donate it under ``jax.jit``).
      last_only: return logits only for each row's last appended token (``[B, 1, V]``).
      kv_hook: None, or a static callable ``(k, v) -> (k, v)`` on each layer's new keys
        (before RoPE) and values, ``[B, T, K, H]`` each, applied before attention and before
        they are stored (e.g. :class:`jaxkv.eval.FakeQuantKV`); passed to models that take it.
    Returns:
      ``(logits float32[B, T, V], cache)``. A full cache admits at most ``max_len`` tokens
      per row: tokens beyond it are not written (callers check ``cache.length``).
    """
    model = nnx.merge(graphdef, state)
    if kv_hook is None:
        return model(tokens, n, cache, last_only=last_only)
    return model(tokens, n, cache, last_only=last_only, kv_hook=kv_hook)
