"""Per-layer KV precision (issue 15): boosted layers (``LayerSpecs.boosted``, ``--kv-boost-layers``)
and the measured sensitivity pass (``jaxkv.eval.layer_sensitivity``, ``jaxkv ppl --kv-sensitivity``).

A boosted layer only changes what that layer stores, so a boosted cache must give exactly the
logits of the same per-layer specs written by hand, and the pass's figures must be exactly
:func:`jaxkv.eval.token_nll` through the spec it says it measured.
"""

from __future__ import annotations

import io
import re
import sys

import numpy as np
import pytest

from paths import STORIES_BIN, TEXT, TOK512_MODEL

from jaxkv import CacheSpec, ChatSession, JaxkvError, LayerSpecs, load_model
from jaxkv.cli import main
from jaxkv.decode.batch import resolve_cache
from jaxkv.decode.loop import new_cache_bits
from jaxkv.eval import layer_sensitivity, perplexity, token_nll
from jaxkv.testing import tiny_config, tiny_loaded, tiny_model

KIVI = dict(sink=2, window=16, group_size=4, residual=8, positions="cache")
INT2 = CacheSpec(kv_quantize="int2", residual_dtype="float16", **KIVI)
INT8 = CacheSpec(kv_quantize="int8", residual_dtype="float16", **KIVI)
TOKENS = list(np.random.default_rng(0).integers(0, 64, 40))
STORIES = [str(STORIES_BIN), "--tokenizer", str(TOK512_MODEL)]


def test_boosted_equals_the_hand_made_layer_specs():
    boosted = LayerSpecs.boosted(INT2, 4, (2, 0), "int8")
    assert boosted == LayerSpecs((INT8, INT2, INT8, INT2))
    assert boosted.runs == ((INT8, 0, 1), (INT2, 1, 2), (INT8, 2, 3), (INT2, 3, 4))
    # both sides take the mode, whatever the base's pair
    mixed = CacheSpec(k_quantize="int2", v_quantize="int4", residual_dtype="float16", **KIVI)
    assert LayerSpecs.boosted(mixed, 2, [1], "int8").specs == (mixed, INT8)
    # a float mode stores sinks and window in itself (a float cache takes no residual_dtype)
    assert LayerSpecs.boosted(INT2, 2, (0,), "fp16").specs[0] == CacheSpec(kv_quantize="fp16", **KIVI)
    # batch decoding takes it as a fixed spec (not as a function of the tokens a batch needs)
    assert resolve_cache(boosted, 100) is boosted


@pytest.mark.parametrize(
    "args, message",
    [
        ((INT2, 4, (0, 4)), "LayerSpecs.boosted: layers 0,4: layer 4 is out of range: the model has 4 layers (0-3)"),
        ((INT2, 4, (-1,)), "layer -1 is out of range"),
        ((INT2, 4, (1, 3, 1)), "LayerSpecs.boosted: layers 1,3,1: layer 1 is given twice"),
        ((INT2, 4, ()), "expected one or more layer indices in [0, 4)"),
        ((INT2, 4, (0,), "int3"), "LayerSpecs.boosted: mode int3: expected one of fp32, fp16, bf16, int8, int4, int2"),
        (
            (CacheSpec(max_len=8), 4, (0,)),
            "mode int8 does not raise the precision of the cache's fp32 keys and values (nothing to boost)",
        ),
        ((INT8, 4, (0,)), "mode int8 does not raise the precision of the cache's int8 keys and values"),
        ((INT8, 4, (0,), "int4"), "mode int4 does not raise"),
        (
            (CacheSpec(k_quantize="int2", v_quantize="fp16", **KIVI), 4, (0,)),
            "mode int8 does not raise the precision of the cache's int2 keys and fp16 values",
        ),
        ((INT2, 0, (0,)), "LayerSpecs.boosted: n_layers=0: expected an integer >= 1"),
    ],
)
def test_bad_boosts_are_named(args, message):
    with pytest.raises(JaxkvError) as e:
        LayerSpecs.boosted(*args)
    assert message in str(e.value)


def test_a_boosted_cache_gives_the_hand_made_logits_and_differs_from_the_base(chunked):
    model = tiny_model(n_layers=3)
    boosted, _ = chunked(LayerSpecs.boosted(INT2, 3, (1,), "int8"), TOKENS, 8, model)
    by_hand, cache = chunked(LayerSpecs((INT2, INT8, INT2)), TOKENS, 8, model)
    np.testing.assert_array_equal(boosted, by_hand)
    assert [g.spec for g in cache.groups] == [INT2, INT8, INT2]
    base, _ = chunked(INT2, TOKENS, 8, model)
    assert np.abs(boosted - base).max() > 1e-3  # 40 tokens: codes have been read back since token 10


def test_local_layers_keep_their_window_under_per_layer_specs(chunked):
    """A model with local sliding-window layers: each local layer gets ``local(W)`` of its own
    per-layer spec (before, a LayerSpecs passed through unchanged and the forward refused it)."""
    kinds = ("sliding_attention", "full_attention", "sliding_attention")
    config = tiny_config(n_layers=3, layer_types=kinds, sliding_window=8)
    boosted = LayerSpecs.boosted(INT2, 3, (0, 1), "int8")
    made = config.cache_spec(boosted)
    assert made == LayerSpecs((INT8.local(8), INT8, INT2.local(8)))
    assert made.specs[0].attention_window == 8 and made.specs[0].window == 8 and made.specs[0].kv_quantize == "int8"
    assert config.cache_spec(made) == made  # applied twice: unchanged (a resumed file's spec)
    assert config.cache_spec(INT2) == LayerSpecs((INT2.local(8), INT2, INT2.local(8)))
    with pytest.raises(JaxkvError, match="LayerSpecs holds 2 layer specs, but the model has n_layers=3"):
        config.cache_spec(LayerSpecs((INT2, INT8)))
    model = tiny_model(n_layers=3, layer_types=kinds, sliding_window=8)
    logits, cache = chunked(boosted, TOKENS, 8, model)
    assert [g.spec for g in cache.groups] == list(made.specs)
    assert np.abs(logits - chunked(INT2, TOKENS, 8, model)[0]).max() > 1e-3


def test_layer_sensitivity_figures_are_token_nll_through_the_boosted_specs():
    loaded = tiny_loaded(tokenizer=False)  # L = 2
    base = CacheSpec(max_len=48, kv_quantize="int2", group_size=4, residual=4)
    ids = TOKENS + TOKENS[:8]

    def ppl(spec):
        return perplexity(token_nll(loaded, ids, cache=spec, chunk=16))

    result = layer_sensitivity(loaded, ids, base, mode="int4", top=(1, 2), chunk=16)
    assert result.base_ppl == ppl(base) and result.base_bits == new_cache_bits(loaded.config, base)
    expected = [ppl(LayerSpecs.boosted(base, 2, (layer,), "int4")) for layer in range(2)]
    np.testing.assert_array_equal(result.ppl, expected)
    assert len(set(expected)) == 2 and result.base_ppl not in expected  # every boost changes the figure
    np.testing.assert_array_equal(result.gain, result.base_ppl - np.asarray(expected))
    assert result.ranking == tuple(sorted(range(2), key=lambda layer: (-result.gain[layer], layer)))
    first, every = result.top
    assert (
        first.layers == (result.ranking[0],)
        and first.ppl == expected[result.ranking[0]]
        and first.flag == str(first.layers[0])
    )
    int4 = CacheSpec(max_len=48, kv_quantize="int4", group_size=4, residual=4)
    assert every.layers == (0, 1) and every.flag == "0,1"
    np.testing.assert_allclose(every.ppl, ppl(int4), rtol=1e-12)
    assert (every.store_bits, every.bits) == new_cache_bits(loaded.config, int4)
    assert every.bits > first.bits > result.base_bits[1]
    with pytest.raises(JaxkvError, match=r"each k must be an integer in \[1, 2\]"):
        layer_sensitivity(loaded, ids, base, top=(3,))
    with pytest.raises(JaxkvError, match="nothing to boost"):
        layer_sensitivity(loaded, ids, CacheSpec(max_len=48), top=(1,))


def cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


INT4_FLAGS = ["--kv-quantize", "int4", "--kv-group-size", "16", "--kv-residual", "16"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["ppl", *STORIES, "--text", str(TEXT), *INT4_FLAGS, "--kv-boost-layers", "0,5"],
            "--kv-boost-layers 0,5: layer 5 is out of range: the model has 5 layers (0-4)",
        ),
        (
            ["sample", *STORIES, *INT4_FLAGS, "--kv-boost-layers", "7"],
            "--kv-boost-layers 7: layer 7 is out of range: the model has 5 layers (0-4)",
        ),
        (
            ["chat", *STORIES, "--chat-template", "{{ messages }}", *INT4_FLAGS, "--kv-boost-layers", "1,2,1"],
            "--kv-boost-layers 1,2,1: layer 1 is given twice",
        ),
        (
            ["ppl", *STORIES, "--text", str(TEXT), *INT4_FLAGS, "--kv-boost-layers", "0,a"],
            "--kv-boost-layers 0,a: expected comma-separated layer indices, integers >= 0 (e.g. 0,1,29)",
        ),
        (
            ["sample", *STORIES, "--kv-boost-layers", "0,1"],
            "--kv-boost-layers 0,1 with --kv-boost-quantize int8 does not raise the precision of the cache's fp32 keys and "
            "values (nothing to boost)",
        ),
        (
            [
                "batch",
                *STORIES,
                "--input",
                "in.jsonl",
                "--output",
                "out.jsonl",
                "--kv-quantize",
                "int8",
                "--kv-boost-layers",
                "1",
                "--kv-boost-quantize",
                "int4",
            ],
            "--kv-boost-layers 1 with --kv-boost-quantize int4 does not raise the precision",
        ),
        (
            ["ppl", *STORIES, "--text", str(TEXT), *INT4_FLAGS, "--kv-boost-layers", "0", "--kv-boost-quantize", "q8"],
            "--kv-boost-layers 0 with --kv-boost-quantize q8: expected one of fp32, fp16, bf16, int8, int4, int2",
        ),
        (
            ["ppl", *STORIES, "--text", str(TEXT), *INT4_FLAGS, "--kv-boost-quantize", "fp16"],
            "--kv-boost-quantize fp16 needs --kv-boost-layers L,L,... (the layers to store in it)",
        ),
        (
            ["ppl", *STORIES, "--text", str(TEXT), "--kv-sensitivity"],
            "--kv-sensitivity with --kv-boost-quantize int8 does not raise the precision of the cache's fp32 keys and values",
        ),
        (
            ["ppl", *STORIES, "--text", str(TEXT), *INT4_FLAGS, "--kv-sensitivity", "--kv-boost-layers", "0"],
            "--kv-sensitivity boosts each layer alone from the cache the flags describe: leave out --kv-boost-layers",
        ),
        (
            ["ppl", *STORIES, "--text", str(TEXT), "--recompute-window", "8", "--kv-boost-layers", "0"],
            "--recompute-window re-encodes every window from scratch",
        ),
    ],
)
@pytest.mark.jax_independent
def test_cli_refuses_bad_boosts_in_one_line(capsys, argv, message):
    code, _, err = cli(capsys, *argv)
    assert code == 2 and err.startswith("jaxkv: error: ") and err.count("\n") == 1 and message in err, err


@pytest.mark.jax_independent
def test_cli_ppl_with_boosted_layers_is_token_nll_through_them(capsys):
    code, out, err = cli(
        capsys,
        "ppl",
        *STORIES,
        "--text",
        str(TEXT),
        "--tokens",
        "96",
        *INT4_FLAGS,
        "--kv-boost-layers",
        "3,0",
        "--kv-boost-quantize",
        "fp16",
    )
    assert code == 0, err
    stories = load_model(STORIES_BIN, tokenizer=TOK512_MODEL)
    ids = stories.tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:96]
    base = CacheSpec(max_len=256, kv_quantize="int4", group_size=16, residual=16)
    spec = LayerSpecs.boosted(base, 5, (0, 3), "fp16")
    assert f"cache {spec.describe()};" in out and "layer 0: full 256, fp16" in out
    assert f"perplexity {perplexity(token_nll(stories, ids, cache=spec)):.4f}  (" in out


def test_a_boosted_chat_resumes_from_its_file(tmp_path, capsys, monkeypatch):
    """``jaxkv chat --kv-boost-layers`` saves a per-layer cache; a second run without the cache
    flags resumes it (and one with the same flags too), replying as one uninterrupted session."""
    from test_chat import STORIES_CHAT_ARGV, stories_chat

    path = str(tmp_path / "chat.safetensors")
    flags = [
        "--streaming-llm-sink",
        "4",
        "--streaming-llm-window",
        "32",
        *INT4_FLAGS[:2],
        "--kv-group-size",
        "8",
        "--kv-residual",
        "8",
        "--kv-boost-layers",
        "0,4",
    ]
    replies = []
    for stdin, given in (("Hello\n", flags), ("And then?\n", []), ("Why?\n", flags)):
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        code, out, err = cli(capsys, "chat", *STORIES_CHAT_ARGV, "--tokens", "8", *given, "--cache-file", path)
        assert code == 0, err
        replies.append(out.rstrip("\n"))
    assert "[resumed" in err and "layer 0: sink 4 + window 32, int8" in err
    base = CacheSpec(sink=4, window=32, kv_quantize="int4", group_size=8, residual=8, positions="cache")
    session = ChatSession(stories_chat(), LayerSpecs.boosted(base, 5, (0, 4)), max_new_tokens=8)
    assert replies == [session.send(m) for m in ("Hello", "And then?", "Why?")]


@pytest.mark.jax_independent
@pytest.mark.slow
def test_cli_sensitivity_table_ranks_by_gain_and_measures_the_suggestions(capsys):
    code, out, err = cli(
        capsys,
        "ppl",
        *STORIES,
        "--text",
        str(TEXT),
        "--tokens",
        "96",
        *INT4_FLAGS,
        "--kv-boost-quantize",
        "int8",
        "--kv-sensitivity",
        "--chunk",
        "32",
    )
    assert code == 0, err
    rows = [
        tuple(float(x) for x in m.groups()) for m in re.finditer(r"^ +(\d+) +(\d+) +([\d.]+) +(-?[\d.]+)$", out, re.M)
    ]
    assert [int(r[0]) for r in rows] == [1, 2, 3, 4, 5] and sorted(int(r[1]) for r in rows) == [0, 1, 2, 3, 4]
    assert [r[3] for r in rows] == sorted((r[3] for r in rows), reverse=True)
    top2 = ",".join(map(str, sorted(int(r[1]) for r in rows[:2])))
    line = next(x for x in out.splitlines() if x.startswith("top 2 in int8:"))
    assert f"--kv-boost-layers {top2} --kv-boost-quantize int8" in line and "bits/element" in line
    stories = load_model(STORIES_BIN, tokenizer=TOK512_MODEL)
    ids = stories.tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:96]
    base = CacheSpec(max_len=256, kv_quantize="int4", group_size=16, residual=16)
    spec = LayerSpecs.boosted(base, 5, tuple(int(x) for x in top2.split(",")), "int8")
    assert f"perplexity {perplexity(token_nll(stories, ids, cache=spec)):.4f} (gain" in line
    assert "(8 runs," in out
