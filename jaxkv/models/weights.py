"""Weights below float32: the weight formats, how a model holds its matrices
(:class:`TransposedWeight`, :class:`QuantizedWeight`), and the one projection every layer
and the LM head use, :func:`dense`.

A model's matrices (the projections, the MLP, the embedding table and the LM head) are
held in one of :data:`WEIGHT_FORMATS`; norms and biases always stay float32.

* ``fp32``: float32, ``x @ W`` as jaxkv computed before formats existed.
* ``bf16`` / ``fp16``: that dtype; activations stay float32 between layers and each
  product is ``x @ W`` with ``W`` converted inside the compiled step (the weights cross
  memory at 2 bytes each).
* ``int8``: symmetric int8 codes per block of 32 inputs, like GGUF ``Q8_0``:
  ``scale = max|w| / 127`` (1 where the block is all zero), ``q = round(w / scale)``,
  ``w' = q * scale``; one float16 scale per (output, block).
* ``q4``: 4-bit codes with a scale and a minimum per block of 32 inputs, like GGUF ``Q4_1``:
  ``scale = (max - min) / 15`` (1 where the block is constant), ``min = min``,
  ``q = clip(round((w - min) / scale), 0, 15)``, ``w' = q * scale + min``; two codes per
  ``uint8``: byte ``j`` of a row holds input ``j`` in its low nibble and input ``j + I'/2``
  in its high one (``I'``: the row's padded width), so each half of the row unpacks with
  one mask or one shift (ggml instead pairs ``j`` and ``j + 16`` within a block: held that
  way, XLA CPU's fused product indexed every nibble through the block and ran 4x slower);
  float16 scales and minimums.

* ``q8_0`` / ``q4_0`` / ``q4_1``: ggml's own block types, the bytes a GGUF file holds
  (:class:`BlockWeight`, quantised by ``gguf.quants.quantize``), multiplied by ggml's CPU
  product through ``jax.ffi`` (:mod:`jaxkv.models.ggml`: the activations quantised to 8 bits
  per block of 32, as llama.cpp computes) and dequantised inside the XLA program where that
  library is unavailable (another platform than the CPU, no compiler). The table and head of a
  4-bit model are ``q8_0``.

``int8`` and ``q4`` are dequantised on the fly inside the step (the compiled program takes
the int8 / uint8 codes as parameters; tests/test_weights.py checks its HLO). Scales are
stored as float16 (as GGUF stores them) and applied in float32.

Layout. jaxkv's matrices are ``W[..., I, O]`` in the ``x @ W`` orientation (leading axes:
the stacked layers L; :func:`jaxkv.models.llama.weight_shapes`). A model *holds* each one
transposed, ``[..., O, I]``, as ``torch.nn.Linear`` and GGUF do: :class:`TransposedWeight`
for the float formats, :class:`QuantizedWeight` (codes ``[..., O, I]`` int8 or
``[..., O, I/2]`` q4, flat along the inputs; scales and mins ``[..., O, I/32]``) for the
integer ones. With
the inputs on the minor axis, XLA CPU computes a one-token product (decode) as one loop
that reads each weight where it lies, in its format: the layer scan's slice of the stacked
weights, the conversion and the dequantisation all fuse into the dot, and nothing is
copied or written per layer. Held as ``[..., I, O]``, the same step copied every layer's
matrices out of the stack (fp32: 14.6 MB a layer on SmolLM2, every token) and wrote the
dequantised float32 codes before each dot (the int8 LM head alone: 113 MB a token); and
with the codes shaped ``[..., O, I/32, 32]`` (blocks as an axis) the fused int8 product ran
7x slower on an Intel Xeon (AVX-512, AMX) than with the same bytes shaped ``[..., O, I]``;
docs/PERFORMANCE.md has the measurements. An ``I`` that is not a multiple of 32 is padded
with zero weights (and :func:`dense` pads ``x`` with zeros), so every shape is accepted.
The embedding table ``[V, D]`` is its own tied LM head ``[D, V]`` held transposed: a float
table stays a plain array, a quantised one is the head's :class:`QuantizedWeight` (codes
``[V, D or D/2]``), and :func:`embed_lookup` gathers and dequantises only the rows it needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxkv.errors import JaxkvError
from jaxkv.models import ggml

WEIGHT_FORMATS = ("fp32", "bf16", "fp16", "int8", "q4", "q8_0", "q4_0", "q4_1")
"""The accepted ``weights=`` values (``load_model``, ``--weights``)."""
BLOCK_FORMATS = {"q8_0": 8, "q4_0": 2, "q4_1": 3}
"""The formats held in ggml's own block types (:class:`BlockWeight`) -> their ``ggml_type``
(``gguf.GGMLQuantizationType``) value."""
FLOAT_FORMATS = {"fp32": np.float32, "bf16": jnp.bfloat16, "fp16": np.float16}
"""The formats held as plain arrays -> their dtype."""
HEAD_FORMATS = {"q4": "int8", "q4_0": "q8_0", "q4_1": "q8_0"}
"""The format of the embedding table and LM head where it differs from the other matrices':
under ``q4`` they are int8 (under ``q4_0`` / ``q4_1``: ``q8_0``), as in llama.cpp's Q4_1 files
(SmolLM2's ``token_embd`` is Q8_0; at 4 bits the tied head alone costs +8 % perplexity on SmolLM2)."""
BLOCK = 32
"""Inputs per block of the integer formats (GGUF's ``QK8_0`` / ``QK4_1``)."""


class _Held:
    """What both held forms share: ``w[...]`` is ``w`` itself, as for an array
    (``nnx.Param(w)[...]`` reads it)."""

    def __getitem__(self, key):
        if key is not Ellipsis:
            raise JaxkvError(
                f"{type(self).__name__}[{key!r}]: only [...] is supported (slice the leaves with jax.tree.map)"
            )
        return self

    @property
    def nbytes(self) -> int:
        """Bytes held (every leaf)."""
        return sum(int(leaf.nbytes) for leaf in jax.tree.leaves(self))


@struct.dataclass
class TransposedWeight(_Held):
    """A float matrix ``W[..., I, O]`` held as its transpose (a pytree; see the module docstring).

    Attributes:
      t: ``[..., O, I]`` in any float dtype (float32, bfloat16, float16).
    """

    t: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape ``(..., I, O)``."""
        return (*self.t.shape[:-2], self.t.shape[-1], self.t.shape[-2])

    @property
    def dtype(self):
        """The dtype the matrix is held in."""
        return self.t.dtype

    def dequantize(self) -> jax.Array:
        """The matrix ``[..., I, O]`` in its dtype (an XLA transpose: for tests and inspection)."""
        return jnp.swapaxes(self.t, -1, -2)


@struct.dataclass
class QuantizedWeight(_Held):
    """A matrix ``W[..., I, O]`` as integer codes per block of 32 inputs, held transposed
    (a pytree; see the module docstring for the formats and the layout).

    Attributes:
      codes: ``int8[..., O, I']`` (``int8``) or ``uint8[..., O, I'/2]`` (``q4``, two 4-bit
        codes a byte: inputs ``j`` and ``j + I'/2``); ``I'`` is I padded to a multiple of 32.
      scales: ``float16[..., O, I/32]``.
      mins: ``float16[..., O, I/32]`` (``q4``), or None (``int8``: symmetric).
      n_in: I, the logical input width (the codes may hold zero padding up to a multiple of 32).
      format: ``"int8"`` or ``"q4"``.
    """

    codes: jax.Array
    scales: jax.Array
    mins: jax.Array | None
    n_in: int = struct.field(pytree_node=False)
    format: str = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape ``(..., I, O)``."""
        return (*self.codes.shape[:-2], self.n_in, self.codes.shape[-2])

    @property
    def dtype(self):
        """The codes' dtype (``int8``, or ``uint8`` for q4): what the weights are held as."""
        return self.codes.dtype

    def rows(self) -> jax.Array:
        """The float32 transpose ``[..., O, I']`` the codes stand for (``I'``: I padded to a
        multiple of 32 with zero weights). Inside a product this is never materialised for
        one token: XLA fuses it into the dot."""
        shape = (*self.scales.shape, BLOCK)
        per_input = lambda a: jnp.broadcast_to(a.astype(jnp.float32)[..., None], shape).reshape(*shape[:-2], -1)  # noqa: E731
        if self.format == "int8":
            return self.codes.astype(jnp.float32) * per_input(self.scales)
        return _unpack_halves(self.codes, jnp).astype(jnp.float32) * per_input(self.scales) + per_input(self.mins)

    def dequantize(self) -> jax.Array:
        """The float32 matrix ``[..., I, O]`` the codes stand for."""
        return jnp.swapaxes(self.rows()[..., : self.n_in], -1, -2)


_BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
"""Bytes of one block of 32 inputs in ggml's layout: a float16 scale ``d`` (and for Q4_1 a
float16 minimum ``m``), then the codes: 32 int8 (Q8_0), or 16 bytes whose low nibbles hold
inputs 0-15 and high nibbles 16-31 (Q4_0: ``(q - 8) * d``; Q4_1: ``q * d + m``)."""


@struct.dataclass
class BlockWeight(_Held):
    """A matrix ``W[..., I, O]`` held as ggml's blocks (``q8_0``, ``q4_0``, ``q4_1``: the bytes a
    GGUF file holds), transposed: one row of blocks per output. A product is ggml's own
    (:mod:`jaxkv.models.ggml`, an XLA custom call) where it is available, else the blocks are
    dequantised inside the XLA program.

    Attributes:
      blocks: ``uint8[..., O, I'/32 * bytes]`` (``I'``: I padded to a multiple of 32 with zero
        weights; bytes per block in :data:`_BLOCK_BYTES`).
      layer: None, or an int32 scalar: this weight is ``blocks[layer]`` of a stack of layers
        held whole (:meth:`at`: a layer scan reads the stack in place instead of copying
        each layer's slice for the custom call).
      n_in: I, the logical input width.
      format: one of :data:`BLOCK_FORMATS`.
    """

    blocks: jax.Array
    n_in: int = struct.field(pytree_node=False)
    format: str = struct.field(pytree_node=False)
    layer: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape ``(..., I, O)`` (of the one layer when :attr:`layer` is set)."""
        lead = self.blocks.shape[:-2] if self.layer is None else self.blocks.shape[1:-2]
        return (*lead, self.n_in, self.blocks.shape[-2])

    @property
    def dtype(self):
        """``uint8``: what the weights are held as."""
        return self.blocks.dtype

    def at(self, layer: jax.Array) -> BlockWeight:
        """Layer ``layer`` (an int32 scalar, traced or not) of a stacked weight, read in place."""
        return self.replace(layer=jnp.asarray(layer, jnp.int32))

    def rows(self) -> jax.Array:
        """The float32 transpose ``[..., O, I']`` the blocks stand for (XLA's dequantisation)."""
        return dequantize_blocks(self.blocks if self.layer is None else self.blocks[self.layer], self.format)

    def dequantize(self) -> jax.Array:
        """The float32 matrix ``[..., I, O]`` the blocks stand for."""
        return jnp.swapaxes(self.rows()[..., : self.n_in], -1, -2)


def dequantize_blocks(blocks: jax.Array, fmt: str) -> jax.Array:
    """float32 ``[..., O, I']`` of ggml blocks ``uint8[..., O, I'/32 * bytes]`` of format ``fmt``
    (:data:`_BLOCK_BYTES` has the layouts; jax.numpy, fused into the consumer by XLA)."""
    size = _BLOCK_BYTES[fmt]
    b = blocks.reshape(*blocks.shape[:-1], -1, size)
    half = lambda at: jax.lax.bitcast_convert_type(b[..., at : at + 2], jnp.float16).astype(jnp.float32)[..., None]  # noqa: E731
    if fmt == "q8_0":
        values = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32) * half(0)
    else:
        q = b[..., size - 16 :]
        codes = jnp.concatenate([q & 15, q >> 4], axis=-1).astype(jnp.float32)
        values = (codes - 8) * half(0) if fmt == "q4_0" else codes * half(0) + half(2)
    return values.reshape(*blocks.shape[:-1], -1)


HELD_FORMS = (TransposedWeight, QuantizedWeight, BlockWeight)
"""The pytree types a model's matrices are held as."""


def check_weight_format(value) -> str:
    """``value`` if it is one of :data:`WEIGHT_FORMATS`.

    Raises:
      JaxkvError: naming the bad value and the accepted ones.
    """
    if value not in WEIGHT_FORMATS:
        raise JaxkvError(f"weights={value!r} is not a weight format: expected one of {', '.join(WEIGHT_FORMATS)}")
    return value


def quantize(w: np.ndarray, fmt: str) -> QuantizedWeight | BlockWeight:
    """Quantise a float matrix ``w[..., I, O]`` (``x @ W`` orientation) per block of 32 inputs.

    Args:
      w: float numpy array, at least 2-D; the blocks run along axis -2 (the inputs).
      fmt: ``"int8"`` (Q8_0-like) or ``"q4"`` (Q4_1-like), formulas in the module docstring;
        or one of :data:`BLOCK_FORMATS`, quantised by ``gguf.quants.quantize`` (llama.cpp's
        reference quantisation, bit for bit).
    Returns:
      the :class:`QuantizedWeight` or :class:`BlockWeight` (numpy leaves, held transposed;
      jnp.asarray them to place on a device).
    Raises:
      JaxkvError: another ``fmt``, or ``w`` of fewer than 2 dimensions.
    """
    if fmt not in ("int8", "q4", *BLOCK_FORMATS):
        raise JaxkvError(f"quantize: format {fmt!r}: expected one of int8, q4, {', '.join(BLOCK_FORMATS)}")
    if np.ndim(w) < 2:
        raise JaxkvError(f"quantize: a weight of shape {np.shape(w)}: expected a matrix [..., I, O]")
    rows = np.swapaxes(np.asarray(w, np.float32), -1, -2)  # [..., O, I]: a view when w is float32
    lead, n_in = rows.shape[:-1], rows.shape[-1]
    flat = rows.reshape(-1, n_in)
    if fmt in BLOCK_FORMATS:
        blocks = np.concatenate([_quantize_blocks(flat[i : i + _ROWS], fmt) for i in range(0, len(flat), _ROWS)])
        return BlockWeight(blocks=blocks.reshape(*lead, -1), n_in=n_in, format=fmt)
    parts = [_quantize_rows(flat[i : i + _ROWS], fmt) for i in range(0, len(flat), _ROWS)]
    codes, scales, *mins = (np.concatenate(leaves).reshape(*lead, -1) for leaves in zip(*parts))
    return QuantizedWeight(codes=codes, scales=scales, mins=mins[0] if mins else None, n_in=n_in, format=fmt)


_ROWS = 4096
"""Rows :func:`quantize` quantises at a time: its float32 temporaries stay a few MB whatever the matrix."""


def _quantize_blocks(rows: np.ndarray, fmt: str) -> np.ndarray:
    """ggml blocks ``uint8[O, I'/32 * bytes]`` of float32 ``rows [O, I]`` (zero-padded to 32)."""
    import gguf

    pad = -rows.shape[-1] % BLOCK
    if pad:
        rows = np.concatenate([rows, np.zeros((*rows.shape[:-1], pad), np.float32)], axis=-1)
    return gguf.quants.quantize(np.ascontiguousarray(rows), gguf.GGMLQuantizationType(BLOCK_FORMATS[fmt]))


def _quantize_rows(rows: np.ndarray, fmt: str) -> tuple[np.ndarray, ...]:
    """``(codes, scales)`` (int8) or ``(codes, scales, mins)`` (q4) of float32 ``rows [O, I]``."""
    pad = -rows.shape[-1] % BLOCK
    if pad:
        rows = np.concatenate([rows, np.zeros((*rows.shape[:-1], pad), np.float32)], axis=-1)
    blocks = rows.reshape(*rows.shape[:-1], rows.shape[-1] // BLOCK, BLOCK)
    if fmt == "int8":
        scale = np.abs(blocks).max(axis=-1) / 127
        scale = np.where(scale == 0, 1, scale).astype(np.float16)
        codes = np.clip(np.round(blocks / scale.astype(np.float32)[..., None]), -127, 127).astype(np.int8)
        return codes.reshape(rows.shape), scale
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)
    scale = (high - low) / 15
    scale = np.where(scale == 0, 1, scale).astype(np.float16)
    low = low.astype(np.float16)
    q = np.clip(np.round((blocks - low.astype(np.float32)[..., None]) / scale.astype(np.float32)[..., None]), 0, 15)
    return _pack_halves(q.astype(np.uint8).reshape(rows.shape)), scale, low


def _pack_halves(q: np.ndarray) -> np.ndarray:
    """4-bit codes ``uint8[..., n]`` two a byte, ``[..., n/2]``: the first half in the low nibbles."""
    half = q.shape[-1] // 2
    return q[..., :half] | (q[..., half:] << 4)


def _unpack_halves(codes, xp):
    """The inverse of :func:`_pack_halves` (``xp``: numpy or jax.numpy)."""
    return xp.concatenate([codes & 15, codes >> 4], axis=-1)


def convert(w: np.ndarray, fmt) -> TransposedWeight | QuantizedWeight:
    """A float matrix ``w[..., I, O]`` held in weight format ``fmt`` (jax leaves): a
    :class:`TransposedWeight` of :data:`FLOAT_FORMATS` dtype, a :class:`QuantizedWeight` or a
    :class:`BlockWeight`.

    Converted on the host and placed on the device once (``jax.device_put``), so that
    converting a model's weights one by one holds at most one weight twice.

    Args:
      w: float array ``[..., I, O]`` (numpy, or anything ``np.asarray`` reads).
      fmt: one of :data:`WEIGHT_FORMATS`, or a float dtype to hold it in.
    Raises:
      JaxkvError: ``fmt`` neither a weight format nor a float dtype.
    """
    if isinstance(fmt, str) and check_weight_format(fmt) not in FLOAT_FORMATS:
        return jax.tree.map(jax.device_put, quantize(w, fmt))
    dtype = FLOAT_FORMATS[fmt] if isinstance(fmt, str) else fmt
    if not jnp.issubdtype(dtype, jnp.floating):
        raise JaxkvError(f"convert: {fmt!r} is neither a weight format ({', '.join(WEIGHT_FORMATS)}) nor a float dtype")
    return TransposedWeight(t=jax.device_put(np.ascontiguousarray(np.swapaxes(np.asarray(w, dtype), -1, -2))))


def dense(x: jax.Array, w, preferred_element_type=None) -> jax.Array:
    """``x @ W`` for a weight in any form: the one projection of every layer and the LM head.

    Args:
      x: ``[..., I]`` activations.
      w: ``[I, O]``: an array (any float dtype; a custom model's own weights), a
        :class:`TransposedWeight`, a :class:`QuantizedWeight` or a :class:`BlockWeight`.
      preferred_element_type: for weights of ``x``'s dtype: the dot's result dtype
        (None: ``x @ w``'s).
    Returns:
      ``[..., O]``: in ``x``'s dtype (or ``preferred_element_type``) when ``w`` has it;
      float32 otherwise (lower-precision weights are converted, integer codes dequantised,
      inside the dot). One row is computed as a vector (:func:`as_vector`).
    """
    lead = x.shape[:-1]
    return _dense(as_vector(x), w, preferred_element_type).reshape(*lead, -1)


def as_vector(x: jax.Array) -> jax.Array:
    """``x [..., D]`` as ``[D]`` when it holds one row (a decode step of one sequence), else ``x``.

    Why: XLA CPU fuses the computation of a one-token product's input vector into the product's
    loop, which recomputes it for every output row; an input computed in ``[1, 1, D]`` is then
    indexed through the unit axes at every step of that loop. Measured (30 stacked int8
    matrices 1,536 x 576, one token, a `lax.scan`): an RMSNorm input computed as ``[D]`` 0.118
    ms a matrix, as ``[1, 1, D]`` 0.199. :func:`dense`, RMSNorm and the gated MLP compute one
    row as a vector (docs/PERFORMANCE.md)."""
    return x.reshape(-1) if x.ndim > 1 and x.size == x.shape[-1] else x


def _dense(x, w, preferred_element_type):
    if isinstance(w, BlockWeight):
        return _block_product(x.astype(jnp.float32), w)
    if isinstance(w, QuantizedWeight):
        x = x.astype(jnp.float32)
        padded = w.scales.shape[-1] * BLOCK
        if x.shape[-1] != padded:
            x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - x.shape[-1])])
        return x @ w.rows().T
    if isinstance(w, TransposedWeight):
        if w.t.dtype == x.dtype:
            return (
                x @ w.t.T
                if preferred_element_type is None
                else jnp.dot(x, w.t.T, preferred_element_type=preferred_element_type)
            )
        return x.astype(jnp.float32) @ w.t.T.astype(jnp.float32)
    if w.dtype == x.dtype:
        return x @ w if preferred_element_type is None else jnp.dot(x, w, preferred_element_type=preferred_element_type)
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))


def _block_product(x, w: BlockWeight):
    """``x [..., I] @ W`` for ggml blocks: ggml's product for up to :data:`ggml.MAX_ROWS` rows
    where :mod:`jaxkv.models.ggml` is available, else XLA's dot with the blocks dequantised."""
    padded = w.blocks.shape[-1] // _BLOCK_BYTES[w.format] * BLOCK
    if x.shape[-1] != padded:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded - x.shape[-1])])
    if x.size // padded > ggml.MAX_ROWS or not ggml.available():
        return x @ w.rows().T
    if w.blocks.ndim > 2 and w.layer is None:
        raise JaxkvError(f"dense: a stack of {w.blocks.shape[:-2]} block weights: pick a layer with .at(i)")
    layer = jnp.zeros(1, jnp.int32) if w.layer is None else w.layer.reshape(1)
    out = ggml.mul_mat(x.reshape(-1, padded), w.blocks, layer, BLOCK_FORMATS[w.format])
    return out.reshape(*x.shape[:-1], -1)


def embed_lookup(table, tokens: jax.Array) -> jax.Array:
    """Rows of an embedding table for ``tokens``.

    Args:
      table: ``[V, D]`` array, or the :class:`QuantizedWeight` / :class:`BlockWeight` of its
        transpose ``[D, V]`` (codes ``[V, D or D/2]``, blocks ``[V, D/32 * bytes]``).
      tokens: int32 ids ``[B, T]``.
    Returns:
      ``[B, T, D]``: in the table's dtype for an array; float32 for a quantised table (only
      the gathered rows are dequantised).
    """
    if isinstance(table, BlockWeight):
        rows = dequantize_blocks(jnp.take(table.blocks, tokens.reshape(-1), axis=0), table.format)
        return rows[:, : table.n_in].reshape(*tokens.shape, table.n_in)
    if not isinstance(table, QuantizedWeight):
        return jnp.take(table, tokens, axis=0)
    ids = tokens.reshape(-1)
    picked = QuantizedWeight(
        codes=jnp.take(table.codes, ids, axis=0),
        scales=jnp.take(table.scales, ids, axis=0),
        mins=None if table.mins is None else jnp.take(table.mins, ids, axis=0),
        n_in=table.n_in,
        format=table.format,
    )
    return picked.rows()[:, : table.n_in].reshape(*tokens.shape, table.n_in)


def tied_head(table) -> TransposedWeight | QuantizedWeight | BlockWeight:
    """The LM head ``[D, V]`` of a tied embedding table ``[V, D]``: the table itself is the
    head held transposed (a quantised table already is the head's)."""
    return table if isinstance(table, (QuantizedWeight, BlockWeight)) else TransposedWeight(t=table)


def as_held(w) -> TransposedWeight | QuantizedWeight:
    """``w`` as a model holds it: a float array ``[..., I, O]`` becomes its
    :class:`TransposedWeight` (same dtype); a held form is returned as it is."""
    return w if isinstance(w, HELD_FORMS) else TransposedWeight(t=jnp.swapaxes(w, -1, -2))


def legacy_leaves(w) -> tuple[np.ndarray, ...]:
    """The leaves of a held matrix as jaxkv held them before the transposed layout, in their
    pytree order: ``(W[..., I, O],)`` for a :class:`TransposedWeight`; codes
    ``[..., I/32, 32 or 16, O]`` (q4 in ggml's packing: inputs ``j`` and ``j + 16`` of a block
    share byte ``j``), scales (and mins) ``[..., I/32, O]`` for a :class:`QuantizedWeight`.
    What a chat file's weights fingerprint hashes (:func:`jaxkv.decode.chat.model_fingerprint`),
    so that files saved before still resume."""
    if isinstance(w, TransposedWeight):
        return (np.swapaxes(np.asarray(w.t), -1, -2),)
    if isinstance(w, BlockWeight):  # newer than the transposed layout: its own leaves
        return (np.asarray(w.blocks),)
    codes = np.asarray(w.codes)
    if w.format == "q4":  # one code a byte, [..., O, I'], then packed within each block of 32
        codes = _unpack_halves(codes, np)
    blocks = codes.reshape(*codes.shape[:-1], -1, BLOCK)
    if w.format == "q4":
        blocks = _pack_halves(blocks)
    out = (np.moveaxis(blocks, -3, -1), np.swapaxes(np.asarray(w.scales), -1, -2))
    return out if w.mins is None else (*out, np.swapaxes(np.asarray(w.mins), -1, -2))
