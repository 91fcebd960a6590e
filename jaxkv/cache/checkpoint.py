"""Save and load a KV cache: one ``safetensors`` file, atomic, checksummed, every field checked.

The file holds every leaf of the cache pytree (a :class:`KVCache` or a per-layer
:class:`jaxkv.cache.layered.LayeredCache`), named by its path in the pytree
(``jax.tree_util.tree_flatten_with_path``: ``cache.ring_k``, ``cache.quant.k_codes``, ...),
so any cache layout saves and loads without a list of leaf names here; the caller's extra
arrays (e.g. a conversation's token ids) under their own names; and string metadata: the
file ``format``, the cache ``spec`` (JSON of :class:`CacheSpec` or :class:`LayerSpecs`), the caller's entries, and a
``checksum``: SHA-256 over every metadata entry and every array (name, dtype, shape, bytes).

bfloat16 leaves (no ``safetensors.numpy`` dtype) are stored as their uint16 bit patterns and
restored from the template's dtype. Writes go through :func:`jaxkv.files.atomic_write`
(a temporary file, ``fsync``, ``os.replace``; mode 0600). :func:`load_cache` refuses a missing,
truncated or corrupt file, one of another format, and a cache whose arrays do not match the
template (names, dtypes, shapes) with a :class:`JaxkvError` naming the file.

``jaxkv.ChatSession`` files (``jaxkv-chat/2``) are written and read with these two functions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.kv import KVCache
from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.errors import JaxkvError
from jaxkv.files import atomic_write

FILE_FORMAT = "jaxkv-cache/1"
_RESERVED = ("format", "spec", "checksum")
_LATER_SPEC_FIELDS = ("attention_window",)
"""CacheSpec fields added after the format was defined: written only when set, so a cache
that does not use them is saved byte for byte as before."""


def _spec_fields(spec) -> dict:
    """The JSON fields of a :class:`CacheSpec` (or :class:`LayerSpecs`: ``{"specs": [...]}``)."""
    if isinstance(spec, LayerSpecs):
        return {"specs": [_spec_fields(s) for s in spec.specs]}
    return {k: v for k, v in dataclasses.asdict(spec).items() if not (k in _LATER_SPEC_FIELDS and v is None)}


def named_leaves(cache) -> list[tuple[str, jax.Array]]:
    """``[(name, leaf)]`` of a cache pytree in flattening order, names like ``cache.ring_k``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(cache)
    return [("cache" + jax.tree_util.keystr(p), leaf) for p, leaf in flat]


def save_cache(
    path: str | os.PathLike,
    cache: KVCache,
    metadata: dict[str, str] | None = None,
    *,
    arrays: dict[str, np.ndarray] | None = None,
    file_format: str = FILE_FORMAT,
) -> None:
    """Write ``cache`` (and the caller's ``arrays`` and string ``metadata``) to ``path``, atomically.

    Args:
      path: the file (``.safetensors``); an interrupted save leaves the old file.
      cache: the cache pytree (any layout; leaves are fetched to the host).
      metadata: string entries stored as given (not ``format``, ``spec`` or ``checksum``).
      arrays: extra NumPy arrays, by name (names must not start with ``cache``).
      file_format: the ``format`` entry a reader checks (e.g. ``jaxkv-chat/2``).
    Raises:
      JaxkvError: a reserved metadata key, a non-string value or a clashing array name;
      OSError: the directory is not writable (nothing is left behind).
    """
    import safetensors.numpy

    metadata = dict(metadata or {})
    arrays = dict(arrays or {})
    bad = [k for k in metadata if k in _RESERVED or not isinstance(metadata[k], str)]
    bad += [k for k in arrays if k.startswith("cache")]
    if bad:
        raise JaxkvError(f"save_cache: entries {bad} are reserved, not strings, or clash with the cache's arrays")
    tensors = {name: _storable(np.asarray(leaf)) for name, leaf in named_leaves(cache)}
    tensors.update({name: np.ascontiguousarray(a) for name, a in arrays.items()})
    metadata = {"format": file_format, "spec": json.dumps(_spec_fields(cache.spec), sort_keys=True), **metadata}
    metadata["checksum"] = _checksum(tensors, metadata)
    atomic_write(path, safetensors.numpy.save(tensors, metadata=metadata))


def load_cache(
    path: str | os.PathLike,
    like: KVCache | Callable[[CacheSpec, dict], KVCache],
    *,
    file_format: str = FILE_FORMAT,
    what: str = "jaxkv cache",
) -> tuple[KVCache, dict[str, np.ndarray], dict[str, str]]:
    """Read a file written by :func:`save_cache` into a cache shaped like ``like``.

    Args:
      path: the file.
      like: an empty cache of the expected spec and shapes (its values are not used), or a
        function ``(spec, metadata) -> such a cache`` called with the file's spec and metadata
        (once both passed the checksum), which may refuse them by raising.
      file_format: the ``format`` entry expected. what: how messages name the file (``jaxkv chat cache``).
    Returns:
      ``(cache, arrays, metadata)``: the restored cache (device arrays, in ``like``'s tree
      structure), the caller's extra arrays and string metadata (``format``, ``spec`` and
      ``checksum`` included).
    Raises:
      JaxkvError: a missing, unreadable, truncated or corrupt file (checksum), another format,
      a spec other than ``like``'s, or arrays whose names, dtypes or shapes differ from ``like``'s.
    """
    path = os.fspath(path)
    tensors, meta = _read(path, file_format, what)
    try:
        fields = json.loads(meta["spec"])
        if "specs" in fields:  # LayerSpecs: one CacheSpec per layer
            spec = LayerSpecs(tuple(CacheSpec(**f) for f in fields["specs"]))
        else:
            spec = CacheSpec(**fields)
    except (KeyError, TypeError, ValueError) as e:
        raise JaxkvError(f"{path}: corrupt {what} file (spec: {e})") from None
    if callable(like) and not isinstance(like, KVCache):
        like = like(spec, meta)
    elif like.spec != spec:
        raise JaxkvError(f"{path} holds a cache for another cache spec ({spec.describe()}), not {like.spec.describe()}")
    named = named_leaves(like)
    cache_names = {n for n, _ in named}
    missing = cache_names - set(tensors)
    extra = {n for n in tensors if n.startswith("cache")} - cache_names
    if missing or extra:
        raise JaxkvError(f"{path}: corrupt {what} file (arrays {sorted(missing | extra)} do not match the spec)")
    leaves = []
    for name, template in named:
        arr = _restore(tensors[name], template.dtype)
        if arr is None or arr.shape != template.shape:
            raise JaxkvError(
                f"{path}: corrupt {what} file ({name} is {tensors[name].dtype}{list(tensors[name].shape)}, "
                f"expected {template.dtype}{list(template.shape)})"
            )
        leaves.append(jnp.asarray(arr))
    cache = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)
    return cache, {n: a for n, a in tensors.items() if n not in cache_names}, meta


def _storable(a: np.ndarray) -> np.ndarray:
    """bfloat16 has no safetensors.numpy dtype: store its bits as uint16 (restored from the template's dtype)."""
    if a.dtype.name == "bfloat16":
        a = a.view(np.uint16)
    return np.ascontiguousarray(a)


def _restore(a: np.ndarray, dtype) -> np.ndarray | None:
    dtype = np.dtype(dtype)
    if a.dtype == dtype:
        return a
    if dtype.name == "bfloat16" and a.dtype == np.uint16:
        return a.view(dtype)
    return None


def _checksum(tensors: dict, metadata: dict) -> str:
    h = hashlib.sha256()
    for key in sorted(metadata):
        if key != "checksum":
            h.update(f"{key}={metadata[key]}\0".encode())
    for name in sorted(tensors):
        a = tensors[name]
        h.update(f"{name}:{a.dtype.str}:{a.shape}\0".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _read(path: str, file_format: str, what: str) -> tuple[dict, dict]:
    """Tensors and string metadata of a file, checked against its format and checksum."""
    import safetensors.numpy

    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        raise JaxkvError(f"{path}: no such {what.removeprefix('jaxkv ')} file") from None
    except OSError as e:
        raise JaxkvError(f"{path}: cannot read the {what.removeprefix('jaxkv ')} file: {e.strerror or e}") from None
    bad = f"{path}: not a {what} file, or a truncated/corrupt one"
    if len(blob) < 8:
        raise JaxkvError(f"{bad} ({len(blob)} bytes)")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise JaxkvError(f"{bad} (its header says {n} bytes, the file has {len(blob) - 8} after the length)")
    try:
        header = json.loads(blob[8 : 8 + n])
        meta = header.get("__metadata__") or {}
    except (ValueError, AttributeError) as e:
        raise JaxkvError(f"{bad} (header: {e})") from None
    if meta.get("format") != file_format:
        raise JaxkvError(f"{bad} (format {meta.get('format')!r}, expected {file_format!r})")
    try:
        tensors = safetensors.numpy.load(blob)
    except Exception as e:  # safetensors raises its own SafetensorError for truncated data
        raise JaxkvError(f"{bad} ({e})") from None
    if meta.get("checksum") != _checksum(tensors, meta):
        raise JaxkvError(f"{bad} (checksum mismatch: the data were changed or cut)")
    return tensors, meta
