"""jaxkv beside llama.cpp's own ``llama-bench`` on the same GGUF: prefill, decode, first token, peak RSS.

A script, not a ``jaxkv bench`` flag: it drives an external C++ binary built outside the repo,
measures each side in its own process (peak RSS from ``/usr/bin/time``), and alternates the
two round by round so that a loaded machine hits both alike; none of that belongs in the
library. Numbers and commands: docs/PERFORMANCE.md ("jaxkv beside llama.cpp").

Build llama-bench once (cached outside the repo; ~15 min on 2 cores), from the llama-cpp-python
source distribution on PyPI (its ``vendor/llama.cpp``)::

    mkdir -p /work/tmp/llamacpp && cd /work/tmp/llamacpp
    pip download --no-deps --no-binary :all: llama-cpp-python -d .     # llama_cpp_python-0.3.36.tar.gz
    tar xzf llama_cpp_python-*.tar.gz
    cmake -S llama_cpp_python-*/vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \\
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
    nice -n 10 cmake --build build --config Release --target llama-bench llama-quantize -j2

On a VM whose CPU lists AMX (``amx_tile`` in /proc/cpuinfo) without the kernel granting it, the
native build dies with SIGILL (exit 132) on Q4_1/Q8_0 files (F32 runs): build the CPU backend
again without AMX and point ``LD_LIBRARY_PATH`` at it::

    cmake -S llama_cpp_python-*/vendor/llama.cpp -B build-noamx -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
        -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
        -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
    nice -n 10 cmake --build build-noamx --config Release --target ggml-cpu -j2
    export LD_LIBRARY_PATH=/work/tmp/llamacpp/build-noamx/bin

An F32 GGUF of SmolLM2 (what jaxkv's fp32 weights are: the Q4_1 blocks dequantised, exactly)::

    build/bin/llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf SmolLM2-135M-Instruct.F32.gguf F32

Run (each ``--pair`` is LABEL=GGUF:WEIGHTS, WEIGHTS a ``--weights`` form of jaxkv)::

    python scripts/vs_llamacpp.py --rounds 2 --reps 1 --threads 2,1 --json docs/results/vs_llamacpp.json \\
        --pair stories-F32=../shared/data/models/stories260K.gguf:fp32 \\
        --pair SmolLM2-F32=/work/tmp/llamacpp/models/SmolLM2-135M-Instruct.F32.gguf:fp32 \\
        --pair SmolLM2-Q4_1=../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf:q4 \\
        --pair SmolLM2-Q4_1=../shared/data/models/SmolLM2-135M-Instruct.Q4_1.gguf:int8

What each side measures (batch 1, random prompt tokens, greedy, 2 threads for llama.cpp):

* ``pp512`` / ``pp2048``: prefill tokens/s of a 512 / 2,048-token prompt into an empty cache
  (llama.cpp: f16 KV cache, batch 2048; jaxkv: a full fp32 cache, calls of ``jaxkv.decode.loop.PREFILL_CHUNK`` tokens, compiled first).
* ``tg128@512``: decode tokens/s of 128 tokens after a 512-token prompt (llama-bench ``-d 512``;
  jaxkv a full cache, blocks of 32). ``stream tg128@512``: jaxkv the same, streaming (the first
  token alone, then ~0.1 s blocks: what ``jaxkv sample`` does).
* ``tg128@4096``: decode after 4,096 tokens: llama.cpp its full cache, jaxkv sink 4 + window 252.
* ``TTFT``: seconds from a 512-token prompt to its first generated token, model loaded.
  llama.cpp: 512 / pp512 + 1 / tg128@512 (its prefill, then one decode step). jaxkv, each in a
  fresh process: *compile included* (empty persistent compilation cache), *cached* (a second
  process reading the persistent compilation cache the first wrote) and *warm* (a second
  request in the same process).
* llama.cpp's figure is its best over ``--threads`` (``2,1``: on a 2-core machine shared with
  other jobs its two threads' spin-waits can cost more than the second core gives).
* ``peak RSS``: the process's maximum resident set (``/usr/bin/time -f %M``): llama.cpp's largest over
  its test processes (one llama-bench run per test), jaxkv's measuring process (model load and
  every test in one process, so every compiled program and cache it made). ``peak RSS, one
  request``: a process that loads the model and answers one 512-token prompt: llama-bench's pp512
  run, jaxkv's *TTFT cached* process (what ``jaxkv sample`` does with a 512-token prompt).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

LLAMA_BENCH = os.environ.get("LLAMA_BENCH", "/work/tmp/llamacpp/build/bin/llama-bench")
TESTS = ("pp512", "pp2048", "tg128@512", "tg128@4096")
LLAMA_ARGS = {
    "pp512": ["-p", "512", "-n", "0"],
    "pp2048": ["-p", "2048", "-n", "0"],
    "tg128@512": ["-p", "0", "-n", "128", "-d", "512"],
    "tg128@4096": ["-p", "0", "-n", "128", "-d", "4096"],
}


def timed(argv: list[str], env=None) -> tuple[str, int]:
    """Run ``argv`` under ``/usr/bin/time``: (its stdout, peak RSS in KiB). Raises on failure."""
    with tempfile.NamedTemporaryFile("r", suffix=".rss") as rss:
        proc = subprocess.run(
            ["/usr/bin/time", "-f", "%M", "-o", rss.name, *argv], capture_output=True, text=True, env=env
        )
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return proc.stdout, int(rss.read().split()[-1])


def llama_round(gguf: str, tests, reps: int, threads: list[int]) -> dict:
    """llama-bench processes running ``tests`` with each thread count: per test its best
    tokens/s over the thread counts (every one kept as ``TEST t=N``), peak RSS, build and CPU."""
    out: dict = {}
    for test in tests:  # one -p/-n/-d triple per run: llama-bench crosses lists of them
        for t in threads:
            text, rss = timed([LLAMA_BENCH, "-m", gguf, "-t", str(t), "-r", str(reps), "-o", "json", *LLAMA_ARGS[test]])
            row = json.loads(text)[0]
            out[f"{test} t={t}"] = row["avg_ts"]
            out[test] = max(out.get(test, 0.0), row["avg_ts"])
            out["peak_rss_mib"] = max(out.get("peak_rss_mib", 0), rss / 1024)
            out[f"peak_rss_mib {test}"] = max(out.get(f"peak_rss_mib {test}", 0), rss / 1024)
            out["build"], out["cpu"], out["model_type"] = row["build_commit"], row["cpu_info"], row["model_type"]
    out["TTFT"] = 512 / out["pp512"] + 1 / out["tg128@512"]
    return out


def jaxkv_round(gguf: str, weights: str, tests, cache_dir: str) -> dict:
    """Two fresh jaxkv processes sharing ``cache_dir`` (empty before the first): the first measures
    every test (first token with compiling included, then warm), the second only the first
    token with the persistent compilation cache filled."""
    env = {**os.environ, "JAXKV_COMPILE_CACHE": cache_dir}
    worker = [sys.executable, __file__, "--worker", gguf, weights, ",".join(tests)]
    text, rss = timed(worker, env)
    out = json.loads(text.strip().splitlines()[-1])
    out["peak_rss_mib"] = rss / 1024
    text, rss = timed(worker[:-1] + ["ttft"], env)
    out["TTFT cached"] = json.loads(text.strip().splitlines()[-1])["TTFT compile included"]
    out["peak_rss_mib one request"] = rss / 1024
    return out


def worker(gguf: str, weights: str, tests: list[str]) -> dict:
    """The jaxkv side, in this process (``--worker``); prints one JSON line."""
    from jaxkv.cli import use_compile_cache

    use_compile_cache()
    import jax
    import numpy as np
    from flax import nnx

    from jaxkv import CacheSpec, generate, load_model
    from jaxkv.decode import STREAM_S, new_cache, prefill, warm_prefill

    model = load_model(gguf, weights=weights)
    rng = np.random.default_rng(0)

    def prompt(n):
        return rng.integers(3, model.config.vocab_size, n).tolist()

    def ttft():  # a 512-token prompt to its first token, as `jaxkv sample` streams it
        t0, first = time.perf_counter(), []

        def on_block(out):
            first.append(time.perf_counter() - t0)

        generate(model, [prompt(512)], max_new_tokens=2, ignore_eos=True, stream_s=STREAM_S, on_block=on_block)
        return first[0]

    out = {"TTFT compile included": ttft()}
    if tests == ["ttft"]:
        return out
    out["TTFT warm"] = min(ttft() for _ in range(3))
    for test in tests:
        if test.startswith("pp"):
            n = int(test[2:])
            spec = CacheSpec(max_len=n)
            warm_prefill(model, new_cache(model.config, spec, 1), n)
            times = []
            for _ in range(3):
                cache = new_cache(model.config, spec, 1)
                t0 = time.perf_counter()
                _, logits = prefill(model, cache, [prompt(n)])
                logits.block_until_ready()
                times.append(time.perf_counter() - t0)
            out[test] = n / statistics.median(times)
        else:
            depth = int(test.split("@")[1])
            spec = CacheSpec(max_len=depth + 256) if depth <= 512 else CacheSpec(sink=4, window=252)
            for stream in [None, STREAM_S] if depth == 512 else [None]:
                rates = []
                for _ in range(2 if depth <= 512 else 1):  # decode_s excludes compiling; the best of two at 512
                    r = generate(
                        model,
                        [prompt(depth)],
                        max_new_tokens=129,
                        cache=spec,
                        ignore_eos=True,
                        block=32,
                        stream_s=stream,
                        on_block=(lambda out: None) if stream else None,
                    )
                    rates.append(128 / r.decode_s)
                out[("stream " if stream else "") + test] = max(rates)
    out["weight_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.model))))
    return out


def table(results: dict) -> str:
    """The markdown table of medians over rounds, jaxkv / llama.cpp ratios (TTFT: llama.cpp / jaxkv, >1 = jaxkv faster)."""
    rows = [
        "| model (GGUF) | jaxkv weights | test | llama.cpp | jaxkv | ratio (jaxkv / llama.cpp) |",
        "|---|---|---|---:|---:|---:|",
    ]
    for run in results["runs"]:
        med = lambda side, k: statistics.median(r[k] for r in run[side] if k in r)  # noqa: E731, B023
        lab, w = run["label"], run["weights"]
        for test in results["tests"]:
            a, b = med("llama", test), med("jaxkv", test)
            rows.append(f"| {lab} | {w} | {test} tok/s | {a:,.1f} | {b:,.1f} | **{b / a:.2f}x** |")
            if test == "tg128@512":
                s = med("jaxkv", "stream " + test)
                rows.append(f"| {lab} | {w} | {test} tok/s, jaxkv streaming | {a:,.1f} | {s:,.1f} | **{s / a:.2f}x** |")
        a = med("llama", "TTFT")
        for k in ("TTFT compile included", "TTFT cached", "TTFT warm"):
            b = med("jaxkv", k)
            rows.append(f"| {lab} | {w} | {k} (s) | {a:.3f} | {b:.3f} | **{b / a:.2f}x** (lower is better) |")
        for k, (a_key, b_key) in {
            "peak RSS (MiB)": ("peak_rss_mib", "peak_rss_mib"),
            "peak RSS, one request (MiB)": ("peak_rss_mib pp512", "peak_rss_mib one request"),
        }.items():
            a, b = med("llama", a_key), med("jaxkv", b_key)
            rows.append(f"| {lab} | {w} | {k} | {a:,.0f} | {b:,.0f} | **{b / a:.2f}x** (lower is better) |")
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pair", action="append", required=True, metavar="LABEL=GGUF:WEIGHTS")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=2, help="llama-bench -r (default: %(default)s)")
    p.add_argument("--tests", default=",".join(TESTS))
    p.add_argument(
        "--threads",
        default="2",
        metavar="N1,N2",
        help="llama-bench -t, each; the table takes llama.cpp's best (default: %(default)s)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    tests, threads = args.tests.split(","), [int(t) for t in args.threads.split(",")]
    runs = []
    for pair in args.pair:
        label, rest = pair.split("=", 1)
        gguf, weights = rest.rsplit(":", 1)
        runs.append({"label": label, "gguf": gguf, "weights": weights, "llama": [], "jaxkv": []})
    llama_cache: dict = {}
    for rnd in range(args.rounds):
        for run in runs:  # llama.cpp, then jaxkv, model after model; a GGUF's llama.cpp round runs once per round
            key = (run["gguf"], rnd)
            if key not in llama_cache:
                llama_cache[key] = llama_round(run["gguf"], tests, args.reps, threads)
            run["llama"].append(llama_cache[key])
            with tempfile.TemporaryDirectory() as cache_dir:
                run["jaxkv"].append(jaxkv_round(run["gguf"], run["weights"], tests, cache_dir))
            print(
                f"round {rnd + 1}: {run['label']} {run['weights']}: llama {json.dumps(run['llama'][-1])}\n"
                f"  jaxkv {json.dumps(run['jaxkv'][-1])}",
                file=sys.stderr,
                flush=True,
            )
    import jax

    results = {
        "tests": tests,
        "rounds": args.rounds,
        "threads": threads,
        "runs": runs,
        "llama_bench": LLAMA_BENCH,
        "machine": {
            "cpu": runs[0]["llama"][0]["cpu"],
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "jax": jax.__version__,
            "llama.cpp build": runs[0]["llama"][0]["build"],
        },
    }
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], sys.argv[3], sys.argv[4].split(","))), flush=True)
    else:
        main()
