"""Memory report of a `KVCache`, counted from its pytree leaves (DESIGN §2 "Memory report")."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxkv.cache.kv import KVCache, format_bytes  # format_bytes: defined in kv.py (its check_fits), exported here
from jaxkv.cache.layered import LayeredCache

GROUPS = ("sinks", "window", "slots", "residual", "codes", "scales_zeros", "keep", "bookkeeping")


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes of a KV cache, by group, allocated versus holding live tokens.

    Attributes:
      allocated: bytes per group for the whole capacity (what the device holds).
      live: bytes per group of the slots holding a live token (bookkeeping counts whole).
      tokens_stored: int per row, tokens the cache holds now.
      tokens_seen: int per row, tokens ever appended (prompt plus fed generated tokens).
      capacity: token slots per row (sinks + window/residual + quantised ring).
      by_spec: ``((spec description, layers, allocated bytes), ...)``, one entry per distinct
        layer cache (more than one for per-layer specs, e.g. a model's local sliding-window
        layers beside its global ones).
      store_bits: effective bits per K/V element of the quantised store (codes + scales +
        zeros, and a float side's floats), None without one (see :func:`element_bits`).
      bits_per_element: effective bits per cached K/V element of the whole cache, residual and
        sinks included (see :func:`element_bits`).
    """

    allocated: dict
    live: dict
    tokens_stored: tuple
    tokens_seen: tuple
    capacity: int
    by_spec: tuple = ()
    store_bits: float | None = None
    bits_per_element: float | None = None

    @property
    def allocated_bytes(self) -> int:
        return sum(self.allocated.values())

    @property
    def live_bytes(self) -> int:
        return sum(self.live.values())

    def summary(self) -> str:
        """One line, e.g. ``cache 1.25 MiB allocated, 0.80 MiB live (codes 0.50 MiB, ...)``.

        The per-group figures in parentheses are allocated bytes.
        """
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.allocated.items() if v)
        line = f"cache {format_bytes(self.allocated_bytes)} allocated, {format_bytes(self.live_bytes)} live ({parts})"
        if self.bits_per_element is not None:
            line += f"; {bits_text(self.store_bits, self.bits_per_element)}"
        if len(self.by_spec) > 1:
            line += "; " + "; ".join(
                f"{n} layer{'s' if n > 1 else ''} of {desc}: {format_bytes(b)}" for desc, n, b in self.by_spec
            )
        return line


def element_bits(cache) -> tuple[float | None, float]:
    """Effective bits per K/V element of a cache, counted from its leaves' shapes and dtypes
    (the cache, or its shapes from ``jax.eval_shape``: nothing is read).

    Returns:
      ``(store_bits, bits)``: ``store_bits`` = 8 x bytes of the quantised store (codes,
      scales and zeros; a float side's floats in a mixed cache) / the K/V elements it has
      slots for (``2 * L * B * K * W * H``), None for a cache without a store; ``bits`` = 8 x
      bytes of sinks, ring (window or residual) and store / the K/V elements of the whole
      capacity (``2 * L * B * K * C * H``). Positions and lengths (bookkeeping) are left out
      of both. A :class:`LayeredCache` sums over its runs of layers.
    """

    def nbytes(leaves):
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves if x is not None)

    store_bytes = store_elements = total_bytes = total_elements = 0
    for part in getattr(cache, "groups", (cache,)):
        per_slot = 2 * int(np.prod(part.ring_k.shape)) // part.ring_k.shape[3]  # K and V elements of one token slot
        ring = nbytes([part.sink_k, part.sink_v, part.ring_k, part.ring_v])
        store = 0 if part.quant is None else nbytes(jax.tree.leaves(part.quant.replace(pos=None)))
        if part.keep is not None:  # the keep tier's keys and values count with the whole cache
            ring += nbytes(jax.tree.leaves(part.policy.retention.layer_view(part.keep)))
        slots = 0 if part.quant is None else part.quant.pos.shape[1]
        store_bytes, store_elements = store_bytes + store, store_elements + per_slot * slots
        total_bytes, total_elements = total_bytes + ring + store, total_elements + per_slot * part.spec.capacity
    return (8 * store_bytes / store_elements if store_elements else None), 8 * total_bytes / total_elements


def bits_text(store_bits: float | None, bits: float) -> str:
    """``6.50 bits/element in the quantised store (codes + scales + zeros), 15.68 with residual and sinks``
    (or ``16.00 bits/element`` without a store)."""
    if store_bits is None:
        return f"{bits:.2f} bits/element"
    return f"{store_bits:.2f} bits/element in the quantised store (codes + scales + zeros), {bits:.2f} with residual and sinks"


def memory_report(cache: KVCache | LayeredCache) -> MemoryReport:
    """Count a cache's bytes from its leaves (host-side; reads the position arrays).

    For a :class:`LayeredCache` the groups sum over its runs of layers, ``tokens_stored``
    is that of the run holding the most and ``capacity`` that of the largest layer cache.

    Returns:
      a :class:`MemoryReport`; ``allocated`` sums to the bytes of every leaf of ``cache``.
    """
    allocated = dict.fromkeys(GROUPS, 0)
    live = dict.fromkeys(GROUPS, 0)

    def add(group, leaves, pos):
        nbytes = sum(int(x.nbytes) for x in leaves)
        allocated[group] += nbytes
        filled = float(np.mean(np.asarray(pos) >= 0)) if pos.size else 0.0
        live[group] += int(round(nbytes * filled))

    book = 0
    by_spec = {}
    for part in getattr(cache, "groups", (cache,)):  # a LayeredCache: every run of layers
        layers, nbytes = by_spec.get(part.spec.describe(), (0, 0))
        by_spec[part.spec.describe()] = (
            layers + part.ring_k.shape[0],
            nbytes + sum(int(x.nbytes) for x in jax.tree.leaves(part)),
        )
        if part.sink_k is not None:
            add("sinks", [part.sink_k, part.sink_v], part.sink_pos)
        add(part.storage.ring_group or part.policy.ring_group, [part.ring_k, part.ring_v], part.ring_pos)
        if part.quant is not None:
            for group, leaves, pos in part.storage.memory_groups(part.quant):
                add(group, leaves, pos)
        if part.keep is not None:
            for group, leaves, pos in part.policy.retention.memory_groups(part.keep):
                add(group, leaves, pos)
            book += sum(int(x.nbytes) for x in (part.keep.score, part.keep.ring_score) if x is not None)
        book += sum(int(x.nbytes) for x in [part.length] + part.positions())
    allocated["bookkeeping"] = live["bookkeeping"] = book
    store_bits, bits = element_bits(cache)
    return MemoryReport(
        allocated={k: v for k, v in allocated.items()},
        live=live,
        tokens_stored=tuple(int(x) for x in np.asarray(cache.stored())),
        tokens_seen=tuple(int(x) for x in np.asarray(cache.length)),
        capacity=cache.spec.capacity,
        by_spec=tuple((desc, n, b) for desc, (n, b) in by_spec.items()),
        store_bits=store_bits,
        bits_per_element=bits,
    )
