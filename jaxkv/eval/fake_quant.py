"""Fake-quantised keys and values: a ``kv_hook`` for KIVI's quantisation-axis ablation.

KIVI (Liu et al. 2024, arXiv 2402.02750) Table 1 compares four ways to quantise a KV
cache: keys per channel or per token, times values per channel or per token. jaxkv's
cache stores one of them (keys per channel in groups of G tokens, values per token,
DESIGN §2); the other three need no cache layout to be measured: :class:`FakeQuantKV`
replaces every layer's keys and values by ``dequantize(quantize(x))`` with the cache's own
KIVI kernels, and :func:`jaxkv.eval.teacher_forced_nll` runs the library's forward with
it as its ``kv_hook``.

Every token is fake-quantised (there is no full-precision residual), and a per-channel
group's range includes the up to G - 1 later tokens of its group, which a real cache never
lets a query see.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.cache.kivi import codes_per_byte, dequantize_keys, dequantize_values, quantize_keys, quantize_values
from jaxkv.cache.rope import apply_rope
from jaxkv.errors import JaxkvError

AXES = (None, "channel", "token")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FakeQuantKV:
    """``kv_hook`` that quantises then dequantises each layer's keys and values (KIVI kernels).

    Attributes:
      keys, values: ``"channel"`` = one (scale, zero) per channel and group of
        ``group_size`` consecutive tokens (:func:`jaxkv.cache.kivi.quantize_keys`),
        ``"token"`` = one per token over the head's H channels
        (:func:`jaxkv.cache.kivi.quantize_values`), None = left in full precision.
        Default: KIVI's pairing (keys per channel, values per token).
      bits: 8, 4 or 2; scale and zero are float16, as in the cache.
      group_size: G, tokens per per-channel group; the chunk length T must be a multiple.
      rope_theta: None = quantise keys as the model makes them (before RoPE, as a
        ``positions="cache"`` cache stores them); a RoPE base = quantise them as an
        ``absolute``-position cache stores them, rotated at positions ``0..T-1`` (so the
        chunk must start at position 0, a fresh cache), then rotate them back, since the
        forward rotates what the hook returns.

    Called as ``hook(k, v)`` with ``k, v: float[B, T, K, H]``; returns both in the same
    shape and dtype.

    Raises:
      JaxkvError: an axis not in {"channel", "token", None}, ``bits`` not in {8, 4, 2}, a
        ``group_size`` below 1 (at construction); ``T % group_size != 0`` (at the call).
    """

    keys: str | None = "channel"
    values: str | None = "token"
    bits: int = 4
    group_size: int = 32
    rope_theta: float | None = None

    def __post_init__(self):
        for name in ("keys", "values"):
            if getattr(self, name) not in AXES:
                raise JaxkvError(f"FakeQuantKV: {name}={getattr(self, name)!r}: expected 'channel', 'token' or None")
        codes_per_byte(self.bits)
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise JaxkvError(f"FakeQuantKV: group_size={self.group_size!r}: expected an integer >= 1")

    def _fake_quant(self, x, axis):  # x: [B, K, T, H]
        if axis == "channel":
            q = quantize_keys(x, bits=self.bits, group_size=self.group_size)
            return dequantize_keys(q, bits=self.bits, group_size=self.group_size, dtype=x.dtype)
        return dequantize_values(quantize_values(x, bits=self.bits), bits=self.bits, dtype=x.dtype)

    def __call__(self, k, v):
        if self.keys is not None:
            pos = jnp.arange(k.shape[1], dtype=jnp.int32)[None, None, :]
            k = jnp.swapaxes(k, 1, 2)  # [B, K, T, H], the kernels' layout
            if self.rope_theta is not None:
                k = apply_rope(k, pos, theta=self.rope_theta)
            k = self._fake_quant(k, self.keys)
            if self.rope_theta is not None:
                k = apply_rope(k, -pos, theta=self.rope_theta)
            k = jnp.swapaxes(k, 1, 2)
        if self.values is not None:
            v = jnp.swapaxes(self._fake_quant(jnp.swapaxes(v, 1, 2), self.values), 1, 2)
        return k, v
