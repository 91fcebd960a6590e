"""``python -m jaxkv.cli``: the ``jaxkv`` command."""

import sys

from jaxkv.cli import main

sys.exit(main())
