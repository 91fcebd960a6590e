"""The matrix products of one SmolLM2-135M decode step under XLA, in each candidate form of the
integer weight product, at B rows (issue 43's first measurement; docs/PERFORMANCE.md).

Every form runs the seven per-layer products of SmolLM2 (q, k, v, o, gate, up, down: ``[O, I]``
held transposed, as jaxkv holds them) for 30 stacked layers in one ``lax.scan``, B rows of
activations; random weights (only the shapes and dtypes matter for the time). The LM head is
left out. Forms:

* ``fp32``: ``x @ W.T``, float32 weights (538 MB read a step with the head; here 30 x 6.6 MB);
* ``int8-blocks``: jaxkv's ``--weights int8`` (codes ``int8[O, I]`` with a float16 scale per
  block of 32 inputs, GGUF Q8_0's numbers), dequantised into the dot (:func:`jaxkv.models.weights.dense`);
* ``int8-blocks-dot``: the same codes, activations quantised to int8 per block of 32 (llama.cpp's
  Q8_0 activations), one int8 x int8 -> int32 dot per block (``einsum('bnk,onk->bon')``), scaled
  and summed: Q8_0 x Q8_0 as ggml computes it;
* ``int8-rows-dot``: per-output-channel int8 weights, activations quantised to int8 per row, one
  int8 x int8 -> int32 dot over the whole row, both scales after (W8A8);
* ``int8-rows-f32``: the same codes and activation codes multiplied in float32 (the products are
  integers, exact while a row's sum stays below 2**24), the form a one-row step would use;
* ``ggml-q8_0``, ``ggml-q4_0``, ``ggml-q4_1``: jaxkv's ``--weights q8_0 / q4_0 / q4_1``, ggml's
  blocks multiplied by ggml's CPU product through ``jax.ffi`` (:mod:`jaxkv.models.ggml`), the
  stacked blocks read in place (the scan passes a layer index, as jaxkv's models do).

Usage: python scripts/bench_matmul.py [--rows 1,16,64] [--rounds 3] [--forms ...]
Prints each form's milliseconds per step (best of 5 calls per round), round by round, forms
alternating within a round.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.models import ggml
from jaxkv.models.weights import BLOCK_FORMATS, BlockWeight, dense, quantize

LAYERS, D, F = 30, 576, 1536
SHAPES = ((D, D), (192, D), (192, D), (D, D), (F, D), (F, D), (D, F))  # [O, I] of q, k, v, o, gate, up, down
BLOCK = 32


def _row_codes(x):
    """int8 codes of each row of ``x [B, I]`` and its scale ``[B, 1]`` (max |x| / 127)."""
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127
    scale = jnp.where(scale == 0, 1, scale)
    return jnp.round(x / scale), scale


def fp32(x, w):
    return x @ w.T


def int8_blocks(x, w):
    codes, scales = w
    o, i = codes.shape
    rows = codes.reshape(o, i // BLOCK, BLOCK).astype(jnp.float32) * scales.astype(jnp.float32)[..., None]
    return x @ rows.reshape(o, i).T


def int8_blocks_dot(x, w):
    codes, scales = w
    (o, i), b = codes.shape, x.shape[0]
    xq, xs = _row_codes(x.reshape(b, i // BLOCK, BLOCK))
    part = jnp.einsum(
        "bnk,onk->bon", xq.astype(jnp.int8), codes.reshape(o, i // BLOCK, BLOCK), preferred_element_type=jnp.int32
    )
    return (part.astype(jnp.float32) * xs[..., 0][:, None, :] * scales.astype(jnp.float32)[None]).sum(-1)


def int8_rows_dot(x, w):
    codes, scales = w
    xq, xs = _row_codes(x)
    acc = lax.dot_general(xq.astype(jnp.int8), codes, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * xs * scales.T


def int8_rows_f32(x, w):
    codes, scales = w
    xq, xs = _row_codes(x)
    return (xq @ codes.T.astype(jnp.float32)) * xs * scales.T


FORMS = {
    "fp32": (fp32, "fp32"),
    "int8-blocks": (int8_blocks, "blocks"),
    "int8-blocks-dot": (int8_blocks_dot, "blocks"),
    "int8-rows-dot": (int8_rows_dot, "rows"),
    "int8-rows-f32": (int8_rows_f32, "rows"),
    **{f"ggml-{fmt}": (dense, fmt) for fmt in BLOCK_FORMATS},
}


def weights(kind: str, rng: np.random.Generator):
    """The seven stacked matrices ``[L, O, I]`` in ``kind``: fp32, block-32 int8, per-row int8, or
    ggml's blocks (a :class:`~jaxkv.models.weights.BlockWeight`)."""
    out = []
    for o, i in SHAPES:
        w = rng.normal(size=(LAYERS, o, i)).astype(np.float32) * 0.05
        if kind == "fp32":
            out.append(jnp.asarray(w))
            continue
        if kind in BLOCK_FORMATS:  # quantize takes W[..., I, O]
            out.append(jax.tree.map(jnp.asarray, quantize(np.swapaxes(w, -1, -2), kind)))
            continue
        groups = w.reshape(LAYERS, o, -1, BLOCK) if kind == "blocks" else w[..., None, :]
        scale = np.abs(groups).max(-1) / 127
        codes = np.round(groups / scale[..., None]).astype(np.int8).reshape(LAYERS, o, i)
        out.append((jnp.asarray(codes), jnp.asarray(scale.astype(np.float16 if kind == "blocks" else np.float32))))
    return out


def step(product):
    """One decode step's products: every layer's seven matrices applied to rows derived from the carry."""

    def layer(x, ws):
        acc = x
        for w in ws:
            n_in = w.shape[-2] if isinstance(w, BlockWeight) else (w[0] if isinstance(w, tuple) else w).shape[-1]
            y = product(x if n_in == D else jnp.concatenate([x] * 3, axis=-1)[:, :n_in], w)
            acc = acc + 1e-3 * (y if y.shape[-1] == D else jnp.mean(y, axis=-1, keepdims=True))
        return acc, None

    def run(x, ws):
        if isinstance(ws[0], BlockWeight):  # the stacks read in place: the scan runs over layer indices
            return lax.scan(lambda x, i: layer(x, [w.at(i) for w in ws]), x, jnp.arange(LAYERS))[0]
        return lax.scan(layer, x, ws)[0]

    return jax.jit(run)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,16,64", help="batch sizes B (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, forms alternating within each (default: %(default)s)")
    p.add_argument("--forms", default=",".join(FORMS), help="forms to run (default: all: %(default)s)")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    forms = args.forms.split(",")
    held = {kind: weights(kind, rng) for kind in {FORMS[f][1] for f in forms}}
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.devices()[0].device_kind}")
    if any(f.startswith("ggml-") for f in forms):
        print(f"ggml: {ggml.library_dir()}, {ggml.threads()} threads; {ggml.unavailable_reason() or 'available'}")
    for b in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.normal(size=(b, D)).astype(np.float32))
        runs = {f: step(FORMS[f][0]) for f in forms}
        for f in forms:
            runs[f](x, held[FORMS[f][1]]).block_until_ready()  # compile
        times: dict[str, list[float]] = {f: [] for f in forms}
        for _ in range(args.rounds):
            for f in forms:
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    runs[f](x, held[FORMS[f][1]]).block_until_ready()
                    best = min(best, time.perf_counter() - t0)
                times[f].append(best * 1e3)
        base = np.median(times["fp32"]) if "fp32" in times else None
        for f in forms:
            ratio = f"  {base / np.median(times[f]):.2f}x fp32" if base else ""
            print(f"B={b:3d} {f:16s} " + " ".join(f"{t:7.1f}" for t in times[f]) + f" ms{ratio}")


if __name__ == "__main__":
    main()
