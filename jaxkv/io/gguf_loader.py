"""Loader for GGUF checkpoints (llama.cpp's format), through the ``gguf`` package.

``general.architecture`` selects the model family (:mod:`jaxkv.io.registry`), which names
the tensors and builds the config. Each tensor is dequantised on its own (a few threads at
a time) to float32 with ``gguf.quants.dequantize`` (which returns ``(out, in)`` matrices),
transposed to the internal ``x @ W`` layout where the family says it is a linear weight,
and written into its slot of a stack with a leading L axis. Q/K rows the family declares
interleaved (llama.cpp's converter stores Llama's in the interleaved-pair RoPE layout) are
permuted to rotate-half here. A tensor the family does not read is refused (it would
change the outputs: biases, experts, RoPE frequency factors).
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any

import gguf
import numpy as np

from jaxkv.errors import JaxkvError, ModelFileError, check_finite
from jaxkv.io import registry
from jaxkv.io.tokenizer import Tokenizer
from jaxkv.models.blocks import interleaved_to_rotate_half

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


def _open(path: str | os.PathLike, name: str) -> gguf.GGUFReader:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(f"cannot read GGUF file {os.fspath(path)}: {e.strerror or e}") from None
    if len(magic) < len(MAGIC):
        raise ModelFileError(f"{name}: truncated: a GGUF file starts with {MAGIC!r} and a header, got {len(magic)} bytes")
    if magic != MAGIC:
        raise ModelFileError(f"{name}: not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
    try:
        reader = _Reader(path)
    except _PastTheEnd as e:
        part = "its tensor data end at" if e.tensor_data else "its header (metadata, tensor infos) runs to"
        raise ModelFileError(f"{name}: truncated GGUF file: {part} byte {e.end:,}, the file has {e.size:,} bytes") from None
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


def load_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The :class:`Tokenizer` of a GGUF file, reading its metadata only (no tensors).

    Raises:
      ModelFileError: naming the file, if it is not a readable GGUF file.
      JaxkvError: if its tokenizer is of an unsupported kind.
    """
    return Tokenizer.from_gguf_metadata(gguf_metadata(path), name=os.path.basename(os.fspath(path)))


def load_gguf(path: str | os.PathLike) -> tuple[Any, dict[str, np.ndarray], Tokenizer]:
    """Read a GGUF checkpoint and its tokenizer.

    Args:
      path: a GGUF v2/v3 file of a registered architecture (``general.architecture ==
        "llama"``), tensors in F32, F16, BF16, Q8_0, Q4_0 or Q4_1.
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
    weights, jobs, read = {}, [], set(extra)
    for template, keys in fmt.plan(weight_shapes):
        per_layer = "{i}" in template
        names = [template.format(i=i) for i in range(weight_shapes[keys[0]][0])] if per_layer else [template]
        parts = [weight_shapes[k][1:] if per_layer else weight_shapes[k] for k in keys]  # internal [in, out] of one tensor
        one = parts[0][:-1] + (sum(p[-1] for p in parts),)  # fused parts: concatenated on the output axis
        stacks = [np.empty((len(names), *p), dtype=np.float32) for p in parts]
        for key, stacked in zip(keys, stacks):
            weights[key] = stacked if per_layer else stacked[0]
        matrix = keys[0] in fmt.linear
        n_heads = getattr(config, fmt.interleaved[keys[0]]) if keys[0] in fmt.interleaved else None
        for i, tensor_name in enumerate(names):
            tensor = tensors.get(tensor_name)
            if tensor is None:
                raise ModelFileError(f"{name}: tensor {tensor_name!r} is missing")
            _check_type(name, tensor)
            expected = one[::-1] if matrix else one  # the file's numpy order: (out, in)
            if shapes[tensor_name] != expected:
                raise ModelFileError(f"{name}: tensor {tensor_name!r} has shape {shapes[tensor_name]}; expected {expected} for this config")
            jobs.append((stacks, i, tensor, matrix, n_heads))
            read.add(tensor_name)
    unread = sorted(set(tensors) - read)
    if unread:
        raise ModelFileError(
            f"{name}: tensor {unread[0]!r} is not part of a {family.name} model as jaxkv computes it (it would change "
            f"the outputs): not supported"
        )

    def fill(job):
        stacks, i, tensor, matrix, n_heads = job
        w = _dequantize(name, tensor)
        w = w.T if matrix else w
        if n_heads:
            w = interleaved_to_rotate_half(w, n_heads, w.shape[-1] // n_heads)
        for stacked, piece in zip(stacks, np.split(w, np.cumsum([s.shape[-1] for s in stacks])[:-1], axis=-1)):
            stacked[i] = piece

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(fill, jobs))  # numpy releases the GIL in the heavy parts
    if fmt.transform is not None:
        weights = fmt.transform(config, weights)
    return config, weights, Tokenizer.from_gguf_metadata(metadata, name=name)
