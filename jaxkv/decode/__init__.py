"""Decoding: samplers, the one compiled decode loop, and the text API on top of it.

Layers (each uses only the ones above it in this list):

* :mod:`~jaxkv.decode.sampler`: :class:`Sampler` (next-token rule), PRNG keys;
* :mod:`~jaxkv.decode.loop`: :func:`new_cache`, :func:`plan_chunks`, :func:`prefill`, the
  compiled loop (:func:`decode`; :func:`lower_decode` / :func:`compile_decode` for audits and
  tests; :func:`compile_counts`), :func:`prefill_and_decode`;
* :mod:`~jaxkv.decode.prompt`: prompts in (chat template, BOS, id checks), reply text out;
* :mod:`~jaxkv.decode.text`: :func:`generate`, :func:`sample`, :func:`text_stream`;
* :mod:`~jaxkv.decode.chat` (:class:`ChatSession`), :mod:`~jaxkv.decode.batch` (JSONL batches),
  :mod:`~jaxkv.decode.parallel` (device meshes).
"""

from jaxkv.decode.loop import (
    FINISH_REASONS,
    STREAM_S,
    BatchGeneration,
    Chunk,
    LoopState,
    chunk_len,
    compile_counts,
    compile_decode,
    count_compiles,
    decode,
    full_cache_len,
    lower_decode,
    new_cache,
    plan_chunks,
    prefill,
    prefill_and_decode,
    to_host,
    warm_prefill,
)
from jaxkv.decode.prompt import check_token_ids, encode_prompt, reply_text
from jaxkv.decode.sampler import Sampler, prng_keys
from jaxkv.decode.text import Generation, generate, sample, text_stream

__all__ = [
    "FINISH_REASONS",
    "STREAM_S",
    "BatchGeneration",
    "Chunk",
    "Generation",
    "LoopState",
    "Sampler",
    "check_token_ids",
    "chunk_len",
    "compile_counts",
    "compile_decode",
    "count_compiles",
    "decode",
    "encode_prompt",
    "full_cache_len",
    "generate",
    "lower_decode",
    "new_cache",
    "plan_chunks",
    "prefill",
    "prefill_and_decode",
    "prng_keys",
    "reply_text",
    "sample",
    "text_stream",
    "to_host",
    "warm_prefill",
]
