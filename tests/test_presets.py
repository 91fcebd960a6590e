"""Named low-bit KV cache presets (issue 35): ``configs/kv-presets``, :func:`jaxkv.cache_preset` and
``--kv-preset``. Every preset fits its bit budget in both cache shapes of the issue on SmolLM2's
shape (counted from the cache's leaves), the flag builds the same spec as the storage flags it
stands for, and (slow) the 4- and 3-bit presets keep the golden Paris answer."""

from __future__ import annotations

import importlib.util
import json

import pytest

from paths import REPO

import jaxkv
from jaxkv import CacheSpec, JaxkvError, LlamaConfig
from jaxkv.cache.preset import PRESET_DIR, STORAGE_FIELDS, preset_names, preset_storage
from jaxkv.cli import build_parser, cache_spec_from_args
from jaxkv.cli.flags import CACHE_FLAGS
from jaxkv.decode.loop import new_cache_bits

BUDGETS = {"4bit": 4.0, "3bit": 3.0}
"""The issue's budgets in effective bits per K/V element."""


def test_the_presets_are_data_with_a_description():
    assert preset_names() == ["3bit", "4bit"]
    for name in preset_names():
        data = json.loads((PRESET_DIR / f"{name}.json").read_text())
        assert set(data) == {"about", "storage", "full_cache_sinks"} and data["about"]
        assert set(data["storage"]) <= set(STORAGE_FIELDS)


@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_each_preset_fits_its_budget_in_both_shapes_of_smollm2(name):
    """Full cache of 2048 tokens (4 full-precision sinks) and sink 4 + window 1020 (rounded down to
    whole groups, as the CLI does): bits of codes, scales, zeros, residual and sinks <= the budget."""
    config = LlamaConfig.from_preset("smollm2-135m")
    group = preset_storage(name).get("group_size", CacheSpec.group_size)
    for spec in (
        jaxkv.cache_preset(name, max_len=2048, sink=4),
        jaxkv.cache_preset(name, sink=4, window=1020 - 1020 % group),
    ):
        store, bits = new_cache_bits(config, spec)
        assert bits <= BUDGETS[name], (spec.describe(), bits)
        assert store < bits  # the residual and sinks cost bits too


def test_cache_preset_takes_a_shape_and_overrides():
    spec = jaxkv.cache_preset("4bit", max_len=512)
    assert spec == CacheSpec(max_len=512, sink=4, **preset_storage("4bit"))  # a full cache's sinks in full precision
    assert jaxkv.cache_preset("4bit", max_len=512, sink=0).sink == 0
    assert jaxkv.cache_preset("4bit", window=992).sink == 0  # StreamingLLM's sinks are the caller's
    assert jaxkv.cache_preset("4bit", max_len=512, residual=64).residual == 64
    with pytest.raises(JaxkvError, match=r"cache_preset\('4bit'\) needs the cache's shape: max_len=N .* window=W"):
        jaxkv.cache_preset("4bit")
    with pytest.raises(JaxkvError, match=r"no KV cache preset '5bit': expected one of 3bit, 4bit"):
        jaxkv.cache_preset("5bit", max_len=512)


def _flags(words):
    args = build_parser().parse_args(["sample", *words])
    return args, cache_spec_from_args(args, 10, 20)


@pytest.mark.parametrize("name", ["4bit", "3bit"])
def test_flag_builds_the_spec_of_the_storage_flags_it_stands_for(name):
    """``--kv-preset NAME`` and the preset's storage written as flags make one spec."""
    storage = preset_storage(name)
    words = []
    for field, value in storage.items():
        words += [CACHE_FLAGS[field]] if value is True else [CACHE_FLAGS[field], str(value)]
    shape = ["--streaming-llm-sink", "4", "--streaming-llm-window", "512"]
    assert _flags(["--kv-preset", name, *shape])[1] == _flags([*words, *shape])[1]
    assert _flags(["--kv-preset", name, *shape])[1] == jaxkv.cache_preset(name, sink=4, window=512)
    full = _flags(["--kv-preset", name, "--max-len", "256"])[1]
    assert full == jaxkv.cache_preset(name, max_len=256) and full.sink == 4


def test_flag_beside_storage_flags_is_refused_by_name():
    with pytest.raises(
        JaxkvError, match=r"--kv-preset 3bit sets the cache's storage: leave out --kv-clip, --kv-quantize"
    ):
        _flags(["--kv-preset", "3bit", "--kv-quantize", "int4", "--kv-clip"])
    with pytest.raises(JaxkvError, match=r"no KV cache preset 'int4': expected one of 3bit, 4bit"):
        _flags(["--kv-preset", "int4"])


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_preset_keeps_the_golden_paris_answer(smollm2, golden, name):
    """Greedy ChatML answer of SmolLM2 through a full cache of each preset (4 full-precision sinks):
    the golden "The capital of France is Paris." (the fp32 cache's)."""
    g = golden["smollm2_chatml_paris"]
    out = jaxkv.sample(
        smollm2, g["prompt_token_ids"], cache=jaxkv.cache_preset(name, max_len=256, sink=4), max_new_tokens=12
    )
    assert out.text.startswith(g["expected_text_prefix"])


def _script():
    spec = importlib.util.spec_from_file_location("kv_presets_script", REPO / "scripts" / "kv_presets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_presets_doc_is_the_render_of_the_measured_results():
    """docs/PRESETS.md is scripts/kv_presets.py's rendering of docs/results/kv_presets.json (no number
    typed by hand), and its verdicts follow from those numbers: the budgets' bits hold in both shapes."""
    script = _script()
    res = json.loads((REPO / "docs" / "results" / "kv_presets.json").read_text())
    assert (REPO / "docs" / "PRESETS.md").read_text() == script.document(res, "results/kv_presets.png")
    assert set(res["presets"]) == set(preset_names())
    for line in script.verdicts(res):
        assert line.endswith(("**met**", "**missed**", "**kept**", "**lost**"))
    for name, (bits, _) in script.GOALS.items():
        for shape in ("full", "window"):
            assert res["presets"][name][shape]["python-docs"]["bits"] <= bits
