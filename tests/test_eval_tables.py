"""jaxkv.eval's tables and the fake-quantised K/V hook (issue 13, deliverable 5).

* the memory table's bytes are the cache's real pytree-leaf bytes;
* prefix_match's exact values;
* ``kv_hook``: an identity hook leaves the logits bit-identical; :class:`FakeQuantKV`
  equals a NumPy per-channel / per-token fake quantisation, and changes a tiny model's NLL
  as much as its bits say.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from reference import quantize_dequantize

from jaxkv import CacheSpec, JaxkvError, KVCache, forward
from jaxkv.cache.rope import apply_rope
from jaxkv.eval import FakeQuantKV, memory_rows, memory_spec, prefix_match, teacher_forced_nll, token_nll
from jaxkv.eval.tables import filled_report
from jaxkv.testing import tiny_loaded

SHAPE = dict(n_layers=2, n_kv_heads=3, head_dim=16)


# --------------------------------------------------------------------------- memory table


@pytest.mark.parametrize("tokens", [64, 96])
def test_memory_rows_are_the_leaf_bytes(tokens):
    modes = ("fp32", "fp16", "bf16", "int8", "int4", "int2")
    rows = memory_rows(tokens=(tokens,), modes=modes, group_size=16, residual=32, shape=SHAPE)
    assert [r["mode"] for r in rows] == list(modes)
    for r in rows:
        cache = KVCache.create(memory_spec(r["mode"], tokens, group_size=16, residual=32), batch=1, **SHAPE)
        leaves = sum(int(x.nbytes) for x in jax.tree.leaves(cache))
        assert r["bytes"] == r["leaf_bytes"] == leaves == sum(r["groups"].values())
        assert r["capacity"] == tokens
    by = {r["mode"]: r for r in rows}
    kv = 2 * SHAPE["n_layers"] * SHAPE["n_kv_heads"] * tokens * SHAPE["head_dim"]  # K and V elements
    bookkeeping = 4 * tokens + 4  # int32 slot positions and one int32 length per row
    assert by["fp32"]["groups"]["slots"] == 4 * kv and by["bf16"]["groups"]["slots"] == 2 * kv
    assert by["fp32"]["bytes"] == 4 * kv + bookkeeping and by["fp16"]["bytes"] == 2 * kv + bookkeeping
    assert by["bf16"]["ratio_vs_bf16"] == 1.0 and by["fp32"]["ratio_vs_bf16"] == pytest.approx(
        by["bf16"]["bytes"] / by["fp32"]["bytes"]
    )
    quantised = kv * (tokens - 32) // tokens  # K and V elements in the quantised ring (the rest: fp32 residual)
    for mode, cpb in (("int8", 1), ("int4", 2), ("int2", 4)):
        assert by[mode]["groups"]["codes"] == quantised // cpb
        assert by[mode]["groups"]["residual"] == 4 * (kv - quantised)


def test_filled_report_counts_the_appended_tokens():
    spec = CacheSpec(window=64, kv_quantize="int4", group_size=16, residual=32)
    rep = filled_report(spec, 80, shape=SHAPE)
    assert rep.tokens_stored[0] == 80 and rep.capacity == 96
    assert rep.allocated_bytes == sum(int(x.nbytes) for x in jax.tree.leaves(KVCache.create(spec, batch=1, **SHAPE)))
    assert 0 < rep.live_bytes < rep.allocated_bytes


# --------------------------------------------------------------------------- prefix match


def test_prefix_match_exact_values():
    ref = [5, 6, 7, 8]
    assert prefix_match(ref, [5, 6, 7, 8]) == 1.0
    assert prefix_match(ref, [5, 6, 7, 8, 9]) == 1.0
    assert prefix_match(ref, [5, 6, 0, 8]) == 0.5
    assert prefix_match(ref, [5, 6, 7]) == 0.75
    assert prefix_match(ref, [0, 6, 7, 8]) == 0.0
    assert prefix_match(ref, []) == 0.0
    assert prefix_match([1, 2, 3], [1, 9, 9]) == pytest.approx(1 / 3)
    with pytest.raises(JaxkvError, match="no tokens"):
        prefix_match([], [1])


# --------------------------------------------------------------------------- kv_hook


def test_identity_hook_gives_bit_identical_logits():
    lm = tiny_loaded(tokenizer=False)
    c = lm.config
    graphdef, state = nnx.split(lm.model)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, c.vocab_size, (2, 12)), jnp.int32)
    n = jnp.asarray([12, 7], jnp.int32)

    def step(hook):
        cache = KVCache.create(
            CacheSpec(sink=2, window=8), batch=2, n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim
        )
        run = jax.jit(lambda s, t, n, cache: forward(graphdef, s, t, n, cache, kv_hook=hook))
        return run(state, tokens, n, cache)

    plain, hooked = step(None), step(lambda k, v: (k, v))
    np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(hooked[0]))
    for a, b in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(hooked[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _grid_groups(rng, shape, axis, group, bits):
    """Random float32 ``x`` whose groups along ``axis`` (``group`` elements) have a float16-exact
    minimum and a range of ``levels * 2**e``: float16 scales and zeros are then exact under any
    rounding, so the kernels and the NumPy reference must agree to the bit."""
    levels = 2**bits - 1
    x = np.moveaxis(rng.uniform(0.05, 0.95, shape).astype(np.float32), axis, -1)
    lead = x.shape[:-1]
    n = x.shape[-1] // group
    step = np.float32(2.0) ** rng.integers(-6, 0, lead + (n, 1)).astype(np.float32)
    lo = (rng.integers(-64, 64, lead + (n, 1)) / 32).astype(np.float32)
    g = x.reshape(lead + (n, group)) * levels * step + lo
    g[..., 0:1], g[..., 1:2] = lo, lo + levels * step  # the group's exact min and max
    return np.moveaxis(g.reshape(x.shape), -1, axis)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize(
    "keys,values", [("channel", "token"), ("token", "channel"), ("channel", "channel"), ("token", "token")]
)
def test_fake_quant_matches_numpy(keys, values, bits):
    """Per channel = groups of G tokens along T, per token = the head's H channels ([B, T, K, H] in and out)."""
    rng = np.random.default_rng(bits)
    b, t, k, h, g = 2, 16, 3, 8, 4
    axis = {"channel": 1, "token": 3}  # of [B, T, K, H]

    def data(how):
        return _grid_groups(rng, (b, t, k, h), axis[how], g if how == "channel" else h, bits)

    kx, vx = data(keys), data(values)
    hook = FakeQuantKV(keys=keys, values=values, bits=bits, group_size=g)
    got_k, got_v = jax.jit(hook)(jnp.asarray(kx), jnp.asarray(vx))

    def ref(x, how):
        if how == "token":
            return quantize_dequantize(x, bits, axis=3, scale_dtype=np.float16)
        grouped = x.reshape(b, t // g, g, k, h)  # T split into groups of G
        return quantize_dequantize(grouped, bits, axis=2, scale_dtype=np.float16).reshape(x.shape)

    np.testing.assert_array_equal(np.asarray(got_k), ref(kx, keys))
    np.testing.assert_array_equal(np.asarray(got_v), ref(vx, values))
    assert not np.array_equal(np.asarray(got_k), kx)  # it did quantise


def test_fake_quant_after_rope_and_untouched_axes():
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.normal(size=(1, 8, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, 8, 2, 8)), jnp.float32)
    pos = jnp.arange(8, dtype=jnp.int32)[None, :, None]
    plain = FakeQuantKV(bits=2, group_size=4)
    rotated = FakeQuantKV(bits=2, group_size=4, rope_theta=100.0)
    want = apply_rope(plain(apply_rope(k, pos, theta=100.0), v)[0], -pos, theta=100.0)
    got_k, got_v = rotated(k, v)
    np.testing.assert_allclose(np.asarray(got_k), np.asarray(want), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(plain(k, v)[1]))
    same_k, same_v = FakeQuantKV(keys=None, values=None)(k, v)
    assert same_k is k and same_v is v


def test_fake_quant_rejects_bad_settings():
    with pytest.raises(JaxkvError, match="keys='head'"):
        FakeQuantKV(keys="head")
    with pytest.raises(JaxkvError, match="bits"):
        FakeQuantKV(bits=3)
    with pytest.raises(JaxkvError, match="group_size=0"):
        FakeQuantKV(group_size=0)
    with pytest.raises(JaxkvError, match="32"):  # T = 12 is not a multiple of G = 32
        teacher_forced_nll(tiny_loaded(tokenizer=False), np.zeros((1, 12), np.int32), kv_hook=FakeQuantKV())


def test_teacher_forced_nll_with_and_without_fake_quant():
    lm = tiny_loaded(tokenizer=False)
    rows = np.random.default_rng(2).integers(0, lm.config.vocab_size, (3, 32)).astype(np.int32)
    base = teacher_forced_nll(lm, rows)
    assert base.shape == (3, 31) and base.dtype == np.float64
    for r, row in enumerate(rows):  # one pass over a full cache = the streamed full-cache NLL
        np.testing.assert_allclose(base[r], token_nll(lm, row), atol=1e-5)
    np.testing.assert_allclose(teacher_forced_nll(lm, rows[0]), base[0], atol=1e-6)
    err = {
        bits: np.max(np.abs(teacher_forced_nll(lm, rows, kv_hook=FakeQuantKV(bits=bits, group_size=8)) - base))
        for bits in (8, 2)
    }
    assert 0 < err[8] < 0.05 and err[2] > 10 * err[8], err
