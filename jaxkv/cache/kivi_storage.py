"""KIVI storage: bit-packed int8/int4/int2 codes behind a full-precision residual.

Source: Liu et al. 2024, "KIVI", arXiv 2402.02750, §3.2 (keys per-channel in groups of G
tokens, values per-token) and §4 (full-precision residual of R recent tokens). Semantics:
DESIGN §2 "KIVI quantisation". The kernels are :mod:`jaxkv.cache.kivi`.

Window tokens land in the cache's full-precision ring, here the *residual* of R slots.
When it is full and a row appends again, its R tokens are quantised as R/G groups and
written into the quantised ring (:class:`QuantRing`), which keeps the last W flushed
tokens and evicts whole groups; codes already stored are never re-quantised. Sinks stay
in full precision (float32).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from jaxkv.cache import kivi
from jaxkv.cache.ring import write_ring
from jaxkv.cache.rotation import hadamard, rotate
from jaxkv.cache.storage import FLOAT_DTYPES, Leaving, Segment, Storage, as_container
from jaxkv.errors import JaxkvError

BITS = {"int8": 8, "int4": 4, "int2": 2}


@struct.dataclass
class QuantRing:
    """KIVI storage of the last W flushed window tokens (KIVI §3.2, §4).

    A quantised side has codes, scales and zeros (its float leaf is None); a float side of
    a mixed spec has its float leaf (the codes, scales and zeros are None).

    Attributes:
      k_codes: uint8[L, B, K, W, H/cpb], keys quantised per-channel, codes packed along H.
      k_scale, k_zero: [L, B, K, W/G, H] (scale_dtype; float8 held as int8 bit patterns, see
        :meth:`KiviStorage.scales`), one pair per channel and group of G tokens.
      v_codes: uint8[L, B, K, W, H/cpb], values quantised per-token.
      v_scale, v_zero: [L, B, K, W] (scale_dtype), one pair per token.
      pos: int32[B, W], absolute position per token slot, -1 = empty (None in a per-layer view).
      k_float, v_float: [L, B, K, W, H] keys/values of a float side (fp32, fp16, or bf16 held
        as int16 bit patterns), else None.
    """

    k_codes: jax.Array | None
    k_scale: jax.Array | None
    k_zero: jax.Array | None
    v_codes: jax.Array | None
    v_scale: jax.Array | None
    v_zero: jax.Array | None
    pos: jax.Array | None
    k_float: jax.Array | None = None
    v_float: jax.Array | None = None


_FLOAT8 = {"float8_e4m3fn": (4, 3, 7), "float8_e5m2": (5, 2, 15)}  # exponent bits, mantissa bits, bias


def float8_bits_to_float32(bits, dtype: str):
    """float32 values of float8 ``dtype`` numbers held as int8 bit patterns, by integer arithmetic
    (no NaN or inf: scales and zeros never hold them). XLA CPU emulates a float8 conversion with
    scalar code, and a fusion holding one is not vectorised: in a decode step that dequantises
    and rotates pre-RoPE keys that made the step 2x slower (SmolLM2, sink 4 + window 992: 61 against
    28 ms/token).

    Args:
      bits: int8 bit patterns, any shape. dtype: ``float8_e4m3fn`` or ``float8_e5m2``.
    Returns:
      float32 of ``bits``' shape."""
    e_bits, m_bits, bias = _FLOAT8[dtype]
    u = bits.astype(jnp.int32) & 0xFF
    sign = (u >> 7) << 31
    e = (u >> m_bits) & ((1 << e_bits) - 1)
    m = u & ((1 << m_bits) - 1)
    normal = lax.bitcast_convert_type(sign | ((e - bias + 127) << 23) | (m << (23 - m_bits)), jnp.float32)
    tiny = m.astype(jnp.float32) * np.float32(2.0 ** (1 - bias - m_bits))  # subnormal: m * 2**(1 - bias - m_bits)
    return jnp.where(e == 0, jnp.where(sign != 0, -tiny, tiny), normal)


_GROUP_LEAVES = ("k_scale", "k_zero")  # one slot per group of G tokens; every other leaf: one per token


@dataclasses.dataclass(frozen=True)
class KiviStorage(Storage):
    """KIVI codes of ``bits`` per element (``kind`` int8|int4|int2), group size G, residual R;
    keys and values each with their own mode when ``value_kind`` is set.

    Attributes:
      kind: the keys' mode, and the values' unless ``value_kind`` is set (int8|int4|int2, or
        fp32|fp16|bf16 beside quantised values).
      group_size: G, tokens per per-channel key group. residual: R, a multiple of G.
      scale_dtype: storage dtype of scales and zeros (arithmetic is always float32).
      value_kind: the values' mode when it differs from ``kind`` (None: ``kind``'s).
      residual_dtype: float dtype of the sinks and the residual (float32, float16, bfloat16).
      rotate_keys, rotate_values: quantise ``x @ M`` instead of ``x`` for the keys (values), M
        the orthonormal Hadamard matrix of the head (:mod:`jaxkv.cache.rotation`; a quantised
        side only, keys after RoPE only); attention folds M into its read.
      codebook: the code levels of the quantised sides, ``uniform`` (KIVI) or ``normal``
        (:func:`jaxkv.cache.kivi.normal_codebook`; int4/int2 sides).
      clip: choose each group's range by a clipping search (:data:`jaxkv.cache.kivi.CLIP_RANGES`)
        instead of its min and max; the codes are read as before.
    """

    kind: str = "int4"
    group_size: int = 32
    residual: int = 128
    scale_dtype: str = "float16"
    value_kind: str | None = None
    residual_dtype: str = "float32"
    rotate_keys: bool = False
    rotate_values: bool = False
    codebook: str = "uniform"
    clip: bool = False

    ring_group = "residual"

    @property
    def modes(self) -> tuple:
        """``(keys' mode, values' mode)``."""
        return self.kind, self.value_kind or self.kind

    @property
    def key_bits(self) -> int | None:
        """Bits per key code (None: the keys are stored as floats)."""
        return BITS.get(self.modes[0])

    @property
    def value_bits(self) -> int | None:
        """Bits per value code (None: the values are stored as floats)."""
        return BITS.get(self.modes[1])

    @property
    def bits(self) -> int:
        """Bits per code of keys and values alike.

        Raises:
          JaxkvError: keys and values of different precision (use :attr:`key_bits`, :attr:`value_bits`).
        """
        if self.key_bits != self.value_bits:
            raise JaxkvError(
                f"the cache stores keys as {self.modes[0]} and values as {self.modes[1]}: "
                "ask for key_bits or value_bits"
            )
        return self.key_bits

    @property
    def float_dtype(self):
        return jnp.dtype(self.residual_dtype)

    @property
    def flush(self) -> int:
        return self.residual

    def ring_slots(self, policy) -> int:
        return self.residual

    def store_slots(self, policy) -> int:
        if policy.bounded:
            return policy.window
        # lazy flush: after the last admitted position max_len - 1, R * floor((max_len - 1) / R)
        # tokens have been flushed, the rest sit in the residual
        return self.residual * max(1, (policy.max_len - 1) // self.residual)

    def window_for(self, retained: int) -> int:
        """The residual counts towards the retained tokens; the window is whole groups."""
        window = retained - self.residual
        return window - window % self.group_size

    def create_store(self, policy, *, lbk: tuple, head_dim: int, batch: int) -> QuantRing:
        for mode, bits in zip(self.modes, (self.key_bits, self.value_bits)):
            if bits is not None and head_dim % (8 // bits):
                raise JaxkvError(f"head_dim={head_dim} is not a multiple of {8 // bits}, the {mode} codes per byte")
        if self.rotate_keys or self.rotate_values:
            hadamard(head_dim)  # refuses a head_dim that is not a power of two
        w, g, sdt = self.store_slots(policy), self.group_size, jnp.dtype(self.scale_dtype)
        leaves = {}
        if self.key_bits is None:
            leaves.update(k_float=as_container(jnp.zeros(lbk + (w, head_dim)), FLOAT_DTYPES[self.modes[0]]))
        else:
            leaves.update(
                k_codes=jnp.zeros(lbk + (w, head_dim * self.key_bits // 8), jnp.uint8),
                k_scale=self._held(jnp.ones(lbk + (w // g, head_dim), sdt)),
                k_zero=self._held(jnp.zeros(lbk + (w // g, head_dim), sdt)),
            )
        if self.value_bits is None:
            leaves.update(v_float=as_container(jnp.zeros(lbk + (w, head_dim)), FLOAT_DTYPES[self.modes[1]]))
        else:
            leaves.update(
                v_codes=jnp.zeros(lbk + (w, head_dim * self.value_bits // 8), jnp.uint8),
                v_scale=self._held(jnp.ones(lbk + (w,), sdt)),
                v_zero=self._held(jnp.zeros(lbk + (w,), sdt)),
            )
        return QuantRing(
            **{name: leaves.get(name) for name in QuantRing.__dataclass_fields__ if name != "pos"},
            pos=jnp.full((batch, w), -1, jnp.int32),
        )

    @property
    def _coding(self) -> dict:
        """The quantisers' storage arguments: scale dtype, codebook, clipping search."""
        clip = kivi.CLIP_RANGES[self.codebook] if self.clip else None
        return dict(scale_dtype=self.scale_dtype, codebook=self.codebook, clip=clip)

    def _held(self, x):
        """Scales or zeros as the store holds them: float8 as int8 bit patterns (XLA CPU converts a
        whole float8 operand to float32 for a slice or an update, as it does bfloat16's: measured, a
        sink 4 + window 992 SmolLM2 cache of pre-RoPE keys decoded 2x slower), any other dtype as is."""
        return lax.bitcast_convert_type(x, jnp.int8) if x.dtype.itemsize == 1 else x

    def scales(self, *held) -> list:
        """Scales or zeros as the store holds them (:meth:`_held`) as float arrays for the kernels:
        float8 ones as float32 (exact), any other as stored."""
        return [float8_bits_to_float32(x, self.scale_dtype) if x.dtype == jnp.int8 else x for x in held]

    def _encode(self, k, v) -> dict:
        """The store leaves (by name) of R residual keys/values ``[..., R, H]``: codes, scales
        and zeros of a quantised side, floats of a float side."""
        out = {}
        if self.rotate_keys:
            k = rotate(k, jnp.asarray(hadamard(k.shape[-1])))
        if self.rotate_values:
            v = rotate(v, jnp.asarray(hadamard(v.shape[-1])))
        if self.key_bits is None:
            out["k_float"] = as_container(k, FLOAT_DTYPES[self.modes[0]])
        else:
            qk = kivi.quantize_keys(k, bits=self.key_bits, group_size=self.group_size, **self._coding)
            out.update(k_codes=qk.codes, k_scale=self._held(qk.scale), k_zero=self._held(qk.zero))
        if self.value_bits is None:
            out["v_float"] = as_container(v, FLOAT_DTYPES[self.modes[1]])
        else:
            qv = kivi.quantize_values(v, bits=self.value_bits, **self._coding)
            out.update(v_codes=qv.codes, v_scale=self._held(qv.scale), v_zero=self._held(qv.zero))
        return out

    def flush_ring(self, cache, n):
        """KIVI lazy flush: rows about to append to a full residual quantise it first.

        The residual's R tokens become R/G groups in the quantised ring (evicting the
        oldest whole groups) and its slots are emptied.
        """
        sink, r, g = cache.policy.sink, self.residual, self.group_size
        u0 = cache.length - sink
        flush = (n > 0) & (u0 > 0) & (u0 % r == 0)
        q = cache.quant
        ring_k, ring_v = self.read(cache.ring_k), self.read(cache.ring_v)

        # quantise only when some row flushes; the (small, R-token) result is then written
        # in place with a per-row count of 0 or R, so no step copies the quantised ring
        shapes = jax.eval_shape(self._encode, ring_k, ring_v)
        new = lax.cond(
            jnp.any(flush),
            self._encode,
            lambda k, v: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
            ring_k,
            ring_v,
        )
        start = (u0 - r) % q.pos.shape[1]  # slot of the residual's first token
        count = jnp.where(flush, r, 0)
        tok = dict(batch_axis=1, slot_axis=3, batch_parallel=cache.batch_sharded)
        written = {
            name: write_ring(
                getattr(q, name), x, *((start // g, count // g) if name in _GROUP_LEAVES else (start, count)), **tok
            )
            for name, x in new.items()
        }
        pos_axes = dict(batch_axis=0, slot_axis=1, batch_parallel=cache.batch_sharded)
        quant = q.replace(**written, pos=write_ring(q.pos, cache.ring_pos, start, count, **pos_axes))
        keep = cache.keep
        if keep is not None and keep.store_score is not None:  # the residual's scores move with its tokens
            keep = keep.replace(store_score=write_ring(keep.store_score, keep.ring_score, start, count, **pos_axes))
        return cache.replace(quant=quant, ring_pos=jnp.where(flush[:, None], -1, cache.ring_pos), keep=keep)

    def leaving(self, cache, n, chunk: int):
        """The tokens a flush in this call evicts from the quantised ring: the R oldest flushed
        tokens (whole groups) in the slots the residual is about to take, dequantised (a rotated
        side rotated back). Returns a :class:`~jaxkv.cache.storage.Leaving` with ``store`` the
        tier's scores of the quantised slots."""
        q, r, g = cache.quant, self.residual, self.group_size
        u0 = cache.length - cache.policy.sink
        flush = (n > 0) & (u0 > 0) & (u0 % r == 0)
        w = q.pos.shape[1]
        slots = ((u0 - r) % w)[:, None] + jnp.arange(r, dtype=jnp.int32)[
            None
        ]  # in range: W is a multiple of R's groups
        slots = slots % w
        pos = jnp.where(flush[:, None], jnp.take_along_axis(q.pos, slots, axis=1), -1)
        tok = lambda x: jnp.take_along_axis(x, slots[None, :, None, :, None], axis=3)  # noqa: E731
        groups = slots[:, ::g] // g
        grp = lambda x: jnp.take_along_axis(x, groups[None, :, None, :, None], axis=3)  # noqa: E731
        if self.key_bits is None:
            k = self.read(tok(q.k_float)).astype(jnp.float32)
        else:
            k = kivi.dequantize_keys(
                kivi.QuantizedKeys(tok(q.k_codes), *self.scales(grp(q.k_scale), grp(q.k_zero))),
                bits=self.key_bits,
                group_size=g,
                codebook=self.codebook,
            )
        if self.value_bits is None:
            v = self.read(tok(q.v_float)).astype(jnp.float32)
        else:
            per = lambda x: jnp.take_along_axis(x, slots[None, :, None, :], axis=3)  # noqa: E731
            v = kivi.dequantize_values(
                kivi.QuantizedValues(tok(q.v_codes), *self.scales(per(q.v_scale), per(q.v_zero))),
                bits=self.value_bits,
                codebook=self.codebook,
            )
        if self.rotate_keys:
            k = rotate(k, jnp.asarray(hadamard(k.shape[-1])).T)
        if self.rotate_values:
            v = rotate(v, jnp.asarray(hadamard(v.shape[-1])).T)
        return Leaving(k, v, pos, slots, store=None if cache.keep is None else cache.keep.store_score)

    def segments(self, store: QuantRing, pos, dtype) -> list:
        """The quantised ring of one layer as channel blocks (KIVI §3.2): one :class:`Segment`
        whose keys and values are lists of 1 (int8, a float side) or ``8 // bits`` arrays
        ``dtype[B, K, W, H / n]`` (see ``blocks`` of :func:`jaxkv.cache.kivi.dequantize_affine`),
        with the Hadamard matrices a rotated side was stored by."""
        if self.key_bits is None:
            k = [self.read(store.k_float).astype(dtype)]
        else:
            k = kivi.dequantize_keys(
                kivi.QuantizedKeys(store.k_codes, *self.scales(store.k_scale, store.k_zero)),
                bits=self.key_bits,
                group_size=self.group_size,
                dtype=dtype,
                blocks=True,
                codebook=self.codebook,
            )
        if self.value_bits is None:
            v = [self.read(store.v_float)]
        else:
            v = kivi.dequantize_values(
                kivi.QuantizedValues(store.v_codes, *self.scales(store.v_scale, store.v_zero)),
                bits=self.value_bits,
                dtype=dtype,
                blocks=True,
                codebook=self.codebook,
            )
        rotated = self.rotate_keys or self.rotate_values
        rotation = jnp.asarray(hadamard(sum(block.shape[-1] for block in v))) if rotated else None
        return [
            Segment(
                k,
                v,
                pos,
                key_rotation=rotation if self.rotate_keys else None,
                value_rotation=rotation if self.rotate_values else None,
            )
        ]

    def memory_groups(self, store: QuantRing) -> list:
        """Codes, scales and zeros of the quantised sides; a float side's window tokens as ``window``."""

        def present(*names):
            return [getattr(store, name) for name in names if getattr(store, name) is not None]

        groups = [
            ("codes", present("k_codes", "v_codes"), store.pos),
            ("scales_zeros", present("k_scale", "k_zero", "v_scale", "v_zero"), store.pos),
            ("window", present("k_float", "v_float"), store.pos),
        ]
        return [group for group in groups if group[1]]

    def describe(self) -> str:
        k, v = self.modes
        extra = "" if self.residual_dtype == "float32" else f", residual {self.residual_dtype}"
        rotated = [side for side, on in (("K", self.rotate_keys), ("V", self.rotate_values)) if on]
        extra += f", Hadamard {'+'.join(rotated)}" if rotated else ""
        extra += "" if self.scale_dtype == "float16" else f", scales {self.scale_dtype}"
        extra += ", normal codebook" if self.codebook == "normal" else ""
        extra += ", clipped ranges" if self.clip else ""
        return f"{k if k == v else f'K {k} V {v}'} (G={self.group_size}, R={self.residual}{extra})"
