"""``jaxkv info``: versions, backend, devices and the cache modes the backend is known to run."""

from __future__ import annotations

import importlib.metadata as md
import platform

import jax

from jaxkv.eval.audit import backend_support


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
    print("Apple plugins: " + (", ".join(plugins) if plugins else "none installed (pip install 'jaxkv[metal]' or 'jaxkv[mps]')"))
    backend = jax.default_backend()
    devices = jax.devices()
    print(f"backend {backend}; devices: {', '.join(f'{d} ({d.device_kind})' for d in devices)}")
    support = backend_support(devices[0].platform if devices else backend)
    print(f"cache modes on {backend}: " + ", ".join(f"{mode} {status}" for mode, status in support.items()))
