"""apply and revert: plan every change and check it all before touching anything, then make
the changes as one transaction (overlay_txn: lock, journal, stash, rollback on any failure or
signal, recovery after a kill). `dsa_image.overlay.cli` re-exports both; import from there."""

from __future__ import annotations

import contextlib
import importlib.util
import marshal
import os
import re
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsa_image.overlay import fs
from dsa_image.overlay import txn
from dsa_image.core.atomic import read_regular
from dsa_image.overlay.manifest import Entry, Manifest, ManifestError, load_manifest
from dsa_image.overlay.core import BAD_INPUT, CANNOT_WRITE, DRIFT, LOCK_TIMEOUT, ORIGINALS_DIR_NAME, RECEIPT_NAME, TOOL, TXN_DIR_NAME, OverlayError, cache_path, expected_receipt, file_sha256, installed_vllm_version, is_bytecode_of, load_inputs, looks_like_receipt, read_overlay_files, receipt_bytes, reinstall_advice, require_dir, stale_bytecode
from dsa_image.core.recipe import RECIPES_DIR

Report = Callable[[str], None] | None
PROBE_PREFIX = ".overlay-probe."  # check_writable's temp files: a killed run's are removed by the next one
_PROBE = re.compile(re.escape(PROBE_PREFIX) + r"[a-z0-9_]{8}")  # what tempfile.mkstemp makes of the prefix


def _absolute(path: Path) -> Path:
    if "\0" in str(path):
        raise OverlayError(BAD_INPUT, f"{str(path)!r}: a path cannot contain a NUL byte")
    return Path(os.path.abspath(path))


def _scope(site: Path, manifest: Manifest, receipt: Path | None) -> txn.Scope:
    """What a journal or index in `site` may name: the manifest's files, and the receipts this
    run trusts (the default one and the caller's --receipt; none read from disk)."""
    return txn.Scope(frozenset(site / e.path for e in manifest.files),
                     frozenset({site / RECEIPT_NAME, *([receipt] if receipt else [])}))


def _prepare(site: Path, manifest: Manifest, receipt: Path | None, report: Report) -> str | None:
    """Under the exclusive lock, before anything is planned: the stash directories must be
    ours, and what a killed run left (a transaction, writability probes) is finished or
    rolled back. Returns what recovery did (None: nothing)."""
    txn.check_stashes(site)
    note = txn.recover(site, _scope(site, manifest, receipt), manifest.vllm_version)
    if note and report:
        report(note)
    remove_probes(site, probe_dirs(site, manifest, receipt or site / RECEIPT_NAME))
    return note


def managed_paths(site: Path, manifest: Manifest) -> list[Path]:
    """Every installed path the manifest's entries cover: the files, and each .py file's
    bytecode (present, and the one this interpreter writes)."""
    paths = [site / e.path for e in manifest.files]
    for source in (p for p in list(paths) if p.suffix == ".py"):
        paths += [*stale_bytecode(source), cache_path(source)]
    return list(dict.fromkeys(paths))


def no_symlinks(site: Path, manifest: Manifest, paths: list[Path]) -> None:
    """apply and revert act on real files in real directories of the site only: a symlink
    there could lead anywhere (overlay_fs refuses one swapped in later, too)."""
    for path in paths:
        link = fs.symlink_on_the_way(site, path)
        if link is not None:
            raise OverlayError(CANNOT_WRITE, (
                f"{link} is a symlink (-> {os.readlink(link)}), where vLLM installs a real "
                f"{'directory' if link != path else 'file'}; apply and revert never act through a symlink in "
                f"{site}. Nothing was changed. {reinstall_advice(manifest.vllm_version, site)} after removing it "
                f"(`rm {link}`), then re-run"))


# --- apply ------------------------------------------------------------------------------------


def apply(site: Path, recipe_id: str, manifest_path: Path, overlay_dir: Path, receipt_path: Path | None = None,
          recipes_dir: Path = RECIPES_DIR, lock_timeout: float = LOCK_TIMEOUT, report: Report = None) -> dict:
    """Overlay `site` (a site-packages dir) and write the receipt; all or nothing."""
    recipe, manifest, raw = load_inputs(recipe_id, manifest_path, recipes_dir)
    contents = read_overlay_files(manifest, overlay_dir)
    site = _absolute(site)
    require_dir(site)
    receipt_path = check_receipt_target(site, manifest, _absolute(receipt_path or site / RECEIPT_NAME))
    receipt = expected_receipt(recipe.id, manifest, raw)
    with txn.site_lock(site, exclusive=True, timeout=lock_timeout):
        recovered = _prepare(site, manifest, receipt_path, report)
        if recovered and _carries(site, manifest, receipt_path, receipt_bytes(receipt)):
            # A killed revert rolled back, or a killed apply finished: what apply makes is there.
            if report:
                report(f"{site}: the overlay is applied, with its receipt {receipt_path}")
            return receipt
        paths = list(dict.fromkeys([*managed_paths(site, manifest), receipt_path]))
        no_symlinks(site, manifest, paths)
        dirs = _new_caches(site, manifest)
        problems = drift_problems(site, manifest, installed_vllm_version(site))
        if problems:
            raise OverlayError(DRIFT, "\n".join(problems))
        check_writable(site, manifest, receipt_path)
        txn.run(site, "apply", paths, dirs, receipt_path,
                lambda t: _install(t, site, manifest, contents, receipt_path, receipt_bytes(receipt)))
    return receipt


def _carries(site: Path, manifest: Manifest, receipt_path: Path, receipt: bytes) -> bool:
    """The receipt apply would write is there and every file is the overlay's."""
    try:
        if fs.read(site, receipt_path) != receipt:
            return False
    except OSError:
        return False
    return all(file_sha256(site / e.path, site) == e.overlay_sha256 for e in manifest.files)


def check_receipt_target(site: Path, manifest: Manifest, receipt_path: Path, action: str = "apply replaces",
                         ours: bool | None = None) -> Path:
    """The receipt goes to a path outside the packages the overlay manages, and replaces at
    most an earlier receipt: never a module, a FIFO, or any other file a typo could name. A
    regular file at `ours` paths (default: SITE/vllm_overlay_receipt.json) is taken as an
    earlier receipt whatever it holds (a truncated or tampered one is still ours)."""
    ours = receipt_path == site / RECEIPT_NAME if ours is None else ours
    resolved = Path(os.path.realpath(receipt_path))
    real_site = Path(os.path.realpath(site))
    guarded = sorted({real_site / e.path.split("/")[0] for e in manifest.files}
                     | {real_site / TXN_DIR_NAME, real_site / ORIGINALS_DIR_NAME})
    for directory in guarded:
        if resolved.is_relative_to(directory):
            raise OverlayError(BAD_INPUT, f"{receipt_path}: the receipt may not go inside {directory}, which the "
                                          "overlay manages; nothing was changed. Leave --receipt out or name a "
                                          "path outside it")
    try:
        mode = os.lstat(receipt_path).st_mode
    except FileNotFoundError:
        return receipt_path
    if not stat.S_ISREG(mode) or not (ours or looks_like_receipt(read_regular(receipt_path))):
        what = "is not a regular file" if not stat.S_ISREG(mode) else "exists and is not an overlay receipt"
        raise OverlayError(BAD_INPUT, f"{receipt_path}: {what}; {action} only an overlay receipt, so nothing "
                                      "was changed. Move it away or name another --receipt")
    return receipt_path


def drift_problems(site: Path, manifest: Manifest, installed_version: str) -> list[str]:
    """One line per reason the installed files are not the ones the overlay was made for,
    each saying what to do; empty when apply may go ahead."""
    problems = [p for e in manifest.files if (p := _entry_problem(site, manifest, e, installed_version))]
    wanted = manifest.vllm_version
    if not problems and installed_version != wanted:
        problems.append(f"the overlay was made for vLLM {wanted}, but the installed vLLM is {installed_version} "
                        f"(every replaced file still matches, the rest of vLLM may not). Nothing was changed. "
                        f"Install vLLM {wanted} (`python -m pip install vllm=={wanted}`) or re-base the overlay "
                        f"on vLLM {installed_version}.")
    return problems


def _entry_problem(site: Path, manifest: Manifest, entry: Entry, installed: str) -> str | None:
    target = site / entry.path
    made_for = f"the overlay was made for vLLM {manifest.vllm_version}"
    reinstall = f"Nothing was changed. {reinstall_advice(manifest.vllm_version, site)}, then re-run apply."
    found = file_sha256(target, site)
    if entry.new:
        if found == entry.overlay_sha256:
            return None  # ours, left by an earlier apply (pip --force-reinstall keeps it): same bytes
        if os.path.lexists(target):
            return (f"{entry.path}: {made_for} where this file is new, but {target} exists (sha256 {found}, the "
                    f"overlay's is {entry.overlay_sha256}) in the installed vLLM {installed}; apply never overwrites "
                    f"a file it did not write. Nothing was changed. If it is not yours, move it away "
                    f"(`mv {target} {target}.moved`) and re-run apply.")
        if not target.parent.is_dir():
            return f"{entry.path}: {made_for}, but its directory is missing in the installed vLLM {installed}. {reinstall}"
        return None
    if found == entry.upstream_sha256:
        return None
    if found == entry.overlay_sha256:
        return (f"{entry.path}: already carries the overlay (sha256 {found}). Nothing was changed. apply runs once: "
                f"`{TOOL} verify --site-packages {site}` checks an applied overlay, `{TOOL} revert --site-packages "
                f"{site}` returns to upstream vLLM {manifest.vllm_version} (then apply again).")
    if found is None:
        return (f"{entry.path}: {made_for} (upstream sha256 {entry.upstream_sha256}), but the installed vLLM "
                f"{installed} has no such file. {reinstall}")
    return (f"{entry.path}: {made_for} (upstream sha256 {entry.upstream_sha256}), but the installed file has sha256 "
            f"{found} and the installed vLLM is {installed}. {reinstall}")


def probe_dirs(site: Path, manifest: Manifest, receipt_path: Path) -> list[Path]:
    """Every directory apply writes to."""
    directories = {site} | {(site / e.path).parent for e in manifest.files}
    directories |= {d / "__pycache__" for d in directories if (d / "__pycache__").is_dir()}
    directories.add(receipt_path.parent)
    return sorted(directories)


def check_writable(site: Path, manifest: Manifest, receipt_path: Path) -> None:
    """Create and remove a temp file in every directory apply writes to: catches read-only
    mounts even for root (os.access does not), before anything changes. One a SIGKILL left
    is removed by the next apply or revert (remove_probes, under the lock)."""
    for directory in probe_dirs(site, manifest, receipt_path):
        try:
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=PROBE_PREFIX)
            os.close(fd)
            os.unlink(tmp)
        except OSError as exc:
            raise OverlayError(CANNOT_WRITE, f"{directory}: cannot write ({exc.strerror or exc}). Nothing was changed.") from exc


def remove_probes(site: Path, directories: list[Path]) -> None:
    """The writability probes a killed run left: regular files of check_writable's names only."""
    for directory in directories:
        try:
            names = fs.listdir(site, directory)
        except OSError:
            continue  # absent, or not a real directory (apply refuses that later, saying why)
        for name in filter(_PROBE.fullmatch, names):
            with contextlib.suppress(OSError):  # read-only: check_writable then says so
                st = fs.lstat(site, directory / name)
                if st is not None and stat.S_ISREG(st.st_mode):
                    fs.unlink(site, directory / name)


def _new_caches(site: Path, manifest: Manifest) -> list[Path]:
    """The __pycache__ directories apply creates (the journal lists them, with every path
    apply may change, before the first change)."""
    caches = [(site / e.path).parent / "__pycache__" for e in manifest.files if e.path.endswith(".py")]
    return [cache for cache in dict.fromkeys(caches) if not fs.exists(site, cache)]


def checked_pyc(source: Path, data: bytes) -> bytes:
    """The CHECKED_HASH bytecode py_compile writes for `data` at `source` (PEP 552: magic,
    flags, the source's hash, the code): Python re-hashes the source before trusting it, and
    it has no mtime in it (reproducible). Made here, so that it is staged like any content."""
    code = compile(data, str(source), "exec", dont_inherit=True)
    return importlib.util.MAGIC_NUMBER + (0b11).to_bytes(4, "little") + importlib.util.source_hash(data) + marshal.dumps(code)


def _install(t: txn.Transaction, site: Path, manifest: Manifest, contents: dict[str, bytes],
             receipt_path: Path, receipt: bytes) -> None:
    t.make_dirs()
    for entry in manifest.files:
        t.put(site / entry.path, contents[entry.path])
    for entry in (e for e in manifest.files if e.path.endswith(".py")):
        source = site / entry.path
        cfile = cache_path(source)
        for stale in stale_bytecode(source):
            if stale != cfile:
                t.remove(stale)
        t.put(cfile, checked_pyc(source, contents[entry.path]), mode=_bytecode_mode(site, source))
    for entry in manifest.files:
        installed = file_sha256(site / entry.path, site)
        if installed != entry.overlay_sha256:
            raise OverlayError(CANNOT_WRITE, f"{entry.path}: installed copy has sha256 {installed}, "
                                             f"expected {entry.overlay_sha256}")
    t.put(receipt_path, receipt)


def _bytecode_mode(site: Path, source: Path) -> int:
    """The mode of a source's bytecode: the source's own, without its execute bits."""
    status = fs.lstat(site, source)
    if status is None:  # this apply wrote it a moment ago: something else is changing the target
        raise OverlayError(CANNOT_WRITE, f"{source}: gone right after it was written")
    return stat.S_IMODE(status.st_mode) & 0o666


# --- revert -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Op:
    path: Path
    source: Path | None  # hard-link this original into place; None: delete the path


def revert(site: Path, manifest_path: Path, receipt_path: Path | None = None,
           lock_timeout: float = LOCK_TIMEOUT, report: Report = None) -> list[str]:
    """Put upstream vLLM back: every replaced file (and its bytecode) from the originals apply
    kept, the overlay's new files, their bytecode, the receipt and the originals removed. All
    or nothing. Files pip already reinstalled are left as they are (only our leftovers go)."""
    try:
        manifest, _ = load_manifest(manifest_path)
    except ManifestError as exc:
        raise OverlayError(BAD_INPUT, str(exc)) from exc
    site = _absolute(site)
    require_dir(site)
    given = _absolute(receipt_path) if receipt_path else None
    with txn.site_lock(site, exclusive=True, timeout=lock_timeout):
        _prepare(site, manifest, given, report)
        no_symlinks(site, manifest, [*managed_paths(site, manifest), given or site / RECEIPT_NAME])
        originals, recorded_receipt, made_dirs = _originals(site, manifest)
        receipt = given or _recorded_receipt(site, recorded_receipt)
        receipt_ops = _revert_receipt(site, manifest, receipt, ours=given is None)
        problems: list[str] = []
        notes: list[str] = []
        ops = [op for e in manifest.files for op in _revert_entry(site, manifest, e, originals, problems, notes)]
        ops += receipt_ops
        if problems:
            raise OverlayError(DRIFT, "\n".join(problems))
        if not ops and not fs.exists(site, site / ORIGINALS_DIR_NAME):
            return notes + [f"{site}: nothing to revert (no overlay file, receipt or originals in it)"]
        txn.run(site, "revert", [op.path for op in ops], [], receipt, lambda t: _execute(t, ops))
        for directory in reversed(made_dirs):
            with contextlib.suppress(OSError):  # only empty ones go: the __pycache__ apply made
                fs.rmdir(site, directory)
    return notes + [f"{'restored' if op.source else 'removed'} {op.path}" for op in ops]


def _originals(site: Path, manifest: Manifest) -> tuple[dict[Path, Path], Path | None, list[Path]]:
    """What the last apply kept: path -> its original, where it wrote the receipt, and the
    directories it created. The index is read back like any input (txn.read_document)."""
    directory = site / ORIGINALS_DIR_NAME
    index = directory / txn.INDEX
    if not fs.exists(site, index):
        return {}, None, []  # none: revert asks for a reinstall wherever it needs an original
    scope = _scope(site, manifest, None)
    try:
        kept = txn.read_document(site, index, scope)
    except (OSError, ValueError) as exc:
        raise OverlayError(CANNOT_WRITE, (
            f"{index}: unreadable, or not an index this tool writes ({exc}); nothing was changed. "
            f"{reinstall_advice(manifest.vllm_version, site)}, move the originals away (`mv {directory} "
            f"{directory}.moved`), then re-run revert: it removes the overlay's remaining files")) from exc
    originals = {s.path: s.orig for s in kept.slots if s.orig is not None and scope.holds(s.path)}
    return originals, kept.receipt, kept.dirs


def _recorded_receipt(site: Path, recorded: Path | None) -> Path:
    """Where apply wrote the receipt, by the index: acted on without --receipt only when it is
    the site's default one (a path read from disk never leads outside the site)."""
    default = site / RECEIPT_NAME
    if recorded is None or recorded == default:
        return default
    raise OverlayError(CANNOT_WRITE, (
        f"{site / ORIGINALS_DIR_NAME / txn.INDEX}: names the receipt {recorded}, but revert removes a receipt "
        f"other than {default} only when the command names it; nothing was changed. If apply was given "
        f"`--receipt {recorded}`, run `{TOOL} revert --site-packages {site} --receipt {recorded}`; otherwise "
        f"`{TOOL} revert --site-packages {site} --receipt {default}`"))


def _revert_entry(site: Path, manifest: Manifest, entry: Entry, originals: dict[Path, Path],
                  problems: list[str], notes: list[str]) -> list[_Op]:
    target = site / entry.path
    found = file_sha256(target, site)
    if entry.new:
        if found != entry.overlay_sha256 and fs.exists(site, target):
            notes.append(f"{target}: left alone, it is not the file the overlay added (sha256 {found})")
            return []
        ours = [_Op(target, None)] if fs.exists(site, target) else []
        return ours + _bytecode_back(target, {})
    if found == entry.upstream_sha256:
        return []  # already upstream (pip reinstalled it): its bytecode is pip's too
    original = originals.get(target)
    if found == entry.overlay_sha256 and original is not None and file_sha256(original, site) == entry.upstream_sha256:
        return [_Op(target, original)] + _bytecode_back(target, originals)
    if found == entry.overlay_sha256:
        what = f"carries the overlay, but {site / ORIGINALS_DIR_NAME} keeps no intact original of it"
    else:
        what = (f"has sha256 {found}: neither upstream ({entry.upstream_sha256}) nor the overlay's "
                f"({entry.overlay_sha256})" if found else "is missing")
    problems.append(f"{target}: {what}. Nothing was changed. {reinstall_advice(manifest.vllm_version, site)}, "
                    f"then re-run revert: it removes the overlay's remaining files.")
    return []


def _bytecode_back(source: Path, originals: dict[Path, Path]) -> list[_Op]:
    """The bytecode apply moved aside comes back (valid again: it is the original source
    inode that returns); bytecode written since goes."""
    kept = {p: o for p, o in originals.items() if is_bytecode_of(source, p)}
    return [_Op(p, o) for p, o in sorted(kept.items())] + [_Op(p, None) for p in stale_bytecode(source) if p not in kept]


def _revert_receipt(site: Path, manifest: Manifest, receipt: Path, ours: bool) -> list[_Op]:
    if not fs.exists(site, receipt):
        return []
    check_receipt_target(site, manifest, receipt, "revert deletes", ours)
    return [_Op(receipt, None)]


def _execute(t: txn.Transaction, ops: list[_Op]) -> None:
    for op in ops:
        if op.source is None:
            t.remove(op.path)
        else:
            t.put(op.path, link=op.source)
