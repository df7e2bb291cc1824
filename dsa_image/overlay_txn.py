"""The transaction under apply and revert: a lock, a journal, and a stash of every original.

While one runs, SITE/.vllm_overlay_txn/ holds
  journal.json  every path it may change and where that path's original goes, written and
                fsync'd before the first change
  N.orig        the original of path N: a hard link to its inode (a rename where the kernel
                refuses the link), so nothing is copied and owner, mode and mtime stay
  N.new         path N's new content, staged, then swapped in with os.replace
(a --receipt outside SITE gets its two slots next to it instead).

Rollback renames every N.orig back over its path and deletes the paths that did not exist: it
allocates no inode and no byte, so it works on a full disk. The commit point renames
journal.json to index.json (allocation-free too); then apply keeps the directory as
SITE/.vllm_overlay_originals/ (what revert puts back) and revert deletes it.

A run killed outright (SIGKILL, power loss) leaves the directory; the next apply or revert
finds it under the lock and rolls it back (journal.json) or finishes it (index.json) first.
The lock is flock(2) on the site-packages directory itself: no lock file to leave behind or to
create on a full or read-only disk, and the kernel drops it with its holder.
"""

from __future__ import annotations

import fcntl
import json
import os
import py_compile
import shutil
import signal
import stat
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .atomic import fsync_dir, read_regular, write_atomic, write_new
from .overlay_core import (CANNOT_WRITE, LOCK_TIMEOUT, ORIGINALS_DIR_NAME, TOOL, TXN_DIR_NAME, Interrupted,
                           OverlayError, looks_like_receipt, reason, reinstall_command)

JOURNAL = "journal.json"
INDEX = "index.json"
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# --- lock and signals -----------------------------------------------------------------------


@contextmanager
def site_lock(site: Path, exclusive: bool, timeout: float = LOCK_TIMEOUT):
    """flock the site-packages directory: exclusive for apply/revert, shared for verify. A
    second caller waits up to `timeout` seconds, then fails with CANNOT_WRITE."""
    try:
        fd = os.open(site, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        if exclusive:
            raise OverlayError(CANNOT_WRITE, f"{site}: cannot lock it ({reason(exc)}); nothing was changed") from exc
        yield  # verify only reads: a directory it may not open it still reads unlocked
        return
    try:
        _acquire(fd, site, exclusive, timeout)
        yield
    finally:
        os.close(fd)


def _acquire(fd: int, site: Path, exclusive: bool, timeout: float) -> None:
    operation = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, operation)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise OverlayError(CANNOT_WRITE, (
                    f"{site}: another apply or revert still holds the lock on it after "
                    f"{timeout:g} s; nothing was changed. Wait for it to finish, then re-run.")) from None
            time.sleep(0.05)
        except OSError as exc:
            if exclusive:
                raise OverlayError(CANNOT_WRITE, f"{site}: cannot lock it ({reason(exc)}); nothing was changed") from exc
            return  # a filesystem without flock: verify only reads, so it goes on unlocked


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


@contextmanager
def signals_raise():
    """Inside the block SIGINT, SIGTERM and SIGHUP raise Interrupted, so the transaction rolls
    back instead of dying half done (only the main thread can take signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise_interrupted) for s in _SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


@contextmanager
def signals_held():
    """Defer those signals: a second Ctrl-C cannot cut a rollback or a commit in half."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# --- the transaction ------------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    path: Path
    orig: Path | None  # where the original inode goes; None: the path did not exist
    new: Path  # where the new content is staged


class Transaction:
    def __init__(self, site: Path, kind: str, slots: list[Slot], dirs: list[Path], receipt: Path):
        self.site, self.kind, self.slots, self.dirs, self.receipt = site, kind, slots, dirs, receipt
        self.dir = site / TXN_DIR_NAME
        self.by_path = {slot.path: slot for slot in slots}

    @classmethod
    def begin(cls, site: Path, kind: str, paths: list[Path], dirs: list[Path], receipt: Path) -> Transaction:
        """Create the stash directory and its journal; nothing else is touched yet."""
        txn_dir = site / TXN_DIR_NAME
        os.mkdir(txn_dir, 0o755)
        try:
            slots = [_slot(site, txn_dir, i, path) for i, path in enumerate(paths)]
            txn = cls(site, kind, slots, dirs, receipt)
            write_atomic(txn_dir / JOURNAL, json.dumps(txn.document(), indent=1).encode())
            fsync_dir(site)
        except BaseException:
            shutil.rmtree(txn_dir, ignore_errors=True)
            raise
        return txn

    def document(self) -> dict:
        """Paths relative to the site and the stash, nothing per-run (no pid, no time): apply
        keeps this as the originals' index, and the image layer stays reproducible."""
        return {"kind": self.kind, "receipt": self._rel(self.receipt, self.site),
                "dirs": [self._rel(d, self.site) for d in self.dirs],
                "slots": [{"path": self._rel(s.path, self.site), "orig": s.orig and self._rel(s.orig, self.dir),
                           "new": self._rel(s.new, self.dir)} for s in self.slots]}

    @staticmethod
    def _rel(path: Path, base: Path) -> str:
        return path.relative_to(base).as_posix() if path.is_relative_to(base) else str(path)

    @classmethod
    def from_document(cls, site: Path, doc: dict, txn_dir: Path) -> Transaction:
        """Read back a journal or index. Recovery may run as root on what another user could
        write, so every path must lie in the site (its stash in the stash directory), except
        the receipt's (its slots beside it); anything else is refused as unreadable."""
        if doc["kind"] not in ("apply", "revert"):
            raise ValueError(f"unknown kind {doc['kind']!r}")
        receipt = Path(os.path.normpath(site / doc["receipt"]))
        slots = [_slot_from(site, txn_dir, receipt, s) for s in doc["slots"]]
        return cls(site, doc["kind"], slots, [_inside(site, d) for d in doc["dirs"]], receipt)

    # -- changes: each one stashes the original first ---------------------------------------

    def make_dirs(self) -> None:
        for directory in self.dirs:
            os.mkdir(directory, 0o755)

    def put(self, path: Path, data: bytes | None = None, *, link: Path | None = None,
            compile_from: Path | None = None, mode: int = 0o644) -> None:
        """Swap `path` to new content (bytes, a hard link to `link`, or the checked-hash
        bytecode of `compile_from`), in the mode and owner of the file it replaces."""
        slot = self.by_path[path]
        like = _stat(path)
        owner = (like.st_uid, like.st_gid) if like else None
        if os.path.lexists(slot.new):
            os.unlink(slot.new)
        if data is not None:
            write_new(slot.new, data, stat.S_IMODE(like.st_mode) if like else mode, owner)
        elif link is not None:
            os.link(link, slot.new, follow_symlinks=False)
        else:
            _compile(compile_from, slot.new, owner)
        self._stash(slot)
        os.replace(slot.new, path)

    def remove(self, path: Path) -> None:
        slot = self.by_path[path]
        if slot.orig is not None and os.path.lexists(path) and not os.path.lexists(slot.orig):
            os.rename(path, slot.orig)

    def _stash(self, slot: Slot) -> None:
        if slot.orig is None or os.path.lexists(slot.orig):
            return
        try:
            os.link(slot.path, slot.orig, follow_symlinks=False)
        except PermissionError:  # fs.protected_hardlinks: not our inode; a rename keeps it too
            os.rename(slot.path, slot.orig)

    # -- the two ways out -------------------------------------------------------------------

    def commit(self) -> None:
        """The point of no return: everything is durable, then journal.json -> index.json."""
        for directory in sorted({self.dir} | {s.path.parent for s in self.slots if os.path.isdir(s.path.parent)}):
            fsync_dir(directory)
        os.replace(self.dir / JOURNAL, self.dir / INDEX)

    def rollback(self) -> list[str]:
        """Put every original back; one line per path that could not be (the stash then stays)."""
        failures = []
        for slot in reversed(self.slots):
            try:
                _restore(slot, deletable=slot.path.is_relative_to(self.site) or _is_receipt(slot.path))
            except OSError as exc:
                kept = f"its original is kept at {slot.orig}" if slot.orig else "it did not exist before"
                failures.append(f"{slot.path} ({reason(exc)}; {kept})")
        for directory in reversed(self.dirs):
            try:
                os.rmdir(directory)
            except OSError:
                pass  # absent, or holds files someone else put there
        if not failures:
            self._discard()
        return failures

    def finish(self) -> None:
        """After the commit point: apply keeps the originals, revert drops them."""
        self._drop_outside()
        if self.kind == "apply":
            keep = {INDEX} | {s.orig.name for s in self.slots if s.orig and s.orig.parent == self.dir}
            for leftover in self.dir.iterdir():
                if leftover.name not in keep:
                    leftover.unlink()
            _rmtree(self.site / ORIGINALS_DIR_NAME)
            os.rename(self.dir, self.site / ORIGINALS_DIR_NAME)
        else:
            _rmtree(self.site / ORIGINALS_DIR_NAME)
            _rmtree(self.dir)
        fsync_dir(self.site)

    def _discard(self) -> None:
        self._drop_outside()
        _rmtree(self.dir)

    def _drop_outside(self) -> None:
        for slot in self.slots:
            for stashed in (slot.orig, slot.new):
                if stashed is not None and stashed.parent != self.dir and os.path.lexists(stashed):
                    os.unlink(stashed)


def _slot(site: Path, txn_dir: Path, index: int, path: Path) -> Slot:
    base = txn_dir / str(index) if path.is_relative_to(site) else path.parent / f".{path.name}.vllm-overlay"
    orig = base.with_name(base.name + ".orig") if os.path.lexists(path) else None
    return Slot(path, orig, base.with_name(base.name + ".new"))


def _inside(base: Path, rel: str) -> Path:
    path = Path(os.path.normpath(base / rel))
    if path == base or not path.is_relative_to(base):
        raise ValueError(f"{rel!r} is not inside {base}")
    return path


def _slot_from(site: Path, txn_dir: Path, receipt: Path, doc: dict) -> Slot:
    path = Path(os.path.normpath(site / doc["path"]))
    if path != receipt:
        path = _inside(site, doc["path"])
    stash = txn_dir if path.is_relative_to(site) else path.parent
    return Slot(path, doc["orig"] and _inside(stash, doc["orig"]), _inside(stash, doc["new"]))


def _is_receipt(path: Path) -> bool:
    try:
        return looks_like_receipt(read_regular(path))
    except OSError:
        return False


def _stat(path: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _compile(source: Path, cfile: Path, owner: tuple[int, int] | None) -> None:
    """CHECKED_HASH bytecode: it carries the source's hash, so Python never runs it for other
    source bytes, and it has no mtime in it (reproducible)."""
    py_compile.compile(str(source), cfile=str(cfile), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
    fd = os.open(cfile, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if owner is not None and os.geteuid() == 0:
            os.fchown(fd, *owner)
        os.fsync(fd)
    finally:
        os.close(fd)


def _restore(slot: Slot, deletable: bool) -> None:
    if slot.orig is None:
        if deletable and os.path.lexists(slot.path):
            os.unlink(slot.path)
    elif os.path.lexists(slot.orig):
        # Two links to one inode (killed between link and swap): rename is a no-op, and the
        # stash is discarded with its directory.
        os.replace(slot.orig, slot.path)
    if os.path.lexists(slot.new):
        os.unlink(slot.new)


def _rmtree(path: Path) -> None:
    if os.path.lexists(path):
        shutil.rmtree(path)


# --- running one, and recovering one a killed process left ----------------------------------


def restore_failed(site: Path, failures: list[str]) -> str:
    return (f"RESTORE FAILED for {'; '.join(failures)}. The journal {site / TXN_DIR_NAME / JOURNAL} "
            f"is kept: `{TOOL} revert --site-packages {site}` finishes the restore")


def run(site: Path, kind: str, paths: list[Path], dirs: list[Path], receipt: Path,
        body: Callable[[Transaction], None]) -> None:
    """begin, body(txn), commit, finish. Any exception or signal before the commit point
    rolls every change back and is raised again (as OverlayError(CANNOT_WRITE) or Interrupted,
    saying whether every file was restored)."""
    with signals_raise():
        try:
            txn = Transaction.begin(site, kind, paths, dirs, receipt)
        except Interrupted as exc:
            raise Interrupted(exc.signum, f"{site}: {kind} {exc}; nothing was changed") from None
        except OSError as exc:
            raise OverlayError(CANNOT_WRITE, f"{site}: cannot start the {kind} ({exc}); nothing was changed") from exc
        try:
            body(txn)
            with signals_held():
                txn.commit()
        except BaseException as exc:
            with signals_held():
                failures = txn.rollback()
            raise _rolled_back(site, kind, exc, failures)
    _finish(site, kind, txn)


def _rolled_back(site: Path, kind: str, exc: BaseException, failures: list[str]) -> BaseException:
    outcome = "every file was restored" if not failures else restore_failed(site, failures)
    if isinstance(exc, Interrupted):
        return Interrupted(exc.signum, f"{site}: {kind} {exc}; {outcome}")
    if isinstance(exc, Exception):
        error = OverlayError(CANNOT_WRITE, f"{site}: {kind} failed ({exc}); {outcome}")
        error.__cause__ = exc
        return error
    return exc


def _finish(site: Path, kind: str, txn: Transaction) -> None:
    try:
        with signals_held():
            txn.finish()
    except OSError as exc:
        raise OverlayError(CANNOT_WRITE, (
            f"{site}: the {kind} is complete and committed, but tidying {txn.dir} failed ({exc}); the next "
            f"`{TOOL} apply` or `revert` on {site} finishes it")) from exc


def recover(site: Path, version: str) -> str | None:
    """Under the exclusive lock: finish or roll back what a killed apply/revert left. Returns
    what was done (None: nothing was left). `version`: the vLLM to reinstall if it cannot."""
    txn_dir = site / TXN_DIR_NAME
    if not os.path.lexists(txn_dir):
        return None
    with signals_held():
        for name, verb in ((INDEX, "finished"), (JOURNAL, "rolled back")):
            if os.path.lexists(txn_dir / name):
                txn = Transaction.from_document(site, _read_document(site, txn_dir / name, version), txn_dir)
                _complete(site, txn, name)
                return f"{site}: {verb} the {txn.kind} a killed run left unfinished"
        _rmtree(txn_dir)  # killed before its journal existed: it had changed nothing
    return f"{site}: removed the empty {txn_dir} of a killed run"


def _complete(site: Path, txn: Transaction, name: str) -> None:
    if name == INDEX:
        txn.finish()
        return
    failures = txn.rollback()
    if failures:
        raise OverlayError(CANNOT_WRITE, f"{site}: rolling back the interrupted {txn.kind}: {restore_failed(site, failures)}")


def _read_document(site: Path, path: Path, version: str) -> dict:
    try:
        doc = json.loads(read_regular(path))
        Transaction.from_document(site, doc, path.parent)
        return doc
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise OverlayError(CANNOT_WRITE, (
            f"{path}: unreadable ({exc}), so what the interrupted run changed is unknown. Reinstall vLLM "
            f"{version} with the python of the environment that holds {site} (`{reinstall_command(version)}`), "
            f"delete {path.parent} (`rm -r {path.parent}`), then re-run")) from exc
