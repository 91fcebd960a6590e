"""Aggregate decode throughput of each weight format at B rows: the batched decode loop (the
one the serving engine runs, no HTTP) on a real model, formats alternating (issue 43;
docs/PERFORMANCE.md).

    python scripts/bench_weights.py ../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --formats fp32,int8,q8_0,q4_0,q4_1 --rows 1,16,64 --tokens 64 --rounds 2

Each row: a 16-token prompt, then ``--tokens`` greedy tokens (no EOS stop) into a StreamingLLM
cache (sink 4 + window 252); prints tokens per second over all rows (compile excluded), round by
round, and each format's median against fp32's.
"""

from __future__ import annotations

import argparse

import numpy as np

import jaxkv
from jaxkv.decode import decode, new_cache, prefill
from jaxkv.models import ggml


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--formats", default="fp32,int8,q8_0,q4_0,q4_1")
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    formats = args.formats.split(",")
    models = {fmt: jaxkv.load_model(args.model, weights=fmt) for fmt in formats}
    print(f"ggml: {ggml.library_dir()}, {ggml.threads()} threads; {ggml.unavailable_reason() or 'available'}")
    spec = jaxkv.CacheSpec(sink=4, window=252)
    rng = np.random.default_rng(0)
    for b in (int(r) for r in args.rows.split(",")):
        prompts = [list(rng.integers(100, 1000, 16)) for _ in range(b)]
        rates: dict[str, list[float]] = {fmt: [] for fmt in formats}
        for r in range(args.rounds + 1):  # round 0 compiles
            for fmt in formats:
                m = models[fmt]
                cache, logits = prefill(m, new_cache(m.config, spec, b), prompts)
                out = decode(m, cache, logits, max_new_tokens=[args.tokens] * b, block=32, eos_id=None)
                if r:
                    rates[fmt].append(b * args.tokens / out.decode_s)
        base = np.median(rates["fp32"]) if "fp32" in rates else None
        for fmt in formats:
            ratio = f"  {np.median(rates[fmt]) / base:.2f}x fp32" if base else ""
            print(f"B={b:3d} {fmt:5s} " + " ".join(f"{t:7.1f}" for t in rates[fmt]) + f" tok/s{ratio}", flush=True)


if __name__ == "__main__":
    main()
