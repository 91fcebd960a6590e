"""Deprecated: moved to :mod:`jaxkv.decode.chat`. Importing ``jaxkv.chat`` warns and gives that module."""

import importlib
import sys
import warnings

warnings.warn("jaxkv.chat is deprecated: import jaxkv.decode.chat instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("jaxkv.decode.chat")
