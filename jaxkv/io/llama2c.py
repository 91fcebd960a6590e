"""Loader for llama2.c legacy (version 0) checkpoints, e.g. ``stories260K.bin``.

File layout (karpathy/llama2.c ``export.py --version 0``): a header of 7 little-endian
int32 ``dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len`` (a negative
``vocab_size`` means the classifier is stored separately), then float32 arrays, matrices
in PyTorch ``(out, in)`` row-major order::

    token_embedding [V, D]  rms_att [L, D]  wq [L, D, D]  wk [L, K*H, D]  wv [L, K*H, D]
    wo [L, D, D]  rms_ffn [L, D]  w1 [L, F, D]  w2 [L, D, F]  w3 [L, F, D]  rms_final [D]
    freq_cis_real [seq_len, H/2]  freq_cis_imag [seq_len, H/2]  (wcls [V, D] if not shared)
"""

from __future__ import annotations

import os

import numpy as np

from jaxkv.errors import ModelFileError, check_finite
from jaxkv.io import registry
from jaxkv.models.blocks import interleaved_to_rotate_half
from jaxkv.models.llama import LlamaConfig

HEADER_BYTES = 28
_HEADER_NAMES = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")
_VERSIONED_MAGIC = 0x616B3432  # "ak42": llama2.c export versions >= 1, not the legacy format


def _array_shapes(header: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """The float32 arrays after the header, in file order, with their shapes."""
    d, f, n_layers, n_heads = header["dim"], header["hidden_dim"], header["n_layers"], header["n_heads"]
    v, seq_len = abs(header["vocab_size"]), header["seq_len"]
    head_dim = d // n_heads
    kv = header["n_kv_heads"] * head_dim
    shapes = [
        ("token_embedding", (v, d)),
        ("rms_att", (n_layers, d)),
        ("wq", (n_layers, d, d)),
        ("wk", (n_layers, kv, d)),
        ("wv", (n_layers, kv, d)),
        ("wo", (n_layers, d, d)),
        ("rms_ffn", (n_layers, d)),
        ("w1", (n_layers, f, d)),
        ("w2", (n_layers, d, f)),
        ("w3", (n_layers, f, d)),
        ("rms_final", (d,)),
        ("freq_cis_real", (seq_len, head_dim // 2)),
        ("freq_cis_imag", (seq_len, head_dim // 2)),
    ]
    if header["vocab_size"] < 0:
        shapes.append(("wcls", (v, d)))
    return shapes


def _check_header(name: str, header: dict[str, int]) -> None:
    if header["dim"] == _VERSIONED_MAGIC:
        raise ModelFileError(
            f"{name}: a versioned llama2.c export (magic 'ak42'); only the legacy version-0 format is supported "
            "(export with `export.py --version 0`)"
        )
    bad = [f"{k}={v}" for k, v in header.items() if (v == 0 if k == "vocab_size" else v < 1)]
    if bad:
        raise ModelFileError(f"{name}: not a llama2.c checkpoint: header has non-positive {', '.join(bad)}")
    if header["dim"] % header["n_heads"] or (header["dim"] // header["n_heads"]) % 2:
        raise ModelFileError(
            f"{name}: not a llama2.c checkpoint: dim={header['dim']} must be n_heads={header['n_heads']} times an even head size"
        )
    if header["n_heads"] % header["n_kv_heads"]:
        raise ModelFileError(
            f"{name}: not a llama2.c checkpoint: n_heads={header['n_heads']} is not a multiple of n_kv_heads={header['n_kv_heads']}"
        )


def load_llama2c(path: str | os.PathLike) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Read a llama2.c legacy checkpoint into the internal weight layout.

    Args:
      path: a llama2.c version-0 ``.bin`` file (float32, little-endian).
    Returns:
      ``(config, weights)``: a :class:`LlamaConfig` (RoPE theta 10000, RMSNorm eps 1e-5,
      ``max_seq_len`` = the header's seq_len, ``name`` = the file name) and a dict of
      float32 numpy arrays in the layout of :mod:`jaxkv.models.llama` (``x @ W``
      orientation, Q/K output channels permuted to rotate-half RoPE; ``lm_head [D, V]``
      only when the classifier is not shared). The precomputed freq_cis tables are skipped.
    Raises:
      ModelFileError: naming the file, if it is missing, shorter or longer than the header's
        shapes require, or its header is not a plausible Llama (non-positive sizes, dim not
        divisible into even-sized heads, n_heads % n_kv_heads != 0, a versioned export), or a
        tensor holding a NaN or an infinity (named, with the count).
    """
    name = os.path.basename(os.fspath(path))
    try:
        size = os.path.getsize(path)
        raw_header = np.fromfile(path, dtype="<i4", count=7)
    except OSError as e:
        raise ModelFileError(f"cannot read llama2.c checkpoint {os.fspath(path)}: {e.strerror or e}") from None
    if size < HEADER_BYTES:
        raise ModelFileError(
            f"{name}: truncated: a llama2.c checkpoint starts with a {HEADER_BYTES}-byte header, got {size:,} bytes"
        )
    header = {k: int(v) for k, v in zip(_HEADER_NAMES, raw_header)}
    _check_header(name, header)

    shapes = _array_shapes(header)
    expected = HEADER_BYTES + 4 * sum(int(np.prod(shape, dtype=object)) for _, shape in shapes)
    if size != expected:
        problem = "truncated" if size < expected else "trailing bytes"
        dims = ", ".join(f"{k}={v}" for k, v in header.items())
        raise ModelFileError(f"{name}: {problem}: expected {expected:,} bytes for {dims}; got {size:,}")

    data = np.memmap(path, dtype="<f4", mode="r", offset=HEADER_BYTES)
    arrays, offset = {}, 0
    for key, shape in shapes:
        count = int(np.prod(shape))
        arrays[key] = data[offset : offset + count].reshape(shape)
        offset += count

    family = registry.LLAMA2C
    fmt = family.llama2c
    config = fmt.config(tuple(header.values()), name=name)  # header already validated
    weights = {}
    for key in family.weight_shapes(config):
        w = arrays[fmt.tensors[key]]
        check_finite(f"{name}: tensor {fmt.tensors[key]!r}", w, ModelFileError)
        w = np.swapaxes(w, -1, -2) if key in fmt.linear else w  # [L, out, in] -> [L, in, out]
        if key in fmt.interleaved:
            n_heads = getattr(config, fmt.interleaved[key])
            w = interleaved_to_rotate_half(w, n_heads, w.shape[-1] // n_heads)
        weights[key] = np.array(w, dtype=np.float32, order="C")  # a fresh array, not a view of the file
    del data, arrays
    return config, weights
