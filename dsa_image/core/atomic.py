"""Whole-file writes that readers and crashes never see half done, and reads that never block.

Stdlib only. `write_atomic` is the one way this package replaces a file in place: a temp file
next to the target (same filesystem, so the rename is atomic), fsync'd before the rename and
the directory fsync'd after it, so after a crash the path holds the old bytes or the new ones.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from dsa_image.core import status


class NotRegularFile(status.DsaImageError, OSError):
    """The path is a FIFO, socket, device or directory: reading or replacing it is refused."""

    exit_code = status.USAGE

    def __init__(self, path: Path | str):
        super().__init__(errno.EINVAL, "not a regular file (a FIFO, socket, device or directory)", str(path))


def fsync_dir(directory: Path | str, dir_fd: int | None = None) -> None:
    """Make the directory's entries (a rename, a new link) durable. Some filesystems cannot
    fsync a directory (EINVAL): there the rename is as durable as they make it anyway. With
    `dir_fd`, `directory` is a name in that directory, and a symlink there is refused."""
    nofollow = os.O_NOFOLLOW if dir_fd is not None else 0
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | nofollow, dir_fd=dir_fd)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _write_fd(fd: int, data: bytes, mode: int, owner: tuple[int, int] | None) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fchmod(fd, mode)
    if owner is not None and os.geteuid() == 0:
        os.fchown(fd, *owner)
    os.fsync(fd)


def write_new(path: Path | str, data: bytes, mode: int = 0o644, owner: tuple[int, int] | None = None,
              dir_fd: int | None = None) -> None:
    """Create `path` (a name in `dir_fd` if given), which must not exist, with `data`, durably;
    on failure no file is left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        _write_fd(fd, data, mode, owner)
    except BaseException:
        os.close(fd)
        os.unlink(path, dir_fd=dir_fd)
        raise
    os.close(fd)


def write_atomic(path: Path | str, data: bytes, mode: int | None = None, owner: tuple[int, int] | None = None) -> None:
    """Replace (or create) `path` with `data`. `mode` defaults to the replaced file's mode, or
    0o644; `owner` (uid, gid) is applied when running as root. A FIFO or device at `path` is
    refused: replacing one would hide what it was."""
    path = Path(path)
    try:
        current = os.lstat(path)
    except FileNotFoundError:
        current = None
    if current is not None and not stat.S_ISREG(current.st_mode):
        raise NotRegularFile(path)
    if mode is None:
        mode = stat.S_IMODE(current.st_mode) if current is not None else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        try:
            _write_fd(fd, data, mode, owner)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    fsync_dir(path.parent)


def read_regular(path: Path | str) -> bytes:
    """The bytes of `path`, which must be a regular file (opened non-blocking and checked on
    the open descriptor, so a FIFO swapped in cannot make the reader hang)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(path)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
