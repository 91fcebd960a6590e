"""Errors raised by jaxkv.

Every error a user can cause (bad flags, bad files, a prompt that does not fit) is a
:class:`JaxkvError`, a ``ValueError`` subclass whose message names the bad value and
what would be accepted. The CLI prints it on one line and exits with code 2. A refused cache
spec (or a cache too large for the machine) is a :class:`CacheSpecError`, whose fields the
CLI shows as its flags.
"""

import numbers


class JaxkvError(ValueError):
    """Bad input to jaxkv: the message names the value and what would be accepted."""


class ModelFileError(JaxkvError):
    """A model or tokenizer file is missing, truncated, corrupt or of an unsupported kind."""


class CacheFullError(JaxkvError):
    """A full (unbounded) KV cache would exceed its ``max_len`` slots."""


INT32_LIMIT = 2**31
"""Positions, slots, lengths and token counts are int32 (DESIGN §1): sizes must stay below this."""


def int_problem(value, minimum: int, maximum: int | None = None) -> str | None:
    """What is wrong with ``value`` as an integer (not a bool) in ``[minimum, maximum)``, or None.

    E.g. ``"expected an integer >= 1"``; the text :func:`check_int` puts after the value.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < minimum
        or (maximum is not None and value >= maximum)
    ):
        return (
            f"expected an integer in [{minimum}, {maximum})"
            if maximum is not None
            else f"expected an integer >= {minimum}"
        )
    return None


def check_int(name: str, value, minimum: int, maximum: int | None = None, *, spaced: bool | None = None) -> int:
    """``value`` as an int, checked to be an integer (not a bool) in ``[minimum, maximum)``.

    Args:
      name: what to call the value in the message: an argument (``max_new_tokens``, shown as
        ``max_new_tokens=0``) or a flag (``--tokens``, shown as ``--tokens 0``).
      spaced: show ``name value`` (True) or ``name=value`` (False); None = spaced for a flag.
    Raises:
      JaxkvError: naming the value and the accepted range.
    """
    problem = int_problem(value, minimum, maximum)
    if problem is not None:
        spaced = name.startswith("-") if spaced is None else spaced
        shown = f"{name} {value!r}" if spaced else f"{name}={value!r}"
        raise JaxkvError(f"{shown}: {problem}")
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
    raise error(
        f"{name} holds {bad:,} non-finite value{'s' if bad > 1 else ''} (NaN or infinity) of {finite.size:,}, "
        f"the first at index {first}"
    )


class CacheSpecError(JaxkvError):
    """A cache spec, or a cache of it, refused; the fields the message names are kept apart
    from its text, so a caller can show them in its own terms: ``str(error)`` shows them as
    the Python API names them (``CacheSpec.window=252``), the command line as its flags
    (``--streaming-llm-window 252``, see :meth:`render`).

    Attributes:
      template: the message: ``{f}`` is field ``f`` with its value, ``{f:name}`` its name alone,
        ``{f:=V}`` the field set to ``V`` (a suggested value).
      values: field -> value, for every field the template names.
      prefix: what the Python rendering starts with (``"CacheSpec."`` before a field).
    """

    def __init__(self, template: str, values: dict, *, prefix: str = "CacheSpec."):
        self.template, self.values, self.prefix = template, dict(values), prefix
        super().__init__(self.render())

    def render(self, names: "FieldNames | None" = None) -> str:
        """The message with its fields shown by ``names`` (None: :class:`FieldNames`, with the prefix)."""
        shown = FieldNames() if names is None else names

        class Field:
            def __init__(self, field, value):
                self.field, self.value = field, value

            def __format__(self, spec):
                if spec == "name":
                    return shown.name(self.field)
                if spec.startswith("="):
                    return shown.show(self.field, spec[1:], suggested=True)
                return shown.show(self.field, self.value)

        body = self.template.format_map({f: Field(f, v) for f, v in self.values.items()})
        return self.prefix + body if names is None else body


class FieldNames:
    """How a :class:`CacheSpecError` shows a field: as the Python API names it (``window=252``).
    The command line subclasses it to show its flags."""

    def name(self, field: str) -> str:
        return field

    def show(self, field: str, value, *, suggested: bool = False) -> str:
        """``field`` with ``value`` (a suggested value is shown as written, not as a repr)."""
        return f"{field}={value}" if suggested else f"{field}={value!r}"
