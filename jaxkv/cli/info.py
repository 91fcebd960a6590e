"""``jaxkv info``: versions, backend, devices and the cache modes the backend is known to run."""

from __future__ import annotations

import importlib.metadata as md
import platform

import jax

from jaxkv.eval.audit import backend_support
from jaxkv.io.registry import FAMILIES


def add_parser(sub) -> None:
    i = sub.add_parser("info", help="backend, devices and versions")
    i.set_defaults(func=run)


def _version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def run(args) -> None:
    versions = [f"{d} {_version(d)}" for d in ("jaxkv", "jax", "jaxlib", "flax", "chex", "numpy") if _version(d)]
    plugins = [f"{d} {_version(d)}" for d in ("jax-metal", "jax-mps") if _version(d)]
    print(f"python {platform.python_version()} on {platform.system()} {platform.machine()}")
    print("versions: " + ", ".join(versions))
    print(
        "Apple plugins: "
        + (", ".join(plugins) if plugins else "none installed (pip install 'jaxkv[metal]' or 'jaxkv[mps]')")
    )
    backend = jax.default_backend()
    devices = jax.devices()
    print(f"backend {backend}; devices: {', '.join(f'{d} ({d.device_kind})' for d in devices)}")
    support = backend_support(devices[0].platform if devices else backend)
    print(f"cache modes on {backend}: " + ", ".join(f"{mode} {status}" for mode, status in support.items()))
    print(
        "model families: "
        + "; ".join(
            f"{f.name} (HF {', '.join(f.hf.architectures)}; GGUF {', '.join(f.gguf.architectures)})"
            for f in FAMILIES.values()
        )
    )
    print(
        "local sliding-window layers (Mistral, Gemma 2/3, Phi-3) keep the model's own window in the cache, in the "
        "chosen storage; the StreamingLLM flags bound the global layers"
    )
