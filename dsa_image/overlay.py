"""Put the overlay (overlay/vllm/...) over an installed vLLM, and prove it is there.

Stdlib only and never imports vLLM: `apply` runs in a bare Docker build stage (Debian python3
plus the venv), on machines without a GPU, and on a bare copy of the files it replaces.

  check   the repo agrees with itself: manifest <-> overlay files <-> pinned wheel(s)
  apply   fail closed, all or nothing: verify every upstream file, copy, refresh bytecode,
          re-hash, write a receipt; any failure restores every file
  verify  re-hash the installed files against the receipt, then import each overlaid module
          in a fresh interpreter and check that it comes from the installed path
  diff    unified diff of each overlay file against its upstream file in the pinned wheel
  record  add or refresh manifest entries (the only writer of overlay hashes)
"""

from __future__ import annotations

import difflib
import email.parser
import importlib.util
import json
import os
import py_compile
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import wheels
from .manifest import Entry, Manifest, ManifestError, load_manifest, manifest_bytes, parse_manifest, record_entry, with_entry, without_entry
from .recipe import DEFAULT_RECIPE, RECIPES_DIR, REPO_ROOT, Recipe, RecipeError, load_recipe

OVERLAY_DIR = REPO_ROOT / "overlay"
MANIFEST_PATH = OVERLAY_DIR / "manifest.json"
RECEIPT_NAME = "vllm_overlay_receipt.json"
RECEIPT_SCHEMA = 1
REFERENCE_PLATFORM = "linux/amd64"  # the wheel `record` and `diff` read upstream files from

# Exit codes, documented in scripts/overlay.py --help.
OK = 0
MISMATCH = 1  # installed state disagrees with the receipt / manifest, or a module is shadowed
BAD_INPUT = 2  # usage, recipe, manifest, overlay tree, target without vLLM
DRIFT = 3  # the installed (or pinned) vLLM is not the one the overlay was made for
CANNOT_WRITE = 4  # read-only target or a failed write; everything was restored


class OverlayError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def _short(sha: str | None) -> str:
    return sha[:12] if sha else "(none)"


# --- inputs -------------------------------------------------------------------------------


def load_inputs(recipe_id: str, manifest_path: Path, recipes_dir: Path = RECIPES_DIR) -> tuple[Recipe, Manifest, bytes]:
    """Recipe and manifest, required to describe the same vLLM."""
    try:
        recipe = load_recipe(recipe_id, recipes_dir)
        manifest, raw = load_manifest(manifest_path)
    except (RecipeError, ManifestError) as exc:
        raise OverlayError(BAD_INPUT, str(exc)) from exc
    pinned = {w.sha256 for w in recipe.wheels.values()}
    if manifest.vllm_version != recipe.vllm_version or manifest.wheel_sha256 not in pinned:
        raise OverlayError(BAD_INPUT, (
            f"{manifest_path}: made for vLLM {manifest.vllm_version} ({manifest.wheel_filename} "
            f"{_short(manifest.wheel_sha256)}), but recipe {recipe.id} pins vLLM {recipe.vllm_version}. "
            "Run `python3 scripts/overlay.py record --refresh` after re-basing the overlay."))
    return recipe, manifest, raw


def read_overlay_files(manifest: Manifest, overlay_dir: Path) -> dict[str, bytes]:
    """Every overlay file's bytes, each required to hash to its manifest entry."""
    contents = {}
    for entry in manifest.files:
        source = overlay_dir / entry.path
        try:
            data = source.read_bytes()
        except OSError as exc:
            raise OverlayError(BAD_INPUT, f"{source}: overlay file missing or unreadable ({exc.strerror or exc}); "
                                          "restore it or drop it with `record --remove`") from exc
        found = wheels.sha256_bytes(data)
        if found != entry.overlay_sha256:
            raise OverlayError(BAD_INPUT, (
                f"{source}: has sha256 {_short(found)}, the manifest records {_short(entry.overlay_sha256)}. "
                "If the edit is intended run `python3 scripts/overlay.py record --refresh`."))
        contents[entry.path] = data
    return contents


def installed_vllm_version(site: Path) -> str:
    """The Version of vLLM's dist-info in `site` (read from METADATA, vLLM is never imported)."""
    if not site.is_dir():
        raise OverlayError(BAD_INPUT, f"{site}: not a directory")
    found = []
    for info in sorted(site.glob("*.dist-info")):
        metadata = info / "METADATA"
        if info.name.lower().startswith("vllm-") and metadata.is_file():
            headers = email.parser.HeaderParser().parsestr(metadata.read_text(errors="replace"))
            if (headers.get("Name") or "").lower() == "vllm":
                found.append(headers.get("Version") or "")
    if len(found) != 1 or not found[0]:
        what = "no vllm-*.dist-info/METADATA" if not found else f"{len(found)} vLLM dist-infos ({', '.join(found)})"
        raise OverlayError(BAD_INPUT, f"{site}: {what}; point --site-packages at the site-packages holding one vLLM install")
    return found[0]


# --- check ----------------------------------------------------------------------------------


def unrecorded_files(manifest: Manifest, overlay_dir: Path) -> list[str]:
    """Files under overlay/ that no manifest entry covers (bytecode and the manifest aside)."""
    recorded = {e.path for e in manifest.files}
    present = []
    for path in sorted(overlay_dir.rglob("*")):
        rel = path.relative_to(overlay_dir).as_posix()
        if path.is_file() and rel != "manifest.json" and "__pycache__" not in path.parts and path.suffix != ".pyc":
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
                    f"{entry.path}: the manifest records upstream sha256 {_short(entry.upstream_sha256)}, "
                    f"{wheel.filename} has {_short(found)}. Re-base the overlay file, then run "
                    "`python3 scripts/overlay.py record --refresh`."))
        report.append(f"{wheel.filename}: {len(manifest.files)} entries agree")
    return report


def _fetch(filename: str, sha256: str) -> Path:
    try:
        return wheels.ensure_wheel(filename, sha256)
    except wheels.WheelError as exc:
        raise OverlayError(BAD_INPUT, str(exc)) from exc


# --- apply ----------------------------------------------------------------------------------


@dataclass
class _Transaction:
    """What apply changed, so that any failure can put every byte back."""

    originals: dict[Path, tuple[bytes, int] | None]  # path -> (bytes, mode), None = did not exist

    def remember(self, path: Path) -> None:
        if path not in self.originals:
            self.originals[path] = (path.read_bytes(), path.stat().st_mode & 0o7777) if path.exists() else None

    def rollback(self) -> list[str]:
        failures = []
        for path, original in reversed(list(self.originals.items())):
            try:
                if original is None:
                    path.unlink(missing_ok=True)
                else:
                    _write_atomic(path, original[0], original[1])
            except OSError as exc:
                failures.append(f"{path}: {exc}")
        return failures


def _write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write via a temp file in the same directory and rename: readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _probe_writable(directory: Path) -> None:
    """Create and remove a temp file: catches read-only mounts even for root (os.access does not)."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".overlay-probe.")
    os.close(fd)
    os.unlink(tmp)


def stale_bytecode(source: Path) -> list[Path]:
    """Every cached .pyc of `source` (any interpreter tag, any optimization level)."""
    cache = source.parent / "__pycache__"
    return sorted(cache.glob(f"{source.stem}.*.pyc")) if cache.is_dir() else []


def _drift_problems(site: Path, manifest: Manifest, installed_version: str) -> list[str]:
    problems = []
    made_for = f"the overlay was made for vLLM {manifest.vllm_version}"
    rebuild = (f"Nothing was changed. Rebuild the overlay against the installed version or install "
               f"vLLM {manifest.vllm_version}.")
    for entry in manifest.files:
        target = site / entry.path
        if entry.new:
            if target.exists() or target.is_symlink():
                problems.append(f"{entry.path}: {made_for} where this file is new, but it exists in the target "
                                f"(installed vLLM {installed_version}); a new file never overwrites one. {rebuild}")
            elif not target.parent.is_dir():
                problems.append(f"{entry.path}: {made_for}, but its directory is missing in the installed "
                                f"vLLM {installed_version}. {rebuild}")
            continue
        if not target.is_file():
            problems.append(f"{entry.path}: {made_for} (upstream sha256 {_short(entry.upstream_sha256)}), "
                            f"but the installed vLLM {installed_version} has no such file. {rebuild}")
            continue
        found = wheels.sha256_file(target)
        if found == entry.overlay_sha256 and found != entry.upstream_sha256:
            problems.append(f"{entry.path}: already carries the overlay (sha256 {_short(found)}). Nothing was "
                            f"changed. apply runs once, on a clean install of vLLM {manifest.vllm_version}.")
        elif found != entry.upstream_sha256:
            problems.append(f"{entry.path}: {made_for} (upstream sha256 {_short(entry.upstream_sha256)}), but the "
                            f"installed file has sha256 {_short(found)} and the installed vLLM is {installed_version}. {rebuild}")
    if not problems and installed_version != manifest.vllm_version:
        problems.append(f"{made_for}, but the installed vLLM is {installed_version} (every replaced file "
                        f"still matches, the rest of vLLM may not). {rebuild}")
    return problems


def apply(site: Path, recipe_id: str = DEFAULT_RECIPE, manifest_path: Path = MANIFEST_PATH,
          overlay_dir: Path = OVERLAY_DIR, receipt_path: Path | None = None,
          recipes_dir: Path = RECIPES_DIR) -> dict:
    """Overlay `site` (a site-packages dir) and write the receipt; all or nothing."""
    recipe, manifest, raw = load_inputs(recipe_id, manifest_path, recipes_dir)
    contents = read_overlay_files(manifest, overlay_dir)
    installed_version = installed_vllm_version(site)
    problems = _drift_problems(site, manifest, installed_version)
    if problems:
        raise OverlayError(DRIFT, "\n".join(problems))
    receipt_path = receipt_path or site / RECEIPT_NAME
    _check_writable(site, manifest, receipt_path)
    transaction = _Transaction({})
    try:
        receipt = _install(site, manifest, contents, transaction, recipe.id, raw)
        transaction.remember(receipt_path)
        _write_atomic(receipt_path, receipt_bytes(receipt))
    except (OSError, py_compile.PyCompileError, OverlayError) as exc:
        failures = transaction.rollback()
        restored = ("every file was restored" if not failures
                    else f"RESTORE FAILED for {'; '.join(failures)}: reinstall vLLM {manifest.vllm_version}")
        raise OverlayError(CANNOT_WRITE, f"{site}: apply failed ({exc}); {restored}") from exc
    return receipt


def _check_writable(site: Path, manifest: Manifest, receipt_path: Path) -> None:
    directories = {(site / e.path).parent for e in manifest.files}
    directories |= {d / "__pycache__" for d in directories if (d / "__pycache__").is_dir()}
    directories.add(receipt_path.parent)
    for directory in sorted(directories):
        try:
            _probe_writable(directory)
        except OSError as exc:
            raise OverlayError(CANNOT_WRITE, f"{directory}: cannot write ({exc.strerror or exc}). Nothing was changed.") from exc


def _install(site: Path, manifest: Manifest, contents: dict[str, bytes], transaction: _Transaction,
             recipe_id: str, manifest_raw: bytes) -> dict:
    for entry in manifest.files:
        target = site / entry.path
        transaction.remember(target)
        original = transaction.originals[target]
        _write_atomic(target, contents[entry.path], original[1] if original else 0o644)
    for entry in manifest.files:
        target = site / entry.path
        if target.suffix == ".py":
            _refresh_bytecode(target, transaction)
    for entry in manifest.files:
        installed = wheels.sha256_file(site / entry.path)
        if installed != entry.overlay_sha256:
            raise OverlayError(CANNOT_WRITE, f"{entry.path}: installed copy has sha256 {_short(installed)}, "
                                             f"expected {_short(entry.overlay_sha256)}")
    return expected_receipt(recipe_id, manifest, manifest_raw)


def expected_receipt(recipe_id: str, manifest: Manifest, manifest_raw: bytes) -> dict:
    """The receipt apply writes for this manifest once every installed file is the overlay's:
    a function of the manifest alone, so its sha256 is known before any build."""
    files = [{"path": e.path, "upstream_sha256": e.upstream_sha256, "overlay_sha256": e.overlay_sha256,
              "installed_sha256": e.overlay_sha256} for e in manifest.files]
    return {"schema": RECEIPT_SCHEMA, "recipe": recipe_id, "vllm_version": manifest.vllm_version,
            "manifest_sha256": wheels.sha256_bytes(manifest_raw), "files": files}


def predicted_receipt_sha256(recipe_id: str = DEFAULT_RECIPE, manifest_path: Path = MANIFEST_PATH) -> str:
    """sha256 of the receipt an image built from this manifest must carry (its label)."""
    manifest, manifest_raw = load_manifest(manifest_path)
    return wheels.sha256_bytes(receipt_bytes(expected_receipt(recipe_id, manifest, manifest_raw)))


def _refresh_bytecode(source: Path, transaction: _Transaction) -> None:
    """Drop every cached .pyc of `source`, then compile it. CHECKED_HASH pycs carry the source's
    hash instead of its mtime: reproducible bytes, and never trusted for a different source."""
    for stale in stale_bytecode(source):
        transaction.remember(stale)
        stale.unlink()
    cfile = Path(importlib.util.cache_from_source(str(source)))
    transaction.remember(cfile)
    cfile.parent.mkdir(exist_ok=True)
    py_compile.compile(str(source), cfile=str(cfile), doraise=True,
                       invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)


def receipt_bytes(receipt: dict) -> bytes:
    return (json.dumps(receipt, indent=2, sort_keys=True) + "\n").encode()


# --- verify ---------------------------------------------------------------------------------


def load_receipt(path: Path) -> dict:
    try:
        receipt = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise OverlayError(MISMATCH, f"{path}: no receipt; run `scripts/overlay.py apply` first (or pass --receipt)") from None
    except (OSError, ValueError) as exc:
        raise OverlayError(MISMATCH, f"{path}: receipt unreadable or not JSON ({exc}); re-run apply on a clean vLLM") from exc
    keys = {"schema", "recipe", "vllm_version", "manifest_sha256", "files"}
    file_keys = {"path", "upstream_sha256", "overlay_sha256", "installed_sha256"}
    if (not isinstance(receipt, dict) or set(receipt) != keys or receipt["schema"] != RECEIPT_SCHEMA
            or not isinstance(receipt["files"], list)
            or not all(isinstance(f, dict) and set(f) == file_keys for f in receipt["files"])):
        raise OverlayError(MISMATCH, f"{path}: not a schema {RECEIPT_SCHEMA} overlay receipt (tampered or truncated)")
    return receipt


def _check_receipt(receipt: dict, receipt_path: Path, manifest: Manifest, manifest_raw: bytes) -> None:
    """The receipt must be the one apply writes for this manifest: any edit to it shows here."""
    manifest_sha = wheels.sha256_bytes(manifest_raw)
    if receipt["manifest_sha256"] != manifest_sha:
        raise OverlayError(MISMATCH, f"{receipt_path}: written for manifest sha256 {_short(receipt['manifest_sha256'])}, "
                                     f"the manifest is {_short(manifest_sha)}; re-apply on a clean vLLM")
    if receipt != expected_receipt(receipt["recipe"], manifest, manifest_raw):
        raise OverlayError(MISMATCH, f"{receipt_path}: does not match what apply writes for this manifest (tampered receipt)")


def verify(site: Path, manifest_path: Path = MANIFEST_PATH, receipt_path: Path | None = None,
           python: str = sys.executable) -> list[str]:
    """Re-hash, then import in a fresh interpreter; raise OverlayError(MISMATCH) on any difference."""
    manifest, lines = verify_hashes(site, manifest_path, receipt_path)
    return lines + check_imports(site, manifest.files, python)


def verify_hashes(site: Path, manifest_path: Path = MANIFEST_PATH,
                  receipt_path: Path | None = None) -> tuple[Manifest, list[str]]:
    """The receipt is the one apply wrote for this manifest, and every installed file still
    hashes to it."""
    try:
        manifest, raw = load_manifest(manifest_path)
    except ManifestError as exc:
        raise OverlayError(BAD_INPUT, str(exc)) from exc
    receipt_path = receipt_path or site / RECEIPT_NAME
    receipt = load_receipt(receipt_path)
    _check_receipt(receipt, receipt_path, manifest, raw)
    installed_version = installed_vllm_version(site)
    if installed_version != receipt["vllm_version"]:
        raise OverlayError(MISMATCH, f"{site}: the receipt is for vLLM {receipt['vllm_version']}, the installed vLLM is {installed_version}")
    for item in receipt["files"]:
        target = site / item["path"]
        found = wheels.sha256_file(target) if target.is_file() else None
        if found != item["installed_sha256"]:
            raise OverlayError(MISMATCH, f"{item['path']}: installed file has sha256 {_short(found)}, the receipt "
                                         f"records {_short(item['installed_sha256'])} (changed after apply)")
    return manifest, [f"{len(receipt['files'])} files match the receipt {receipt_path}"]


_IMPORT_PROBE = """
import importlib, json, sys
modules, out = json.loads(sys.argv[1]), sys.argv[2]
result = {"sys_path": sys.path, "modules": {}}
for name in modules:
    try:
        result["modules"][name] = {"file": getattr(importlib.import_module(name), "__file__", None)}
    except BaseException as exc:
        result["modules"][name] = {"error": f"{type(exc).__name__}: {exc}"}
with open(out, "w") as f:
    json.dump(result, f)
"""


def check_imports(site: Path, entries: tuple[Entry, ...], python: str = sys.executable, timeout: float = 600) -> list[str]:
    """Import every overlaid module in a fresh `python` (cwd: an empty temp dir, environment as
    is, so a PYTHONPATH checkout or an editable install would win and be caught) and require
    its __file__ to be the installed path."""
    expected = {e.module: (site / e.path) for e in entries if e.module}
    with tempfile.TemporaryDirectory(prefix="overlay-verify-") as cwd:
        out = Path(cwd) / "result.json"
        done = subprocess.run([python, "-c", _IMPORT_PROBE, json.dumps(sorted(expected)), str(out)],
                              cwd=cwd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0 or not out.exists():
            raise OverlayError(MISMATCH, f"{python}: import probe failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        result = json.loads(out.read_text())
    on_path = {os.path.realpath(p) for p in result["sys_path"] if p}
    site_note = "" if os.path.realpath(site) in on_path else (
        f" ({site} is not on sys.path of {python}; run verify with the python of that environment: --python)")
    lines = []
    for module, path in sorted(expected.items()):
        got = result["modules"][module]
        if "error" in got:
            raise OverlayError(MISMATCH, f"{module}: import failed in {python}: {got['error']}{site_note}")
        if not got["file"] or os.path.realpath(got["file"]) != os.path.realpath(path):
            raise OverlayError(MISMATCH, f"{module}: imported from {got['file']}, not the installed {path} "
                                         f"(shadowed by PYTHONPATH, an editable install or a checkout){site_note}")
        lines.append(f"{module}: {got['file']}")
    return lines


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
    except (RecipeError, ManifestError) as exc:
        raise OverlayError(BAD_INPUT, str(exc)) from exc
    _write_atomic(manifest_path, manifest_bytes(manifest))
    return manifest
