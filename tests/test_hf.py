"""Hugging Face model folders (issue 8): config.json + safetensors (single or sharded with an
index) + a `tokenizers` tokenizer.json, for Llama-family and Qwen2 (Q/K/V biases) models.

* tiny random Llama (bf16, sharded) and Qwen2 (f32, single file, biases) folders written
  here load, match an independent NumPy forward pass of the HF tensors (rotate-half RoPE,
  GQA, biases) and decode greedily through ``jaxkv.sample``;
* stories260K re-saved in HF's layout (Q/K rows permuted as HF's convert script does)
  gives the same logits as the llama2.c ``.bin`` loader to 1e-5;
* missing files and unsupported architectures raise ModelFileError naming them.
"""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from paths import STORIES_BIN, TOK512_MODEL
from reference import read_llama2c_raw

from jaxkv import CacheSpec, JaxkvError, KVCache, ModelFileError, forward, load_model, sample
from jaxkv.io import load_model_files, registry

# ------------------------------------------------------------------------ writing folders


def byte_tokenizer(specials, bos=None):
    """A byte-level BPE with no merges: ids 0..255 are bytes, then the special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for s in specials:
        vocab[s] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, vocab[bos])])
    return tok


def hf_tensors(cfg, *, rng, bias=False, tie=False):
    """Random HF-named tensors ``(out, in)`` for a config dict."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    n, k = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    h = cfg.get("head_dim") or d // n

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale or 1 / np.sqrt(shape[-1]))).astype(np.float32)

    t = {"model.embed_tokens.weight": w(v, d, scale=1.0), "model.norm.weight": 1 + w(d, scale=0.1)}
    if not tie:
        t["lm_head.weight"] = w(v, d)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {
            p + "input_layernorm.weight": 1 + w(d, scale=0.1),
            p + "self_attn.q_proj.weight": w(n * h, d),
            p + "self_attn.k_proj.weight": w(k * h, d),
            p + "self_attn.v_proj.weight": w(k * h, d),
            p + "self_attn.o_proj.weight": w(d, n * h),
            p + "post_attention_layernorm.weight": 1 + w(d, scale=0.1),
            p + "mlp.gate_proj.weight": w(f, d),
            p + "mlp.up_proj.weight": w(f, d),
            p + "mlp.down_proj.weight": w(d, f),
        }
        if bias:
            t |= {
                p + "self_attn.q_proj.bias": w(n * h, scale=0.5),
                p + "self_attn.k_proj.bias": w(k * h, scale=0.5),
                p + "self_attn.v_proj.bias": w(k * h, scale=0.5),
            }
    return t


def write_folder(folder, cfg, tensors, *, tokenizer=None, tok_config=None, shards=1, dtype=np.float32):
    """Write config.json, the safetensors (``shards`` > 1: with model.safetensors.index.json)
    and optionally tokenizer.json / tokenizer_config.json."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    stored = {k: v.astype(dtype) for k, v in tensors.items()}
    if shards == 1:
        save_file(stored, os.path.join(folder, "model.safetensors"))
    else:
        names = sorted(stored)
        weight_map = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: stored[k] for k in names[s::shards]}
            save_file(part, os.path.join(folder, fname))
            weight_map |= dict.fromkeys(part, fname)
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    if tokenizer is not None:
        tokenizer.save(os.path.join(folder, "tokenizer.json"))
    if tok_config is not None:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(tok_config, f)
    return folder


LLAMA_CFG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=264,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    hidden_act="silu",
    bos_token_id=256,
    eos_token_id=257,
    rope_scaling=None,
    attention_bias=False,
)
QWEN2_CFG = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    vocab_size=260,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    hidden_act="silu",
    use_sliding_window=False,
    sliding_window=None,
    bos_token_id=256,
    eos_token_id=256,
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """Tiny random Llama: bf16 tensors in 2 shards + index, BOS added by the tokenizer's post-processor."""
    folder = str(tmp_path_factory.mktemp("hf") / "tiny-llama")
    tensors = hf_tensors(LLAMA_CFG, rng=np.random.default_rng(0))
    tok = byte_tokenizer(["<s>", "</s>"], bos="<s>")
    write_folder(folder, LLAMA_CFG, tensors, tokenizer=tok, shards=2, dtype=ml_dtypes.bfloat16)
    return folder, {k: v.astype(ml_dtypes.bfloat16).astype(np.float32) for k, v in tensors.items()}


@pytest.fixture(scope="module")
def qwen2_folder(tmp_path_factory):
    """Tiny random Qwen2: float32, one file, Q/K/V biases, tied embeddings, ChatML template."""
    folder = str(tmp_path_factory.mktemp("hf") / "tiny-qwen2")
    tensors = hf_tensors(QWEN2_CFG, rng=np.random.default_rng(1), bias=True, tie=True)
    tok = byte_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok_config = dict(bos_token=None, eos_token="<|im_end|>", chat_template=CHATML, add_bos_token=False)
    write_folder(folder, QWEN2_CFG, tensors, tokenizer=tok, tok_config=tok_config)
    return folder, tensors


# ---------------------------------------------------------------- independent NumPy forward


def numpy_forward(cfg, t, tokens):
    """Logits float64[T, V] of a full causal pass over ``tokens``, straight from HF tensors:
    rotate-half RoPE, GQA, optional Q/K/V biases (float64)."""
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    d, n, kh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    h = cfg.get("head_dim") or d // n
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    T = len(tokens)
    pos = np.arange(T)
    inv = 1.0 / theta ** (np.arange(h // 2) * 2.0 / h)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):  # [T, heads, H], rotate-half
        a, b = x[..., : h // 2], x[..., h // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    x = t["model.embed_tokens.weight"][tokens]
    mask = np.tril(np.ones((T, T), bool))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."

        def proj(name, inp):
            y = inp @ t[p + f"self_attn.{name}.weight"].T  # noqa: B023 (proj is called in this iteration)
            return y + t[p + f"self_attn.{name}.bias"] if p + f"self_attn.{name}.bias" in t else y  # noqa: B023

        hn = norm(x, t[p + "input_layernorm.weight"])
        q = rope(proj("q_proj", hn).reshape(T, n, h))
        k = rope(proj("k_proj", hn).reshape(T, kh, h))
        v = proj("v_proj", hn).reshape(T, kh, h)
        out = np.zeros((T, n, h))
        for head in range(n):
            kv = head // (n // kh)
            s = q[:, head] @ k[:, kv].T / np.sqrt(h)
            s = np.where(mask, s, -np.inf)
            e = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, head] = (e / e.sum(axis=1, keepdims=True)) @ v[:, kv]
        x = x + out.reshape(T, n * h) @ t[p + "self_attn.o_proj.weight"].T
        hn = norm(x, t[p + "post_attention_layernorm.weight"])
        g = hn @ t[p + "mlp.gate_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (hn @ t[p + "mlp.up_proj.weight"].T)) @ t[p + "mlp.down_proj.weight"].T
    x = norm(x, t["model.norm.weight"])
    head = t["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else t["lm_head.weight"]
    return x @ head.T


def jax_logits(model, tokens):
    """jaxkv's teacher-forced logits float32[T, V] (one chunk through a full cache)."""
    c = model.config
    cache = KVCache.create(
        CacheSpec(max_len=len(tokens)), batch=1, n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim
    )
    gd, st = nnx.split(model.model)
    logits, _ = forward(gd, st, jnp.asarray([tokens], jnp.int32), jnp.asarray([len(tokens)], jnp.int32), cache)
    return np.asarray(logits[0])


def greedy_reference(cfg, tensors, prompt, steps):
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(np.argmax(numpy_forward(cfg, tensors, ids)[-1])))
    return ids[len(prompt) :]


# ----------------------------------------------------------------------------------- tests


def test_tiny_llama_sharded_bf16_loads_matches_numpy_and_decodes(llama_folder):
    folder, tensors = llama_folder
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
    model = load_model(folder)
    c = model.config
    assert (c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, c.vocab_size) == (2, 4, 2, 8, 264)
    assert not c.tie_embeddings and not c.attention_bias and c.norm_eps == 1e-5 and c.name == "tiny-llama"
    tok = model.tokenizer
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (256, 257, True)  # BOS found through the post-processor
    prompt = tok.encode("Hi there")
    assert prompt[0] == 256 and len(prompt) == 9 and tok.decode(prompt) == "Hi there"
    np.testing.assert_allclose(jax_logits(model, prompt), numpy_forward(LLAMA_CFG, tensors, prompt), atol=1e-4, rtol=0)
    out = sample(model, "Hi there", max_new_tokens=5)
    expected = greedy_reference(LLAMA_CFG, tensors, prompt, 5)
    if 257 in expected:  # EOS stops generation (and is kept), as in Hugging Face
        expected = expected[: expected.index(257) + 1]
    assert out.token_ids == expected


def test_tiny_qwen2_with_biases_loads_matches_numpy_and_decodes(qwen2_folder):
    folder, tensors = qwen2_folder
    model = load_model(folder)
    c = model.config
    assert c.attention_bias and c.tie_embeddings and c.rope_theta == 1e6 and c.head_dim == 8
    assert set(k for k in ("bq", "bk", "bv") if hasattr(model.model, k)) == {"bq", "bk", "bv"}
    tok = model.tokenizer
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (None, 258, False)
    text = tok.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    prompt = tok.encode(text)
    assert prompt[0] == 257 and 258 in prompt  # special tokens are single ids
    np.testing.assert_allclose(jax_logits(model, prompt), numpy_forward(QWEN2_CFG, tensors, prompt), atol=1e-4, rtol=0)
    # biases matter: dropping them changes the logits
    no_bias = {k: v for k, v in tensors.items() if not k.endswith("bias")}
    assert np.max(np.abs(numpy_forward(QWEN2_CFG, no_bias, prompt) - jax_logits(model, prompt))) > 1e-2
    out = sample(model, prompt, max_new_tokens=6, cache=CacheSpec(sink=2, window=32))
    expected = greedy_reference(QWEN2_CFG, tensors, prompt, 6)
    if 258 in expected:
        expected = expected[: expected.index(258) + 1]
    assert out.token_ids == expected


def hf_permute(w, n_heads):
    """HF's ``convert_llama_weights_to_hf.permute`` of a (out, in) Q/K matrix: llama2.c/Meta's
    interleaved-pair rows -> rotate-half rows (written here independently of jaxkv)."""
    out, inp = w.shape
    return w.reshape(n_heads, out // n_heads // 2, 2, inp).transpose(0, 2, 1, 3).reshape(out, inp)


def test_stories260k_resaved_in_hf_layout_matches_bin_loader(tmp_path):
    w, cfg = read_llama2c_raw(STORIES_BIN)  # numpy-only reader, Q/K left interleaved
    n_layers, d, _ = w["wq"].shape
    n, k = cfg["n_heads"], cfg["n_kv_heads"]
    tensors = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["final_norm"]}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": w["attn_norm"][i],
            p + "self_attn.q_proj.weight": hf_permute(w["wq"][i].T, n),
            p + "self_attn.k_proj.weight": hf_permute(w["wk"][i].T, k),
            p + "self_attn.v_proj.weight": w["wv"][i].T,
            p + "self_attn.o_proj.weight": w["wo"][i].T,
            p + "post_attention_layernorm.weight": w["mlp_norm"][i],
            p + "mlp.gate_proj.weight": w["w_gate"][i].T,
            p + "mlp.up_proj.weight": w["w_up"][i].T,
            p + "mlp.down_proj.weight": w["w_down"][i].T,
        }
    hf_cfg = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=d,
        intermediate_size=w["w_gate"].shape[2],
        num_hidden_layers=n_layers,
        num_attention_heads=n,
        num_key_value_heads=k,
        vocab_size=w["embed"].shape[0],
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        hidden_act="silu",
        bos_token_id=1,
        eos_token_id=2,
    )
    folder = write_folder(
        str(tmp_path / "stories260K-hf"), hf_cfg, {k_: np.ascontiguousarray(v) for k_, v in tensors.items()}
    )
    shutil.copy(TOK512_MODEL, os.path.join(folder, "tokenizer.model"))  # SentencePiece fallback
    hf_model = load_model(folder)
    bin_model = load_model(STORIES_BIN, tokenizer=TOK512_MODEL)
    tokens = bin_model.tokenizer.encode("Once upon a time, there was a little girl named Lily.")
    assert hf_model.tokenizer.encode("Once upon a time") == bin_model.tokenizer.encode("Once upon a time")
    np.testing.assert_allclose(jax_logits(hf_model, tokens), jax_logits(bin_model, tokens), atol=1e-5, rtol=0)
    config_hf, weights_hf, _ = load_model_files(folder)
    config_bin, weights_bin, _ = load_model_files(STORIES_BIN, TOK512_MODEL)
    for name, a in weights_bin.items():
        np.testing.assert_array_equal(weights_hf[name], a, err_msg=name)


# ------------------------------------------------------------------------------ errors


def test_missing_files_are_named(tmp_path, llama_folder):
    src, _ = llama_folder
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFileError, match="config.json"):
        load_model(empty)

    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(os.path.join(src, "config.json"), no_weights)
    with pytest.raises(ModelFileError, match=r"model\.safetensors"):
        load_model(no_weights)

    lost_shard = tmp_path / "lost-shard"
    shutil.copytree(src, lost_shard)
    os.remove(lost_shard / "model-00002-of-00002.safetensors")
    with pytest.raises(ModelFileError, match="model-00002-of-00002.safetensors"):
        load_model(lost_shard)

    no_tok = tmp_path / "no-tokenizer"
    shutil.copytree(src, no_tok)
    os.remove(no_tok / "tokenizer.json")
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        load_model(no_tok)

    lost_tensor = tmp_path / "lost-tensor"
    shutil.copytree(src, lost_tensor)
    index = json.loads((lost_tensor / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    (lost_tensor / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFileError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(lost_tensor)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "GPT2LMHeadModel"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "llama3"),
        (dict(hidden_act="gelu"), "gelu"),
        (dict(attention_bias=True), "attention_bias"),
    ],
)
def test_unsupported_configs_are_named(tmp_path, llama_folder, change, match):
    src, _ = llama_folder
    folder = tmp_path / "model"
    shutil.copytree(src, folder)
    (folder / "config.json").write_text(json.dumps({**LLAMA_CFG, **change}))
    with pytest.raises(ModelFileError, match=match) as err:
        load_model(folder)
    assert "config.json" in str(err.value)


def test_wrong_tensor_shape_is_named(tmp_path):
    cfg = {**LLAMA_CFG, "num_hidden_layers": 1}
    tensors = hf_tensors(cfg, rng=np.random.default_rng(2))
    tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"]
    folder = write_folder(str(tmp_path / "bad"), cfg, tensors, tokenizer=byte_tokenizer(["<s>", "</s>"]))
    with pytest.raises(ModelFileError, match=r"k_proj\.weight.*shape \(32, 32\), expected \(16, 32\)"):
        load_model(folder)


def test_raw_safetensors_reader_matches_safetensors(tmp_path):
    """The fallback byte reader (for safetensors versions without numpy bf16) reads what
    safetensors itself reads, for bf16, f16 and f32."""
    from jaxkv.io.hf import SafetensorsFile

    rng = np.random.default_rng(3)
    arrays = {
        "a": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
        "b": rng.standard_normal(7).astype(np.float16),
        "c": rng.standard_normal((2, 2, 2)).astype(np.float32),
    }
    save_file(arrays, str(tmp_path / "x.safetensors"))
    shard = SafetensorsFile(str(tmp_path / "x.safetensors"))
    for name, a in arrays.items():
        raw = shard.read_raw(name)
        assert raw.dtype == a.dtype and raw.shape == a.shape
        np.testing.assert_array_equal(raw.astype(np.float32), a.astype(np.float32))
        np.testing.assert_array_equal(shard.get(name).astype(np.float32), a.astype(np.float32))


def test_from_hf_reads_mistral_head_dim_and_rope_parameters():
    from jaxkv.errors import JaxkvError
    from jaxkv.models.llama import LlamaConfig

    c = LlamaConfig.from_hf(
        dict(
            architectures=["MistralForCausalLM"],
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            vocab_size=100,
            rope_parameters={"rope_type": "default", "rope_theta": 5e5},
            sliding_window=4096,
            max_position_embeddings=8192,
        ),
        name="m",
    )
    assert (c.head_dim, c.n_kv_heads, c.rope_theta, c.norm_eps, c.max_seq_len, c.tie_embeddings) == (
        32,
        1,
        5e5,
        1e-6,
        8192,
        False,
    )
    assert c.sliding_window == 4096 and c.layer_kinds == ("sliding_attention",) * 2  # Mistral's window, every layer
    # model_type alone is enough; TinyLlama/SmolLM2 are LlamaForCausalLM
    c = LlamaConfig.from_hf(
        dict(
            model_type="llama",
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=4,
            vocab_size=10,
            tie_word_embeddings=True,
        )
    )
    assert c.n_kv_heads == 4 and c.head_dim == 16 and c.tie_embeddings and not c.attention_bias
    with pytest.raises(JaxkvError, match="use_sliding_window"):
        registry.family_for_hf(QWEN2_CFG).hf.config({**QWEN2_CFG, "use_sliding_window": True})
    with pytest.raises(JaxkvError, match="num_hidden_layers"):
        LlamaConfig.from_hf({k: v for k, v in LLAMA_CFG.items() if k != "num_hidden_layers"})
    with pytest.raises(
        JaxkvError, match="rope_scaling of type 'dynamic' is not supported: expected one of default, linear, llama3"
    ):
        LlamaConfig.from_hf({**LLAMA_CFG, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    assert LlamaConfig.from_hf({**LLAMA_CFG, "rope_scaling": {"type": "linear", "factor": 2.0}}).rope.kind == "linear"


# ------------------------------------------------------------------- architecture registry

HF_ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]  # Llama's tensor names
# (every family against transformers itself: tests/test_families.py)


@pytest.mark.parametrize("arch", HF_ARCHITECTURES)
def test_each_registered_hf_architecture_loads_and_matches_numpy(tmp_path, arch):
    cfg = {k: v for k, v in LLAMA_CFG.items() if k != "model_type"} | {"architectures": [arch]}
    family = registry.family_for_hf(cfg)
    config = family.hf.config(cfg, name="probe")  # Qwen2 always has Q/K/V biases
    tensors = hf_tensors(cfg, rng=np.random.default_rng(5), bias=config.attention_bias)
    folder = write_folder(str(tmp_path / arch), cfg, tensors, tokenizer=byte_tokenizer(["<s>", "</s>"]))
    model = load_model(folder)
    assert registry.family_of(model.config) is family and isinstance(model.model, family.model)
    prompt = [256, 72, 105, 33]
    np.testing.assert_allclose(jax_logits(model, prompt), numpy_forward(cfg, tensors, prompt), atol=1e-4, rtol=0)


def test_unknown_architectures_are_named_with_the_supported_ones(tmp_path, llama_folder):
    supported = (
        "expected one of LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
        "Gemma2ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM"
    )
    with pytest.raises(JaxkvError, match=f"architecture GPTNeoXForCausalLM is not supported: {supported}"):
        registry.family_for_hf({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"})
    with pytest.raises(JaxkvError, match=f"architecture model_type 'gpt_neox' is not supported: {supported}"):
        registry.family_for_hf({"model_type": "gpt_neox"})
    assert registry.family_for_hf({"model_type": "qwen2"}) is registry.FAMILIES["qwen2"]
    with pytest.raises(
        JaxkvError,
        match="GGUF architecture 'gptneox' is not supported: expected one of 'llama', 'qwen2', "
        "'qwen3', 'gemma2', 'gemma3', 'phi3'",
    ):
        registry.family_for_gguf("gptneox")
    with pytest.raises(JaxkvError, match="config dict is of no registered model family: expected one of LlamaConfig"):
        registry.family_of({})
    folder = tmp_path / "neox"
    shutil.copytree(llama_folder[0], folder)
    (folder / "config.json").write_text(
        json.dumps({**LLAMA_CFG, "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"})
    )
    with pytest.raises(
        ModelFileError, match=rf"config\.json: architecture GPTNeoXForCausalLM is not supported: {supported}"
    ):
        load_model(folder)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5 is not supported"),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}),
            "partial_rotary_factor=0.25",
        ),
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is not supported"),
        (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0 is not supported"),
        (dict(query_pre_attn_scalar=256), "query_pre_attn_scalar=256 is not supported"),
        (dict(use_qk_norm=True), "use_qk_norm=True is not supported"),
        (
            dict(layer_types=["full_attention", "sliding_attention"]),
            "layer_types with 'sliding_attention' is not supported",
        ),
        (dict(mlp_bias=True), "mlp_bias=true is not supported"),
    ],
)
def test_maths_changing_config_attributes_are_refused_by_name(tmp_path, llama_folder, change, match):
    folder = tmp_path / "model"
    shutil.copytree(llama_folder[0], folder)
    (folder / "config.json").write_text(json.dumps({**LLAMA_CFG, **change}))
    with pytest.raises(ModelFileError, match=match) as err:
        load_model(folder)
    assert "config.json" in str(err.value)


def test_neutral_values_of_those_attributes_load(tmp_path, llama_folder):
    folder = tmp_path / "model"
    shutil.copytree(llama_folder[0], folder)
    neutral = dict(
        partial_rotary_factor=1.0,
        attn_logit_softcapping=None,
        query_pre_attn_scalar=None,
        use_qk_norm=False,
        layer_types=["full_attention", "full_attention"],
        mlp_bias=False,
    )
    (folder / "config.json").write_text(json.dumps({**LLAMA_CFG, **neutral}))
    prompt = [256, 72, 105]
    np.testing.assert_array_equal(
        jax_logits(load_model(folder), prompt), jax_logits(load_model(llama_folder[0]), prompt)
    )


def test_a_bias_the_family_does_not_read_is_refused(tmp_path):
    cfg = {**LLAMA_CFG, "num_hidden_layers": 1}
    tensors = hf_tensors(cfg, rng=np.random.default_rng(6)) | {
        "model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)
    }
    folder = write_folder(str(tmp_path / "o-bias"), cfg, tensors, tokenizer=byte_tokenizer(["<s>", "</s>"]))
    with pytest.raises(ModelFileError, match=r"'model\.layers\.0\.self_attn\.o_proj\.bias' is a bias"):
        load_model(folder)


def test_a_non_finite_weight_is_refused_naming_the_shard_and_tensor(tmp_path):
    cfg = {**LLAMA_CFG, "num_hidden_layers": 1}
    tensors = hf_tensors(cfg, rng=np.random.default_rng(3))
    tensors["model.layers.0.mlp.up_proj.weight"][5, 2:4] = [np.nan, np.inf]
    folder = write_folder(
        str(tmp_path / "nan"), cfg, tensors, tokenizer=byte_tokenizer(["<s>", "</s>"]), dtype=ml_dtypes.bfloat16
    )
    with pytest.raises(ModelFileError) as e:
        load_model(folder)
    assert str(e.value) == (
        f"{folder}/model.safetensors: tensor 'model.layers.0.mlp.up_proj.weight' holds 2 non-finite values "
        "(NaN or infinity) of 1,536, the first at index [5, 2]"
    )
