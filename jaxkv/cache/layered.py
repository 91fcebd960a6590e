"""`LayeredCache`: a KV cache whose layers have different specs (:class:`LayerSpecs`).

Each maximal run of consecutive layers with equal specs is one :class:`KVCache` (its
layers stacked on L), so a model scans each run as it scans a uniform cache and no leaf
is ever sliced or copied. All runs hold the same tokens appended (one ``length`` per row):
:meth:`LayeredCache.begin` admits the fewest tokens any run's policy allows, then begins
every run with that count; which of them each run *keeps* is its own policy.

The model contract is the same three calls as :class:`KVCache` plus :meth:`runs`, which
tells a model which layers read which run (``KVCache.runs`` gives the one run of a
uniform cache, so a model written over ``runs`` serves both).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jaxkv.cache.kv import KVCache, LayerKV, Step, register_per_layer_empty
from jaxkv.cache.spec import LayerSpecs
from jaxkv.errors import JaxkvError


class LayeredStep(struct.PyTreeNode):
    """The :class:`Step` of every run of a :class:`LayeredCache` call.

    Attributes:
      steps: one :class:`Step` per run. n: int32[B], tokens each row appends (same in every run).
    """

    steps: tuple
    n: jax.Array


@struct.dataclass
class LayeredCache:
    """Runs of layers, each a :class:`KVCache` of its own spec. Build with :meth:`create`.

    Attributes:
      spec: the :class:`LayerSpecs` (static).
      groups: one :class:`KVCache` per run of ``spec.runs``, in layer order.
    """

    spec: LayerSpecs = struct.field(pytree_node=False)
    groups: tuple

    @classmethod
    def create(
        cls, spec: LayerSpecs, *, batch: int, n_layers: int, n_kv_heads: int, head_dim: int, devices=None
    ) -> LayeredCache:
        """An empty cache of ``len(spec.specs)`` layers (``n_layers`` must match).

        Raises:
          JaxkvError: ``n_layers`` differs from the number of specs, or a bad size or a cache
            larger than the devices' memory (see :meth:`KVCache.create`).
        """
        return KVCache.create(
            spec, batch=batch, n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim, devices=devices
        )

    @classmethod
    def _empty(cls, spec: LayerSpecs, *, batch: int, n_layers: int, n_kv_heads: int, head_dim: int) -> LayeredCache:
        """The empty cache of :meth:`KVCache.create` for per-layer specs (sizes and memory checked there)."""
        if n_layers != len(spec.specs):
            raise JaxkvError(f"LayerSpecs holds {len(spec.specs)} layer specs, but the model has n_layers={n_layers}")
        return cls(
            spec=spec,
            groups=tuple(
                KVCache._empty(s, batch=batch, n_layers=b - a, n_kv_heads=n_kv_heads, head_dim=head_dim)
                for s, a, b in spec.runs
            ),
        )

    def starting_at(self, position: int) -> LayeredCache:
        """Every run starting at ``position`` (see :meth:`KVCache.starting_at`)."""
        return self.replace(groups=tuple(g.starting_at(position) for g in self.groups))

    @property
    def length(self) -> jax.Array:
        """int32[B]: tokens appended so far per row (the same in every run)."""
        return self.groups[0].length

    @property
    def batch(self) -> int:
        return self.groups[0].batch

    @property
    def n_layers(self) -> int:
        return sum(g.n_layers for g in self.groups)

    @property
    def batch_sharded(self) -> bool:
        return self.groups[0].batch_sharded

    def stored(self) -> jax.Array:
        """int32[B]: tokens held by the run that holds the most."""
        return jnp.max(jnp.stack([g.stored() for g in self.groups]), axis=0)

    def begin(self, n: jax.Array, chunk: int) -> tuple[LayeredCache, LayeredStep]:
        """:meth:`KVCache.begin` for every run, with the count every run admits."""
        n = self.spec.admit(self.length, n)
        began = [g.begin(n, chunk) for g in self.groups]
        return self.replace(groups=tuple(c for c, _ in began)), LayeredStep(steps=tuple(s for _, s in began), n=n)

    def runs(self, step: LayeredStep) -> list[tuple[int, int, Step, LayerKV]]:
        """``[(first layer, end layer, step, layers)]`` per run: attend layer ``first + i``
        over ``jax.tree.map(lambda a: a[i], layers)`` with that run's ``step``."""
        return [(a, b, s, g.layers()) for (_, a, b), s, g in zip(self.spec.runs, step.steps, self.groups)]

    def commit(self, step: LayeredStep, k_new: jax.Array, v_new: jax.Array, *, mass=None) -> LayeredCache:
        """Write the new keys/values ``[L, B, K, T, H]`` of every layer (all L, in layer order);
        ``mass``: one entry per run (see :meth:`KVCache.commit`), or None."""
        masses = [None] * len(self.groups) if mass is None else list(mass)
        return self.replace(
            groups=tuple(
                g.commit(s, k_new[a:b], v_new[a:b], mass=m)
                for (_, a, b), s, g, m in zip(self.spec.runs, step.steps, self.groups, masses)
            )
        )


register_per_layer_empty(LayeredCache._empty)  # KVCache.create(LayerSpecs(...)) -> a LayeredCache
