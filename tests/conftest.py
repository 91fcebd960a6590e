"""Shared fixtures: the golden outputs and the real models of ../shared/data (paths in
tests/paths.py); the tiny random model is :mod:`jaxkv.testing`'s, the NumPy references
are in tests/reference.py."""

from __future__ import annotations

import atexit
import gc
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


# ---- the process's memory mappings ------------------------------------------------------------
MAPPINGS_CLEARED_ABOVE = 30_000
"""Memory mappings of a test process above which the compiled programs are let go at the end of a
test module. Every XLA:CPU executable maps its code (~5 mappings for a one-op program, ~340 for the
programs of one ``jaxkv.sample`` with a new cache), and JAX's caches keep them alive: a pytest-xdist
worker reached Linux's default ``vm.max_map_count`` (65,530) ~12 minutes into the whole suite, where
the next mapping failed and jaxlib segfaulted (2026-12-07, inside ``executable.serialize()`` as the
persistent compilation cache wrote a program; a floor worker held 34,561 mappings 6 minutes in)."""


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to keep under
        return 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a module in this process (its module fixtures gone), free JAX's
    compiled programs if the process holds over :data:`MAPPINGS_CLEARED_ABOVE` mappings (the next
    module compiles or loads again what it needs)."""
    yield
    last_of_module = nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None)
    if last_of_module and _mappings() > MAPPINGS_CLEARED_ABOVE:
        from jaxkv.decode import loop

        loop._EXECUTABLES.clear()
        jax.clear_caches()
        gc.collect()


# ---- --compile-counts: the XLA compiles of each test module -----------------------------------
_counted = {"programs": 0, "hits": 0, "seconds": 0.0}  # since the last test phase's report


def _on_duration(event: str, seconds: float, **_) -> None:
    from jaxkv.decode import loop  # imported after the platform is set

    if event == loop.COMPILE_EVENT:  # a compile or a persistent-cache load
        _counted["programs"] += 1
        _counted["seconds"] += seconds


def _on_event(event: str, **_) -> None:
    from jaxkv.decode import loop

    if event == loop.CACHE_HIT_EVENT:
        _counted["hits"] += 1


def pytest_addoption(parser):
    parser.addoption(
        "--compile-counts",
        action="store_true",
        help="print each test module's XLA programs (compiled, loaded from the persistent cache), their seconds and the module's test seconds",
    )


def pytest_configure(config):
    if config.getoption("--compile-counts"):
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        jax.monitoring.register_event_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's (setup, call, teardown) counts travel in its report (pytest-xdist sends them
    from the workers)."""
    report = (yield).get_result()
    if item.config.getoption("--compile-counts"):
        report.user_properties.append(("xla", dict(_counted)))
        _counted.update(programs=0, hits=0, seconds=0.0)


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("--compile-counts"):
        return
    modules: dict[str, list] = {}  # compiled, loaded, compile seconds, test seconds (setup, call, teardown)
    for reports in terminalreporter.stats.values():
        for report in reports:
            if not isinstance(report, pytest.TestReport):
                continue
            m = modules.setdefault(report.nodeid.split("::")[0], [0, 0, 0.0, 0.0])
            m[3] += report.duration
            for key, n in getattr(report, "user_properties", ()):
                if key == "xla":
                    m[0], m[1], m[2] = m[0] + n["programs"] - n["hits"], m[1] + n["hits"], m[2] + n["seconds"]
    terminalreporter.section("XLA programs and test seconds per test module")
    terminalreporter.write_line(f"{'compiled':>9} {'loaded':>7} {'compile s':>9} {'test s':>8}  module")
    for name, (compiled, hits, seconds, spent) in sorted(modules.items(), key=lambda kv: -kv[1][3]):
        terminalreporter.write_line(f"{compiled:9d} {hits:7d} {seconds:9.1f} {spent:8.1f}  {name}")
    total = [sum(m[i] for m in modules.values()) for i in range(4)]
    terminalreporter.write_line(f"{total[0]:9d} {total[1]:7d} {total[2]:9.1f} {total[3]:8.1f}  in all")


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
