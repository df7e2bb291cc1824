"""The three-way merge of one overlaid file: base (the upstream file the overlay was made
from), ours (the overlay file) and theirs (the target release's file) walked diff3-style into
chunks, rendered with conflict markers, and our hunks listed with the conflict region each
fell into (`merge_entry`). New files and files upstream removed are merged here too.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from dsa_image.overlay.manifest import Entry
from dsa_image.overlay.core import DRIFT
from dsa_image.rebase.symbols import RebaseError, Wheel


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
    base_text = _base_text(entry, base)
    if theirs is None:
        return _merge_removed(entry, ours, base_text, target)
    base_lines, our_lines, their_lines = (t.splitlines(keepends=True) for t in (base_text, ours, theirs))
    chunks = diff3_chunks(base_lines, our_lines, their_lines)
    labels = (f"ours (overlay {entry.path})", f"base (vLLM {base.version})", f"theirs (vLLM {target.version})")
    merged = render_merge(chunks, base_lines, our_lines, their_lines, labels)
    hunks: list[Hunk] = []
    region = 0
    for chunk in chunks:
        if chunk.kind in ("ours", "both", "conflict"):
            region += chunk.kind == "conflict"
            hunks.append(Hunk(len(hunks) + 1, chunk, region if chunk.kind == "conflict" else None))
    status = "conflict" if region else "merged-cleanly"
    return FileMerge(entry.path, status, entry.changes, base_text, ours, theirs, merged, hunks)


def _base_text(entry: Entry, base: Wheel) -> str:
    """The base release's copy of a file the overlay replaces (check_inputs has hashed it)."""
    data = base.read(entry.path)
    if data is None:
        raise RebaseError(DRIFT, f"{entry.path}: {base.filename} has no such file, the manifest records "
                                 f"upstream sha256 {entry.upstream_sha256}")
    return data.decode()


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
