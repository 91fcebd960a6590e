"""The Llama decoder against an independent NumPy forward pass and the golden outputs."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paths import SMOLLM2, STORIES_BIN, TEXT, TOK512_BIN, TOK512_MODEL
from reference import RefDecoder, read_llama2c_raw

from jaxkv import CacheSpec, KVCache, forward, sample


@pytest.fixture(scope="module")
def story_tokens(stories):
    ids = stories.tokenizer.encode(TEXT.read_text()[:2000])
    return ids[:64]


def full_forward(model, tokens, spec=None):
    """One teacher-forced forward pass of ``tokens`` (one chunk) -> float32[T, V]."""
    c = model.config
    spec = spec or CacheSpec(max_len=len(tokens))
    cache = KVCache.create(spec, batch=1, n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim)
    gd, st = nnx.split(model.model)
    logits, _ = forward(gd, st, jnp.asarray([tokens], jnp.int32), jnp.asarray([len(tokens)], jnp.int32), cache)
    return np.asarray(logits[0])


def test_stories260k_logits_match_numpy_reference(stories, story_tokens):
    weights, cfg = read_llama2c_raw(STORIES_BIN)
    ref = RefDecoder(weights, cfg, rope_layout="interleaved")
    expected = np.stack([ref.step(t) for t in story_tokens])
    got = full_forward(stories, story_tokens)
    assert len(story_tokens) == 64
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_token_by_token_equals_teacher_forced(stories, story_tokens):
    c = stories.config
    gd, st = nnx.split(stories.model)
    step = jax.jit(forward, static_argnums=0, donate_argnames="cache")
    cache = KVCache.create(
        CacheSpec(max_len=64), batch=1, n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim
    )
    rows = []
    for t in story_tokens:
        logits, cache = step(gd, st, jnp.asarray([[t]], jnp.int32), jnp.asarray([1], jnp.int32), cache)
        rows.append(np.asarray(logits[0, 0]))
    np.testing.assert_allclose(np.stack(rows), full_forward(stories, story_tokens), atol=2e-5, rtol=0)


@pytest.mark.parametrize("tokenizer", [TOK512_MODEL, TOK512_BIN])
def test_stories260k_golden_greedy(golden, tokenizer):
    from jaxkv import load_model

    g = golden["stories260K_greedy_from_bos"]
    model = load_model(STORIES_BIN, tokenizer=tokenizer)
    out = sample(model, g["prompt_token_ids"], max_new_tokens=g["steps_including_bos"], temperature=0.0)
    assert out.text == g["expected_text"]
    assert out.finish_reason == "length" and len(out.token_ids) == 200


@pytest.mark.jax_independent
def test_cli_prints_golden_text(golden):
    g = golden["stories260K_greedy_from_bos"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxkv.cli",
            "sample",
            str(STORIES_BIN),
            "--tokenizer",
            str(TOK512_BIN),
            "--tokens",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == g["expected_text"] + "\n"
    report = proc.stderr.strip().splitlines()[-1]
    assert report.startswith("[200 tokens, length;") and "tokens/s" in report and "cache" in report


@pytest.mark.slow
def test_smollm2_chatml_golden(golden, smollm2):
    g = golden["smollm2_chatml_paris"]
    ids = smollm2.tokenizer.encode(g["prompt"], add_bos=False)
    assert ids == g["prompt_token_ids"]
    out = sample(smollm2, ids, max_new_tokens=12)
    assert out.text.startswith(g["expected_text_prefix"]), out.text


def test_config_presets_match_the_real_checkpoints(stories, smollm2_config):
    from jaxkv import JaxkvError, LlamaConfig

    preset = LlamaConfig.from_preset("stories260K")
    assert preset == dataclasses.replace(stories.config, name="stories260K")
    assert LlamaConfig.from_preset("smollm2-135m") == dataclasses.replace(
        smollm2_config, name="smollm2-135m", norm_eps=1e-5
    )
    assert LlamaConfig.from_preset("llama-tiny").n_kv_heads == 2
    with pytest.raises(JaxkvError, match="llama-tiny"):
        LlamaConfig.from_preset("no-such-model")


@pytest.fixture(scope="module")
def smollm2_config():
    """SmolLM2's config from its GGUF metadata alone (no weights loaded)."""
    from jaxkv.io.gguf_loader import gguf_metadata
    from jaxkv.models.llama import LlamaConfig

    return LlamaConfig.from_gguf(gguf_metadata(SMOLLM2), tie_embeddings=True, name="x")
