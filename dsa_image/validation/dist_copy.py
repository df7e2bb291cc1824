"""Copy a distribution the H200's Python has installed into a validation site, file by file.

Staging does not carry the NVIDIA libraries that torch needs in the site when the H200 already
has them at the lock's version (dsa_image.validation.stage.COPIED): the install phase copies the
H200's installed copy instead. Its RECORD is read as untrusted input, like a wheel's: every
entry must name a regular file inside the installation's site-packages and match the sha256 and
size listed for it, nothing may already exist in the target site, no folder on the way to a
target may be a symlink (it would lead the write out of the site), and a failure removes what
this copy wrote. It runs in the session runner on the device, in the H200's own Python.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import sys
import sysconfig
from importlib import metadata
from pathlib import Path, PurePosixPath
from typing import Callable

from dsa_image.build.lock_parse import normalize
from dsa_image.core import status
from dsa_image.validation import stage

BYTECODE = ".pyc"  # pip records compiled bytecode without a hash: a cache, rebuilt on import


class CopyError(status.DsaImageError):
    """An installed distribution cannot be copied as it is recorded; says what was found."""

    exit_code = status.ENVIRONMENT


def copy_listed(selection: Path, site: Path, say: Callable[[str], None]) -> int:
    """The install phase's step: every pin a bundle's selection.txt leaves to the H200's own
    installation (file column stage.FROM_H200: torch's CUDA libraries at the lock's version)
    copied into `site`. 0, or 1 with the reason on stderr."""
    if not selection.is_file():
        print(f"install: expected {selection} (it rides with the first part); carry it", file=sys.stderr)
        return status.FAILED
    try:
        # the whole file is read before the first copy: a bad line late in it leaves the site untouched
        for name, version in left_to_h200(selection):
            count = copy_dist(name, version, site)
            say(f"{name}=={version}: {count} files of the H200's installation into {site}")
    except (CopyError, OSError) as exc:
        print(f"install: {exc}", file=sys.stderr)
        return status.FAILED
    return status.SUCCESS


def left_to_h200(selection: Path) -> list[tuple[str, str]]:
    """(name, version) of each pin `selection` leaves to the H200's installation, sorted. The
    file came with the bundle, so it is untrusted: a malformed line is a CopyError naming it."""
    try:
        pins = stage.parse_selection(selection.read_text(), str(selection))
    except stage.StageError as exc:
        raise CopyError(str(exc)) from exc
    return sorted((name, version) for name, (version, source) in pins.items() if source == stage.FROM_H200)


def installed_roots() -> list[Path]:
    """This Python's own site-packages (not sys.path: a site on PYTHONPATH is no installation)."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(Path(paths[key]) for key in ("purelib", "platlib")))


def find(name: str, version: str, roots: list[Path]) -> metadata.Distribution:
    """The one installed distribution `name` under `roots`, at `version` (a local label aside)."""
    wanted = normalize(name)
    found = [d for d in metadata.distributions(path=[str(r) for r in roots]) if normalize(d.metadata["Name"]) == wanted]
    if not found:
        raise CopyError(f"{name}=={version}: expected it installed under {', '.join(map(str, roots))}, found none; "
                        "stage it (the H200's record says it has it: run the inventory phase)")
    versions = sorted({d.version for d in found})
    if len(found) > 1 or not stage.same_release(versions[0], version):
        raise CopyError(f"{name}: expected {version} installed, found {', '.join(versions)}; stage it")
    return found[0]


def entries(dist: metadata.Distribution, root: Path) -> list[tuple[PurePosixPath, str | None, int | None]]:
    """(relative path, sha256 in RECORD form or None, size or None) of each RECORD entry, each
    checked to stay inside `root`."""
    files = dist.files
    if files is None:
        raise CopyError(f"{dist.metadata['Name']}: no RECORD under {root}; cannot know its files")
    out = []
    for entry in files:
        path = PurePosixPath(str(entry))
        if path.is_absolute() or ".." in path.parts:
            raise CopyError(f"{dist.metadata['Name']}: RECORD entry {str(entry)!r} is outside {root}; refusing to copy")
        digest = entry.hash.value if entry.hash and entry.hash.mode == "sha256" else None
        if entry.hash and digest is None:
            raise CopyError(f"{dist.metadata['Name']}: RECORD entry {path} has a {entry.hash.mode} hash; expected sha256")
        out.append((path, digest, entry.size))
    return out


def record_hash(data_path: Path) -> str:
    """A file's sha256 as RECORD writes it (urlsafe base64, no padding)."""
    digest = hashlib.sha256()
    with data_path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


def copy_dist(name: str, version: str, site: Path, roots: list[Path] | None = None) -> int:
    """Copy the installed `name`==`version` into `site`; the number of files copied. Entries
    without a hash are RECORD itself and bytecode (not copied); any other is refused."""
    roots = roots or installed_roots()
    dist = find(name, version, roots)
    root = Path(str(dist.locate_file("")))
    plan = [e for e in entries(dist, root) if not e[0].name.endswith(BYTECODE) or e[1]]
    unhashed = [str(p) for p, digest, _ in plan if digest is None and not _is_record(p)]
    if unhashed:
        raise CopyError(f"{name}: RECORD lists {', '.join(unhashed[:3])} without a sha256; cannot verify the copy")
    _refuse_linked_folders(name, [p for p, _, _ in plan], site)
    clashes = [str(p) for p, _, _ in plan if (site / p).exists() or (site / p).is_symlink()]
    if clashes:
        raise CopyError(f"{name}: {site} already has {', '.join(clashes[:3])}; expected a site without {name}")
    written: list[Path] = []
    try:
        for path, digest, size in plan:
            written.append(site / path)
            _copy_one(root / path, site / path, digest, size, name)
    except BaseException:
        _undo(written, site)
        raise
    return len(written)


def _refuse_linked_folders(name: str, paths: list[PurePosixPath], site: Path) -> None:
    """Refuse before copying if a folder on the way to an entry is a symlink in `site`: the copy
    would write wherever it points (a RECORD inside its root is no proof the target stays in the
    site). Each folder is looked at once: a CUDA library lists thousands of files in a few."""
    folders = {folder for path in paths for folder in path.parents if folder.parts}
    linked = {folder for folder in folders if (site / folder).is_symlink()}
    for path in paths:
        folder = next((f for f in reversed(path.parents) if f in linked), None)
        if folder is not None:
            raise CopyError(f"{name}: RECORD entry {path} would be written through {site / folder}, a symlink "
                            f"(to {(site / folder).readlink()}); expected real folders in the site. Remove the "
                            "symlink (or start from a fresh site) and re-run the install phase")


def _undo(written: list[Path], site: Path) -> None:
    """Remove what a failed copy wrote: its files, then the folders it left empty (not `site`)."""
    for target in written:
        target.unlink(missing_ok=True)
    for folder in sorted({p for t in written for p in t.parents if p.is_relative_to(site) and p != site},
                         key=lambda p: len(p.parts), reverse=True):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def _copy_one(source: Path, target: Path, digest: str | None, size: int | None, name: str) -> None:
    if source.is_symlink() or not source.is_file():
        raise CopyError(f"{name}: {source} is not a regular file; expected one (RECORD lists it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    shutil.copymode(source, target)
    if digest is not None and (record_hash(target) != digest or (size is not None and target.stat().st_size != size)):
        raise CopyError(f"{name}: {source} differs from its RECORD (sha256 or size); the H200's installation is "
                        "damaged: stage the wheel instead")


def _is_record(path: PurePosixPath) -> bool:
    return path.name == "RECORD" and path.parent.name.endswith(".dist-info")

