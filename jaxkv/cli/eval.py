"""``jaxkv eval passkey|lines``: retrieval accuracy through the KV cache, depth x length (:mod:`jaxkv.eval.retrieval`)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

from jaxkv.cli.flags import (
    add_cache_flags,
    add_model_flags,
    add_tokenizer_flag,
    boosted_spec,
    cache_spec_from_args,
    preset_note,
)
from jaxkv.errors import JaxkvError, check_int
from jaxkv.eval.bench import check_outputs
from jaxkv.eval.retrieval import DEPTHS, TASKS, plot_heatmap, retrieval_accuracy
from jaxkv.files import atomic_write
from jaxkv.io import load_model


def add_parser(sub) -> None:
    e = sub.add_parser(
        "eval", help="retrieval accuracy (passkey, lines) through the KV cache, by depth and prompt length"
    )
    e.add_argument(
        "task",
        choices=TASKS,
        help="passkey: a pass key hidden in filler text (Landmark Attention §4.2); "
        "lines: the value of one of many key-value lines (LongChat)",
    )
    add_model_flags(e)
    add_tokenizer_flag(e)
    e.add_argument(
        "--lengths",
        default="512,1024,2048",
        metavar="N1,N2",
        help="prompt lengths in the model's tokens (default: %(default)s)",
    )
    e.add_argument(
        "--depths",
        default=",".join(f"{d:g}" for d in DEPTHS),
        metavar="D1,D2",
        help="where the key sits, fractions of the filler in [0, 1] (default: %(default)s)",
    )
    e.add_argument(
        "--seeds", type=int, default=3, metavar="N", help="prompts per cell, seeds 0..N-1 (default: %(default)s)"
    )
    e.add_argument(
        "--tokens", type=int, default=8, metavar="N", help="greedy tokens generated per prompt (default: %(default)s)"
    )
    e.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt in the model's chat template, the reply "
        "started with the answer's stub (default: the raw text; see docs/RETRIEVAL.md)",
    )
    e.add_argument(
        "--batch-size", type=int, default=8, metavar="B", help="prompts per compiled call (default: %(default)s)"
    )
    e.add_argument(
        "--json", default=None, metavar="FILE", help="write the accuracies and every answer as JSON (default: none)"
    )
    e.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="draw the depth x length heat map, needs matplotlib (default: none)",
    )
    add_cache_flags(e)
    e.set_defaults(func=run)


def _numbers(flag: str, text: str, kind, accepted: Callable, what: str, example: str) -> list:
    """The comma-separated values of ``flag``, each ``kind`` and ``accepted``.

    Raises:
      JaxkvError: ``--depths 0,1.5: expected numbers in [0, 1] separated by commas, e.g. 0,0.5,1``.
    """
    try:
        values = [kind(item) for item in text.split(",")]
    except ValueError:
        values = None
    if values is None or not all(accepted(v) for v in values):
        raise JaxkvError(f"{flag} {text}: expected {what} separated by commas, e.g. {example}")
    return values


def run(args) -> None:
    lengths = _numbers("--lengths", args.lengths, int, lambda n: n >= 1, "integers >= 1", "512,1024")
    depths = _numbers("--depths", args.depths, float, lambda d: 0 <= d <= 1, "numbers in [0, 1]", "0,0.5,1")
    for flag, value in (("--seeds", args.seeds), ("--tokens", args.tokens), ("--batch-size", args.batch_size)):
        check_int(flag, value, 1)
    if args.max_len is not None:
        raise JaxkvError(f"--max-len {args.max_len}: jaxkv eval sizes a full cache for each length; leave it out")
    boosted_spec(args, cache_spec_from_args(args, max(lengths), args.tokens))  # validate the cache flags before loading
    check_outputs(args.json, args.plot)

    model = load_model(args.model, tokenizer=args.tokenizer, weights=args.weights)
    n_layers = model.config.n_layers
    preset_note(args, model.config, boosted_spec(args, cache_spec_from_args(args, max(lengths), args.tokens), n_layers))
    # a full cache is sized per length (its longest prompt + --tokens), a bounded one is the same at every length
    spec = (
        (lambda need: boosted_spec(args, cache_spec_from_args(args, need), n_layers))
        if args.streaming_llm_window is None
        else boosted_spec(args, cache_spec_from_args(args), n_layers)
    )
    result = retrieval_accuracy(
        model,
        spec,
        args.task,
        lengths,
        depths,
        args.seeds,
        max_new_tokens=args.tokens,
        chat=args.chat,
        batch=args.batch_size,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    name = os.path.basename(model.path or result.model)
    print(
        f"{name}: {args.task} accuracy by depth (rows) and prompt length in tokens (columns), {len(result.seeds)} "
        f"seed(s) per cell, {'chat template' if result.chat else 'raw prompt'}; cache {result.cache[-1]} "
        f"({result.cache_bytes[-1] / 2**20:.1f} MiB per row at the longest); {result.seconds:.0f} s"
    )
    print(result.table())
    if args.json:
        try:
            atomic_write(args.json, json.dumps(result.to_json(), indent=1).encode(), private=False)
        except OSError as e:
            raise JaxkvError(f"--json {args.json}: cannot write it ({e})") from None
    if args.plot:
        plot_heatmap(result, args.plot)
