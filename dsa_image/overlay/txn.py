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

Whoever may write the site may have planted anything there, so the stash directories must be
real directories of this process's user (check_stashes), a journal or index read back names
only what the manifest manages (Scope, Transaction.from_document), and every change goes
through overlay_fs, which never follows a symlink inside the site.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import stat
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsa_image.overlay import fs
from dsa_image.core.atomic import fsync_dir, read_regular
from dsa_image.overlay.core import CANNOT_WRITE, LOCK_TIMEOUT, ORIGINALS_DIR_NAME, TOOL, TXN_DIR_NAME, Interrupted, OverlayError, is_bytecode_of, looks_like_receipt, reason, reinstall_command

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


@dataclass(frozen=True)
class Scope:
    """What a journal or an index read back from disk may name; anything else refuses it.
    files: the manifest's entries (absolute paths in the site); a .py entry's bytecode in its
    __pycache__ is in scope too, and so is that directory. receipts: the receipts this run
    trusts (the site's default one and the caller's --receipt): the only paths outside the
    manifest's files a recovery acts on."""
    files: frozenset[Path]
    receipts: frozenset[Path]

    def holds(self, path: Path) -> bool:
        return path in self.files or any(is_bytecode_of(source, path) for source in self.files)

    def holds_dir(self, path: Path) -> bool:
        return any(path == source.parent / "__pycache__" for source in self.files if source.suffix == ".py")


class Transaction:
    def __init__(self, site: Path, kind: str, slots: list[Slot], dirs: list[Path], receipt: Path):
        self.site, self.kind, self.slots, self.dirs, self.receipt = site, kind, slots, dirs, receipt
        self.dir = site / TXN_DIR_NAME
        self.by_path = {slot.path: slot for slot in slots}

    @classmethod
    def begin(cls, site: Path, kind: str, paths: list[Path], dirs: list[Path], receipt: Path) -> Transaction:
        """Create the stash directory and its journal; nothing else is touched yet."""
        txn_dir = site / TXN_DIR_NAME
        fs.mkdir(site, txn_dir, 0o755)
        try:
            slots = [_slot(site, txn_dir, i, path, fs.exists(site, path)) for i, path in enumerate(paths)]
            txn = cls(site, kind, slots, dirs, receipt)
            staged = txn_dir / (JOURNAL + ".new")  # complete or absent: a recovery reads no half journal
            fs.write_new(site, staged, json.dumps(txn.document(), indent=1).encode(), 0o644, None)
            fs.replace(site, staged, txn_dir / JOURNAL)
            fs.fsync(site, txn_dir)
            fsync_dir(site)
        except BaseException:
            with contextlib.suppress(OSError):
                fs.remove_tree(site, txn_dir)
            raise
        return txn

    def document(self) -> dict:
        """Paths relative to the site and the stash, nothing per-run (no pid, no time): apply
        keeps this as the originals' index, and the image layer stays reproducible."""
        return {"kind": self.kind, "receipt": _rel(self.receipt, self.site),
                "dirs": [_rel(d, self.site) for d in self.dirs],
                "slots": [{"path": _rel(s.path, self.site), "orig": s.orig and _rel(s.orig, self.dir),
                           "new": _rel(s.new, self.dir)} for s in self.slots]}

    @classmethod
    def from_document(cls, site: Path, doc, txn_dir: Path, scope: Scope) -> Transaction:
        """Read back a journal or index (its stash directory `txn_dir` already checked: a real
        one, ours). The tool wrote it, but into a directory others may write, and a recovery
        may run as root: so it is input like any other. Every path must be relative and
        normalised, a file or __pycache__ the manifest manages (or the journal's receipt),
        with no symlink on the way; each slot exactly the stash names `document` writes. The
        receipt is returned as named: the caller acts on it only if `scope` trusts it.
        Raises ValueError saying what is wrong."""
        if not isinstance(doc, dict) or set(doc) != {"kind", "receipt", "dirs", "slots"}:
            raise ValueError("expected a JSON object with exactly the keys dirs, kind, receipt, slots")
        if doc["kind"] not in ("apply", "revert"):
            raise ValueError(f"unknown kind {doc['kind']!r}")
        if not isinstance(doc["dirs"], list) or not isinstance(doc["slots"], list):
            raise ValueError("dirs and slots must be lists")
        receipt = _path(site, doc["receipt"], absolute=True)
        dirs = [_path(site, d) for d in doc["dirs"]]
        for directory in dirs:
            if not scope.holds_dir(directory):
                raise ValueError(f"{directory}: not a __pycache__ directory of a module the manifest manages")
        slots = [_slot_from(site, txn_dir, i, item, receipt, scope) for i, item in enumerate(doc["slots"])]
        if len({s.path for s in slots}) != len(slots) or len(set(dirs)) != len(dirs):
            raise ValueError("a path is named twice")
        for path in [*dirs, *(s.path for s in slots)]:
            link = fs.symlink_on_the_way(site, path.parent)
            if link is not None:
                raise ValueError(f"{path}: {link} on the way is a symlink (-> {os.readlink(link)})")
        return cls(site, doc["kind"], slots, dirs, receipt)

    # -- changes: each one stashes the original first ---------------------------------------

    def make_dirs(self) -> None:
        for directory in self.dirs:
            fs.mkdir(self.site, directory, 0o755)

    def put(self, path: Path, data: bytes | None = None, *, link: Path | None = None, mode: int = 0o644) -> None:
        """Swap `path` to new content (bytes, or a hard link to `link`), in the mode and owner
        of the file it replaces (`mode` for a new file)."""
        slot = self.by_path[path]
        like = fs.lstat(self.site, path)
        owner = (like.st_uid, like.st_gid) if like else None
        if fs.exists(self.site, slot.new):
            fs.unlink(self.site, slot.new)
        if data is not None:
            fs.write_new(self.site, slot.new, data, stat.S_IMODE(like.st_mode) if like else mode, owner)
        elif link is not None:
            fs.link(self.site, link, slot.new)
        else:
            raise TypeError(f"put {path}: neither data nor a link to put there")
        self._stash(slot)
        fs.replace(self.site, slot.new, path)

    def remove(self, path: Path) -> None:
        slot = self.by_path[path]
        if slot.orig is not None and fs.exists(self.site, path) and not fs.exists(self.site, slot.orig):
            fs.rename(self.site, path, slot.orig)

    def _stash(self, slot: Slot) -> None:
        if slot.orig is None or fs.exists(self.site, slot.orig):
            return
        try:
            fs.link(self.site, slot.path, slot.orig)
        except PermissionError:  # fs.protected_hardlinks: not our inode; a rename keeps it too
            fs.rename(self.site, slot.path, slot.orig)

    # -- the two ways out -------------------------------------------------------------------

    def commit(self) -> None:
        """The point of no return: everything is durable, then journal.json -> index.json."""
        parents = {s.path.parent for s in self.slots if _is_dir(fs.lstat(self.site, s.path.parent))}
        for directory in sorted({self.dir} | parents):
            fs.fsync(self.site, directory)
        fs.replace(self.site, self.dir / JOURNAL, self.dir / INDEX)

    def rollback(self) -> list[str]:
        """Put every original back; one line per path that could not be (the stash then stays)."""
        failures = []
        for slot in reversed(self.slots):
            try:
                self._restore(slot)
            except OSError as exc:
                kept = f"its original is kept at {slot.orig}" if slot.orig else "it did not exist before"
                failures.append(f"{slot.path} ({reason(exc)}; {kept})")
        for directory in reversed(self.dirs):
            try:
                fs.rmdir(self.site, directory)
            except OSError:
                pass  # absent, or holds files someone else put there
        if not failures:
            self._discard()
        return failures

    def _restore(self, slot: Slot) -> None:
        if slot.orig is None:
            # A path that did not exist: ours to delete inside the site; outside it, only a receipt.
            if fs.exists(self.site, slot.path) and (slot.path.is_relative_to(self.site) or _is_receipt(slot.path)):
                fs.unlink(self.site, slot.path)
        elif fs.exists(self.site, slot.orig):
            # Two links to one inode (killed between link and swap): rename is a no-op, and the
            # stash is discarded with its directory.
            fs.replace(self.site, slot.orig, slot.path)
        if fs.exists(self.site, slot.new):
            fs.unlink(self.site, slot.new)

    def finish(self) -> None:
        """After the commit point: apply keeps the originals, revert drops them."""
        self._drop_outside()
        if self.kind == "apply":
            keep = {INDEX} | {s.orig.name for s in self.slots if s.orig and s.orig.parent == self.dir}
            for leftover in fs.listdir(self.site, self.dir):
                if leftover not in keep:
                    fs.unlink(self.site, self.dir / leftover)
            fs.remove_tree(self.site, self.site / ORIGINALS_DIR_NAME)
            fs.rename(self.site, self.dir, self.site / ORIGINALS_DIR_NAME)
        else:
            fs.remove_tree(self.site, self.site / ORIGINALS_DIR_NAME)
            fs.remove_tree(self.site, self.dir)
        fsync_dir(self.site)

    def _discard(self) -> None:
        self._drop_outside()
        fs.remove_tree(self.site, self.dir)

    def _drop_outside(self) -> None:
        for slot in self.slots:
            for stashed in (slot.orig, slot.new):
                if stashed is not None and stashed.parent != self.dir and fs.exists(self.site, stashed):
                    fs.unlink(self.site, stashed)


def _rel(path: Path, base: Path) -> str:
    return path.relative_to(base).as_posix() if path.is_relative_to(base) else str(path)


def _slot(site: Path, txn_dir: Path, index: int, path: Path, existed: bool) -> Slot:
    orig, new = _stash_names(site, txn_dir, index, path)
    return Slot(path, orig if existed else None, new)


def _stash_names(site: Path, txn_dir: Path, index: int, path: Path) -> tuple[Path, Path]:
    """Where slot `index` keeps `path`'s original and stages its new content: in the
    transaction directory, or (a receipt outside the site) beside the path."""
    base = txn_dir / str(index) if path.is_relative_to(site) else path.parent / f".{path.name}.vllm-overlay"
    return base.with_name(base.name + ".orig"), base.with_name(base.name + ".new")


def _path(site: Path, text, absolute: bool = False) -> Path:
    """A path as `document` writes it: relative to the site and normalised (no '', '.', '..'
    part), or, where `absolute`, an absolute normalised path outside the site."""
    if not isinstance(text, str) or not text or "\0" in text:
        raise ValueError(f"{text!r}: not a path")
    if text.startswith("/"):
        path = Path(text)
        if not absolute or os.path.normpath(text) != text or path.is_relative_to(site):
            raise ValueError(f"{text!r}: an absolute path where a path relative to {site} belongs")
        return path
    if any(part in ("", ".", "..") for part in text.split("/")):
        raise ValueError(f"{text!r}: not a normalised path inside {site}")
    return site / text


def _slot_from(site: Path, txn_dir: Path, index: int, item, receipt: Path, scope: Scope) -> Slot:
    if not isinstance(item, dict) or set(item) != {"path", "orig", "new"}:
        raise ValueError(f"slots[{index}]: expected exactly the keys new, orig, path")
    path = _path(site, item["path"], absolute=True)
    if path != receipt and path not in scope.receipts and not scope.holds(path):
        raise ValueError(f"slots[{index}]: {path} is neither a file the manifest manages nor a receipt")
    orig, new = _stash_names(site, txn_dir, index, path)
    if item["new"] != _rel(new, txn_dir) or item["orig"] not in (None, _rel(orig, txn_dir)):
        raise ValueError(f"slots[{index}]: stash names {item['orig']!r}, {item['new']!r} are not the ones "
                         f"this tool writes for {path}")
    return Slot(path, orig if item["orig"] else None, new)


def _is_dir(st: os.stat_result | None) -> bool:
    return st is not None and stat.S_ISDIR(st.st_mode)


def _is_receipt(path: Path) -> bool:
    try:
        return looks_like_receipt(read_regular(path))
    except OSError:
        return False


# --- the stash directories ---------------------------------------------------------------------


def stash_problem(site: Path, name: str, owned: bool = True) -> str | None:
    """Why SITE/name is not a stash directory this tool may use (None: absent, or one). A
    FIFO, a file, a symlink or someone else's directory there is not ours: following it,
    opening it or emptying it could hang or act outside the site. `owned`: it must belong
    to this process's user (verify, which only reads, runs as any user)."""
    path = site / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISDIR(st.st_mode) and (not owned or st.st_uid == os.geteuid()):
        return None
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        what = f"a {'dangling ' if not os.path.exists(path) else ''}symlink (-> {target})"
    elif stat.S_ISDIR(st.st_mode):
        what = f"a directory owned by uid {st.st_uid} (this run's user is uid {os.geteuid()})"
    else:
        what = fs.what_is(st)
    return (f"{path} is {what}, not a stash directory this tool made. Nothing was changed. If no apply or "
            f"revert of yours is running, look at it and move it away (`mv {path} {path}.moved`), then re-run")


def check_stashes(site: Path) -> None:
    for name in (TXN_DIR_NAME, ORIGINALS_DIR_NAME):
        problem = stash_problem(site, name)
        if problem:
            raise OverlayError(CANNOT_WRITE, problem)


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


def recover(site: Path, scope: Scope, version: str) -> str | None:
    """Under the exclusive lock, the stash directories checked: finish or roll back what a
    killed apply/revert left. Returns what was done (None: nothing was left). `version`: the
    vLLM to reinstall if it cannot."""
    txn_dir = site / TXN_DIR_NAME
    if not fs.exists(site, txn_dir):
        return None
    with signals_held():
        names = fs.listdir(site, txn_dir)
        for name, verb in ((INDEX, "finished"), (JOURNAL, "rolled back")):
            if name in names:
                txn = _read_document(site, txn_dir / name, scope, version)
                _complete(site, txn, name)
                return f"{site}: {verb} the {txn.kind} a killed run left unfinished"
        fs.remove_tree(site, txn_dir)  # killed before its journal existed: it had changed nothing
    return f"{site}: removed the empty {txn_dir} of a killed run"


def _complete(site: Path, txn: Transaction, name: str) -> None:
    if name == INDEX:
        txn.finish()
        return
    failures = txn.rollback()
    if failures:
        raise OverlayError(CANNOT_WRITE, f"{site}: rolling back the interrupted {txn.kind}: {restore_failed(site, failures)}")


def read_document(site: Path, path: Path, scope: Scope) -> Transaction:
    """A journal or index, validated (Transaction.from_document); raises OSError or ValueError."""
    try:
        doc = json.loads(fs.read(site, path))
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    return Transaction.from_document(site, doc, path.parent, scope)


def _read_document(site: Path, path: Path, scope: Scope, version: str) -> Transaction:
    try:
        txn = read_document(site, path, scope)
    except (OSError, ValueError) as exc:
        raise OverlayError(CANNOT_WRITE, (
            f"{path}: unreadable, or not a journal this tool writes ({exc}), so what the interrupted run changed "
            f"is unknown; nothing was changed. Reinstall vLLM {version} with the python of the environment that "
            f"holds {site} (`{reinstall_command(version)}`), delete {path.parent} (`rm -r {path.parent}`), "
            "then re-run")) from exc
    if txn.receipt not in scope.receipts:
        raise OverlayError(CANNOT_WRITE, (
            f"{path}: the interrupted {txn.kind} wrote its receipt to {txn.receipt}, but this command names "
            f"{' or '.join(str(r) for r in sorted(scope.receipts))}; a recovery touches a receipt elsewhere only "
            f"when the command names it, so nothing was changed. If that run was given `--receipt {txn.receipt}`, "
            f"re-run with the same --receipt; otherwise reinstall vLLM {version} (`{reinstall_command(version)}`), "
            f"delete {path.parent} (`rm -r {path.parent}`) and re-run"))
    return txn
