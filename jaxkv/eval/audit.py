"""StableHLO audit for the constructs that break Apple's Metal backends (DESIGN §4).

``jax.jit(f).lower(...).as_text()`` is the StableHLO (MLIR) module that a PJRT plugin such
as jax-metal or jax-mps receives. This module scans that text for the hazards DESIGN §4
lists, so a change that would crash or silently miscompile on a Mac is caught on any
machine (CPU included):

==================  ===========================================================================
hazard              what is flagged
==================  ===========================================================================
``unsigned-index``  an unsigned integer (``ui8``..``ui64``) *index* operand of
                    ``dynamic_slice``, ``dynamic_update_slice``, ``gather``, ``dynamic_gather``
                    or ``scatter``. Unsigned *data* is fine: ``uint8`` is KIVI's code storage,
                    and the PRNG computes on ``ui32``.
``int4``            a 4-bit integer element type (``i4``/``ui4``, i.e. ``jnp.int4``/``uint4``).
``f64``             a float64 element type (``jax_enable_x64`` leaking in).
``complex``         a complex element type.
``scatter``         ``stablehlo.scatter`` (``x.at[i].set(...)``); jaxkv writes with
                    ``dynamic_update_slice`` at exact slots instead (DESIGN §2).
``bit-count``       ``stablehlo.popcnt`` or ``stablehlo.count_leading_zeros``.
==================  ===========================================================================

API: :func:`audit_text` (a StableHLO string -> list of findings), :func:`audit_function`
(lower a function, then audit it), :func:`audit_cache_mode` and :func:`audit_all` (jaxkv's
decode step, prefill chunk, compiled decode loop and KIVI kernels for every cache mode),
and :func:`backend_support` (which cache modes a backend is known to run). Run
``python -m jaxkv.eval.audit`` for a table.
"""

from __future__ import annotations

import functools
import itertools
import re
import sys

import jax
import jax.numpy as jnp

from jaxkv.cache.policy import POSITION_MODES
from jaxkv.cache.spec import KV_MODES

HAZARDS = ("unsigned-index", "int4", "f64", "complex", "scatter", "bit-count")

# op -> how to find its index operands from the operand count n
_INDEX_OPERANDS = {
    "dynamic_slice": lambda n: range(1, n),
    "dynamic_update_slice": lambda n: range(2, n),
    "gather": lambda n: range(1, 2),
    "dynamic_gather": lambda n: range(1, n),
    "scatter": lambda n: range((n - 1) // 2, (n - 1) // 2 + 1),  # (inputs..., indices, updates...)
}
_OP = re.compile(r'(?<![#\w.])"?stablehlo\.([a-z_]+)\b')  # an op name, not a #stablehlo.* attribute
_ELEMENT = re.compile(r"tensor<(?:[0-9?]+x)*((?:complex<[a-z0-9]+>)|[a-z]+[0-9]*)")
_UNSIGNED = re.compile(r"^ui[0-9]+$")
_SIGNATURE = re.compile(r":\s*\((.*)\)\s*->")


def _split_types(text: str) -> list[str]:
    """Split ``tensor<..>, tensor<..>`` at top-level commas."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


def _element(type_text: str) -> str | None:
    m = _ELEMENT.search(type_text)
    return m.group(1) if m else None


def audit_text(text: str) -> list[str]:
    """Findings for every Metal hazard in a StableHLO module's text (empty list = clean).

    Args:
      text: MLIR text, e.g. ``jax.jit(f).lower(*args).as_text()``.
    Returns:
      one string per finding, ``"line N: HAZARD: detail: <the line>"`` (HAZARD one of
      :data:`HAZARDS`); at most one finding per hazard and line.
    """
    lines = text.splitlines()
    findings = []

    def report(i, hazard, detail):
        findings.append(f"line {i + 1}: {hazard}: {detail}: {lines[i].strip()[:200]}")

    for i, line in enumerate(lines):
        elements = set(_ELEMENT.findall(line))
        if elements & {"i4", "ui4"}:
            report(i, "int4", "4-bit integer type " + "/".join(sorted(elements & {"i4", "ui4"})))
        if "f64" in elements or "complex<f64>" in elements:
            report(i, "f64", "float64 type")
        if any(e.startswith("complex") for e in elements):
            report(i, "complex", "complex type " + "/".join(sorted(e for e in elements if e.startswith("complex"))))
        op_match = _OP.search(line)
        op = op_match.group(1) if op_match else None
        if op in ("popcnt", "count_leading_zeros"):
            report(i, "bit-count", f"stablehlo.{op}")
        if op == "scatter":
            report(i, "scatter", "stablehlo.scatter (.at[].set/add); write with dynamic_update_slice instead")
        if op in _INDEX_OPERANDS:
            signature = _SIGNATURE.search(line)
            j = i
            while signature is None and j + 1 < len(lines) and j - i < 200:  # an op with a region: `}) : (...) -> ...`
                j += 1
                if lines[j].lstrip().startswith("})"):
                    signature = _SIGNATURE.search(lines[j])
                    break
            if signature is None:
                continue
            types = _split_types(signature.group(1))
            bad = sorted(
                {
                    e
                    for k in _INDEX_OPERANDS[op](len(types))
                    if k < len(types)
                    for e in [_element(types[k])]
                    if e and _UNSIGNED.match(e)
                }
            )
            if bad:
                report(i, "unsigned-index", f"stablehlo.{op} index operand of type {'/'.join(bad)} (use int32)")
    return findings


def lower_text(fn, *args, **kwargs) -> str:
    """StableHLO text of ``fn`` lowered at ``args`` (``fn`` may already be ``jax.jit``-ed,
    e.g. with static arguments; otherwise it is jitted here)."""
    lower = getattr(fn, "lower", None)
    lowered = lower(*args, **kwargs) if lower is not None else jax.jit(fn).lower(*args, **kwargs)
    return lowered.as_text()


def audit_function(fn, *args, **kwargs) -> list[str]:
    """:func:`audit_text` of ``fn`` lowered at ``args``/``kwargs`` (see :func:`lower_text`)."""
    return audit_text(lower_text(fn, *args, **kwargs))


# ------------------------------------------------------------------- jaxkv's own programs

MODES = tuple(itertools.product(KV_MODES, ("full", "streaming"), POSITION_MODES)) + (
    ("int4/int8", "streaming", "cache"),
    ("int2/fp16", "streaming", "absolute"),
    ("fp16/int4", "full", "absolute"),
    ("bf16/int2", "streaming", "cache"),
    ("int4@float16", "streaming", "cache"),
    ("int2@bfloat16", "full", "absolute"),
    ("int2+pre-rope", "streaming", "absolute"),
    ("int4/int2+hadamard-values", "streaming", "cache"),
    ("int2+hadamard-keys", "full", "absolute"),
    ("int4+hadamard-both", "streaming", "absolute"),
    ("int4/int2+pre-rope+hadamard-values@float16", "streaming", "absolute"),
)
"""Every cache mode the audit covers: (storage, full|streaming, positions). The storage is a
``kv_quantize`` mode, or ``K/V`` (keys as K, values as V), then any options of
:data:`jaxkv.cache.spec.LEVERS` (``+pre-rope``, ``+hadamard-values``, ...), optionally
``@DTYPE`` (the residual and sinks in that ``residual_dtype``)."""


def mode_spec(storage: str, kind: str, positions: str):
    """A small :class:`CacheSpec` of one mode of :data:`MODES` (sink 4 + window 16 or a full
    cache of 32; KIVI G=4, R=8)."""
    from jaxkv.cache.spec import CacheSpec, lever_fields

    modes, _, residual_dtype = storage.partition("@")
    modes, *options = modes.split("+")
    keys, _, values = modes.partition("/")
    shape = dict(sink=4, window=16) if kind == "streaming" else dict(max_len=32)
    return CacheSpec(
        kv_quantize=values or keys,
        k_quantize=keys,
        residual_dtype=residual_dtype or "float32",
        group_size=4,
        residual=8,
        positions=positions,
        **lever_fields(options),
        **shape,
    )


SAMPLERS = ("greedy", "temperature")


def audit_cache_mode(spec, model=None, *, batch: int = 2, chunk: int = 4, samplers=SAMPLERS) -> dict[str, list[str]]:
    """Lower jaxkv's programs for one cache spec and audit each.

    Args:
      spec: the :class:`CacheSpec`.
      model: a Flax NNX model with the ``(tokens, n, cache, last_only)`` contract and a
        ``config`` (default: a tiny random :class:`Llama`).
    Returns:
      ``{program: findings}`` for ``forward`` (the decode step, T=1), ``forward T=chunk``
      (a prefill chunk), ``_decode_block`` (the compiled decode loop, :func:`jaxkv.decode.lower_decode`) with each of
      ``samplers`` ("greedy"; "temperature" = temperature + top-k + top-p) and, for KIVI
      modes, the quantise/dequantise kernels.
    """
    from flax import nnx

    from jaxkv.decode import Sampler, lower_decode, new_cache
    from jaxkv.models.step import forward
    from jaxkv.testing import tiny_model

    model = model if model is not None else tiny_model()
    graphdef, state = nnx.split(model)
    cache = new_cache(model.config, spec, batch)
    step = jax.jit(forward, static_argnums=0)
    n = jnp.ones((batch,), jnp.int32)
    out = {
        "forward": audit_function(step, graphdef, state, jnp.zeros((batch, 1), jnp.int32), n, cache),
        f"forward T={chunk}": audit_function(step, graphdef, state, jnp.zeros((batch, chunk), jnp.int32), n, cache),
    }
    rules = {"greedy": Sampler(), "temperature": Sampler(temperature=0.8, top_k=8, top_p=0.9)}
    for name in samplers:
        sampler = rules[name]
        lowered = lower_decode(model, cache, sampler=sampler, block=4, eos_id=1, max_new_tokens=4)
        out[f"_decode_block {name}"] = audit_text(lowered.as_text())
    if spec.quantized:
        bits = sorted({spec.storage.key_bits, spec.storage.value_bits} - {None})
        out["kivi kernels"] = [f for b in bits for f in audit_kivi_kernels(b, spec.group_size, spec.scale_dtype)]
    return out


def audit_kivi_kernels(bits: int, group_size: int = 4, scale_dtype="float16") -> list[str]:
    """Findings for the KIVI quantise/dequantise kernels (keys and values) at ``bits``,
    dequantising to float32, float16 and bfloat16."""
    from jaxkv.cache import kivi

    x = jnp.zeros((2, 2, 2 * group_size, 8), jnp.float32)  # [B, K, T, H]
    findings = []
    qk = jax.eval_shape(lambda x: kivi.quantize_keys(x, bits=bits, group_size=group_size, scale_dtype=scale_dtype), x)
    qv = jax.eval_shape(lambda x: kivi.quantize_values(x, bits=bits, scale_dtype=scale_dtype), x)
    findings += audit_function(
        lambda x: kivi.quantize_keys(x, bits=bits, group_size=group_size, scale_dtype=scale_dtype), x
    )
    findings += audit_function(lambda x: kivi.quantize_values(x, bits=bits, scale_dtype=scale_dtype), x)
    zeros = functools.partial(jax.tree.map, lambda s: jnp.zeros(s.shape, s.dtype))
    for dtype in (jnp.float32, jnp.float16, jnp.bfloat16):
        findings += audit_function(
            lambda q: kivi.dequantize_keys(q, bits=bits, group_size=group_size, dtype=dtype),  # noqa: B023 (traced here)
            zeros(qk),
        )
        findings += audit_function(lambda q: kivi.dequantize_values(q, bits=bits, dtype=dtype), zeros(qv))  # noqa: B023
    return findings


def audit_all(model=None) -> dict[tuple[str, str, str], dict[str, list[str]]]:
    """:func:`audit_cache_mode` for every mode of :data:`MODES` (keyed by the mode tuple)."""
    return {mode: audit_cache_mode(mode_spec(*mode), model) for mode in MODES}


# ----------------------------------------------------------------- what a backend supports

_ALL_OK = dict.fromkeys(KV_MODES, "supported")
_METAL = {**_ALL_OK, "bf16": "risky: bfloat16 is unreliable on Metal (prefer fp16)"}


def backend_support(platform: str) -> dict[str, str]:
    """Cache modes (``kv_quantize``) a JAX platform is known to run, per DESIGN §4.

    ``cpu``, ``gpu``/``cuda``/``rocm`` and ``tpu`` run every mode. Apple's ``METAL``
    (jax-metal) and ``mps`` (jax-mps) run fp32, fp16 and the KIVI modes (int8/int4/int2:
    uint8 codes, int32 indices, no int4 dtype, no scatter, as this module checks); bf16 is
    risky there. Other platforms: "unknown".
    """
    p = platform.lower()
    if p in ("cpu", "gpu", "cuda", "rocm", "tpu"):
        return dict(_ALL_OK)
    if p in ("metal", "mps"):
        return dict(_METAL)
    return dict.fromkeys(_ALL_OK, "unknown")


def main(argv=None) -> int:
    """``python -m jaxkv.eval.audit``: audit every mode, print one line per mode; exit 1 on a hazard."""
    bad = 0
    for mode, programs in audit_all().items():
        findings = [f"{prog}: {f}" for prog, fs in programs.items() for f in fs]
        bad += bool(findings)
        print(f"{'/'.join(mode):28s} {'OK' if not findings else f'{len(findings)} hazard(s)'}")
        for f in findings[:10]:
            print("   ", f)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
