"""``jaxkv serve --ray``: replicas on Ray Serve, each follow-up routed to the replica that holds
its history (:mod:`jaxkv.serve.cluster`). The router's choice is tested on its own; end to end, a
real ``jaxkv serve --ray`` process (a local Ray instance, two replicas of stories260K) answers
the ``openai`` client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import subprocess
import time

import pytest

pytest.importorskip("ray.serve", reason="jaxkv[cluster] (Ray Serve) is not installed")

from ray.serve.request_router import ReplicaID  # noqa: E402
from test_serve_http import CACHE_FLAGS, SPEC, STORIES, Server, _expected  # noqa: E402

from jaxkv.errors import JaxkvError  # noqa: E402
from jaxkv.serve.cluster import PrefixAffinityRouter, PrefixIndex  # noqa: E402

pytestmark = pytest.mark.jax_independent  # routing and HTTP (the engine: test_serve_engine.py)


# ---- the prefix index and the router's choice -------------------------------------------------


def test_index_finds_the_longest_prefix_held_by_a_live_replica():
    index = PrefixIndex(block=4)
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    index.insert(system + [9, 9, 9, 9, 7], "a")  # a partial last block is not indexed
    index.insert(system + [10, 11, 12, 13], "b")
    assert len(index) == 4  # two shared blocks, one block each of the rest
    assert index.match(system + [9, 9, 9, 9, 1, 2, 3, 4], {"a", "b"}) == (12, ["a"])
    assert index.match(system + [10, 11, 12, 13], {"a", "b"}) == (12, ["b"])
    assert index.match(system + [0, 0, 0, 0], {"a", "b"}) == (8, ["a", "b"])
    assert index.match(system + [9, 9, 9, 9], {"b"}) == (8, ["b"])  # "a" not live: its block is not a match
    assert index.match([2, 1, 3, 4, 5, 6, 7, 8], {"a", "b"}) == (0, [])  # the same tokens in another order
    assert index.match(system[:3], {"a", "b"}) == (0, [])  # shorter than a block
    index.forget("a")
    assert index.match(system + [9, 9, 9, 9], {"a", "b"}) == (8, ["b"])
    assert len(index) == 3


def test_index_forgets_the_least_recently_used_blocks():
    index = PrefixIndex(block=2, capacity=3)
    index.insert([1, 2, 3, 4], "a")
    index.insert([5, 6], "b")
    index.insert([1, 2], "a")  # [1, 2] is used again: [3, 4]'s key is now the oldest
    index.insert([7, 8], "b")
    assert len(index) == 3
    assert index.match([1, 2, 3, 4], {"a", "b"}) == (2, ["a"])
    assert index.match([5, 6], {"a", "b"}) == (2, ["b"])
    with pytest.raises(JaxkvError, match="block=0"):
        PrefixIndex(block=0)


class _Replica:
    def __init__(self, name: str):
        self.replica_id = ReplicaID(unique_id=name, deployment_id=None)


class _Lengths:
    def __init__(self, loads: dict):
        self.loads = loads

    def get(self, replica_id):
        return self.loads.get(replica_id.unique_id)


def _router(loads: dict, **options) -> PrefixAffinityRouter:
    """The router's policy without Ray's routing loop: its state and the queue lengths it last heard."""
    router = object.__new__(PrefixAffinityRouter)
    router.index = PrefixIndex(block=4)
    router.imbalance = options.get("imbalance", 2)
    router.min_match = options.get("min_match", 0.5)
    router.affinity = options.get("affinity", True)
    router._replica_queue_len_cache = _Lengths(loads)
    return router


class _Pending:
    def __init__(self, ids):
        self.args = [ids]


def _choose(router: PrefixAffinityRouter, replicas: list, pending: _Pending | None) -> list:
    return asyncio.run(router.choose_replicas(replicas, pending))


def test_router_prefers_the_holder_within_the_imbalance_bound():
    a, b, c = _Replica("a"), _Replica("b"), _Replica("c")
    history = list(range(20))
    loads = {"a": 0, "b": 0, "c": 0}
    router = _router(loads)
    router.on_request_routed(_Pending(history), b.replica_id, None)
    ranks = _choose(router, [a, b, c], _Pending(history + [99, 98]))
    assert ranks[0] == [b] and len(ranks[1]) == 2  # the holder first, then two at random
    loads["b"] = 3  # 3 above the least loaded: beyond the bound of 2
    assert len(_choose(router, [a, b, c], _Pending(history))) == 1
    loads.update(a=1, c=1)  # 2 above the least loaded now: within
    assert (_choose(router, [a, b, c], _Pending(history)))[0] == [b]
    assert len(_choose(router, [a, c], _Pending(history))) == 1  # b gone
    assert len(_choose(router, [a, b, c], _Pending(list(range(50, 70))))) == 1  # never seen
    assert len(_choose(router, [a, b, c], None)) == 1  # info(), not generate()
    # two holders of the same (system) prefix: the less loaded one
    router.on_request_routed(_Pending(history[:8] + [7] * 8), c.replica_id, None)
    assert (_choose(router, [a, b, c], _Pending(history[:8] + [5] * 8)))[0] == [c]
    # a known prefix under half the prompt (a shared system prompt, a new conversation): no pull
    assert len(_choose(router, [a, b, c], _Pending(history[:8] + [5] * 9))) == 1
    unaffine = _router({"a": 0, "b": 0}, affinity=False)
    unaffine.on_request_routed(_Pending(history), b.replica_id, None)
    assert len(_choose(unaffine, [a, b], _Pending(history))) == 1


# ---- a real jaxkv serve --ray -------------------------------------------------------------------


def _ancestors(pid: int) -> list[int]:
    out = []
    with contextlib.suppress(OSError):
        while pid > 1:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
            out.append(pid)
    return out


class RayServer(Server):
    """``jaxkv serve --ray`` (a local Ray instance): stopped with SIGTERM, as Ray needs to end
    its own processes."""

    def replica_pids(self) -> list[int]:
        """The engine replicas' processes (Ray workers under this server's process)."""
        found = subprocess.run(["pgrep", "-f", "ServeReplica:jaxkv:EngineReplica"], capture_output=True, text=True)
        return [pid for pid in map(int, found.stdout.split()) if self.proc.pid in _ancestors(pid)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def cluster():
    s = RayServer(
        *STORIES,
        *CACHE_FLAGS,
        "--ray",
        "--replicas",
        "2",
        "--slots",
        "1",  # each replica compiles 3 programs fewer than with 2 (both replicas compile at once)
        "--max-num-batched-tokens",
        "32",
        "--route-imbalance",
        "64",  # prefix affinity alone (the bound is tested above): every follow-up to its history
        ready_timeout=240,
        env={"RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": ""},
    )
    yield s
    s.stop()


STARTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her dog, and every day they ran to the park",
    "Tom had a red ball. He liked to throw it high in the sky and catch it. One day the ball went over the fence into the garden of his friend",
    "One day, a big dog went to the park with his friend the cat. They saw a tall tree with many birds in it, and the cat wanted to climb",
    "There was a little bird who lived in a tree near the river. Every morning she sang a song for the fish, and the fish jumped to hear",
    "Sam and his mom went to the store to buy some milk and bread. At the store, Sam saw a big box of toys and he asked his mom if he",
    "Once upon a time, there was a happy frog who liked to jump. He jumped over rocks and logs all day long, until he met a slow turtle",
    "Anna found a shiny box under her bed. She opened it and saw a small key inside. She took the key and looked for a door that it could",
    "The sun was hot, so Ben went to swim in the big blue lake. His sister Mia came with him, and they played with a ball in the water",
]
TURNS, TOKENS = 3, 8  # prompts of 47-65 tokens: each follow-up's known prefix covers over half of it


@pytest.mark.slow
def test_follow_ups_reach_the_replica_holding_their_history(cluster, stories):
    client = cluster.client()

    def chat(start: str) -> list:
        prompt, turns = start, []
        for _ in range(TURNS):
            r = client.completions.create(model="stories260K", prompt=prompt, max_tokens=TOKENS, temperature=0)
            turns.append((prompt, r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens))
            prompt = prompt + r.choices[0].text + " Then"
        return turns

    with concurrent.futures.ThreadPoolExecutor(len(STARTS)) as pool:
        chats = list(pool.map(chat, STARTS))
    for turns in chats:
        for t, (prompt, text, cached) in enumerate(turns):
            assert text == _expected(stories, prompt, TOKENS, SPEC), prompt  # one plain engine's greedy text
            if t:  # the follow-up found the previous prompt's state on its replica
                assert cached >= len(stories.tokenizer.encode(turns[t - 1][0])) - 1, (prompt, cached)
    deadline = time.monotonic() + 30  # a replica busy in a step answers its stats call late
    while (metrics := cluster.metrics()).get(("jaxkv_slots", frozenset()), 0) < 2 and time.monotonic() < deadline:
        time.sleep(1)
    assert metrics[("jaxkv_replicas", frozenset())] == 2
    assert metrics[("jaxkv_slots", frozenset())] == 2  # both replicas' engines summed

    # a replica killed: Ray Serve restarts it; meanwhile the other one serves every request
    pids = cluster.replica_pids()
    assert len(pids) == 2, pids
    os.kill(pids[0], signal.SIGKILL)
    time.sleep(1)

    def complete(prompt: str) -> str:
        return (
            client.completions.create(model="stories260K", prompt=prompt, max_tokens=TOKENS, temperature=0)
            .choices[0]
            .text
        )

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(complete, STARTS[:4]))
    assert texts == [_expected(stories, p, TOKENS, SPEC) for p in STARTS[:4]]
    ours = [line for line in cluster.output().splitlines() if "ServeController" not in line]  # Ray's own logs the kill
    assert not any("Traceback" in line for line in ours), "\n".join(ours)


# ---- the command line and serve run's builder --------------------------------------------------


def test_ray_flags_need_ray(capsys):
    from jaxkv.cli import main

    assert main(["serve", *STORIES, "--replicas", "2", "--route-imbalance", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["jaxkv: error: --replicas, --route-imbalance: Ray Serve's flags: add --ray"]
    assert main(["serve", *STORIES, "--ray", "--replicas", "0"]) == 2
    assert "--replicas" in capsys.readouterr().err


def test_serve_run_builder_takes_jaxkv_serve_flags():
    from ray.serve import Application

    from jaxkv.cli.serve import ray_app

    app = ray_app({"argv": " ".join([*STORIES, *CACHE_FLAGS, "--replicas", "3", "--slots", "2"])})
    assert isinstance(app, Application)
    with pytest.raises(JaxkvError, match="--slots"):
        ray_app({"argv": " ".join([*STORIES, "--slots", "0"])})


def test_ray_flag_without_ray_names_the_extra(monkeypatch, capsys):
    import sys

    import jaxkv.serve
    from jaxkv.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    monkeypatch.delitem(sys.modules, "jaxkv.serve.cluster")
    monkeypatch.delattr(jaxkv.serve, "cluster")
    assert main(["serve", *STORIES, "--ray"]) == 2
    assert capsys.readouterr().err.strip() == (
        "jaxkv: error: jaxkv serve --ray needs Ray Serve (ray is missing): pip install 'jaxkv[cluster]'"
    )
