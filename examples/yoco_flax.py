"""Your own Flax NNX model on jaxkv's cache: a YOCO-style decoder-decoder.

YOCO ("You Only Cache Once", Sun et al. 2024, arXiv 2405.05254, §2) splits L layers in two:

* the **self-decoder** (lower L/2 layers): ordinary causal self-attention; each layer owns
  one cache entry, as in any Llama;
* the **cross-decoder** (upper L/2 layers): the self-decoder's output is projected *once*
  into a global K/V, ``K^ = RMSNorm(X) W_K``, ``V^ = RMSNorm(X) W_V`` (YOCO §2.2), and every
  cross-decoder layer attends to that one K/V with its own queries.

So the KV cache holds L/2 + 1 entries instead of L (5 of 8 here). The model decides *which*
K/V are cached (depth); the :class:`jaxkv.CacheSpec` decides *how many tokens* (StreamingLLM
sinks + window) and *at what precision* (KIVI int8/int4/int2): three orthogonal axes.

Nothing here is jaxkv's Llama: the modules are plain ``nnx.Linear``/``nnx.Embed`` layers
held in ``nnx.Dict`` (not ``nnx.List``, which flax 0.10.4 lacks). The model follows the
per-layer cache contract of ``docs/custom_models.md``::

    cache, step = cache.begin(n, T)                                # once per call
    out, k_store, v_store = attend(step, entry, q, k, v, theta=...)  # per layer (entry of cache.layers())
    cache = cache.commit(step, k_new[E, B, K, T, H], v_new)        # once, all E entries

and :func:`jaxkv.sample` drives it unchanged, because a :class:`jaxkv.LoadedModel` only
needs ``model(tokens, n, cache, last_only=...) -> (logits, cache)`` and a ``config`` whose
``n_layers``/``n_kv_heads``/``head_dim``/``vocab_size`` describe the *cache* and vocabulary.

Run (a random model over bytes, so the text is noise; the point is the cache)::

    python examples/yoco_flax.py --tokens 1000 --sink 4 --window 60 --kv-quantize int4 \\
        --group-size 4 --residual 12
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

import jaxkv
from jaxkv.cache.attention import attend
from jaxkv.cache.memory import format_bytes
from jaxkv.io.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class YocoConfig:
    """Shape of the YOCO-style decoder.

    Attributes:
      vocab_size: V. dim: D. hidden_dim: F (SwiGLU). n_heads: N. n_kv_heads: K. head_dim: H.
      n_self_layers: self-decoder layers, one cache entry each.
      n_cross_layers: cross-decoder layers, all reading the one shared entry.
      rope_theta, norm_eps: RoPE base and RMSNorm epsilon.
    """

    vocab_size: int = 256
    dim: int = 64
    hidden_dim: int = 128
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    n_self_layers: int = 4
    n_cross_layers: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def n_layers(self) -> int:
        """Cache entries (the KVCache's L axis): one per self-decoder layer plus the shared one.

        This is the name jaxkv's sampling reads to allocate the cache."""
        return self.n_self_layers + 1

    @property
    def shared_entry(self) -> int:
        """Index of the cross-decoder's shared K/V in the cache."""
        return self.n_self_layers

    @property
    def n_decoder_layers(self) -> int:
        """Transformer layers (what a per-layer cache would have to hold)."""
        return self.n_self_layers + self.n_cross_layers


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        return (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps) * self.weight[...]).astype(x.dtype)


class SwiGLU(nnx.Module):
    def __init__(self, c: YocoConfig, *, rngs: nnx.Rngs):
        self.gate = nnx.Linear(c.dim, c.hidden_dim, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(c.dim, c.hidden_dim, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(c.hidden_dim, c.dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class SelfDecoderLayer(nnx.Module):
    """Causal self-attention (its own cache entry) + SwiGLU."""

    def __init__(self, c: YocoConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(c.dim, c.norm_eps)
        self.wq = nnx.Linear(c.dim, c.n_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.wk = nnx.Linear(c.dim, c.n_kv_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.wv = nnx.Linear(c.dim, c.n_kv_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(c.n_heads * c.head_dim, c.dim, use_bias=False, rngs=rngs)
        self.mlp_norm = RMSNorm(c.dim, c.norm_eps)
        self.mlp = SwiGLU(c, rngs=rngs)
        self.shape = (c.n_heads, c.n_kv_heads, c.head_dim)

    def __call__(self, x, attend_entry):
        """``attend_entry(q, k, v) -> (out, k_store, v_store)`` attends over this layer's entry."""
        b, t, _ = x.shape
        n_heads, n_kv, h = self.shape
        hx = self.attn_norm(x)
        q = self.wq(hx).reshape(b, t, n_heads, h)
        k = self.wk(hx).reshape(b, t, n_kv, h)
        v = self.wv(hx).reshape(b, t, n_kv, h)
        out, k_store, v_store = attend_entry(q, k, v)
        x = x + self.wo(out.reshape(b, t, n_heads * h))
        return x + self.mlp(self.mlp_norm(x)), k_store, v_store


class CrossDecoderLayer(nnx.Module):
    """Attention of its own queries over the shared K/V (no K/V projection) + SwiGLU."""

    def __init__(self, c: YocoConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(c.dim, c.norm_eps)
        self.wq = nnx.Linear(c.dim, c.n_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.wo = nnx.Linear(c.n_heads * c.head_dim, c.dim, use_bias=False, rngs=rngs)
        self.mlp_norm = RMSNorm(c.dim, c.norm_eps)
        self.mlp = SwiGLU(c, rngs=rngs)
        self.shape = (c.n_heads, c.head_dim)

    def __call__(self, x, attend_shared):
        b, t, _ = x.shape
        n_heads, h = self.shape
        q = self.wq(self.attn_norm(x)).reshape(b, t, n_heads, h)
        x = x + self.wo(attend_shared(q).reshape(b, t, n_heads * h))
        return x + self.mlp(self.mlp_norm(x))


class Yoco(nnx.Module):
    """The YOCO-style decoder. The KV cache stays outside the module (jaxkv's contract)."""

    def __init__(self, config: YocoConfig, *, rngs: nnx.Rngs):
        c = self.config = config
        self.embed = nnx.Embed(c.vocab_size, c.dim, rngs=rngs)
        self.self_layers = nnx.Dict({str(i): SelfDecoderLayer(c, rngs=rngs) for i in range(c.n_self_layers)})
        # the cross-decoder's global K/V, computed once from the self-decoder's output (YOCO §2.2)
        self.kv_norm = RMSNorm(c.dim, c.norm_eps)
        self.wk_shared = nnx.Linear(c.dim, c.n_kv_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.wv_shared = nnx.Linear(c.dim, c.n_kv_heads * c.head_dim, use_bias=False, rngs=rngs)
        self.cross_layers = nnx.Dict({str(i): CrossDecoderLayer(c, rngs=rngs) for i in range(c.n_cross_layers)})
        self.final_norm = RMSNorm(c.dim, c.norm_eps)
        self.lm_head = nnx.Linear(c.dim, c.vocab_size, use_bias=False, rngs=rngs)

    def __call__(self, tokens, n, cache: jaxkv.KVCache, *, last_only: bool = False):
        """``(tokens int32[B, T], n int32[B], cache) -> (logits float32[B, T or 1, V], cache)``.

        ``cache`` has ``config.n_layers`` entries: 0..n_self-1 for the self-decoder, then the
        shared one. Tokens at and beyond ``n[b]`` are padding.
        """
        c = self.config
        b, t = tokens.shape
        cache, step = cache.begin(n, t)  # admit, flush, positions: once per call
        leaves = cache.layers()  # each [E, ...]; entry e is leaves[...][e]

        def entry(e):
            return jax.tree.map(lambda a: a[e], leaves)

        x = self.embed(tokens)
        k_stores, v_stores = [], []
        for i in range(c.n_self_layers):
            layer_cache = entry(i)
            x, k_store, v_store = self.self_layers[str(i)](
                x, lambda q, k, v, e=layer_cache: attend(step, e, q, k, v, theta=c.rope_theta)
            )
            k_stores.append(k_store)
            v_stores.append(v_store)

        # the shared K/V of this chunk, projected once and attended by every cross-decoder layer
        hx = self.kv_norm(x)
        k_sh = self.wk_shared(hx).reshape(b, t, c.n_kv_heads, c.head_dim)
        v_sh = self.wv_shared(hx).reshape(b, t, c.n_kv_heads, c.head_dim)
        shared = entry(c.shared_entry)
        stored = {}

        def attend_shared(q):
            out, k_store, v_store = attend(step, shared, q, k_sh, v_sh, theta=c.rope_theta)
            stored.setdefault("kv", (k_store, v_store))  # identical for every cross layer
            return out

        for i in range(c.n_cross_layers):
            x = self.cross_layers[str(i)](x, attend_shared)
        if not stored:  # no cross layers: still store the shared entry
            attend_shared(jnp.zeros((b, t, c.n_heads, c.head_dim), x.dtype))
        k_stores.append(stored["kv"][0])
        v_stores.append(stored["kv"][1])

        cache = cache.commit(step, jnp.stack(k_stores), jnp.stack(v_stores))  # [E, B, K, T, H]
        if last_only:
            idx = jnp.maximum(step.n - 1, 0)[:, None, None]
            x = jnp.take_along_axis(x, jnp.broadcast_to(idx, (b, 1, x.shape[-1])), axis=1)
        logits = self.lm_head(self.final_norm(x)).astype(jnp.float32)
        return logits, cache


class ByteVocabulary:
    """A 256-token byte vocabulary, duck-typed as a :class:`jaxkv.io.tokenizer.Tokenizer` backend."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def id_to_token(self, i: int) -> str:
        return bytes([i]).decode("latin-1")


def build(config: YocoConfig | None = None, *, seed: int = 0) -> jaxkv.LoadedModel:
    """A random YOCO model with a byte tokenizer, ready for :func:`jaxkv.sample`."""
    config = config or YocoConfig()
    tokenizer = Tokenizer(ByteVocabulary(), bos_id=None, eos_id=None, add_bos=False, name="bytes")
    return jaxkv.LoadedModel(config=config, model=Yoco(config, rngs=nnx.Rngs(seed)), tokenizer=tokenizer)


def cache_bytes(config: YocoConfig, spec: jaxkv.CacheSpec, *, batch: int = 1) -> dict[str, int]:
    """K/V bytes (all leaves except bookkeeping) of a YOCO cache versus a per-layer one."""

    def kv(n_layers):
        cache = jaxkv.KVCache.create(
            spec, batch=batch, n_layers=n_layers, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim
        )
        report = jaxkv.memory_report(cache)
        return report.allocated_bytes - report.allocated["bookkeeping"]

    return {"yoco": kv(config.n_layers), "per_layer": kv(config.n_decoder_layers)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--prompt", default="Once upon a time")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=60)
    p.add_argument("--kv-quantize", default="int4")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--residual", type=int, default=12)
    p.add_argument("--positions", default="absolute", choices=("absolute", "cache"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    spec = jaxkv.CacheSpec(
        sink=args.sink,
        window=args.window,
        kv_quantize=args.kv_quantize,
        group_size=args.group_size,
        residual=args.residual,
        positions=args.positions,
    )
    model = build(seed=args.seed)
    out = jaxkv.sample(model, args.prompt, max_new_tokens=args.tokens, cache=spec)
    c = model.config
    sizes = cache_bytes(c, spec)
    print(f"generated {len(out.token_ids)} tokens ({out.finish_reason}); first ids: {out.token_ids[:16]}")
    print(out.report())
    print(
        f"YOCO cache: {c.n_layers} entries for {c.n_decoder_layers} layers; K/V "
        f"{format_bytes(sizes['yoco'])} vs {format_bytes(sizes['per_layer'])} "
        f"per-layer ({sizes['yoco'] / sizes['per_layer']:.1%}), {spec.describe()}"
    )


if __name__ == "__main__":
    main()
