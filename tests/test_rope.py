"""RoPE (:mod:`jaxkv.cache.rope`): frequencies of each scaling against their formulas, and
angles that keep relative geometry at any int32 position (a bounded cache streams forever)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import CacheSpec
from jaxkv.cache.rope import Rope, apply_rope
from jaxkv.errors import JaxkvError
from tests.paths import STORIES_BIN, TEXT

POSITIONS = np.array([0, 1, 255, 256, 4095, 4096, 2**20 + 3, 2**24, 2**24 + 1, 2**24 + 12345, 2**30 + 7, 2**31 - 1])


@pytest.mark.parametrize("rope", [Rope.default(10000.0, 64), Rope.default(500000.0, 128), Rope.linear(1e6, 32, 8.0)])
def test_angles_are_exact_to_3e_5_rad_at_every_int32_position(rope):
    positions = np.concatenate([POSITIONS, -POSITIONS[1:], np.random.default_rng(0).integers(0, 2**31 - 1, 200)])
    cos, sin = (np.asarray(x, np.float64) for x in rope.cos_sin(positions.astype(np.int32)))
    exact = positions[:, None].astype(np.float64) * np.asarray(rope.inv_freq)  # float64: exact phase to ~1e-7 rad
    error = np.abs(np.angle(np.exp(1j * exact) * (cos - 1j * sin)))
    assert error.max() < 3e-5
    # a float32 product (what RoPE computed before) is off by radians here: float32(2**24 + 1) == 2**24
    float32 = np.float32(positions[:, None]) * np.asarray(rope.inv_freq, np.float32)
    assert np.abs(np.angle(np.exp(1j * exact) * np.exp(-1j * float32.astype(np.float64)))).max() > 0.1


def test_attention_scores_depend_on_relative_positions_only_even_past_2_24():
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 8, 64)).astype(np.float32)
    rel = np.arange(8, dtype=np.int32) * 37
    near = np.einsum(
        "ih,jh->ij", np.asarray(apply_rope(q, rel + 500, theta=1e4)), np.asarray(apply_rope(k, rel, theta=1e4))
    )
    for base in (2**24, 2**24 + 1, 2**30 + 5):
        far = np.einsum(
            "ih,jh->ij",
            np.asarray(apply_rope(q, rel + 500 + base, theta=1e4)),
            np.asarray(apply_rope(k, rel + base, theta=1e4)),
        )
        np.testing.assert_allclose(far, near, atol=2e-3)  # scores ~N(0, 64): 2e-3 is float32 rounding


def test_scaled_frequencies_follow_their_formulas():
    plain = np.asarray(Rope.default(500000.0, 64).inv_freq)
    np.testing.assert_allclose(plain, 1.0 / 500000.0 ** (np.arange(32) * 2 / 64), rtol=1e-15)
    np.testing.assert_allclose(Rope.linear(500000.0, 64, 4.0).inv_freq, plain / 4.0, rtol=1e-15)
    llama3 = np.asarray(
        Rope.llama3(
            500000.0, 64, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
        ).inv_freq
    )
    wavelen = 2 * np.pi / plain
    np.testing.assert_allclose(llama3[wavelen < 8192 / 4], plain[wavelen < 8192 / 4])  # high frequencies kept
    np.testing.assert_allclose(llama3[wavelen > 8192], plain[wavelen > 8192] / 8.0)  # low ones divided by factor
    mid = (wavelen >= 2048) & (wavelen <= 8192)
    assert mid.any() and np.all((llama3[mid] < plain[mid]) & (llama3[mid] > plain[mid] / 8.0))
    factors = np.linspace(1, 8, 32)
    np.testing.assert_allclose(Rope.with_factors(500000.0, 64, factors).inv_freq, plain / factors, rtol=1e-15)


@pytest.mark.parametrize("bad,match", [
    (lambda: Rope.default(-1.0, 64), "theta=-1.0"),
    (lambda: Rope.default(1e4, 63), "head_dim=63"),
    (lambda: Rope.linear(1e4, 64, 0), "linear factor=0"),
    (lambda: Rope.llama3(1e4, 64, factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0,
                         original_max_position_embeddings=8192), "high_freq_factor=1.0 must exceed"),
    (lambda: Rope.with_factors(1e4, 64, np.ones(31)), "expected 32 positive finite factors"),
    (lambda: apply_rope(np.ones((2, 64), np.float32), 0), "exactly one of rope"),
    (lambda: apply_rope(np.ones((2, 64), np.float32), 0, rope=Rope.default(1e4, 32)), "head dim 32 applied to head dim 64"),
])  # fmt: skip
def test_bad_rope_arguments_are_named(bad, match):
    with pytest.raises(JaxkvError, match=match):
        bad()


@pytest.mark.slow
def test_a_50000_token_stream_at_position_2_24_has_the_perplexity_of_one_at_0():
    from jaxkv.eval.perplexity import token_nll
    from jaxkv.io import load_model

    model = load_model(STORIES_BIN)
    ids = model.tokenizer.encode(TEXT.read_text())[:50_000]
    assert len(ids) == 50_000
    spec = CacheSpec(window=1024)  # sinks are positions < sink: a stream starting at 2**24 has none
    at_0 = np.exp(token_nll(model, ids, cache=spec, chunk=256).mean())
    far = np.exp(token_nll(model, ids, cache=spec, chunk=256, start=2**24).mean())
    assert 3.0 < at_0 < 6.0 and abs(far / at_0 - 1) < 0.01  # measured here: 4.38646 both
