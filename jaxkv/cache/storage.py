"""Cache storages: how the kept keys and values are held, written, read and counted.

A *storage* is the second extension axis of the cache (the first is the *policy*,
:mod:`jaxkv.cache.policy`). Every storage holds the sinks and a full-precision ring
(``sink_k/v``, ``ring_k/v`` of :class:`jaxkv.cache.kv.KVCache`) in its *container* dtype,
and may add a compressed store of its own (the ``quant`` leaf of the cache: a pytree the
storage defines, stacked on L, with one ``pos`` array per row). A storage owns:

* the container dtype of the full-precision leaves and how to read them back
  (:meth:`Storage.to_container`, :meth:`Storage.read`);
* the sizes: ring slots and compressed slots for a policy (:meth:`Storage.ring_slots`,
  :meth:`Storage.store_slots`), the lazy-flush period the policy must respect
  (:attr:`Storage.flush`);
* its compressed store: creation, the flush of the ring into it before a write
  (:meth:`Storage.flush_ring`), reads as channel blocks for attention
  (:meth:`Storage.segments`) and byte accounting (:meth:`Storage.memory_groups`).

Adding a storage (e.g. separate key/value precision, a rotation before quantising) means
one new class with these methods and one line in :attr:`jaxkv.cache.spec.CacheSpec.storage`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

FLOAT_DTYPES = {"fp32": jnp.float32, "fp16": jnp.float16, "bf16": jnp.bfloat16}


class Segment(NamedTuple):
    """One stored segment of a layer, as attention reads it (see :meth:`Storage.segments`).

    Attributes:
      keys: channel blocks ``[B, K, S, H/n]`` whose concatenation along H is the stored keys.
      values: channel blocks ``[B, K, S, H/m]`` of the stored values.
      pos: int32[B, S], absolute position per slot, -1 = empty.
      key_rotation: None, or an orthonormal ``float32[H, H]`` M the keys were stored rotated by
        (``k @ M``): scores use the query ``q @ M`` (:mod:`jaxkv.cache.rotation`).
      value_rotation: None, or the M the values were stored rotated by: the segment's
        ``probabilities @ values`` is multiplied by ``M.T`` (folded into the read).
    """

    keys: list
    values: list
    pos: jax.Array
    key_rotation: jax.Array | None = None
    value_rotation: jax.Array | None = None


class Leaving(NamedTuple):
    """The tokens that leave a cache's window in one call (:meth:`Storage.leaving`), for a keep tier
    (:mod:`jaxkv.cache.retention`).

    Attributes:
      k, v: float32[L, B, K, M, H], their keys and values as the window held them.
      pos: int32[B, M], their positions, -1 = no token (in order: the oldest first).
      slots: int32[B, M], the slots they leave (of the ring, or of ``store``'s array).
      store: None (they leave the ring: scores in ``ring_score``) or the tier's ``store_score``.
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    slots: jax.Array
    store: jax.Array | None = None


def as_container(x, dtype):
    """``x`` cast to the float ``dtype`` of a cache leaf, bfloat16 held as int16 bit patterns
    (see :meth:`Storage.to_container`); :meth:`Storage.read` undoes it."""
    x = x.astype(dtype)
    return lax.bitcast_convert_type(x, jnp.int16) if x.dtype == jnp.bfloat16 else x


@dataclasses.dataclass(frozen=True)
class Storage:
    """Common part of every storage (frozen, hashable). Subclasses set :attr:`kind`."""

    kind: str = "fp32"
    flush = 0  # lazy-flush period in tokens (0: every token is written straight into the ring)

    # ---- full-precision leaves (sinks, ring) -----------------------------------------------------
    @property
    def float_dtype(self):
        """The float dtype of the keys in sinks and ring."""
        return jnp.float32

    @property
    def value_dtype(self):
        """The float dtype of the values in sinks and ring (the keys' unless a storage says otherwise)."""
        return self.float_dtype

    def to_container(self, x, *, values: bool = False):
        """Keys (or, with ``values``, values) ``[..., H]`` as the sink/ring leaves hold them:
        :attr:`float_dtype` (:attr:`value_dtype`), with bfloat16 held as int16 bit patterns
        (XLA CPU converts a whole bfloat16 operand to float32 for a slice or an update, which
        would copy the cache at every step; as int16 the per-layer reads and in-place writes
        stay what they are for fp16; same bytes)."""
        return as_container(x, self.value_dtype if values else self.float_dtype)

    @staticmethod
    def read(x):
        """The float values of a sink/ring leaf (any slice of it), undoing :meth:`to_container`."""
        return lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.int16 else x

    # ---- sizes -------------------------------------------------------------------------------------
    def ring_slots(self, policy) -> int:
        """Full-precision ring slots after the sinks: the window, or a full cache's ``max_len``."""
        return policy.window if policy.bounded else policy.max_len

    def store_slots(self, policy) -> int:
        """Token slots of the compressed store (0: none)."""
        return 0

    def window_for(self, retained: int) -> int:
        """The largest StreamingLLM window whose cache retains at most ``retained`` tokens
        after the sinks (may be < 1: then none fits)."""
        return retained

    # ---- the compressed store (none for float storage) ---------------------------------------------
    def create_store(self, policy, *, lbk: tuple, head_dim: int, batch: int):
        """An empty compressed store (a pytree with a ``pos`` leaf, or None).

        Raises:
          JaxkvError: a ``head_dim`` the storage cannot hold.
        """
        return None

    def flush_ring(self, cache, n):
        """The cache after rows about to append ``n[b] > 0`` tokens moved a full ring into the store."""
        return cache

    def segments(self, store, pos, dtype) -> list:
        """One layer of the store as attention :class:`Segment` s."""
        return []

    def leaving(self, cache, n, chunk: int):
        """The tokens that leave the window when rows append ``n[b]`` tokens (T = ``chunk``):
        those in the ring slots the write will overwrite, for a storage that writes every token
        into its window. Returns a :class:`Leaving`."""
        in_sink, _, ring_slot = cache.policy.write_slots(cache.length, cache.spec.n_ring)
        r = cache.ring_pos.shape[1]
        j = jnp.arange(min(chunk, r), dtype=jnp.int32)
        slots = (ring_slot[:, None] + j[None]) % r  # [B, M]
        pos = jnp.where(
            j[None] < jnp.where(in_sink, 0, n)[:, None], jnp.take_along_axis(cache.ring_pos, slots, axis=1), -1
        )
        take = lambda x: self.read(jnp.take_along_axis(x, slots[None, :, None, :, None], axis=3)).astype(jnp.float32)  # noqa: E731
        return Leaving(take(cache.ring_k), take(cache.ring_v), pos, slots)

    def memory_groups(self, store) -> list:
        """``[(group, leaves, pos)]`` of the store for the memory report."""
        return []

    ring_group = None  # memory group of the ring if the storage names it (else the policy's)

    def describe(self) -> str:
        return self.kind


@dataclasses.dataclass(frozen=True)
class FloatStorage(Storage):
    """Sinks and window in fp32, fp16 or bf16 (``kind``; the values in ``value_kind`` when
    set, e.g. fp16 keys and bf16 values); no compressed store."""

    value_kind: str | None = None

    @property
    def float_dtype(self):
        return FLOAT_DTYPES[self.kind]

    @property
    def value_dtype(self):
        return FLOAT_DTYPES[self.value_kind or self.kind]

    def describe(self) -> str:
        return self.kind if self.value_kind in (None, self.kind) else f"K {self.kind} V {self.value_kind}"
