"""Samplers: the next-token rule of the compiled decode loop, and the PRNG keys it draws from."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

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
        """int32[B] next tokens from float32 logits ``[B, V]`` and a PRNG key (the rows draw from
        its ``split`` into B keys) or one key per row ``[B, 2]`` (used as it is):
        :func:`sample_rows` with this rule on every row."""
        keys = rng if rng.ndim == 2 else jax.random.split(rng, logits.shape[0])
        return sample_rows(logits, SamplingRows.of(self, logits.shape[0], logits.shape[-1]), keys)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Each row's next-token rule as arrays (a pytree), so that rows of any settings share one
    compiled decode loop (:func:`jaxkv.decode.loop.decode_block`, the serving engine's calls).

    Attributes:
      temperature: float32[B], 0 = greedy. top_k: int32[B] in [1, V] (V = every token).
      top_p: float32[B] in (0, 1] (1 = every token).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array

    @classmethod
    def of(cls, sampler: Sampler | Sequence[Sampler], batch: int, vocab: int) -> SamplingRows:
        """The arrays of one :class:`Sampler` for every row, or of B samplers (one per row), for a
        vocabulary of ``vocab`` tokens. Raises: JaxkvError: a list whose length is not ``batch``,
        or an entry that is not a :class:`Sampler`."""
        samplers = [sampler] * batch if isinstance(sampler, Sampler) else list(sampler)
        if len(samplers) != batch or not all(isinstance(s, Sampler) for s in samplers):
            raise JaxkvError(f"sampler: expected a jaxkv.Sampler or {batch} of them (one per row), got {sampler!r}")
        return cls(
            temperature=np.array([s.temperature for s in samplers], np.float32),
            top_k=np.array([min(s.top_k or vocab, vocab) for s in samplers], np.int32),
            top_p=np.array([1.0 if s.top_p is None else s.top_p for s in samplers], np.float32),
        )


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


def step_keys(rng, steps):
    """uint32[B, 2]: the key each row samples its next token with at sampling steps ``steps:
    int32[B]``. ``rng``: one PRNG key ``[2]`` shared by the rows (they sample in step, each
    ``split(fold_in(rng, step), B)[b]``: what :meth:`Sampler.get_next_tokens` draws for a batch)
    or one key per row ``[B, 2]`` (``split(fold_in(rng[b], steps[b]), 1)[0]``: what a one-row
    batch seeded alike draws, so a row's tokens depend on its own seed and step alone)."""
    if rng.ndim == 1:  # the rows still sampling share one step (finished rows stop counting)
        return jax.random.split(jax.random.fold_in(rng, jnp.max(steps)), steps.shape[0])
    return jax.vmap(lambda k, s: jax.random.split(jax.random.fold_in(k, s), 1)[0])(rng, steps)


def sample_rows(logits, rows: SamplingRows, keys):
    """Each row's next token under its own rule: temperature with optional top-k / top-p, or
    greedy argmax at temperature 0, with traced settings so that rows of any settings share one
    compiled program.

    Args:
      logits: float32[B, V]. rows: the rules (:class:`SamplingRows`). keys: uint32[B, 2], each
        row's key for this token (:func:`step_keys`).
    Returns:
      int32[B] next tokens. The draws (V random numbers a row: 16 ms for 16 rows of SmolLM2's
      49,152 on a 2-core CPU) run only when some row samples, the sorts that top-k / top-p
      need only when some row uses them.
    """
    temperature, top_k, top_p = rows.temperature, rows.top_k, rows.top_p
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    vocab = logits.shape[-1]

    def truncated(scaled):
        ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
        kth = jnp.take_along_axis(ordered, jnp.clip(top_k, 1, vocab)[:, None] - 1, axis=-1)
        scaled = jnp.where((top_k < vocab)[:, None] & (scaled < kth), -jnp.inf, scaled)
        ordered = jnp.sort(scaled, axis=-1)[:, ::-1]  # the top-k survivors
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        threshold = jnp.min(jnp.where(before < top_p[:, None], ordered, jnp.inf), axis=-1, keepdims=True)
        return jnp.where((top_p < 1)[:, None] & (scaled < threshold), -jnp.inf, scaled)

    def drawn(scaled):
        needs_sort = jnp.any((temperature > 0) & ((top_k < vocab) | (top_p < 1)))
        scaled = lax.cond(needs_sort, truncated, lambda x: x, scaled)
        return jnp.where(temperature > 0, jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32), greedy)

    return lax.cond(jnp.any(temperature > 0), drawn, lambda _: greedy, scaled)
