#!/usr/bin/env python
"""Regenerate docs/RESULTS.md and its plots (issue 5): what the caches cost in quality.

Usage (from the repository root; needs the ``results`` extra, i.e. matplotlib)::

    .venv/bin/python scripts/reproduce.py                 # everything -> docs/RESULTS.md, docs/results/
    .venv/bin/python scripts/reproduce.py --quick         # smoke run, small sizes -> a temp folder
    .venv/bin/python scripts/reproduce.py --render-only   # re-render from docs/results/results.json

Inputs are only ``../shared/data`` (relative to the repository root): stories260K
(llama2.c .bin + tok512.model), SmolLM2-135M-Instruct (GGUF) and the TinyStories
validation text. Every number in the document is measured by this script in this run;
nothing is copied in except the prior Swift implementation's published tables (marked
as such) for comparison.

Sections
  1. NLL versus position (StreamingLLM Fig. 3 at small scale): full cache, window only,
     sink 4 + window in both position modes, and the sliding-window-with-recomputation
     oracle, evaluated at a uniform sample of positions (it costs a whole window per token).
  2. Perplexity by number of sinks at a fixed cache size (StreamingLLM Table 2).
  3. KIVI: perplexity by precision and group size through the real cache, and the K/V
     quantisation-axis ablation (KIVI Table 1) by fake quantisation in a small forward of
     our own that reuses jaxkv's weights, RMSNorm, RoPE and ``quantize_affine``.
  4. Memory table at the prior implementation's model shape and at SmolLM2's, counted from
     the cache's pytree leaves (``scripts/kivi_tables.py``).
  5. Greedy prefix match against an fp32 cache (``scripts/kivi_tables.py``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import platform
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = REPO / ".." / "shared" / "data"
MODELS = DATA / "models"
TEXT = DATA / "text" / "tinystories_valid_head.txt"
STORIES_BIN = MODELS / "stories260K.bin"
TOK512 = MODELS / "tok512.model"
SMOLLM2 = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"

sys.path.insert(0, str(REPO / "scripts"))
import kivi_tables as kt  # noqa: E402  (memory table, greedy prefix match: reused, not duplicated)

FULL = dict(
    # section 1
    st_tokens=8192, sm_tokens=4096, cache=256, sink=4,
    st_rec_stride=8, sm_rec_stride=16, st_rec_batch=32, sm_rec_batch=8,
    # section 2
    sinks=(0, 1, 2, 4, 8), st_sink_tokens=8192, sm_sink_tokens=4096,
    # section 3
    kivi_modes=("int8", "int4", "int2"), groups=(32, 64, 128),
    st_kivi_segments=16, st_kivi_len=512, sm_kivi_tokens=1024, ablation_group=32, ablation_bits=(4, 2),
    # section 5
    greedy_new=100,
)
QUICK = dict(
    FULL, st_tokens=1024, sm_tokens=320, st_rec_stride=64, sm_rec_stride=32, st_sink_tokens=1024,
    sm_sink_tokens=320, st_kivi_segments=2, sm_kivi_tokens=256, greedy_new=10,
)
MODEL_NAMES = ("stories260K", "SmolLM2-135M")
PRIOR_SHAPE = dict(n_layers=12, n_kv_heads=8, head_dim=32)
MEM_TOKENS = (128, 256, 384, 500, 1024, 2048)
MEM_MODES = ("bf16", "int8", "int4", "int2")
# The prior Swift implementation's published table (prior-art/streamingllm-kivi-swift.md), MB as printed
# there (decimal: 6,144,000 B of bf16 K+V at 500 tokens is printed "6.2 MB"); 1024 and 2048 were extrapolated.
PRIOR_MEMORY = {
    128: (1.6, 0.854, 0.854, 0.478), 256: (3.2, 1.7, 1.7, 0.947), 384: (4.7, 2.5, 2.5, 1.4),
    500: (6.2, 3.3, 3.3, 1.8), 1024: (12.5, 6.6, 6.6, 3.5), 2048: (25.0, 13.2, 13.2, 7.0),
}
PRIOR_GREEDY = {  # prompt -> (bf16, int8, int4) prefix match, 60 tokens, its model (27M, 12L, 8H, D=32)
    "The first president…": (1.00, 1.00, 1.00), "In machine learning…": (1.00, 1.00, 0.82),
    "Once upon a time…": (1.00, 1.00, 1.00), "Photosynthesis is…": (0.52, 1.00, 1.00),
}

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


class Timer:
    """Wall and CPU (all threads) seconds of a block, appended to ``sink[name]``."""

    def __init__(self, sink: dict, name: str):
        self.sink, self.name = sink, name

    def __enter__(self):
        self.t, self.c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.sink[self.name] = dict(wall_s=round(time.perf_counter() - self.t, 1),
                                    cpu_s=round(time.process_time() - self.c, 1))


# ------------------------------------------------------------------------------ machine


def machine() -> dict:
    import flax
    import jax
    import jaxlib
    import numpy as np

    cpu = platform.processor() or "unknown"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return dict(cpu=cpu, logical_cpus=os.cpu_count(), usable_cpus=usable, platform=platform.platform(),
                python=platform.python_version(), jax=jax.__version__, jaxlib=jaxlib.__version__,
                flax=flax.__version__, numpy=np.__version__, backend=jax.default_backend(),
                devices=[str(d) for d in jax.devices()],
                load_avg_start=[round(x, 2) for x in os.getloadavg()])


# ------------------------------------------------------------------------------ helpers


def encode_prefix(model, n: int) -> list[int]:
    """The first ``n`` ids of the text as one stream (the tokenizer's default BOS), at least n or an error."""
    text = TEXT.read_text(encoding="utf-8")
    chars = 8 * n
    while True:
        ids = model.tokenizer.encode(text[:chars])
        if len(ids) > n + 8 or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n:
        raise SystemExit(f"{TEXT}: only {len(ids)} tokens, {n} needed")
    return ids[:n]


def ppl_of(nll) -> float:
    import numpy as np

    return float(math.exp(float(np.mean(nll))))


def paired(nll_a, nll_b, idx) -> dict:
    """exp(mean(a - b)) over positions ``idx`` with a 95 % interval from the paired SE."""
    import numpy as np

    d = np.asarray(nll_a)[idx] - np.asarray(nll_b)[idx]
    se = float(np.std(d, ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    m = float(np.mean(d))
    return dict(ratio=math.exp(m), lo=math.exp(m - 1.96 * se), hi=math.exp(m + 1.96 * se), n=int(len(d)))


def recompute_at(model, ids, positions, *, window: int, batch: int):
    """The library's recomputation oracle (``recompute_contexts`` + ``_recompute_batch``, the code behind
    :func:`jaxkv.eval.recompute_nll`) evaluated only at query ``positions`` (nll of ``ids[i + 1]``)."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxkv.eval.perplexity import _recompute_batch, recompute_contexts

    ids = np.asarray(ids, np.int32)
    index, length = recompute_contexts(len(ids), window)
    rows = np.asarray(positions, np.int64)
    c = model.config
    shape = (c.n_layers, c.n_kv_heads, c.head_dim)
    graphdef, state = nnx.split(model.model)
    out = np.empty(len(rows), np.float64)
    for r0 in range(0, len(rows), batch):
        sel = rows[r0: r0 + batch]
        tok = np.zeros((batch, index.shape[1]), np.int32)
        n = np.zeros((batch,), np.int32)
        tgt = np.zeros((batch,), np.int32)
        tok[: len(sel)] = ids[index[sel]]
        n[: len(sel)] = length[sel]
        tgt[: len(sel)] = ids[sel + 1]
        nll = _recompute_batch(graphdef, state, jnp.asarray(tok), jnp.asarray(n), jnp.asarray(tgt), shape=shape)
        out[r0: r0 + len(sel)] = np.asarray(nll, np.float64)[: len(sel)]
    return out


# ------------------------------------------------- fake-quantised forward (KIVI Table 1 ablation)


def _fake_quant(x, how, bits, group):
    """Quantise then dequantise ``x[B, K, T, H]``: ``channel`` = per channel in groups of ``group`` tokens,
    ``token`` = per token over the H channels of a head, None = untouched (jaxkv.cache.kivi.quantize_affine)."""
    from jaxkv.cache.kivi import dequantize_affine, quantize_affine

    if how is None:
        return x
    axis, gs = (-2, group) if how == "channel" else (-1, None)
    qt = quantize_affine(x, bits=bits, axis=axis, group_size=gs)  # float16 scale/zero, as the cache's default
    return dequantize_affine(qt, bits=bits, axis=axis, group_size=gs, dtype=x.dtype)


@functools.lru_cache(maxsize=None)
def _fq_fn(config, k_how, v_how, bits, group):
    import jax
    import jax.numpy as jnp
    from jax import lax

    from jaxkv.cache.rope import apply_rope
    from jaxkv.models.llama import rms_norm

    c = config

    @jax.jit
    def run(weights, tokens):
        """One teacher-forced causal pass over ``tokens[B, T]`` with every layer's K (after RoPE) and V
        fake-quantised; returns (nll float32[B, T-1], attention mass on key 0 float32[L])."""
        b, t = tokens.shape
        pos = jnp.arange(t, dtype=jnp.int32)
        g = c.n_heads // c.n_kv_heads
        causal = pos[:, None] >= pos[None, :]
        x = jnp.take(weights["embed"], tokens, axis=0)

        def layer(x, w):
            h = rms_norm(x, w["attn_norm"], c.norm_eps)
            q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
            if c.attention_bias:
                q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
            q = apply_rope(q.reshape(b, t, c.n_kv_heads, g, c.head_dim), pos[None, :, None, None], theta=c.rope_theta)
            k = apply_rope(jnp.swapaxes(k.reshape(b, t, c.n_kv_heads, c.head_dim), 1, 2), pos[None, None, :],
                           theta=c.rope_theta)
            v = jnp.swapaxes(v.reshape(b, t, c.n_kv_heads, c.head_dim), 1, 2)
            k, v = _fake_quant(k, k_how, bits, group), _fake_quant(v, v_how, bits, group)
            s = jnp.einsum("btkgh,bksh->bkgts", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(
                jnp.float32(c.head_dim))
            p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
            sink_mass = jnp.mean(p[..., 32:, 0])  # queries at positions >= 32
            out = jnp.einsum("bkgts,bksh->btkgh", p, v).reshape(b, t, c.n_heads * c.head_dim)
            x = x + out @ w["wo"]
            h = rms_norm(x, w["mlp_norm"], c.norm_eps)
            x = x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
            return x, sink_mass

        layers = {k: v for k, v in weights.items() if k not in ("embed", "final_norm", "lm_head")}
        x, sink_mass = lax.scan(layer, x, layers)
        x = rms_norm(x, weights["final_norm"], c.norm_eps)
        head = weights["embed"].T if c.tie_embeddings else weights["lm_head"]
        logp = jax.nn.log_softmax(jnp.dot(x[:, :-1], head, preferred_element_type=jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return nll, sink_mass

    return run


def fake_quant_nll(model, tokens, *, k_how=None, v_how=None, bits=4, group=32):
    import jax.numpy as jnp
    import numpy as np

    from jaxkv.models.llama import BIAS_WEIGHTS, LAYER_WEIGHTS

    c = model.config
    names = LAYER_WEIGHTS + (BIAS_WEIGHTS if c.attention_bias else ()) + ("embed", "final_norm") + (
        () if c.tie_embeddings else ("lm_head",))
    weights = {n: getattr(model.model, n)[...] for n in names}
    nll, sink = _fq_fn(c, k_how, v_how, bits, group)(weights, jnp.asarray(np.asarray(tokens, np.int32)))
    return np.asarray(nll, np.float64), np.asarray(sink, np.float64)


# ------------------------------------------------------------------------------ sections


def spec_for(kind: str, *, n_scored: int, cache: int, sink: int = 4):
    from jaxkv import CacheSpec

    if kind == "full":
        return CacheSpec(max_len=n_scored + 1)
    if kind == "window":
        return CacheSpec(sink=0, window=cache)
    if kind in ("sink_absolute", "sink_cache"):
        return CacheSpec(sink=sink, window=cache - sink, positions=kind.split("_")[1])
    raise ValueError(kind)


def section1(name, model, ids, cfg, res, timings):
    """NLL vs position for the four cache kinds over ``ids`` and the sampled recompute oracle."""
    import numpy as np

    from jaxkv.eval import token_nll

    n = len(ids) - 1
    out = dict(tokens=n, cache=cfg["cache"], sink=cfg["sink"], runs={}, specs={})
    for kind in ("full", "window", "sink_absolute", "sink_cache"):
        spec = spec_for(kind, n_scored=n, cache=cfg["cache"], sink=cfg["sink"])
        log(f"{name}: section 1, {spec.describe()}, {n} tokens")
        with Timer(timings, f"{name} s1 {kind}"):
            nll = token_nll(model, ids, cache=spec)
        out["runs"][kind] = nll
        out["specs"][kind] = spec.describe()
        log(f"{name}: {kind} ppl {ppl_of(nll):.3f} ({timings[f'{name} s1 {kind}']})")
    stride = cfg["st_rec_stride" if name == "stories260K" else "sm_rec_stride"]
    batch = cfg["st_rec_batch" if name == "stories260K" else "sm_rec_batch"]
    positions = np.arange(cfg["cache"], n, stride)
    log(f"{name}: recompute oracle, window {cfg['cache']}, {len(positions)} sampled positions (stride {stride})")
    with Timer(timings, f"{name} s1 recompute"):
        rec = recompute_at(model, ids, positions, window=cfg["cache"], batch=batch)
    out["recompute"] = dict(window=cfg["cache"], stride=stride, positions=positions, nll=rec)
    log(f"{name}: recompute ppl at samples {ppl_of(rec):.3f} ({timings[f'{name} s1 recompute']})")
    res[name]["s1"] = out


def section2(name, model, ids, cfg, res, timings):
    """Perplexity by number of sinks at cache size ``cfg['cache']`` (sink + window), both position modes."""
    from jaxkv import CacheSpec
    from jaxkv.eval import token_nll

    n_tok = cfg["st_sink_tokens" if name == "stories260K" else "sm_sink_tokens"]
    ids = ids[: n_tok + 1]
    n = len(ids) - 1
    s1 = res[name]["s1"]["runs"]
    table = {}
    for sink in cfg["sinks"]:
        for positions in ("absolute", "cache"):
            reuse = {(0, "absolute"): "window", (cfg["sink"], "absolute"): "sink_absolute",
                     (cfg["sink"], "cache"): "sink_cache"}.get((sink, positions))
            if reuse and len(s1[reuse]) >= n:  # a streamed NLL is causal: its prefix is the shorter run
                nll, how = s1[reuse][:n], f"section 1 ({reuse}), first {n} tokens"
            elif sink == 0 and positions == "cache" and name != "stories260K":
                nll, how = s1["window"][:n], "= absolute (no sinks: identical relative distances; see stories260K)"
            else:
                spec = CacheSpec(sink=sink, window=cfg["cache"] - sink, positions=positions)
                log(f"{name}: section 2, {spec.describe()}, {n} tokens")
                with Timer(timings, f"{name} s2 sink{sink} {positions}"):
                    nll = token_nll(model, ids, cache=spec)
                how = "run"
            table[f"{sink}/{positions}"] = dict(sink=sink, positions=positions, ppl=ppl_of(nll),
                                                ppl_past=ppl_of(nll[cfg["cache"]:]), how=how)
    res[name]["s2"] = dict(tokens=n, cache=cfg["cache"], table=table)


def kivi_inputs(name, model, cfg):
    """Token rows for section 3: stories260K = BOS + 511-token segments (its trained context is 512),
    SmolLM2 = the first ``sm_kivi_tokens`` tokens as one stream (its trained context is 8192)."""
    if name == "stories260K":
        seg, count = cfg["st_kivi_len"], cfg["st_kivi_segments"]
        ids = encode_prefix(model, 1 + count * (seg - 1))
        bos = ids[0]
        return [[bos] + ids[1 + i * (seg - 1): 1 + (i + 1) * (seg - 1)] for i in range(count)]
    return [encode_prefix(model, cfg["sm_kivi_tokens"])]


def section3(name, model, cfg, res, timings):
    """KIVI through the real cache (full cache, residual R = G), and the fake-quantised axis ablation."""
    import numpy as np

    from jaxkv import CacheSpec
    from jaxkv.eval import token_nll

    rows = kivi_inputs(name, model, cfg)
    t = len(rows[0])
    scored = sum(len(r) - 1 for r in rows)
    cache = {}

    def run(label, spec):
        log(f"{name}: section 3, {spec.describe()} x {len(rows)} row(s) of {t}")
        with Timer(timings, f"{name} s3 {label}"):
            nll = np.concatenate([token_nll(model, r, cache=spec) for r in rows])
        cache[label] = dict(ppl=ppl_of(nll), spec=spec.describe())
        return nll

    fp32 = run("fp32", CacheSpec(max_len=t))
    run("bf16", CacheSpec(max_len=t, kv_quantize="bf16"))
    for mode in cfg["kivi_modes"]:
        for g in cfg["groups"]:
            run(f"{mode}/G{g}", CacheSpec(max_len=t, kv_quantize=mode, group_size=g, residual=g))
    for label, r in cache.items():
        r["vs_fp32"] = r["ppl"] / cache["fp32"]["ppl"] - 1

    # ablation: one batched causal pass over the same rows, K (after RoPE) and V fake-quantised
    batch = np.asarray(rows, np.int32)
    g = cfg["ablation_group"]
    with Timer(timings, f"{name} s3 ablation"):
        base, sink_mass = fake_quant_nll(model, batch)
        base = base.reshape(-1)
        check = float(np.max(np.abs(base - fp32)))
        abl = {}
        for bits in cfg["ablation_bits"]:
            for k_how in ("channel", "token"):
                for v_how in ("token", "channel"):
                    log(f"{name}: ablation int{bits} K per-{k_how} V per-{v_how}")
                    nll, _ = fake_quant_nll(model, batch, k_how=k_how, v_how=v_how, bits=bits, group=g)
                    abl[f"int{bits}/K-{k_how}/V-{v_how}"] = dict(bits=bits, k=k_how, v=v_how, ppl=ppl_of(nll))
    for r in abl.values():
        r["vs_fp32"] = r["ppl"] / ppl_of(base) - 1
    expected_uniform = float(np.mean(1.0 / (np.arange(32, t) + 1)))
    res[name]["s3"] = dict(rows=len(rows), row_len=t, scored=scored, cache=cache, ablation=abl, ablation_group=g,
                           ablation_fp32_ppl=ppl_of(base), ablation_check_max_abs=check,
                           sink_mass=[float(x) for x in sink_mass], sink_mass_uniform=expected_uniform)


def filled_cache_bytes(spec, n_tokens: int, shape: dict) -> dict:
    """Append ``n_tokens`` (zeros) through the cache API; allocated and live bytes from memory_report."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxkv import KVCache, memory_report
    from jaxkv.cache.ring import plan_chunk

    cache = KVCache.create(spec, batch=1, **shape)
    t = spec.max_chunk
    kv = jnp.zeros((shape["n_layers"], 1, shape["n_kv_heads"], t, shape["head_dim"]), jnp.float32)
    step = jax.jit(lambda cache, n: cache.prepare(n).append(kv, kv, n))  # one compile; entries >= n ignored
    i = 0
    while i < n_tokens:
        n = int(plan_chunk(spec, np.array([i]), np.array([n_tokens - i]), t)[0])
        cache = step(cache, jnp.asarray([n], jnp.int32))
        i += n
    rep = memory_report(cache)
    return dict(allocated=rep.allocated_bytes, live=rep.live_bytes, capacity=rep.capacity,
                stored=rep.tokens_stored[0], groups=dict(rep.allocated))


def section4(res, timings):
    """Memory table (bytes of every pytree leaf) at the prior's shape and at SmolLM2's."""
    out = {}
    with Timer(timings, "s4 memory"):
        for label, shape in (("prior", PRIOR_SHAPE), ("SmolLM2-135M", kt.SMOLLM2_SHAPE)):
            exact = [n for n in MEM_TOKENS if (n - kt.RESIDUAL) % kt.GROUP_SIZE == 0]
            rows = kt.memory_rows(tokens=tuple(exact), modes=MEM_MODES, shape=shape)
            table = {f"{r['tokens']}/{r['mode']}": dict(bytes=r["bytes"], leaf_bytes=r["leaf_bytes"],
                                                        capacity=r["capacity"], groups=r["groups"]) for r in rows}
            for n in MEM_TOKENS:
                if n in exact:
                    continue
                # W = n - R is not a multiple of G: the nearest KIVI cache holding n tokens has W = G*floor((n-R)/G)+G
                bf16 = kt.allocated_report(kt.memory_spec("bf16", n), shape=shape)[0]
                table[f"{n}/bf16"] = dict(bytes=bf16.allocated_bytes, capacity=bf16.capacity, groups=dict(bf16.allocated))
                w = kt.GROUP_SIZE * math.ceil((n - kt.RESIDUAL) / kt.GROUP_SIZE)
                for mode in MEM_MODES[1:]:
                    from jaxkv import CacheSpec

                    spec = CacheSpec(window=w, kv_quantize=mode, group_size=kt.GROUP_SIZE, residual=kt.RESIDUAL)
                    f = filled_cache_bytes(spec, n, shape)
                    table[f"{n}/{mode}"] = dict(bytes=f["allocated"], live=f["live"], capacity=f["capacity"],
                                                stored=f["stored"], groups=f["groups"])
            out[label] = dict(shape=shape, table=table)
    out["group_size"], out["residual"] = kt.GROUP_SIZE, kt.RESIDUAL
    res["s4"] = out


def section5(models, cfg, res, timings):
    out = {}
    for name, model in models.items():
        log(f"{name}: section 5, greedy prefix match, {len(kt.PROMPTS)} prompts x {cfg['greedy_new']} tokens")
        with Timer(timings, f"{name} s5 greedy"):
            g = kt.greedy_match(model, kt.PROMPTS, new_tokens=cfg["greedy_new"])
        out[name] = dict(modes={m: dict(per_prompt=d["per_prompt"], mean=d["mean"], exact=d["exact"])
                                for m, d in g["modes"].items()},
                         prompt_lengths=g["prompt_lengths"],
                         reference_text=[model.tokenizer.decode(t) for t in g["reference"]])
    res["s5"] = dict(prompts=list(kt.PROMPTS), new_tokens=cfg["greedy_new"], group_size=kt.GROUP_SIZE,
                     residual=kt.RESIDUAL, models=out)


# ------------------------------------------------------------------------------ claims


RANGES = (0, 256, 512, 1024, 2048, 4096, 8192)


def claims(res) -> dict:
    """Verdicts, with the thresholds fixed here (before looking at any run):
    blow-up = perplexity past the window more than 2x the recomputation oracle's at the same positions;
    'within 10 %' = ratio to the oracle <= 1.10; 'flat' = in every range past 512, sink 4 + window
    (cache positions) within 10 % of the oracle on the same positions; 'degrades' = the full cache more
    than 10 % above the oracle in every range past 512; int8 = |ppl / fp32 - 1| <= 0.5 %."""
    import numpy as np

    out = {}
    for name in MODEL_NAMES:
        if name not in res or "s1" not in res[name]:
            continue
        s1 = res[name]["s1"]
        pos = np.asarray(s1["recompute"]["positions"])
        rec = np.full(s1["tokens"], np.nan)
        rec[pos] = s1["recompute"]["nll"]
        c = {}
        for kind in ("full", "window", "sink_absolute", "sink_cache"):
            c[kind] = paired(s1["runs"][kind], rec, pos)
        ranges = []
        for lo, hi in zip(RANGES, RANGES[1:]):
            if lo >= s1["tokens"]:
                break
            sel = pos[(pos >= lo) & (pos < hi)]
            row = dict(lo=lo, hi=min(hi, s1["tokens"]), n_samples=int(len(sel)),
                       ppl={k: ppl_of(np.asarray(v)[lo:hi]) for k, v in s1["runs"].items()})
            if len(sel) >= 2:
                row["recompute"] = ppl_of(rec[sel])
                row["ratio"] = {k: paired(v, rec, sel) for k, v in s1["runs"].items()}
            ranges.append(row)
        past512 = [r for r in ranges if r["lo"] >= 512 and "ratio" in r]
        bins = []
        for lo in range(0, s1["tokens"], 512):
            sel = pos[(pos >= lo) & (pos < lo + 512)]
            if len(sel) >= 4:
                bins.append(dict(lo=lo, hi=lo + 512, ratio={k: paired(v, rec, sel)["ratio"] for k, v in s1["runs"].items()}))
        out[name] = dict(
            vs_recompute=c, ranges=ranges, bins=bins,
            window_blows_up=c["window"]["ratio"] > 2.0,
            sink_within_10={k: c[k]["ratio"] <= 1.10 for k in ("sink_absolute", "sink_cache")},
            cache_flat=bool(past512) and all(r["ratio"]["sink_cache"]["ratio"] <= 1.10 for r in past512),
            full_degrades=bool(past512) and all(r["ratio"]["full"]["ratio"] > 1.10 for r in past512),
        )
        if "s3" in res[name]:
            int8 = {k: v["vs_fp32"] for k, v in res[name]["s3"]["cache"].items() if k.startswith("int8")}
            out[name]["int8"] = int8
            out[name]["int8_within"] = all(abs(v) <= 0.005 for v in int8.values())
    return out


# ------------------------------------------------------------------------------ plots


def plots(res, outdir: pathlib.Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    made = []
    labels = {"full": "full cache", "window": "window only (sink 0)", "sink_absolute": "sink 4 + window, absolute pos.",
              "sink_cache": "sink 4 + window, cache pos."}
    colors = {"full": "tab:gray", "window": "tab:red", "sink_absolute": "tab:orange", "sink_cache": "tab:blue"}
    for name in MODEL_NAMES:
        if name not in res or "s1" not in res[name]:
            continue
        s1 = res[name]["s1"]
        n = s1["tokens"]
        roll = 256 if n >= 2048 else 64
        fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True, gridspec_kw=dict(height_ratios=[3, 2]))
        kernel = np.ones(roll) / roll
        for kind in ("full", "sink_absolute", "sink_cache", "window"):  # window last, dashed: it may overlap
            nll = np.asarray(s1["runs"][kind])
            y = np.exp(np.convolve(nll, kernel, mode="valid"))
            x = np.arange(len(y)) + roll // 2
            ax.plot(x, y, label=labels[kind], color=colors[kind], lw=1.3, ls="--" if kind == "window" else "-")
        # bottom: paired ratio to the recomputation oracle per bin of its sampled positions
        pos = np.asarray(s1["recompute"]["positions"])
        rec = np.asarray(s1["recompute"]["nll"])
        bw = 512 if n >= 4096 else 256 if n >= 1024 else 64
        edges = [lo for lo in range(0, n, bw) if ((pos >= lo) & (pos < lo + bw)).sum() >= 4]
        for kind in ("full", "window", "sink_absolute", "sink_cache"):
            nll = np.asarray(s1["runs"][kind])
            ys = [math.exp(float(np.mean(nll[pos[(pos >= lo) & (pos < lo + bw)]] - rec[(pos >= lo) & (pos < lo + bw)])))
                  for lo in edges]
            bx.plot([lo + bw / 2 for lo in edges], ys, "o-", color=colors[kind], ms=4, lw=1.2)
        bx.axhspan(1 / 1.1, 1.1, color="tab:green", alpha=0.15, label="within 10 % of the oracle")
        bx.axhline(1.0, color="k", lw=0.8)
        bx.set_yscale("log")
        bx.set_ylabel("ratio to recompute oracle")
        bx.set_xlabel("token position")
        bx.legend(fontsize=8, loc="upper left")
        bx.grid(alpha=0.3, which="both")
        trained = 512 if name == "stories260K" else 8192
        for a in (ax, bx):
            a.axvline(s1["cache"], color="k", ls=":", lw=0.8)
            if trained < n:
                a.axvline(trained, color="tab:purple", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.set_ylabel(f"perplexity (exp of rolling mean NLL, {roll} tokens)")
        ax.set_title(f"{name}: streaming perplexity versus position ({n} tokens of TinyStories)\n"
                     f"dotted line: cache size {s1['cache']}" + (f"; dashed line: trained context {trained}" if trained < n else "")
                     + f"\nbottom: paired ratio to the recomputation oracle (window {s1['cache']}) per {bw} positions",
                     fontsize=9)
        ax.legend(fontsize=8, loc="best")
        ax.grid(alpha=0.3, which="both")
        fig.tight_layout()
        fname = f"nll_vs_position_{name}.png"
        fig.savefig(outdir / fname, dpi=110)
        plt.close(fig)
        made.append(fname)

    have2 = [m for m in MODEL_NAMES if m in res and "s2" in res[m]]
    if have2:
        fig, axes = plt.subplots(1, len(have2), figsize=(5 * len(have2), 4), squeeze=False)
        for ax, name in zip(axes[0], have2):
            s2 = res[name]["s2"]
            for positions, col in (("absolute", "tab:orange"), ("cache", "tab:blue")):
                rows = [v for v in s2["table"].values() if v["positions"] == positions]
                rows.sort(key=lambda r: r["sink"])
                ax.plot([r["sink"] for r in rows], [r["ppl"] for r in rows], "o-", color=col, label=f"{positions} positions")
            ax.set_xticks(sorted({v["sink"] for v in s2["table"].values()}))
            ax.set_xlabel(f"sink tokens (sink + window = {s2['cache']})")
            ax.set_ylabel(f"perplexity over {s2['tokens']} tokens")
            ax.set_yscale("log")
            ax.set_title(name)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(outdir / "ppl_by_sinks.png", dpi=110)
        plt.close(fig)
        made.append("ppl_by_sinks.png")

    have3 = [m for m in MODEL_NAMES if m in res and "s3" in res[m]]
    if have3:
        fig, axes = plt.subplots(1, len(have3), figsize=(5 * len(have3), 4), squeeze=False)
        for ax, name in zip(axes[0], have3):
            cache = res[name]["s3"]["cache"]
            groups = sorted({int(k.split("/G")[1]) for k in cache if "/G" in k})
            for mode, col in (("int8", "tab:green"), ("int4", "tab:blue"), ("int2", "tab:red")):
                ax.plot(groups, [100 * cache[f"{mode}/G{g}"]["vs_fp32"] for g in groups], "o-", color=col, label=mode)
            ax.axhline(100 * cache["bf16"]["vs_fp32"], color="tab:gray", ls="--", label="bf16")
            ax.axhline(0, color="k", lw=0.6)
            ax.set_xscale("log", base=2)
            ax.set_xticks(groups, [str(g) for g in groups])
            ax.set_yscale("symlog", linthresh=0.1)
            ax.set_xlabel("group size G (residual R = G)")
            ax.set_ylabel("perplexity change vs fp32 cache (%)")
            ax.set_title(f"{name}: KIVI (fp32 ppl {cache['fp32']['ppl']:.3f})")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(outdir / "kivi_ppl.png", dpi=110)
        plt.close(fig)
        made.append("kivi_ppl.png")
    return made


# ------------------------------------------------------------------------------ render


def fmt_ratio(r) -> str:
    return f"{r['ratio']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]"


def mb(b) -> str:
    return f"{b / 1e6:.3f}"


def render(res, made: list[str]) -> str:
    cfg = res["config"]
    m = res["machine"]
    cl = claims(res)
    L = []
    add = L.append
    add("# Results: what a bounded and quantised KV cache costs in quality")
    add("")
    add(f"Generated by `scripts/reproduce.py`{' --quick (SMOKE RUN: small sizes, not the results)' if res['quick'] else ''} "
        f"on {res['date']}; every number below was measured in that run, from `../shared/data` only "
        "(stories260K, SmolLM2-135M-Instruct Q4_1 GGUF, `text/tinystories_valid_head.txt`). "
        "Rerun it to regenerate this file, its plots in `docs/results/` and `docs/results/results.json` "
        "(which also holds every per-token NLL): `pip install -e '.[results]' && python scripts/reproduce.py`.")
    add("")
    tot = res["timings"].get("total", {})
    add(f"**Machine**: {m['cpu']}, {m['logical_cpus']} logical CPUs ({m['usable_cpus']} usable), {m['platform']}; "
        f"JAX backend `{m['backend']}`. **Versions**: Python {m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}, "
        f"flax {m['flax']}, numpy {m['numpy']}. **Wall time**: {tot.get('wall_s', float('nan')) / 60:.1f} min "
        f"({tot.get('cpu_s', float('nan')) / 60:.1f} CPU-min over all threads). Load average at start "
        f"{m['load_avg_start']}, at end {m.get('load_avg_end')}: the machine was shared with other jobs, so wall "
        "times are upper bounds (the CPU-minutes are closer to what an idle 2-core machine needs).")
    add("")
    add("## Summary of the claims (thresholds fixed in `claims()` of the script before the full run)")
    add("")
    add(claim_summary(res, cl))
    add("")

    # ---------------------------------------------------------------- section 1
    add("## 1. NLL versus position (StreamingLLM Fig. 3, small scale)")
    add("")
    add("Teacher-forced NLL of every token through the cache (`jaxkv.eval.token_nll`: each token scored with exactly "
        "what the cache holds when it is predicted; chunked prefill equals token-by-token decode). One continuous "
        "stream of TinyStories text (the tokenizer's default BOS first; no BOS between stories). Cache size "
        f"{cfg['cache']} for every bounded cache: window only = sink 0 + window {cfg['cache']}; "
        f"sink {cfg['sink']} + window {cfg['cache'] - cfg['sink']} in `absolute` positions (keys keep the RoPE of "
        "their original position; the prior implementation's choice) and in `cache` positions (keys rotated at "
        "their rank in the cache, the paper's §3.2). Full cache = every token kept.")
    add("")
    add(f"**Recomputation oracle** (the paper's sliding window with re-computation, `recompute_nll`'s code, window "
        f"{cfg['cache']}, no sinks): it re-encodes a whole window per token, so it is evaluated only at a uniform "
        "sample of positions past the window (one position in "
        + ", ".join(f"{res[n]['s1']['recompute']['stride']} for {n}" for n in MODEL_NAMES if "s1" in res.get(n, {}))
        + "); each cache is compared to it **on the same sampled positions** (paired: ratio of perplexities = "
        "exp(mean NLL difference), with a 95 % interval from the paired standard error).")
    add("")
    for name in MODEL_NAMES:
        if "s1" not in res.get(name, {}):
            continue
        s1, c = res[name]["s1"], cl[name]
        add(f"### {name}: {s1['tokens']} tokens")
        add("")
        if f"nll_vs_position_{name}.png" in made:
            add(f"![NLL versus position, {name}](results/nll_vs_position_{name}.png)")
            add("")
        hdr = ["cache", "ppl overall"] + [f"[{r['lo']}, {r['hi']})" for r in c["ranges"]]
        add("| " + " | ".join(hdr) + " |")
        add("|---|" + "---:|" * (len(hdr) - 1))
        for kind in ("full", "window", "sink_absolute", "sink_cache"):
            cells = [s1["specs"][kind], f"{ppl_of(s1['runs'][kind]):.3f}"] + [f"{r['ppl'][kind]:.3f}" for r in c["ranges"]]
            add("| " + " | ".join(cells) + " |")
        add("| recompute oracle, **at its sampled positions only** | " + f"{ppl_of(s1['recompute']['nll']):.3f} | "
            + " | ".join(f"{r['recompute']:.3f} (n={r['n_samples']})" if "recompute" in r else "–" for r in c["ranges"]) + " |")
        add("")
        add("The oracle's row covers only its sampled positions, so compare it with the caches through the "
            "paired ratios below, not cell by cell with the rows above (those average every position).")
        add("")
        add(f"Ratio to the recomputation oracle on the same sampled positions (all positions >= {s1['cache']}, "
            f"n = {c['vs_recompute']['full']['n']}), and per range:")
        add("")
        hdr = ["cache", f"all >= {s1['cache']}"] + [f"[{r['lo']}, {r['hi']})" for r in c["ranges"] if "ratio" in r]
        add("| " + " | ".join(hdr) + " |")
        add("|---|" + "---:|" * (len(hdr) - 1))
        for kind in ("full", "window", "sink_absolute", "sink_cache"):
            cells = [s1["specs"][kind], fmt_ratio(c["vs_recompute"][kind])] + [
                f"{r['ratio'][kind]['ratio']:.3f}" for r in c["ranges"] if "ratio" in r]
            add("| " + " | ".join(cells) + " |")
        add("")
    add(section1_discussion(res, cl))
    add("")

    # ---------------------------------------------------------------- section 2
    add("## 2. Perplexity by number of sinks (StreamingLLM Table 2)")
    add("")
    if "ppl_by_sinks.png" in made:
        add("![perplexity by number of sinks](results/ppl_by_sinks.png)")
        add("")
    for name in MODEL_NAMES:
        if "s2" not in res.get(name, {}):
            continue
        s2 = res[name]["s2"]
        add(f"**{name}**, {s2['tokens']} tokens, cache size {s2['cache']} (sink S0 + window {s2['cache']} - S0): "
            f"perplexity over all tokens / over positions >= {s2['cache']} (past the window).")
        add("")
        sinks = sorted({v["sink"] for v in s2["table"].values()})
        add("| positions | " + " | ".join(f"S0 = {s}" for s in sinks) + " |")
        add("|---|" + "---:|" * len(sinks))
        for positions in ("absolute", "cache"):
            add(f"| {positions} | " + " | ".join(
                f"{s2['table'][f'{s}/{positions}']['ppl']:.3f} / {s2['table'][f'{s}/{positions}']['ppl_past']:.3f}"
                for s in sinks) + " |")
        reused = sorted({v["how"] for v in s2["table"].values() if v["how"] != "run"})
        if reused:
            add("")
            add("Reused rather than rerun: " + "; ".join(reused) + ".")
        add("")
    add(section2_discussion(res))
    add("")

    # ---------------------------------------------------------------- section 3
    add("## 3. KIVI: perplexity by precision and group size, and the quantisation-axis ablation")
    add("")
    add("Through the real cache (`token_nll`): a **full** cache (no eviction) whose window tokens are stored as "
        "KIVI codes (keys per channel in groups of G tokens, values per token, float16 scale/zero, codes packed), "
        "residual **R = G** full-precision recent tokens (the smallest allowed, so the most tokens are read back "
        "from codes), versus the same full cache in fp32 and bf16. Every cache holds the same tokens, so the "
        "differences are the quantisation alone. Texts within each model's trained context: "
        + "; ".join(
            (f"stories260K: {res[n]['s3']['rows']} segments of {res[n]['s3']['row_len']} tokens (BOS + 511 "
             "consecutive tokens of the stream each)" if n == "stories260K" else
             f"SmolLM2-135M: the first {res[n]['s3']['row_len']} tokens of the stream")
            + f" = {res[n]['s3']['scored']} scored tokens"
            for n in MODEL_NAMES if "s3" in res.get(n, {})) + ".")
    add("")
    if "kivi_ppl.png" in made:
        add("![KIVI perplexity change versus fp32](results/kivi_ppl.png)")
        add("")
    for name in MODEL_NAMES:
        if "s3" not in res.get(name, {}):
            continue
        s3 = res[name]["s3"]
        cache = s3["cache"]
        groups = sorted({int(k.split("/G")[1]) for k in cache if "/G" in k})
        add(f"**{name}**: fp32 {cache['fp32']['ppl']:.4f}, bf16 {cache['bf16']['ppl']:.4f} "
            f"({100 * cache['bf16']['vs_fp32']:+.3f} %).")
        add("")
        add("| cache | " + " | ".join(f"G = R = {g}" for g in groups) + " |")
        add("|---|" + "---:|" * len(groups))
        for mode in ("int8", "int4", "int2"):
            add(f"| {mode} | " + " | ".join(
                f"{cache[f'{mode}/G{g}']['ppl']:.4f} ({100 * cache[f'{mode}/G{g}']['vs_fp32']:+.3f} %)" for g in groups) + " |")
        add("")
    add("### Axis ablation (KIVI Table 1)")
    add("")
    add("jaxkv's cache has one layout (keys per channel, values per token), and this section does not change the "
        "library. The ablation therefore runs a small forward of its own (in the script): the model's own weights, "
        "`rms_norm` and `apply_rope` from jaxkv, and one teacher-forced causal pass over the same token rows as "
        "above, in which every layer's keys (after RoPE, as the `absolute`-position cache stores them) and values "
        "are replaced by `dequantize_affine(quantize_affine(x, axis=...))`: *per channel* = one (scale, zero) per "
        f"channel and group of G = {cfg['ablation_group']} tokens (`axis=-2`), *per token* = one per token over the "
        "head's H channels (`axis=-1`); float16 scale/zero as in the cache. This is fake quantisation of **every** "
        "token: no full-precision residual, and a per-channel group's range includes the (up to G - 1) later tokens "
        "of its group, which the real cache never lets a query see. So it is harsher than the cache above in one "
        "way and slightly optimistic in another; it is the same for all four pairings, which is what the ablation "
        "compares. With no quantisation the pass reproduces the full-cache `token_nll` to "
        + ", ".join(f"{res[n]['s3']['ablation_check_max_abs']:.1e} nats ({n})" for n in MODEL_NAMES if "s3" in res.get(n, {}))
        + " (max abs difference per token).")
    add("")
    for name in MODEL_NAMES:
        if "s3" not in res.get(name, {}):
            continue
        s3 = res[name]["s3"]
        abl = s3["ablation"]
        add(f"**{name}** (head dim {res[name]['config']['head_dim']}; fake-quant fp32 baseline ppl "
            f"{s3['ablation_fp32_ppl']:.4f}; perplexity and change vs that baseline):")
        add("")
        add("| keys | values | " + " | ".join(f"int{b}" for b in cfg["ablation_bits"]) + " |")
        add("|---|---|" + "---:|" * len(cfg["ablation_bits"]))
        for k_how, v_how in (("channel", "token"), ("token", "token"), ("token", "channel"), ("channel", "channel")):
            tag = " (KIVI)" if (k_how, v_how) == ("channel", "token") else ""
            add(f"| per {k_how}{tag} | per {v_how} | " + " | ".join(
                f"{abl[f'int{b}/K-{k_how}/V-{v_how}']['ppl']:.4f} ({100 * abl[f'int{b}/K-{k_how}/V-{v_how}']['vs_fp32']:+.2f} %)"
                for b in cfg["ablation_bits"]) + " |")
        add("")
    add(section3_discussion(res, cl))
    add("")

    # ---------------------------------------------------------------- section 4
    if "s4" in res:
        add(section4_render(res))
        add("")
    # ---------------------------------------------------------------- section 5
    if "s5" in res:
        add(section5_render(res))
        add("")

    # ---------------------------------------------------------------- timings
    add("## Run time per step")
    add("")
    add("| step | wall s | CPU s |")
    add("|---|---:|---:|")
    for k, v in res["timings"].items():
        add(f"| {k} | {v['wall_s']} | {v['cpu_s']} |")
    add("")
    add("## Not done / limits")
    add("")
    for item in limits(res):
        add(f"- {item}")
    add("")
    return "\n".join(L)


def claim_summary(res, cl) -> str:
    out = []
    st, sm = cl.get("stories260K"), cl.get("SmolLM2-135M")

    def verdict(ok):
        return "**holds**" if ok else "**misses**"

    for name, c in (("stories260K", st), ("SmolLM2-135M", sm)):
        if not c:
            continue
        w = c["vs_recompute"]["window"]
        out.append(f"- *Window-only perplexity blows up once the text passes the window* ({name}): {verdict(c['window_blows_up'])}: "
                   f"past the window it is {w['ratio']:.2f}x the recomputation oracle's ({fmt_ratio(w)}; blow-up "
                   "threshold 2x)" + ("; borderline: the 95 % interval includes 2x" if w["lo"] < 2.0 < w["hi"] else "")
                   + ".")
        for kind, label in (("sink_cache", "cache"), ("sink_absolute", "absolute")):
            r = c["vs_recompute"][kind]
            out.append(f"- *Sink 4 + window stays within 10 % of the recomputation oracle* ({name}, {label} positions): "
                       f"{verdict(c['sink_within_10'][kind])}: ratio {fmt_ratio(r)}.")
    if st:
        rng = [r for r in st["ranges"] if r["lo"] >= 512 and "ratio" in r]
        out.append("- *With `positions=\"cache\"` stories260K stays flat to "
                   f"{res['stories260K']['s1']['tokens']} tokens*: {verdict(st['cache_flat'])}: ratio to the oracle per range past 512: "
                   + ", ".join(f"[{r['lo']}, {r['hi']}) {r['ratio']['sink_cache']['ratio']:.3f}" for r in rng)
                   + "; its perplexity by range " + ", ".join(f"[{r['lo']}, {r['hi']}) {r['ppl']['sink_cache']:.2f}"
                                                             for r in st["ranges"]) + ".")
        out.append("- *while the full cache degrades past 512*: " + verdict(st["full_degrades"]) + ": full-cache perplexity by range "
                   + ", ".join(f"[{r['lo']}, {r['hi']}) {r['ppl']['full']:.2f}" for r in st["ranges"]) + ".")
    for name, c in (("stories260K", st), ("SmolLM2-135M", sm)):
        if c and "int8" in c:
            out.append(f"- *int8 perplexity within 0.5 % of fp32* ({name}): {verdict(c['int8_within'])}: "
                       + ", ".join(f"{k.split('/')[1]} {100 * v:+.3f} %" for k, v in c["int8"].items()) + ".")
    return "\n".join(out)


def section1_discussion(res, cl) -> str:
    """What the numbers of section 1 say, including why the misses miss (measured where possible)."""
    L = ["### What section 1 shows", ""]
    st, sm = cl.get("stories260K"), cl.get("SmolLM2-135M")
    if sm:
        w, a, c = (sm["vs_recompute"][k] for k in ("window", "sink_absolute", "sink_cache"))
        effect = w["ratio"] > 1.10 and max(a["ratio"], c["ratio"]) <= 1.10
        L.append(f"- **SmolLM2-135M**: once the first tokens are evicted, the window-only cache is "
                 f"{w['ratio']:.2f}x the oracle, and keeping 4 sink tokens gives {a['ratio']:.2f}x (absolute) / "
                 f"{c['ratio']:.2f}x (cache positions). "
                 + ("This is the paper's effect, qualitatively. " if effect else "")
                 + ("The window-only degradation stays below the 2x we set for a 'blow-up': the paper's window "
                    "attention reaches perplexities in the hundreds to thousands on 7B+ models over 20K-token "
                    "texts; this 135M model with a 256-token cache degrades far less. " if not sm["window_blows_up"] else "")
                 + f"Its trained context is 8192 tokens, so its full cache is in distribution here (ratio "
                 f"{sm['vs_recompute']['full']['ratio']:.2f} to the oracle: more context than the oracle's 256 tokens).")
    if st:
        w = st["vs_recompute"]["window"]
        sm3 = res["stories260K"].get("s3", {})
        mass = sm3.get("sink_mass")
        if not st["window_blows_up"]:
            L.append(f"- **stories260K does not show the attention-sink effect**: window only is {w['ratio']:.3f}x "
                     "the oracle past the window, and no blow-up. Measured reason: the model hardly attends to its "
                     "first token. In one causal pass over section 3's 512-token segments (BOS first), the mean "
                     "attention weight on position 0 of queries at positions >= 32 is, by layer, "
                     + (", ".join(f"{x:.3f}" for x in mass) if mass else "(not measured)")
                     + (f", against {sm3['sink_mass_uniform']:.3f} for uniform attention" if mass else "")
                     + (" (SmolLM2-135M over its first 1024 tokens, by layer: " + ", ".join(
                         f"{x:.2f}" for x in res["SmolLM2-135M"]["s3"]["sink_mass"]) + ")"
                        if "s3" in res.get("SmolLM2-135M", {}) else "")
                     + ". With no sink to lose, evicting the first tokens costs nothing. A plausible cause (not "
                     "tested here): llama2.c trains on random 512-token crops of the concatenated stories, so the "
                     "first token of a training window is an arbitrary mid-story token, and BOS recurs at every "
                     "story start.")
        else:
            L.append(f"- **stories260K**: window only is {w['ratio']:.3f}x the oracle past the window.")
        a = st["vs_recompute"]["sink_absolute"]
        blow = [r for r in st["ranges"] if r["ppl"]["sink_absolute"] > 2 * r["ppl"]["sink_cache"]]
        if not st["sink_within_10"]["sink_absolute"]:
            L.append(f"- **Sink 4 + window in absolute positions fails on stories260K** ({a['ratio']:.2f}x the oracle "
                     "past the window"
                     + (f"; the first range where it is more than twice the cache-position run is [{blow[0]['lo']}, "
                        f"{blow[0]['hi']}), perplexity {blow[0]['ppl']['sink_absolute']:.1f} against "
                        f"{blow[0]['ppl']['sink_cache']:.2f}" if blow else "")
                     + "; per 512 positions it is above 2x the oracle in "
                     + ", ".join(f"[{b['lo']}, {b['hi']})" for b in st["bins"] if b["ratio"]["sink_absolute"] > 2)
                     + ", and back within 10 % in "
                     + (", ".join(f"[{b['lo']}, {b['hi']})" for b in st["bins"]
                                  if b["lo"] >= 2048 and b["ratio"]["sink_absolute"] <= 1.1) or "none past 2048")
                     + "): its queries see the sink keys at their original positions, so the query-to-sink distance "
                     "grows with the text and leaves the 512 positions the model was trained on. Why it grows large "
                     + (f"only from about position {[b for b in st['bins'] if b['ratio']['sink_absolute'] > 2][0]['lo']}"
                        if any(b["ratio"]["sink_absolute"] > 2 for b in st["bins"]) else "so late")
                     + ", and why it recedes again late in the text, we did not "
                     "investigate (RoPE angles are periodic, so an out-of-range distance need not stay harmful). "
                     "`positions=\"cache\"` "
                     "keeps every distance below the cache size and stays at the oracle's level. SmolLM2 (trained "
                     f"to 8192) is not affected at {res['SmolLM2-135M']['s1']['tokens'] if 'SmolLM2-135M' in res else '?'} tokens.")
        full = st["ranges"]
        L.append("- **Full cache on stories260K**: perplexity by range "
                 + ", ".join(f"[{r['lo']}, {r['hi']}) {r['ppl']['full']:.2f}" for r in full)
                 + (" — it degrades once positions pass the trained context of 512, which a bounded cache with "
                    "cache positions avoids." if st["full_degrades"] else "."))
    return "\n".join(L)


def section2_discussion(res) -> str:
    L = ["The paper's Table 2 (Llama-2 and others, 4K-token texts) finds that one or two initial tokens do not "
         "fully restore perplexity, four generally suffice, and more bring diminishing returns. Here:", ""]
    for name in MODEL_NAMES:
        s2 = res.get(name, {}).get("s2")
        if not s2:
            continue
        t = s2["table"]
        for positions in ("cache", "absolute"):
            p = {s: t[f"{s}/{positions}"]["ppl_past"] for s in sorted({v["sink"] for v in t.values()})}
            one_enough = abs(p[1] / p[4] - 1) <= 0.02
            hurt = p[0] < p[1] / 1.1
            L.append(f"- {name}, {positions} positions, past the window: "
                     + ", ".join(f"S0 = {k} {v:.3f}" for k, v in p.items())
                     + f". No sink vs 4 sinks: {100 * (p[0] / p[4] - 1):+.1f} %; "
                     + ("one sink already comes within 2 % of four." if one_enough else
                        f"one sink is {100 * (p[1] / p[4] - 1):+.1f} % off four.")
                     + (" Here any sink makes it worse: the sink keys sit at their original positions, ever farther "
                        "from the query, outside the trained context (section 1)." if hurt else ""))
    L.append("- SmolLM2's tokenizer adds no BOS, so its sinks are the first text tokens; stories260K's first token is BOS.")
    return "\n".join(L)


def section3_discussion(res, cl) -> str:
    L = ["### What section 3 shows", ""]
    for name in MODEL_NAMES:
        s3 = res.get(name, {}).get("s3")
        if not s3:
            continue
        abl = s3["ablation"]
        for b in res["config"]["ablation_bits"]:
            best = min((k for k in abl if k.startswith(f"int{b}/")), key=lambda k: abl[k]["ppl"])
            tie = None
            if best != f"int{b}/K-channel/V-token" and abl[f"int{b}/K-channel/V-token"]["ppl"] <= abl[best]["ppl"] * 1.001:
                best, tie = f"int{b}/K-channel/V-token", best  # within 0.1 %: a tie, reported as such
            kivi = abl[f"int{b}/K-channel/V-token"]
            worst = max((k for k in abl if k.startswith(f"int{b}/")), key=lambda k: abl[k]["ppl"])
            real = s3["cache"].get(f"int{b}/G{res['config']['ablation_group']}")
            L.append(f"- {name}, int{b}: "
                     + ("KIVI's pairing (keys per channel, values per token) is the best of the four"
                        + (f", tied within 0.1 % with {tie.split('/', 1)[1].replace('/', ', ').replace('-', ' per ')}"
                           if tie else "")
                        if best == f"int{b}/K-channel/V-token" else
                        f"the best pairing is {best.split('/', 1)[1].replace('/', ', ').replace('-', ' per ')}, not KIVI's")
                     + f" ({kivi['vs_fp32'] * 100:+.2f} %); worst {worst.split('/', 1)[1].replace('/', ', ').replace('-', ' per ')} "
                     f"({abl[worst]['vs_fp32'] * 100:+.2f} %)"
                     + (f"; the real cache (G = R = {res['config']['ablation_group']}, residual in full precision, "
                        f"groups quantised only once complete) {real['vs_fp32'] * 100:+.2f} %." if real else "."))
    keys_matter = all(
        max(s3["ablation"][f"int{b}/K-channel/V-{v}"]["ppl"] for v in ("token", "channel"))
        < min(s3["ablation"][f"int{b}/K-token/V-{v}"]["ppl"] for v in ("token", "channel"))
        for s3 in (res[n]["s3"] for n in MODEL_NAMES if "s3" in res.get(n, {})) for b in res["config"]["ablation_bits"])
    if keys_matter:
        L.append("- In every case both pairings with keys per channel beat both with keys per token: the key axis "
                 "decides, as in KIVI's Table 1. KIVI's explanation (not measured here) is that key outliers sit in "
                 "a few fixed channels, so one range per token spends the levels on them and crushes the other "
                 "channels, while one range per channel fits each.")
    L.append("- Per-token groups here are one head's H channels: 64 for SmolLM2, only 8 for stories260K (KIVI's "
             "models: 128), so a per-token range covers fewer channels than in the paper.")
    return "\n".join(L)


def section4_render(res) -> str:
    s4 = res["s4"]
    g, r = s4["group_size"], s4["residual"]
    L = ["## 4. Memory table (the prior implementation's, counted from the pytree leaves)", ""]
    L.append(f"Bytes of every leaf of a freshly allocated `KVCache` (`scripts/kivi_tables.py`: `memory_rows`; "
             f"`jaxkv.memory_report`), batch 1. bf16 = a full cache of N slots; int8/int4/int2 = KIVI with "
             f"G = {g}, R = {r}: N - R quantised slots (codes packed: two int4 / four int2 codes per byte; float16 "
             "scale and zero per channel-group of keys and per token of values) plus the R-token residual, "
             "which jaxkv keeps in **float32**, plus the int32 position bookkeeping. MB = 10^6 bytes, as the "
             "prior note prints them; the ratio is bf16 bytes / these bytes.")
    L.append("")
    L.append("Shapes: the prior note's model (12 layers, 8 heads, head dim 32; its cache stores one K/V per head, "
             "so **8 KV heads**) and SmolLM2-135M (30 layers, **3 KV heads** of 9 query heads, head dim 64).")
    L.append("")
    for label in ("prior", "SmolLM2-135M"):
        t = s4[label]["table"]
        L.append(f"**{'prior model shape (L=12, K=8, H=32)' if label == 'prior' else 'SmolLM2-135M (L=30, K=3, H=64)'}**")
        L.append("")
        L.append("| stored tokens | " + " | ".join(MEM_MODES) + " |")
        L.append("|---:|" + "---:|" * len(MEM_MODES))
        for n in MEM_TOKENS:
            bf = t[f"{n}/bf16"]["bytes"]
            cells = []
            for mode in MEM_MODES:
                e = t[f"{n}/{mode}"]
                s = f"{mb(e['bytes'])} ({bf / e['bytes']:.2f}x)"
                if "live" in e:
                    s += " †"
                cells.append(s)
            L.append(f"| {n} | " + " | ".join(cells) + " |")
        L.append("")
        odd = [n for n in MEM_TOKENS if "live" in t[f"{n}/int8"]]
        for n in odd:
            e = t[f"{n}/int8"]
            L.append(f"† {n} tokens: N - R = {n - r} is not a multiple of G = {g}, so no KIVI cache has exactly {n} "
                     f"slots; shown is the smallest that holds {n} (capacity {e['capacity']}: {e['capacity'] - r} "
                     f"quantised + {r} residual), after appending {n} tokens through the cache API. Bytes of the "
                     "slots actually holding tokens: "
                     + ", ".join(f"{mode} {mb(t[f'{n}/{mode}']['live'])} MB" for mode in MEM_MODES[1:]) + ".")
            L.append("")
    t = s4["prior"]["table"]
    L.append("**Against the prior implementation's table** (its numbers as printed; its int4 stored codes in int8 "
             "bytes, and it listed a theoretical packed int4; it had no residual and one key scale per channel "
             "for the whole cache):")
    L.append("")
    L.append("| stored tokens | bf16 prior / ours | int8 prior / ours | int4 prior stored (= int8) / prior packed (theory) / ours packed | int2 ours packed |")
    L.append("|---:|---:|---:|---:|---:|")
    for n in MEM_TOKENS:
        p = PRIOR_MEMORY[n]
        L.append(f"| {n} | {p[0]} / {mb(t[f'{n}/bf16']['bytes'])} | {p[1]} / {mb(t[f'{n}/int8']['bytes'])} | "
                 f"{p[2]} / {p[3]} / {mb(t[f'{n}/int4']['bytes'])} | {mb(t[f'{n}/int2']['bytes'])} |")
    L.append("")
    e = t["2048/int4"]
    gr = e["groups"]
    L.append(f"At 2048 tokens our int4 cache is {mb(e['bytes'])} MB: codes {mb(gr.get('codes', 0))}, scales and zeros "
             f"{mb(gr.get('scales_zeros', 0))}, float32 residual {mb(gr.get('residual', 0))}, bookkeeping "
             f"{mb(gr.get('bookkeeping', 0))} MB. Ours is truly packed, so int4 is about half of int8 in codes; "
             "it carries more scale bytes than the prior's (KIVI's per-group key scales, one per 32 tokens, "
             "instead of one per channel for the whole cache, which the prior recomputed on every append and "
             "so re-quantised stored codes) and the full-precision residual KIVI prescribes; at small N the "
             "residual dominates the difference.")
    return "\n".join(L)


def section5_render(res) -> str:
    s5 = res["s5"]
    L = ["## 5. Greedy prefix match against an fp32 cache (the prior implementation's proxy)", ""]
    L.append(f"`scripts/kivi_tables.py`'s `greedy_match`: the 8 prompts decoded together (ragged batch), "
             f"{s5['new_tokens']} greedy tokens each, EOS disabled, a full cache of longest prompt + "
             f"{s5['new_tokens']} slots in each mode (KIVI: G = {s5['group_size']}, R = {s5['residual']}, so most "
             "tokens are read back from codes). Score = fraction of the fp32-cache tokens reproduced before the "
             "first divergence. Prompts: the prior's four (\"The first president…\", \"In machine learning…\", "
             "\"Once upon a time…\", \"Photosynthesis is…\") and four more:")
    L.append("")
    for i, p in enumerate(s5["prompts"]):
        L.append(f"{i}. `{p}`")
    L.append("")
    for name, d in s5["models"].items():
        modes = list(d["modes"])
        L.append(f"**{name}** (prompt lengths {d['prompt_lengths']} tokens)")
        L.append("")
        L.append("| prompt | " + " | ".join(modes) + " |")
        L.append("|---|" + "---:|" * len(modes))
        for i, p in enumerate(s5["prompts"]):
            L.append(f"| {p[:40]}{'…' if len(p) > 40 else ''} | " + " | ".join(
                f"{100 * d['modes'][m]['per_prompt'][i]:.0f} %" for m in modes) + " |")
        L.append("| **mean** (exact rows) | " + " | ".join(
            f"**{100 * d['modes'][m]['mean']:.0f} %** ({d['modes'][m]['exact']}/{len(s5['prompts'])})" for m in modes) + " |")
        L.append("")
    L.append("The prior implementation's table (its 27M model, 60 tokens; bf16 / int8 / int4 on the first four "
             "prompts): " + "; ".join(f"{k} {v[0]:.0%} / {v[1]:.0%} / {v[2]:.0%}" for k, v in PRIOR_GREEDY.items())
             + ". A greedy prefix match flips on the first near-tie of two logits and then counts nothing after "
             "it, so it is a coarse proxy; section 3 measures the same caches by perplexity.")
    return "\n".join(L)


def limits(res) -> list[str]:
    cfg = res["config"]
    out = []
    for name in MODEL_NAMES:
        s1 = res.get(name, {}).get("s1")
        if s1:
            out.append(f"{name}: the recomputation oracle was evaluated at {len(s1['recompute']['positions'])} "
                       f"positions (one in {s1['recompute']['stride']}, from {s1['cache']} on), not at every token: "
                       "it re-encodes a whole window per token. Comparisons with it are paired on those positions.")
    out.append(f"SmolLM2-135M: sections 1 and 2 over {cfg['sm_tokens']} / {cfg['sm_sink_tokens']} tokens (not 8192), "
               f"section 3 over {cfg['sm_kivi_tokens']} tokens, to keep the whole run within 30 minutes on 2 cores.")
    out.append("The KIVI axis ablation is fake quantisation in the script's own forward (method in section 3), not "
               "the cache: jaxkv's cache implements only KIVI's layout.")
    out.append("KIVI in a bounded (StreamingLLM + KIVI) cache is not measured here; section 3 isolates the "
               "quantisation by using full caches.")
    out.append("'The full cache degrades past 512' concerns stories260K (trained context 512); SmolLM2's trained "
               "context is 8192, beyond every text here.")
    return out


# ------------------------------------------------------------------------------ main


def to_jsonable(x):
    import numpy as np

    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        if x.dtype.kind == "f":
            return [round(float(v), 5) for v in x]
        return x.tolist()
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, (np.integer,)):
        return int(x)
    return x


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run with small sizes (writes to a temp folder "
                        "unless --out is given)")
    parser.add_argument("--out", type=pathlib.Path, help="folder for RESULTS.md and results/ (default: docs)")
    parser.add_argument("--render-only", action="store_true", help="re-render RESULTS.md and the plots from "
                        "OUT/results/results.json without running the models")
    args = parser.parse_args(argv)
    out = args.out or (pathlib.Path(tempfile.gettempdir()) / "jaxkv-reproduce-quick" if args.quick else REPO / "docs")
    resdir = out / "results"
    resdir.mkdir(parents=True, exist_ok=True)

    if args.render_only:
        res = json.loads((resdir / "results.json").read_text())
        made = plots(res, resdir)
        (out / "RESULTS.md").write_text(render(res, made), encoding="utf-8")
        log(f"rendered {out / 'RESULTS.md'} from {resdir / 'results.json'}")
        return 0

    import jax

    jax.config.update("jax_platforms", "cpu")
    from jaxkv import load_model

    cfg = dict(QUICK if args.quick else FULL)
    timings: dict = {}
    res: dict = dict(quick=args.quick, config=cfg, date=time.strftime("%Y-%m-%d %H:%M %Z"), machine=machine())
    total_t, total_c = time.perf_counter(), time.process_time()
    with Timer(timings, "load models"):
        models = {"stories260K": load_model(STORIES_BIN, tokenizer=TOK512),
                  "SmolLM2-135M": load_model(SMOLLM2)}
    for name, model in models.items():
        c = model.config
        res[name] = dict(config=dict(n_layers=c.n_layers, n_heads=c.n_heads, n_kv_heads=c.n_kv_heads,
                                     head_dim=c.head_dim, dim=c.dim, trained_context=c.max_seq_len,
                                     rope_theta=c.rope_theta))
    log("section 4: memory")
    section4(res, timings)
    for name, model in models.items():
        n = cfg["st_tokens" if name == "stories260K" else "sm_tokens"]
        ids = encode_prefix(model, n + 1)
        section1(name, model, ids, cfg, res, timings)
        section2(name, model, ids, cfg, res, timings)
        section3(name, model, cfg, res, timings)
        # keep a checkpoint of what is done, so a crash later does not lose it
        (resdir / "results.json").write_text(json.dumps(to_jsonable(res)))
    section5(models, cfg, res, timings)
    timings["total"] = dict(wall_s=round(time.perf_counter() - total_t, 1), cpu_s=round(time.process_time() - total_c, 1))
    res["timings"] = timings
    res["machine"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    res = json.loads(json.dumps(to_jsonable(res)))  # render from exactly what is stored
    (resdir / "results.json").write_text(json.dumps(res))
    made = plots(res, resdir)
    (out / "RESULTS.md").write_text(render(res, made), encoding="utf-8")
    log(f"wrote {out / 'RESULTS.md'}, {', '.join(made)}; total {timings['total']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
