"""The ``jaxkv`` command line: ``jaxkv sample | chat | ppl | batch | bench | info``.

One module per subcommand (``add_parser`` + ``run``); the flags they share (cache, model,
sampler) in :mod:`jaxkv.cli.flags`. Errors a user can cause print one line,
``jaxkv: error: ...``, and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys

from jaxkv.cli import batch, bench, chat, info, ppl, sample
from jaxkv.cli.flags import add_cache_flags, cache_spec_from_args, error_text
from jaxkv.errors import JaxkvError

__all__ = ["add_cache_flags", "build_parser", "cache_spec_from_args", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``jaxkv`` argument parser (every subcommand)."""
    parser = argparse.ArgumentParser(prog="jaxkv", description="Long-context decoding with a bounded, quantised KV cache.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (sample, chat, ppl, batch, bench, info):
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``jaxkv`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code (2 on a :class:`JaxkvError`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except JaxkvError as e:
        print(f"jaxkv: error: {error_text(e, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
