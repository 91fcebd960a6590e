"""NumPy reference implementations used by the tests (independent of jaxkv's JAX code).

* :func:`rope` -- RoPE in either layout ("half" = rotate-half, "interleaved" = llama2.c pairs).
* :func:`quantize_dequantize` -- KIVI affine fake-quantisation (DESIGN §2), float32 maths.
* :class:`RefDecoder` -- a Llama decoder run one token at a time over an explicit
  retained set: the set of DESIGN §2 is *simulated* (sinks, window, lazy residual flush,
  last W flushed tokens), never computed from a closed formula, and ranks for
  ``positions="cache"`` are the indices in the sorted retained set.
"""

from __future__ import annotations

import numpy as np


def rope(x, pos, theta, layout="half"):
    """Rotate ``x[..., H]`` at integer positions ``pos`` (broadcast to x.shape[:-1]) in float64."""
    h = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(h // 2) * 2.0 / h)
    ang = np.asarray(pos, np.float64)[..., None] * inv
    cos, sin = np.cos(ang), np.sin(ang)
    if layout == "half":
        a, b = x[..., : h // 2], x[..., h // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x, dtype=np.float64)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = b * cos + a * sin
    return out


def quantize_dequantize(x, bits, axis, scale_dtype=np.float32):
    """KIVI affine quantisation of ``x`` with min/max taken over ``axis``; returns x' (float32).

    ``scale = max(eps, (max - min) / (2**bits - 1))``, ``zero = min``, both rounded to
    ``scale_dtype``; ``q = clip(round((x - zero) / scale), 0, 2**bits - 1)``; ``x' = q*scale + zero``.
    """
    x = np.asarray(x, np.float32)
    levels = 2**bits - 1
    lo = x.min(axis=axis, keepdims=True)
    hi = x.max(axis=axis, keepdims=True)
    eps = np.finfo(scale_dtype).tiny
    scale = np.maximum((hi - lo) / np.float32(levels), eps).astype(scale_dtype).astype(np.float32)
    zero = lo.astype(scale_dtype).astype(np.float32)
    q = np.clip(np.round((x - zero) / scale), 0, levels)
    return (q * scale + zero).astype(np.float32)


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


class RefDecoder:
    """Token-by-token Llama decoding over an explicitly simulated retained set.

    Args:
      weights: internal-layout float arrays (see jaxkv.models.llama) or, with
        ``rope_layout="interleaved"``, the same with Q/K in llama2.c's pair layout.
      cfg: dict with n_heads, n_kv_heads, head_dim, theta, eps, tie.
      sink, window: StreamingLLM sizes (window None = keep everything).
      bits, group_size, residual: KIVI (bits None = full precision).
      positions: "absolute" or "cache".
    """

    def __init__(self, weights, cfg, *, sink=0, window=None, bits=None, group_size=None, residual=None,
                 positions="absolute", rope_layout="half", scale_dtype=np.float32):
        self.w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
        self.cfg = cfg
        self.sink, self.window = sink, window
        self.bits, self.g, self.r = bits, group_size, residual
        self.positions, self.layout, self.scale_dtype = positions, rope_layout, scale_dtype
        self.t = 0
        self.k, self.v = {}, {}  # position -> [L, K, H] as stored (full precision)
        self.kq, self.vq = {}, {}  # position -> [L, K, H] dequantised (flushed tokens)
        self.flushed, self.resid = [], []

    # -- the retained set, simulated --------------------------------------------------------
    def _retain(self, t):
        if t < self.sink:
            return
        if self.bits is None:
            return
        if len(self.resid) == self.r:  # lazy flush of a full residual
            self._quantize(self.resid)
            self.flushed += self.resid
            self.resid = []
        self.resid.append(t)

    def retained(self, t):
        sinks = list(range(min(self.sink, t + 1)))
        if self.bits is None:
            rest = list(range(self.sink, t + 1))
            if self.window is not None:
                rest = rest[-self.window :] if self.window else []
            return sinks, rest, []
        flushed = self.flushed[-self.window :] if self.window is not None else list(self.flushed)
        return sinks, list(self.resid), flushed

    def _quantize(self, positions):
        k = np.stack([self.k[p] for p in positions], axis=2)  # [L, K, R, H]
        v = np.stack([self.v[p] for p in positions], axis=2)
        L, K, R, H = k.shape
        kg = k.reshape(L, K, R // self.g, self.g, H)
        kd = quantize_dequantize(kg, self.bits, axis=3, scale_dtype=self.scale_dtype).reshape(L, K, R, H)
        vd = quantize_dequantize(v, self.bits, axis=3, scale_dtype=self.scale_dtype)
        for i, p in enumerate(positions):
            self.kq[p], self.vq[p] = kd[:, :, i], vd[:, :, i]

    # -- one token ------------------------------------------------------------------------------
    def step(self, token):
        """Append ``token`` at position ``self.t``; return its logits float64[V]."""
        c, w, t = self.cfg, self.w, self.t
        nh, nkv, hd = c["n_heads"], c["n_kv_heads"], c["head_dim"]
        x = w["embed"][token]
        n_layers = w["wq"].shape[0]
        self.k[t] = np.zeros((n_layers, nkv, hd))
        self.v[t] = np.zeros((n_layers, nkv, hd))
        self._retain(t)
        sinks, rest, flushed = self.retained(t)
        keys = sorted(sinks + rest + flushed)
        ranks = {p: i for i, p in enumerate(keys)}
        for l in range(n_layers):
            h = rms_norm(x, w["attn_norm"][l], c["eps"])
            q = (h @ w["wq"][l]).reshape(nh, hd)
            k = (h @ w["wk"][l]).reshape(nkv, hd)
            v = (h @ w["wv"][l]).reshape(nkv, hd)
            absolute = self.positions == "absolute"
            self.k[t][l] = rope(k, t, c["theta"], self.layout) if absolute else k
            self.v[t][l] = v
            qpos = t if absolute else ranks[t]
            qr = rope(q, qpos, c["theta"], self.layout)
            kk = np.stack([(self.kq if p in flushed else self.k)[p][l] for p in keys], axis=1)  # [K, S, H]
            vv = np.stack([(self.vq if p in flushed else self.v)[p][l] for p in keys], axis=1)
            if not absolute:
                kk = rope(kk, np.array([ranks[p] for p in keys])[None, :], c["theta"], self.layout)
            group = nh // nkv
            out = np.zeros((nh, hd))
            for head in range(nh):
                kv_head = head // group
                s = kk[kv_head] @ qr[head] / np.sqrt(hd)
                p_ = np.exp(s - s.max())
                p_ /= p_.sum()
                out[head] = p_ @ vv[kv_head]
            x = x + out.reshape(-1) @ w["wo"][l]
            h = rms_norm(x, w["mlp_norm"][l], c["eps"])
            x = x + (silu(h @ w["w_gate"][l]) * (h @ w["w_up"][l])) @ w["w_down"][l]
        x = rms_norm(x, w["final_norm"], c["eps"])
        head = w["embed"].T if c["tie"] else w["lm_head"]
        self.t += 1
        return x @ head

    def stored(self):
        """Positions held after the last step (sinks, window/residual, quantised)."""
        sinks, rest, flushed = self.retained(self.t - 1)
        return sorted(sinks + rest + flushed)
