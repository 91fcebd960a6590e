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
``quant``       storage-defined or None     the storage's compressed store (KIVI :class:`QuantRing`:
                                            bit-packed codes of the last W flushed tokens)
``keep``        :class:`KeepTier` or None   tokens kept after they left the window, by a rule
                                            (:mod:`jaxkv.cache.retention`), ``pos int32[B, C]``
==============  ==========================  ===============================================

What is kept where is the spec's *policy* (:mod:`jaxkv.cache.policy`); how it is held is
its *storage* (:mod:`jaxkv.cache.storage`, :mod:`jaxkv.cache.kivi_storage`). This module
only lays the leaves out and runs the three calls of the model contract.

Position ``p < S0`` lives in sink slot ``p``; window position ``p`` (index ``u = p - S0``)
lives in ring slot ``u % R`` (and, once flushed under KIVI, in quantised slot ``u % W``).
Attention masks come from the per-slot position arrays, so slot order never matters.
All updates are pure functions returning a new cache; under ``jax.jit`` with the cache
donated, XLA updates the buffers in place.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.cache.kivi_storage import QuantRing
from jaxkv.cache.retention import KeepTier, Mass
from jaxkv.cache.ring import write_ring
from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.cache.storage import Storage
from jaxkv.errors import INT32_LIMIT, CacheSpecError, JaxkvError, check_int

__all__ = ["KVCache", "KeepTier", "LayerKV", "Mass", "QuantRing", "Step", "layer_value"]


class Step(struct.PyTreeNode):
    """What one model call needs to attend and commit: made by :meth:`KVCache.begin`, shared
    by every layer (per-row, not per-layer, arrays).

    Attributes:
      spec: the cache's :class:`CacheSpec` (static).
      n: int32[B], tokens each row appends in this call (after :meth:`KVCache.begin` admitted them).
      q_pos: int32[B, T], absolute position of each query, -1 = padding.
      sink_pos, ring_pos, store_pos: int32[B, S] per segment: sinks, full-precision ring
        (window or KIVI residual), the storage's compressed store (None where absent).
      q_rot_sink: int32[B, T], RoPE position of the query against sink keys.
      q_rot: int32[B, T], RoPE position of the query against all other keys.
      k_shift: int32[B], subtracted from a window key's absolute position to get its RoPE position.
      keep_pos: int32[B, C], the keep tier's positions (None without one).
      keep_rot: int32[B, C], the RoPE position of each keep-tier key stored before RoPE: its
        rank (``positions="cache"``) or its position (None without a tier).
    """

    spec: CacheSpec = struct.field(pytree_node=False)
    n: jax.Array
    q_pos: jax.Array
    sink_pos: jax.Array | None
    ring_pos: jax.Array
    store_pos: jax.Array | None
    q_rot_sink: jax.Array
    q_rot: jax.Array
    k_shift: jax.Array
    keep_pos: jax.Array | None = None
    keep_rot: jax.Array | None = None


ReadView = Step  # the name before the three-call contract (deprecated)


class LayerKV(struct.PyTreeNode):
    """The per-layer leaves of a cache (each with a leading L axis from :meth:`KVCache.layers`,
    or one layer of it inside a layer loop): what :func:`jaxkv.cache.attention.attend` reads.

    Attributes:
      sink_k, sink_v: ``[L, B, K, S0, H]`` in the storage's container dtype (None without sinks).
      ring_k, ring_v: ``[L, B, K, R, H]``, the window (float storage) or the KIVI residual.
      store: the storage's compressed store without its positions (KIVI :class:`QuantRing`), or None.
      keep: the keep tier's keys and values (:class:`KeepTier` without its per-row arrays), or None.
    """

    sink_k: jax.Array | None
    sink_v: jax.Array | None
    ring_k: jax.Array
    ring_v: jax.Array
    store: QuantRing | None
    keep: KeepTier | None = None


@struct.dataclass
class KVCache:
    """The KV cache pytree (see the module docstring for the layout). Build with :meth:`create`.

    ``bf16`` storage is held as int16 bit patterns (read it with :func:`layer_value`): see
    :meth:`jaxkv.cache.storage.Storage.to_container`.

    ``batch_sharded`` (static) says the B axis is split over devices
    (:func:`jaxkv.decode.parallel.shard_cache` sets it): writes then update all rows at once
    (``write_ring(batch_parallel=True)``) so each device writes only its own rows.

    A model uses it through three calls (DESIGN §3): ``cache, step = cache.begin(n, T)``
    once per call; :func:`jaxkv.cache.attention.attend` per layer, over one layer of
    ``cache.layers()``; ``cache = cache.commit(step, k_new, v_new)`` once.
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
    keep: KeepTier | None = None
    batch_sharded: bool = struct.field(pytree_node=False, default=False)

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def create(
        cls, spec: CacheSpec | LayerSpecs, *, batch: int, n_layers: int, n_kv_heads: int, head_dim: int, devices=None
    ):
        """An empty cache: every slot position -1, every length 0.

        Its bytes are counted from the leaves' shapes first (nothing allocated) and checked
        against the memory of the devices it goes to (:func:`check_fits`).

        Args:
          spec: what to keep and how to store it: one :class:`CacheSpec` for every layer, or
            :class:`LayerSpecs` (one per layer; returns a :class:`jaxkv.cache.layered.LayeredCache`).
          batch: B rows. n_layers: L. n_kv_heads: K. head_dim: H.
          devices: the devices the cache is spread over (None: the default device), for the memory check.
        Raises:
          JaxkvError: a size outside [1, 2**31), or ``head_dim`` not divisible by the codes per byte;
            :class:`~jaxkv.errors.CacheSpecError`: a cache larger than the devices' memory.
        """
        sizes = {
            name: check_int(f"KVCache.create: {name}", value, 1, INT32_LIMIT, spaced=False)
            for name, value in (
                ("batch", batch),
                ("n_layers", n_layers),
                ("n_kv_heads", n_kv_heads),
                ("head_dim", head_dim),
            )
        }
        check_fits(spec, devices=devices, **sizes)
        return _created(spec, **sizes)

    @classmethod
    def _empty(cls, spec: CacheSpec | LayerSpecs, *, batch: int, n_layers: int, n_kv_heads: int, head_dim: int):
        """The empty cache of :meth:`create`, sizes and memory checked there."""
        if isinstance(spec, LayerSpecs):  # a LayeredCache, made of KVCaches (registered by jaxkv.cache.layered)
            if _per_layer_empty is None:
                raise JaxkvError("per-layer specs need jaxkv.cache.layered imported (import jaxkv.cache does it)")
            return _per_layer_empty(spec, batch=batch, n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim)
        lbk = (n_layers, batch, n_kv_heads)
        storage = spec.storage

        def slots(n, values=False):
            return storage.to_container(jnp.zeros(lbk + (n, head_dim)), values=values)

        def empty_pos(n):
            return jnp.full((batch, n), -1, jnp.int32)

        store = storage.create_store(spec.policy, lbk=lbk, head_dim=head_dim, batch=batch)
        retention = spec.policy.retention
        keep = (
            None
            if retention is None
            else retention.create(lbk=lbk, head_dim=head_dim, batch=batch, ring=spec.n_ring, store=spec.n_quant)
        )
        has_sink = spec.n_sink > 0
        return cls(
            spec=spec,
            length=jnp.zeros((batch,), jnp.int32),
            sink_k=slots(spec.n_sink) if has_sink else None,
            sink_v=slots(spec.n_sink, values=True) if has_sink else None,
            sink_pos=empty_pos(spec.n_sink) if has_sink else None,
            ring_k=slots(spec.n_ring),
            ring_v=slots(spec.n_ring, values=True),
            ring_pos=empty_pos(spec.n_ring),
            quant=store,
            keep=keep,
        )

    def starting_at(self, position: int) -> KVCache:
        """This (empty) cache with every row's stream starting at ``position``: the next token
        is at that position, as if the tokens before it had come and gone. A stream that
        starts past the sinks keeps none (sinks are positions ``< sink``). For long-stream
        tests (RoPE precision at large absolute positions) without streaming that far.

        Raises:
          JaxkvError: a cache that holds tokens, a full cache (its slots are positions), or a
            position outside ``[0, 2**31 - 2**24)``.
        """
        if (
            isinstance(position, bool)
            or not isinstance(position, (int, np.integer))
            or not 0 <= position < 2**31 - 2**24
        ):
            raise JaxkvError(f"starting_at: position={position!r}, expected an integer in [0, 2**31 - 2**24)")
        if not self.spec.bounded and position:
            raise JaxkvError(f"starting_at({position}): a full cache holds positions 0..max_len-1 only: use a window")
        if np.any(np.asarray(self.length) != 0):
            raise JaxkvError("starting_at: the cache already holds tokens; start from an empty cache")
        return self.replace(length=jnp.full_like(self.length, position))

    # ---- shapes --------------------------------------------------------------------------------
    @property
    def policy(self):
        """The spec's :class:`jaxkv.cache.policy.Policy`."""
        return self.spec.policy

    @property
    def storage(self):
        """The spec's :class:`jaxkv.cache.storage.Storage`."""
        return self.spec.storage

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    @property
    def n_layers(self) -> int:
        return self.ring_k.shape[0]

    def positions(self) -> list:
        """The per-slot position arrays ``int32[B, S]`` of every segment that exists."""
        pos = [p for p in (self.sink_pos, self.ring_pos) if p is not None]
        return pos + [part.pos for part in (self.quant, self.keep) if part is not None]

    def stored(self) -> jax.Array:
        """int32[B]: tokens each row holds now (sinks + window/residual + quantised + keep tier)."""
        return sum(jnp.sum(p >= 0, axis=1) for p in self.positions()).astype(jnp.int32)

    # ---- the model contract: begin, attend per layer, commit ------------------------------------
    def begin(self, n: jax.Array, chunk: int) -> tuple[KVCache, Step]:
        """Start a model call that appends up to ``n[b]`` of ``chunk`` (T) tokens per row.

        Admits what the policy allows (a full cache never overflows), moves the tokens that
        leave the window in this call into a keep tier by its rule (:mod:`jaxkv.cache.retention`),
        lets the storage flush before anything is read (KIVI: a full residual is quantised
        first), and computes the positions and RoPE offsets every layer shares.

        Args:
          n: int32[B] tokens offered per row (0 = the row sits this call out).
          chunk: T, the static chunk length.
        Returns:
          ``(cache, step)``: read layers from this cache, pass ``step`` to every
          :func:`jaxkv.cache.attention.attend` and to :meth:`commit`.
        """
        n = self.policy.admit(self.length, n)
        cache = self
        retention = self.policy.retention
        if retention is not None and retention.slots:
            cache = cache.replace(keep=retention.admit(cache.keep, self.storage.leaving(cache, n, chunk)))
        cache = self.storage.flush_ring(cache, n)
        return cache, cache._step(n, _query_positions(cache.length, n, chunk))

    def _step(self, n, q_pos) -> Step:
        keep_pos = keep_rot = n_keep = None
        if self.keep is not None:
            keep_pos = self.keep.pos
            n_keep = jnp.sum(keep_pos >= 0, axis=1).astype(jnp.int32)
            keep_rot = self.policy.retention.ranks(keep_pos, self.policy.sink) if self.policy.rope_at_rank else keep_pos
        q_rot_sink, q_rot, k_shift = self.policy.rope_offsets(q_pos, n_keep)
        return Step(
            spec=self.spec,
            n=n,
            q_pos=q_pos,
            sink_pos=self.sink_pos,
            ring_pos=self.ring_pos,
            store_pos=None if self.quant is None else self.quant.pos,
            q_rot_sink=q_rot_sink,
            q_rot=q_rot,
            k_shift=k_shift,
            keep_pos=keep_pos,
            keep_rot=keep_rot,
        )

    def layers(self) -> LayerKV:
        """The per-layer leaves, each with a leading L axis: index one layer with
        ``jax.tree.map(lambda a: a[l], cache.layers())`` or feed them to ``lax.scan`` as ``xs``."""
        return LayerKV(
            sink_k=self.sink_k,
            sink_v=self.sink_v,
            ring_k=self.ring_k,
            ring_v=self.ring_v,
            store=None if self.quant is None else self.quant.replace(pos=None),
            keep=None if self.keep is None else self.policy.retention.layer_view(self.keep),
        )

    def runs(self, step: Step) -> list[tuple[int, int, Step, LayerKV]]:
        """``[(0, L, step, self.layers())]``: the one run of layers of a uniform cache (see
        :meth:`jaxkv.cache.layered.LayeredCache.runs`, whose form a model can loop over)."""
        return [(0, self.n_layers, step, self.layers())]

    def commit(self, step: Step, k_new: jax.Array, v_new: jax.Array, *, mass=None, token_score=None) -> KVCache:
        """Write each row's first ``step.n[b]`` new keys/values and advance its length.

        Args:
          step: from :meth:`begin` on this cache.
          k_new, v_new: ``[L, B, K, T, H]``, the ``k_store``/``v_store`` that
            :func:`jaxkv.cache.attention.attend` returned for every layer, stacked on L
            (keys after RoPE in ``absolute`` mode, before RoPE in ``cache`` mode).
          mass: a cache whose keep tier ranks tokens by the attention they receive
            (``keep_score`` h2o or tova): the :class:`Mass` that ``attend(..., mass=True)``
            returned for every layer, stacked on L (or a one-entry list of it: one per run of
            :meth:`runs`). Ignored (may be None) otherwise.
          token_score: float32[B, T], a SnapKV replay's observation score of each new token.
        Raises:
          JaxkvError: ``mass`` missing where the keep tier needs it.
        A row's chunk never crosses the sink/window boundary nor a lazy flush
        (:meth:`jaxkv.cache.policy.Policy.plan_chunk` guarantees it; decode steps of one
        token always satisfy it).
        """
        n, pos = step.n, step.q_pos
        in_sink, sink_slot, ring_slot = self.policy.write_slots(self.length, self.spec.n_ring)
        retention = self.policy.retention
        keep = self.keep
        if retention is not None:
            if isinstance(mass, (list, tuple)) and not isinstance(mass, Mass):
                mass = mass[0] if len(mass) == 1 else mass
            if retention.attention_scored and not isinstance(mass, Mass):
                raise JaxkvError(
                    f"this cache's keep tier ({retention.describe()}) ranks tokens by the attention they "
                    "receive: call attend(..., mass=True) in every layer and pass "
                    "commit(step, k_new, v_new, mass=the masses stacked on L)"
                )
            if isinstance(mass, Mass):
                mass = jax.tree.map(lambda m: jnp.sum(m, axis=0), mass)  # summed over layers
            keep = retention.rescore(
                self.keep,
                ring_slot=ring_slot,
                n=jnp.where(in_sink, 0, n),
                chunk=k_new.shape[3],
                mass=mass if retention.attention_scored else None,
                token_score=token_score,
                batch_parallel=self.batch_sharded,
            )
        kv = dict(batch_axis=1, slot_axis=3, batch_parallel=self.batch_sharded)
        pos_axes = dict(batch_axis=0, slot_axis=1, batch_parallel=self.batch_sharded)
        k_new, v_new = self.storage.to_container(k_new), self.storage.to_container(v_new, values=True)
        new = {}
        if self.sink_k is not None:
            ns = jnp.where(in_sink, n, 0)
            new.update(
                sink_k=write_ring(self.sink_k, k_new, sink_slot, ns, **kv),
                sink_v=write_ring(self.sink_v, v_new, sink_slot, ns, **kv),
                sink_pos=write_ring(self.sink_pos, pos, sink_slot, ns, **pos_axes),
            )
        nr = jnp.where(in_sink, 0, n)
        new.update(
            ring_k=write_ring(self.ring_k, k_new, ring_slot, nr, **kv),
            ring_v=write_ring(self.ring_v, v_new, ring_slot, nr, **kv),
            ring_pos=write_ring(self.ring_pos, pos, ring_slot, nr, **pos_axes),
        )
        return self.replace(length=self.length + n, keep=keep, **new)

    # ---- the six-call protocol before the three-call contract (deprecated) ------------------------
    def admit(self, n: jax.Array) -> jax.Array:
        """Deprecated: :meth:`begin` admits. int32[B] tokens each row may append."""
        _deprecated("KVCache.admit")
        return self.policy.admit(self.length, n)

    def prepare(self, n: jax.Array) -> KVCache:
        """Deprecated: :meth:`begin` flushes. The cache after the storage's lazy flush."""
        _deprecated("KVCache.prepare")
        return self.storage.flush_ring(self, n)

    def query_positions(self, n: jax.Array, chunk: int) -> jax.Array:
        """Deprecated: ``step.q_pos`` of :meth:`begin`. int32[B, T] positions, -1 beyond ``n[b]``."""
        _deprecated("KVCache.query_positions")
        return _query_positions(self.length, n, chunk)

    def read_view(self, q_pos: jax.Array) -> Step:
        """Deprecated: the ``step`` of :meth:`begin`, for queries at ``q_pos[B, T]``."""
        _deprecated("KVCache.read_view")
        return self._step(jnp.sum(q_pos >= 0, axis=1).astype(jnp.int32), q_pos)

    def layer_leaves(self) -> LayerKV:
        """Deprecated: :meth:`layers`."""
        _deprecated("KVCache.layer_leaves", "KVCache.layers")
        return self.layers()

    def append(self, k_new: jax.Array, v_new: jax.Array, n: jax.Array) -> KVCache:
        """Deprecated: :meth:`commit`. Write each row's first ``n[b]`` keys/values ``[L, B, K, T, H]``."""
        _deprecated("KVCache.append", "KVCache.commit")
        n = jnp.asarray(n, jnp.int32)
        return self.commit(self._step(n, _query_positions(self.length, n, k_new.shape[3])), k_new, v_new)


# The builder of the empty cache for per-layer specs (LayerSpecs -> LayeredCache._empty), set by
# jaxkv.cache.layered when it is imported (jaxkv.cache imports it), so that the imports among kv.py,
# layered.py and memory.py go one way only: memory -> layered -> kv.
_per_layer_empty = None


def register_per_layer_empty(build) -> None:
    """Have :meth:`KVCache.create` build the cache of a :class:`LayerSpecs` spec with
    ``build(spec, *, batch, n_layers, n_kv_heads, head_dim)`` (jaxkv.cache.layered registers
    ``LayeredCache._empty``)."""
    global _per_layer_empty
    _per_layer_empty = build


@functools.partial(jax.jit, static_argnums=0, static_argnames=("batch", "n_layers", "n_kv_heads", "head_dim"))
def _created(spec, *, batch, n_layers, n_kv_heads, head_dim):
    """:meth:`KVCache._empty` as one compiled program (each of its leaves made eagerly was a
    program of its own: ~0.1 s of lowering in a fresh process)."""
    return KVCache._empty(spec, batch=batch, n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim)


# ---- the cache against the machine's memory --------------------------------------------------------
def cache_bytes(spec: CacheSpec | LayerSpecs, *, batch: int, n_layers: int, n_kv_heads: int, head_dim: int) -> int:
    """Bytes of every leaf of ``KVCache.create(spec, ...)``, from the leaves' shapes (nothing is allocated).

    Raises:
      JaxkvError: as :meth:`KVCache.create` for a spec the shapes do not fit.
    """
    sizes = dict(batch=batch, n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim)
    shapes = jax.eval_shape(lambda: KVCache._empty(spec, **sizes))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def physical_memory() -> int | None:
    """Bytes of the host's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def device_memory(devices=None) -> tuple[int | None, str]:
    """``(bytes, where)``: the memory ``devices`` hold together (None: the default device), and
    their description (e.g. ``cpu``, ``8 gpu devices``).

    An accelerator counts its own memory (``memory_stats()["bytes_limit"]``); a CPU, or a device
    that reports no memory (unified memory), counts the host's physical memory, once. Bytes
    are None when unknown.
    """
    devices = list(jax.devices()[:1] if devices is None else devices)
    total, host = 0, False
    for device in devices:
        try:
            limit = (device.memory_stats() or {}).get("bytes_limit")
        except Exception:  # a backend without memory stats
            limit = None
        if limit:
            total += int(limit)
        else:
            host = True
    if host:
        ram = physical_memory()
        if ram is None:
            return None, "host"
        total += ram
    kinds = sorted({d.platform for d in devices})
    return total, "/".join(kinds) if len(devices) == 1 else f"{len(devices)} {'/'.join(kinds)} devices"


def _resized(spec, field: str, n: int):
    """``spec`` with ``field`` (``window`` or ``max_len``) set to ``n`` on every layer that has it and is
    not a model's local layer (for :class:`LayerSpecs`; local layers keep their window)."""
    if isinstance(spec, LayerSpecs):
        return LayerSpecs(
            tuple(
                _resized(s, field, n) if s.attention_window is None and getattr(s, field) is not None else s
                for s in spec.specs
            )
        )
    with warnings.catch_warnings():  # a smaller window than the sinks, while searching: not the user's spec
        warnings.simplefilter("ignore", UserWarning)
        return dataclasses.replace(spec, **{field: n})


def check_fits(
    spec: CacheSpec | LayerSpecs, *, batch: int, n_layers: int, n_kv_heads: int, head_dim: int, devices=None
) -> int:
    """Bytes of the cache :meth:`KVCache.create` would allocate, checked against the memory of
    ``devices`` (:func:`device_memory`; None: the default device) before anything is allocated.

    Returns:
      the cache's bytes (int).
    Raises:
      CacheSpecError: a cache larger than that memory; the message gives its size and the largest
        window (or ``max_len``) and batch that fit.
    """
    sizes = dict(batch=batch, n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim)
    need = cache_bytes(spec, **sizes)
    memory, where = device_memory(devices)
    if memory is None or need <= memory:
        return need
    parts = getattr(spec, "specs", (spec,))
    bounded = [s for s in parts if s.attention_window is None]
    fits = []
    if bounded:  # the largest size (window, or max_len of a full cache) that fits, by bisection
        user = bounded[0]
        field = "window" if user.bounded else "max_len"
        unit = user.group_size if user.quantized and user.bounded else 1
        low = user.residual if user.quantized and user.bounded else 1  # the smallest valid size
        lo, hi = -1, (getattr(user, field) - low) // unit  # the answer k: low + k * unit, in [-1, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cache_bytes(_resized(spec, field, low + mid * unit), **sizes) <= memory:
                lo = mid
            else:
                hi = mid - 1
        if lo >= 0:
            fits.append(f"{{{field}:={low + lo * unit}}}")
    per_row = cache_bytes(spec, **{**sizes, "batch": 1})
    if (batch > 1 or not fits) and memory >= per_row:
        fits.append(f"{{batch:={memory // per_row}}} at this size")
    values = {f.name: getattr((bounded or parts)[0], f.name) for f in dataclasses.fields(CacheSpec)}
    values["batch"] = batch
    raise CacheSpecError(
        f"a KV cache of {format_bytes(need)} ({spec.describe()}; batch {batch}, {n_layers} layers, {n_kv_heads} KV heads, "
        f"head dim {head_dim}) is more than the {format_bytes(memory)} of memory of {where}: "
        + (
            f"the most that fits is {' or '.join(fits)}"
            if fits
            else f"even {{{field}:={low}}} does not fit"
            if bounded
            else "not even one row fits"
        ),
        values,
        prefix="",
    )


def _deprecated(old: str, new: str = "KVCache.begin") -> None:
    warnings.warn(
        f"{old} is deprecated: use {new} (docs/custom_models.md, the three-call contract)",
        DeprecationWarning,
        stacklevel=3,
    )


def layer_value(x: jax.Array) -> jax.Array:
    """The float values of a sink/window leaf (any slice of it): bf16 storage is held as
    int16 bit patterns (see :class:`KVCache`) and viewed back as bfloat16; others unchanged."""
    return Storage.read(x)


def _query_positions(length, n, chunk: int):
    """int32[B, T]: positions ``length[b] + j`` of the next ``chunk`` tokens, -1 beyond ``n[b]``."""
    j = jnp.arange(chunk, dtype=jnp.int32)[None, :]
    return jnp.where(j < n[:, None], length[:, None] + j, -1)
