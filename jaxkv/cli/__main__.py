"""``python -m jaxkv.cli``: the ``jaxkv`` command."""

import sys

from jaxkv.cli import command

sys.exit(command())
