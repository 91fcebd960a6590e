"""Deprecated: moved to :mod:`jaxkv.decode.parallel`. Importing ``jaxkv.parallel`` warns and gives that module."""

import importlib
import sys
import warnings

warnings.warn("jaxkv.parallel is deprecated: import jaxkv.decode.parallel instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("jaxkv.decode.parallel")
