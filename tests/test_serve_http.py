"""``jaxkv serve`` end to end: a real uvicorn subprocess serving the real stories260K model,
driven by the ``openai`` client and ``httpx`` (docs/SERVING.md).

One server per module (4 slots, no cache flags: the default cache, an API key, a prefill budget
of 32 tokens a step) for most tests;
a tiny one (1 slot, a queue of 1, sink 4 + window 60) for the queue-full and SIGTERM tests;
SmolLM2 (which has a chat template) for the one chat test. Outputs are compared with
:func:`jaxkv.sample` of the same prompt and cache, run in this process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from paths import REPO, SMOLLM2, STORIES_BIN, TOK512_MODEL

import jaxkv
from jaxkv import CacheSpec
from jaxkv.cli import main
from jaxkv.decode.chat import default_cache_spec
from jaxkv.serve import engine
from jaxkv.serve.protocol import FINISH_REASONS

pytestmark = pytest.mark.jax_independent  # the HTTP layer (its engine: test_serve_engine.py)

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
SPEC = CacheSpec(sink=4, window=60)
CACHE_FLAGS = ["--streaming-llm-sink", "4", "--streaming-llm-window", "60"]
STORIES = [str(STORIES_BIN), "--tokenizer", str(TOK512_MODEL)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``python -m jaxkv.cli serve`` subprocess on a free port (``stop()`` always ends it)."""

    def __init__(self, *flags: str, ready_timeout: float = 120.0, env: dict | None = None):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXKV_COMPILE_CACHE": "off", **(env or {})}
        env.pop("JAXKV_API_KEY", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxkv.cli", "serve", *flags, "--port", str(self.port)],
            cwd=REPO,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.health = []  # (status, body) of each /health answer while waiting
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"jaxkv serve exited with {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"jaxkv serve not ready after {ready_timeout} s:\n{self.output()}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=5)
                # Ray Serve's proxy answers in text until the app is deployed (tests/test_cluster.py)
                self.health.append(
                    (r.status_code, r.json() if r.headers.get("content-type") == "application/json" else r.text)
                )
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def client(self, api_key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def metrics(self) -> dict:
        """``{(name, frozenset(labels)): value}`` of a /metrics scrape."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def server():
    # no cache flags: the default cache; prompts here are short: a budget of 32 tokens a step
    # warms 3 prefill shapes instead of the default 512's 15 (the warm-up took 54 s of the module)
    s = Server(*STORIES, "--slots", "4", "--api-key", KEY, "--max-num-batched-tokens", "32")
    yield s
    output = s.output()
    s.stop()
    assert "Traceback" not in output, output  # disconnects and bad requests leave no tracebacks


@pytest.fixture(scope="module")
def tiny():
    """1 slot, a queue of 1, a 1 s shutdown timeout (its last test sends it SIGTERM)."""
    s = Server(*STORIES, *CACHE_FLAGS, "--slots", "1", "--max-queue", "1", "--shutdown-timeout", "1")
    yield s
    s.stop()


def _sse(lines) -> list:
    """The JSON objects of SSE ``data:`` lines up to ``[DONE]`` (asserted to come)."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return out
        out.append(json.loads(line[6:]))
    raise AssertionError(f"the stream ended without data: [DONE] after {len(out)} chunks")


def _expected(model, prompt: str, n: int, cache: CacheSpec | None = None, **kwargs) -> str:
    """The text :func:`jaxkv.sample` streams (``on_text``) with ``cache`` (None: the default cache
    of a ``jaxkv serve`` without cache flags): as the server, it keeps the leading space of the
    first token (``Generation.text`` drops it, as a plain decode of the ids does)."""
    pieces = []
    cache = default_cache_spec(model.config) if cache is None else cache
    jaxkv.sample(model, prompt, max_new_tokens=n, cache=cache, on_text=pieces.append, **kwargs)
    return "".join(pieces)


# ---- the server itself ---------------------------------------------------------------------------


def test_health_models_metrics(server):
    statuses = {status for status, _ in server.health}
    assert statuses <= {200, 503} and server.health[-1] == (200, {"status": "ok"})
    assert all(body == {"status": "loading"} for status, body in server.health if status == 503)
    assert "jaxkv serve: listening on " + server.url in server.output()
    assert [m.id for m in server.client().models.list()] == ["stories260K"]
    names = {name for name, _ in server.metrics()}
    for name in (
        "jaxkv_queue_depth",
        "jaxkv_busy_slots",
        "jaxkv_slots",
        "jaxkv_kv_cache_bytes",
        "jaxkv_prefix_cache_entries",
        "jaxkv_prefix_cache_bytes",
        "jaxkv_prefix_cache_hits_total",
        "jaxkv_prefix_cache_misses_total",
        "jaxkv_prompt_tokens_total",
        "jaxkv_completion_tokens_total",
        "jaxkv_cached_tokens_total",
        "jaxkv_decode_calls_total",
        "jaxkv_decode_rows_total",
        "jaxkv_prefill_calls_total",
        "jaxkv_prefill_rows_total",
        "jaxkv_time_to_first_token_seconds_count",
        "jaxkv_inter_token_latency_seconds_count",
    ):
        assert name in names, name
    assert server.metrics()[("jaxkv_slots", frozenset())] == 4


def test_completion_equals_sample(server, stories):
    prompt, n = "Once upon a time", 24
    expected = _expected(stories, prompt, n)
    client = server.client()
    r = client.completions.create(model="stories260K", prompt=prompt, max_tokens=n, temperature=0)
    assert r.choices[0].text == expected and r.choices[0].finish_reason in ("length", "stop")
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "stories260K"
    ids = stories.tokenizer.encode(prompt)
    assert r.usage.prompt_tokens == len(ids) and r.usage.total_tokens == len(ids) + r.usage.completion_tokens

    chunks = list(
        client.completions.create(
            model="stories260K",
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_a_stream_of_n_tokens_arrives_in_n_chunks(server, stories):
    """Every token is sent as it is sampled (llama-server's streaming; --stream-interval 1, the
    default): 20 tokens, 20 chunks carrying text, then the finish chunk."""
    prompt, n = "Tim found a shiny shell", 20  # no other test's prompt starts with it (prefix hits)
    chunks = list(
        server.client().completions.create(
            model="stories260K",
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert chunks[-1].usage.completion_tokens == n and len(texts) == n
    assert "".join(texts) == _expected(stories, prompt, n, ignore_eos=True)


@pytest.mark.slow
def test_concurrent_clients_equal_solo(server, stories):
    names = [
        "Lily",
        "Tom",
        "Sue",
        "Max",
        "Ben",
        "Amy",
        "Sam",
        "Mia",
        "Tim",
        "Zoe",
        "Bob",
        "Ann",
        "Joe",
        "Kim",
        "Dan",
        "Eve",
    ]
    prompts = [f"Once upon a time, {name} went to the" for name in names]
    n = 20
    solo = [_expected(stories, p, n) for p in prompts]
    client = server.client()

    def ask(i):
        if i % 2:  # half of them streaming
            stream = client.completions.create(
                prompt=prompts[i], max_tokens=n, temperature=0, stream=True, model="stories260K"
            )
            return "".join(c.choices[0].text for c in stream if c.choices)
        return (
            client.completions.create(prompt=prompts[i], max_tokens=n, temperature=0, model="stories260K")
            .choices[0]
            .text
        )

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, range(16)))
    assert together == solo


def test_prefix_cache_hit_in_usage(server):
    client = server.client()
    prompt = "The little dog ran to the park and saw a big red ball. He wanted to play with it, so he"
    first = client.completions.create(model="stories260K", prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model="stories260K", prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens
    assert second.choices[0].text == first.choices[0].text


def test_disconnect_frees_the_slot(server):
    before = server.metrics().get(("jaxkv_finished_requests_total", frozenset({("reason", "cancelled")})), 0)
    body = {"prompt": "Once upon a time", "max_tokens": 100000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        got = [line for line, _ in zip((line for line in lines if line.startswith("data: ")), range(3))]
        assert len(got) == 3
    with pytest.raises(httpx.ReadTimeout):  # a client of a non-streaming request that gives up waiting
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, headers=AUTH, timeout=1)
    deadline = time.monotonic() + 5
    while True:  # the engine frees the slots at its next step
        m = server.metrics()
        if m[("jaxkv_busy_slots", frozenset())] == 0 and m[("jaxkv_queue_depth", frozenset())] == 0:
            break
        assert time.monotonic() < deadline, f"a slot is still busy 5 s after the client left: {m}"
        time.sleep(0.1)
    assert m[("jaxkv_finished_requests_total", frozenset({("reason", "cancelled")}))] == before + 2
    r = server.client().completions.create(model="stories260K", prompt="Once", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_api_key(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key" and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # /health and /metrics need no key
    assert httpx.get(f"{server.url}/metrics").status_code == 200


BAD = [  # (case, endpoint, body, status, param, code): the schema's answers before pydantic, kept
    ("malformed JSON", "completions", b'{"prompt": "x",', 400, None, "invalid_json"),
    ("not an object", "completions", b"[1, 2]", 400, None, "invalid_json"),
    ("invalid UTF-8", "completions", b'{"prompt": "\xff\xfe"}', 400, None, "invalid_json"),
    ("NaN", "completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature", "invalid_json"),
    ("Infinity", "completions", b'{"prompt": "x", "max_tokens": Infinity}', 400, "max_tokens", "invalid_json"),
    ("1e999", "completions", b'{"prompt": "x", "top_p": 1e999}', 400, "top_p", "invalid_json"),
    ("lone surrogate", "completions", b'{"prompt": "a\\ud800"}', 400, "prompt", "invalid_value"),
    (
        "nested too deeply",
        "completions",
        b'{"prompt": "x", "user": ' + b"[" * 100000 + b"]" * 100000 + b"}",
        400,
        None,
        "invalid_json",
    ),
    ("max_tokens bool", "completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens", "invalid_type"),
    ("max_tokens string", "completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "invalid_type"),
    ("max_tokens 0", "completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("max_tokens 2**31", "completions", {"prompt": "x", "max_tokens": 2147483648}, 400, "max_tokens", "invalid_value"),
    ("temperature -1", "completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "invalid_value"),
    ("temperature 2.5", "completions", {"prompt": "x", "temperature": 2.5}, 400, "temperature", "invalid_value"),
    ("top_p 0", "completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("top_k -2", "completions", {"prompt": "x", "top_k": -2}, 400, "top_k", "invalid_value"),
    ("seed 2**32", "completions", {"prompt": "x", "seed": 4294967296}, 400, "seed", "invalid_value"),
    ("n 2", "completions", {"prompt": "x", "n": 2}, 400, "n", "unsupported_value"),
    ("stream string", "completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "invalid_type"),
    (
        "stream_options without stream",
        "completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "invalid_value",
    ),
    ("five stops", "completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ("empty stop", "completions", {"prompt": "x", "stop": [""]}, 400, "stop", "invalid_value"),
    ("two prompts", "completions", {"prompt": ["a", "b"]}, 400, "prompt", "unsupported_value"),
    ("no prompt", "completions", {"max_tokens": 3}, 400, "prompt", "missing_required_parameter"),
    ("prompt number", "completions", {"prompt": 5}, 400, "prompt", "invalid_type"),
    ("id outside the vocabulary", "completions", {"prompt": [1, 512]}, 400, "prompt", "invalid_value"),
    ("echo", "completions", {"prompt": "x", "echo": True}, 400, "echo", "unsupported_parameter"),
    ("best_of", "completions", {"prompt": "x", "best_of": 2}, 400, "best_of", "unsupported_parameter"),
    ("suffix", "completions", {"prompt": "x", "suffix": "end"}, 400, "suffix", "unsupported_parameter"),
    ("logprobs", "completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs", "unsupported_parameter"),
    ("logit_bias", "completions", {"prompt": "x", "logit_bias": {"5": 10}}, 400, "logit_bias", "unsupported_parameter"),
    (
        "presence_penalty",
        "completions",
        {"prompt": "x", "presence_penalty": 0.5},
        400,
        "presence_penalty",
        "unsupported_parameter",
    ),
    ("unknown model", "completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    (
        "tools",
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        "tools",
        "unsupported_parameter",
    ),
    (
        "chat logprobs",
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True},
        400,
        "logprobs",
        "unsupported_parameter",
    ),
    (
        "response_format",
        "chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
        400,
        "response_format",
        "unsupported_parameter",
    ),
    ("no messages", "chat/completions", {"model": "stories260K"}, 400, "messages", "missing_required_parameter"),
    (
        "tool role",
        "chat/completions",
        {"messages": [{"role": "tool", "content": "x"}]},
        400,
        "messages[0].role",
        "invalid_value",
    ),
    (
        "image part",
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0].type",
        "invalid_value",
    ),
    (
        "no chat template",
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}]},
        400,
        "messages",
        "model_not_supported",
    ),
]


@pytest.mark.parametrize("case, endpoint, body, status, param, code", BAD, ids=[b[0] for b in BAD])
def test_bad_request(server, case, endpoint, body, status, param, code):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}/v1/{endpoint}", content=data, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"]
    if status == 404:
        assert error["code"] == "model_not_found"
    assert error["code"] == code


def test_serves_after_bad_requests(server):
    key = ("jaxkv_requests_total", frozenset({("status", "400")}))
    before = server.metrics().get(key, 0.0)  # xdist may run the BAD cases on another worker's server: count here
    for _, endpoint, body, *_ in BAD[:6]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        httpx.post(f"{server.url}/v1/{endpoint}", content=data, headers={**AUTH, "Content-Type": "application/json"})
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "Once", "max_tokens": 2, "unknown_field": 1},
        headers=AUTH,
        timeout=30,
    )  # unknown fields are ignored; the model omitted is this one
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="stories260K", prompt="x", max_tokens=2, n=2)
    assert e.value.body["param"] == "n"
    assert server.metrics()[key] == before + 6 + 1


def test_default_cache(server, stories):
    """No cache flags: the bounded default (sink 4 + a window filling min(1024, the trained
    context), positions cache), named in the `listening on` line and on the model card."""
    spec = default_cache_spec(stories.config)
    assert spec.sink == 4 and spec.sink + spec.window == min(1024, stories.config.max_seq_len)
    assert f"cache {spec.describe()}, the default:" in server.output()
    card = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]
    assert card["jaxkv"] == {"cache": spec.describe(), "slots": 4, "max_tokens_per_request": None}
    assert httpx.get(f"{server.url}/v1/models/stories260K", headers=AUTH).json() == card


@pytest.mark.parametrize("flag", ["--max-num-batched-tokens", "--stream-interval"])
def test_engine_flags_refused_by_name(capsys, flag):
    assert main(["serve", *STORIES, flag, "0"]) == 2  # before anything loads
    err = capsys.readouterr().err
    assert err.startswith(f"jaxkv: error: {flag} 0: ") and err.count("\n") == 1, err


def test_finish_reasons_cover_the_engine():
    assert set(FINISH_REASONS) == set(engine.FINISH_REASONS) - {"error"}  # error: a 500 or an error event
    assert set(FINISH_REASONS.values()) == {"stop", "length"}


@pytest.mark.slow
def test_full_cache_limits(stories):
    s = Server(*STORIES, "--max-len", "64", "--slots", "1")
    try:
        url = f"{s.url}/v1/completions"
        ids = stories.tokenizer.encode("Once upon a time")
        r = httpx.post(url, json={"prompt": "Once upon a time", "max_tokens": 100}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = httpx.post(url, json={"prompt": "the cat sat " * 40}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = httpx.post(url, json={"prompt": "Once upon a time", "temperature": 0, "ignore_eos": True}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 64 - len(ids)  # what still fits
        assert r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        s.stop()


# ---- the tiny server: queue full, then SIGTERM ---------------------------------------------------

LONG = {"prompt": "Once upon a time", "max_tokens": 100000, "ignore_eos": True, "temperature": 0, "stream": True}


def _first_data(lines) -> dict:
    """The first SSE data object of ``lines`` (an iterator the caller keeps: an abandoned
    ``iter_lines()`` closes the connection when it is collected, which cancels the request)."""
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("no data")


@pytest.mark.slow
def test_queue_full_is_429(tiny):
    with httpx.Client(timeout=30) as c, contextlib.ExitStack() as streams:
        running = streams.enter_context(c.stream("POST", f"{tiny.url}/v1/completions", json=LONG))
        running_lines = running.iter_lines()
        _first_data(running_lines)  # it holds the one slot
        queued = streams.enter_context(c.stream("POST", f"{tiny.url}/v1/completions", json=LONG))
        assert queued.status_code == 200  # it waits in the queue of one
        r = c.post(f"{tiny.url}/v1/completions", json={**LONG, "stream": False})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            tiny.client().completions.create(model="stories260K", prompt="x", max_tokens=2)
    deadline = time.monotonic() + 10
    while (m := tiny.metrics())[("jaxkv_busy_slots", frozenset())] or m[("jaxkv_queue_depth", frozenset())]:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
    assert tiny.client().completions.create(model="stories260K", prompt="x", max_tokens=2).usage.completion_tokens == 2


@pytest.mark.slow
def test_sigterm_ends_streams_and_exits_0(tiny):
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{tiny.url}/v1/completions", json=LONG) as r:
        lines = r.iter_lines()
        _first_data(lines)
        tiny.proc.send_signal(signal.SIGTERM)
        chunks = _sse(lines)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # cut short by the shutdown
    assert tiny.proc.wait(timeout=60) == 0, tiny.output()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{tiny.url}/health", timeout=5)


# ---- chat: SmolLM2 has a template ----------------------------------------------------------------


@pytest.mark.slow
def test_chat_equals_sample(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = _expected(smollm2, messages[0]["content"], 12, SPEC, chat=True)
    flags = ["--slots", "1", "--max-num-batched-tokens", "32"]  # one request at a time: 2 prefill shapes to warm
    s = Server(str(SMOLLM2), *CACHE_FLAGS, *flags, "--model-name", "smol", ready_timeout=600)
    try:
        client = s.client()
        r = client.chat.completions.create(model="smol", messages=messages, max_completion_tokens=12, temperature=0)
        assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected
        chunks = list(
            client.chat.completions.create(model="smol", messages=messages, max_tokens=12, temperature=0, stream=True)
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    finally:
        s.stop()
