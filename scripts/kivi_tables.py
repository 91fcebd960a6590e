#!/usr/bin/env python
"""KIVI tables (issue 4): cache memory by mode, and greedy agreement with an fp32 cache.

Usage::

    python scripts/kivi_tables.py            # both tables, markdown
    python scripts/kivi_tables.py --json     # the same numbers as one JSON object
    python scripts/kivi_tables.py --no-greedy

The tables and their conventions are :mod:`jaxkv.eval.tables` (``memory_rows``,
``greedy_match``); the models are stories260K (tok512.model) and SmolLM2-135M (GGUF) from
``../shared/data`` (or ``$JAXKV_DATA``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
MODELS = pathlib.Path(os.environ.get("JAXKV_DATA", REPO.parent / "shared" / "data")) / "models"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of markdown")
    parser.add_argument("--no-greedy", action="store_true", help="only the memory table (no model runs)")
    parser.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per prompt (default 100)")
    args = parser.parse_args(argv)

    from jaxkv import load_model
    from jaxkv.eval import tables
    from jaxkv.eval.report.measure import machine

    new_tokens = tables.NEW_TOKENS if args.new_tokens is None else args.new_tokens
    rows = tables.memory_rows()
    greedy, seconds = {}, {}
    if not args.no_greedy:
        models = {
            "stories260K": load_model(MODELS / "stories260K.bin", tokenizer=MODELS / "tok512.model"),
            "SmolLM2-135M": load_model(MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"),
        }
        for name, model in models.items():
            t0 = time.perf_counter()
            greedy[name] = tables.greedy_match(model, new_tokens=new_tokens)
            seconds[name] = time.perf_counter() - t0
    facts = machine()
    if args.json:
        slim = {name: {k: v for k, v in res.items() if k != "reference"} for name, res in greedy.items()}
        for res in slim.values():
            res["modes"] = {m: {k: v for k, v in d.items() if k != "tokens"} for m, d in res["modes"].items()}
        print(
            json.dumps(
                dict(
                    machine=facts,
                    group_size=tables.GROUP_SIZE,
                    residual=tables.RESIDUAL,
                    shape=tables.SMOLLM2_SHAPE,
                    memory=rows,
                    greedy=slim,
                    greedy_seconds=seconds,
                    prompts=list(tables.PROMPTS),
                ),
                indent=1,
            )
        )
        return 0
    print(
        f"## KV cache memory at SmolLM2-135M's shape (L=30, K=3, H=64, B=1), G={tables.GROUP_SIZE}, "
        f"R={tables.RESIDUAL}\n"
    )
    print("Allocated bytes of every pytree leaf (ratio = bf16 bytes / these bytes).\n")
    print(tables.memory_markdown(rows))
    if greedy:
        print("\n## Greedy decoding vs the fp32 cache\n")
        print(tables.greedy_markdown(greedy))
        print(
            f"\nWall seconds per model, {1 + len(tables.GREEDY_MODES)} generate calls, compile included: "
            + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
        )
        print("\n| model | cache | wall s | cpu s | compile s | prefill s | decode s |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for name, res in greedy.items():
            for mode, t in [("fp32", res["fp32"])] + list(res["modes"].items()):
                print(
                    f"| {name} | {mode} | {t['seconds']:.1f} | {t['cpu_seconds']:.1f} | {t['compile_s']:.1f} | "
                    f"{t['prefill_s']:.2f} | {t['decode_s']:.1f} |"
                )
    print("\nMachine: " + ", ".join(f"{k} {v}" for k, v in facts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
