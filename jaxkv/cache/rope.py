"""Rotary position embedding (RoPE, Su et al. 2021) in the rotate-half layout.

A :class:`Rope` holds a model's RoPE frequencies (plain, or rescaled as Llama 3.x,
linear position interpolation or llama.cpp's ``rope_freqs`` ask). Angles are computed from
int32 positions every time they are needed; stored keys are never re-rotated (DESIGN §2).

Angles keep their precision at any int32 position: above 255 tokens, ``position *
inv_freq`` is reduced modulo one turn in fixed point (:meth:`Rope.cos_sin`) before it
becomes float32, so the phase error is below ``3e-5`` rad at position ``2**30`` as at 300. A float32 product
``float32(p) * inv_freq`` instead loses the phase past ``p = 2**24`` (where
``float32(2**24 + 1) == 2**24``), and a bounded cache that streams forever in ``absolute``
mode reaches such positions.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from jaxkv.errors import JaxkvError

_HIGH_DIGITS = 6  # base-16 digits of |position| >> 8 (|position| < 2**31)
_TURN = 2**24  # fixed-point phase units per turn


@dataclasses.dataclass(frozen=True)
class Rope:
    """A model's RoPE frequencies (frozen, hashable: a static argument of ``jax.jit``).

    Attributes:
      inv_freq: ``H/2`` angular frequencies in radians per token (float64 values), pair
        ``i`` rotating channels ``i`` and ``i + H/2``.
      kind: how they were made (``default``, ``linear``, ``llama3``, ``factors``), for messages.

    Build one with :meth:`default`, :meth:`linear`, :meth:`llama3` or :meth:`with_factors`.
    """

    inv_freq: tuple[float, ...]
    kind: str = "default"

    def __post_init__(self):
        if not self.inv_freq or not all(math.isfinite(f) and f > 0 for f in self.inv_freq):
            raise JaxkvError(f"Rope({self.kind}): frequencies must be positive and finite, got {self.inv_freq[:4]}...")

    @property
    def head_dim(self) -> int:
        """H, the head dim it rotates (twice the number of frequencies)."""
        return 2 * len(self.inv_freq)

    @classmethod
    def default(cls, theta: float, head_dim: int) -> Rope:
        """Plain RoPE: ``inv_freq[i] = theta ** (-2i / H)`` (Su et al. 2021, §3.2.2).

        Raises:
          JaxkvError: ``theta`` not positive, ``head_dim`` not a positive even number.
        """
        if not (isinstance(theta, (int, float)) and theta > 0 and math.isfinite(theta)):
            raise JaxkvError(f"RoPE theta={theta!r}: expected a positive number")
        if not isinstance(head_dim, (int, np.integer)) or head_dim < 2 or head_dim % 2:
            raise JaxkvError(f"RoPE head_dim={head_dim!r}: expected a positive even number")
        exponent = np.arange(head_dim // 2, dtype=np.float64) * 2.0 / head_dim
        return cls(tuple(float(x) for x in 1.0 / float(theta) ** exponent))

    @classmethod
    def linear(cls, theta: float, head_dim: int, factor: float) -> Rope:
        """Linear position interpolation (Chen et al. 2023, arXiv 2306.15595): every
        frequency divided by ``factor`` (HF ``rope_type="linear"``; Gemma 3's global layers).

        Raises:
          JaxkvError: ``factor`` not a positive number (and as :meth:`default`).
        """
        _positive("linear factor", factor)
        return cls(tuple(f / factor for f in cls.default(theta, head_dim).inv_freq), "linear")

    @classmethod
    def llama3(
        cls,
        theta: float,
        head_dim: int,
        *,
        factor: float,
        low_freq_factor: float,
        high_freq_factor: float,
        original_max_position_embeddings: int,
    ) -> Rope:
        """Llama 3.1's frequency-dependent scaling (HF ``rope_type="llama3"``; Meta's
        ``apply_scaling``): wavelengths longer than ``original / low_freq_factor`` tokens are
        divided by ``factor``, shorter than ``original / high_freq_factor`` kept, and those in
        between interpolated smoothly.

        Raises:
          JaxkvError: a parameter that is not a positive number, or
            ``high_freq_factor <= low_freq_factor``.
        """
        for name, value in (
            ("factor", factor),
            ("low_freq_factor", low_freq_factor),
            ("high_freq_factor", high_freq_factor),
            ("original_max_position_embeddings", original_max_position_embeddings),
        ):
            _positive(f"llama3 {name}", value)
        if high_freq_factor <= low_freq_factor:
            raise JaxkvError(
                f"llama3 RoPE scaling: high_freq_factor={high_freq_factor} must exceed low_freq_factor={low_freq_factor}"
            )
        base = np.asarray(cls.default(theta, head_dim).inv_freq)
        wavelen = 2 * np.pi / base
        low_wavelen = original_max_position_embeddings / low_freq_factor
        high_wavelen = original_max_position_embeddings / high_freq_factor
        scaled = np.where(wavelen > low_wavelen, base / factor, base)
        smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return cls(tuple(float(x) for x in np.where(medium, smoothed, scaled)), "llama3")

    @classmethod
    def with_factors(cls, theta: float, head_dim: int, factors) -> Rope:
        """Plain RoPE with each frequency divided by ``factors[i]`` (llama.cpp's GGUF
        ``rope_freqs`` tensor, how its converter stores Llama 3.x scaling).

        Raises:
          JaxkvError: ``factors`` not ``H/2`` positive finite numbers.
        """
        factors = np.asarray(factors, np.float64).reshape(-1)
        if factors.shape != (head_dim // 2,) or not np.all(np.isfinite(factors) & (factors > 0)):
            raise JaxkvError(f"rope_freqs: expected {head_dim // 2} positive finite factors, got shape {factors.shape}")
        return cls(tuple(float(f / s) for f, s in zip(cls.default(theta, head_dim).inv_freq, factors)), "factors")

    def _phase_tables(self) -> np.ndarray:
        """int32[6, H/2]: the phase of ``256 * 16**i`` tokens at each frequency, in 2**-24 turns."""
        turns = np.asarray(self.inv_freq, np.float64) / (2 * np.pi)
        tables = [np.mod(turns * (256.0 * 16.0**i), 1.0) for i in range(_HIGH_DIGITS)]
        return np.mod(np.round(np.stack(tables) * _TURN), _TURN).astype(np.int32)

    def cos_sin(self, positions):
        """``(cos, sin)`` float32 ``[..., H/2]`` of the angles ``positions * inv_freq``.

        The low 8 bits of ``|position|`` are multiplied in float32; the rest, six base-16
        digits, each times a table of phases mod one turn in 2**-24-turn units, summed as
        int32 mod 2**24 (no product exceeds 2**28: no overflow, no unsigned arithmetic,
        DESIGN §4). The phase error stays below ``3e-5`` rad at every int32 position.

        Args:
          positions: int32 array (any shape; negative values allowed: only relative angles
            matter to attention).
        """
        pos = jnp.asarray(positions, jnp.int32)[..., None]
        mag = jnp.abs(pos)
        freq = np.asarray(self.inv_freq, np.float32)
        phase = jnp.zeros(pos.shape[:-1] + freq.shape, jnp.int32)
        for i, table in enumerate(self._phase_tables()):
            digit = (mag >> (8 + 4 * i)) & 15
            phase = (phase + digit * jnp.asarray(table)) & (_TURN - 1)
        angle = (mag & 255).astype(jnp.float32) * freq + phase.astype(jnp.float32) * np.float32(2 * np.pi / _TURN)
        angle = jnp.where(pos < 0, -angle, angle)
        return jnp.cos(angle), jnp.sin(angle)


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise JaxkvError(f"RoPE {name}={value!r}: expected a positive number")


def as_rope(rope: Rope | None, theta: float | None, head_dim: int) -> Rope:
    """``rope``, or plain RoPE of base ``theta`` (the older ``theta=`` keyword) for ``head_dim``.

    Raises:
      JaxkvError: neither or both given, or a rope for another head dim.
    """
    if (rope is None) == (theta is None):
        raise JaxkvError("RoPE: pass exactly one of rope=Rope(...) or theta=BASE")
    if rope is None:
        return Rope.default(float(theta), head_dim)
    if rope.head_dim != head_dim:
        raise JaxkvError(f"RoPE for head dim {rope.head_dim} applied to head dim {head_dim}")
    return rope


def rope_blocks(blocks: list, positions, *, rope: Rope | None = None, theta: float | None = None) -> list:
    """Rotate ``x`` given as an even number of equal channel blocks, at integer ``positions``.

    Args:
      blocks: ``n`` (even) arrays ``[..., H/n]`` whose concatenation along the last axis is
        ``x[..., H]`` (the KIVI channel blocks, :func:`jaxkv.cache.kivi.dequantize_affine`).
      positions, rope, theta: as :func:`apply_rope`.
    Returns:
      the ``n`` rotated blocks (block ``j`` pairs with block ``j + n/2``, as channel ``i``
      pairs with ``i + H/2``), each in its input dtype; nothing is concatenated.
    """
    n = len(blocks)
    width = blocks[0].shape[-1]
    cos, sin = as_rope(rope, theta, n * width).cos_sin(positions)
    out = [None] * n
    for j in range(n // 2):
        c, s = cos[..., j * width : (j + 1) * width], sin[..., j * width : (j + 1) * width]
        x1, x2 = blocks[j].astype(jnp.float32), blocks[j + n // 2].astype(jnp.float32)
        out[j] = (x1 * c - x2 * s).astype(blocks[j].dtype)
        out[j + n // 2] = (x2 * c + x1 * s).astype(blocks[j].dtype)
    return out


def apply_rope(x, positions, *, rope: Rope | None = None, theta: float | None = None):
    """Rotate ``x`` at integer ``positions``.

    Args:
      x: ``[..., H]`` float array (any float dtype; the rotation is computed in float32).
      positions: int32 array broadcastable to ``x.shape[:-1]``; negative values are allowed
        (only relative angles matter to attention).
      rope: the model's :class:`Rope`; or ``theta``, the base of plain RoPE (10000 for
        Llama 2, 100000 for SmolLM2).
    Returns:
      ``[..., H]`` in ``x.dtype``: channel ``i`` and ``i + H/2`` rotated by
      ``position * inv_freq[i]``.
    Raises:
      JaxkvError: neither or both of ``rope`` and ``theta``, or a rope of another head dim.
    """
    half = x.shape[-1] // 2
    return jnp.concatenate(rope_blocks([x[..., :half], x[..., half:]], positions, rope=rope, theta=theta), axis=-1)
