"""Shared fixtures: the golden outputs and the real models of ../shared/data (paths in
tests/paths.py); the tiny random model is :mod:`jaxkv.testing`'s, the NumPy references
are in tests/reference.py."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

import jax
import pytest
from flax import nnx

from paths import GOLDEN, SMOLLM2, STORIES_BIN, TOK512_MODEL

jax.config.update("jax_platforms", "cpu")
os.environ.setdefault("JAXKV_COMPILE_CACHE", "off")  # `python -m jaxkv.cli` subprocesses: no cache in $HOME


def _suite_compile_cache() -> None:
    """One JAX persistent compilation cache for the whole run (jax >= 0.6), so that each program
    is compiled once: by this process, the pytest-xdist workers (started after this import, they
    inherit the environment) and every ``python -m jaxkv.cli`` subprocess. It is
    ``$JAX_COMPILATION_CACHE_DIR`` when set (``scripts/test.sh --quick`` keeps one between runs),
    else a temporary folder removed when the process that made it exits. jax 0.5.0's CPU
    executables reloaded from the cache decode garbage (:func:`jaxkv.cli.use_compile_cache`), so
    the floor runs without it."""
    if jax.__version_info__ < (0, 6):
        return
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        where = tempfile.mkdtemp(prefix="jaxkv-test-xla-")
        atexit.register(shutil.rmtree, where, ignore_errors=True)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = where
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs", float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])
    )
    jax.config.update(
        "jax_persistent_cache_min_entry_size_bytes", int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"])
    )


_suite_compile_cache()


@pytest.fixture(scope="session")
def golden():
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="session")
def stories():
    """stories260K with its SentencePiece tokenizer, as a LoadedModel."""
    from jaxkv import load_model

    return load_model(STORIES_BIN, tokenizer=TOK512_MODEL)


@pytest.fixture(scope="session")
def smollm2():
    from jaxkv import load_model

    return load_model(SMOLLM2)


@pytest.fixture(scope="session")
def chunked():
    """``chunked(spec, tokens, chunk, model=None, cache=None, sizes=None) -> (logits, cache)``:
    the logits float32[T, V] of every token when ``tokens`` (T ids) are streamed through
    jaxkv's forward in chunks of up to ``chunk`` (:func:`jaxkv.decode.plan_chunks`), into
    ``cache`` (default: a new one-row cache of ``spec``) of ``model`` (default:
    ``jaxkv.testing.tiny_model()``); each chunk's token count is appended to ``sizes`` if given."""
    import jax.numpy as jnp
    import numpy as np

    from jaxkv import forward
    from jaxkv.decode import new_cache, plan_chunks
    from jaxkv.testing import tiny_model

    step = jax.jit(forward, static_argnums=0, donate_argnames="cache")

    def run(spec, tokens, chunk, model=None, cache=None, sizes=None):
        model = model or tiny_model()
        gd, st = nnx.split(model)
        if cache is None:
            cache = new_cache(model.config, spec, 1)
        rows = []
        for c in plan_chunks(spec, np.asarray(cache.length), [len(tokens)], chunk):
            logits, cache = step(gd, st, jnp.asarray(c.take([tokens], chunk)), jnp.asarray(c.n), cache)
            rows.append(np.asarray(logits[0, : c.n[0]]))
            if sizes is not None:
                sizes.append(int(c.n[0]))
        return np.concatenate(rows), cache

    return run


def decode_loop_hlo(model, spec) -> str:
    """The compiled HLO text of jaxkv's decode loop (:func:`jaxkv.decode.lower_decode`) for one row."""
    from jaxkv.decode import Sampler, lower_decode, new_cache

    cache = new_cache(model.config, spec, 1)
    return lower_decode(model, cache, sampler=Sampler(), block=4, eos_id=None, max_new_tokens=5).compile().as_text()
