"""Decoding over several devices with JAX's SPMD partitioner: a ``("data", "kv")`` mesh.

Nothing here schedules work by hand. The cache leaves and the parameters get a
:class:`~jax.sharding.NamedSharding` each (:func:`create_cache`, :func:`shard_cache`,
:func:`shard_model`); the jitted prefill and decode functions of :mod:`jaxkv.decode`
then run unchanged and ``jax.jit`` partitions them from their inputs' shardings (the
cache is donated, so each step's cache comes back with the same shardings it went in with).

Mesh axes:

* ``data``: the batch axis B of the cache (data parallel): each device holds, attends
  over and writes only its own rows.
* ``kv``: the KV-head axis K of the cache and, with it, the attention heads of the
  parameters (tensor parallel, Megatron style): ``wq``/``wk``/``wv`` split by output
  heads, ``wo`` by input heads, the MLP by its hidden units; one all-reduce per
  attention block and per MLP joins the partial sums. Query heads stay with their KV head
  (GQA: head ``n`` reads KV head ``n // (N / K)``), so attention itself needs no
  communication.

Cache leaf layouts and their partition specs (DESIGN §1 letters):

=======================================  ==========================  ==========================
leaf                                     shape                       spec
=======================================  ==========================  ==========================
``sink_k/v``, ``ring_k/v``, KIVI codes   ``[L, B, K, C, H]``         ``P(None, 'data', 'kv', None, None)``
KIVI key scales/zeros                    ``[L, B, K, W/G, H]``       same
KIVI value scales/zeros                  ``[L, B, K, W]``            ``P(None, 'data', 'kv', None)``
``sink_pos``, ``ring_pos``, ``quant.pos``  ``int32[B, C]``           ``P('data', None)``
``length``                               ``int32[B]``                ``P('data')``
=======================================  ==========================  ==========================

Several hosts: call ``jax.distributed.initialize()`` first in every process; ``jax.devices()``
is then the global device list and the same mesh spans all hosts (see docs/BATCH.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.cache.kv import KVCache, check_fits
from jaxkv.errors import JaxkvError, check_int
from jaxkv.io import LoadedModel, registry

AXES = ("data", "kv")
SHARD_MODES = ("data", "data,kv")


def make_mesh(*, data: int | None = None, kv: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 2-D mesh with axes ``("data", "kv")`` of shape ``(data, kv)``.

    Args:
      data: devices along the batch axis; None = all the devices not used by ``kv``.
      kv: devices along the KV-head axis (1 = no tensor parallelism).
      devices: the devices to use, default ``jax.devices()`` (every host's, after
        ``jax.distributed.initialize()``); the first ``data * kv`` are taken.
    Raises:
      JaxkvError: sizes below 1 or more devices asked for than there are.
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, value in (("kv", kv), ("data", data)):
        if value is not None:
            check_int(f"make_mesh: {name}", value, 1)
    if data is None:
        if len(devices) % kv:
            raise JaxkvError(f"make_mesh: kv={kv} does not divide the {len(devices)} devices")
        data = len(devices) // kv
    if data * kv > len(devices):
        raise JaxkvError(f"make_mesh: data={data} x kv={kv} needs {data * kv} devices, there are {len(devices)}")
    return Mesh(np.asarray(devices[: data * kv], dtype=object).reshape(data, kv), AXES)


def mesh_for(n_kv_heads: int, shard: str = "data", *, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh the CLI's ``--shard`` asks for, over all ``devices``.

    ``shard="data"``: every device on the batch axis. ``shard="data,kv"``: the KV-head
    axis gets the largest device count dividing both the device count and ``n_kv_heads``
    (e.g. 8 devices, K=2: 4 x 2; SmolLM2's K=3 on 4 devices: 4 x 1), the batch axis the rest.
    """
    if shard not in SHARD_MODES:
        raise JaxkvError(f"--shard {shard!r}: expected one of {', '.join(SHARD_MODES)}")
    devices = list(jax.devices() if devices is None else devices)
    kv = math.gcd(len(devices), n_kv_heads) if shard == "data,kv" else 1
    return make_mesh(kv=kv, devices=devices)


def data_size(mesh: Mesh | None) -> int:
    """Devices along ``data`` (1 without a mesh): a sharded batch must be a multiple of it."""
    return 1 if mesh is None else mesh.shape["data"]


def cache_partition_spec(leaf) -> P:
    """The :class:`PartitionSpec` of one cache leaf (an array or its shape), from its rank (see the module table)."""
    ndim = len(leaf.shape)
    if ndim >= 4:  # [L, B, K, ...]
        return P(None, "data", "kv", *([None] * (ndim - 3)))
    if ndim == 2:  # [B, C] positions
        return P("data", None)
    if ndim == 1:  # [B] lengths
        return P("data")
    raise JaxkvError(f"cache leaf of shape {leaf.shape}: no sharding rule")


def cache_shardings(cache: KVCache, mesh: Mesh):
    """A pytree like ``cache`` holding each leaf's :class:`NamedSharding`."""
    return jax.tree.map(lambda x: NamedSharding(mesh, cache_partition_spec(x)), cache)


def _check_split(batch: int, n_kv_heads: int, mesh: Mesh) -> None:
    if batch % mesh.shape["data"]:
        raise JaxkvError(
            f"batch of {batch} rows does not split over data={mesh.shape['data']} devices: pad it to a multiple"
        )
    if n_kv_heads % mesh.shape["kv"]:
        raise JaxkvError(f"{n_kv_heads} KV heads do not split over kv={mesh.shape['kv']} devices")


def shard_cache(cache: KVCache, mesh: Mesh) -> KVCache:
    """Place an existing cache on ``mesh``: rows over ``data``, KV heads over ``kv``.

    The result is marked ``batch_sharded`` so its writes update all rows at once (each
    device its own) instead of looping over rows, which would make the partitioner
    all-gather the whole cache at every step.

    Raises:
      JaxkvError: B not a multiple of the ``data`` size, or K not a multiple of the ``kv`` size.
    """
    _check_split(cache.batch, cache.ring_k.shape[2], mesh)
    placed = jax.device_put(cache, cache_shardings(cache, mesh))
    return placed.replace(batch_sharded=True)


def create_cache(spec, mesh: Mesh, *, batch: int, n_layers: int, n_kv_heads: int, head_dim: int) -> KVCache:
    """An empty cache born sharded (like ``shard_cache(KVCache.create(spec, ...), mesh)``).

    Sizes as :meth:`KVCache.create` takes them (:func:`jaxkv.decode.new_cache` with a mesh
    passes a model's). Each device
    allocates only its own block (the creation is jitted with the leaves' shardings as
    ``out_shardings``), so no host ever holds the whole global cache, which matters when the
    mesh spans several hosts.

    Raises:
      JaxkvError: B not a multiple of the ``data`` size, or K not a multiple of the ``kv`` size;
        a cache larger than the memory of the mesh's devices together.
    """
    _check_split(batch, n_kv_heads, mesh)
    sizes = dict(batch=batch, n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim)
    devices = list(mesh.devices.flat)
    check_fits(spec, devices=devices, **sizes)  # before tracing, so that the error is the plain one line

    def make():
        return KVCache.create(spec, devices=devices, **sizes)

    shardings = cache_shardings(jax.eval_shape(make), mesh)
    return jax.jit(make, out_shardings=shardings)().replace(batch_sharded=True)


def param_partition_spec(
    name: str, shape: tuple[int, ...], mesh: Mesh, *, n_kv_heads: int, family=None, held: str | None = None
) -> P:
    """Replicated, except over a ``kv`` axis > 1: attention weights split by heads, MLP by hidden
    units, on the axes the model's family names (:class:`jaxkv.models.family.Family`
    ``head_axes``/``mlp_axes``, axes of ``W[..., I, O]``; ``family`` None =
    :data:`jaxkv.io.registry.DEFAULT`).

    ``held``: the field of a held matrix this leaf of ``shape`` is (``"t"`` of a
    :class:`~jaxkv.models.weights.TransposedWeight`, ``"codes"``/``"scales"``/``"mins"`` of a
    :class:`~jaxkv.models.weights.QuantizedWeight`, all ``[..., O, I]``, ``[..., O, I/2]`` (q4
    codes) or ``[..., O, I/32]`` (scales, mins)): the family's axis is mapped to where the leaf
    holds it; the ``"blocks"`` of a :class:`~jaxkv.models.weights.BlockWeight` are replicated."""
    kv = mesh.shape["kv"]
    if kv == 1 or held == "blocks":  # ggml's blocks stay whole: its product reads a device's full rows
        return P()
    family = family or registry.DEFAULT
    axis = family.head_axes.get(name) if n_kv_heads % kv == 0 else None
    if axis is None:
        axis = family.mlp_axes.get(name)
    if axis is not None and held is not None:
        rank = len(shape)  # held leaves have the rank of W[..., I, O]
        axis = rank - 2 if axis == rank - 1 else rank - 1 if axis == rank - 2 else axis
    if axis is None or shape[axis] % kv:
        return P()
    spec = [None] * len(shape)
    spec[axis] = "kv"
    return P(*spec)


def shard_model(model: LoadedModel, mesh: Mesh) -> LoadedModel:
    """A copy of ``model`` whose parameters live on ``mesh`` (see :func:`param_partition_spec`)."""
    graphdef, state = nnx.split(model.model)
    k, family = model.config.n_kv_heads, registry.family_of(model.config, default=registry.DEFAULT)

    def place(path, x):
        name = str(getattr(path[0], "key", getattr(path[0], "name", path[0])))
        field = getattr(path[-1], "name", None) if len(path) > 2 else None  # name, .value, then a held form's field
        spec = param_partition_spec(name, x.shape, mesh, n_kv_heads=k, family=family, held=field)
        return jax.device_put(x, NamedSharding(mesh, spec))

    state = jax.tree_util.tree_map_with_path(place, state)
    return dataclasses.replace(model, model=nnx.merge(graphdef, state))


def initialize_distributed(
    coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None
) -> None:
    """Join a multi-process run (one process per host) before anything touches a device.

    Calls ``jax.distributed.initialize``; with no arguments it detects the cluster (SLURM,
    Open MPI, TPU pods, Kubernetes) or reads ``JAX_COORDINATOR_ADDRESS``. Afterwards
    ``jax.devices()`` lists every host's devices, so :func:`make_mesh` spans all of them.
    CPU processes exchange collectives through gloo (chosen here: jax 0.5 defaults to none),
    unless ``JAX_CPU_COLLECTIVES_IMPLEMENTATION`` names another (e.g. mpi).
    """
    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)


def describe(mesh: Mesh | None) -> str:
    """E.g. ``mesh data=4 x kv=1 over 4 cpu devices`` (``single device`` without a mesh)."""
    if mesh is None:
        return "single device"
    d = mesh.devices.flat[0]
    hosts = f" on {jax.process_count()} processes" if jax.process_count() > 1 else ""
    return (
        f"mesh data={mesh.shape['data']} x kv={mesh.shape['kv']} over {mesh.devices.size} {d.platform} devices{hosts}"
    )


def is_lead() -> bool:
    """True in process 0 (the one that prints and writes files); always True on one host."""
    return jax.process_index() == 0
