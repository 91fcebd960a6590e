"""ggml's CPU matrix product as an XLA custom call (``jax.ffi``): the product of the weights
held in ggml's block types (:class:`jaxkv.models.weights.BlockWeight`).

Why: XLA CPU converts a quantised weight to float32 in memory before every batched dot
(docs/PERFORMANCE.md, "Batched integer products under XLA CPU"), so integer weights made
batches slower than fp32. ggml (the kernel library of llama.cpp) multiplies its blocks
directly: the activations are quantised to its dot type (Q8_0 / Q8_1 blocks of 32, as
llama.cpp does) and each weight block is read once per product, in its packed form.

The library is the ``libggml-python`` wheel (prebuilt ggml, a dependency of jaxkv), or the
ggml build that ``$JAXKV_GGML_DIR`` names (a folder holding ``include/ggml.h`` and its
``lib*/libggml-cpu.*``: e.g. one built for this machine, with llamafile's batched kernels).
The shim ``ggml_mul_mat.cc`` (beside this file) is compiled once with the machine's C++
compiler (``$CXX`` or ``c++``) against jaxlib's FFI headers and that library, into
``$XDG_CACHE_HOME/jaxkv/ffi`` (``~/.cache/jaxkv/ffi``; beside the compiled programs of
:func:`jaxkv.cli.use_compile_cache`), keyed by its source, the jaxlib version and the
library's path. Where any of that is missing, or the computation runs on another platform
than the CPU, :func:`available` is False and :func:`jaxkv.models.weights.dense` dequantises
the blocks inside the XLA program instead (same weights, float32 activations).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

MAX_ROWS = 16
"""The most rows (tokens) a product gives ggml; more go to XLA's dot of the dequantised blocks.
Measured (scripts/bench_matmul.py, SmolLM2's products, 2-core AMD EPYC, the libggml-python
wheel): ggml 2.9-3.1x fp32 at 1 row, 1.25-1.56x at 16, 0.53-0.63x at 64, where XLA's dot of
dequantised weights is ~1.0x (docs/PERFORMANCE.md)."""
TARGET = "jaxkv_ggml_mul_mat"
"""The custom call's name in XLA's registry."""
SOURCE = pathlib.Path(__file__).with_name("ggml_mul_mat.cc")


def threads() -> int:
    """Threads of ggml's pool for one product: ``$JAXKV_GGML_THREADS``, else the CPUs this
    process may run on."""
    if os.environ.get("JAXKV_GGML_THREADS"):
        return max(1, int(os.environ["JAXKV_GGML_THREADS"]))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def library_dir() -> pathlib.Path | None:
    """The ggml installation used: ``$JAXKV_GGML_DIR``, else the ``libggml`` package's, else None."""
    if os.environ.get("JAXKV_GGML_DIR"):
        return pathlib.Path(os.environ["JAXKV_GGML_DIR"])
    try:
        import libggml
    except ImportError:
        return None
    return pathlib.Path(libggml.__file__).parent


def _lib_subdir(root: pathlib.Path) -> pathlib.Path | None:
    for sub in ("lib64", "lib", "bin", "."):
        if any((root / sub).glob("*ggml-cpu.*")):
            return root / sub
    return None


def _build() -> pathlib.Path:
    """The compiled shim (built now if its cache entry is missing). Raises RuntimeError naming
    what is missing."""
    root = library_dir()
    if root is None or not (root / "include" / "ggml.h").is_file():
        raise RuntimeError("no ggml library: install libggml-python, or set $JAXKV_GGML_DIR")
    lib = _lib_subdir(root)
    if lib is None:
        raise RuntimeError(f"{root}: no libggml-cpu library under lib64/, lib/ or bin/")
    import jaxlib

    key = hashlib.sha256(
        b"\0".join([SOURCE.read_bytes(), jaxlib.__version__.encode(), str(lib).encode(), sys.platform.encode()])
    ).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "jaxkv" / "ffi" / key
    out = cache / ("jaxkv_ggml.dll" if sys.platform == "win32" else "libjaxkv_ggml.so")
    if out.is_file():
        return out
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (set $CXX)")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, renamed: concurrent builds stay whole
        built = pathlib.Path(tmp) / out.name
        cmd = [
            cxx, "-O2", "-std=c++17", "-shared", "-fPIC", str(SOURCE), "-o", str(built),
            f"-I{jax.ffi.include_dir()}", f"-I{root / 'include'}", f"-L{lib}",
            "-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{lib}",
        ]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        os.replace(built, out)
    return out


@functools.cache
def _register() -> str | None:
    """Build and register the custom call once per process: None, or why it is unavailable."""
    try:
        import ctypes

        path = _build()
        handler = ctypes.CDLL(str(path)).JaxkvGgmlMulMat
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    except (RuntimeError, OSError, AttributeError) as err:
        log.info("ggml's matrix product unavailable, dequantising in XLA instead: %s", err)
        return str(err)
    return None


def available() -> bool:
    """True when :func:`mul_mat` can run here: the computation's platform is the CPU and the
    shim built and registered (see the module docstring)."""
    return jax.default_backend() == "cpu" and _register() is None


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    if jax.default_backend() != "cpu":
        return f"the computation runs on {jax.default_backend()}, not the CPU"
    return _register()


def mul_mat(x: jax.Array, blocks: jax.Array, layer: jax.Array, ggml_type: int) -> jax.Array:
    """``x @ W[layer].T`` by ggml, for ``W`` held in ggml's block type ``ggml_type``.

    Args:
      x: float32 ``[M, K]`` activations (K a multiple of the type's block size).
      blocks: uint8 ``[..., N, R]``: rows of ``R`` bytes (K inputs of the type each), under any
        leading axes (a model's stacked layers; read in place, not copied).
      layer: int32 ``[1]``, the index of ``W`` among the leading axes flattened (0 for none).
      ggml_type: ``ggml_type`` / ``gguf.GGMLQuantizationType`` value (Q8_0 8, Q4_0 2, Q4_1 3).
    Returns:
      float32 ``[M, N]``.
    Raises:
      RuntimeError: from :func:`available`'s reasons, when it is False (check it first).
    """
    if _register() is not None:
        raise RuntimeError(f"ggml's matrix product is unavailable: {_register()}")
    out = jax.ShapeDtypeStruct((x.shape[0], blocks.shape[-2]), jnp.float32)
    call = jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")
    return call(x, blocks, layer, type=np.int64(ggml_type), threads=np.int64(threads()))
