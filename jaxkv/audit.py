"""Deprecated: moved to :mod:`jaxkv.eval.audit`. Importing ``jaxkv.audit`` warns and gives that
module; ``python -m jaxkv.audit`` still runs the audit (as ``python -m jaxkv.eval.audit``)."""

import sys
import warnings

import jaxkv.eval.audit

if __name__ == "__main__":
    sys.exit(jaxkv.eval.audit.main())
warnings.warn("jaxkv.audit is deprecated: import jaxkv.eval.audit instead", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = jaxkv.eval.audit
