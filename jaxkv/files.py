"""Atomic file writes: every file jaxkv writes (a chat cache, batch results, per-token NLL),
and the check that such a file can be written, made before the work that produces it.

Beside :mod:`jaxkv.errors` at the bottom of the layers (DESIGN §3): it imports only that.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

from jaxkv.errors import JaxkvError


def _temporary(path: str) -> tuple[int, str]:
    """A new temporary file beside ``path`` (same directory): ``(fd, name)``; raises OSError."""
    return tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path))


def check_writable(
    path: str | os.PathLike, flag: str | None = None, *, not_same_as: str | os.PathLike | None = None
) -> None:
    """Check, before any work, that :func:`atomic_write` will be able to write ``path``.

    It does what the write will do: resolves symlinks, accepts an existing device or pipe it
    can write to (written through), else creates and removes a temporary file in the target's
    directory. So a directory that is missing, not a directory, read-only (for this user; root
    may write into a mode-0555 directory, as the later write would) or on a read-only file
    system is found now, not after the work.

    Args:
      path: the output file. flag: how to name it in the message (``--output``); None = the path alone.
      not_same_as: an input file that ``path`` must not be (also through a symlink or a hard
        link): writing the output would replace it.
    Raises:
      JaxkvError: one line naming ``flag path`` and why it cannot be written.
    """
    path = os.fspath(path)
    shown = f"{flag} {path}" if flag else path
    real = os.path.realpath(path)
    if os.path.isdir(real):
        raise JaxkvError(f"{shown}: is a directory; expected a file name")
    if (
        not_same_as is not None
        and os.path.exists(real)
        and os.path.exists(not_same_as)
        and os.path.samefile(real, not_same_as)
    ):
        raise JaxkvError(
            f"{shown}: is the input file {os.fspath(not_same_as)} (writing it would replace the input); "
            "choose another file"
        )
    if os.path.exists(real) and not os.path.isfile(real):  # a device or a pipe: written through
        if not os.access(real, os.W_OK):
            raise JaxkvError(f"{shown}: not writable")
        return
    directory = os.path.dirname(real)
    if not os.path.isdir(directory):
        why = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise JaxkvError(f"{shown}: the directory {directory} {why}")
    try:
        fd, tmp = _temporary(real)
    except OSError as e:
        raise JaxkvError(f"{shown}: cannot create a file in {directory} ({e.strerror})") from None
    os.close(fd)
    os.unlink(tmp)


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
    fd, tmp = _temporary(path)
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
