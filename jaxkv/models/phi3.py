"""The Phi-3 family, as a variant of the shared decoder (:mod:`jaxkv.models.llama`).

Phi-3 (Abdin et al. 2024, arXiv 2404.14219) is Llama with fused projections: one
``qkv_proj`` (queries, keys, values concatenated on the output axis) and one
``gate_up_proj`` (gate, then up), split at load; and, in its 4k-context checkpoints, a
sliding window on every layer (``sliding_window``, e.g. 2047). The 128k checkpoints'
``longrope`` scaling is refused by name, as is a ``partial_rotary_factor`` other than 1 (Phi-4-mini).
"""

from __future__ import annotations

from jaxkv.models.family import Family, Format
from jaxkv.models.llama import (
    GGUF_TENSORS,
    HF_TENSORS,
    LINEAR,
    Llama,
    LlamaConfig,
    gguf_builder,
    gguf_config,
    hf_architecture,
    hf_config,
    weight_shapes,
)

HF_FUSED = {
    "model.layers.{i}.self_attn.qkv_proj.weight": ("wq", "wk", "wv"),
    "model.layers.{i}.mlp.gate_up_proj.weight": ("w_gate", "w_up"),
}
GGUF_FUSED = {"blk.{i}.attn_qkv.weight": ("wq", "wk", "wv"), "blk.{i}.ffn_up.weight": ("w_gate", "w_up")}


def phi3_from_hf(hf: dict, *, name: str = "hf") -> LlamaConfig:
    """Config of a Phi-3 ``config.json`` (its ``sliding_window`` on every layer).

    Raises:
      JaxkvError: anything :func:`~jaxkv.models.llama.hf_config` refuses (e.g. ``longrope``).
    """
    arch = hf_architecture(hf, ("Phi3ForCausalLM",), {"phi3": "Phi3ForCausalLM"})
    return hf_config(hf, arch=arch, family="phi3", name=name, sliding_window=hf.get("sliding_window") or None)


def _phi3_from_gguf(metadata, **kwargs):
    window = metadata.get("phi3.attention.sliding_window") or None  # 0: none (Phi-4)
    return gguf_config(metadata, arch="phi3", family="phi3", sliding_window=window, **kwargs)


PHI3 = Family(
    name="phi3",
    config=LlamaConfig,
    model=Llama,
    weight_shapes=weight_shapes,
    head_axes={"wq": 2, "wk": 2, "wv": 2, "wo": 1},
    mlp_axes={"w_gate": 2, "w_up": 2, "w_down": 1},
    hf=Format(
        config=phi3_from_hf,
        tensors=HF_TENSORS,
        linear=LINEAR,
        fused=HF_FUSED,
        architectures=("Phi3ForCausalLM",),
        model_types=("phi3",),
    ),
    gguf=Format(
        config=gguf_builder(_phi3_from_gguf),
        tensors=GGUF_TENSORS,
        linear=LINEAR,
        fused=GGUF_FUSED,
        architectures=("phi3",),
    ),
)
"""Phi-3 / Phi-3.5 mini (4k context)."""
