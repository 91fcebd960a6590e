"""The Qwen families, as variants of the shared decoder (:mod:`jaxkv.models.llama`).

* **Qwen2 / Qwen2.5** (``Qwen2ForCausalLM``; GGUF ``qwen2``): Llama with biases on the
  Q/K/V projections (none on the output projection).
* **Qwen3** (``Qwen3ForCausalLM``; GGUF ``qwen3``): Llama with a per-head RMSNorm of
  queries and keys before RoPE (``q_norm``/``k_norm``), no biases.

Both store Q/K in the rotate-half layout in GGUF too (llama.cpp's NEOX RoPE): nothing is
permuted. Qwen2's optional sliding window on upper layers (``use_sliding_window``) is refused.
"""

from __future__ import annotations

from jaxkv.errors import JaxkvError
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

HEAD_AXES = {"wq": 2, "wk": 2, "wv": 2, "wo": 1}
MLP_AXES = {"w_gate": 2, "w_up": 2, "w_down": 1}
GGUF_BIASES = {"bq": "blk.{i}.attn_q.bias", "bk": "blk.{i}.attn_k.bias", "bv": "blk.{i}.attn_v.bias"}
HF_QK_NORMS = {
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
}
GGUF_QK_NORMS = {"q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight"}


def qwen2_from_hf(hf: dict, *, name: str = "hf") -> LlamaConfig:
    """Config of a Qwen2/Qwen2.5 ``config.json`` (Q/K/V biases always on).

    Raises:
      JaxkvError: ``use_sliding_window`` true, or anything :func:`~jaxkv.models.llama.hf_config` refuses.
    """
    arch = hf_architecture(hf, ("Qwen2ForCausalLM",), {"qwen2": "Qwen2ForCausalLM"})
    return hf_config(hf, arch=arch, family="qwen2", name=name, attention_bias=True)


def qwen3_from_hf(hf: dict, *, name: str = "hf") -> LlamaConfig:
    """Config of a Qwen3 ``config.json`` (per-head Q/K RMSNorm).

    Raises:
      JaxkvError: ``attention_bias`` true, ``use_sliding_window`` true, or anything
        :func:`~jaxkv.models.llama.hf_config` refuses.
    """
    arch = hf_architecture(hf, ("Qwen3ForCausalLM",), {"qwen3": "Qwen3ForCausalLM"})
    if hf.get("attention_bias"):
        raise JaxkvError(f"{arch} config: attention_bias=true is not supported: expected false")
    return hf_config(hf, arch=arch, family="qwen3", name=name, qk_norm=True)


def _gguf(arch: str, **switches):
    def build(metadata, **kwargs):
        return gguf_config(metadata, arch=arch, family=arch, **kwargs, **switches)

    return gguf_builder(build)


QWEN2 = Family(
    name="qwen2",
    config=LlamaConfig,
    model=Llama,
    weight_shapes=weight_shapes,
    head_axes=HEAD_AXES,
    mlp_axes=MLP_AXES,
    hf=Format(
        config=qwen2_from_hf,
        tensors=HF_TENSORS,
        linear=LINEAR,
        architectures=("Qwen2ForCausalLM",),
        model_types=("qwen2",),
    ),
    gguf=Format(
        config=_gguf("qwen2", attention_bias=True),
        tensors={**GGUF_TENSORS, **GGUF_BIASES},
        linear=LINEAR,
        architectures=("qwen2",),
    ),
)
"""Qwen2 / Qwen2.5."""

QWEN3 = Family(
    name="qwen3",
    config=LlamaConfig,
    model=Llama,
    weight_shapes=weight_shapes,
    head_axes=HEAD_AXES,
    mlp_axes=MLP_AXES,
    hf=Format(
        config=qwen3_from_hf,
        tensors={**HF_TENSORS, **HF_QK_NORMS},
        linear=LINEAR,
        architectures=("Qwen3ForCausalLM",),
        model_types=("qwen3",),
    ),
    gguf=Format(
        config=_gguf("qwen3", qk_norm=True),
        tensors={**GGUF_TENSORS, **GGUF_QK_NORMS},
        linear=LINEAR,
        architectures=("qwen3",),
    ),
)
"""Qwen3 (dense)."""

__all__ = ["QWEN2", "QWEN3"]
