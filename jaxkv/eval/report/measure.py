"""Measurements of docs/RESULTS.md (issue 5): what a bounded and quantised KV cache costs in quality.

Every number comes from jaxkv's public evaluation functions, run on the models and text of
a data folder (``../shared/data`` from the repository root: stories260K as llama2.c
``.bin`` + ``tok512.model``, SmolLM2-135M-Instruct Q4_1 GGUF, the TinyStories validation
text). :func:`run` returns one JSON-ready dict (:func:`to_jsonable`), which
:mod:`jaxkv.eval.report.plot` and :mod:`jaxkv.eval.report.render` turn into the document.

Sections
  1. NLL versus position (StreamingLLM Fig. 3 at small scale): full cache, window only,
     sink 4 + window in both position modes (:func:`jaxkv.eval.token_nll`), and the
     sliding-window-with-recomputation oracle (:func:`jaxkv.eval.recompute_nll`) at a
     uniform sample of positions (it costs a whole window per token).
  2. Perplexity by number of sinks at a fixed cache size (StreamingLLM Table 2).
  3. KIVI: perplexity by precision and group size through the real cache, and the K/V
     quantisation-axis ablation (KIVI Table 1) by fake quantisation
     (:class:`jaxkv.eval.FakeQuantKV` as the forward's ``kv_hook``).
  4. Memory table at the prior implementation's model shape and at SmolLM2's, counted from
     the cache's pytree leaves (:func:`jaxkv.eval.memory_rows`).
  5. Greedy prefix match against an fp32 cache (:func:`jaxkv.eval.greedy_match`).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import platform
import sys
import time

import numpy as np

from jaxkv.cache.spec import CacheSpec
from jaxkv.errors import JaxkvError
from jaxkv.eval import tables
from jaxkv.eval.fake_quant import FakeQuantKV
from jaxkv.eval.perplexity import perplexity, recompute_nll, teacher_forced_nll, token_nll
from jaxkv.files import atomic_write
from jaxkv.io import load_model

FULL = dict(
    # section 1
    st_tokens=8192,
    sm_tokens=4096,
    cache=256,
    sink=4,
    st_rec_stride=8,
    sm_rec_stride=16,
    st_rec_batch=32,
    sm_rec_batch=8,
    # section 2
    sinks=(0, 1, 2, 4, 8),
    st_sink_tokens=8192,
    sm_sink_tokens=4096,
    # section 3
    kivi_modes=("int8", "int4", "int2"),
    groups=(32, 64, 128),
    st_kivi_segments=16,
    st_kivi_len=512,
    sm_kivi_tokens=1024,
    ablation_group=32,
    ablation_bits=(4, 2),
    # section 5
    greedy_new=100,
)
QUICK = dict(
    FULL,
    st_tokens=1024,
    sm_tokens=320,
    st_rec_stride=64,
    sm_rec_stride=32,
    st_sink_tokens=1024,
    sm_sink_tokens=320,
    st_kivi_segments=2,
    sm_kivi_tokens=256,
    greedy_new=10,
)
SECTIONS = (1, 2, 3, 4, 5)
MODEL_NAMES = ("stories260K", "SmolLM2-135M")
PRIOR_SHAPE = dict(n_layers=12, n_kv_heads=8, head_dim=32)
MEM_TOKENS = (128, 256, 384, 500, 1024, 2048)
MEM_MODES = ("bf16", "int8", "int4", "int2")

T0 = time.perf_counter()


def log(msg: str) -> None:
    """``msg`` on stderr, prefixed with the seconds since import."""
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


class Timer:
    """Wall and CPU (all threads) seconds of a block, stored as ``sink[name] = {"wall_s", "cpu_s"}``."""

    def __init__(self, sink: dict, name: str):
        self.sink, self.name = sink, name

    def __enter__(self):
        self.t, self.c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.sink[self.name] = dict(
            wall_s=round(time.perf_counter() - self.t, 1), cpu_s=round(time.process_time() - self.c, 1)
        )


def machine() -> dict:
    """CPU, platform, versions, JAX backend and devices, and the load average now."""
    import flax
    import jax
    import jaxlib

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
    return dict(
        cpu=cpu,
        logical_cpus=os.cpu_count(),
        usable_cpus=usable,
        platform=platform.platform(),
        python=platform.python_version(),
        jax=jax.__version__,
        jaxlib=jaxlib.__version__,
        flax=flax.__version__,
        numpy=np.__version__,
        backend=jax.default_backend(),
        devices=[str(d) for d in jax.devices()],
        load_avg_start=[round(x, 2) for x in os.getloadavg()],
    )


def encode_prefix(model, text: pathlib.Path, n: int) -> list[int]:
    """The first ``n`` token ids of the file ``text`` as one stream (the tokenizer's default BOS).

    Raises:
      JaxkvError: the text has fewer than ``n`` tokens.
    """
    body = text.read_text(encoding="utf-8")
    chars = 8 * n
    while True:
        ids = model.tokenizer.encode(body[:chars])
        if len(ids) > n + 8 or chars >= len(body):
            break
        chars *= 2
    if len(ids) < n:
        raise JaxkvError(f"{text}: only {len(ids)} tokens, {n} needed")
    return ids[:n]


# ------------------------------------------------------------------------------ sections


def spec_for(kind: str, *, n_scored: int, cache: int, sink: int = 4) -> CacheSpec:
    """Section 1's caches: ``full``, ``window`` (sink 0), ``sink_absolute`` / ``sink_cache`` (sink + window)."""
    if kind == "full":
        return CacheSpec(max_len=n_scored + 1)
    if kind == "window":
        return CacheSpec(sink=0, window=cache)
    if kind in ("sink_absolute", "sink_cache"):
        return CacheSpec(sink=sink, window=cache - sink, positions=kind.split("_")[1])
    raise JaxkvError(f"spec_for: kind={kind!r}: expected 'full', 'window', 'sink_absolute' or 'sink_cache'")


def section1(name, model, ids, cfg, res, timings):
    """NLL vs position for the four cache kinds over ``ids`` and the sampled recompute oracle."""
    n = len(ids) - 1
    out = dict(tokens=n, cache=cfg["cache"], sink=cfg["sink"], runs={}, specs={})
    for kind in ("full", "window", "sink_absolute", "sink_cache"):
        spec = spec_for(kind, n_scored=n, cache=cfg["cache"], sink=cfg["sink"])
        log(f"{name}: section 1, {spec.describe()}, {n} tokens")
        with Timer(timings, f"{name} s1 {kind}"):
            nll = token_nll(model, ids, cache=spec)
        out["runs"][kind] = nll
        out["specs"][kind] = spec.describe()
        log(f"{name}: {kind} ppl {perplexity(nll):.3f} ({timings[f'{name} s1 {kind}']})")
    stride = cfg["st_rec_stride" if name == "stories260K" else "sm_rec_stride"]
    batch = cfg["st_rec_batch" if name == "stories260K" else "sm_rec_batch"]
    positions = np.arange(cfg["cache"], n, stride)
    log(f"{name}: recompute oracle, window {cfg['cache']}, {len(positions)} sampled positions (stride {stride})")
    with Timer(timings, f"{name} s1 recompute"):
        rec = recompute_nll(model, ids, window=cfg["cache"], batch=batch, positions=positions)
    out["recompute"] = dict(window=cfg["cache"], stride=stride, positions=positions, nll=rec)
    log(f"{name}: recompute ppl at samples {perplexity(rec):.3f} ({timings[f'{name} s1 recompute']})")
    res[name]["s1"] = out


def section2(name, model, ids, cfg, res, timings):
    """Perplexity by number of sinks at cache size ``cfg['cache']`` (sink + window), both position modes;
    reuses section 1's runs where they are the same cache."""
    n_tok = cfg["st_sink_tokens" if name == "stories260K" else "sm_sink_tokens"]
    ids = ids[: n_tok + 1]
    n = len(ids) - 1
    s1 = res[name].get("s1", {}).get("runs", {})
    table = {}
    for sink in cfg["sinks"]:
        for positions in ("absolute", "cache"):
            reuse = {
                (0, "absolute"): "window",
                (cfg["sink"], "absolute"): "sink_absolute",
                (cfg["sink"], "cache"): "sink_cache",
            }.get((sink, positions))
            if reuse in s1 and len(s1[reuse]) >= n:  # a streamed NLL is causal: its prefix is the shorter run
                nll, how = s1[reuse][:n], f"section 1 ({reuse}), first {n} tokens"
            elif sink == 0 and positions == "cache" and name != "stories260K" and "window" in s1:
                nll, how = s1["window"][:n], "= absolute (no sinks: identical relative distances; see stories260K)"
            else:
                spec = CacheSpec(sink=sink, window=cfg["cache"] - sink, positions=positions)
                log(f"{name}: section 2, {spec.describe()}, {n} tokens")
                with Timer(timings, f"{name} s2 sink{sink} {positions}"):
                    nll = token_nll(model, ids, cache=spec)
                how = "run"
            table[f"{sink}/{positions}"] = dict(
                sink=sink, positions=positions, ppl=perplexity(nll), ppl_past=perplexity(nll[cfg["cache"] :]), how=how
            )
    res[name]["s2"] = dict(tokens=n, cache=cfg["cache"], table=table)


def kivi_inputs(name, model, text, cfg):
    """Token rows for section 3: stories260K = BOS + 511-token segments (its trained context is 512),
    SmolLM2 = the first ``sm_kivi_tokens`` tokens as one stream (its trained context is 8192)."""
    if name == "stories260K":
        seg, count = cfg["st_kivi_len"], cfg["st_kivi_segments"]
        ids = encode_prefix(model, text, 1 + count * (seg - 1))
        bos = ids[0]
        return [[bos] + ids[1 + i * (seg - 1) : 1 + (i + 1) * (seg - 1)] for i in range(count)]
    return [encode_prefix(model, text, cfg["sm_kivi_tokens"])]


def section3(name, model, text, cfg, res, timings):
    """KIVI through the real cache (full cache, residual R = G), and the fake-quantised axis ablation."""
    rows = kivi_inputs(name, model, text, cfg)
    t = len(rows[0])
    scored = sum(len(r) - 1 for r in rows)
    cache = {}

    def run(label, spec):
        log(f"{name}: section 3, {spec.describe()} x {len(rows)} row(s) of {t}")
        with Timer(timings, f"{name} s3 {label}"):
            nll = np.concatenate([token_nll(model, r, cache=spec) for r in rows])
        cache[label] = dict(ppl=perplexity(nll), spec=spec.describe())
        return nll

    fp32 = run("fp32", CacheSpec(max_len=t))
    run("bf16", CacheSpec(max_len=t, kv_quantize="bf16"))
    for mode in cfg["kivi_modes"]:
        for g in cfg["groups"]:
            run(f"{mode}/G{g}", CacheSpec(max_len=t, kv_quantize=mode, group_size=g, residual=g))
    for r in cache.values():
        r["vs_fp32"] = r["ppl"] / cache["fp32"]["ppl"] - 1

    # ablation: one batched causal pass over the same rows, K (after RoPE, as the absolute-position
    # cache stores them) and V fake-quantised
    batch = np.asarray(rows, np.int32)
    g = cfg["ablation_group"]
    with Timer(timings, f"{name} s3 ablation"):
        base = teacher_forced_nll(model, batch).reshape(-1)
        check = float(np.max(np.abs(base - fp32)))
        abl = {}
        for bits in cfg["ablation_bits"]:
            for k_how in ("channel", "token"):
                for v_how in ("token", "channel"):
                    log(f"{name}: ablation int{bits} K per-{k_how} V per-{v_how}")
                    hook = FakeQuantKV(
                        keys=k_how, values=v_how, bits=bits, group_size=g, rope_theta=model.config.rope_theta
                    )
                    nll = teacher_forced_nll(model, batch, kv_hook=hook)
                    abl[f"int{bits}/K-{k_how}/V-{v_how}"] = dict(bits=bits, k=k_how, v=v_how, ppl=perplexity(nll))
    for r in abl.values():
        r["vs_fp32"] = r["ppl"] / perplexity(base) - 1
    res[name]["s3"] = dict(
        rows=len(rows),
        row_len=t,
        scored=scored,
        cache=cache,
        ablation=abl,
        ablation_group=g,
        ablation_fp32_ppl=perplexity(base),
        ablation_check_max_abs=check,
    )


def section4(res, timings):
    """Memory table (bytes of every pytree leaf) at the prior's shape and at SmolLM2's."""
    g, r = tables.GROUP_SIZE, tables.RESIDUAL
    out = {}
    with Timer(timings, "s4 memory"):
        for label, shape in (("prior", PRIOR_SHAPE), ("SmolLM2-135M", tables.SMOLLM2_SHAPE)):
            exact = [n for n in MEM_TOKENS if (n - r) % g == 0]
            rows = tables.memory_rows(tokens=tuple(exact), modes=MEM_MODES, shape=shape)
            table = {
                f"{x['tokens']}/{x['mode']}": dict(
                    bytes=x["bytes"], leaf_bytes=x["leaf_bytes"], capacity=x["capacity"], groups=x["groups"]
                )
                for x in rows
            }
            for n in MEM_TOKENS:
                if n in exact:
                    continue
                # W = n - R is not a multiple of G: the nearest KIVI cache holding n tokens has W = G*floor((n-R)/G)+G
                bf16 = tables.allocated_report(tables.memory_spec("bf16", n), shape=shape)[0]
                table[f"{n}/bf16"] = dict(
                    bytes=bf16.allocated_bytes, capacity=bf16.capacity, groups=dict(bf16.allocated)
                )
                w = g * math.ceil((n - r) / g)
                for mode in MEM_MODES[1:]:
                    rep = tables.filled_report(
                        CacheSpec(window=w, kv_quantize=mode, group_size=g, residual=r), n, shape=shape
                    )
                    table[f"{n}/{mode}"] = dict(
                        bytes=rep.allocated_bytes,
                        live=rep.live_bytes,
                        capacity=rep.capacity,
                        stored=rep.tokens_stored[0],
                        groups=dict(rep.allocated),
                    )
            out[label] = dict(shape=shape, table=table)
    out["group_size"], out["residual"] = g, r
    res["s4"] = out


def section5(models, cfg, res, timings):
    """Greedy prefix match of each model's KIVI and bf16 caches against its fp32 cache."""
    out = {}
    for name, model in models.items():
        log(f"{name}: section 5, greedy prefix match, {len(tables.PROMPTS)} prompts x {cfg['greedy_new']} tokens")
        with Timer(timings, f"{name} s5 greedy"):
            g = tables.greedy_match(model, tables.PROMPTS, new_tokens=cfg["greedy_new"])
        out[name] = dict(
            modes={
                m: dict(per_prompt=d["per_prompt"], mean=d["mean"], exact=d["exact"]) for m, d in g["modes"].items()
            },
            prompt_lengths=g["prompt_lengths"],
            reference_text=[model.tokenizer.decode(t) for t in g["reference"]],
        )
    res["s5"] = dict(
        prompts=list(tables.PROMPTS),
        new_tokens=cfg["greedy_new"],
        group_size=tables.GROUP_SIZE,
        residual=tables.RESIDUAL,
        models=out,
    )


# ------------------------------------------------------------------------------ run


def to_jsonable(x):
    """``x`` with numpy arrays and scalars as JSON types; float arrays rounded to 5 decimals (nats)."""
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


def run(data: pathlib.Path, *, quick: bool = False, sections=SECTIONS, checkpoint: pathlib.Path | None = None) -> dict:
    """Measure ``sections`` of docs/RESULTS.md on the models and text under ``data``.

    Args:
      data: the data folder (``models/stories260K.bin``, ``models/tok512.model``,
        ``models/SmolLM2-135M-Instruct.Q4_1.gguf``, ``text/tinystories_valid_head.txt``).
      quick: small sizes (:data:`QUICK`): a smoke run, not the results.
      sections: which of 1-5 to run (section 2 reuses section 1's runs when both run).
      checkpoint: where to write the JSON after each model, so a crash keeps what was done.
    Returns:
      the results as JSON types (:func:`to_jsonable`), every per-token NLL in nats included;
      ``timings`` holds wall and CPU seconds per step.
    Raises:
      JaxkvError: a section not in 1-5, a missing model file, a text too short.
    """
    sections = set(sections)
    if not sections or not sections <= set(SECTIONS):
        raise JaxkvError(f"sections={sorted(sections)}: expected a non-empty subset of {list(SECTIONS)}")
    models_dir, text = data / "models", data / "text" / "tinystories_valid_head.txt"
    cfg = dict(QUICK if quick else FULL)
    timings: dict = {}
    res: dict = dict(quick=quick, config=cfg, date=time.strftime("%Y-%m-%d %H:%M %Z"), machine=machine())
    total_t, total_c = time.perf_counter(), time.process_time()
    with Timer(timings, "load models"):
        models = {
            "stories260K": load_model(models_dir / "stories260K.bin", tokenizer=models_dir / "tok512.model"),
            "SmolLM2-135M": load_model(models_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"),
        }
    for name, model in models.items():
        c = model.config
        res[name] = dict(
            config=dict(
                n_layers=c.n_layers,
                n_heads=c.n_heads,
                n_kv_heads=c.n_kv_heads,
                head_dim=c.head_dim,
                dim=c.dim,
                trained_context=c.max_seq_len,
                rope_theta=c.rope_theta,
            )
        )
    if 4 in sections:
        log("section 4: memory")
        section4(res, timings)
    for name, model in models.items():
        if sections & {1, 2}:
            n = cfg["st_tokens" if name == "stories260K" else "sm_tokens"]
            ids = encode_prefix(model, text, n + 1)
        if 1 in sections:
            section1(name, model, ids, cfg, res, timings)
        if 2 in sections:
            section2(name, model, ids, cfg, res, timings)
        if 3 in sections:
            section3(name, model, text, cfg, res, timings)
        if checkpoint is not None:
            atomic_write(checkpoint, json.dumps(to_jsonable(res)).encode(), private=False)
    if 5 in sections:
        section5(models, cfg, res, timings)
    timings["total"] = dict(
        wall_s=round(time.perf_counter() - total_t, 1), cpu_s=round(time.process_time() - total_c, 1)
    )
    res["timings"] = timings
    res["machine"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    return json.loads(json.dumps(to_jsonable(res)))  # exactly what is stored
