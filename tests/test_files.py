"""jaxkv.files.atomic_write: whole file or the old one; symlinks and devices written through."""

from __future__ import annotations

import os

from jaxkv.files import atomic_write


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
