"""The shared decoder and the Llama family.

:class:`LlamaConfig` and :class:`Llama` are the one decoder every family maps its
checkpoints onto (the way penzai's ``variants`` do): RMSNorm, RoPE (plain or scaled), GQA,
a gated MLP, plus the switches the other families need (Q/K/V biases, per-head Q/K norms,
post-sublayer norms, GeGLU, embedding scale, attention and final logit soft-capping, a query
scale, local sliding-window layers with their own RoPE base). This module also holds the
Llama family itself (Llama 2/3.x, SmolLM2, TinyLlama, the llama2.c models, Mistral): the
names of its weights in each format and its config builders, registered as :data:`FAMILY`
in :mod:`jaxkv.io.registry`. The other families (:mod:`jaxkv.models.qwen`,
:mod:`jaxkv.models.gemma`, :mod:`jaxkv.models.phi3`) are small modules of config builders
and weight names.

The model never owns its KV cache: the step is the pure function
``(params, tokens[B, T], cache) -> (logits[B, T, V], cache)`` (:func:`jaxkv.models.step.forward`),
and the layer loop is one ``lax.scan`` over the stacked weights and the stacked cache leaves.

The internal weight layout every loader produces (``x @ W`` orientation, numpy arrays):

====================  =====================  =========================================
name                  shape                  meaning
====================  =====================  =========================================
``embed``             ``[V, D]``             token embedding
``attn_norm``         ``[L, D]``             RMSNorm weight before attention
``wq``                ``[L, D, N*H]``        query projection (rotate-half RoPE layout)
``wk``                ``[L, D, K*H]``        key projection (rotate-half RoPE layout)
``wv``                ``[L, D, K*H]``        value projection
``bq``                ``[L, N*H]``           query bias (only when ``attention_bias``; Qwen2)
``bk``                ``[L, K*H]``           key bias (rotate-half layout; only when ``attention_bias``)
``bv``                ``[L, K*H]``           value bias (only when ``attention_bias``)
``q_norm``            ``[L, H]``             per-head RMSNorm of queries (only when ``qk_norm``; Qwen3, Gemma 3)
``k_norm``            ``[L, H]``             per-head RMSNorm of keys (only when ``qk_norm``)
``attn_post_norm``    ``[L, D]``             RMSNorm of the attention output (only when ``post_norms``; Gemma)
``mlp_post_norm``     ``[L, D]``             RMSNorm of the MLP output (only when ``post_norms``)
``wo``                ``[L, N*H, D]``        attention output projection
``mlp_norm``          ``[L, D]``             RMSNorm weight before the gated MLP
``w_gate``            ``[L, D, F]``          MLP gate (llama2.c ``w1``)
``w_up``              ``[L, D, F]``          MLP up (llama2.c ``w3``)
``w_down``            ``[L, F, D]``          MLP down (llama2.c ``w2``)
``final_norm``        ``[D]``                final RMSNorm weight
``lm_head``           ``[D, V]``             classifier; absent when tied to ``embed``
====================  =====================  =========================================

RoPE convention: one internal convention, "rotate-half" (Hugging Face's): within a head,
channel ``i`` pairs with channel ``i + H/2``. llama2.c and GGUF checkpoints store Q/K rows
in the interleaved-pair layout (channel ``2i`` pairs with ``2i+1``); their loaders permute
the Q/K output channels with :func:`jaxkv.models.blocks.interleaved_to_rotate_half` at
load time (the ``interleaved`` entries of :data:`FAMILY`).

RMSNorm weights are always multiplied as they are: Gemma's ``(1 + w)`` norms get their 1
added when its Hugging Face weights are loaded (llama.cpp's converter already stores ``1 + w``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxkv.cache.attention import attend
from jaxkv.cache.kv import KVCache
from jaxkv.cache.rope import Rope
from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.errors import JaxkvError
from jaxkv.models.blocks import gated_mlp, pre_norm_residual, qkv_projection, rms_norm
from jaxkv.models.family import Family, Format
from jaxkv.models.weights import (
    FLOAT_FORMATS,
    HEAD_FORMATS,
    HELD_FORMS,
    BlockWeight,
    as_held,
    check_weight_format,
    convert,
    dense,
    embed_lookup,
    tied_head,
)

HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
"""Hugging Face ``architectures`` that :meth:`LlamaConfig.from_hf` accepts."""
HF_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
"""``config.json`` ``model_type`` -> the architecture it means when ``architectures`` is absent."""

LAYER_KINDS = ("full_attention", "sliding_attention")
"""Attention layer kinds (Hugging Face's ``layer_types`` names): global, or local over the
model's ``sliding_window``."""
MLP_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}
"""Gate activations of the gated MLP: SwiGLU (Llama, Qwen, Mistral, Phi-3), GeGLU with the
tanh approximation of GELU (Gemma)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape and hyper-parameters of the shared decoder (every family's checkpoints map onto it).

    Attributes:
      vocab_size: V, tokens.
      dim: D, model width.
      n_layers: L.
      n_heads: N, query heads.
      n_kv_heads: K, key/value heads (GQA: ``N % K == 0``).
      head_dim: H.
      hidden_dim: F, MLP hidden width.
      rope_theta: RoPE base of plain RoPE (10000 for Llama 2, 100000 for SmolLM2).
      norm_eps: RMSNorm epsilon.
      max_seq_len: the context length the model was trained with, tokens.
      tie_embeddings: the classifier is ``embed.T``.
      attention_bias: the Q/K/V projections have biases ``bq``/``bk``/``bv`` (Qwen2).
      name: a human-readable identity (file name or preset).
      family: the registered family it was loaded as (``llama``, ``qwen2``, ``gemma2``, ...).
      rope: the global layers' :class:`~jaxkv.cache.rope.Rope` when it is not plain RoPE of
        ``rope_theta`` (Llama 3.x ``llama3`` scaling, linear scaling, GGUF ``rope_freqs``).
      local_rope: the local layers' Rope when it differs from the global one (Gemma 3: base 10000).
      sliding_window: tokens a local layer attends to (the query and the ``W - 1`` before it);
        None = no local layers.
      layer_types: per layer ``full_attention`` or ``sliding_attention`` (Gemma 2/3); None =
        every layer local when ``sliding_window`` is set (Mistral, Phi-3), else global.
      qk_norm: per-head RMSNorm of queries and keys before RoPE (Qwen3, Gemma 3).
      post_norms: RMSNorm of each sublayer's output before the residual add (Gemma 2/3).
      mlp_activation: the MLP gate's activation, ``silu`` (SwiGLU) or ``gelu_tanh`` (GeGLU).
      embed_scale: embeddings multiplied by ``sqrt(D)`` (in the model dtype; Gemma).
      attn_softcap: scores capped as ``c * tanh(s / c)`` (Gemma 2), None = no cap.
      final_softcap: logits capped likewise (Gemma 2), None = no cap.
      query_scale: the score scale, None = ``1/sqrt(H)`` (Gemma: ``query_pre_attn_scalar**-0.5``).
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    tie_embeddings: bool = True
    attention_bias: bool = False
    name: str = "llama"
    family: str = "llama"
    rope: Rope | None = None
    local_rope: Rope | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    qk_norm: bool = False
    post_norms: bool = False
    mlp_activation: str = "silu"
    embed_scale: bool = False
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_scale: float | None = None

    def __post_init__(self):
        for field in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "hidden_dim",
            "max_seq_len",
        ):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise JaxkvError(f"LlamaConfig.{field}={value!r}: expected a positive integer")
        if self.n_heads % self.n_kv_heads:
            raise JaxkvError(
                f"LlamaConfig: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads} (GQA needs N % K == 0)"
            )
        if self.head_dim % 2:
            raise JaxkvError(f"LlamaConfig.head_dim={self.head_dim}: RoPE needs an even head dim")
        if not self.rope_theta > 0:
            raise JaxkvError(f"LlamaConfig.rope_theta={self.rope_theta!r}: expected a positive number")
        for field in ("rope", "local_rope"):
            rope = getattr(self, field)
            if rope is not None and (not isinstance(rope, Rope) or rope.head_dim != self.head_dim):
                raise JaxkvError(f"LlamaConfig.{field}={rope!r}: expected a Rope for head dim {self.head_dim}")
        if self.sliding_window is not None and (
            isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise JaxkvError(f"LlamaConfig.sliding_window={self.sliding_window!r}: expected a positive integer or None")
        if self.layer_types is not None:
            if (
                not isinstance(self.layer_types, tuple)
                or len(self.layer_types) != self.n_layers
                or not set(self.layer_types) <= set(LAYER_KINDS)
            ):
                raise JaxkvError(
                    f"LlamaConfig.layer_types={self.layer_types!r}: expected a tuple of {self.n_layers} of {', '.join(LAYER_KINDS)}"
                )
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise JaxkvError("LlamaConfig.layer_types has sliding_attention layers but sliding_window is None")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise JaxkvError(
                f"LlamaConfig.mlp_activation={self.mlp_activation!r}: expected one of {', '.join(MLP_ACTIVATIONS)}"
            )
        for field in ("attn_softcap", "final_softcap", "query_scale"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise JaxkvError(f"LlamaConfig.{field}={value!r}: expected a positive number or None")

    # ---- per-layer attention ---------------------------------------------------------------------
    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """Per layer ``full_attention`` (global) or ``sliding_attention`` (local over ``sliding_window``)."""
        if self.layer_types is not None:
            return self.layer_types
        return ("sliding_attention" if self.sliding_window else "full_attention",) * self.n_layers

    def rope_for(self, kind: str) -> Rope:
        """The :class:`~jaxkv.cache.rope.Rope` of a layer of kind ``kind`` (see :attr:`layer_kinds`)."""
        if kind == "sliding_attention" and self.local_rope is not None:
            return self.local_rope
        return self.rope if self.rope is not None else Rope.default(self.rope_theta, self.head_dim)

    def cache_spec(self, spec: CacheSpec | LayerSpecs) -> CacheSpec | LayerSpecs:
        """The cache this model needs for the user's ``spec``: ``spec`` itself when every layer
        is global; else :class:`~jaxkv.cache.spec.LayerSpecs` where each local layer keeps
        its own window (:meth:`CacheSpec.local`, with the user's storage) and the global
        layers keep what ``spec`` says. Per-layer specs (e.g.
        :meth:`~jaxkv.cache.spec.LayerSpecs.boosted`) stay per layer: each local layer gets
        the ``local`` of its own spec. Applying it twice changes nothing.

        Raises:
          JaxkvError: a storage the local window cannot hold (see :meth:`CacheSpec.local`), or
            per-layer specs of another layer count than ``n_layers``.
        """
        if "sliding_attention" not in self.layer_kinds:
            return spec
        per_layer = isinstance(spec, LayerSpecs)
        if per_layer and len(spec.specs) != self.n_layers:
            raise JaxkvError(
                f"LayerSpecs holds {len(spec.specs)} layer specs, but the model has n_layers={self.n_layers}"
            )
        given = spec.specs if per_layer else (spec,) * self.n_layers
        kinds = self.layer_kinds
        local = {
            s: s.local(self.sliding_window) for s in {g for g, kind in zip(given, kinds) if kind == "sliding_attention"}
        }
        specs = tuple(local[s] if kind == "sliding_attention" else s for s, kind in zip(given, kinds))
        return LayerSpecs(specs) if per_layer or len(set(specs)) > 1 else specs[0]

    @classmethod
    def from_llama2c(cls, header, *, name: str = "llama2c") -> LlamaConfig:
        """Config from the 7 int32 header of a llama2.c legacy checkpoint.

        ``header`` is ``(dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len)``;
        a negative vocab_size means the classifier is stored separately (not tied).
        """
        dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = (int(x) for x in header)
        return cls(
            vocab_size=abs(vocab_size),
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=dim // n_heads if n_heads > 0 else 0,
            hidden_dim=hidden_dim,
            rope_theta=10000.0,
            norm_eps=1e-5,
            max_seq_len=seq_len,
            tie_embeddings=vocab_size > 0,
            name=name,
        )

    @classmethod
    def from_gguf(
        cls,
        metadata: dict,
        *,
        tie_embeddings: bool,
        vocab_size: int | None = None,
        name: str = "gguf",
        extra: dict | None = None,
    ) -> LlamaConfig:
        """Config from GGUF ``llama.*`` metadata (a plain ``{key: value}`` dict): Llama 2/3.x,
        SmolLM2, TinyLlama, Mistral (llama.cpp writes them all as ``llama``).

        Args:
          metadata: the file's metadata, ``general.architecture`` == ``"llama"``.
          tie_embeddings: the file has no classifier (``output.weight``).
          vocab_size: V when the metadata lacks ``llama.vocab_size`` (the embedding's rows).
          name: the config's name.
          extra: the file's ``rope_freqs.weight`` (Llama 3.x scaling) as a float32 array, if any.
        Raises:
          JaxkvError: see :func:`gguf_config`.
        """
        return gguf_config(
            metadata,
            arch="llama",
            family="llama",
            tie_embeddings=tie_embeddings,
            vocab_size=vocab_size,
            name=name,
            extra=extra,
            sliding_window=metadata.get("llama.attention.sliding_window"),
        )

    @classmethod
    def from_hf(cls, hf: dict, *, name: str = "hf") -> LlamaConfig:
        """Config from a Hugging Face ``config.json`` (a plain dict) of the Llama family.

        Supported: ``LlamaForCausalLM`` (Llama 2/3.x, SmolLM2, TinyLlama; ``rope_scaling``
        default, ``linear`` or ``llama3``) and ``MistralForCausalLM`` (its
        ``sliding_window`` on every layer). See :func:`hf_config` for what is read.

        Raises:
          JaxkvError: an unsupported architecture, or anything :func:`hf_config` refuses.
        """
        arch = hf_architecture(hf, HF_ARCHITECTURES, HF_MODEL_TYPES)
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            which = "attention_bias" if hf.get("attention_bias") else "mlp_bias"
            raise JaxkvError(f"{arch} config: {which}=true is not supported (biases on the projections)")
        window = hf.get("sliding_window") if arch == "MistralForCausalLM" else None
        return hf_config(hf, arch=arch, family="llama", name=name, sliding_window=window)

    @classmethod
    def from_preset(cls, name: str) -> LlamaConfig:
        """A named preset from the repository's ``configs/`` folder (e.g. ``"smollm2-135m"``,
        ``"stories260K"``, ``"llama-tiny"``), or a path to such a JSON file.

        Raises:
          JaxkvError: an unknown name (the message lists the presets) or a bad file.
        """
        import json
        import pathlib

        folder = pathlib.Path(__file__).resolve().parents[2] / "configs"
        path = pathlib.Path(name) if name.endswith(".json") else folder / f"{name}.json"
        if not path.is_file():
            known = sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []
            raise JaxkvError(
                f"no config preset {name!r}: expected one of {', '.join(known) or '(none found)'} or a .json path"
            )
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as e:
            raise JaxkvError(f"{path}: not a LlamaConfig preset: {e}") from None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies in an fp32 cache (all layers)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * 4


# internal name -> tensor name in each checkpoint format ("{i}" = layer index)
HF_TENSORS = {
    "embed": "model.embed_tokens.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "wq": "model.layers.{i}.self_attn.q_proj.weight",
    "wk": "model.layers.{i}.self_attn.k_proj.weight",
    "wv": "model.layers.{i}.self_attn.v_proj.weight",
    "wo": "model.layers.{i}.self_attn.o_proj.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "w_gate": "model.layers.{i}.mlp.gate_proj.weight",
    "w_up": "model.layers.{i}.mlp.up_proj.weight",
    "w_down": "model.layers.{i}.mlp.down_proj.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "bq": "model.layers.{i}.self_attn.q_proj.bias",
    "bk": "model.layers.{i}.self_attn.k_proj.bias",
    "bv": "model.layers.{i}.self_attn.v_proj.bias",
}
GGUF_TENSORS = {
    "embed": "token_embd.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "wq": "blk.{i}.attn_q.weight",
    "wk": "blk.{i}.attn_k.weight",
    "wv": "blk.{i}.attn_v.weight",
    "wo": "blk.{i}.attn_output.weight",
    "mlp_norm": "blk.{i}.ffn_norm.weight",
    "w_gate": "blk.{i}.ffn_gate.weight",
    "w_up": "blk.{i}.ffn_up.weight",
    "w_down": "blk.{i}.ffn_down.weight",
    "final_norm": "output_norm.weight",
    "lm_head": "output.weight",
}
LLAMA2C_TENSORS = {  # the arrays of jaxkv.io.llama2c (stacked on L in the file)
    "embed": "token_embedding",
    "attn_norm": "rms_att",
    "wq": "wq",
    "wk": "wk",
    "wv": "wv",
    "wo": "wo",
    "mlp_norm": "rms_ffn",
    "w_gate": "w1",
    "w_up": "w3",
    "w_down": "w2",
    "final_norm": "rms_final",
    "lm_head": "wcls",
}
LINEAR = frozenset({"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "lm_head"})
"""Weights every format stores ``(out, in)`` (PyTorch's order), transposed to ``x @ W`` at load."""
MATRICES = LINEAR | {"embed"}
"""The weights a ``weight_format`` other than fp32 holds in that format (the rest stay float32)."""
INTERLEAVED = {"wq": "n_heads", "wk": "n_kv_heads"}
"""Q/K projections, which llama2.c and GGUF files store in the interleaved-pair RoPE layout."""
LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
OPTIONAL_LAYER_WEIGHTS = {  # per-layer weights a config switch adds -> that switch
    "bq": "attention_bias",
    "bk": "attention_bias",
    "bv": "attention_bias",
    "q_norm": "qk_norm",
    "k_norm": "qk_norm",
    "attn_post_norm": "post_norms",
    "mlp_post_norm": "post_norms",
}


def layer_weight_names(config: LlamaConfig) -> tuple[str, ...]:
    """The per-layer weights (stacked on L) of ``config``: :data:`LAYER_WEIGHTS` plus those its switches add."""
    return LAYER_WEIGHTS + tuple(n for n, switch in OPTIONAL_LAYER_WEIGHTS.items() if getattr(config, switch))


def weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every weight of the internal layout (see the module docstring):
    name -> shape, per-layer weights with a leading L; ``lm_head`` only when untied, the
    optional weights only when their switch is on."""
    c = config
    L, D, F, V, H = c.n_layers, c.dim, c.hidden_dim, c.vocab_size, c.head_dim
    shapes = {
        "embed": (V, D),
        "attn_norm": (L, D),
        "wq": (L, D, c.n_heads * H),
        "wk": (L, D, c.n_kv_heads * H),
        "wv": (L, D, c.n_kv_heads * H),
        "wo": (L, c.n_heads * H, D),
        "mlp_norm": (L, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
        "final_norm": (D,),
    }
    if not c.tie_embeddings:
        shapes["lm_head"] = (D, V)
    # optional weights last, so the random init of the others does not depend on them
    if c.attention_bias:
        shapes.update(bq=(L, c.n_heads * H), bk=(L, c.n_kv_heads * H), bv=(L, c.n_kv_heads * H))
    if c.qk_norm:
        shapes.update(q_norm=(L, H), k_norm=(L, H))
    if c.post_norms:
        shapes.update(attn_post_norm=(L, D), mlp_post_norm=(L, D))
    return shapes


class Llama(nnx.Module):
    """The shared decoder: per-layer weights (names and shapes: :func:`weight_shapes`) stacked
    on a leading L axis; each layer is two pre-norm residual steps (GQA attention through
    the cache, gated MLP) of :mod:`jaxkv.models.blocks`, with the switches of
    :class:`LlamaConfig` (Q/K norms, post norms, soft-capping, local layers).

    Build it from checkpoint weights with :meth:`from_weights`, or randomly (tests,
    benchmarks) with ``Llama(config, rngs=nnx.Rngs(seed))``.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        key = rngs.params()
        for i, (name, shape) in enumerate(weight_shapes(config).items()):
            if name.endswith("norm"):
                value = jnp.ones(shape, dtype)
            elif name in ("bq", "bk", "bv"):
                value = (0.1 * jax.random.normal(jax.random.fold_in(key, i), shape)).astype(dtype)
            else:
                fan_in = shape[-2]
                value = (jax.random.normal(jax.random.fold_in(key, i), shape) / np.sqrt(fan_in)).astype(dtype)
                if name in LINEAR:
                    value = as_held(value)
            setattr(self, name, nnx.Param(value))

    @classmethod
    def from_weights(
        cls, config: LlamaConfig, weights: dict, *, dtype=jnp.float32, weight_format: str = "fp32"
    ) -> Llama:
        """A model holding ``weights`` (numpy arrays of the internal layout), cast to ``dtype``.

        The matrices are held transposed (:mod:`jaxkv.models.weights`: a
        :class:`~jaxkv.models.weights.TransposedWeight` or a
        :class:`~jaxkv.models.weights.QuantizedWeight`); a weight given already held (a
        model's own ``nnx.to_pure_dict(nnx.state(model))``) is kept as it is.

        Args:
          config, weights: the model's config and its weights (see :func:`weight_shapes`).
          dtype: parameter and activation dtype (float32 default).
          weight_format: one of :data:`jaxkv.models.weights.WEIGHT_FORMATS`: anything but
            ``fp32`` holds the matrices (:data:`MATRICES`) in that format (the embedding and LM
            head in :data:`~jaxkv.models.weights.HEAD_FORMATS`'s where it names one), float32 activations
            between layers (``dtype`` must then be float32); norms and biases stay float32.
        Raises:
          JaxkvError: a missing weight or one of the wrong shape (named), an unknown
            ``weight_format``, or one other than fp32 with a ``dtype`` other than float32.
        """
        check_weight_format(weight_format)
        if weight_format != "fp32" and jnp.dtype(dtype) != jnp.float32:
            raise JaxkvError(
                f"{config.name}: weights={weight_format!r} computes in float32 between layers: "
                f"expected dtype float32, got {jnp.dtype(dtype).name}"
            )
        shapes = weight_shapes(config)
        missing = [name for name in shapes if name not in weights]
        if missing:
            raise JaxkvError(f"{config.name}: weight {missing[0]!r} is missing")
        model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=dtype))
        # the largest first: the host copy a conversion holds is then the largest while the fewest
        # weights are placed (peak memory: the placed weights plus one weight on the host, not two)
        for name, shape in sorted(shapes.items(), key=lambda item: -int(np.prod(item[1]))):
            w = weights[name]  # read here, once (a lazy mapping builds it now)
            if name == "embed" and isinstance(w, HELD_FORMS):  # held as its tied head [D, V]
                shape = shape[::-1]
            if tuple(w.shape) != shape:
                raise JaxkvError(f"{config.name}: weight {name!r} has shape {tuple(w.shape)}, expected {shape}")
            fmt = HEAD_FORMATS.get(weight_format, weight_format) if name in ("embed", "lm_head") else weight_format
            held_dtype = dtype if fmt == "fp32" else FLOAT_FORMATS.get(fmt)  # None: an integer format
            if isinstance(w, HELD_FORMS):  # a model's own state (nnx.to_pure_dict), kept as held
                value = w
            elif name not in MATRICES:
                value = jnp.asarray(w, dtype)
            elif name == "embed" and held_dtype is not None:  # a float table [V, D] is its own head held transposed
                value = jax.device_put(np.asarray(w, held_dtype))
            elif name == "embed":  # quantised as the tied head [D, V]
                value = convert(np.asarray(w).T, fmt)
            else:
                value = convert(w, fmt if held_dtype is None else held_dtype)
            setattr(model, name, nnx.Param(value))
        return model

    def __call__(self, tokens, n, cache: KVCache, *, last_only: bool = False, kv_hook=None):
        """One chunk through the decoder; see :func:`jaxkv.models.step.forward` (the pure
        step that calls it) for the arguments, shapes and result."""
        c = self.config
        b, t = tokens.shape
        cache, step = cache.begin(n, t)
        x = embed_lookup(self.embed[...], tokens).astype(self.final_norm[...].dtype)  # float32 unless dtype says
        if c.embed_scale:
            x = x * jnp.asarray(c.dim**0.5, x.dtype)
        activation = MLP_ACTIVATIONS[c.mlp_activation]

        def sublayer(x, w, norm, post_norm, fn):
            if not c.post_norms:
                return pre_norm_residual(x, w[norm], c.norm_eps, fn)
            y, aux = fn(rms_norm(x, w[norm], c.norm_eps))
            return x + rms_norm(y, w[post_norm], c.norm_eps), aux

        def layer(step, rope, x, xs):
            w, kv, index = xs
            w = {**w, **{name: stack.at(index) for name, stack in in_place.items()}}

            def attention(h):
                bias = (w["bq"], w["bk"], w["bv"]) if c.attention_bias else None
                q, k, v = qkv_projection(
                    h,
                    w["wq"],
                    w["wk"],
                    w["wv"],
                    n_heads=c.n_heads,
                    n_kv_heads=c.n_kv_heads,
                    head_dim=c.head_dim,
                    bias=bias,
                )
                if c.qk_norm:
                    q, k = rms_norm(q, w["q_norm"], c.norm_eps), rms_norm(k, w["k_norm"], c.norm_eps)
                if kv_hook is not None:
                    k, v = kv_hook(k, v)
                retention = step.spec.policy.retention
                scored = retention is not None and retention.attention_scored
                out, *stored = attend(
                    step, kv, q, k, v, rope=rope, scale=c.query_scale, softcap=c.attn_softcap, mass=scored
                )
                return dense(out.reshape(b, t, c.n_heads * c.head_dim), w["wo"]), tuple(stored)

            def mlp(h):
                return gated_mlp(h, w["w_gate"], w["w_up"], w["w_down"], activation), None

            x, stored = sublayer(x, w, "attn_norm", "attn_post_norm", attention)
            x, _ = sublayer(x, w, "mlp_norm", "mlp_post_norm", mlp)
            return x, stored

        weights = {name: getattr(self, name)[...] for name in layer_weight_names(c)}
        # ggml's blocks are read in place by their product (a layer index, not a slice per layer)
        in_place = {name: w for name, w in weights.items() if isinstance(w, BlockWeight)}
        weights = {name: w for name, w in weights.items() if name not in in_place}
        kinds = c.layer_kinds
        k_new, v_new, masses = [], [], []
        for first, end, run_step, run_layers in cache.runs(step):  # one run unless per-layer specs
            window = c.sliding_window if kinds[first] == "sliding_attention" else None
            if len(set(kinds[first:end])) != 1 or run_step.spec.attention_window != window:
                raise JaxkvError(
                    f"{c.name}: the cache of layers {first}-{end - 1} is not the one their attention needs "
                    f"(a local window of {c.sliding_window} tokens on {', '.join(sorted(set(kinds[first:end])))} "
                    "layers): make it with jaxkv.decode.new_cache(config, spec, batch), or "
                    "KVCache.create(config.cache_spec(spec), ...)"
                )
            run_weights = weights if (first, end) == (0, c.n_layers) else jax.tree.map(lambda a: a[first:end], weights)  # noqa: B023
            body = functools.partial(layer, run_step, c.rope_for(kinds[first]))
            index = jnp.arange(first, end, dtype=jnp.int32)
            x, (k_run, v_run, *mass) = lax.scan(body, x, (run_weights, run_layers, index))
            k_new.append(k_run)
            v_new.append(v_run)
            masses.append(mass[0] if mass else None)
        cache = cache.commit(step, jnp.concatenate(k_new), jnp.concatenate(v_new), mass=masses)
        if last_only:  # the last appended token of each row
            idx = jnp.maximum(step.n - 1, 0)[:, None, None]
            x = jnp.take_along_axis(x, jnp.broadcast_to(idx, (b, 1, x.shape[-1])), axis=1)
        x = rms_norm(x, self.final_norm[...], c.norm_eps)
        head = tied_head(self.embed[...]) if c.tie_embeddings else self.lm_head[...]
        logits = dense(x, head, preferred_element_type=jnp.float32)
        if c.final_softcap is not None:
            logits = c.final_softcap * jnp.tanh(logits / c.final_softcap)
        return logits, cache


# ---- config builders shared by every family's formats ----------------------------------------------
_HF_UNSUPPORTED = {  # config.json attributes that change the maths -> the values that leave them as computed here
    "attn_logit_softcapping": (None,),  # Gemma 2 (read by its family)
    "final_logit_softcapping": (None,),  # Gemma 2
    "query_pre_attn_scalar": (None,),  # an attention scale other than 1/sqrt(H) (Gemma)
    "use_qk_norm": (None, False),  # norms on Q and K (Llama 4)
    "use_sliding_window": (None, False),  # Qwen2's optional window on some layers
}
_HF_ROPE_TYPES = ("default", "linear", "llama3")


def hf_architecture(hf: dict, architectures: tuple, model_types: dict) -> str:
    """The one ``architectures`` entry of a ``config.json`` (or its ``model_type``'s), checked
    against a family's list.

    Raises:
      JaxkvError: several architectures, or one not in ``architectures`` (both named).
    """
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    arch = archs[0] if archs else model_types.get(model_type)
    if len(archs) > 1 or arch not in architectures:
        found = ", ".join(map(str, archs)) if archs else f"model_type {model_type!r}"
        raise JaxkvError(f"architecture {found} is not supported: expected one of {', '.join(architectures)}")
    return arch


def hf_rope(hf: dict, arch: str, head_dim: int, kind: str = "full_attention") -> Rope:
    """The :class:`Rope` of one layer kind from a ``config.json``: transformers 5's
    ``rope_parameters`` (flat, or one entry per layer kind as Gemma 3 writes it), else the
    older ``rope_theta`` + ``rope_scaling`` (+ Gemma 3's ``rope_local_base_freq`` for local
    layers). Types ``default``, ``linear`` and ``llama3``.

    Raises:
      JaxkvError: another RoPE type (``dynamic``, ``yarn``, ``longrope``, ...) or a
        ``partial_rotary_factor`` other than 1, named with the accepted values.
    """
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(kind), dict):
        params = params[kind]
    elif not isinstance(params, dict):
        params = dict(hf.get("rope_scaling") or {})
        if kind == "sliding_attention" and hf.get("rope_local_base_freq") is not None:
            params = {"rope_theta": hf["rope_local_base_freq"]}  # Gemma 3: local layers unscaled
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    theta = float(params.get("rope_theta") or 10000.0)
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise JaxkvError(
            f"{arch} config: partial_rotary_factor={partial!r} is not supported: expected 1 (RoPE on whole heads)"
        )
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type == "default":
        return Rope.default(theta, head_dim)
    if rope_type == "linear":
        return Rope.linear(theta, head_dim, params.get("factor"))
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        return Rope.llama3(theta, head_dim, **{k: params.get(k) for k in keys})
    raise JaxkvError(
        f"{arch} config: rope_scaling of type {rope_type!r} is not supported: expected one of "
        f"{', '.join(_HF_ROPE_TYPES)}"
    )


def _theta(hf: dict) -> float:
    """The global layers' RoPE base of a ``config.json`` (``rope_parameters`` or ``rope_theta``)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if isinstance(params, dict) and params.get("rope_theta"):
        return float(params["rope_theta"])
    return float(hf.get("rope_theta") or 10000.0)


def hf_config(
    hf: dict,
    *,
    arch: str,
    family: str,
    name: str,
    unsupported: dict | None = None,
    activations=("silu", "swish"),
    **switches,
) -> LlamaConfig:
    """A :class:`LlamaConfig` from a ``config.json``, for any family.

    Reads ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads`` (default: the query heads),
    ``head_dim`` (default: hidden_size / heads), ``vocab_size``, the RoPE (:func:`hf_rope`,
    per layer kind), ``rms_norm_eps`` (default 1e-6), ``max_position_embeddings`` (default
    2048), ``tie_word_embeddings`` (default False), ``hidden_act``/``hidden_activation``.

    Args:
      hf: the ``config.json``; arch: its architecture (for messages); family: the family's name.
      unsupported: attribute -> the values this family computes as (default: those of
        plain Llama: no soft-capping, no query scale, no Q/K norm, no Qwen2 window); any
        other value is refused by name.
      activations: the ``hidden_act`` values the family's MLP computes (mapped to
        :data:`MLP_ACTIVATIONS`).
      switches: the family's own :class:`LlamaConfig` fields (e.g. ``qk_norm=True``).
    Raises:
      JaxkvError: a missing or invalid size, an unsupported activation or RoPE, or an
        attribute named in ``unsupported`` with another value (named, with the accepted ones).
    """

    def need(key):
        value = hf.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise JaxkvError(f"{arch} config: {key}={value!r}, expected a positive integer")
        return value

    act = hf.get("hidden_activation") or hf.get("hidden_act") or activations[0]
    if act not in activations:
        raise JaxkvError(
            f"{arch} config: hidden_act={act!r} is not supported: expected {' or '.join(map(repr, activations))}"
        )
    for key, neutral in (_HF_UNSUPPORTED if unsupported is None else unsupported).items():
        if hf.get(key) not in neutral:
            raise JaxkvError(
                f"{arch} config: {key}={hf.get(key)!r} is not supported: expected {' or '.join(map(repr, neutral))}"
            )
    dim, n_heads, n_layers = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
    head_dim = hf.get("head_dim") or (dim // n_heads)
    kinds = switches.pop("layer_types", None)
    if kinds is None and hf.get("layer_types") and set(hf["layer_types"]) != {"full_attention"}:
        other = next(k for k in hf["layer_types"] if k != "full_attention")
        raise JaxkvError(
            f"{arch} config: layer_types with {other!r} is not supported: expected only 'full_attention' layers"
        )
    rope = hf_rope(hf, arch, head_dim)
    local = hf_rope(hf, arch, head_dim, "sliding_attention") if kinds and "sliding_attention" in kinds else None
    theta = _theta(hf)
    return LlamaConfig(
        vocab_size=need("vocab_size"),
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        hidden_dim=need("intermediate_size"),
        rope_theta=theta,
        rope=None if rope == Rope.default(theta, head_dim) else rope,
        local_rope=None if local is None or local == rope else local,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=int(hf.get("max_position_embeddings") or 2048),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        mlp_activation="gelu_tanh" if act.startswith("gelu") else "silu",
        layer_types=tuple(kinds) if kinds else None,
        name=name,
        family=family,
        **switches,
    )


def gguf_config(
    metadata: dict,
    *,
    arch: str,
    family: str,
    tie_embeddings: bool,
    vocab_size: int | None,
    name: str,
    extra: dict | None = None,
    neutral: dict | None = None,
    **switches,
) -> LlamaConfig:
    """A :class:`LlamaConfig` from the ``{arch}.*`` keys of a GGUF file's metadata, for any family.

    Reads ``embedding_length``, ``block_count``, ``attention.head_count``,
    ``attention.head_count_kv``, ``attention.key_length``, ``feed_forward_length``,
    ``vocab_size``, ``rope.freq_base``, ``rope.scaling.type``/``rope.scaling.factor``
    (``none``/``linear``), the ``rope_freqs`` tensor (llama.cpp's form of Llama 3.x
    scaling, through ``read``), ``attention.layer_norm_rms_epsilon``, ``context_length``.

    Args:
      metadata: the file's metadata (``general.architecture == arch``).
      arch: the key prefix; family: the family's name; name: the config's name.
      tie_embeddings, vocab_size: as :meth:`LlamaConfig.from_gguf`.
      extra: the file's small non-weight tensors (:attr:`Format.extra`) as float32 arrays.
      neutral: more ``{arch}.*`` keys that would change the maths -> the value computed here.
      switches: the family's own :class:`LlamaConfig` fields.
    Raises:
      JaxkvError: another architecture, a missing size, or a key that would change the maths
        this family computes (named with its value): ``expert_count`` > 0 (mixture of
        experts), ``rope.scaling.type`` other than ``none``/``linear``,
        ``rope.dimension_count`` or ``attention.value_length`` other than the head dim.
    """
    if metadata.get("general.architecture") != arch:
        raise JaxkvError(
            f"GGUF architecture {metadata.get('general.architecture')!r} is not supported here: expected {arch!r}"
        )

    def get(key, default=None):
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise JaxkvError(f"GGUF metadata lacks '{arch}.{key}'")
        return value

    dim = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", dim // n_heads))
    checks = {  # keys that change the maths -> the value that leaves it as computed here
        "expert_count": 0,  # a mixture of experts (Mixtral)
        "rope.dimension_count": head_dim,  # RoPE on part of each head only
        "attention.value_length": head_dim,
        **(neutral or {}),
    }
    for key, expected in checks.items():
        value = metadata.get(f"{arch}.{key}", expected)
        if value != expected:
            raise JaxkvError(
                f"GGUF metadata {arch}.{key}={value!r} is not supported: expected {expected!r} (it changes the outputs)"
            )
    theta = float(get("rope.freq_base", 10000.0))
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    factor = float(metadata.get(f"{arch}.rope.scaling.factor", metadata.get(f"{arch}.rope.scale_linear", 1.0)) or 1.0)
    if scaling not in ("none", "linear"):
        raise JaxkvError(
            f"GGUF metadata {arch}.rope.scaling.type={scaling!r} is not supported: expected 'none' or 'linear'"
        )
    rope = None
    if extra and "rope_freqs.weight" in extra:
        rope = Rope.with_factors(theta, head_dim, extra["rope_freqs.weight"])
    elif factor != 1.0:
        rope = Rope.linear(theta, head_dim, factor)
    return LlamaConfig(
        vocab_size=int(get("vocab_size", vocab_size)),
        dim=dim,
        n_layers=int(get("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(get("attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        hidden_dim=int(get("feed_forward_length")),
        rope_theta=theta,
        rope=rope,
        norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_seq_len=int(get("context_length", 2048)),
        tie_embeddings=tie_embeddings,
        name=name,
        family=family,
        **switches,
    )


def gguf_builder(build):
    """A GGUF :attr:`Format.config` from ``build(metadata, *, tie_embeddings, vocab_size, name, extra)``:
    tied when the file has no ``output.weight``, V from ``token_embd.weight`` when the
    metadata lacks it (``shapes``: tensor name -> shape in numpy order)."""

    def config(metadata: dict, shapes: dict, *, name: str, extra: dict | None = None):
        embed = shapes.get("token_embd.weight")
        return build(
            metadata,
            tie_embeddings="output.weight" not in shapes,
            vocab_size=embed[0] if embed else None,
            name=name,
            extra=extra,
        )

    return config


FAMILY = Family(
    name="llama",
    config=LlamaConfig,
    model=Llama,
    weight_shapes=weight_shapes,
    head_axes={"wq": 2, "wk": 2, "wv": 2, "wo": 1},  # [L, D, N*H] split by heads; wo [L, N*H, D]
    mlp_axes={"w_gate": 2, "w_up": 2, "w_down": 1},
    hf=Format(
        config=LlamaConfig.from_hf,
        tensors=HF_TENSORS,
        linear=LINEAR,
        architectures=HF_ARCHITECTURES,
        model_types=tuple(HF_MODEL_TYPES),
    ),
    gguf=Format(
        config=gguf_builder(LlamaConfig.from_gguf),
        tensors=GGUF_TENSORS,
        extra=("rope_freqs.weight",),
        linear=LINEAR,
        interleaved=INTERLEAVED,
        architectures=("llama",),
    ),
    llama2c=Format(config=LlamaConfig.from_llama2c, tensors=LLAMA2C_TENSORS, linear=LINEAR, interleaved=INTERLEAVED),
)
"""The Llama family, as :mod:`jaxkv.io.registry` registers it."""
