"""Every model family against its independent references: Hugging Face ``transformers``
(PyTorch, CPU) for the HF folder, and llama.cpp's own converter for the GGUF path.

Tiny random models of each family are built locally (:mod:`tests.families`): Llama 3.x
(``llama3`` RoPE scaling, text past its original context), Qwen2 (biases), Qwen3 (Q/K
norms), Mistral (sliding window on every layer), Gemma 2 (soft-capping, alternating local
and global layers), Gemma 3 (Q/K norms, 5 local : 1 global, separate local RoPE base, linear
global scaling), Phi-3 (fused projections). Local windows are 16 tokens, the text 64.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import CacheSpec, generate
from jaxkv.cache.layered import LayeredCache
from jaxkv.cache.memory import memory_report
from jaxkv.decode import new_cache
from jaxkv.eval.perplexity import token_nll
from jaxkv.io import load_model
from jaxkv.io.registry import FAMILIES as REGISTERED
from jaxkv.models.llama import Llama
from jaxkv.models.step import forward

pytest.importorskip("torch", reason="the transformers reference needs torch (scripts/test.sh installs it)")
pytest.importorskip("transformers", reason="the reference is Hugging Face transformers (scripts/test.sh installs it)")

from tests import families  # noqa: E402  (imports transformers lazily)

T = 64
IDS = [int(x) for x in np.random.default_rng(0).integers(3, 512, T)]
LOCAL = ("mistral", "gemma2", "gemma3")  # families with sliding-window layers


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    built = {}

    def get(family):
        if family not in built:
            built[family] = families.build(str(root / family), family)
        return built[family]

    return get


def logits(model, ids, spec=None):
    """float32[T, V]: one forward over ``ids`` through a fresh cache (full, unless ``spec``)."""
    graphdef, state = nnx.split(model.model)
    cache = new_cache(model.config, spec or CacheSpec(max_len=len(ids)), 1)
    out, _ = forward(graphdef, state, jnp.asarray([ids], jnp.int32), jnp.asarray([len(ids)], jnp.int32), cache)
    return np.asarray(out[0])


@pytest.mark.parametrize("family", families.FAMILIES)
def test_hf_folder_logits_match_transformers(folders, family):
    folder = folders(family)
    model = load_model(folder)
    assert model.config.family == family.replace("llama3", "llama").replace("mistral", "llama")
    reference = families.hf_logits(folder, IDS)
    assert np.abs(reference).max() > 1.0  # unit-scale logits: an error cannot hide
    np.testing.assert_allclose(logits(model, IDS), reference, atol=1e-4, rtol=0)
    if family in LOCAL:  # the local window matters on this text: ignoring it would show
        config = dataclasses.replace(model.config, sliding_window=10**6)  # local layers as wide as the text
        wrong = dataclasses.replace(
            model, model=Llama.from_weights(config, dict(nnx.to_pure_dict(nnx.state(model.model)))), config=config
        )
        assert np.abs(logits(wrong, IDS) - reference).max() > 1e-2
        assert np.abs(logits(wrong, IDS)[: families.WINDOW] - reference[: families.WINDOW]).max() < 1e-4


def test_llama3_scaling_matters_past_the_original_context(folders):
    model = load_model(folders("llama3"))
    assert model.config.rope.kind == "llama3" and model.config.max_seq_len == 256
    plain = dataclasses.replace(model.config, rope=None)
    wrong = dataclasses.replace(
        model, model=Llama.from_weights(plain, dict(nnx.to_pure_dict(nnx.state(model.model)))), config=plain
    )
    reference = families.hf_logits(folders("llama3"), IDS)
    # original_max_position_embeddings = 32: plain RoPE is visibly wrong on this text
    assert np.abs(logits(wrong, IDS) - reference).max() > 1e-2
    np.testing.assert_allclose(logits(model, IDS), reference, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", families.FAMILIES)
def test_token_by_token_through_the_cache_equals_teacher_forced(folders, family):
    model = load_model(folders(family))
    full = token_nll(model, IDS, chunk=T)
    one = token_nll(model, IDS, chunk=1)
    np.testing.assert_allclose(one, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", families.FAMILIES)
def test_streaming_int4_cache_decodes_with_a_per_layer_memory_report(folders, family):
    model = load_model(folders(family))
    spec = CacheSpec(sink=4, window=32, kv_quantize="int4", group_size=8, residual=16)
    cache = new_cache(model.config, spec, 1)
    kinds = model.config.layer_kinds
    if "sliding_attention" in kinds:  # local layers keep the model's own window, in the user's storage
        local = spec.local(families.WINDOW)
        assert (local.sink, local.window, local.attention_window, local.kv_quantize) == (0, 16, 16, "int4")
        expected = tuple(local if k == "sliding_attention" else spec for k in kinds)
        got = cache.spec.specs if isinstance(cache, LayeredCache) else (cache.spec,) * len(kinds)
        assert got == expected
    fp32 = token_nll(model, IDS, cache=CacheSpec(sink=4, window=32))
    int4 = token_nll(model, IDS, cache=spec)
    assert np.isfinite(int4).all() and abs(int4.mean() - fp32.mean()) < 0.05 * fp32.mean()
    out = generate(model, [IDS[:8]], max_new_tokens=48, cache=spec)
    assert len(out.token_ids[0]) == 48 or out.finish_reasons[0] == "eos"
    report = memory_report(new_cache(model.config, spec, 1))
    assert sum(n for _, n, _ in report.by_spec) == len(kinds)
    if family == "gemma3":  # 6 local layers and one global, each kind with its bytes
        assert [(d.split(",")[0], n) for d, n, _ in report.by_spec] == [
            ("sink 0 + window 16 (local attention over 16)", 6),
            ("sink 4 + window 32", 1),
        ]
        local_bytes, global_bytes = report.by_spec[0][2], report.by_spec[1][2]
        assert local_bytes + global_bytes == report.allocated_bytes and local_bytes / 6 < global_bytes
        assert "1 layer of sink 4 + window 32" in report.summary()


def test_cache_positions_rotate_each_layer_kind_with_its_own_rope(folders):
    model = load_model(folders("gemma3"))  # local base 10000, global 1e6 with linear scaling
    assert model.config.local_rope is not None and model.config.rope_for("sliding_attention") != model.config.rope_for(
        "full_attention"
    )
    absolute = logits(model, IDS)
    cache = logits(model, IDS, CacheSpec(max_len=T, positions="cache"))  # ranks = positions in a full cache
    np.testing.assert_allclose(cache, absolute, atol=1e-4, rtol=0)
    # streaming: until the first eviction from the global layers' window, ranks are positions too
    spec = CacheSpec(sink=4, window=32)
    by_rank = token_nll(model, IDS, cache=dataclasses.replace(spec, positions="cache"))
    by_position = token_nll(model, IDS, cache=spec)
    np.testing.assert_allclose(by_rank[:36], by_position[:36], atol=1e-4)
    assert np.abs(by_rank[40:] - by_position[40:]).max() > 1e-4  # then the global layers' ranks compress


def test_every_family_is_registered():
    assert set(REGISTERED) == {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"}


# ---------------------------------------------------------------------------------------- GGUF
converter = families.llama_cpp_converter()


@pytest.mark.slow
@pytest.mark.skipif(
    converter is None,
    reason="llama.cpp's convert_hf_to_gguf.py not found (scripts/test.sh unpacks it "
    "into ~/.cache/jaxkv/llama.cpp; or set JAXKV_LLAMA_CPP)",
)
@pytest.mark.parametrize("family", families.FAMILIES)
def test_gguf_from_llama_cpp_converter_matches_the_hf_folder(folders, tmp_path, family):
    folder = folders(family)
    gguf = families.convert(folder, str(tmp_path / f"{family}.gguf"), converter)
    hf, model = load_model(folder), load_model(gguf)
    assert model.config.family == hf.config.family
    a, b = logits(hf, IDS), logits(model, IDS)
    if family == "mistral":  # llama.cpp's converter drops Mistral's window (llama.cpp ignores it): equal within it
        assert model.config.sliding_window is None
        a, b = a[: families.WINDOW], b[: families.WINDOW]
    else:
        same = dict(name=hf.config.name, norm_eps=hf.config.norm_eps, rope=hf.config.rope)  # float32 in the file
        assert dataclasses.replace(model.config, **same) == hf.config
        np.testing.assert_allclose(
            model.config.rope_for("full_attention").inv_freq, hf.config.rope_for("full_attention").inv_freq, rtol=1e-6
        )
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("family", ["llama3", "qwen3", "gemma3"])
def test_cli_chat_sample_with_a_streaming_int4_cache(folders, capsys, family):
    from jaxkv.cli import main

    code = main(
        [
            "sample",
            folders(family),
            "--chat",
            "--prompt",
            "Once upon a time",
            "--tokens",
            "6",
            "--streaming-llm-sink",
            "4",
            "--streaming-llm-window",
            "32",
            "--kv-quantize",
            "int4",
            "--kv-group-size",
            "8",
            "--kv-residual",
            "16",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    report = err.strip().splitlines()[-1]
    assert "tokens" in report and "cache" in report
    if family == "gemma3":  # the memory report gives each layer kind
        assert "6 layers of sink 0 + window 16 (local attention over 16)" in report
        assert "1 layer of sink 4 + window 32" in report


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling of type 'yarn' is not supported"),
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75 is not supported"),
    ({"hidden_act": "relu"}, "hidden_act='relu' is not supported"),
])  # fmt: skip
def test_cli_refuses_maths_it_does_not_implement_in_one_line(folders, tmp_path, capsys, change, message):
    import json
    import shutil

    from jaxkv.cli import main

    folder = tmp_path / "changed"
    shutil.copytree(folders("qwen3"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None) if "rope_scaling" in change or "partial_rotary_factor" in change else None
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    code = main(["sample", str(folder), "--prompt", "Hi", "--tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


def test_a_cache_without_the_models_window_is_refused_not_silently_wrong(folders):
    from jaxkv import JaxkvError, KVCache

    model = load_model(folders("mistral"))  # every layer local: a plain cache would run, without the window
    c = model.config
    plain = KVCache.create(
        CacheSpec(max_len=T), batch=1, n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim
    )
    graphdef, state = nnx.split(model.model)
    with pytest.raises(JaxkvError, match="a local window of 16 tokens on sliding_attention layers.*new_cache"):
        forward(graphdef, state, jnp.asarray([IDS], jnp.int32), jnp.asarray([T], jnp.int32), plain)
