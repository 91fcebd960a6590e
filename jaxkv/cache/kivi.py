"""KIVI kernels: asymmetric (affine) low-bit quantisation of keys and values.

Source: Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV
Cache", arXiv 2402.02750, §3.2 (per-channel keys, per-token values) and §4 (grouped
keys, packed low-bit codes). The cache semantics that use these kernels are in
DESIGN.md §2 "KIVI quantisation".

Layout and axes (DESIGN.md §1): every kernel takes ``[..., T, H]`` -- any number of
leading dims (``L`` layers, ``B`` rows, ``K`` kv heads, ...), then ``T`` tokens, then
``H`` head-dim channels.

- Keys are quantised **per channel** in groups of ``G = group_size`` consecutive
  tokens: one ``(scale, zero)`` per ``(..., group of G tokens, channel h)``.
- Values are quantised **per token**: one ``(scale, zero)`` per ``(..., token)``,
  over the ``H`` channels.

Both are thin wrappers around one core, :func:`quantize_affine` /
:func:`dequantize_affine`, whose reduction ``axis`` (and ``group_size`` along it) is a
parameter, so KIVI's Table-1 ablation (keys per token, values per channel) is
``quantize_affine(k, axis=-1)`` / ``quantize_affine(v, axis=-2, group_size=G)``.

Affine quantisation (all arithmetic in float32 whatever the input, scale or output
dtype), with ``levels = 2**bits - 1``::

    zero  = min(x over the group)                     -> stored in scale_dtype
    scale = max(eps, (max/2 - zero/2) * (2 / levels))  -> stored in scale_dtype
            # = (max - zero) / levels
    q     = clip(round((x - zero) * (1 / scale)), 0, levels)   (round half to even)
    x'    = q * scale + zero

Divisions are written as multiplications by a float32 reciprocal on purpose: XLA's
algebraic simplifier rewrites ``a / broadcast(b)`` into ``a * broadcast(1 / b)`` (seen
on CPU), so spelling it out gives the same codes on every backend and in the NumPy
reference, and lets us keep the reciprocal out of the subnormal range (a flush-to-zero
backend would turn ``1 / 2e38`` into 0).

Numerical decisions (the bug class of the previous attempt was silent NaN):

1. **Codes come from the stored scale/zero.** ``zero`` is rounded *down* and
   ``scale`` rounded *up* into ``scale_dtype`` (directed rounding, not nearest), then
   cast back to float32, and the codes are computed from these stored values. So
   ``[zero, zero + levels * scale]`` always covers the group and every element
   round-trips within ``scale / 2`` of the *stored* scale (plus float32 rounding),
   whatever ``scale_dtype`` is.
2. **eps** is ``max(finfo(scale_dtype).tiny, 2**-100)``: the smallest *normal*
   float16 (6.1e-5) for float16 scales, ``2**-100`` (7.9e-31) for float32 and bfloat16
   scales (so that ``4 / scale`` stays a normal float32). Scales never underflow to
   zero or to a subnormal, so there is no division by zero and nothing for a
   flush-to-zero backend to flush. A constant group gets ``scale = eps`` and
   ``q = 0``, so it reconstructs to ``zero`` -- exactly the constant whenever the
   constant is representable in ``scale_dtype`` (always for float32 scales; for
   float16 scales e.g. 0, 1.5, -3, any float16 input). A constant that float16 cannot
   represent reconstructs within ``eps / 2`` (``scale / 2``) like any other value.
3. **No overflow, no inf, no NaN for finite inputs.** Ranges are computed as
   ``max / 2 - zero / 2`` (finite even for ``max = 3e38, zero = -3e38``), codes as
   ``(x / 4 - zero / 4) * (4 / scale)`` and reconstruction as ``q * scale + zero`` or,
   when that could overflow float32, as ``2 * (q * (scale / 2) + zero / 2)``; all are
   the same numbers as the plain formulas wherever those do not overflow (XLA on CPU
   fuses ``q * scale + zero`` into an FMA, which cannot overflow either; the halved
   form is for backends that do not). Scales are clamped to
   ``[eps, finfo(scale_dtype).max]``.
4. **Saturation of out-of-range values.** float16 scale/zero storage cannot hold
   values beyond +-65504. ``zero`` is clamped into ``[-max, max]`` of ``scale_dtype``
   before it is stored, and ``scale`` to at most ``max``. Consequences, all finite:
   a group whose minimum is below ``-65504`` reconstructs its elements below
   ``-65504`` as about ``-65504`` (saturated); a group whose minimum is above
   ``65504`` keeps ``zero = 65504`` and a larger scale (still within ``scale / 2``);
   elements above ``zero + levels * 65504`` saturate there. Choose
   ``scale_dtype=jnp.float32`` when activations can exceed float16's range
   (bfloat16 has float32's range). The dequantised result is saturated into the
   finite range of the requested output ``dtype`` before the cast, so it is never
   +-inf either.
5. Inputs must be finite: a NaN or inf in a group makes that group's codes
   undefined (NaN in, garbage out; no check is made on traced values).

Packing (DESIGN.md §2): codes are packed along the last (H) axis, ``cpb = 8 // bits``
codes per ``uint8`` byte, in a **split-half** layout: the first half of the channels
goes to the low bits and the second half to the high bits, recursively::

    int4: packed[..., i] = c[i] | c[i + H/2] << 4                                  i < H/2
    int2: packed[..., i] = c[i] | c[i + H/2] << 2 | c[i + H/4] << 4 | c[i + 3H/4] << 6    i < H/4

int8 is the identity. Each bit field of a byte is thus a contiguous block of H/cpb
channels: :func:`unpack_codes` splits each byte into its fields and concatenates them
along H, and :func:`dequantize_affine` with ``blocks=True`` dequantises each block as
its own elementwise loop (exact float32 ``floor`` arithmetic, which XLA CPU vectorises
better than byte shifts), never concatenating them: attention contracts block by block.
llama.cpp's Q4_0 blocks split halves the same way. Only shifts, masks, ORs, floors and
concatenations are used (no popcnt/clz, no scatter, no unsigned
*index* dtypes; ``uint8`` is a storage dtype only), per the jax-metal hazards of
DESIGN.md §4.

All errors a caller can cause (bad ``bits``, ``T % group_size != 0``,
``H % cpb != 0``, bad dtypes) raise :class:`jaxkv.errors.JaxkvError` at trace time,
before anything reaches XLA.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.errors import JaxkvError

__all__ = [
    "SUPPORTED_BITS",
    "QuantizedTensor",
    "QuantizedKeys",
    "QuantizedValues",
    "codes_per_byte",
    "pack_codes",
    "unpack_codes",
    "quantize_affine",
    "dequantize_affine",
    "CODEBOOKS",
    "CLIP_RANGES",
    "normal_codebook",
    "quantize_keys",
    "dequantize_keys",
    "quantize_values",
    "dequantize_values",
]

SUPPORTED_BITS = (8, 4, 2)
"""Code widths KIVI supports here; codes per byte is ``8 // bits``."""

_SCALE_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2)
_OUT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
# Signed integers of the same width, for the exact one-ulp steps of directed rounding.
_SAME_WIDTH_INT = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32}
# Lower bound of eps whatever the scale dtype: keeps 4 / scale a normal float32.
_EPS_FLOOR = 2.0**-100

CODEBOOKS = ("uniform", "normal")
"""Level sets of the codes: ``uniform`` (KIVI's affine integer levels over the group's range) or
``normal`` (Lloyd-Max levels of a standard normal, :func:`normal_codebook`, over the group's mean
and standard deviation; 4- and 2-bit codes)."""

CLIP_RANGES = {"uniform": (1.0, 0.9, 0.8, 0.7, 0.6, 0.5), "normal": (1.0, 0.85, 1.15, 0.7, 1.3)}
"""Candidate ranges of the clipping search of each codebook (``clip=True`` of the storages), as
fractions of its full range (``uniform``: min to max; ``normal``: the standard deviation): each
group keeps the candidate of least squared reconstruction error. Measured on Gaussian and Laplace
data (groups of 32 tokens, of 64 channels): 2-bit uniform codes' error falls by 36-48 %."""


@functools.cache
def normal_codebook(bits: int) -> tuple[float, ...]:
    """The ``2**bits`` Lloyd-Max reconstruction levels of a standard normal, ascending: the levels
    of least mean squared error for N(0, 1) (Lloyd 1982; Max 1960), e.g. +-0.4528, +-1.5104 at 2
    bits. KVQuant (Hooper et al. 2024, arXiv 2401.18079, §3.4) fits non-uniform levels to the keys'
    and values' distribution; a group normalised by its mean and standard deviation (after a
    Hadamard rotation, nearly Gaussian) takes these fixed ones.

    Raises:
      JaxkvError: ``bits`` other than 4 or 2.
    """
    if bits not in (4, 2):
        raise JaxkvError(f"bits={bits!r}: the normal codebook is for 4- or 2-bit codes (8-bit codes stay uniform)")
    n = 2**bits
    pdf = lambda x: 0.0 if math.isinf(x) else math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2))) if not math.isinf(x) else float(x > 0)  # noqa: E731
    levels = [-3 + 6 * (i + 0.5) / n for i in range(n)]
    for _ in range(1000):  # Lloyd's iteration: thresholds at midpoints, levels at the cells' centroids
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
        levels = [(pdf(a) - pdf(b)) / (cdf(b) - cdf(a)) for a, b in zip(edges, edges[1:])]
    return tuple(float(np.float32(x)) for x in levels)


class QuantizedTensor(NamedTuple):
    """Output of :func:`quantize_affine` (a pytree).

    Attributes:
      codes: ``uint8[..., H // cpb]`` packed codes (the input's shape, last axis packed).
      scale: ``scale_dtype[...]`` the input's shape with the reduction ``axis`` replaced
        by its number of groups ``n = x.shape[axis] // group_size``.
      zero: same shape and dtype as ``scale``.
    """

    codes: jax.Array
    scale: jax.Array
    zero: jax.Array


class QuantizedKeys(NamedTuple):
    """KIVI keys, per channel in groups of G tokens (a pytree).

    Attributes:
      codes: ``uint8[..., T, H // cpb]``; ``T * H / cpb`` bytes per leading index.
      scale: ``scale_dtype[..., T // G, H]``.
      zero: ``scale_dtype[..., T // G, H]``.
    """

    codes: jax.Array
    scale: jax.Array
    zero: jax.Array


class QuantizedValues(NamedTuple):
    """KIVI values, per token (a pytree).

    Attributes:
      codes: ``uint8[..., T, H // cpb]``; ``T * H / cpb`` bytes per leading index.
      scale: ``scale_dtype[..., T]``.
      zero: ``scale_dtype[..., T]``.
    """

    codes: jax.Array
    scale: jax.Array
    zero: jax.Array


# --------------------------------------------------------------------------- checks


def codes_per_byte(bits: Any) -> int:
    """Codes per ``uint8`` byte for a code width: 1, 2 or 4 for bits 8, 4, 2.

    Raises:
      JaxkvError: ``bits`` is not one of 8, 4, 2.
    """
    ok = isinstance(bits, (int, np.integer)) and not isinstance(bits, (bool, np.bool_))
    if not ok or int(bits) not in SUPPORTED_BITS:
        raise JaxkvError(f"bits={bits!r} is not supported; KIVI codes are 8, 4 or 2 bits wide")
    return 8 // int(bits)


def _check_float_dtype(dtype: Any, *, name: str, allowed: tuple) -> jnp.dtype:
    names = ", ".join(jnp.dtype(a).name for a in allowed)
    try:
        dt = jnp.dtype(dtype)
    except TypeError as err:
        raise JaxkvError(f"{name}={dtype!r} is not a dtype; use one of {names}") from err
    if dt not in [jnp.dtype(a) for a in allowed]:
        raise JaxkvError(
            f"{name}={dt.name} is not supported; use one of {names} (float64 and complex do not run on jax-metal)"
        )
    return dt


def _check_last_axis(h: int, bits: int) -> int:
    cpb = codes_per_byte(bits)
    if h % cpb != 0:
        raise JaxkvError(
            f"head dim H={h} is not a multiple of {cpb}, the codes per byte at bits={bits}; "
            f"packing {bits}-bit codes needs H % {cpb} == 0"
        )
    return cpb


def _normalise_axis(axis: Any, ndim: int) -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool) or not -ndim <= axis < ndim:
        raise JaxkvError(f"axis={axis!r} is out of range for an input of rank {ndim}")
    return int(axis) % ndim


def _check_groups(length: int, group_size: Any, *, what: str) -> int:
    """Group size along the reduction axis (``None`` = the whole axis)."""
    if group_size is None:
        return length
    ok = isinstance(group_size, (int, np.integer)) and not isinstance(group_size, bool)
    if not ok or group_size < 1:
        raise JaxkvError(f"group_size={group_size!r} must be a positive int")
    if length % group_size != 0:
        raise JaxkvError(f"{what}={length} is not a multiple of group_size={group_size}; quantise whole groups only")
    return int(group_size)


# ----------------------------------------------------------------------- packing


def _pack(codes: jax.Array, bits: int) -> jax.Array:
    while bits < 8:  # fold the second half of H into the high bits of the first half
        half = codes.shape[-1] // 2
        codes = codes[..., :half] | (codes[..., half:] << bits)
        bits *= 2
    return codes


def _planes(packed: jax.Array, bits: int) -> list[jax.Array]:
    """The ``cpb`` contiguous channel blocks ``[..., H/cpb]`` of packed codes, in channel order,
    as exact float32 codes (``hi = floor(x / 2**w)``, ``lo = x - 2**w * hi``): XLA CPU
    vectorises this float arithmetic better than byte shifts and masks."""
    planes, width = [packed.astype(jnp.float32)], 8
    while width > bits:  # the low bits hold the first half of the channels, the high bits the second
        width //= 2
        high = [jnp.floor(x * np.float32(1.0 / (1 << width))) for x in planes]
        planes = [x - np.float32(1 << width) * hi for x, hi in zip(planes, high)] + high
    return planes


def _unpack(packed: jax.Array, bits: int) -> jax.Array:
    if bits == 8:
        return packed
    return jnp.concatenate(_planes(packed, bits), axis=-1).astype(jnp.uint8)


@functools.partial(jax.jit, static_argnames=("bits",))
def pack_codes(codes: jax.Array, *, bits: int) -> jax.Array:
    """Pack ``uint8[..., H]`` codes in ``[0, 2**bits)`` into ``uint8[..., H // cpb]``.

    ``cpb = 8 // bits``, split-half layout (module docstring): int4 byte ``i`` holds
    channel ``i`` in its low nibble and ``i + H/2`` in its high nibble; int2 byte ``i``
    holds channels ``i, i + H/2, i + H/4, i + 3H/4`` at bits 0, 2, 4, 6. Bits of a code
    above ``bits`` are not masked off (the quantiser never produces them).
    Output bytes: ``prod(leading) * H / cpb``.

    Raises:
      JaxkvError: ``bits`` not in {8, 4, 2}, or ``H % cpb != 0``.
    """
    codes_per_byte(bits)
    chex.assert_type(codes, jnp.uint8)
    chex.assert_rank(codes, {i for i in range(1, 16)})
    _check_last_axis(codes.shape[-1], bits)
    return _pack(codes, bits)


@functools.partial(jax.jit, static_argnames=("bits",))
def unpack_codes(packed: jax.Array, *, bits: int) -> jax.Array:
    """Inverse of :func:`pack_codes`: ``uint8[..., H // cpb] -> uint8[..., H]``.

    Raises:
      JaxkvError: ``bits`` not in {8, 4, 2}.
    """
    codes_per_byte(bits)
    chex.assert_type(packed, jnp.uint8)
    chex.assert_rank(packed, {i for i in range(1, 16)})
    return _unpack(packed, bits)


# ------------------------------------------------------------------ affine core


def _round_directed(x: jax.Array, dtype: jnp.dtype, *, up: bool) -> jax.Array:
    """Round finite float32 ``x`` (within ``dtype``'s range) into ``dtype``, toward +inf
    (``up``) or -inf. Exact: round to nearest, then step one ulp via an integer bitcast
    where the nearest value lies on the wrong side."""
    if dtype == np.float32:
        return x
    y = x.astype(dtype)
    yf = y.astype(jnp.float32)
    wrong = (yf < x) if up else (yf > x)
    ity = _SAME_WIDTH_INT[dtype.itemsize]
    i = jax.lax.bitcast_convert_type(y, ity)
    min_int = jnp.iinfo(ity).min  # the bit pattern of -0.0
    if up:
        # +x (i >= 0) -> i + 1 ; -x (i < 0) -> i - 1 ; -0.0 -> smallest positive subnormal.
        stepped = jnp.where(i == min_int, jnp.ones_like(i), jnp.where(i >= 0, i + 1, i - 1))
    else:
        # +x (i > 0) -> i - 1 ; -x (i < 0) -> i + 1 ; +0.0 -> smallest negative subnormal.
        stepped = jnp.where(i == 0, jnp.full_like(i, min_int + 1), jnp.where(i > 0, i - 1, i + 1))
    stepped = jax.lax.bitcast_convert_type(stepped, dtype)
    return jnp.where(wrong, stepped, y)


def _dequant_f32(q: jax.Array, scale: jax.Array, zero: jax.Array, levels: int) -> jax.Array:
    """``q * scale + zero`` in float32 without intermediate overflow (finite inputs)."""
    big = np.float32(np.finfo(np.float32).max / 2)
    plain = q * scale + zero
    halved = (q * (scale * 0.5) + zero * 0.5) * 2.0
    safe = (scale <= big / levels) & (jnp.abs(zero) <= big)
    out = jnp.where(safe, plain, halved)
    fmax = np.float32(np.finfo(np.float32).max)
    return jnp.clip(out, -fmax, fmax)


@functools.partial(jax.jit, static_argnames=("bits", "axis", "group_size", "scale_dtype", "codebook", "clip"))
def quantize_affine(
    x: jax.Array,
    *,
    bits: int,
    axis: int,
    group_size: int | None = None,
    scale_dtype: Any = jnp.float16,
    codebook: str = "uniform",
    clip: tuple | None = None,
) -> QuantizedTensor:
    """Affine-quantise ``x`` with one ``(scale, zero)`` per group along ``axis``.

    The core of KIVI (arXiv 2402.02750 §3.2): ``axis=-2, group_size=G`` on ``[..., T, H]``
    is per-channel quantisation in groups of G tokens (KIVI keys); ``axis=-1,
    group_size=None`` is per-token quantisation over H (KIVI values). Codes are always
    packed along the last axis (see the module docstring for the numerics and layout).

    Args:
      x: ``float16 | bfloat16 | float32 [..., H]`` (rank >= 1), finite.
      bits: 8, 4 or 2 (static).
      axis: the reduction axis (static); negative values count from the end.
      group_size: elements per group along ``axis`` (static); ``None`` = the whole axis.
      scale_dtype: storage dtype of scale and zero: float16 (default, as KIVI),
        bfloat16, float32, or 8-bit float8_e4m3fn / float8_e5m2 (static; half float16's
        metadata bits, rounded by the same directed rule; their smallest normal, 2**-6 and
        2**-14, is the smallest scale, so a group narrower than 2**-6 * levels loses resolution in
        float8_e4m3fn).
      codebook: the code levels (static, :data:`CODEBOOKS`): ``uniform`` (KIVI, above) or
        ``normal``: ``zero`` = the group's mean, ``scale`` = its standard deviation, ``q`` = the
        nearest of the levels ``c`` of :func:`normal_codebook`, ``x' = scale * c[q] + zero``
        (4- and 2-bit codes).
      clip: None, or candidate ranges as fractions of the full one (static, e.g.
        :data:`CLIP_RANGES`): ``uniform`` shrinks ``[min, max]`` towards the group's mean by each
        fraction, ``normal`` multiplies ``scale``; each group keeps the candidate of least squared
        reconstruction error (clipping search: the range that best trades the clipped tails for a
        finer step, what min-max ranges waste at 2 bits). Clipped elements saturate at the
        range's ends, so the ``scale / 2`` bound (decision 1) holds inside the range only.

    Returns:
      ``QuantizedTensor(codes=uint8[..., H // cpb], scale, zero)``; ``scale`` and
      ``zero`` have ``x``'s shape with ``axis`` replaced by ``x.shape[axis] //
      group_size`` groups. Bytes: ``x.size / cpb`` of codes plus ``2 * itemsize`` per
      group.

    Raises:
      JaxkvError: ``bits`` not in {8, 4, 2}; ``H % (8 // bits) != 0``;
        ``x.shape[axis] % group_size != 0``; ``axis`` out of range; an unsupported
        ``scale_dtype`` or input dtype; a ``codebook`` not in :data:`CODEBOOKS` (``normal``
        with 8-bit codes); ``clip`` not a tuple of fractions in (0, 1] (``uniform``) or > 0.
    """
    codes_per_byte(bits)
    _check_codebook(codebook, bits)
    if clip is not None and (
        not isinstance(clip, tuple)
        or not clip
        or not all(isinstance(c, float) and 0 < c <= (1 if codebook == "uniform" else 4) for c in clip)
    ):
        raise JaxkvError(
            f"clip={clip!r}: expected None or a tuple of range fractions in (0, 1], e.g. {CLIP_RANGES[codebook]}"
        )
    sdt = _check_float_dtype(scale_dtype, name="scale_dtype", allowed=_SCALE_DTYPES)
    _check_float_dtype(x.dtype, name="input dtype", allowed=_OUT_DTYPES)
    chex.assert_type(x, float)
    ax = _normalise_axis(axis, x.ndim)
    _check_last_axis(x.shape[-1], bits)
    g = _check_groups(x.shape[ax], group_size, what=f"x.shape[{axis}]")
    n = x.shape[ax] // g
    levels = 2**bits - 1

    # [..., n, g, ...]: reduce over the g axis (ax + 1), keeping it for broadcasting.
    grouped = x.astype(jnp.float32).reshape(x.shape[:ax] + (n, g) + x.shape[ax + 1 :])
    if codebook != "uniform" or clip is not None:
        zero_s, scale_s, q = _search(grouped, ax + 1, bits, sdt, codebook, clip or (1.0,))
        return QuantizedTensor(
            codes=_pack(q.reshape(x.shape), bits),
            scale=jnp.squeeze(scale_s, axis=ax + 1),
            zero=jnp.squeeze(zero_s, axis=ax + 1),
        )
    lo = jnp.min(grouped, axis=ax + 1, keepdims=True)
    hi = jnp.max(grouped, axis=ax + 1, keepdims=True)
    zero_s, scale_s, q = _affine(grouped, lo, hi, levels, sdt)
    q = q.astype(jnp.uint8).reshape(x.shape)
    codes = _pack(q, bits)

    chex.assert_type(codes, jnp.uint8)
    return QuantizedTensor(
        codes=codes,
        scale=jnp.squeeze(scale_s, axis=ax + 1),
        zero=jnp.squeeze(zero_s, axis=ax + 1),
    )


def _affine(x: jax.Array, lo: jax.Array, hi: jax.Array, levels: int, sdt) -> tuple:
    """``(zero, scale, codes)`` of float32 groups ``x`` over the range ``[lo, hi]`` (size-1 dims along
    the groups' axis): zero rounded down and scale rounded up into ``sdt`` (numerical decisions 1-4),
    float32 codes in ``[0, levels]`` from the stored values."""
    finfo = jnp.finfo(sdt)
    smax, eps = np.float32(finfo.max), np.float32(max(float(finfo.tiny), _EPS_FLOOR))
    zero_s = _round_directed(jnp.clip(lo, -smax, smax), sdt, up=False)
    zero = zero_s.astype(jnp.float32)  # <= lo unless lo < -smax (saturated)
    half_range = hi * 0.5 - zero * 0.5  # (hi - zero) / 2, never overflows
    scale_s = _round_directed(jnp.clip(half_range * np.float32(2.0 / levels), eps, smax), sdt, up=True)
    scale = scale_s.astype(jnp.float32)
    # (x - zero) * (1 / scale) as (x/4 - zero/4) * (4 / scale): the same float32 numbers
    # (powers of two), but neither the difference overflows nor 4/scale leaves the
    # normal range (scale in [2**-100, 2**128)).
    t = (x * 0.25 - zero * 0.25) * (np.float32(4.0) / scale)
    return zero_s, scale_s, jnp.clip(jnp.round(t), 0, levels)


def _check_codebook(codebook: Any, bits: int) -> None:
    if codebook not in CODEBOOKS:
        raise JaxkvError(f"codebook={codebook!r}: expected one of {', '.join(CODEBOOKS)}")
    if codebook == "normal":
        normal_codebook(bits)


def _search(x: jax.Array, axis: int, bits: int, sdt, codebook: str, ranges: tuple) -> tuple:
    """``(zero, scale, codes)`` of groups along ``axis`` of float32 ``x`` (kept as size-1 dims; codes
    ``uint8``, x's shape): of the candidate ranges, each group's least squared error
    (:func:`quantize_affine`'s ``codebook`` and ``clip``)."""
    finfo = jnp.finfo(sdt)
    smax, eps = np.float32(finfo.max), np.float32(max(float(finfo.tiny), _EPS_FLOOR))
    mean = jnp.mean(x, axis=axis, keepdims=True)
    if codebook == "normal":
        table = np.asarray(normal_codebook(bits), np.float32)
        mids = (table[1:] + table[:-1]) * np.float32(0.5)
        zero_s = jnp.clip(mean, -smax, smax).astype(sdt)
        zero = zero_s.astype(jnp.float32)
        spread = jnp.sqrt(jnp.mean(jnp.square(x - zero), axis=axis, keepdims=True))
    else:
        lo, hi = jnp.min(x, axis=axis, keepdims=True), jnp.max(x, axis=axis, keepdims=True)
    best = None
    for c in ranges:
        if codebook == "normal":
            scale_s = _round_directed(jnp.clip(spread * np.float32(c), eps, smax), sdt, up=True)
            scale = scale_s.astype(jnp.float32)
            t = (x * 0.25 - zero * 0.25) * (np.float32(4.0) / scale)
            q = sum((t > m).astype(jnp.int32) for m in mids)
            rec = jnp.asarray(table)[q] * scale + zero
        else:
            lo_c = lo if c == 1.0 else mean + np.float32(c) * (lo - mean)
            hi_c = hi if c == 1.0 else mean + np.float32(c) * (hi - mean)
            zero_s, scale_s, q = _affine(x, lo_c, hi_c, 2**bits - 1, sdt)
            rec = q * scale_s.astype(jnp.float32) + zero_s.astype(jnp.float32)
        err = jnp.sum(jnp.square(rec - x), axis=axis, keepdims=True)
        if best is None:
            best = (err, zero_s, scale_s, q)
        else:
            better = err < best[0]
            best = tuple(jnp.where(better, new, old) for new, old in zip((err, zero_s, scale_s, q), best))
    return best[1], best[2], best[3].astype(jnp.uint8)


@functools.partial(jax.jit, static_argnames=("bits", "axis", "group_size", "dtype", "blocks", "codebook"))
def dequantize_affine(
    qt: QuantizedTensor,
    *,
    bits: int,
    axis: int,
    group_size: int | None = None,
    dtype: Any = jnp.float32,
    blocks: bool = False,
    codebook: str = "uniform",
) -> jax.Array | list[jax.Array]:
    """Inverse of :func:`quantize_affine`: ``x' = q * scale + zero`` in float32 (``codebook``
    ``normal``: ``c[q] * scale + zero``), cast last.

    Args:
      qt: ``(codes=uint8[..., H // cpb], scale, zero)`` as returned by
        :func:`quantize_affine` (any NamedTuple with those three fields).
      bits, axis, group_size: as given to :func:`quantize_affine` (static).
      dtype: output dtype, normally the query's (float16, bfloat16 or float32; static).
        Values beyond its finite range saturate to +-max (never inf).
      blocks: return the channel blocks instead of one array (static): a list of 1 or
        ``cpb`` arrays ``dtype[..., H / len]`` whose concatenation along H is the array.
        Attention contracts each block on its own (:mod:`jaxkv.cache.attention`), which
        keeps every XLA fusion a contiguous elementwise loop (on XLA CPU, dequantising
        int4 keys into one concatenated array and attending took 2-4x as long).
      codebook: as given to :func:`quantize_affine` (static).

    Returns:
      ``dtype[..., H]``, the shape of the quantised input (or its blocks, see ``blocks``).

    Raises:
      JaxkvError: ``bits`` not in {8, 4, 2}; ``group_size`` inconsistent with the
        scale's shape; an unsupported ``dtype``; a ``codebook`` :func:`quantize_affine` refuses.
    """
    codes_per_byte(bits)
    _check_codebook(codebook, bits)
    odt = _check_float_dtype(dtype, name="dtype", allowed=_OUT_DTYPES)
    codes, scale, zero = qt.codes, qt.scale, qt.zero
    chex.assert_type(codes, jnp.uint8)
    chex.assert_type([scale, zero], float)
    chex.assert_equal_shape([scale, zero])
    shape = codes.shape[:-1] + (codes.shape[-1] * codes_per_byte(bits),)
    ax = _normalise_axis(axis, len(shape))
    chex.assert_rank(scale, len(shape))
    n = scale.shape[ax]
    if n < 1 or shape[ax] % n != 0:
        raise JaxkvError(f"scale has {n} groups along axis {axis}, which does not divide {shape[ax]}")
    g = shape[ax] // n
    if group_size is not None and group_size != g:
        raise JaxkvError(
            f"group_size={group_size!r} does not match the codes: {shape[ax]} elements "
            f"in {n} groups along axis {axis} (check bits={bits} and group_size)"
        )
    chex.assert_shape(scale, shape[:ax] + (n,) + shape[ax + 1 :])
    s, z = scale.astype(jnp.float32), zero.astype(jnp.float32)
    last = ax == len(shape) - 1
    planes = _planes(codes, bits)
    hb = codes.shape[-1]  # channels per plane
    if last and n > 1 and hb % g:  # groups along H straddle the planes: dequantise them joined
        planes, hb = [jnp.concatenate(planes, axis=-1)], shape[-1]

    def dequant_block(j: int, plane: jax.Array) -> jax.Array:
        # channel block j: [j * hb, (j + 1) * hb), dequantised alone (one contiguous
        # elementwise loop from the packed bytes, which XLA fuses with the unpacking)
        if not last:
            sj, zj, nj = s[..., j * hb : (j + 1) * hb], z[..., j * hb : (j + 1) * hb], n
        elif n == 1:
            sj, zj, nj = s, z, 1
        else:
            sj, zj, nj = s[..., j * hb // g : (j + 1) * hb // g], z[..., j * hb // g : (j + 1) * hb // g], hb // g
        grouped = plane.reshape(plane.shape[:ax] + (nj, -1) + plane.shape[ax + 1 :])
        sj, zj = jnp.expand_dims(sj, ax + 1), jnp.expand_dims(zj, ax + 1)
        if codebook == "normal":  # the codes' levels (|c| < 3)
            grouped = jnp.asarray(np.asarray(normal_codebook(bits), np.float32))[grouped.astype(jnp.int32)]
        if jnp.finfo(scale.dtype).max <= 65504:  # |q * scale + zero| <= 256 * 65504: float32 cannot overflow
            x = grouped * sj + zj
        else:
            x = _dequant_f32(grouped, sj, zj, 2**bits - 1)
        return x.reshape(plane.shape)

    def cast(x: jax.Array) -> jax.Array:
        if odt != jnp.float32:
            omax = np.float32(jnp.finfo(odt).max)
            x = jnp.clip(x, -omax, omax)
        return x.astype(odt)

    out = [cast(dequant_block(j, plane)) for j, plane in enumerate(planes)]
    if blocks:
        return out
    return jnp.concatenate(out, axis=-1) if len(out) > 1 else out[0]


# ------------------------------------------------------------------ KIVI wrappers


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "scale_dtype", "codebook", "clip"))
def quantize_keys(
    k: jax.Array,
    *,
    bits: int,
    group_size: int,
    scale_dtype: Any = jnp.float16,
    codebook: str = "uniform",
    clip: tuple | None = None,
) -> QuantizedKeys:
    """KIVI keys: per-channel quantisation in groups of G tokens (arXiv 2402.02750 §3.2, §4).

    Args:
      k: ``float16 | bfloat16 | float32 [..., T, H]`` keys, ``T % G == 0``, finite.
      bits: 8, 4 or 2 (static).
      group_size: ``G``, consecutive tokens sharing one (scale, zero) per channel (static).
      scale_dtype: storage dtype of scale and zero (static; default float16).
      codebook, clip: the code levels and the clipping search (static), as :func:`quantize_affine`'s.

    Returns:
      ``QuantizedKeys(codes=uint8[..., T, H // cpb], scale=scale_dtype[..., T // G, H],
      zero=scale_dtype[..., T // G, H])``. Bytes per leading index:
      ``T * H / cpb + 2 * (T / G) * H * itemsize(scale_dtype)``.

    Raises:
      JaxkvError: ``T % G != 0``, ``H % (8 // bits) != 0``, ``bits`` not in {8, 4, 2},
        unsupported dtypes.
    """
    chex.assert_rank(k, {i for i in range(2, 16)})
    qt = quantize_affine(
        k, bits=bits, axis=-2, group_size=group_size, scale_dtype=scale_dtype, codebook=codebook, clip=clip
    )
    return QuantizedKeys(*qt)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "dtype", "blocks", "codebook"))
def dequantize_keys(
    qk: QuantizedKeys,
    *,
    bits: int,
    group_size: int,
    dtype: Any = jnp.float32,
    blocks: bool = False,
    codebook: str = "uniform",
) -> jax.Array | list[jax.Array]:
    """Dequantise :func:`quantize_keys` output to ``dtype[..., T, H]`` (the query's dtype),
    or to its channel blocks with ``blocks=True`` (see :func:`dequantize_affine`).

    Raises:
      JaxkvError: ``bits`` or ``group_size`` inconsistent with ``qk``'s shapes,
        ``bits`` not in {8, 4, 2}, unsupported ``dtype``.
    """
    chex.assert_rank(qk.codes, {i for i in range(2, 16)})
    cpb = codes_per_byte(bits)
    if qk.codes.shape[-1] * cpb != qk.scale.shape[-1]:
        raise JaxkvError(
            f"bits={bits} unpacks codes of width {qk.codes.shape[-1]} to H="
            f"{qk.codes.shape[-1] * cpb}, but the key scales have H={qk.scale.shape[-1]}"
        )
    return dequantize_affine(
        qk, bits=bits, axis=-2, group_size=group_size, dtype=dtype, blocks=blocks, codebook=codebook
    )


@functools.partial(jax.jit, static_argnames=("bits", "scale_dtype", "codebook", "clip"))
def quantize_values(
    v: jax.Array, *, bits: int, scale_dtype: Any = jnp.float16, codebook: str = "uniform", clip: tuple | None = None
) -> QuantizedValues:
    """KIVI values: per-token quantisation over H (arXiv 2402.02750 §3.2).

    Args:
      v: ``float16 | bfloat16 | float32 [..., T, H]`` values, finite.
      bits: 8, 4 or 2 (static).
      scale_dtype: storage dtype of scale and zero (static; default float16).
      codebook, clip: the code levels and the clipping search (static), as :func:`quantize_affine`'s.

    Returns:
      ``QuantizedValues(codes=uint8[..., T, H // cpb], scale=scale_dtype[..., T],
      zero=scale_dtype[..., T])``. Bytes per leading index:
      ``T * H / cpb + 2 * T * itemsize(scale_dtype)``.

    Raises:
      JaxkvError: ``H % (8 // bits) != 0``, ``bits`` not in {8, 4, 2}, unsupported dtypes.
    """
    chex.assert_rank(v, {i for i in range(2, 16)})
    qt = quantize_affine(v, bits=bits, axis=-1, group_size=None, scale_dtype=scale_dtype, codebook=codebook, clip=clip)
    return QuantizedValues(codes=qt.codes, scale=jnp.squeeze(qt.scale, -1), zero=jnp.squeeze(qt.zero, -1))


@functools.partial(jax.jit, static_argnames=("bits", "dtype", "blocks", "codebook"))
def dequantize_values(
    qv: QuantizedValues, *, bits: int, dtype: Any = jnp.float32, blocks: bool = False, codebook: str = "uniform"
) -> jax.Array | list[jax.Array]:
    """Dequantise :func:`quantize_values` output to ``dtype[..., T, H]`` (the query's dtype),
    or to its channel blocks with ``blocks=True`` (see :func:`dequantize_affine`).

    Raises:
      JaxkvError: ``bits`` not in {8, 4, 2}, unsupported ``dtype``.
    """
    chex.assert_rank(qv.codes, {i for i in range(2, 16)})
    chex.assert_shape([qv.scale, qv.zero], qv.codes.shape[:-1])
    qt = QuantizedTensor(qv.codes, qv.scale[..., None], qv.zero[..., None])
    return dequantize_affine(qt, bits=bits, axis=-1, group_size=None, dtype=dtype, blocks=blocks, codebook=codebook)
