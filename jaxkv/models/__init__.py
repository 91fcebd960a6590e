"""Models: shared NNX blocks (:mod:`~jaxkv.models.blocks`), the pure model step
(:func:`~jaxkv.models.step.forward`), and one module per family (:mod:`~jaxkv.models.llama`),
each declaring its :class:`~jaxkv.models.family.Family`. Loading checkpoints into them is
:mod:`jaxkv.io`'s job (``jaxkv.io.load_model``, the architecture registry)."""

from __future__ import annotations

from jaxkv.models.family import Family, Format
from jaxkv.models.llama import Llama, LlamaConfig
from jaxkv.models.step import forward

__all__ = ["Family", "Format", "Llama", "LlamaConfig", "forward"]
