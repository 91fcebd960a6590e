"""The ``jaxkv`` command line: ``jaxkv sample | chat | serve | ppl | eval | batch | bench | info``.

One module per subcommand (``add_parser`` + ``run``); the flags they share (cache, model,
sampler) in :mod:`jaxkv.cli.flags`. Errors a user can cause print one line,
``jaxkv: error: ...``, and exit with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxkv import __version__
from jaxkv.cli import batch, bench, chat, eval, info, ppl, sample, serve
from jaxkv.cli.flags import add_cache_flags, cache_spec_from_args, check_model_flags, error_text
from jaxkv.errors import JaxkvError

__all__ = ["add_cache_flags", "build_parser", "cache_spec_from_args", "command", "main", "use_compile_cache"]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="jaxkv", description="Long-context decoding with a bounded, quantised KV cache."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (sample, chat, serve, ppl, eval, batch, bench, info):
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


def use_compile_cache(environ=os.environ) -> str | None:
    """Turn on JAX's persistent compilation cache for this process; returns its folder (None: off).

    Where: ``$JAXKV_COMPILE_CACHE`` (``off`` turns it off), else ``$XDG_CACHE_HOME/jaxkv/xla``
    (``~/.cache/jaxkv/xla``). A folder already set for JAX (``JAX_COMPILATION_CACHE_DIR`` or
    ``jax.config``) is kept as it is. Every program is cached, however fast it compiled, unless
    ``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` says otherwise. A second run of the same
    model and cache then loads its executables instead of compiling them (docs/PERFORMANCE.md);
    its decode loop and prefill chunk without even tracing them: they are kept in the folder's
    ``jaxkv-executables`` (:data:`jaxkv.decode.loop.EXECUTABLE_STORE`).

    Off on jax < 0.6: jax 0.5.0's CPU executables reloaded from the cache decoded garbage
    (a resumed chat printed only ``<unk>``; see tests/test_chat.py).
    """
    import jax

    from jaxkv.decode import loop

    where = jax.config.jax_compilation_cache_dir
    if not where:
        where = environ.get("JAXKV_COMPILE_CACHE")
        if where == "off" or jax.__version_info__ < (0, 6):
            return None
        if not where:
            where = os.path.join(environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxkv", "xla")
        jax.config.update("jax_compilation_cache_dir", where)
        if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in environ:
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if jax.__version_info__ >= (0, 6):
        loop.EXECUTABLE_STORE = os.path.join(where, "jaxkv-executables")
    return where


def command() -> int:
    """The ``jaxkv`` console command: :func:`main` with the persistent compilation cache on (:func:`use_compile_cache`)."""
    use_compile_cache()
    return main()
