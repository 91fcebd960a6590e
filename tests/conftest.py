"""Shared fixtures: the real files in ../shared/data, a tiny random Llama, a jitted step."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re

import jax
import numpy as np
import pytest
from flax import nnx

jax.config.update("jax_platforms", "cpu")

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = pathlib.Path(os.environ.get("JAXKV_DATA", REPO.parent / "shared" / "data"))
MODELS = DATA / "models"
STORIES_BIN = MODELS / "stories260K.bin"
STORIES_GGUF = MODELS / "stories260K.gguf"
TOK512_MODEL = MODELS / "tok512.model"
TOK512_BIN = MODELS / "tok512.bin"
SMOLLM2 = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = DATA / "text" / "tinystories_valid_head.txt"


@pytest.fixture(scope="session")
def golden():
    return json.loads((DATA / "golden" / "golden.json").read_text())


@pytest.fixture(scope="session")
def stories():
    """stories260K with its SentencePiece tokenizer, as a LoadedModel."""
    from jaxkv import load_model

    return load_model(STORIES_BIN, tokenizer=TOK512_MODEL)


@pytest.fixture(scope="session")
def smollm2():
    from jaxkv import load_model

    return load_model(SMOLLM2)


TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, hidden_dim=48, rope_theta=10000.0)


@functools.lru_cache(maxsize=None)
def tiny_model(seed: int = 0, **overrides):
    """A small random GQA Llama (N=4 query heads over K=2 KV heads) and its numpy weights."""
    from jaxkv.models.config import LlamaConfig
    from jaxkv.models.llama import Llama, weight_shapes

    config = LlamaConfig(**{**TINY, **overrides})
    model = Llama(config, rngs=nnx.Rngs(seed))
    weights = {name: np.asarray(getattr(model, name)[...]) for name in weight_shapes(config)}
    ref_cfg = dict(n_heads=config.n_heads, n_kv_heads=config.n_kv_heads, head_dim=config.head_dim,
                   theta=config.rope_theta, eps=config.norm_eps, tie=config.tie_embeddings)
    return model, weights, ref_cfg


def ref_kwargs(spec):
    """RefDecoder keyword arguments describing a CacheSpec."""
    kw = dict(sink=spec.sink, window=spec.window, positions=spec.positions)
    if spec.quantized:
        kw.update(bits=spec.bits, group_size=spec.group_size, residual=spec.residual,
                  scale_dtype=np.dtype(spec.scale_dtype).type)
    return kw


def decode_loop_hlo(model, spec) -> str:
    """The compiled HLO text of jaxkv's decode loop (:func:`jaxkv.decode.lower_decode`) for one row."""
    from jaxkv.decode import Sampler, lower_decode, new_cache

    cache = new_cache(model.config, spec, 1)
    return lower_decode(model, cache, sampler=Sampler(), block=4, eos_id=None, max_new_tokens=5).compile().as_text()


def materialised_buffers(hlo: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(instruction, element type, shape) of every buffer a compiled program writes: the
    instructions outside fusion bodies, less parameters, tuple elements and bitcasts."""
    out, fused = [], False
    for line in hlo.splitlines():
        if line.endswith("{") and not line.startswith(" "):  # a computation begins
            fused = "fused_computation" in line or line.startswith("%wrapped")
        elif not fused and (m := re.match(r"\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]", line)):
            if not re.search(r"= \S+ (parameter|get-tuple-element|bitcast)\(", line):
                out.append((m.group(1), m.group(2), tuple(int(d) for d in m.group(3).split(",") if d)))
    return out
