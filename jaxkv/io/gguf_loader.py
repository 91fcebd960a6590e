"""Loader for GGUF Llama checkpoints (llama.cpp's format), through the ``gguf`` package.

Each tensor is dequantised on its own (a few threads at a time) to float32 with
``gguf.quants.dequantize`` (which returns ``(out, in)`` matrices), transposed to the internal
``x @ W`` layout and written into its slot of a stack with a leading L axis. llama.cpp's
converter stores Q/K rows in the interleaved-pair RoPE layout; they are permuted to
rotate-half here.
"""

from __future__ import annotations

import concurrent.futures
import os

import gguf
import numpy as np

from jaxkv.errors import JaxkvError, ModelFileError
from jaxkv.io.tokenizer import Tokenizer
from jaxkv.models.config import LlamaConfig, interleaved_to_rotate_half

MAGIC = b"GGUF"
_T = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (_T.F32, _T.F16, _T.BF16, _T.Q8_0, _T.Q4_0, _T.Q4_1)

# internal name -> (GGUF name, per layer?, matrix?)
_TENSORS = {
    "embed": ("token_embd", False, False),
    "attn_norm": ("attn_norm", True, False),
    "wq": ("attn_q", True, True),
    "wk": ("attn_k", True, True),
    "wv": ("attn_v", True, True),
    "wo": ("attn_output", True, True),
    "mlp_norm": ("ffn_norm", True, False),
    "w_gate": ("ffn_gate", True, True),
    "w_up": ("ffn_up", True, True),
    "w_down": ("ffn_down", True, True),
    "final_norm": ("output_norm", False, False),
    "lm_head": ("output", False, True),
}


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


def _open(path: str | os.PathLike, name: str) -> gguf.GGUFReader:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFileError(f"cannot read GGUF file {os.fspath(path)}: {e.strerror or e}") from None
    if magic != MAGIC:
        raise ModelFileError(f"{name}: not a GGUF file (starts with {magic!r}, expected {MAGIC!r})")
    try:
        reader = _Reader(path)
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        raise ModelFileError(f"{name}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None
    return reader


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


def load_gguf(path: str | os.PathLike) -> tuple[LlamaConfig, dict[str, np.ndarray], Tokenizer]:
    """Read a GGUF Llama checkpoint and its tokenizer.

    Args:
      path: a GGUF v2/v3 file with ``general.architecture == "llama"``, tensors in F32, F16,
        BF16, Q8_0, Q4_0 or Q4_1.
    Returns:
      ``(config, weights, tokenizer)``: a :class:`LlamaConfig` from the ``llama.*`` metadata
      (``name`` = the file name; tied when there is no ``output.weight``), float32 numpy
      weights in the layout of :mod:`jaxkv.models.config` (per-layer tensors stacked on a
      leading L axis, Q/K permuted to rotate-half RoPE), and the :class:`Tokenizer` built
      from the ``tokenizer.*`` metadata.
    Raises:
      ModelFileError: naming the file, if it is not a GGUF file, is truncated, is not a
        llama architecture, lacks a tensor, has a tensor of the wrong shape, or has a tensor
        of an unsupported quantisation type (the message names the tensor and the type).
      JaxkvError: if its tokenizer is of an unsupported kind.
    """
    name = os.path.basename(os.fspath(path))
    reader = _open(path, name)
    metadata = _metadata(reader, name)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" in tensors and "llama.vocab_size" not in metadata:
        metadata["_vocab_size"] = int(tensors["token_embd.weight"].shape[-1])
    try:
        config = LlamaConfig.from_gguf(metadata, tie_embeddings="output.weight" not in tensors, name=name)
    except JaxkvError as e:
        raise ModelFileError(f"{name}: {e}") from None

    n, k, h, d, f, v = config.n_heads, config.n_kv_heads, config.head_dim, config.dim, config.hidden_dim, config.vocab_size
    shapes = {  # internal [in, out] layout, per layer
        "embed": (v, d), "attn_norm": (d,), "wq": (d, n * h), "wk": (d, k * h), "wv": (d, k * h), "wo": (n * h, d),
        "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d), "final_norm": (d,), "lm_head": (d, v),
    }  # fmt: skip
    heads = {"wq": n, "wk": k}
    weights, jobs = {}, []
    for key, (gguf_name, per_layer, matrix) in _TENSORS.items():
        if key == "lm_head" and config.tie_embeddings:
            continue
        names = [f"blk.{i}.{gguf_name}.weight" for i in range(config.n_layers)] if per_layer else [f"{gguf_name}.weight"]
        stacked = np.empty((len(names), *shapes[key]), dtype=np.float32)
        weights[key] = stacked if per_layer else stacked[0]
        for i, tensor_name in enumerate(names):
            tensor = tensors.get(tensor_name)
            if tensor is None:
                raise ModelFileError(f"{name}: tensor {tensor_name!r} is missing")
            _check_type(name, tensor)
            expected = shapes[key][::-1] if matrix else shapes[key]  # the file's numpy order: (out, in)
            if tuple(int(x) for x in tensor.shape[::-1]) != expected:
                raise ModelFileError(
                    f"{name}: tensor {tensor_name!r} has shape {tuple(int(x) for x in tensor.shape[::-1])}; "
                    f"expected {expected} for this config"
                )
            jobs.append((stacked, i, tensor, matrix, heads.get(key)))

    def fill(job):
        stacked, i, tensor, matrix, n_heads = job
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        w = w.T if matrix else w
        stacked[i] = interleaved_to_rotate_half(w, n_heads, h) if n_heads else w

    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(fill, jobs))  # numpy releases the GIL in the heavy parts
    return config, weights, Tokenizer.from_gguf_metadata(metadata, name=name)
