"""``jaxkv sample``: generate text from a model (:func:`jaxkv.sample`)."""

from __future__ import annotations

import sys

from jaxkv.cli.flags import (
    add_cache_flags,
    add_model_flags,
    add_sampler_flags,
    add_tokenizer_flag,
    boosted_spec,
    cache_spec_from_args,
    preset_note,
    sampler_from_args,
)
from jaxkv.decode import encode_prompt, sample
from jaxkv.decode.prompt import prompt_text, stop_strings
from jaxkv.errors import INT32_LIMIT, JaxkvError, check_int
from jaxkv.io import load_model


def add_parser(sub) -> None:
    s = sub.add_parser("sample", help="generate text from a model")
    add_model_flags(s)
    s.add_argument(
        "--prompt", default=None, metavar="TEXT", help="prompt text; - reads it from stdin (default: empty, i.e. BOS)"
    )
    s.add_argument(
        "--prompt-file", default=None, metavar="PATH", help="read the prompt from a UTF-8 file (default: --prompt)"
    )
    s.add_argument(
        "--tokens", type=int, default=128, metavar="N", help="tokens to generate at most (default: %(default)s)"
    )
    s.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="STRING",
        help="stop when the text contains STRING, printed without it and what follows; repeatable (default: none)",
    )
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS: generate exactly --tokens tokens")
    add_sampler_flags(
        s,
        seed=None,
        seed_help="PRNG seed in [0, 2**32) (default: a fresh one when sampling, printed in "
        "the report line so that --seed S repeats the run; 0 when greedy)",
    )
    add_tokenizer_flag(s)
    s.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    s.add_argument(
        "--verbose",
        action="store_true",
        help="print the prompt (as the model reads it: chat-templated with --chat) before the generated text, "
        "and a line on stderr with the model, prompt tokens, cache and sampler",
    )
    add_cache_flags(s)
    s.set_defaults(func=run)


def read_prompt(args) -> str:
    """The prompt of ``--prompt TEXT``, ``--prompt -`` (stdin) or ``--prompt-file PATH``.

    One trailing newline of a file or stdin is dropped (as llama.cpp's ``--file`` does).

    Raises:
      JaxkvError: both flags, or a prompt, file or stdin that is not UTF-8 text.
    """
    if args.prompt is not None and args.prompt_file is not None:
        raise JaxkvError(f"--prompt and --prompt-file {args.prompt_file}: give one of the two")
    if args.prompt_file is None and args.prompt != "-":
        prompt = args.prompt or ""
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # bytes of another encoding on the command line (surrogate escapes)
            raise JaxkvError(
                f"--prompt {prompt!r}: not UTF-8 text (at character {e.start}); "
                "give UTF-8, or the file with --prompt-file"
            ) from None
        return prompt
    what = "--prompt - (stdin)" if args.prompt_file is None else f"--prompt-file {args.prompt_file}"
    try:
        if args.prompt_file is None:
            data = sys.stdin.buffer.read()
        else:
            with open(args.prompt_file, "rb") as f:
                data = f.read()
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise JaxkvError(f"{what}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise JaxkvError(f"{what}: cannot read it as UTF-8 text ({e})") from None
    return text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")


def run(args) -> int:
    """``jaxkv sample``: returns the exit code (130 when Ctrl-C stopped decoding, after the report line)."""
    sampler = sampler_from_args(args)  # validate before loading
    check_int("--tokens", args.tokens, 1, INT32_LIMIT)
    stops = stop_strings(args.stop)
    prompt = read_prompt(args)
    model = load_model(args.model, tokenizer=args.tokenizer, weights=args.weights)
    prompt_ids = encode_prompt(model.tokenizer, prompt, chat=args.chat)
    spec = boosted_spec(args, cache_spec_from_args(args, len(prompt_ids), args.tokens), model.config.n_layers)
    preset_note(args, model.config, spec)
    if args.verbose:
        print(
            f"[jaxkv sample: {model.config.name}; prompt {len(prompt_ids)} tokens; cache {spec.describe()}; {sampler}]",
            file=sys.stderr,
            flush=True,
        )
        print(prompt_text(model.tokenizer, prompt, chat=args.chat), end="", flush=True)
    result = sample(
        model,
        prompt_ids,
        max_new_tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        cache=spec,
        stop=stops,
        ignore_eos=args.ignore_eos,
        interruptible=True,
        on_text=lambda piece: print(piece, end="", flush=True),
    )
    print(flush=True)
    print(result.report(), file=sys.stderr, flush=True)
    return 130 if result.finish_reason == "interrupted" else 0
