"""The command line a user of llama.cpp or mlx-lm expects: --version, defaults in --help, the
subcommand's usage for a bad flag, the prompt from stdin or a file, --stop, --ignore-eos,
--verbose, fresh and repeatable seeds, top-k/top-p ignored at temperature 0 (warned), Ctrl-C
keeping what was generated; and the docs' promises (BATCH.md's Python runs as written, a
config that is not hashable is refused by name)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import io
import os
import re
import select
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from paths import DATA, REPO, STORIES_BIN, TOK512_MODEL

import jaxkv
from jaxkv import CacheSpec, JaxkvError, LoadedModel, generate, sample
from jaxkv.cli import _parsers, main
from jaxkv.models.llama import Llama
from jaxkv.testing import numpy_weights

pytestmark = pytest.mark.jax_independent  # command-line text and behaviour

STORIES = [str(STORIES_BIN), "--tokenizer", str(TOK512_MODEL)]
PROMPT = "Once upon a time"
PERIOD = 426  # tok512's "."


def cli(capsys, *argv):
    """``jaxkv ARGV`` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse: --version, --help, bad flags
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(code, err, message):
    assert code == 2 and err.startswith("jaxkv: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err


def streamed(model, prompt, **kwargs):
    """(Generation, the text its on_text received) of :func:`jaxkv.sample`."""
    pieces = []
    out = sample(model, prompt, on_text=pieces.append, **kwargs)
    return out, "".join(pieces)


# ---------------------------------------------------------------- --version, --help, usage


def test_version_is_the_package_metadata(capsys):
    assert jaxkv.__version__ == importlib.metadata.version("jaxkv")
    code, out, _ = cli(capsys, "--version")
    assert code == 0 and out == f"jaxkv {jaxkv.__version__}\n"


def test_help_of_every_subcommand_shows_every_default():
    """Every option taking a value says its default: argparse's own (``%(default)s``, never
    shown as None) or in words; flags (``--chat``) are off unless given."""
    _, commands = _parsers()
    assert sorted(commands) == ["batch", "bench", "chat", "eval", "info", "ppl", "sample", "serve"]
    checked = 0
    for name, sub in commands.items():
        text = re.sub(r"\s+", " ", sub.format_help())  # expands every %(default)s
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or action.nargs == 0 or action.required:
                continue
            shown = action.option_strings[-1] if action.option_strings else action.dest
            assert action.help and "(default: " in action.help, f"jaxkv {name} {shown}: no default in {action.help!r}"
            if "%(default)s" in action.help:
                assert action.default is not None, f"jaxkv {name} {shown}: the help would say 'default: None'"
            checked += 1
        assert "(default: None)" not in text, name
    assert checked > 50
    sample_help = re.sub(r"\s+", " ", commands["sample"].format_help())
    assert "--tokens N tokens to generate at most (default: 128)" in sample_help
    assert "--kv-group-size G KIVI tokens per per-channel key group (default: 32)" in sample_help
    chat_help = re.sub(r"\s+", " ", commands["chat"].format_help())
    assert "--tokens N tokens per reply at most (default: 256)" in chat_help
    assert "(default: cache, or the resumed file's)" in chat_help


@pytest.mark.parametrize(
    "argv",
    [
        ["sample"],
        ["chat"],
        ["ppl", "--text", "t.txt"],
        ["batch", "--input", "i", "--output", "o"],
        ["bench"],
        ["info"],
        ["eval", "passkey"],
        ["serve"],
    ],
    ids=lambda a: a[0],
)
def test_an_unknown_flag_prints_the_subcommand_usage(capsys, argv):
    code, out, err = cli(capsys, *argv, "--bogus=7", "--tokens-per-second")
    lines = err.splitlines()
    assert code == 2 and out == ""
    assert lines[0].startswith(f"usage: jaxkv {argv[0]} [-h]"), err
    assert lines[-1] == f"jaxkv {argv[0]}: error: unrecognized arguments: --bogus=7 --tokens-per-second", err
    assert "Traceback" not in err and "{sample,chat,ppl,eval,batch,bench,info}" not in err  # not the top-level usage


# ---------------------------------------------------------------- the prompt: text, stdin, file


def test_prompt_from_stdin_or_a_file_equals_the_prompt_flag(capsys, monkeypatch, tmp_path):
    argv = ["sample", *STORIES, "--tokens", "12"]
    code, expected, _ = cli(capsys, *argv, "--prompt", PROMPT)
    assert code == 0 and expected.startswith(", there was")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(f"{PROMPT}\n".encode())))
    assert cli(capsys, *argv, "--prompt", "-")[:2] == (0, expected)  # one trailing newline dropped
    path = tmp_path / "prompt.txt"
    path.write_bytes(f"{PROMPT}\r\n".encode())
    assert cli(capsys, *argv, "--prompt-file", str(path))[:2] == (0, expected)
    path.write_bytes(f"{PROMPT}\n\n".encode())  # only one newline is dropped: the prompt differs
    code, out, _ = cli(capsys, *argv, "--prompt-file", str(path))
    assert code == 0 and out != expected


@pytest.mark.parametrize("case", ["both", "missing", "directory", "not utf-8", "stdin not utf-8", "argv not utf-8"])
def test_bad_prompt_sources_one_line_before_loading(capsys, monkeypatch, tmp_path, case):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9\n")
    argv, message = {
        "both": (
            ["--prompt", "hi", "--prompt-file", str(bad)],
            f"--prompt and --prompt-file {bad}: give one of the two",
        ),
        "missing": (
            ["--prompt-file", str(tmp_path / "nope.txt")],
            f"--prompt-file {tmp_path / 'nope.txt'}: no such file",
        ),
        "directory": (["--prompt-file", str(tmp_path)], f"--prompt-file {tmp_path}: cannot read it as UTF-8 text"),
        "not utf-8": (
            ["--prompt-file", str(bad)],
            f"--prompt-file {bad}: cannot read it as UTF-8 text ('utf-8' codec can't decode",
        ),
        "stdin not utf-8": (["--prompt", "-"], "--prompt - (stdin): cannot read it as UTF-8 text"),
        "argv not utf-8": (
            ["--prompt", "caf\udce9"],
            "--prompt 'caf\\udce9': not UTF-8 text (at character 3)",
        ),  # b"caf\xe9"
    }[case]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfe")))
    # the model does not exist: the prompt is checked first
    one_error_line(*cli(capsys, "sample", str(tmp_path / "no-model.gguf"), *argv)[::2], message)
    assert bad.read_bytes() == b"caf\xe9\n"


def test_verbose_echoes_the_prompt_before_the_generated_text(capsys, stories):
    _, text = streamed(stories, PROMPT, max_new_tokens=12)
    code, out, err = cli(capsys, "sample", *STORIES, "--tokens", "12", "--prompt", PROMPT, "--verbose")
    assert code == 0 and out == PROMPT + text + "\n"
    n = len(stories.tokenizer.encode(PROMPT))
    assert err.splitlines()[0] == (
        f"[jaxkv sample: stories260K.bin; prompt {n} tokens; cache full 256, fp32, positions=absolute; "
        "Sampler(temperature=0.0, top_k=None, top_p=None)]"
    )


# ---------------------------------------------------------------- --stop


def test_stop_strings_end_generation_and_are_not_returned_or_printed(stories):
    full, full_text = streamed(stories, PROMPT, max_new_tokens=60)
    assert full.finish_reason == "length" and full_text == full.text
    early, late = full.text[40:46], full.text[70:78]  # 'e love', ' park. O'
    assert full.text.find(early) == 40 and full.text.find(late) == 70
    for block in (1, 4, 32):  # a stop string inside one block or across blocks
        out, text = streamed(stories, PROMPT, max_new_tokens=60, stop=[late, early], block=block)
        assert out.finish_reason == "stop" and out.text == text == full.text[:40], (block, text)
        assert out.token_ids == full.token_ids[: len(out.token_ids)]
        decode = stories.tokenizer.decode
        assert early in decode(out.token_ids) and early not in decode(
            out.token_ids[:-1]
        )  # ends at the completing token
    assert streamed(stories, PROMPT, max_new_tokens=60, stop=late)[0].text == full.text[:70]


def test_text_held_back_for_a_stop_string_that_never_completes_is_printed(stories):
    full, _ = streamed(stories, PROMPT, max_new_tokens=60)
    never = full.text[-6:] + "\x00"  # the text ends with all but its last character
    out, text = streamed(stories, PROMPT, max_new_tokens=60, stop=never, block=4)
    assert out.finish_reason == "length" and out.text == text == full.text
    for bad in ("", ["ok", ""], [3]):
        with pytest.raises(JaxkvError, match="expected a non-empty string"):
            sample(stories, PROMPT, max_new_tokens=4, stop=bad)


def test_cli_stop_prints_the_text_before_it(capsys, stories):
    full, _ = streamed(stories, PROMPT, max_new_tokens=60)
    code, out, err = cli(
        capsys,
        "sample",
        *STORIES,
        "--prompt",
        PROMPT,
        "--tokens",
        "60",
        "--stop",
        full.text[70:78],
        "--stop",
        full.text[40:46],
    )
    assert code == 0 and out == full.text[:40] + "\n"
    assert re.match(r"\[\d+ tokens, stop; ", err.splitlines()[-1]), err


# ---------------------------------------------------------------- --ignore-eos


@functools.cache
def stories_that_stop() -> LoadedModel:
    """stories260K whose EOS embedding row (the classifier is tied) is 1.2 x the "." row: EOS after a sentence."""
    from jaxkv import load_model

    loaded = load_model(STORIES_BIN, tokenizer=TOK512_MODEL)
    w = numpy_weights(loaded.model)
    w["embed"] = w["embed"].copy()
    w["embed"][loaded.tokenizer.eos_id] = 1.2 * w["embed"][PERIOD]
    return dataclasses.replace(loaded, model=Llama.from_weights(loaded.config, w))


def test_ignore_eos_generates_exactly_max_new_tokens():
    model = stories_that_stop()
    eos = model.tokenizer.eos_id
    stopped = sample(model, PROMPT, max_new_tokens=80)
    assert stopped.finish_reason == "eos" and stopped.token_ids[-1] == eos and len(stopped.token_ids) < 40
    out, text = streamed(model, PROMPT, max_new_tokens=80, ignore_eos=True)
    assert out.finish_reason == "length" and len(out.token_ids) == 80
    assert out.token_ids[: len(stopped.token_ids)] == stopped.token_ids  # the same tokens, then on past EOS
    assert out.text.startswith(stopped.text) and len(out.text) > len(stopped.text) and text.startswith(stopped.text)


# ---------------------------------------------------------------- seeds


def test_no_seed_when_sampling_draws_a_fresh_one_that_repeats_the_run(stories):
    runs = [sample(stories, PROMPT, max_new_tokens=24, temperature=1.0, seed=None) for _ in range(2)]
    assert runs[0].seed != runs[1].seed and all(0 <= r.seed < 2**32 for r in runs)
    assert f", seed {runs[0].seed}; " in runs[0].report()
    again = sample(stories, PROMPT, max_new_tokens=24, temperature=1.0, seed=runs[0].seed)
    assert again.token_ids == runs[0].token_ids and again.seed == runs[0].seed
    greedy = sample(stories, PROMPT, max_new_tokens=24, seed=None)
    assert greedy.seed is None and ", seed" not in greedy.report()
    assert greedy.token_ids == sample(stories, PROMPT, max_new_tokens=24, seed=0).token_ids


def test_cli_prints_the_fresh_seed_and_seed_repeats_it(capsys):
    argv = ["sample", *STORIES, "--prompt", PROMPT, "--tokens", "24", "--temperature", "1.0"]
    runs = [cli(capsys, *argv) for _ in range(2)]
    seeds = [int(re.match(r"\[24 tokens, length, seed (\d+); ", err.splitlines()[-1]).group(1)) for _, _, err in runs]
    assert seeds[0] != seeds[1]
    code, out, err = cli(capsys, *argv, "--seed", str(seeds[0]))
    assert code == 0 and out == runs[0][1] and f"[24 tokens, length, seed {seeds[0]}; " in err


@pytest.mark.parametrize("seed", ["-1", str(2**32), str(2**40)])
@pytest.mark.parametrize("command", ["sample", "chat", "batch"])
def test_seeds_outside_uint32_are_refused_not_wrapped(capsys, tmp_path, seed, command):
    extra = (
        ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")] if command == "batch" else []
    )
    code, _, err = cli(capsys, command, str(tmp_path / "no-model.gguf"), "--seed", seed, "--temperature", "0.5", *extra)
    one_error_line(code, err, f"--seed {seed}: expected an integer in [0, 4294967296)")
    assert list(tmp_path.iterdir()) == []


def test_python_seeds_outside_uint32_are_refused(stories):
    for seed in (-1, 2**32):
        with pytest.raises(JaxkvError, match=rf"seed={seed}: expected an integer in \[0, 4294967296\)"):
            sample(stories, PROMPT, max_new_tokens=2, temperature=1.0, seed=seed)
    with pytest.raises(JaxkvError, match=r"seed\[1\]=-3: expected an integer in \[0, 4294967296\)"):
        generate(stories, [[1, 2], [1, 3]], max_new_tokens=2, seed=[0, -3])


# ---------------------------------------------------------------- top-k / top-p at temperature 0


def test_top_k_top_p_at_temperature_0_warn_once_and_decode_greedily(capsys):
    argv = ["sample", *STORIES, "--prompt", PROMPT, "--tokens", "12"]
    code, greedy, err = cli(capsys, *argv)
    assert code == 0 and "warning" not in err
    code, out, err = cli(capsys, *argv, "--top-k", "5", "--top-p", "0.9")
    assert code == 0 and out == greedy
    assert err.splitlines()[0] == (
        "jaxkv: warning: --top-k 5 and --top-p 0.9 are ignored at --temperature 0 "
        "(greedy decoding); give --temperature T > 0 to sample"
    )
    assert sum("warning" in line for line in err.splitlines()) == 1
    code, _, err = cli(capsys, *argv, "--top-k", "5", "--temperature", "0.7")
    assert code == 0 and "warning" not in err


def test_chat_warns_too(capsys, tmp_path):
    code, _, err = cli(capsys, "chat", str(tmp_path / "no-model.gguf"), "--top-p", "0.5")
    warning, error = err.splitlines()
    assert (
        warning
        == "jaxkv: warning: --top-p 0.5 is ignored at --temperature 0 (greedy decoding); give --temperature T > 0 to sample"
    )
    one_error_line(code, error + "\n", "no-model.gguf")  # then the missing model, as before


# ---------------------------------------------------------------- Ctrl-C


@pytest.mark.slow  # a process of its own (~30 s); test_interruptible_sample_... checks the same in this one
def test_ctrl_c_during_sample_keeps_the_text_and_prints_the_report(stories):
    """SIGINT to a real ``jaxkv sample`` after its first output: the text printed so far stays,
    the report line says ``interrupted``, the exit code is 130 and there is no traceback."""
    spec = ["--streaming-llm-sink", "4", "--streaming-llm-window", "60"]
    argv = [
        sys.executable,
        "-m",
        "jaxkv.cli",
        "sample",
        *STORIES,
        "--prompt",
        PROMPT,
        "--tokens",
        "1000000",
        "--ignore-eos",
        *spec,
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )
    try:
        first = b""
        while len(first) < 400:  # past the 64-token cap (text streams: the first token arrives alone)
            ready, _, _ = select.select([proc.stdout], [], [], 300)
            assert ready, "no output within 300 s"
            first += os.read(proc.stdout.fileno(), 1 << 16)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out, err = (first + out).decode(), err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    report = err.splitlines()[-1]
    n = int(re.match(r"\[(\d+) tokens, interrupted; ", report).group(1))
    assert n > 64 and "(StreamingLLM cap)" in report
    expected, text = streamed(stories, PROMPT, max_new_tokens=n, ignore_eos=True, cache=CacheSpec(sink=4, window=60))
    assert expected.finish_reason == "length"
    assert out == text + "\n"


def test_interruptible_sample_stops_after_the_block_of_a_first_sigint(stories):
    """A SIGINT while the first piece of text prints ends decoding after that block: the first
    block of a streamed sample is its first token alone."""
    handler = signal.getsignal(signal.SIGINT)
    pieces = []

    def ctrl_c(piece):
        pieces.append(piece)
        os.kill(os.getpid(), signal.SIGINT)  # handled at once in this (the main) thread

    out = sample(stories, PROMPT, max_new_tokens=1000, block=8, interruptible=True, on_text=ctrl_c)
    assert out.finish_reason == "interrupted" and len(out.token_ids) == 1
    expected = sample(stories, PROMPT, max_new_tokens=1)
    assert out.token_ids == expected.token_ids and "".join(pieces) == out.text == expected.text
    assert signal.getsignal(signal.SIGINT) is handler


# ---------------------------------------------------------------- the docs' promises


def test_a_config_that_is_not_hashable_is_refused_by_name():
    @dataclasses.dataclass
    class PlainConfig:
        vocab_size: int = 8

    class Tiny(nnx.Module):
        def __init__(self, config):
            self.config = config
            self.w = nnx.Param(jnp.zeros(3))

    with pytest.raises(
        JaxkvError,
        match=r"^LoadedModel: Tiny holds a value jax\.jit cannot hash "
        r"\(unhashable type: 'PlainConfig'\).*frozen=True\)$",
    ):
        LoadedModel(config=PlainConfig(), model=Tiny(PlainConfig()), tokenizer=None)
    frozen = dataclasses.dataclass(frozen=True)(
        type("FrozenConfig", (), {"__annotations__": {"vocab_size": int}, "vocab_size": 8})
    )
    assert LoadedModel(config=frozen(), model=Tiny(frozen()), tokenizer=None).config.vocab_size == 8


def python_blocks(markdown: str, *sections: str) -> str:
    """The ```python blocks of the named ``## `` sections of a Markdown text, joined."""
    code = []
    for part in re.split(r"^## ", markdown, flags=re.MULTILINE):
        if part.startswith(sections):
            code += re.findall(r"^```python\n(.*?)^```", part, flags=re.MULTILINE | re.DOTALL)
    return "\n".join(code)


@pytest.mark.slow  # a process of its own compiling a dozen shapes (~80 s on 2 busy cores)
def test_the_batch_docs_python_runs_as_written(tmp_path):
    """docs/BATCH.md's Python, run in a fresh process in an empty folder (the data's path made
    absolute), on one CPU split into 4 devices as the document suggests."""
    code = python_blocks((REPO / "docs" / "BATCH.md").read_text(), "Python", "Sharding")
    assert code.count("run_rows(") == 2 and "run_file(" in code and "make_mesh(" in code
    code = code.replace("../shared/data", str(DATA))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "results.jsonl").read_text().count("\n") == 2


def test_the_command_caches_compiled_programs_and_a_second_run_loads_them(tmp_path):
    """``python -m jaxkv.cli`` turns on JAX's persistent compilation cache in
    ``$JAXKV_COMPILE_CACHE`` (jax >= 0.6; off on 0.5.0, whose reloaded CPU executables decoded
    garbage) and the store of decode loops and prefill chunks inside it: the first run writes
    entries, the second compiles nothing new and prints the same text."""
    cache = tmp_path / "xla"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXKV_COMPILE_CACHE": str(cache)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the suite's (tests/conftest.py) would be kept instead
    argv = [
        sys.executable,
        "-m",
        "jaxkv.cli",
        "sample",
        str(STORIES_BIN),
        "--tokenizer",
        str(TOK512_MODEL),
        "--prompt",
        "Once upon a time",
        "--tokens",
        "12",
    ]
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    if jax.__version_info__ < (0, 6):
        assert not cache.exists()
        return
    entries = sorted(p.relative_to(cache) for p in cache.rglob("*"))
    assert entries  # the prefill and decode programs
    stored = sorted(p.name.split("-")[0] for p in (cache / "jaxkv-executables").iterdir())
    assert stored == ["decode", "prefill"]  # those two also kept by signature (loaded without tracing)
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout and "Lily" in first.stdout
    assert sorted(p.relative_to(cache) for p in cache.rglob("*")) == entries  # loaded, none compiled anew
    # An executable JAX's cache loads is not stored (serialised again it lacks its compiled
    # code: "Function ... not found" when the next process runs it): the store fills only
    # with what a process compiled itself.
    shutil.rmtree(cache / "jaxkv-executables")
    for _ in range(2):
        again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr
        assert again.stdout == first.stdout
