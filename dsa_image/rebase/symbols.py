"""What a vLLM file defines and mentions, and what a release's source shows: a Python file's
symbols, the names it uses and the modules it imports (`Source`), a wheel's sources read
lazily (`Wheel`), whether an anchor (upstream code a change touches) is still in the target
and what it may have become, and whether a change's signatures hold in a release.

It also holds RebaseError, the rebase's one error type, and KNOWN_RENAMES: this module is the
bottom of the package's import order (merge, changes, report, cli above it), so every module
that raises or reads them can import them from here.
"""

from __future__ import annotations

import ast
import difflib
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from dsa_image.overlay import cli as overlay
from dsa_image.overlay.manifest import Signature

# Renames upstream made that difflib cannot guess from the names alone. Each is reported only
# after checking it against the two releases: old name in the base file and gone from the
# target file, new name present in the target file.
KNOWN_RENAMES = {
    "vllm/v1/attention/backends/mla/indexer.py": {
        # MLAAttentionSpec's per-block state count replaced storage_block_size (0.33.0).
        "storage_block_size": "num_states",
        # The builder's FP4 indexer-cache flag; 0.33.0 derives it from the attention
        # config's indexer_kv_dtype (dsa_indexer_uses_fp4).
        "use_fp4_indexer_cache": "indexer_uses_fp4",
    },
}


class RebaseError(overlay.OverlayError):
    pass


# --- what a Python file defines and mentions ---------------------------------------------------


@dataclass
class Source:
    """A Python file's lines and names. Spans are 0-based half-open line ranges."""

    lines: list[str]
    symbols: dict[str, tuple[int, int]] = field(default_factory=dict)  # qualified bound name -> span
    mentions: dict[str, list[int]] = field(default_factory=dict)  # identifier -> lines it appears on
    uses: list[tuple[str, str, int]] = field(default_factory=list)  # (name | attr | self-attr, identifier, line)

    @property
    def module_names(self) -> set[str]:
        return {q for q in self.symbols if "." not in q}

    @property
    def members(self) -> set[str]:
        """Names bound in a class body or as self.<name> in a method, at any depth."""
        return {q.rsplit(".", 1)[1] for q in self.symbols if "." in q}

    def innermost(self, line: int) -> str | None:
        """The smallest symbol whose span holds `line`."""
        holding = [(end - start, q) for q, (start, end) in self.symbols.items() if start <= line < end]
        return min(holding)[1] if holding else None

    def text(self, span: tuple[int, int]) -> str:
        return "".join(self.lines[span[0]:span[1]])


def parse_source(text: str, where: str) -> Source:
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise RebaseError(overlay.BAD_INPUT, f"{where}: not parseable Python ({exc})") from exc
    source = Source(text.splitlines(keepends=True))
    _bind(tree.body, "", source, in_class=False)
    for node in ast.walk(tree):
        for kind, name, line in _mentioned(node):
            source.mentions.setdefault(name, []).append(line)
            if kind in ("name", "attr", "self-attr"):
                source.uses.append((kind, name, line))
    return source


def _span(node: ast.stmt) -> tuple[int, int]:
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return first - 1, _end_line(node)


def _end_line(node: ast.stmt | ast.expr) -> int:
    """A node's last line (1-based): ast.parse sets it on every node; only one built by hand lacks it."""
    if node.end_lineno is None:
        raise RebaseError(overlay.BAD_INPUT, f"line {node.lineno}: a syntax node without an end line")
    return node.end_lineno


def _bind(body: list[ast.stmt], prefix: str, source: Source, in_class: bool) -> None:
    """Record the names `body` binds (first binding wins), descending into classes and into the
    compound statements (if TYPE_CHECKING:, try:) that still bind at this level."""
    for node in body:
        for name in _bound_names(node):
            source.symbols.setdefault(prefix + name, _span(node))
        if isinstance(node, ast.ClassDef):
            _bind(node.body, f"{prefix}{node.name}.", source, in_class=True)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and in_class:
            for attr, statement in _self_bindings(node):
                source.symbols.setdefault(prefix + attr, _span(statement))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (getattr(node, "body", []), getattr(node, "orelse", []), getattr(node, "finalbody", []),
                          *(h.body for h in getattr(node, "handlers", []))):
                _bind(block, prefix, source, in_class)


def _self_bindings(method: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[str, ast.stmt]]:
    """(name, its statement) for each self.<name> a method assigns, at any depth."""
    return [(target.attr, sub) for sub in ast.walk(method) if isinstance(sub, ast.stmt)
            for target in _assign_targets(sub)
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"]


def _assign_targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return [t for target in node.targets for t in ast.walk(target) if isinstance(t, (ast.Name, ast.Attribute))]
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _bound_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name != "*"]
    return [t.id for t in _assign_targets(node) if isinstance(t, ast.Name)]


def _mentioned(node: ast.AST) -> list[tuple[str, str, int]]:
    """(kind, identifier, 0-based line) for the identifiers `node` itself carries."""
    if isinstance(node, ast.Name):
        return [("name" if isinstance(node.ctx, ast.Load) else "bind", node.id, node.lineno - 1)]
    if isinstance(node, ast.Attribute):
        if not isinstance(node.ctx, ast.Load):
            return [("bind", node.attr, _end_line(node) - 1)]
        on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
        return [("self-attr" if on_self else "attr", node.attr, _end_line(node) - 1)]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [("bind", node.name, node.lineno - 1)]
    if isinstance(node, ast.arg):
        return [("bind", node.arg, node.lineno - 1)]
    if isinstance(node, ast.keyword) and node.arg:
        return [("keyword", node.arg, node.lineno - 1)]
    if isinstance(node, ast.alias):
        return [("bind", (node.asname or node.name).split(".")[0], node.lineno - 1)]
    return []


def imported_modules(text: str) -> set[str]:
    """vllm modules a file imports, anywhere in it (function-level imports included), plus the
    submodules a `from package import name` may name."""
    modules = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
            modules |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {m for m in modules if m == "vllm" or m.startswith("vllm.")}


# --- wheels -------------------------------------------------------------------------------------


class Wheel:
    """One vLLM wheel, read lazily; Python members are parsed once."""

    def __init__(self, path: Path, filename: str, sha256: str, version: str):
        self.path, self.filename, self.sha256, self.version = path, filename, sha256, version
        self._archive = zipfile.ZipFile(path)
        self._names = set(self._archive.namelist())
        self._sources: dict[str, Source] = {}
        self._definers: dict[str, list[str]] | None = None

    def close(self) -> None:
        self._archive.close()

    def has(self, member: str) -> bool:
        return member in self._names

    def read(self, member: str) -> bytes | None:
        return self._archive.read(member) if member in self._names else None

    def source(self, member: str) -> Source | None:
        if member not in self._sources:
            data = self.read(member)
            if data is None:
                return None
            self._sources[member] = parse_source(data.decode(), f"{self.filename}:{member}")
        return self._sources[member]

    def module_path(self, module: str) -> str | None:
        stem = module.replace(".", "/")
        return next((p for p in (f"{stem}.py", f"{stem}/__init__.py") if p in self._names), None)

    def python_members(self) -> list[str]:
        return sorted(n for n in self._names if n.startswith("vllm/") and n.endswith(".py"))

    def definers(self, name: str) -> list[str]:
        """The files with a `def name` or `class name` (indexed once, by a regex pass)."""
        if self._definers is None:
            self._definers = {}
            pattern = re.compile(rb"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+([A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)
            for member in self.python_members():
                for found in dict.fromkeys(pattern.findall(self._archive.read(member))):
                    self._definers.setdefault(found.decode(), []).append(member)
        return self._definers.get(name, [])


# --- anchors: is the upstream code a change touches still there? --------------------------------


def _key(name: str) -> str:
    """Compare names by their last part, case and underscores aside: storage_block_size and
    StorageBlockSize, or f and Class._f, are the same word."""
    return name.rsplit(".", 1)[-1].replace("_", "").lower()


def close_matches(name: str, base_names: set[str], target_names: set[str], limit: int = 3) -> list[str]:
    """Names new in the target (absent from base) that look like `name`."""
    scored = [(difflib.SequenceMatcher(None, _key(name), _key(c)).ratio(), c) for c in target_names - base_names]
    return [c for ratio, c in sorted(scored, key=lambda rc: (-rc[0], rc[1])) if ratio >= 0.8][:limit]


def defined_elsewhere(name: str, path: str, target: Wheel, limit: int = 5) -> list[str]:
    return [m for m in target.definers(name.rsplit(".", 1)[-1]) if m != path][:limit]


def check_anchor(anchor: str, base: Wheel, target: Wheel) -> dict:
    path, _, name = anchor.partition(":")
    before, after = base.source(path), target.source(path)
    if before is None:
        raise RebaseError(overlay.BAD_INPUT, f"anchor {anchor}: vLLM {base.version} has no {path}; "
                                             "anchors name upstream code the change touches (changes.toml)")
    kind = "symbol" if name in before.symbols else "identifier" if name in before.mentions else None
    if kind is None:
        raise RebaseError(overlay.BAD_INPUT, f"anchor {anchor}: vLLM {base.version} has no such name in {path}; "
                                             "anchors name upstream code the change touches (changes.toml)")
    result = {"anchor": anchor, "kind": kind, "in_target": False}
    if after is not None and (name in after.symbols if kind == "symbol" else name in after.mentions):
        line = after.symbols[name][0] if kind == "symbol" else after.mentions[name][0]
        return {**result, "in_target": True, "evidence": f"{path}:{line + 1}"}
    if after is None:
        return {**result, "evidence": f"vLLM {target.version} has no {path}"}
    known = KNOWN_RENAMES.get(path, {}).get(name)
    pool = (before.symbols, after.symbols) if kind == "symbol" else (before.mentions, after.mentions)
    if known and (known in after.symbols or known in after.mentions):
        result["renamed_to"] = known
    result["close_matches"] = close_matches(name, set(pool[0]), set(pool[1]))
    if kind == "symbol":
        result["defined_elsewhere"] = defined_elsewhere(name, path, target)
    return {**result, "evidence": f"not in vLLM {target.version} {path}"}


# --- signatures: is the change upstream? --------------------------------------------------------


def _line_at(text: str, hit: re.Match) -> int:
    """The line of the match's first non-blank character (a ^\\s* pattern can start on an
    earlier, empty line)."""
    matched = hit.group()
    blank = len(matched) - len(matched.lstrip()) if matched.strip() else 0
    return text.count("\n", 0, hit.start() + blank)


def check_signature(signature: Signature, wheel: Wheel) -> dict:
    """Does `wheel`'s source show the signature? The first `at` that exists is checked."""
    result = {"at": list(signature.at), "means": signature.means}
    for at in signature.at:
        path, _, name = at.partition(":")
        found = _text_at(wheel, path, name)
        if found is None:
            continue
        text, first = found
        return {**result, **_match_signature(signature, at, path, text, first)}
    return {**result, "checked": None, "holds": False,
            "evidence": f"vLLM {wheel.version} has none of {', '.join(signature.at)}"}


def _text_at(wheel: Wheel, path: str, name: str) -> tuple[str, int] | None:
    """The text a signature's `at` names (symbol `name` of `path`, or without one the whole
    file) and its first line (0-based); None when `wheel` has no such file or symbol."""
    if name:
        source = wheel.source(path)
        if source is None or name not in source.symbols:
            return None
        span = source.symbols[name]
        return source.text(span), span[0]
    data = wheel.read(path)
    return None if data is None else (data.decode(), 0)


def _match_signature(signature: Signature, at: str, path: str, text: str, first: int) -> dict:
    where = f"{path}:{first + 1}-{first + text.count(chr(10))}"
    if signature.contains:
        hit = re.search(signature.contains, text, re.MULTILINE)
        if not hit:
            return {"checked": at, "holds": False, "evidence": f"no match for /{signature.contains}/ in {where}"}
        line = first + _line_at(text, hit)
        evidence = f"{path}:{line + 1}: {text.splitlines()[line - first].strip()}"
    else:
        evidence = f"{at} is defined ({where})"
    if signature.lacks:
        hit = re.search(signature.lacks, text, re.MULTILINE)
        if hit:
            line = first + _line_at(text, hit)
            return {"checked": at, "holds": False,
                    "evidence": f"{path}:{line + 1}: {text.splitlines()[line - first].strip()} (matches /{signature.lacks}/)"}
        evidence += f"; nothing in {where} matches /{signature.lacks}/"
    return {"checked": at, "holds": True, "evidence": evidence}
