"""Named low-bit KV cache presets: the storage measured best within a bit budget, kept as data.

A preset is a JSON file ``configs/kv-presets/NAME.json`` of the repository: ``{"about": "...",
"storage": {CacheSpec storage fields}, "full_cache_sinks": S}``. It gives the cache's *storage*
(precision of keys and values, group size, residual, scales, rotation, codebook, clipping), and the
first S tokens a *full* cache keeps apart in full precision (IntactKV; in a full cache sinks are a
matter of precision, not of what is kept); the cache's *shape* (a full cache's ``max_len``, or
StreamingLLM's ``sink`` and ``window``) and RoPE ``positions`` come from the caller. How each preset was chosen, and what it measured, is docs/QUANTIZATION.md's "Presets".

Sources: KIVI (Liu et al. 2024, arXiv 2402.02750, §3-4), KVQuant (Hooper et al. 2024, arXiv
2401.18079: pre-RoPE keys §3.1, non-uniform levels §3.4), QuaRot (arXiv 2404.00456: Hadamard).
"""

from __future__ import annotations

import json
import pathlib

from jaxkv.cache.spec import CacheSpec
from jaxkv.errors import JaxkvError

PRESET_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs" / "kv-presets"
"""The folder of the preset files (``configs/kv-presets`` of the repository)."""

STORAGE_FIELDS = (
    "kv_quantize",
    "k_quantize",
    "v_quantize",
    "group_size",
    "residual",
    "residual_dtype",
    "scale_dtype",
    "pre_rope_keys",
    "hadamard",
    "codebook",
    "clip",
)
"""The :class:`CacheSpec` fields a preset may set."""


def preset_names() -> list[str]:
    """The presets there are, sorted (``["2bit", "3bit", "4bit"]``)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.json")) if PRESET_DIR.is_dir() else []


def _preset(name: str) -> tuple[dict, int]:
    """``(storage fields, full-cache sinks)`` of preset ``name``, checked."""
    path = PRESET_DIR / f"{name}.json"
    if not isinstance(name, str) or "/" in name or not path.is_file():
        raise JaxkvError(f"no KV cache preset {name!r}: expected one of {', '.join(preset_names()) or '(none found)'}")
    try:
        data = json.loads(path.read_text())
        storage, sinks = dict(data["storage"]), int(data["full_cache_sinks"])
    except (ValueError, KeyError, TypeError) as e:
        raise JaxkvError(
            f"{path}: not a KV cache preset ({e!r}): expected {{'about': ..., 'storage': {{...}}, 'full_cache_sinks': S}}"
        ) from None
    unknown = sorted(set(storage) - set(STORAGE_FIELDS))
    if unknown:
        raise JaxkvError(f"{path}: {', '.join(unknown)} are not storage fields: expected {', '.join(STORAGE_FIELDS)}")
    return storage, sinks


def preset_storage(name: str) -> dict:
    """The storage fields of preset ``name`` (``{"kv_quantize": "int2", ...}``).

    Raises:
      JaxkvError: an unknown name (the message lists the presets), or a file that is not a preset
        (bad JSON, a field outside :data:`STORAGE_FIELDS`).
    """
    return _preset(name)[0]


def preset_full_cache_sinks(name: str) -> int:
    """The first tokens a full cache of preset ``name`` keeps in full precision unless told otherwise.

    Raises:
      JaxkvError: as :func:`preset_storage`.
    """
    return _preset(name)[1]


def cache_preset(name: str, **overrides) -> CacheSpec:
    """The :class:`CacheSpec` of preset ``name`` (``"4bit"``, ``"3bit"``, ``"2bit"``) for a cache
    shape, e.g. ``cache_preset("4bit", max_len=4096)`` (a full cache) or ``cache_preset("3bit",
    sink=4, window=992)`` (StreamingLLM; the window a multiple of the preset's group size); a full
    cache keeps :func:`preset_full_cache_sinks` first tokens in full precision unless ``sink`` is given. Its
    effective bits per K/V element for a model: :func:`jaxkv.memory_report` of a cache made from
    it, or ``jaxkv.decode.loop.new_cache_bits(config, spec)``.

    Args:
      name: a preset of :func:`preset_names`.
      overrides: :class:`CacheSpec` fields: the shape (``max_len``, or ``window`` and ``sink``),
        ``positions``, a keep tier, or any storage field to change.

    Raises:
      JaxkvError: an unknown preset, no shape (neither ``max_len`` nor ``window``); anything
        :class:`CacheSpec` refuses (e.g. a window that is not a multiple of the group size, or
        ``positions="cache"`` with a preset that rotates keys stored after RoPE).
    """
    storage, sinks = _preset(name)
    if overrides.get("max_len") is None and overrides.get("window") is None:
        raise JaxkvError(
            f"cache_preset({name!r}) needs the cache's shape: max_len=N for a full cache, or window=W "
            "(and sink=S) for a StreamingLLM cache"
        )
    if overrides.get("window") is None:
        overrides.setdefault("sink", sinks)
    return CacheSpec(**{**storage, **overrides})
