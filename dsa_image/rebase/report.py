"""The report: report.json (`build_report`, one dict per change and per file), its markdown
(`render_markdown`, report.md is nothing but this rendering of report.json), and the output
directory (`write_outputs`: the report, then the base/, ours/, theirs/ and merged/ trees).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path, PurePosixPath

from dsa_image.overlay import cli as overlay
from dsa_image.core import wheels
from dsa_image.core.atomic import read_regular
from dsa_image.rebase.changes import Inputs
from dsa_image.rebase.merge import FileMerge
from dsa_image.rebase.symbols import RebaseError

REPORT_SCHEMA = 1
# The overlay tool's one exit-code table (overlay_core) holds rebase's CONFLICT too.
CONFLICT = overlay.CONFLICT
MAX_EXCERPT_LINES = 8  # per side of a conflict region in report.md and report.json


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

VERDICT_WORDS = {"merged-cleanly": "merged cleanly", "conflict": "in conflict", "already-upstream": "already upstream",
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
    verdicts = ", ".join(VERDICT_WORDS[v] for v in change["verdicts"])
    return (f"| `{change_id}`: {change['title']} | {verdicts} | {merged} | {static} | "
            f"{upstream['behavioural']['status']} | {gone} | {vanished} |")


def _change_section(change_id: str, change: dict, version: str) -> list[str]:
    merge, upstream = change["merge"], change["upstream"]
    out = [f"## `{change_id}`: {change['title']}", "",
           f"- verdicts: {', '.join(VERDICT_WORDS[v] for v in change['verdicts']) or 'none'}",
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
