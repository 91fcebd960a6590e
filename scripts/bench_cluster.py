"""Prefix-affinity routing against power of two choices: ``jaxkv serve --ray`` replicas under chat
clients that resend their whole history every turn (docs/SCALING.md).

One local Ray instance; for each router in turn (``--routers``, alternating over ``--rounds``),
the application of :func:`jaxkv.serve.cluster.build_application` is deployed, warmed up (one
request, not measured) and driven by ``--chats`` concurrent chat clients (the ``openai`` package,
streaming ``/v1/chat/completions``), each ``--turns`` turns: the first user message is a distinct
``--words``-word slice of the TinyStories text, each later one a short request, and every
request carries the whole conversation so far. Then the application is deleted, so each router
starts from empty prefix stores.

Routers: ``prefix`` (:class:`~jaxkv.serve.cluster.PrefixAffinityRouter`), ``pow2`` (the same
router with ``affinity=False``: power of two choices over the replicas' queue lengths, Ray Serve's
default policy).

Per request (on the client, ``time.perf_counter``): TTFT (sent -> the first chunk with text),
output tokens and cached prompt tokens (the final usage chunk). Per router: output tok/s over the
load's wall time, TTFT p50/p90 of first turns and of follow-ups, the share of follow-up prompt
tokens found cached. Run::

    python scripts/bench_cluster.py [MODEL] --replicas 2 --chats 8 --turns 3 --words 400 \\
        --out docs/results/cluster_smollm2.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import platform
import socket
import statistics
import sys
import time

import openai

REPO = pathlib.Path(__file__).resolve().parents[1]
TEXT = REPO.parent / "shared" / "data" / "text" / "tinystories_valid_head.txt"
FOLLOW_UPS = ["Go on, in one sentence.", "Who is the story about?", "How does it end?", "Say it again, shorter."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(values: list, q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    k = (len(values) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def _turn(client: openai.OpenAI, model: str, messages: list, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return dict(
        ttft=ttft,
        e2e=time.perf_counter() - t0,
        text="".join(text),
        completion_tokens=usage.completion_tokens,
        prompt_tokens=usage.prompt_tokens,
        cached_tokens=usage.prompt_tokens_details.cached_tokens,
    )


def _chat(client, model: str, document: str, turns: int, max_tokens: int) -> list:
    messages = [{"role": "user", "content": f"Read this story.\n\n{document}\n\nTell me what happens next."}]
    out = []
    for t in range(turns):
        r = _turn(client, model, messages, max_tokens)
        out.append({**r, "turn": t})
        messages += [{"role": "assistant", "content": r["text"]}, {"role": "user", "content": FOLLOW_UPS[t % 4]}]
    return out


def _load(url: str, model: str, documents: list, turns: int, max_tokens: int) -> tuple[list, float]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(documents)) as pool:
        chats = list(pool.map(lambda d: _chat(client, model, d, turns, max_tokens), documents))
    return [r for chat in chats for r in chat], time.perf_counter() - t0


def _summary(requests: list, wall: float) -> dict:
    first = [r for r in requests if r["turn"] == 0]
    later = [r for r in requests if r["turn"] > 0]
    return dict(
        wall_s=wall,
        output_tok_s=sum(r["completion_tokens"] for r in requests) / wall,
        ttft_first_p50=_percentile([r["ttft"] for r in first], 0.5),
        ttft_first_p90=_percentile([r["ttft"] for r in first], 0.9),
        ttft_followup_p50=_percentile([r["ttft"] for r in later], 0.5),
        ttft_followup_p90=_percentile([r["ttft"] for r in later], 0.9),
        followup_cached_share=sum(r["cached_tokens"] for r in later) / max(1, sum(r["prompt_tokens"] for r in later)),
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="model file (default: jaxkv's default model)")
    ap.add_argument("--routers", default="prefix,pow2")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--words", type=int, default=400, help="words of each chat's first message")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument(
        "--prefix-cache-bytes",
        type=int,
        default=2 << 30,
        help="each replica's prefix cache (one SmolLM2 state of the default cache is 47 MB: 2 GiB holds 45)",
    )
    ap.add_argument("--out", default=None, help="write every request and the summaries here (JSON)")
    args = ap.parse_args(argv)

    import jax
    import ray
    from ray import serve

    ray.init(num_cpus=args.replicas, include_dashboard=False, logging_level="warning")  # before jax's threads
    from jaxkv.cli import use_compile_cache
    from jaxkv.decode.chat import default_cache_spec
    from jaxkv.io import default_model_path, load_model
    from jaxkv.serve.cluster import build_application

    model_path = args.model or default_model_path()
    config = load_model(model_path).config
    spec = default_cache_spec(config)
    name = os.path.splitext(config.name)[0]
    words = TEXT.read_text().split()
    documents = [" ".join(words[i * args.words : (i + 1) * args.words]) for i in range(args.chats)]
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
    results = []
    for _ in range(args.rounds):
        for router in args.routers.split(","):
            app = build_application(
                model_path,
                spec,
                replicas=args.replicas,
                engine_options=dict(
                    slots=args.slots,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    prefix_cache_bytes=args.prefix_cache_bytes,
                ),
                app_options=dict(model_name=name),
                router_options=dict(affinity=router == "prefix"),
                replica_setup=use_compile_cache,  # the first deployment compiles, the later ones load
            )
            t0 = time.perf_counter()
            serve.run(app, name="bench", route_prefix="/", logging_config={"log_level": "WARNING"})
            ready = time.perf_counter() - t0
            _load(url, name, [" ".join(words[-50:])], 1, 4)  # warm-up, not measured
            requests, wall = _load(url, name, documents, args.turns, args.max_tokens)
            summary = _summary(requests, wall)
            results.append(dict(router=router, ready_s=ready, summary=summary, requests=requests))
            print(
                f"{router:6s} ready {ready:5.1f} s | {summary['output_tok_s']:6.2f} tok/s | TTFT first "
                f"p50 {summary['ttft_first_p50']:.2f} p90 {summary['ttft_first_p90']:.2f} s | follow-up "
                f"p50 {summary['ttft_followup_p50']:.2f} p90 {summary['ttft_followup_p90']:.2f} s | "
                f"follow-up prompt tokens cached {summary['followup_cached_share']:.0%}",
                flush=True,
            )
            serve.delete("bench")
    serve.shutdown()
    ray.shutdown()
    by_router = {}
    for r in results:
        by_router.setdefault(r["router"], []).append(r["summary"])
    medians = {
        router: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for router, runs in by_router.items()
    }
    if args.out:
        pathlib.Path(args.out).write_text(
            json.dumps(
                dict(
                    args=vars(args),
                    machine=dict(
                        cpu=platform.processor() or platform.machine(),
                        cores=os.cpu_count(),
                        python=platform.python_version(),
                        jax=jax.__version__,
                        ray=ray.__version__,
                    ),
                    medians=medians,
                    runs=results,
                ),
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
