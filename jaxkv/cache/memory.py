"""Memory report of a `KVCache`, counted from its pytree leaves (DESIGN §2 "Memory report")."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.cache.kv import KVCache

GROUPS = ("sinks", "window", "slots", "residual", "codes", "scales_zeros", "bookkeeping")


def format_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes of a KV cache, by group, allocated versus holding live tokens.

    Attributes:
      allocated: bytes per group for the whole capacity (what the device holds).
      live: bytes per group of the slots holding a live token (bookkeeping counts whole).
      tokens_stored: int per row, tokens the cache holds now.
      tokens_seen: int per row, tokens ever appended (prompt plus fed generated tokens).
      capacity: token slots per row (sinks + window/residual + quantised ring).
    """

    allocated: dict
    live: dict
    tokens_stored: tuple
    tokens_seen: tuple
    capacity: int

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
        return f"cache {format_bytes(self.allocated_bytes)} allocated, {format_bytes(self.live_bytes)} live ({parts})"


def memory_report(cache: KVCache) -> MemoryReport:
    """Count a cache's bytes from its leaves (host-side; reads the position arrays).

    Returns:
      a :class:`MemoryReport`; ``allocated`` sums to the bytes of every leaf of ``cache``.
    """
    spec = cache.spec
    allocated = dict.fromkeys(GROUPS, 0)
    live = dict.fromkeys(GROUPS, 0)

    def add(group, leaves, pos):
        nbytes = sum(int(x.nbytes) for x in leaves)
        allocated[group] += nbytes
        filled = float(np.mean(np.asarray(pos) >= 0)) if pos.size else 0.0
        live[group] += int(round(nbytes * filled))

    if cache.sink_k is not None:
        add("sinks", [cache.sink_k, cache.sink_v], cache.sink_pos)
    ring_group = "residual" if spec.quantized else "window" if spec.bounded else "slots"  # slots: a full cache
    add(ring_group, [cache.ring_k, cache.ring_v], cache.ring_pos)
    pos_leaves = [cache.length, cache.ring_pos] + ([cache.sink_pos] if cache.sink_pos is not None else [])
    if cache.quant is not None:
        q = cache.quant
        add("codes", [q.k_codes, q.v_codes], q.pos)
        add("scales_zeros", [q.k_scale, q.k_zero, q.v_scale, q.v_zero], q.pos)
        pos_leaves.append(q.pos)
    book = sum(int(x.nbytes) for x in pos_leaves)
    allocated["bookkeeping"] = live["bookkeeping"] = book
    return MemoryReport(
        allocated={k: v for k, v in allocated.items()},
        live=live,
        tokens_stored=tuple(int(x) for x in np.asarray(cache.stored())),
        tokens_seen=tuple(int(x) for x in np.asarray(cache.length)),
        capacity=spec.capacity,
    )
