"""scripts/quantization.py and its core, jaxkv.eval.report.quantization (docs/QUANTIZATION.md,
issue 15): the table carries the values jaxkv.eval computes, the budget verdicts pick right,
the flags column builds the config it names."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from paths import REPO

from jaxkv.cache.memory import memory_report
from jaxkv.cache.spec import CacheSpec, LayerSpecs
from jaxkv.cli import build_parser
from jaxkv.cli.flags import cache_spec_from_args
from jaxkv.decode import new_cache
from jaxkv.errors import JaxkvError
from jaxkv.eval import bench, greedy_match, perplexity, token_nll
from jaxkv.eval.report import quantization as q
from jaxkv.testing import tiny_loaded

pytestmark = pytest.mark.jax_independent  # a script's tables (jaxkv.eval: tested on the floor)


def load_script():
    spec = importlib.util.spec_from_file_location("quantization_script", REPO / "scripts" / "quantization.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = load_script()
TINY_SIZES = dict(
    q.QUICK,
    tokens=48,
    greedy_new=6,
    decode_sink=2,
    decode_window=16,
    decode_prompt=8,
    decode_new=8,
    decode_block=4,
    prefill_sink=2,
    prefill_window=16,
    prefill_chunk=8,
)
TINY_CONFIGS = (
    q.QuantConfig("fp16", "baseline", dict(kv_quantize="fp16")),
    q.QuantConfig("int4-r8", "KIVI", dict(kv_quantize="int4", group_size=8, residual=8), recommended=True),
)


def test_table_values_are_what_jaxkv_eval_computes():
    model = tiny_loaded()
    ids = np.random.default_rng(0).integers(4, 64, TINY_SIZES["tokens"]).tolist()
    prompts = ["once upon a time there was a cat.", "the dog ran to the park and"]
    configs = TINY_CONFIGS[1:]  # int4 only: each config costs compiles
    flags = {c.name: SCRIPT.flags_text(c, len(ids)) for c in configs}
    res = q.measure(
        {"tiny": model},
        {"tiny": ids},
        configs,
        sizes=TINY_SIZES,
        prompts=prompts,
        flags=flags,
        main="tiny",
        prefill_model="tiny",
        sections=("ppl", "greedy"),
    )  # decode, prefill: below

    row = res["ppl"]["tiny"]["configs"]["int4-r8"]
    spec = CacheSpec(max_len=len(ids), kv_quantize="int4", group_size=8, residual=8)
    fp32 = perplexity(token_nll(model, ids))
    expected = perplexity(token_nll(model, ids, cache=spec)) / fp32 - 1
    assert abs(expected) > 1e-4  # the int4 codes are read: the figure is not a trivial 0
    np.testing.assert_allclose(row["delta"], expected, rtol=1e-9)
    report = memory_report(new_cache(model.config, spec, 1))  # counted from the allocated leaves
    assert (row["store_bits"], row["bits"]) == pytest.approx((report.store_bits, report.bits_per_element))

    direct = greedy_match(model, prompts, modes=("int4",), new_tokens=6, group_size=8, residual=8)["modes"]["int4"]
    assert res["greedy"]["configs"]["int4-r8"]["per_prompt"] == direct["per_prompt"]
    assert set(res["greedy"]["configs"]) == {"int4-r8"}  # recommended configs only

    header, rows = q.table_rows(res)
    cells = dict(zip(header, next(r for r in rows if r[0].startswith("int4-r8"))))
    assert cells["ΔPPL tiny"] == q.pct(expected)
    assert cells["tiny bits store / whole"] == f"{report.store_bits:.2f} / {report.bits_per_element:.2f}"
    assert cells["`jaxkv ppl` flags"] == "`--kv-quantize int4 --kv-group-size 8 --kv-residual 8`"
    assert cells["greedy match (tiny)"] == f"{100 * direct['mean']:.0f} % ({direct['exact']}/2)"
    text = q.render(res, None)
    assert "| " + " | ".join(next(r for r in rows if r[0].startswith("int4-r8"))) + " |" in text


def test_decode_and_prefill_columns_against_the_baseline():
    model = tiny_loaded()
    res = q.measure(
        {"tiny": model},
        {"tiny": []},
        TINY_CONFIGS,
        sizes=TINY_SIZES,
        prompts=[],
        main="tiny",
        prefill_model="tiny",
        flags={c.name: "" for c in TINY_CONFIGS},
        sections=("decode", "prefill"),
    )
    d = res["decode"]["configs"]
    assert d["fp16"]["ratio"] == 1.0 and d["int4-r8"]["ratio"] == d["int4-r8"]["ms"] / d["fp16"]["ms"]
    assert len(d["int4-r8"]["repeats"]) == TINY_SIZES["decode_repeat"] and d["int4-r8"]["ms"] > 0
    header, rows = q.table_rows(res)
    assert (
        rows[1][header.index("decode ms/token (tiny; x fp16)")]
        == f"{d['int4-r8']['ms']:.2f} ({d['int4-r8']['ratio']:.2f}x)"
    )
    p = res["prefill"]["configs"]
    spec = TINY_CONFIGS[1].spec(sink=2, window=16)
    assert p["int4-r8"] == dict(zip(("temp_bytes", "chunk"), bench.prefill_temp_bytes(model, spec, chunk=8)))
    assert p["int4-r8"]["chunk"] == 8 and p["fp16"]["chunk"] == 8 and p["fp16"]["temp_bytes"] > 0
    assert rows[1][header.index("prefill temp MiB (tiny)")] == f"{p['int4-r8']['temp_bytes'] / 2**20:.1f}"


def rows_of(**rows):
    return {k: dict(delta=d, bits=b, store_bits=s) for k, (d, b, s) in rows.items()}


def test_verdicts_pick_the_lowest_delta_within_each_budget():
    rows = rows_of(
        a=(0.005, 4.8, 4.1),
        e=(0.008, 4.9, 3.2),
        b=(0.02, 3.9, 3.5),
        c=(0.5, 2.9, 2.5),
        f=(0.02, 3.6, 3.1),
        fp16=(-0.001, 16.0, None),
    )
    whole = q.verdicts(rows)
    assert [(v["budget"], v["best"], v["met"], v["within"]) for v in whole] == [
        (5.0, "a", True, 5),
        (4.0, "f", True, 3),
        (3.0, "c", False, 1),
    ]  # b and f tie on ΔPPL: fewer bits wins
    assert whole[2]["delta"] == 0.5 and whole[2]["bits"] == 2.9
    store = q.verdicts(rows, bits=q.store_or_whole)
    assert [(v["best"], v["met"]) for v in store] == [("a", True), ("e", True), ("c", False)]
    none = q.verdicts(rows_of(x=(0.001, 6.0, 5.5), y=(0.2, 5.2, 4.4)))
    assert [(v["best"], v["met"], v["fewest"]) for v in none] == [(None, False, "y")] * 3
    assert "**missed**: no measured config within 3 bits (fewest: `y`, 5.20 bits, ΔPPL +20.00 %)" in q.verdict_text(
        none[2], rows_of(x=(0.001, 6.0, 5.5), y=(0.2, 5.2, 4.4)), lambda r: r["bits"]
    )
    assert q.verdict_text(whole[0], rows, lambda r: r["bits"]).endswith(
        "**met** by `a`, ΔPPL +0.50 % at 4.80 bits (5 configs within the budget)"
    )


def test_flags_build_the_config_they_name():
    for c in SCRIPT.CONFIGS:
        if c.missing():
            continue
        text = SCRIPT.flags_text(c, 256)
        args = build_parser().parse_args(["ppl", "--text", "x.txt", *text.split()])
        assert cache_spec_from_args(args, 256) == c.spec(max_len=256), c.name


def test_selection_and_refusals(monkeypatch):
    bogus = q.QuantConfig("int2-new", "lever", dict(kv_quantize="int2", no_such_field=True))
    boost = q.QuantConfig("int2-boost", "lever", dict(kv_quantize="int2"), boost=(0, 1))
    monkeypatch.setattr(SCRIPT, "CONFIGS", (TINY_CONFIGS[0], TINY_CONFIGS[1], bogus, boost))
    assert bogus.missing() == ["no_such_field"] and boost.missing() == []
    assert boost.cache(3, max_len=8) == LayerSpecs.boosted(CacheSpec(max_len=8, kv_quantize="int2"), 3, (0, 1), "int8")
    chosen, skipped = SCRIPT.select(None, quick=True)
    assert [c.name for c in chosen] == ["fp16", "int4-r8", "int2-boost"] and skipped == {"int2-new": ["no_such_field"]}
    assert [c.name for c in SCRIPT.select("int4-r8", quick=False)[0]] == ["fp16", "int4-r8"]  # the baseline comes along
    with pytest.raises(SystemExit, match="int2-new \\(needs no_such_field\\)"):
        SCRIPT.select(None, quick=False)
    with pytest.raises(SystemExit, match="unknown config\\(s\\) int9"):
        SCRIPT.select("int9", quick=True)
    with pytest.raises(JaxkvError, match="CacheSpec has no field no_such_field"):
        bogus.spec(max_len=8)
    with pytest.raises(JaxkvError, match="needs no_such_field"):
        q.measure({}, {}, [bogus], sizes=TINY_SIZES, prompts=[], flags={}, main="", prefill_model="")
    with pytest.raises(JaxkvError, match="storage sets window"):
        q.QuantConfig("x", "lever", dict(kv_quantize="int2", window=64))
    with pytest.raises(JaxkvError, match="kind='other'"):
        q.QuantConfig("x", "other", {})


def test_text_prompts_are_whole_paragraphs(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("skip me\n\nOne two.\n\nThree four five.\n\nSix.\n\nSeven eight nine ten.\n", encoding="utf-8")
    assert q.text_prompts(path, count=2, chars=12, skip_chars=3) == [
        "One two.\n\nThree four five.",
        "Six.\n\nSeven eight nine ten.",
    ]
    with pytest.raises(JaxkvError, match="only 2 prompts of 12 characters"):
        q.text_prompts(path, count=3, chars=12, skip_chars=3)


def test_render_and_plot_from_results_alone(tmp_path):
    pytest.importorskip("matplotlib")
    from jaxkv.eval.report.measure import machine

    rows = rows_of(fp16=(0.0, 16.0, None), **{"int2-r32": (0.3, 3.9, 3.5), "k4v2": (-0.002, 4.6, 4.0)})
    res = dict(
        quick=True,
        sizes=dict(q.QUICK),
        date="today",
        machine=dict(machine(), load_avg_end=[0, 0, 0]),
        timings={},
        skipped={"int2-had-v": ["hadamard"]},
        configs={k: dict(kind="KIVI", storage={}, recommended=False, flags=f"--x {k}") for k in rows},
        models={"m": dict(n_layers=2, n_kv_heads=2, head_dim=8, trained_context=512)},
        ppl={"m": dict(tokens=256, scored=255, fp32_ppl=4.0, configs=rows)},
    )
    name = q.plot(res, tmp_path / "quantization.png")
    assert (tmp_path / name).stat().st_size > 10_000
    text = q.render(res, name)
    assert "![ΔPPL versus effective bits](results/quantization.png)" in text
    assert (
        "- <= 5 bits/element, goal ΔPPL <= 1 %: **met** by `k4v2`, ΔPPL -0.20 % at 4.60 bits (2 configs within the budget)"
        in text
    )
    assert "| int2-r32 | `--x int2-r32` | 3.50 / 3.90 | +30.00 % |" in text
    assert "`int2-had-v` (hadamard)" in text
