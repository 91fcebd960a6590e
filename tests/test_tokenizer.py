"""Tokenizers against SentencePiece, llama.cpp's golden ids and round trips on real text."""

import json

import pytest

import paths
from paths import MODELS, SMOLLM2

from jaxkv.errors import JaxkvError, ModelFileError
from jaxkv.io import Tokenizer, load_gguf_tokenizer, load_tokenizer

pytestmark = pytest.mark.jax_independent  # host tokenizers

GOLDEN = json.loads(paths.GOLDEN.read_text())
TEXT = paths.TEXT.read_text(encoding="utf-8")
# Lines with mojibake (non-ASCII), double and trailing spaces are all in the first ~6500.
LINES = TEXT.split("\n")[:300] + [line for line in TEXT.split("\n") if "  " in line or "\u00e2" in line]
ODD = [
    "",
    " ",
    "  hi  there  ",
    "héllo wörld 😀 日本",
    "x\n\n y \n",
    "a<s>b</s> c",
    "123 4567",
    "\t tab",
    "ünïcödé\r\n",
]


@pytest.fixture(scope="module")
def sp():
    return Tokenizer.from_sentencepiece(MODELS / "tok512.model")


@pytest.fixture(scope="module")
def tok_bin():
    return Tokenizer.from_llama2c(MODELS / "tok512.bin")


@pytest.fixture(scope="module")
def tok_gguf():
    return load_gguf_tokenizer(MODELS / "stories260K.gguf")


@pytest.fixture(scope="module")
def smol():
    return load_gguf_tokenizer(SMOLLM2)


def test_sentencepiece_ids(sp):
    assert sp.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert sp.encode("Once upon a time", add_bos=False) == [403, 407, 261, 378]
    assert (sp.bos_id, sp.eos_id, sp.vocab_size, sp.add_bos) == (1, 2, 512, True)
    assert sp.decode([1, 403, 407, 261, 378]) == "Once upon a time"


def test_llama2c_bin_ids(tok_bin):
    assert tok_bin.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert tok_bin.encode("Once upon a time", add_bos=False) == [403, 407, 261, 378]
    assert (tok_bin.bos_id, tok_bin.eos_id, tok_bin.vocab_size) == (1, 2, 512)
    assert [tok_bin.id_to_token(i) for i in (0, 1, 2, 13, 403)] == ["<unk>", "<s>", "</s>", "<0x0A>", "▁Once"]
    assert tok_bin.decode([13]) == "\n"  # byte fallback


@pytest.mark.parametrize("other", ["tok_bin", "tok_gguf"])
def test_same_ids_as_sentencepiece_on_real_text(sp, other, request):
    tok = request.getfixturevalue(other)
    assert len(LINES) > 300
    for line in LINES + ODD:
        ids = sp.encode(line)
        assert tok.encode(line) == ids, line
        assert tok.decode(ids) == sp.decode(ids), line
    chunk = TEXT[:20000]  # one stream with newlines and blank lines
    ids = sp.encode(chunk)
    assert tok.encode(chunk) == ids
    assert tok.decode(ids) == sp.decode(ids) == chunk.strip()


def test_sentencepiece_whitespace_and_specials(sp, tok_bin):
    for tok in (sp, tok_bin):
        assert tok.encode("  hi  there  ", add_bos=False) == tok.encode("hi there", add_bos=False)
        assert tok.encode("a<s>b</s>", add_bos=False) == tok.encode("a", add_bos=False) + [1] + tok.encode(
            "b", add_bos=False
        ) + [2]
        assert tok.decode(tok.encode("x\n\ny \n")) == "x\n\ny \n"
        assert tok.decode(tok.encode("héllo 😀 日本")) == "héllo 😀 日本"


def test_llama2c_golden_text_round_trips_without_leading_space(sp, tok_bin):
    golden = GOLDEN["stories260K_greedy_from_bos"]
    ids = golden["prompt_token_ids"] + tok_bin.encode(golden["expected_text"], add_bos=False)
    assert ids[0] == 1 and len(ids) > 150
    assert tok_bin.decode(ids) == golden["expected_text"]
    assert sp.decode(ids) == golden["expected_text"]


def test_smollm2_golden_chatml_ids(smol):
    golden = GOLDEN["smollm2_chatml_paris"]
    assert smol.add_bos is False
    assert smol.encode(golden["prompt"]) == golden["prompt_token_ids"]
    assert smol.encode(golden["prompt"], add_bos=True) == [1] + golden["prompt_token_ids"]
    assert (smol.bos_id, smol.eos_id, smol.vocab_size) == (1, 2, 49152)
    # special tokens are dropped on decode, the rest round-trips
    assert smol.decode(golden["prompt_token_ids"]) == "user\nWhat is the capital of France?\nassistant\n"


def test_smollm2_byte_level_and_digits(smol):
    assert [smol.id_to_token(i) for i in smol.encode("2024 hello world")] == ["2", "0", "2", "4", "Ġhello", "Ġworld"]
    for text in ODD + LINES[:50] + ["<|im_start|>x", "def f(x):\n\treturn x**2  # ok\n"]:
        ids = smol.encode(text)
        assert smol.decode(ids) == text.replace("<|im_start|>", ""), text


def test_smollm2_chat_template(smol):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    assert smol.apply_chat_template(question) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}] + question
    prompt = smol.apply_chat_template(with_system, add_generation_prompt=False)
    assert (
        prompt
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    )
    assert smol.encode(prompt).count(1) == 2 and smol.encode(prompt).count(2) == 2


def test_chat_template_rendered_like_hugging_face(smol):
    tok = load_gguf_tokenizer(MODELS / "stories260K.gguf")
    with pytest.raises(JaxkvError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    # trim_blocks/lstrip_blocks, bos/eos tokens, raise_exception, tojson
    tok.chat_template = (
        "{{ bos_token }}\n  {% for m in messages %}\n{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
        "[{{ m.role }}] {{ m.content | tojson }}{{ eos_token }}\n  {% endfor %}\n"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "hé"}]) == '<s>\n[user] "hé"</s>\n'
    with pytest.raises(JaxkvError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": ""}])


@pytest.mark.parametrize("which", ["tok_bin", "sp", "smol"])
def test_decode_stream_holds_back_partial_utf8(which, request):
    tok = request.getfixturevalue(which)
    text = "Ünïcödé 😀 and 日本語 text\nwith 42 emoji 🎉🎉, done."
    ids = tok.encode(text, add_bos=False)
    stream, pieces = tok.decode_stream(), []
    for i in ids:
        pieces.append(stream.push([i]))
        assert "\ufffd" not in pieces[-1]
    pieces.append(stream.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert "" in pieces  # some token ended inside a multi-byte character and was held back


def test_decode_stream_keeps_space_after_context_and_long_streams(tok_bin, smol):
    for tok in (tok_bin, smol):
        prompt = tok.encode("Once upon a time")
        stream = tok.decode_stream(prompt)
        assert stream.push(tok.encode(" there was", add_bos=False)) == " there was"
        story = TEXT[:3000]
        ids = tok.encode(story, add_bos=False)
        out = "".join(stream.push(ids[i : i + 5]) for i in range(0, len(ids), 5)) + stream.flush()
        assert (
            out
            == tok.decode(prompt + tok.encode(" there was", add_bos=False) + ids)[len("Once upon a time there was") :]
        )


def test_unsupported_gguf_tokenizers():
    with pytest.raises(JaxkvError, match="'bert' is not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(JaxkvError, match="needs metadata 'tokenizer.ggml.scores'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
    gpt2 = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": []}
    with pytest.raises(JaxkvError, match="'qwen2' is not supported"):
        Tokenizer.from_gguf_metadata({**gpt2, "tokenizer.ggml.pre": "qwen2"})
    assert Tokenizer.from_gguf_metadata(gpt2).encode("ab") == [0, 1]


def test_bad_tokenizer_files(tmp_path):
    truncated = tmp_path / "tok512.bin"
    truncated.write_bytes((MODELS / "tok512.bin").read_bytes()[:3001])
    with pytest.raises(ModelFileError, match="tok512.bin: truncated"):
        load_tokenizer(truncated)
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x07not a protobuf" * 10)
    with pytest.raises(ModelFileError, match="not a SentencePiece model"):
        load_tokenizer(garbage)
    with pytest.raises(ModelFileError, match="no such tokenizer file"):
        load_tokenizer(tmp_path / "absent.model")
