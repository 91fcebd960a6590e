"""What a model family declares: its config class, its model class, its internal weights,
and how each checkpoint format names and lays them out.

A family is one module of :mod:`jaxkv.models` (e.g. :mod:`jaxkv.models.llama`) that ends
with ``FAMILY = Family(...)``; :mod:`jaxkv.io.registry` maps the architecture names of the
files (HF ``config.json`` ``architectures``, GGUF ``general.architecture``) to it, and the
loaders of :mod:`jaxkv.io` read the file formats (GGUF tensors, safetensors shards, the
llama2.c header) and ask the family for everything else. Adding a family is one module plus
one line of the registry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class Format:
    """How one checkpoint format stores a family's models.

    Attributes:
      config: the config builder; its arguments are the format's (see the loaders):
        HF ``(config_json: dict, *, name)``, GGUF ``(metadata: dict, shapes: {tensor
        name: shape in numpy order}, *, name)``, llama2.c ``(header: 7 ints, *, name)``.
        Raises JaxkvError naming any attribute it does not implement.
      tensors: internal weight name -> the tensor's name in the file; ``{i}`` stands for
        the layer index of a per-layer weight stored one tensor per layer.
      linear: internal names of the weights stored ``(out, in)``, transposed to ``x @ W``.
      interleaved: llama2.c and GGUF: internal names of the Q/K weights stored in the
        interleaved-pair RoPE layout -> the config attribute holding their head count
        (permuted to rotate-half at load; see
        :func:`jaxkv.models.blocks.interleaved_to_rotate_half`). Hugging Face checkpoints
        are rotate-half already.
      architectures: the names in the file that select this family (HF ``architectures``
        entries; GGUF ``general.architecture`` values).
      model_types: HF only: ``config.json`` ``model_type`` values that select it when
        ``architectures`` is absent.
      extra: small tensors that are not weights but parameters of the config (GGUF
        ``rope_freqs.weight``): read, when present, before the config is built.
      fused: file tensors holding several internal weights concatenated along their output
        axis (Phi-3's ``qkv_proj`` and ``gate_up_proj``): file template -> the internal
        names, in order; split at load.
      transform: ``(config, weights) -> weights`` applied after loading (e.g. Gemma's
        Hugging Face norms stored as ``w`` for ``1 + w``).
    """

    config: Callable[..., Any]
    tensors: Mapping[str, str]
    linear: frozenset[str] = frozenset()
    interleaved: Mapping[str, str] = dataclasses.field(default_factory=dict)
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    fused: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    transform: Callable[[Any, dict], dict] | None = None

    def plan(self, shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[str, tuple[str, ...]]]:
        """What to read for weights of these internal ``shapes``: ``[(file tensor template,
        (internal names it holds, in order)), ...]``, one entry per tensor (or per fused
        tensor) of the file, in the order of ``shapes``."""
        fused_of = {name: template for template, names in self.fused.items() for name in names}
        out, done = [], set()
        for name in shapes:
            if name in done:
                continue
            template = fused_of.get(name)
            names = self.fused[template] if template else (name,)
            out.append((template or self.tensors[name], names))
            done.update(names)
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """A model family: config, model and weight layout, and the checkpoint formats it loads from.

    Attributes:
      name: the family's name (``"llama"``).
      config: its config class (a frozen dataclass; one class per family).
      model: its ``nnx.Module`` class, with ``from_weights(config, weights, *, dtype, weight_format)`` and
        ``__call__(tokens, n, cache, *, last_only=False) -> (logits, cache)``
        (run it through :func:`jaxkv.models.step.forward`).
      weight_shapes: ``config -> {internal name: shape}``, every weight the model holds
        (per-layer weights stacked on a leading L axis).
      hf, gguf, llama2c: how each format stores it (None: not loadable from that format).
      head_axes, mlp_axes: tensor parallelism (:func:`jaxkv.decode.parallel.shard_model`):
        internal weight name -> the axis split over KV-head groups (attention) or over
        hidden units (MLP); weights not named are replicated.
    """

    name: str
    config: type
    model: type
    weight_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    head_axes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    mlp_axes: Mapping[str, int] = dataclasses.field(default_factory=dict)
    hf: Format | None = None
    gguf: Format | None = None
    llama2c: Format | None = None
