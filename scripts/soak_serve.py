"""Soak test of `jaxkv serve`: N requests through one server, its RSS after each 100.

Issue 32's "memory stays flat" check: starts `jaxkv serve` on stories260K (8 slots, sink 4 +
window 60) on a free port, sends N short greedy completions from 8 client threads, and prints
the server's RSS (MiB, /proc, so Linux only) and its prefix-store bytes after every 100
requests, then the growth from request 200 (warm-up and the prefix store filled) to the end.
The prefix store grows to its bound by design: give a small ``--prefix-cache-bytes`` to see
the rest flat within the run.

    python scripts/soak_serve.py 2000 --prefix-cache-bytes 16000000
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("requests", type=int, help="requests to send (a multiple of 100, >= 300)")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="more `jaxkv serve` flags")
    args = p.parse_args()
    if args.requests < 300 or args.requests % 100:
        p.error(f"requests={args.requests}: expected a multiple of 100, >= 300")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxkv.cli",
            "serve",
            str(DATA / "models" / "stories260K.bin"),
            "--tokenizer",
            str(DATA / "models" / "tok512.model"),
            "--port",
            str(port),
            "--slots",
            "8",
            "--streaming-llm-sink",
            "4",
            "--streaming-llm-window",
            "60",
            *args.serve_args,
        ],
        stderr=subprocess.DEVNULL,
    )

    def rss_mib() -> int:
        with open(f"/proc/{server.pid}/status") as f:
            return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) // 1024

    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            sys.exit("jaxkv serve did not become healthy in 300 s")
        words = (DATA / "text" / "tinystories_valid_head.txt").read_text().split()

        def one(i: int) -> None:
            start = i * 7 % 5000
            r = httpx.post(
                f"{url}/v1/completions",
                timeout=120,
                json={"prompt": " ".join(words[start : start + 12]), "max_tokens": 16, "temperature": 0},
            )
            r.raise_for_status()

        marks = {}
        with cf.ThreadPoolExecutor(8) as pool:
            for done in range(100, args.requests + 1, 100):
                list(pool.map(one, range(done - 100, done)))
                marks[done] = rss_mib()
                prefix = next(
                    line.split()[1]
                    for line in httpx.get(f"{url}/metrics").text.splitlines()
                    if line.startswith("jaxkv_prefix_cache_bytes")
                )
                print(
                    f"{done} requests: RSS {marks[done]} MiB, prefix store {float(prefix) / 2**20:.1f} MiB", flush=True
                )
        first, last = marks[200], marks[args.requests]
        print(
            f"RSS after 200 requests {first} MiB, after {args.requests} {last} MiB: "
            f"{100 * (last - first) / first:+.1f} %"
        )
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
