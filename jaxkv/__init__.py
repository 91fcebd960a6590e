"""jaxkv: long-context LLM decoding in JAX with a KV cache bounded in length (StreamingLLM)
and compressed in precision (KIVI).

Public API::

    import jaxkv
    model = jaxkv.load_model("stories260K.bin", tokenizer="tok512.model")
    out = jaxkv.sample(model, "Once upon a time", max_new_tokens=200,
                       cache=jaxkv.CacheSpec(sink=4, window=252, kv_quantize="int4", group_size=4, residual=28))
    print(out.text, out.report())
"""

import importlib.metadata as _metadata

from jaxkv.cache.kv import KVCache
from jaxkv.cache.memory import MemoryReport, memory_report
from jaxkv.cache.preset import cache_preset
from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.decode import BatchGeneration, Generation, Sampler, decode, generate, prefill, sample
from jaxkv.decode.chat import ChatSession
from jaxkv.errors import CacheFullError, JaxkvError, ModelFileError
from jaxkv.io import LoadedModel, load_model
from jaxkv.models.llama import Llama, LlamaConfig
from jaxkv.models.step import forward

try:
    __version__ = _metadata.version("jaxkv")
except _metadata.PackageNotFoundError:  # a source tree on the path, not installed
    __version__ = "0+unknown"

__all__ = [
    "CacheFullError",
    "BatchGeneration",
    "CacheSpec",
    "ChatSession",
    "Generation",
    "JaxkvError",
    "KVCache",
    "LayerSpecs",
    "Llama",
    "LlamaConfig",
    "LoadedModel",
    "MemoryReport",
    "ModelFileError",
    "Sampler",
    "cache_preset",
    "decode",
    "forward",
    "generate",
    "load_model",
    "memory_report",
    "prefill",
    "sample",
]
