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


def check_int(name: str, value, minimum: int, maximum: int | None = None, *, spaced: bool | None = None) -> int:
    """``value`` as an int, checked to be an integer (not a bool) in ``[minimum, maximum)``.

    Args:
      name: what to call the value in the message: an argument (``max_new_tokens``, shown as
        ``max_new_tokens=0``) or a flag (``--tokens``, shown as ``--tokens 0``).
      spaced: show ``name value`` (True) or ``name=value`` (False); None = spaced for a flag.
    Raises:
      JaxkvError: naming the value and the accepted range.
    """
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum or (
        maximum is not None and value >= maximum
    ):
        spaced = name.startswith("-") if spaced is None else spaced
        shown = f"{name} {value!r}" if spaced else f"{name}={value!r}"
        bound = f"in [{minimum}, {maximum})" if maximum is not None else f">= {minimum}"
        raise JaxkvError(f"{shown}: expected an integer {bound}")
    return int(value)


def check_finite(name: str, values, error: type[JaxkvError] = JaxkvError) -> None:
    """Refuse an array holding a NaN or an infinity (a weight, a cached key or value).

    Args:
      name: what to call the array in the message (``model.gguf: tensor 'blk.3.attn_q.weight'``).
      values: a float array (NumPy, or anything ``np.isfinite`` takes).
      error: the error class to raise (e.g. :class:`ModelFileError`).
    Raises:
      error: ``NAME holds N non-finite values (NaN or infinity) of M, the first at index [i, j]``.
    """
    import numpy as np

    finite = np.isfinite(values)
    if finite.all():
        return
    bad = finite.size - np.count_nonzero(finite)
    first = [int(i) for i in np.unravel_index(np.argmin(finite), finite.shape)]
    raise error(f"{name} holds {bad:,} non-finite value{'s' if bad > 1 else ''} (NaN or infinity) of {finite.size:,}, "
                f"the first at index {first}")
