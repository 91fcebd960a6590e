"""Replicas of the serving engine on Ray Serve, each request routed to the replica that most
likely holds its prompt's prefix (docs/SCALING.md).

:func:`build_application` returns a Ray Serve application of two deployments:

- :class:`EngineReplica` (``replicas`` of them): one :class:`~jaxkv.serve.engine.Engine` each,
  with its own slots and prefix store. Ray Serve calls its ``check_health`` (the engine's
  scheduler runs) and restarts a replica that fails it or dies; its ``record_routing_stats`` is
  the engine's :meth:`~jaxkv.serve.engine.Engine.stats`.
- :class:`Ingress` (one replica behind Ray Serve's HTTP proxy): the OpenAI-compatible app of
  :func:`jaxkv.serve.app.create_app`, unchanged, over a :class:`RemoteEngine` that sends each
  request's prompt ids and :class:`~jaxkv.serve.engine.SamplingParams` to an engine replica
  through a ``DeploymentHandle`` and relays the replica's events. A replica that dies before a
  request's first event is left for another (no request is lost that had not started streaming).

The replica is chosen by :class:`PrefixAffinityRouter`, a Ray Serve request router: a chat
client resends its whole history every turn, and the replica that served the previous turn holds
that history's state in its prefix store (the state at the end of the previous prompt: the
follow-up prefills only the reply and the new message there, everything elsewhere). The router
remembers which replicas it sent which prompts (:class:`PrefixIndex`: chained hashes of blocks of
token ids, as vLLM keys its prefix cache) and sends a request to the least loaded replica holding
its longest known prefix when that prefix covers at least ``min_match`` of the prompt (half),
unless that replica runs more than ``imbalance`` requests above the least loaded one; otherwise
Ray Serve's power of two choices. Ray Serve's own router spreads a conversation's turns over the
replicas.

``jaxkv serve --ray --replicas N`` runs it (a local Ray instance, or the cluster at
``$RAY_ADDRESS``); ``serve run configs/ray-serve.yaml`` is the same through Ray's CLI or KubeRay.
Needs the ``cluster`` extra: ``pip install 'jaxkv[cluster]'`` (``ray[serve]``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import random
import sys
import types
from collections.abc import Callable, Sequence

from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from jaxkv.errors import JaxkvError
from jaxkv.io import load_model
from jaxkv.serve.app import create_app
from jaxkv.serve.engine import Engine, Event, QueueFullError, SamplingParams, check_request

__all__ = ["EngineReplica", "Ingress", "PrefixAffinityRouter", "PrefixIndex", "RemoteEngine", "build_application"]

log = logging.getLogger("jaxkv.serve")

ROUTERS: dict = {}
"""This process's :class:`PrefixAffinityRouter` s by deployment name (:meth:`RemoteEngine.stats`
reads the replicas' routing stats from them)."""

BLOCK_TOKENS = 16
"""Token ids per hashed block of :class:`PrefixIndex` (a prompt's last partial block is not indexed)."""


class PrefixIndex:
    """Which replicas were sent prompts starting with which tokens.

    A prompt's key at block ``i`` hashes its first ``(i + 1) * block`` token ids, chained block by
    block (as vLLM keys its prefix cache), so one dict lookup per block finds the longest known
    prefix. Each key maps to the replicas sent such a prompt; beyond ``capacity`` keys the least
    recently used are forgotten.

    Args:
      block: token ids per block, >= 1. capacity: keys kept at most, >= 1.
    """

    def __init__(self, block: int = BLOCK_TOKENS, capacity: int = 1 << 16):
        if block < 1 or capacity < 1:
            raise JaxkvError(f"PrefixIndex(block={block}, capacity={capacity}): expected both >= 1")
        self.block, self.capacity = block, capacity
        self._holders: collections.OrderedDict[int, dict] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def keys(self, ids: Sequence[int]) -> list[int]:
        """The chained hashes of the whole blocks of ``ids`` (``len(ids) // block`` of them)."""
        key, out = 0, []
        for start in range(0, len(ids) - self.block + 1, self.block):
            key = hash((key, *ids[start : start + self.block]))
            out.append(key)
        return out

    def match(self, ids: Sequence[int], live) -> tuple[int, list]:
        """``(tokens, replicas)``: the longest indexed prefix of ``ids`` held by replicas in
        ``live`` (a container of replica ids), in tokens, and those replicas; ``(0, [])`` if none."""
        best: tuple[int, list] = (0, [])
        for depth, key in enumerate(self.keys(ids), 1):
            holders = [r for r in self._holders.get(key, ()) if r in live]
            if not holders:
                break
            best = (depth * self.block, holders)
        return best

    def insert(self, ids: Sequence[int], replica) -> None:
        """Record that ``replica`` was sent a prompt of ``ids`` (each of its blocks most recently used)."""
        for key in self.keys(ids):
            holders = self._holders.pop(key, {})
            holders[replica] = None
            self._holders[key] = holders
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def forget(self, replica) -> None:
        """Drop ``replica`` (dead) from every key."""
        for key in list(self._holders):
            holders = self._holders[key]
            holders.pop(replica, None)
            if not holders:
                del self._holders[key]


def _prompt_ids(pending_request: PendingRequest | None) -> list[int] | None:
    """The prompt ids of an :meth:`EngineReplica.generate` call (its first argument), else None."""
    if pending_request is None or not pending_request.args:
        return None
    ids = pending_request.args[0]
    return ids if isinstance(ids, list) else None


class PrefixAffinityRouter(RequestRouter):
    """A Ray Serve request router: a request goes to the replica holding the longest known
    prefix of its prompt (see the module docstring), power of two choices otherwise.

    ``request_router_kwargs``: ``block`` (token ids per hashed block), ``capacity`` (blocks
    remembered), ``imbalance`` (requests a prefix-holding replica may run above the least loaded
    one and still be chosen), ``min_match`` (the share of the prompt's tokens the known prefix
    must cover, as SGLang's router's cache threshold: a shared system prompt alone does not pull
    every new conversation to one replica), ``affinity`` (False: power of two choices always, Ray
    Serve's default router, for comparison).
    """

    def initialize_state(
        self,
        block: int = BLOCK_TOKENS,
        capacity: int = 1 << 16,
        imbalance: int = 4,
        min_match: float = 0.5,
        affinity: bool = True,
    ) -> None:
        self.index = PrefixIndex(block, capacity)
        self.imbalance = imbalance
        self.min_match = min_match
        self.affinity = affinity
        # through sys.modules: Ray may run a by-value copy of this class, whose globals are not
        # this module's
        sys.modules[__name__].ROUTERS[self._deployment_id.name] = self

    def load(self, replica: RunningReplica) -> int:
        """Requests ``replica`` runs or queues, as this router last heard (0 if not yet)."""
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Ranks of replicas to try: the prefix holder (if any, and not too loaded), then two at random."""
        pair = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        ids = _prompt_ids(pending_request)
        if ids is None or not self.affinity:
            return [pair]
        by_id = {r.replica_id: r for r in candidate_replicas}
        matched, holders = self.index.match(ids, by_id)
        if holders and matched >= self.min_match * len(ids):
            best = min((by_id[h] for h in holders), key=self.load)
            if self.load(best) - min(map(self.load, candidate_replicas)) <= self.imbalance:
                return [[best], pair]
        return [pair]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        ids = _prompt_ids(pending_request)
        if ids is not None:
            self.index.insert(ids, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)

    def replica_stats(self) -> list[dict]:
        """Each live replica's last routing stats (its engine's ``stats()``)."""
        return [r.routing_stats for r in self.curr_replicas.values() if r.routing_stats]


@serve.deployment(
    ray_actor_options={"num_cpus": 1},
    health_check_period_s=5,
    health_check_timeout_s=30,
)
class EngineReplica:
    """One engine (a Ray Serve replica): loads the model, warms the engine up, serves
    :meth:`generate` calls.

    Args:
      model, tokenizer, weights: as :func:`jaxkv.io.load_model` takes them.
      spec: every row's cache (as :class:`~jaxkv.serve.engine.Engine` takes it).
      engine_options: the Engine's keyword arguments (``slots``, ``max_queue``, ...).
      shutdown_timeout: seconds in-flight requests get when the replica stops.
      setup: called first, in the replica's process (``jaxkv serve --ray``: its persistent
        compilation cache, so a restarted replica loads its programs instead of compiling them).
    """

    def __init__(
        self,
        model: str,
        *,
        tokenizer,
        weights: str,
        spec,
        engine_options: dict,
        shutdown_timeout: float,
        setup: Callable[[], object] | None = None,
    ):
        if setup is not None:
            setup()
        loaded = load_model(model, tokenizer=tokenizer, weights=weights)
        self.engine = Engine(loaded, spec, **engine_options).start()
        self.shutdown_timeout = shutdown_timeout

    def info(self) -> dict:
        """What the ingress needs to check and encode requests: ``tokenizer``, ``config``,
        ``spec`` (the engine's), ``slots``, ``max_queue``."""
        e = self.engine
        return dict(
            tokenizer=e.model.tokenizer, config=e.model.config, spec=e.spec, slots=e.slots, max_queue=e.max_queue
        )

    async def generate(self, prompt_ids: list[int], params: SamplingParams):
        """The request's :class:`~jaxkv.serve.engine.Event` s as the engine emits them (a
        streaming call); cancelling the call cancels the request."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        request = self.engine.submit(
            prompt_ids, params, on_event=lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
        )
        try:
            while True:
                event = await events.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            request.cancel()  # no-op once finished

    def record_routing_stats(self) -> dict:
        return self.engine.stats()

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("the engine's scheduler is not running")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(self.shutdown_timeout)


class _RemoteRequest:
    """A request relayed by :class:`RemoteEngine` (``cancel()`` as :class:`~jaxkv.serve.engine.Request`'s)."""

    def __init__(self, task: asyncio.Task):
        self.task = task

    def cancel(self) -> None:
        self.task.cancel()


class RemoteEngine:
    """The engine interface :func:`~jaxkv.serve.app.create_app` serves, over the replicas of
    an :class:`EngineReplica` deployment (used by :class:`Ingress`, in its event loop).

    Args:
      handle: the deployment's ``DeploymentHandle`` (routed by :class:`PrefixAffinityRouter`).
      info: :meth:`EngineReplica.info` of one replica (every replica serves the same model and cache).
      replicas: the deployment's replicas; requests relayed at once are at most
        ``replicas * (slots + max_queue)`` (beyond: :class:`~jaxkv.serve.engine.QueueFullError`, a 429).
      retries: times a request whose replica died before its first event is sent again.
    """

    ready = True  # Ray Serve routes to the ingress once its constructor returned, after a replica answered

    def __init__(self, handle, info: dict, *, replicas: int, retries: int = 2):
        self.handle = handle
        self.model = types.SimpleNamespace(tokenizer=info["tokenizer"], config=info["config"])
        self.spec, self.slots = info["spec"], info["slots"]
        self.capacity = replicas * (info["slots"] + info["max_queue"])
        self.retries = retries
        self.running = 0

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, on_event) -> _RemoteRequest:
        """As :meth:`Engine.submit <jaxkv.serve.engine.Engine.submit>` (``on_event`` is called in this
        event loop); the request goes to a replica chosen by the deployment's router."""
        ids = check_request(prompt_ids, params, self.model.config.vocab_size, self.spec.token_limit)
        if self.running >= self.capacity:
            raise QueueFullError(f"{self.running} requests are running or waiting on the replicas: retry later")
        self.running += 1
        return _RemoteRequest(asyncio.get_running_loop().create_task(self._relay(ids, params, on_event)))

    async def _relay(self, ids: list[int], params: SamplingParams, on_event) -> None:
        last = Event(
            token_ids=[], text="", finish_reason=None, prompt_tokens=len(ids), cached_tokens=0, completion_tokens=0
        )
        try:
            for attempt in range(self.retries + 1):
                stream = self.handle.options(stream=True).generate.remote(ids, params)
                try:
                    async for last in stream:
                        on_event(last)
                    return
                except asyncio.CancelledError:
                    stream.cancel()
                    raise
                except RayActorError as e:
                    if last.completion_tokens or last.finish_reason is not None or attempt == self.retries:
                        raise
                    log.warning("jaxkv serve: a replica died before streaming a request (%s); sending it again", e)
        except asyncio.CancelledError:
            on_event(_last_event(last, "cancelled"))
        except Exception as e:  # noqa: BLE001 - the request ends with an error, the server goes on
            on_event(_last_event(last, "error", f"{type(e).__name__}: {e}"))
        finally:
            self.running -= 1

    def stats(self) -> dict:
        """The engines' :meth:`~jaxkv.serve.engine.Engine.stats` summed over the live replicas
        that have reported (their last routing stats, <= ~1 s old), plus ``replicas``: the live
        replicas the router knows."""
        router = ROUTERS.get(EngineReplica.name)
        if router is None:  # nothing routed yet
            return {"replicas": 0}
        total = collections.Counter(replicas=len(router.curr_replicas))
        for report in router.replica_stats():
            total.update(report)
        return dict(total)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Nothing to do here: Ray Serve stops the replicas (each ends its requests, :meth:`EngineReplica.__del__`)."""


def _last_event(last: Event, reason: str, error: str | None = None) -> Event:
    """The closing event after ``last``: its counts, no new tokens."""
    return dataclasses.replace(last, token_ids=[], text="", finish_reason=reason, error=error)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """The HTTP entry (a Ray Serve ingress deployment): :func:`~jaxkv.serve.app.create_app` over a
    :class:`RemoteEngine` of ``engine``.

    Args:
      engine: the :class:`EngineReplica` deployment's handle. replicas: its replicas.
      app_options: :func:`~jaxkv.serve.app.create_app`'s keyword arguments (``model_name``, ...).
    """

    async def __init__(self, engine, *, replicas: int, app_options: dict):
        info = await engine.info.remote()
        self._jaxkv_app = create_app(RemoteEngine(engine, info, replicas=replicas), **app_options)

    def __serve_build_asgi_app__(self):
        return self._jaxkv_app


def build_application(
    model: str,
    spec,
    *,
    replicas: int,
    tokenizer: str | None = None,
    weights: str = "fp32",
    engine_options: dict | None = None,
    app_options: dict,
    shutdown_timeout: float = 10.0,
    replica_cpus: float = 1.0,
    router_options: dict | None = None,
    replica_setup: Callable[[], object] | None = None,
):
    """The Ray Serve application: ``serve.run(build_application(...))``.

    Args:
      model, tokenizer, weights: the model (:func:`jaxkv.io.load_model`), loaded by each replica.
      spec: each request's cache (:class:`~jaxkv.CacheSpec` or :class:`~jaxkv.LayerSpecs`).
      replicas: engine replicas, >= 1. replica_cpus: Ray CPUs each one reserves.
      engine_options: :class:`~jaxkv.serve.engine.Engine`'s keyword arguments (``slots``, ...).
      app_options: :func:`~jaxkv.serve.app.create_app`'s keyword arguments (``model_name`` at least).
      shutdown_timeout: seconds a stopping replica gives its requests.
      router_options: :class:`PrefixAffinityRouter`'s ``request_router_kwargs``.
      replica_setup: called first in each replica's process (an importable function).
    Returns:
      a ``ray.serve.Application`` (the :class:`Ingress` bound to the :class:`EngineReplica` deployment).
    """
    engine_options = dict(engine_options or {})
    slots = engine_options.get("slots", 4)
    max_queue = engine_options.get("max_queue", 64)
    replica = EngineReplica.options(
        num_replicas=replicas,
        max_ongoing_requests=slots + max_queue,
        ray_actor_options={"num_cpus": replica_cpus},
        graceful_shutdown_timeout_s=shutdown_timeout + 5,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={"imbalance": slots, **(router_options or {})},
            request_routing_stats_period_s=1.0,
        ),
    ).bind(
        model,
        tokenizer=tokenizer,
        weights=weights,
        spec=spec,
        engine_options=engine_options,
        shutdown_timeout=shutdown_timeout,
        setup=replica_setup,
    )
    return Ingress.bind(replica, replicas=replicas, app_options=app_options)
