"""Check the b12x API our overlay calls against a real b12x wheel, without importing it.

b12x moved its indexer API between releases (``b12x.attention.indexer`` in 0.20 to
0.30.x, ``nsa_indexer`` in 1.1 to 1.2.x, ``dsa_indexer._impl`` from 1.3), and b12x
needs a CUDA GPU of compute capability 12.x to import usefully. So the check is
static: it reads the overlay's ``b12x_indexer.py`` for every ``from b12x... import``
and every call of an imported name, and the wheel's sources for what those modules
export and which parameters those functions and dataclasses take.
"""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

OVERLAY_MODULE = "vllm/v1/attention/backends/mla/b12x_indexer.py"


@dataclass
class Usage:
    """What the overlay needs from one b12x module."""

    module: str
    names: set[str] = field(default_factory=set)
    # name -> list of (number of positional args, keyword names) per call site
    calls: dict[str, list[tuple[int, set[str]]]] = field(default_factory=dict)


def overlay_usage(source: str) -> dict[str, Usage]:
    """b12x modules the overlay imports from, the names, and how it calls them."""
    tree = ast.parse(source)
    usages: dict[str, Usage] = {}
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("b12x"):
            usage = usages.setdefault(node.module, Usage(node.module))
            for alias in node.names:
                usage.names.add(alias.name)
                imported[alias.asname or alias.name] = node.module
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            module = imported.get(node.func.id)
            if module:
                keywords = {k.arg for k in node.keywords if k.arg}
                usages[module].calls.setdefault(node.func.id, []).append(
                    (len(node.args), keywords))
    return usages


@dataclass
class Signature:
    positional: list[str]
    keyword_only: list[str]
    required: set[str]


def _function_signature(node: ast.FunctionDef) -> Signature:
    args = node.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    with_default = positional[len(positional) - len(args.defaults):] if args.defaults else []
    required = {a for a in positional if a not in with_default}
    required |= {a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is None}
    return Signature(positional, [a.arg for a in args.kwonlyargs], required)


def _dataclass_signature(node: ast.ClassDef) -> Signature:
    fields = [(s.target.id, s.value) for s in node.body if isinstance(s, ast.AnnAssign)
              and isinstance(s.target, ast.Name)]
    names = [name for name, _ in fields]
    required = {name for name, value in fields if value is None}
    return Signature(names, [], required)


def _import_target(base: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names; ``base`` is where its dots lead."""
    if not node.level:
        return node.module or ""  # absolute imports always name a module
    return f"{base}.{node.module}" if node.module else base


class WheelSources:
    """Python sources of a wheel, by module name."""

    def __init__(self, wheel: Path):
        self.files: dict[str, str] = {}
        with zipfile.ZipFile(wheel) as archive:
            for name in archive.namelist():
                if name.endswith(".py"):
                    module = name[:-3].replace("/", ".")
                    if module.endswith(".__init__"):
                        module = module[: -len(".__init__")]
                    self.files[module] = archive.read(name).decode()

    def resolve(self, module: str, name: str,
                depth: int = 0) -> ast.FunctionDef | ast.ClassDef | None:
        """The AST node defining ``module.name``, following ``from .x import``."""
        if module not in self.files or depth > 8:
            return None
        tree = ast.parse(self.files[module])
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
                return node
        package = module if self._is_package(module) else module.rpartition(".")[0]
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and any(
                    (a.asname or a.name) == name for a in node.names):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                target = _import_target(base, node)
                original = next(a.name for a in node.names if (a.asname or a.name) == name)
                return self.resolve(target, original, depth + 1)
        return None

    def _is_package(self, module: str) -> bool:
        return any(m.startswith(module + ".") for m in self.files)


def api_signature(sources: WheelSources, module: str, name: str) -> Signature | None:
    """The parameters of the function or dataclass ``module.name``; None where undefined."""
    node = sources.resolve(module, name)
    if node is None:
        return None
    return _function_signature(node) if isinstance(node, ast.FunctionDef) else _dataclass_signature(node)


def problems(wheel: Path, overlay_source: str) -> list[str]:
    """Every way the overlay's use of b12x does not fit the wheel; empty when it fits."""
    sources = WheelSources(wheel)
    found = []
    for module, usage in sorted(overlay_usage(overlay_source).items()):
        if module not in sources.files:
            found.append(f"module {module} is not in {wheel.name}")
            continue
        for name in sorted(usage.names):
            signature = api_signature(sources, module, name)
            if signature is None:
                found.append(f"{module}.{name} is not defined in {wheel.name}")
                continue
            for n_positional, keywords in usage.calls.get(name, []):
                accepted = set(signature.positional) | set(signature.keyword_only)
                given = set(signature.positional[:n_positional]) | keywords
                if n_positional > len(signature.positional):
                    found.append(f"{module}.{name}: called with {n_positional} positional "
                                 f"arguments, takes {len(signature.positional)}")
                for keyword in sorted(keywords - accepted):
                    found.append(f"{module}.{name}: no parameter {keyword!r}")
                for missing in sorted(signature.required - given):
                    found.append(f"{module}.{name}: required parameter {missing!r} not passed")
    return found


def module_constants(source: str) -> dict[str, object]:
    """Module-level ``NAME = literal`` assignments of a source file, and ``NAME = OTHER`` where
    OTHER is such a constant assigned before (b12x aliases tile sizes so)."""
    constants: dict[str, object] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if isinstance(node.value, ast.Name):
                if node.value.id in constants:
                    constants[node.targets[0].id] = constants[node.value.id]
                continue
            try:
                constants[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return constants


def constant_mismatches(files: dict[str, str], expected: dict[tuple[str, str], object]) -> list[str]:
    """Where ``expected`` {(module, name): value} differs from the modules' sources in ``files``
    (module name -> source)."""
    found = []
    for (module, name), value in sorted(expected.items(), key=str):
        actual = module_constants(files[module]).get(name, "<missing>") if module in files else "<no module>"
        if actual != value:
            found.append(f"{module}.{name}: b12x has {actual!r}, expected {value!r}")
    return found
