"""Weights held in ggml's block types (``q8_0``, ``q4_0``, ``q4_1``:
:class:`jaxkv.models.weights.BlockWeight`) and their product by ggml through ``jax.ffi``
(:mod:`jaxkv.models.ggml`): the blocks against the gguf package's quantiser and dequantiser,
ggml's product against the exact product of its quantised operands, the XLA fallback
against the dequantised matrix, a tiny model's logits against fp32, and the compiled decode
loop reading the stacked blocks in place."""

from __future__ import annotations

import re

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_weights import TOKENS, logits_of

from conftest import decode_loop_hlo

from jaxkv import CacheSpec
from jaxkv.models import ggml
from jaxkv.models.llama import Llama
from jaxkv.models.weights import BLOCK_FORMATS, BlockWeight, dense, dequantize_blocks, embed_lookup, quantize
from jaxkv.testing import numpy_weights, tiny_model

RNG = np.random.default_rng(0)
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def placed(w: BlockWeight) -> BlockWeight:
    return jax.tree.map(jnp.asarray, w)


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_blocks_are_ggufs_and_dequantise_as_gguf_does(fmt):
    w = RNG.standard_normal((2, 80, 6)).astype(np.float32)  # [L, I, O], 80 inputs: padded to 96
    w[1, :32, 3] = 0  # an all-zero block
    bw = quantize(w, fmt)
    qtype = gguf.GGMLQuantizationType(BLOCK_FORMATS[fmt])
    padded = np.concatenate([np.swapaxes(w, -1, -2), np.zeros((2, 6, 16), np.float32)], axis=-1)
    np.testing.assert_array_equal(bw.blocks, gguf.quants.quantize(padded, qtype))
    assert bw.shape == (2, 80, 6) and bw.blocks.shape == (2, 6, gguf.quants.quant_shape_to_byte_shape((96,), qtype)[0])
    np.testing.assert_array_equal(
        np.asarray(dequantize_blocks(jnp.asarray(bw.blocks), fmt)), gguf.quants.dequantize(bw.blocks, qtype)
    )


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
@pytest.mark.parametrize("tokens", [1, 5])
def test_ggml_product_is_the_exact_product_of_its_quantised_operands(fmt, tokens):
    """ggml quantises the activations to Q8_0 blocks (Q8_1 for Q4_1: the same codes and scale
    plus a float16 sum) and multiplies block by block: with both operands quantised the product
    is exact to float32 rounding (Q4_1: to the float16 rounding of that sum, ~1e-3)."""
    assert ggml.available(), ggml.unavailable_reason()
    w = RNG.standard_normal((3, 96, 40)).astype(np.float32)  # three stacked layers
    bw = placed(quantize(w, fmt))
    x = RNG.standard_normal((1, tokens, 96)).astype(np.float32)
    x_q = gguf.quants.dequantize(gguf.quants.quantize(x, Q8_0), Q8_0).astype(np.float64)
    product = jax.jit(lambda x, w, i: dense(x, w.at(i)))
    for layer in range(3):
        want = x_q @ np.asarray(bw.at(layer).dequantize(), np.float64)
        got = np.asarray(product(x, bw, layer))
        assert got.shape == (1, tokens, 40)
        assert np.abs(got - want).max() <= {"q4_1": 2e-3}.get(fmt, 1e-6) * np.abs(want).max()


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
@pytest.mark.parametrize("why", ["no library", "more rows than ggml.MAX_ROWS"])
def test_without_ggml_the_blocks_are_dequantised_in_xla(fmt, why, monkeypatch):
    if why == "no library":
        monkeypatch.setattr(ggml, "available", lambda: False)
    w = RNG.standard_normal((48, 7)).astype(np.float32)
    bw = placed(quantize(w, fmt))
    x = jnp.asarray(RNG.standard_normal((1, 3 if why == "no library" else ggml.MAX_ROWS + 1, 48)), jnp.float32)
    deq = np.asarray(bw.dequantize())
    assert deq.shape == (48, 7) and np.abs(deq - w).max() <= np.abs(w).max() / (7 if fmt == "q8_0" else 1)
    np.testing.assert_allclose(np.asarray(dense(x, bw)), np.asarray(x) @ deq, rtol=1e-5, atol=1e-5)
    ids = jnp.asarray([[3, 0, 6]], jnp.int32)  # a table [V=7, D=48] held as its transpose
    np.testing.assert_array_equal(np.asarray(embed_lookup(bw, ids)), deq.T[np.asarray(ids)])


BOUNDS = {"q8_0": 0.2, "q4_0": 1.6, "q4_1": 1.6}
"""max |logit - fp32 logit| on the tiny model, as test_weights.BOUNDS (int8, q4)."""


@pytest.mark.parametrize("fmt", list(BLOCK_FORMATS))
def test_a_model_in_blocks_is_near_fp32_and_its_decode_loop_reads_the_stack_in_place(fmt):
    model = tiny_model()
    held = Llama.from_weights(model.config, numpy_weights(model), weight_format=fmt)
    assert isinstance(held.w_gate[...], BlockWeight) and held.w_gate[...].format == fmt
    assert held.embed[...].format == "q8_0"  # the tied head and table: Q8_0, as llama.cpp's Q4 files
    gap = np.abs(logits_of(held, TOKENS) - logits_of(model, TOKENS)).max()
    assert 0 < gap <= BOUNDS[fmt], gap
    hlo = decode_loop_hlo(held, CacheSpec(sink=2, window=8))
    calls = re.findall(
        r'custom_call_target="jaxkv_ggml_mul_mat", operand_layout_constraints=\{(.*?)\}, api_version', hlo
    )
    # w_gate [L=2, O=48, 32 inputs], w_down [2, 32, 48 inputs padded to 64]: the whole stacks
    row = {"q8_0": 34, "q4_0": 18, "q4_1": 20}[fmt]
    operands = " ".join(calls)
    assert f"u8[2,48,{row}]" in operands and f"u8[2,32,{2 * row}]" in operands, operands
    assert len(calls) == 8, calls  # 7 matrices in the layer scan, the head once


def test_the_shim_names_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXKV_GGML_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="no ggml library: install libggml-python, or set"):
        ggml._build()


def test_a_gguf_matrix_in_the_held_type_is_kept_as_the_files_bytes(tmp_path):
    """``load_model(weights="q4_1")`` on a file whose matrices are Q4_1 holds the file's own
    blocks (Q/K rows permuted to rotate-half; the Q8_0 table and head as Q8_0) and reads a matrix
    of another type as float32 to quantise it: the model quantising every float32 value instead."""
    from test_io import H, K, L, N, write_tiny_gguf

    import jaxkv
    from jaxkv.io import load_gguf

    Q = gguf.GGMLQuantizationType
    types = {"token_embd": Q.Q8_0, "output": Q.Q8_0, "attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_0,
             "attn_output": Q.Q4_1, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_1}  # fmt: skip
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, types)
    raw = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
    _, w, _ = load_gguf(path, blocks="q4_1")
    rotate_half = [hd * H + c for hd in range(N) for c in [0, 2, 4, 6, 1, 3, 5, 7]]
    for i in range(L):
        np.testing.assert_array_equal(w["wq"].blocks[i], raw[f"blk.{i}.attn_q.weight"][rotate_half])
        np.testing.assert_array_equal(w["wk"].blocks[i], raw[f"blk.{i}.attn_k.weight"][rotate_half[: K * H]])
        np.testing.assert_array_equal(w["w_down"].blocks[i], raw[f"blk.{i}.ffn_down.weight"])
    assert w["wq"].format == "q4_1" and w["embed"].format == w["lm_head"].format == "q8_0"
    np.testing.assert_array_equal(w["embed"].blocks, raw["token_embd.weight"])
    assert isinstance(w["wv"], np.ndarray) and w["wv"].dtype == np.float32  # Q4_0 in the file: read as float32

    held = jaxkv.load_model(path, weights="q4_1").model
    assert isinstance(held.wv[...], BlockWeight) and held.wv[...].format == "q4_1"
    # the same model as quantising the file's float32 values (ggml's Q4_1 / Q8_0 give the blocks back)
    config, values, _ = load_gguf(path)
    requantised = Llama.from_weights(config, values, weight_format="q4_1")
    for name in ("wq", "w_down", "embed", "lm_head"):
        np.testing.assert_array_equal(getattr(held, name)[...].blocks, getattr(requantised, name)[...].blocks)
    np.testing.assert_array_equal(logits_of(held, TOKENS), logits_of(requantised, TOKENS))


@pytest.mark.slow
def test_smollm2_in_its_files_q4_1_blocks_keeps_the_golden_answer(golden):
    """SmolLM2-135M-Instruct's Q4_1 file held as its own blocks (``--weights q4_1``, ggml's
    product): the greedy ChatML answer still starts as the golden one ("Paris")."""
    from paths import SMOLLM2

    import jaxkv

    model = jaxkv.load_model(SMOLLM2, weights="q4_1")
    assert model.model.w_gate[...].format == "q4_1" and model.model.embed[...].format == "q8_0"
    g = golden["smollm2_chatml_paris"]
    out = jaxkv.sample(model, g["prompt_token_ids"], max_new_tokens=12)
    assert out.text.startswith(g["expected_text_prefix"]), out.text


def test_auto_weights_hold_a_gguf_in_its_own_block_type(tmp_path, monkeypatch):
    from test_io import write_tiny_gguf

    from paths import SMOLLM2, STORIES_BIN

    from jaxkv.io import best_weights

    Q = gguf.GGMLQuantizationType
    mixed, q8 = tmp_path / "mixed.gguf", tmp_path / "q8.gguf"
    write_tiny_gguf(mixed, {"attn_q": Q.Q4_1, "attn_v": Q.Q4_0})
    write_tiny_gguf(
        q8, dict.fromkeys(["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"], Q.Q8_0)
    )
    assert [best_weights(p) for p in (SMOLLM2, q8, mixed, STORIES_BIN)] == ["q4_1", "q8_0", "fp32", "fp32"]
    monkeypatch.setattr(ggml, "available", lambda: False)
    assert best_weights(SMOLLM2) == "fp32"  # no ggml here: the blocks' XLA product is slow at one row


def test_a_stored_program_with_ggml_products_loads_in_a_new_process(tmp_path):
    """The command's store of compiled programs (tests/test_cli_ux.py) with ``--weights q4_1``: a
    second process loads the stored decode loop and prefill chunk, whose custom call it registers
    before loading them (it traces nothing that would), and prints the same text."""
    import os
    import subprocess
    import sys

    from paths import STORIES_BIN, TOK512_MODEL

    if jax.__version_info__ < (0, 6):
        pytest.skip("no store below jax 0.6 (jaxkv.cli.use_compile_cache)")
    cache = tmp_path / "xla"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXKV_COMPILE_CACHE": str(cache)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    argv = [sys.executable, "-m", "jaxkv.cli", "sample", str(STORIES_BIN), "--tokenizer", str(TOK512_MODEL),
            "--prompt", "Once upon a time", "--tokens", "12", "--weights", "q4_1"]  # fmt: skip
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    entries = sorted(p.relative_to(cache) for p in cache.rglob("*"))
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and "compiling instead of loading" not in second.stderr, second.stderr
    assert second.stdout == first.stdout and sorted(p.relative_to(cache) for p in cache.rglob("*")) == entries
