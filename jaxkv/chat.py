"""Deprecated: moved to :mod:`jaxkv.decode.chat` (the session) and :mod:`jaxkv.cli.chat` (the
REPL). Importing ``jaxkv.chat`` warns and gives the public names it had."""

import warnings

from jaxkv.cli.chat import CHAT_HELP, chat_loop
from jaxkv.cli.chat import run as run_cli
from jaxkv.decode.chat import FILE_FORMAT, ChatSession, ChatStats, default_cache_spec, model_fingerprint

__all__ = ["CHAT_HELP", "FILE_FORMAT", "ChatSession", "ChatStats", "chat_loop", "default_cache_spec",
           "model_fingerprint", "run_cli"]

warnings.warn("jaxkv.chat is deprecated: import jaxkv.decode.chat (ChatSession) or jaxkv.cli.chat (the REPL)",
              DeprecationWarning, stacklevel=2)
