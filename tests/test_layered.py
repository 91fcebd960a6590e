"""Per-layer cache specs (``LayerSpecs``, ``LayeredCache``): runs of layers with their own caches.

A layer's cache only changes what *that* layer attends to, so with specs ``(A, B)`` the
first layer sees exactly the inputs it sees under a uniform ``A`` cache: its run must hold
bit-identical leaves. Chunked prefill must equal token-by-token decoding (every run's
chunk plan is respected), and equal specs must reproduce a uniform cache exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import CacheSpec, JaxkvError, KVCache, LayerSpecs, generate, memory_report
from jaxkv.cache.layered import LayeredCache
from jaxkv.testing import tiny_loaded

WINDOW = CacheSpec(sink=2, window=6)
KIVI = CacheSpec(sink=2, window=8, kv_quantize="int4", group_size=2, residual=4, positions="cache")
FULL = CacheSpec(max_len=64)
TOKENS = list(np.random.default_rng(0).integers(0, 64, 40))


@pytest.mark.parametrize("spec", [WINDOW, KIVI])
def test_equal_specs_reproduce_a_uniform_cache(chunked, spec):
    uniform, _ = chunked(spec, TOKENS, 1)
    layered, cache = chunked(LayerSpecs((spec, spec)), TOKENS, 1)
    assert isinstance(cache, LayeredCache) and len(cache.groups) == 1
    np.testing.assert_array_equal(layered, uniform)


@pytest.mark.parametrize("first,second", [(WINDOW, FULL), (FULL, WINDOW), (KIVI, WINDOW)])
def test_each_run_keeps_its_own_spec(chunked, first, second):
    _, uniform = chunked(first, TOKENS, 1)
    logits, cache = chunked(LayerSpecs((first, second)), TOKENS, 1)
    assert [g.spec for g in cache.groups] == [first, second]
    # layer 0 sees the same inputs as under a uniform `first` cache: identical leaves
    for a, b in zip(jax.tree.leaves(cache.groups[0]), jax.tree.leaves(uniform)):
        if a.ndim >= 4:  # per-layer leaves [L, B, ...]: the uniform cache's layer 0
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[:1])
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # each run stores what a uniform cache of its spec stores
    stored = [int(g.stored()[0]) for g in cache.groups]
    expected = [int(chunked(s, TOKENS, 1)[1].stored()[0]) for s in (first, second)]
    assert stored == expected and expected[0] != expected[1]
    assert int(cache.stored()[0]) == max(expected)
    # different from both uniform runs once the window has evicted tokens
    assert not np.allclose(logits, chunked(second, TOKENS, 1)[0])


@pytest.mark.parametrize("first,second", [(WINDOW, FULL), (KIVI, WINDOW)])
def test_chunked_prefill_equals_token_by_token(chunked, first, second):
    spec = LayerSpecs((first, second))
    np.testing.assert_allclose(chunked(spec, TOKENS, 8)[0], chunked(spec, TOKENS, 1)[0], atol=1e-5)


def test_memory_report_sums_the_runs(chunked):
    spec = LayerSpecs((WINDOW, KIVI))
    _, cache = chunked(spec, TOKENS[:20], 1)
    report = memory_report(cache)
    assert report.allocated_bytes == sum(int(x.nbytes) for x in jax.tree.leaves(cache))
    assert report.allocated["sinks"] and report.allocated["window"] and report.allocated["codes"]
    assert report.capacity == max(WINDOW.capacity, KIVI.capacity)


def test_generate_with_equal_layer_specs_matches_one_spec():
    loaded = tiny_loaded(tokenizer=False)
    prompts = [[1, 5, 9, 3], [2, 7]]
    one = generate(loaded, prompts, max_new_tokens=30, cache=WINDOW, eos_id=None)
    layered = generate(loaded, prompts, max_new_tokens=30, cache=LayerSpecs((WINDOW, WINDOW)), eos_id=None)
    assert layered.token_ids == one.token_ids


def test_bad_layer_specs_are_named():
    with pytest.raises(JaxkvError, match="non-empty tuple of CacheSpec"):
        LayerSpecs([WINDOW])
    with pytest.raises(JaxkvError, match="n_layers=3"):
        KVCache.create(LayerSpecs((WINDOW, FULL)), batch=1, n_layers=3, n_kv_heads=2, head_dim=8)
    assert LayerSpecs((WINDOW, WINDOW, FULL)).describe() == (
        f"layers 0-1: {WINDOW.describe()}; layer 2: {FULL.describe()}"
    )
    assert LayerSpecs((WINDOW, FULL)).token_limit == 64 and LayerSpecs((WINDOW, KIVI)).token_limit is None


@pytest.mark.parametrize("spec", [WINDOW, KIVI])
def test_deprecated_six_call_protocol_equals_the_three_calls(spec):
    """admit/prepare/query_positions/read_view/layer_leaves/append and attend(spec, view, ...)
    still work (with a DeprecationWarning) and give the same output and cache."""
    from jaxkv.cache.attention import attend

    @jax.jit
    def three_calls(cache, q, k, v, n):
        cache, step = cache.begin(n, q.shape[1])
        out, ks, vs = attend(step, jax.tree.map(lambda a: a[0], cache.layers()), q, k, v, theta=10000.0)
        return out, cache.commit(step, ks[None], vs[None])

    @jax.jit
    def six_calls(cache, q, k, v, n):
        n = cache.admit(n)
        cache = cache.prepare(n)
        view = cache.read_view(cache.query_positions(n, q.shape[1]))
        out, ks, vs = attend(spec, view, jax.tree.map(lambda a: a[0], cache.layer_leaves()), q, k, v, theta=10000.0)
        return out, cache.append(ks[None], vs[None], n)

    rng = np.random.default_rng(1)
    cache = KVCache.create(spec, batch=2, n_layers=1, n_kv_heads=2, head_dim=8)
    with pytest.warns(DeprecationWarning):  # raised while tracing
        for _ in range(7):  # a few calls of 3 tokens (row 1 appends 2), across a KIVI flush
            q, k, v = (jnp.asarray(rng.normal(size=(2, 3, h, 8)), jnp.float32) for h in (4, 2, 2))
            n = jnp.asarray([3, 2], jnp.int32)
            out, new = three_calls(cache, q, k, v, n)
            out_old, old = six_calls(cache, q, k, v, n)
            np.testing.assert_array_equal(np.asarray(out_old), np.asarray(out))
            for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(new)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            cache = new


def test_a_layered_cache_saves_and_loads(chunked, tmp_path):
    from jaxkv.cache.checkpoint import load_cache, save_cache

    spec = LayerSpecs((KIVI, WINDOW))
    _, cache = chunked(spec, TOKENS[:30], 1)
    save_cache(tmp_path / "c.safetensors", cache)
    empty = KVCache.create(spec, batch=1, n_layers=2, n_kv_heads=2, head_dim=8)
    loaded, _, _ = load_cache(tmp_path / "c.safetensors", empty)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(JaxkvError, match="another cache spec"):
        load_cache(
            tmp_path / "c.safetensors",
            KVCache.create(LayerSpecs((WINDOW, KIVI)), batch=1, n_layers=2, n_kv_heads=2, head_dim=8),
        )


def test_a_local_layer_sees_exactly_the_models_window_even_beside_a_kivi_residual():
    spec = CacheSpec(sink=4, window=64, kv_quantize="int4", group_size=8, residual=16)
    local = spec.local(32)
    assert (local.sink, local.window, local.attention_window, local.kv_quantize, local.residual) == (
        0,
        32,
        32,
        "int4",
        16,
    )
    q, p = np.arange(300)[:, None], np.arange(300)[None, :]
    mask = np.asarray(local.policy.visible(q, p))
    np.testing.assert_array_equal(mask, (p <= q) & (p > q - 32))  # the query and the 31 before it
    # the storage retains every position the mask admits (the lazily flushed window plus the residual)
    assert np.all(np.asarray(local.policy.window_start(np.arange(300))) <= np.maximum(np.arange(300) - 31, 0))
    # without the mask the KIVI residual would show up to R older tokens
    wide = np.asarray(dataclasses.replace(local, attention_window=None).policy.visible(q, p))
    assert wide.sum() > mask.sum() and np.all(wide >= mask)
    # the user's bound holds on local layers too; a full cache's local layers keep the model's window
    assert (
        CacheSpec(sink=4, window=8).local(16).window == 8
        and CacheSpec(sink=4, window=8).local(16).attention_window == 16
    )
    assert (CacheSpec(max_len=100).local(16).window, CacheSpec(max_len=10).local(16).window) == (16, 10)
    with pytest.raises(JaxkvError, match="local layers keep its sliding window of 8 tokens: .*residual=16"):
        spec.local(8)
