"""docs/RESULTS.md from the measured results (``measure.run``'s JSON): claims with fixed
thresholds, tables and the prose that reads them.

:func:`render` is a pure function of the results dict and the plot file names, so
``scripts/reproduce.py --render-only`` re-renders the document from a saved JSON without
running any model.
"""

from __future__ import annotations

import numpy as np

from jaxkv.eval.perplexity import paired_ratio, perplexity
from jaxkv.eval.report.measure import MEM_MODES, MEM_TOKENS, MODEL_NAMES

# The prior Swift implementation's published table (prior-art/streamingllm-kivi-swift.md), MB as printed
# there (decimal: 6,144,000 B of bf16 K+V at 500 tokens is printed "6.2 MB"); 1024 and 2048 were extrapolated.
PRIOR_MEMORY = {
    128: (1.6, 0.854, 0.854, 0.478),
    256: (3.2, 1.7, 1.7, 0.947),
    384: (4.7, 2.5, 2.5, 1.4),
    500: (6.2, 3.3, 3.3, 1.8),
    1024: (12.5, 6.6, 6.6, 3.5),
    2048: (25.0, 13.2, 13.2, 7.0),
}
PRIOR_GREEDY = {  # prompt -> (bf16, int8, int4) prefix match, 60 tokens, its model (27M, 12L, 8H, D=32)
    "The first president…": (1.00, 1.00, 1.00),
    "In machine learning…": (1.00, 1.00, 0.82),
    "Once upon a time…": (1.00, 1.00, 1.00),
    "Photosynthesis is…": (0.52, 1.00, 1.00),
}


RANGES = (0, 256, 512, 1024, 2048, 4096, 8192)


def claims(res) -> dict:
    """Verdicts, with the thresholds fixed here (before looking at any run):
    blow-up = perplexity past the window more than 2x the recomputation oracle's at the same positions;
    'within 10 %' = ratio to the oracle <= 1.10; 'flat' = in every range past 512, sink 4 + window
    (cache positions) within 10 % of the oracle on the same positions; 'degrades' = the full cache more
    than 10 % above the oracle in every range past 512; int8 = |ppl / fp32 - 1| <= 0.5 %."""
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
            c[kind] = paired_ratio(s1["runs"][kind], rec, pos)
        ranges = []
        for lo, hi in zip(RANGES, RANGES[1:]):
            if lo >= s1["tokens"]:
                break
            sel = pos[(pos >= lo) & (pos < hi)]
            row = dict(
                lo=lo,
                hi=min(hi, s1["tokens"]),
                n_samples=int(len(sel)),
                ppl={k: perplexity(np.asarray(v)[lo:hi]) for k, v in s1["runs"].items()},
            )
            if len(sel) >= 2:
                row["recompute"] = perplexity(rec[sel])
                row["ratio"] = {k: paired_ratio(v, rec, sel) for k, v in s1["runs"].items()}
            ranges.append(row)
        past512 = [r for r in ranges if r["lo"] >= 512 and "ratio" in r]
        bins = []
        for lo in range(0, s1["tokens"], 512):
            sel = pos[(pos >= lo) & (pos < lo + 512)]
            if len(sel) >= 4:
                bins.append(
                    dict(
                        lo=lo, hi=lo + 512, ratio={k: paired_ratio(v, rec, sel)["ratio"] for k, v in s1["runs"].items()}
                    )
                )
        out[name] = dict(
            vs_recompute=c,
            ranges=ranges,
            bins=bins,
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


def machine_text(m: dict, total: dict) -> str:
    """The **Machine** / **Versions** / **Wall time** paragraph of a generated document, from
    :func:`jaxkv.eval.report.measure.machine` (``load_avg_end`` added at the end of the run) and
    the run's total ``{"wall_s", "cpu_s"}``."""
    return (
        f"**Machine**: {m['cpu']}, {m['logical_cpus']} logical CPUs ({m['usable_cpus']} usable), {m['platform']}; "
        f"JAX backend `{m['backend']}`. **Versions**: Python {m['python']}, jax {m['jax']}, jaxlib {m['jaxlib']}, "
        f"flax {m['flax']}, numpy {m['numpy']}. **Wall time**: {total.get('wall_s', float('nan')) / 60:.1f} min "
        f"({total.get('cpu_s', float('nan')) / 60:.1f} CPU-min over all threads). Load average at start "
        f"{m['load_avg_start']}, at end {m.get('load_avg_end')}: the machine was shared with other jobs, so wall "
        "times are upper bounds (the CPU-minutes are closer to what an idle 2-core machine needs)."
    )


def fmt_ratio(r) -> str:
    """A :func:`jaxkv.eval.paired_ratio` dict as ``ratio [lo, hi]``."""
    return f"{r['ratio']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]"


def mb(b) -> str:
    """Bytes as decimal megabytes (10^6 bytes), 3 decimals."""
    return f"{b / 1e6:.3f}"


def render(res: dict, made: list[str]) -> str:
    """The markdown of docs/RESULTS.md.

    Args:
      res: the results of :func:`jaxkv.eval.report.measure.run` (as stored in JSON); the
        sections it lacks are left out.
      made: file names of the plots in ``results/`` next to the document (linked when present).
    Returns:
      the document, one string.
    """
    cfg = res["config"]
    m = res["machine"]
    cl = claims(res)
    L = []
    add = L.append
    add("# Results: what a bounded and quantised KV cache costs in quality")
    add("")
    add(
        f"Generated by `scripts/reproduce.py`{' --quick (SMOKE RUN: small sizes, not the results)' if res['quick'] else ''} "
        f"on {res['date']}; every number below was measured in that run, from `../shared/data` only "
        "(stories260K, SmolLM2-135M-Instruct Q4_1 GGUF, `text/tinystories_valid_head.txt`). "
        "Rerun it to regenerate this file, its plots in `docs/results/` and `docs/results/results.json` "
        "(which also holds every per-token NLL): `pip install -e '.[results]' && python scripts/reproduce.py`."
    )
    add("")
    add(machine_text(m, res["timings"].get("total", {})))
    add("")
    add(
        "## Summary of the claims (thresholds fixed in `claims()` of `jaxkv/eval/report/render.py` before the full run)"
    )
    add("")
    add(claim_summary(res, cl))
    add("")

    # ---------------------------------------------------------------- section 1
    add("## 1. NLL versus position (StreamingLLM Fig. 3, small scale)")
    add("")
    add(
        "Teacher-forced NLL of every token through the cache (`jaxkv.eval.token_nll`: each token scored with exactly "
        "what the cache holds when it is predicted; chunked prefill equals token-by-token decode). One continuous "
        "stream of TinyStories text (the tokenizer's default BOS first; no BOS between stories). Cache size "
        f"{cfg['cache']} for every bounded cache: window only = sink 0 + window {cfg['cache']}; "
        f"sink {cfg['sink']} + window {cfg['cache'] - cfg['sink']} in `absolute` positions (keys keep the RoPE of "
        "their original position; the prior implementation's choice) and in `cache` positions (keys rotated at "
        "their rank in the cache, the paper's §3.2). Full cache = every token kept."
    )
    add("")
    add(
        f"**Recomputation oracle** (the paper's sliding window with re-computation, `recompute_nll`'s code, window "
        f"{cfg['cache']}, no sinks): it re-encodes a whole window per token, so it is evaluated only at a uniform "
        "sample of positions past the window (one position in "
        + ", ".join(f"{res[n]['s1']['recompute']['stride']} for {n}" for n in MODEL_NAMES if "s1" in res.get(n, {}))
        + "); each cache is compared to it **on the same sampled positions** (paired: ratio of perplexities = "
        "exp(mean NLL difference), with a 95 % interval from the paired standard error)."
    )
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
            cells = [s1["specs"][kind], f"{perplexity(s1['runs'][kind]):.3f}"] + [
                f"{r['ppl'][kind]:.3f}" for r in c["ranges"]
            ]
            add("| " + " | ".join(cells) + " |")
        add(
            "| recompute oracle, **at its sampled positions only** | "
            + f"{perplexity(s1['recompute']['nll']):.3f} | "
            + " | ".join(f"{r['recompute']:.3f} (n={r['n_samples']})" if "recompute" in r else "–" for r in c["ranges"])
            + " |"
        )
        add("")
        add(
            "The oracle's row covers only its sampled positions, so compare it with the caches through the "
            "paired ratios below, not cell by cell with the rows above (those average every position)."
        )
        add("")
        add(
            f"Ratio to the recomputation oracle on the same sampled positions (all positions >= {s1['cache']}, "
            f"n = {c['vs_recompute']['full']['n']}), and per range:"
        )
        add("")
        hdr = ["cache", f"all >= {s1['cache']}"] + [f"[{r['lo']}, {r['hi']})" for r in c["ranges"] if "ratio" in r]
        add("| " + " | ".join(hdr) + " |")
        add("|---|" + "---:|" * (len(hdr) - 1))
        for kind in ("full", "window", "sink_absolute", "sink_cache"):
            cells = [s1["specs"][kind], fmt_ratio(c["vs_recompute"][kind])] + [
                f"{r['ratio'][kind]['ratio']:.3f}" for r in c["ranges"] if "ratio" in r
            ]
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
        add(
            f"**{name}**, {s2['tokens']} tokens, cache size {s2['cache']} (sink S0 + window {s2['cache']} - S0): "
            f"perplexity over all tokens / over positions >= {s2['cache']} (past the window)."
        )
        add("")
        sinks = sorted({v["sink"] for v in s2["table"].values()})
        add("| positions | " + " | ".join(f"S0 = {s}" for s in sinks) + " |")
        add("|---|" + "---:|" * len(sinks))
        for positions in ("absolute", "cache"):
            add(
                f"| {positions} | "
                + " | ".join(
                    f"{s2['table'][f'{s}/{positions}']['ppl']:.3f} / {s2['table'][f'{s}/{positions}']['ppl_past']:.3f}"
                    for s in sinks
                )
                + " |"
            )
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
    add(
        "Through the real cache (`token_nll`): a **full** cache (no eviction) whose window tokens are stored as "
        "KIVI codes (keys per channel in groups of G tokens, values per token, float16 scale/zero, codes packed), "
        "residual **R = G** full-precision recent tokens (the smallest allowed, so the most tokens are read back "
        "from codes), versus the same full cache in fp32 and bf16. Every cache holds the same tokens, so the "
        "differences are the quantisation alone. Texts within each model's trained context: "
        + "; ".join(
            (
                f"stories260K: {res[n]['s3']['rows']} segments of {res[n]['s3']['row_len']} tokens (BOS + 511 "
                "consecutive tokens of the stream each)"
                if n == "stories260K"
                else f"SmolLM2-135M: the first {res[n]['s3']['row_len']} tokens of the stream"
            )
            + f" = {res[n]['s3']['scored']} scored tokens"
            for n in MODEL_NAMES
            if "s3" in res.get(n, {})
        )
        + "."
    )
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
        add(
            f"**{name}**: fp32 {cache['fp32']['ppl']:.4f}, bf16 {cache['bf16']['ppl']:.4f} "
            f"({100 * cache['bf16']['vs_fp32']:+.3f} %)."
        )
        add("")
        add("| cache | " + " | ".join(f"G = R = {g}" for g in groups) + " |")
        add("|---|" + "---:|" * len(groups))
        for mode in ("int8", "int4", "int2"):
            add(
                f"| {mode} | "
                + " | ".join(
                    f"{cache[f'{mode}/G{g}']['ppl']:.4f} ({100 * cache[f'{mode}/G{g}']['vs_fp32']:+.3f} %)"
                    for g in groups
                )
                + " |"
            )
        add("")
    add("### Axis ablation (KIVI Table 1)")
    add("")
    add(
        "jaxkv's cache has one layout (keys per channel, values per token); the four pairings are measured by fake "
        "quantisation instead. `jaxkv.eval.teacher_forced_nll` runs the library's forward in one teacher-forced "
        "causal pass over the same token rows as above (a fresh full fp32 cache per row), with "
        "`jaxkv.eval.FakeQuantKV` as its `kv_hook`: every layer's keys (after RoPE, as the `absolute`-position cache "
        "stores them) and values are replaced by a round trip through the cache's KIVI kernels: *per channel* = "
        f"`quantize_keys`/`dequantize_keys`, one (scale, zero) per channel and group of G = {cfg['ablation_group']} "
        "tokens, *per token* = `quantize_values`/`dequantize_values`, one per token over the head's H channels; "
        "float16 scale/zero as in the cache. This is fake quantisation of **every** "
        "token: no full-precision residual, and a per-channel group's range includes the (up to G - 1) later tokens "
        "of its group, which the real cache never lets a query see. So it is harsher than the cache above in one "
        "way and slightly optimistic in another; it is the same for all four pairings, which is what the ablation "
        "compares. With no quantisation the pass reproduces the full-cache `token_nll` to "
        + ", ".join(
            f"{res[n]['s3']['ablation_check_max_abs']:.1e} nats ({n})" for n in MODEL_NAMES if "s3" in res.get(n, {})
        )
        + " (max abs difference per token)."
    )
    add("")
    for name in MODEL_NAMES:
        if "s3" not in res.get(name, {}):
            continue
        s3 = res[name]["s3"]
        abl = s3["ablation"]
        add(
            f"**{name}** (head dim {res[name]['config']['head_dim']}; fake-quant fp32 baseline ppl "
            f"{s3['ablation_fp32_ppl']:.4f}; perplexity and change vs that baseline):"
        )
        add("")
        add("| keys | values | " + " | ".join(f"int{b}" for b in cfg["ablation_bits"]) + " |")
        add("|---|---|" + "---:|" * len(cfg["ablation_bits"]))
        for k_how, v_how in (("channel", "token"), ("token", "token"), ("token", "channel"), ("channel", "channel")):
            tag = " (KIVI)" if (k_how, v_how) == ("channel", "token") else ""
            add(
                f"| per {k_how}{tag} | per {v_how} | "
                + " | ".join(
                    f"{abl[f'int{b}/K-{k_how}/V-{v_how}']['ppl']:.4f} ({100 * abl[f'int{b}/K-{k_how}/V-{v_how}']['vs_fp32']:+.2f} %)"
                    for b in cfg["ablation_bits"]
                )
                + " |"
            )
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
        out.append(
            f"- *Window-only perplexity blows up once the text passes the window* ({name}): {verdict(c['window_blows_up'])}: "
            f"past the window it is {w['ratio']:.2f}x the recomputation oracle's ({fmt_ratio(w)}; blow-up "
            "threshold 2x)" + ("; borderline: the 95 % interval includes 2x" if w["lo"] < 2.0 < w["hi"] else "") + "."
        )
        for kind, label in (("sink_cache", "cache"), ("sink_absolute", "absolute")):
            r = c["vs_recompute"][kind]
            out.append(
                f"- *Sink 4 + window stays within 10 % of the recomputation oracle* ({name}, {label} positions): "
                f"{verdict(c['sink_within_10'][kind])}: ratio {fmt_ratio(r)}."
            )
    if st:
        rng = [r for r in st["ranges"] if r["lo"] >= 512 and "ratio" in r]
        out.append(
            '- *With `positions="cache"` stories260K stays flat to '
            f"{res['stories260K']['s1']['tokens']} tokens*: {verdict(st['cache_flat'])}: ratio to the oracle per range past 512: "
            + ", ".join(f"[{r['lo']}, {r['hi']}) {r['ratio']['sink_cache']['ratio']:.3f}" for r in rng)
            + "; its perplexity by range "
            + ", ".join(f"[{r['lo']}, {r['hi']}) {r['ppl']['sink_cache']:.2f}" for r in st["ranges"])
            + "."
        )
        out.append(
            "- *while the full cache degrades past 512*: "
            + verdict(st["full_degrades"])
            + ": full-cache perplexity by range "
            + ", ".join(f"[{r['lo']}, {r['hi']}) {r['ppl']['full']:.2f}" for r in st["ranges"])
            + "."
        )
    for name, c in (("stories260K", st), ("SmolLM2-135M", sm)):
        if c and "int8" in c:
            out.append(
                f"- *int8 perplexity within 0.5 % of fp32* ({name}): {verdict(c['int8_within'])}: "
                + ", ".join(f"{k.split('/')[1]} {100 * v:+.3f} %" for k, v in c["int8"].items())
                + "."
            )
    return "\n".join(out)


def section1_discussion(res, cl) -> str:
    """What the numbers of section 1 say, including why the misses miss (measured where possible)."""
    L = ["### What section 1 shows", ""]
    st, sm = cl.get("stories260K"), cl.get("SmolLM2-135M")
    if sm:
        w, a, c = (sm["vs_recompute"][k] for k in ("window", "sink_absolute", "sink_cache"))
        effect = w["ratio"] > 1.10 and max(a["ratio"], c["ratio"]) <= 1.10
        L.append(
            f"- **SmolLM2-135M**: once the first tokens are evicted, the window-only cache is "
            f"{w['ratio']:.2f}x the oracle, and keeping 4 sink tokens gives {a['ratio']:.2f}x (absolute) / "
            f"{c['ratio']:.2f}x (cache positions). "
            + ("This is the paper's effect, qualitatively. " if effect else "")
            + (
                "The window-only degradation stays below the 2x we set for a 'blow-up': the paper's window "
                "attention reaches perplexities in the hundreds to thousands on 7B+ models over 20K-token "
                "texts; this 135M model with a 256-token cache degrades far less. "
                if not sm["window_blows_up"]
                else ""
            )
            + f"Its trained context is 8192 tokens, so its full cache is in distribution here (ratio "
            f"{sm['vs_recompute']['full']['ratio']:.2f} to the oracle: more context than the oracle's 256 tokens)."
        )
    if st:
        w = st["vs_recompute"]["window"]
        if not st["window_blows_up"]:
            L.append(
                f"- **stories260K does not show the attention-sink effect**: window only is {w['ratio']:.3f}x "
                "the oracle past the window, and no blow-up: evicting the first tokens costs it nothing. A "
                "plausible cause (not tested here): llama2.c trains on random 512-token crops of the "
                "concatenated stories, so the first token of a training window is an arbitrary mid-story "
                "token, and BOS recurs at every story start."
            )
        else:
            L.append(f"- **stories260K**: window only is {w['ratio']:.3f}x the oracle past the window.")
        a = st["vs_recompute"]["sink_absolute"]
        blow = [r for r in st["ranges"] if r["ppl"]["sink_absolute"] > 2 * r["ppl"]["sink_cache"]]
        if not st["sink_within_10"]["sink_absolute"]:
            L.append(
                f"- **Sink 4 + window in absolute positions fails on stories260K** ({a['ratio']:.2f}x the oracle "
                "past the window"
                + (
                    f"; the first range where it is more than twice the cache-position run is [{blow[0]['lo']}, "
                    f"{blow[0]['hi']}), perplexity {blow[0]['ppl']['sink_absolute']:.1f} against "
                    f"{blow[0]['ppl']['sink_cache']:.2f}"
                    if blow
                    else ""
                )
                + "; per 512 positions it is above 2x the oracle in "
                + ", ".join(f"[{b['lo']}, {b['hi']})" for b in st["bins"] if b["ratio"]["sink_absolute"] > 2)
                + ", and back within 10 % in "
                + (
                    ", ".join(
                        f"[{b['lo']}, {b['hi']})"
                        for b in st["bins"]
                        if b["lo"] >= 2048 and b["ratio"]["sink_absolute"] <= 1.1
                    )
                    or "none past 2048"
                )
                + "): its queries see the sink keys at their original positions, so the query-to-sink distance "
                "grows with the text and leaves the 512 positions the model was trained on. Why it grows large "
                + (
                    f"only from about position {[b for b in st['bins'] if b['ratio']['sink_absolute'] > 2][0]['lo']}"
                    if any(b["ratio"]["sink_absolute"] > 2 for b in st["bins"])
                    else "so late"
                )
                + ", and why it recedes again late in the text, we did not "
                "investigate (RoPE angles are periodic, so an out-of-range distance need not stay harmful). "
                '`positions="cache"` '
                "keeps every distance below the cache size and stays at the oracle's level. SmolLM2 (trained "
                f"to 8192) is not affected at {res['SmolLM2-135M']['s1']['tokens'] if 'SmolLM2-135M' in res else '?'} tokens."
            )
        full = st["ranges"]
        L.append(
            "- **Full cache on stories260K**: perplexity by range "
            + ", ".join(f"[{r['lo']}, {r['hi']}) {r['ppl']['full']:.2f}" for r in full)
            + (
                " — it degrades once positions pass the trained context of 512, which a bounded cache with "
                "cache positions avoids."
                if st["full_degrades"]
                else "."
            )
        )
    return "\n".join(L)


def section2_discussion(res) -> str:
    L = [
        "The paper's Table 2 (Llama-2 and others, 4K-token texts) finds that one or two initial tokens do not "
        "fully restore perplexity, four generally suffice, and more bring diminishing returns. Here:",
        "",
    ]
    for name in MODEL_NAMES:
        s2 = res.get(name, {}).get("s2")
        if not s2:
            continue
        t = s2["table"]
        for positions in ("cache", "absolute"):
            p = {s: t[f"{s}/{positions}"]["ppl_past"] for s in sorted({v["sink"] for v in t.values()})}
            one_enough = abs(p[1] / p[4] - 1) <= 0.02
            hurt = p[0] < p[1] / 1.1
            L.append(
                f"- {name}, {positions} positions, past the window: "
                + ", ".join(f"S0 = {k} {v:.3f}" for k, v in p.items())
                + f". No sink vs 4 sinks: {100 * (p[0] / p[4] - 1):+.1f} %; "
                + (
                    "one sink already comes within 2 % of four."
                    if one_enough
                    else f"one sink is {100 * (p[1] / p[4] - 1):+.1f} % off four."
                )
                + (
                    " Here any sink makes it worse: the sink keys sit at their original positions, ever farther "
                    "from the query, outside the trained context (section 1)."
                    if hurt
                    else ""
                )
            )
    L.append(
        "- SmolLM2's tokenizer adds no BOS, so its sinks are the first text tokens; stories260K's first token is BOS."
    )
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
            if (
                best != f"int{b}/K-channel/V-token"
                and abl[f"int{b}/K-channel/V-token"]["ppl"] <= abl[best]["ppl"] * 1.001
            ):
                best, tie = f"int{b}/K-channel/V-token", best  # within 0.1 %: a tie, reported as such
            kivi = abl[f"int{b}/K-channel/V-token"]
            worst = max((k for k in abl if k.startswith(f"int{b}/")), key=lambda k: abl[k]["ppl"])
            real = s3["cache"].get(f"int{b}/G{res['config']['ablation_group']}")
            L.append(
                f"- {name}, int{b}: "
                + (
                    "KIVI's pairing (keys per channel, values per token) is the best of the four"
                    + (
                        f", tied within 0.1 % with {tie.split('/', 1)[1].replace('/', ', ').replace('-', ' per ')}"
                        if tie
                        else ""
                    )
                    if best == f"int{b}/K-channel/V-token"
                    else f"the best pairing is {best.split('/', 1)[1].replace('/', ', ').replace('-', ' per ')}, not KIVI's"
                )
                + f" ({kivi['vs_fp32'] * 100:+.2f} %); worst {worst.split('/', 1)[1].replace('/', ', ').replace('-', ' per ')} "
                f"({abl[worst]['vs_fp32'] * 100:+.2f} %)"
                + (
                    f"; the real cache (G = R = {res['config']['ablation_group']}, residual in full precision, "
                    f"groups quantised only once complete) {real['vs_fp32'] * 100:+.2f} %."
                    if real
                    else "."
                )
            )
    keys_matter = all(
        max(s3["ablation"][f"int{b}/K-channel/V-{v}"]["ppl"] for v in ("token", "channel"))
        < min(s3["ablation"][f"int{b}/K-token/V-{v}"]["ppl"] for v in ("token", "channel"))
        for s3 in (res[n]["s3"] for n in MODEL_NAMES if "s3" in res.get(n, {}))
        for b in res["config"]["ablation_bits"]
    )
    if keys_matter:
        L.append(
            "- In every case both pairings with keys per channel beat both with keys per token: the key axis "
            "decides, as in KIVI's Table 1. KIVI's explanation (not measured here) is that key outliers sit in "
            "a few fixed channels, so one range per token spends the levels on them and crushes the other "
            "channels, while one range per channel fits each."
        )
    L.append(
        "- Per-token groups here are one head's H channels: 64 for SmolLM2, only 8 for stories260K (KIVI's "
        "models: 128), so a per-token range covers fewer channels than in the paper."
    )
    return "\n".join(L)


def section4_render(res) -> str:
    s4 = res["s4"]
    g, r = s4["group_size"], s4["residual"]
    L = ["## 4. Memory table (the prior implementation's, counted from the pytree leaves)", ""]
    L.append(
        f"Bytes of every leaf of a freshly allocated `KVCache` (`jaxkv.eval.memory_rows`; "
        f"`jaxkv.memory_report`), batch 1. bf16 = a full cache of N slots; int8/int4/int2 = KIVI with "
        f"G = {g}, R = {r}: N - R quantised slots (codes packed: two int4 / four int2 codes per byte; float16 "
        "scale and zero per channel-group of keys and per token of values) plus the R-token residual, "
        "which jaxkv keeps in **float32**, plus the int32 position bookkeeping. MB = 10^6 bytes, as the "
        "prior note prints them; the ratio is bf16 bytes / these bytes."
    )
    L.append("")
    L.append(
        "Shapes: the prior note's model (12 layers, 8 heads, head dim 32; its cache stores one K/V per head, "
        "so **8 KV heads**) and SmolLM2-135M (30 layers, **3 KV heads** of 9 query heads, head dim 64)."
    )
    L.append("")
    for label in ("prior", "SmolLM2-135M"):
        t = s4[label]["table"]
        L.append(
            f"**{'prior model shape (L=12, K=8, H=32)' if label == 'prior' else 'SmolLM2-135M (L=30, K=3, H=64)'}**"
        )
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
            L.append(
                f"† {n} tokens: N - R = {n - r} is not a multiple of G = {g}, so no KIVI cache has exactly {n} "
                f"slots; shown is the smallest that holds {n} (capacity {e['capacity']}: {e['capacity'] - r} "
                f"quantised + {r} residual), after appending {n} tokens through the cache API. Bytes of the "
                "slots actually holding tokens: "
                + ", ".join(f"{mode} {mb(t[f'{n}/{mode}']['live'])} MB" for mode in MEM_MODES[1:])
                + "."
            )
            L.append("")
    t = s4["prior"]["table"]
    L.append(
        "**Against the prior implementation's table** (its numbers as printed; its int4 stored codes in int8 "
        "bytes, and it listed a theoretical packed int4; it had no residual and one key scale per channel "
        "for the whole cache):"
    )
    L.append("")
    L.append(
        "| stored tokens | bf16 prior / ours | int8 prior / ours | int4 prior stored (= int8) / prior packed (theory) / ours packed | int2 ours packed |"
    )
    L.append("|---:|---:|---:|---:|---:|")
    for n in MEM_TOKENS:
        p = PRIOR_MEMORY[n]
        L.append(
            f"| {n} | {p[0]} / {mb(t[f'{n}/bf16']['bytes'])} | {p[1]} / {mb(t[f'{n}/int8']['bytes'])} | "
            f"{p[2]} / {p[3]} / {mb(t[f'{n}/int4']['bytes'])} | {mb(t[f'{n}/int2']['bytes'])} |"
        )
    L.append("")
    e = t["2048/int4"]
    gr = e["groups"]
    L.append(
        f"At 2048 tokens our int4 cache is {mb(e['bytes'])} MB: codes {mb(gr.get('codes', 0))}, scales and zeros "
        f"{mb(gr.get('scales_zeros', 0))}, float32 residual {mb(gr.get('residual', 0))}, bookkeeping "
        f"{mb(gr.get('bookkeeping', 0))} MB. Ours is truly packed, so int4 is about half of int8 in codes; "
        "it carries more scale bytes than the prior's (KIVI's per-group key scales, one per 32 tokens, "
        "instead of one per channel for the whole cache, which the prior recomputed on every append and "
        "so re-quantised stored codes) and the full-precision residual KIVI prescribes; at small N the "
        "residual dominates the difference."
    )
    return "\n".join(L)


def section5_render(res) -> str:
    s5 = res["s5"]
    L = ["## 5. Greedy prefix match against an fp32 cache (the prior implementation's proxy)", ""]
    L.append(
        f"`jaxkv.eval.greedy_match`: the 8 prompts decoded together (ragged batch), "
        f"{s5['new_tokens']} greedy tokens each, EOS disabled, a full cache of longest prompt + "
        f"{s5['new_tokens']} slots in each mode (KIVI: G = {s5['group_size']}, R = {s5['residual']}, so most "
        "tokens are read back from codes). Score = fraction of the fp32-cache tokens reproduced before the "
        'first divergence. Prompts: the prior\'s four ("The first president…", "In machine learning…", '
        '"Once upon a time…", "Photosynthesis is…") and four more:'
    )
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
            L.append(
                f"| {p[:40]}{'…' if len(p) > 40 else ''} | "
                + " | ".join(f"{100 * d['modes'][m]['per_prompt'][i]:.0f} %" for m in modes)
                + " |"
            )
        L.append(
            "| **mean** (exact rows) | "
            + " | ".join(
                f"**{100 * d['modes'][m]['mean']:.0f} %** ({d['modes'][m]['exact']}/{len(s5['prompts'])})"
                for m in modes
            )
            + " |"
        )
        L.append("")
    L.append(
        "The prior implementation's table (its 27M model, 60 tokens; bf16 / int8 / int4 on the first four "
        "prompts): "
        + "; ".join(f"{k} {v[0]:.0%} / {v[1]:.0%} / {v[2]:.0%}" for k, v in PRIOR_GREEDY.items())
        + ". A greedy prefix match flips on the first near-tie of two logits and then counts nothing after "
        "it, so it is a coarse proxy; section 3 measures the same caches by perplexity."
    )
    return "\n".join(L)


def limits(res) -> list[str]:
    cfg = res["config"]
    out = []
    for name in MODEL_NAMES:
        s1 = res.get(name, {}).get("s1")
        if s1:
            out.append(
                f"{name}: the recomputation oracle was evaluated at {len(s1['recompute']['positions'])} "
                f"positions (one in {s1['recompute']['stride']}, from {s1['cache']} on), not at every token: "
                "it re-encodes a whole window per token. Comparisons with it are paired on those positions."
            )
    out.append(
        f"SmolLM2-135M: sections 1 and 2 over {cfg['sm_tokens']} / {cfg['sm_sink_tokens']} tokens (not 8192), "
        f"section 3 over {cfg['sm_kivi_tokens']} tokens, to keep the whole run within 30 minutes on 2 cores."
    )
    out.append(
        "The KIVI axis ablation is fake quantisation in the library's forward (method in section 3), not "
        "the cache: jaxkv's cache implements only KIVI's layout."
    )
    out.append(
        "KIVI in a bounded (StreamingLLM + KIVI) cache is not measured here; section 3 isolates the "
        "quantisation by using full caches."
    )
    out.append(
        "'The full cache degrades past 512' concerns stories260K (trained context 512); SmolLM2's trained "
        "context is 8192, beyond every text here."
    )
    return out
