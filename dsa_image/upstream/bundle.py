"""The upstream tests' bundle: the selected files of a base's sdist, their support files and
upstream's config, extracted into a small directory with `bundle.json` (the sdist's filename
and sha256, the overlaid modules, the selection with the import that selected each file, each
file's sha256, and the third-party modules each selected file needs at import), plus the
upstream-tests lock's packages in `libs/`. `load_bundle` reads one back, every file re-hashed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from dsa_image.build import lock, lock_parse
from dsa_image.core import wheels
from dsa_image.core.recipe import Recipe
from dsa_image.overlay.manifest import Manifest
from dsa_image.upstream.selection import TESTS, Selection, UpstreamTestsError, UpstreamTree, is_test_file, overlaid_modules, select

BUNDLE_SCHEMA = 1
BUNDLE_FILE = "bundle.json"
LIBS = "libs"  # in a bundle: the upstream-tests lock's packages (pip install --target)
# Copied verbatim beside tests/: upstream's pytest configuration (markers, options).
CONFIG_FILES = ("pyproject.toml",)


def read_sdist(sdist: Path, version: str) -> tuple[UpstreamTree, dict[str, bytes]]:
    """The tests tree (.py files under tests/) and the CONFIG_FILES of a vLLM sdist. Members are
    read as bytes, never extracted: a link or a path outside the top directory is ignored."""
    top = f"vllm-{version}"
    files: dict[str, bytes] = {}
    config: dict[str, bytes] = {}
    try:
        with tarfile.open(sdist, "r:gz") as archive:
            for member in archive:
                rel = _member_path(member, top)
                if rel is None:
                    continue
                if rel in CONFIG_FILES:
                    config[rel] = _member_bytes(archive, member, sdist)
                elif rel.startswith(f"{TESTS}/") and rel.endswith(".py"):
                    files[rel] = _member_bytes(archive, member, sdist)
    except (OSError, tarfile.TarError, EOFError) as exc:
        raise UpstreamTestsError(f"{sdist}: cannot read it as a gzip'd tar ({exc}); delete it to download again") from exc
    if f"{TESTS}/conftest.py" not in files:
        raise UpstreamTestsError(f"{sdist}: no {top}/{TESTS}/conftest.py: not a vLLM {version} sdist with its tests")
    return UpstreamTree(files), config


def _member_bytes(archive: tarfile.TarFile, member: tarfile.TarInfo, sdist: Path) -> bytes:
    data = archive.extractfile(member)
    if data is None:  # never for the regular files _member_path passes; refused rather than assumed
        raise UpstreamTestsError(f"{sdist}: {member.name} is not a regular file")
    return data.read()


def _member_path(member: tarfile.TarInfo, top: str) -> str | None:
    if not member.isfile():
        return None
    parts = PurePosixPath(member.name).parts
    if len(parts) < 2 or parts[0] != top or any(p in ("", ".", "..") for p in parts) or "\\" in member.name:
        return None
    return "/".join(parts[1:])


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def selection_doc(selection: Selection, version: str, sdist_filename: str, sdist_sha256: str) -> dict:
    """The part of bundle.json that says what was selected from which sdist, and why."""
    return {
        "vllm_version": version,
        "sdist": {"filename": sdist_filename, "sha256": sdist_sha256},
        "overlaid_modules": list(selection.overlaid),
        "selected": [{"path": s.path, "imports": list(s.imports), "needs": list(s.needs)} for s in selection.selected],
        "support": list(selection.support),
    }


def write_bundle(out: Path, tree: UpstreamTree, config: dict[str, bytes], selection: Selection, doc: dict,
                 install_libs=None) -> dict:
    """Write the selected files, their support files and upstream's config into `out`, which
    must not exist; `install_libs(dir)` (if given) fills `out/libs` and returns the packages it
    installed. Everything goes into a temporary sibling first: a failed bundle leaves nothing."""
    if out.exists():
        raise UpstreamTestsError(f"{out}: exists; a bundle is written into a new directory (remove it, or pick another)")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.partial")
    if staging.exists():
        shutil.rmtree(staging, ignore_errors=True)
    try:
        for rel in [s.path for s in selection.selected] + list(selection.support):
            _write(staging / rel, tree.files[rel])
        for rel, data in config.items():
            _write(staging / rel, data)
        libs = install_libs(staging / LIBS) if install_libs else []
        files = {str(p.relative_to(staging)): _sha256(p.read_bytes()) for p in sorted(staging.rglob("*")) if p.is_file()}
        bundle = {"schema": BUNDLE_SCHEMA, **doc, "config": sorted(config), "libs": libs, "files": files}
        _write(staging / BUNDLE_FILE, (json.dumps(bundle, indent=2, sort_keys=True) + "\n").encode())
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return bundle


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def pinned_sdist(recipe: Recipe) -> Path:
    """The base's sdist from $DSA_IMAGE_CACHE (downloaded when absent); its sha256 must be the
    recipe's pin, checked on every call (wheels.WheelError otherwise)."""
    return wheels.ensure_wheel(recipe.sdist.filename, recipe.sdist.sha256)


def lib_requirements(recipe: Recipe, lock_path: Path) -> str:
    """The recipe's [upstream_tests] packages as pip requirements, each with the hashes of the lock."""
    try:
        pins = lock_parse.parse_lock(lock_path.read_text())
    except (OSError, lock_parse.LockError) as exc:
        raise UpstreamTestsError(f"{lock_path}: cannot read the lock ({exc}); run `{lock.COMPILE_COMMAND}`") from exc
    lines = []
    for name in recipe.upstream_test_packages:
        pin = pins.get(lock_parse.normalize(name))
        if pin is None:
            raise UpstreamTestsError(f"{lock_path}: no pin for {name} ([upstream_tests] packages); run "
                                     f"`{lock.COMPILE_COMMAND}`")
        lines.append(f"{name}=={pin.version} " + " ".join(f"--hash=sha256:{h}" for h in sorted(pin.hashes)))
    return "".join(f"{line}\n" for line in lines)


def pip_installer(requirements: str, python_version: str | None, python: str = sys.executable):
    """install_libs for write_bundle: pip, hash-checked, wheels only, no bytecode, for
    `python_version` (the Python that will run the tests; None: this one's)."""
    def install(target: Path) -> list[str]:
        with tempfile.TemporaryDirectory() as scratch:
            listed = Path(scratch) / "requirements.txt"
            listed.write_text(requirements)
            argv = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--require-hashes",
                    "--only-binary=:all:", "--no-compile", "--index-url", wheels.PYPI_SIMPLE, "--target", str(target),
                    "-r", str(listed)]
            if python_version:
                argv += ["--python-version", python_version]
            done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            raise wheels.WheelError(f"installing the upstream tests' packages failed ({' '.join(argv)}):\n"
                                    f"{done.stderr.strip()[-2000:]}")
        return sorted(line.split(" ", 1)[0] for line in requirements.splitlines())
    return install


def make_bundle(recipe: Recipe, manifest: Manifest, out: Path, lock_path: Path,
                python_version: str | None = None) -> dict:
    """The bundle of the recipe's base: its pinned sdist's selection and the lock's packages."""
    if manifest.vllm_version != recipe.vllm_version:
        raise UpstreamTestsError(f"the manifest is vLLM {manifest.vllm_version}'s, the base {recipe.vllm_version}")
    tree, config = read_sdist(pinned_sdist(recipe), recipe.vllm_version)
    selection = select(tree, overlaid_modules(manifest))
    if not selection.selected:
        raise UpstreamTestsError(f"{recipe.sdist.filename}: no test file imports an overlaid module "
                                 f"({', '.join(selection.overlaid)}); nothing to gate on")
    doc = selection_doc(selection, recipe.vllm_version, recipe.sdist.filename, recipe.sdist.sha256)
    installer = pip_installer(lib_requirements(recipe, lock_path), python_version)
    return write_bundle(out, tree, config, selection, doc, installer)


@dataclass(frozen=True)
class Bundle:
    root: Path
    doc: dict
    sha256: str  # of bundle.json: names the bundle a run's results came from

    @property
    def vllm_version(self) -> str:
        return self.doc["vllm_version"]

    @property
    def selected(self) -> list[dict]:
        return self.doc["selected"]


def load_bundle(root: Path) -> Bundle:
    """A bundle as `write_bundle` wrote it, every file re-hashed: one that changed, went missing or
    was added is refused (a run's results must be of the files bundle.json names). `root` may
    also be a bundle.json alone, as the image's exported results carry it: enough to compare
    runs (which files were selected, which bundle the results name), not to run them."""
    if root.is_file():
        doc, data = _read_bundle_doc(root)
        return Bundle(root.parent, doc, _sha256(data))
    doc, data = _read_bundle_doc(root / BUNDLE_FILE)
    present = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    present.discard(BUNDLE_FILE)
    listed = doc["files"]
    problems = [f"{rel}: missing" for rel in sorted(set(listed) - present)]
    problems += [f"{rel}: not listed in {BUNDLE_FILE}" for rel in sorted(present - set(listed))]
    problems += [f"{rel}: sha256 {found}, {BUNDLE_FILE} records {listed[rel]}" for rel in sorted(present & set(listed))
                 if (found := _sha256((root / rel).read_bytes())) != listed[rel]]
    if problems:
        raise UpstreamTestsError(f"{root}: the bundle is not what was written: {'; '.join(problems[:5])}"
                                 f"{' ...' if len(problems) > 5 else ''}; make it again with `bundle`")
    return Bundle(root, doc, _sha256(data))


def _read_bundle_doc(path: Path) -> tuple[dict, bytes]:
    try:
        data = path.read_bytes()
        doc = json.loads(data)
    except (OSError, ValueError) as exc:
        raise UpstreamTestsError(f"{path}: cannot read the bundle ({exc}); make one with "
                                 "`python3 scripts/upstream_tests.py bundle --vllm X.Y.Z --out DIR`") from exc
    _check_bundle_doc(doc, path)
    return doc, data


def _check_bundle_doc(doc, where: Path) -> None:
    keys = {"schema", "vllm_version", "sdist", "overlaid_modules", "selected", "support", "config", "libs", "files"}
    if not isinstance(doc, dict) or doc.get("schema") != BUNDLE_SCHEMA or set(doc) != keys:
        raise UpstreamTestsError(f"{where}: expected a bundle.json of schema {BUNDLE_SCHEMA} with keys {', '.join(sorted(keys))}")
    files = doc["files"]
    if not isinstance(files, dict) or not all(isinstance(v, str) and _safe_path(k) for k, v in files.items()):
        raise UpstreamTestsError(f"{where}: files must map relative paths inside the bundle to sha256")
    selected = doc["selected"]
    if not isinstance(selected, list) or not all(
            isinstance(s, dict) and isinstance(s.get("path"), str) and s["path"] in files and is_test_file(s["path"])
            and isinstance(s.get("needs"), list) and all(isinstance(n, str) for n in s["needs"]) for s in selected):
        raise UpstreamTestsError(f"{where}: selected must list test files of the bundle, each with its needs")


def _safe_path(rel: str) -> bool:
    parts = PurePosixPath(rel).parts
    return bool(parts) and not PurePosixPath(rel).is_absolute() and "\\" not in rel and \
        all(p not in ("", ".", "..") for p in parts) and "\0" not in rel
