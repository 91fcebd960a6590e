"""The keep tier: tokens leaving the StreamingLLM window, kept by a rule instead of dropped.

A cache with ``keep = C > 0`` (:attr:`jaxkv.cache.spec.CacheSpec.keep`) holds, besides its
sinks and its window, a *keep tier* of C slots (:class:`KeepTier`). Each token that leaves the
window (its ring slot is overwritten) competes with the tokens in the tier: if the tier has
an empty slot it takes it, else it replaces the tier's lowest-priority token when its own
priority is higher, else it is dropped. Competing one leaving token at a time, the tier
holds the C highest-priority tokens that ever left the window. The priority is the rule's
(:attr:`Retention.rule`):

* ``recent``: the position (a FIFO of the last C tokens to leave). With a lower-precision
  tier (``keep_quantize="int2"``) this is *tiered retention*: evicted tokens move to a cheaper
  ring instead of being dropped (MiKV, Yang et al. 2024, arXiv 2402.18096, §3).
* ``h2o``: the attention mass a token received, summed over every query, layer and head
  since it was written (Heavy-Hitter Oracle, Zhang et al. 2023, arXiv 2306.14048, §3.3).
* ``tova``: the attention mass from the last query of the latest call (TOVA, Oren et al.
  2024, arXiv 2401.06104, §3): tier tokens are rescored at every call; a leaving token carries
  the score of the last call that still saw it.
* ``snapkv``: the attention mass from the last :data:`OBSERVE` prompt tokens over the whole
  prompt, max-pooled over :data:`POOL` neighbouring positions (SnapKV, Li et al. 2024, arXiv
  2404.14469, §4.2-4.3). The prompt is scored by one observation pass over a full cache and
  replayed into this one (:func:`jaxkv.decode.loop.prefill`); tokens that leave the window later,
  during decode, are dropped as StreamingLLM drops them.

Shapes are static (the tier is C slots; admission is one exact-slot write per leaving token),
and one kept set serves every layer and head of a row: the scores are summed over them, so
positions stay one ``int32[B, C]`` per row like every other segment (SnapKV and TOVA select
per head; here one set per row). Tier tokens are stored as the window stores them (float),
or per-token quantised (int8/int4/int2: codes, one scale and zero per token and head, the KIVI
value kernels of :mod:`jaxkv.cache.kivi` for keys and values alike).

In ``positions="cache"`` mode (StreamingLLM §3.2) a tier token's RoPE rank is ``S0 + `` the
number of tier tokens before it, and the window's ranks start after the tier: ranks stay the
positions *in the cache*, oldest first.

Timing: the tokens that leave the window in a call compete for the tier at the call's start
(:meth:`jaxkv.cache.kv.KVCache.begin`), so the call's queries already see them there (a tier token
is visible to a query whose window it has left, :meth:`jaxkv.cache.policy.Policy.kept_visible`);
the scores take the call's attention at its end (:meth:`jaxkv.cache.kv.KVCache.commit`). Decoding
token by token is thus exact for every rule (the tests check each against a NumPy simulation,
slot by slot). A prefill chunk of T tokens admits its leaving tokens at once and scores them with
the chunk's queries together, so for ``h2o``/``tova`` it is an approximation of token by token;
``recent`` keeps the same set in chunks (its priority is the position), and ``snapkv`` is defined
on the whole prompt (its replay keeps the same set whatever the chunking).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from jaxkv.cache import kivi
from jaxkv.cache.ring import write_ring
from jaxkv.cache.rotation import hadamard, rotate
from jaxkv.cache.storage import FLOAT_DTYPES, Segment, Storage, as_container

RULES = ("recent", "h2o", "tova", "snapkv")
OBSERVE = 32  # SnapKV's observation window: the last prompt tokens whose attention scores the prompt
POOL = 7  # SnapKV's pooling kernel over positions (keeps a selected token's neighbours)
BITS = {"int8": 8, "int4": 4, "int2": 2}


class Mass(NamedTuple):
    """Attention mass one call's queries gave each slot, summed over query heads (one layer;
    stacked on L by the model's layer loop): see :func:`jaxkv.cache.attention.attend`.

    Attributes:
      ring: float32[B, R], the window's (or KIVI residual's) slots. keep: float32[B, C], the
      tier's slots. chunk: float32[B, T], the call's own tokens. store: float32[B, W], the
      slots of a storage's compressed store (KIVI's quantised window; [B, 0] without one).
    """

    ring: jax.Array
    keep: jax.Array
    chunk: jax.Array
    store: jax.Array


@struct.dataclass
class KeepTier:
    """The keep tier's leaves (see the module docstring).

    Attributes:
      k, v: ``[L, B, K, C, H]`` floats (the container dtype of the tier), or uint8 codes
        ``[L, B, K, C, H / cpb]`` of a quantised tier.
      k_scale, k_zero, v_scale, v_zero: ``[L, B, K, C]`` (scale_dtype), one pair per token
        and head of a quantised tier, else None.
      pos: int32[B, C], the absolute position per slot, -1 = empty (None in a per-layer view).
      score: float32[B, C], each slot's score (None for ``recent`` and in a per-layer view).
      ring_score: float32[B, R], the score of each window (KIVI: residual) slot, carried into
        the tier when the token leaves the window (None for ``recent`` and in a per-layer view).
      store_score: float32[B, W], the same for the slots of a KIVI window's quantised ring
        (moved there from ``ring_score`` by a flush), else None.
    """

    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None
    k_zero: jax.Array | None
    v_scale: jax.Array | None
    v_zero: jax.Array | None
    pos: jax.Array | None
    score: jax.Array | None
    ring_score: jax.Array | None
    store_score: jax.Array | None = None


_TOKEN_LEAVES = ("k", "v", "k_scale", "k_zero", "v_scale", "v_zero")


@dataclasses.dataclass(frozen=True)
class Retention:
    """What the keep tier keeps and how it stores it (frozen, hashable; part of the policy).

    Attributes:
      slots: C, tier slots (0: no tier; a full cache's scoring pass only tracks scores).
      rule: ``recent``, ``h2o``, ``tova`` or ``snapkv`` (see the module docstring).
      kind: the tier's storage, fp32|fp16|bf16 or int8|int4|int2 (per-token codes).
      scale_dtype: storage dtype of a quantised tier's scales and zeros.
      rotate_keys, rotate_values: a quantised tier quantises ``x @ M`` (M the head's orthonormal
        Hadamard matrix, :mod:`jaxkv.cache.rotation`), folded into attention's read as KIVI's
        rotated sides are: per-token codes of rotated keys spread a channel's outliers over all.
    """

    slots: int = 0
    rule: str = "recent"
    kind: str = "fp16"
    scale_dtype: str = "float16"
    rotate_keys: bool = False
    rotate_values: bool = False

    @property
    def attention_scored(self) -> bool:
        """True when every call's attention mass updates the scores (``h2o``, ``tova``)."""
        return self.rule in ("h2o", "tova")

    @property
    def observes_prompt(self) -> bool:
        """True when the tier is chosen by an observation pass over the whole prompt (``snapkv``:
        :func:`jaxkv.decode.loop.prefill` prefills an empty cache through :meth:`CacheSpec.observer`)."""
        return self.rule == "snapkv"

    @property
    def tracked(self) -> bool:
        """True when slots carry a score (every rule but ``recent``, whose priority is the position)."""
        return self.rule != "recent"

    @property
    def bits(self) -> int | None:
        """Bits per code of a quantised tier (None: floats)."""
        return BITS.get(self.kind)

    def describe(self) -> str:
        rotated = [side for side, on in (("K", self.rotate_keys), ("V", self.rotate_values)) if on]
        return f"keep {self.slots} {self.rule} ({self.kind}{', Hadamard ' + '+'.join(rotated) if rotated else ''})"

    # ---- leaves ----------------------------------------------------------------------------------
    def create(self, *, lbk: tuple, head_dim: int, batch: int, ring: int, store: int = 0) -> KeepTier:
        """An empty tier: every slot position -1, every score 0 (``ring``, ``store``: the
        window's full-precision and compressed slots, whose scores it tracks).

        Raises:
          JaxkvError: a quantised tier with ``head_dim`` not a multiple of the codes per byte.
        """
        c = self.slots
        if self.bits is None:
            leaves = {name: as_container(jnp.zeros(lbk + (c, head_dim)), FLOAT_DTYPES[self.kind]) for name in "kv"}
        else:
            kivi._check_last_axis(head_dim, self.bits)
            if self.rotate_keys or self.rotate_values:
                hadamard(head_dim)  # refuses a head_dim that is not a power of two
            leaves = {name: jnp.zeros(lbk + (c, head_dim * self.bits // 8), jnp.uint8) for name in "kv"}
            leaves.update(
                {
                    f"{side}_{name}": fill(lbk + (c,), self.scale_dtype)
                    for side in "kv"
                    for name, fill in (("scale", jnp.ones), ("zero", jnp.zeros))
                }
            )
        score = jnp.zeros((batch, c), jnp.float32) if self.tracked else None
        return KeepTier(
            **{name: leaves.get(name) for name in _TOKEN_LEAVES},
            pos=jnp.full((batch, c), -1, jnp.int32),
            score=score,
            ring_score=jnp.zeros((batch, ring), jnp.float32) if self.tracked else None,
            store_score=jnp.zeros((batch, store), jnp.float32) if self.tracked and store else None,
        )

    def layer_view(self, tier: KeepTier) -> KeepTier:
        """The per-layer leaves (k, v, scales) without the per-row arrays."""
        return tier.replace(pos=None, score=None, ring_score=None, store_score=None)

    def _encode(self, k, v) -> dict:
        """Tier leaves of keys/values ``float[..., T, H]``."""
        if self.bits is None:
            return dict(k=as_container(k, FLOAT_DTYPES[self.kind]), v=as_container(v, FLOAT_DTYPES[self.kind]))
        if self.rotate_keys:
            k = rotate(k, jnp.asarray(hadamard(k.shape[-1])))
        if self.rotate_values:
            v = rotate(v, jnp.asarray(hadamard(v.shape[-1])))
        qk = kivi.quantize_values(k, bits=self.bits, scale_dtype=self.scale_dtype)
        qv = kivi.quantize_values(v, bits=self.bits, scale_dtype=self.scale_dtype)
        return dict(k=qk.codes, k_scale=qk.scale, k_zero=qk.zero, v=qv.codes, v_scale=qv.scale, v_zero=qv.zero)

    def segment(self, tier: KeepTier, pos, dtype) -> Segment:
        """One layer of the tier as an attention :class:`Segment` (dequantised per token)."""
        if self.bits is None:
            return Segment([Storage.read(tier.k).astype(dtype)], [Storage.read(tier.v)], pos)
        k = kivi.dequantize_values(kivi.QuantizedValues(tier.k, tier.k_scale, tier.k_zero), bits=self.bits, dtype=dtype)
        v = kivi.dequantize_values(kivi.QuantizedValues(tier.v, tier.v_scale, tier.v_zero), bits=self.bits, dtype=dtype)
        m = jnp.asarray(hadamard(k.shape[-1])) if self.rotate_keys or self.rotate_values else None
        return Segment(
            [k],
            [v],
            pos,
            key_rotation=m if self.rotate_keys else None,
            value_rotation=m if self.rotate_values else None,
        )

    def memory_groups(self, tier: KeepTier) -> list:
        """``[("keep", leaves, pos)]`` for the memory report (codes, scales and zeros, or floats)."""
        leaves = [getattr(tier, name) for name in _TOKEN_LEAVES if getattr(tier, name) is not None]
        return [("keep", leaves, tier.pos)]

    # ---- one call: admission at begin, scores at commit --------------------------------------------
    def reduce_queries(self, probs, q_pos):
        """Mass per slot of one segment's probabilities ``float32[B, K, G, T, S]``: summed over
        heads and the call's queries (``h2o``, a scoring pass), or from its last query only
        (``tova``). Returns float32[B, S]."""
        per_query = jnp.sum(probs, axis=(1, 2))  # [B, T, S]
        if self.rule == "tova":
            last = jnp.argmax(q_pos, axis=1)  # the last valid query of each row
            return jnp.take_along_axis(per_query, last[:, None, None], axis=1)[:, 0]
        return jnp.sum(per_query, axis=1)

    def admit(self, tier: KeepTier, leaving) -> KeepTier:
        """The tier after the tokens leaving the window in this call competed for it, in order.

        Args:
          leaving: the storage's :class:`~jaxkv.cache.storage.Leaving` tokens (:meth:`jaxkv.cache.storage.Storage.leaving`).
        """
        if not self.slots:
            return tier
        cand = self._encode(leaving.k, leaving.v)
        score = None
        if self.tracked:
            carried = tier.ring_score if leaving.store is None else leaving.store
            score = jnp.take_along_axis(carried, leaving.slots, axis=1)
        return self._admit(tier, cand, leaving.pos, score)

    def rescore(
        self,
        tier: KeepTier,
        *,
        ring_slot,
        n,
        chunk: int,
        mass: Mass | None,
        token_score=None,
        batch_parallel: bool = False,
    ) -> KeepTier:
        """The scores after a call appended ``n[b]`` tokens at ring slot ``ring_slot[b]``: the tier's
        and the window's slots take the call's mass (``h2o`` adds it, ``tova`` replaces), the new
        tokens' slots their own mass; a ``snapkv`` cache gives them ``token_score`` (a replay's
        observation scores) or ``-inf`` (decode: a token nobody observed).

        Args:
          ring_slot: int32[B]. n: int32[B] tokens written to the ring. chunk: T.
          mass: the call's :class:`Mass` summed over layers (``h2o``/``tova``; else None).
          token_score: float32[B, T] or None.
        """
        if not self.tracked:
            return tier
        put = dict(batch_axis=0, slot_axis=1, batch_parallel=batch_parallel)
        if self.rule == "snapkv":
            new = jnp.full((n.shape[0], chunk), -jnp.inf, jnp.float32) if token_score is None else token_score
            return tier.replace(ring_score=write_ring(tier.ring_score, new.astype(jnp.float32), ring_slot, n, **put))
        h2o = self.rule == "h2o"
        scores = {
            name: (getattr(tier, name) + m if h2o else m)
            for name, m in (("score", mass.keep), ("ring_score", mass.ring), ("store_score", mass.store))
            if getattr(tier, name) is not None
        }
        scores["ring_score"] = write_ring(scores["ring_score"], mass.chunk, ring_slot, n, **put)
        return tier.replace(**scores)

    def _admit(self, tier: KeepTier, cand: dict, cand_pos, cand_score) -> KeepTier:
        """Each valid candidate (``cand_pos >= 0``), in order, takes an empty slot, or the slot
        of the lowest priority when its own is higher (ties keep the tier's token)."""
        b_rows, t = cand_pos.shape

        def priority(pos, score):  # empty slots lowest
            if self.tracked:
                return jnp.where(pos >= 0, score, -jnp.inf)
            return jnp.where(pos >= 0, pos, -1)

        def one(i, tier):
            b, j = i // t, i % t
            p = cand_pos[b, j]
            own = priority(p, None if cand_score is None else cand_score[b, j])
            pri = priority(tier.pos[b], None if tier.score is None else tier.score[b])
            slot = jnp.argmin(pri).astype(jnp.int32)
            take = (p >= 0) & ((tier.pos[b, slot] < 0) | (own > pri[slot]))
            put = {}
            for name, x in cand.items():  # [L, B, K, T, ...] -> this token's slot
                old = getattr(tier, name)
                idx = (0, b, 0, slot) + (0,) * (old.ndim - 4)
                sizes = (old.shape[0], 1, old.shape[2], 1) + old.shape[4:]
                new = lax.dynamic_slice(x, (0, b, 0, j) + (0,) * (x.ndim - 4), sizes)
                put[name] = lax.dynamic_update_slice(old, jnp.where(take, new, lax.dynamic_slice(old, idx, sizes)), idx)
            put["pos"] = lax.dynamic_update_slice(
                tier.pos, jnp.where(take, p, tier.pos[b, slot])[None, None], (b, slot)
            )
            if self.tracked:
                put["score"] = lax.dynamic_update_slice(
                    tier.score, jnp.where(take, cand_score[b, j], tier.score[b, slot])[None, None], (b, slot)
                )
            return tier.replace(**put)

        return lax.fori_loop(0, b_rows * t, one, tier)

    def ranks(self, tier_pos, sink: int):
        """int32[B, C]: each tier token's rank in the cache (``positions="cache"``): ``sink`` + the
        tier tokens before it (0 for an empty slot)."""
        live = tier_pos >= 0
        before = (tier_pos[:, None, :] < tier_pos[:, :, None]) & live[:, None, :]
        return jnp.where(live, sink + jnp.sum(before, axis=2).astype(jnp.int32), 0)


def pooled(score, length):
    """SnapKV's clustering: ``score float32[B, S]`` max-pooled over :data:`POOL` neighbouring
    positions (slots beyond ``length[b]`` do not count). Returns float32[B, S]."""
    s = jnp.where(jnp.arange(score.shape[1])[None] < length[:, None], score, -jnp.inf)
    return lax.reduce_window(s, -jnp.inf, lax.max, (1, POOL), (1, 1), [(0, 0), (POOL // 2, POOL // 2)])
