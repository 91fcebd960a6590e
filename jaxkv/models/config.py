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
