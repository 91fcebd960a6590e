"""Cache specs at the edges (issue 17): sizes beyond int32 or the machine's memory, numpy integers,
conflicting cache flags, KIVI group-size messages that name the flag to change and to what, and
hypothesis properties over random specs (construct consistently or raise JaxkvError; a few
appends through the cache API stay finite and keep the DESIGN §2 retained set)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paths import REPO, STORIES_BIN, TEXT, TOK512_MODEL

from jaxkv import CacheSpec, JaxkvError, KVCache, LayerSpecs
from jaxkv.cache import kv
from jaxkv.cache.attention import attend
from jaxkv.cli import main
from jaxkv.errors import CacheSpecError

STORIES = [str(STORIES_BIN), "--tokenizer", str(TOK512_MODEL)]
TINY = dict(n_layers=1, n_kv_heads=1, head_dim=8)  # fp32: 64 B of keys and values + 4 B of position per slot


def limit_memory(monkeypatch, nbytes: int) -> None:
    """Pretend the default device holds ``nbytes`` (the check reads :func:`jaxkv.cache.kv.device_memory`)."""
    monkeypatch.setattr(kv, "device_memory", lambda devices=None: (nbytes, "cpu"))


# ---- CacheSpec: int32 bounds, numpy integers, conflicts ------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(window=3_000_000_000),
            "CacheSpec.window=3000000000: expected an integer in [1, 2147483648) (positions and slots are int32)",
        ),
        (
            dict(max_len=2**31),
            "CacheSpec.max_len=2147483648: expected an integer in [1, 2147483648) (positions and slots are int32)",
        ),
        (
            dict(sink=3_000_000_000, window=4),
            "CacheSpec.sink=3000000000: expected an integer in [0, 2147483648) (positions and slots are int32)",
        ),
        (
            dict(sink=2**30, window=2**30),
            "CacheSpec: sink=1073741824 + window=1073741824 make 2147483648 slots: expected fewer than 2**31 (positions and slots are int32)",
        ),
        (
            dict(max_len=2**31 - 1, kv_quantize="int4"),
            "CacheSpec: max_len=2147483647 + residual=128 make 2147483648 slots: expected fewer than 2**31 (positions and slots are int32)",
        ),
        (dict(window=4.0), "CacheSpec.window=4.0: expected an integer in [1, 2147483648)"),
        (dict(window=True), "CacheSpec.window=True: expected an integer in [1, 2147483648)"),
        (dict(window="4"), "CacheSpec.window='4': expected an integer in [1, 2147483648)"),
        (dict(max_len=8, group_size=0), "CacheSpec.group_size=0: expected an integer in [1, 2147483648)"),
        (
            dict(max_len=8, kv_quantize=["int4"]),
            "CacheSpec.kv_quantize=['int4']: expected one of fp32, fp16, bf16, int8, int4, int2",
        ),
        (dict(max_len=8, positions=None), "CacheSpec.positions=None: expected one of absolute, cache"),
    ],
)
def test_cache_spec_refuses_sizes_beyond_int32_and_non_integers(kwargs, message):
    with pytest.raises(CacheSpecError) as e:
        CacheSpec(**kwargs)
    assert str(e.value) == message


def test_numpy_integers_are_ints():
    spec = CacheSpec(
        sink=np.int64(4), window=np.int32(64), kv_quantize="int4", group_size=np.int64(8), residual=np.uint16(16)
    )
    plain = CacheSpec(sink=4, window=64, kv_quantize="int4", group_size=8, residual=16)
    assert spec == plain and hash(spec) == hash(plain) and spec.describe() == plain.describe()
    assert [type(getattr(spec, f)) for f in ("sink", "window", "group_size", "residual")] == [int] * 4
    assert CacheSpec(max_len=np.int64(10)).capacity == 10


def test_max_len_with_window_and_sinks_beyond_the_window_warn():
    with pytest.warns(UserWarning) as record:
        spec = CacheSpec(max_len=100, window=8)
        CacheSpec(sink=16, window=8)
    assert [str(w.message) for w in record] == [
        "CacheSpec(max_len=100, window=8): a StreamingLLM cache (window set) has no max_len, so max_len is ignored: pass one of them",
        "CacheSpec(sink=16, window=8): more sinks than window tokens; StreamingLLM keeps a few sinks (e.g. 4) before a much larger window",
    ]
    assert spec.capacity == 8 and spec.token_limit is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(window=256, kv_quantize="int8", group_size=7),
            "CacheSpec.residual=128 is not a multiple of group_size=7: use a group_size that divides 128 (e.g. 2, 4, 8, 16, 32, 64) "
            "or a residual that is a multiple of 7 (e.g. 126 or 133)",
        ),
        (
            dict(sink=4, window=252, kv_quantize="int8"),
            "CacheSpec.window=252 is not a multiple of group_size=32: the quantised window evicts whole groups; use window=224 or 256",
        ),
        (
            dict(window=60, kv_quantize="int4"),
            "CacheSpec.window=60 is not a multiple of group_size=32: the quantised window evicts whole groups; use window=128, "
            "the smallest that holds residual=128",
        ),
        (
            dict(window=64, kv_quantize="int2"),
            "CacheSpec.residual=128 is larger than window=64: a flush of the residual must fit in the window; use window=128 or more, "
            "or residual=64 or less",
        ),
    ],
)
def test_group_size_messages_give_the_nearest_valid_values(kwargs, message):
    with pytest.raises(CacheSpecError) as e:
        CacheSpec(**kwargs)
    assert str(e.value) == message


# ---- the cache against the machine's memory ---------------------------------------------------------
def test_cache_bytes_are_the_leaves_bytes():
    for spec in (
        CacheSpec(sink=4, window=60),
        CacheSpec(sink=2, window=16, kv_quantize="int4", group_size=4, residual=8),
        CacheSpec(max_len=33, kv_quantize="int2", group_size=4, residual=8),
    ):
        cache = KVCache.create(spec, batch=2, n_layers=2, n_kv_heads=2, head_dim=8)
        assert kv.cache_bytes(spec, batch=2, n_layers=2, n_kv_heads=2, head_dim=8) == sum(
            x.nbytes for x in jax.tree.leaves(cache)
        )


def test_a_cache_beyond_the_machine_memory_is_refused_up_front():
    """No patching: 2**31 - 1 slots of 64 layers are terabytes, more than this machine holds."""
    with pytest.raises(
        CacheSpecError,
        match=r"^a KV cache of \d+\.\d\d GiB \(sink 0 \+ window 2147483647, fp32, positions=absolute; "
        r"batch 1, 64 layers, 8 KV heads, head dim 64\) is more than the .* of memory of cpu: "
        r"the most that fits is window=\d+$",
    ):
        KVCache.create(CacheSpec(window=2**31 - 1), batch=1, n_layers=64, n_kv_heads=8, head_dim=64)


@pytest.mark.parametrize(
    "spec, batch, memory, fits, largest",
    [
        # fp32: 68 W + 4 bytes for a window of W; the largest window in 68 * 1000 + 4 bytes is 1000
        (CacheSpec(window=10**6), 1, 68 * 1000 + 4, "window=1000", dict(window=1000)),
        # int8, G=4, R=8: 32 W + 548 bytes; whole groups of 4: 1000, not 1002
        (
            CacheSpec(window=10**6, kv_quantize="int8", group_size=4, residual=8),
            1,
            32 * 1002 + 548,
            "window=1000",
            dict(window=1000),
        ),
        (CacheSpec(max_len=10**6), 1, 68 * 1000 + 4, "max_len=1000", dict(max_len=1000)),
        # 4 rows: 4 * (68 W + 4) <= 136008 for W <= 499; at W = 10**6 not one row fits
        (CacheSpec(window=10**6), 4, 136008, "window=499", dict(window=499)),
        # 1000 rows of a window of 100 (6804 bytes each): no window fits 68004 bytes, 9 rows do
        (CacheSpec(window=100), 1000, 68004, "batch=9 at this size", dict(batch=9)),
    ],
)
def test_the_refusal_says_what_would_fit(monkeypatch, spec, batch, memory, fits, largest):
    limit_memory(monkeypatch, memory)
    with pytest.raises(CacheSpecError) as e:
        KVCache.create(spec, batch=batch, **TINY)
    assert str(e.value).endswith(f"of memory of cpu: the most that fits is {fits}"), str(e.value)
    assert str(e.value).startswith(
        "a KV cache of "
    ) and f"({spec.describe()}; batch {batch}, 1 layers, 1 KV heads, head dim 8)" in str(e.value)
    field, n = next(iter(largest.items()))
    unit = spec.group_size if spec.quantized else 1
    ok = dict(batch=batch, **TINY) | ({"batch": n} if field == "batch" else {})
    bigger = dict(ok) | ({"batch": n + 1} if field == "batch" else {})
    fitting = spec if field == "batch" else dataclasses.replace(spec, **{field: n})
    over = spec if field == "batch" else dataclasses.replace(spec, **{field: n + unit})
    assert kv.cache_bytes(fitting, **ok) <= memory < kv.cache_bytes(over, **bigger)
    KVCache.create(fitting, **ok)  # the suggestion is accepted


def test_layered_and_mesh_caches_are_checked_too(monkeypatch):
    from jaxkv.decode import parallel

    limit_memory(monkeypatch, 10_000)
    local = CacheSpec(window=4).local(4)
    with pytest.raises(CacheSpecError, match=r"the most that fits is window=\d+$"):
        KVCache.create(LayerSpecs((CacheSpec(window=10**5), local)), batch=1, n_layers=2, n_kv_heads=1, head_dim=8)
    with pytest.raises(CacheSpecError, match=r"the most that fits is window=\d+$"):
        parallel.create_cache(CacheSpec(window=10**5), parallel.make_mesh(data=1), batch=1, **TINY)
    # only a model's local layers (no window of the user's to shrink): 276 bytes a row, 18 rows in 5000
    limit_memory(monkeypatch, 5000)
    with pytest.raises(
        CacheSpecError,
        match=r"is more than the 4.88 KiB of memory of cpu: the most that fits is batch=18 at this size$",
    ):
        KVCache.create(local, batch=200, **TINY)


def test_kvcache_create_sizes():
    with pytest.raises(JaxkvError, match=r"^KVCache.create: batch=0: expected an integer in \[1, 2147483648\)$"):
        KVCache.create(CacheSpec(window=4), batch=0, **TINY)
    assert KVCache.create(CacheSpec(window=4), batch=np.int64(2), **TINY).batch == 2


# ---- the command line ----------------------------------------------------------------------------
def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code, err, message):
    assert code == 2 and err == f"jaxkv: error: {message}\n", err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokens", "3000000000"], "--tokens 3000000000: expected an integer in [1, 2147483648)"),
        (
            ["--max-len", "3000000000"],
            "--max-len 3000000000: expected an integer in [1, 2147483648) (positions and slots are int32)",
        ),
        (
            ["--streaming-llm-window", "3000000000"],
            "--streaming-llm-window 3000000000: expected an integer in [1, 2147483648) (positions and slots are int32)",
        ),
        (
            ["--streaming-llm-sink", "3000000000", "--streaming-llm-window", "3000000000"],
            "--streaming-llm-sink 3000000000: expected an integer in [0, 2147483648) (positions and slots are int32)",
        ),
        (
            ["--streaming-llm-sink", "1073741824", "--streaming-llm-window", "1073741824"],
            "--streaming-llm-sink 1073741824 + --streaming-llm-window 1073741824 make 2147483648 slots: expected fewer than 2**31 "
            "(positions and slots are int32)",
        ),
        (
            ["--kv-quantize", "int8", "--kv-group-size", "7", "--streaming-llm-window", "252"],
            "--kv-residual 128 (default) is not a multiple of --kv-group-size 7: use a --kv-group-size that divides 128 "
            "(e.g. 2, 4, 8, 16, 32, 64) or a --kv-residual that is a multiple of 7 (e.g. 126 or 133)",
        ),
        (
            ["--kv-quantize", "int4", "--streaming-llm-window", "60"],
            "--streaming-llm-window 60 is not a multiple of --kv-group-size 32 (default): the quantised window evicts whole groups; "
            "use --streaming-llm-window 128, the smallest that holds --kv-residual 128 (default)",
        ),
        (
            ["--kv-quantize", "int4", "--streaming-llm-window", "64", "--kv-residual", "128"],
            "--kv-residual 128 is larger than --streaming-llm-window 64: a flush of the residual must fit in the window; "
            "use --streaming-llm-window 128 or more, or --kv-residual 64 or less",
        ),
        (
            ["--max-len", "64", "--streaming-llm-window", "32"],
            "--max-len 64 with --streaming-llm-window 32: a StreamingLLM cache holds --streaming-llm-sink + --streaming-llm-window "
            "tokens and has no --max-len; pass one of them",
        ),
        (
            ["--kv-group-size", "8"],
            "--kv-group-size 8 is for a KIVI cache: it needs --kv-quantize int8|int4|int2 (the cache is fp32)",
        ),
        (
            ["--kv-quantize", "fp16", "--kv-residual", "64"],
            "--kv-residual 64 is for a KIVI cache: it needs --kv-quantize int8|int4|int2 (the cache is fp16)",
        ),
        (
            ["--streaming-llm-sink", "64", "--streaming-llm-window", "4"],
            "--streaming-llm-sink 64 is larger than --streaming-llm-window 4: StreamingLLM keeps a few sinks (e.g. 4) before a much "
            "larger window (swapped?)",
        ),
    ],
)
def test_sample_cache_flags_one_line_in_flag_names(capsys, argv, message):
    code, out, err = run_cli(capsys, "sample", *STORIES, "--prompt", "Once", *argv)
    assert_one_line(code, err, message)
    assert out == ""


def test_memory_refusal_in_flag_names(capsys, monkeypatch):
    # stories260K: 5 layers x 4 KV heads x head dim 8, fp32: 1284 bytes per slot, 4 of length
    limit_memory(monkeypatch, 1284 * (4 + 1000) + 4)
    code, _, err = run_cli(
        capsys, "sample", *STORIES, "--prompt", "Once", "--streaming-llm-sink", "4", "--streaming-llm-window", "1000000"
    )
    assert_one_line(
        code,
        err,
        "a KV cache of 1.20 GiB (sink 4 + window 1000000, fp32, positions=absolute; batch 1, 5 layers, "
        "4 KV heads, head dim 8) is more than the 1.23 MiB of memory of cpu: the most that fits is "
        "--streaming-llm-window 1000",
    )
    code, _, err = run_cli(capsys, "sample", *STORIES, "--prompt", "Once", "--tokens", "1000000")
    assert_one_line(
        code,
        err,
        "a KV cache of 1.20 GiB (full 1000192, fp32, positions=absolute; batch 1, 5 layers, 4 KV heads, "
        "head dim 8) is more than the 1.23 MiB of memory of cpu: the most that fits is --max-len 1004 "
        "(the full cache holds the prompt and every generated token: fewer --tokens, or bound it with "
        "--streaming-llm-window M)",
    )


def test_chat_ppl_batch_refuse_the_same_flags_and_write_nothing(capsys, tmp_path):
    cache_file, nll, output = tmp_path / "chat.safetensors", tmp_path / "nll.txt", tmp_path / "out.jsonl"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once"}\n')
    code, out, err = run_cli(
        capsys,
        "chat",
        *STORIES,
        "--chat-template",
        "{{ messages[0].content }}",
        "--cache-file",
        str(cache_file),
        "--kv-group-size",
        "8",
    )
    assert_one_line(
        code, err, "--kv-group-size 8 is for a KIVI cache: it needs --kv-quantize int8|int4|int2 (the cache is fp32)"
    )
    code, out, err = run_cli(
        capsys, "ppl", *STORIES, "--text", str(TEXT), "--nll-out", str(nll), "--streaming-llm-window", "3000000000"
    )
    assert_one_line(
        code,
        err,
        "--streaming-llm-window 3000000000: expected an integer in [1, 2147483648) (positions and slots are int32)",
    )
    code, out, err = run_cli(
        capsys,
        "batch",
        *STORIES,
        "--input",
        str(prompts),
        "--output",
        str(output),
        "--max-len",
        "64",
        "--streaming-llm-window",
        "32",
    )
    assert (
        code == 2
        and err.startswith("jaxkv: error: --max-len 64 with --streaming-llm-window 32: ")
        and err.count("\n") == 1
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"] and prompts.read_text() == '{"prompt": "Once"}\n'


@pytest.mark.jax_independent
def test_huge_tokens_through_the_console_script():
    """The issue's report: ``--tokens 1000000000`` (a full cache sized for it) was RESOURCE_EXHAUSTED."""
    proc = subprocess.run(
        [sys.executable, "-m", "jaxkv.cli", "sample", *STORIES, "--prompt", "Once", "--tokens", "1000000000"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(
        "jaxkv: error: a KV cache of 1195.82 GiB (full 1000000256, fp32, positions=absolute; batch 1, "
        "5 layers, 4 KV heads, head dim 8) is more than the "
    )
    assert " of memory of cpu: the most that fits is --max-len " in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_readme_window_with_int8_is_rounded_with_a_note(capsys):
    """README: ``--streaming-llm-sink 4 --streaming-llm-window 252``; adding ``--kv-quantize int8`` (G=32) rounds to 224."""
    code, out, err = run_cli(
        capsys,
        "sample",
        *STORIES,
        "--prompt",
        "Once upon a time",
        "--tokens",
        "8",
        "--streaming-llm-sink",
        "4",
        "--streaming-llm-window",
        "252",
        "--positions",
        "cache",
        "--kv-quantize",
        "int8",
    )
    lines = err.splitlines()
    assert code == 0 and len(out) > 8 and len(lines) == 2, err
    assert lines[0] == (
        "jaxkv: note: --streaming-llm-window 252 rounded down to 224, a multiple of --kv-group-size 32 (default): "
        "the quantised window evicts whole groups"
    )
    assert (
        lines[1].startswith("[8 tokens, length;") and "codes 70.00 KiB" in lines[1]
    )  # 5 layers x 4 heads x 224 x 8 x 2 bytes


def test_flag_defaults_resolve_to_the_spec_defaults(capsys):
    from jaxkv.cli import build_parser, cache_spec_from_args

    args = build_parser().parse_args(["sample", "--kv-quantize", "int4", "--streaming-llm-window", "256"])
    assert (args.kv_group_size, args.kv_residual) == (None, None)
    assert cache_spec_from_args(args) == CacheSpec(window=256, kv_quantize="int4", group_size=32, residual=128)
    with pytest.raises(SystemExit):
        main(["sample", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "KIVI tokens per per-channel key group (default: 32)" in shown and "a multiple of G (default: 128)" in shown


# ---- hypothesis properties -----------------------------------------------------------------------
def sizes(minimum):
    """Valid and invalid values of a size field: small ints, numpy ints, huge ints, and wrong types."""
    return st.one_of(
        st.integers(minimum - 2, 300),
        st.integers(minimum, 300).map(np.int64),
        st.integers(2**31 - 300, 2**31 + 300),
        st.integers(-(2**70), 2**70),
        st.sampled_from([True, False, 4.0, float("nan"), "8", None, [4], np.float32(8), np.array(4)]),
    )


SPEC_FIELDS = dict(
    max_len=sizes(1),
    sink=sizes(0),
    window=sizes(1),
    group_size=sizes(1),
    residual=sizes(1),
    kv_quantize=st.sampled_from(["fp32", "fp16", "bf16", "int8", "int4", "int2", "int3", "", None, 4, b"int4"]),
    positions=st.sampled_from(["absolute", "cache", "rank", None]),
    scale_dtype=st.sampled_from(["float16", "float32", "bfloat16"]),
    attention_window=st.one_of(st.none(), sizes(1)),
)


@settings(max_examples=300, deadline=None, database=None)
@given(st.fixed_dictionaries({}, optional=SPEC_FIELDS))
def test_any_spec_constructs_consistently_or_raises_jaxkv_error(kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            spec = CacheSpec(**kwargs)
        except JaxkvError as e:
            assert isinstance(e, CacheSpecError) and str(e).startswith("CacheSpec") and "\n" not in str(e)
            return
        again = CacheSpec(**{f: getattr(spec, f) for f in kwargs})
    fields = ("sink", "group_size", "residual") + tuple(
        f for f in ("max_len", "window", "attention_window") if getattr(spec, f) is not None
    )
    assert all(type(getattr(spec, f)) is int for f in fields)
    assert spec == again and hash(spec) == hash(again)
    assert spec.capacity == spec.n_sink + spec.n_ring + spec.n_quant < 2**31
    assert spec.bounded == (spec.window is not None) and spec.n_sink == spec.sink
    if spec.quantized:
        assert (
            spec.n_quant % spec.group_size == 0
            and spec.n_ring == spec.residual
            and spec.residual % spec.group_size == 0
        )
        if spec.bounded:
            assert spec.n_quant == spec.window >= spec.residual
    else:
        assert spec.n_quant == 0 and spec.n_ring == (spec.window if spec.bounded else spec.max_len)
    assert spec.token_limit == (None if spec.bounded else spec.max_len)
    assert 1 <= spec.max_chunk <= spec.capacity


def expected_positions(spec: CacheSpec, t: int) -> list:
    """The positions a cache holds after ``t`` appended tokens (DESIGN §2): sinks, then the window,
    under KIVI the last W flushed tokens (the residual flushes lazily, R at a time) plus the residual."""
    if not spec.bounded:
        return list(range(min(t, spec.max_len)))
    sinks, u = list(range(min(spec.sink, t))), max(t - spec.sink, 0)
    if not spec.quantized:
        return sinks + list(range(spec.sink + max(u - spec.window, 0), t))
    flushed = spec.residual * ((u - 1) // spec.residual) if u else 0
    return sinks + list(range(spec.sink + flushed - min(spec.window, flushed), t))


@st.composite
def small_specs(draw):
    mode = draw(st.sampled_from(["fp32", "bf16", "int8", "int4", "int2"]))
    g = draw(st.sampled_from([1, 2, 4]))
    r = g * draw(st.integers(1, 2))
    window = (
        None
        if draw(st.booleans())
        else r + g * draw(st.integers(0, 2))
        if mode.startswith("int")
        else draw(st.integers(1, 6))
    )
    return CacheSpec(
        max_len=draw(st.integers(1, 12)) if window is None else None,
        window=window,
        sink=draw(st.integers(0, min(2, window))) if window else 0,
        kv_quantize=mode,
        group_size=g,
        residual=r,
        positions=draw(st.sampled_from(["absolute", "cache"])),
    )


@jax.jit
def append_one(cache, q, k, v):
    """One token through the cache API (begin, attend on its one layer, commit): the attention output and the cache."""
    cache, step = cache.begin(jnp.ones((cache.batch,), jnp.int32), 1)
    out, ks, vs = attend(step, jax.tree.map(lambda x: x[0], cache.layers()), q, k, v, theta=10000.0)
    return out, cache.commit(step, ks[None], vs[None])


@settings(max_examples=8, deadline=None, database=None)
@given(small_specs(), st.integers(1, 14))
def test_small_specs_append_tokens_without_nan(spec, tokens):
    tokens = min(tokens, spec.token_limit or tokens)  # a full cache admits no more
    cache = KVCache.create(spec, batch=1, **TINY)
    rng = np.random.default_rng(tokens)
    for _ in range(tokens):
        out, cache = append_one(cache, *(jnp.asarray(rng.standard_normal((1, 1, 1, 8)), jnp.float32) for _ in range(3)))
        assert np.all(np.isfinite(np.asarray(out)))
    held = sorted(int(p) for p in np.concatenate([np.asarray(pos[0]) for pos in cache.positions()]) if p >= 0)
    assert held == expected_positions(spec, tokens) and int(cache.stored()[0]) == len(held)
