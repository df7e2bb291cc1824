"""What apply, revert and verify share: exit codes, the one error type, inputs, the receipt.

`dsa_image.overlay.cli` re-exports all of it; import from there.
"""

from __future__ import annotations

import fnmatch
import json
import signal
import sys
from pathlib import Path

from dsa_image.core import dist_info, status, wheels
from dsa_image.overlay import fs as overlay_fs
from dsa_image.core.atomic import NotRegularFile, read_regular
from dsa_image.overlay.manifest import Manifest, ManifestError, load_manifest
from dsa_image.core.recipe import RECIPES_DIR, REPO_ROOT, Recipe, RecipeError, load_recipe, vllm_dir

# One overlay per base: overlay/vllm-<version>/ mirrors site-packages (vllm/...) and holds the
# manifest and the named changes of the overlay made for that vLLM release.
OVERLAY_ROOT = REPO_ROOT / "overlay"
MANIFEST_NAME = "manifest.json"
RECEIPT_NAME = "vllm_overlay_receipt.json"
RECEIPT_SCHEMA = 1
REFERENCE_PLATFORM = "linux/amd64"  # the wheel `record` and `diff` read upstream files from
# In the target site-packages: the stash and journal of a running apply/revert, and the
# originals an applied overlay replaced (what revert puts back). Dot-names: never importable.
TXN_DIR_NAME = ".vllm_overlay_txn"
ORIGINALS_DIR_NAME = ".vllm_overlay_originals"
LOCK_TIMEOUT = 120.0  # seconds a second apply/revert/verify waits for the target's lock
TOOL = "python3 scripts/overlay.py"

# The tool's exit codes: its names for codes of the one table (dsa_image.core.status), listed
# with what each means here in scripts/overlay.py --help.
OK = status.SUCCESS
MISMATCH = status.FAILED  # installed state disagrees with the receipt / manifest, or a module is shadowed
BAD_INPUT = status.USAGE  # usage, recipe, manifest, overlay tree, target without vLLM
DRIFT = status.DRIFT  # the installed (or pinned) vLLM is not the one the overlay was made for
CANNOT_WRITE = status.ENVIRONMENT  # read-only target, a failed write, a busy lock; everything was restored
CONFLICT = status.CONFLICT  # rebase: the 3-way merge left conflicts; nothing was recorded


def overlay_dir(version: str) -> Path:
    """The overlay made for vLLM `version`."""
    return OVERLAY_ROOT / vllm_dir(version)


def manifest_path(version: str) -> Path:
    return overlay_dir(version) / MANIFEST_NAME


class OverlayError(status.DsaImageError):
    """What stops apply, revert, verify, record or rebase: `exit_code` is one of the codes above."""

    def __init__(self, exit_code: int, message: str):
        super().__init__(message)
        self.exit_code = exit_code


class Interrupted(BaseException):
    """SIGINT/SIGTERM/SIGHUP during a transaction. A BaseException like KeyboardInterrupt, so
    that only the transaction's own handler (which rolls back) stops it."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message or f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


def reinstall_command(version: str) -> str:
    return f"python -m pip install --force-reinstall --no-deps vllm=={version}"


def reinstall_advice(version: str, site: Path) -> str:
    return (f"Reinstall vLLM {version} with the python of the environment that holds {site} "
            f"(`{reinstall_command(version)}`)")


def require_dir(site: Path) -> None:
    try:
        ok = site.is_dir()
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise OverlayError(BAD_INPUT, f"{site}: not a directory; --site-packages takes the site-packages that holds vLLM")


# --- inputs -------------------------------------------------------------------------------


def load_inputs(recipe_id: str, manifest_path: Path, recipes_dir: Path = RECIPES_DIR) -> tuple[Recipe, Manifest, bytes]:
    """The manifest and the recipe as seen from the base it was made for (its vLLM version),
    required to pin exactly the wheel the manifest names."""
    try:
        recipe = load_recipe(recipe_id, recipes_dir)
        manifest, raw = load_manifest(manifest_path)
    except (RecipeError, ManifestError) as exc:
        raise OverlayError(BAD_INPUT, str(exc)) from exc
    if manifest.vllm_version not in recipe.vllm_versions:
        raise OverlayError(BAD_INPUT, (
            f"{manifest_path}: made for vLLM {manifest.vllm_version}, but recipe {recipe.id} pins vLLM "
            f"{', '.join(recipe.vllm_versions)}. Re-base the overlay and run `{TOOL} record --refresh --vllm VERSION`."))
    recipe = load_recipe(recipe_id, recipes_dir, manifest.vllm_version)
    if manifest.wheel_sha256 not in {w.sha256 for w in recipe.wheels.values()}:
        raise OverlayError(BAD_INPUT, (
            f"{manifest_path}: made from {manifest.wheel_filename} {manifest.wheel_sha256}, but recipe {recipe.id} "
            f"pins other vLLM {recipe.vllm_version} wheels. Run `{TOOL} record --refresh --vllm "
            f"{recipe.vllm_version}` after re-basing the overlay."))
    return recipe, manifest, raw


def read_overlay_files(manifest: Manifest, overlay_dir: Path) -> dict[str, bytes]:
    """Every overlay file's bytes, each required to hash to its manifest entry."""
    contents = {}
    for entry in manifest.files:
        source = overlay_dir / entry.path
        try:
            data = read_regular(source)
        except (OSError, ValueError) as exc:
            raise OverlayError(BAD_INPUT, f"{source}: overlay file missing or unreadable ({reason(exc)}); "
                                          "restore it or drop it with `record --remove`") from exc
        found = wheels.sha256_bytes(data)
        if found != entry.overlay_sha256:
            raise OverlayError(BAD_INPUT, (
                f"{source}: has sha256 {found}, the manifest records {entry.overlay_sha256}. "
                f"If the edit is intended run `{TOOL} record --refresh`."))
        contents[entry.path] = data
    return contents


def installed_vllm_version(site: Path) -> str:
    """The Version of vLLM's dist-info in `site` (read from METADATA, vLLM is never imported)."""
    require_dir(site)
    try:
        return dist_info.installed_vllm_version(site)
    except dist_info.DistInfoError as exc:
        raise OverlayError(BAD_INPUT, str(exc)) from None


def reason(exc: BaseException) -> str:
    """The OS's words for an error (strerror), else its text."""
    return getattr(exc, "strerror", None) or str(exc)


def file_sha256(path: Path, site: Path | None = None) -> str | None:
    """sha256 of a regular file at `path`; None when there is none (absent, FIFO, directory).
    With `site`: reached from it without following a symlink (a symlink: None too)."""
    try:
        return wheels.sha256_bytes(overlay_fs.read(site, path) if site else read_regular(path))
    except OSError:
        return None


def stale_bytecode(source: Path) -> list[Path]:
    """Every cached .pyc of `source` in its __pycache__ (any interpreter tag, any optimization)."""
    cache = source.parent / "__pycache__"
    return sorted(cache.glob(f"{source.stem}.*.pyc")) if cache.is_dir() else []


def is_bytecode_of(source: Path, path: Path) -> bool:
    """`path` is one of the names stale_bytecode globs for `source` (a .py file)."""
    return (source.suffix == ".py" and path.parent == source.parent / "__pycache__"
            and fnmatch.fnmatchcase(path.name, f"{source.stem}.*.pyc"))


def cache_path(source: Path) -> Path:
    """Where this interpreter reads `source`'s bytecode from without a pycache prefix: apply
    always writes there, so the file is inside the target whatever PYTHONPYCACHEPREFIX says."""
    return source.parent / "__pycache__" / f"{source.stem}.{sys.implementation.cache_tag}.pyc"


# --- the receipt ----------------------------------------------------------------------------


def expected_receipt(recipe_id: str, manifest: Manifest, manifest_raw: bytes) -> dict:
    """The receipt apply writes for this manifest once every installed file is the overlay's:
    a function of the manifest alone, so its sha256 is known before any build."""
    files = [{"path": e.path, "upstream_sha256": e.upstream_sha256, "overlay_sha256": e.overlay_sha256,
              "installed_sha256": e.overlay_sha256} for e in manifest.files]
    return {"schema": RECEIPT_SCHEMA, "recipe": recipe_id, "vllm_version": manifest.vllm_version,
            "manifest_sha256": wheels.sha256_bytes(manifest_raw), "files": files}


def predicted_receipt_sha256(recipe: Recipe, manifest: Path | None = None) -> str:
    """sha256 of the receipt an image of the recipe's base must carry (its label); `manifest`
    defaults to that base's overlay/vllm-<version>/manifest.json."""
    parsed, manifest_raw = load_manifest(manifest or manifest_path(recipe.vllm_version))
    return wheels.sha256_bytes(receipt_bytes(expected_receipt(recipe.id, parsed, manifest_raw)))


def receipt_bytes(receipt: dict) -> bytes:
    return (json.dumps(receipt, indent=2, sort_keys=True) + "\n").encode()


def looks_like_receipt(data: bytes) -> bool:
    """Some schema's overlay receipt (tampered ones included): a file apply may replace and
    revert may delete, unlike any other file a mistyped --receipt could name."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and {"schema", "files"} <= set(doc)


def load_receipt(path: Path, site: Path | None = None) -> dict:
    where = site or "DIR"
    advice = f"run `{TOOL} revert --site-packages {where}`, then `{TOOL} apply --site-packages {where}`"
    try:
        data = read_regular(path)
    except FileNotFoundError:
        raise OverlayError(MISMATCH, f"{path}: no receipt; run `{TOOL} apply --site-packages {where}` first "
                                     "(or pass --receipt)") from None
    except (NotRegularFile, ValueError) as exc:
        raise OverlayError(BAD_INPUT, f"{path}: not a receipt file ({reason(exc)})") from exc
    except OSError as exc:
        raise OverlayError(MISMATCH, f"{path}: receipt unreadable ({reason(exc)}); {advice}") from exc
    try:
        receipt = json.loads(data)
    except RecursionError:
        raise OverlayError(BAD_INPUT, f"{path}: JSON nested too deeply to be a receipt") from None
    except ValueError as exc:
        raise OverlayError(MISMATCH, f"{path}: receipt not JSON ({exc}); {advice}") from exc
    keys = {"schema", "recipe", "vllm_version", "manifest_sha256", "files"}
    file_keys = {"path", "upstream_sha256", "overlay_sha256", "installed_sha256"}
    if (not isinstance(receipt, dict) or set(receipt) != keys or receipt["schema"] != RECEIPT_SCHEMA
            or not isinstance(receipt["files"], list)
            or not all(isinstance(f, dict) and set(f) == file_keys for f in receipt["files"])):
        raise OverlayError(MISMATCH, f"{path}: not a schema {RECEIPT_SCHEMA} overlay receipt (tampered or truncated); {advice}")
    return receipt
