"""The keep tier (jaxkv.cache.retention): tokens leaving the window kept by recent, h2o, tova or
snapkv. Every rule is checked against tests/reference.py, which simulates the tier slot by slot
(its own admission, its own attention mass in float64), and SnapKV's selection against a NumPy
top-C of the pooled observation scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from reference import RefDecoder, ref_config, ref_kwargs

from jaxkv import CacheSpec, JaxkvError, KVCache, forward
from jaxkv.cache.attention import attend
from jaxkv.cache.checkpoint import load_cache, save_cache
from jaxkv.cache.memory import memory_report
from jaxkv.cache.retention import OBSERVE, POOL
from jaxkv.decode.loop import prefill
from jaxkv.testing import numpy_weights, tiny_loaded, tiny_model

STEP = jax.jit(forward, static_argnums=0, donate_argnames="cache")


def new_cache(spec, batch=1):
    c = tiny_model().config
    return KVCache.create(spec, batch=batch, n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim)


def tokens_for(n, seed=0):
    return np.random.default_rng(seed).integers(0, 64, n).tolist()


def kept(cache, row=0):
    return sorted(int(p) for p in np.asarray(cache.keep.pos[row]) if p >= 0)


KIVI = dict(kv_quantize="int4", group_size=4, residual=4, scale_dtype="float32")


@pytest.mark.parametrize(
    "rule,positions,storage",
    [
        ("recent", "absolute", {}),
        ("h2o", "absolute", {}),
        ("tova", "absolute", {}),
        ("recent", "cache", {}),
        ("h2o", "cache", {}),
        ("tova", "cache", {}),
        ("recent", "absolute", dict(keep_quantize="int4")),
        ("tova", "absolute", dict(keep_quantize="int2", hadamard="both")),
        ("recent", "cache", dict(keep_quantize="int4", hadamard="values")),
        ("h2o", "absolute", KIVI),
        ("tova", "cache", KIVI),
        ("recent", "cache", KIVI),
        ("h2o", "absolute", dict(KIVI, hadamard="both")),
        ("tova", "absolute", dict(KIVI, residual_dtype="float16")),
    ],
)
def test_decode_matches_the_reference_tier_slot_by_slot(rule, positions, storage):
    """Token by token over five window lengths, on a float window and on a KIVI int4 window
    (whose evicted groups join the tier dequantised): logits to 2e-5 (5e-4 with a quantised
    tier or a float16 residual), the kept set exactly, the scores to 1e-4 (float32 against the
    reference's float64 mass)."""
    spec = CacheSpec(sink=2, window=8, keep=6, keep_score=rule, positions=positions, **storage)
    # as test_kivi_cache; a quantised tier 5e-4: a tier value at a rounding boundary can take the other
    # code under another float32 summation order (jax 0.5.0, int2 + Hadamard tier: one code flips at
    # token 21, max 3.3e-4 until it leaves; jax 0.10: the same codes, 1.4e-6)
    atol = 5e-4 if "residual_dtype" in storage or "keep_quantize" in storage else 2e-5
    tokens = tokens_for(2 + 5 * 8 + 3, seed=3)
    model = tiny_model()
    gd, st = nnx.split(model)
    cache = new_cache(spec)
    ref = RefDecoder(numpy_weights(model), ref_config(model.config), **ref_kwargs(spec))
    for i, tok in enumerate(tokens):
        logits, cache = STEP(gd, st, jnp.asarray([[tok]], jnp.int32), jnp.asarray([1], jnp.int32), cache)
        expected = ref.step(tok)
        np.testing.assert_allclose(np.asarray(logits[0, 0]), expected, atol=atol, rtol=0)
        assert kept(cache) == sorted(ref.kept()), f"after token {i}"
    assert len(kept(cache)) == 6 and int(cache.stored()[0]) == 2 + 8 + 6 + (
        int(cache.ring_pos[0].__ge__(0).sum()) if spec.quantized else 0
    )
    if rule != "recent":
        slots = np.asarray(cache.keep.pos[0])
        got = {int(p): float(s) for p, s in zip(slots, np.asarray(cache.keep.score[0]))}
        want = dict(zip(ref.slots, ref.slot_score))
        np.testing.assert_allclose([got[p] for p in sorted(got)], [want[p] for p in sorted(got)], rtol=1e-4)
    elif not spec.quantized:  # a FIFO: the last six tokens to leave the window
        assert kept(cache) == list(range(len(tokens) - 8 - 6, len(tokens) - 8))


def test_recent_tier_in_chunks_keeps_what_token_by_token_keeps():
    """``recent`` priority is the position, so the kept set does not depend on the chunking."""
    spec = CacheSpec(sink=4, window=16, keep=8, keep_score="recent")
    loaded = tiny_loaded()
    tokens = tokens_for(75, seed=5)
    chunked, _ = prefill(loaded, new_cache(spec), [tokens], chunk=16)
    gd, st = nnx.split(loaded.model)
    cache = new_cache(spec)
    for tok in tokens:
        _, cache = STEP(gd, st, jnp.asarray([[tok]], jnp.int32), jnp.asarray([1], jnp.int32), cache)
    assert kept(chunked) == kept(cache) == list(range(75 - 16 - 8, 75 - 16))


def _observer_mass(model, prompt):
    """The reference's SnapKV vote: the mass the last OBSERVE queries of a full-attention decode give each token."""
    ref = RefDecoder(numpy_weights(model), ref_config(model.config))
    total = np.zeros(len(prompt))
    for i, tok in enumerate(prompt):
        ref.step(tok)
        if i >= len(prompt) - OBSERVE:
            for p, m in ref.last_mass.items():
                total[p] += m
    return total


@pytest.mark.parametrize(
    "positions,storage",
    [("absolute", {}), ("cache", {}), ("cache", dict(kv_quantize="int4", group_size=4, residual=8))],
)
def test_snapkv_keeps_the_top_pooled_prompt_tokens(positions, storage):
    """SnapKV: the observation scores equal the reference's full-attention mass of the last 32
    queries (1e-4); the tier holds exactly the top-C by max-pooled score among the prompt tokens
    that left the window (float, or KIVI's quantised window and residual; the NumPy rule, slot by
    slot, ties to the earlier token); the logits after the prompt are full attention's."""
    loaded = tiny_loaded()
    prompt = tokens_for(120, seed=7)
    spec = CacheSpec(sink=4, window=24, keep=10, keep_score="snapkv", positions=positions, **storage)
    cache, logits = prefill(loaded, new_cache(spec), [prompt], chunk=32)
    observer, full_logits = prefill(loaded, new_cache(spec.observer(128)), [prompt[:-OBSERVE]], chunk=32)
    observer = observer.replace(keep=observer.keep.replace(ring_score=jnp.zeros_like(observer.keep.ring_score)))
    observer, full_logits = prefill(loaded, observer, [prompt[-OBSERVE:]], chunk=32)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full_logits), atol=1e-6)
    score = np.asarray(observer.keep.ring_score[0, :120])
    np.testing.assert_allclose(score, _observer_mass(loaded.model, prompt), rtol=1e-4, atol=1e-5)
    padded = np.pad(score, POOL // 2, constant_values=-np.inf)
    pooled = np.array([padded[i : i + POOL].max() for i in range(120)])
    window = {int(p) for part in cache.positions()[1:] for p in np.asarray(part[0]) if p >= 0} - set(kept(cache))
    slots, slot_score = [None] * 10, [0.0] * 10
    for p in (q for q in range(4, 120) if q not in window):  # the prompt tokens that left the window, in order
        empty = [i for i, q in enumerate(slots) if q is None]
        slot = empty[0] if empty else int(np.argmin(slot_score))
        if empty or pooled[p] > slot_score[slot]:
            slots[slot], slot_score[slot] = p, pooled[p]
    assert kept(cache) == sorted(slots) and len(window) == (24 if not storage else 28) and max(window) == 119


def test_a_model_that_does_not_pass_the_mass_is_told_how():
    spec = CacheSpec(sink=1, window=4, keep=2, keep_score="h2o")
    cache = new_cache(spec)
    cache, step = cache.begin(jnp.asarray([1], jnp.int32), 1)
    layer = jax.tree.map(lambda a: a[0], cache.layers())
    q = jnp.ones((1, 1, 4, 8))
    k = v = jnp.ones((1, 1, 2, 8))
    _, ks, vs = attend(step, layer, q, k, v, theta=10000.0)
    with pytest.raises(JaxkvError, match=r"attend\(\.\.\., mass=True\)"):
        cache.commit(step, jnp.stack([ks, ks]), jnp.stack([vs, vs]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(max_len=64, keep=8), r"keep=8 keeps tokens that leave a window, but this is a full cache"),
        (
            dict(sink=4, window=64, keep=8, kv_quantize="int4", residual=32, keep_quantize="int2"),
            r"keep_quantize='int2' would quantise a KIVI window's tokens a second time",
        ),
        (
            dict(sink=4, window=64, keep_score="tova"),
            r"keep_score='tova' chooses the tokens of a keep tier, but keep=0 keeps none",
        ),
        (
            dict(sink=4, window=64, keep_quantize="int2"),
            r"keep_quantize='int2' is the keep tier's storage, but keep=0 keeps none",
        ),
        (
            dict(sink=4, window=64, keep=8, keep_score="lru"),
            r"keep_score='lru': expected one of recent, h2o, tova, snapkv",
        ),
        (dict(sink=4, window=64, keep=-1), r"keep"),
        (dict(max_len=64, keep_score="snapkv"), r"keep_score='snapkv' on a full cache"),
    ],
)
def test_bad_keep_specs_are_refused_by_name(kwargs, match):
    with pytest.raises(JaxkvError, match=match):
        CacheSpec(**kwargs)


def test_tier_bytes_description_and_checkpoint_round_trip(tmp_path):
    """An int2 tier of 16 slots (tiny model: L=2, K=2, H=8): codes 2 bits and one float16 scale
    and zero per token and head, for keys and values; saved and loaded leaf for leaf."""
    spec = CacheSpec(sink=2, window=8, keep=16, keep_quantize="int2", kv_quantize="fp16")
    assert spec.describe() == "sink 2 + window 8 + keep 16 recent (int2), fp16, positions=absolute"
    assert spec.capacity == 2 + 8 + 16
    assert CacheSpec(sink=2, window=8, keep=4, keep_quantize="fp16", kv_quantize="fp16").keep_quantize is None
    loaded = tiny_loaded()
    cache, _ = prefill(loaded, new_cache(spec), [tokens_for(40)], chunk=8)
    report = memory_report(cache)
    assert report.allocated["keep"] == 2 * (2 * 1 * 2 * 16 * 8 * 2 // 8) + 4 * (2 * 1 * 2 * 16 * 2)
    assert kept(cache) == list(range(40 - 8 - 16, 40 - 8))
    save_cache(tmp_path / "c.safetensors", cache)
    back, _, _ = load_cache(tmp_path / "c.safetensors", new_cache(spec))
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_per_layer_specs_keep_their_own_tier_and_snapkv_is_refused_there():
    """A run of layers with a keep tier (LayerSpecs) ranks by the mass of its own layers; SnapKV's
    observation pass needs one spec for every layer and is refused by name, not streamed."""
    from jaxkv import LayerSpecs
    from jaxkv.decode.loop import new_cache as model_cache

    loaded = tiny_loaded()
    plain = CacheSpec(sink=2, window=8)
    cache, _ = prefill(
        loaded,
        model_cache(loaded.config, LayerSpecs((CacheSpec(sink=2, window=8, keep=4, keep_score="h2o"), plain)), 1),
        [tokens_for(39)],
        chunk=8,
    )
    assert len(kept(cache.groups[0])) == 4 and cache.groups[1].keep is None
    assert int(cache.groups[0].stored()[0]) == 2 + 8 + 4 and int(cache.groups[1].stored()[0]) == 2 + 8
    snap = LayerSpecs((CacheSpec(sink=2, window=8, keep=4, keep_score="snapkv"), plain))
    with pytest.raises(JaxkvError, match="keep_score=snapkv with per-layer cache specs"):
        prefill(loaded, model_cache(loaded.config, snap, 1), [tokens_for(39)])
