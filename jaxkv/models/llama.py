"""Llama-family decoder in Flax NNX (RMSNorm, RoPE, GQA, SwiGLU), layers stacked on an L axis.

The model never owns its KV cache: the step is the pure function
``(params, tokens[B, T], cache) -> (logits[B, T, V], cache)`` (:func:`forward`), and the
layer loop is one ``lax.scan`` over the stacked weights and the stacked cache leaves.
Weight names and layouts are those of :mod:`jaxkv.models.config`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxkv.cache.attention import attend
from jaxkv.cache.kv import KVCache
from jaxkv.errors import JaxkvError
from jaxkv.models.config import LlamaConfig

LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
BIAS_WEIGHTS = ("bq", "bk", "bv")  # present only when config.attention_bias (Qwen2)


def weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every weight of the internal layout (``lm_head`` only when untied,
    ``bq``/``bk``/``bv`` only with ``attention_bias``)."""
    c = config
    L, D, F, V = c.n_layers, c.dim, c.hidden_dim, c.vocab_size
    shapes = {
        "embed": (V, D),
        "attn_norm": (L, D),
        "wq": (L, D, c.n_heads * c.head_dim),
        "wk": (L, D, c.n_kv_heads * c.head_dim),
        "wv": (L, D, c.n_kv_heads * c.head_dim),
        "wo": (L, c.n_heads * c.head_dim, D),
        "mlp_norm": (L, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
        "final_norm": (D,),
    }
    if not c.tie_embeddings:
        shapes["lm_head"] = (D, V)
    if c.attention_bias:  # last, so the random init of the other weights does not depend on it
        shapes.update(bq=(L, c.n_heads * c.head_dim), bk=(L, c.n_kv_heads * c.head_dim), bv=(L, c.n_kv_heads * c.head_dim))
    return shapes


def rms_norm(x, weight, eps: float):
    """RMSNorm over the last axis, computed in float32: ``x / rms(x) * weight``."""
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * weight.astype(jnp.float32)).astype(x.dtype)


class Llama(nnx.Module):
    """A Llama-family decoder whose per-layer weights are stacked on a leading L axis.

    Build it from checkpoint weights with :meth:`from_weights`, or randomly (tests,
    benchmarks) with ``Llama(config, rngs=nnx.Rngs(seed))``.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        key = rngs.params()
        for i, (name, shape) in enumerate(weight_shapes(config).items()):
            if name.endswith("norm"):
                value = jnp.ones(shape, dtype)
            elif name in BIAS_WEIGHTS:
                value = (0.1 * jax.random.normal(jax.random.fold_in(key, i), shape)).astype(dtype)
            else:
                fan_in = shape[-2]
                value = (jax.random.normal(jax.random.fold_in(key, i), shape) / np.sqrt(fan_in)).astype(dtype)
            setattr(self, name, nnx.Param(value))

    @classmethod
    def from_weights(cls, config: LlamaConfig, weights: dict, *, dtype=jnp.float32) -> "Llama":
        """A model holding ``weights`` (numpy arrays of the internal layout), cast to ``dtype``.

        Raises:
          JaxkvError: a missing weight or one of the wrong shape (named).
        """
        shapes = weight_shapes(config)
        for name, shape in shapes.items():
            if name not in weights:
                raise JaxkvError(f"{config.name}: weight {name!r} is missing")
            if tuple(weights[name].shape) != shape:
                raise JaxkvError(f"{config.name}: weight {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")
        model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=dtype))
        for name in shapes:
            setattr(model, name, nnx.Param(jnp.asarray(weights[name], dtype)))
        return model

    def __call__(self, tokens, n, cache: KVCache, *, last_only: bool = False, kv_hook=None):
        """See :func:`forward`."""
        c = self.config
        b, t = tokens.shape
        n = cache.admit(n)
        cache = cache.prepare(n)
        view = cache.read_view(cache.query_positions(n, t))
        x = jnp.take(self.embed[...], tokens, axis=0)

        def layer(x, xs):
            w, kv = xs
            h = rms_norm(x, w["attn_norm"], c.norm_eps)
            q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
            if c.attention_bias:
                q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
            q = q.reshape(b, t, c.n_heads, c.head_dim)
            k = k.reshape(b, t, c.n_kv_heads, c.head_dim)
            v = v.reshape(b, t, c.n_kv_heads, c.head_dim)
            if kv_hook is not None:
                k, v = kv_hook(k, v)
            out, k_store, v_store = attend(cache.spec, view, kv, q, k, v, theta=c.rope_theta)
            x = x + out.reshape(b, t, c.n_heads * c.head_dim) @ w["wo"]
            h = rms_norm(x, w["mlp_norm"], c.norm_eps)
            x = x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
            return x, (k_store, v_store)

        names = LAYER_WEIGHTS + (BIAS_WEIGHTS if c.attention_bias else ())
        weights = {name: getattr(self, name)[...] for name in names}
        x, (k_new, v_new) = lax.scan(layer, x, (weights, cache.layer_leaves()))
        cache = cache.append(k_new, v_new, n)
        if last_only:  # the last appended token of each row
            idx = jnp.maximum(n - 1, 0)[:, None, None]
            x = jnp.take_along_axis(x, jnp.broadcast_to(idx, (b, 1, x.shape[-1])), axis=1)
        x = rms_norm(x, self.final_norm[...], c.norm_eps)
        head = self.embed[...].T if c.tie_embeddings else self.lm_head[...]
        logits = jnp.dot(x, head, preferred_element_type=jnp.float32)
        return logits, cache


def forward(graphdef, state, tokens, n, cache: KVCache, *, last_only: bool = False, kv_hook=None):
    """The pure model step: ``nnx.merge`` the parameters, run the chunk, return logits and the new cache.

    Args:
      graphdef, state: ``nnx.split(model)``.
      tokens: int32[B, T] token ids; entries at and beyond ``n[b]`` are padding.
      n: int32[B] tokens to append per row (0 = the row sits this step out).
      cache: the KV cache (donate it under ``jax.jit``).
      last_only: return logits only for each row's last appended token (``[B, 1, V]``).
      kv_hook: None, or a static callable ``(k, v) -> (k, v)`` on each layer's new keys
        (before RoPE) and values, ``[B, T, K, H]`` each, applied before attention and before
        they are stored (e.g. :class:`jaxkv.eval.FakeQuantKV`).
    Returns:
      ``(logits float32[B, T, V], cache)``. A full cache admits at most ``max_len`` tokens
      per row: tokens beyond it are not written (callers check ``cache.length``).
    """
    model = nnx.merge(graphdef, state)
    return model(tokens, n, cache, last_only=last_only, kv_hook=kv_hook)
