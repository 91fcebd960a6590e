"""``jaxkv sample``: generate text from a model (:func:`jaxkv.sample`)."""

from __future__ import annotations

import sys

from jaxkv.cli.flags import add_cache_flags, add_model_flags, add_sampler_flags, add_tokenizer_flag, cache_spec_from_args
from jaxkv.decode import Sampler, encode_prompt, sample
from jaxkv.errors import INT32_LIMIT, check_int
from jaxkv.io import load_model

def add_parser(sub) -> None:
    s = sub.add_parser("sample", help="generate text from a model")
    add_model_flags(s)
    s.add_argument("--prompt", default="", help="prompt text (default: empty, i.e. BOS)")
    s.add_argument("--tokens", type=int, default=128, metavar="N", help="tokens to generate at most (default 128)")
    add_sampler_flags(s)
    add_tokenizer_flag(s)
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_cache_flags(s)
    s.set_defaults(func=run)


def run(args) -> None:
    Sampler(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)  # validate before loading
    check_int("--tokens", args.tokens, 1, INT32_LIMIT)
    model = load_model(args.model, tokenizer=args.tokenizer)
    prompt_ids = encode_prompt(model.tokenizer, args.prompt, chat=args.chat)
    result = sample(
        model,
        prompt_ids,
        max_new_tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        cache=cache_spec_from_args(args, len(prompt_ids), args.tokens),
        on_text=lambda piece: print(piece, end="", flush=True),
    )
    print(flush=True)
    print(result.report(), file=sys.stderr, flush=True)
