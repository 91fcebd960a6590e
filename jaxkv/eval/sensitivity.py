"""Which layers a low-bit KV cache hurts most: a measured sensitivity pass, one layer boosted at a time.

:func:`layer_sensitivity` streams one text through the base cache (e.g. KIVI int2), then
once more for every layer ``l`` with only that layer's keys and values stored in a more
precise mode (:meth:`jaxkv.LayerSpecs.boosted`), and ranks the layers by how much
perplexity that single boost wins back. The few most sensitive layers are then boosted
together (``jaxkv ... --kv-boost-layers``), each suggestion measured again and shown beside
its effective bits per element (:func:`jaxkv.decode.loop.new_cache_bits`).

Layer-wise KV precision: KVTuner (Li et al. 2025, arXiv 2502.04420) shows that layers
differ in their sensitivity to KV quantisation and searches per-layer precision pairs
offline; this pass is the simplest measured form of that idea (one layer at a time, the
top k together), through the real cache rather than a proxy error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.decode.loop import new_cache_bits
from jaxkv.errors import JaxkvError
from jaxkv.eval.perplexity import perplexity, token_nll
from jaxkv.io import LoadedModel


@dataclasses.dataclass(frozen=True)
class Boost:
    """Layers boosted together, measured.

    Attributes:
      layers: the boosted layer indices, ascending.
      spec: the :class:`~jaxkv.LayerSpecs` (before the model's local windows are applied).
      ppl: perplexity through that cache on the pass's tokens.
      store_bits, bits: effective bits per K/V element of the cache, as
        :func:`jaxkv.cache.memory.element_bits` counts them (quantised store alone, or None
        without one; whole cache, residual and sinks included).
    """

    layers: tuple
    spec: LayerSpecs
    ppl: float
    store_bits: float | None
    bits: float

    @property
    def flag(self) -> str:
        """The command line's ``--kv-boost-layers`` value, e.g. ``0,3``."""
        return ",".join(map(str, self.layers))


@dataclasses.dataclass(frozen=True)
class LayerSensitivity:
    """What :func:`layer_sensitivity` measured.

    Attributes:
      base: the base spec. mode: the boosted layers' storage.
      base_ppl: perplexity through the base cache. base_bits: ``(store_bits, bits)`` of it.
      ppl: ``float64[L]``, perplexity with only layer ``l`` boosted.
      ranking: layer indices, most sensitive first (largest :attr:`gain`; ties: lower index first).
      top: a measured :class:`Boost` of the first k layers of :attr:`ranking`, for each k asked.
    """

    base: CacheSpec
    mode: str
    base_ppl: float
    base_bits: tuple
    ppl: np.ndarray
    ranking: tuple
    top: tuple

    @property
    def gain(self) -> np.ndarray:
        """``float64[L]``: ``base_ppl - ppl[l]``, the perplexity won back by boosting layer ``l`` alone
        (negative: the boost made it worse)."""
        return self.base_ppl - self.ppl


def layer_sensitivity(
    model: LoadedModel,
    tokens: Sequence[int],
    base: CacheSpec,
    *,
    mode: str = "int8",
    top: Sequence[int] = (2, 4),
    chunk: int = 128,
    progress: bool = False,
) -> LayerSensitivity:
    """Perplexity with each single layer's KV cache boosted to ``mode``, the layers ranked, and
    the top k boosted together.

    Cost: ``1 + L + len(top)`` :func:`token_nll` runs over ``tokens`` (the base, each layer
    boosted alone, each top-k set), each with its own per-layer spec, so each compiles its
    own step: about ``L + 3`` times one ``jaxkv ppl`` run (30 layers: 33 runs).

    Args:
      model: a :class:`~jaxkv.io.LoadedModel`.
      tokens: N >= 2 token ids (one stream, as :func:`token_nll` takes it).
      base: the cache of every layer not boosted (e.g. ``CacheSpec(max_len=N,
        kv_quantize="int2", group_size=32, residual=32)``).
      mode: the boosted layers' storage of keys and values (fp32|fp16|bf16|int8|int4|int2,
        more bits than ``base``; see :meth:`jaxkv.LayerSpecs.boosted`).
      top: the k of the top-k sets to measure, each in ``[1, L]`` (empty: none).
      chunk: tokens per compiled call (speed only), as in :func:`token_nll`.
      progress: a tqdm bar on stderr per run.
    Returns:
      a :class:`LayerSensitivity`.
    Raises:
      JaxkvError: a ``base`` or ``mode`` :meth:`~jaxkv.LayerSpecs.boosted` refuses, a k outside
        ``[1, L]`` (named), bad tokens or a cache too small for them (as :func:`token_nll`).
    """
    n_layers = model.config.n_layers
    for k in top:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= n_layers:
            raise JaxkvError(
                f"layer_sensitivity: top={tuple(top)!r}: each k must be an integer in [1, {n_layers}] "
                f"(the model has {n_layers} layers)"
            )
    specs = [
        LayerSpecs.boosted(base, n_layers, (layer,), mode) for layer in range(n_layers)
    ]  # refuses a bad mode first

    def ppl_of(spec) -> float:
        return perplexity(token_nll(model, tokens, cache=spec, chunk=chunk, progress=progress))

    base_ppl = ppl_of(base)
    ppl = np.array([ppl_of(spec) for spec in specs], np.float64)
    ranking = tuple(int(i) for i in np.argsort(ppl - base_ppl, kind="stable"))  # most perplexity won back first
    boosts = []
    for k in top:
        layers = tuple(sorted(ranking[:k]))
        spec = LayerSpecs.boosted(base, n_layers, layers, mode)
        boosts.append(Boost(layers, spec, ppl_of(spec), *new_cache_bits(model.config, spec)))
    return LayerSensitivity(
        base=base,
        mode=mode,
        base_ppl=base_ppl,
        base_bits=new_cache_bits(model.config, base),
        ppl=ppl,
        ranking=ranking,
        top=tuple(boosts),
    )
