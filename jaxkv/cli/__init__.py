"""The ``jaxkv`` command line: ``jaxkv sample | chat | ppl | eval | batch | bench | info``.

One module per subcommand (``add_parser`` + ``run``); the flags they share (cache, model,
sampler) in :mod:`jaxkv.cli.flags`. Errors a user can cause print one line,
``jaxkv: error: ...``, and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys

from jaxkv import __version__
from jaxkv.cli import batch, bench, chat, eval, info, ppl, sample
from jaxkv.cli.flags import add_cache_flags, cache_spec_from_args, check_model_flags, error_text
from jaxkv.errors import JaxkvError

__all__ = ["add_cache_flags", "build_parser", "cache_spec_from_args", "main"]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(prog="jaxkv", description="Long-context decoding with a bounded, quantised KV cache.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (sample, chat, ppl, eval, batch, bench, info):
        command.add_parser(sub)
    return parser, sub.choices


def build_parser() -> argparse.ArgumentParser:
    """The ``jaxkv`` argument parser (every subcommand)."""
    return _parsers()[0]


def main(argv: list[str] | None = None) -> int:
    """Run ``jaxkv`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    2 on a :class:`JaxkvError` (one line on stderr) and on bad flags (the subcommand's usage
    and the error, as argparse prints them); 130 on Ctrl-C; else the subcommand's own (0).
    """
    parser, commands = _parsers()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top-level one
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        check_model_flags(args)
        return args.func(args) or 0
    except JaxkvError as e:
        print(f"jaxkv: error: {error_text(e, args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
