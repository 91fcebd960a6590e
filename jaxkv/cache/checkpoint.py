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
truncated or corrupt file, one of another format, a cache whose arrays do not match the
template (names, dtypes, shapes), and one whose contents no cache can hold (a negative
length, a position outside its row's stream, a sink holding a later token, a token stored
twice, a NaN or an infinity) with a :class:`JaxkvError` naming the file and the field.

Live prefixes (``prefix_format``): a cache holds few tokens early on (a short chat fills 78
of its 1,024 slots), and its empty slots hold what an empty cache holds (-1 positions, zero
keys, unit scales). With a ``prefix_format``, a leaf whose trailing slots along one axis all
hold that value is stored as its prefix, and the metadata entry ``prefixes`` gives, per such
leaf, the axis and the value's bit pattern: the file grows with the tokens held, and the
cache read back is bit for bit the one saved. A file with no leaf so stored keeps
``file_format`` and holds the same arrays and metadata as the whole layout.

``jaxkv.ChatSession`` files (``jaxkv-chat/2``, and ``jaxkv-chat/3`` with prefixes) are
written and read with these two functions.
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
from jaxkv.cache.layered import LayeredCache
from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.cache.storage import Storage
from jaxkv.errors import JaxkvError, check_finite
from jaxkv.files import atomic_write

FILE_FORMAT = "jaxkv-cache/1"
_RESERVED = ("format", "spec", "checksum", "prefixes")
_LATER_SPEC_FIELDS = (
    "attention_window",
    "k_quantize",
    "v_quantize",
    "residual_dtype",
    "pre_rope_keys",
    "hadamard",
    "keep",
    "keep_score",
    "keep_quantize",
    "codebook",
    "clip",
)
"""CacheSpec fields added after the format was defined: written only when not their default,
so a cache that does not use them is saved byte for byte as before (``pre_rope_keys`` also not
when ``positions="cache"`` implies it)."""


def _spec_fields(spec) -> dict:
    """The JSON fields of a :class:`CacheSpec` (or :class:`LayerSpecs`: ``{"specs": [...]}``)."""
    if isinstance(spec, LayerSpecs):
        return {"specs": [_spec_fields(s) for s in spec.specs]}
    defaults = {f.name: f.default for f in dataclasses.fields(CacheSpec)}
    if spec.policy.rope_at_rank:  # keys at their rank are always stored before RoPE
        defaults["pre_rope_keys"] = True
    return {k: v for k, v in dataclasses.asdict(spec).items() if not (k in _LATER_SPEC_FIELDS and v == defaults[k])}


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
    prefix_format: str | None = None,
) -> None:
    """Write ``cache`` (and the caller's ``arrays`` and string ``metadata``) to ``path``, atomically.

    Args:
      path: the file (``.safetensors``); an interrupted save leaves the old file.
      cache: the cache pytree (any layout; leaves are fetched to the host).
      metadata: string entries stored as given (not ``format``, ``spec``, ``checksum`` or ``prefixes``).
      arrays: extra NumPy arrays, by name (names must not start with ``cache``).
      file_format: the ``format`` entry a reader checks (e.g. ``jaxkv-chat/2``).
      prefix_format: store leaves as live prefixes (see the module docstring); the file's
        ``format`` is then this one when at least one leaf is so stored (e.g. ``jaxkv-chat/3``).
        None = every leaf whole.
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
    prefixes = {}
    for name, bits in (_empty_values(cache) if prefix_format is not None else {}).items():
        tensors[name], prefix = _live_prefix(tensors[name], bits)
        if prefix is not None:
            prefixes[name] = prefix
    tensors.update({name: np.ascontiguousarray(a) for name, a in arrays.items()})
    header = {
        "format": prefix_format if prefixes else file_format,
        "spec": json.dumps(_spec_fields(cache.spec), sort_keys=True),
    }
    if prefixes:
        header["prefixes"] = json.dumps(prefixes, sort_keys=True)
    metadata = {**header, **metadata}
    metadata["checksum"] = _checksum(tensors, metadata)
    atomic_write(path, safetensors.numpy.save(tensors, metadata=metadata))


def load_cache(
    path: str | os.PathLike,
    like: KVCache | Callable[[CacheSpec, dict], KVCache],
    *,
    file_format: str = FILE_FORMAT,
    prefix_format: str | None = None,
    what: str = "jaxkv cache",
) -> tuple[KVCache, dict[str, np.ndarray], dict[str, str]]:
    """Read a file written by :func:`save_cache` into a cache shaped like ``like``.

    Args:
      path: the file.
      like: an empty cache of the expected spec and shapes (its values are not used), or a
        function ``(spec, metadata) -> such a cache`` called with the file's spec and metadata
        (once both passed the checksum), which may refuse them by raising.
      file_format: the ``format`` entry expected. prefix_format: also accepted, for a file
        whose ``prefixes`` entry lists leaves stored as live prefixes (None: none accepted).
      what: how messages name the file (``jaxkv chat cache``).
    Returns:
      ``(cache, arrays, metadata)``: the restored cache (device arrays, in ``like``'s tree
      structure), the caller's extra arrays and string metadata (``format``, ``spec`` and
      ``checksum`` included).
    Raises:
      JaxkvError: a missing, unreadable, truncated or corrupt file (checksum), another format,
      a spec other than ``like``'s, arrays whose names, dtypes or shapes differ from ``like``'s,
      or contents no cache holds (a negative length, a position outside its row's stream, a
      token stored twice, a NaN or an infinity): the message names the file and the field.
    """
    path = os.fspath(path)
    tensors, meta = _read(path, (file_format, prefix_format), what)

    def corrupt(problem: str) -> JaxkvError:
        return JaxkvError(f"{path}: corrupt {what} file ({problem})")

    spec = _spec_entry(meta, corrupt)
    if callable(like) and not isinstance(like, KVCache):
        like = like(spec, meta)
    elif like.spec != spec:
        raise JaxkvError(f"{path} holds a cache for another cache spec ({spec.describe()}), not {like.spec.describe()}")
    named = named_leaves(like)
    cache_names = {n for n, _ in named}
    missing = cache_names - set(tensors)
    extra = {n for n in tensors if n.startswith("cache")} - cache_names
    if missing or extra:
        raise corrupt(f"arrays {sorted(missing | extra)} do not match the spec")
    prefixes = _prefixes_entry(meta, cache_names, corrupt) if meta["format"] == prefix_format else {}
    leaves = []
    for name, template in named:
        stored, expected = tensors[name], f"{template.dtype}{list(template.shape)}"
        arr = _restore(stored, template.dtype)
        if name in prefixes and arr is not None:
            axis, bits = prefixes[name]
            if bits >= 1 << (8 * stored.itemsize):
                raise corrupt(f"prefixes: {name}: fill {bits} does not fit its {stored.itemsize} bytes")
            expected = f"a prefix along axis {axis} of {expected}"
            arr = _whole(stored, template.shape, axis, bits)
            arr = None if arr is None else _restore(arr, template.dtype)
        if arr is None or arr.shape != template.shape:
            raise corrupt(f"{name} is {stored.dtype}{list(stored.shape)}, expected {expected}")
        leaves.append(arr)
    cache = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), leaves)
    _check_contents(cache, corrupt)
    return jax.tree.map(jnp.asarray, cache), {n: a for n, a in tensors.items() if n not in cache_names}, meta


def _spec_entry(meta: dict, corrupt: Callable[[str], JaxkvError]) -> CacheSpec | LayerSpecs:
    """The ``spec`` entry as a :class:`CacheSpec` (or :class:`LayerSpecs`), every field checked by it."""
    if "spec" not in meta:
        raise corrupt("no 'spec' entry")
    try:
        fields = json.loads(meta["spec"])
        if isinstance(fields, dict) and set(fields) == {"specs"} and isinstance(fields["specs"], list):
            return LayerSpecs(tuple(CacheSpec(**_object(f)) for f in fields["specs"]))  # one CacheSpec per layer
        return CacheSpec(**_object(fields))
    except (TypeError, ValueError) as e:
        raise corrupt(f"spec: {e}") from None


def _object(fields) -> dict:
    if not isinstance(fields, dict):
        raise TypeError(f"expected a JSON object of CacheSpec fields, got {json.dumps(fields)[:60]}")
    return fields


def _empty_values(cache) -> dict[str, int]:
    """``{leaf name: bit pattern}`` of the one value an empty cache of ``cache``'s spec holds in
    each leaf (-1 positions, zero keys, unit scales), from an empty cache of one layer, row and
    head; a leaf whose empty value is not one value is left out."""
    runs = cache.groups if isinstance(cache, LayeredCache) else (cache,)
    tiny = tuple(KVCache.create(r.spec, batch=1, n_layers=1, n_kv_heads=1, head_dim=r.ring_k.shape[-1]) for r in runs)
    empty = cache.replace(groups=tiny) if isinstance(cache, LayeredCache) else tiny[0]
    out = {}
    for name, leaf in named_leaves(empty):
        a = _storable(np.asarray(leaf)).reshape(-1)
        bits = a.view(f"u{a.itemsize}")
        if bits.size and (bits == bits[0]).all():
            out[name] = int(bits[0])
    return out


def _live_prefix(a: np.ndarray, fill: int) -> tuple[np.ndarray, list[int] | None]:
    """``a`` as its shortest prefix along one axis whose rest holds only the bit pattern ``fill``
    (an empty slot's): ``(prefix, [axis, fill])``, or ``(a, None)`` when no axis shortens it.
    Bit patterns are compared, so a live -0.0 or NaN is never taken for an empty slot."""
    differs = a.view(f"u{a.itemsize}") != fill
    best = None  # (elements stored, axis, length)
    for axis in range(a.ndim):
        used = np.flatnonzero(differs.any(axis=tuple(i for i in range(a.ndim) if i != axis)))
        n = int(used[-1]) + 1 if used.size else 0
        if n < a.shape[axis] and (best is None or n * (a.size // a.shape[axis]) < best[0]):
            best = (n * (a.size // a.shape[axis]), axis, n)
    if best is None:
        return a, None
    _, axis, n = best
    return np.ascontiguousarray(a[(slice(None),) * axis + (slice(0, n),)]), [axis, fill]


def _prefixes_entry(meta: dict, cache_names: set, corrupt: Callable[[str], JaxkvError]) -> dict[str, tuple[int, int]]:
    """The ``prefixes`` entry: ``{leaf name: (axis, bits)}``, names and types checked (axes and bits by :func:`_whole`)."""
    try:
        prefixes = json.loads(meta["prefixes"])
    except KeyError:
        raise corrupt(f"format {meta['format']!r} without its 'prefixes' entry") from None
    except ValueError as e:
        raise corrupt(f"prefixes: {e}") from None
    if not isinstance(prefixes, dict) or not prefixes:
        raise corrupt("prefixes: expected a JSON object {leaf name: [axis, fill]}")
    for name, entry in prefixes.items():
        if name not in cache_names:
            raise corrupt(f"prefixes: {name!r} is not an array of the cache")
        if not (isinstance(entry, list) and len(entry) == 2 and all(type(v) is int and v >= 0 for v in entry)):
            raise corrupt(f"prefixes: {name}: {json.dumps(entry)[:60]}, expected [axis, fill] (integers >= 0)")
    return {name: tuple(entry) for name, entry in prefixes.items()}


def _whole(stored: np.ndarray, shape: tuple, axis: int, bits: int) -> np.ndarray | None:
    """The whole leaf of ``shape`` from its prefix ``stored`` along ``axis``, the rest the value
    of bit pattern ``bits`` (it fits the dtype); None when ``stored`` is not such a prefix."""
    if (
        stored.ndim != len(shape)
        or axis >= stored.ndim
        or stored.shape[axis] >= shape[axis]
        or any(a != b for i, (a, b) in enumerate(zip(stored.shape, shape)) if i != axis)
    ):
        return None
    whole = np.full(shape, bits, f"u{stored.itemsize}").view(stored.dtype)
    whole[(slice(None),) * axis + (slice(0, stored.shape[axis]),)] = stored
    return whole


def _check_contents(cache, corrupt: Callable[[str], JaxkvError]) -> None:
    """Refuse what no cache holds (the arrays already have the template's names, dtypes, shapes):
    per run of layers, a length below 0 (or above a full cache's ``max_len``, or unlike the
    other runs'), a position that is neither -1 (empty) nor one of its row's stream (a sink
    holds one of the first ``sink``, every other slot a later one), a position stored twice in
    a row, and a NaN or an infinity in any float leaf (read as the storage reads it)."""
    named = named_leaves(cache)
    names = {id(leaf): name for name, leaf in named}
    for name, leaf in named:
        values = np.asarray(Storage.read(leaf))  # bf16 sinks and ring are held as int16 bits
        if jnp.issubdtype(values.dtype, jnp.floating):
            try:
                check_finite(name, values)
            except JaxkvError as e:
                raise corrupt(str(e)) from None
    runs = cache.groups if isinstance(cache, LayeredCache) else (cache,)
    for run in runs:
        length, spec = run.length, run.spec
        shown = f"{names[id(length)]} = {length.tolist()}"
        if (length < 0).any():
            raise corrupt(f"{shown}: a negative token count")
        if spec.token_limit is not None and (length > spec.token_limit).any():
            raise corrupt(f"{shown}: more tokens than the full cache's max_len={spec.token_limit}")
        if not np.array_equal(length, runs[0].length):
            raise corrupt(f"{shown} differs from {names[id(runs[0].length)]} = {runs[0].length.tolist()}")
        segments = [(p, p is run.sink_pos) for p in run.positions()]
        for pos, sink in segments:
            low = np.zeros_like(length) if sink else np.full_like(length, spec.n_sink)
            high = np.minimum(length, spec.n_sink) if sink else length
            bad = (pos != -1) & ((pos < low[:, None]) | (pos >= high[:, None]))
            if bad.any():
                b, slot = (int(i) for i in np.argwhere(bad)[0])
                raise corrupt(
                    f"{names[id(pos)]}[{b}, {slot}] = {int(pos[b, slot])}: expected -1 (empty) or a position "
                    f"in [{int(low[b])}, {int(high[b])}) (row {b} holds {int(length[b])} tokens)"
                )
        live = np.concatenate([pos for pos, _ in segments], axis=1)
        for b, row in enumerate(live):
            values, counts = np.unique(row[row >= 0], return_counts=True)
            if (counts > 1).any():
                raise corrupt(
                    f"position {int(values[np.argmax(counts > 1)])} is stored {int(counts.max())} times in row {b}"
                )


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


def _read(path: str, formats: tuple[str | None, ...], what: str) -> tuple[dict, dict]:
    """Tensors and string metadata of a file, checked against its format (one of ``formats``) and checksum."""
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
    if meta.get("format") not in [f for f in formats if f is not None]:
        expected = " or ".join(repr(f) for f in formats if f is not None)
        raise JaxkvError(f"{bad} (format {meta.get('format')!r}, expected {expected})")
    try:
        tensors = safetensors.numpy.load(blob)
    except Exception as e:  # safetensors raises its own SafetensorError for truncated data
        raise JaxkvError(f"{bad} ({e})") from None
    if meta.get("checksum") != _checksum(tensors, meta):
        raise JaxkvError(f"{bad} (checksum mismatch: the data were changed or cut)")
    return tensors, meta
