#!/usr/bin/env python
"""KIVI tables (issue 4): cache memory by mode, and greedy agreement with an fp32 cache.

Usage::

    python scripts/kivi_tables.py            # both tables, markdown
    python scripts/kivi_tables.py --json     # the same numbers as one JSON object
    python scripts/kivi_tables.py --no-greedy

(a) **Memory**, at SmolLM2-135M's KV shape (30 layers, 3 KV heads, head dim 64, B=1),
G=32, R=32, counted from the *allocated* pytree leaves of ``KVCache.create`` (zeros,
so cheap) with :func:`jaxkv.memory_report`: everything is included (codes, scales and
zeros, the full-precision residual, sinks, position arrays and lengths).

"N stored tokens" means a cache with exactly N token slots per row and layer, every one
of which holds a token once N tokens have been appended:

* fp32 / bf16: a full cache, ``CacheSpec(max_len=N)``;
* int8 / int4 / int2: a KIVI window of ``W = N - R`` quantised slots plus the ``R``-token
  full-precision residual, ``CacheSpec(window=N - R, residual=R, group_size=G)``. With
  the lazy flush (DESIGN §2), after N tokens the quantised ring holds
  ``R * floor((N - 1) / R) = N - R`` tokens and the residual the last R: all N stored.

(b) **Greedy match**: 8 prompts decoded together (``jaxkv.generate``, B=8, ragged
prompts), 100 new tokens each, greedy, EOS disabled (``eos_id=-1``, so every row runs
the full 100 steps), with a *full* cache of ``longest prompt + 100`` tokens in each mode.
KIVI modes use G=32, R=32: with R=128 a ~110-token sequence would never leave the
residual and nothing would be quantised; with R=32 up to 96 of the ~110 tokens are read
back from codes. The score of a prompt is the fraction of the fp32-cache tokens
reproduced before the first divergence (1.0 = all 100 identical); the table gives the
mean over the 8 prompts, and how many prompts match exactly.

The test ``tests/test_kivi_cache.py`` imports :func:`memory_rows` and
:func:`greedy_match` from here, so the numbers asserted there are the numbers printed.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = pathlib.Path(os.environ.get("JAXKV_DATA", REPO.parent / "shared" / "data"))
MODELS = DATA / "models"
STORIES_BIN = MODELS / "stories260K.bin"
TOK512_MODEL = MODELS / "tok512.model"
SMOLLM2 = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"

SMOLLM2_SHAPE = dict(n_layers=30, n_kv_heads=3, head_dim=64)
MEMORY_TOKENS = (128, 256, 512, 1024, 2048)
MEMORY_MODES = ("fp32", "bf16", "int8", "int4", "int2")
GREEDY_MODES = ("bf16", "int8", "int4", "int2")
GROUP_SIZE = 32
RESIDUAL = 32
NEW_TOKENS = 100
PROMPTS = (
    # the prior implementation's four
    "The first president of the United States",
    "In machine learning,",
    "Once upon a time",
    "Photosynthesis is",
    # four more: a story opening, dialogue, a list, a question
    "Lily and her dog went to the park. They",
    '"Can I have a cookie?" asked Tom. His mom said',
    "The three primary colors are",
    "Why is the sky blue? The sky is blue because",
)


# ------------------------------------------------------------------------- (a) memory


def memory_spec(mode: str, tokens: int, *, group_size: int = GROUP_SIZE, residual: int = RESIDUAL):
    """The cache with exactly ``tokens`` token slots in ``mode`` (see the module docstring)."""
    from jaxkv import CacheSpec
    from jaxkv.cache.spec import QUANT_MODES

    if mode in QUANT_MODES:
        return CacheSpec(window=tokens - residual, kv_quantize=mode, group_size=group_size, residual=residual)
    return CacheSpec(max_len=tokens, kv_quantize=mode)


def allocated_report(spec, *, batch: int = 1, shape: dict = SMOLLM2_SHAPE):
    """:class:`jaxkv.MemoryReport` of a freshly allocated cache, and the summed bytes of its leaves."""
    import jax

    from jaxkv import KVCache, memory_report

    cache = KVCache.create(spec, batch=batch, **shape)
    leaves = sum(int(x.nbytes) for x in jax.tree.leaves(cache))
    return memory_report(cache), leaves


def memory_rows(tokens=MEMORY_TOKENS, modes=MEMORY_MODES, *, group_size=GROUP_SIZE, residual=RESIDUAL,
                shape: dict = SMOLLM2_SHAPE) -> list[dict]:
    """One dict per (tokens, mode): capacity, bytes by group, total, leaf total, ratio vs bf16."""
    rows = []
    for n in tokens:
        reports = {m: allocated_report(memory_spec(m, n, group_size=group_size, residual=residual), shape=shape)
                   for m in modes}
        bf16 = reports["bf16"][0].allocated_bytes if "bf16" in reports else allocated_report(
            memory_spec("bf16", n), shape=shape)[0].allocated_bytes
        for m in modes:
            rep, leaves = reports[m]
            rows.append(dict(tokens=n, mode=m, capacity=rep.capacity, bytes=rep.allocated_bytes, leaf_bytes=leaves,
                             groups=dict(rep.allocated), ratio_vs_bf16=bf16 / rep.allocated_bytes))
    return rows


def memory_markdown(rows: list[dict]) -> str:
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    tokens = list(dict.fromkeys(r["tokens"] for r in rows))
    cell = {(r["tokens"], r["mode"]): r for r in rows}
    out = ["| stored tokens | " + " | ".join(modes) + " |", "|---:|" + "---:|" * len(modes)]
    for n in tokens:
        out.append(f"| {n} | " + " | ".join(
            f"{cell[n, m]['bytes'] / 2**20:.3f} MiB ({cell[n, m]['ratio_vs_bf16']:.2f}x)" for m in modes) + " |")
    out.append("")
    out.append(f"Breakdown at {tokens[-1]} stored tokens (bytes):")
    out.append("")
    groups = [g for g in rows[0]["groups"]]
    out.append("| mode | " + " | ".join(groups) + " | total |")
    out.append("|---|" + "---:|" * (len(groups) + 1))
    for m in modes:
        r = cell[tokens[-1], m]
        out.append(f"| {m} | " + " | ".join(str(r["groups"][g]) for g in groups) + f" | {r['bytes']} |")
    return "\n".join(out)


# ------------------------------------------------------------------- (b) greedy match


def prefix_match(reference, got) -> float:
    """Fraction of ``reference`` reproduced by ``got`` before the first divergence."""
    n = 0
    for a, b in zip(reference, got):
        if a != b:
            break
        n += 1
    return n / len(reference)


def greedy_match(model, prompts=PROMPTS, *, modes=GREEDY_MODES, new_tokens: int = NEW_TOKENS,
                 group_size: int = GROUP_SIZE, residual: int = RESIDUAL) -> dict:
    """Greedy-decode ``prompts`` together with an fp32 full cache and with each of ``modes``.

    Args:
      model: a :class:`jaxkv.LoadedModel` (its tokenizer encodes the prompts, BOS as the model's default).
      prompts: texts, decoded as one ragged batch.
      modes: cache modes to compare with fp32 (float or KIVI; KIVI with ``group_size``/``residual``).
    Returns:
      ``{"reference": [[ids]], "fp32": timing, "prompt_lengths": [...], "modes": {mode: {"per_prompt":
      [...], "mean": float, "exact": int, "tokens": [[ids]], **timing}}}``; ``timing`` holds wall
      ``seconds``, ``cpu_seconds`` (all threads) and generate's ``compile_s``/``prefill_s``/``decode_s``.
    """
    from jaxkv import CacheSpec, generate
    from jaxkv.cache.spec import QUANT_MODES

    ids = [model.tokenizer.encode(p) for p in prompts]
    max_len = max(len(p) for p in ids) + new_tokens

    def run(mode):
        kw = dict(group_size=group_size, residual=residual) if mode in QUANT_MODES else {}
        t0, c0 = time.perf_counter(), time.process_time()
        out = generate(model, ids, max_new_tokens=new_tokens, cache=CacheSpec(max_len=max_len, kv_quantize=mode, **kw),
                       eos_id=-1)
        assert all(len(t) == new_tokens for t in out.token_ids), out.finish_reasons
        timing = dict(seconds=time.perf_counter() - t0, cpu_seconds=time.process_time() - c0,
                      compile_s=out.compile_s, prefill_s=out.prefill_s, decode_s=out.decode_s)
        return out.token_ids, timing

    reference, ref_timing = run("fp32")
    result = dict(reference=reference, fp32=ref_timing, prompt_lengths=[len(p) for p in ids], modes={})
    for mode in modes:
        got, timing = run(mode)
        per = [prefix_match(r, g) for r, g in zip(reference, got)]
        result["modes"][mode] = dict(per_prompt=per, mean=sum(per) / len(per), exact=sum(p == 1.0 for p in per),
                                     tokens=got, **timing)
    return result


def load_models() -> dict:
    """The two real models of the greedy table: stories260K (tok512.model) and SmolLM2-135M (GGUF)."""
    from jaxkv import load_model

    return {
        "stories260K": load_model(STORIES_BIN, tokenizer=TOK512_MODEL),
        "SmolLM2-135M": load_model(SMOLLM2),
    }


def greedy_markdown(results: dict) -> str:
    modes = list(next(iter(results.values()))["modes"])
    first = next(iter(results.values()))["reference"]
    n, steps = len(first), len(first[0])
    out = [f"Mean prefix match with the fp32 cache ({n} prompts, {steps} greedy tokens each; exact rows in brackets):",
           "", "| model | " + " | ".join(modes) + " |", "|---|" + "---:|" * len(modes)]
    for name, res in results.items():
        out.append(f"| {name} | " + " | ".join(
            f"{res['modes'][m]['mean']:.3f} ({res['modes'][m]['exact']}/{n})" for m in modes) + " |")
    out += ["", "Per prompt (fraction before the first divergence):", ""]
    out.append("| model | mode | " + " | ".join(f"p{i}" for i in range(n)) + " |")
    out.append("|---|---|" + "---:|" * n)
    for name, res in results.items():
        for m in modes:
            out.append(f"| {name} | {m} | " + " | ".join(f"{x:.2f}" for x in res["modes"][m]["per_prompt"]) + " |")
    return "\n".join(out)


def machine_facts() -> dict:
    import jax
    import flax
    import numpy as np

    return dict(python=platform.python_version(), jax=jax.__version__, jaxlib=jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
                flax=flax.__version__, numpy=np.__version__, backend=jax.default_backend(),
                cpu_count=os.cpu_count(), platform=platform.platform())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of markdown")
    parser.add_argument("--no-greedy", action="store_true", help="only the memory table (no model runs)")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    args = parser.parse_args(argv)

    rows = memory_rows()
    greedy, seconds = {}, {}
    if not args.no_greedy:
        for name, model in load_models().items():
            t0 = time.perf_counter()
            greedy[name] = greedy_match(model, new_tokens=args.new_tokens)
            seconds[name] = time.perf_counter() - t0
    if args.json:
        slim = {name: {k: v for k, v in res.items() if k != "reference"} for name, res in greedy.items()}
        for res in slim.values():
            res["modes"] = {m: {k: v for k, v in d.items() if k != "tokens"} for m, d in res["modes"].items()}
        print(json.dumps(dict(machine=machine_facts(), group_size=GROUP_SIZE, residual=RESIDUAL, shape=SMOLLM2_SHAPE,
                              memory=rows, greedy=slim, greedy_seconds=seconds, prompts=list(PROMPTS)), indent=1))
        return 0
    print(f"## KV cache memory at SmolLM2-135M's shape (L=30, K=3, H=64, B=1), G={GROUP_SIZE}, R={RESIDUAL}")
    print()
    print("Allocated bytes of every pytree leaf (ratio = bf16 bytes / these bytes).")
    print()
    print(memory_markdown(rows))
    if greedy:
        print()
        print("## Greedy decoding vs the fp32 cache")
        print()
        print(greedy_markdown(greedy))
        print()
        print("Wall seconds per model, 5 generate calls (fp32 + 4 modes), compile included: "
              + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()))
        print()
        print("| model | cache | wall s | cpu s | compile s | prefill s | decode s |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for name, res in greedy.items():
            for mode, t in [("fp32", res["fp32"])] + list(res["modes"].items()):
                print(f"| {name} | {mode} | {t['seconds']:.1f} | {t['cpu_seconds']:.1f} | {t['compile_s']:.1f} | "
                      f"{t['prefill_s']:.2f} | {t['decode_s']:.1f} |")
    print()
    print("Machine: " + ", ".join(f"{k} {v}" for k, v in machine_facts().items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
