"""Batch decoding (jaxkv/batch.py) and sharding over devices (jaxkv/parallel.py).

Ragged rows of one batch give exactly the tokens of each prompt decoded alone; a run
sharded over 4 (forced) CPU devices gives the tokens of the unsharded run with the cache
really split; the JSONL runner keeps input order, skips malformed lines by number and
writes its output atomically.
"""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paths import REPO, STORIES_BIN, TOK512_MODEL

from jaxkv import CacheSpec, JaxkvError, Sampler, generate, sample
from jaxkv.cache import kv
from jaxkv.cache.ring import write_ring
from jaxkv.cli import main
from jaxkv.decode.batch import (
    Row,
    _RowLimits,
    padded_batch_size,
    parse_requests,
    plan_batches,
    read_requests,
    run_rows,
    write_jsonl_atomic,
)
from jaxkv.testing import tiny_loaded

FP = CacheSpec(sink=4, window=60)
INT4 = CacheSpec(sink=4, window=64, kv_quantize="int4", group_size=16, residual=16)
LENGTHS = (1, 7, 40, 300)
BUDGETS = (12, 5, 12, 9)  # rows stop at their own budget while the others go on


def prompt(n, seed):
    return np.random.default_rng(seed).integers(0, 64, n).tolist()


@pytest.mark.parametrize("spec", [FP, INT4], ids=["sink4+60", "int4-w64-G16-R16"])
def test_ragged_greedy_rows_equal_each_prompt_alone(spec):
    lm = tiny_loaded(tokenizer=False)
    prompts = [prompt(n, 100 + i) for i, n in enumerate(LENGTHS)]
    rows = [Row(ids=p, max_new_tokens=m) for p, m in zip(prompts, BUDGETS)]
    batched = run_rows(lm, rows, batch_size=4, cache=spec)
    for p, m, got in zip(prompts, BUDGETS, batched):
        alone = generate(lm, [p], max_new_tokens=m, cache=spec)
        assert got.token_ids == alone.token_ids[0], len(p)
        assert got.finish_reason == alone.finish_reasons[0] == "length"
        assert got.stored_tokens == int(alone.cache.stored()[0])
        assert got.prompt_tokens == len(p)


def test_sampled_row_depends_on_its_seed_not_its_batch():
    """A row's draws are jaxkv.generate's for its prompt alone with its seed, whatever shares its
    batch (rows at other temperatures, greedy ones included: one compiled loop)."""
    lm = tiny_loaded(tokenizer=False)
    target = Row(ids=prompt(9, 1), max_new_tokens=10, temperature=0.9, seed=1234)
    others = [
        Row(ids=prompt(n, 2 + n), max_new_tokens=10, temperature=t, seed=n) for n, t in ((3, 0.0), (20, 0.5), (33, 0.9))
    ]
    alone = run_rows(lm, [target], batch_size=1, cache=FP)[0]
    mixed = run_rows(lm, others[:2] + [target] + others[2:], batch_size=4, cache=FP)
    assert mixed[2].token_ids == alone.token_ids
    solo = generate(lm, [target.ids], max_new_tokens=10, cache=FP, sampler=Sampler(temperature=0.9), seed=1234)
    assert alone.token_ids == solo.token_ids[0]
    greedy = generate(lm, [others[0].ids], max_new_tokens=10, cache=FP)
    assert mixed[0].token_ids == greedy.token_ids[0]
    reseeded = run_rows(lm, [Row(ids=target.ids, max_new_tokens=10, temperature=0.9, seed=99)], batch_size=1, cache=FP)[
        0
    ]
    assert reseeded.token_ids != alone.token_ids


def test_plan_sorts_by_length_whatever_the_temperature_and_pads_to_few_shapes():
    rows = [
        Row(ids=[1] * n, max_new_tokens=1, temperature=t)
        for n, t in [(5, 0.0), (1, 0.7), (9, 0.0), (2, 0.0), (3, 0.7), (7, 0.0), (4, 0.0)]
    ]
    assert plan_batches(rows, 2) == [[1, 3], [4, 6], [0, 5], [2]]
    assert [padded_batch_size(n, 16) for n in (16, 9, 5, 3, 1)] == [16, 16, 8, 4, 1]
    assert [padded_batch_size(n, 6, multiple=4) for n in (6, 3, 1)] == [8, 4, 4]


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_batch_parallel_ring_write_equals_row_loop(chunk):
    """The vmapped write used on a sharded batch writes exactly what the per-row loop writes (wraps included)."""
    rng = np.random.default_rng(chunk)
    buf = jnp.asarray(rng.normal(size=(2, 5, 3, 8, 4)), jnp.float32)  # [L, B, K, R, H]
    new = jnp.asarray(rng.normal(size=(2, 5, 3, chunk, 4)), jnp.float32)
    start = jnp.asarray([0, 7, 5, 3, 6], jnp.int32)
    n = jnp.asarray(np.minimum([chunk, chunk, 0, chunk - 1, 2], chunk), jnp.int32)
    kw = dict(batch_axis=1, slot_axis=3)
    loop = jax.jit(lambda *a: write_ring(*a, **kw))(buf, new, start, n)
    par = jax.jit(lambda *a: write_ring(*a, **kw, batch_parallel=True))(buf, new, start, n)
    np.testing.assert_array_equal(np.asarray(par), np.asarray(loop))
    pos = jnp.full((5, 8), -1, jnp.int32)
    p_new = jnp.arange(5 * chunk, dtype=jnp.int32).reshape(5, chunk)
    kw = dict(batch_axis=0, slot_axis=1)
    np.testing.assert_array_equal(
        np.asarray(write_ring(pos, p_new, start, n, **kw, batch_parallel=True)),
        np.asarray(write_ring(pos, p_new, start, n, **kw)),
    )


SHARDED = textwrap.dedent(
    """
    import json, re, sys
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_platforms", "cpu")
    from flax import nnx
    from jaxkv import CacheSpec, KVCache
    from jaxkv.decode import Sampler, lower_decode, parallel
    from jaxkv.decode.batch import Row, run_rows
    from jaxkv.testing import tiny_loaded

    assert jax.device_count() == 4, jax.devices()

    def spec_of(x):  # the partition spec as a list, trailing Nones dropped (jax versions differ there)
        spec = list(x.sharding.spec)
        while spec and spec[-1] is None:
            spec.pop()
        return spec

    lm = tiny_loaded(tokenizer=False)
    c = lm.config
    prompts = [np.random.default_rng(100 + i).integers(0, 64, n).tolist() for i, n in enumerate((1, 7, 40, 300, 12, 3))]
    rows = [Row(ids=p, max_new_tokens=m) for p, m in zip(prompts, (12, 5, 12, 9, 7, 40))]
    specs = {"fp": CacheSpec(sink=4, window=60),
             "int4": CacheSpec(sink=4, window=64, kv_quantize="int4", group_size=16, residual=16)}
    out = {}
    for name, spec in specs.items():
        ref = [r.token_ids for r in run_rows(lm, rows, batch_size=8, cache=spec)]
        for shape in ((4, 1), (2, 2)) if name == "fp" else ((2, 2),):
            mesh = parallel.make_mesh(data=shape[0], kv=shape[1])
            batches = []
            got = [r.token_ids for r in run_rows(lm, rows, batch_size=8, cache=spec, mesh=mesh,
                                                 on_batch=lambda members, gen: batches.append(gen))]
            out[f"{name} {shape[0]}x{shape[1]} same tokens"] = got == ref
        # the final cache of the 2 x 2 run (B=8 rows over data=2, K=2 heads over kv=2)
        cache = batches[-1].cache
        leaves = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(cache)[0]}
        out[f"{name} leaves"] = {k: [spec_of(x), x.shape, sorted({s.data.shape for s in x.addressable_shards})]
                                 for k, x in leaves.items()}
        out[f"{name} wq spec"] = spec_of(nnx.state(parallel.shard_model(lm, mesh).model)["wq"].value.t)  # held [L, N*H, D]
        # shard_cache (place an existing cache) and create_cache (born sharded) agree
        made = parallel.create_cache(spec, mesh, batch=8, n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim)
        placed = parallel.shard_cache(KVCache.create(spec, batch=8, n_layers=c.n_layers, n_kv_heads=c.n_kv_heads,
                                                     head_dim=c.head_dim), mesh)
        out[f"{name} create == shard"] = (made.batch_sharded and placed.batch_sharded and all(
            x.sharding.is_equivalent_to(y.sharding, x.ndim) and bool((np.asarray(x) == np.asarray(y)).all())
            for x, y in zip(jax.tree.leaves(made), jax.tree.leaves(placed))))
        if name == "int4":  # the compiled decode loop moves no cache between devices: no all-gather
            hlo = lower_decode(parallel.shard_model(lm, mesh), cache, sampler=Sampler(), block=4, eos_id=None,
                               max_new_tokens=5).compile().as_text()
            out["collectives"] = sorted(set(re.findall(r"(all-gather|all-to-all|collective-permute|all-reduce)\\(", hlo)))
    print("RESULT " + json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def sharded_run():
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO)
    )
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=900, cwd=REPO / "tests"
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_sharded_runs_give_the_unsharded_tokens(sharded_run):
    assert sharded_run["fp 4x1 same tokens"] is True
    assert sharded_run["fp 2x2 same tokens"] is True
    assert sharded_run["int4 2x2 same tokens"] is True


@pytest.mark.parametrize("name", ["fp", "int4"])
def test_cache_leaves_are_sharded_over_data_and_kv(sharded_run, name):
    leaves = sharded_run[f"{name} leaves"]
    # B=8 rows over data=2, K=2 heads over kv=2: every device holds [L, 4, 1, C, H]
    assert leaves[".ring_k"][0] == [None, "data", "kv"]
    l, b, k, r, h = leaves[".ring_k"][1]
    assert leaves[".ring_k"][2] == [[l, b // 2, k // 2, r, h]]
    assert leaves[".ring_pos"][0] == ["data"] and leaves[".ring_pos"][2] == [[b // 2, leaves[".ring_pos"][1][1]]]
    assert leaves[".length"][0] == ["data"] and leaves[".length"][2] == [[b // 2]]
    assert leaves[".sink_k"][2] == [[l, b // 2, 1, 4, h]]
    if name == "int4":
        for leaf in (".quant.k_codes", ".quant.k_scale", ".quant.v_codes", ".quant.v_scale"):
            spec, shape, shards = leaves[leaf]
            assert spec == [None, "data", "kv"] and shards == [[shape[0], b // 2, 1, *shape[3:]]], leaf
        assert leaves[".quant.pos"][2] == [[b // 2, 64]]
    assert sharded_run[f"{name} wq spec"] == [None, "kv"]
    assert sharded_run[f"{name} create == shard"] is True


def test_sharded_decode_loop_moves_no_cache_between_devices(sharded_run):
    """Writes stay on each device's own rows (no all-gather of the cache); the only
    collective is the tensor-parallel all-reduce of the head-split attention and MLP."""
    assert sharded_run["collectives"] == ["all-reduce"]


def test_parse_requests_reports_bad_lines_by_number():
    lines = [
        '{"prompt": "a"}',
        "{not json",
        "",
        '["prompt"]',
        '{"prompt": 3}',
        '{"prompt": "b", "max_new_tokens": 0}',
        '{"prompt": "c", "temperature": -1}',
        '{"prompt": "d", "seed": 1.5}',
        '{"text": "e"}',
        '{"prompt": "f", "max_new_tokens": true}',
        '{"prompt": "g", "max_new_tokens": 4, "temperature": 0.5, "seed": 7, "id": [1]}',
    ]
    requests, errors = parse_requests(lines)
    assert [(r.index, r.line, r.prompt) for r in requests] == [(0, 1, "a"), (9, 11, "g")]
    assert (requests[1].max_new_tokens, requests[1].temperature, requests[1].seed, requests[1].id) == (4, 0.5, 7, [1])
    assert [e.line for e in errors] == [2, 4, 5, 6, 7, 8, 9, 10]
    messages = [e.message for e in errors]
    assert "invalid JSON" in messages[0] and "JSON object" in messages[1] and '"prompt" must be a string' in messages[2]
    assert '"max_new_tokens"' in messages[3] and '"temperature"' in messages[4] and '"seed"' in messages[5]
    assert 'missing "prompt"' in messages[6] and '"max_new_tokens"' in messages[7]


STORIES = [str(STORIES_BIN), "--tokenizer", str(TOK512_MODEL)]
PROMPTS = [
    "Once upon a time, there was a little dog named Max who loved to run in the park",
    "Lily",
    "The sun",
    "One day, a big bear",
]


def test_jsonl_input_order_malformed_line_skipped_atomic_output(tmp_path, capsys):
    src = tmp_path / "prompts.jsonl"
    lines = [
        json.dumps({"prompt": PROMPTS[0], "id": "a"}),
        json.dumps({"prompt": PROMPTS[1], "max_new_tokens": 5}),
        '{"prompt": "broken", ',
        json.dumps({"prompt": PROMPTS[2], "temperature": 0.8, "seed": 11}),
        json.dumps({"prompt": PROMPTS[3], "max_new_tokens": 7}),
    ]
    src.write_text("\n".join(lines) + "\n")
    dst = tmp_path / "results.jsonl"
    dst.write_text("old results\n")
    code = main(
        [
            "batch",
            *STORIES,
            "--input",
            str(src),
            "--output",
            str(dst),
            "--batch-size",
            "2",
            "--tokens",
            "12",
            "--no-progress",
        ]
    )
    _, err = capsys.readouterr()
    assert code == 0, err
    assert f"{src}: line 3: invalid JSON" in err and "(skipped)" in err
    out = [json.loads(ln) for ln in dst.read_text().splitlines()]
    assert [(r["index"], r["line"]) for r in out] == [(0, 1), (1, 2), (3, 4), (4, 5)]  # input order, line 3 missing
    assert out[0]["id"] == "a" and "id" not in out[1]
    assert [r["generated_tokens"] for r in out] == [len(r["token_ids"]) for r in out]
    for r, budget in zip(out, (12, 5, 12, 7)):  # per-row max_new_tokens, else --tokens
        assert len(r["token_ids"]) == budget if r["finish_reason"] == "length" else r["finish_reason"] == "eos"
    for r in out:
        assert r["stored_tokens"] == r["prompt_tokens"] + r["generated_tokens"] - 1
    # a greedy row equals the prompt sampled alone
    alone = sample(str(STORIES_BIN), PROMPTS[3], max_new_tokens=7, tokenizer=str(TOK512_MODEL))
    assert out[3]["token_ids"] == alone.token_ids and out[3]["text"] == alone.text
    assert sorted(os.listdir(tmp_path)) == ["prompts.jsonl", "results.jsonl"]  # no temporary file left behind


def test_failed_write_leaves_the_old_output_intact(tmp_path):
    dst = tmp_path / "results.jsonl"
    dst.write_text('{"old": true}\n')

    def records():
        yield {"index": 0}
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_jsonl_atomic(dst, records())
    assert dst.read_text() == '{"old": true}\n'
    assert os.listdir(tmp_path) == ["results.jsonl"]
    write_jsonl_atomic(dst, [{"index": 0, "text": "é"}])
    assert json.loads(dst.read_text()) == {"index": 0, "text": "é"}


def test_prompt_longer_than_a_fixed_full_cache_is_skipped_by_line(tmp_path, capsys):
    src = tmp_path / "p.jsonl"
    src.write_text(
        json.dumps({"prompt": "Once upon a time there was a big dog who liked to play"})
        + "\n"
        + json.dumps({"prompt": "Hi"})
        + "\n"
    )
    dst = tmp_path / "r.jsonl"
    code = main(
        [
            "batch",
            *STORIES,
            "--input",
            str(src),
            "--output",
            str(dst),
            "--max-len",
            "8",
            "--tokens",
            "3",
            "--no-progress",
        ]
    )
    _, err = capsys.readouterr()
    assert code == 0, err
    assert "line 1: prompt of" in err and "max_len=8" in err
    out = [json.loads(ln) for ln in dst.read_text().splitlines()]
    assert [r["line"] for r in out] == [2]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "0"], "--batch-size 0"),
        (["--shard", "model"], "--shard 'model'"),
        (["--temperature", "-1"], "temperature=-1.0"),
        (
            ["--streaming-llm-window", "60", "--kv-quantize", "int4", "--kv-group-size", "32"],
            "--streaming-llm-window 60 is not",
        ),
    ],
)
def test_bad_batch_flags_one_line_exit_2(tmp_path, capsys, argv, message):
    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "x"}\n')
    code = main(["batch", *STORIES, "--input", str(src), "--output", str(tmp_path / "r.jsonl"), *argv])
    _, err = capsys.readouterr()
    assert code == 2 and err.startswith("jaxkv: error: ") and message in err and err.count("\n") == 1, err


def test_no_valid_rows_and_missing_input_are_errors(tmp_path, capsys):
    src = tmp_path / "p.jsonl"
    src.write_text("oops\n")
    assert main(["batch", *STORIES, "--input", str(src), "--output", str(tmp_path / "r.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "line 1: invalid JSON" in err and "no valid rows" in err
    assert (
        main(["batch", *STORIES, "--input", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "r.jsonl")]) == 2
    )
    assert "no such input file" in capsys.readouterr().err
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.slow
def test_two_processes_on_one_global_mesh_write_the_one_process_results(tmp_path, capsys):
    """docs/BATCH.md's multi-host recipe on one machine: 2 processes x 2 CPU devices joined by
    jax.distributed (gloo) into one 4-device mesh give the results of a single process."""
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": 6 + i}) + "\n" for i, p in enumerate(PROMPTS)))
    common = ["--input", str(src), "--tokens", "10", "--batch-size", "4", "--no-progress"]
    assert main(["batch", *STORIES, *common, "--output", str(tmp_path / "one.jsonl")]) == 0, capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO)
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jaxkv.cli",
                "batch",
                *STORIES,
                *common,
                "--output",
                str(tmp_path / "two.jsonl"),
                "--shard",
                "data",
                "--coordinator",
                f"localhost:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    logs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][1][-3000:] + logs[1][1][-3000:]
    assert "mesh data=4 x kv=1 over 4 cpu devices on 2 processes" in logs[0][1]
    assert "wrote" not in logs[1][1]  # only process 0 reports and writes
    one = [json.loads(ln) for ln in (tmp_path / "one.jsonl").read_text().splitlines()]
    two = [json.loads(ln) for ln in (tmp_path / "two.jsonl").read_text().splitlines()]
    assert [(r["index"], r["token_ids"], r["text"]) for r in two] == [
        (r["index"], r["token_ids"], r["text"]) for r in one
    ]


def test_row_seeds_make_one_key_per_row_and_a_wrong_count_is_refused():
    from jaxkv import JaxkvError
    from jaxkv.decode import prng_keys

    assert prng_keys(3, 2).shape == (2,)
    keys = np.asarray(prng_keys([5, 6, 5], 3))
    assert keys.shape == (3, 2) and (keys[0] == keys[2]).all() and (keys[0] != keys[1]).any()
    with pytest.raises(JaxkvError, match="one per row"):
        prng_keys([1, 2, 3], 2)


# ---- one bad row never kills a run --------------------------------------------------------------
def test_parse_requests_skips_rows_no_tokenizer_or_writer_could_take():
    deep = "[" * 100_000 + "]" * 100_000
    lines = [
        b'{"prompt": "a"}',
        b'{"prompt": "\\ud800 x"}',
        b'{"prompt": "b", "id": "ok\\udfff"}',
        b'{"prompt": "c", "id": ' + deep.encode() + b"}",
        b'{"prompt": "caf\xe9"}',
        b"  ",
        b'{"prompt": "d", "seed": ' + b"1" * 5000 + b"}",
        '{"prompt": "e\u2028f", "id": "\u00e9"}'.encode(),
    ]
    requests, errors = parse_requests(lines)
    assert [(r.index, r.line, r.prompt, r.id) for r in requests] == [(0, 1, "a", None), (6, 8, "e\u2028f", "\u00e9")]
    assert [str(e) for e in errors] == [
        "line 2: \"prompt\" holds a lone surrogate '\\ud800' at character 0: not valid Unicode text",
        "line 3: \"id\" holds a lone surrogate '\\udfff': not valid Unicode text",
        "line 4: invalid JSON (nested too deeply for Python's parser)",
        "line 5: not UTF-8 text (byte 0xe9 at byte 16)",
        "line 7: invalid JSON (Exceeds the limit (4300 digits) for integer string conversion)",
    ]


def test_read_requests_splits_lines_only_at_line_ends(tmp_path):
    """A raw U+2028 (valid inside a JSON string) used to split a record in two (str.splitlines)."""
    src = tmp_path / "p.jsonl"
    src.write_bytes('{"prompt": "one\u2028two"}\r\n{"prompt": "x\x1cy"}\r{"prompt": "\xff"}'.encode())
    requests, errors = read_requests(src)
    assert [(r.line, r.prompt) for r in requests] == [(1, "one\u2028two"), (3, "\xff")]
    assert [e.line for e in errors] == [2] and "invalid JSON" in errors[0].message  # a raw control character


FREE = 64 * 2**20  # the memory the tests pretend the device has
# stories260K: L=5 layers x K=4 KV heads x H=8 x fp32 x (K + V) + an int32 position = 1284 bytes per slot and row;
# a batch of 8 rows: 10272 bytes per slot + 32 (lengths); 64 MiB hold 6533 slots, the largest multiple of 256 is 6400
FIT_SLOTS = 6400


def test_bad_rows_are_skipped_by_line_and_the_good_rows_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(kv, "device_memory", lambda devices=None: (FREE, "cpu"))
    src = tmp_path / "p.jsonl"
    src.write_bytes(
        b"\n".join(
            [
                json.dumps({"prompt": "Lily", "id": "a"}).encode(),
                b'{"prompt": "\\ud800"}',
                b'{"prompt": "Lily", "id": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                json.dumps({"prompt": "The sun", "max_new_tokens": 1_000_000_000}).encode(),
                b'{"prompt": "caf\xe9"}',
                json.dumps({"prompt": "One day\u2028a big bear", "id": 7}, ensure_ascii=False).encode(),
                json.dumps({"prompt": "The sun", "max_new_tokens": 2**31}).encode(),
                json.dumps(
                    {"prompt": "The sun", "max_new_tokens": FIT_SLOTS - 4 + 1}
                ).encode(),  # "The sun" is 4 tokens
            ]
        )
        + b"\n"
    )
    dst = tmp_path / "r.jsonl"
    code = main(["batch", *STORIES, "--input", str(src), "--output", str(dst), "--tokens", "6", "--no-progress"])
    err = capsys.readouterr().err.splitlines()
    assert code == 0, err
    needs = "after a prompt of 4 tokens needs a cache of full {slots}, fp32, positions=absolute: {size} for a batch of 8 rows"
    fits = f"more than the 64.00 MiB of memory: at most max_new_tokens={FIT_SLOTS - 4} fits (or use fewer rows per batch, or a StreamingLLM window)"
    assert [line for line in err if line.startswith(str(src))] == [
        f"{src}: line {n}: {why} (skipped)"
        for n, why in [
            (2, "\"prompt\" holds a lone surrogate '\\ud800' at character 0: not valid Unicode text"),
            (3, "invalid JSON (nested too deeply for Python's parser)"),
            (5, "not UTF-8 text (byte 0xe9 at byte 16)"),
            (4, "max_new_tokens=1000000000 " + needs.format(slots=1_000_000_256, size="9566.55 GiB") + ", " + fits),
            (
                7,
                (
                    "max_new_tokens=2147483648 after a prompt of 4 tokens passes the last int32 position 2**31 - 1: "
                    "at most max_new_tokens=2147483643"
                ),
            ),
            (
                8,
                f"max_new_tokens={FIT_SLOTS - 3} "
                + needs.format(slots=FIT_SLOTS + 256, size="65.20 MiB")
                + ", "
                + fits,
            ),
        ]
    ]
    assert err[-1].startswith(f"[wrote 2 results to {dst}; 6 lines skipped; 2 rows in 1 batches;")
    out = [json.loads(ln) for ln in dst.read_text().splitlines()]
    assert [(r["index"], r["line"], r["id"]) for r in out] == [(0, 1, "a"), (5, 6, 7)]
    for r, text in zip(out, ["Lily", "One day\u2028a big bear"]):
        alone = sample(str(STORIES_BIN), text, max_new_tokens=6, tokenizer=str(TOK512_MODEL))
        assert r["token_ids"] == alone.token_ids and r["text"] == alone.text


def test_run_rows_checks_each_row_before_any_allocation(monkeypatch):
    """Without on_error the first row that cannot run raises; with it that row is left out (None) and
    the others decode as they would alone. The largest budget the message offers does fit."""
    monkeypatch.setattr(kv, "device_memory", lambda devices=None: (FREE, "cpu"))
    lm = tiny_loaded(tokenizer=False)
    rows = [
        Row(ids=prompt(7, 1), max_new_tokens=5),
        Row(ids=prompt(3, 2), max_new_tokens=10**9),
        Row(ids=[1, 70_000], max_new_tokens=2),
        Row(ids=prompt(4, 3), max_new_tokens=3),
    ]
    with pytest.raises(
        JaxkvError,
        match=r"^max_new_tokens=1000000000 after a prompt of 3 tokens needs a cache of full "
        r"1000000256, .* at most max_new_tokens=(\d+) fits",
    ):
        run_rows(lm, rows, batch_size=2)
    refused = []
    out = run_rows(lm, rows, batch_size=2, on_error=lambda i, e: refused.append((i, str(e))))
    assert [i for i, _ in refused] == [1, 2] and "token id 70000 is outside the vocabulary" in refused[1][1]
    assert out[1] is None and out[2] is None
    for r, got in zip([rows[0], rows[3]], [out[0], out[3]]):
        assert got.token_ids == generate(lm, [list(r.ids)], max_new_tokens=r.max_new_tokens).token_ids[0]
    fit = int(re.search(r"at most max_new_tokens=(\d+)", refused[0][1]).group(1))
    limits = _RowLimits(lm, None, 2, None)  # the boundary, checked without decoding
    limits.check(Row(ids=prompt(3, 2), max_new_tokens=fit))
    with pytest.raises(JaxkvError, match=f"at most max_new_tokens={fit} fits"):
        limits.check(Row(ids=prompt(3, 2), max_new_tokens=fit + 1))
    assert limits.cache_bytes(3 + fit) <= FREE < limits.cache_bytes(3 + fit + 1)


def test_a_batch_cache_is_sized_by_its_largest_row_not_longest_prompt_plus_largest_budget():
    lm = tiny_loaded(tokenizer=False)
    sizes = []
    rows = [Row(ids=prompt(200, 1), max_new_tokens=1), Row(ids=prompt(1, 2), max_new_tokens=200)]
    out = run_rows(lm, rows, batch_size=2, on_batch=lambda members, gen: sizes.append(gen.cache.spec.max_len))
    assert sizes == [256]  # full_cache_len(201), not full_cache_len(400) = 512
    assert [len(r.token_ids) for r in out] == [1, 200]


def test_no_decodable_row_is_an_error_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "Once upon a time there was a big dog"}) + "\n" + '{"prompt": 1}\n')
    dst = tmp_path / "r.jsonl"
    code = main(["batch", *STORIES, "--input", str(src), "--output", str(dst), "--max-len", "4", "--no-progress"])
    err = capsys.readouterr().err
    assert (
        code == 2 and err.splitlines()[-1] == f"jaxkv: error: {src}: no row could be decoded (1 malformed, 1 skipped)"
    )
    assert "Traceback" not in err and sorted(os.listdir(tmp_path)) == ["p.jsonl"]


def test_output_through_a_symlink_and_onto_devices(tmp_path, capsys):
    """A symlink's target gets the results (the link stays); /dev/null stays a device; /dev/full
    (every write fails: ENOSPC) is one line and exit 2, and stays a device."""
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "Lily"}) + "\n")
    (tmp_path / "target.jsonl").write_text("old\n")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "target.jsonl")
    common = ["batch", *STORIES, "--input", str(src), "--tokens", "3", "--no-progress"]
    assert main([*common, "--output", str(tmp_path / "link.jsonl")]) == 0, capsys.readouterr().err
    assert (tmp_path / "link.jsonl").is_symlink()
    assert [json.loads(ln)["line"] for ln in (tmp_path / "target.jsonl").read_text().splitlines()] == [1]
    assert main([*common, "--output", "/dev/null"]) == 0, capsys.readouterr().err
    assert main([*common, "--output", "/dev/full"]) == 2
    err = capsys.readouterr().err
    assert (
        err.splitlines()[-1] == "jaxkv: error: /dev/full: cannot write the results ([Errno 28] No space left on device)"
    )
    for device in ("/dev/null", "/dev/full"):
        assert stat.S_ISCHR(os.stat(device).st_mode)
    assert sorted(os.listdir(tmp_path)) == ["link.jsonl", "p.jsonl", "target.jsonl"]
