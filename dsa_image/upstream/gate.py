"""vLLM's own tests as the overlay's gate: select, bundle, run per file, compare stock with overlay.

A base's pinned sdist (`[vllm."X".sdist]` in the recipe, fetched and re-hashed by
dsa_image.core.wheels) ships vLLM's `tests/`. From it:

* **select**: the test files (`test_*.py`, `*_test.py`) that import an overlaid module (the
  base's manifest entries: vllm/a/b.py -> vllm.a.b), found by import analysis of every
  `import x`, `from x import y` (y may be a submodule), `from . import y`, anywhere in the
  file (functions included), and `importlib.import_module("x")` / `pytest.importorskip("x")`
  with a constant name. Importing `a.b.c` runs `a` and `a.b` too, so any overlaid prefix counts.
* **support**: what those files need to be collected: the `conftest.py` and package
  `__init__.py` files on the way up from each, and every tests-local module they (or those)
  import, transitively (`tests.x`, relative imports, and the top-level names pytest's
  `prepend` import mode makes importable from a file's base directory), and `pytest_plugins`.
* **bundle**: just those files, extracted into a small directory with `bundle.json` (the sdist's
  filename and sha256, the overlaid modules, the selection with the import that selected each
  file, each file's sha256, and the third-party modules each selected file needs at import).
* **run**: each selected file in its own pytest process against one site (a Python and, for a
  `pip install --target` site, its directory on PYTHONPATH), junit XML per file, a timeout per
  file. A file whose import needs a module the site lacks is not run; the result says which.
* **compare**: a stock run and an overlaid run of the same bundle, test by test. The rule: no
  test that passes (or is skipped) on stock may fail, error, be skipped (if it passed) or be
  missing on the overlay; a test failing on both is listed, not fixed.

Stdlib only (it runs in a bare build stage and against any site).
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from dsa_image.build import lock, lock_parse
from dsa_image.core import wheels
from dsa_image.core.atomic import write_atomic
from dsa_image.overlay.manifest import Manifest
from dsa_image.overlay.core import RECEIPT_NAME
from dsa_image.core.recipe import Recipe
from dsa_image.core.site_path import pythonpath

BUNDLE_SCHEMA = 1
BUNDLE_FILE = "bundle.json"
LIBS = "libs"  # in a bundle: the upstream-tests lock's packages (pip install --target)
TESTS = "tests"
# What pytest collects by default (python_files); vLLM's pyproject.toml does not change it.
_TEST_FILE_PATTERNS = ("test_*.py", "*_test.py")
# Copied verbatim beside tests/: upstream's pytest configuration (markers, options).
CONFIG_FILES = ("pyproject.toml",)
# Exceptions whose handler makes a failed import optional.
_IMPORT_GUARDS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
_IMPORT_CALLS = {"import_module", "importorskip", "__import__"}


class UpstreamTestsError(Exception):
    """A bundle, an sdist or a run's results cannot be used; the message says what to do."""


def overlaid_modules(manifest: Manifest) -> tuple[str, ...]:
    """The import names of a base's overlaid Python files, from its manifest's install paths."""
    return tuple(sorted(e.module for e in manifest.files if e.module))


# --- import analysis ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Import:
    """One name a file imports. `names` are the dotted names it may load (for `from a import b`:
    a and a.b, since b may be a submodule); `level` > 0 for a relative import."""

    names: tuple[str, ...]
    level: int
    line: int
    required: bool  # runs whenever the file is imported: not in a function, an `if` or a guarded `try`


class _ImportVisitor(ast.NodeVisitor):
    def __init__(self) -> None:
        self.found: list[Import] = []
        self._optional = 0  # depth inside a function, an `if` or a try that catches ImportError

    def _add(self, names: tuple[str, ...], level: int, node: ast.AST, optional: bool = False) -> None:
        self.found.append(Import(names, level, node.lineno, not (self._optional or optional)))

    def _inside(self, node: ast.AST, optional: bool) -> None:
        self._optional += optional
        self.generic_visit(node)
        self._optional -= optional

    def visit_FunctionDef(self, node):  # also async def and lambda: bodies run only when called
        self._inside(node, True)

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_If(self, node):  # `if TYPE_CHECKING:`, `if current_platform.is_rocm():` ...
        self._inside(node, True)

    def visit_Try(self, node):
        guarded = any(_catches_import_error(h.type) for h in node.handlers)
        self._optional += guarded
        for child in node.body:
            self.visit(child)
        self._optional -= guarded
        for child in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(child)

    visit_TryStar = visit_Try

    def visit_Import(self, node):
        for alias in node.names:
            self._add((alias.name,), 0, node)

    def visit_ImportFrom(self, node):
        base = node.module or ""
        names = tuple(f"{base}.{a.name}" if base else a.name for a in node.names if a.name != "*")
        self._add(((base,) if base else ()) + names, node.level, node)

    def visit_Call(self, node):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name in _IMPORT_CALLS and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            # importorskip skips the test when the module is missing: never required.
            self._add((node.args[0].value,), 0, node, optional=name == "importorskip")
        self.generic_visit(node)

    def visit_Assign(self, node):
        # conftest's `pytest_plugins = ["a.b", ...]` (or a single string): pytest imports them.
        if any(isinstance(t, ast.Name) and t.id == "pytest_plugins" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            for value in values:
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    self._add((value.value,), 0, node)
        self.generic_visit(node)


def _catches_import_error(handler: ast.expr | None) -> bool:
    if handler is None:  # bare except
        return True
    names = handler.elts if isinstance(handler, ast.Tuple) else [handler]
    return any((n.id if isinstance(n, ast.Name) else getattr(n, "attr", None)) in _IMPORT_GUARDS for n in names)


def imports_of(source: bytes, where: str) -> list[Import]:
    """Every import in a Python file, wherever it is in the file."""
    try:
        tree = ast.parse(source, filename=where)
    except (SyntaxError, ValueError) as exc:
        raise UpstreamTestsError(f"{where}: cannot parse it as Python ({exc})") from exc
    visitor = _ImportVisitor()
    visitor.visit(tree)
    return visitor.found


def loads_module(name: str, modules: set[str] | tuple[str, ...]) -> str | None:
    """The overlaid module that importing `name` runs: `name` itself or one of its parents."""
    parts = name.split(".")
    return next((m for i in range(len(parts), 0, -1) if (m := ".".join(parts[:i])) in modules), None)


# --- the tests tree: what a file imports from it --------------------------------------------------


def is_test_file(path: str) -> bool:
    return any(PurePosixPath(path).match(pattern) for pattern in _TEST_FILE_PATTERNS)


@dataclass
class UpstreamTree:
    """The sdist's tests/ (paths like tests/v1/x.py -> bytes) and how pytest imports from it."""

    files: dict[str, bytes]
    _imports: dict[str, list[Import]] = field(default_factory=dict)

    def imports(self, path: str) -> list[Import]:
        if path not in self._imports:
            self._imports[path] = imports_of(self.files[path], path)
        return self._imports[path]

    def _is_package(self, directory: PurePosixPath) -> bool:
        return str(directory / "__init__.py") in self.files

    def base_dir(self, path: str) -> PurePosixPath:
        """The directory pytest's `prepend` mode puts on sys.path for `path`: the first one up
        that is not a package (the bundle root for tests/..., whose directories are packages)."""
        directory = PurePosixPath(path).parent
        while directory != PurePosixPath(".") and self._is_package(directory):
            directory = directory.parent
        return directory

    def _module_file(self, directory: PurePosixPath, name: str) -> str | None:
        stem = directory.joinpath(*name.split("."))
        for candidate in (f"{stem}.py", f"{stem}/__init__.py"):
            if candidate.startswith(f"{TESTS}/") and candidate in self.files:
                return candidate
        return None

    def packages_of(self, path: str) -> list[str]:
        """The `__init__.py` files importing `path` runs: its packages, up to its base directory."""
        base, found = self.base_dir(path), []
        directory = PurePosixPath(path).parent
        while directory != base and directory != PurePosixPath("."):
            init = str(directory / "__init__.py")
            if init != path:
                found.append(init)
            directory = directory.parent
        return found

    def conftests_of(self, path: str) -> list[str]:
        """The conftest.py files pytest loads for `path`: tests/ down to the file's directory."""
        parts = PurePosixPath(path).parent.parts
        return [c for i in range(1, len(parts) + 1)
                if (c := str(PurePosixPath(*parts[:i]) / "conftest.py")) in self.files and c != path]

    def resolve(self, path: str, imp: Import, search: list[PurePosixPath]) -> list[str]:
        """The tests-local files an import of `path` loads (none for a third-party module).
        `search`: the directories on sys.path when `path` is imported (base directories)."""
        if imp.level:
            package = PurePosixPath(path).parent
            for _ in range(imp.level - 1):
                package = package.parent
            return [f for name in imp.names if (f := self._module_file(package, name))]
        found = []
        for name in imp.names:
            for directory in search:
                if (f := self._module_file(directory, name)):
                    found.append(f)
                    break
        return found

    def search_path(self, path: str) -> list[PurePosixPath]:
        """sys.path's tests-local directories while `path` is collected: its base directory,
        its conftests', and the root (`python -m pytest` runs in the bundle root)."""
        dirs = [self.base_dir(path), *(self.base_dir(c) for c in reversed(self.conftests_of(path))),
                PurePosixPath(".")]
        return list(dict.fromkeys(dirs))

    def third_party(self, path: str, imp: Import, search: list[PurePosixPath]) -> str | None:
        """The top-level name of a third-party module the import needs, or None (local, stdlib,
        relative)."""
        if imp.level or not imp.names or self.resolve(path, imp, search):
            return None
        top = imp.names[0].split(".")[0]
        return None if top in sys.stdlib_module_names or top == "__future__" else top


@dataclass(frozen=True)
class Selected:
    path: str
    imports: tuple[str, ...]  # the overlaid modules it imports ("file:line module")
    needs: tuple[str, ...]  # third-party top-level modules its collection imports, sorted


@dataclass(frozen=True)
class Selection:
    overlaid: tuple[str, ...]
    selected: tuple[Selected, ...]
    support: tuple[str, ...]  # every other file the bundle carries, sorted


def select(tree: UpstreamTree, overlaid: tuple[str, ...]) -> Selection:
    """The test files importing an overlaid module, with the support files they need."""
    modules = set(overlaid)
    selected = []
    for path in sorted(p for p in tree.files if is_test_file(p)):
        hits = [f"{path}:{imp.line} {m}" for imp in tree.imports(path) if not imp.level
                for name in imp.names if (m := loads_module(name, modules))]
        if hits:
            selected.append(Selected(path, tuple(dict.fromkeys(hits)), tuple(sorted(collection_needs(tree, path)))))
    support: set[str] = set()
    for item in selected:
        support |= support_files(tree, item.path)
    return Selection(tuple(overlaid), tuple(selected), tuple(sorted(support - {s.path for s in selected})))


def support_files(tree: UpstreamTree, path: str) -> set[str]:
    """Every tests-local file collecting `path` may load: conftests, packages and imports, transitively."""
    search = tree.search_path(path)
    todo = [path, *tree.conftests_of(path)]
    seen: set[str] = set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo += tree.packages_of(current)
        for imp in tree.imports(current):
            todo += tree.resolve(current, imp, search)
    return seen


def collection_needs(tree: UpstreamTree, path: str) -> set[str]:
    """The third-party top-level modules collecting `path` must import: required imports of the
    file, its conftests and packages, and of the local modules those import when imported."""
    search = tree.search_path(path)
    todo = [path, *tree.conftests_of(path)]
    seen: set[str] = set()
    needs: set[str] = set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo += tree.packages_of(current)
        for imp in tree.imports(current):
            if not imp.required:
                continue
            if (top := tree.third_party(current, imp, search)):
                needs.add(top)
            todo += tree.resolve(current, imp, search)
    return needs


# --- the sdist and the bundle ------------------------------------------------------------------


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
                    config[rel] = archive.extractfile(member).read()
                elif rel.startswith(f"{TESTS}/") and rel.endswith(".py"):
                    files[rel] = archive.extractfile(member).read()
    except (OSError, tarfile.TarError, EOFError) as exc:
        raise UpstreamTestsError(f"{sdist}: cannot read it as a gzip'd tar ({exc}); delete it to download again") from exc
    if f"{TESTS}/conftest.py" not in files:
        raise UpstreamTestsError(f"{sdist}: no {top}/{TESTS}/conftest.py: not a vLLM {version} sdist with its tests")
    return UpstreamTree(files), config


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
    was added is refused (a run's results must be of the files bundle.json names)."""
    path = root / BUNDLE_FILE
    try:
        data = path.read_bytes()
        doc = json.loads(data)
    except (OSError, ValueError) as exc:
        raise UpstreamTestsError(f"{path}: cannot read the bundle ({exc}); make one with "
                                 "`python3 scripts/upstream_tests.py bundle --vllm X.Y.Z --out DIR`") from exc
    _check_bundle_doc(doc, path)
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


# --- running the bundle against a site, file by file ----------------------------------------------

SIDES = ("stock", "overlay")
RUN_FILE = "run.json"
RUN_SCHEMA = 1
# Asked in a fresh interpreter of the site: what vLLM it imports, whether the overlay's receipt
# lies beside it, and which of the modules collection needs it cannot find (with the libs).
_PROBE = """
import importlib.metadata, importlib.util, json, os, sys
sys.path.extend(json.loads(sys.argv[1]))
import vllm
site = os.path.dirname(os.path.dirname(os.path.abspath(vllm.__file__)))
print(json.dumps({"python": sys.version.split()[0], "vllm_version": importlib.metadata.version("vllm"),
                  "vllm_site": site, "receipt": os.path.exists(os.path.join(site, sys.argv[2])),
                  "missing": [m for m in json.loads(sys.argv[3]) if importlib.util.find_spec(m) is None]}))
"""
# Runs pytest with the libs appended to sys.path (after the site's packages, which they never
# shadow); the bundle root (cwd) is sys.path[0], so `tests.` and upstream's config resolve there.
_PYTEST = "import json, sys; sys.path.extend(json.loads(sys.argv.pop(1))); import pytest; sys.exit(pytest.main(sys.argv[1:]))"
_LOG_TAIL = 3000  # characters of a crashed file's output kept in run.json


@dataclass(frozen=True)
class Site:
    """Where one side's vLLM is: `python` runs it; `site` is a `pip install --target`
    directory put first on PYTHONPATH (None: the python's own site-packages); `libs` are
    appended to sys.path (the image's test runner, pytest)."""

    side: str
    python: str
    site: Path | None = None
    libs: tuple[Path, ...] = ()

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        if self.site is not None:
            env["PYTHONPATH"] = pythonpath(str(self.site))
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # the bundle may be read-only, and stays as written
        # Offline unless the caller says otherwise: a test that would download a model fails
        # at once, alike on both sides, instead of waiting on an unreachable hub.
        env.setdefault("HF_HUB_OFFLINE", "1")
        return env


def junit_name(path: str) -> str:
    """A result file name for a test file: tests/v1/x.py -> tests__v1__x.xml."""
    return path.removesuffix(".py").replace("/", "__") + ".xml"


def probe_site(site: Site, bundle: Bundle, needs: list[str], timeout: float = 300) -> dict:
    """What `site` imports, checked against the bundle's base and the side it is named for."""
    libs = [str(p) for p in (*site.libs, bundle.root / LIBS)]
    with tempfile.TemporaryDirectory() as empty:  # nothing in the cwd shadows the site
        done = subprocess.run([site.python, "-B", "-c", _PROBE, json.dumps(libs), RECEIPT_NAME, json.dumps(needs)],
                              cwd=empty, env=site.environment(dict(os.environ)),
                              capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise UpstreamTestsError(f"{site.side}: {site.python} cannot import vllm"
                                 f"{f' with {site.site} first on PYTHONPATH' if site.site else ''}: "
                                 f"{done.stderr.strip()[-1500:]}")
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    if facts["vllm_version"] != bundle.vllm_version:
        raise UpstreamTestsError(f"{site.side}: the site's vLLM is {facts['vllm_version']} ({facts['vllm_site']}), "
                                 f"the bundle holds vLLM {bundle.vllm_version}'s tests; run a bundle of that base")
    overlaid = facts["receipt"]
    if overlaid != (site.side == "overlay"):
        found = "carries the overlay (its receipt is there)" if overlaid else "has no overlay receipt"
        raise UpstreamTestsError(f"{site.side}: {facts['vllm_site']} {found}; the {site.side} side needs "
                                 f"{'a site with the overlay applied' if site.side == 'overlay' else 'stock vLLM'}")
    return facts


@dataclass(frozen=True)
class FileResult:
    """One test file's run on one side. status: ran (junit written), not-runnable (a module
    collection imports is missing), timeout, crashed (no junit: killed, internal error)."""

    status: str
    seconds: float
    exit_code: int | None = None
    reason: str = ""

    def doc(self) -> dict:
        return {"status": self.status, "seconds": round(self.seconds, 1), "exit_code": self.exit_code,
                "reason": self.reason}


def run_file(site: Site, bundle: Bundle, path: str, out: Path, timeout: float) -> FileResult:
    """`path` in its own pytest process against `site`, junit to out/junit/, output to out/logs/."""
    junit = out / "junit" / junit_name(path)
    log = out / "logs" / junit_name(path).replace(".xml", ".log")
    for p in (junit, log):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.unlink(missing_ok=True)
    libs = json.dumps([str(p) for p in (*site.libs, bundle.root / LIBS)])
    argv = [site.python, "-B", "-c", _PYTEST, libs, path, "--rootdir", ".", "-p", "no:cacheprovider",
            f"--junitxml={junit}", "-q", "-rfE", "--color=no"]
    started = time.monotonic()
    with open(log, "wb") as output:
        process = subprocess.Popen(argv, cwd=bundle.root, env=site.environment(dict(os.environ)),
                                   stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _end_session(process)
    seconds = time.monotonic() - started
    if code is None:
        return FileResult("timeout", seconds, None, f"killed after {timeout:.0f} s")
    if junit.is_file():
        return FileResult("ran", seconds, code)
    tail = log.read_bytes()[-_LOG_TAIL:].decode(errors="replace")
    return FileResult("crashed", seconds, code, f"pytest exited {code} without junit XML: ...{tail}")


def _end_session(process: subprocess.Popen) -> None:
    """Kill what is left of the session pytest led (it, on a timeout; the workers a test started
    and left behind, which could hold the GPU for the next file)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def load_run(out: Path, side: str, bundle_sha256: str | None = None) -> dict:
    """out/<side>/run.json (untrusted: checked); a fresh one when absent and `bundle_sha256` given."""
    path = out / side / RUN_FILE
    if not path.exists():
        if bundle_sha256 is None:
            raise UpstreamTestsError(f"{path}: missing; run `python3 scripts/upstream_tests.py run --side {side} "
                                     f"--out {out} ...` first")
        return {"schema": RUN_SCHEMA, "side": side, "bundle_sha256": bundle_sha256, "site": None, "files": {}}
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise UpstreamTestsError(f"{path}: not a run's results ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("schema") != RUN_SCHEMA or doc.get("side") != side \
            or not isinstance(doc.get("files"), dict) or not isinstance(doc.get("bundle_sha256"), str):
        raise UpstreamTestsError(f"{path}: not a schema {RUN_SCHEMA} run of the {side} side")
    for rel, result in doc["files"].items():
        if not (isinstance(result, dict) and result.get("status") in ("ran", "not-runnable", "timeout", "crashed")):
            raise UpstreamTestsError(f"{path}: files[{rel!r}] has no known status")
    if bundle_sha256 is not None and doc["bundle_sha256"] != bundle_sha256:
        raise UpstreamTestsError(f"{path}: results of another bundle (sha256 {doc['bundle_sha256']}, this one "
                                 f"{bundle_sha256}); use a new --out, or remove {out / side}")
    return doc


def _save_run(out: Path, doc: dict) -> None:
    (out / doc["side"]).mkdir(parents=True, exist_ok=True)
    write_atomic(out / doc["side"] / RUN_FILE, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())


@dataclass(frozen=True)
class Task:
    site: Site
    path: str


def run_tasks(bundle: Bundle, sites: list[Site], out: Path, timeout: float, files: list[str] | None = None,
              jobs: int = 1, deadline_s: float | None = None, report=print) -> dict[str, dict]:
    """Run each selected file (or `files`) on each site, `jobs` at a time, interleaved by file (with
    jobs=2 a file's stock and overlay runs go together). A file with a result in out/ already is
    not run again; after `deadline_s` no file is started (the next call resumes). Returns each
    side's run.json document."""
    selected = {s["path"]: s for s in bundle.selected}
    unknown = sorted(set(files or ()) - set(selected))
    if unknown:
        raise UpstreamTestsError(f"not selected in {bundle.root}: {', '.join(unknown)} (the selection: "
                                 "`python3 scripts/upstream_tests.py select`)")
    wanted = [p for p in selected if not files or p in files]
    needs = sorted({n for p in wanted for n in selected[p]["needs"]})
    runs = {}
    for site in sites:
        facts = probe_site(site, bundle, needs)
        runs[site.side] = load_run(out, site.side, bundle.sha256)
        seen = {"python": site.python, "site": str(site.site) if site.site else None,
                "libs": [str(p) for p in site.libs], **{k: v for k, v in facts.items() if k != "missing"}}
        if runs[site.side]["site"] not in (None, seen):
            raise UpstreamTestsError(f"{out / site.side}: results of another site ({runs[site.side]['site']}, this "
                                     f"one {seen}); use a new --out, or remove {out / site.side}")
        runs[site.side]["site"] = seen
        for path in wanted:
            missing = sorted(set(selected[path]["needs"]) & set(facts["missing"]))
            if missing and path not in runs[site.side]["files"]:
                runs[site.side]["files"][path] = FileResult(
                    "not-runnable", 0.0, None, f"its collection imports {', '.join(missing)}, which "
                    f"{site.python} cannot import here").doc()
        _save_run(out, runs[site.side])
    tasks = [Task(site, path) for path in wanted for site in sites if path not in runs[site.side]["files"]]
    started, lock = time.monotonic(), threading.Lock()

    def one(task: Task) -> None:
        if deadline_s is not None and time.monotonic() - started > deadline_s:
            return
        result = run_file(task.site, bundle, task.path, out / task.site.side, timeout)
        with lock:
            runs[task.site.side]["files"][task.path] = result.doc()
            _save_run(out, runs[task.site.side])
            report(f"{task.site.side:8} {result.status:12} {result.seconds:6.0f} s  {task.path}")

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, tasks))
    return runs


# --- reading junit and comparing the sides -------------------------------------------------------

PASSED, FAILED, ERROR, SKIPPED, MISSING = "passed", "failed", "error", "skipped", "missing"
_FAILS = (FAILED, ERROR)


def node_id(test_file: str, classname: str, name: str) -> str:
    """pytest's node id of a junit testcase of `test_file` (classname: the file's dotted path and
    its class; none for the file itself: a collection error, a module-level skip)."""
    module = test_file.removesuffix(".py").replace("/", ".")
    if not classname:
        return test_file
    if classname == module:
        return f"{test_file}::{name}"
    inner = classname[len(module) + 1:] if classname.startswith(f"{module}.") else classname
    return f"{test_file}::{inner.replace('.', '::')}::{name}"


def junit_outcomes(path: Path, test_file: str) -> dict[str, str]:
    """{node id: outcome} of the junit XML of `test_file`: passed, failed, error or skipped
    (pytest writes an xfail as skipped). A test with a failure and an error (a failed call, then
    a failed teardown) is failed."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        raise UpstreamTestsError(f"{path}: not junit XML ({exc})") from exc
    outcomes = {}
    for case in root.iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = FAILED if "failure" in kinds else ERROR if "error" in kinds else SKIPPED if "skipped" in kinds else PASSED
        test = node_id(test_file, case.get("classname", ""), case.get("name", ""))
        # A test reported twice (a passed call, then an error in its teardown) keeps the worse.
        if outcomes.get(test) not in _FAILS:
            outcomes[test] = outcome
    return outcomes


@dataclass(frozen=True)
class Change:
    path: str
    test: str
    stock: str
    overlay: str


@dataclass
class FileComparison:
    path: str
    stock: dict  # run.json's entry, or {} when the side has none yet
    overlay: dict
    counts: dict[str, dict[str, int]]  # side -> outcome -> count
    regressions: list[Change]
    fail_on_both: list[Change]
    other: list[Change]  # fixed on the overlay, skipped where stock failed, only on one side

    @property
    def complete(self) -> bool:
        return self.stock.get("status") == "ran" and self.overlay.get("status") == "ran"


def is_regression(stock: str, overlay: str) -> bool:
    """The rule: what passes on stock must pass on the overlay; what stock skips may not fail
    there; a test only the overlay has may not fail."""
    if stock == PASSED:
        return overlay != PASSED  # failed, error, skipped or not run at all
    if stock == SKIPPED:
        return overlay in (*_FAILS, MISSING)
    return stock == MISSING and overlay in _FAILS


def compare_file(path: str, stock: dict, overlay: dict, out: Path) -> FileComparison:
    sides = {"stock": stock, "overlay": overlay}
    outcomes = {side: junit_outcomes(out / side / "junit" / junit_name(path), path) if r.get("status") == "ran" else {}
                for side, r in sides.items()}
    counts = {side: {k: sum(1 for o in found.values() if o == k) for k in (PASSED, FAILED, ERROR, SKIPPED)}
              for side, found in outcomes.items()}
    comparison = FileComparison(path, stock, overlay, counts, [], [], [])
    if stock.get("status") != "ran":
        return comparison  # no baseline: incomplete, never a verdict
    for test in sorted(set(outcomes["stock"]) | set(outcomes["overlay"])):
        change = Change(path, test, outcomes["stock"].get(test, MISSING), outcomes["overlay"].get(test, MISSING))
        if is_regression(change.stock, change.overlay):
            comparison.regressions.append(change)
        elif change.stock in _FAILS and change.overlay in _FAILS:
            comparison.fail_on_both.append(change)
        elif change.stock != change.overlay:
            comparison.other.append(change)
    if overlay.get("status") not in (None, "ran") and not comparison.regressions:
        # The overlay's run gave nothing where stock's did: that is a regression by itself.
        comparison.regressions.append(Change(path, f"{path} (the whole file)", "ran", overlay["status"]))
    return comparison


@dataclass(frozen=True)
class Comparison:
    vllm_version: str
    files: tuple[FileComparison, ...]

    @property
    def regressions(self) -> list[Change]:
        return [c for f in self.files for c in f.regressions]

    @property
    def incomplete(self) -> list[FileComparison]:
        return [f for f in self.files if not f.complete]

    @property
    def stock_passed(self) -> int:
        """Tests passing on stock: none means the gate compared nothing (a broken site)."""
        return sum(f.counts["stock"][PASSED] for f in self.files)

    @property
    def verdict(self) -> str:
        """regressions, incomplete (a file without a result, or nothing passing on stock) or ok."""
        if self.regressions:
            return "regressions"
        return "incomplete" if self.incomplete or not self.stock_passed else "ok"


def compare_runs(out: Path, bundle: Bundle, files: list[str] | None = None) -> Comparison:
    """The stock and overlay runs in out/stock and out/overlay, test by test, over every file
    `bundle` selects (or `files` of them): a selected file neither side has a result for is
    compared too, as incomplete, so a run cut short can never read as a pass."""
    stock, overlay = load_run(out, "stock"), load_run(out, "overlay")
    if stock["bundle_sha256"] != overlay["bundle_sha256"]:
        raise UpstreamTestsError(f"{out}: the stock and overlay results come from different bundles "
                                 f"({stock['bundle_sha256']} vs {overlay['bundle_sha256']}); run both from one")
    if stock["bundle_sha256"] != bundle.sha256:
        raise UpstreamTestsError(f"{out}: results of another bundle (sha256 {stock['bundle_sha256']}, "
                                 f"{bundle.root} is {bundle.sha256}); compare with the bundle they ran")
    selected = [s["path"] for s in bundle.selected]
    unknown = sorted(set(files or ()) - set(selected))
    if unknown:
        raise UpstreamTestsError(f"not selected in {bundle.root}: {', '.join(unknown)}")
    strays = sorted((set(stock["files"]) | set(overlay["files"])) - set(selected))
    if strays:
        raise UpstreamTestsError(f"{out}: results for files {bundle.root} does not select: {', '.join(strays[:5])}")
    sites = (stock.get("site") or {}), (overlay.get("site") or {})
    versions = {s.get("vllm_version") for s in sites}
    if len(versions) != 1 or None in versions:
        raise UpstreamTestsError(f"{out}: expected both sides on one vLLM, found {sorted(map(str, versions))}")
    if sites[0].get("receipt") or not sites[1].get("receipt"):
        raise UpstreamTestsError(f"{out}: the stock side must have no overlay receipt and the overlay side one")
    paths = sorted(p for p in selected if not files or p in files)
    compared = tuple(compare_file(p, stock["files"].get(p, {}), overlay["files"].get(p, {}), out) for p in paths)
    return Comparison(versions.pop(), compared)


def _cell(result: dict, counts: dict[str, int]) -> str:
    if result.get("status") != "ran":
        return f"{result.get('status', 'not run'):>17}"
    return f"{counts[PASSED]:5} {counts[FAILED] + counts[ERROR]:5} {counts[SKIPPED]:5}"


def format_comparison(comparison: Comparison) -> str:
    """The per-file table (passed / failed+errors / skipped on each side), then every regression,
    every test failing on both, every file without a result, and the count of regressions."""
    width = max([len(f.path) for f in comparison.files] + [4])
    lines = [f"vLLM {comparison.vllm_version}: upstream's tests, stock vs overlay",
             f"{'file':{width}}  {'stock':^17}  {'overlay':^17}",
             f"{'':{width}}  {'pass':>5} {'fail':>5} {'skip':>5}  {'pass':>5} {'fail':>5} {'skip':>5}"]
    for f in comparison.files:
        note = f"  {len(f.regressions)} regression(s)" if f.regressions else ""
        lines.append(f"{f.path:{width}}  {_cell(f.stock, f.counts['stock'])}  {_cell(f.overlay, f.counts['overlay'])}{note}")
    total = {side: {k: sum(f.counts[side][k] for f in comparison.files) for k in (PASSED, FAILED, ERROR, SKIPPED)}
             for side in SIDES}
    lines.append(f"{'total':{width}}  {_cell({'status': 'ran'}, total['stock'])}  {_cell({'status': 'ran'}, total['overlay'])}")
    sections = [("regressions (pass or skip on stock, fail/error/skip/missing on the overlay)", comparison.regressions),
                ("failing on both (listed, not the overlay's)", [c for f in comparison.files for c in f.fail_on_both]),
                ("other differences (not regressions)", [c for f in comparison.files for c in f.other])]
    for title, changes in sections:
        if changes:
            lines += ["", f"{title}:"] + [f"  {c.test}: {c.stock} -> {c.overlay}" for c in changes]
    if comparison.incomplete:
        lines += ["", "files without a result on a side (the comparison is incomplete):"]
        for f in comparison.incomplete:
            for side, result in (("stock", f.stock), ("overlay", f.overlay)):
                if result.get("status") != "ran":
                    reason = result.get("reason") or "not run yet (run again: it resumes)"
                    lines.append(f"  {f.path} [{side}] {result.get('status', 'not run')}: {reason.strip()[:300]}")
    if not comparison.stock_passed:
        lines += ["", "no test passed on stock: the comparison proves nothing (is the stock site broken?)"]
    count = len(comparison.regressions)
    lines += ["", f"{count} regression{'' if count == 1 else 's'}"]
    return "\n".join(lines) + "\n"


def comparison_doc(comparison: Comparison) -> dict:
    def changes(items):
        return [{"test": c.test, "stock": c.stock, "overlay": c.overlay} for c in items]
    return {"vllm_version": comparison.vllm_version, "regressions": len(comparison.regressions),
            "complete": not comparison.incomplete, "verdict": comparison.verdict,
            "files": {f.path: {"stock": {**f.stock, "counts": f.counts["stock"]},
                               "overlay": {**f.overlay, "counts": f.counts["overlay"]},
                               "regressions": changes(f.regressions), "fail_on_both": changes(f.fail_on_both),
                               "other": changes(f.other)} for f in comparison.files}}
