"""Samplers: the next-token rule of the compiled decode loop, and the PRNG keys it draws from."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.errors import JaxkvError, check_int

SEED_LIMIT = 2**32  # seeds are uint32: PRNGKey(2**32) would be PRNGKey(0), PRNGKey(-1) PRNGKey(2**32 - 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampler:
    """Next-token rule: greedy (temperature 0) or temperature with optional top-k / top-p.

    Attributes:
      temperature: >= 0; 0 means greedy argmax.
      top_k: keep the k most likely tokens (None = all); >= 1.
      top_p: nucleus sampling, keep the smallest set whose probability reaches p; in (0, 1].
    Raises:
      JaxkvError: on values outside those ranges.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise JaxkvError(f"temperature={t!r}: expected a finite number >= 0 (0 = greedy)")
        if self.top_k is not None:
            check_int("top_k", self.top_k, 1)
        if self.top_p is not None and not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise JaxkvError(f"top_p={self.top_p!r}: expected a number in (0, 1]")

    def get_next_tokens(self, logits, rng):
        """int32[B] next tokens from float32 logits ``[B, V]`` and a PRNG key (or one key per row, ``[B, 2]``)."""
        if self.temperature == 0:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits = logits.astype(jnp.float32) / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = lax.top_k(logits, self.top_k)[0][:, -1:]
            logits = jnp.where(logits < kth, -jnp.inf, logits)
        if self.top_p is not None and self.top_p < 1:
            sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
            probs = jax.nn.softmax(sorted_logits, axis=-1)
            before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
            kept = jnp.where(before < self.top_p, sorted_logits, jnp.inf)
            threshold = jnp.min(kept, axis=-1, keepdims=True)
            logits = jnp.where(logits < threshold, -jnp.inf, logits)
        keys = rng if rng.ndim == 2 else jax.random.split(rng, logits.shape[0])
        return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def prng_keys(seed, batch: int):
    """One PRNG key for an int seed (rows draw from its split), or one key per row ``[B, 2]``
    for B seeds (each row's draws then depend only on its own seed, not on its batch).

    Raises:
      JaxkvError: a seed list whose length is not ``batch``, seeds that are not integers, or
      seeds outside ``[0, 2**32)`` (refused, not wrapped).
    """
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return jax.random.PRNGKey(check_int("seed", seed, 0, SEED_LIMIT))
    seeds = list(seed)
    if len(seeds) != batch or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in seeds):
        raise JaxkvError(f"seed: expected an integer or {batch} integers (one per row), got {seed!r}")
    return jnp.stack([jax.random.PRNGKey(check_int(f"seed[{i}]", s, 0, SEED_LIMIT)) for i, s in enumerate(seeds)])


def sample_rows(logits, temperature, top_k, top_p, keys, steps):
    """Per-row sampling with traced parameters: what :meth:`Sampler.get_next_tokens` draws for
    each row on its own, the row's settings arrays instead of static fields, so that rows of
    any settings share one compiled program (the serving engine's decode step).

    Row ``b`` draws exactly what ``Sampler(temperature=temperature[b], top_k=..., top_p=...)``
    draws for a one-row batch seeded ``PRNGKey(seed)`` at sampling step ``steps[b]`` (its
    :func:`jaxkv.sample` run with that seed): the key ``split(fold_in(keys[b], steps[b]), 1)[0]``.

    Args:
      logits: float32[B, V]. temperature: float32[B], 0 = greedy. top_k: int32[B] in [1, V]
        (V = all tokens). top_p: float32[B] in (0, 1] (1 = all). keys: uint32[B, 2], one
        ``PRNGKey(seed)`` per row. steps: int32[B], each row's sampling step.
    Returns:
      int32[B] next tokens. The draws (V random numbers a row: 16 ms for 16 rows of SmolLM2's
      49,152 on a 2-core CPU) run only when some row samples, the sort that top-k / top-p
      need only when some row uses them.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    vocab = logits.shape[-1]

    def truncated(scaled):
        ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
        kth = jnp.take_along_axis(ordered, jnp.clip(top_k, 1, vocab)[:, None] - 1, axis=-1)
        scaled = jnp.where((top_k < vocab)[:, None] & (scaled < kth), -jnp.inf, scaled)
        ordered = jnp.sort(scaled, axis=-1)[:, ::-1]  # the top-k survivors, as Sampler sorts them
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        threshold = jnp.min(jnp.where(before < top_p[:, None], ordered, jnp.inf), axis=-1, keepdims=True)
        return jnp.where((top_p < 1)[:, None] & (scaled < threshold), -jnp.inf, scaled)

    def drawn(scaled):
        needs_sort = jnp.any((temperature > 0) & ((top_k < vocab) | (top_p < 1)))
        scaled = lax.cond(needs_sort, truncated, lambda x: x, scaled)
        row_keys = jax.vmap(lambda k, s: jax.random.split(jax.random.fold_in(k, s), 1)[0])(keys, steps)
        return jnp.where(temperature > 0, jax.vmap(jax.random.categorical)(row_keys, scaled).astype(jnp.int32), greedy)

    return lax.cond(jnp.any(temperature > 0), drawn, lambda _: greedy, scaled)
