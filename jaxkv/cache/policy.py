"""Cache policies: which positions a cache keeps, where each lives, and at which RoPE rank.

A *policy* is one extension axis of the cache (the other is the *storage*,
:mod:`jaxkv.cache.storage`). It owns, for every row of a batch:

* the retained set and the attention mask (:meth:`Policy.visible`, DESIGN §2);
* the slot of each position (sink slot ``p`` for ``p < S0``, else ring slot
  ``(p - S0) % ring``) and how many tokens a row may append (:meth:`Policy.admit`);
* the RoPE rank of a key and a query in ``positions="cache"`` mode (StreamingLLM §3.2,
  :meth:`Policy.rope_offsets`);
* the host-side chunk plan of a prefill (:meth:`Policy.plan_chunk`).

Everything on arrays is int32 (DESIGN §1: unsigned index dtypes crash jax-metal) and works
on per-row arrays, so rows of one batch wrap at different steps.

The retained set of a storage that flushes lazily (KIVI: the residual moves into the
quantised ring ``flush`` tokens at a time, when it is full and a new token arrives) counts
the window over *flushed* tokens: after token ``q`` the flushed count is
``F(q) = flush * floor((q - S0) / flush)`` and the window starts at
``S0 + max(0, F(q) - W)``; the residual is always retained. ``flush = 0`` means a storage
that writes every token straight into the window (float storage).

Adding a policy (e.g. score-based eviction) means one new class with these methods and
one line in :attr:`jaxkv.cache.spec.CacheSpec.policy`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxkv.cache.retention import Retention

POSITION_MODES = ("absolute", "cache")


@dataclasses.dataclass(frozen=True)
class Policy:
    """Common part of every policy (frozen, hashable: a static argument of ``jax.jit``).

    Attributes:
      sink: S0, first positions always kept (0 for none).
      positions: ``absolute`` (keys rotated at their absolute position before storing) or
        ``cache`` (keys stored before RoPE, rotated on read at their rank, StreamingLLM §3.2).
      pre_rope: in ``absolute`` mode too, keys are stored before RoPE and rotated on read at
        their absolute position (better per-channel statistics for KIVI keys: KVQuant,
        Hooper et al. 2024, arXiv 2401.18079, §3.2); the same logits within float rounding.
      flush: tokens a lazily flushing storage moves at a time (KIVI residual R), 0 = none.
      attention_window: A > 0: queries see only the last A positions (a model's local
        sliding-window layer), whatever else is stored; 0 = no such limit.
      retention: None, or the keep tier of tokens leaving the window (:mod:`jaxkv.cache.retention`).
    """

    sink: int = 0
    positions: str = "absolute"
    pre_rope: bool = False
    flush: int = 0
    attention_window: int = 0
    retention: Retention | None = None

    # ---- sizes (static Python ints) ------------------------------------------------------------
    token_limit = None  # most tokens a row may append (None = unbounded)
    bounded = True  # the cache stops growing (a window policy)
    ring_group = "window"  # memory-report group of the full-precision ring of a float storage

    @property
    def rope_at_rank(self) -> bool:
        """True when RoPE positions are ranks in the cache (``positions="cache"``, StreamingLLM §3.2)."""
        return self.positions == "cache"

    @property
    def keys_pre_rope(self) -> bool:
        """True when keys are stored before RoPE and rotated on read (``positions="cache"``, or
        ``pre_rope`` in absolute mode)."""
        return self.rope_at_rank or self.pre_rope

    # ---- retained set (traced, int32) ------------------------------------------------------------
    def window_start(self, q):
        """First non-sink position query ``q`` attends to (int32, same shape as ``q``)."""
        raise NotImplementedError

    def visible(self, q, p):
        """bool mask: query at position ``q`` attends to key at position ``p`` (``-1`` = empty/padding).

        ``q`` and ``p`` broadcast against each other, e.g. ``q[B, T, 1]`` with ``p[B, 1, S]``.
        """
        mask = (q >= 0) & (p >= 0) & (p <= q) & ((p < self.sink) | (p >= self.window_start(q)))
        if self.attention_window:
            mask &= p > q - self.attention_window
        return mask

    def kept_visible(self, q, p):
        """bool mask of the keep tier (:mod:`jaxkv.cache.retention`): a kept token is visible to
        every query whose window it has left (a prefill chunk's early queries still see the
        chunk's leaving tokens in the window), ``q``/``p`` as in :meth:`visible`."""
        mask = (q >= 0) & (p >= 0) & (p < self.window_start(q))
        if self.attention_window:
            mask &= p > q - self.attention_window
        return mask

    def rank(self, q, n_keep=0):
        """Rank of query ``q`` in its own retained set (StreamingLLM §3.2 position in the cache).

        Sinks are ranks ``0..S0-1``, then the ``n_keep`` (int32[B, 1] or 0) tokens of a keep
        tier, then the window oldest first, so ``rank(q) = q`` for ``q < S0`` and
        ``S0 + n_keep + q - window_start(q)`` otherwise.
        """
        return jnp.where(q < self.sink, q, self.sink + n_keep + q - self.window_start(q))

    def rope_offsets(self, q_pos, n_keep=None):
        """RoPE positions of one chunk: ``(q_rot_sink int32[B, T], q_rot int32[B, T], k_shift int32[B])``.

        In ``cache`` mode a key's RoPE position is its rank in the query's retained set.
        Only ``rank(q) - rank(p)`` matters, so window keys are rotated at ``p - k_shift``
        (their exact rank for the chunk's last query) and queries at ``q - k_shift``; sink
        and keep-tier keys at their rank and queries at ``rank(q)``. Each query of a chunk
        thus sees the ranks of its own retained set. In ``absolute`` mode everything uses
        absolute positions (``k_shift = 0``), whether keys are stored before or after RoPE.

        Args:
          q_pos: int32[B, T]. n_keep: None, or int32[B], the tokens in each row's keep tier.
        """
        if not self.rope_at_rank:
            return q_pos, q_pos, jnp.zeros(q_pos.shape[:1], jnp.int32)
        kept = jnp.zeros(q_pos.shape[:1], jnp.int32) if n_keep is None else n_keep
        last = jnp.maximum(jnp.max(q_pos, axis=1), 0)
        k_shift = self.window_start(last) - self.sink - kept
        q_rot = jnp.where(q_pos >= 0, q_pos - k_shift[:, None], 0)
        q_rot_sink = jnp.where(q_pos >= 0, self.rank(q_pos, kept[:, None]), 0)
        return q_rot_sink, q_rot, k_shift

    # ---- appends ----------------------------------------------------------------------------------
    def write_slots(self, length, ring: int):
        """Where each row's next tokens go: ``(in_sink bool[B], sink_slot int32[B], ring_slot int32[B])``.

        Position ``p < S0`` lives in sink slot ``p``, any later one in ring slot
        ``(p - S0) % ring`` (DESIGN §2); a chunk starting in the sinks stays there
        (:meth:`plan_chunk`), so one start per region suffices.
        """
        in_sink = length < self.sink
        return in_sink, jnp.minimum(length, max(self.sink - 1, 0)), jnp.maximum(length - self.sink, 0) % ring

    def admit(self, length, n):
        """int32[B]: how many of ``n[b]`` new tokens row ``b`` (holding ``length[b]``) may append."""
        n = jnp.asarray(n, jnp.int32)
        if self.token_limit is not None:
            n = jnp.clip(n, 0, self.token_limit - length)
        return n

    def plan_chunk(self, length: np.ndarray, remaining: np.ndarray, chunk: int) -> np.ndarray:
        """Host-side: how many tokens each row appends in the next prefill call.

        A chunk never crosses the sink/window boundary, never holds more tokens than the
        ring, and never crosses a lazy flush, so every query of the chunk sees the same
        stored tokens it would see token by token (DESIGN §2).

        Args:
          length: int[B], tokens already in each row. remaining: int[B], tokens left to append.
          chunk: T, the static chunk length of the compiled call (``<= max_chunk``).
        Returns:
          int32[B] tokens per row, ``0 <= n <= min(remaining, chunk)``.
        """
        length = np.asarray(length, np.int64)
        n = np.minimum(np.asarray(remaining, np.int64), chunk)
        in_sink = length < self.sink
        n = np.where(in_sink, np.minimum(n, self.sink - length), n)
        if self.flush:
            u = np.maximum(length - self.sink, 0)
            n = np.where(in_sink, n, np.minimum(n, self.flush - u % self.flush))
        return n.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class FullCache(Policy):
    """Every token up to ``max_len`` slots; a row never appends beyond them (DESIGN §2)."""

    max_len: int = 1
    bounded = False
    ring_group = "slots"

    @property
    def token_limit(self) -> int:
        return self.max_len

    def window_start(self, q):
        return jnp.full_like(q, self.sink)  # every position after the sinks (none evicted)


@dataclasses.dataclass(frozen=True)
class StreamingLLM(Policy):
    """The first ``sink`` tokens plus the last ``window`` (flushed) tokens (StreamingLLM §3, DESIGN §2)."""

    window: int = 1

    def window_start(self, q):
        s0 = self.sink
        if self.flush:
            flushed = self.flush * (jnp.maximum(q - s0, 0) // self.flush)
            return s0 + jnp.maximum(flushed - self.window, 0)
        return jnp.maximum(s0, q - self.window + 1)
