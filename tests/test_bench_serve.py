"""scripts/bench_serve.py's pure parts: the percentiles, the ITL split, a load phase's summary, the
SSE parser (on a stream recorded from llama-server, cut at every byte), the Prometheus and
llama.cpp log parsers. No server is started."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import pytest

from paths import REPO

pytestmark = pytest.mark.jax_independent  # pure Python (the stats, the SSE parser)


def load_script():
    spec = importlib.util.spec_from_file_location("bench_serve_script", REPO / "scripts" / "bench_serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


B = load_script()

# llama-server 0.5.0-dev (commit 0c1e570), POST /v1/completions {"prompt": "Once upon a time", "max_tokens": 3,
# "stream": true, "stream_options": {"include_usage": true}, ...}: usage rides on the finish chunk.
LLAMA_STREAM = (
    b'data: {"choices":[{"text":",","index":0,"logprobs":null,"finish_reason":null}],"created":1796417736,'
    b'"object":"text_completion","id":"chatcmpl-x"}\n\n'
    b'data: {"choices":[{"text":" the","index":0,"logprobs":null,"finish_reason":null}],"created":1796417739,'
    b'"object":"text_completion","id":"chatcmpl-x"}\n\n'
    b'data: {"choices":[{"text":" city","index":0,"logprobs":null,"finish_reason":null}],"created":1796417739,'
    b'"object":"text_completion","id":"chatcmpl-x"}\n\n'
    b'data: {"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],"created":1796417739,'
    b'"object":"text_completion","usage":{"completion_tokens":3,"prompt_tokens":4,"total_tokens":7,'
    b'"prompt_tokens_details":{"cached_tokens":0}},"id":"chatcmpl-x","timings":{"cache_n":0,"prompt_n":4}}\n\n'
    b"data: [DONE]\n\n"
)

# jaxkv serve's chat stream: a role chunk, text chunks (one may hold several tokens, with a
# multi-byte character), the finish chunk, then usage alone (choices: []), with \r\n line ends.
JAXKV_CHAT_STREAM = (
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant",'
    '"content":""},"logprobs":null,"finish_reason":null}],"usage":null}\r\n\r\n'
    ": a comment line\r\n\r\n"
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Caf\u00e9 au"},'
    '"logprobs":null,"finish_reason":null}],"usage":null}\r\n\r\n'
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":" lait"},'
    '"logprobs":null,"finish_reason":null}],"usage":null}\r\n\r\n'
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"logprobs":null,'
    '"finish_reason":"length"}],"usage":null}\r\n\r\n'
    'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":9,'
    '"completion_tokens":4,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":0}}}\r\n\r\n'
    "data: [DONE]\r\n\r\n"
).encode()


def test_percentile_linear_interpolation():
    xs = [15, 20, 35, 40, 50]
    assert B.percentile(xs, 0) == 15
    assert B.percentile(xs, 100) == 50
    assert B.percentile(xs, 50) == 35
    assert B.percentile(xs, 40) == pytest.approx(29.0)  # rank 1.6: 20 + 0.6 * 15
    assert B.percentile(list(reversed(xs)), 99) == pytest.approx(49.6)  # rank 3.96: 40 + 0.96 * 10
    assert B.percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert B.percentile([7.5], 99) == 7.5
    assert B.percentile([], 50) is None
    with pytest.raises(ValueError):
        B.percentile(xs, 101)


def test_itl_one_token_per_chunk_and_several():
    times = [1.0, 1.1, 1.3, 1.6]
    itl, gaps = B.itl_from_chunks(times, 4)  # one token a chunk: the gaps themselves
    assert gaps == pytest.approx([0.1, 0.2, 0.3])
    assert itl == pytest.approx(gaps)
    itl, gaps = B.itl_from_chunks(times, 7)  # 6 tokens after the first over 3 chunks: 2 a chunk
    assert itl == pytest.approx([0.05, 0.1, 0.15])
    assert B.itl_from_chunks(times, None)[0] == pytest.approx(gaps)  # no usage: per chunk
    assert B.itl_from_chunks(times, 2)[0] == pytest.approx(gaps)  # fewer tokens than chunks: never shorter
    assert B.itl_from_chunks([1.0], 5) == ([], [])


def test_summarize_fixed_requests():
    reqs = [
        {
            "ok": True,
            "ttft_s": 0.1,
            "chunk_gaps_s": [0.01, 0.02],
            "itl_s": [0.01, 0.02],
            "text_chunks": 3,
            "output_tokens": 3,
            "e2e_s": 0.13,
            "tpot_s": 0.015,
        },
        {
            "ok": True,
            "ttft_s": 0.3,
            "chunk_gaps_s": [0.03, 0.04],
            "itl_s": [0.015, 0.02],
            "text_chunks": 2,
            "output_tokens": 3,
            "e2e_s": 0.37,
            "tpot_s": 0.035,
        },
        {"ok": False, "ttft_s": None, "itl_s": [], "output_tokens": 0, "e2e_s": 5.0, "error": "timed out"},
    ]
    s = B.summarize(reqs, wall_s=2.0)
    assert (s["requests"], s["ok"], s["errors"]) == (3, 2, 1)
    assert s["output_tokens"] == 6
    assert s["req_per_s"] == pytest.approx(1.0)
    assert s["out_tok_per_s"] == pytest.approx(3.0)
    assert s["ttft_p50_ms"] == pytest.approx(200.0)
    assert s["ttft_p99_ms"] == pytest.approx(298.0)
    assert s["itl_p50_ms"] == pytest.approx(25.0)
    assert s["itl_p99_ms"] == pytest.approx(39.7)
    assert s["itl_mean_ms"] == pytest.approx(25.0)
    assert s["itl_token_p50_ms"] == pytest.approx(17.5)
    assert s["chunks_per_reply"] == pytest.approx(2.5)
    assert s["tpot_p50_ms"] == pytest.approx(25.0)
    assert s["e2e_p99_ms"] == pytest.approx(367.6)
    empty = B.summarize([], wall_s=0.0)
    assert empty["req_per_s"] is None and empty["ttft_p50_ms"] is None


def test_median_summary_over_rounds():
    rounds = [
        {"requests": 4, "ok": 4, "out_tok_per_s": 10.0, "peak_rss_mib": 300.0, "kv_bytes": None},
        {"requests": 4, "ok": 3, "out_tok_per_s": 14.0, "peak_rss_mib": 320.0, "kv_bytes": None},
        {"requests": 4, "ok": 4, "out_tok_per_s": 11.0, "peak_rss_mib": 310.0, "kv_bytes": None},
    ]
    m = B.median_summary(rounds)
    assert (m["requests"], m["ok"], m["rounds"]) == (12, 11, 3)
    assert m["out_tok_per_s"] == 11.0
    assert m["peak_rss_mib"] == 320.0
    assert m["kv_bytes"] is None


def parse_all(data: bytes, step: int) -> list[str]:
    p = B.SSEParser()
    events = []
    for i in range(0, len(data), step):
        events += p.feed(data[i : i + step])
    return events + p.close()


@pytest.mark.parametrize("step", [1, 2, 7, 1 << 20])
def test_sse_parser_llama_stream_cut_anywhere(step):
    events = parse_all(LLAMA_STREAM, step)
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert [B.chunk_text(o) for o in objs] == [",", " the", " city", ""]
    assert objs[-1]["usage"]["completion_tokens"] == 3
    assert objs[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("step", [1, 3, 1 << 20])
def test_sse_parser_jaxkv_chat_stream_crlf(step):
    events = parse_all(JAXKV_CHAT_STREAM, step)
    assert len(events) == 6 and events[-1] == "[DONE]"  # the comment dropped
    objs = [json.loads(e) for e in events[:-1]]
    assert "".join(B.chunk_text(o) for o in objs) == "Caf\u00e9 au lait"
    assert [bool(B.chunk_text(o)) for o in objs] == [False, True, True, False, False]  # TTFT: the 2nd chunk
    assert objs[-1]["usage"]["completion_tokens"] == 4


def test_sse_parser_multiline_data_and_unterminated_end():
    p = B.SSEParser()
    assert p.feed(b"event: x\ndata: a\ndata: b\n\nid: 3\n") == ["a\nb"]
    assert p.feed(b"data: tail") == []
    assert p.close() == ["tail"]
    assert B.SSEParser().feed(b"\n\n\n") == []  # blank keep-alives: no events
    assert json.loads(B.SSEParser().feed(b'error: {"code": 500}\n\n')[0]) == {"error": '{"code": 500}'}


def test_prometheus_and_llama_log_parsers():
    text = (
        "# HELP jaxkv_kv_cache_bytes bytes of the batched KV cache\n# TYPE jaxkv_kv_cache_bytes gauge\n"
        "jaxkv_kv_cache_bytes 2.359296e+07\njaxkv_kv_cache_bytes_extra 1.0\n"
        'jaxkv_requests_total{status="200"} 12.0\njaxkv_busy_slots 0.0\n'
        'jaxkv_time_to_first_token_seconds_bucket{le="0.1"} 3.0\n'
    )
    assert B.prometheus_value(text, "jaxkv_kv_cache_bytes") == 23592960
    assert B.prometheus_value(text, "jaxkv_requests_total") == 12.0
    assert B.prometheus_value(text, "jaxkv_missing") is None
    assert B.prometheus_samples(text, "jaxkv_") == {
        "jaxkv_kv_cache_bytes": 23592960,
        "jaxkv_kv_cache_bytes_extra": 1.0,
        "jaxkv_busy_slots": 0.0,
    }
    log = (
        "0.00.395.024 I llama_kv_cache:        CPU KV buffer size =    22.50 MiB\n"
        "0.00.406.864 I llama_kv_cache: size =   22.50 MiB (   512 cells,  30 layers,  2/2 seqs), "
        "K (f16):   11.25 MiB, V (f16):   11.25 MiB\n"
    )
    assert B.llama_kv_bytes(log) == round(22.5 * (1 << 20))
    assert B.llama_kv_bytes(log + log.splitlines()[1].replace("22.50", "1.50")) == 24 << 20  # two caches (iSWA)
    assert B.llama_kv_bytes("no such line") is None


def test_table_and_prompts(tmp_path):
    row = {
        "server": "jaxkv",
        "clients": 4,
        "req_per_s": 0.5,
        "out_tok_per_s": 64.0,
        "ttft_p50_ms": 812.3,
        "ttft_p99_ms": 1500.0,
        "itl_p50_ms": 55.55,
        "itl_p99_ms": None,
        "chunks_per_reply": 128.0,
        "peak_rss_mib": 700.2,
        "kv_bytes": 3 << 20,
        "ok": 8,
        "requests": 8,
    }
    table = B.markdown_table([row]).splitlines()
    assert table[0].startswith("| server | clients | req/s | out tok/s | TTFT p50 ms")
    assert table[2] == "| jaxkv | 4 | 0.500 | 64.0 | 812 | 1500 | 55.5 | - | 128.0 | 700 | 3.0 | 8/8 |"
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{i}" for i in range(30_000)))
    prompts = B.Prompts(str(text))
    loads = [prompts.load(i, 80) for i in range(8)] + [prompts.load(i, 80, 1) for i in range(8)]
    assert len(set(loads)) == 16 and all(len(p.split()) == 80 for p in loads)
    assert not set(prompts.prefix(200).split()) & set(" ".join(loads).split())
    conv = B.conversation(prompts, 2000, 2000)
    assert conv[0]["role"] == "user" and conv[-1]["role"] == "user" and len(conv) % 2 == 1
    assert math.isclose(sum(len(m["content"].split()) for m in conv), 2000 / B.TOKENS_PER_WORD, rel_tol=0.05)
