"""Deprecated: moved to :mod:`jaxkv.eval.bench`. Importing ``jaxkv.bench`` warns and gives that module."""

import importlib
import sys
import warnings

warnings.warn("jaxkv.bench is deprecated: import jaxkv.eval.bench instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = importlib.import_module("jaxkv.eval.bench")
