"""The Llama family: Llama 2, SmolLM2, TinyLlama, the TinyStories llama2.c models, Mistral
(without its sliding window) and Qwen2 (Q/K/V biases). One module holds the whole family:
its config (:class:`LlamaConfig`, built from each checkpoint format's metadata, refusing by
name what it does not implement), the names of its weights in each format, and the
decoder block (:class:`Llama`, Flax NNX: RMSNorm, RoPE, GQA, SwiGLU), registered as
:data:`FAMILY` in :mod:`jaxkv.io.registry`.

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
``wo``                ``[L, N*H, D]``        attention output projection
``mlp_norm``          ``[L, D]``             RMSNorm weight before the SwiGLU MLP
``w_gate``            ``[L, D, F]``          SwiGLU gate (llama2.c ``w1``)
``w_up``              ``[L, D, F]``          SwiGLU up (llama2.c ``w3``)
``w_down``            ``[L, F, D]``          SwiGLU down (llama2.c ``w2``)
``final_norm``        ``[D]``                final RMSNorm weight
``lm_head``           ``[D, V]``             classifier; absent when tied to ``embed``
====================  =====================  =========================================

RoPE convention: one internal convention, "rotate-half" (Hugging Face's): within a head,
channel ``i`` pairs with channel ``i + H/2``. llama2.c and GGUF checkpoints store Q/K rows
in the interleaved-pair layout (channel ``2i`` pairs with ``2i+1``); their loaders permute
the Q/K output channels with :func:`jaxkv.models.blocks.interleaved_to_rotate_half` at
load time (the ``interleaved`` entries of :data:`FAMILY`).
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
from jaxkv.errors import JaxkvError
from jaxkv.models.blocks import pre_norm_residual, qkv_projection, rms_norm, swiglu
from jaxkv.models.family import Family, Format

HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
"""Hugging Face ``architectures`` that :meth:`LlamaConfig.from_hf` accepts."""
HF_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""``config.json`` ``model_type`` -> the architecture it means when ``architectures`` is absent."""

_HF_UNSUPPORTED = {  # config.json attributes that change the maths -> the values that leave them as computed here
    "partial_rotary_factor": (None, 1, 1.0),  # RoPE on part of each head only (Phi, StableLM)
    "attn_logit_softcapping": (None,),  # Gemma 2
    "final_logit_softcapping": (None,),  # Gemma 2
    "query_pre_attn_scalar": (None,),  # an attention scale other than 1/sqrt(H) (Gemma)
    "use_qk_norm": (None, False),  # norms on Q and K (Llama 4)
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape and hyper-parameters of a Llama-family decoder.

    Attributes:
      vocab_size: V, tokens.
      dim: D, model width.
      n_layers: L.
      n_heads: N, query heads.
      n_kv_heads: K, key/value heads (GQA: ``N % K == 0``).
      head_dim: H.
      hidden_dim: F, SwiGLU hidden width.
      rope_theta: RoPE base (10000 for Llama 2, 100000 for SmolLM2).
      norm_eps: RMSNorm epsilon.
      max_seq_len: the context length the model was trained with, tokens.
      tie_embeddings: the classifier is ``embed.T``.
      attention_bias: the Q/K/V projections have biases ``bq``/``bk``/``bv`` (Qwen2).
      name: a human-readable identity (file name or preset).
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

    def __post_init__(self):
        for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "max_seq_len"):
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

    @classmethod
    def from_llama2c(cls, header, *, name: str = "llama2c") -> "LlamaConfig":
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
    def from_gguf(cls, metadata: dict, *, tie_embeddings: bool, vocab_size: int | None = None, name: str = "gguf") -> "LlamaConfig":
        """Config from GGUF ``llama.*`` metadata (a plain ``{key: value}`` dict).

        Args:
          metadata: the file's metadata, ``general.architecture`` == ``"llama"``.
          tie_embeddings: the file has no classifier (``output.weight``).
          vocab_size: V when the metadata lacks ``llama.vocab_size`` (the embedding's rows).
          name: the config's name.
        Raises:
          JaxkvError: another architecture, a missing size, or a key that would change the
            maths this family computes (named with its value): ``llama.expert_count`` > 0
            (mixture of experts), ``llama.rope.scaling.type`` other than ``none``,
            ``llama.rope.scale_linear`` != 1, ``llama.rope.dimension_count`` or
            ``llama.attention.value_length`` other than the head dim.
        """
        arch = metadata.get("general.architecture")
        if arch != "llama":
            raise JaxkvError(f"GGUF architecture {arch!r} is not supported: expected 'llama'")

        def get(key, default=None):
            value = metadata.get(f"llama.{key}", default)
            if value is None:
                raise JaxkvError(f"GGUF metadata lacks 'llama.{key}'")
            return value

        dim = int(get("embedding_length"))
        n_heads = int(get("attention.head_count"))
        head_dim = int(metadata.get("llama.attention.key_length", dim // n_heads))
        neutral = {  # llama.* keys that change the maths -> the value that leaves it as computed here
            "expert_count": 0,  # a mixture of experts (Mixtral)
            "rope.scaling.type": "none",
            "rope.scale_linear": 1,
            "rope.dimension_count": head_dim,  # RoPE on part of each head only
            "attention.value_length": head_dim,
        }
        for key, expected in neutral.items():
            value = metadata.get(f"llama.{key}", expected)
            if value != expected:
                raise JaxkvError(f"GGUF metadata llama.{key}={value!r} is not supported: expected {expected!r} (it changes the outputs)")
        return cls(
            vocab_size=int(get("vocab_size", vocab_size)),
            dim=dim,
            n_layers=int(get("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            hidden_dim=int(get("feed_forward_length")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            max_seq_len=int(get("context_length", 2048)),
            tie_embeddings=tie_embeddings,
            name=name,
        )

    @classmethod
    def from_hf(cls, hf: dict, *, name: str = "hf") -> "LlamaConfig":
        """Config from a Hugging Face ``config.json`` (a plain dict).

        Supported: ``LlamaForCausalLM`` (Llama, SmolLM2, TinyLlama), ``MistralForCausalLM``
        and ``Qwen2ForCausalLM`` (Q/K/V biases), with SiLU MLPs and plain RoPE
        (``rope_scaling`` absent, null or of type ``default``). Read: ``hidden_size``,
        ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads`` (default: the query heads), ``head_dim`` (default:
        hidden_size / heads), ``vocab_size``, ``rope_theta`` (or ``rope_parameters``;
        default 10000), ``rms_norm_eps`` (default 1e-6), ``max_position_embeddings``
        (default 2048), ``tie_word_embeddings`` (default False). Mistral's
        ``sliding_window`` is not applied (logits are exact up to that many tokens; use a
        StreamingLLM cache for a bounded window).

        Raises:
          JaxkvError: an unsupported architecture, activation, RoPE scaling, bias or
            sliding-window layout, or a missing/invalid size (each named); an attribute
            that would change the maths this family computes, named with its value:
            ``partial_rotary_factor`` (also inside ``rope_parameters``) other than 1,
            ``attn_logit_softcapping``, ``final_logit_softcapping`` or
            ``query_pre_attn_scalar`` set, ``use_qk_norm`` true, ``layer_types`` other than
            all ``full_attention``.
        """
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        arch = archs[0] if archs else HF_MODEL_TYPES.get(model_type)
        if len(archs) > 1 or arch not in HF_ARCHITECTURES:
            found = ", ".join(archs) if archs else f"model_type {model_type!r}"
            raise JaxkvError(f"architecture {found} is not supported: expected one of {', '.join(HF_ARCHITECTURES)}")

        def need(key):
            value = hf.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise JaxkvError(f"{arch} config: {key}={value!r}, expected a positive integer")
            return value

        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise JaxkvError(f"{arch} config: hidden_act={act!r} is not supported: expected 'silu'")
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind != "default":
                raise JaxkvError(f"{arch} config: rope_scaling of type {kind!r} is not supported (only plain RoPE)")
        for key, neutral in _HF_UNSUPPORTED.items():
            value = hf.get(key, rope.get(key))
            if value not in neutral:
                raise JaxkvError(f"{arch} config: {key}={value!r} is not supported: expected {' or '.join(map(repr, neutral))}")
        kinds = hf.get("layer_types") or ["full_attention"]
        if set(kinds) != {"full_attention"}:
            other = next(k for k in kinds if k != "full_attention")
            raise JaxkvError(f"{arch} config: layer_types with {other!r} is not supported: expected only 'full_attention' layers")
        if arch == "Qwen2ForCausalLM":
            bias = True  # Qwen2 always has Q/K/V biases (and none on the output projection)
            if hf.get("use_sliding_window"):
                raise JaxkvError(f"{arch} config: use_sliding_window=true is not supported")
        else:
            if hf.get("attention_bias") or hf.get("mlp_bias"):
                which = "attention_bias" if hf.get("attention_bias") else "mlp_bias"
                raise JaxkvError(f"{arch} config: {which}=true is not supported (biases on the output/MLP projections)")
            bias = False
        dim, n_heads = need("hidden_size"), need("num_attention_heads")
        head_dim = hf.get("head_dim") or (dim // n_heads)
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        return cls(
            vocab_size=need("vocab_size"),
            dim=dim,
            n_layers=need("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            hidden_dim=need("intermediate_size"),
            rope_theta=float(theta if theta is not None else 10000.0),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_seq_len=int(hf.get("max_position_embeddings") or 2048),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bias,
            name=name,
        )

    @classmethod
    def from_preset(cls, name: str) -> "LlamaConfig":
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
            raise JaxkvError(f"no config preset {name!r}: expected one of {', '.join(known) or '(none found)'} or a .json path")
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
INTERLEAVED = {"wq": "n_heads", "wk": "n_kv_heads"}
"""Q/K projections, which llama2.c and GGUF files store in the interleaved-pair RoPE layout."""
LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
BIAS_WEIGHTS = ("bq", "bk", "bv")  # present only when config.attention_bias (Qwen2)


def weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Expected shape of every weight of the internal layout (see the module docstring):
    name -> shape, per-layer weights with a leading L; ``lm_head`` only when untied,
    ``bq``/``bk``/``bv`` only with ``attention_bias``."""
    c = config
    L, D, F, V = c.n_layers, c.dim, c.hidden_dim, c.vocab_size
    shapes = {
        "embed": (V, D),
        "attn_norm": (L, D),
        "wq": (L, D, c.n_heads * c.head_dim),
        "wk": (L, D, c.n_kv_heads * c.head_dim),
        "wv": (L, D, c.n_kv_heads * c.head_dim),
        "wo": (L, c.n_heads * c.head_dim, D),
        "mlp_norm": (L, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
        "final_norm": (D,),
    }
    if not c.tie_embeddings:
        shapes["lm_head"] = (D, V)
    if c.attention_bias:  # last, so the random init of the other weights does not depend on it
        shapes.update(bq=(L, c.n_heads * c.head_dim), bk=(L, c.n_kv_heads * c.head_dim), bv=(L, c.n_kv_heads * c.head_dim))
    return shapes


class Llama(nnx.Module):
    """A Llama-family decoder whose per-layer weights (names and shapes: :func:`weight_shapes`)
    are stacked on a leading L axis; each layer is two pre-norm residual steps (GQA
    attention through the cache, SwiGLU MLP) of :mod:`jaxkv.models.blocks`.

    Build it from checkpoint weights with :meth:`from_weights`, or randomly (tests,
    benchmarks) with ``Llama(config, rngs=nnx.Rngs(seed))``.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = config
        key = rngs.params()
        for i, (name, shape) in enumerate(weight_shapes(config).items()):
            if name.endswith("norm"):
                value = jnp.ones(shape, dtype)
            elif name in BIAS_WEIGHTS:
                value = (0.1 * jax.random.normal(jax.random.fold_in(key, i), shape)).astype(dtype)
            else:
                fan_in = shape[-2]
                value = (jax.random.normal(jax.random.fold_in(key, i), shape) / np.sqrt(fan_in)).astype(dtype)
            setattr(self, name, nnx.Param(value))

    @classmethod
    def from_weights(cls, config: LlamaConfig, weights: dict, *, dtype=jnp.float32) -> "Llama":
        """A model holding ``weights`` (numpy arrays of the internal layout), cast to ``dtype``.

        Raises:
          JaxkvError: a missing weight or one of the wrong shape (named).
        """
        shapes = weight_shapes(config)
        for name, shape in shapes.items():
            if name not in weights:
                raise JaxkvError(f"{config.name}: weight {name!r} is missing")
            if tuple(weights[name].shape) != shape:
                raise JaxkvError(f"{config.name}: weight {name!r} has shape {tuple(weights[name].shape)}, expected {shape}")
        model = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=dtype))
        for name in shapes:
            setattr(model, name, nnx.Param(jnp.asarray(weights[name], dtype)))
        return model

    def __call__(self, tokens, n, cache: KVCache, *, last_only: bool = False, kv_hook=None):
        """One chunk through the decoder; see :func:`jaxkv.models.step.forward` (the pure
        step that calls it) for the arguments, shapes and result."""
        c = self.config
        b, t = tokens.shape
        cache, step = cache.begin(n, t)
        x = jnp.take(self.embed[...], tokens, axis=0)

        def layer(step, x, xs):
            w, kv = xs

            def attention(h):
                bias = (w["bq"], w["bk"], w["bv"]) if c.attention_bias else None
                q, k, v = qkv_projection(
                    h, w["wq"], w["wk"], w["wv"], n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, bias=bias
                )
                if kv_hook is not None:
                    k, v = kv_hook(k, v)
                out, k_store, v_store = attend(step, kv, q, k, v, theta=c.rope_theta)
                return out.reshape(b, t, c.n_heads * c.head_dim) @ w["wo"], (k_store, v_store)

            def mlp(h):
                return swiglu(h, w["w_gate"], w["w_up"], w["w_down"]), None

            x, stored = pre_norm_residual(x, w["attn_norm"], c.norm_eps, attention)
            x, _ = pre_norm_residual(x, w["mlp_norm"], c.norm_eps, mlp)
            return x, stored

        names = LAYER_WEIGHTS + (BIAS_WEIGHTS if c.attention_bias else ())
        weights = {name: getattr(self, name)[...] for name in names}
        k_new, v_new = [], []
        for first, end, run_step, run_layers in cache.runs(step):  # one run unless per-layer specs
            run_weights = weights if (first, end) == (0, c.n_layers) else jax.tree.map(lambda a: a[first:end], weights)
            x, (k_run, v_run) = lax.scan(functools.partial(layer, run_step), x, (run_weights, run_layers))
            k_new.append(k_run)
            v_new.append(v_run)
        cache = cache.commit(step, jnp.concatenate(k_new), jnp.concatenate(v_new))
        if last_only:  # the last appended token of each row
            idx = jnp.maximum(step.n - 1, 0)[:, None, None]
            x = jnp.take_along_axis(x, jnp.broadcast_to(idx, (b, 1, x.shape[-1])), axis=1)
        x = rms_norm(x, self.final_norm[...], c.norm_eps)
        head = self.embed[...].T if c.tie_embeddings else self.lm_head[...]
        logits = jnp.dot(x, head, preferred_element_type=jnp.float32)
        return logits, cache


def _config_from_gguf(metadata: dict, shapes: dict, *, name: str) -> LlamaConfig:
    """:meth:`LlamaConfig.from_gguf`, tied when the file has no classifier and with the
    vocabulary size of the embedding when the metadata lacks it (``shapes``: tensor name ->
    shape in numpy order)."""
    embed = shapes.get(GGUF_TENSORS["embed"])
    return LlamaConfig.from_gguf(
        metadata, tie_embeddings=GGUF_TENSORS["lm_head"] not in shapes, vocab_size=embed[0] if embed else None, name=name
    )


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
    gguf=Format(config=_config_from_gguf, tensors=GGUF_TENSORS, linear=LINEAR, interleaved=INTERLEAVED, architectures=("llama",)),
    llama2c=Format(config=LlamaConfig.from_llama2c, tensors=LLAMA2C_TENSORS, linear=LINEAR, interleaved=INTERLEAVED),
)
"""The Llama family, as :mod:`jaxkv.io.registry` registers it."""
