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
from flax import struct
from jax import lax

from jaxkv.cache import kivi
from jaxkv.cache.ring import write_ring
from jaxkv.cache.storage import Storage
from jaxkv.errors import JaxkvError

BITS = {"int8": 8, "int4": 4, "int2": 2}


@struct.dataclass
class QuantRing:
    """KIVI storage of the last W flushed window tokens (KIVI §3.2, §4).

    Attributes:
      k_codes: uint8[L, B, K, W, H/cpb], keys quantised per-channel, codes packed along H.
      k_scale, k_zero: [L, B, K, W/G, H] (scale_dtype), one pair per channel and group of G tokens.
      v_codes: uint8[L, B, K, W, H/cpb], values quantised per-token.
      v_scale, v_zero: [L, B, K, W] (scale_dtype), one pair per token.
      pos: int32[B, W], absolute position per token slot, -1 = empty (None in a per-layer view).
    """

    k_codes: jax.Array
    k_scale: jax.Array
    k_zero: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_zero: jax.Array
    pos: jax.Array | None


@dataclasses.dataclass(frozen=True)
class KiviStorage(Storage):
    """KIVI codes of ``bits`` per element (``kind`` int8|int4|int2), group size G, residual R.

    Attributes:
      group_size: G, tokens per per-channel key group. residual: R, a multiple of G.
      scale_dtype: storage dtype of scales and zeros (arithmetic is always float32).
    """

    kind: str = "int4"
    group_size: int = 32
    residual: int = 128
    scale_dtype: str = "float16"

    ring_group = "residual"

    @property
    def bits(self) -> int:
        return BITS[self.kind]

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
        per_byte = 8 // self.bits
        if head_dim % per_byte:
            raise JaxkvError(f"head_dim={head_dim} is not a multiple of {per_byte}, the {self.kind} codes per byte")
        w, g, sdt = self.store_slots(policy), self.group_size, jnp.dtype(self.scale_dtype)
        width = head_dim // per_byte
        return QuantRing(
            k_codes=jnp.zeros(lbk + (w, width), jnp.uint8),
            k_scale=jnp.ones(lbk + (w // g, head_dim), sdt),
            k_zero=jnp.zeros(lbk + (w // g, head_dim), sdt),
            v_codes=jnp.zeros(lbk + (w, width), jnp.uint8),
            v_scale=jnp.ones(lbk + (w,), sdt),
            v_zero=jnp.zeros(lbk + (w,), sdt),
            pos=jnp.full((batch, w), -1, jnp.int32),
        )

    def flush_ring(self, cache, n):
        """KIVI lazy flush: rows about to append to a full residual quantise it first.

        The residual's R tokens become R/G groups in the quantised ring (evicting the
        oldest whole groups) and its slots are emptied.
        """
        sink, r, g = cache.policy.sink, self.residual, self.group_size
        u0 = cache.length - sink
        flush = (n > 0) & (u0 > 0) & (u0 % r == 0)
        q = cache.quant

        def quantize(k, v):
            return (
                kivi.quantize_keys(k, bits=self.bits, group_size=g, scale_dtype=self.scale_dtype),
                kivi.quantize_values(v, bits=self.bits, scale_dtype=self.scale_dtype),
            )

        # quantise only when some row flushes; the (small, R-token) result is then written
        # in place with a per-row count of 0 or R, so no step copies the quantised ring
        shapes = jax.eval_shape(quantize, cache.ring_k, cache.ring_v)
        qk, qv = lax.cond(
            jnp.any(flush), quantize, lambda k, v: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
            cache.ring_k, cache.ring_v,
        )
        start = (u0 - r) % q.pos.shape[1]  # slot of the residual's first token
        count = jnp.where(flush, r, 0)
        gstart, gcount = start // g, count // g
        tok = dict(batch_axis=1, slot_axis=3, batch_parallel=cache.batch_sharded)
        quant = QuantRing(
            k_codes=write_ring(q.k_codes, qk.codes, start, count, **tok),
            k_scale=write_ring(q.k_scale, qk.scale, gstart, gcount, **tok),
            k_zero=write_ring(q.k_zero, qk.zero, gstart, gcount, **tok),
            v_codes=write_ring(q.v_codes, qv.codes, start, count, **tok),
            v_scale=write_ring(q.v_scale, qv.scale, start, count, **tok),
            v_zero=write_ring(q.v_zero, qv.zero, start, count, **tok),
            pos=write_ring(q.pos, cache.ring_pos, start, count, batch_axis=0, slot_axis=1,
                           batch_parallel=cache.batch_sharded),
        )
        return cache.replace(quant=quant, ring_pos=jnp.where(flush[:, None], -1, cache.ring_pos))

    def segments(self, store: QuantRing, pos, dtype) -> list:
        """The quantised ring of one layer as channel blocks (KIVI §3.2): one segment whose
        keys and values are lists of 1 (int8) or ``8 // bits`` arrays ``dtype[B, K, W, H / n]``
        (see ``blocks`` of :func:`jaxkv.cache.kivi.dequantize_affine`), never concatenated."""
        k = kivi.dequantize_keys(
            kivi.QuantizedKeys(codes=store.k_codes, scale=store.k_scale, zero=store.k_zero),
            bits=self.bits, group_size=self.group_size, dtype=dtype, blocks=True,
        )
        v = kivi.dequantize_values(
            kivi.QuantizedValues(codes=store.v_codes, scale=store.v_scale, zero=store.v_zero),
            bits=self.bits, dtype=dtype, blocks=True,
        )
        return [(k, v, pos)]

    def memory_groups(self, store: QuantRing) -> list:
        return [
            ("codes", [store.k_codes, store.v_codes], store.pos),
            ("scales_zeros", [store.k_scale, store.k_zero, store.v_scale, store.v_zero], store.pos),
        ]

    def describe(self) -> str:
        return f"{self.kind} (G={self.group_size}, R={self.residual})"
