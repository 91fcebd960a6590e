"""`KVCache`: the KV cache as an immutable pytree of fixed-capacity ring buffers.

Layout (DESIGN §1 axis letters; every leaf stacked on a leading L axis so the model's
layer loop is one ``lax.scan``):

==============  ==========================  ===============================================
leaf            shape                       holds
==============  ==========================  ===============================================
``length``      ``int32[B]``                tokens appended so far per row (next position)
``sink_k/v``    ``[L, B, K, S0, H]``        the first S0 tokens, full precision (None if S0=0)
``sink_pos``    ``int32[B, S0]``            absolute position per sink slot, -1 = empty
``ring_k/v``    ``[L, B, K, R, H]``         circular window (fp modes) or KIVI residual
``ring_pos``    ``int32[B, R]``             absolute position per ring slot, -1 = empty
``quant``       :class:`QuantRing` or None  KIVI: bit-packed codes of the last W flushed tokens
==============  ==========================  ===============================================

Position ``p < S0`` lives in sink slot ``p``; window position ``p`` (index ``u = p - S0``)
lives in ring slot ``u % R`` (and, once flushed under KIVI, in quantised slot ``u % W``).
Attention masks come from the per-slot position arrays, so slot order never matters.
All updates are pure functions returning a new cache; under ``jax.jit`` with the cache
donated, XLA updates the buffers in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxkv.cache import kivi
from jaxkv.cache.ring import rank, window_start, write_ring
from jaxkv.cache.spec import CacheSpec
from jaxkv.errors import JaxkvError

STORAGE_DTYPES = {"fp32": jnp.float32, "fp16": jnp.float16, "bf16": jnp.bfloat16}


@struct.dataclass
class QuantRing:
    """KIVI storage of the last W flushed window tokens (KIVI §3.2, §4).

    Attributes:
      k_codes: uint8[L, B, K, W, H/cpb], keys quantised per-channel, codes packed along H.
      k_scale, k_zero: [L, B, K, W/G, H] (scale_dtype), one pair per channel and group of G tokens.
      v_codes: uint8[L, B, K, W, H/cpb], values quantised per-token.
      v_scale, v_zero: [L, B, K, W] (scale_dtype), one pair per token.
      pos: int32[B, W], absolute position per token slot, -1 = empty.
    """

    k_codes: jax.Array
    k_scale: jax.Array
    k_zero: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_zero: jax.Array
    pos: jax.Array


class ReadView(struct.PyTreeNode):
    """Per-row (not per-layer) inputs of one attention call: positions and RoPE offsets.

    Attributes:
      q_pos: int32[B, T], absolute position of each query, -1 = padding.
      sink_pos, ring_pos, quant_pos: int32[B, S] per segment (None where absent).
      q_rot_sink: int32[B, T], RoPE position of the query against sink keys.
      q_rot: int32[B, T], RoPE position of the query against all other keys.
      k_shift: int32[B], subtracted from a non-sink key's absolute position to get its RoPE position.
    """

    q_pos: jax.Array
    sink_pos: jax.Array | None
    ring_pos: jax.Array
    quant_pos: jax.Array | None
    q_rot_sink: jax.Array
    q_rot: jax.Array
    k_shift: jax.Array


@struct.dataclass
class KVCache:
    """The KV cache pytree (see the module docstring for the layout). Build with :meth:`create`.

    ``bf16`` storage is held as int16 bit patterns (read it with :func:`layer_value`): XLA CPU
    runs bfloat16 slices and updates by converting the whole operand to float32, which would
    copy the whole cache at every step; as int16 the per-layer reads and the in-place writes
    stay what they are for fp16. The bytes are the same.

    ``batch_sharded`` (static) says the B axis is split over devices
    (:func:`jaxkv.parallel.shard_cache` sets it): writes then update all rows at once
    (``write_ring(batch_parallel=True)``) so each device writes only its own rows.
    """

    spec: CacheSpec = struct.field(pytree_node=False)
    length: jax.Array
    sink_k: jax.Array | None
    sink_v: jax.Array | None
    sink_pos: jax.Array | None
    ring_k: jax.Array
    ring_v: jax.Array
    ring_pos: jax.Array
    quant: QuantRing | None
    batch_sharded: bool = struct.field(pytree_node=False, default=False)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def create(cls, spec: CacheSpec, *, batch: int, n_layers: int, n_kv_heads: int, head_dim: int) -> "KVCache":
        """An empty cache: every slot position -1, every length 0.

        Args:
          spec: what to keep and how to store it.
          batch: B rows. n_layers: L. n_kv_heads: K. head_dim: H.
        Raises:
          JaxkvError: a non-positive size, or ``head_dim`` not divisible by the codes per byte.
        """
        for name, value in (("batch", batch), ("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise JaxkvError(f"KVCache.create: {name}={value!r}, expected a positive integer")
        lbk = (n_layers, batch, n_kv_heads)

        def slots(n):
            return _to_container(jnp.zeros(lbk + (n, head_dim)), spec)

        def empty_pos(n):
            return jnp.full((batch, n), -1, jnp.int32)

        quant = None
        if spec.quantized:
            per_byte = 8 // spec.bits
            if head_dim % per_byte:
                raise JaxkvError(
                    f"head_dim={head_dim} is not a multiple of {per_byte}, the {spec.kv_quantize} codes per byte"
                )
            w, sdt = spec.n_quant, jnp.dtype(spec.scale_dtype)
            quant = QuantRing(
                k_codes=jnp.zeros(lbk + (w, head_dim // per_byte), jnp.uint8),
                k_scale=jnp.ones(lbk + (w // spec.group_size, head_dim), sdt),
                k_zero=jnp.zeros(lbk + (w // spec.group_size, head_dim), sdt),
                v_codes=jnp.zeros(lbk + (w, head_dim // per_byte), jnp.uint8),
                v_scale=jnp.ones(lbk + (w,), sdt),
                v_zero=jnp.zeros(lbk + (w,), sdt),
                pos=empty_pos(w),
            )
        has_sink = spec.n_sink > 0
        return cls(
            spec=spec,
            length=jnp.zeros((batch,), jnp.int32),
            sink_k=slots(spec.n_sink) if has_sink else None,
            sink_v=slots(spec.n_sink) if has_sink else None,
            sink_pos=empty_pos(spec.n_sink) if has_sink else None,
            ring_k=slots(spec.n_ring),
            ring_v=slots(spec.n_ring),
            ring_pos=empty_pos(spec.n_ring),
            quant=quant,
        )

    # ---- shapes --------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.length.shape[0]

    @property
    def n_layers(self) -> int:
        return self.ring_k.shape[0]

    def stored(self) -> jax.Array:
        """int32[B]: tokens each row holds now (sinks + window/residual + quantised)."""
        count = jnp.sum(self.ring_pos >= 0, axis=1)
        if self.sink_pos is not None:
            count += jnp.sum(self.sink_pos >= 0, axis=1)
        if self.quant is not None:
            count += jnp.sum(self.quant.pos >= 0, axis=1)
        return count.astype(jnp.int32)

    # ---- the three steps of an append: admit, read, write ---------------------------------------
    def admit(self, n: jax.Array) -> jax.Array:
        """int32[B]: how many of ``n[b]`` new tokens row ``b`` may append (a full cache never overflows)."""
        n = jnp.asarray(n, jnp.int32)
        if self.spec.token_limit is not None:
            n = jnp.clip(n, 0, self.spec.token_limit - self.length)
        return n

    def prepare(self, n: jax.Array) -> "KVCache":
        """KIVI lazy flush: rows about to append to a full residual quantise it first.

        The residual's R tokens become R/G groups in the quantised ring (evicting the
        oldest whole groups) and its slots are emptied; codes already stored are never
        re-quantised. A no-op for float caches.
        """
        spec = self.spec
        if not spec.quantized:
            return self
        u0 = self.length - spec.sink
        flush = (n > 0) & (u0 > 0) & (u0 % spec.residual == 0)
        q, g = self.quant, spec.group_size

        def quantize(k, v):
            return (
                kivi.quantize_keys(k, bits=spec.bits, group_size=g, scale_dtype=spec.scale_dtype),
                kivi.quantize_values(v, bits=spec.bits, scale_dtype=spec.scale_dtype),
            )

        # quantise only when some row flushes; the (small, R-token) result is then written
        # in place with a per-row count of 0 or R, so no step copies the quantised ring
        shapes = jax.eval_shape(quantize, self.ring_k, self.ring_v)
        qk, qv = lax.cond(
            jnp.any(flush), quantize, lambda k, v: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes),
            self.ring_k, self.ring_v,
        )
        start = (u0 - spec.residual) % spec.n_quant  # slot of the residual's first token
        count = jnp.where(flush, spec.residual, 0)
        gstart, gcount = start // g, count // g
        tok = dict(batch_axis=1, slot_axis=3, batch_parallel=self.batch_sharded)
        quant = QuantRing(
            k_codes=write_ring(q.k_codes, qk.codes, start, count, **tok),
            k_scale=write_ring(q.k_scale, qk.scale, gstart, gcount, **tok),
            k_zero=write_ring(q.k_zero, qk.zero, gstart, gcount, **tok),
            v_codes=write_ring(q.v_codes, qv.codes, start, count, **tok),
            v_scale=write_ring(q.v_scale, qv.scale, start, count, **tok),
            v_zero=write_ring(q.v_zero, qv.zero, start, count, **tok),
            pos=write_ring(q.pos, self.ring_pos, start, count, batch_axis=0, slot_axis=1, batch_parallel=self.batch_sharded),
        )
        return self.replace(quant=quant, ring_pos=jnp.where(flush[:, None], -1, self.ring_pos))

    def query_positions(self, n: jax.Array, chunk: int) -> jax.Array:
        """int32[B, T]: absolute positions of the next ``chunk`` tokens, -1 beyond ``n[b]``."""
        j = jnp.arange(chunk, dtype=jnp.int32)[None, :]
        return jnp.where(j < n[:, None], self.length[:, None] + j, -1)

    def read_view(self, q_pos: jax.Array) -> ReadView:
        """Positions and RoPE offsets for attending ``q_pos[B, T]`` to this cache plus the chunk.

        In ``positions="cache"`` mode (StreamingLLM §3.2) a key's RoPE position is its rank
        in the query's retained set. Since only ``rank(q) - rank(p)`` matters, window keys
        are rotated at ``p - k_shift`` (their exact rank for the chunk's last query) and
        queries at ``q - k_shift``; sink keys at ``p`` and queries at ``rank(q)``. Each query
        of a chunk thus sees the ranks of its own retained set. In ``absolute`` mode
        everything uses absolute positions.
        """
        spec = self.spec
        if spec.positions == "cache":
            last = jnp.maximum(jnp.max(q_pos, axis=1), 0)
            k_shift = window_start(spec, last) - spec.sink
            q_rot = jnp.where(q_pos >= 0, q_pos - k_shift[:, None], 0)
            q_rot_sink = jnp.where(q_pos >= 0, rank(spec, q_pos), 0)
        else:
            k_shift = jnp.zeros_like(self.length)
            q_rot = q_rot_sink = q_pos
        return ReadView(
            q_pos=q_pos,
            sink_pos=self.sink_pos,
            ring_pos=self.ring_pos,
            quant_pos=None if self.quant is None else self.quant.pos,
            q_rot_sink=q_rot_sink,
            q_rot=q_rot,
            k_shift=k_shift,
        )

    def layer_leaves(self) -> dict:
        """The per-layer arrays (each with a leading L axis) for ``lax.scan`` over layers
        (float leaves in their container dtype: read them with :func:`layer_value`)."""
        leaves = dict(sink_k=self.sink_k, sink_v=self.sink_v, ring_k=self.ring_k, ring_v=self.ring_v)
        if self.quant is not None:
            q = self.quant
            leaves.update(
                k_codes=q.k_codes, k_scale=q.k_scale, k_zero=q.k_zero,
                v_codes=q.v_codes, v_scale=q.v_scale, v_zero=q.v_zero,
            )
        return leaves

    def append(self, k_new: jax.Array, v_new: jax.Array, n: jax.Array) -> "KVCache":
        """Write each row's first ``n[b]`` new keys/values and advance its length.

        Args:
          k_new, v_new: ``[L, B, K, T, H]`` as attention stored them (after RoPE in
            ``absolute`` mode, before RoPE in ``cache`` mode).
          n: int32[B] from :meth:`admit`; a row's chunk must not cross the sink/window
            boundary nor a KIVI flush (``ring.plan_chunk`` guarantees it; decode steps of
            one token always satisfy it).
        """
        spec = self.spec
        n = jnp.asarray(n, jnp.int32)
        chunk = k_new.shape[3]
        pos = self.query_positions(n, chunk)
        in_sink = self.length < spec.sink
        kv = dict(batch_axis=1, slot_axis=3, batch_parallel=self.batch_sharded)
        pos_axes = dict(batch_axis=0, slot_axis=1, batch_parallel=self.batch_sharded)
        k_new, v_new = _to_container(k_new, spec), _to_container(v_new, spec)
        new = {}
        if spec.n_sink:
            ns = jnp.where(in_sink, n, 0)
            start = jnp.minimum(self.length, spec.sink - 1)
            new.update(
                sink_k=write_ring(self.sink_k, k_new, start, ns, **kv),
                sink_v=write_ring(self.sink_v, v_new, start, ns, **kv),
                sink_pos=write_ring(self.sink_pos, pos, start, ns, **pos_axes),
            )
        nr = jnp.where(in_sink, 0, n)
        start = jnp.maximum(self.length - spec.sink, 0) % spec.n_ring
        new.update(
            ring_k=write_ring(self.ring_k, k_new, start, nr, **kv),
            ring_v=write_ring(self.ring_v, v_new, start, nr, **kv),
            ring_pos=write_ring(self.ring_pos, pos, start, nr, **pos_axes),
        )
        return self.replace(length=self.length + n, **new)


def layer_value(x: jax.Array) -> jax.Array:
    """The float values of a sink/window leaf (any slice of it): bf16 storage is held as
    int16 bit patterns (see :class:`KVCache`) and viewed back as bfloat16; others unchanged."""
    return lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.int16 else x


def _to_container(x: jax.Array, spec: CacheSpec) -> jax.Array:
    """Keys/values in the sink/window storage of ``spec`` (float32 under KIVI), as held."""
    x = x.astype(jnp.float32 if spec.quantized else STORAGE_DTYPES[spec.kv_quantize])
    return lax.bitcast_convert_type(x, jnp.int16) if x.dtype == jnp.bfloat16 else x


def dequantized(spec: CacheSpec, layer: dict, dtype):
    """Dequantise one layer's quantised ring (KIVI §3.2) as channel blocks.

    Returns:
      ``(k_blocks, v_blocks)``: lists of 1 (int8) or ``8 // bits`` arrays
      ``dtype[B, K, W, H / len]`` whose concatenation along H is the dequantised ring
      (see ``blocks`` of :func:`jaxkv.cache.kivi.dequantize_affine`).
    """
    k = kivi.dequantize_keys(
        kivi.QuantizedKeys(codes=layer["k_codes"], scale=layer["k_scale"], zero=layer["k_zero"]),
        bits=spec.bits, group_size=spec.group_size, dtype=dtype, blocks=True,
    )
    v = kivi.dequantize_values(
        kivi.QuantizedValues(codes=layer["v_codes"], scale=layer["v_scale"], zero=layer["v_zero"]),
        bits=spec.bits, dtype=dtype, blocks=True,
    )
    return k, v
