"""docs/QUANTIZATION.md (issue 15): low-bit KV caches past KIVI's floor, every quality figure
beside the bits it costs.

For each :class:`QuantConfig` (a cache *storage*: the :class:`~jaxkv.cache.spec.CacheSpec`
fields beyond the cache's shape) :func:`measure` takes, through jaxkv's public evaluation
functions:

* **ΔPPL** = perplexity through a full cache of that storage / perplexity through the fp32
  full cache - 1, teacher-forced over the same N-token stream (:func:`jaxkv.eval.token_nll`),
  on every model given;
* **effective bits per K/V element** of that same cache, counted from its leaves
  (:func:`jaxkv.cache.memory.element_bits`): the quantised store alone (codes + scales +
  zeros), and the whole cache (residual and sinks included);
* **greedy match** with the fp32 cache for the *recommended* configs
  (:func:`jaxkv.eval.greedy_match`, long prompts from the text so the residual is flushed);
* **decode ms/token** in a StreamingLLM cache of one sink + window shape for every config
  (:func:`jaxkv.eval.bench.run`, round-robin repeats), and its ratio to fp16's;
* **prefill temporaries**: the compiled prefill call's ``temp_size_in_bytes``
  (:func:`jaxkv.eval.bench.prefill_temp_bytes`).

:func:`verdicts` picks, per bit budget of the issue (<= 5 bits: ΔPPL <= 1 %; <= 4: 3 %;
<= 3: 10 %), the measured config of lowest ΔPPL within the budget and says whether it meets
the goal; :func:`render` and :func:`plot` are pure functions of the results dict
(``scripts/quantization.py --render-only`` re-renders from the saved JSON).

Sources: KIVI (Liu et al. 2024, arXiv 2402.02750, §3-4: per-channel keys, per-token values,
group size G, residual R); KVQuant (Hooper et al. 2024, arXiv 2401.18079, §3.1: pre-RoPE
keys); QuaRot / RotateKV (Hadamard rotation before quantising); StreamingLLM (Xiao et al.
2023, arXiv 2309.17453, §3.2: sinks and the cache position mode).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence

from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.decode.loop import new_cache_bits
from jaxkv.errors import JaxkvError
from jaxkv.eval import bench, tables
from jaxkv.eval.perplexity import perplexity, token_nll
from jaxkv.eval.report.measure import Timer, log, machine
from jaxkv.eval.report.render import machine_text
from jaxkv.io import LoadedModel

PRESETS_NOTE = (
    "**Presets** (issue 35): `--kv-preset 4bit|3bit` (`jaxkv.cache_preset`) carry the best storage measured "
    "since, with levers this table predates (full-precision sinks in a full cache, a clipping search, 8-bit "
    "scales, a normal codebook): `docs/PRESETS.md` has every lever alone and combined, bits against perplexity "
    "on held-out prose, and the goals met or missed."
)
"""The pointer to docs/PRESETS.md (scripts/kv_presets.py) near the top of the document."""

BUDGETS = ((5.0, 0.01), (4.0, 0.03), (3.0, 0.10))
"""The issue's goals: ``(bits per K/V element <=, ΔPPL <=)``."""

SHAPE_FIELDS = ("max_len", "sink", "window")
"""CacheSpec fields each measurement sets itself (a config gives the storage only)."""

BASELINE = "fp16"
"""The config decode ms/token and prefill temporaries are compared with."""

KINDS = ("baseline", "KIVI", "lever", "combination")
"""Config kinds, in the document's order."""

FULL = dict(
    tokens=2048,
    greedy_new=100,
    greedy_prompts=8,
    greedy_chars=1000,
    greedy_skip_chars=40000,
    decode_sink=4,
    decode_window=512,
    decode_prompt=512,
    decode_new=128,
    decode_block=32,
    decode_repeat=3,
    prefill_sink=4,
    prefill_window=4096,
    prefill_chunk=128,
)
"""Sizes of the full run: ``tokens`` scored per model (one stream from the text's start); greedy:
``greedy_prompts`` prompts of >= ``greedy_chars`` characters (whole paragraphs of the text from
character ``greedy_skip_chars`` on), ``greedy_new`` tokens each; decode: a cache of
``decode_sink`` + ``decode_window`` after a random ``decode_prompt``-token prompt,
``decode_new`` tokens in blocks of ``decode_block``, ``decode_repeat`` rounds; prefill: a
``prefill_sink`` + ``prefill_window`` cache, calls of ``prefill_chunk`` tokens."""

QUICK = dict(
    FULL,
    tokens=256,
    greedy_new=16,
    greedy_chars=300,
    decode_window=128,
    decode_prompt=64,
    decode_new=64,
    decode_block=16,
    decode_repeat=1,
)
"""Sizes of a smoke run (``--quick``): not the results."""


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """One row of docs/QUANTIZATION.md: a cache storage, measured in each cache shape the document uses.

    Attributes:
      name: short unique label (``--only`` selects by it).
      kind: one of :data:`KINDS` (baseline, literal KIVI, one lever alone, a combination).
      storage: :class:`CacheSpec` fields other than the shape (:data:`SHAPE_FIELDS`), e.g.
        ``{"kv_quantize": "int2", "group_size": 32, "residual": 32}``; a field this jaxkv's
        CacheSpec lacks makes the config unavailable (:meth:`missing`).
      recommended: also measure its greedy match (a candidate for a budget).
      boost: per-layer precision (:func:`boosted`): the layers whose keys and values are stored
        as ``boost_quantize``; None = every layer alike.
      boost_quantize: the boosted layers' mode.
    """

    name: str
    kind: str
    storage: dict
    recommended: bool = False
    boost: tuple | None = None
    boost_quantize: str = "int8"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise JaxkvError(f"QuantConfig {self.name!r}: kind={self.kind!r}: expected one of {', '.join(KINDS)}")
        shape = sorted(set(self.storage) & set(SHAPE_FIELDS))
        if shape:
            raise JaxkvError(
                f"QuantConfig {self.name!r}: storage sets {', '.join(shape)}: the shape is each "
                "measurement's own; give only storage fields"
            )

    def missing(self) -> list[str]:
        """What this jaxkv lacks to build the config: CacheSpec fields not defined; [] when available."""
        fields = {f.name for f in dataclasses.fields(CacheSpec)}
        return sorted(set(self.storage) - fields)

    def spec(self, **shape) -> CacheSpec:
        """The single-layer :class:`CacheSpec` of this storage in ``shape`` (``max_len=N`` or
        ``sink=S, window=W``).

        Raises:
          JaxkvError: the config is unavailable (:meth:`missing`), or CacheSpec refuses it.
        """
        missing = sorted(set(self.storage) - {f.name for f in dataclasses.fields(CacheSpec)})
        if missing:
            raise JaxkvError(f"config {self.name!r}: CacheSpec has no field {', '.join(missing)} in this jaxkv")
        return CacheSpec(**shape, **self.storage)

    def fits(self, n_layers: int) -> bool:
        """False when :attr:`boost` names a layer the model does not have (that model's cells: –)."""
        return self.boost is None or max(self.boost) < n_layers

    def cache(self, n_layers: int, **shape) -> CacheSpec | LayerSpecs:
        """The cache to measure: :meth:`spec`, per layer when :attr:`boost` is set (:func:`boosted`)."""
        return boosted(self, self.spec(**shape), n_layers)


def boosted(config: QuantConfig, spec: CacheSpec, n_layers: int) -> CacheSpec | LayerSpecs:
    """``spec`` with ``config.boost``'s layers stored as ``config.boost_quantize`` (keys and values,
    :meth:`LayerSpecs.boosted`); ``spec`` itself when ``config.boost`` is None.

    Raises:
      JaxkvError: a layer index outside the model's ``n_layers`` or a mode that raises nothing.
    """
    return spec if config.boost is None else LayerSpecs.boosted(spec, n_layers, config.boost, config.boost_quantize)


def text_prompts(path: pathlib.Path, *, count: int, chars: int, skip_chars: int) -> list[str]:
    """``count`` prompts of whole paragraphs (blank-line separated) of the text file ``path``:
    from the first paragraph starting at or after character ``skip_chars``, each prompt the
    next paragraphs joined until it has at least ``chars`` characters.

    Raises:
      JaxkvError: the text runs out first.
    """
    body = path.read_text(encoding="utf-8")
    start = body.find("\n\n", skip_chars)
    paragraphs = [p.strip() for p in body[start:].split("\n\n") if p.strip()] if start >= 0 else []
    prompts, current = [], []
    for p in paragraphs:
        current.append(p)
        if len("\n\n".join(current)) >= chars:
            prompts.append("\n\n".join(current))
            current = []
            if len(prompts) == count:
                return prompts
    raise JaxkvError(
        f"{path}: only {len(prompts)} prompts of {chars} characters after character {skip_chars}, {count} needed"
    )


# ------------------------------------------------------------------------------ measurements


def ppl_rows(model: LoadedModel, ids: Sequence[int], configs: Sequence[QuantConfig]) -> dict:
    """ΔPPL and effective bits of each config on one model, full caches of ``len(ids)`` slots.

    Returns:
      ``{"tokens": N, "scored": N - 1, "fp32_ppl": float, "configs": {name: {"ppl", "delta"
      (ppl / fp32_ppl - 1), "store_bits" (None without a quantised store), "bits" (whole
      cache), "cache" (described)}}}``.
    """
    n = len(ids)
    base = perplexity(token_nll(model, ids, cache=CacheSpec(max_len=n)))
    out = dict(tokens=n, scored=n - 1, fp32_ppl=base, configs={})
    for c in (c for c in configs if c.fits(model.config.n_layers)):
        spec = c.cache(model.config.n_layers, max_len=n)
        log(f"{model.config.name}: ppl, {c.name}: {spec.describe()}, {n} tokens")
        ppl = perplexity(token_nll(model, ids, cache=spec))
        store, bits = new_cache_bits(model.config, spec)
        out["configs"][c.name] = dict(ppl=ppl, delta=ppl / base - 1, store_bits=store, bits=bits, cache=spec.describe())
        log(f"  ppl {ppl:.4f} ({100 * (ppl / base - 1):+.2f} %), {bits:.2f} bits/element")
    return out


def greedy_rows(model: LoadedModel, prompts: Sequence[str], configs: Sequence[QuantConfig], *, new_tokens: int) -> dict:
    """Greedy prefix match with the fp32 full cache (:func:`jaxkv.eval.greedy_match`), one full
    cache of each config (sized for the longest prompt + ``new_tokens``).

    Returns:
      ``{"prompt_lengths": [tokens], "new_tokens": int, "configs": {name: {"per_prompt", "mean", "exact"}}}``.
    """

    def spec_of(c, max_len):
        return c.cache(model.config.n_layers, max_len=max_len)

    modes = {c.name: functools.partial(spec_of, c) for c in configs}
    g = tables.greedy_match(model, list(prompts), modes=modes, new_tokens=new_tokens)
    return dict(
        prompt_lengths=g["prompt_lengths"],
        new_tokens=new_tokens,
        configs={k: dict(per_prompt=v["per_prompt"], mean=v["mean"], exact=v["exact"]) for k, v in g["modes"].items()},
    )


def decode_rows(model: LoadedModel, configs: Sequence[QuantConfig], sizes: dict) -> dict:
    """Decode ms/token of each config in one StreamingLLM cache shape (:func:`jaxkv.eval.bench.run`,
    the configs round-robin ``decode_repeat`` times; median over the repeats).

    Returns:
      ``{"configs": {name: {"ms", "repeats" (each repeat's ms/token), "ratio" (ms / the
      baseline's ms, when the baseline is among ``configs``), "peak_rss_mib"}}, "bandwidth_gbs": float}``.
    """
    shape = dict(sink=sizes["decode_sink"], window=sizes["decode_window"])
    specs = {c.name: c.cache(model.config.n_layers, **shape) for c in configs}
    res = bench.run(
        model,
        specs,
        [sizes["decode_new"]],
        prompt_tokens=sizes["decode_prompt"],
        block=sizes["decode_block"],
        repeat=sizes["decode_repeat"],
        log=log,
    )
    rows = {
        r["mode"]: dict(
            ms=r["rows"][0]["decode_ms_per_token"],
            repeats=r["rows"][0]["decode_ms_per_token_repeats"],
            peak_rss_mib=r["peak_rss_mib"],
        )
        for r in res["runs"]
    }
    for r in rows.values():
        if BASELINE in rows:
            r["ratio"] = r["ms"] / rows[BASELINE]["ms"]
    return dict(configs=rows, bandwidth_gbs=res["bandwidth_gbs"])


def prefill_rows(model: LoadedModel, configs: Sequence[QuantConfig], sizes: dict) -> dict:
    """Temporary bytes of the compiled prefill call (:func:`jaxkv.eval.bench.prefill_temp_bytes`)
    into a ``prefill_sink`` + ``prefill_window`` cache of each config.

    Returns:
      ``{"configs": {name: {"temp_bytes", "chunk" (tokens of the compiled call)}}}``.
    """
    shape = dict(sink=sizes["prefill_sink"], window=sizes["prefill_window"])
    rows = {}
    for c in (c for c in configs if c.fits(model.config.n_layers)):
        temp, t = bench.prefill_temp_bytes(model, c.cache(model.config.n_layers, **shape), chunk=sizes["prefill_chunk"])
        rows[c.name] = dict(temp_bytes=temp, chunk=t)
        log(f"{model.config.name}: prefill temporaries, {c.name}: {temp / 2**20:.1f} MiB (T={t})")
    return dict(configs=rows)


def measure(
    models: Mapping[str, LoadedModel],
    ids: Mapping[str, Sequence[int]],
    configs: Sequence[QuantConfig],
    *,
    sizes: dict,
    prompts: Sequence[str],
    flags: Mapping[str, str],
    main: str,
    prefill_model: str,
    quick: bool = False,
    skipped: Mapping[str, list] | None = None,
    sections: Sequence[str] = ("ppl", "greedy", "decode", "prefill"),
) -> dict:
    """Every number of docs/QUANTIZATION.md, as one JSON-ready dict.

    Args:
      models: ``{name: LoadedModel}``; ids: ``{name: token ids}`` scored by each (one stream).
      configs: the configs to measure (available ones: :meth:`QuantConfig.missing` empty).
      sizes: :data:`FULL`, :data:`QUICK` or alike. prompts: the greedy-match prompts (texts).
      flags: ``{name: the config's CLI flags, as text}`` (the caller's: the CLI is above eval).
      main: the model of the greedy match and the decode timing; prefill_model: that of the
        prefill temporaries.
      quick: a smoke run (said in the document). skipped: ``{name: missing}`` of configs left out.
      sections: which of ppl, greedy, decode, prefill to measure (greedy only with a recommended
        config; decode for the baselines, literal KIVI and the recommended configs).
    Returns:
      ``{"quick", "sizes", "date", "machine", "configs": {name: {"kind", "storage", "recommended",
      "flags"}}, "skipped", "models": {name: {"n_layers", "n_kv_heads", "head_dim",
      "trained_context"}}, "ppl": {model: ppl_rows}, "greedy": {"model", "prompts", **greedy_rows},
      "decode": {"model", "sink", "window", **decode_rows}, "prefill": {"model", "sink", "window",
      **prefill_rows}, "timings"}``.
    Raises:
      JaxkvError: an unknown section, or an unavailable config.
    """
    unknown = set(sections) - {"ppl", "greedy", "decode", "prefill"}
    if unknown:
        raise JaxkvError(f"sections {sorted(unknown)}: expected any of ppl, greedy, decode, prefill")
    for c in configs:
        if c.missing():
            raise JaxkvError(f"config {c.name!r} needs {', '.join(c.missing())}, which this jaxkv lacks")
    timings: dict = {}
    t0, c0 = time.perf_counter(), time.process_time()
    res = dict(
        quick=quick,
        sizes=dict(sizes),
        date=time.strftime("%Y-%m-%d %H:%M %Z"),
        machine=machine(),
        configs={
            c.name: dict(kind=c.kind, storage=dict(c.storage), recommended=c.recommended, flags=flags[c.name])
            for c in configs
        },
        skipped=dict(skipped or {}),
        models={
            name: dict(
                n_layers=m.config.n_layers,
                n_kv_heads=m.config.n_kv_heads,
                head_dim=m.config.head_dim,
                trained_context=m.config.max_seq_len,
            )
            for name, m in models.items()
        },
    )
    if "ppl" in sections:
        res["ppl"] = {}
        for name, model in models.items():
            with Timer(timings, f"{name} ppl"):
                res["ppl"][name] = ppl_rows(model, ids[name], configs)
    chosen = [c for c in configs if c.recommended]
    if "greedy" in sections and chosen:
        with Timer(timings, f"{main} greedy"):
            res["greedy"] = dict(
                model=main,
                prompts=list(prompts),
                **greedy_rows(models[main], prompts, chosen, new_tokens=sizes["greedy_new"]),
            )
    if "decode" in sections:
        with Timer(timings, f"{main} decode"):
            timed = [c for c in configs if c.recommended or c.kind in ("baseline", "KIVI")]
            res["decode"] = dict(
                model=main,
                sink=sizes["decode_sink"],
                window=sizes["decode_window"],
                **decode_rows(models[main], timed, sizes),
            )
    if "prefill" in sections:
        with Timer(timings, f"{prefill_model} prefill"):
            res["prefill"] = dict(
                model=prefill_model,
                sink=sizes["prefill_sink"],
                window=sizes["prefill_window"],
                **prefill_rows(models[prefill_model], configs, sizes),
            )
    timings["total"] = dict(wall_s=round(time.perf_counter() - t0, 1), cpu_s=round(time.process_time() - c0, 1))
    res["timings"] = timings
    res["machine"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    return res


# ------------------------------------------------------------------------------ verdicts


def store_or_whole(row: dict) -> float:
    """A row's bits of the quantised store, or of the whole cache when it has no store (float caches)."""
    return row["bits"] if row["store_bits"] is None else row["store_bits"]


def verdicts(
    rows: Mapping[str, dict], *, bits: Callable[[dict], float] = lambda r: r["bits"], budgets=BUDGETS
) -> list[dict]:
    """Per budget, the best measured config within it and whether it meets the goal.

    Args:
      rows: ``{name: {"delta": ΔPPL (fraction), "bits": ..., "store_bits": ...}}`` (one model's
        :func:`ppl_rows` ``configs``).
      bits: the bits a row is charged (default: the whole cache, residual and sinks included;
        :func:`store_or_whole` for the store alone).
      budgets: ``((bits <=, ΔPPL <=), ...)``.
    Returns:
      per budget ``{"budget", "goal", "best": name or None, "delta", "bits", "met": bool,
      "within": configs inside the budget, "fewest": name of fewest bits overall}``: ``best``
      has the lowest ΔPPL of the configs within the budget (ties: fewer bits, then name), and
      ``met`` says whether that ΔPPL is <= the goal (no config within: None, not met).
    """
    out = []
    fewest = min(rows, key=lambda k: (bits(rows[k]), k), default=None)
    for budget, goal in budgets:
        within = [k for k, r in rows.items() if bits(r) <= budget]
        best = min(within, key=lambda k: (rows[k]["delta"], bits(rows[k]), k), default=None)
        out.append(
            dict(
                budget=budget,
                goal=goal,
                best=best,
                within=len(within),
                fewest=fewest,
                delta=None if best is None else rows[best]["delta"],
                bits=None if best is None else bits(rows[best]),
                met=best is not None and rows[best]["delta"] <= goal,
            )
        )
    return out


def verdict_text(v: dict, rows: Mapping[str, dict], bits: Callable[[dict], float]) -> str:
    """One budget's :func:`verdicts` entry as a markdown line."""
    head = f"<= {v['budget']:g} bits/element, goal ΔPPL <= {100 * v['goal']:g} %: "
    if v["best"] is None:
        f = v["fewest"]
        return head + (
            f"**missed**: no measured config within {v['budget']:g} bits"
            + (f" (fewest: `{f}`, {bits(rows[f]):.2f} bits, ΔPPL {pct(rows[f]['delta'])})" if f else "")
        )
    what = (
        f"`{v['best']}`, ΔPPL {pct(v['delta'])} at {v['bits']:.2f} bits ({v['within']} "
        f"config{'s' if v['within'] > 1 else ''} within the budget)"
    )
    return head + (f"**met** by {what}" if v["met"] else f"**missed**: the best within the budget is {what}")


# ------------------------------------------------------------------------------ document


def pct(x: float) -> str:
    """A fraction as a signed percentage, 2 decimals: ``0.0123 -> '+1.23 %'``."""
    return f"{100 * x:+.2f} %"


def _flushed(tokens: int, residual: int) -> int:
    """Tokens a KIVI cache holds as codes after ``tokens`` appended (lazy flush: whole residuals,
    once the next token arrives), DESIGN §2."""
    return residual * ((tokens - 1) // residual)


def _bits_cell(row: dict) -> str:
    return ("–" if row["store_bits"] is None else f"{row['store_bits']:.2f}") + f" / {row['bits']:.2f}"


def table_rows(res: dict) -> tuple[list[str], list[list[str]]]:
    """The main table: ``(header, rows)``, one row per config, cells as the document prints them."""
    models = list(res.get("ppl", {}))
    header = ["config", "`jaxkv ppl` flags"]
    for m in models:
        header += [f"{m} bits store / whole", f"ΔPPL {m}"]
    greedy, decode, prefill = res.get("greedy"), res.get("decode"), res.get("prefill")
    if greedy:
        header.append(f"greedy match ({greedy['model']})")
    if decode:
        header.append(f"decode ms/token ({decode['model']}; x {BASELINE})")
    if prefill:
        header.append(f"prefill temp MiB ({prefill['model']})")
    rows = []
    for name, c in res["configs"].items():
        cells = [name + (" **(rec.)**" if c["recommended"] else ""), f"`{c['flags']}`" if c["flags"] else "(defaults)"]
        for m in models:
            r = res["ppl"][m]["configs"].get(name)
            cells += ["–", "–"] if r is None else [_bits_cell(r), pct(r["delta"])]
        if greedy:
            g = greedy["configs"].get(name)
            cells.append("–" if g is None else f"{100 * g['mean']:.0f} % ({g['exact']}/{len(g['per_prompt'])})")
        if decode:
            d = decode["configs"].get(name)
            cells.append("–" if d is None else f"{d['ms']:.2f}" + (f" ({d['ratio']:.2f}x)" if "ratio" in d else ""))
        if prefill:
            p = prefill["configs"].get(name)
            chunk = res["sizes"]["prefill_chunk"]
            cells.append(
                "–"
                if p is None
                else f"{p['temp_bytes'] / 2**20:.1f}" + (f" (T={p['chunk']})" if p["chunk"] != chunk else "")
            )
        rows.append(cells)
    return header, rows


def render(res: dict, plot_name: str | None) -> str:
    """The markdown of docs/QUANTIZATION.md from :func:`measure`'s results (sections it lacks are left out).

    Args:
      res: the results (as stored in JSON). plot_name: the plot's file name in ``results/``, or None.
    """
    s = res["sizes"]
    L = []
    add = L.append
    add("# Low-bit KV caches: ΔPPL against the bits they cost")
    add("")
    add(
        f"Generated by `scripts/quantization.py`{' --quick (SMOKE RUN: small sizes, not the results)' if res['quick'] else ''} "
        f"on {res['date']}; every number below was measured in that run, from `../shared/data` only, and every "
        "verdict is computed from those numbers (`verdicts()` in `jaxkv/eval/report/quantization.py`). Rerun it "
        "to regenerate this file, `docs/results/quantization.png` and `docs/results/quantization.json`: "
        "`pip install -e '.[results]' && python scripts/quantization.py`."
    )
    add("")
    add(machine_text(res["machine"], res["timings"].get("total", {})))
    add("")
    add(PRESETS_NOTE)
    add("")
    add("## Goals (issue 15) and what was measured")
    add("")
    add(
        "Budgets in effective bits per cached K/V element, counted from the cache's leaves (codes + scales + zeros "
        "of the quantised store, and the full-precision residual and sinks for the whole cache; positions and "
        "lengths left out): "
        + "; ".join(f"<= {b:g} bits: ΔPPL <= {100 * g:g} %" for b, g in BUDGETS)
        + ". Per budget, the config of lowest ΔPPL among those within it, and whether it meets the goal:"
    )
    add("")
    for model, p in res.get("ppl", {}).items():
        rows = p["configs"]
        for label, bits in (
            ("whole cache (residual and sinks counted)", lambda r: r["bits"]),
            ("quantised store only", store_or_whole),
        ):
            add(f"**{model}**, bits of the {label}:")
            add("")
            for v in verdicts(rows, bits=bits):
                add(f"- {verdict_text(v, rows, bits)}")
            add("")
    decode, prefill = res.get("decode"), res.get("prefill")
    if decode and BASELINE in decode["configs"]:
        slow = [k for k, d in decode["configs"].items() if d["ratio"] > 1 / 0.8]
        add(
            f"Decode speed at or above 0.8x {BASELINE}'s (ms/token at most 1.25x): "
            + (
                "every config."
                if not slow
                else "**missed** by " + ", ".join(f"`{k}` ({decode['configs'][k]['ratio']:.2f}x)" for k in slow) + "."
            )
        )
        add("")
    if prefill and BASELINE in prefill["configs"]:
        ref = prefill["configs"][BASELINE]["temp_bytes"]
        worse = [k for k, p in prefill["configs"].items() if p["temp_bytes"] > ref]
        add(
            f"Prefill temporaries no worse than {BASELINE}'s ({ref / 2**20:.1f} MiB): "
            + (
                "every config."
                if not worse
                else "**missed** by "
                + ", ".join(f"`{k}` ({prefill['configs'][k]['temp_bytes'] / 2**20:.1f} MiB)" for k in worse)
                + "."
            )
        )
        add("")
    if plot_name:
        add(f"![ΔPPL versus effective bits](results/{plot_name})")
        add("")
    add("## The table")
    add("")
    header, rows = table_rows(res)
    add("| " + " | ".join(header) + " |")
    add("|---|---|" + "---:|" * (len(header) - 2))
    for r in rows:
        add("| " + " | ".join(r) + " |")
    add("")
    add("## Method")
    add("")
    for model, p in res.get("ppl", {}).items():
        info = res["models"][model]
        add(
            f"- **ΔPPL, {model}** (L={info['n_layers']}, K={info['n_kv_heads']}, H={info['head_dim']}, trained "
            f"context {info['trained_context']}): the first {p['tokens']} tokens of `text/tinystories_valid_head.txt` "
            f"as one stream ({p['scored']} scored), teacher-forced through a full cache of {p['tokens']} slots of "
            f"each config (`jaxkv.eval.token_nll`); ΔPPL = perplexity / the fp32 full cache's ({p['fp32_ppl']:.4f}) "
            "- 1. The bits are those of that same cache (`jaxkv.cache.memory.element_bits`)."
            + (
                " The text is longer than the model's trained context, so its absolute perplexity is out of "
                "distribution; the ratio still compares storages on the same tokens."
                if p["tokens"] > info["trained_context"]
                else ""
            )
        )
    g = res.get("greedy")
    if g:
        add(
            f"- **Greedy match** ({g['model']}, recommended configs): {len(g['prompts'])} prompts of whole paragraphs "
            f"of the same text from character {s['greedy_skip_chars']} on, at least {s['greedy_chars']} characters "
            f"each ({min(g['prompt_lengths'])}-{max(g['prompt_lengths'])} tokens: with R = 128, the shortest "
            f"prompt's cache holds {_flushed(min(g['prompt_lengths']) + g['new_tokens'], 128)} tokens as codes at "
            f"the end), decoded together, {g['new_tokens']} greedy tokens each, EOS disabled, full caches "
            "(`jaxkv.eval.greedy_match`); score = the fraction of the fp32 cache's tokens reproduced before the "
            "first divergence, mean over the prompts (exactly reproduced prompts in brackets)."
        )
    if decode:
        add(
            f"- **Decode ms/token** ({decode['model']}): `jaxkv.eval.bench.run`, a StreamingLLM cache of sink "
            f"{decode['sink']} + window {decode['window']} in each config (the same window for all; a KIVI cache "
            "also holds its residual), a random "
            f"prompt of {s['decode_prompt']} tokens, {s['decode_new']} greedy tokens in blocks of {s['decode_block']}, "
            f"the configs round-robin {s['decode_repeat']} time(s), median; the ratio is to {BASELINE}'s ms/token "
            "(> 1 = slower)."
        )
    if prefill:
        add(
            f"- **Prefill temporaries** ({prefill['model']}): `temp_size_in_bytes` of the compiled prefill call "
            f"(`jaxkv.eval.bench.prefill_temp_bytes`) into a sink {prefill['sink']} + window {prefill['window']} "
            f"cache, {s['prefill_chunk']} tokens per call (a KIVI residual of fewer tokens caps the call: T = R, "
            "shown). MiB = 2^20 bytes."
        )
    add(
        "- **Flags**: the storage flags of `jaxkv ppl` (and every subcommand with the cache flags) that build "
        "the config; add the cache's shape (`--streaming-llm-sink S --streaming-llm-window W`, or nothing for a "
        "full cache)."
    )
    if res["skipped"]:
        add("")
        add(
            "**Not measured in this run** (this jaxkv lacks what they need): "
            + "; ".join(f"`{k}` ({', '.join(v)})" for k, v in res["skipped"].items())
            + "."
        )
    return "\n".join(L) + "\n"


MARKERS = "osD^vP*Xh<>p"
COLORS = {"baseline": "tab:gray", "KIVI": "tab:blue", "lever": "tab:orange", "combination": "tab:green"}
FLOOR = 1e-2  # % : ΔPPL at or below it is drawn there (log axis)


def plot(res: dict, path: pathlib.Path) -> str:
    """ΔPPL (%, log y) against whole-cache effective bits, one marker per config, one panel per
    model; a thin line from the store's bits to the whole cache's; the goals as steps. PNG, 110 dpi.

    Returns:
      the file name written.
    Raises:
      JaxkvError: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        raise JaxkvError("the plot needs matplotlib: pip install 'jaxkv[results]' (or pass --no-plots)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(res["ppl"])
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 7), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = res["ppl"][model]["configs"]
        for i, (name, r) in enumerate(rows.items()):
            y = max(100 * r["delta"], FLOOR)
            kind = res["configs"][name]["kind"]
            if r["store_bits"] is not None:
                ax.plot([r["store_bits"], r["bits"]], [y, y], color=COLORS[kind], lw=0.6, alpha=0.5)
            ax.plot(
                r["bits"],
                y,
                MARKERS[i % len(MARKERS)],
                color=COLORS[kind],
                ms=7,
                ls="none",
                mfc="none" if r["delta"] < 0 else COLORS[kind],
                label=name,
            )
            ax.annotate(name, (r["bits"], y), fontsize=6, xytext=(4, 2), textcoords="offset points")
        xs, ys, left = [], [], min(2.0, min(r["bits"] for r in rows.values()) - 0.25)
        for b, g in sorted(BUDGETS):  # the goal as steps: <= 10 % up to 3 bits, <= 3 % up to 4, <= 1 % up to 5
            xs, ys, left = xs + [left, b], ys + [100 * g] * 2, b
        ax.plot(xs, ys, color="tab:red", lw=0.9, label="goal (issue 15)")
        ax.set_yscale("log")
        ax.set_xlabel("effective bits per K/V element, whole cache (thin line from the store's bits)")
        ax.set_ylabel(f"ΔPPL vs the fp32 cache, % (<= {FLOOR} % drawn at {FLOOR}; hollow: negative)")
        p = res["ppl"][model]
        ax.set_title(f"{model}: {p['tokens']} tokens, fp32 ppl {p['fp32_ppl']:.3f}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
    handles, labels = axes[0][0].get_legend_handles_labels()  # the same configs, markers and colours in every panel
    handles = [
        matplotlib.lines.Line2D(
            [], [], marker=h.get_marker(), color=h.get_color(), ls=h.get_linestyle(), lw=h.get_linewidth()
        )
        for h in handles
    ]  # filled, whatever the first panel's sign
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.012 * (len(labels) // 5), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name
