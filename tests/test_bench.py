"""``jaxkv bench``: one small synthetic run checked value by value; bad input gives one line and exit code 2."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from paths import REPO

from jaxkv import CacheSpec, JaxkvError, KVCache, LlamaConfig, memory_report
from jaxkv.cli import main
from jaxkv.models.llama import weight_shapes

pytestmark = pytest.mark.jax_independent  # jaxkv bench's command line and report

SYNTHETIC = "synthetic:L=1,D=64,N=2,K=1,F=128,V=256"
CONFIG = LlamaConfig(n_layers=1, dim=64, n_heads=2, n_kv_heads=1, head_dim=32, hidden_dim=128, vocab_size=256)
PROMPT, LENGTHS = 8, (64, 128)
SPECS = {  # the modes of the run, built by hand: full = prompt + longest length slots; KIVI G=32, R=32
    "full": CacheSpec(max_len=PROMPT + max(LENGTHS)),
    "sink2+30": CacheSpec(sink=2, window=30),
    "sink2+32:int4": CacheSpec(sink=2, window=32, kv_quantize="int4", group_size=32, residual=32),
}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """Exit code, stdout and JSON of one ``jaxkv bench`` run: 3 modes, 2 lengths, 2 repeats."""
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        code = main(
            [
                "bench",
                SYNTHETIC,
                "--modes",
                ",".join(SPECS),
                "--lengths",
                ",".join(map(str, LENGTHS)),
                "--block",
                "16",
                "--repeat",
                "2",
                "--prompt-tokens",
                str(PROMPT),
                "--json",
                str(path),
            ]
        )
    return code, stdout.getvalue(), json.loads(path.read_text())


def test_bench_medians_over_repeats(bench):
    code, _, results = bench
    assert code == 0
    assert results["model"] == SYNTHETIC and results["repeat"] == 2 and results["bandwidth_gbs"] > 0
    assert [r["mode"] for r in results["runs"]] == list(SPECS)
    for run in results["runs"]:
        assert [row["length"] for row in run["rows"]] == list(LENGTHS)
        for row in run["rows"]:
            repeats = row["decode_ms_per_token_repeats"]
            assert len(repeats) == 2 and all(ms > 0 for ms in repeats)
            assert row["decode_ms_per_token"] == float(np.median(repeats))
            assert row["decode_tokens_per_s"] == 1000 / row["decode_ms_per_token"]
        assert len(run["prefill_tokens_per_s_repeats"]) == 2
        assert run["prefill_tokens_per_s"] == float(np.median(run["prefill_tokens_per_s_repeats"]))
        assert run["compile_s"] > 0  # from the first repeat (later ones find the programs compiled)
        assert run["curve"]["ends"] == list(range(16, max(LENGTHS) + 1, 16))


def test_bench_cache_bytes_match_memory_report(bench):
    _, _, results = bench
    # 8 + 128 - 1 = 135 tokens appended (the last sampled one is not); int4: 2 sinks, then 133 = 4 flushed
    # groups of 32 (the window keeps the last) + 5 in the residual
    stored = {"full": 135, "sink2+30": 32, "sink2+32:int4": 2 + 32 + 5}
    for run in results["runs"]:
        spec = SPECS[run["mode"]]
        fresh = KVCache.create(
            spec, batch=1, n_layers=CONFIG.n_layers, n_kv_heads=CONFIG.n_kv_heads, head_dim=CONFIG.head_dim
        )
        assert run["cache"] == spec.describe()
        assert run["cache_bytes_allocated"] == memory_report(fresh).allocated_bytes
        assert run["tokens_stored"] == stored[run["mode"]]
    sink = results["runs"][1]  # 135 tokens through 32 fp32 slots: every slot is live
    assert [row["cache_bytes_live"] for row in sink["rows"]] == [sink["cache_bytes_allocated"]] * 2


def test_bench_roofline_from_recorded_bytes(bench):
    _, _, results = bench
    weight_bytes = 4 * sum(math.prod(shape) for shape in weight_shapes(CONFIG).values())
    for run in results["runs"]:
        assert run["weight_bytes"] == weight_bytes
        for row in run["rows"]:
            roofline = (weight_bytes + row["cache_bytes_live"]) / (results["bandwidth_gbs"] * 1e9) * 1e3
            assert row["roofline_ms_per_token"] == pytest.approx(roofline, rel=1e-12)
    full = results["runs"][0]["rows"]  # a full cache holds prompt + n tokens at length n
    assert full[0]["cache_bytes_live"] < full[1]["cache_bytes_live"] == results["runs"][0]["cache_bytes_live"]


def test_bench_table_one_line_per_mode_and_length(bench):
    _, out, results = bench
    lines = out.splitlines()
    assert lines[0].startswith(f"# {SYNTHETIC} on cpu") and "2 repeat(s)" in lines[0]
    rows = [line for line in lines[3:] if line.startswith("| ")]
    assert len(rows) == len(lines) - 3 == len(SPECS) * len(LENGTHS)
    expected = [(run["cache"], row) for run in results["runs"] for row in run["rows"]]
    for line, (cache, row) in zip(rows, expected):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        repeats = row["decode_ms_per_token_repeats"]
        assert cells[:4] == [
            cache,
            str(row["length"]),
            f"{row['decode_ms_per_token']:.3f}",
            f"{min(repeats):.3f}-{max(repeats):.3f}",
        ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--modes", "full,foo"], "cache mode 'foo'"),
        (["--modes", "sink4"], "cache mode 'sink4'"),
        (["--modes", "sink4+x"], "cache mode 'sink4+x'"),
        (["--modes", "full:int3"], "cache mode 'full:int3'"),
        (
            ["--modes", "sink4+60:int4"],
            "cache mode 'sink4+60:int4': CacheSpec.window=60 is not a multiple of group_size=32",
        ),
        (["--lengths", "64,x"], "--lengths '64,x'"),
        (["--lengths", "0"], "length 0"),
        (["--lengths", "32,256"], "length 32 is shorter than one decode block (64 tokens)"),
        (["--json", "/no/such/dir/out.json"], "--json /no/such/dir/out.json: no such folder /no/such/dir"),
        (["--plot", "/no/such/dir/out.png"], "--plot /no/such/dir/out.png: no such folder /no/such/dir"),
        (["--repeat", "0"], "repeat 0"),
        (["--prompt-tokens", "0"], "prompt tokens 0"),
        (["synthetic:L=1,D=64,N=2,K=1,F=128,X=3"], "unknown key 'X'"),
        (["synthetic:L=1,D=64,N=2,K=1,F=128"], "missing V"),
        (["synthetic:L=1,D=64,N=2,K=1,F=128,V=big"], "V='big' is not an integer"),
        (["synthetic:L=1,D=64,N=3,K=1,F=128,V=256"], "D=64 is not divisible by N=3"),
        (["synthetic:L=1,D=64,N=2,K=1,F=128,V=3"], "V=3 is too small"),
        (["synthetic:L=1,D=64,N=4,K=3,F=128,V=256"], "n_heads=4 is not a multiple of n_kv_heads=3"),
        (["preset:nope"], "no config preset 'nope'"),
    ],
)
def test_bench_bad_input_one_line_exit_2(capsys, argv, message):
    model = [] if argv[0].startswith(("synthetic:", "preset:")) else [SYNTHETIC]
    code = main(["bench", *model, *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("jaxkv: error: ") and message in err, err


def test_script_is_the_subcommand():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_decode.py"), SYNTHETIC, "--modes", "sink4"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2 and proc.stderr.startswith("jaxkv: error: cache mode 'sink4'"), proc.stderr


def test_mode_with_separate_key_and_value_storage():
    """``:K/V`` stores keys as K and values as V (KIVI's G=R=32 when either is int*)."""
    from jaxkv.eval.bench import parse_mode

    spec = parse_mode("sink4+256:int2/fp16", 64)
    assert spec == CacheSpec(sink=4, window=256, k_quantize="int2", v_quantize="fp16", group_size=32, residual=32)
    assert parse_mode("full:int4/int4", 64) == CacheSpec(max_len=64, kv_quantize="int4", group_size=32, residual=32)
    with pytest.raises(JaxkvError, match=r"cache mode 'full:int4/int3': expected full or sinkS\+W"):
        parse_mode("full:int4/int3", 64)


def test_mode_with_storage_options():
    """``+pre-rope`` and ``+hadamard-SIDES`` after the storage (issue 15's levers, as the audit spells them)."""
    from jaxkv.eval.bench import parse_mode

    spec = parse_mode("sink4+256:int4/int2+pre-rope+hadamard-values", 64)
    assert spec == CacheSpec(
        sink=4,
        window=256,
        k_quantize="int4",
        v_quantize="int2",
        group_size=32,
        residual=32,
        pre_rope_keys=True,
        hadamard="values",
    )
    assert parse_mode("full:int2+hadamard-both", 64).storage.rotate_keys
    with pytest.raises(
        JaxkvError,
        match="cache mode 'full:int2\\+rotate': storage option 'rotate': expected one of "
        "pre-rope, hadamard-keys, hadamard-values, hadamard-both",
    ):
        parse_mode("full:int2+rotate", 64)
    with pytest.raises(
        JaxkvError, match="cache mode 'full:fp16\\+hadamard-values': CacheSpec.hadamard='values' rotates"
    ):
        parse_mode("full:fp16+hadamard-values", 64)
