"""Deprecated: the Llama config moved to :mod:`jaxkv.models.llama` (the Llama family module)
and :func:`interleaved_to_rotate_half` to :mod:`jaxkv.models.blocks`."""

import warnings

from jaxkv.models.blocks import interleaved_to_rotate_half
from jaxkv.models.llama import HF_ARCHITECTURES, LlamaConfig

warnings.warn(
    "jaxkv.models.config is deprecated: import LlamaConfig and HF_ARCHITECTURES from jaxkv.models.llama, "
    "interleaved_to_rotate_half from jaxkv.models.blocks",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["HF_ARCHITECTURES", "LlamaConfig", "interleaved_to_rotate_half"]
