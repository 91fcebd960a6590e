"""The serving engine without HTTP (jaxkv.serve.engine): continuous batching gives every
request what jaxkv.sample gives it alone, nothing compiles after warm-up, prefixes are reused,
slots are freed on cancel, the queue is bounded."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
import textwrap
import threading

import jax
import numpy as np
import pytest

from paths import REPO, STORIES_BIN, TOK512_MODEL

import jaxkv
from jaxkv.decode import compile_counts
from jaxkv.errors import JaxkvError
from jaxkv.serve import Engine, EngineStopped, QueueFullError, SamplingParams

SPEC = jaxkv.CacheSpec(sink=4, window=60)
PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went",
    "One day, a bird",
    "The sun was",
    "Sam had a red ball",
]


@pytest.fixture(scope="module")
def engine(stories):
    engine = Engine(stories, SPEC, slots=4, max_queue=16).start()
    yield engine
    engine.shutdown(timeout=0)


def solo(model, prompt, n, spec=SPEC, **kwargs):
    """``(token ids, streamed text)`` of ``jaxkv.sample`` alone."""
    pieces = []
    out = jaxkv.sample(model, prompt, max_new_tokens=n, cache=spec, on_text=pieces.append, **kwargs)
    return out.token_ids, "".join(pieces), out.finish_reason


def test_concurrent_requests_get_their_solo_outputs_and_nothing_compiles_after_warm_up(stories, engine):
    """6 greedy and 2 sampled requests through 4 slots at once (some wait in the queue, rows
    join and leave mid-batch) each get jaxkv.sample's tokens and text; after warm-up none of
    them, whatever its length or sampling settings, compiled a program."""
    tok = stories.tokenizer
    settings = [dict()] * len(PROMPTS) + [
        dict(temperature=0.8, top_k=20, seed=7),
        dict(temperature=1.0, top_p=0.9, seed=3),
    ]
    prompts = PROMPTS + PROMPTS[:2]
    lengths = [30 + 7 * i for i in range(len(prompts))]
    before = compile_counts()
    requests = [
        engine.submit(tok.encode(p), SamplingParams(max_tokens=n, **kw)) for p, n, kw in zip(prompts, lengths, settings)
    ]
    for r in requests:
        r.result(timeout=120)
    assert compile_counts() == before
    for r, p, n, kw in zip(requests, prompts, lengths, settings):
        ids, text, reason = solo(stories, p, n, **kw)
        assert (r.token_ids, r.text) == (ids, text), p
        assert r.finish_reason == {"eos": "stop"}.get(reason, reason)


def test_a_stop_string_ends_a_request_as_sample_does(stories, engine):
    ids, text, _ = solo(stories, PROMPTS[0], 60, stop=["girl"])
    r = engine.submit(stories.tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=60, stop=("girl",))).result(60)
    assert (r.token_ids, r.text, r.finish_reason) == (ids, text, "stop") and "girl" not in r.text


def test_eos_ends_a_request_in_a_full_cache_as_sample_does(stories):
    """stories260K's own EOS never comes within a few hundred tokens: "." stands in for it (the
    same tokenizer change on both sides). ignore_eos runs through it to max_tokens."""
    tok = copy.copy(stories.tokenizer)
    tok.eos_id = tok.encode(".", add_bos=False)[-1]
    model = dataclasses.replace(stories, tokenizer=tok)
    spec = jaxkv.CacheSpec(max_len=128)
    engine = Engine(model, spec, slots=2, max_num_batched_tokens=32).start()  # warms chunks of 16, 32 only
    try:
        stopped, ignoring = (
            engine.submit(tok.encode(PROMPTS[3]), SamplingParams(max_tokens=60, ignore_eos=i)) for i in (False, True)
        )
        ids, text, reason = solo(model, PROMPTS[3], 60, spec=spec)
        assert reason == "eos" and (stopped.result(60).token_ids, stopped.text, stopped.finish_reason) == (
            ids,
            text,
            "stop",
        )
        ids, text, reason = solo(model, PROMPTS[3], 60, spec=spec, ignore_eos=True)
        assert (ignoring.result(60).token_ids, ignoring.text, ignoring.finish_reason) == (ids, text, "length")
        assert tok.eos_id in ignoring.token_ids[:-1]
    finally:
        engine.shutdown(timeout=0)


def test_a_window_below_the_smallest_prefill_bucket_prefills_in_chunks_of_the_window(stories):
    """A window of 12 (or a budget of 10 tokens a step) caps the prefill chunk below the smallest
    power-of-two bucket: the chunk is the cap itself, and greedy output is still jaxkv.sample's
    (the engine once failed to start here, its list of chunk sizes empty)."""
    spec = jaxkv.CacheSpec(sink=4, window=12)
    assert Engine(stories, SPEC, slots=1, max_num_batched_tokens=10).chunk_buckets == (10,)
    engine = Engine(stories, spec, slots=1).start()
    try:
        assert engine.chunk_buckets == (12,)
        r = engine.submit(stories.tokenizer.encode(PROMPTS[0]), SamplingParams(max_tokens=30, ignore_eos=True))
        assert r.result(60).token_ids == solo(stories, PROMPTS[0], 30, spec=spec, ignore_eos=True)[0]
    finally:
        engine.shutdown(timeout=0)


def test_prng_keys_are_made_on_the_host_as_jax_makes_them():
    for seed in (0, 1, 7, 2**31, 2**32 - 1):
        assert np.array_equal(np.array((0, seed), np.uint32), np.asarray(jax.random.PRNGKey(seed))), seed


def test_a_follow_up_turn_prefills_only_its_new_tokens_after_the_window_wrapped(stories, engine):
    """Turn 2 resends turn 1's prompt and reply (which filled the 64-slot ring several times over)
    plus a new message: its whole history but the reply's last token (sampled, never appended)
    comes from the prefix store, and its output is what a fresh run of the whole conversation gives."""
    tok = stories.tokenizer
    first = tok.encode(PROMPTS[2])
    one = engine.submit(first, SamplingParams(max_tokens=150, ignore_eos=True)).result(60)
    history = first + one.token_ids
    follow = history + tok.encode("Then", add_bos=False)
    two = engine.submit(follow, SamplingParams(max_tokens=40)).result(60)
    assert two.cached_tokens == len(history) - 1 > 2 * (SPEC.sink + SPEC.window)
    ids, _, _ = solo(stories, follow, 40)
    assert two.token_ids == ids


def test_a_shared_system_prompt_is_prefilled_once(stories, engine):
    """Two prompts sharing a long prefix: the second stores the state where they branch, so a
    third with the same prefix starts there."""
    tok = stories.tokenizer
    system = tok.encode("Once upon a time, in a small town, there lived a kind old man who loved his garden")
    tails = [tok.encode(t, add_bos=False) for t in (" and his dog.", " and the birds.", " and the sun.")]
    results = [engine.submit(system + t, SamplingParams(max_tokens=8)).result(60) for t in tails]
    assert results[0].cached_tokens < len(system)
    assert results[2].cached_tokens >= len(system)
    assert results[2].token_ids == solo(stories, system + tails[2], 8)[0]


def test_cancel_frees_the_slot_within_a_step(stories, engine):
    seen = threading.Event()
    events = []

    def on_event(e):
        events.append(e)
        seen.set()

    r = engine.submit(
        stories.tokenizer.encode(PROMPTS[1]), SamplingParams(max_tokens=100_000, ignore_eos=True), on_event=on_event
    )
    assert seen.wait(60)
    r.cancel()
    for _ in range(600):
        if r.finish_reason is not None:
            break
        threading.Event().wait(0.05)
    assert events[-1].finish_reason == "cancelled" and len(r.token_ids) < 100_000
    assert engine.stats()["busy_slots"] == 0
    again = engine.submit(stories.tokenizer.encode(PROMPTS[1]), SamplingParams(max_tokens=5)).result(60)
    assert again.token_ids == solo(stories, PROMPTS[1], 5)[0]


def test_bad_requests_are_refused_before_any_work(stories):
    engine = Engine(stories, jaxkv.CacheSpec(max_len=64), slots=1, max_queue=1, prefix_cache_bytes=0)
    ids = stories.tokenizer.encode(PROMPTS[0])
    with pytest.raises(JaxkvError, match="beyond the cache's 64 tokens"):
        engine.submit(ids, SamplingParams(max_tokens=64))
    with pytest.raises(JaxkvError, match="outside the vocabulary"):
        engine.submit([1, 512], SamplingParams(max_tokens=1))
    with pytest.raises(JaxkvError, match="at least one token"):
        engine.submit([], SamplingParams(max_tokens=1))
    for bad, field in (
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=1, temperature=float("nan")), "temperature"),
        (dict(max_tokens=1, top_p=0), "top_p"),
        (dict(max_tokens=1, top_k=0), "top_k"),
        (dict(max_tokens=1, seed=2**32), "seed"),
        (dict(max_tokens=1, stop=("",)), "stop"),
    ):
        with pytest.raises(JaxkvError, match=field):
            SamplingParams(**bad)
    first, second = (engine.submit(ids, SamplingParams(max_tokens=4)) for _ in range(2))  # a free slot + the queue
    with pytest.raises(QueueFullError, match="max_queue=1"):
        engine.submit(ids, SamplingParams(max_tokens=4))
    engine.shutdown(timeout=0)  # never started: what waits ends at once
    assert first.result(1).finish_reason == second.result(1).finish_reason == "interrupted"
    with pytest.raises(EngineStopped):
        engine.submit(ids, SamplingParams(max_tokens=4))


@pytest.mark.slow
def test_slots_shard_over_two_devices_with_a_kivi_cache():
    """2 forced host devices, slots over the mesh's data axis, an int4 KIVI window: the
    outputs are jaxkv.sample's on one device."""
    script = textwrap.dedent(f"""
        import jax, jaxkv
        from jaxkv.decode import parallel
        from jaxkv.serve import Engine, SamplingParams
        assert len(jax.devices()) == 2
        m = jaxkv.load_model({str(STORIES_BIN)!r}, tokenizer={str(TOK512_MODEL)!r})
        spec = jaxkv.CacheSpec(sink=4, window=64, kv_quantize="int4", group_size=8, residual=16)
        e = Engine(m, spec, slots=2, mesh=parallel.make_mesh(data=2)).start()
        prompts = {PROMPTS[:3]!r}
        rs = [e.submit(m.tokenizer.encode(p), SamplingParams(max_tokens=90)) for p in prompts]
        for r, p in zip(rs, prompts):
            assert r.result(120).token_ids == jaxkv.sample(m, p, max_new_tokens=90, cache=spec).token_ids, p
        assert "'data'" in str(e._cache.ring_k.sharding.spec)
        e.shutdown()
        print("ok")
    """)
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO)
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_cost_follows_busy_rows_one_request_runs_one_row(stories, engine):
    """One request on a 4-slot engine: every decode step it ran was a 1-row step (the busy rows
    compacted into the smallest compiled batch), its prefill 1-row calls."""
    prompt = "A tiny frog sat on a leaf"  # in no earlier test: nothing of it is in the prefix store
    before = engine.stats()
    r = engine.submit(stories.tokenizer.encode(prompt), SamplingParams(max_tokens=20, ignore_eos=True)).result(60)
    after = engine.stats()
    steps, rows = (after[k] - before[k] for k in ("decode_steps_total", "decode_rows_total"))
    assert len(r.token_ids) == 20 and steps == 20 and rows == 20
    calls, rows = (after[k] - before[k] for k in ("prefill_calls_total", "prefill_rows_total"))
    assert rows == calls == 2  # the sinks, then the rest (a chunk never crosses the sink boundary)
    assert r.token_ids == solo(stories, prompt, 20, ignore_eos=True)[0]


def test_every_token_is_its_own_event_unless_stream_interval_says_otherwise(stories, engine):
    """stream_interval=1 (the default): a reply of N tokens arrives in N events carrying one token
    each (the last with the finish reason); an engine with stream_interval=4 sends them 4 at a time,
    and a shutdown ends a request with the tokens it had not yet sent."""
    events = []
    ids = stories.tokenizer.encode(PROMPTS[5])
    r = engine.submit(ids, SamplingParams(max_tokens=13, ignore_eos=True), on_event=events.append)
    for _ in range(1200):
        if r.finish_reason is not None:
            break
        threading.Event().wait(0.05)
    assert [len(e.token_ids) for e in events] == [1] * 13 and events[-1].finish_reason == "length"
    assert "".join(e.text for e in events) == solo(stories, PROMPTS[5], 13, ignore_eos=True)[1]
    coarse = Engine(stories, SPEC, slots=1, stream_interval=4).start()
    try:
        got = list(coarse.submit(ids, SamplingParams(max_tokens=13, ignore_eos=True)).events(60))
        assert [len(e.token_ids) for e in got] == [4, 4, 4, 1]
        assert sum((e.token_ids for e in got), []) == r.token_ids
        # a shutdown ends a row with the tokens it had not yet sent in its last event
        coarse.stream_interval = 10_000  # no event before the end
        long = coarse.submit(ids, SamplingParams(max_tokens=2000, ignore_eos=True))
        while coarse.stats()["completion_tokens_total"] <= 13:
            threading.Event().wait(0.01)
    finally:
        coarse.shutdown(timeout=0)
    sampled = coarse.stats()["completion_tokens_total"] - 13
    assert long.finish_reason == "interrupted" and 0 < len(long.token_ids) == sampled < 2000
    assert (long.token_ids, long.text) == solo(stories, PROMPTS[5], sampled, ignore_eos=True)[:2]


def test_a_prompt_arriving_while_others_decode_starts_within_a_step(stories, engine):
    """A request submitted while another decodes (from inside that one's token delivery, so the
    moment is exact) samples its first token at most two decode steps later: the decode call
    running ends after its step, the next step prefills the prompt and decodes it."""
    tok = stories.tokenizer
    marks = {}

    def on_long(e):
        if len(marks) == 0 and e.completion_tokens == 10:
            marks["submitted"] = engine.stats()["decode_steps_total"]
            marks["late"] = engine.submit(tok.encode(PROMPTS[0]), SamplingParams(max_tokens=5), on_event=on_late)

    def on_late(e):
        if "first" not in marks and e.token_ids:
            marks["first"] = engine.stats()["decode_steps_total"]

    long = engine.submit(tok.encode(PROMPTS[1]), SamplingParams(max_tokens=200, ignore_eos=True), on_event=on_long)
    for _ in range(1200):
        if long.finish_reason is not None and "late" in marks and marks["late"].finish_reason is not None:
            break
        threading.Event().wait(0.05)
    assert marks["first"] - marks["submitted"] <= 2, marks
    assert marks["late"].token_ids == solo(stories, PROMPTS[0], 5)[0]
