"""Deprecated: moved to :mod:`jaxkv.decode.batch`. Importing ``jaxkv.batch`` warns and gives that module."""

import importlib
import sys
import warnings

warnings.warn("jaxkv.batch is deprecated: import jaxkv.decode.batch instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("jaxkv.decode.batch")
