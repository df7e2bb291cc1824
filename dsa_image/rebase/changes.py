"""Change tracking: the named changes of the overlay's changes.toml (folded into its
manifest) against a merge. Which change each hunk belongs to (`attribute`), the names a
change's hunks use that the target no longer defines (`vanished_uses`), the changes' own
tests run against a stock target vLLM (behavioural evidence), the checks the report rests on
(`check_inputs`), and per change what it became on the target (`change_report`).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

from dsa_image.overlay import cli as overlay
from dsa_image.core import wheels
from dsa_image.overlay.manifest import Change, Manifest
from dsa_image.core.recipe import REPO_ROOT
from dsa_image.rebase.merge import FileMerge
from dsa_image.rebase.symbols import (KNOWN_RENAMES, RebaseError, Source, Wheel, check_anchor, check_signature,
                                      close_matches, imported_modules, parse_source)


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


# --- names our hunks use that the target no longer defines ---------------------------------------


def _definitions(wheel: Wheel, paths: list[str]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Module-level names and class members (with the files defining them) of those of
    `paths` that `wheel` has."""
    module_level: dict[str, set[str]] = {}
    members: dict[str, set[str]] = {}
    for path in paths:
        source = wheel.source(path)
        if source is None:
            continue
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
        scopes.append(_definitions(wheel, list(dict.fromkeys(paths))))
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


# --- what the report rests on, and what each change became --------------------------------------


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
