"""How apply and revert reach a path in the site-packages directory DIR: from DIR, one real
directory at a time.

DIR and the directories above it are the caller's (--site-packages names them), reached as
named. Below DIR nothing is trusted: whoever may write there may have planted a symlink, or may
swap one in while a run goes on. So every directory on the way is opened with O_NOFOLLOW (a
symlink there is refused, never followed) and the last step is a *at() call on a bare name in
the directory so opened (unlinkat, renameat, linkat, openat with O_NOFOLLOW), none of which
follows a symlink either. A path outside DIR is the caller's own --receipt, or its slots beside
it: reached as named. Opening a directory with O_DIRECTORY never blocks on a FIFO, and a file
is opened O_NONBLOCK, so nothing here can hang.

`dsa_image.overlay.txn` makes every change through these functions.
"""

from __future__ import annotations

import errno
import os
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dsa_image.core.atomic import NotRegularFile, fsync_dir, write_new as _write_new
from dsa_image.core import status

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class SymlinkOnTheWay(status.DsaImageError, OSError):
    """A symlink where DIR's tree must have a real directory (or, for lstat_chain, a file)."""

    exit_code = status.ENVIRONMENT

    def __init__(self, path: Path | str):
        super().__init__(errno.ELOOP, "a symlink on the way: apply and revert never follow one inside the site",
                         str(path))


@contextmanager
def directory_of(site: Path, path: Path) -> Iterator[tuple[int, str]]:
    """(a descriptor of path's directory, path's last name): inside `site`, that directory is
    reached from `site` without following a symlink; outside it, as named."""
    if not path.is_relative_to(site) or path == site:
        fd = os.open(path.parent, _DIR_FLAGS)
        name = path.name
    else:
        *folders, name = path.relative_to(site).parts
        fd = os.open(site, _DIR_FLAGS)
        for folder in folders:
            try:
                below = _down(fd, folder, path)
            finally:
                os.close(fd)
            fd = below
    try:
        yield fd, name
    finally:
        os.close(fd)


def _down(fd: int, folder: str, path: Path) -> int:
    """A descriptor of `folder` in directory `fd`, refusing a symlink."""
    try:
        return os.open(folder, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP) and _is_link(fd, folder):
            raise SymlinkOnTheWay(path) from None
        raise


def _is_link(fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def lstat(site: Path, path: Path) -> os.stat_result | None:
    """The path's own status (a symlink's, not its target's); None when it does not exist
    (a missing directory on the way, or a file where one should be, included)."""
    try:
        with directory_of(site, path) as (fd, name):
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except SymlinkOnTheWay:
        raise
    except (FileNotFoundError, NotADirectoryError):
        return None


def exists(site: Path, path: Path) -> bool:
    return lstat(site, path) is not None


def unlink(site: Path, path: Path) -> None:
    with directory_of(site, path) as (fd, name):
        os.unlink(name, dir_fd=fd)


def replace(site: Path, src: Path, dst: Path) -> None:
    """rename(2): dst, whatever it is (a symlink too), is replaced, never followed."""
    with directory_of(site, src) as (src_fd, src_name), directory_of(site, dst) as (dst_fd, dst_name):
        os.replace(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)


def rename(site: Path, src: Path, dst: Path) -> None:
    """replace(), for a dst that is not there (a stash slot)."""
    with directory_of(site, src) as (src_fd, src_name), directory_of(site, dst) as (dst_fd, dst_name):
        os.rename(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)


def link(site: Path, src: Path, dst: Path) -> None:
    """A hard link to src's own inode (a symlink's, never its target's)."""
    with directory_of(site, src) as (src_fd, src_name), directory_of(site, dst) as (dst_fd, dst_name):
        os.link(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd, follow_symlinks=False)


def mkdir(site: Path, path: Path, mode: int = 0o755) -> None:
    with directory_of(site, path) as (fd, name):
        os.mkdir(name, mode, dir_fd=fd)


def rmdir(site: Path, path: Path) -> None:
    with directory_of(site, path) as (fd, name):
        os.rmdir(name, dir_fd=fd)


def write_new(site: Path, path: Path, data: bytes, mode: int, owner: tuple[int, int] | None) -> None:
    with directory_of(site, path) as (fd, name):
        _write_new(name, data, mode, owner, dir_fd=fd)


def read(site: Path, path: Path) -> bytes:
    """A regular file's bytes; a symlink (ELOOP), FIFO or directory (NotRegularFile) is refused."""
    with directory_of(site, path) as (dir_fd, name):
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(path)
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def listdir(site: Path, path: Path) -> list[str]:
    """The names in directory `path` (itself no symlink)."""
    with directory_of(site, path) as (fd, name):
        sub = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
    try:
        return os.listdir(sub)
    finally:
        os.close(sub)


def fsync(site: Path, directory: Path) -> None:
    """fsync_dir, reaching `directory` without following a symlink."""
    with directory_of(site, directory) as (fd, name):
        fsync_dir(name, dir_fd=fd)


def remove_tree(site: Path, path: Path) -> None:
    """rm -r without following a symlink or opening anything but a directory; absent: nothing."""
    with directory_of(site, path) as (fd, name):
        _remove_at(fd, name)


def _remove_at(fd: int, name: str) -> None:
    try:
        mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        os.unlink(name, dir_fd=fd)
        return
    sub = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
    try:
        for entry in os.listdir(sub):
            _remove_at(sub, entry)
    finally:
        os.close(sub)
    os.rmdir(name, dir_fd=fd)


def symlink_on_the_way(site: Path, path: Path) -> Path | None:
    """The first symlink from `site` down to `path` (path itself included); None when every
    component that exists is a real directory (or, the last, not a symlink)."""
    if not path.is_relative_to(site):
        return None
    current = site
    for part in path.relative_to(site).parts:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None
        if stat.S_ISLNK(mode):
            return current
        if not stat.S_ISDIR(mode):
            return None
    return None


def what_is(st: os.stat_result) -> str:
    """A file type in words, for messages."""
    kinds = ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISREG, "a regular file"),
             (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"))
    return next((words for test, words in kinds if test(st.st_mode)), "an unknown kind of file")
