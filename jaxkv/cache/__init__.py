"""The KV cache: what is kept (a *policy*), how it is held (a *storage*), the pytree, and the
three-call contract a model uses (``begin``, ``attend`` per layer, ``commit``).

See docs/ARCHITECTURE.md for the two extension points and DESIGN §2 for the semantics.
"""

from jaxkv.cache.attention import attend
from jaxkv.cache.kivi_storage import KiviStorage, QuantRing
from jaxkv.cache.kv import KVCache, LayerKV, Step
from jaxkv.cache.layered import LayeredCache, LayeredStep
from jaxkv.cache.memory import MemoryReport, memory_report
from jaxkv.cache.policy import FullCache, Policy, StreamingLLM
from jaxkv.cache.rows import batch_axes, put_rows, take_rows
from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.cache.storage import FloatStorage, Storage

__all__ = [
    "CacheSpec",
    "FloatStorage",
    "FullCache",
    "KVCache",
    "KiviStorage",
    "LayerKV",
    "LayerSpecs",
    "LayeredCache",
    "LayeredStep",
    "MemoryReport",
    "Policy",
    "QuantRing",
    "Step",
    "Storage",
    "StreamingLLM",
    "attend",
    "batch_axes",
    "memory_report",
    "put_rows",
    "take_rows",
]
