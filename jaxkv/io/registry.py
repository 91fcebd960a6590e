"""The architecture registry: the architecture names of checkpoint files -> model families.

A family (:class:`jaxkv.models.family.Family`, one module of :mod:`jaxkv.models`) declares
the names that select it per format: Hugging Face ``config.json`` ``architectures`` (or,
absent that, ``model_type``) and GGUF ``general.architecture``. llama2.c files name no
architecture: they are Llama by definition. To add a family, write its module and add its
``FAMILY`` to :data:`FAMILIES`.
"""

from __future__ import annotations

from jaxkv.errors import JaxkvError
from jaxkv.models import gemma, llama, phi3, qwen
from jaxkv.models.family import Family

FAMILIES: dict[str, Family] = {
    family.name: family for family in (llama.FAMILY, qwen.QWEN2, qwen.QWEN3, gemma.GEMMA2, gemma.GEMMA3, phi3.PHI3)
}
"""Every registered family, by name."""

LLAMA2C: Family = FAMILIES["llama"]
"""The family of llama2.c checkpoints (the format holds no architecture name)."""

DEFAULT: Family = FAMILIES["llama"]
"""The family assumed for a model of no registered family (your own Flax model,
docs/custom_models.md) where one is needed: e.g. its weights named like Llama's are split
for tensor parallelism, the others replicated."""

_BY_CONFIG = {}
for _family in FAMILIES.values():  # families that share a config class (variants of one decoder) share its model
    _BY_CONFIG.setdefault(_family.config, _family)
    if (_family.model, dict(_family.head_axes), dict(_family.mlp_axes)) != (
        _BY_CONFIG[_family.config].model,
        dict(_BY_CONFIG[_family.config].head_axes),
        dict(_BY_CONFIG[_family.config].mlp_axes),
    ):
        raise RuntimeError(
            f"families {_family.name} and {_BY_CONFIG[_family.config].name} share a config class but not its model"
        )


def _supported(kind: str) -> list[str]:
    return [
        arch for family in FAMILIES.values() if getattr(family, kind) for arch in getattr(family, kind).architectures
    ]


def family_for_hf(config: dict) -> Family:
    """The family of a Hugging Face ``config.json`` (a plain dict): by its first
    ``architectures`` entry, else by its ``model_type``.

    Raises:
      JaxkvError: an architecture no family registers (named, with the supported ones).
    """
    archs = config.get("architectures") or []
    model_type = config.get("model_type")
    for family in FAMILIES.values():
        if family.hf and (archs[0] in family.hf.architectures if archs else model_type in family.hf.model_types):
            return family
    found = ", ".join(map(str, archs)) if archs else f"model_type {model_type!r}"
    raise JaxkvError(f"architecture {found} is not supported: expected one of {', '.join(_supported('hf'))}")


def family_for_gguf(architecture) -> Family:
    """The family of a GGUF file's ``general.architecture`` value (e.g. ``"llama"``).

    Raises:
      JaxkvError: an architecture no family registers (named, with the supported ones).
    """
    for family in FAMILIES.values():
        if family.gguf and architecture in family.gguf.architectures:
            return family
    raise JaxkvError(
        f"GGUF architecture {architecture!r} is not supported: expected one of {', '.join(map(repr, _supported('gguf')))}"
    )


def family_of(config, *, default: Family | None = None) -> Family:
    """The family ``config`` was loaded as (its ``family`` field, e.g. ``"gemma2"``), else the
    family whose config class it is an instance of (exactly), else ``default``.

    Raises:
      JaxkvError: a config of no registered family (named, with the registered ones) and no ``default``.
    """
    family = FAMILIES.get(getattr(config, "family", None))
    if family is None or type(config) is not family.config:
        family = _BY_CONFIG.get(type(config), default)
    if family is None:
        known = ", ".join(c.__name__ for c in _BY_CONFIG)
        raise JaxkvError(f"config {type(config).__name__} is of no registered model family: expected one of {known}")
    return family
