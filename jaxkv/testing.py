"""A tiny random Llama and a tiny tokenizer, for tests, examples and users' own tests.

Everything here is built in memory in milliseconds (no files, no downloads) and is
deterministic: the same ``seed`` and overrides give the same weights on every run and
backend-independent token ids, so expected values written down once stay valid.

* :func:`tiny_config` / :func:`tiny_model`: a 2-layer grouped-query Llama
  (``N = 4`` query heads over ``K = 2`` KV heads, ``H = 8``, ``D = 32``, ``V = 64``)
  with random float32 weights from ``nnx.Rngs(seed)``.
* :func:`numpy_weights`: a model's weights as float32 NumPy arrays (internal layout).
* :func:`tiny_tokenizer`: a character-level :class:`~jaxkv.io.tokenizer.Tokenizer` of
  exactly ``V = 64`` ids with BOS/EOS and a ChatML chat template.
* :func:`tiny_loaded`: both as a :class:`~jaxkv.models.LoadedModel`, ready for
  :func:`jaxkv.sample`, :func:`jaxkv.generate`, :class:`jaxkv.ChatSession` and batches.
* :func:`materialised_buffers`: the buffers a compiled XLA program writes, to check
  that a decode loop never copies its cache.

Example::

    from jaxkv import CacheSpec, sample
    from jaxkv.testing import tiny_loaded

    text = sample(tiny_loaded(), "once upon a time", max_new_tokens=8, cache=CacheSpec(sink=4, window=16))
"""

from __future__ import annotations

import re
import string

import numpy as np
from flax import nnx

from jaxkv.io import LoadedModel
from jaxkv.io.tokenizer import Tokenizer
from jaxkv.models.llama import LINEAR, Llama, LlamaConfig, weight_shapes

__all__ = [
    "TINY_CONFIG",
    "TINY_CHAT_TEMPLATE",
    "materialised_buffers",
    "numpy_weights",
    "tiny_config",
    "tiny_loaded",
    "tiny_model",
    "tiny_tokenizer",
]

TINY_CONFIG = dict(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=48, rope_theta=10000.0
)
""":class:`LlamaConfig` fields of the tiny model (the rest are LlamaConfig's defaults)."""

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, as SmolLM2 writes it: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message."""

_SPECIALS = ("<unk>", "<s>", "<|im_start|>", "<|im_end|>")  # ids 0, 1 (BOS), 2, 3 (EOS)
_CHARACTERS = "\n " + string.ascii_lowercase + string.digits + ".,!?'\":;-()[]{}<>/|_=+"


def tiny_config(**overrides) -> LlamaConfig:
    """The tiny model's :class:`LlamaConfig`: :data:`TINY_CONFIG` updated with ``overrides``
    (any LlamaConfig field, e.g. ``head_dim=64`` or ``n_layers=1``).

    Raises:
      JaxkvError: an override LlamaConfig refuses (named).
    """
    return LlamaConfig(**{**TINY_CONFIG, **overrides})


def tiny_model(seed: int = 0, **overrides) -> Llama:
    """A random tiny :class:`Llama` (float32 parameters drawn from ``nnx.Rngs(seed)``).

    Args:
      seed: the parameter seed; the same seed and overrides give the same weights.
      overrides: :class:`LlamaConfig` fields replacing :data:`TINY_CONFIG`'s.

    Returns:
      a fresh module (callers may change it); ``model.config`` is :func:`tiny_config`.
      With the defaults: ``D = 32``, ``L = 2``, ``N = 4`` query heads over ``K = 2`` KV
      heads of ``H = 8``, SwiGLU width 48, ``V = 64``, tied embeddings, RoPE base 10000.

    Raises:
      JaxkvError: an override LlamaConfig refuses (named).
    """
    return Llama(tiny_config(**overrides), rngs=nnx.Rngs(seed))


def numpy_weights(model: Llama) -> dict[str, np.ndarray]:
    """``model``'s weights as NumPy arrays, keyed and shaped as
    :func:`jaxkv.models.llama.weight_shapes` (the internal layout of
    :mod:`jaxkv.models.llama`: per-layer tensors stacked on a leading ``L`` axis, e.g.
    ``wq: [L, D, N*H]``), in the parameters' dtype (float32 for :func:`tiny_model`).
    :meth:`Llama.from_weights` takes them back."""
    return {
        name: np.asarray(getattr(model, name)[...].dequantize() if name in LINEAR else getattr(model, name)[...])
        for name in weight_shapes(model.config)
    }


def tiny_tokenizer() -> Tokenizer:
    """A character-level tokenizer of exactly 64 ids (the tiny model's ``V``).

    Ids: 0 ``<unk>`` (any character not below), 1 ``<s>`` (BOS, prepended by
    :meth:`~Tokenizer.encode` by default), 2 ``<|im_start|>``, 3 ``<|im_end|>`` (EOS, which
    ends a chat reply), then one id per character of ``"\\n"``, ``" "``, ``a-z``,
    ``0-9`` and ``.,!?'":;-()[]{}<>/|_=+``.
    Text is lower-cased first, so ``decode(encode(text))`` is ``text.lower()`` for text
    of those characters. The special tokens written in the text encode to their single
    ids, and the chat template is :data:`TINY_CHAT_TEMPLATE` (ChatML).

    Built with the ``tokenizers`` library (a BPE without merges), so it is also a small
    example of :meth:`Tokenizer.from_hf`.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {token: i for i, token in enumerate(_SPECIALS + tuple(_CHARACTERS))}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    hf.normalizer = normalizers.Lowercase()
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens(list(_SPECIALS))
    return Tokenizer.from_hf(hf, bos_id=1, eos_id=3, add_bos=True, chat_template=TINY_CHAT_TEMPLATE, name="tiny")


def tiny_loaded(seed: int = 0, *, tokenizer: bool = True, **overrides) -> LoadedModel:
    """:func:`tiny_model` as a :class:`LoadedModel` (``path=None``).

    Args:
      seed, overrides: as for :func:`tiny_model` (a ``vocab_size`` override other than 64
        needs ``tokenizer=False``).
      tokenizer: attach :func:`tiny_tokenizer` (text in, text out, stops at its EOS) or,
        with False, none (token ids in and out; decoding stops at a token only when told).

    Raises:
      JaxkvError: an override LlamaConfig refuses, or ``vocab_size`` other than the
        tokenizer's 64 with ``tokenizer=True``.
    """
    from jaxkv.errors import JaxkvError

    model = tiny_model(seed, **overrides)
    tok = tiny_tokenizer() if tokenizer else None
    if tok is not None and tok.vocab_size != model.config.vocab_size:
        raise JaxkvError(
            f"vocab_size={model.config.vocab_size!r}: the tiny tokenizer has {tok.vocab_size} ids; pass tokenizer=False"
        )
    return LoadedModel(config=model.config, model=model, tokenizer=tok)


def materialised_buffers(hlo: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(instruction, element type, shape) of every buffer a compiled program writes.

    Args:
      hlo: the text of a *compiled* XLA program, e.g.
        ``jax.jit(f).lower(*args).compile().as_text()``.

    Returns:
      one ``(name, element type such as "f32", shape)`` per instruction outside fusion
      bodies, less parameters, tuple elements and bitcasts (which write nothing). A
      decode loop that updates its cache in place shows no buffer of the cache's shape.
    """
    out, fused = [], False
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):  # a computation begins
            fused = "fused_computation" in line or line.startswith("%wrapped")
        elif not fused and (m := re.match(r"\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]", line)):
            if not re.search(r"= \S+ (parameter|get-tuple-element|bitcast)\(", line):
                out.append((m.group(1), m.group(2), tuple(int(d) for d in m.group(3).split(",") if d)))
    return out
