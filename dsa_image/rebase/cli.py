"""Re-base the overlay onto another vLLM release: a 3-way merge per overlaid file and a report
per named change (the overlay's changes.toml, folded into its manifest.json by `record`).

  base    the upstream file the overlay was made from (pinned wheel, hash-checked)
  ours    the overlay file
  theirs  the same path in the target release's wheel (hash-checked against the index)

Writes only into its output directory (default build/rebase/<from>-to-<to>/): base/, ours/,
theirs/ and merged/ trees mirroring site-packages, report.md and report.json. Never writes
overlay/ or the manifest: a merged file becomes overlay only through a person and `record`.

Per change the report says whether its hunks merged cleanly or conflict (both sides shown),
whether it is already upstream (static signatures checked against the target's source, and,
with --target-python, the change's own tests run against the stock target vLLM), and which
upstream code it touches moved or was renamed.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from dsa_image.overlay import cli as overlay
from dsa_image.core import wheels
from dsa_image.core.atomic import read_regular
from dsa_image.overlay.manifest import Change, Entry, Manifest, Signature
from dsa_image.core.recipe import DEFAULT_RECIPE, REPO_ROOT

REPORT_SCHEMA = 1
# The overlay tool's one exit-code table (overlay_core) holds rebase's CONFLICT too.
CONFLICT = overlay.CONFLICT
MAX_EXCERPT_LINES = 8  # per side of a conflict region in report.md and report.json
TARGET_PLATFORM_SUFFIX = "_x86_64.whl"  # the reference platform's wheel (overlay.REFERENCE_PLATFORM)

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


# --- 3-way merge ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """One region of a 3-way merge; ranges are 0-based, half-open line ranges.

    kind: "same" (all three agree), "ours" (only the overlay changed it), "theirs" (only
    upstream changed it), "both" (both changed it identically), "conflict".
    """

    kind: str
    base: tuple[int, int]
    ours: tuple[int, int]
    theirs: tuple[int, int]


def _match_map(base: list[str], other: list[str]) -> list[int]:
    """For each base line, the index of the other-side line it is matched to, or -1."""
    matcher = difflib.SequenceMatcher(None, base, other, autojunk=False)
    pairs = [(a + k, b + k) for a, b, size in matcher.get_matching_blocks() for k in range(size)]
    matched = [-1] * len(base)
    for i, j in _slide_down(base, other, pairs):
        matched[i] = j
    return matched


def _slide_down(base: list[str], other: list[str], pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Move each pure insertion or deletion as far down as equal lines allow (git's diff does
    the same). Without this, an insertion that ends like the line after it (`    ),`) can be
    aligned one line earlier than the other side's insertion at the same place, and two
    edits of one spot merge silently instead of conflicting."""
    pairs = [*pairs, (len(base), len(other))]  # a matched end, so a trailing gap can slide too
    for k in range(len(pairs) - 1):
        i0, j0 = pairs[k - 1] if k else (-1, -1)
        i1, j1 = pairs[k]
        if pairs[k + 1] != (i1 + 1, j1 + 1):
            continue  # sliding would merge this gap into the next change
        if i1 == i0 + 1 and j1 > j0 + 1 and other[j0 + 1] == other[j1]:
            pairs[k] = (i1, j0 + 1)
        elif j1 == j0 + 1 and i1 > i0 + 1 and base[i0 + 1] == base[i1]:
            pairs[k] = (i0 + 1, j1)
    return pairs[:-1]


def diff3_chunks(base: list[str], ours: list[str], theirs: list[str]) -> list[Chunk]:
    """The classic diff3 walk: runs of base lines matched on both sides are stable; what lies
    between two stable runs is one unstable region, classified by which sides changed it."""
    to_ours, to_theirs = _match_map(base, ours), _match_map(base, theirs)
    chunks: list[Chunk] = []
    o = a = b = 0
    while o < len(base) or a < len(ours) or b < len(theirs):
        run = 0
        while (o + run < len(base) and to_ours[o + run] == a + run and to_theirs[o + run] == b + run):
            run += 1
        if run:
            chunks.append(Chunk("same", (o, o + run), (a, a + run), (b, b + run)))
            o, a, b = o + run, a + run, b + run
            continue
        nxt = next((i for i in range(o, len(base)) if to_ours[i] >= a and to_theirs[i] >= b), None)
        end = (nxt, to_ours[nxt], to_theirs[nxt]) if nxt is not None else (len(base), len(ours), len(theirs))
        chunks.extend(_classify(base, ours, theirs, (o, end[0]), (a, end[1]), (b, end[2])))
        o, a, b = end
    return chunks


def _classify(base, ours, theirs, o, a, b) -> list[Chunk]:
    base_part, ours_part, theirs_part = base[o[0]:o[1]], ours[a[0]:a[1]], theirs[b[0]:b[1]]
    if ours_part == base_part and theirs_part == base_part:
        return [Chunk("same", o, a, b)]
    if ours_part == base_part:
        return [Chunk("theirs", o, a, b)]
    if theirs_part == base_part:
        return [Chunk("ours", o, a, b)]
    if ours_part == theirs_part:
        return [Chunk("both", o, a, b)]
    return _trim_conflict(ours, theirs, o, a, b)


def _trim_conflict(ours, theirs, o, a, b) -> list[Chunk]:
    """Lines both sides share at the start or end of a conflict are not in conflict (git's
    zealous merge does the same): they become "both" chunks around a smaller conflict."""
    head = 0
    while a[0] + head < a[1] and b[0] + head < b[1] and ours[a[0] + head] == theirs[b[0] + head]:
        head += 1
    tail = 0
    while (a[1] - tail > a[0] + head and b[1] - tail > b[0] + head
           and ours[a[1] - tail - 1] == theirs[b[1] - tail - 1]):
        tail += 1
    chunks = []
    if head:
        chunks.append(Chunk("both", (o[0], o[0]), (a[0], a[0] + head), (b[0], b[0] + head)))
    chunks.append(Chunk("conflict", o, (a[0] + head, a[1] - tail), (b[0] + head, b[1] - tail)))
    if tail:
        chunks.append(Chunk("both", (o[1], o[1]), (a[1] - tail, a[1]), (b[1] - tail, b[1])))
    return chunks


def render_merge(chunks: list[Chunk], base: list[str], ours: list[str], theirs: list[str],
                 labels: tuple[str, str, str]) -> str:
    """The merged text, diff3-style markers (ours, base, theirs) around each conflict."""
    out = []
    for chunk in chunks:
        if chunk.kind in ("same", "ours", "both"):
            out.extend(ours[slice(*chunk.ours)])
        elif chunk.kind == "theirs":
            out.extend(theirs[slice(*chunk.theirs)])
        else:
            out.append(f"<<<<<<< {labels[0]}\n")
            out.extend(_terminated(ours[slice(*chunk.ours)]))
            out.append(f"||||||| {labels[1]}\n")
            out.extend(_terminated(base[slice(*chunk.base)]))
            out.append("=======\n")
            out.extend(_terminated(theirs[slice(*chunk.theirs)]))
            out.append(f">>>>>>> {labels[2]}\n")
    return "".join(out)


def _terminated(lines: list[str]) -> list[str]:
    """A last line without a newline would swallow the following marker."""
    return [*lines[:-1], lines[-1] if lines[-1].endswith("\n") else lines[-1] + "\n"] if lines else []


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


def _span(node: ast.AST) -> tuple[int, int]:
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return first - 1, node.end_lineno


def _bind(body: list[ast.stmt], prefix: str, source: Source, in_class: bool) -> None:
    """Record the names `body` binds (first binding wins), descending into classes and into the
    compound statements (if TYPE_CHECKING:, try:) that still bind at this level."""
    for node in body:
        for name in _bound_names(node):
            source.symbols.setdefault(prefix + name, _span(node))
        if isinstance(node, ast.ClassDef):
            _bind(node.body, f"{prefix}{node.name}.", source, in_class=True)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and in_class:
            for sub in ast.walk(node):
                for target in _assign_targets(sub):
                    if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                            and target.value.id == "self"):
                        source.symbols.setdefault(prefix + target.attr, _span(sub))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (getattr(node, "body", []), getattr(node, "orelse", []), getattr(node, "finalbody", []),
                          *(h.body for h in getattr(node, "handlers", []))):
                _bind(block, prefix, source, in_class)


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
            return [("bind", node.attr, node.end_lineno - 1)]
        on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
        return [("self-attr" if on_self else "attr", node.attr, node.end_lineno - 1)]
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
                for found in dict.fromkeys(pattern.findall(self.read(member))):
                    self._definers.setdefault(found.decode(), []).append(member)
        return self._definers.get(name, [])


def wheel_version(path: Path) -> str:
    """The Version in the wheel's vllm-*.dist-info/METADATA."""
    with zipfile.ZipFile(path) as archive:
        metadata = [n for n in archive.namelist() if re.fullmatch(r"vllm-[^/]+\.dist-info/METADATA", n)]
        if len(metadata) != 1:
            raise RebaseError(overlay.BAD_INPUT, f"{path}: not a vLLM wheel (no single vllm-*.dist-info/METADATA)")
        found = re.search(r"^Version: (\S+)$", archive.read(metadata[0]).decode(errors="replace"), re.MULTILINE)
    if not found:
        raise RebaseError(overlay.BAD_INPUT, f"{path}: {metadata[0]} has no Version")
    return found.group(1)


def resolve_target(version: str, index_url: str = wheels.PYPI_SIMPLE) -> tuple[Path, str, str]:
    """The target release's x86_64 manylinux wheel (the platform `record` and `diff` read),
    downloaded with the sha256 the index states and re-hashed (cached like every wheel)."""
    try:
        listed = [f for f in wheels.index_files("vllm", index_url)
                  if f.filename.startswith(f"vllm-{version}-") and "manylinux" in f.filename
                  and f.filename.endswith(TARGET_PLATFORM_SUFFIX)]
    except wheels.WheelError as exc:
        raise RebaseError(overlay.BAD_INPUT, str(exc)) from exc
    if len(listed) != 1:
        names = ", ".join(f.filename for f in listed) or "none"
        raise RebaseError(overlay.BAD_INPUT, f"vLLM {version}: expected one manylinux x86_64 wheel on {index_url}, "
                                             f"found {names}")
    entry = listed[0]
    try:
        return wheels.ensure_wheel(entry.filename, entry.sha256, index_url), entry.filename, entry.sha256
    except wheels.WheelError as exc:
        raise RebaseError(overlay.BAD_INPUT, str(exc)) from exc


def local_target(path: Path, sha256: str) -> tuple[Path, str, str]:
    """An offline target wheel, trusted only when it hashes to the sha256 given for it."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256 or ""):
        raise RebaseError(overlay.BAD_INPUT, "--wheel needs --wheel-sha256 (64 lower-case hex) to check it against")
    if not path.is_file():
        raise RebaseError(overlay.BAD_INPUT, f"{path}: no such wheel")
    found = wheels.sha256_file(path)
    if found != sha256:
        raise RebaseError(overlay.BAD_INPUT, f"{path}: has sha256 {found}, --wheel-sha256 says {sha256}")
    return path, path.name, sha256


# --- merging one file ---------------------------------------------------------------------------


@dataclass
class Hunk:
    """A region the overlay changed (ours differs from base), after the merge."""

    number: int
    chunk: Chunk
    region: int | None  # its conflict region number, None when it merged cleanly
    changes: tuple[str, ...] = ()


@dataclass
class FileMerge:
    path: str
    status: str  # merged-cleanly | conflict | new-file | new-file-collides | removed-upstream
    changes: tuple[str, ...]
    base: str | None
    ours: str
    theirs: str | None
    merged: str
    hunks: list[Hunk]
    note: str = ""
    vanished: list[dict] = field(default_factory=list)

    @property
    def conflicts(self) -> int:
        return len({h.region for h in self.hunks if h.region is not None})


def merge_entry(entry: Entry, ours: str, base: Wheel, target: Wheel) -> FileMerge:
    theirs_raw = target.read(entry.path)
    theirs = None if theirs_raw is None else theirs_raw.decode()
    if entry.new:
        return _merge_new(entry, ours, theirs, target.version)
    base_text = base.read(entry.path).decode()
    if theirs is None:
        return _merge_removed(entry, ours, base_text, target)
    chunks = diff3_chunks(*(t.splitlines(keepends=True) for t in (base_text, ours, theirs)))
    labels = (f"ours (overlay {entry.path})", f"base (vLLM {base.version})", f"theirs (vLLM {target.version})")
    merged = render_merge(chunks, *(t.splitlines(keepends=True) for t in (base_text, ours, theirs)), labels)
    hunks, region = [], 0
    for chunk in chunks:
        if chunk.kind in ("ours", "both", "conflict"):
            region += chunk.kind == "conflict"
            hunks.append(Hunk(len(hunks) + 1, chunk, region if chunk.kind == "conflict" else None))
    status = "conflict" if region else "merged-cleanly"
    return FileMerge(entry.path, status, entry.changes, base_text, ours, theirs, merged, hunks)


def _whole_file_hunk(ours: str, theirs: str | None) -> Hunk:
    ours_lines, theirs_lines = len(ours.splitlines()), len((theirs or "").splitlines())
    return Hunk(1, Chunk("conflict", (0, 0), (0, ours_lines), (0, theirs_lines)), 1)


def _merge_new(entry: Entry, ours: str, theirs: str | None, version: str) -> FileMerge:
    if theirs is None:
        hunk = Hunk(1, Chunk("ours", (0, 0), (0, len(ours.splitlines())), (0, 0)), None)
        return FileMerge(entry.path, "new-file", entry.changes, None, ours, None, ours, [hunk],
                         note=f"new file: vLLM {version} has no file at this path; carried over as is")
    return FileMerge(entry.path, "new-file-collides", entry.changes, None, ours, theirs, ours,
                     [_whole_file_hunk(ours, theirs)],
                     note=f"new file: vLLM {version} now has a file at this path; ours would overwrite it")


def _merge_removed(entry: Entry, ours: str, base_text: str, target: Wheel) -> FileMerge:
    name = PurePosixPath(entry.path).name
    elsewhere = [m for m in target.python_members() if PurePosixPath(m).name == name]
    where = f"; files named {name} there: {', '.join(elsewhere[:5])}" if elsewhere else ""
    return FileMerge(entry.path, "removed-upstream", entry.changes, base_text, ours, None, ours,
                     [_whole_file_hunk(ours, None)],
                     note=f"vLLM {target.version} has no file at this path (removed or moved){where}")


# --- which change a hunk belongs to -----------------------------------------------------------


def _names_in(change: Change, path: str) -> list[str]:
    return [n.partition(":")[2] for n in (*change.anchors, *change.introduces) if n.partition(":")[0] == path]


def attribute(merge: FileMerge, changes: list[Change], base: Source | None, ours: Source | None) -> None:
    """Each hunk belongs to the changes whose anchors or introduced names it touches (see
    _places; the symbols are the innermost ones holding the hunk's base and ours lines). A
    file that carries one change gives it every hunk."""
    for hunk in merge.hunks:
        if len(changes) == 1 or base is None or ours is None:
            hunk.changes = tuple(c.id for c in changes)
            continue
        base_lines, ours_lines = range(*hunk.chunk.base), range(*hunk.chunk.ours)
        inside = {base.innermost(i) for i in base_lines} | {ours.innermost(j) for j in ours_lines}
        text = "".join([*(base.lines[i] for i in base_lines), *(ours.lines[j] for j in ours_lines)])
        hunk.changes = tuple(c.id for c in changes if any(_places(n, inside, text) for n in _names_in(c, merge.path)))


def _places(name: str, inside: set[str | None], text: str) -> bool:
    """A dotted name places lines that lie in that symbol; a plain one, lines in a symbol of
    that last name (Class.name, Class.name.attr aside) or lines that mention it."""
    if "." in name:
        return name in inside
    return (any(q is not None and (q == name or q.endswith("." + name)) for q in inside)
            or re.search(rf"\b{re.escape(name)}\b", text) is not None)


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


# --- names our hunks use that the target no longer defines ---------------------------------------


def _definitions(wheel: Wheel, paths: list[str]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Module-level names and class members (with the files defining them) of `paths`."""
    module_level: dict[str, set[str]] = {}
    members: dict[str, set[str]] = {}
    for path in paths:
        source = wheel.source(path)
        for name in source.module_names:
            module_level.setdefault(name, set()).add(path)
        for name in source.members:
            members.setdefault(name, set()).add(path)
    return module_level, members


def vanished_uses(merge: FileMerge, ours: Source, changes: list[Change], base: Wheel, target: Wheel) -> list[dict]:
    """Names our changed lines read (a bare name or an attribute) that vLLM base defines in
    this file or a vllm module it imports, and that the target defines in none of them: a
    hunk can merge cleanly and still call code that is gone. Names the overlay file binds
    itself (a module-level name, or self.<member> of its own classes) do not count."""
    modules = sorted(imported_modules(merge.ours))
    scopes = []
    for wheel in (base, target):
        paths = [merge.path, *filter(None, (wheel.module_path(m) for m in modules))]
        scopes.append(_definitions(wheel, [p for p in dict.fromkeys(paths) if wheel.has(p)]))
    (base_mod, base_mem), (target_mod, target_mem) = scopes
    changed = {j: h for h in merge.hunks for j in range(*h.chunk.ours)}
    found: dict[str, dict] = {}
    for kind, name, line in ours.uses:
        hunk = changed.get(line)
        if hunk is None or name in (ours.members if kind == "self-attr" else ours.module_names if kind == "name" else ()):
            continue
        attribute_like = kind != "name"
        defined = base_mod.get(name, set()) | (base_mem.get(name, set()) if attribute_like else set())
        if not defined or name in target_mod or (attribute_like and name in target_mem):
            continue
        item = found.setdefault(name, {"name": name, "kind": "attribute" if attribute_like else "name",
                                       "file": merge.path, "uses": [],
                                       "defined_in_base": sorted(defined), "close_matches": close_matches(
                                           name, set(base_mod) | set(base_mem), set(target_mod) | set(target_mem))})
        known = KNOWN_RENAMES.get(merge.path, {}).get(name)
        if known and (known in target_mod or known in target_mem):
            item["renamed_to"] = known
        placed = _place_line(line, ours, changes, merge.path) or hunk.changes
        item["uses"].append({"ours_line": line + 1, "changes": list(placed)})
    return [found[n] for n in sorted(found)]


def _place_line(line: int, ours: Source, changes: list[Change], path: str) -> tuple[str, ...]:
    """The changes one overlay line belongs to, when its own symbol or text says so."""
    inside, text = {ours.innermost(line)}, ours.lines[line]
    return tuple(c.id for c in changes if any(_places(n, inside, text) for n in _names_in(c, path)))


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
        if not wheel.has(path):
            continue
        if name:
            source = wheel.source(path)
            if source is None or name not in source.symbols:
                continue
            span = source.symbols[name]
            text, first = source.text(span), span[0]
        else:
            text, first = wheel.read(path).decode(), 0
        return {**result, **_match_signature(signature, at, path, text, first)}
    return {**result, "checked": None, "holds": False,
            "evidence": f"vLLM {wheel.version} has none of {', '.join(signature.at)}"}


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


# --- behavioural evidence: the changes' own tests against the stock target vLLM ------------------

_PROBE = """
import hashlib, importlib.metadata, importlib.util, json, os, sys
dist = importlib.metadata.distribution("vllm")
spec = importlib.util.find_spec("vllm")
files = {}
for member in json.loads(sys.argv[1]):
    path = dist.locate_file(member)
    files[member] = hashlib.sha256(open(path, "rb").read()).hexdigest() if os.path.isfile(path) else None
print(json.dumps({"version": dist.version, "files": files,
                  "imported_from": os.path.dirname(spec.origin) if spec and spec.origin else None,
                  "installed_at": os.path.dirname(str(dist.locate_file("vllm/__init__.py")))}))
"""


def check_stock_target(python: str, target: Wheel, paths: list[str], timeout: float = 300) -> None:
    """`python` must import an unmodified vLLM of the target version: every overlaid path
    hashes to the target wheel's file (or is absent where the wheel has none)."""
    try:
        done = subprocess.run([python, "-c", _PROBE, json.dumps(paths)], capture_output=True, text=True,
                              timeout=timeout, cwd=tempfile.gettempdir())
    except OSError as exc:
        raise RebaseError(overlay.BAD_INPUT, f"--target-python {python}: cannot run it ({exc})") from exc
    if done.returncode != 0:
        raise RebaseError(overlay.BAD_INPUT, f"--target-python {python}: no vLLM there ({done.stderr.strip()[-500:]})")
    found = json.loads(done.stdout)
    if found["version"] != target.version:
        raise RebaseError(overlay.BAD_INPUT, f"--target-python {python} has vLLM {found['version']}, not {target.version}")
    if not found["imported_from"] or os.path.realpath(found["imported_from"]) != os.path.realpath(found["installed_at"]):
        raise RebaseError(overlay.BAD_INPUT, f"--target-python {python} imports vllm from {found['imported_from']}, "
                                             f"not its installed {found['installed_at']} (PYTHONPATH or a checkout)")
    for path in paths:
        member = target.read(path)
        expected = None if member is None else wheels.sha256_bytes(member)
        if found["files"][path] != expected:
            raise RebaseError(overlay.BAD_INPUT, f"--target-python {python}: {path} is not vLLM {target.version}'s "
                                                 f"stock file (sha256 {found['files'][path]}, wheel {expected}); "
                                                 "behavioural evidence needs a stock install")


def run_tests(python: str, tests: list[str], repo_root: Path, log_dir: Path, timeout: float = 3600) -> dict[str, str]:
    """pytest outcome per node id: passed, failed, error, skipped or not-collected."""
    log_dir.mkdir(parents=True, exist_ok=True)
    junit = log_dir / "junit.xml"
    command = [python, "-m", "pytest", "-p", "no:cacheprovider", "--continue-on-collection-errors",
               f"--junitxml={junit}", *tests]
    done = subprocess.run(command, cwd=repo_root, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    (log_dir / "pytest.log").write_text(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}")
    cases = ElementTree.parse(junit).getroot().iter("testcase") if junit.exists() else []
    outcomes: dict[str, list[str]] = {}
    for case in cases:
        module, name = case.get("classname", ""), case.get("name", "").split("[", 1)[0]
        node = f"{module.replace('.', '/')}.py::{name}"
        tags = {child.tag for child in case}
        outcomes.setdefault(node, []).append(next(
            (label for tag, label in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")) if tag in tags),
            "passed"))
    return {t: _combined(outcomes.get(t)) for t in tests}


def _combined(results: list[str] | None) -> str:
    """One outcome for a node id (a parametrized test has several): the worst of them."""
    if not results:
        return "not-collected"
    return next((worst for worst in ("failed", "error", "skipped") if worst in results), "passed")


def _behaviour(change: Change, outcomes: dict[str, str] | None, version: str) -> dict:
    if not change.tests:
        return {"status": "no-tests", "detail": "this change has no CPU behavioural tests; the evidence is static only"}
    if outcomes is None:
        return {"status": "not-collected",
                "detail": f"behavioural evidence not collected: no environment with vLLM {version} "
                          "(run with --target-python PYTHON, an interpreter with stock vLLM installed)"}
    results = {t: outcomes[t] for t in change.tests}
    status = ("passed" if set(results.values()) == {"passed"}
              else "inconclusive" if set(results.values()) <= {"passed", "skipped"} else "failed")
    return {"status": status, "tests": results,
            "detail": f"the change's tests against stock vLLM {version}: " + ", ".join(
                f"{t.rsplit('::', 1)[1]} {r}" for t, r in results.items())}


def check_test_ids(tests: list[str], repo_root: Path) -> None:
    """A node id must name a test function defined in its file (caught before anything runs)."""
    for node in tests:
        path, _, name = node.partition("::")
        source = repo_root / path
        defined = source.is_file() and any(
            isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
            for n in ast.parse(source.read_text()).body)
        if not defined:
            raise RebaseError(overlay.BAD_INPUT, f"test {node}: no such test function (changes.toml)")


# --- the rebase ------------------------------------------------------------------------------------


@dataclass
class Inputs:
    manifest: Manifest
    manifest_sha256: str
    ours: dict[str, str]  # overlay path -> text, each already checked against the manifest
    base: Wheel
    target: Wheel
    repo_root: Path = REPO_ROOT  # where the changes' tests live (and run)


def check_inputs(inputs: Inputs) -> None:
    """What the report rests on: named changes, a base wheel whose files are the ones the
    overlay was made from, anchors and introduced names where they should be, signatures
    that the base does not already show, test ids that exist."""
    manifest, base = inputs.manifest, inputs.base
    if not manifest.changes:
        raise RebaseError(overlay.BAD_INPUT, "the manifest names no changes: define them in its changes.toml and "
                                             f"run `python3 scripts/overlay.py record --refresh --vllm {manifest.vllm_version}`")
    for entry in manifest.files:
        member = base.read(entry.path)
        found = None if member is None else wheels.sha256_bytes(member)
        if found != entry.upstream_sha256:
            raise RebaseError(overlay.DRIFT, f"{entry.path}: {base.filename} has sha256 {found}, the manifest "
                                             f"records {entry.upstream_sha256}")
    ours = {p: parse_source(t, f"overlay/{p}") for p, t in inputs.ours.items() if p.endswith(".py")}
    for change in manifest.changes:
        for name in change.introduces:
            _check_introduced(name, ours, base)
        for signature in change.signatures:
            if check_signature(signature, base)["holds"]:
                raise RebaseError(overlay.BAD_INPUT, f"change {change.id}: signature {signature.at[0]} already holds on "
                                                     f"vLLM {base.version}, so it cannot show the change upstream")
        check_test_ids(list(change.tests), inputs.repo_root)


def _check_introduced(name: str, ours_sources: dict[str, Source], base: Wheel) -> None:
    path, _, symbol = name.partition(":")
    ours, before = ours_sources.get(path), base.source(path)
    if ours is None or (symbol not in ours.symbols and symbol not in ours.mentions):
        raise RebaseError(overlay.BAD_INPUT, f"introduces {name}: the overlay file has no such name")
    if before is not None and (symbol in before.symbols or symbol in before.mentions):
        raise RebaseError(overlay.BAD_INPUT, f"introduces {name}: vLLM {base.version} already has it "
                                             "(an upstream name is an anchor)")


def rebase(inputs: Inputs, command: str, target_python: str | None = None,
           log_dir: Path | None = None) -> tuple[dict, list[FileMerge]]:
    """Merge every overlay file onto the target and judge every change; returns the report
    (a JSON-able dict) and the merges (what `write_outputs` puts on disk)."""
    check_inputs(inputs)
    manifest, base, target = inputs.manifest, inputs.base, inputs.target
    merges = [_merge_and_place(entry, inputs) for entry in manifest.files]
    outcomes = None
    if target_python:
        tests = sorted({t for c in manifest.changes for t in c.tests})
        check_stock_target(target_python, target, [e.path for e in manifest.files])
        outcomes = run_tests(target_python, tests, inputs.repo_root, log_dir or Path(tempfile.mkdtemp())) if tests else {}
    changes = {c.id: change_report(c, merges, base, target, outcomes) for c in manifest.changes}
    return build_report(inputs, command, merges, changes, outcomes is not None), merges


def _merge_and_place(entry: Entry, inputs: Inputs) -> FileMerge:
    """Merge one file, place its hunks in changes, and (Python, both sides there) find the
    names its hunks use that the target lost."""
    base, target = inputs.base, inputs.target
    merge = merge_entry(entry, inputs.ours[entry.path], base, target)
    changes = [inputs.manifest.change(i) for i in entry.changes]
    if not entry.path.endswith(".py"):
        attribute(merge, changes, None, None)
        return merge
    ours = parse_source(merge.ours, f"overlay/{entry.path}")
    attribute(merge, changes, base.source(entry.path) if merge.base is not None else None, ours)
    if merge.base is not None and merge.theirs is not None:
        merge.vanished = vanished_uses(merge, ours, changes, base, target)
    return merge


def change_report(change: Change, merges: list[FileMerge], base: Wheel, target: Wheel,
                  outcomes: dict[str, str] | None) -> dict:
    hunks = [(m, h) for m in merges for h in m.hunks if change.id in h.changes]
    regions = sorted({f"{m.path}#{h.region}" for m, h in hunks if h.region is not None}, key=_region_order)
    conflicted = sum(h.region is not None for _, h in hunks)
    merge = {"status": "conflict" if regions else "merged-cleanly" if hunks else "no-hunks",
             "hunks": len(hunks), "clean": len(hunks) - conflicted, "conflict": conflicted, "regions": regions}
    signatures = [check_signature(s, target) for s in change.signatures]
    held = sum(s["holds"] for s in signatures)
    static = "no-signatures" if not signatures else "yes" if held == len(signatures) else "partly" if held else "no"
    behaviour = _behaviour(change, outcomes, target.version)
    anchors = [check_anchor(a, base, target) for a in change.anchors]
    vanished = [_for_change(v, change.id) for m in merges for v in m.vanished
                if any(change.id in u["changes"] for u in v["uses"])]
    verdicts = [merge["status"]] if merge["status"] != "no-hunks" else []
    if static == "yes" and behaviour["status"] != "failed":
        verdicts.append("already-upstream")
    if any(not a["in_target"] for a in anchors) or vanished:
        verdicts.append("upstream-moved")
    return {"title": change.title, "files": [m.path for m in merges if change.id in m.changes], "verdicts": verdicts,
            "merge": merge, "upstream": {"static": static, "signatures_holding": held, "signatures": signatures,
                                         "behavioural": behaviour},
            "anchors": anchors, "vanished": vanished}


def _for_change(vanished: dict, change_id: str) -> dict:
    """A vanished name as one change sees it: only the lines that change placed."""
    lines = [u["ours_line"] for u in vanished["uses"] if change_id in u["changes"]]
    return {**{k: v for k, v in vanished.items() if k != "uses"}, "ours_lines": lines}


def _region_order(region: str) -> tuple[str, int]:
    path, _, number = region.rpartition("#")
    return path, int(number)


def _lines(span: tuple[int, int]) -> dict:
    return {"start": span[0] + 1, "count": span[1] - span[0]}


def _excerpt(text: str | None, span: tuple[int, int]) -> list[str]:
    lines = (text or "").splitlines()[span[0]:span[1]]
    return lines[:MAX_EXCERPT_LINES]


# How each of our hunks merged; "same-as-upstream": the target made the very same edit.
_HUNK_MERGE = {"ours": "clean", "both": "same-as-upstream", "conflict": "conflict"}


def file_report(merge: FileMerge) -> dict:
    hunks = [{"hunk": h.number, "merge": _HUNK_MERGE[h.chunk.kind], "region": h.region,
              "base": _lines(h.chunk.base), "ours": _lines(h.chunk.ours), "theirs": _lines(h.chunk.theirs),
              "changes": list(h.changes)} for h in merge.hunks]
    regions = [{"region": h.region, "changes": list(h.changes), "base": _lines(h.chunk.base),
                "ours": {**_lines(h.chunk.ours), "excerpt": _excerpt(merge.ours, h.chunk.ours)},
                "theirs": {**_lines(h.chunk.theirs), "excerpt": _excerpt(merge.theirs, h.chunk.theirs)}}
               for h in merge.hunks if h.region is not None]
    digest = {side: None if text is None else wheels.sha256_bytes(text.encode())
              for side, text in (("base", merge.base), ("ours", merge.ours), ("theirs", merge.theirs))}
    return {"status": merge.status, "note": merge.note, "changes": list(merge.changes), "sha256": digest,
            "hunks": hunks, "conflicts": merge.conflicts, "conflict_regions": regions,
            "unattributed_hunks": [h.number for h in merge.hunks if not h.changes and h.chunk.kind != "both"],
            "vanished": merge.vanished, "merged": f"merged/{merge.path}"}


def build_report(inputs: Inputs, command: str, merges: list[FileMerge], changes: dict, behavioural: bool) -> dict:
    conflicts = sum(m.conflicts for m in merges)
    base, target = inputs.base, inputs.target
    return {
        "schema": REPORT_SCHEMA,
        "command": command,
        "from": {"vllm": base.version, "wheel": base.filename, "sha256": base.sha256},
        "to": {"vllm": target.version, "wheel": target.filename, "sha256": target.sha256},
        "manifest_sha256": inputs.manifest_sha256,
        "conflicts": conflicts,
        "exit_code": CONFLICT if conflicts else overlay.OK,
        "behavioural_evidence": ("collected: each change's tests ran against stock vLLM " + target.version
                                 if behavioural else f"not collected: no environment with vLLM {target.version}"),
        "changes": changes,
        "files": {m.path: file_report(m) for m in merges},
    }


# --- the report on disk ------------------------------------------------------------------------

_VERDICT_WORDS = {"merged-cleanly": "merged cleanly", "conflict": "in conflict", "already-upstream": "already upstream",
                  "upstream-moved": "upstream moved or renamed code it touches"}


def _span_words(lines: dict) -> str:
    if lines["count"] == 0:
        return f"none (before line {lines['start']})"
    return f"{lines['start']}-{lines['start'] + lines['count'] - 1}"


def _fenced(lines: list[str], total: int) -> list[str]:
    fence = "~" * max(4, 1 + max((len(m) for m in re.findall(r"~+", "\n".join(lines))), default=0))
    more = [f"... {total - len(lines)} more lines"] if total > len(lines) else []
    return [f"{fence}python", *lines, *more, fence] if lines else ["(nothing)"]


def render_markdown(report: dict) -> str:
    source, target = report["from"], report["to"]
    out = [f"# Overlay rebase: vLLM {source['vllm']} -> {target['vllm']}", "",
           f"Regenerate: `{report['command']}` (the same as `"
           f"{report['command'].replace('python3 scripts/overlay.py rebase', 'python3 -m dsa_image.rebase.cli')}`)", "",
           "Written by `dsa_image/rebase/cli.py`; the merged sources (with conflict markers) stay in the output "
           "directory (`build/rebase/...`), never under `overlay/`, and nothing is recorded in the manifest.", "",
           "| | wheel | sha256 |", "|---|---|---|",
           f"| base | {source['wheel']} | `{source['sha256']}` |", f"| target | {target['wheel']} | `{target['sha256']}` |",
           "", f"Overlay manifest sha256 `{report['manifest_sha256']}`.", "",
           f"**Result: {report['conflicts']} conflict region(s); exit {report['exit_code']}"
           f" ({'conflict' if report['exit_code'] else 'ok'}).** Behavioural evidence {report['behavioural_evidence']}.",
           "", f"## What each change became on vLLM {target['vllm']}", "",
           "| change | verdicts | merge | already upstream (static signatures) | behavioural | anchors gone | "
           "names our hunks use that upstream no longer defines |", "|---|---|---|---|---|---|---|"]
    for change_id, change in report["changes"].items():
        out.append(_summary_row(change_id, change))
    out += ["", "Verdicts: *merged cleanly* / *in conflict* (the change's hunks, attributed by its anchors), "
            "*already upstream* (every signature holds in the target's source, and its tests did not fail against "
            "the stock target where they ran), *upstream moved or renamed code it touches* (an anchor is gone, or a "
            "name its hunks use is).", ""]
    for change_id, change in report["changes"].items():
        out += _change_section(change_id, change, target["vllm"])
    for path, item in report["files"].items():
        out += _file_section(path, item, source["vllm"], target["vllm"])
    return "\n".join(out).rstrip() + "\n"


def _summary_row(change_id: str, change: dict) -> str:
    merge, upstream = change["merge"], change["upstream"]
    merged = {"conflict": f"conflict: {merge['conflict']} of {merge['hunks']} hunks",
              "merged-cleanly": f"clean: {merge['hunks']} hunks", "no-hunks": "no hunks"}[merge["status"]]
    static = f"{upstream['static']} ({upstream['signatures_holding']}/{len(upstream['signatures'])})"
    gone = ", ".join(f"`{a['anchor'].partition(':')[2]}`" for a in change["anchors"] if not a["in_target"]) or "none"
    vanished = ", ".join(sorted({f"`{v['name']}`" for v in change["vanished"]})) or "none"
    verdicts = ", ".join(_VERDICT_WORDS[v] for v in change["verdicts"])
    return (f"| `{change_id}`: {change['title']} | {verdicts} | {merged} | {static} | "
            f"{upstream['behavioural']['status']} | {gone} | {vanished} |")


def _change_section(change_id: str, change: dict, version: str) -> list[str]:
    merge, upstream = change["merge"], change["upstream"]
    out = [f"## `{change_id}`: {change['title']}", "",
           f"- verdicts: {', '.join(_VERDICT_WORDS[v] for v in change['verdicts']) or 'none'}",
           f"- files: {', '.join(f'`{f}`' for f in change['files'])}",
           f"- merge: {merge['hunks']} hunks, {merge['clean']} clean, {merge['conflict']} in conflict"
           + (f" (conflict regions {_regions_words(merge['regions'])})" if merge["regions"] else ""),
           f"- already upstream in vLLM {version}, static evidence: {upstream['static']}"]
    for signature in upstream["signatures"]:
        mark = "holds" if signature["holds"] else "does not hold"
        out.append(f"  - {mark}: {signature['means']} ({signature['evidence']})")
    out.append(f"- behavioural: {upstream['behavioural']['detail']}")
    if change["anchors"]:
        out.append(f"- anchors (upstream code this change touches) in vLLM {version}:")
    for anchor in change["anchors"]:
        out.append(f"  - `{anchor['anchor']}` ({anchor['kind']}): " + _anchor_words(anchor))
    for used in change["vanished"]:
        likely = (f"; renamed to `{used['renamed_to']}` (known rename, checked against both wheels)"
                  if used.get("renamed_to") else "")
        likely += f"; likely now {', '.join(f'`{c}`' for c in used['close_matches'])}" if used["close_matches"] else ""
        out.append(f"- our hunks use `{used['name']}` ({used['kind']}; `{used['file']}` overlay lines "
                   f"{', '.join(map(str, used['ours_lines']))}), which {', '.join(used['defined_in_base'])} "
                   f"defined and vLLM {version} defines nowhere there{likely}")
    return [*out, ""]


def _regions_words(regions: list[str]) -> str:
    by_file: dict[str, list[str]] = {}
    for region in regions:
        path, _, number = region.rpartition("#")
        by_file.setdefault(path, []).append(number)
    return "; ".join(f"`{PurePosixPath(p).name}` {', '.join(n)}" for p, n in by_file.items())


def _anchor_words(anchor: dict) -> str:
    if anchor["in_target"]:
        return f"present ({anchor['evidence']})"
    words = [f"gone ({anchor['evidence']})"]
    if anchor.get("renamed_to"):
        words.append(f"renamed to `{anchor['renamed_to']}` (known rename, checked against both wheels)")
    if anchor.get("close_matches"):
        words.append("likely now " + ", ".join(f"`{c}`" for c in anchor["close_matches"]))
    if anchor.get("defined_elsewhere"):
        words.append("defined in " + ", ".join(f"`{p}`" for p in anchor["defined_elsewhere"]))
    return "; ".join(words)


def _file_section(path: str, item: dict, base_version: str, target_version: str) -> list[str]:
    clean = sum(h["merge"] != "conflict" for h in item["hunks"])
    out = [f"## File `{path}`: {item['status']}", ""]
    if item["note"]:
        out += [item["note"], ""]
    out += [f"Changes: {', '.join(f'`{c}`' for c in item['changes'])}. Our hunks: {len(item['hunks'])}, {clean} clean, "
            f"{item['conflicts']} conflict region(s). Merged result: `{item['merged']}` in the output directory.", ""]
    unplaced = [h for h in item["hunks"] if h["hunk"] in item["unattributed_hunks"]]
    if unplaced:
        out += ["Hunks no change's anchors or introduced names place (merge them by hand, then name them in "
                "changes.toml): " + ", ".join(
                    f"{h['hunk']} ({h['merge']}; ours lines {_span_words(h['ours'])})" for h in unplaced) + ".", ""]
    for region in item["conflict_regions"]:
        out += [f"### `{PurePosixPath(path).name}` conflict {region['region']}: changes "
                f"{', '.join(f'`{c}`' for c in region['changes']) or '(none placed)'}", "",
                f"base (vLLM {base_version}) lines {_span_words(region['base'])}; ours lines "
                f"{_span_words(region['ours'])}; theirs (vLLM {target_version}) lines {_span_words(region['theirs'])}.", "",
                f"ours ({region['ours']['count']} lines):", *_fenced(region["ours"]["excerpt"], region["ours"]["count"]), "",
                f"theirs ({region['theirs']['count']} lines):",
                *_fenced(region["theirs"]["excerpt"], region["theirs"]["count"]), ""]
    return out


def report_bytes(report: dict) -> bytes:
    return (json.dumps(report, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def write_report(directory: Path, report: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "report.json").write_bytes(report_bytes(report))
    (directory / "report.md").write_text(render_markdown(report))


SIDES = ("base", "ours", "theirs", "merged")  # the trees write_outputs makes in --out


def check_out_dir(out_dir: Path) -> None:
    """write_outputs replaces the four trees only in a directory an earlier rebase wrote (its
    report.json is there): anything else at those names is someone's, and is refused."""
    present = [out_dir / side for side in SIDES if os.path.lexists(out_dir / side)]
    links = [p for p in present if p.is_symlink() or not p.is_dir()]
    if links or present and not _rebase_report(out_dir / "report.json"):
        what = "a symlink or not a directory" if links else "and no report.json of a rebase beside them"
        raise RebaseError(overlay.BAD_INPUT, (
            f"--out {out_dir}: {', '.join(p.name for p in links or present)} already there ({what}); rebase "
            "replaces those trees only where it wrote them, so nothing was written. Move them away or name "
            "another --out"))


def _rebase_report(path: Path) -> bool:
    try:
        doc = json.loads(read_regular(path))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("schema") == REPORT_SCHEMA and {"from", "to", "files", "changes"} <= set(doc)


def write_outputs(out_dir: Path, merges: list[FileMerge], report: dict) -> None:
    """The report, then the base/, ours/, theirs/ and merged/ trees (replaced, so no stale
    file survives: check_out_dir allowed it). The report first: a run killed while writing
    the trees leaves a directory the next run may replace."""
    check_out_dir(out_dir)
    write_report(out_dir, report)
    for side in SIDES:
        tree = out_dir / side
        if tree.is_dir():
            shutil.rmtree(tree)
        for merge in merges:
            text = getattr(merge, side)
            if text is not None:
                target = tree / merge.path
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(text)


# --- command line ------------------------------------------------------------------------------


def add_rebase_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--to", required=True, metavar="VERSION", help="the vLLM release to re-base onto, e.g. 0.33.0")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--out", help="output directory (default: build/rebase/<from>-to-<to>/ of this repo)")
    parser.add_argument("--report-dir", help="also write report.md and report.json here (e.g. docs/rebase/...)")
    parser.add_argument("--wheel", help="offline: the target wheel file, used only if it hashes to --wheel-sha256")
    parser.add_argument("--wheel-sha256", help="sha256 the --wheel file must have")
    parser.add_argument("--target-python", help="an interpreter with the stock target vLLM: run each change's tests "
                                                "against it (behavioural evidence)")
    parser.add_argument("--index-url", default=wheels.PYPI_SIMPLE, help="PEP 691 simple index (default: PyPI)")


def add_rebase_parser(commands, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """The `rebase` subcommand, for scripts/overlay.py's subparsers (`parents` give --vllm)."""
    parser = commands.add_parser("rebase", parents=parents,
                                 help="3-way merge the overlay onto another vLLM; report per named change")
    add_rebase_arguments(parser)
    return parser


def _outside(directory: Path, overlay_dir: Path, what: str) -> Path:
    """`directory`, refused when it is, holds or lies inside the overlay or any of the repo's."""
    directory = directory.resolve()
    for protected in (overlay_dir.resolve(), overlay.OVERLAY_ROOT.resolve()):
        if directory == protected or protected in directory.parents or directory in protected.parents:
            raise RebaseError(overlay.BAD_INPUT, f"{what} {directory}: must not be, hold or lie inside the overlay "
                                                 f"directory {protected} (rebase never writes an overlay)")
    return directory


def regenerate_command(base: str, version: str, recipe_id: str, report_dir: Path | None) -> str:
    """The command that rewrites this report (both spellings work: the module is the tool)."""
    parts = ["python3 scripts/overlay.py rebase", f"--vllm {base}", f"--to {version}"]
    if recipe_id != DEFAULT_RECIPE:
        parts.append(f"--recipe {recipe_id}")
    if report_dir is not None and REPO_ROOT in report_dir.parents:
        parts.append(f"--report-dir {report_dir.relative_to(REPO_ROOT).as_posix()}")
    return " ".join(parts)


def load(args) -> Inputs:
    """Recipe, manifest, overlay files and both wheels, each checked before use."""
    recipe, manifest, raw = overlay.load_inputs(args.recipe, Path(args.manifest))
    ours = {path: data.decode() for path, data in overlay.read_overlay_files(manifest, Path(args.overlay_dir)).items()}
    if args.wheel:
        target_path, filename, sha256 = local_target(Path(args.wheel), args.wheel_sha256 or "")
    else:
        target_path, filename, sha256 = resolve_target(args.to, args.index_url)
    found = wheel_version(target_path)
    if found != args.to:
        raise RebaseError(overlay.BAD_INPUT, f"{target_path}: is vLLM {found}, not --to {args.to}")
    base_path = overlay.reference_wheel(recipe)
    base_version = wheel_version(base_path)
    if base_version != manifest.vllm_version:
        raise RebaseError(overlay.DRIFT, f"{base_path}: is vLLM {base_version}, the manifest is for {manifest.vllm_version}")
    return Inputs(manifest, wheels.sha256_bytes(raw), ours,
                  Wheel(base_path, manifest.wheel_filename, manifest.wheel_sha256, base_version),
                  Wheel(target_path, filename, sha256, found))


def run_rebase(args) -> int:
    """scripts/overlay.py rebase: merge, report, and exit CONFLICT when any region conflicts."""
    if args.to == args.vllm:
        # A merge onto its own release "merges cleanly" and says nothing.
        raise RebaseError(overlay.BAD_INPUT, (
            f"--to {args.to} is the base itself (--vllm; without it the recipe's default): rebase moves one base's "
            f"overlay onto another release, e.g. `--vllm OLDER --to {args.to}`"))
    overlay_dir = Path(args.overlay_dir)
    report_dir = _outside(Path(args.report_dir), overlay_dir, "--report-dir") if args.report_dir else None
    out_dir = _outside(Path(args.out), overlay_dir, "--out") if args.out else None
    if out_dir is not None:
        check_out_dir(out_dir)  # before any download
    inputs = load(args)
    default_out = REPO_ROOT / "build" / "rebase" / f"{inputs.manifest.vllm_version}-to-{args.to}"
    out_dir = out_dir or _outside(default_out, overlay_dir, "--out")
    command = regenerate_command(args.vllm, args.to, args.recipe, report_dir)
    try:
        report, merges = rebase(inputs, command, args.target_python, out_dir / "behaviour")
    finally:
        inputs.base.close()
        inputs.target.close()
    write_outputs(out_dir, merges, report)
    if report_dir is not None:
        write_report(report_dir, report)
    for change_id, change in report["changes"].items():
        print(f"{change_id}: {', '.join(_VERDICT_WORDS[v] for v in change['verdicts'])}", file=sys.stderr)
    print(f"{report['conflicts']} conflict region(s); report: {out_dir / 'report.md'}"
          + (f" and {report_dir / 'report.md'}" if report_dir else ""), file=sys.stderr)
    return report["exit_code"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m dsa_image.rebase.cli", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=f"exit codes: {overlay.OK} merged without conflict; {overlay.BAD_INPUT} bad "
                                            f"input; {overlay.DRIFT} the pinned wheel is not what the overlay was made "
                                            f"from; {CONFLICT} conflicts (nothing recorded in any case)")
    parser.add_argument("--manifest", help="default: the --vllm base's overlay/vllm-VERSION/manifest.json")
    parser.add_argument("--overlay-dir", help="default: the --vllm base's overlay/vllm-VERSION/")
    parser.add_argument("--vllm", metavar="VERSION", help="the base to re-base from (default: the recipe's default)")
    add_rebase_arguments(parser)
    args = parser.parse_args(argv)
    try:
        overlay.resolve_base(args, args.vllm)
        return run_rebase(args)
    except overlay.OverlayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
