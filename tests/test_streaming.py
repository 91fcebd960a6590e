"""StreamingLLM cache (DESIGN §2): sinks + circular window, both RoPE position modes.

Every logit is checked against tests/reference.py, which simulates the retained set
explicitly and attends with ranks taken from the sorted set.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import decode_loop_hlo
from reference import RefDecoder, ref_config, ref_kwargs

from jaxkv import CacheFullError, CacheSpec, JaxkvError, KVCache, Sampler, forward, prefill, sample
from jaxkv.cache.attention import RING_BLOCK
from jaxkv.io import LoadedModel
from jaxkv.testing import materialised_buffers, numpy_weights, tiny_loaded, tiny_model

PAIRS = [(0, 8), (4, 8), (4, 13), (1, 1), (2, 64)]


def new_cache(spec, batch=1, model=None):
    c = (model or tiny_model()).config
    return KVCache.create(spec, batch=batch, n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim)


# one compiled step per cache spec and chunk shape (the trace-once property is asserted on its
# own in test_decode_step_traces_once_and_donated_cache_is_aliased)
STEP = jax.jit(forward, static_argnums=0, donate_argnames="cache")


def decode(spec, tokens, model=None):
    """Token-by-token logits float32[T, V] and the final cache."""
    model = model or tiny_model()
    gd, st = nnx.split(model)
    cache = new_cache(spec, model=model)
    rows = []
    for t in tokens:
        logits, cache = STEP(gd, st, jnp.asarray([[t]], jnp.int32), jnp.asarray([1], jnp.int32), cache)
        rows.append(np.asarray(logits[0, 0]))
    return np.stack(rows), cache


def reference_logits(spec, tokens):
    model = tiny_model()
    ref = RefDecoder(numpy_weights(model), ref_config(model.config), **ref_kwargs(spec))
    return np.stack([ref.step(int(t)) for t in tokens]), ref


def tokens_for(n, seed=0):
    return np.random.default_rng(seed).integers(0, 64, n).tolist()


@pytest.mark.parametrize("positions", ["absolute", "cache"])
@pytest.mark.parametrize("sink,window", PAIRS)
def test_decode_matches_reference_across_three_wraps(sink, window, positions):
    spec = CacheSpec(sink=sink, window=window, positions=positions)
    tokens = tokens_for(sink + 3 * window + 5)
    got, cache = decode(spec, tokens)
    expected, ref = reference_logits(spec, tokens)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)
    assert (
        sorted(
            p
            for p in np.concatenate([np.asarray(cache.ring_pos[0])] + ([np.asarray(cache.sink_pos[0])] if sink else []))
            if p >= 0
        )
        == ref.stored()
    )


@pytest.mark.parametrize("kv_quantize", ["fp32", "bf16"])
def test_pre_rope_keys_in_absolute_mode_keep_the_logits(kv_quantize):
    """``pre_rope_keys`` (issue 15) stores keys before RoPE and rotates them on read at their
    absolute position: a float cache gives today's logits within float rounding (measured
    fp32: 1.5e-6 over three wraps on logits up to 2.4; bf16: rounding the unrotated key is
    another rounding, measured 1.2e-2, vs 1.6e-2 between the bf16 and fp32 caches), and fp32
    equals the reference's pre-RoPE decoder."""
    spec = CacheSpec(sink=4, window=8, kv_quantize=kv_quantize, pre_rope_keys=True)
    tokens = tokens_for(4 + 3 * 8 + 5, seed=21)
    got, _ = decode(spec, tokens)
    today, _ = decode(CacheSpec(sink=4, window=8, kv_quantize=kv_quantize), tokens)
    np.testing.assert_allclose(got, today, atol=1e-5 if kv_quantize == "fp32" else 3e-2, rtol=0)
    if kv_quantize == "fp32":
        expected, _ = reference_logits(spec, tokens)
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("positions", ["absolute", "cache"])
@pytest.mark.parametrize("sink,window,chunk", [(4, 8, 8), (4, 13, 4), (1, 1, 1), (2, 64, 16), (0, 8, 8)])
def test_chunked_prefill_equals_token_by_token(sink, window, chunk, positions, chunked):
    """A prompt several times longer than the cache streams through in chunks; every
    query's logits equal token-by-token decoding (and the reference)."""
    spec = CacheSpec(sink=sink, window=window, positions=positions)
    tokens = tokens_for(sink + 3 * window + 3, seed=1)
    got, cache_c = chunked(spec, tokens, chunk)
    expected, cache_t = decode(spec, tokens)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)
    for a, b in zip(jax.tree.leaves(cache_c), jax.tree.leaves(cache_t)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.parametrize(
    "spec",
    [CacheSpec(max_len=600), CacheSpec(sink=4, window=300, positions="cache")],
    ids=["full-600", "sink4-window300-cache"],
)
def test_prefill_reads_a_ring_longer_than_a_block_blockwise(spec, chunked):
    """A ring of more slots than RING_BLOCK is read by a prefill chunk block by block, each with
    its own softmax statistics, blocks that no query sees skipped (jaxkv.cache.attention): every
    query's logits still equal token-by-token decoding and the NumPy reference."""
    assert max(spec.max_len or 0, spec.window or 0) > RING_BLOCK
    tokens = tokens_for(560, seed=2)
    got, _ = chunked(spec, tokens, 128)
    expected, _ = decode(spec, tokens)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)
    np.testing.assert_allclose(got, reference_logits(spec, tokens)[0], atol=1e-4, rtol=0)


def expected_slots(spec, total):
    """slot -> absolute position, from DESIGN §2's ring arithmetic."""
    s0, w = spec.sink, spec.window
    slots = [-1] * (s0 + w)
    for p in range(total):
        slots[p if p < s0 else s0 + (p - s0) % w] = p
    return slots


@pytest.mark.parametrize("offset", [-1, 0, 1, 8, 9])
def test_total_lengths_land_in_right_slots(offset, chunked):
    """Total lengths W-1, W, W+1, 2W, 2W+1 (W=8, S0=4) after chunked prefill."""
    spec = CacheSpec(sink=4, window=8)
    total = spec.window + offset
    _, cache = chunked(spec, tokens_for(total), chunk=4)
    slots = np.concatenate([np.asarray(cache.sink_pos[0]), np.asarray(cache.ring_pos[0])]).tolist()
    assert slots == expected_slots(spec, total)
    assert int(cache.length[0]) == total and int(cache.stored()[0]) == min(total, 12)


def test_chunk_crossing_ring_end_is_split_at_the_wrap(chunked):
    spec = CacheSpec(sink=4, window=8)
    tokens = tokens_for(4 + 6 + 5, seed=3)
    model = tiny_model()
    gd, st = nnx.split(model)
    # fill to two slots before the ring end, then write a 5-token chunk that wraps
    _, cache = chunked(spec, tokens[:10], chunk=8)
    assert (int(cache.length[0]) - 4) % 8 == 6 and np.asarray(cache.ring_pos[0]).tolist()[6:] == [-1, -1]
    buf = jnp.asarray([tokens[10:15]], jnp.int32)
    logits, cache = STEP(gd, st, buf, jnp.asarray([5], jnp.int32), cache)
    assert np.asarray(cache.ring_pos[0]).tolist() == [12, 13, 14, 7, 8, 9, 10, 11]
    expected, cache_t = decode(spec, tokens)
    np.testing.assert_allclose(np.asarray(logits[0]), expected[10:], atol=2e-5)
    np.testing.assert_allclose(np.asarray(cache.ring_k), np.asarray(cache_t.ring_k), atol=1e-5)


@pytest.mark.parametrize("positions", ["absolute", "cache"])
def test_ragged_batch_rows_equal_rows_alone(positions):
    spec = CacheSpec(sink=4, window=8, positions=positions)
    loaded = tiny_loaded(tokenizer=False)
    model = loaded.model
    prompts = [tokens_for(3, 10), tokens_for(8 + 7, 11), tokens_for(2 * 8 + 1, 12)]
    cache, last = prefill(loaded, new_cache(spec, batch=3), prompts, chunk=8)
    gd, st = nnx.split(model)
    follow = np.asarray([tokens_for(6, 20 + b) for b in range(3)], np.int32)
    batch_logits = [np.asarray(last)]
    for j in range(6):
        logits, cache = STEP(gd, st, jnp.asarray(follow[:, j : j + 1]), jnp.ones((3,), jnp.int32), cache)
        batch_logits.append(np.asarray(logits[:, 0]))
    batch_logits = np.stack(batch_logits, axis=1)  # [B, 7, V]
    for b, p in enumerate(prompts):
        alone, _ = decode(spec, p + follow[b].tolist())
        np.testing.assert_allclose(batch_logits[b], alone[len(p) - 1 :], atol=2e-5)
    assert np.asarray(cache.length).tolist() == [9, 21, 23]


def test_decode_step_traces_once_and_donated_cache_is_aliased():
    model = tiny_model()
    gd, st = nnx.split(model)
    spec = CacheSpec(sink=2, window=5, positions="cache")

    @chex.assert_max_traces(n=1)
    def step(graphdef, state, tokens, n, cache):
        return forward(graphdef, state, tokens, n, cache)

    jitted = jax.jit(step, static_argnums=0, donate_argnames="cache")
    cache = new_cache(spec)
    for t in tokens_for(2 + 3 * 5 + 2):  # three wraps
        _, cache = jitted(gd, st, jnp.asarray([[t]], jnp.int32), jnp.asarray([1], jnp.int32), cache)
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache))
    compiled = (
        jax.jit(forward, static_argnums=0, donate_argnames="cache")
        .lower(gd, st, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), cache)
        .compile()
    )
    assert compiled.memory_analysis().alias_size_in_bytes == cache_bytes
    assert "input_output_alias" in compiled.as_text()


def test_spec_validation_errors():
    with pytest.raises(JaxkvError, match="window=0"):
        CacheSpec(sink=4, window=0)
    with pytest.raises(JaxkvError, match="sink=-1"):
        CacheSpec(sink=-1, window=8)
    with pytest.raises(JaxkvError, match="positions='rank'"):
        CacheSpec(sink=4, window=8, positions="rank")
    with pytest.raises(JaxkvError, match="needs a window"):
        CacheSpec(sink=4, max_len=16)
    with pytest.raises(JaxkvError, match="max_len"):
        CacheSpec()


def test_full_cache_refuses_to_overflow():
    loaded = tiny_loaded(tokenizer=False)
    model = loaded.model
    with pytest.raises(CacheFullError, match="max_len=8"):
        prefill(loaded, new_cache(CacheSpec(max_len=8)), [tokens_for(9)])
    # the jitted step admits only what fits: no out-of-bounds write, length stops at max_len
    gd, st = nnx.split(model)
    cache = new_cache(CacheSpec(max_len=8))
    _, cache = STEP(gd, st, jnp.zeros((1, 8), jnp.int32), jnp.asarray([6], jnp.int32), cache)
    before = np.asarray(cache.ring_k)
    _, cache = STEP(gd, st, jnp.ones((1, 8), jnp.int32), jnp.asarray([5], jnp.int32), cache)
    assert int(cache.length[0]) == 8
    np.testing.assert_array_equal(np.asarray(cache.ring_k)[..., :6, :], before[..., :6, :])


@pytest.mark.slow
@pytest.mark.parametrize("positions", ["absolute", "cache"])
def test_stories260k_streams_4000_tokens_with_bounded_cache(stories, positions):
    spec = CacheSpec(sink=4, window=252, positions=positions)
    short = sample(stories, "Once upon a time", max_new_tokens=300, cache=spec, temperature=0.8, seed=0)
    out = sample(stories, "Once upon a time", max_new_tokens=4000, cache=spec, temperature=0.8, seed=0)
    assert len(out.token_ids) == 4000, out.finish_reason
    assert out.memory.capacity == 256 and out.memory.tokens_stored == (256,)
    assert out.memory.tokens_seen[0] == len(out.prompt_ids) + len(out.token_ids) - 1
    assert out.memory.allocated == short.memory.allocated  # bytes stop growing at the cap
    assert out.memory.live_bytes == short.memory.live_bytes
    assert "stored 256 (StreamingLLM cap)" in out.report()
    words = out.text.split()
    assert len(words) > 1000 and len(set(words[-300:])) > 30  # still producing varied text at the end


def test_sample_compiles_once_per_spec_and_batch(stories):
    """Different prompts (within one power-of-two prefill bucket) and generation lengths with one
    cache spec reuse the compiled prefill and decode."""
    from jaxkv.decode import compile_counts

    spec = CacheSpec(sink=4, window=28)
    sample(stories, "Once upon a time", max_new_tokens=5, cache=spec)
    decode_before, prefill_before = compile_counts()["decode"], compile_counts()["prefill"]
    for prompt, n in (("One day, a dog", 40), ("The sun was hot", 70)):
        assert len(stories.tokenizer.encode(prompt)) <= 8
        sample(stories, prompt, max_new_tokens=n, cache=spec)
    assert compile_counts()["decode"] == decode_before
    assert compile_counts()["prefill"] == prefill_before


@pytest.mark.skipif(jax.__version_info__ < (0, 6), reason="no store below jax 0.6 (jaxkv.cli.use_compile_cache)")
def test_a_stored_decode_loop_and_prefill_chunk_are_loaded_instead_of_compiled(tmp_path, monkeypatch):
    """With an executable store (what ``jaxkv`` turns on beside JAX's compilation cache), a
    process that has not compiled a signature loads its decode loop and prefill chunk from the
    store: nothing compiles, the tokens are the compiled ones. Another cache spec is another
    file; a damaged file is compiled again (with a warning) and removed; a folder that cannot
    be written is warned about; a user's own Flax module is not stored (its code is not in the key)."""
    from jax._src import compilation_cache

    from jaxkv import generate
    from jaxkv.decode import compile_counts, loop

    monkeypatch.setattr(loop, "EXECUTABLE_STORE", str(tmp_path))
    monkeypatch.setattr(loop, "_EXECUTABLES", {})  # as a fresh process, which compiles what it runs:
    monkeypatch.setattr(compilation_cache, "_cache_checked", True)  # JAX's persistent cache off (the
    monkeypatch.setattr(compilation_cache, "_cache_used", False)  # suite's, tests/conftest.py, holds
    jax.clear_caches()  # the programs other tests compiled) and nothing compiled in memory
    model = tiny_loaded(tokenizer=False)
    kwargs = dict(max_new_tokens=12, cache=CacheSpec(sink=2, window=8), block=4)
    compiled = generate(model, [tokens_for(5)], **kwargs).token_ids
    stored = sorted(tmp_path.iterdir())
    assert [p.name.split("-")[0] for p in stored] == ["decode", "prefill"]

    loop._EXECUTABLES.clear()
    before = compile_counts()
    assert generate(model, [tokens_for(5)], **kwargs).token_ids == compiled
    assert compile_counts() == before  # loaded, not compiled

    generate(model, [tokens_for(5)], **{**kwargs, "cache": CacheSpec(sink=2, window=12)})
    assert len(list(tmp_path.iterdir())) == 4

    decode_file = stored[0]
    decode_file.write_bytes(b"not an executable")
    loop._EXECUTABLES.clear()
    with pytest.warns(UserWarning, match="compiling instead of loading"):
        assert generate(model, [tokens_for(5)], **kwargs).token_ids == compiled
    assert not decode_file.exists()  # stored again by the next process that compiles it

    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(loop, "EXECUTABLE_STORE", str(tmp_path / "a-file" / "store"))  # cannot be made
    with pytest.warns(UserWarning, match="compiled program not stored"):
        out = generate(model, [tokens_for(5)], **{**kwargs, "cache": CacheSpec(sink=2, window=16)})
    assert len(out.token_ids[0]) == 12 and out.finish_reasons == ["length"]  # decoding went on to its budget

    class Own(nnx.Module):  # a user's model class: its code could change under the same key
        pass

    assert loop._storable(model) and not loop._storable(LoadedModel(config=model.config, model=Own(), tokenizer=None))


@pytest.mark.parametrize("kv_quantize", ["fp32", "fp16", "bf16"])
def test_decode_loop_writes_the_window_in_place_and_never_copies_it(kv_quantize):
    """The only whole-window buffers the compiled decode loop writes are the in-place ring
    updates: no copy, no conversion of the window (bf16: XLA CPU converts a whole bfloat16
    operand to float32 to slice or update it, so bf16 storage is held as int16 bit patterns)."""
    model = tiny_model(head_dim=64)
    c = model.config
    spec = CacheSpec(sink=4, window=508, kv_quantize=kv_quantize)
    whole = (c.n_layers, 1, c.n_kv_heads, spec.n_ring, c.head_dim)
    buffers = [
        (name, dtype) for name, dtype, shape in materialised_buffers(decode_loop_hlo(model, spec)) if shape == whole
    ]
    assert len(buffers) == 2 and all("dynamic-update-slice" in name for name, _ in buffers), buffers  # ring_k, ring_v


@pytest.mark.parametrize(
    "stream_s,sizes",
    [(None, [8, 8, 4]), (0.0, [1] * 20), (1e9, [1, 8, 8, 3])],
    ids=["blocks", "token-by-token", "first-token-then-blocks"],
)
def test_streamed_decode_runs_every_block_size_in_one_compiled_loop(stream_s, sizes):
    """A decode of several blocks of varying step counts (``stream_s``: the first block one
    token, then as many as fit) reuses the decode loop the plain run compiled (one compile
    per signature, none per block) and samples exactly the tokens of plain blocks of 8."""
    from jaxkv import generate
    from jaxkv.decode import compile_counts

    model = tiny_loaded(tokenizer=False)
    spec = CacheSpec(sink=2, window=8)
    kwargs = dict(max_new_tokens=20, cache=spec, block=8, sampler=Sampler(temperature=0.9, top_k=20), seed=3)
    reference = generate(model, [tokens_for(5)], **kwargs).token_ids[0]
    before = compile_counts()["decode"]
    blocks = []
    got = generate(
        model, [tokens_for(5)], **kwargs, stream_s=stream_s, on_block=lambda out: blocks.append(int((out >= 0).sum()))
    )
    assert compile_counts()["decode"] == before  # the same compiled loop whatever each block's step count
    assert blocks == sizes
    assert got.token_ids[0] == reference and len(reference) == 20
