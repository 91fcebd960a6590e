#!/usr/bin/env python
"""Regenerate docs/QUANTIZATION.md and docs/results/quantization.png (issue 15): ΔPPL of low-bit
KV caches against the effective bits they cost, greedy match, decode speed, prefill memory.

Usage (from the repository root; the plot needs the ``results`` extra, i.e. matplotlib)::

    .venv/bin/python scripts/quantization.py                   # every config, both models -> docs/
    .venv/bin/python scripts/quantization.py --quick           # smoke run: stories260K, 256 tokens -> a temp folder
    .venv/bin/python scripts/quantization.py --only int2-r32,int2-cachepos --out /tmp/q
    .venv/bin/python scripts/quantization.py --list            # the configs, and which this jaxkv can build
    .venv/bin/python scripts/quantization.py --render-only     # re-render from docs/results/quantization.json

The configs are :data:`CONFIGS` below (``recommended=True``: greedy match measured too); the
measurements, verdicts, plot and markdown are :mod:`jaxkv.eval.report.quantization`. A full run
refuses configs this jaxkv cannot build yet (a CacheSpec field it lacks, the per-layer boost
slot); ``--quick`` skips them (listed in the document), ``--only`` picks what to run. The
``fp16`` baseline is always measured (decode and prefill are compared with it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile

from jaxkv.eval.report.quantization import BASELINE, FULL, QUICK, QuantConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = pathlib.Path(os.environ.get("JAXKV_DATA", REPO.parent / "shared" / "data"))
TEXT = DATA / "text" / "tinystories_valid_head.txt"
MODEL_FILES = {
    "SmolLM2-135M": ("SmolLM2-135M-Instruct.Q4_1.gguf", None),
    "stories260K": ("stories260K.bin", "tok512.model"),
}
MAIN, PREFILL_MODEL, QUICK_MODEL = "SmolLM2-135M", "stories260K", "stories260K"


def _kivi(mode: str, residual: int = 128, group: int = 32, **more) -> dict:
    return dict(kv_quantize=mode, group_size=group, residual=residual, **more)


def _k4v2(**more) -> dict:  # keys int4, values int2 (llama.cpp's -ctk q4 -ctv q2 idea), KIVI's default G and R
    return _kivi("int2", k_quantize="int4", **more)


TOP2 = (18, 23)  # SmolLM2's most sensitive layers (stories260K has 5 layers: its configs boost none)

CONFIGS = (
    # baselines: the float caches (ΔPPL vs the fp32 full cache)
    QuantConfig("fp16", "baseline", dict(kv_quantize="fp16")),
    QuantConfig("bf16", "baseline", dict(kv_quantize="bf16")),
    # literal KIVI: G = R = 32 (most tokens read back from codes) and KIVI's default G = 32, R = 128
    QuantConfig("int8-r32", "KIVI", _kivi("int8", 32)),
    QuantConfig("int8-r128", "KIVI", _kivi("int8")),
    QuantConfig("int4-r32", "KIVI", _kivi("int4", 32)),
    QuantConfig("int4-r128", "KIVI", _kivi("int4")),
    QuantConfig("int2-r32", "KIVI", _kivi("int2", 32)),
    QuantConfig("int2-r128", "KIVI", _kivi("int2")),
    # each lever alone, on int2 (R = 128) and on int4 where it matters
    QuantConfig("int2-k4", "lever", _k4v2()),
    QuantConfig("int2-v4", "lever", _kivi("int4", k_quantize="int2")),
    QuantConfig("int2-res16", "lever", _kivi("int2", residual_dtype="float16")),
    QuantConfig("int2-cachepos", "lever", _kivi("int2", positions="cache")),
    QuantConfig("int2-prerope", "lever", _kivi("int2", pre_rope_keys=True)),
    QuantConfig("int2-had-v", "lever", _kivi("int2", hadamard="values")),
    QuantConfig("int2-had-k", "lever", _kivi("int2", hadamard="keys")),
    QuantConfig("int2-had-kv", "lever", _kivi("int2", hadamard="both")),
    QuantConfig("int2-g128", "lever", _kivi("int2", 128, 128)),
    # per-layer boost: the top 2 layers of SmolLM2's sensitivity pass on int2, G = R = 32, 1,024 tokens
    # (`jaxkv ppl --kv-sensitivity`: 18, 23; then 17, 24), in int8
    QuantConfig("int2-boost2", "lever", _kivi("int2"), boost=TOP2, boost_quantize="int8"),
    QuantConfig("int4-prerope", "lever", _kivi("int4", pre_rope_keys=True)),
    QuantConfig("int4-had-v", "lever", _kivi("int4", hadamard="values")),
    # combinations (recommended: the candidates for each budget). R = 32 in float16: at 2,048
    # tokens the residual and its 16 bits weigh 0.25 bit/element, R = 128 a whole bit.
    QuantConfig("int4-r32-res16", "combination", _kivi("int4", 32, residual_dtype="float16"), recommended=True),
    QuantConfig(
        "k4v2-r32-hadkv-res16",
        "combination",
        _k4v2(residual=32, hadamard="both", residual_dtype="float16"),
        recommended=True,
    ),
    QuantConfig(
        "k4v2-r32-prerope-hadv-res16",
        "combination",
        _k4v2(residual=32, pre_rope_keys=True, hadamard="values", residual_dtype="float16"),
    ),
    QuantConfig(
        "int2-r32-hadkv-res16",
        "combination",
        _kivi("int2", 32, hadamard="both", residual_dtype="float16"),
        recommended=True,
    ),
    QuantConfig(
        "int2-r32-hadkv-res16-boost2",
        "combination",
        _kivi("int2", 32, hadamard="both", residual_dtype="float16"),
        boost=TOP2,
        boost_quantize="int4",
        recommended=True,
    ),
    QuantConfig(
        "int2-r32-prerope-hadv-res16",
        "combination",
        _kivi("int2", 32, pre_rope_keys=True, hadamard="values", residual_dtype="float16"),
    ),
    QuantConfig(
        "int2-g16-r32-hadkv-res16", "combination", _kivi("int2", 32, 16, hadamard="both", residual_dtype="float16")
    ),
)


def flags_text(config: QuantConfig, tokens: int) -> str:
    """The config's storage flags as `jaxkv ppl` spells them (:func:`jaxkv.cli.flags.spec_flags`);
    CacheSpec fields without a flag follow in brackets."""
    from jaxkv.cli.flags import spec_flags

    words, unflagged = spec_flags(config.spec(max_len=tokens), shape=False)
    if config.boost is not None:  # the per-layer boost's flags (slot: see jaxkv.eval.report.quantization.boosted)
        words += ["--kv-boost-layers", ",".join(map(str, config.boost)), "--kv-boost-quantize", config.boost_quantize]
    return " ".join(
        words + ([f"[no flag: {', '.join(f'{k}={v!r}' for k, v in unflagged.items())}]"] if unflagged else [])
    )


def select(only: str | None, quick: bool) -> tuple[list[QuantConfig], dict]:
    """``(configs to measure, {name: missing} of those skipped)``; the baseline always comes along.

    Raises:
      SystemExit: an unknown name in ``only``, an unavailable config asked for by name, or (a
        full run) any unavailable config.
    """
    names = [c.name for c in CONFIGS]
    if only:
        wanted = [n.strip() for n in only.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            raise SystemExit(f"--only: unknown config(s) {', '.join(unknown)}; expected some of {', '.join(names)}")
        chosen = [c for c in CONFIGS if c.name in wanted or c.name == BASELINE]
    else:
        chosen = list(CONFIGS)
    missing = {c.name: c.missing() for c in chosen if c.missing()}
    if missing and (only or not quick):
        raise SystemExit(
            "this jaxkv cannot build: "
            + "; ".join(f"{k} (needs {', '.join(v)})" for k, v in missing.items())
            + ": leave them out with --only, or use --quick to skip them"
        )
    return [c for c in chosen if c.name not in missing], missing


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke run: {QUICK_MODEL} only, small sizes; skips the "
        "configs this jaxkv cannot build (writes to a temp folder unless --out is given)",
    )
    parser.add_argument("--only", metavar="NAME,NAME", help=f"measure only these configs (and {BASELINE}); see --list")
    parser.add_argument(
        "--tokens",
        type=int,
        metavar="N",
        help=f"tokens of text scored per model (default: {FULL['tokens']}; --quick: {QUICK['tokens']})",
    )
    parser.add_argument(
        "--sections", default="ppl,greedy,decode,prefill", help="what to measure (default: %(default)s)"
    )
    parser.add_argument("--out", type=pathlib.Path, help="folder for QUANTIZATION.md and results/ (default: docs)")
    parser.add_argument("--render-only", action="store_true", help="re-render from OUT/results/quantization.json")
    parser.add_argument("--no-plots", action="store_true", help="do not draw the plot (no matplotlib needed)")
    parser.add_argument("--list", action="store_true", help="list the configs and what each lacks, then exit")
    args = parser.parse_args(argv)
    if args.list:
        for c in CONFIGS:
            print(
                f"{c.name:30s} {c.kind:12s} {'rec. ' if c.recommended else '     '}"
                + (f"needs {', '.join(c.missing())}" if c.missing() else "available")
            )
        return 0
    out = args.out or (
        pathlib.Path(tempfile.gettempdir()) / "jaxkv-quantization-quick" if args.quick else REPO / "docs"
    )
    resdir = out / "results"
    resdir.mkdir(parents=True, exist_ok=True)
    json_path = resdir / "quantization.json"

    from jaxkv.eval.report import quantization as q
    from jaxkv.eval.report.measure import encode_prefix, log, to_jsonable
    from jaxkv.files import atomic_write

    if args.render_only:
        if not json_path.is_file():
            raise SystemExit(f"--render-only: no {json_path} to render (run without --render-only first)")
        res = json.loads(json_path.read_text())
    else:
        import jax

        jax.config.update("jax_platforms", "cpu")
        from jaxkv.io import load_model

        configs, skipped = select(args.only, args.quick)
        sizes = dict(QUICK if args.quick else FULL)
        if args.tokens is not None:
            if args.tokens < 2:
                raise SystemExit(f"--tokens {args.tokens}: expected an integer >= 2")
            sizes["tokens"] = args.tokens
        flags = {c.name: flags_text(c, sizes["tokens"]) for c in configs}  # fails now, not after the run
        names = [QUICK_MODEL] if args.quick else list(MODEL_FILES)
        models = {}
        for name in names:
            weights, tokenizer = MODEL_FILES[name]
            models[name] = load_model(
                DATA / "models" / weights, tokenizer=None if tokenizer is None else DATA / "models" / tokenizer
            )
        ids = {name: encode_prefix(m, TEXT, sizes["tokens"]) for name, m in models.items()}
        prompts = q.text_prompts(
            TEXT, count=sizes["greedy_prompts"], chars=sizes["greedy_chars"], skip_chars=sizes["greedy_skip_chars"]
        )
        res = q.measure(
            models,
            ids,
            configs,
            sizes=sizes,
            prompts=prompts,
            flags=flags,
            quick=args.quick,
            main=MAIN if MAIN in models else names[0],
            prefill_model=PREFILL_MODEL if PREFILL_MODEL in models else names[0],
            skipped=skipped,
            sections=[s.strip() for s in args.sections.split(",")],
        )
        res = json.loads(json.dumps(to_jsonable(res)))
        atomic_write(json_path, json.dumps(res, indent=1).encode(), private=False)
    plot_name = None
    if args.no_plots:
        plot_name = "quantization.png" if (resdir / "quantization.png").exists() else None
    elif "ppl" in res:
        plot_name = q.plot(res, resdir / "quantization.png")
    (out / "QUANTIZATION.md").write_text(q.render(res, plot_name), encoding="utf-8")
    log(f"wrote {out / 'QUANTIZATION.md'} from {json_path}" + (f"; plot {plot_name}" if plot_name else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
