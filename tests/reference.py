"""NumPy reference implementations used by the tests (independent of jaxkv's JAX code).

* :func:`rope` -- RoPE in either layout ("half" = rotate-half, "interleaved" = llama2.c pairs).
* :func:`ref_quantize` / :func:`ref_dequantize` / :func:`ref_pack` -- KIVI affine quantisation
  with the directed rounding of jaxkv/cache/kivi.py (written separately from the kernels:
  ``np.nextafter`` for the stored scale/zero, a plain loop for packing, float64 for
  dequantisation); :func:`quantize_dequantize` composes them for :class:`RefDecoder`.
* :class:`RefDecoder` -- a Llama decoder run one token at a time over an explicit
  retained set: the set of DESIGN §2 is *simulated* (sinks, window, lazy residual flush,
  last W flushed tokens), never computed from a closed formula, and ranks for
  ``positions="cache"`` are the indices in the sorted retained set.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

F32 = np.float32


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


# ------------------------------------------------------------------ KIVI (the one NumPy reference)

# numpy types of jaxkv's float dtype names (bfloat16 from ml_dtypes, as in JAX)
NP_DTYPES = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
}

# Lloyd-Max levels of N(0, 1) (J. Max, "Quantizing for minimum distortion", IRE Trans. IT-6, 1960,
# Table I, 4 and 16 levels; the positive half, ascending)
MAX_1960 = {
    2: (0.4528, 1.510),
    4: (0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733),
}


def ref_round(x, dtype, *, up):
    """float32 -> ``dtype``, rounded toward +inf (``up``) or -inf, via ``np.nextafter``."""
    y = x.astype(dtype)
    if np.dtype(dtype) == np.float32:
        return y
    wrong = (y.astype(F32) < x) if up else (y.astype(F32) > x)
    top = float(ml_dtypes.finfo(dtype).max)  # float8_e4m3fn has no inf
    target = np.array(top if up else -top, dtype=dtype)
    return np.where(wrong, np.nextafter(y, target), y)


def ref_quantize(x, *, bits, axis, group=None, scale_dtype=np.float32):
    """KIVI affine quantisation with the directed rounding of jaxkv/cache/kivi.py (numerical
    decisions 1-4), in float32: unpacked codes ``uint8`` (x's shape) and the *stored*
    scale/zero (``scale_dtype``, x's shape with ``axis`` replaced by its ``x.shape[axis] //
    group`` groups; ``group=None`` = the whole axis).

    ``zero = min`` rounded *down* and ``scale = (max - zero) / levels`` rounded *up* into
    ``scale_dtype`` (so ``[zero, zero + levels * scale]`` covers the group), both clamped to
    the finite range of ``scale_dtype`` and the scale to at least ``eps = max(tiny,
    2**-100)``; the codes ``clip(round((x - zero) / scale), 0, levels)`` come from the stored
    values, with the division written as the kernels write it (``(x/4 - zero/4) * (4/scale)``).
    """
    x = np.asarray(x).astype(F32)
    ax = axis % x.ndim
    group = x.shape[ax] if group is None else group
    n = x.shape[ax] // group
    xg = x.reshape(x.shape[:ax] + (n, group) + x.shape[ax + 1 :])
    lo = xg.min(axis=ax + 1, keepdims=True)
    hi = xg.max(axis=ax + 1, keepdims=True)
    levels = 2**bits - 1
    sdt = NP_DTYPES[np.dtype(scale_dtype).name]
    fi = ml_dtypes.finfo(sdt)
    smax, eps = F32(fi.max), F32(max(float(fi.tiny), 2.0**-100))
    zero = ref_round(np.clip(lo, -smax, smax), sdt, up=False)
    zf = zero.astype(F32)
    scale = np.clip((hi * F32(0.5) - zf * F32(0.5)) * F32(2.0 / levels), eps, smax)
    scale = ref_round(scale, sdt, up=True)
    sf = scale.astype(F32)
    t = (xg * F32(0.25) - zf * F32(0.25)) * (F32(4.0) / sf)
    q = np.clip(np.round(t), 0, levels).astype(np.uint8).reshape(x.shape)
    return q, scale.squeeze(ax + 1), zero.squeeze(ax + 1)


CLIP_RANGES = {"uniform": (1.0, 0.9, 0.8, 0.7, 0.6, 0.5), "normal": (1.0, 0.85, 1.15, 0.7, 1.3)}
"""The candidate ranges of jaxkv's clipping search (jaxkv/cache/kivi.py), by codebook."""


def lloyd_max(bits, iterations=2000):
    """The ``2**bits`` Lloyd-Max levels of N(0, 1), float64, ascending: Lloyd's iteration from
    levels spread evenly over [-3, 3], in NumPy (cells' centroids from the normal's pdf and cdf)."""
    erf = np.vectorize(math.erf)
    pdf = lambda t: np.exp(-np.square(t) / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda t: 0.5 * (1 + erf(t / math.sqrt(2)))  # noqa: E731
    n = 2**bits
    levels = -3 + 6 * (np.arange(n) + 0.5) / n
    for _ in range(iterations):
        edges = np.concatenate([[-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]])
        a, b = edges[:-1], edges[1:]
        levels = (pdf(a) - pdf(b)) / (cdf(b) - cdf(a))
    return levels


def ref_search(x, *, bits, axis, group=None, scale_dtype=np.float32, codebook="uniform", ranges=(1.0,), levels=None):
    """The clipping search and the normal codebook of jaxkv/cache/kivi.py, written from their
    definitions: per group, of the candidate ranges (``uniform``: ``[min, max]`` shrunk towards the
    group's mean by each fraction; ``normal``: the standard deviation times each), the one of least
    squared error of the reconstruction from the *stored* scale and zero (directed rounding as
    :func:`ref_quantize`, the normal codebook's zero the mean rounded to nearest); ``normal`` codes
    index the Lloyd-Max levels of N(0, 1) (``levels``, else :data:`MAX_1960`'s). Returns ``(codes,
    scale, zero, levels)`` (``levels`` None for ``uniform``)."""
    x = np.asarray(x).astype(F32)
    ax = axis % x.ndim
    group = x.shape[ax] if group is None else group
    n = x.shape[ax] // group
    xg = x.reshape(x.shape[:ax] + (n, group) + x.shape[ax + 1 :])
    sdt = NP_DTYPES[np.dtype(scale_dtype).name]
    fi = ml_dtypes.finfo(sdt)
    smax, eps = F32(fi.max), F32(max(float(fi.tiny), 2.0**-100))
    mean = xg.mean(axis=ax + 1, keepdims=True, dtype=F32)
    lo, hi = xg.min(axis=ax + 1, keepdims=True), xg.max(axis=ax + 1, keepdims=True)
    if codebook == "normal":
        half = np.asarray(MAX_1960[bits], F32)
        levels = np.concatenate([-half[::-1], half]) if levels is None else np.asarray(levels, F32)
        zero = np.clip(mean, -smax, smax).astype(sdt)
        std = np.sqrt(np.mean(np.square(xg - zero.astype(F32)), axis=ax + 1, keepdims=True, dtype=F32))
    best = None
    for c in ranges:
        if codebook == "normal":
            scale = ref_round(np.clip(std * F32(c), eps, smax).astype(F32), sdt, up=True)
            zf, sf = zero.astype(F32), scale.astype(F32)
            t = (xg * F32(0.25) - zf * F32(0.25)) * (F32(4.0) / sf)
            q = np.argmin(np.abs(t[..., None] - levels), axis=-1)  # the nearest level
            rec = levels[q] * sf + zf
        else:
            lo_c = lo if c == 1.0 else mean + F32(c) * (lo - mean)
            hi_c = hi if c == 1.0 else mean + F32(c) * (hi - mean)
            zero_c = ref_round(np.clip(lo_c, -smax, smax), sdt, up=False)
            zf = zero_c.astype(F32)
            scale = ref_round(
                np.clip((hi_c * F32(0.5) - zf * F32(0.5)) * F32(2.0 / (2**bits - 1)), eps, smax), sdt, up=True
            )
            sf = scale.astype(F32)
            q = np.clip(np.round((xg * F32(0.25) - zf * F32(0.25)) * (F32(4.0) / sf)), 0, 2**bits - 1)
            rec = q * sf + zf
        err = np.sum(np.square(rec - xg), axis=ax + 1, keepdims=True)
        candidate = (err, zero if codebook == "normal" else zero_c, scale, q)
        best = candidate if best is None else tuple(np.where(err < best[0], *pair) for pair in zip(candidate, best))
    _, zero, scale, q = best
    return q.astype(np.uint8).reshape(x.shape), scale.squeeze(ax + 1), zero.squeeze(ax + 1), levels


def ref_dequantize(q, scale, zero, *, axis, dtype=np.float32, levels=None):
    """float64 ``q * scale + zero`` (scale/zero as :func:`ref_quantize` returns them; ``levels``:
    ``levels[q] * scale + zero``), saturated into ``dtype``'s finite range and cast."""
    ax = axis % q.ndim
    n = scale.shape[ax]
    g = q.shape[ax] // n
    qg = (q.astype(np.float64) if levels is None else levels[q].astype(np.float64)).reshape(
        q.shape[:ax] + (n, g) + q.shape[ax + 1 :]
    )
    s = np.expand_dims(scale.astype(np.float64), ax + 1)
    z = np.expand_dims(zero.astype(np.float64), ax + 1)
    x = (qg * s + z).reshape(q.shape)
    odt = NP_DTYPES[np.dtype(dtype).name]
    m = float(ml_dtypes.finfo(odt).max)
    return np.clip(x, -m, m).astype(odt)


# split-half layout: channel block j (of H / cpb contiguous channels) sits at this bit offset
BLOCK_OFFSETS = {2: [0, 4], 4: [0, 4, 2, 6], 1: [0]}


def ref_pack(codes, bits):
    """Pack ``uint8[..., H]`` codes into ``uint8[..., H // cpb]`` (split-half layout), with a plain loop."""
    cpb = 8 // bits
    n = codes.shape[-1] // cpb
    out = np.zeros(codes.shape[:-1] + (n,), np.uint8)
    for c in range(codes.shape[-1]):
        out[..., c % n] |= (codes[..., c] << BLOCK_OFFSETS[cpb][c // n]).astype(np.uint8)
    return out


def quantize_dequantize(x, bits, axis, scale_dtype=np.float32, coding=None):
    """KIVI fake-quantisation of ``x`` with one group over ``axis``: :func:`ref_dequantize`
    of :func:`ref_quantize` (float32 result); ``coding``: :func:`ref_search`'s ``codebook``,
    ``ranges`` and ``levels`` instead."""
    if coding:
        q, scale, zero, levels = ref_search(x, bits=bits, axis=axis, scale_dtype=scale_dtype, **coding)
        return ref_dequantize(q, scale, zero, axis=axis, levels=levels)
    q, scale, zero = ref_quantize(x, bits=bits, axis=axis, scale_dtype=scale_dtype)
    return ref_dequantize(q, scale, zero, axis=axis)


def sylvester(n):
    """float64[n, n]: the orthonormal Hadamard matrix of order n (a power of two), H_2n = [[H, H], [H, -H]]."""
    m = np.ones((1, 1))
    while m.shape[0] < n:
        m = np.kron(np.array([[1.0, 1.0], [1.0, -1.0]]), m)
    return m / np.sqrt(n)


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
      bits, group_size, residual: KIVI (bits None = full precision). ``bits`` is one int for keys
        and values, or a pair ``(keys, values)`` whose entries are ints (KIVI bits) or NumPy
        float dtypes (a float side of a mixed cache: flushed tokens rounded to that dtype).
      scale_dtype: KIVI's scale/zero storage dtype (rounded as jaxkv rounds them: :func:`ref_quantize`).
      residual_dtype: None (sinks and residual in full precision), or the NumPy float dtype
        every stored key/value (sinks, residual, before any flush) is rounded to; a token
        attends to its own key and value unrounded, as jaxkv attends to a chunk's own.
      positions: "absolute" or "cache".
      pre_rope_keys: in "absolute" mode, store keys before RoPE and rotate every read key at
        its absolute position (a no-op in "cache" mode, which always does).
      hadamard: ``(keys, values)`` bools: quantise that side as ``x @ M`` and read it back as
        ``dequantise(...) @ M.T``, M the orthonormal Sylvester Hadamard matrix (built here by
        Kronecker products, not with jaxkv's code).
      codebook, clip, levels: the window's codes by :func:`ref_search` (``clip``: its candidate
        ranges; ``levels``: a normal codebook's levels by bits), else :func:`ref_quantize`'s.
      keep, keep_rule, keep_bits: a keep tier of ``keep`` slots for tokens leaving the window
        (float window only), simulated slot by slot: a leaving token takes the first empty
        slot, else the first slot of the lowest priority if its own is higher; priority =
        position (``recent``), attention mass summed over every query head and layer since it
        was written (``h2o``), or from the latest step (``tova``; a leaving token carries the
        mass of the last step that saw it). ``keep_bits``: per-token quantised tier (keys and
        values alike, over H), else the stored floats; ``keep_rotate``: (keys, values) of a
        quantised tier quantised as ``x @ M`` and read as ``dequantise(.) @ M.T``.
    """

    def __init__(
        self,
        weights,
        cfg,
        *,
        sink=0,
        window=None,
        bits=None,
        group_size=None,
        residual=None,
        positions="absolute",
        rope_layout="half",
        scale_dtype=np.float32,
        residual_dtype=None,
        pre_rope_keys=False,
        hadamard=(False, False),
        keep=0,
        keep_rule="recent",
        keep_bits=None,
        keep_rotate=(False, False),
        codebook="uniform",
        clip=None,
        levels=None,
    ):
        self.w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
        self.codebook, self.clip, self.levels = codebook, clip, levels
        self.cfg = cfg
        self.sink, self.window = sink, window
        self.bits, self.g, self.r = bits, group_size, residual
        self.positions, self.layout, self.scale_dtype = positions, rope_layout, scale_dtype
        self.residual_dtype = residual_dtype
        self.pre_rope_keys, self.hadamard = pre_rope_keys, hadamard
        self.t = 0
        self.k, self.v = {}, {}  # position -> [L, K, H] as stored (full precision)
        self.kq, self.vq = {}, {}  # position -> [L, K, H] dequantised (flushed tokens)
        self.flushed, self.resid = [], []
        self.keep, self.keep_rule, self.keep_bits, self.keep_rotate = keep, keep_rule, keep_bits, keep_rotate
        self.slots = [None] * keep  # the keep tier: a position per slot
        self.slot_score = [0.0] * keep
        self.ring_score = {}  # window position -> score
        self.kt, self.vt = {}, {}  # position -> [L, K, H] as the tier holds it

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
        m = sylvester(H)
        k, v = (x @ m if rotated else x for x, rotated in zip((k, v), self.hadamard))
        kb, vb = self.bits if isinstance(self.bits, tuple) else (self.bits, self.bits)
        kg = k.reshape(L, K, R // self.g, self.g, H)
        if isinstance(kb, int):
            kd = quantize_dequantize(kg, kb, axis=3, scale_dtype=self.scale_dtype, coding=self.coding(kb)).reshape(
                L, K, R, H
            )
        else:  # a float side: the stored floats
            kd = k.astype(kb).astype(np.float64)
        vd = (
            quantize_dequantize(v, vb, axis=3, scale_dtype=self.scale_dtype, coding=self.coding(vb))
            if isinstance(vb, int)
            else v.astype(vb).astype(np.float64)
        )
        kd, vd = (x @ m.T if rotated else x for x, rotated in zip((kd, vd), self.hadamard))
        for i, p in enumerate(positions):
            self.kq[p], self.vq[p] = kd[:, :, i], vd[:, :, i]

    def coding(self, bits):
        """:func:`quantize_dequantize`'s ``coding`` of the window's ``bits``-bit codes (None: plain KIVI)."""
        if self.codebook == "uniform" and self.clip is None:
            return None
        levels = self.levels[bits] if self.codebook == "normal" else None
        return dict(codebook=self.codebook, ranges=self.clip or (1.0,), levels=levels)

    def _stored(self, x):
        """``x`` as the sinks and residual hold it (rounded to ``residual_dtype``)."""
        return x if self.residual_dtype is None else x.astype(self.residual_dtype).astype(np.float64)

    # -- one token ------------------------------------------------------------------------------
    def _admit(self, entries):
        """Admit position ``self.t`` with zero K/V rows ``[entries, K, H]`` (filled by the
        caller) into the simulated retained set; returns ``(keys, ranks, flushed)``: the
        sorted retained positions, their ranks, the quantised ones among them."""
        t, c = self.t, self.cfg
        self.k[t] = np.zeros((entries, c["n_kv_heads"], c["head_dim"]))
        self.v[t] = np.zeros((entries, c["n_kv_heads"], c["head_dim"]))
        window_before = set(sum(self.retained(t - 1)[1:], [])) if t else set()
        self._retain(t)
        sinks, rest, flushed = self.retained(t)
        if self.keep:  # tokens of the window that this step's window no longer holds
            self._leave(sorted(window_before - set(rest + flushed) - set(sinks)))
        self.window_now = [p for p in rest + flushed if p >= self.sink]
        keys = sorted(sinks + rest + flushed + self.kept())
        return keys, {p: i for i, p in enumerate(keys)}, flushed

    def kept(self):
        return [p for p in self.slots if p is not None]

    def _leave(self, leaving):
        """Tokens leaving the window this step (oldest first) compete for the keep tier."""
        rule = self.keep_rule
        for p in leaving:
            own = p if rule == "recent" else self.ring_score.pop(p)
            empty = [i for i, q in enumerate(self.slots) if q is None]
            if empty:
                slot = empty[0]
            else:
                pri = [q if rule == "recent" else sc for q, sc in zip(self.slots, self.slot_score)]
                slot = int(np.argmin(pri))
                if not own > pri[slot]:
                    continue
            old = self.slots[slot]
            if old is not None:
                del self.kt[old], self.vt[old]
            self.slots[slot], self.slot_score[slot] = p, own
            flushed = p in self.kq
            k, v = (self.kq if flushed else self.k)[p], (self.vq if flushed else self.v)[p]
            if self.keep_bits is not None:
                m = sylvester(k.shape[-1])
                k, v = (
                    quantize_dequantize(x @ m if rot else x, self.keep_bits, axis=2, scale_dtype=self.scale_dtype)
                    @ (m.T if rot else np.eye(k.shape[-1]))
                    for x, rot in zip((k, v), self.keep_rotate)
                )
            self.kt[p], self.vt[p] = self._stored(k), self._stored(v)

    def _rescore(self, window, mass):
        """After a step: the tier's and the window's scores take its attention mass."""
        if self.keep_rule not in ("h2o", "tova"):
            return
        h2o = self.keep_rule == "h2o"
        for i, p in enumerate(self.slots):
            if p is not None:
                self.slot_score[i] = self.slot_score[i] + mass[p] if h2o else mass[p]
        for p in window:
            self.ring_score[p] = self.ring_score.get(p, 0.0) + mass[p] if h2o else mass[p]

    def step(self, token):
        """Append ``token`` at position ``self.t``; return its logits float64[V]."""
        c, w, t = self.cfg, self.w, self.t
        nh, nkv, hd = c["n_heads"], c["n_kv_heads"], c["head_dim"]
        x = w["embed"][token]
        n_layers = w["wq"].shape[0]
        keys, ranks, flushed = self._admit(n_layers)
        mass = {}  # position -> attention mass received this step (all layers and query heads)
        for l in range(n_layers):
            h = rms_norm(x, w["attn_norm"][l], c["eps"])
            q = (h @ w["wq"][l]).reshape(nh, hd)
            k = (h @ w["wk"][l]).reshape(nkv, hd)
            v = (h @ w["wv"][l]).reshape(nkv, hd)
            absolute = self.positions == "absolute"
            rotate_on_read = not absolute or self.pre_rope_keys
            k = k if rotate_on_read else rope(k, t, c["theta"], self.layout)
            self.k[t][l], self.v[t][l] = self._stored(k), self._stored(v)
            qpos = t if absolute else ranks[t]
            qr = rope(q, qpos, c["theta"], self.layout)

            # the token attends to itself as computed (jaxkv: the chunk's own keys), to the rest as stored
            def held(p, floats, quantised, tier):
                return (tier if p in tier else quantised if p in flushed else floats)[p][l]  # noqa: B023 (called in this iteration)

            kk = np.stack([k if p == t else held(p, self.k, self.kq, self.kt) for p in keys], axis=1)  # [K, S, H]
            vv = np.stack([v if p == t else held(p, self.v, self.vq, self.vt) for p in keys], axis=1)
            if rotate_on_read:  # at the key's rank (cache) or its absolute position
                kk = rope(kk, np.array([p if absolute else ranks[p] for p in keys])[None, :], c["theta"], self.layout)
            group = nh // nkv
            out = np.zeros((nh, hd))
            for head in range(nh):
                kv_head = head // group
                s = kk[kv_head] @ qr[head] / np.sqrt(hd)
                p_ = np.exp(s - s.max())
                p_ /= p_.sum()
                out[head] = p_ @ vv[kv_head]
                for key, share in zip(keys, p_):
                    mass[key] = mass.get(key, 0.0) + share
            x = x + out.reshape(-1) @ w["wo"][l]
            h = rms_norm(x, w["mlp_norm"][l], c["eps"])
            x = x + (silu(h @ w["w_gate"][l]) * (h @ w["w_up"][l])) @ w["w_down"][l]
        self.last_mass = mass  # position -> attention mass of this step (SnapKV's vote, summed by the tests)
        if self.keep:
            self._rescore(self.window_now, mass)
        x = rms_norm(x, w["final_norm"], c["eps"])
        head = w["embed"].T if c["tie"] else w["lm_head"]
        self.t += 1
        return x @ head

    def stored(self):
        """Positions held after the last step (sinks, window/residual, quantised)."""
        sinks, rest, flushed = self.retained(self.t - 1)
        return sorted(sinks + rest + flushed + self.kept())


# ------------------------------------------------------------------ RefDecoder's inputs


def ref_config(config):
    """RefDecoder's ``cfg`` dict for a jaxkv :class:`LlamaConfig`."""
    return dict(
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        theta=config.rope_theta,
        eps=config.norm_eps,
        tie=config.tie_embeddings,
    )


def ref_kwargs(spec):
    """RefDecoder keyword arguments describing a CacheSpec."""
    kw = dict(sink=spec.sink, window=spec.window, positions=spec.positions, pre_rope_keys=spec.pre_rope_keys)
    if spec.keep:
        kw.update(
            keep=spec.keep,
            keep_rule=spec.keep_score,
            keep_bits=spec.retention.bits,
            keep_rotate=(spec.retention.rotate_keys, spec.retention.rotate_values),
            scale_dtype=np.dtype(spec.scale_dtype).type,
        )
    if spec.quantized:
        storage = spec.storage
        floats = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
        kb, vb = (
            b if b is not None else floats[m] for b, m in zip((storage.key_bits, storage.value_bits), spec.kv_modes)
        )
        kw.update(
            bits=kb if kb == vb else (kb, vb),
            group_size=spec.group_size,
            residual=spec.residual,
            scale_dtype=np.dtype(spec.scale_dtype).type,
            residual_dtype=None if spec.residual_dtype == "float32" else NP_DTYPES[spec.residual_dtype],
            hadamard=(storage.rotate_keys, storage.rotate_values),
            codebook=spec.codebook,
            clip=CLIP_RANGES[spec.codebook] if spec.clip else None,
            levels={b: lloyd_max(b) for b in (4, 2)},
        )
    return kw


def read_llama2c_raw(path):
    """Parse a llama2.c legacy checkpoint with numpy alone (not jaxkv's loader): returns the
    reference's weights with Q/K kept in llama2.c's interleaved-pair layout."""
    raw = np.fromfile(path, dtype=np.int32, count=7)
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = (int(x) for x in raw)
    f = np.fromfile(path, dtype=np.float32, offset=28)
    head = dim // n_heads
    out, i = {}, 0

    def take(*shape):
        nonlocal i
        n = int(np.prod(shape))
        a = f[i : i + n].reshape(shape)
        i += n
        return a

    out["embed"] = take(vocab, dim)
    out["attn_norm"] = take(n_layers, dim)
    out["wq"] = take(n_layers, dim, dim).transpose(0, 2, 1)
    out["wk"] = take(n_layers, n_kv * head, dim).transpose(0, 2, 1)
    out["wv"] = take(n_layers, n_kv * head, dim).transpose(0, 2, 1)
    out["wo"] = take(n_layers, dim, dim).transpose(0, 2, 1)
    out["mlp_norm"] = take(n_layers, dim)
    out["w_gate"] = take(n_layers, hidden, dim).transpose(0, 2, 1)
    out["w_down"] = take(n_layers, dim, hidden).transpose(0, 2, 1)
    out["w_up"] = take(n_layers, hidden, dim).transpose(0, 2, 1)
    out["final_norm"] = take(dim)
    cfg = dict(n_heads=n_heads, n_kv_heads=n_kv, head_dim=head, theta=10000.0, eps=1e-5, tie=True)
    return out, cfg
