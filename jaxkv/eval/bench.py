"""Decode benchmark (``jaxkv bench``): decode ms/token by cache mode and generated length,
beside a memory-bandwidth roofline; also prefill tokens/s, compile seconds, cache bytes, peak RSS,
and the temporary bytes of a compiled prefill call (:func:`prefill_temp_bytes`).

Method. For each cache mode, one run of :func:`jaxkv.generate`: batch 1, a random prompt of
``prompt_tokens`` ids, greedy, EOS disabled, ``max(lengths)`` generated tokens in compiled
blocks of ``block`` decode steps. The host stamps the time as each block arrives, which gives
ms/token per block (block 0 starts at the mean block time before its stamp). *Decode ms/token
at length n* is the median ms/token of the blocks ending within (n - W, n] generated tokens,
W = max(4 * block, 256), the earliest of them left out when there are more than two (or the
block holding token n when none ends there); *tokens/s* is 1000 / that. Compile seconds (prefill
and decode programs) are measured apart from decode.

With ``repeat`` N the modes run round-robin N times (A, B, C, A, B, C, ...), so that noise
from the machine hits every mode alike; the reported decode ms/token is the median over the
repeats (every repeat's value is kept), compile seconds come from the first repeat.

The *roofline* is the fastest a decode step can be if it must read every weight and every live
cache byte from memory once: (weight bytes + live cache bytes at n) / bandwidth, with the
bandwidth from a 256 MiB NumPy copy (read + write counted, best of 5). Live cache bytes at n are
the end-of-run live bytes for a bounded (StreamingLLM) cache, and for a full cache the
end-of-run live bytes scaled by (prompt + n) / tokens seen. ratio = roofline / measured
(1.0 = at the limit).
"""

from __future__ import annotations

import os
import platform
import re
import resource
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from jaxkv.cache.memory import memory_report
from jaxkv.cache.spec import KV_MODES, CacheSpec, lever_fields
from jaxkv.decode import chunk_len, generate, new_cache
from jaxkv.decode.loop import prefill_chunk
from jaxkv.errors import JaxkvError, check_int
from jaxkv.io import LoadedModel, load_model
from jaxkv.models.llama import Llama, LlamaConfig, weight_shapes
from jaxkv.models.weights import check_weight_format

KIVI = {"group_size": 32, "residual": 32}
"""KIVI group size G and residual R of the benchmark's int* modes, tokens."""

SYNTHETIC = {"L": "n_layers", "D": "dim", "N": "n_heads", "K": "n_kv_heads", "F": "hidden_dim", "V": "vocab_size"}
"""Keys of a ``synthetic:`` model spec and the :class:`LlamaConfig` fields they set."""

_MODE = re.compile(
    rf"(?:full|sink(\d+)\+(\d+))(?::({'|'.join(KV_MODES)})(?:/({'|'.join(KV_MODES)}))?((?:\+[a-z-]+)*))?"
)


def parse_mode(text: str, max_len: int) -> CacheSpec:
    """The cache a mode string names: ``full``, ``full:int8``, ``sink4+252``, ``sink4+256:int4``,
    ``sink4+256:int2/fp16``, ``sink4+256:int2+pre-rope+hadamard-values``.

    ``full`` is a full cache of ``max_len`` slots, ``sinkS+W`` a StreamingLLM cache of S sinks
    and a window of W tokens; ``:Q`` stores it as Q (fp32 default; int8|int4|int2 are KIVI with
    the group size and residual of :data:`KIVI`), ``:K/V`` keys as K and values as V, then any
    ``+OPTION`` of :data:`jaxkv.cache.spec.LEVERS` (pre-RoPE keys, a Hadamard rotation).

    Raises:
      JaxkvError: text of no such form (named), or a spec :class:`CacheSpec` refuses.
    """
    m = _MODE.fullmatch(text)
    if m is None:
        raise JaxkvError(
            f"cache mode {text!r}: expected full or sinkS+W, optionally :{'|'.join(KV_MODES)} "
            "or :K/V for keys and values, then +OPTIONs (e.g. full, sink4+252, sink4+256:int4, "
            "sink4+256:int2/fp16, sink4+256:int2+pre-rope+hadamard-values)"
        )
    sink, window, quant, values, options = m.groups()
    modes = dict(kv_quantize=values or quant or "fp32", k_quantize=quant if values else None)
    try:  # KIVI's group size and residual; float storage has none
        modes.update(lever_fields(options.split("+")[1:] if options else []))
        if window is None:
            return CacheSpec(max_len=max_len, **modes, **KIVI)
        return CacheSpec(sink=int(sink), window=int(window), **modes, **KIVI)
    except JaxkvError as e:
        raise JaxkvError(f"cache mode {text!r}: {e}") from None


def _synthetic_config(model: str) -> LlamaConfig:
    example = "e.g. synthetic:L=4,D=256,N=8,K=2,F=688,V=4096"
    fields = {}
    for item in model.removeprefix("synthetic:").split(","):
        key, _, value = item.partition("=")
        if key not in SYNTHETIC:
            raise JaxkvError(f"{model!r}: unknown key {key!r}; expected {', '.join(SYNTHETIC)} ({example})")
        try:
            fields[key] = int(value)
        except ValueError:
            raise JaxkvError(f"{model!r}: {key}={value!r} is not an integer ({example})") from None
    missing = [key for key in SYNTHETIC if key not in fields]
    if missing:
        raise JaxkvError(f"{model!r}: missing {', '.join(missing)}; expected all of {', '.join(SYNTHETIC)} ({example})")
    if fields["V"] < 4:  # the random prompt draws ids 3 .. V-1 (0-2 are special in llama2.c vocabularies)
        raise JaxkvError(f"{model!r}: V={fields['V']} is too small; expected V >= 4")
    if fields["N"] < 1 or fields["D"] % fields["N"]:
        raise JaxkvError(f"{model!r}: D={fields['D']} is not divisible by N={fields['N']} (head_dim = D / N)")
    return LlamaConfig(**{SYNTHETIC[k]: v for k, v in fields.items()}, head_dim=fields["D"] // fields["N"], name=model)


def load(model: str | None, weights: str = "fp32") -> LoadedModel:
    """The model to benchmark.

    Args:
      model: a model file or folder (see :func:`jaxkv.load_model`), None for the default model,
        ``preset:NAME`` (random weights in the shape of ``configs/NAME.json``), or
        ``synthetic:L=..,D=..,N=..,K=..,F=..,V=..`` (random weights: layers, width, query heads,
        KV heads, SwiGLU width, vocabulary; N must divide D and K must divide N).
      weights: the weight format (:data:`jaxkv.models.weights.WEIGHT_FORMATS`), as :func:`jaxkv.load_model` takes it.
    Raises:
      JaxkvError: an unknown preset; a synthetic spec with an unknown, missing or non-integer
      key, or a shape :class:`LlamaConfig` refuses; ModelFileError: bad model files.
    """
    if (model or "").startswith("preset:"):
        config = LlamaConfig.from_preset(model.removeprefix("preset:"))
    elif (model or "").startswith("synthetic:"):
        config = _synthetic_config(model)
    else:
        return load_model(model, weights=weights)
    check_weight_format(weights)
    random = Llama(config, rngs=nnx.Rngs(0))
    if weights != "fp32":
        random = Llama.from_weights(
            config,
            {name: np.asarray(getattr(random, name)[...]) for name in weight_shapes(config)},
            weight_format=weights,
        )
    return LoadedModel(config=config, model=random, tokenizer=None)


def bandwidth_gbs() -> float:
    """Memory bandwidth in GB/s (1e9 bytes/s) from a 256 MiB NumPy copy (read + write counted), best of 5."""
    src = np.ones(64 * 2**20, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def bench_mode(
    model: LoadedModel, spec: CacheSpec, lengths: Sequence[int], *, prompt_tokens: int, block: int, bandwidth: float
) -> dict:
    """One benchmark run of one cache mode to ``max(lengths)`` generated tokens (see the module docstring).

    Args:
      model: the model. spec: its cache. lengths: generated lengths to report, tokens.
      prompt_tokens: random prompt ids. block: decode steps per compiled call. bandwidth: GB/s.
    Returns:
      a dict: ``cache`` (the spec described), ``compile_s`` (seconds), ``prefill_tokens_per_s``,
      ``weight_bytes``, ``cache_bytes_allocated`` / ``cache_bytes_live`` / ``tokens_stored`` (at the
      end of the run), ``peak_rss_mib`` (the process's peak so far, MiB), ``rows`` (per length:
      ``decode_ms_per_token``, ``cache_bytes_live`` and ``roofline_ms_per_token`` at that length)
      and ``curve`` (``ends``: generated tokens at the end of each block, ``ms``: its ms/token).
    Raises:
      JaxkvError: a cache the model cannot use (e.g. a head dim that int4 codes do not divide).
    """
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, model.config.vocab_size, prompt_tokens)]
    stamps = []
    result = generate(
        model,
        [prompt],
        max_new_tokens=max(lengths),
        cache=spec,
        block=block,
        eos_id=-1,
        on_block=lambda out: stamps.append((time.perf_counter(), int((out >= 0).sum()))),
    )
    ends, per_token = [], []
    prev = stamps[0][0] - result.decode_s / len(stamps)  # approximate start of block 0
    for t, count in stamps:
        ends.append((ends[-1] if ends else 0) + count)
        per_token.append((t - prev) / max(count, 1) * 1e3)
        prev = t
    ends, per_token = np.array(ends), np.array(per_token)
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.model)))
    mem = memory_report(result.cache)
    seen = mem.tokens_seen[0]
    rows = []
    for n in lengths:
        sel = (ends <= n) & (ends > n - max(4 * block, 256))
        if not sel.any():
            sel = ends == ends[np.searchsorted(ends, n)]
        ms = float(np.median(per_token[sel][1:] if sel.sum() > 2 else per_token[sel]))
        live = mem.live_bytes if spec.bounded else round(mem.live_bytes * min(prompt_tokens + n, seen) / seen)
        rows.append(
            {
                "length": n,
                "decode_ms_per_token": ms,
                "cache_bytes_live": live,
                "roofline_ms_per_token": (weights + live) / (bandwidth * 1e9) * 1e3,
            }
        )
    rss_unit = 2**20 if sys.platform == "darwin" else 2**10  # ru_maxrss: bytes on macOS, KiB on Linux
    return {
        "cache": spec.describe(),
        "compile_s": result.compile_s,
        "prefill_tokens_per_s": prompt_tokens / max(result.prefill_s, 1e-9),
        "weight_bytes": weights,
        "cache_bytes_allocated": mem.allocated_bytes,
        "cache_bytes_live": mem.live_bytes,
        "tokens_stored": mem.tokens_stored[0],
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / rss_unit,
        "rows": rows,
        "curve": {"ends": ends.tolist(), "ms": per_token.tolist()},
    }


def prefill_temp_bytes(model: LoadedModel, spec: CacheSpec, *, chunk: int = 128) -> tuple[int, int]:
    """Temporary bytes XLA allocates for one compiled prefill call (:func:`jaxkv.decode.prefill`'s
    step) into a one-row cache of ``spec``: the ``temp_size_in_bytes`` of the compiled program's
    ``memory_analysis()`` (scratch buffers: attention scores, dequantised blocks; not the weights,
    the donated cache, nor the chunk's inputs and logits). Compiles, runs nothing.

    Args:
      model: the model. spec: its cache. chunk: tokens per prefill call, capped as
        :func:`jaxkv.decode.chunk_len` caps it (at ``spec.max_chunk``: a KIVI residual of R < chunk
        tokens makes the call R tokens).
    Returns:
      ``(temp bytes, tokens T of the compiled call)``.
    Raises:
      JaxkvError: a cache the model cannot use.
    """
    cache = new_cache(model.config, spec, 1)
    t = chunk_len(cache.spec, chunk, chunk)
    graphdef, state = nnx.split(model.model)
    tokens = jax.ShapeDtypeStruct((1, t), np.int32)
    n = jax.ShapeDtypeStruct((1,), np.int32)
    compiled = prefill_chunk.lower(graphdef, state, tokens, n, cache).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes), t


def run(
    model: str | LoadedModel | None,
    modes: Sequence[str] | Mapping[str, CacheSpec],
    lengths: Sequence[int],
    *,
    prompt_tokens: int,
    block: int,
    repeat: int,
    log: Callable[[str], None] | None = None,
    weights: str = "fp32",
) -> dict:
    """Benchmark every mode at every length, the modes round-robin ``repeat`` times.

    Validates every argument before loading the model.

    Args:
      model: a :class:`LoadedModel` or what :func:`load` takes. modes: mode strings (:func:`parse_mode`),
        or a mapping ``{label: CacheSpec}`` for caches no mode string names (the label is the run's ``mode``).
      lengths: generated lengths to report, tokens (one run per mode to the longest).
      prompt_tokens: prompt length, tokens. block: decode steps per compiled call. repeat: rounds over the modes.
      log: called with one line after each run (progress).
      weights: the weight format of a model :func:`load` loads (ignored for a LoadedModel).
    Returns:
      a JSON-able dict: ``model``, ``weights`` (the format), ``machine``, ``versions``, ``bandwidth_gbs`` (GB/s), the arguments, and
      ``runs``, one per mode: :func:`bench_mode`'s dict from the first repeat (``compile_s``, bytes, peak
      RSS) plus ``mode``, ``prefill_tokens_per_s`` (median; ``prefill_tokens_per_s_repeats``: each repeat's),
      ``curve`` (median ms/token per block) and per row ``decode_ms_per_token`` (median over repeats),
      ``decode_ms_per_token_repeats`` (each repeat's, in order), ``decode_tokens_per_s`` (1000 / the median).
    Raises:
      JaxkvError: a length, ``prompt_tokens``, ``block`` or ``repeat`` below 1, no lengths, a bad mode
      (:func:`parse_mode`) or model (:func:`load`).
    """
    if not lengths:
        raise JaxkvError("lengths []: expected at least one generated length")
    for what, value in (
        *(("length", n) for n in lengths),
        ("prompt tokens", prompt_tokens),
        ("block", block),
        ("repeat", repeat),
    ):
        check_int(what, value, 1, spaced=True)
    if min(lengths) < block:  # ms/token is measured per decode block
        raise JaxkvError(
            f"length {min(lengths)} is shorter than one decode block ({block} tokens): "
            "use lengths >= --block or a smaller --block"
        )
    if isinstance(modes, Mapping):
        modes, specs = list(modes), list(modes.values())
    else:
        specs = [parse_mode(mode, prompt_tokens + max(lengths)) for mode in modes]
    loaded = model if isinstance(model, LoadedModel) else load(model, weights)
    bandwidth = bandwidth_gbs()
    repeats = [[] for _ in specs]
    for r in range(repeat):
        for mode, spec, done in zip(modes, specs, repeats):
            done.append(
                bench_mode(loaded, spec, lengths, prompt_tokens=prompt_tokens, block=block, bandwidth=bandwidth)
            )
            if log:
                log(
                    f"[bench {r + 1}/{repeat}] {mode}: compile {done[-1]['compile_s']:.1f} s, "
                    f"{done[-1]['rows'][-1]['decode_ms_per_token']:.3f} ms/token at {lengths[-1]}"
                )
    return {
        "model": loaded.config.name,
        "weights": weights,
        "backend": jax.default_backend(),
        "machine": " ".join(
            filter(
                None,
                (
                    platform.machine(),
                    platform.processor(),
                    f"cpus={os.cpu_count()}",
                    f"devices={jax.local_device_count()}",
                ),
            )
        ),
        "versions": {"python": platform.python_version(), "jax": jax.__version__},
        "bandwidth_gbs": bandwidth,
        "prompt_tokens": prompt_tokens,
        "block": block,
        "repeat": repeat,
        "lengths": list(lengths),
        "runs": [{"mode": mode, **_combine(done)} for mode, done in zip(modes, repeats)],
    }


def _combine(repeats: list[dict]) -> dict:
    """One mode's repeats as one result: medians over the repeats, the rest from the first."""
    first = repeats[0]
    rows = []
    for i, row in enumerate(first["rows"]):
        ms = [rep["rows"][i]["decode_ms_per_token"] for rep in repeats]
        median = float(np.median(ms))
        rows.append(
            {
                **row,
                "decode_ms_per_token": median,
                "decode_ms_per_token_repeats": ms,
                "decode_tokens_per_s": 1e3 / median,
            }
        )
    prefill = [rep["prefill_tokens_per_s"] for rep in repeats]
    curve = {"ends": first["curve"]["ends"], "ms": np.median([rep["curve"]["ms"] for rep in repeats], axis=0).tolist()}
    return {
        **first,
        "prefill_tokens_per_s": float(np.median(prefill)),
        "prefill_tokens_per_s_repeats": prefill,
        "rows": rows,
        "curve": curve,
    }


def table(results: dict) -> str:
    """:func:`run`'s results as a markdown table under a ``#`` title line, one row per (mode, length).

    Columns: decode ms/token (median) and its spread over the repeats (min-max), tokens/s, roofline
    ms/token, ratio (roofline / measured), prefill tokens/s, compile s, allocated cache bytes, peak RSS MiB.
    """
    lines = [
        (
            f"# {results['model']} on {results['backend']}, bandwidth {results['bandwidth_gbs']:.1f} GB/s, "
            f"jax {results['versions']['jax']}, {results['repeat']} repeat(s)"
        ),
        (
            "| cache | length | decode ms/token | spread | tokens/s | roofline ms/token | ratio | prefill tokens/s "
            "| compile s | cache bytes | peak RSS MiB |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["runs"]:
        for row in r["rows"]:
            ms, reps = row["decode_ms_per_token"], row["decode_ms_per_token_repeats"]
            lines.append(
                f"| {r['cache']} | {row['length']} | {ms:.3f} | {min(reps):.3f}-{max(reps):.3f} | "
                f"{row['decode_tokens_per_s']:.1f} | {row['roofline_ms_per_token']:.3f} | {row['roofline_ms_per_token'] / ms:.2f} | "
                f"{r['prefill_tokens_per_s']:.1f} | {r['compile_s']:.1f} | {r['cache_bytes_allocated']} | {r['peak_rss_mib']:.0f} |"
            )
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    """Save decode ms/token against generated tokens (log x), one line per mode, to ``path`` (PNG, PDF, ...);
    dashed in the mode's colour: its roofline ms/token at each reported length.

    Raises:
      JaxkvError: matplotlib is not installed (``pip install 'jaxkv[results]'``); ``path``
      cannot be written.
    """
    plt = pyplot(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results["runs"]:
        (line,) = ax.plot(r["curve"]["ends"], r["curve"]["ms"], label=r["cache"], lw=1)
        ax.plot(
            [row["length"] for row in r["rows"]],
            [row["roofline_ms_per_token"] for row in r["rows"]],
            ls="--",
            marker="_",
            ms=12,
            color=line.get_color(),
            lw=0.8,
        )  # the roofline at each reported length
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("decode ms/token")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(plt.matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax.set_title(f"{results['model']} ({results['backend']}); dashed: roofline", fontsize=9)
    save_figure(fig, path, dpi=120)


def pyplot(path: str):
    """``matplotlib.pyplot`` on the Agg backend (no display), imported on first use, to draw ``path``.

    Raises:
      JaxkvError: matplotlib is not installed (``--plot PATH: needs matplotlib ...``).
    """
    try:
        import matplotlib
    except ImportError:
        raise JaxkvError(f"--plot {path}: needs matplotlib (pip install 'jaxkv[results]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, *, dpi: int) -> None:
    """Lay ``fig`` out tightly, write it to ``path`` (format by extension) and close it.

    Raises:
      JaxkvError: ``path`` cannot be written (``--plot PATH: cannot write it (...)``).
    """
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as e:
        raise JaxkvError(f"--plot {path}: cannot write it ({e})") from None
    finally:
        pyplot(path).close(fig)


def check_outputs(json_path: str | None, plot_path: str | None) -> None:
    """Fail before a long run, not after it: the output folders exist, matplotlib for a plot.

    Raises:
      JaxkvError: a ``--json`` / ``--plot`` path whose folder does not exist; ``--plot``
      without matplotlib.
    """
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not os.path.isdir(folder):
            raise JaxkvError(f"{flag} {path}: no such folder {folder}")
    if plot_path:
        pyplot(plot_path)
