"""Errors raised by jaxkv.

Every error a user can cause (bad flags, bad files, a prompt that does not fit) is a
:class:`JaxkvError`, a ``ValueError`` subclass whose message names the bad value and
what would be accepted. The CLI prints it on one line and exits with code 2.
"""


class JaxkvError(ValueError):
    """Bad input to jaxkv: the message names the value and what would be accepted."""


class ModelFileError(JaxkvError):
    """A model or tokenizer file is missing, truncated, corrupt or of an unsupported kind."""


class CacheFullError(JaxkvError):
    """A full (unbounded) KV cache would exceed its ``max_len`` slots."""
