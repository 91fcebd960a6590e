"""Deprecated: moved to :mod:`jaxkv.decode`. Importing ``jaxkv.sampling`` warns and gives that module."""

import importlib
import sys
import warnings

warnings.warn("jaxkv.sampling is deprecated: import jaxkv.decode instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("jaxkv.decode")
