"""Atomic file writes: every file jaxkv writes (a chat cache, batch results, per-token NLL).

Beside :mod:`jaxkv.errors` at the bottom of the layers (DESIGN §3): it imports nothing of jaxkv.
"""

from __future__ import annotations

import contextlib
import os
import tempfile


def atomic_write(path: str | os.PathLike, data: bytes, *, private: bool = True) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    A temporary file in the same directory is written, flushed and ``fsync``-ed, then
    ``os.replace``-d onto ``path``, and the directory is ``fsync``-ed (POSIX) so the rename
    survives a crash. On any failure (an exception, Ctrl-C) the temporary file is removed and
    the old file is left as it was.

    Args:
      path: the file to write.
      data: its whole content.
      private: mode 0600 (the file may hold a conversation); False = 0666 less the umask, as
        ``open()`` would create it.
    Raises:
      OSError: the directory is missing or not writable (nothing is left behind).
    """
    path = os.path.realpath(os.fspath(path))  # a symlink is written through, not replaced
    if os.path.exists(path) and not os.path.isfile(path):  # a device or a pipe (/dev/stdout): no rename
        with open(path, "wb") as f:
            f.write(data)
        return
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            if not private:
                umask = os.umask(0)
                os.umask(umask)
                os.fchmod(f.fileno(), 0o666 & ~umask)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError, AttributeError):  # make the rename durable (POSIX)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
