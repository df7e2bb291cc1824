"""Selecting vLLM's own tests for the overlay's gate: which test files of a base's sdist
import an overlaid module, and what else collecting them loads.

* **select**: the test files (`test_*.py`, `*_test.py`) that import an overlaid module (the
  base's manifest entries: vllm/a/b.py -> vllm.a.b), found by import analysis of every
  `import x`, `from x import y` (y may be a submodule), `from . import y`, anywhere in the
  file (functions included), and `importlib.import_module("x")` / `pytest.importorskip("x")`
  with a constant name. Importing `a.b.c` runs `a` and `a.b` too, so any overlaid prefix counts.
* **support**: what those files need to be collected: the `conftest.py` and package
  `__init__.py` files on the way up from each, and every tests-local module they (or those)
  import, transitively (`tests.x`, relative imports, and the top-level names pytest's
  `prepend` import mode makes importable from a file's base directory), and `pytest_plugins`.

UpstreamTestsError, which every stage of the gate raises, lives here, in the first of them.
Stdlib only, like the rest of dsa_image.upstream.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from dsa_image.overlay.manifest import Manifest
from dsa_image.core import status

TESTS = "tests"
# What pytest collects by default (python_files); vLLM's pyproject.toml does not change it.
_TEST_FILE_PATTERNS = ("test_*.py", "*_test.py")
# Exceptions whose handler makes a failed import optional.
_IMPORT_GUARDS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}
_IMPORT_CALLS = {"import_module", "importorskip", "__import__"}


class UpstreamTestsError(status.DsaImageError):
    """A bundle, an sdist or a run's results cannot be used; the message says what to do."""

    exit_code = status.USAGE


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

    def _add(self, names: tuple[str, ...], level: int, node: ast.stmt | ast.expr, optional: bool = False) -> None:
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
