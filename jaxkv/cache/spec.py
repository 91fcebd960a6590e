"""`CacheSpec`: what a KV cache keeps (sinks, window, residual) and how it stores it.

Sources: StreamingLLM (Xiao et al. 2023, arXiv 2309.17453, §3.2) for ``sink``/``window``
and the two RoPE position modes; KIVI (Liu et al. 2024, arXiv 2402.02750, §3-4) for
``kv_quantize``/``group_size``/``residual``. The normative semantics are in DESIGN §2.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import warnings

import numpy as np

from jaxkv.cache.kivi import CODEBOOKS
from jaxkv.cache.kivi_storage import BITS, KiviStorage
from jaxkv.cache.policy import POSITION_MODES, FullCache, Policy, StreamingLLM
from jaxkv.cache.retention import RULES as KEEP_RULES
from jaxkv.cache.retention import Retention
from jaxkv.cache.storage import FLOAT_DTYPES, FloatStorage, Storage
from jaxkv.errors import INT32_LIMIT, CacheSpecError, JaxkvError, int_problem

FLOAT_MODES = tuple(FLOAT_DTYPES)
QUANT_MODES = tuple(BITS)
KV_MODES = FLOAT_MODES + QUANT_MODES
SCALE_DTYPES = ("float16", "float32", "float8_e4m3fn", "float8_e5m2")
RESIDUAL_DTYPES = ("float32", "float16", "bfloat16")
HADAMARD_SIDES = {"none": (False, False), "keys": (True, False), "values": (False, True), "both": (True, True)}
LEVERS = {
    "pre-rope": {"pre_rope_keys": True},
    **{f"hadamard-{side}": {"hadamard": side} for side in HADAMARD_SIDES if side != "none"},
}
"""Storage options of the benchmark's and the audit's mode strings (``int2+pre-rope+hadamard-values``)
and the :class:`CacheSpec` fields each sets."""


def lever_fields(names) -> dict:
    """The :class:`CacheSpec` fields of option names of :data:`LEVERS` (e.g. ``["pre-rope"]``).

    Raises:
      JaxkvError: a name not in :data:`LEVERS`.
    """
    fields = {}
    for name in names:
        if name not in LEVERS:
            raise JaxkvError(f"storage option {name!r}: expected one of {', '.join(LEVERS)}")
        fields.update(LEVERS[name])
    return fields


def make_storage(
    kv_quantize: str,
    v_quantize: str | None = None,
    *,
    group_size: int = 32,
    residual: int = 128,
    scale_dtype: str = "float16",
    residual_dtype: str = "float32",
    hadamard: str = "none",
    codebook: str = "uniform",
    clip: bool = False,
) -> Storage:
    """The :class:`Storage` of keys in ``kv_quantize`` and values in ``v_quantize`` (None: the
    keys' mode), values as :class:`CacheSpec` takes them (validated there). The one place a
    storage kind is chosen by name: KIVI when either side is int8/int4/int2, else float."""
    value_kind = None if v_quantize in (None, kv_quantize) else v_quantize
    if kv_quantize in QUANT_MODES or value_kind in QUANT_MODES:
        rotate_keys, rotate_values = HADAMARD_SIDES[hadamard]
        return KiviStorage(
            kind=kv_quantize,
            group_size=group_size,
            residual=residual,
            scale_dtype=scale_dtype,
            value_kind=value_kind,
            residual_dtype=residual_dtype,
            rotate_keys=rotate_keys,
            rotate_values=rotate_values,
            codebook=codebook,
            clip=clip,
        )
    return FloatStorage(kind=kv_quantize, value_kind=value_kind)


def _divisors_near(n: int, g: int, most: int = 6) -> list:
    """Up to ``most`` divisors of ``n`` (>= 2), the nearest to ``g`` (by ratio), ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    divisors = sorted({d for s in small for d in (s, n // s) if d >= 2}) or [1]
    return sorted(sorted(divisors, key=lambda d: abs(np.log(d / g)))[:most])


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheSpec:
    """Static description of a KV cache; hashable, so it can be a ``jax.jit`` static argument.

    A *full* cache (``window=None``) holds every token up to ``max_len`` slots and refuses
    to overflow. A *StreamingLLM* cache (``window=W``) keeps the first ``sink`` tokens and
    the last ``W`` tokens; its size stops growing at ``sink + W`` slots. With
    ``kv_quantize`` in ``int8|int4|int2`` (KIVI), window tokens first land in a
    full-precision residual of up to ``residual`` tokens, then move, ``group_size`` at a
    time, into bit-packed codes; sinks stay in full precision (``residual_dtype``).

    Keys and values may differ (``k_quantize``/``v_quantize``, llama.cpp's ``-ctk``/``-ctv``):
    when either side is quantised, the residual, group size and window rules of KIVI apply
    to the cache, and a float side is moved with the quantised one into the window, as
    floats of its own mode. Equal modes are one spec however they are written: a side equal
    to ``kv_quantize`` is stored as None, and two explicit sides that differ keep the values'
    in ``kv_quantize`` (``CacheSpec(k_quantize="int2", v_quantize="int4") ==
    CacheSpec(kv_quantize="int4", k_quantize="int2")``); :attr:`kv_modes` gives both.

    Attributes:
      max_len: slots of a full cache, tokens (required when ``window`` is None, ignored otherwise).
      sink: S0, first tokens always kept (attention sinks, StreamingLLM §3), in full precision
        (``residual_dtype``) beside a KIVI cache's codes; a full cache takes sinks only when it
        quantises (IntactKV, Liu et al. 2024, arXiv 2403.01241: the sink tokens kept lossless).
      window: W, most recent tokens kept (for KIVI: most recent *flushed* tokens); None = full cache.
      kv_quantize: storage precision of keys and values, one of fp32, fp16, bf16, int8, int4, int2.
      k_quantize, v_quantize: None, or the keys' (values') precision, overriding ``kv_quantize``.
      group_size: G, tokens per per-channel key quantisation group (KIVI §3.2).
      residual: R, full-precision recent tokens before quantisation (KIVI §4), a multiple of G.
      positions: ``absolute`` (keys keep RoPE of their original position) or ``cache``
        (keys stored before RoPE and rotated on read at their rank in the cache, StreamingLLM §3.2).
      scale_dtype: storage dtype of KIVI scales and zeros (arithmetic is always float32):
        float16 (KIVI), float32, or 8-bit float8_e4m3fn / float8_e5m2 (half the metadata bits;
        not on jax-metal).
      attention_window: None, or A: a query attends only to the last A positions (itself
        included) even when more are stored: a model's local sliding-window layer
        (Mistral, Gemma 2/3). Made by :meth:`local`.
      residual_dtype: float dtype of the sinks and the KIVI residual (float32, float16,
        bfloat16); a quantised cache only (a float cache stores them in its own mode).
      pre_rope_keys: store keys before RoPE and rotate them on read at their absolute position
        (KVQuant, Hooper et al. 2024, arXiv 2401.18079, §3.2: per-channel key statistics are
        cleaner before RoPE mixes channel pairs); ``positions="cache"`` always stores them so
        (it is set True there). Logits equal the post-RoPE cache's within float rounding.
      hadamard: ``none``, ``values``, ``keys`` or ``both``: quantise those sides rotated by the
        head's orthonormal Hadamard matrix (QuaRot, arXiv 2404.00456; :mod:`jaxkv.cache.rotation`),
        folded into attention's read; an int* keep tier's tokens too. Quantised (int*) sides only, a head_dim that is a power of
        two, and rotated keys need keys stored after RoPE (``positions="absolute"``, no
        ``pre_rope_keys``): a pre-RoPE key would have to be rotated back for every read.
      keep: C, slots of a *keep tier* for tokens leaving the window (0: none, StreamingLLM
        drops them); a StreamingLLM cache (:mod:`jaxkv.cache.retention`).
      keep_score: which leaving tokens the tier keeps: ``recent`` (the last C: tiered
        retention), ``h2o`` (most attention received), ``tova`` (most attention from the latest
        query) or ``snapkv`` (most attention from the prompt's last tokens, chosen at the end
        of the prompt's prefill). On a full cache (``keep=0``), ``h2o`` only tracks the scores
        (SnapKV's observation pass).
      codebook: ``uniform`` (KIVI's affine levels) or ``normal`` (Lloyd-Max levels of a standard
        normal over each group's mean and standard deviation, the fixed distribution-shaped
        codebook of KVQuant's non-uniform quantisation, arXiv 2401.18079 §3.4): the code levels of
        the int4/int2 sides (:mod:`jaxkv.cache.kivi`).
      clip: choose each group's range by a clipping search (the candidate of least squared
        error, :data:`jaxkv.cache.kivi.CLIP_RANGES`) instead of min-max; int* sides.
      keep_quantize: the tier's storage, fp32|fp16|bf16|int8|int4|int2 (int*: per-token codes
        of keys and values; a float window only); None: the window's float mode (a KIVI
        window: ``residual_dtype``, its evicted codes dequantised once).

    Raises:
      JaxkvError: on any value outside the accepted ranges (the message names it).
    """

    max_len: int | None = None
    sink: int = 0
    window: int | None = None
    kv_quantize: str = "fp32"
    group_size: int = 32
    residual: int = 128
    positions: str = "absolute"
    scale_dtype: str = "float16"
    attention_window: int | None = None
    k_quantize: str | None = None
    v_quantize: str | None = None
    residual_dtype: str = "float32"
    pre_rope_keys: bool = False
    hadamard: str = "none"
    keep: int = 0
    keep_score: str = "recent"
    keep_quantize: str | None = None
    codebook: str = "uniform"
    clip: bool = False

    def __post_init__(self):
        for name, accepted in (
            ("kv_quantize", KV_MODES),
            ("k_quantize", KV_MODES),
            ("v_quantize", KV_MODES),
            ("positions", POSITION_MODES),
            ("scale_dtype", SCALE_DTYPES),
            ("residual_dtype", RESIDUAL_DTYPES),
            ("hadamard", tuple(HADAMARD_SIDES)),
            ("keep_score", KEEP_RULES),
            ("keep_quantize", KV_MODES),
            ("codebook", CODEBOOKS),
        ):
            value = getattr(self, name)
            if value is None and name in ("k_quantize", "v_quantize", "keep_quantize"):
                continue
            if not isinstance(value, str) or value not in accepted:
                self._refuse(f"{{{name}}}: expected one of {', '.join(accepted)}")
        k, v = self.k_quantize or self.kv_quantize, self.v_quantize or self.kv_quantize
        # one canonical form per pair of modes: the values' mode in kv_quantize, a differing keys' in k_quantize
        for name, value in (("kv_quantize", v), ("k_quantize", None if k == v else k), ("v_quantize", None)):
            object.__setattr__(self, name, value)
        if not isinstance(self.pre_rope_keys, (bool, np.bool_)):
            self._refuse("{pre_rope_keys}: expected True or False")
        object.__setattr__(self, "pre_rope_keys", bool(self.pre_rope_keys) or self.positions == "cache")
        tier_quantized = self.keep_quantize in QUANT_MODES
        for side, mode, rotated in zip(("keys", "values"), (k, v), HADAMARD_SIDES[self.hadamard]):
            if rotated and mode not in QUANT_MODES and not tier_quantized:
                self._refuse(
                    f"{{hadamard}} rotates the {side} before quantising them, but this cache stores them as "
                    f"{mode}: rotate int8/int4/int2 sides only"
                )
        if HADAMARD_SIDES[self.hadamard][0] and self.pre_rope_keys:
            why = "{positions}" if self.positions == "cache" else "{pre_rope_keys:name}"
            self._refuse(
                "{hadamard} rotates keys stored after RoPE, but " + why + " stores them before it (they "
                "would be rotated back at every read): use {hadamard:=values}, or {positions:=absolute} "
                "without {pre_rope_keys:name}"
            )
        if not isinstance(self.clip, (bool, np.bool_)):
            self._refuse("{clip}: expected True or False")
        object.__setattr__(self, "clip", bool(self.clip))
        for name in ("codebook", "clip"):
            if getattr(self, name) != getattr(CacheSpec, name) and not self.quantized:
                self._refuse(
                    f"{{{name}}} is for a quantised cache (int8, int4 or int2 keys or values): this one stores "
                    f"keys as {k} and values as {v}"
                )
        if self.codebook == "normal" and "int8" in (k, v):
            self._refuse("{codebook} has levels for int4 and int2 codes: store int8 sides with {codebook:=uniform}")
        if self.residual_dtype != "float32" and not self.quantized:
            self._refuse(
                f"{{residual_dtype}} is for a quantised cache (int8, int4 or int2 keys or values): this one "
                f"stores keys as {k} and values as {v}, sinks and window included"
            )
        for name, minimum in (
            ("sink", 0),
            ("max_len", 1),
            ("window", 1),
            ("attention_window", 1),
            ("group_size", 1),
            ("residual", 1),
            ("keep", 0),
        ):
            value = getattr(self, name)
            if value is None and name in ("max_len", "window", "attention_window"):
                continue
            problem = int_problem(value, minimum, INT32_LIMIT)
            if problem is not None:
                big = not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= minimum
                self._refuse(f"{{{name}}}: {problem}" + (" (positions and slots are int32)" if big else ""))
            object.__setattr__(self, name, int(value))  # numpy integers as ints: hashable, JSON, equal
        if self.window is None:
            if self.sink and not self.quantized:
                self._refuse(
                    "{sink} needs a window: pass {window:=W} for a StreamingLLM cache (a full cache keeps "
                    "sinks apart only to hold them in full precision beside int8/int4/int2 codes)"
                )
            if self.max_len is None:
                self._refuse("{max_len}: a full cache (window=None) needs max_len, the number of slots")
        else:
            if self.max_len is not None:
                warnings.warn(
                    f"CacheSpec(max_len={self.max_len}, window={self.window}): a StreamingLLM cache "
                    "(window set) has no max_len, so max_len is ignored: pass one of them",
                    stacklevel=3,
                )
            if self.sink > self.window:
                warnings.warn(
                    f"CacheSpec(sink={self.sink}, window={self.window}): more sinks than window tokens; "
                    "StreamingLLM keeps a few sinks (e.g. 4) before a much larger window",
                    stacklevel=3,
                )
        if self.quantized:
            self._check_groups()
        self._check_keep()
        if self.capacity >= INT32_LIMIT:
            sizes = "{sink} + {window}" if self.bounded else "{max_len}"
            self._refuse(
                sizes
                + (" + {residual}" if self.quantized else "")
                + f" make {self.capacity} slots: expected fewer than 2**31 (positions and slots are int32)",
                prefix="CacheSpec: ",
            )

    def _refuse(self, template: str, *, prefix: str = "CacheSpec."):
        raise CacheSpecError(template, {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, prefix=prefix)

    def _check_keep(self):
        """The keep tier: a StreamingLLM cache with a float window; a full cache only tracks h2o scores."""
        if self.keep_quantize == self._window_float:
            object.__setattr__(self, "keep_quantize", None)  # the window's own mode: one canonical spec
        if self.keep:
            if self.window is None:
                self._refuse(
                    "{keep} keeps tokens that leave a window, but this is a full cache (it keeps every "
                    "token): pass {window:=W}, or {keep:=0}"
                )
            if self.quantized and self.keep_quantize in QUANT_MODES:
                self._refuse(
                    "{keep_quantize} would quantise a KIVI window's tokens a second time as they leave it "
                    "(a code is quantised once): keep the tier in float ({keep_quantize:=None}, the "
                    "residual's dtype), or quantise a float window's tier"
                )
        elif self.keep_score != "recent" and self.window is not None:
            self._refuse("{keep_score} chooses the tokens of a keep tier, but {keep} keeps none: pass {keep:=C} slots")
        elif self.keep_score not in ("recent", "h2o"):
            self._refuse("{keep_score} on a full cache: only h2o (tracking attention scores) applies to one")
        if self.keep_quantize is not None and not self.keep:
            self._refuse("{keep_quantize} is the keep tier's storage, but {keep} keeps none: pass {keep:=C} slots")

    def _check_groups(self):
        """KIVI: R a multiple of G, W a multiple of G, R <= W; each refusal names the nearest valid values."""
        g, r, w = self.group_size, self.residual, self.window
        if r % g:
            divisors = ", ".join(map(str, _divisors_near(r, g)))
            multiples = [m for m in (r - r % g, r - r % g + g) if m >= g and (w is None or m <= w)]
            self._refuse(
                f"{{residual}} is not a multiple of {{group_size}}: use a {{group_size:name}} that divides {r} "
                f"(e.g. {divisors}) or a {{residual:name}} that is a multiple of {g}"
                + (f" (e.g. {' or '.join(map(str, multiples))})" if multiples else "")
            )
        if w is None:
            return
        if w % g:
            below, above = w - w % g, max(w - w % g + g, r)
            use = (
                f"{{window:={below}}} or {above}"
                if below >= r
                else f"{{window:={above}}}, the smallest that holds {{residual}}"
            )
            self._refuse(
                f"{{window}} is not a multiple of {{group_size}}: the quantised window evicts whole groups; use {use}"
            )
        if r > w:
            self._refuse(
                f"{{residual}} is larger than {{window}}: a flush of the residual must fit in the window; "
                f"use {{window:={r}}} or more, or {{residual:={w}}} or less"
            )

    # ---- the typed parts ----------------------------------------------------------------------
    @functools.cached_property
    def storage(self) -> Storage:
        """The :class:`jaxkv.cache.storage.Storage` of :attr:`kv_modes` (float or KIVI)."""
        return make_storage(
            *self.kv_modes,
            group_size=self.group_size,
            residual=self.residual,
            scale_dtype=self.scale_dtype,
            residual_dtype=self.residual_dtype,
            hadamard=self.hadamard,
            codebook=self.codebook,
            clip=self.clip,
        )

    @functools.cached_property
    def policy(self) -> Policy:
        """The :class:`jaxkv.cache.policy.Policy`: a full cache or StreamingLLM sinks + window."""
        common = dict(
            sink=self.sink,
            positions=self.positions,
            pre_rope=self.pre_rope_keys,
            flush=self.storage.flush,
            attention_window=self.attention_window or 0,
            retention=self.retention,
        )
        if self.window is None:
            return FullCache(max_len=self.max_len, **common)
        return StreamingLLM(window=self.window, **common)

    @functools.cached_property
    def retention(self) -> Retention | None:
        """The keep tier's :class:`jaxkv.cache.retention.Retention` (None without one)."""
        if not self.keep and self.keep_score == "recent":
            return None
        kind = self.keep_quantize or self._window_float
        rotate_keys, rotate_values = HADAMARD_SIDES[self.hadamard] if kind in QUANT_MODES else (False, False)
        return Retention(
            slots=self.keep,
            rule=self.keep_score,
            kind=kind,
            scale_dtype=self.scale_dtype,
            rotate_keys=rotate_keys,
            rotate_values=rotate_values,
        )

    @property
    def _window_float(self) -> str:
        """The float mode of the window's full-precision tokens (a KIVI window: its residual's)."""
        if self.quantized:
            return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[self.residual_dtype]
        return self.kv_modes[0]

    def observer(self, max_len: int) -> CacheSpec:
        """The full cache of ``max_len`` slots that SnapKV's observation pass prefills a prompt
        into (SnapKV §4.2): this spec's float window mode and positions, every token kept,
        the attention each slot receives tracked (``keep_score="h2o"``); its prompt is then
        replayed into a cache of this spec (:func:`jaxkv.decode.loop.prefill`)."""
        k, v = self.kv_modes
        return CacheSpec(
            max_len=max_len,
            kv_quantize=v,
            k_quantize=k,
            positions=self.positions,
            pre_rope_keys=self.pre_rope_keys,
            keep_score="h2o",
        )

    def local(self, window: int) -> CacheSpec:
        """This spec for a model's local attention layer over its last ``window`` tokens
        (its trained sliding window: Mistral, Gemma 2/3, Phi-3).

        The local layer keeps no sinks and a window of ``window`` tokens (fewer when this
        spec's own window is smaller: the user's bound holds on every layer), in this spec's
        storage and position mode, and masks attention to the last ``window`` positions
        (a KIVI residual may hold older ones). So its retained set is exactly the model's
        window, as the model was trained.

        Raises:
          JaxkvError: a storage the window cannot hold (e.g. a KIVI residual larger than
            the window), naming the model's window.
        """
        kept = window if self.window is None else min(window, self.window)
        if self.window is None and self.max_len is not None:
            kept = min(kept, self.max_len)
        try:
            return dataclasses.replace(
                self,
                sink=0,
                window=kept,
                max_len=None,
                attention_window=window,
                keep=0,
                keep_score="recent",
                keep_quantize=None,
            )
        except JaxkvError as e:
            raise JaxkvError(f"the model's local layers keep its sliding window of {window} tokens: {e}") from None

    # ---- derived sizes (all static Python ints) -------------------------------------------
    @property
    def kv_modes(self) -> tuple:
        """``(keys' mode, values' mode)``, e.g. ``("int2", "fp16")``."""
        return self.k_quantize or self.kv_quantize, self.kv_quantize

    @property
    def quantized(self) -> bool:
        """True when keys or values are KIVI codes (int8, int4, int2)."""
        return any(mode in QUANT_MODES for mode in self.kv_modes)

    @property
    def bits(self) -> int:
        """Bits per stored code of keys and values (KIVI modes with one precision only; see
        ``storage.key_bits`` and ``storage.value_bits``)."""
        return self.storage.bits

    @property
    def bounded(self) -> bool:
        """True for a StreamingLLM cache (one with a window)."""
        return self.policy.bounded

    @property
    def n_sink(self) -> int:
        """Full-precision sink slots."""
        return self.sink

    @property
    def n_ring(self) -> int:
        """Full-precision ring slots after the sinks: the window (fp modes) or the residual (KIVI)."""
        return self.storage.ring_slots(self.policy)

    @property
    def n_quant(self) -> int:
        """Token slots of the quantised ring (0 for fp modes); a multiple of group_size."""
        return self.storage.store_slots(self.policy)

    @property
    def capacity(self) -> int:
        """C: token slots allocated per row and layer (sinks + ring + quantised ring + keep tier)."""
        return self.n_sink + self.n_ring + self.n_quant + self.keep

    @property
    def token_limit(self) -> int | None:
        """Most tokens a row may append (full caches), None when unbounded (StreamingLLM)."""
        return self.policy.token_limit

    @property
    def max_chunk(self) -> int:
        """Most tokens one row may append in one call (a chunk never crosses the ring or a flush)."""
        return self.n_ring

    def describe(self) -> str:
        """One-line human description, e.g. ``sink 4 + window 252, int4 (G=32, R=128), absolute``."""
        shape = f"sink {self.sink} + window {self.window}" if self.bounded else f"full {self.max_len}"
        shape += f" ({self.sink} full-precision sinks)" if self.sink and not self.bounded else ""
        if self.attention_window is not None:
            shape += f" (local attention over {self.attention_window})"
        keys = ", pre-RoPE keys" if self.pre_rope_keys and self.positions == "absolute" else ""
        if self.keep:
            shape += f" + {self.retention.describe()}"
        return f"{shape}, {self.storage.describe()}, positions={self.positions}{keys}"


@dataclasses.dataclass(frozen=True)
class LayerSpecs:
    """Per-layer cache specs: layer ``l`` keeps and stores tokens as ``specs[l]`` says.

    For a model whose layers need different caches: a local sliding-window layer beside
    a global one, more bits for sensitive layers. A single :class:`CacheSpec` still means
    "the same for every layer". Consecutive layers with equal specs form one *run*, stored
    as one :class:`jaxkv.cache.kv.KVCache` (its layers stacked on L) inside a
    :class:`jaxkv.cache.layered.LayeredCache`. Every layer appends the same tokens: a call
    admits the fewest any layer's policy allows, and a prefill chunk respects every
    layer's plan (:meth:`plan_chunk`).

    Attributes:
      specs: one :class:`CacheSpec` per layer (hashable tuple).
    Raises:
      JaxkvError: an empty tuple or an entry that is not a CacheSpec.
    """

    specs: tuple

    def __post_init__(self):
        if not isinstance(self.specs, tuple) or not self.specs or not all(isinstance(s, CacheSpec) for s in self.specs):
            raise JaxkvError(f"LayerSpecs.specs={self.specs!r}: expected a non-empty tuple of CacheSpec, one per layer")

    @property
    def runs(self) -> tuple:
        """``((spec, first layer, end layer), ...)``: maximal runs of consecutive equal specs."""
        out, start = [], 0
        for i in range(1, len(self.specs) + 1):
            if i == len(self.specs) or self.specs[i] != self.specs[start]:
                out.append((self.specs[start], start, i))
                start = i
        return tuple(out)

    @property
    def policy(self) -> LayerSpecs:
        """The joint admission and chunk plan of every layer's policy (this object)."""
        return self

    # ---- what every layer allows (static ints, host plans, traced admission) ------------------
    @property
    def token_limit(self) -> int | None:
        limits = [s.token_limit for s in self.specs if s.token_limit is not None]
        return min(limits) if limits else None

    @property
    def max_chunk(self) -> int:
        return min(s.max_chunk for s in self.specs)

    @property
    def capacity(self) -> int:
        """Token slots of the largest layer cache."""
        return max(s.capacity for s in self.specs)

    @property
    def bounded(self) -> bool:
        return all(s.bounded for s in self.specs)

    def admit(self, length, n):
        """int32[B]: the fewest of ``n[b]`` tokens any layer's policy admits."""
        for spec, _, _ in self.runs:
            n = spec.policy.admit(length, n)
        return n

    def plan_chunk(self, length, remaining, chunk: int):
        """Host-side: the fewest tokens any layer's policy plans (see :meth:`Policy.plan_chunk`)."""
        return np.min([spec.policy.plan_chunk(length, remaining, chunk) for spec, _, _ in self.runs], axis=0)

    def describe(self) -> str:
        return "; ".join(
            f"layers {a}-{b - 1}: {s.describe()}" if b - a > 1 else f"layer {a}: {s.describe()}"
            for s, a, b in self.runs
        )

    @classmethod
    def boosted(
        cls,
        base: CacheSpec,
        n_layers: int,
        layers,
        mode: str = "int8",
        *,
        names: tuple[str, str] = ("LayerSpecs.boosted: layers", "LayerSpecs.boosted: mode"),
    ) -> LayerSpecs:
        """``base`` on every layer but ``layers``, whose keys and values are stored in ``mode``:
        more bits for the few layers a low-bit cache hurts most (see
        :func:`jaxkv.eval.layer_sensitivity`, which finds them).

        A boosted layer keeps ``base``'s sinks, window, positions, group size and residual;
        its keys and values are both ``mode`` (``k_quantize``/``v_quantize`` cleared), and a
        float ``mode`` stores its sinks and window in that mode (``residual_dtype`` back to
        float32, the only one a float cache takes, and no Hadamard rotation; on a StreamingLLM base such a layer keeps
        the last W tokens, without the up to R of a KIVI residual). A model's local
        sliding-window layers still get their window from :meth:`jaxkv.LlamaConfig.cache_spec`.

        Args:
          base: the spec of the other layers. n_layers: L, the model's layer count.
          layers: layer indices in ``[0, L)``, each once, in any order (e.g. ``(0, 1, 29)``).
          mode: the boosted layers' storage, fp32|fp16|bf16|int8|int4|int2; it must store at
            least as many bits per element as each side of ``base`` and more than one of them.
          names: what the messages call ``layers`` and ``mode`` (the CLI passes its flags).
        Returns:
          ``LayerSpecs`` of L specs.
        Raises:
          JaxkvError: ``base`` not a CacheSpec, a bad ``n_layers``, no layers, an index that is
            not an integer in ``[0, L)`` or given twice (named, with L), a ``mode`` outside
            the six or one that would not raise the precision (named with ``base``'s modes).

        Source: KVTuner (Li et al. 2025, arXiv 2502.04420): layers differ in how much KV
        quantisation costs them, so a per-layer precision beats one precision for all.
        """
        layers_name, mode_name = names
        if not isinstance(base, CacheSpec):
            raise JaxkvError(f"LayerSpecs.boosted: base={base!r}: expected a CacheSpec")
        if int_problem(n_layers, 1) is not None:
            raise JaxkvError(f"LayerSpecs.boosted: n_layers={n_layers!r}: {int_problem(n_layers, 1)}")
        if not isinstance(mode, str) or mode not in KV_MODES:
            raise JaxkvError(
                f"{mode_name} {mode if isinstance(mode, str) else repr(mode)}: expected one of {', '.join(KV_MODES)}"
            )
        shown = ",".join(map(str, layers)) if isinstance(layers, (tuple, list)) else repr(layers)
        if not isinstance(layers, (tuple, list)) or not layers:
            raise JaxkvError(f"{layers_name} {shown}: expected one or more layer indices in [0, {n_layers})")
        for i, layer in enumerate(layers):
            if int_problem(layer, 0, n_layers) is not None:
                raise JaxkvError(
                    f"{layers_name} {shown}: layer {layer!r} is out of range: the model has "
                    f"{n_layers} layers (0-{n_layers - 1})"
                )
            if layer in layers[:i]:
                raise JaxkvError(f"{layers_name} {shown}: layer {layer} is given twice")

        def bits(m: str) -> int:
            return BITS[m] if m in BITS else 8 * np.dtype(FLOAT_DTYPES[m]).itemsize

        if any(bits(mode) < bits(m) for m in base.kv_modes) or all(bits(mode) == bits(m) for m in base.kv_modes):
            k, v = base.kv_modes
            sides = f"{k} keys and values" if k == v else f"{k} keys and {v} values"
            raise JaxkvError(
                f"{mode_name} {mode} does not raise the precision of the cache's {sides} (nothing "
                "to boost): boost an int8, int4 or int2 cache to a mode of more bits per element "
                "(int2 < int4 < int8 < fp16 = bf16 < fp32)"
            )
        quantized = mode in QUANT_MODES  # a float mode: float32 sinks/window of its own mode, nothing rotated
        boost = dataclasses.replace(
            base,
            kv_quantize=mode,
            k_quantize=None,
            v_quantize=None,
            residual_dtype=base.residual_dtype if quantized else "float32",
            hadamard=base.hadamard if quantized else "none",
        )
        chosen = {int(layer) for layer in layers}
        return cls(tuple(boost if i in chosen else base for i in range(n_layers)))
