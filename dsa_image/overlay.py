"""Put the overlay (overlay/vllm/...) over an installed vLLM, prove it is there, take it off.

Stdlib only and never imports vLLM: `apply` runs in a bare Docker build stage (Debian python3
plus the venv), on machines without a GPU, and on a bare copy of the files it replaces.

  check   the repo agrees with itself: manifest <-> overlay files <-> pinned wheel(s)
  apply   fail closed, all or nothing: verify every upstream file, copy, refresh bytecode,
          re-hash, write a receipt, as one transaction (lock, journal, stash of every
          original; any failure or signal restores every file) -- overlay_apply, overlay_txn
  revert  the inverse transaction: upstream vLLM back from the originals apply kept
  verify  re-hash the installed files against the receipt, then import each overlaid module
          in a fresh interpreter and check that what runs is compiled from the installed
          file -- overlay_verify
  diff    unified diff of each overlay file against its upstream file in the pinned wheel
  record  add or refresh manifest entries (the only writer of overlay hashes)

This module is the public face: everything other modules and scripts use is importable from
here. docs/overlay.md describes the transaction, recovery and exit codes.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from . import wheels
from .atomic import write_atomic
from .manifest import (CHANGES_FILE, Manifest, ManifestError, fold_changes, manifest_bytes, parse_manifest, record_entry,
                       with_entry, without_entry)
from .overlay_apply import apply, check_receipt_target, check_writable, drift_problems, revert
from .overlay_core import (BAD_INPUT, CANNOT_WRITE, CONFLICT, DRIFT, LOCK_TIMEOUT, MANIFEST_PATH, MISMATCH, OK,
                           ORIGINALS_DIR_NAME, OVERLAY_DIR, RECEIPT_NAME, RECEIPT_SCHEMA, REFERENCE_PLATFORM,
                           TXN_DIR_NAME, Interrupted, OverlayError, cache_path, expected_receipt, installed_vllm_version,
                           load_inputs, load_receipt, predicted_receipt_sha256, read_overlay_files, receipt_bytes,
                           stale_bytecode)
from .overlay_verify import check_imports, verify, verify_hashes
from .recipe import DEFAULT_RECIPE, Recipe, RecipeError, load_recipe

__all__ = [
    "BAD_INPUT", "CANNOT_WRITE", "CONFLICT", "DRIFT", "LOCK_TIMEOUT", "MANIFEST_PATH", "MISMATCH", "OK", "ORIGINALS_DIR_NAME",
    "OVERLAY_DIR", "RECEIPT_NAME", "RECEIPT_SCHEMA", "REFERENCE_PLATFORM", "TXN_DIR_NAME", "Interrupted",
    "OverlayError", "apply", "cache_path", "check", "check_imports", "check_receipt_target", "check_writable",
    "diff", "drift_problems", "expected_receipt", "installed_vllm_version", "load_inputs", "load_receipt",
    "predicted_receipt_sha256", "read_overlay_files", "receipt_bytes", "record", "reference_wheel", "revert",
    "stale_bytecode", "unrecorded_files", "verify", "verify_hashes",
]


# --- check ----------------------------------------------------------------------------------


def unrecorded_files(manifest: Manifest, overlay_dir: Path) -> list[str]:
    """Files under overlay/ that no manifest entry covers (bytecode and the manifest aside)."""
    recorded = {e.path for e in manifest.files}
    present = []
    for path in sorted(overlay_dir.rglob("*")):
        rel = path.relative_to(overlay_dir).as_posix()
        if (path.is_file() and rel not in ("manifest.json", CHANGES_FILE) and "__pycache__" not in path.parts
                and path.suffix != ".pyc"):
            present.append(rel)
    return [p for p in present if p not in recorded]


def check(recipe_id: str = DEFAULT_RECIPE, manifest_path: Path = MANIFEST_PATH, overlay_dir: Path = OVERLAY_DIR,
          platforms: list[str] | None = None) -> list[str]:
    """Raise on the first inconsistency; return one line per verified wheel."""
    recipe, manifest, _ = load_inputs(recipe_id, manifest_path)
    read_overlay_files(manifest, overlay_dir)
    stray = unrecorded_files(manifest, overlay_dir)
    if stray:
        raise OverlayError(BAD_INPUT, f"{overlay_dir}: not in the manifest: {', '.join(stray)}; "
                                      "record them with `python3 scripts/overlay.py record PATH --why TEXT`")
    report = []
    for platform in platforms or list(recipe.wheels):
        wheel = recipe.wheel(platform)
        path = _fetch(wheel.filename, wheel.sha256)
        for entry in manifest.files:
            original = wheels.read_member(path, entry.path)
            found = None if original is None else wheels.sha256_bytes(original)
            if found != entry.upstream_sha256:
                raise OverlayError(DRIFT, (
                    f"{entry.path}: the manifest records upstream sha256 {entry.upstream_sha256}, "
                    f"{wheel.filename} has {found}. Re-base the overlay file, then run "
                    "`python3 scripts/overlay.py record --refresh`."))
        report.append(f"{wheel.filename}: {len(manifest.files)} entries agree")
    return report


def _fetch(filename: str, sha256: str) -> Path:
    try:
        return wheels.ensure_wheel(filename, sha256)
    except wheels.WheelError as exc:
        raise OverlayError(BAD_INPUT, str(exc)) from exc


# --- diff and record ------------------------------------------------------------------------


def reference_wheel(recipe: Recipe) -> Path:
    wheel = recipe.wheel(REFERENCE_PLATFORM)
    return _fetch(wheel.filename, wheel.sha256)


def diff(recipe_id: str = DEFAULT_RECIPE, manifest_path: Path = MANIFEST_PATH, overlay_dir: Path = OVERLAY_DIR) -> str:
    recipe, manifest, _ = load_inputs(recipe_id, manifest_path)
    contents = read_overlay_files(manifest, overlay_dir)
    wheel = reference_wheel(recipe)
    chunks = []
    for entry in manifest.files:
        upstream = wheels.read_member(wheel, entry.path)
        old = upstream.decode().splitlines(keepends=True) if upstream is not None else []
        fromfile = f"a/{entry.path} (vLLM {manifest.vllm_version} wheel)" if upstream is not None else "/dev/null"
        chunks.extend(difflib.unified_diff(old, contents[entry.path].decode().splitlines(keepends=True),
                                           fromfile=fromfile, tofile=f"b/{entry.path} (overlay)"))
    return "".join(chunks)


def record(paths: list[str], why: str | None = None, refresh: bool = False, remove: bool = False,
           recipe_id: str = DEFAULT_RECIPE, manifest_path: Path = MANIFEST_PATH,
           overlay_dir: Path = OVERLAY_DIR) -> Manifest:
    """Add/update entries for `paths` (or every entry with `refresh`), or drop them (`remove`);
    the manifest is rewritten for the recipe's pinned wheel."""
    try:
        recipe = load_recipe(recipe_id)
        wheel = recipe.wheel(REFERENCE_PLATFORM)
        current = (parse_manifest(manifest_path.read_bytes(), str(manifest_path)) if manifest_path.exists()
                   else Manifest(recipe.vllm_version, wheel.filename, wheel.sha256, ()))
        explicit = [p.removeprefix("overlay/") for p in paths]
        paths = sorted({*explicit, *(e.path for e in current.files)}) if refresh else explicit
        manifest = Manifest(recipe.vllm_version, wheel.filename, wheel.sha256, current.files)
        if remove:
            for path in paths:
                manifest = without_entry(manifest, path)
        else:
            archive = reference_wheel(recipe)
            for path in paths:
                entry = record_entry(path, why if path in explicit else None, overlay_dir, lambda member: wheels.read_member(archive, member),
                                     current.entry(path))
                manifest = with_entry(manifest, entry)
        manifest = fold_changes(manifest, overlay_dir / CHANGES_FILE)
    except (RecipeError, ManifestError) as exc:
        raise OverlayError(BAD_INPUT, str(exc)) from exc
    write_atomic(manifest_path, manifest_bytes(manifest))
    return manifest
