"""Retrieval and perplexity of every eviction policy at one byte budget (issue 18; docs/RETRIEVAL.md).

The budget is a sink 4 + window 1020 fp16 cache's bytes. Each policy spends it differently:
StreamingLLM on the window; SnapKV, H2O and TOVA on a window of 508 plus a keep tier of 512 fp16
slots; tiered retention on a window of 508 plus a FIFO tier of int4 or int2 slots holding as many
bytes as 512 fp16 ones (K and V of one token, H = 64: fp16 256 B; int4 72 B = 64 of codes + 8 of
float16 scales and zeros; int2 40 B), int2 also with the tier quantised Hadamard-rotated. The full cache is the model's own limit.

Runs the passkey task (jaxkv.eval.retrieval_accuracy) at --lengths x --depths x --seeds for every
policy and streaming perplexity (jaxkv.eval.token_nll) on --ppl-tokens of TinyStories, and writes
docs/results/retrieval.json and one heat map per policy (docs/results/retrieval_policy_<name>.png).

    python scripts/retrieval.py                        # SmolLM2-135M-Instruct, the defaults
    python scripts/retrieval.py --lengths 1024 --depths 0.5 --seeds 1 --ppl-tokens 512   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from jaxkv import CacheSpec, load_model
from jaxkv.decode.loop import new_cache_bytes
from jaxkv.eval import perplexity, token_nll
from jaxkv.eval.retrieval import plot_heatmap, retrieval_accuracy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "..", "shared", "data")
WINDOW = dict(sink=4, kv_quantize="fp16")
POLICIES = {
    "full": None,  # a full fp16 cache sized per length
    "streamingllm": CacheSpec(window=1020, **WINDOW),
    "snapkv": CacheSpec(window=508, keep=512, keep_score="snapkv", **WINDOW),
    "h2o": CacheSpec(window=508, keep=512, keep_score="h2o", **WINDOW),
    "tova": CacheSpec(window=508, keep=512, keep_score="tova", **WINDOW),
    "tiered-int4": CacheSpec(window=508, keep=512 * 256 // 72, keep_quantize="int4", **WINDOW),
    "tiered-int2": CacheSpec(window=508, keep=512 * 256 // 40, keep_quantize="int2", **WINDOW),
    "tiered-int2-hadamard": CacheSpec(
        window=508, keep=512 * 256 // 40, keep_quantize="int2", hadamard="both", **WINDOW
    ),
}


def spec_for(name, slots):
    """The policy's spec (a full cache: ``slots`` rounded up to 256)."""
    return POLICIES[name] or CacheSpec(max_len=-(-slots // 256) * 256, kv_quantize="fp16")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(DATA, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--text", default=os.path.join(DATA, "text", "tinystories_valid_head.txt"))
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument(
        "--batch-size", type=int, default=8, help="rows per compiled call (depths x seeds is best a multiple)"
    )
    parser.add_argument("--ppl-tokens", type=int, default=4096)
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help="the policies whose retrieval is measured ('' for none)"
    )
    parser.add_argument(
        "--ppl-policies", default=",".join(POLICIES), help="the policies whose perplexity is measured ('' for none)"
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "results"))
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    model = load_model(args.model)
    with open(args.text, encoding="utf-8") as f:
        text = model.tokenizer.encode(f.read())[: args.ppl_tokens]  # as jaxkv ppl: BOS first if the tokenizer adds one
    os.makedirs(args.out, exist_ok=True)
    results = {}
    for name in filter(None, args.ppl_policies.split(",")):
        t0 = time.perf_counter()
        spec = spec_for(name, len(text))
        results[name] = dict(
            cache=spec.describe() if POLICIES[name] else "full fp16 (sized per length)",
            bytes=new_cache_bytes(model.config, spec_for(name, 1024), 1) if POLICIES[name] else None,
            ppl=perplexity(token_nll(model, text, cache=spec)),
            ppl_seconds=time.perf_counter() - t0,
        )
        print(
            f"{name}: ppl {results[name]['ppl']:.4f} over {len(text)} tokens, {results[name]['bytes']} bytes",
            flush=True,
        )
    for name in filter(None, args.policies.split(",")):
        result = retrieval_accuracy(
            model,
            lambda slots, name=name: spec_for(name, slots),
            "passkey",
            lengths,
            depths,
            args.seeds,
            batch=args.batch_size,
            log=lambda line: print(f"  {name}: {line}", file=sys.stderr, flush=True),  # noqa: B023
        )
        entry = results.setdefault(name, {})
        entry.update(
            accuracy=result.accuracy.tolist(),
            mean=result.accuracy.mean(axis=0).tolist(),
            seconds=result.seconds,
            retrieval=result.to_json(),
        )
        plot_heatmap(result, os.path.join(args.out, f"retrieval_policy_{name}.png"), title=f"passkey, {name}")
        print(f"{name}: mean accuracy per length {[round(100 * a) for a in entry['mean']]} %, {result.seconds:.0f} s")
        print(result.table(), flush=True)
    with open(os.path.join(args.out, "retrieval.json"), "w") as f:
        json.dump(
            dict(lengths=lengths, depths=depths, seeds=args.seeds, ppl_tokens=len(text), policies=results), f, indent=1
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
