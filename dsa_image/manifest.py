"""overlay/manifest.json: what the overlay replaces, the hashes that prove it, and why.

{"files": [{"overlay_sha256": ..., "path": "vllm/...py", "upstream_sha256": ... | null,
            "why": "..."}],
 "schema": 1, "vllm_version": "0.24.0",
 "wheel": {"filename": "vllm-...whl", "sha256": ...}}

`upstream_sha256` is the sha256 of the file the overlay replaces, read from the pinned wheel;
null marks a new file (the wheel has none), which may never overwrite an installed file.
Entries are sorted by path and the JSON by key, so the bytes are a function of the content.
Only `scripts/overlay.py record` writes it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Callable

from .wheels import sha256_bytes

SCHEMA = 1
_SHA256 = re.compile(r"[0-9a-f]{64}")


class ManifestError(Exception):
    """The manifest is missing, malformed, or an entry cannot be recorded."""


@dataclass(frozen=True)
class Entry:
    path: str  # site-packages relative, POSIX, e.g. vllm/envs.py
    upstream_sha256: str | None  # None: a new file, absent from the wheel
    overlay_sha256: str
    why: str

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
class Manifest:
    vllm_version: str
    wheel_filename: str
    wheel_sha256: str
    files: tuple[Entry, ...]

    def entry(self, path: str) -> Entry | None:
        return next((e for e in self.files if e.path == path), None)


def check_path(path: str) -> str:
    """An entry path must be a plain relative POSIX path inside the vllm package."""
    pure = PurePosixPath(path)
    if (not path or pure.is_absolute() or "\\" in path or any(p in ("", ".", "..") for p in path.split("/"))
            or pure.parts[0] != "vllm" or len(pure.parts) < 2):
        raise ManifestError(f"{path!r}: entry paths are relative paths under vllm/ (e.g. vllm/envs.py)")
    return path


def _sha(value, where: str, nullable: bool = False) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise ManifestError(f"{where}: expected a sha256 (64 lower-case hex), found {value!r}")
    return value


def parse_manifest(data: bytes, where: str = "overlay/manifest.json") -> Manifest:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ManifestError(f"{where}: expected a JSON object with \"schema\": {SCHEMA}")
    unknown = set(doc) - {"schema", "vllm_version", "wheel", "files"}
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
    return Manifest(version, wheel["filename"], _sha(wheel.get("sha256"), f"{where}: wheel.sha256"), entries)


def _parse_entry(item, where: str) -> Entry:
    keys = {"path", "upstream_sha256", "overlay_sha256", "why"}
    if not isinstance(item, dict) or set(item) != keys:
        raise ManifestError(f"{where}: expected exactly the keys {', '.join(sorted(keys))}")
    if not isinstance(item["path"], str) or not isinstance(item["why"], str) or not item["why"].strip():
        raise ManifestError(f"{where}: path and why must be non-empty strings")
    try:
        path = check_path(item["path"])
    except ManifestError as exc:
        raise ManifestError(f"{where}: {exc}") from None
    return Entry(
        path=path,
        upstream_sha256=_sha(item["upstream_sha256"], f"{where}.upstream_sha256", nullable=True),
        overlay_sha256=_sha(item["overlay_sha256"], f"{where}.overlay_sha256"),
        why=item["why"],
    )


def manifest_bytes(manifest: Manifest) -> bytes:
    doc = {
        "schema": SCHEMA,
        "vllm_version": manifest.vllm_version,
        "wheel": {"filename": manifest.wheel_filename, "sha256": manifest.wheel_sha256},
        "files": [
            {"path": e.path, "upstream_sha256": e.upstream_sha256, "overlay_sha256": e.overlay_sha256, "why": e.why}
            for e in sorted(manifest.files, key=lambda e: e.path)
        ],
    }
    return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def load_manifest(path: Path) -> tuple[Manifest, bytes]:
    """The parsed manifest and its exact bytes (the receipt records their sha256)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"{path}: cannot read the manifest ({exc.strerror or exc})") from exc
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
