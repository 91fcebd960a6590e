"""Decode benchmark: prefill and decode tokens/s, compile seconds, peak RSS and cache bytes,
by cache mode and generated length, beside a memory-bandwidth roofline.

    python scripts/bench_decode.py --model ../shared/data/models/stories260K.bin \
        --modes full,sink4+252,sink4+252:int8,sink4+256:int4 --lengths 256,1024,4096 --json out.json --plot out.png
    python scripts/bench_decode.py --model synthetic:L=4,D=256,N=8,K=2,F=688,V=4096 --lengths 256,1024
    python scripts/bench_decode.py --model preset:smollm2-135m --lengths 256,1024   # configs/ presets

Decode ms/token at length n is the mean time per token of the decode blocks that end
within [n - window, n] (block = 64 tokens), measured in one run to the longest length.
The roofline is (weight bytes + live cache bytes) / bandwidth, bandwidth from a NumPy copy.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time

import jax
import numpy as np
from flax import nnx

import jaxkv
from jaxkv.cache.memory import memory_report
from jaxkv.models import LoadedModel
from jaxkv.models.config import LlamaConfig
from jaxkv.models.llama import Llama


def parse_mode(text: str, n_max: int) -> jaxkv.CacheSpec:
    """``full``, ``full:int8``, ``sink4+252``, ``sink4+256:int4`` (KIVI with G=32, R=32)."""
    shape, _, quant = text.partition(":")
    quant = quant or "fp32"
    kivi = dict(group_size=32, residual=32) if quant.startswith("int") else {}
    if shape == "full":
        return jaxkv.CacheSpec(max_len=n_max, kv_quantize=quant, **kivi)
    sink, window = shape.removeprefix("sink").split("+")
    return jaxkv.CacheSpec(sink=int(sink), window=int(window), kv_quantize=quant, **kivi)


def load(model: str) -> LoadedModel:
    if model.startswith("preset:"):  # random weights in a named shape from configs/
        config = LlamaConfig.from_preset(model.removeprefix("preset:"))
        return LoadedModel(config=config, model=Llama(config, rngs=nnx.Rngs(0)), tokenizer=None)
    if model.startswith("synthetic:"):
        fields = dict(kv.split("=") for kv in model.removeprefix("synthetic:").split(","))
        names = dict(L="n_layers", D="dim", N="n_heads", K="n_kv_heads", F="hidden_dim", V="vocab_size")
        cfg = {names[k]: int(v) for k, v in fields.items()}
        cfg["head_dim"] = cfg["dim"] // cfg["n_heads"]
        config = LlamaConfig(**cfg, name=model)
        return LoadedModel(config=config, model=Llama(config, rngs=nnx.Rngs(0)), tokenizer=None)
    return jaxkv.load_model(model)


def bandwidth_gbs() -> float:
    """Memory bandwidth in GB/s from a 256 MiB NumPy copy (read + write counted), best of 5."""
    src = np.ones(64 * 2**20, np.float32)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
    return 2 * src.nbytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench(model: LoadedModel, spec: jaxkv.CacheSpec, lengths, prompt_len: int, block: int, bw: float) -> dict:
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, model.config.vocab_size, prompt_len)]
    n_max = max(lengths)
    stamps = []
    t_start = time.perf_counter()
    result = jaxkv.generate(model, [prompt], max_new_tokens=n_max, cache=spec, block=block, eos_id=-1,
                            on_block=lambda out: stamps.append((time.perf_counter(), int((out >= 0).sum()))))
    del t_start
    # per-block ms/token; the first block's time includes nothing but decode (compile is separate)
    ends, per_token = [], []
    prev = stamps[0][0] - result.decode_s / max(1, len(stamps))  # approximate start of block 0
    total = 0
    for t, count in stamps:
        total += count
        ends.append(total)
        per_token.append((t - prev) / max(count, 1) * 1e3)
        prev = t
    ends, per_token = np.array(ends), np.array(per_token)
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.model)))
    mem = memory_report(result.cache)
    rows = []
    for n in lengths:
        sel = (ends <= n) & (ends > n - max(4 * block, 256))
        sel = sel if sel.any() else ends >= min(n, ends.max())
        ms = float(np.median(per_token[sel][1:] if sel.sum() > 2 else per_token[sel]))
        live = mem.live_bytes if spec.bounded else mem.live_bytes * min(n + prompt_len, mem.tokens_seen[0]) / max(mem.tokens_seen[0], 1)
        rows.append(dict(length=n, decode_ms_per_token=ms, decode_tokens_per_s=1e3 / ms,
                         roofline_ms_per_token=(weights + live) / (bw * 1e9) * 1e3))
    return dict(
        mode=spec.describe(), prompt_tokens=prompt_len,
        prefill_tokens_per_s=prompt_len / max(result.prefill_s, 1e-9), compile_s=result.compile_s,
        cache_bytes_allocated=mem.allocated_bytes, cache_bytes_live=mem.live_bytes,
        tokens_stored=mem.tokens_stored[0], weight_bytes=weights,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, rows=rows,
        curve=dict(ends=ends.tolist(), ms=per_token.tolist()),
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model file, preset:NAME (configs/), synthetic:L=..,D=..,N=..,K=..,F=..,V=.., or default")
    p.add_argument("--modes", default="full,sink4+252,sink4+256:int8,sink4+256:int4")
    p.add_argument("--lengths", default="256,1024,4096")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--batch-block", type=int, default=64, dest="block")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    a = p.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    model = load(a.model) if a.model else jaxkv.load_model()
    bw = bandwidth_gbs()
    results = dict(
        machine=f"{platform.machine()} {platform.processor() or ''} cpus={jax.local_device_count()} backend={jax.default_backend()}",
        versions=dict(python=platform.python_version(), jax=jax.__version__),
        model=model.config.name, bandwidth_gbs=bw, runs=[],
    )
    print(f"# {results['model']} on {jax.default_backend()}, bandwidth {bw:.1f} GB/s, jax {jax.__version__}")
    print("| mode | length | decode ms/token | tokens/s | roofline ms/token | ratio | prefill tokens/s | compile s | cache bytes | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in a.modes.split(","):
        spec = parse_mode(mode, a.prompt_tokens + max(lengths))
        r = bench(model, spec, lengths, a.prompt_tokens, a.block, bw)
        results["runs"].append(r)
        for row in r["rows"]:
            print(f"| {r['mode']} | {row['length']} | {row['decode_ms_per_token']:.3f} | {row['decode_tokens_per_s']:.1f} | "
                  f"{row['roofline_ms_per_token']:.3f} | {row['roofline_ms_per_token'] / row['decode_ms_per_token']:.2f} | "
                  f"{r['prefill_tokens_per_s']:.1f} | {r['compile_s']:.1f} | {r['cache_bytes_allocated']} | {r['peak_rss_mib']:.0f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for r in results["runs"]:
            ax.plot(r["curve"]["ends"], r["curve"]["ms"], label=r["mode"], lw=1)
        ax.set_xlabel("generated tokens")
        ax.set_ylabel("decode ms/token")
        ax.set_xscale("log")
        ax.legend(fontsize=7)
        ax.set_title(f"{results['model']} ({jax.default_backend()})")
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
