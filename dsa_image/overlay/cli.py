"""Put an overlay (overlay/vllm-<version>/vllm/...) over an installed vLLM, prove it is there,
take it off. There is one overlay per base of the recipe (the vLLM releases it pins); each
manifest names the release it was made for, and every command reads the recipe as seen from
that release.

Stdlib only and never imports vLLM: `apply` runs in a bare Docker build stage (Debian python3
plus the venv), on machines without a GPU, and on a bare copy of the files it replaces.

  check   the repo agrees with itself: manifest <-> overlay files <-> pinned wheel(s), and
          overlay/ holds an overlay for no release the recipe does not pin
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

from dsa_image.core import wheels
from dsa_image.core.atomic import write_atomic
from dsa_image.overlay.manifest import CHANGES_FILE, Manifest, ManifestError, fold_changes, manifest_bytes, parse_manifest, record_entry, with_entry, without_entry
from dsa_image.overlay.apply import apply, check_receipt_target, check_writable, drift_problems, revert
from dsa_image.overlay.core import BAD_INPUT, CANNOT_WRITE, CONFLICT, DRIFT, LOCK_TIMEOUT, MANIFEST_NAME, MISMATCH, OK, ORIGINALS_DIR_NAME, OVERLAY_ROOT, RECEIPT_NAME, RECEIPT_SCHEMA, REFERENCE_PLATFORM, TXN_DIR_NAME, Interrupted, OverlayError, cache_path, expected_receipt, installed_vllm_version, load_inputs, load_receipt, manifest_path, overlay_dir, predicted_receipt_sha256, read_overlay_files, receipt_bytes, stale_bytecode
from dsa_image.overlay.verify import check_imports, verify, verify_hashes
from dsa_image.core.recipe import DEFAULT_RECIPE, RECIPES_DIR, Recipe, RecipeError, load_recipe, vllm_dir

__all__ = [
    "BAD_INPUT", "CANNOT_WRITE", "CONFLICT", "DRIFT", "LOCK_TIMEOUT", "MANIFEST_NAME", "MISMATCH", "OK",
    "ORIGINALS_DIR_NAME", "OVERLAY_ROOT", "RECEIPT_NAME", "RECEIPT_SCHEMA", "REFERENCE_PLATFORM", "TXN_DIR_NAME",
    "Interrupted", "OverlayError", "apply", "cache_path", "check", "check_imports", "check_receipt_target",
    "check_writable", "base_version", "diff", "drift_problems", "expected_receipt", "installed_vllm_version", "load_inputs",
    "load_receipt", "manifest_path", "overlay_dir", "predicted_receipt_sha256", "read_overlay_files", "receipt_bytes",
    "record", "reference_wheel", "resolve_base", "revert", "stale_bytecode", "stray_overlays", "unrecorded_files", "verify",
    "verify_hashes",
]


def base_version(recipe_id: str, vllm: str | None) -> str:
    """The base (vLLM release) `vllm` names, checked against the recipe; None: its default."""
    try:
        return load_recipe(recipe_id, vllm=vllm).vllm_version
    except RecipeError as exc:
        raise OverlayError(BAD_INPUT, str(exc)) from exc


def resolve_base(args, vllm: str | None) -> None:
    """For a command line: args.vllm set to the base `vllm` names (checked; None: the
    recipe's default), args.manifest and args.overlay_dir to that base's unless given."""
    args.vllm = base_version(getattr(args, "recipe", DEFAULT_RECIPE), vllm)
    args.manifest = args.manifest or str(manifest_path(args.vllm))
    args.overlay_dir = args.overlay_dir or str(overlay_dir(args.vllm))


# --- check ----------------------------------------------------------------------------------


def unrecorded_files(manifest: Manifest, overlay_dir: Path) -> list[str]:
    """Files under overlay/ that no manifest entry covers (bytecode and the manifest aside)."""
    recorded = {e.path for e in manifest.files}
    present = []
    for path in sorted(overlay_dir.rglob("*")):
        rel = path.relative_to(overlay_dir).as_posix()
        if (path.is_file() and rel not in (MANIFEST_NAME, CHANGES_FILE) and "__pycache__" not in path.parts
                and path.suffix != ".pyc"):
            present.append(rel)
    return [p for p in present if p not in recorded]


def stray_overlays(recipe: Recipe, root: Path) -> list[str]:
    """What overlay/ holds besides one overlay/vllm-<version>/ per release the recipe pins."""
    wanted = {vllm_dir(v) for v in recipe.vllm_versions}
    return sorted(p.name for p in root.iterdir() if p.name not in wanted) if root.is_dir() else []


def check(recipe_id: str, manifest_path: Path, overlay_dir: Path, platforms: list[str] | None = None,
          recipes_dir: Path = RECIPES_DIR) -> list[str]:
    """Raise on the first inconsistency; return one line per verified wheel."""
    recipe, manifest, _ = load_inputs(recipe_id, manifest_path, recipes_dir)
    # Checking one of this repository's overlays: its siblings must be overlays of pinned releases too.
    foreign = stray_overlays(recipe, OVERLAY_ROOT) if overlay_dir.resolve().parent == OVERLAY_ROOT.resolve() else []
    if foreign:
        raise OverlayError(BAD_INPUT, f"{OVERLAY_ROOT}: {', '.join(foreign)} is not the overlay of a "
                                      f"vLLM release recipe {recipe.id} pins ({', '.join(recipe.vllm_versions)}): "
                                      f"move it into overlay/{vllm_dir('VERSION')}/ or delete it")
    read_overlay_files(manifest, overlay_dir)
    stray = unrecorded_files(manifest, overlay_dir)
    if stray:
        raise OverlayError(BAD_INPUT, f"{overlay_dir}: not in the manifest: {', '.join(stray)}; "
                                      f"record them with `python3 scripts/overlay.py record --vllm {manifest.vllm_version} "
                                      "PATH --why TEXT`")
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
                    f"`python3 scripts/overlay.py record --refresh --vllm {manifest.vllm_version}`."))
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


def diff(recipe_id: str, manifest_path: Path, overlay_dir: Path) -> str:
    recipe, manifest, _ = load_inputs(recipe_id, manifest_path)
    contents = read_overlay_files(manifest, overlay_dir)
    wheel = reference_wheel(recipe)
    chunks: list[str] = []
    for entry in manifest.files:
        upstream = wheels.read_member(wheel, entry.path)
        old = upstream.decode().splitlines(keepends=True) if upstream is not None else []
        fromfile = f"a/{entry.path} (vLLM {manifest.vllm_version} wheel)" if upstream is not None else "/dev/null"
        chunks.extend(difflib.unified_diff(old, contents[entry.path].decode().splitlines(keepends=True),
                                           fromfile=fromfile, tofile=f"b/{entry.path} (overlay)"))
    return "".join(chunks)


def record(paths: list[str], why: str | None, refresh: bool, remove: bool, recipe_id: str, vllm: str,
           manifest_path: Path, overlay_dir: Path) -> Manifest:
    """Add/update entries for `paths` (or every entry with `refresh`), or drop them (`remove`);
    the manifest is rewritten for the pinned wheel of base `vllm`."""
    try:
        recipe = load_recipe(recipe_id, vllm=vllm)
        wheel = recipe.wheel(REFERENCE_PLATFORM)
        current = (parse_manifest(manifest_path.read_bytes(), str(manifest_path)) if manifest_path.exists()
                   else Manifest(recipe.vllm_version, wheel.filename, wheel.sha256, ()))
        explicit = [p.removeprefix(f"overlay/{vllm_dir(recipe.vllm_version)}/") for p in paths]
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
