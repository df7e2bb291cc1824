"""overlay/vllm-<version>/manifest.json: what one base's overlay replaces, the hashes that prove
it, and why.

{"changes": {"<id>": {"anchors": ["vllm/...py:Name", ...], "introduces": [...], "signatures": [...],
                      "tests": [...], "title": "..."}},
 "files": [{"changes": ["<id>", ...], "overlay_sha256": ..., "path": "vllm/...py",
            "upstream_sha256": ... | null, "why": "..."}],
 "schema": 1, "vllm_version": "0.24.0",
 "wheel": {"filename": "vllm-...whl", "sha256": ...}}

`upstream_sha256` is the sha256 of the file the overlay replaces, read from the pinned wheel;
null marks a new file (the wheel has none), which may never overwrite an installed file.
Entries are sorted by path and the JSON by key, so the bytes are a function of the content.
Only `scripts/overlay.py record` writes it.

The named changes (optional; a manifest without them has neither "changes" key) say what each
file carries: `record` folds them in from the hand-written changes.toml beside it, validated
here. `anchors` are the upstream names (bound symbols like Class.method, or identifiers) a
change's hunks touch in the base file; `introduces` the names it adds there (both place its
hunks); `signatures` are what its presence upstream would look like in a release's source;
`tests` are pytest node ids of its behavioural tests.
`scripts/overlay.py rebase` (dsa_image/rebase/changes.py) reads them.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Callable

from dsa_image.core.atomic import read_regular
from dsa_image.core.wheels import sha256_bytes
from dsa_image.core import status

SCHEMA = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHANGE_ID = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
_TEST_ID = re.compile(r"tests/[A-Za-z0-9_/]+\.py::[A-Za-z_][A-Za-z0-9_]*")
CHANGES_FILE = "changes.toml"  # in the overlay directory, next to manifest.json


class ManifestError(status.DsaImageError):
    """The manifest is missing, malformed, or an entry cannot be recorded."""

    exit_code = status.USAGE


@dataclass(frozen=True)
class Entry:
    path: str  # site-packages relative, POSIX, e.g. vllm/envs.py
    upstream_sha256: str | None  # None: a new file, absent from the wheel
    overlay_sha256: str
    why: str
    changes: tuple[str, ...] = ()  # ids of the named changes this file carries

    @property
    def new(self) -> bool:
        return self.upstream_sha256 is None

    @property
    def module(self) -> str | None:
        """The import name of a .py entry (vllm/a/b.py -> vllm.a.b, vllm/a/__init__.py -> vllm.a)."""
        pure = PurePosixPath(self.path)
        if pure.suffix != ".py":
            return None
        parts = pure.with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@dataclass(frozen=True)
class Signature:
    """What a change looks like upstream: the first of `at` ("path:Qual.name", or "path" for
    the whole file) that exists is checked; it must match `contains` and not match `lacks`
    (Python regexes, multiline), when given."""

    at: tuple[str, ...]
    means: str
    contains: str | None = None
    lacks: str | None = None


@dataclass(frozen=True)
class Change:
    id: str
    title: str
    anchors: tuple[str, ...]  # "path:name", upstream names in the base file
    introduces: tuple[str, ...]  # "path:name", names the change adds to the overlay file
    signatures: tuple[Signature, ...]
    tests: tuple[str, ...]  # pytest node ids, tests/...py::test_name


@dataclass(frozen=True)
class Manifest:
    vllm_version: str
    wheel_filename: str
    wheel_sha256: str
    files: tuple[Entry, ...]
    changes: tuple[Change, ...] = ()  # sorted by id

    def change(self, change_id: str) -> Change | None:
        return next((c for c in self.changes if c.id == change_id), None)

    def entry(self, path: str) -> Entry | None:
        return next((e for e in self.files if e.path == path), None)


def check_path(path: str) -> str:
    """An entry path must be a plain relative POSIX path inside the vllm package."""
    pure = PurePosixPath(path)
    if (not path or pure.is_absolute() or "\\" in path or any(p in ("", ".", "..") for p in path.split("/"))
            or pure.parts[0] != "vllm" or len(pure.parts) < 2):
        raise ManifestError(f"{path!r}: entry paths are relative paths under vllm/ (e.g. vllm/envs.py)")
    return path


def _sha(value, where: str) -> str:
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise ManifestError(f"{where}: expected a sha256 (64 lower-case hex), found {value!r}")
    return value


def _sha_or_none(value, where: str) -> str | None:
    """A sha256, or None: the upstream sha256 of a file the overlay adds."""
    return None if value is None else _sha(value, where)


def parse_manifest(data: bytes, where: str = "manifest.json") -> Manifest:
    try:
        doc = json.loads(data)
    except ValueError as exc:  # not UTF-8, not JSON, or an integer past Python's int-from-text digit limit
        raise ManifestError(f"{where}: not valid JSON ({exc})") from exc
    except RecursionError:
        raise ManifestError(f"{where}: JSON nested too deeply to be a manifest") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ManifestError(f"{where}: expected a JSON object with \"schema\": {SCHEMA}")
    unknown = set(doc) - {"schema", "vllm_version", "wheel", "files", "changes"}
    wheel, files, version = doc.get("wheel"), doc.get("files"), doc.get("vllm_version")
    if unknown or not isinstance(version, str) or not isinstance(wheel, dict) or not isinstance(files, list):
        raise ManifestError(f"{where}: expected keys schema, vllm_version (string), wheel (object), "
                            f"files (list){'; unknown: ' + ', '.join(sorted(unknown)) if unknown else ''}")
    if not isinstance(wheel.get("filename"), str):
        raise ManifestError(f"{where}: wheel.filename must be a string")
    entries = tuple(_parse_entry(item, f"{where}: files[{i}]") for i, item in enumerate(files))
    paths = [e.path for e in entries]
    if paths != sorted(set(paths)):
        raise ManifestError(f"{where}: files must be sorted by path without duplicates")
    changes = _parse_changes(doc["changes"], where) if "changes" in doc else ()
    manifest = Manifest(version, wheel["filename"], _sha(wheel.get("sha256"), f"{where}: wheel.sha256"), entries, changes)
    check_changes(manifest, where)
    return manifest


def _parse_entry(item, where: str) -> Entry:
    keys = {"path", "upstream_sha256", "overlay_sha256", "why"}
    if not isinstance(item, dict) or set(item) - {"changes"} != keys:
        raise ManifestError(f"{where}: expected exactly the keys {', '.join(sorted(keys))} (and changes)")
    ids = item.get("changes", [])
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids) or ids != sorted(set(ids)):
        raise ManifestError(f"{where}: changes must be a sorted list of change ids without duplicates")
    if not isinstance(item["path"], str) or not isinstance(item["why"], str) or not item["why"].strip():
        raise ManifestError(f"{where}: path and why must be non-empty strings")
    try:
        path = check_path(item["path"])
    except ManifestError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    return Entry(
        path=path,
        upstream_sha256=_sha_or_none(item["upstream_sha256"], f"{where}.upstream_sha256"),
        overlay_sha256=_sha(item["overlay_sha256"], f"{where}.overlay_sha256"),
        why=item["why"],
        changes=tuple(ids),
    )


def manifest_bytes(manifest: Manifest) -> bytes:
    named = bool(manifest.changes)
    doc = {
        "schema": SCHEMA,
        "vllm_version": manifest.vllm_version,
        "wheel": {"filename": manifest.wheel_filename, "sha256": manifest.wheel_sha256},
        "files": [
            {"path": e.path, "upstream_sha256": e.upstream_sha256, "overlay_sha256": e.overlay_sha256, "why": e.why,
             **({"changes": sorted(e.changes)} if named else {})}
            for e in sorted(manifest.files, key=lambda e: e.path)
        ],
    }
    if named:
        doc["changes"] = {c.id: _change_doc(c) for c in manifest.changes}
    return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def load_manifest(path: Path) -> tuple[Manifest, bytes]:
    """The parsed manifest and its exact bytes (the receipt records their sha256)."""
    try:
        data = read_regular(path)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        where = repr(str(path)) if "\0" in str(path) else path
        raise ManifestError(f"{where}: cannot read the manifest ({getattr(exc, 'strerror', None) or exc})") from exc
    return parse_manifest(data, str(path)), data


# --- recording: the only way entries and their hashes change ------------------------------


def record_entry(path: str, why: str | None, overlay_dir: Path, upstream: Callable[[str], bytes | None],
                 previous: Entry | None) -> Entry:
    """A fresh entry for `path`: hashes recomputed from overlay_dir and the wheel (`upstream`
    reads a member of it), `why` given or kept from the previous entry."""
    check_path(path)
    why = (why or "").strip() or (previous.why if previous else "")
    if not why:
        raise ManifestError(f"{path}: a new entry needs --why (one line on why this file is overlaid)")
    if "\n" in why:
        raise ManifestError(f"{path}: --why is one line")
    source = overlay_dir / path
    if not source.is_file():
        raise ManifestError(f"{source}: no such overlay file")
    original = upstream(path)
    return Entry(path, None if original is None else sha256_bytes(original), sha256_bytes(source.read_bytes()), why)


def with_entry(manifest: Manifest, entry: Entry) -> Manifest:
    others = [e for e in manifest.files if e.path != entry.path]
    return replace(manifest, files=tuple(sorted([*others, entry], key=lambda e: e.path)))


def without_entry(manifest: Manifest, path: str) -> Manifest:
    if manifest.entry(path) is None:
        raise ManifestError(f"{path}: not in the manifest")
    return replace(manifest, files=tuple(e for e in manifest.files if e.path != path))


# --- named changes: changes.toml beside the manifest, folded into it by `record` --------------


def _strings(value, where: str, allow_empty: bool = True) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value) or (not value and not allow_empty):
        raise ManifestError(f"{where}: expected a {'' if allow_empty else 'non-empty '}list of non-empty strings")
    if len(set(value)) != len(value):
        raise ManifestError(f"{where}: duplicate entries")
    return tuple(value)


def _located(value: str, where: str, need_name: bool) -> str:
    """"path:name" (name: a dotted Python name) or, unless need_name, a bare path."""
    path, _, name = value.partition(":")
    try:
        check_path(path)
    except ManifestError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    if (need_name or name) and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", name):
        raise ManifestError(f"{where}: {value!r} is not path:Name (e.g. vllm/a.py:Class.method)")
    return value


def _regex(value, where: str) -> str | None:
    if value is None:
        return None
    try:
        re.compile(value, re.MULTILINE)
    except (re.error, TypeError) as exc:
        raise ManifestError(f"{where}: not a regular expression ({exc})") from None
    return value


def _parse_signature(item, where: str) -> Signature:
    if not isinstance(item, dict) or not {"at", "means"} <= set(item) <= {"at", "means", "contains", "lacks"}:
        raise ManifestError(f"{where}: expected keys at, means and optionally contains, lacks")
    at = [item["at"]] if isinstance(item["at"], str) else item["at"]
    at = tuple(_located(v, f"{where}.at", need_name=False) for v in _strings(at, f"{where}.at", allow_empty=False))
    if not isinstance(item["means"], str) or not item["means"].strip():
        raise ManifestError(f"{where}.means: one line on what the signature shows")
    return Signature(at, item["means"], _regex(item.get("contains"), f"{where}.contains"),
                     _regex(item.get("lacks"), f"{where}.lacks"))


def _parse_change(change_id: str, item, where: str, extra: frozenset[str] = frozenset()) -> Change:
    if not _CHANGE_ID.fullmatch(change_id):
        raise ManifestError(f"{where}: change id {change_id!r}: lower-case words joined by '-'")
    keys = {"title", "anchors", "introduces", "signatures", "tests"}
    if not isinstance(item, dict) or set(item) != keys | (extra & set(item)):
        raise ManifestError(f"{where}: expected the keys {', '.join(sorted(keys | extra))}")
    if not isinstance(item["title"], str) or not item["title"].strip() or "\n" in item["title"]:
        raise ManifestError(f"{where}.title: one non-empty line")
    anchors = tuple(_located(a, f"{where}.anchors", need_name=True) for a in _strings(item["anchors"], f"{where}.anchors"))
    introduces = tuple(_located(a, f"{where}.introduces", need_name=True)
                       for a in _strings(item["introduces"], f"{where}.introduces"))
    tests = _strings(item["tests"], f"{where}.tests")
    bad = [t for t in tests if not _TEST_ID.fullmatch(t)]
    if bad:
        raise ManifestError(f"{where}.tests: {bad[0]!r} is not a pytest node id like tests/test_x.py::test_y")
    if not isinstance(item["signatures"], list):
        raise ManifestError(f"{where}.signatures: expected a list")
    signatures = tuple(_parse_signature(s, f"{where}.signatures[{i}]") for i, s in enumerate(item["signatures"]))
    return Change(change_id, item["title"], anchors, introduces, signatures, tests)


def _parse_changes(doc, where: str) -> tuple[Change, ...]:
    if not isinstance(doc, dict) or not doc:
        raise ManifestError(f"{where}: changes must be a non-empty object of change id -> change")
    return tuple(_parse_change(k, doc[k], f"{where}: changes.{k}") for k in sorted(doc))


def _change_doc(change: Change) -> dict:
    signatures = [{"at": list(s.at), "means": s.means, **({"contains": s.contains} if s.contains else {}),
                   **({"lacks": s.lacks} if s.lacks else {})} for s in change.signatures]
    return {"title": change.title, "anchors": list(change.anchors), "introduces": list(change.introduces),
            "signatures": signatures, "tests": list(change.tests)}


def check_changes(manifest: Manifest, where: str) -> None:
    """Every file carries at least one defined change, every defined change is carried by a
    file, and a change's anchors lie in upstream files that carry it."""
    if not manifest.changes:
        named = [e.path for e in manifest.files if e.changes]
        if named:
            raise ManifestError(f"{where}: {named[0]} names changes, but the manifest defines none")
        return
    defined = {c.id for c in manifest.changes}
    for entry in manifest.files:
        if not entry.changes:
            raise ManifestError(f"{where}: {entry.path} carries no named change; list it in a change's files")
        unknown = sorted(set(entry.changes) - defined)
        if unknown:
            raise ManifestError(f"{where}: {entry.path} names undefined change(s) {', '.join(unknown)}")
    used = {i for e in manifest.files for i in e.changes}
    for change in manifest.changes:
        if change.id not in used:
            raise ManifestError(f"{where}: change {change.id} is carried by no file")
        for anchor in change.anchors:
            carrier = manifest.entry(anchor.partition(":")[0])
            if carrier is None or change.id not in carrier.changes or carrier.new:
                raise ManifestError(f"{where}: change {change.id}: anchor {anchor} must lie in an upstream file "
                                    "(not a new one) that carries the change")
        for name in change.introduces:
            carrier = manifest.entry(name.partition(":")[0])
            if carrier is None or change.id not in carrier.changes:
                raise ManifestError(f"{where}: change {change.id}: {name} must lie in a file that carries the change")


def load_changes(path: Path) -> tuple[tuple[Change, ...], dict[str, tuple[str, ...]]]:
    """The changes a changes.toml defines, and the files each is carried by."""
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, not TOML, an integer past the digit limit
        raise ManifestError(f"{path}: cannot read the named changes ({exc})") from exc
    if set(doc) != {"changes"} or not isinstance(doc["changes"], dict) or not doc["changes"]:
        raise ManifestError(f"{path}: expected only [changes.<id>] tables")
    changes, files_of = [], {}
    for change_id in sorted(doc["changes"]):
        item = doc["changes"][change_id]
        where = f"{path}: changes.{change_id}"
        changes.append(_parse_change(change_id, item, where, extra=frozenset({"files"})))
        if not isinstance(item, dict) or "files" not in item:
            raise ManifestError(f"{where}: needs files = [the overlay paths that carry it]")
        files_of[change_id] = tuple(check_path(p) for p in _strings(item["files"], f"{where}.files", allow_empty=False))
    return tuple(changes), files_of


def with_changes(manifest: Manifest, changes: tuple[Change, ...], files_of: dict[str, tuple[str, ...]],
                 where: str) -> Manifest:
    """The manifest with `changes` defined and each entry's change ids derived from files_of."""
    for change_id, paths in files_of.items():
        missing = [p for p in paths if manifest.entry(p) is None]
        if missing:
            raise ManifestError(f"{where}: change {change_id} lists {missing[0]}, which has no manifest entry")
    files = tuple(replace(e, changes=tuple(sorted(i for i, paths in files_of.items() if e.path in paths)))
                  for e in manifest.files)
    folded = replace(manifest, files=files, changes=tuple(sorted(changes, key=lambda c: c.id)))
    check_changes(folded, where)
    return folded


def fold_changes(manifest: Manifest, changes_path: Path) -> Manifest:
    """What `record` writes: the named changes from changes_path, or none when it is absent."""
    if not changes_path.exists():
        return replace(manifest, changes=(), files=tuple(replace(e, changes=()) for e in manifest.files))
    changes, files_of = load_changes(changes_path)
    return with_changes(manifest, changes, files_of, str(changes_path))
