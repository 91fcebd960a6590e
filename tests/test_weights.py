"""Weights below float32 (:mod:`jaxkv.models.weights`): the int8 / q4 codes against a NumPy
reference of the formats and against the gguf package's Q8_0 / Q4_1 dequantisers, each
form's logits against fp32, the on-the-fly dequantisation against the model holding the
dequantised matrices, the HLO of the compiled decode step holding the weights in their
format, and the ``--weights`` flag."""

from __future__ import annotations

import re

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import decode_loop_hlo
from test_cli_ux import STORIES, cli, one_error_line

from jaxkv import CacheSpec, JaxkvError, forward
from jaxkv.decode import new_cache
from jaxkv.models.llama import MATRICES, Llama
from jaxkv.models.weights import QuantizedWeight, dense, embed_lookup, legacy_leaves, quantize
from jaxkv.testing import numpy_weights, tiny_model

RNG = np.random.default_rng(0)


def ref_int8(w):
    """Q8_0 per block of 32 inputs (rows of ``w[I, O]``): codes [I, O], float16 scales [I/32, O]."""
    out = np.empty(w.shape, np.int8)
    scales = np.empty((w.shape[0] // 32, w.shape[1]), np.float16)
    for b in range(w.shape[0] // 32):
        for o in range(w.shape[1]):
            block = w[32 * b : 32 * b + 32, o]
            d = np.float16(np.abs(block).max() / 127 or 1)
            scales[b, o] = d
            out[32 * b : 32 * b + 32, o] = np.clip(np.round(block / np.float32(d)), -127, 127)
    return out, scales


def ref_q4(w):
    """Q4_1 per block of 32 inputs: 4-bit codes [I, O], float16 scales and mins [I/32, O]."""
    out = np.empty(w.shape, np.uint8)
    scales = np.empty((w.shape[0] // 32, w.shape[1]), np.float16)
    mins = np.empty_like(scales)
    for b in range(w.shape[0] // 32):
        for o in range(w.shape[1]):
            block = w[32 * b : 32 * b + 32, o]
            lo = np.float16(block.min())
            d = np.float16((block.max() - block.min()) / 15 or 1)
            scales[b, o], mins[b, o] = d, lo
            out[32 * b : 32 * b + 32, o] = np.clip(np.round((block - np.float32(lo)) / np.float32(d)), 0, 15)
    return out, scales, mins


def test_int8_codes_match_the_reference_and_gguf_q8_0():
    w = RNG.standard_normal((64, 5)).astype(np.float32)
    w[32:, 2] = 0  # an all-zero block: scale 1, codes 0
    qw = quantize(w, "int8")
    codes, scales = ref_int8(w)
    np.testing.assert_array_equal(np.asarray(qw.codes).T, codes)  # held transposed: [O, I]
    np.testing.assert_array_equal(np.asarray(qw.scales).T, scales)
    # the same blocks as GGUF Q8_0 bytes (per output row: f16 d, 32 int8 codes), through gguf's dequantiser
    raw = np.concatenate(
        [
            np.concatenate([scales[b, o : o + 1].view(np.uint8), codes[32 * b : 32 * b + 32, o].view(np.uint8)])
            for o in range(5)
            for b in range(2)
        ]
    ).reshape(5, -1)
    np.testing.assert_array_equal(
        np.asarray(qw.dequantize()), gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0).T
    )
    assert np.abs(np.asarray(qw.dequantize()) - w).max() <= np.abs(w).max() / 254 * 1.01


def test_q4_codes_match_the_reference_and_gguf_q4_1():
    w = RNG.standard_normal((64, 5)).astype(np.float32)
    w[:32, 3] = 0.25  # a constant block: scale 1, min 0.25, codes 0, reconstructed exactly
    qw = quantize(w, "q4")
    codes, scales, mins = ref_q4(w)
    packed = np.asarray(qw.codes)  # [O, I/2]: input j in the low nibble, j + I/2 in the high one
    assert packed.shape == (5, 32)
    np.testing.assert_array_equal(np.concatenate([packed & 15, packed >> 4], axis=-1).T, codes)
    np.testing.assert_array_equal(np.asarray(qw.scales).T, scales)
    np.testing.assert_array_equal(np.asarray(qw.mins).T, mins)
    ggml = codes.astype(np.uint8).reshape(2, 2, 16, 5)  # ggml's Q4_1 block: inputs j and j + 16 share byte j
    ggml = ggml[:, 0] | (ggml[:, 1] << 4)  # [block, 16, O]
    raw = np.concatenate(
        [
            np.concatenate([scales[b, o : o + 1].view(np.uint8), mins[b, o : o + 1].view(np.uint8), ggml[b, :, o]])
            for o in range(5)
            for b in range(2)
        ]
    ).reshape(5, -1)
    deq = np.asarray(qw.dequantize())
    np.testing.assert_allclose(deq, gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).T, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(deq[:32, 3], 0.25)


@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_a_matrix_quantised_in_parts_of_rows_equals_the_reference(fmt):
    """quantize works through a few thousand output rows at a time (its temporaries stay small
    for an embedding table); a matrix of more rows than a part, stacked, gets the reference's codes."""
    w = RNG.standard_normal((2, 40, 4100)).astype(np.float32)  # [L, I, O]: I padded to 64, O over one part
    qw = quantize(w, fmt)
    assert qw.codes.shape == (2, 4100, 64 if fmt == "int8" else 32) and qw.scales.shape == (2, 4100, 2)
    padded = np.concatenate([w[1], np.zeros((24, 4100), np.float32)])
    ref = (ref_int8 if fmt == "int8" else ref_q4)(padded)
    codes = np.asarray(qw.codes[1]) if fmt == "int8" else np.concatenate([qw.codes[1] & 15, qw.codes[1] >> 4], axis=-1)
    np.testing.assert_array_equal(codes.T, ref[0])
    for held, expected in zip((qw.scales, qw.mins)[: len(ref) - 1], ref[1:]):
        np.testing.assert_array_equal(np.asarray(held[1]).T, expected)


@pytest.mark.parametrize("fmt", ["int8", "q4"])
@pytest.mark.parametrize("tokens", [1, 9])  # decode (one fused loop on XLA CPU) and prefill (a matrix product)
def test_dense_and_embedding_of_codes_equal_their_dequantised_matrix(fmt, tokens):
    w = RNG.standard_normal((48, 7)).astype(np.float32)  # 48 inputs: padded to 64 with zero weights
    qw = jax_tree(quantize(w, fmt))
    x = jnp.asarray(RNG.standard_normal((1, tokens, 48)), jnp.float32)
    deq = np.asarray(qw.dequantize())
    assert deq.shape == (48, 7) and qw.shape == (48, 7)
    np.testing.assert_allclose(np.asarray(dense(x, qw)), np.asarray(x) @ deq, rtol=1e-5, atol=1e-5)
    ids = jnp.asarray([[3, 0, 6]], jnp.int32)  # a table [V=7, D=48] held as its transpose
    np.testing.assert_array_equal(np.asarray(embed_lookup(qw, ids)), deq.T[np.asarray(ids)])


def jax_tree(qw: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(
        codes=jnp.asarray(qw.codes),
        scales=jnp.asarray(qw.scales),
        mins=None if qw.mins is None else jnp.asarray(qw.mins),
        n_in=qw.n_in,
        format=qw.format,
    )


def logits_of(model, tokens):
    gd, st = nnx.split(model)
    cache = new_cache(model.config, CacheSpec(max_len=32), 1)
    return np.asarray(forward(gd, st, tokens, jnp.asarray([tokens.shape[1]], jnp.int32), cache)[0][0])


TOKENS = jnp.asarray(RNG.integers(0, 64, (1, 12)), jnp.int32)
BOUNDS = {"bf16": 0.05, "fp16": 0.005, "int8": 0.2, "q4": 1.6}
"""max |logit - fp32 logit| on the tiny model (logits up to 2.1); measured: bf16 0.021,
fp16 0.0022, int8 0.095, q4 0.80 (random Gaussian weights, the worst case for 4 bits)."""


@pytest.mark.parametrize("fmt", list(BOUNDS))
def test_each_form_logits_near_fp32(fmt):
    model = tiny_model()
    ref = logits_of(model, TOKENS)
    weights = numpy_weights(model)
    held = Llama.from_weights(model.config, weights, weight_format=fmt)
    got = logits_of(held, TOKENS)
    assert np.abs(got - ref).max() <= BOUNDS[fmt], np.abs(got - ref).max()
    assert np.abs(got - ref).max() > 0  # the format is really in use
    if fmt in ("int8", "q4"):  # on the fly == the fp32 model holding the dequantised matrices, prefill and decode
        deq = {name: np.asarray(getattr(held, name)[...].dequantize()) for name in MATRICES if name in weights}
        deq["embed"] = deq["embed"].T
        exact = Llama.from_weights(model.config, {**weights, **deq})
        np.testing.assert_allclose(got, logits_of(exact, TOKENS), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            logits_of(held, TOKENS[:, :3]), logits_of(exact, TOKENS[:, :3]), rtol=1e-5, atol=1e-5
        )


HELD_AS = {"bf16": "bf16", "fp16": "f16", "int8": "s8", "q4": "u8"}


@pytest.mark.parametrize("fmt", list(HELD_AS))
def test_compiled_decode_step_takes_the_weights_in_their_format(fmt):
    """The entry parameters of the compiled decode loop: the stacked w_gate [L=2, D=32, F=48],
    held transposed ([2, 48, 32]; codes [2, 48, 32] int8 or [2, 48, 16] q4), arrives in its
    format, and no float32 parameter has a matrix's shape, either orientation (a later change
    cannot upcast them at load time)."""
    model = Llama.from_weights(tiny_model().config, numpy_weights(tiny_model()), weight_format=fmt)
    hlo = decode_loop_hlo(model, CacheSpec(sink=2, window=8))
    entry = hlo[hlo.index("ENTRY") :]
    params = re.findall(r"= (\w+)\[([\d,]*)\]\{[^}]*\} parameter\(\d+\)", entry.split("\n}\n")[0])
    shape = {"bf16": "2,48,32", "fp16": "2,48,32", "int8": "2,48,32", "q4": "2,48,16"}[fmt]
    assert (HELD_AS[fmt], shape) in params, params
    matrices = {
        "2,32,32",
        "2,32,16",
        "2,16,32",
        "2,32,48",
        "2,48,32",
        "64,32",
        "32,64",
    }  # wq, wk/wv, w_gate/up, w_down, embed
    assert not [p for p in params if p[0] == "f32" and p[1] in matrices], params


def test_weights_flag_refuses_a_bad_format_in_one_line(capsys):
    one_error_line(
        *cli(capsys, "sample", *STORIES, "--weights", "int3", "--tokens", "1", "--prompt", "hi")[::2],
        "--weights int3: expected one of auto, fp32, bf16, fp16, int8, q4, q8_0, q4_0, q4_1",
    )


def test_a_weight_format_with_a_low_precision_dtype_is_refused():
    model = tiny_model()
    with pytest.raises(
        JaxkvError, match="weights='int8' computes in float32 between layers: expected dtype float32, got bfloat16"
    ):
        Llama.from_weights(model.config, numpy_weights(model), dtype=jnp.bfloat16, weight_format="int8")


@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_legacy_leaves_are_the_layout_chat_fingerprints_hash(fmt):
    """A chat file's weights fingerprint hashes the codes as jaxkv held them before they were
    held transposed and flat: int8 codes [I/32, 32, O]; q4 in ggml's packing [I/32, 16, O]
    (inputs j and j + 16 of a block share byte j); scales and mins [I/32, O]."""
    w = RNG.standard_normal((64, 5)).astype(np.float32)
    ref = ref_int8(w) if fmt == "int8" else ref_q4(w)
    codes = ref[0].reshape(2, 32, 5)
    if fmt == "q4":
        codes = codes[:, :16].astype(np.uint8) | (codes[:, 16:].astype(np.uint8) << 4)
    leaves = legacy_leaves(quantize(w, fmt))
    assert len(leaves) == len(ref)
    np.testing.assert_array_equal(leaves[0], codes)
    for got, want in zip(leaves[1:], ref[1:]):
        np.testing.assert_array_equal(got, want)
