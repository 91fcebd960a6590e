"""Weights below float32: the weight formats, :class:`QuantizedWeight`, and the one
projection every layer and the LM head use, :func:`dense`.

A model's matrices (the projections, the MLP, the embedding table and the LM head) are
held in one of :data:`WEIGHT_FORMATS`; norms and biases always stay float32.

* ``fp32``: float32 arrays, ``x @ W`` exactly as jaxkv computed before formats existed.
* ``bf16`` / ``fp16``: arrays of that dtype; activations stay float32 between layers and
  each product is ``x @ W.astype(float32)`` inside the compiled step (XLA fuses the
  convert into the dot's operand read: the weights cross memory at 2 bytes each).
* ``int8``: symmetric int8 codes per block of 32 inputs, like GGUF ``Q8_0``:
  ``scale = max|w| / 127`` (1 where the block is all zero), ``q = round(w / scale)``,
  ``w' = q * scale``; one float16 scale per (block, output).
* ``q4``: 4-bit codes with a scale and a minimum per block of 32 inputs, like GGUF ``Q4_1``:
  ``scale = (max - min) / 15`` (1 where the block is constant), ``min = min``,
  ``q = clip(round((w - min) / scale), 0, 15)``, ``w' = q * scale + min``; two codes per
  ``uint8``, input ``j`` of a block in the low nibble and input ``j + 16`` in the high
  nibble of byte ``j`` (ggml's packing); float16 scales and minimums.

Both integer formats are dequantised on the fly inside the step (the compiled program takes
the int8 / uint8 codes as parameters; tests/test_weights.py checks its HLO). Scales are
stored as float16 (as GGUF stores them) and applied in float32.

Layout: a :class:`QuantizedWeight` stands for a matrix ``W[..., I, O]`` in jaxkv's
``x @ W`` orientation (leading axes: the stacked layers L); its codes are
``[..., I/32, 32, O]`` (int8) or ``[..., I/32, 16, O]`` (q4), its scales (and mins)
``[..., I/32, O]``. An ``I`` that is not a multiple of 32 is padded with zero weights
(and :func:`dense` pads ``x`` with zeros), so every shape is accepted. The embedding table
``[V, D]`` is held as its transpose ``[D, V]`` (the tied LM head's orientation);
:func:`embed_lookup` gathers the rows of the table and dequantises only those.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.errors import JaxkvError

WEIGHT_FORMATS = ("fp32", "bf16", "fp16", "int8", "q4")
"""The accepted ``weights=`` values (``load_model``, ``--weights``)."""
FLOAT_FORMATS = {"fp32": np.float32, "bf16": jnp.bfloat16, "fp16": np.float16}
"""The formats held as plain arrays -> their dtype."""
HEAD_FORMATS = {"q4": "int8"}
"""The format of the embedding table and LM head where it differs from the other matrices':
under ``q4`` they are int8, as in llama.cpp's Q4_1 files (SmolLM2's ``token_embd`` is Q8_0;
at 4 bits the tied head alone costs +8 % perplexity on SmolLM2)."""
BLOCK = 32
"""Inputs per block of the integer formats (GGUF's ``QK8_0`` / ``QK4_1``)."""
DEQUANTIZE_TOKENS = 8
"""From this many tokens per product (B * T) on, :func:`dense` dequantises the whole matrix
and does one float32 dot (prefill); below it (decode), it dots each block of 32 inputs
with the raw codes and scales the partial sums: that reads 1 (int8) or 0.5 (q4) bytes per
weight and never writes a float32 copy of the matrix."""


@struct.dataclass
class QuantizedWeight:
    """A matrix ``W[..., I, O]`` as integer codes per block of 32 inputs (a pytree; see the
    module docstring for the formats and the layout).

    Attributes:
      codes: ``int8[..., I/32, 32, O]`` (``int8``) or ``uint8[..., I/32, 16, O]`` (``q4``,
        two 4-bit codes a byte).
      scales: ``float16[..., I/32, O]``.
      mins: ``float16[..., I/32, O]`` (``q4``), or None (``int8``: symmetric).
      n_in: I, the logical input width (the codes may hold zero padding up to a multiple of 32).
      format: ``"int8"`` or ``"q4"``.
    """

    codes: jax.Array
    scales: jax.Array
    mins: jax.Array | None
    n_in: int = struct.field(pytree_node=False)
    format: str = struct.field(pytree_node=False)

    def __getitem__(self, key):
        """``w[...]`` is ``w`` itself, as for an array (``nnx.Param(w)[...]`` reads it)."""
        if key is not Ellipsis:
            raise JaxkvError(f"QuantizedWeight[{key!r}]: only [...] is supported (slice the leaves with jax.tree.map)")
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape ``(..., I, O)``."""
        return (*self.codes.shape[:-3], self.n_in, self.codes.shape[-1])

    @property
    def dtype(self):
        """The codes' dtype (``int8``, or ``uint8`` for q4): what the weights are held as."""
        return self.codes.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held (codes, scales and mins)."""
        return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(self))

    def dequantize(self) -> jax.Array:
        """The float32 matrix ``[..., I, O]`` the codes stand for."""
        lead, n_blocks, out = self.codes.shape[:-3], self.codes.shape[-3], self.codes.shape[-1]
        w = _codes_f32(self) * self.scales.astype(jnp.float32)[..., None, :]
        if self.mins is not None:
            w = w + self.mins.astype(jnp.float32)[..., None, :]
        return w.reshape(*lead, n_blocks * BLOCK, out)[..., : self.n_in, :]


def _codes_f32(w: QuantizedWeight) -> jax.Array:
    """The codes as float32 ``[..., I/32, 32, O]`` (q4: nibbles unpacked, low then high)."""
    if w.format == "int8":
        return w.codes.astype(jnp.float32)
    return jnp.concatenate([w.codes & 15, w.codes >> 4], axis=-2).astype(jnp.float32)


def check_weight_format(value) -> str:
    """``value`` if it is one of :data:`WEIGHT_FORMATS`.

    Raises:
      JaxkvError: naming the bad value and the accepted ones.
    """
    if value not in WEIGHT_FORMATS:
        raise JaxkvError(f"weights={value!r} is not a weight format: expected one of {', '.join(WEIGHT_FORMATS)}")
    return value


def quantize(w: np.ndarray, fmt: str) -> QuantizedWeight:
    """Quantise a float matrix ``w[..., I, O]`` (``x @ W`` orientation) per block of 32 inputs.

    Args:
      w: float numpy array, at least 2-D; the blocks run along axis -2 (the inputs).
      fmt: ``"int8"`` (Q8_0-like) or ``"q4"`` (Q4_1-like); formulas in the module docstring.
    Returns:
      the :class:`QuantizedWeight` (numpy leaves; jnp.asarray them to place on a device).
    Raises:
      JaxkvError: another ``fmt``, or ``w`` of fewer than 2 dimensions.
    """
    if fmt not in ("int8", "q4"):
        raise JaxkvError(f"quantize: format {fmt!r}: expected 'int8' or 'q4'")
    w = np.asarray(w, np.float32)
    if w.ndim < 2:
        raise JaxkvError(f"quantize: a weight of shape {w.shape}: expected a matrix [..., I, O]")
    n_in, out = w.shape[-2:]
    pad = -n_in % BLOCK
    if pad:
        w = np.concatenate([w, np.zeros((*w.shape[:-2], pad, out), np.float32)], axis=-2)
    blocks = w.reshape(*w.shape[:-2], (n_in + pad) // BLOCK, BLOCK, out)
    if fmt == "int8":
        scale = np.abs(blocks).max(axis=-2) / 127
        scale = np.where(scale == 0, 1, scale).astype(np.float16)
        codes = np.clip(np.round(blocks / scale.astype(np.float32)[..., None, :]), -127, 127).astype(np.int8)
        return QuantizedWeight(codes=codes, scales=scale, mins=None, n_in=n_in, format=fmt)
    low, high = blocks.min(axis=-2), blocks.max(axis=-2)
    scale = (high - low) / 15
    scale = np.where(scale == 0, 1, scale).astype(np.float16)
    low = low.astype(np.float16)
    q = np.clip(np.round((blocks - low.astype(np.float32)[..., None, :]) / scale.astype(np.float32)[..., None, :]), 0, 15)
    q = q.astype(np.uint8)
    codes = q[..., : BLOCK // 2, :] | (q[..., BLOCK // 2 :, :] << 4)
    return QuantizedWeight(codes=codes, scales=scale, mins=low, n_in=n_in, format=fmt)


def convert(w: np.ndarray, fmt: str):
    """A float matrix ``w[..., I, O]`` held in weight format ``fmt``: a jax array of
    :data:`FLOAT_FORMATS` dtype, or a :class:`QuantizedWeight` with jax leaves.

    Raises:
      JaxkvError: ``fmt`` not in :data:`WEIGHT_FORMATS`.
    """
    check_weight_format(fmt)
    if fmt in FLOAT_FORMATS:
        return jnp.asarray(w, FLOAT_FORMATS[fmt])
    return jax.tree.map(jnp.asarray, quantize(w, fmt))


def dense(x: jax.Array, w, preferred_element_type=None) -> jax.Array:
    """``x @ W`` for a weight in any format: the one projection of every layer and the LM head.

    Args:
      x: ``[..., I]`` activations.
      w: ``[I, O]``: an array (any float dtype), or a :class:`QuantizedWeight`.
      preferred_element_type: for an array of ``x``'s dtype: the dot's result dtype
        (None: ``x @ w``'s).
    Returns:
      ``[..., O]``: in ``x``'s dtype (or ``preferred_element_type``) when ``w`` has it;
      float32 otherwise (a lower-precision array is upcast inside the dot; integer codes
      are dequantised on the fly, see :data:`DEQUANTIZE_TOKENS`).
    """
    if not isinstance(w, QuantizedWeight):
        if w.dtype == x.dtype:
            return x @ w if preferred_element_type is None else jnp.dot(x, w, preferred_element_type=preferred_element_type)
        return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
    x = x.astype(jnp.float32)
    if int(np.prod(x.shape[:-1])) >= DEQUANTIZE_TOKENS:
        return x @ w.dequantize()
    n_blocks = w.codes.shape[-3]
    if x.shape[-1] != n_blocks * BLOCK:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, n_blocks * BLOCK - x.shape[-1])])
    xb = x.reshape(*x.shape[:-1], n_blocks, BLOCK)
    if w.format == "int8":
        partial = jnp.einsum("...bk,bko->...bo", xb, w.codes.astype(jnp.float32))
    else:  # low nibbles hold inputs 0..15 of a block, high nibbles 16..31
        half = BLOCK // 2
        partial = (jnp.einsum("...bk,bko->...bo", xb[..., :half], (w.codes & 15).astype(jnp.float32))
                   + jnp.einsum("...bk,bko->...bo", xb[..., half:], (w.codes >> 4).astype(jnp.float32)))
    y = jnp.einsum("...bo,bo->...o", partial, w.scales.astype(jnp.float32))
    if w.mins is not None:
        y = y + jnp.einsum("...b,bo->...o", xb.sum(-1), w.mins.astype(jnp.float32))
    return y


def embed_lookup(table, tokens: jax.Array) -> jax.Array:
    """Rows of an embedding table for ``tokens``.

    Args:
      table: ``[V, D]`` array, or a :class:`QuantizedWeight` of its transpose ``[D, V]``.
      tokens: int32 ids ``[B, T]``.
    Returns:
      ``[B, T, D]``: in the table's dtype for an array; float32 for a QuantizedWeight (only
      the gathered columns are dequantised).
    """
    if not isinstance(table, QuantizedWeight):
        return jnp.take(table, tokens, axis=0)
    picked = QuantizedWeight(codes=jnp.take(table.codes, tokens.reshape(-1), axis=-1),
                             scales=jnp.take(table.scales, tokens.reshape(-1), axis=-1),
                             mins=None if table.mins is None else jnp.take(table.mins, tokens.reshape(-1), axis=-1),
                             n_in=table.n_in, format=table.format)
    return picked.dequantize().T.reshape(*tokens.shape, table.n_in)


def tied_head(table):
    """The LM head ``[D, V]`` of a tied embedding table (``table.T`` for an array; a
    :class:`QuantizedWeight` already holds the transpose)."""
    return table if isinstance(table, QuantizedWeight) else table.T
