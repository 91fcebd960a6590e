"""Serving: the engine (a request queue, cache rows, steps of batched prompt chunks and
decoding over the busy rows only, a prefix store) and, above it, a thin OpenAI-compatible ASGI app (:mod:`jaxkv.serve.app`).

The engine is usable without HTTP::

    from jaxkv.serve import Engine, SamplingParams
    engine = Engine(model, jaxkv.CacheSpec(sink=4, window=252), slots=8).start()
    print(engine.submit(ids, SamplingParams(max_tokens=32)).result().text)
"""

from jaxkv.serve.engine import ContextLengthError, Engine, EngineStopped, Event, QueueFullError, Request, SamplingParams
from jaxkv.serve.prefix import PrefixStore

__all__ = [
    "ContextLengthError",
    "Engine",
    "EngineStopped",
    "Event",
    "PrefixStore",
    "QueueFullError",
    "Request",
    "SamplingParams",
]
