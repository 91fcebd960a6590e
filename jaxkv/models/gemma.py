"""The Gemma 2 and Gemma 3 families, as variants of the shared decoder (:mod:`jaxkv.models.llama`).

What they change (Gemma Team 2024, arXiv 2408.00118 §2; Gemma 3 technical report 2025, §2):

* GeGLU MLP (tanh-approximated GELU), RMSNorm ``(1 + w)`` (stored as ``w`` by Hugging Face:
  the 1 is added at load; llama.cpp's converter stores ``1 + w`` already), a norm before
  *and after* each sublayer, embeddings scaled by ``sqrt(D)``, tied classifier;
* the score scale ``query_pre_attn_scalar ** -0.5``; Gemma 2 soft-caps attention scores and
  final logits (``c * tanh(x / c)``);
* local sliding-window layers beside global ones: Gemma 2 alternates them (1 : 1), Gemma 3
  has 5 local per global and gives local layers their own RoPE base (10,000; global
  1,000,000, with linear scaling on larger models); Gemma 3 adds per-head Q/K RMSNorm.

The local layers keep exactly their trained window in the cache
(:meth:`~jaxkv.models.llama.LlamaConfig.cache_spec`). Multimodal Gemma 3
(``Gemma3ForConditionalGeneration``) is not supported: its text-only checkpoints
(``Gemma3ForCausalLM``: 270M, 1B) are.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.cache.rope import Rope
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

HF_GEMMA_TENSORS = {
    **HF_TENSORS,
    "attn_post_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "mlp_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "mlp_post_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
}
GGUF_GEMMA_TENSORS = {
    **GGUF_TENSORS,
    "attn_post_norm": "blk.{i}.post_attention_norm.weight",
    "mlp_post_norm": "blk.{i}.post_ffw_norm.weight",
    "q_norm": "blk.{i}.attn_q_norm.weight",
    "k_norm": "blk.{i}.attn_k_norm.weight",
}
_HF_GEMMA_UNSUPPORTED = {"use_bidirectional_attention": (None, False), "use_qk_norm": (None, False)}
PATTERN = {"gemma2": 2, "gemma3": 6}
"""Every n-th layer is global, the others local (llama.cpp's default for files that do not say)."""


def _layer_types(n_layers: int, pattern) -> tuple[str, ...]:
    """Per-layer kinds from a pattern: an int n (layer i global iff ``(i + 1) % n == 0``) or
    a list of bools (True = local), as Hugging Face and llama.cpp write them."""
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != n_layers:
            raise JaxkvError(f"sliding-window pattern of {len(pattern)} layers for a model of {n_layers}")
        return tuple("sliding_attention" if local else "full_attention" for local in pattern)
    return tuple("full_attention" if (i + 1) % int(pattern) == 0 else "sliding_attention" for i in range(n_layers))


def _add_one_to_norms(config: LlamaConfig, weights: dict) -> dict:
    """Hugging Face Gemma stores RMSNorm weights ``w`` of ``(1 + w)``: add the 1 once, at load."""
    return {k: (w + np.float32(1.0) if k.endswith("norm") else w) for k, w in weights.items()}


def _from_hf(family: str, architectures: tuple, model_types: dict, qk_norm: bool):
    def config(hf: dict, *, name: str = "hf") -> LlamaConfig:
        arch = hf_architecture(hf, architectures, model_types)
        n_layers, window = hf.get("num_hidden_layers"), hf.get("sliding_window")
        kinds = hf.get("layer_types") or (
            _layer_types(
                n_layers, hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or PATTERN[family]
            )
            if isinstance(n_layers, int) and window
            else None
        )
        scalar = hf.get("query_pre_attn_scalar")
        if scalar is not None and not (isinstance(scalar, (int, float)) and scalar > 0):
            raise JaxkvError(f"{arch} config: query_pre_attn_scalar={scalar!r}, expected a positive number")
        return hf_config(
            hf,
            arch=arch,
            family=family,
            name=name,
            unsupported=_HF_GEMMA_UNSUPPORTED,
            activations=("gelu_pytorch_tanh",),
            layer_types=tuple(kinds) if kinds else None,
            sliding_window=window if kinds and "sliding_attention" in kinds else None,
            attn_softcap=hf.get("attn_logit_softcapping"),
            final_softcap=hf.get("final_logit_softcapping"),
            query_scale=None if scalar is None else float(scalar) ** -0.5,
            qk_norm=qk_norm,
            post_norms=True,
            embed_scale=True,
        )

    return config


def _from_gguf(arch: str, qk_norm: bool, large_layers: int):
    def build(metadata, *, tie_embeddings, vocab_size, name, extra=None):
        n_layers = int(metadata.get(f"{arch}.block_count", 0))
        window = metadata.get(f"{arch}.attention.sliding_window")
        if arch == "gemma2" and window is None:
            window = 4096  # llama.cpp's default for Gemma 2 files that do not say
        kinds = (
            _layer_types(n_layers, metadata.get(f"{arch}.attention.sliding_window_pattern", PATTERN[arch]))
            if window
            else None
        )
        dim, heads = (
            int(metadata.get(f"{arch}.embedding_length", 0)),
            int(metadata.get(f"{arch}.attention.head_count", 1)),
        )
        head_dim = int(metadata.get(f"{arch}.attention.key_length", dim // heads))
        # llama.cpp's score scale: 1/sqrt(H), except the 27B models' 1/sqrt(D/N) (gemma_pytorch's config)
        scale = (dim // heads if n_layers == large_layers else head_dim) ** -0.5
        local_theta = float(
            metadata.get(
                f"{arch}.rope.freq_base_swa",
                10000.0 if arch == "gemma3" else metadata.get(f"{arch}.rope.freq_base", 10000.0),
            )
        )
        config = gguf_config(
            metadata,
            arch=arch,
            family=arch,
            tie_embeddings=True,
            vocab_size=vocab_size,
            name=name,
            extra=extra,
            layer_types=kinds,
            sliding_window=int(window) if window else None,
            query_scale=scale,
            attn_softcap=metadata.get(f"{arch}.attn_logit_softcapping"),
            final_softcap=metadata.get(f"{arch}.final_logit_softcapping") or None,
            qk_norm=qk_norm,
            post_norms=True,
            embed_scale=True,
            mlp_activation="gelu_tanh",
        )
        local = Rope.default(local_theta, config.head_dim)
        return dataclasses.replace(config, local_rope=None if local == config.rope_for("full_attention") else local)

    return gguf_builder(build)


def _family(name: str, arch: str, model_types: dict, qk_norm: bool, large_layers: int) -> Family:
    return Family(
        name=name,
        config=LlamaConfig,
        model=Llama,
        weight_shapes=weight_shapes,
        head_axes={"wq": 2, "wk": 2, "wv": 2, "wo": 1},
        mlp_axes={"w_gate": 2, "w_up": 2, "w_down": 1},
        hf=Format(
            config=_from_hf(name, (arch,), model_types, qk_norm),
            tensors=HF_GEMMA_TENSORS,
            linear=LINEAR,
            architectures=(arch,),
            model_types=tuple(model_types),
            transform=_add_one_to_norms,
        ),
        gguf=Format(
            config=_from_gguf(name, qk_norm, large_layers),
            tensors=GGUF_GEMMA_TENSORS,
            linear=LINEAR,
            architectures=(name,),
        ),
    )


GEMMA2 = _family("gemma2", "Gemma2ForCausalLM", {"gemma2": "Gemma2ForCausalLM"}, qk_norm=False, large_layers=46)
"""Gemma 2 (2B, 9B, 27B)."""
GEMMA3 = _family("gemma3", "Gemma3ForCausalLM", {"gemma3_text": "Gemma3ForCausalLM"}, qk_norm=True, large_layers=62)
"""Gemma 3, text-only checkpoints (270M, 1B)."""
