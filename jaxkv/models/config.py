"""Model configuration for the Llama family (Llama 2, SmolLM2, TinyStories llama2.c models).

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
the Q/K output channels with :func:`interleaved_to_rotate_half` at load time.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.errors import JaxkvError

HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
"""Hugging Face ``architectures`` that :meth:`LlamaConfig.from_hf` accepts."""


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
    def from_gguf(cls, metadata: dict, *, tie_embeddings: bool, name: str = "gguf") -> "LlamaConfig":
        """Config from GGUF ``llama.*`` metadata (a plain ``{key: value}`` dict)."""
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
        return cls(
            vocab_size=int(get("vocab_size", metadata.get("_vocab_size"))),
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
            sliding-window layout, or a missing/invalid size (each named).
        """
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        arch = archs[0] if archs else by_type.get(model_type)
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


def interleaved_to_rotate_half(w: np.ndarray, n_heads: int, head_dim: int) -> np.ndarray:
    """Permute Q/K output channels from the interleaved-pair RoPE layout to rotate-half.

    Args:
      w: ``[..., n_heads * head_dim]`` weights whose last axis is the Q or K output channel.
    Returns:
      the same weights with, inside each head, channels ``0, 2, 4, ..., 1, 3, 5, ...``, so
      that pair ``(2i, 2i+1)`` of the checkpoint becomes pair ``(i, i + H/2)``. Attention
      scores are unchanged because Q and K are permuted alike.
    """
    perm = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    idx = (np.arange(n_heads)[:, None] * head_dim + perm[None, :]).reshape(-1)
    return w[..., idx]
