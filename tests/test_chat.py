"""Endless chat (issue 9): ChatSession turns over one cache, save/resume, and `jaxkv chat`.

Fast tests use stories260K (tok512 SentencePiece) with a ChatML-like template written with
its control tokens (``<s>role\\n...</s>\\n``); stories260K never emits ``</s>`` (llama2.c
trained it with BOS separators only), so :func:`stories_chat` can also give it a twin
whose EOS embedding row is 1.2x the row of ``.``: a model that ends its reply where it
would end a sentence, to exercise EOS-terminated turns. SmolLM2 (ChatML from its GGUF)
runs one short slow test.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

from paths import REPO, SMOLLM2, STORIES_BIN, TOK512_MODEL
from reference import RefDecoder, ref_config, ref_kwargs

from jaxkv import CacheFullError, CacheSpec, ChatSession, JaxkvError, LoadedModel, Sampler, generate, load_model
from jaxkv.decode.chat import default_cache_spec
from jaxkv.models.llama import Llama
from jaxkv.testing import numpy_weights, tiny_model

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
PERIOD = 426  # tok512's "."
FULL = CacheSpec(max_len=400)
SPEC16 = CacheSpec(sink=4, window=16)
STREAMING = CacheSpec(
    sink=4, window=60, positions="cache"
)  # also what `jaxkv chat --streaming-llm-sink 4 --streaming-llm-window 60` builds
# float32 scales, as when this test was written (RefDecoder matches float16 ones too: see test_kivi_cache)
KIVI = CacheSpec(
    sink=4, window=60, kv_quantize="int4", group_size=4, residual=8, scale_dtype="float32", positions="cache"
)


class Interrupted(BaseException):
    """Stands for KeyboardInterrupt (which would also stop pytest) in the interruption tests."""


MESSAGES = ["Hello there", "Tell me a story about a cat", "Why is the sky blue?", "What happened next?", "Thank you"]


@functools.cache
def stories_chat(stops: bool = False) -> LoadedModel:
    """stories260K with TEMPLATE as its chat template (``stops``: EOS row = 1.2 x the "." row)."""
    loaded = load_model(STORIES_BIN, tokenizer=TOK512_MODEL)
    tok = copy.copy(loaded.tokenizer)
    tok.chat_template = TEMPLATE
    model = loaded.model
    if stops:
        w = numpy_weights(loaded.model)
        w["embed"] = w["embed"].copy()
        w["embed"][tok.eos_id] = 1.2 * w["embed"][PERIOD]
        model = Llama.from_weights(loaded.config, w)
    return dataclasses.replace(loaded, model=model, tokenizer=tok)


def expected_transcript(session: ChatSession, users, replies, reasons) -> list[int]:
    """The conversation's ids as the chat template writes it: the template rendered once over
    the whole conversation (replies as placeholders), each piece between replies tokenised,
    the replies' own ids in between (a stopping EOS stands for the template's closing marker)."""
    tok = session.model.tokenizer
    msgs = [] if session.system is None else [{"role": "system", "content": session.system}]
    for k, user in enumerate(users):
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": f"@@REPLY{k}@@"}]
    pieces = re.split(r"@@REPLY\d+@@", tok.apply_chat_template(msgs, add_generation_prompt=False))
    bos = tok.id_to_token(tok.bos_id)
    ids = tok.encode(pieces[0], add_bos=tok.add_bos and not pieces[0].startswith(bos))
    for k, (reply, reason) in enumerate(zip(replies, reasons)):
        last = k == len(replies) - 1
        ids += reply if last or reason != "eos" else reply[:-1]
        if not last:
            ids += tok.encode(pieces[k + 1], add_bos=False)
    return ids


def converse(session, messages):
    """Send ``messages``; per turn: reply ids, finish reason, stats, index of the reply in the transcript."""
    replies, reasons, stats, starts = [], [], [], []
    for m in messages:
        session.send(m)
        replies.append(session.last_reply_ids)
        reasons.append(session.finish_reason)
        stats.append(session.stats())
        starts.append(len(session.transcript_ids) - len(session.last_reply_ids))
    return replies, reasons, stats, starts


@pytest.fixture(scope="module")
def jax_cache():
    """Environment for subprocesses: CPU, and (jax >= 0.6) the suite's persistent compilation
    cache (tests/conftest.py), so that these processes compile each shape once. jax 0.5.0's CPU
    executables reloaded from that cache decode garbage here (the resumed chat printed only
    <unk>), so the floor runs without it."""
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


# ------------------------------------------------------------------ 1. full cache = from scratch


@pytest.mark.parametrize("stops", [False, True], ids=["length", "eos"])
def test_three_turns_full_cache_equal_decoding_the_transcript_from_scratch(stops):
    """Each reply equals greedy decoding, from an empty cache, of the transcript up to it; the
    transcript is exactly the template's (EOS-stopped replies: the EOS is the closing marker)."""
    model = stories_chat(stops)
    session = ChatSession(model, FULL, max_new_tokens=24)
    replies, reasons, _, starts = converse(session, MESSAGES[:3])
    if stops:
        assert reasons.count("eos") >= 2, reasons
    else:
        assert set(reasons) == {"length"}
    transcript = session.transcript_ids
    assert transcript == expected_transcript(session, MESSAGES[:3], replies, reasons)
    assert transcript[:2] == [1, 318]  # the template's own <s>, no extra BOS
    assert session.tokens_seen == len(transcript) - 1 and session.pending_token == transcript[-1]
    for reply, start in zip(replies, starts):
        scratch = generate(model, [transcript[:start]], max_new_tokens=24, cache=FULL, block=8)
        assert scratch.token_ids[0] == reply
    assert session.messages[1]["content"] == model.tokenizer.decode(
        replies[0][:-1] if reasons[0] == "eos" else replies[0]
    )


def test_turn_rendering_bos_and_no_repeated_system_prompt():
    """A template that does not write BOS gets the tokenizer's BOS on the first turn only; a
    template's default system prompt (as SmolLM2's) appears once; a system message once."""
    no_bos = "{% if messages[0]['role'] != 'system' %}sys: default\n{% endif %}" + TEMPLATE.replace("<s>", "")
    session = ChatSession(stories_chat(), FULL, chat_template=no_bos, max_new_tokens=2)
    tok = session.model.tokenizer
    first = session.turn_ids("Hi")
    assert first[0] == tok.bos_id and first[1] != tok.bos_id
    assert first == tok.encode("sys: default\nuser\nHi</s>\nassistant\n", add_bos=True)
    session.send("Hi")
    second = session.turn_ids("Again")
    assert tok.bos_id not in second[1:] and second[0] == session.pending_token
    assert second[1:] == tok.encode("</s>\nuser\nAgain</s>\nassistant\n", add_bos=False)
    with_system = ChatSession(stories_chat(), FULL, system="Be brief.", max_new_tokens=2)
    with_system.send("Hi")
    assert with_system.turn_ids("Again")[1:] == tok.encode("</s>\n<s>user\nAgain</s>\n<s>assistant\n", add_bos=False)
    assert with_system.messages[0] == {"role": "system", "content": "Be brief."}


# ---------------------------------------------------- 2. thirty turns over a bounded cache


@pytest.mark.parametrize(
    "spec",
    [CacheSpec(sink=4, window=60), STREAMING, KIVI],
    ids=["fp32-absolute", "fp32-cache", "int4-cache"],
)
def test_thirty_turns_stay_under_the_cap_and_match_the_reference(spec):
    """30 scripted turns: stored tokens never exceed the cap; the last turn's logits equal the
    NumPy RefDecoder (DESIGN §2 retained set, simulated) fed the whole transcript token by token."""
    model = stories_chat()
    session = ChatSession(model, spec, max_new_tokens=6)
    script = [f"{MESSAGES[i % len(MESSAGES)]} {i}" for i in range(30)]
    replies, _, stats, starts = converse(session, script)
    cap = spec.sink + spec.window + (spec.residual if spec.quantized else 0)
    assert all(s.tokens_stored <= cap == s.capacity for s in stats)
    assert stats[-1].tokens_seen > 8 * cap and stats[-1].tokens_stored > spec.sink + spec.window // 2
    if not spec.quantized:
        assert [s.tokens_stored for s in stats] == [min(s.tokens_seen, cap) for s in stats]
    ref = RefDecoder(numpy_weights(model.model), ref_config(model.config), **ref_kwargs(spec))
    for t in session.transcript_ids[: starts[-1]]:
        logits = ref.step(t)
    np.testing.assert_allclose(session.last_logits, logits, atol=1e-4, rtol=0)
    assert int(np.argmax(logits)) == replies[-1][0]


# ------------------------------------------------------------------------- 3. save / resume

RESUME_SAMPLER = Sampler(temperature=0.9, top_k=40)


def resumed_in_new_process(path, messages, jax_cache):
    code = (
        "import json, sys\n"
        "from jaxkv import ChatSession, load_model\n"
        "model = load_model(sys.argv[1], tokenizer=sys.argv[2])\n"  # stories_chat(): the template passed here
        "s = ChatSession.load(sys.argv[3], model, chat_template=sys.argv[4])\n"
        "for m in json.loads(sys.argv[5]): s.send(m)\n"
        "print(json.dumps(dict(transcript=s.transcript_ids, turns=s.stats().turns)))\n"
    )
    argv = [str(STORIES_BIN), str(TOK512_MODEL), str(path), TEMPLATE, json.dumps(messages)]
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300, env=jax_cache
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_save_after_turn_two_resume_in_a_new_process_continues_identically(tmp_path, jax_cache):
    """Sampling at temperature 0.9 (so the PRNG position must be restored too), an int4
    StreamingLLM cache that has wrapped: the resumed process produces the same tokens."""
    path = tmp_path / "chat.safetensors"
    session = ChatSession(stories_chat(), KIVI, sampler=RESUME_SAMPLER, seed=7, max_new_tokens=24)
    converse(session, MESSAGES[:2])
    assert session.tokens_seen > KIVI.capacity
    session.save(path)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    converse(session, MESSAGES[2:4])
    resumed = resumed_in_new_process(path, MESSAGES[2:4], jax_cache)
    assert resumed == dict(transcript=session.transcript_ids, turns=4)


def test_load_restores_everything_in_process(tmp_path):
    path = tmp_path / "chat.safetensors"
    session = ChatSession(
        stories_chat(True), CacheSpec(sink=4, window=16, kv_quantize="bf16"), system="Be kind.", max_new_tokens=12
    )
    converse(session, MESSAGES[:2])
    session.save(path)
    loaded = ChatSession.load(path, stories_chat(True))
    for attr in (
        "spec",
        "system",
        "messages",
        "transcript_ids",
        "pending_token",
        "finish_reason",
        "last_reply_ids",
        "seed",
    ):
        assert getattr(loaded, attr) == getattr(session, attr), attr
    assert loaded.stats() == session.stats()
    for a, b in zip(jax.tree.leaves(loaded.cache), jax.tree.leaves(session.cache)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert loaded.send("More") == session.send("More")
    session.reset()  # an empty session saves and loads too
    session.save(path)
    assert ChatSession.load(path, stories_chat(True)).stats().tokens_seen == 0


def test_load_refuses_other_models_specs_and_damaged_files(tmp_path):
    path = tmp_path / "chat.safetensors"
    model = stories_chat()
    session = ChatSession(model, SPEC16, max_new_tokens=4)
    session.send("Hello")
    session.save(path)
    blob = path.read_bytes()

    w = numpy_weights(model.model)
    w["wq"] = w["wq"] * 1.01
    retrained = dataclasses.replace(model, model=Llama.from_weights(model.config, w))
    with pytest.raises(JaxkvError, match=r"saved for another model \(weights_sha256 differ"):
        ChatSession.load(path, retrained)
    tiny = tiny_model()
    with pytest.raises(JaxkvError, match=r"another model \(config, weights_sha256 differ.*n_layers"):
        ChatSession.load(path, LoadedModel(config=tiny.config, model=tiny, tokenizer=model.tokenizer))
    with pytest.raises(JaxkvError, match="another model.*tokenizer"):
        ChatSession.load(path, model, chat_template=TEMPLATE + " ")
    with pytest.raises(JaxkvError, match=r"another cache spec \(sink 4 \+ window 16.*asked for \(sink 4 \+ window 32"):
        ChatSession.load(path, model, cache=CacheSpec(sink=4, window=32))

    damaged = tmp_path / "damaged.safetensors"
    for cut in (len(blob) // 2, len(blob) - 1, 100, 5, 0):
        damaged.write_bytes(blob[:cut])
        with pytest.raises(JaxkvError, match="truncated/corrupt") as e:
            ChatSession.load(damaged, model)
        assert str(damaged) in str(e.value)
    flipped = bytearray(blob)
    flipped[-7] ^= 0x40
    damaged.write_bytes(bytes(flipped))
    with pytest.raises(JaxkvError, match="checksum mismatch"):
        ChatSession.load(damaged, model)
    import safetensors.numpy

    safetensors.numpy.save_file({"x": np.zeros(3, np.float32)}, str(damaged))
    with pytest.raises(JaxkvError, match="not a jaxkv chat cache file"):
        ChatSession.load(damaged, model)
    with pytest.raises(JaxkvError, match="no such chat cache file"):
        ChatSession.load(tmp_path / "missing.safetensors", model)
    assert ChatSession.load(path, model).transcript_ids == session.transcript_ids


@pytest.mark.parametrize("storage", ["fp32", "int4", "bf16"])
def test_jaxkv_chat_2_files_written_before_the_checkpoint_module_still_load(tmp_path, storage):
    """tests/data/chat-v2-*.chat (safetensors files) were written by ChatSession.save as of 5cfd819 (before the
    save/load moved to jaxkv.cache.checkpoint): they load, continue identically, and re-save the
    same arrays and metadata (checksum included): their caches have no empty slot, so they stay
    jaxkv-chat/2, except the int4 one, whose residual holds 1 of its 8 tokens: re-saved, its
    ring_pos is stored as its live prefix (jaxkv-chat/3), all else as it was."""
    import safetensors

    golden = REPO / "tests" / "data" / f"chat-v2-{storage}.chat"
    expected = json.loads((REPO / "tests" / "data" / "chat-v2-expected.json").read_text())[storage]
    session = ChatSession.load(golden, stories_chat())
    assert session.transcript_ids == expected["transcript"]
    session.save(tmp_path / "again.safetensors")
    for_both = []
    for path in (golden, tmp_path / "again.safetensors"):
        with safetensors.safe_open(str(path), framework="np") as f:
            for_both.append((f.metadata(), {k: f.get_tensor(k) for k in f.keys()}))
    if storage == "int4":
        (meta, arrays), (again_meta, again) = for_both
        assert again_meta.pop("format") == "jaxkv-chat/3" and meta.pop("format") == "jaxkv-chat/2"
        assert json.loads(again_meta.pop("prefixes")) == {"cache.ring_pos": [1, 2**32 - 1]}  # -1 beyond slot 0
        assert (
            again.pop("cache.ring_pos").tolist() == [[60]] and arrays.pop("cache.ring_pos")[0, 1:].tolist() == [-1] * 7
        )
        del meta["checksum"], again_meta["checksum"]
    for_both = [(meta, {k: a.tobytes() for k, a in arrays.items()}) for meta, arrays in for_both]
    assert for_both[0] == for_both[1]
    reloaded = ChatSession.load(tmp_path / "again.safetensors", stories_chat())
    for a, b in zip(jax.tree.leaves(reloaded.cache), jax.tree.leaves(session.cache)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert session.send("More") == expected["next"]
    stats = session.stats()  # the spec's repr grows with later CacheSpec fields: compare the spec as one
    assert str(dataclasses.replace(stats, spec=None)) == expected["stats"].split(", spec=")[0] + ", spec=None)"
    assert repr(stats.spec).startswith(expected["stats"].split(", spec=")[1].rstrip(")"))


def test_cache_checkpoint_round_trips_any_cache_and_refuses_mismatches(tmp_path):
    from jaxkv.cache.checkpoint import load_cache, save_cache
    from jaxkv.decode import new_cache, prefill

    loaded = stories_chat()
    for spec in (SPEC16, KIVI, CacheSpec(max_len=64, kv_quantize="bf16")):
        cache, _ = prefill(loaded, new_cache(loaded.config, spec, 2), [[1, 5, 9] * 9, [1, 7]])
        path = tmp_path / "cache.safetensors"
        save_cache(path, cache, {"note": "hi"}, arrays={"extra": np.arange(3, dtype=np.int32)})
        assert os.stat(path).st_mode & 0o777 == 0o600
        back, arrays, meta = load_cache(path, new_cache(loaded.config, spec, 2))
        assert meta["note"] == "hi" and meta["format"] == "jaxkv-cache/1" and list(arrays) == ["extra"]
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(cache)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        with pytest.raises(JaxkvError, match="another cache spec"):
            load_cache(path, new_cache(loaded.config, CacheSpec(sink=4, window=32), 2))
        with pytest.raises(JaxkvError, match="expected"):  # one row, not two
            load_cache(path, new_cache(loaded.config, spec, 1))
        with pytest.raises(JaxkvError, match="not a jaxkv cache file"):
            load_cache(path, cache, file_format="jaxkv-other/1")


def test_cache_checkpoint_live_prefixes_round_trip_bit_for_bit(tmp_path):
    """With a prefix_format, leaves are stored up to their last slot that is not an empty slot's
    value (along the axis that saves most): float, KIVI (codes, group scales), full and per-layer
    caches of ragged rows read back bit for bit; a cache with no empty slot keeps the whole format."""
    import safetensors

    from jaxkv.cache.checkpoint import load_cache, save_cache
    from jaxkv.cache.spec import LayerSpecs
    from jaxkv.decode import new_cache, prefill

    loaded = stories_chat()
    layered = LayerSpecs((CacheSpec(window=8, sink=0),) * 2 + (SPEC16,) * 3)
    prompts = [[1, 5, 9, 3, 8, 2, 7, 4, 6, 5, 9, 3, 8, 2, 7], [1, 7]]
    for spec in (SPEC16, KIVI, CacheSpec(max_len=64, kv_quantize="bf16"), layered):
        cache, _ = prefill(loaded, new_cache(loaded.config, spec, 2), prompts)
        path = tmp_path / "cache.safetensors"
        save_cache(path, cache, prefix_format="jaxkv-cache/2")
        with safetensors.safe_open(str(path), framework="np") as f:
            meta, stored = f.metadata(), {k: f.get_tensor(k).size for k in f.keys()}
        assert meta["format"] == "jaxkv-cache/2" and json.loads(meta["prefixes"])
        assert sum(stored.values()) < sum(np.asarray(x).size for x in jax.tree.leaves(cache)) * 3 // 4, stored
        back, _, _ = load_cache(path, new_cache(loaded.config, spec, 2), prefix_format="jaxkv-cache/2")
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(cache), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b))
        with pytest.raises(JaxkvError, match=r"format 'jaxkv-cache/2', expected 'jaxkv-cache/1'\)$"):
            load_cache(path, new_cache(loaded.config, spec, 2))
    full, _ = prefill(loaded, new_cache(loaded.config, SPEC16, 1), [list(range(1, 30))])
    save_cache(tmp_path / "full.safetensors", full, prefix_format="jaxkv-cache/2")
    save_cache(tmp_path / "whole.safetensors", full)
    files = []
    for name in ("full", "whole"):
        with safetensors.safe_open(str(tmp_path / f"{name}.safetensors"), framework="np") as f:
            files.append((f.metadata(), {k: f.get_tensor(k).tobytes() for k in f.keys()}))
    assert files[0] == files[1] and files[0][0]["format"] == "jaxkv-cache/1"


@pytest.mark.parametrize("kv_quantize", ["fp32", "int4"])
def test_a_short_chat_file_holds_its_live_slots_only_and_resumes_identically(tmp_path, kv_quantize):
    """The default chat cache (sink 4 + window 508 here; 1,024 slots for SmolLM2) after two short
    turns: the file (jaxkv-chat/3) grows with the tokens held, not the slots, and reads back
    bit for bit (every leaf), so the resumed chat continues identically."""
    model = stories_chat()
    spec = default_cache_spec(model.config, kv_quantize=kv_quantize)
    session = ChatSession(model, spec, max_new_tokens=8)
    converse(session, MESSAGES[:2])
    path = tmp_path / "chat.safetensors"
    session.save(path)
    held = session.stats().tokens_stored
    c = model.config
    per_token = c.n_layers * c.n_kv_heads * c.head_dim * 4 * 2  # float32 keys and values
    assert 30 < held == session.tokens_seen < 100
    assert path.stat().st_size < held * per_token + 16 * 1024 < spec.capacity * per_token // 4
    import safetensors

    with safetensors.safe_open(str(path), framework="np") as f:
        assert f.metadata()["format"] == "jaxkv-chat/3"
    loaded = ChatSession.load(path, model)
    for a, b in zip(jax.tree.leaves(loaded.cache), jax.tree.leaves(session.cache), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b))
    assert loaded.send("More") == session.send("More")
    assert loaded.transcript_ids == session.transcript_ids


def test_a_used_up_full_cache_saves_and_loads(tmp_path):
    """A reply stopped by a full cache: the cache holds every token but the pending one, as after any turn."""
    session = ChatSession(stories_chat(), CacheSpec(max_len=40), max_new_tokens=100)
    session.send("Hello there")
    assert session.finish_reason == "cache_full" and session.tokens_seen == 40 == len(session.transcript_ids) - 1
    session.save(tmp_path / "full.safetensors")
    assert ChatSession.load(tmp_path / "full.safetensors", stories_chat()).transcript_ids == session.transcript_ids


GOLDEN_FP32 = REPO / "tests" / "data" / "chat-v2-fp32.chat"  # sink 4 + window 16, 61 tokens in the cache, 2 turns


DELETE = object()


def craft(path, *, state=None, meta=None, tensors=None, source=GOLDEN_FP32):
    """A copy of the chat file ``source`` with ``state`` fields, metadata entries or tensors replaced
    (by a value, or a function of the old one; DELETE deletes the entry), its checksum recomputed
    so that it passes."""
    import safetensors.numpy

    from jaxkv.cache.checkpoint import _checksum

    with open(source, "rb") as f:
        blob = f.read()
    header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
    arrays = dict(safetensors.numpy.load(blob))
    if state is not None:
        fields = json.loads(header["state"])
        header["state"] = json.dumps({k: v for k, v in {**fields, **state}.items() if v is not DELETE})
    for entries, new in ((header, meta or {}), (arrays, tensors or {})):
        for key, value in new.items():
            if value is DELETE:
                del entries[key]
            else:
                entries[key] = value(entries[key]) if callable(value) else value
    arrays = {k: np.ascontiguousarray(a) for k, a in arrays.items()}
    header["checksum"] = _checksum(arrays, header)
    with open(path, "wb") as f:
        f.write(safetensors.numpy.save(arrays, metadata=header))
    return path


def edited(index, value):
    """A tensor edit for :func:`craft`: a copy of the tensor with ``value`` at ``index``."""

    def edit(a):
        a = a.copy()
        a[index] = value
        return a

    return edit


CRAFTED = {  # a valid checksum, and one field that no chat file holds -> the message after "corrupt jaxkv chat ... file ("
    "no-state-key": ({"state": {"turns": DELETE}}, "state has no 'turns'"),
    "unknown-state-key": ({"state": {"mood": "happy"}}, "state has an unknown field 'mood'"),
    "no-model": ({"meta": {"model": DELETE}}, "no 'model' entry"),
    "model-list": ({"meta": {"model": "[1, 2]"}}, "model: expected a JSON object, got [1, 2]"),
    "no-spec": ({"meta": {"spec": DELETE}}, "no 'spec' entry"),
    "spec-list": ({"meta": {"spec": "[4, 16]"}}, "spec: expected a JSON object of CacheSpec fields, got [4, 16]"),
    "negative-turns": ({"state": {"turns": -1}}, "state.turns=-1: expected an integer >= 0"),
    "pending-not-last": ({"state": {"pending": 7}}, "state.pending=7 is not the last of state.last_reply_ids"),
    "not-started": ({"state": {"turns": 0}}, "state.turns=0 with pending=261, finish_reason='length' and 6"),
    "transcript-before-any-turn": (
        {"state": {"turns": 0, "pending": None, "finish_reason": None, "last_reply_ids": [], "messages": []}},
        "state.turns=0 with a transcript of 62 tokens",
    ),
    "roles": ({"state": {"messages": [{"role": "user", "content": "Hi"}]}}, 'state.messages: roles ["user"], expected'),
    "sampler": ({"state": {"sampler": {"temperature": -1}}}, "state.sampler: temperature=-1: expected a finite number"),
    "negative-length": (
        {"tensors": {"cache.length": np.array([-5], np.int32)}},
        "cache.length = [-5]: a negative token count",
    ),
    "length-vs-transcript": (
        {"tensors": {"cache.length": np.array([70], np.int32)}},
        "the cache holds 70 tokens, expected 61: the transcript's 62 less the pending last token",
    ),
    "position-out-of-range": (
        {"tensors": {"cache.ring_pos": edited((0, 0), 999)}},
        "cache.ring_pos[0, 0] = 999: expected -1 (empty) or a position in [4, 61) (row 0 holds 61 tokens)",
    ),
    "later-token-in-a-sink": (
        {"tensors": {"cache.sink_pos": edited((0, 3), 40)}},
        "cache.sink_pos[0, 3] = 40: expected -1 (empty) or a position in [0, 4)",
    ),
    "position-twice": ({"tensors": {"cache.ring_pos": edited((0, 1), 52)}}, "position 52 is stored 2 times in row 0"),
    "nan-value": (
        {"tensors": {"cache.sink_v": edited((2, 0, 1, 3, 5), np.nan)}},
        "cache.sink_v holds 1 non-finite value (NaN or infinity) of 640, the first at index [2, 0, 1, 3, 5])",
    ),
    "wrong-dtype": (
        {"tensors": {"cache.ring_pos": lambda a: a.astype(np.int64)}},
        "cache.ring_pos is int64[1, 16], expected int32[1, 16]",
    ),
    "wrong-shape": (
        {"tensors": {"cache.ring_k": lambda a: a[:, :, :, :15]}},
        "cache.ring_k is float32[5, 1, 4, 15, 8], expected float32[5, 1, 4, 16, 8]",
    ),
    "token-id": ({"tensors": {"transcript": edited(3, 9999)}}, "token id 9999"),
    "unknown-prefix": (
        {"meta": {"format": "jaxkv-chat/3", "prefixes": '{"cache.nope": [1, 0]}'}},
        "prefixes: 'cache.nope' is not an array of the cache",
    ),
    "prefix-too-long": (
        {"meta": {"format": "jaxkv-chat/3", "prefixes": '{"cache.ring_pos": [1, 4294967295]}'}},
        "cache.ring_pos is int32[1, 16], expected a prefix along axis 1 of int32[1, 16]",
    ),
    "prefix-fill": (
        {
            "meta": {"format": "jaxkv-chat/3", "prefixes": '{"cache.ring_pos": [1, 4294967296]}'},
            "tensors": {"cache.ring_pos": lambda a: a[:, :3]},
        },
        "prefixes: cache.ring_pos: fill 4294967296 does not fit its 4 bytes",
    ),
    "prefixes-without-format": (
        {"meta": {"format": "jaxkv-chat/3"}},
        "format 'jaxkv-chat/3' without its 'prefixes' entry",
    ),
}


@pytest.mark.jax_independent
@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_cli_refuses_a_crafted_chat_file_in_one_line_naming_the_field(tmp_path, capsys, case):
    """Each file passes the checksum; ``jaxkv chat --cache-file`` exits 2 with one line naming the
    field, reads no message, and leaves the file as it was."""
    from jaxkv.cli import main

    edits, message = CRAFTED[case]
    path = craft(tmp_path / f"{case}.chat", **edits)
    before = path.read_bytes()
    assert main(["chat", *STORIES_CHAT_ARGV, "--tokens", "3", "--cache-file", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith(f"jaxkv: error: {path}: corrupt jaxkv chat"), err
    assert message in err and "Traceback" not in err, err
    assert path.read_bytes() == before and os.listdir(tmp_path) == [path.name]


@pytest.mark.jax_independent
def test_the_console_script_refuses_a_crafted_chat_file(tmp_path, jax_cache):
    path = craft(tmp_path / "negative.chat", tensors={"cache.length": np.array([-5], np.int32)})
    before = path.read_bytes()
    out = run_chat(jax_cache, *STORIES_CHAT_ARGV, "--cache-file", str(path), stdin="Hello\n")
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == (
        f"jaxkv: error: {path}: corrupt jaxkv chat cache file (cache.length = [-5]: a negative token count)\n"
    )
    assert path.read_bytes() == before and os.listdir(tmp_path) == [path.name]


def test_another_model_is_named_in_one_short_line(tmp_path):
    tiny = tiny_model()
    other = LoadedModel(config=tiny.config, model=tiny, tokenizer=stories_chat().tokenizer)
    with pytest.raises(JaxkvError) as e:
        ChatSession.load(GOLDEN_FP32, other, chat_template=TEMPLATE)
    message = str(e.value)
    assert "\n" not in message and len(message) < 500, message
    assert re.fullmatch(
        f"{re.escape(str(GOLDEN_FP32))} was saved for another model \\(config, weights_sha256 differ: config.dim: file 64, "
        "this model 32; config.hidden_dim: file 172, this model 48; config.max_seq_len: file 512, this model 2048; "
        "config.n_heads: file 8, this model 4; config.n_kv_heads: file 4, this model 2; config.n_layers: file 5, this "
        "model 2; and 2 more\\): load it with the model it was written for, or delete it to start over",
        message,
    )


def test_checkpoint_refuses_a_full_cache_holding_more_than_max_len(tmp_path):
    from jaxkv.cache.checkpoint import load_cache, save_cache
    from jaxkv.decode import new_cache, prefill

    model = stories_chat()
    spec = CacheSpec(max_len=16)
    cache, _ = prefill(model, new_cache(model.config, spec, 1), [[1, 5, 9]])
    save_cache(tmp_path / "ok.safetensors", cache)
    save_cache(tmp_path / "over.safetensors", cache.replace(length=cache.length + 14))
    assert int(load_cache(tmp_path / "ok.safetensors", new_cache(model.config, spec, 1))[0].length[0]) == 3
    with pytest.raises(
        JaxkvError,
        match=r"over.safetensors: corrupt jaxkv cache file \(cache.length = \[17\]: more tokens "
        r"than the full cache's max_len=16\)$",
    ):
        load_cache(tmp_path / "over.safetensors", new_cache(model.config, spec, 1))


@pytest.mark.parametrize("fail", ["replace", "fsync"])
def test_an_interrupted_save_leaves_the_previous_file(tmp_path, monkeypatch, fail):
    path = tmp_path / "chat.safetensors"
    session = ChatSession(stories_chat(), SPEC16, max_new_tokens=4)
    session.send("Hello")
    session.save(path)
    session.send("Again")

    def boom(*args):
        raise Interrupted

    monkeypatch.setattr(os, fail, boom)
    with pytest.raises(Interrupted):
        session.save(path)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.safetensors"]  # no temporary left behind
    assert ChatSession.load(path, stories_chat()).stats().turns == 1


# ----------------------------------------------------------------- 4. limits and robustness


def test_a_full_cache_runs_out_with_a_clear_error_and_reset_starts_over():
    model = stories_chat()
    session = ChatSession(model, FULL, max_new_tokens=500)
    first = session.send("Hello there")
    assert session.finish_reason == "cache_full" and session.tokens_seen == 400
    with pytest.raises(CacheFullError, match=r"max_len=400.*/reset.*--streaming-llm-window"):
        session.send("More")
    assert session.tokens_seen == 400 and session.stats().turns == 1  # unchanged
    session.reset()
    assert session.stats().tokens_seen == 0 and session.messages == []
    assert session.send("Hello there") == first


def test_an_interrupted_turn_leaves_the_session_as_before():
    session = ChatSession(stories_chat(), SPEC16, max_new_tokens=20)
    session.send("Hello")
    before = (session.transcript_ids, session.stats())

    def interrupt(piece):
        raise Interrupted

    with pytest.raises(Interrupted):
        session.send("Again", on_text=interrupt)
    assert (session.transcript_ids, session.stats()) == before
    pieces = []
    text = session.send("Again", on_text=pieces.append)
    assert "".join(pieces) == text and len(pieces) > 1
    fresh = ChatSession(stories_chat(), SPEC16, max_new_tokens=20)
    fresh.send("Hello")
    assert fresh.send("Again") == text


def test_defaults_and_argument_errors():
    model = stories_chat()
    assert ChatSession(model).spec == CacheSpec(sink=4, window=508, positions="cache")  # 512-token context
    smol = dataclasses.replace(model.config, max_seq_len=8192)
    assert default_cache_spec(smol) == CacheSpec(sink=4, window=1020, positions="cache")
    q = default_cache_spec(smol, kv_quantize="int4")
    assert q.window % q.group_size == 0 and q.sink + q.window + q.residual <= 1024
    with pytest.raises(JaxkvError, match="no chat template"):
        ChatSession(load_model(STORIES_BIN, tokenizer=TOK512_MODEL))
    with pytest.raises(JaxkvError, match="max_new_tokens=0"):
        ChatSession(model, max_new_tokens=0)
    with pytest.raises(JaxkvError, match="must be a string"):
        ChatSession(model).send(42)


# ------------------------------------------------------------------------------ 5. the CLI

STORIES_CHAT_ARGV = [str(STORIES_BIN), "--tokenizer", str(TOK512_MODEL), "--chat-template", TEMPLATE]


@pytest.mark.jax_independent
def test_cli_in_a_pseudo_terminal_answers_and_stored_tokens_stop_at_the_cap(jax_cache):
    """Through a pseudo-terminal (the child sees a tty: it prompts, and Ctrl-D ends it)."""
    pexpect = pytest.importorskip("pexpect")
    from pexpect import fdpexpect

    argv = [
        sys.executable,
        "-m",
        "jaxkv.cli",
        "chat",
        *STORIES_CHAT_ARGV,
        "--tokens",
        "12",
        "--streaming-llm-sink",
        "4",
        "--streaming-llm-window",
        "60",
    ]
    # subprocess forks and execs in C; pexpect.spawn would fork this multithreaded (JAX) process in Python
    master, slave = os.openpty()
    proc = subprocess.Popen(
        argv, stdin=slave, stdout=slave, stderr=slave, env={**jax_cache, "TERM": "dumb"}, start_new_session=True
    )
    os.close(slave)
    child = fdpexpect.fdspawn(master, encoding="utf-8", timeout=120)
    try:
        child.expect("Ctrl-D")
        stored, seen = [], []
        for message in ("Hello there", "Tell me a story", "What happened next?"):
            child.expect_exact("> ")
            child.sendline(message)
            child.expect(r"\r\n(.+)\r\n> ")  # the echoed line ends, the reply streams, the next prompt
            assert len(child.match.group(1).strip()) > 10
            child.sendline("/stats")
            child.expect(r"tokens seen (\d+), tokens stored (\d+) \(capacity 64\)")
            seen.append(int(child.match.group(1)))
            stored.append(int(child.match.group(2)))
        assert seen[0] < 64 < seen[1] < seen[2]
        assert stored == [seen[0], 64, 64]
        child.expect_exact("> ")
        child.sendline("/reset")
        child.expect_exact("[conversation reset]")
        child.expect_exact("> ")
        child.send("\x04")  # Ctrl-D on an empty line: end of input
        child.expect(pexpect.EOF)
        assert proc.wait(timeout=60) == 0, child.before
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        child.close()


def run_chat(env, *argv, stdin: str):
    return subprocess.run(
        [sys.executable, "-m", "jaxkv.cli", "chat", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_cli_reads_one_message_per_line_and_resumes_from_its_cache_file(tmp_path, jax_cache):
    """Piped stdin: one message per line; with --cache-file, a second process picks up where the
    first stopped and prints what one session would have; a mismatched spec exits 2."""
    path = tmp_path / "chat.safetensors"
    flags = [*STORIES_CHAT_ARGV, "--tokens", "10", "--streaming-llm-sink", "4", "--streaming-llm-window", "60"]
    first = run_chat(jax_cache, *flags, "--cache-file", str(path), stdin="Hello\nTell me a long story\n")
    assert first.returncode == 0, first.stderr
    second = run_chat(jax_cache, *flags, "--cache-file", str(path), stdin="\n/stats\nAnd then?\n/stats\n")
    assert second.returncode == 0, second.stderr
    assert "[resumed" in second.stderr
    session = ChatSession(stories_chat(), STREAMING, max_new_tokens=10)
    replies = [session.send(m) for m in ("Hello", "Tell me a long story")]
    seen_before = session.tokens_seen
    replies.append(session.send("And then?"))
    out = first.stdout.splitlines() + second.stdout.splitlines()
    assert out[:2] + out[3:4] == replies
    assert f"tokens seen {seen_before}, tokens stored 64 (capacity 64)" in out[2]
    assert f"tokens seen {session.tokens_seen}, tokens stored 64 (capacity 64)" in out[4]
    other = run_chat(
        jax_cache,
        *STORIES_CHAT_ARGV,
        "--streaming-llm-sink",
        "4",
        "--streaming-llm-window",
        "32",
        "--cache-file",
        str(path),
        stdin="Hi\n",
    )
    assert other.returncode == 2 and other.stderr.startswith("jaxkv: error: ") and "another cache spec" in other.stderr
    assert other.stderr.count("\n") == 1


# --------------------------------------------------------------------------- 6. SmolLM2 (slow)


@pytest.mark.slow
def test_smollm2_two_turns_follow_chatml():
    """The real ChatML template: the default system prompt once, <|im_end|> (the EOS) fed as
    the closing marker, the cache transcript equal to the template's."""
    model = load_model(SMOLLM2)
    session = ChatSession(model, max_new_tokens=40)
    users = ["What is the capital of France? Answer in one word.", "And of Italy?"]
    replies, reasons, _, _ = converse(session, users)
    assert "Paris" in session.messages[1]["content"] and "Rome" in session.messages[3]["content"]
    assert "eos" in reasons
    transcript = session.transcript_ids
    assert transcript == expected_transcript(session, users, replies, reasons)
    assert transcript.count(model.tokenizer.encode("system", add_bos=False)[0]) == 1
