"""Loader for GGUF checkpoints (llama.cpp's format), through the ``gguf`` package.

``general.architecture`` selects the model family (:mod:`jaxkv.io.registry`), which names
the tensors and builds the config. Each tensor is dequantised on its own (a few threads at
a time) to float32 with ``gguf.quants.dequantize`` (which returns ``(out, in)`` matrices),
transposed to the internal ``x @ W`` layout where the family says it is a linear weight,
and written into its slot of a stack with a leading L axis. Q/K rows the family declares
interleaved (llama.cpp's converter stores Llama's in the interleaved-pair RoPE layout) are
permuted to rotate-half here. A tensor the family does not read is refused (it would
change the outputs: biases, experts, RoPE frequency factors).

:func:`load_model` reads the weights lazily (:class:`LazyWeights`): one stack at a time, when
the model converts it to its held format, so the process never holds the whole model as
float32 beside the held one (SmolLM2's F32 file: 540 MB); the file's pages a stack was read
from are released from the process once it is built (``madvise``), as the kernel keeps them
in its page cache anyway.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import mmap
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import gguf
import numpy as np

from jaxkv.errors import JaxkvError, ModelFileError, check_finite
from jaxkv.io import registry
from jaxkv.io.tokenizer import Tokenizer
from jaxkv.models.blocks import interleaved_to_rotate_half
from jaxkv.models.weights import BLOCK_FORMATS, HEAD_FORMATS, BlockWeight

MAGIC = b"GGUF"
_T = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (_T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_1)


class _Reader(gguf.GGUFReader):
    """``GGUFReader`` over a plain ndarray view of its memmap: ``np.memmap`` slicing costs
    ~10 us a call and the reader slices twice per vocabulary string (~100k for SmolLM2),
    so this parses the metadata 3x faster. The mapping stays open through the view."""

    @property
    def data(self) -> np.ndarray:
        return self._view

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._view = value.view(np.ndarray)
        self._mmap = getattr(value, "_mmap", None)

    def release(self, tensors) -> None:
        """Drop the file pages holding ``tensors`` from this process's resident set (they stay
        in the kernel's page cache; a later read maps them again). A no-op where the platform
        has no ``madvise``."""
        if self._mmap is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        for tensor in tensors:
            start = int(tensor.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
            self._mmap.madvise(mmap.MADV_DONTNEED, start, int(tensor.data_offset) + int(tensor.n_bytes) - start)

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        """Every read of the file (header, metadata, tensor infos, tensor data) is checked to
        end inside it: a truncated file is named as one, not as a numpy reshape error."""
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > self._view.size:
            raise _PastTheEnd(end, self._view.size, tensor_data=hasattr(self, "data_offset"))
        return super()._get(offset, dtype, count, override_order)


class _PastTheEnd(ValueError):
    """A read of a GGUF file that ends after its last byte (raised by :class:`_Reader`)."""

    def __init__(self, end: int, size: int, *, tensor_data: bool):
        super().__init__(end, size)
        self.end, self.size, self.tensor_data = end, size, tensor_data


class LazyWeights(Mapping):
    """A model's weights, read from its file when indexed: ``weights[name]`` builds that
    weight's float32 stack (and the stacks of the weights fused with it in the file, kept
    until they are indexed), and keeps nothing after handing it out, so converting the
    weights one at a time holds one stack in float32 at a time.

    A ``Mapping[str, np.ndarray]``: ``dict(weights)`` reads them all.
    """

    def __init__(self, groups: list[tuple[tuple[str, ...], Callable[[], dict[str, np.ndarray]]]]):
        self._groups = {key: build for keys, build in groups for key in keys}
        self._pending: dict[str, np.ndarray] = {}

    def __getitem__(self, key: str) -> np.ndarray:
        if key in self._pending:
            return self._pending.pop(key)
        built = self._groups[key]()
        self._pending.update((k, v) for k, v in built.items() if k != key)
        return built[key]

    def __contains__(self, key) -> bool:  # without building it (Mapping's default indexes)
        return key in self._groups

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)


def _open(path: str | os.PathLike, name: str) -> gguf.GGUFReader:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(f"cannot read GGUF file {os.fspath(path)}: {e.strerror or e}") from None
    if len(magic) < len(MAGIC):
        raise ModelFileError(
            f"{name}: truncated: a GGUF file starts with {MAGIC!r} and a header, got {len(magic)} bytes"
        )
    if magic != MAGIC:
        raise ModelFileError(f"{name}: not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
    try:
        reader = _Reader(path)
    except _PastTheEnd as e:
        part = "its tensor data end at" if e.tensor_data else "its header (metadata, tensor infos) runs to"
        raise ModelFileError(
            f"{name}: truncated GGUF file: {part} byte {e.end:,}, the file has {e.size:,} bytes"
        ) from None
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise ModelFileError(f"{name}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None
    return reader


def _dequantize(name: str, tensor: gguf.ReaderTensor) -> np.ndarray:
    """A tensor's values as float32 numpy, in the file's numpy order, checked to be finite
    (a NaN in one Q4_1 scale is a NaN in every value of its block)."""
    _check_type(name, tensor)
    values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
    check_finite(f"{name}: tensor {tensor.name!r}", values, ModelFileError)
    return values


_ROWS = 4096
"""Rows of a tensor :func:`_dequantize_into` dequantises at a time (its temporaries stay a few MB)."""


def _dequantize_into(name: str, tensor: gguf.ReaderTensor, out: np.ndarray) -> None:
    """:func:`_dequantize` written into ``out`` (float32, the file's numpy shape), a few rows at
    a time: a large tensor (an embedding table) never has a float32 temporary of its size."""
    _check_type(name, tensor)
    data = tensor.data
    if data.ndim < 2:
        out[...] = gguf.quants.dequantize(data, tensor.tensor_type)
    else:
        for start in range(0, len(data), _ROWS):
            out[start : start + _ROWS] = gguf.quants.dequantize(data[start : start + _ROWS], tensor.tensor_type)
    check_finite(f"{name}: tensor {tensor.name!r}", out, ModelFileError)


def _check_type(name: str, tensor: gguf.ReaderTensor) -> None:
    if tensor.tensor_type not in SUPPORTED_TYPES:
        accepted = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ModelFileError(
            f"{name}: tensor {tensor.name!r} has quantisation type {tensor.tensor_type.name}, which is not supported: "
            f"expected one of {accepted}"
        )


def _field_value(field: gguf.ReaderField):
    """A metadata value as plain Python (``ReaderField.contents()`` needs gguf >= 0.16)."""

    def one(part: np.ndarray, kind: gguf.GGUFValueType):
        return bytes(part).decode("utf-8") if kind == gguf.GGUFValueType.STRING else part[0].item()

    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def _metadata(reader: gguf.GGUFReader, name: str) -> dict:
    try:
        return {key: _field_value(field) for key, field in reader.fields.items()}
    except UnicodeDecodeError as e:
        raise ModelFileError(f"{name}: corrupt GGUF metadata: a string is not UTF-8 ({e})") from None


def gguf_metadata(path: str | os.PathLike) -> dict:
    """The metadata of a GGUF file, reading no tensors.

    Returns:
      ``{key: value}`` with plain Python values (str, int, float, bool, or lists of them),
      e.g. ``"general.architecture": "llama"``, ``"llama.block_count": 30``; what
      :meth:`LlamaConfig.from_gguf` and :meth:`Tokenizer.from_gguf_metadata` read.

    Raises:
      ModelFileError: naming the file, if it is unreadable, not a GGUF file, truncated, or
        holds a string that is not UTF-8.
    """
    name = os.path.basename(os.fspath(path))
    return _metadata(_open(path, name), name)


def gguf_block_format(path: str | os.PathLike) -> str | None:
    """The block format (:data:`jaxkv.models.weights.BLOCK_FORMATS`) every layer matrix of a
    GGUF file is stored in (``blk.*`` tensors of two or more axes), or None when they are
    floats or of mixed types.

    Raises:
      ModelFileError: not a GGUF file, truncated or corrupt (named).
    """
    reader = _open(path, os.path.basename(os.fspath(path)))
    types = {t.tensor_type for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) >= 2}
    by_type = {gguf.GGMLQuantizationType(value): fmt for fmt, value in BLOCK_FORMATS.items()}
    return by_type.get(types.pop()) if len(types) == 1 else None


def load_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The :class:`Tokenizer` of a GGUF file, reading its metadata only (no tensors).

    Raises:
      ModelFileError: naming the file, if it is not a readable GGUF file.
      JaxkvError: if its tokenizer is of an unsupported kind.
    """
    return Tokenizer.from_gguf_metadata(gguf_metadata(path), name=os.path.basename(os.fspath(path)))


def load_gguf(
    path: str | os.PathLike, *, lazy: bool = False, blocks: str | None = None
) -> tuple[Any, Mapping[str, np.ndarray], Tokenizer]:
    """Read a GGUF checkpoint and its tokenizer.

    Args:
      path: a GGUF v2/v3 file of a registered architecture (``general.architecture ==
        "llama"``), tensors in F32, F16, BF16, Q8_0, Q4_0 or Q4_1.
      lazy: return the weights as a :class:`LazyWeights` (each stack read when indexed, once;
        a NaN is then reported when its tensor is read) instead of a dict of them all.
      blocks: None, or the block format the model will hold its matrices in (one of
        :data:`jaxkv.models.weights.BLOCK_FORMATS`): a matrix whose tensors the file holds in
        that ggml type (the embedding table: in :data:`~jaxkv.models.weights.HEAD_FORMATS`'s)
        is returned as a :class:`~jaxkv.models.weights.BlockWeight` of the file's own bytes
        (numpy leaves; Q/K rows permuted to rotate-half), never as float32.
    Returns:
      ``(config, weights, tokenizer)``: the family's config from the metadata (for Llama a
      :class:`~jaxkv.models.llama.LlamaConfig` from the ``llama.*`` keys; ``name`` = the
      file name; tied when there is no ``output.weight``), float32 numpy weights in the
      family's internal layout (per-layer tensors stacked on a leading L axis, Q/K permuted
      to rotate-half RoPE), and the :class:`Tokenizer` built from the ``tokenizer.*`` metadata.
    Raises:
      ModelFileError: naming the file, if it is not a GGUF file, is truncated, is of an
        unregistered architecture (the message lists the supported ones), has metadata
        the family refuses, lacks a tensor, has a tensor of the wrong shape, one the
        family does not read, one of an unsupported quantisation type (the message
        names the tensor and the type), or one holding a NaN or an infinity after
        dequantisation (named, with the count).
      JaxkvError: if its tokenizer is of an unsupported kind.
    """
    name = os.path.basename(os.fspath(path))
    reader = _open(path, name)
    metadata = _metadata(reader, name)
    reader.fields.clear()  # its parsed metadata (~130 MiB for a 49k-token vocabulary); the lazy weights keep the reader
    tensors = {t.name: t for t in reader.tensors}
    shapes = {key: tuple(int(x) for x in t.shape[::-1]) for key, t in tensors.items()}  # numpy order: (out, in)
    try:
        family = registry.family_for_gguf(metadata.get("general.architecture"))
        fmt = family.gguf
        extra = {key: _dequantize(name, tensors[key]) for key in fmt.extra if key in tensors}
        config = fmt.config(metadata, shapes, name=name, extra=extra)
    except JaxkvError as e:
        raise ModelFileError(f"{name}: {e}") from None

    weight_shapes = family.weight_shapes(config)
    groups, read = [], set(extra)
    for template, keys in fmt.plan(weight_shapes):
        per_layer = "{i}" in template
        names = [template.format(i=i) for i in range(weight_shapes[keys[0]][0])] if per_layer else [template]
        parts = [
            weight_shapes[k][1:] if per_layer else weight_shapes[k] for k in keys
        ]  # internal [in, out] of one tensor
        one = parts[0][:-1] + (sum(p[-1] for p in parts),)  # fused parts: concatenated on the output axis
        matrix = keys[0] in fmt.linear
        n_heads = getattr(config, fmt.interleaved[keys[0]]) if keys[0] in fmt.interleaved else None
        group = []
        for tensor_name in names:
            tensor = tensors.get(tensor_name)
            if tensor is None:
                raise ModelFileError(f"{name}: tensor {tensor_name!r} is missing")
            _check_type(name, tensor)
            expected = one[::-1] if matrix else one  # the file's numpy order: (out, in)
            if shapes[tensor_name] != expected:
                raise ModelFileError(
                    f"{name}: tensor {tensor_name!r} has shape {shapes[tensor_name]}; expected {expected} for this config"
                )
            group.append(tensor)
            read.add(tensor_name)
        held = _block_format(fmt, keys, matrix, group, blocks)
        if held is not None:
            build = functools.partial(_block_stack, reader, keys[0], group, per_layer, held, n_heads)
        else:
            build = functools.partial(_build_stacks, reader, name, keys, parts, group, per_layer, matrix, n_heads)
        groups.append((tuple(keys), build))
    unread = sorted(set(tensors) - read)
    if unread:
        raise ModelFileError(
            f"{name}: tensor {unread[0]!r} is not part of a {family.name} model as jaxkv computes it (it would change "
            f"the outputs): not supported"
        )
    weights: Mapping[str, np.ndarray] = LazyWeights(groups)
    if fmt.transform is not None:
        weights = fmt.transform(config, dict(weights))
    if not lazy:
        weights = {key: w if isinstance(w, BlockWeight) else np.ascontiguousarray(w) for key, w in weights.items()}
    return config, weights, Tokenizer.from_gguf_metadata(metadata, name=name)


def _build_stacks(reader: _Reader, name: str, keys, parts, tensors, per_layer: bool, matrix: bool, n_heads) -> dict:
    """The float32 stacks ``{key: [L, *part]}`` (``part`` alone when not per layer) of one
    planned group of tensors: each dequantised (a few threads at a time), Q/K rows permuted to
    rotate-half if ``n_heads``, and split into the group's fused ``parts``; then the file's
    pages released. A ``matrix`` is stored as the file holds it, ``(out, in)`` (what a model
    holds, :class:`jaxkv.models.weights.TransposedWeight`), and handed out as its transposed
    view in the ``x @ W`` layout, so holding it copies nothing more."""
    held = [(*p[:-2], p[-1], p[-2]) if matrix else p for p in parts]
    stacks = [_aligned_empty((len(tensors), *p)) for p in held]
    views = [np.swapaxes(s, -1, -2) if matrix else s for s in stacks]  # [L, ..., in, out]

    def fill(i):
        if len(stacks) == 1 and not n_heads:  # the file's rows straight into the stack, a few at a time
            return _dequantize_into(name, tensors[i], stacks[0][i])
        w = _dequantize(name, tensors[i])
        w = w.T if matrix else w
        if n_heads:
            w = interleaved_to_rotate_half(w, n_heads, w.shape[-1] // n_heads)
        for view, piece in zip(views, np.split(w, np.cumsum([v.shape[-1] for v in views])[:-1], axis=-1)):
            view[i] = piece

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(fill, range(len(tensors))))  # numpy releases the GIL in the heavy parts
    reader.release(tensors)
    return {key: view if per_layer else view[0] for key, view in zip(keys, views)}


def _block_format(fmt, keys, matrix: bool, tensors, blocks: str | None) -> str | None:
    """The block format a planned group is read in as its own bytes (:func:`_block_stack`), or
    None (read as float32): one matrix, every tensor in that format's ggml type, and no family
    transform that could rewrite it."""
    if blocks is None or len(keys) != 1 or fmt.transform is not None or not (matrix or keys[0] == "embed"):
        return None
    held = HEAD_FORMATS.get(blocks, blocks) if keys[0] in ("embed", "lm_head") else blocks
    wanted = gguf.GGMLQuantizationType(BLOCK_FORMATS[held])
    return held if all(t.tensor_type == wanted for t in tensors) else None


def _block_stack(reader: _Reader, key: str, tensors, per_layer: bool, held: str, n_heads) -> dict:
    """``{key: BlockWeight}`` of a group's tensors as the file holds them: rows of blocks
    ``uint8[L, out, bytes]`` (``[out, bytes]`` when not per layer; the embedding table
    ``[V, D bytes]`` is its tied head's transpose), Q/K rows permuted to rotate-half; then the
    file's pages released."""
    rows = np.empty((len(tensors), *tensors[0].data.shape), np.uint8)
    order = None
    if n_heads:
        order = interleaved_to_rotate_half(np.arange(rows.shape[1]), n_heads, rows.shape[1] // n_heads)
    for i, tensor in enumerate(tensors):
        rows[i] = tensor.data if order is None else tensor.data[order]
    reader.release(tensors)
    n_in = int(tensors[0].shape[0])  # the file's shape is (in, out) in ggml's order
    return {key: BlockWeight(blocks=rows if per_layer else rows[0], n_in=n_in, format=held)}


def _aligned_empty(shape: tuple[int, ...]) -> np.ndarray:
    """``np.empty(shape, np.float32)`` starting on a 64-byte boundary (numpy's own start on 16):
    ``jax.device_put`` on CPU then holds the stack as it is instead of copying it, so a float32
    weight is in memory once while the model is loaded, not twice (SmolLM2: ~110 MB less at the peak)."""
    size = math.prod(shape) * 4
    raw = np.empty(size + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start : start + size].view(np.float32).reshape(shape)
