"""``jaxkv batch``: decode a JSONL file of prompts in ragged batches (:mod:`jaxkv.decode.batch`)."""

from __future__ import annotations

import os
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
from jaxkv.decode import parallel
from jaxkv.decode.batch import run_file
from jaxkv.errors import JaxkvError, check_int
from jaxkv.files import check_writable
from jaxkv.io import load_model


def add_parser(sub) -> None:
    b = sub.add_parser("batch", help="decode a JSONL file of prompts in ragged batches, results in input order")
    add_model_flags(b)
    b.add_argument(
        "--input",
        required=True,
        metavar="JSONL",
        help='one {"prompt": ..., "max_new_tokens"?, "temperature"?, "seed"?, "id"?} per line',
    )
    b.add_argument("--output", required=True, metavar="JSONL", help="results in input order (written atomically)")
    b.add_argument(
        "--batch-size", type=int, default=8, metavar="B", help="rows per compiled call (default: %(default)s)"
    )
    b.add_argument(
        "--tokens",
        type=int,
        default=128,
        metavar="N",
        help="tokens per row at most, unless the row sets max_new_tokens (default: %(default)s)",
    )
    add_sampler_flags(
        b,
        temperature_help="for rows without one; 0 = greedy (default: %(default)s)",
        seed_help="rows without a seed use seed + their index, mod 2**32 (default: %(default)s)",
    )
    b.add_argument(
        "--block", type=int, default=32, metavar="N", help="decode steps per compiled call (default: %(default)s)"
    )
    b.add_argument(
        "--shard",
        default=None,
        metavar="data|data,kv",
        help="shard over all devices: the batch axis (data), or also the KV heads (data,kv) (default: none, one device)",
    )
    add_tokenizer_flag(b)
    b.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    b.add_argument(
        "--ignore-eos", action="store_true", help="do not stop a row at EOS (benchmarks: every row runs its budget)"
    )
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument(
        "--distributed",
        action="store_true",
        help="one process per host: jax.distributed.initialize() (cluster auto-detected)",
    )
    b.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="process 0's address (implies --distributed) (default: auto-detected)",
    )
    b.add_argument(
        "--num-processes",
        type=int,
        default=None,
        metavar="N",
        help="processes in the run (implies --distributed) (default: auto-detected)",
    )
    b.add_argument(
        "--process-id",
        type=int,
        default=None,
        metavar="I",
        help="this process, 0..N-1 (implies --distributed) (default: auto-detected)",
    )
    add_cache_flags(b)
    b.set_defaults(func=run)


def run(args) -> None:
    sampler_from_args(args, warn_greedy=False)  # validate (--seed too) before loading; rows may set a temperature
    for flag, value in (("--tokens", args.tokens), ("--batch-size", args.batch_size), ("--block", args.block)):
        check_int(flag, value, 1)
    if args.shard is not None and args.shard not in parallel.SHARD_MODES:
        raise JaxkvError(f"--shard {args.shard!r}: expected one of {', '.join(parallel.SHARD_MODES)}")
    fixed = boosted_spec(args, cache_spec_from_args(args, 1))  # validates the cache flags
    if not os.path.isfile(args.input):
        raise JaxkvError(f"{args.input}: no such input file")
    check_writable(args.output, "--output", not_same_as=args.input)  # before the model loads, not after the work
    if args.distributed or args.coordinator or args.num_processes is not None or args.process_id is not None:
        parallel.initialize_distributed(args.coordinator, args.num_processes, args.process_id)
    model = load_model(args.model, tokenizer=args.tokenizer, weights=args.weights)
    n_layers = model.config.n_layers
    fixed = boosted_spec(args, fixed, n_layers)
    preset_note(args, model.config, fixed)
    # a full cache without --max-len is sized per batch (the largest prompt + budget of its rows, rounded up)
    cache = (
        (lambda need: boosted_spec(args, cache_spec_from_args(args, need), n_layers))
        if args.streaming_llm_window is None and args.max_len is None
        else fixed
    )
    mesh = parallel.mesh_for(model.config.n_kv_heads, args.shard) if args.shard else None
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if parallel.is_lead() else (lambda msg: None)
    say(
        f"[jaxkv batch: {model.config.name}; cache {fixed.describe() if cache is fixed else 'full, sized per batch'}; "
        f"batch size {args.batch_size}; {parallel.describe(mesh)}]"
    )
    results, errors, stats = run_file(
        model,
        args.input,
        args.output,
        batch_size=args.batch_size,
        cache=cache,
        max_new_tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        block=args.block,
        mesh=mesh,
        progress=not args.no_progress,
        chat=args.chat,
        **({"eos_id": None} if args.ignore_eos else {}),
    )
    say(
        f"[wrote {len(results)} results to {args.output}; {len(errors)} line{'' if len(errors) == 1 else 's'} skipped; {stats.summary()}]"
    )
