"""jaxkv.files: atomic_write (whole file or the old one; symlinks and devices written through) and
check_writable (an output that cannot be written is found before the work, in one line, by the
real ``jaxkv batch``, ``chat --cache-file`` and ``ppl --nll-out``)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile

import pytest

from paths import REPO, STORIES_BIN, TEXT, TOK512_MODEL

from jaxkv import JaxkvError
from jaxkv.files import atomic_write, check_writable

pytestmark = pytest.mark.jax_independent  # file writing on the host


def test_replaces_a_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    path.write_text("old")
    atomic_write(path, b"new", private=False)
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["out.json"]


def test_a_symlink_is_written_through_not_replaced(tmp_path):
    target = tmp_path / "target.jsonl"
    target.write_text("old")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    atomic_write(link, b"new")
    assert link.is_symlink() and target.read_bytes() == b"new"


def test_a_device_is_written_to_not_replaced(tmp_path):
    atomic_write("/dev/null", b"data")  # would need to replace /dev/null with a file otherwise
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


# ---- check_writable ---------------------------------------------------------------------------
@pytest.fixture
def place(tmp_path):
    """tmp_path with an input file ``in.jsonl``, a regular file ``file``, a directory ``dir``,
    a symlink ``link.jsonl`` and a hard link ``hard.jsonl`` to the input."""
    (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
    (tmp_path / "file").write_text("a file\n")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "in.jsonl")
    os.link(tmp_path / "in.jsonl", tmp_path / "hard.jsonl")
    return tmp_path


def listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    "name, why",
    [
        ("missing/out.jsonl", "the directory {d}/missing does not exist"),
        ("file/out.jsonl", "the directory {d}/file is not a directory"),  # NotADirectory: refused as root too
        ("dir", "is a directory; expected a file name"),
        ("in.jsonl", "is the input file {d}/in.jsonl (writing it would replace the input); choose another file"),
        ("link.jsonl", "is the input file {d}/in.jsonl (writing it would replace the input); choose another file"),
        ("hard.jsonl", "is the input file {d}/in.jsonl (writing it would replace the input); choose another file"),
    ],
)
def test_check_writable_names_the_path_and_why_and_touches_nothing(place, name, why):
    before = listing(place)
    with pytest.raises(JaxkvError) as e:
        check_writable(place / name, "--output", not_same_as=place / "in.jsonl")
    assert str(e.value) == f"--output {place / name}: " + why.format(d=place)
    assert listing(place) == before and (place / "in.jsonl").read_text() == '{"prompt": "x"}\n'


def test_check_writable_accepts_new_files_links_and_devices_and_leaves_nothing(place, monkeypatch):
    before = listing(place)
    for path in (place / "new.jsonl", place / "file", place / "dir" / "x.npy", "/dev/null"):
        check_writable(path, "--output", not_same_as=place / "in.jsonl")
    (place / "out.jsonl").symlink_to(place / "dir" / "target.jsonl")  # a dangling link: its target is checked
    (place / "out2.jsonl").symlink_to(place / "nowhere" / "target.jsonl")
    check_writable(place / "out.jsonl")
    monkeypatch.chdir(place)
    with pytest.raises(JaxkvError) as e:
        check_writable("out2.jsonl")  # no flag: the path alone
    assert str(e.value) == f"out2.jsonl: the directory {place}/nowhere does not exist"
    assert listing(place) == sorted(before + ["out.jsonl", "out2.jsonl"])


def test_check_writable_reports_a_directory_it_cannot_create_a_file_in(place, monkeypatch):
    def refuse(**kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), kwargs["dir"])

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(JaxkvError) as e:
        check_writable(place / "dir" / "out.jsonl", "--nll-out")
    assert str(e.value) == f"--nll-out {place}/dir/out.jsonl: cannot create a file in {place}/dir (Permission denied)"


@pytest.mark.skipif(
    os.geteuid() == 0,
    reason="root may write into a mode-0555 directory (and so would the write): "
    "the NotADirectory case above is the unwritable path tested as root",
)
def test_check_writable_refuses_a_read_only_directory(place):
    (place / "dir").chmod(0o555)
    try:
        with pytest.raises(JaxkvError, match=r"cannot create a file in .*/dir \(Permission denied\)$"):
            check_writable(place / "dir" / "out.jsonl", "--output")
        assert os.listdir(place / "dir") == []
    finally:
        (place / "dir").chmod(0o755)


# ---- the real console script: refused before the model loads, nothing on disk changed ------------
STORIES = [str(STORIES_BIN), "--tokenizer", str(TOK512_MODEL)]


def jaxkv(*argv, stdin=""):
    return subprocess.run(
        [sys.executable, "-m", "jaxkv.cli", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)},
    )


@pytest.mark.parametrize(
    "argv, why",
    [
        (
            ["batch", "--input", "{d}/in.jsonl", "--output", "{d}/file/out.jsonl"],
            "--output {d}/file/out.jsonl: the directory {d}/file is not a directory",
        ),
        (
            ["batch", "--input", "{d}/in.jsonl", "--output", "{d}/missing/out.jsonl"],
            "--output {d}/missing/out.jsonl: the directory {d}/missing does not exist",
        ),
        (
            ["batch", "--input", "{d}/in.jsonl", "--output", "{d}/dir"],
            "--output {d}/dir: is a directory; expected a file name",
        ),
        (
            ["batch", "--input", "{d}/in.jsonl", "--output", "{d}/link.jsonl"],
            "--output {d}/link.jsonl: is the input file {d}/in.jsonl (writing it would replace the input); choose another file",
        ),
        (
            ["chat", "--cache-file", "{d}/missing/chat.safetensors"],
            "--cache-file {d}/missing/chat.safetensors: the directory {d}/missing does not exist",
        ),
        (
            ["chat", "--cache-file", "{d}/file/chat.safetensors"],
            "--cache-file {d}/file/chat.safetensors: the directory {d}/file is not a directory",
        ),
        (
            ["ppl", "--text", str(TEXT), "--nll-out", "{d}/missing/nll.txt"],
            "--nll-out {d}/missing/nll.txt: the directory {d}/missing does not exist",
        ),
    ],
)
def test_cli_refuses_an_unwritable_output_before_any_work(place, argv, why):
    before = listing(place)
    command, *rest = argv
    out = jaxkv(command, *STORIES, *[a.format(d=place) for a in rest], stdin="Hello\n")
    assert out.returncode == 2 and out.stderr == f"jaxkv: error: {why.format(d=place)}\n", out.stderr
    assert out.stdout == ""  # no reply printed, no perplexity scored
    assert listing(place) == before and (place / "in.jsonl").read_text() == '{"prompt": "x"}\n'


def test_a_chat_save_that_fails_late_is_one_line():
    """Checked up front, a save can still fail later (the disk fills up): one line, not a traceback."""
    from jaxkv.cli.chat import _save

    class DiskFull:
        def save(self, path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    with pytest.raises(JaxkvError) as e:
        _save(DiskFull(), "chat.safetensors")
    assert str(e.value) == "--cache-file chat.safetensors: cannot save the conversation (No space left on device)"
