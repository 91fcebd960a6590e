"""jaxkv.testing: the tiny model and tokenizer, and end-to-end text decoding built in memory
(sample, chat, batch) with them."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxkv import CacheSpec, ChatSession, JaxkvError, generate, sample
from jaxkv.decode.batch import parse_requests, run_requests
from jaxkv.io import Tokenizer
from jaxkv.models.llama import Llama
from jaxkv.testing import (
    TINY_CONFIG,
    materialised_buffers,
    numpy_weights,
    tiny_config,
    tiny_loaded,
    tiny_model,
    tiny_tokenizer,
)

SPEC = CacheSpec(sink=4, window=16)


def test_same_seed_same_weights_and_overrides_apply():
    a, b, c = numpy_weights(tiny_model()), numpy_weights(tiny_model()), numpy_weights(tiny_model(seed=1))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["wq"], c["wq"])
    assert a["wq"].shape == (2, 32, 4 * 8) and a["wk"].shape == (2, 32, 2 * 8) and a["wq"].dtype == np.float32
    assert tiny_config(head_dim=64).head_dim == 64 and tiny_model(n_layers=1).config.n_layers == 1
    assert {k: getattr(tiny_config(), k) for k in TINY_CONFIG} == TINY_CONFIG
    back = numpy_weights(Llama.from_weights(tiny_config(), a))
    assert all(np.array_equal(a[k], back[k]) for k in a)


def test_tiny_tokenizer_ids_round_trip_and_chat_template():
    tok = tiny_tokenizer()
    assert tok.vocab_size == TINY_CONFIG["vocab_size"] == 64
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 3, True)
    assert [tok.id_to_token(i) for i in range(4)] == ["<unk>", "<s>", "<|im_start|>", "<|im_end|>"]
    ids = tok.encode("Hello, World!\n42")
    assert ids[0] == tok.bos_id and len(ids) == 1 + len("Hello, World!\n42")
    assert tok.decode(ids) == "hello, world!\n42"
    assert tok.encode("a~b", add_bos=False) == [tok.encode("a", add_bos=False)[0], 0, tok.encode("b", add_bos=False)[0]]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(text, add_bos=False)[:2] == [2, tok.encode("u", add_bos=False)[0]]
    assert tok.encode("x<|im_end|>", add_bos=False)[-1] == tok.eos_id


def test_from_hf_refuses_ids_outside_the_vocabulary():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    hf = HFTokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    with pytest.raises(JaxkvError, match="eos_id=2"):
        Tokenizer.from_hf(hf, bos_id=None, eos_id=2, add_bos=False)
    with pytest.raises(JaxkvError, match="add_bos"):
        Tokenizer.from_hf(hf, bos_id=None, eos_id=None, add_bos=True)
    assert Tokenizer.from_hf(hf, bos_id=0, eos_id=1, add_bos=True).encode("ab") == [0, 0, 1]


def test_tiny_loaded_refuses_a_vocabulary_its_tokenizer_lacks():
    with pytest.raises(JaxkvError, match="vocab_size=32"):
        tiny_loaded(vocab_size=32)
    assert tiny_loaded(vocab_size=32, tokenizer=False).tokenizer is None


def test_sample_text_equals_generate_on_its_ids():
    lm = tiny_loaded()
    out = sample(lm, "once upon a time", max_new_tokens=6, cache=SPEC)
    assert out.prompt_ids == lm.tokenizer.encode("once upon a time") and out.prompt_ids[0] == 1
    alone = generate(lm, [out.prompt_ids], max_new_tokens=6, cache=SPEC)
    assert out.token_ids == alone.token_ids[0]
    assert out.text == lm.tokenizer.decode([i for i in out.token_ids if i != lm.tokenizer.eos_id])


def test_chat_turns_follow_the_template():
    lm = tiny_loaded()
    session = ChatSession(lm, SPEC, max_new_tokens=4)
    first = session.send("hi there")
    session.send("and then?")
    assert isinstance(first, str) and session.stats().turns == 2
    tok = lm.tokenizer
    assert session.transcript_ids[:3] == [tok.bos_id, 2, tok.encode("u", add_bos=False)[0]]  # <s><|im_start|>u...


def test_batch_text_requests_equal_each_alone():
    lm = tiny_loaded()
    requests, errors = parse_requests(['{"prompt": "the cat"}', '{"prompt": "a dog ran", "max_new_tokens": 3}'])
    results, skipped = run_requests(lm, requests, max_new_tokens=5, cache=SPEC, batch_size=2)
    assert not errors and not skipped
    for req, res in zip(requests, results):
        alone = sample(lm, req.prompt, max_new_tokens=req.max_new_tokens or 5, cache=SPEC)
        assert (res.token_ids, res.text) == (alone.token_ids, alone.text)


def test_materialised_buffers_lists_what_a_program_writes():
    hlo = jax.jit(lambda x: x.sum(axis=0) * 2.0).lower(np.zeros((3, 4), np.float32)).compile().as_text()
    buffers = materialised_buffers(hlo)
    assert any(dtype == "f32" and shape == (4,) for _, dtype, shape in buffers)
    assert not any(shape == (3, 4) for _, _, shape in buffers)  # the parameter writes nothing
