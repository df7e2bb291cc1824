"""scripts/overlay.py rebase: the 3-way merge, the per-change verdicts and the report.

Synthetic wheels and overlays first (fast, CPU only), then the real 0.24.0 -> 0.33.0 pair
(marked `wheel`: the 0.33.0 wheel, 336 MB, is downloaded once into the tool's cache).
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dsa_image.overlay import cli as overlay
from dsa_image.rebase import cli as rebase
from dsa_image.rebase import report as rebase_report
from dsa_image.core import wheels
from dsa_image.overlay.manifest import (Change, Entry, Manifest, ManifestError, Signature, check_changes, fold_changes,
                                manifest_bytes, parse_manifest)
from dsa_image.core.wheels import sha256_bytes

REPO = Path(__file__).resolve().parent.parent


def lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def merge(base: str, ours: str, theirs: str) -> tuple[str, list[rebase.Chunk]]:
    chunks = rebase.diff3_chunks(lines(base), lines(ours), lines(theirs))
    return rebase.render_merge(chunks, lines(base), lines(ours), lines(theirs), ("ours", "base", "theirs")), chunks


# --- the 3-way merge ----------------------------------------------------------------------------

BASE = "a\nb\nc\nd\ne\nf\ng\nh\n"


def test_edits_on_both_sides_apart_merge_cleanly():
    text, chunks = merge(BASE, BASE.replace("b\n", "B\n"), BASE.replace("g\n", "G\n"))
    assert text == "a\nB\nc\nd\ne\nf\nG\nh\n"
    assert [c.kind for c in chunks if c.kind != "same"] == ["ours", "theirs"]


def test_one_line_edited_differently_is_a_conflict_with_both_sides_and_base():
    text, chunks = merge(BASE, BASE.replace("d\n", "ours-d\n"), BASE.replace("d\n", "theirs-d\n"))
    assert [c.kind for c in chunks].count("conflict") == 1
    assert "<<<<<<< ours\nours-d\n||||||| base\nd\n=======\ntheirs-d\n>>>>>>> theirs\n" in text


def test_the_same_edit_on_both_sides_is_not_a_conflict():
    edited = BASE.replace("e\n", "E\nE2\n")
    text, chunks = merge(BASE, edited, edited)
    assert text == edited and [c.kind for c in chunks if c.kind != "same"] == ["both"]


def test_one_sided_edits_give_that_side():
    ours = BASE.replace("a\n", "").replace("h\n", "h\ni\n")
    assert merge(BASE, ours, BASE)[0] == ours
    assert merge(BASE, BASE, ours)[0] == ours


def test_common_lines_at_the_ends_of_a_conflict_are_not_in_it():
    text, chunks = merge(BASE, BASE.replace("d\n", "x\nours\ny\n"), BASE.replace("d\n", "x\ntheirs\ny\n"))
    conflict = next(c for c in chunks if c.kind == "conflict")
    assert conflict.ours[1] - conflict.ours[0] == 1 and conflict.theirs[1] - conflict.theirs[0] == 1
    assert "x\n<<<<<<< ours\nours\n" in text and ">>>>>>> theirs\ny\n" in text


def test_two_insertions_at_one_place_conflict_even_when_one_ends_like_the_next_line():
    """Ours inserts an entry ending in `    ),` right after the base's `    ),`; a diff may align
    that insertion one line early (before the base's `    ),`, which then matches ours' last
    line), and theirs' insertion at the same place then merged silently after it. Sliding
    insertions down puts both at one place: a conflict, as git reports it (envs.py, 0.33.0)."""
    tail = "".join(f"    'T{i}': {i},\n" for i in range(10)) + "}\n"
    base = "E = {\n    'A': f(\n        1\n    ),\n" + tail
    ours = base.replace("    ),\n", "    ),\n    'B': f(\n        2\n    ),\n", 1)
    theirs = base.replace("    ),\n", "    ),\n    'C': 3,\n", 1)
    text, chunks = merge(base, ours, theirs)
    assert [c.kind for c in chunks].count("conflict") == 1
    assert "'B'" in text and "'C'" in text


def _git_merge(tmp: Path, base: str, ours: str, theirs: str) -> tuple[int, str]:
    for name, text in (("base", base), ("ours", ours), ("theirs", theirs)):
        (tmp / name).write_text(text)
    done = subprocess.run(["git", "merge-file", "-p", str(tmp / "ours"), str(tmp / "base"), str(tmp / "theirs")],
                          capture_output=True, text=True)
    assert done.returncode >= 0, done.stderr
    return done.returncode, done.stdout


def _edited(rng: random.Random, base: list[str], tag: str) -> list[str]:
    out = []
    for line in base:
        roll = rng.random()
        if roll < 0.08:
            continue
        out.append(f"{tag}{line}" if roll < 0.16 else line)
        if rng.random() < 0.08:
            out.append(f"{tag}-new-{len(out)}\n")
    return out


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_agrees_with_git_merge_file_on_random_edits(tmp_path):
    """Lines are unique, so every diff aligns them the same way: git and this merge must then
    agree on whether a merge conflicts, and on the text of every clean merge."""
    rng = random.Random(20261130)
    checked_clean = checked_conflict = 0
    for _ in range(300):
        base = [f"line {i}\n" for i in range(rng.randint(1, 30))]
        ours, theirs = _edited(rng, base, "o"), _edited(rng, base, "t")
        text, chunks = merge("".join(base), "".join(ours), "".join(theirs))
        conflicts = sum(c.kind == "conflict" for c in chunks)
        git_conflicts, git_text = _git_merge(tmp_path, "".join(base), "".join(ours), "".join(theirs))
        assert (conflicts > 0) == (git_conflicts > 0), (base, ours, theirs)
        if not conflicts:
            assert text == git_text
            checked_clean += 1
        else:
            checked_conflict += 1
    assert checked_clean > 30 and checked_conflict > 30


# --- what a Python file defines and mentions ------------------------------------------------------


def test_symbols_cover_classes_members_self_attributes_and_type_checking_blocks():
    source = rebase.parse_source(
        "from typing import TYPE_CHECKING\nimport numpy as np\n\nif TYPE_CHECKING:\n    FLAG: bool = False\n\n\n"
        "class A:\n    width = 1\n\n    @property\n    def size(self):\n        return self.width\n\n"
        "    def __init__(self):\n        self.buffer = np.zeros(1)\n", "t.py")
    assert {"TYPE_CHECKING", "np", "FLAG", "A", "A.width", "A.size", "A.__init__", "A.buffer"} <= set(source.symbols)
    assert source.symbols["A.size"] == (10, 13)  # the decorator belongs to the method
    assert source.innermost(15) == "A.buffer" and source.innermost(14) == "A.__init__"
    assert ("self-attr", "width", 12) in source.uses and ("attr", "zeros", 15) in source.uses
    assert source.mentions["np"] == [1, 15]


def test_close_matches_ignore_case_underscores_and_names_already_in_base():
    target = {"BuildKernel", "_BUILD_KERNEL", "Builder._split_chunks", "unrelated", "build_kernel_old"}
    assert rebase.close_matches("_build_kernel", {"build_kernel_old"}, target) == ["BuildKernel", "_BUILD_KERNEL"]
    assert rebase.close_matches("split_chunks", set(), target) == ["Builder._split_chunks"]


# --- a synthetic rebase ----------------------------------------------------------------------------

SPEC_BASE = "class Spec:\n    block_size: int = 16\n"
SPEC_THEIRS = "class Spec:\n    num_states: int = 16\n"

MOD_BASE = '''from vllm.spec import Spec


def helper(x):
    return x + 1


def compute(values):
    """Sum of helper over values."""
    total = 0
    for v in values:
        total += helper(v)
    return total


class Builder:
    def __init__(self, spec: Spec):
        self.spec = spec
        self.width = 4

    def build(self, n):
        assert n >= 0
        return [0] * n * self.width
'''

MOD_OURS = (MOD_BASE
            .replace("from vllm.spec import Spec\n", "from vllm.spec import Spec\n# carried by the overlay\n")
            .replace("    return x + 1\n", "    return x + 2\n")
            .replace("    total = 0\n", "    total = Spec.block_size\n")
            .replace("class Builder:\n", "class Builder:\n    requires_width = True\n\n")
            .replace("        assert n >= 0\n", "        if n < 0:\n            raise ValueError(f\"negative n {n}\")\n"))

MOD_THEIRS = (MOD_BASE
              .replace("def compute(values):", "def compute_all(values):")
              .replace("class Builder:\n", "class Builder:\n    requires_width = True\n\n")
              .replace("        assert n >= 0\n", "        assert n >= 0, \"n must not be negative\"\n")
              + "\n\ndef added_upstream():\n    return 1\n")

BASE_FILES = {"vllm/__init__.py": "", "vllm/spec.py": SPEC_BASE, "vllm/mod.py": MOD_BASE}
THEIRS_FILES = {"vllm/__init__.py": "", "vllm/spec.py": SPEC_THEIRS, "vllm/mod.py": MOD_THEIRS,
                "vllm/newmod.py": "UPSTREAM = True\n"}
OURS_FILES = {"vllm/mod.py": MOD_OURS, "vllm/newmod.py": "OURS = True\n", "vllm/extra.py": "EXTRA = True\n"}

FAKE_TESTS = '''from vllm import mod


def test_helper_adds_two():
    assert mod.helper(1) == 3


def test_builder_requires_width():
    assert mod.Builder.requires_width is True
'''


def make_wheel(path: Path, version: str, files: dict[str, str]) -> rebase.Wheel:
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
        archive.writestr(f"vllm-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return rebase.Wheel(path, path.name, wheels.sha256_file(path), rebase.wheel_version(path))


def sig(at: str, means: str, contains: str | None = None, lacks: str | None = None) -> Signature:
    return Signature((at,), means, contains, lacks)


CHANGES = (
    Change("build-change", "build raises on a negative n", ("vllm/mod.py:Builder.build",), (),
           (sig("vllm/mod.py:Builder.build", "raises ValueError", contains="ValueError"),), ()),
    Change("compute-change", "compute starts from the spec's block size", ("vllm/mod.py:compute",), (),
           (sig("vllm/mod.py:compute", "starts from the block size", contains="block_size"),), ()),
    Change("extra-change", "a module of our own", (), (), (), ()),
    Change("helper-change", "helper adds two", ("vllm/mod.py:helper",), (),
           (sig("vllm/mod.py:helper", "adds two", contains=r"x \+ 2"),), ("tests/test_fake.py::test_helper_adds_two",)),
    Change("newmod-change", "a new module", (), (), (sig("vllm/newmod.py", "the module exists"),), ()),
    Change("width-change", "Builder says it needs the width", (), ("vllm/mod.py:requires_width",),
           (sig("vllm/mod.py:Builder.requires_width", "the attribute is there"),),
           ("tests/test_fake.py::test_builder_requires_width",)),
)
FILE_CHANGES = {"vllm/mod.py": ("build-change", "compute-change", "helper-change", "width-change"),
                "vllm/newmod.py": ("newmod-change",), "vllm/extra.py": ("extra-change",)}


class Pair:
    """Base and target wheels, an overlay and its manifest, a repo with the changes' tests."""

    def __init__(self, root: Path, changes=CHANGES, ours=OURS_FILES, theirs=THEIRS_FILES):
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.base = make_wheel(root / "vllm-1.0.0-py3-none-any.whl", "1.0.0", BASE_FILES)
        self.target = make_wheel(root / "vllm-2.0.0-py3-none-any.whl", "2.0.0", theirs)
        self.overlay_dir = root / "overlay"
        for path, text in ours.items():
            (self.overlay_dir / path).parent.mkdir(parents=True, exist_ok=True)
            (self.overlay_dir / path).write_text(text)
        entries = tuple(Entry(p, sha256_bytes(BASE_FILES[p].encode()) if p in BASE_FILES else None,
                              sha256_bytes(ours[p].encode()), f"test {p}", FILE_CHANGES[p]) for p in sorted(ours))
        self.manifest = Manifest("1.0.0", self.base.filename, self.base.sha256, entries, changes)
        check_changes(self.manifest, "synthetic")
        self.repo = root / "repo"
        (self.repo / "tests").mkdir(parents=True)
        (self.repo / "tests" / "test_fake.py").write_text(FAKE_TESTS)
        self.inputs = rebase.Inputs(self.manifest, sha256_bytes(manifest_bytes(self.manifest)), dict(ours),
                                    self.base, self.target, self.repo)

    def run(self, python: str | None = None) -> tuple[dict, list[rebase.FileMerge]]:
        return rebase.rebase(self.inputs, "python3 scripts/overlay.py rebase --to 2.0.0", python, self.root / "logs")


@pytest.fixture
def pair(tmp_path) -> Pair:
    return Pair(tmp_path / "pair")


def test_each_change_gets_its_own_verdict(pair):
    report, _ = pair.run()
    verdicts = {cid: change["verdicts"] for cid, change in report["changes"].items()}
    assert verdicts == {
        "build-change": ["conflict"],
        "compute-change": ["merged-cleanly", "upstream-moved"],
        "extra-change": ["merged-cleanly"],
        "helper-change": ["merged-cleanly"],
        "newmod-change": ["conflict", "already-upstream"],  # both facts, reported as such
        "width-change": ["merged-cleanly", "already-upstream"],
    }
    assert report["exit_code"] == rebase.CONFLICT and report["conflicts"] == 2


def test_files_say_how_they_merged(pair):
    report, merges = pair.run()
    files = report["files"]
    assert files["vllm/extra.py"]["status"] == "new-file"
    assert files["vllm/newmod.py"]["status"] == "new-file-collides"
    assert "now has a file at this path" in files["vllm/newmod.py"]["note"]
    assert files["vllm/mod.py"]["status"] == "conflict" and files["vllm/mod.py"]["conflicts"] == 1
    merged = next(m for m in merges if m.path == "vllm/mod.py").merged
    # ours' clean hunks, theirs' rename and addition, the conflict with both sides and the base
    assert "return x + 2" in merged and "def compute_all(values):" in merged and "total = Spec.block_size" in merged
    assert "def added_upstream" in merged and merged.count("requires_width = True") == 1
    assert "<<<<<<< ours (overlay vllm/mod.py)\n" in merged and "raise ValueError" in merged
    assert "||||||| base (vLLM 1.0.0)\n        assert n >= 0\n=======\n" in merged
    assert 'assert n >= 0, "n must not be negative"' in merged


def test_a_hunk_no_change_places_is_reported_not_guessed(pair):
    report, _ = pair.run()
    mod = report["files"]["vllm/mod.py"]
    unplaced = [h for h in mod["hunks"] if h["hunk"] in mod["unattributed_hunks"]]
    assert len(unplaced) == 1 and unplaced[0]["ours"] == {"start": 2, "count": 1}  # the comment line
    assert unplaced[0]["changes"] == []
    assert "place (merge them by hand, then name them in changes.toml): 1 (clean; ours lines 2-2)" in \
        rebase.render_markdown(report)


def test_conflicts_show_both_sides_bounded(pair):
    report, _ = pair.run()
    region = report["files"]["vllm/mod.py"]["conflict_regions"][0]
    assert region["changes"] == ["build-change"]
    assert region["ours"]["excerpt"] == ["        if n < 0:", '            raise ValueError(f"negative n {n}")']
    assert region["theirs"]["excerpt"] == ['        assert n >= 0, "n must not be negative"']
    long_ours = {**OURS_FILES, "vllm/mod.py": MOD_OURS.replace(
        "raise ValueError", "\n            ".join(["pass  # filler"] * 20) + "\n            raise ValueError")}
    report, _ = Pair(pair.root.parent / "long", ours=long_ours).run()
    region = report["files"]["vllm/mod.py"]["conflict_regions"][0]
    assert len(region["ours"]["excerpt"]) == rebase.MAX_EXCERPT_LINES and region["ours"]["count"] == 22
    markdown = rebase.render_markdown(report)
    assert "ours (22 lines):" in markdown and "... 14 more lines" in markdown
    assert 'assert n >= 0, "n must not be negative"' in markdown


def test_already_upstream_carries_its_evidence(pair):
    report, _ = pair.run()
    width = report["changes"]["width-change"]["upstream"]
    assert width["static"] == "yes" and width["signatures"][0]["holds"]
    assert width["signatures"][0]["evidence"].startswith("vllm/mod.py:Builder.requires_width is defined (vllm/mod.py:")
    assert width["behavioural"]["status"] == "not-collected"
    assert "behavioural evidence not collected: no environment with vLLM 2.0.0" in width["behavioural"]["detail"]
    helper = report["changes"]["helper-change"]["upstream"]
    assert helper["static"] == "no" and "no match for /x \\+ 2/" in helper["signatures"][0]["evidence"]
    assert report["changes"]["extra-change"]["upstream"]["static"] == "no-signatures"


def test_a_renamed_anchor_and_a_vanished_name_are_named(pair, monkeypatch):
    report, _ = pair.run()
    change = report["changes"]["compute-change"]
    anchor = change["anchors"][0]
    assert anchor["in_target"] is False and anchor["close_matches"] == ["compute_all"]
    assert "renamed_to" not in anchor
    assert [(v["name"], v["kind"], v["defined_in_base"]) for v in change["vanished"]] == [
        ("block_size", "attribute", ["vllm/spec.py"])]
    monkeypatch.setitem(rebase.KNOWN_RENAMES, "vllm/mod.py", {"compute": "compute_all", "helper": "helper2"})
    report, _ = pair.run()
    assert report["changes"]["compute-change"]["anchors"][0]["renamed_to"] == "compute_all"
    # a known rename is reported only where the target confirms it
    assert "renamed_to" not in report["changes"]["helper-change"]["anchors"][0]


def test_the_report_is_deterministic_and_names_no_local_path(pair, tmp_path):
    first, merges = pair.run()
    second, _ = pair.run()
    assert rebase.report_bytes(first) == rebase.report_bytes(second)
    out = tmp_path / "out"
    rebase.write_outputs(out, merges, first)
    for text in ((out / "report.md").read_text(), (out / "report.json").read_text()):
        assert str(tmp_path) not in text
    assert json.loads((out / "report.json").read_text()) == first
    assert (out / "merged/vllm/mod.py").read_text().count("<<<<<<< ") == 1
    assert (out / "ours/vllm/mod.py").read_text() == MOD_OURS and (out / "base/vllm/mod.py").read_text() == MOD_BASE
    assert (out / "theirs/vllm/newmod.py").read_text() == "UPSTREAM = True\n" and not (out / "base/vllm/newmod.py").exists()


@pytest.mark.parametrize("planted", ["a-directory", "a-symlink"])
def test_out_never_replaces_trees_rebase_did_not_write(pair, tmp_path, planted):
    """`--out DIR` deleted whatever DIR/{base,ours,theirs,merged} held. A directory an earlier
    rebase wrote (its report.json) is replaced; anything else is refused, untouched."""
    report, merges = pair.run()
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep me\n")
    out.mkdir()
    if planted == "a-directory":
        (out / "merged").mkdir()
        (out / "merged" / "keep.txt").write_text("keep me\n")
    else:
        (out / "merged").symlink_to(elsewhere)
    with pytest.raises(rebase.RebaseError, match="rebase replaces those trees only where it wrote them") as caught:
        rebase.write_outputs(out, merges, report)
    assert caught.value.exit_code == overlay.BAD_INPUT
    assert (out / "merged" / "keep.txt").read_text() == "keep me\n" and (elsewhere / "keep.txt").exists()
    assert sorted(p.name for p in out.iterdir()) == ["merged"]  # nothing written
    code = rebase.main(["--vllm", "0.24.0", "--to", "0.33.0", "--out", str(out)])  # refused before any download
    assert code == overlay.BAD_INPUT and (out / "merged" / "keep.txt").exists()


def test_out_of_an_earlier_rebase_is_replaced(pair, tmp_path):
    report, merges = pair.run()
    out = tmp_path / "out"
    rebase.write_outputs(out, merges, report)
    (out / "merged" / "stale.py").write_text("from an earlier run\n")
    rebase.write_outputs(out, merges, report)
    assert not (out / "merged" / "stale.py").exists() and (out / "merged/vllm/mod.py").exists()


def test_a_file_removed_upstream_is_a_conflict_that_says_where_files_of_its_name_are(tmp_path):
    moved = {k: v for k, v in THEIRS_FILES.items() if k != "vllm/mod.py"} | {"vllm/core/mod.py": MOD_THEIRS}
    report, _ = Pair(tmp_path / "p", theirs=moved).run()
    item = report["files"]["vllm/mod.py"]
    assert item["status"] == "removed-upstream" and item["conflicts"] == 1
    assert "files named mod.py there: vllm/core/mod.py" in item["note"]
    assert "conflict" in report["changes"]["helper-change"]["verdicts"]


@pytest.mark.parametrize("changes, message", [
    ((*CHANGES[:3], Change("helper-change", "t", ("vllm/mod.py:no_such_name",), (), (), ()), *CHANGES[4:]),
     "anchor vllm/mod.py:no_such_name: vLLM 1.0.0 has no such name"),
    ((*CHANGES[:3], Change("helper-change", "t", (), ("vllm/mod.py:helper",), (), ()), *CHANGES[4:]),
     "introduces vllm/mod.py:helper: vLLM 1.0.0 already has it"),
    ((*CHANGES[:3], Change("helper-change", "t", (), (), (sig("vllm/mod.py:helper", "x", contains="x"),), ()),
      *CHANGES[4:]), "already holds on vLLM 1.0.0"),
    ((*CHANGES[:3], Change("helper-change", "t", (), (), (), ("tests/test_fake.py::test_missing",)), *CHANGES[4:]),
     "test tests/test_fake.py::test_missing: no such test function"),
])
def test_inputs_that_cannot_support_a_verdict_are_refused(tmp_path, changes, message):
    with pytest.raises(rebase.RebaseError) as raised:
        Pair(tmp_path / "p", changes=changes).run()
    assert raised.value.exit_code == overlay.BAD_INPUT and message in str(raised.value)


def test_a_base_wheel_that_is_not_the_pinned_upstream_is_drift(pair):
    pair.inputs.manifest = Manifest(pair.manifest.vllm_version, pair.manifest.wheel_filename, pair.manifest.wheel_sha256,
                                    tuple(Entry(e.path, "0" * 64 if e.upstream_sha256 else None, e.overlay_sha256,
                                                e.why, e.changes) for e in pair.manifest.files), pair.manifest.changes)
    with pytest.raises(rebase.RebaseError) as raised:
        pair.run()
    assert raised.value.exit_code == overlay.DRIFT


# --- behavioural evidence -----------------------------------------------------------------------


def stock_python(root: Path, files: dict[str, str], version: str = "2.0.0") -> str:
    """An interpreter (this one) whose only vLLM is `files`, installed into its own site dir."""
    site = root / "site"
    for path, text in files.items():
        (site / path).parent.mkdir(parents=True, exist_ok=True)
        (site / path).write_text(text)
    (site / f"vllm-{version}.dist-info").mkdir(parents=True)
    (site / f"vllm-{version}.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    launcher = root / "python"
    launcher.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" "$@"\n')
    launcher.chmod(0o755)
    return str(launcher)


def test_the_changes_tests_run_against_the_stock_target(pair):
    report, _ = pair.run(stock_python(pair.root, THEIRS_FILES))
    width, helper = report["changes"]["width-change"], report["changes"]["helper-change"]
    assert width["upstream"]["behavioural"] == {
        "status": "passed", "tests": {"tests/test_fake.py::test_builder_requires_width": "passed"},
        "detail": "the change's tests against stock vLLM 2.0.0: test_builder_requires_width passed"}
    assert "already-upstream" in width["verdicts"]
    assert helper["upstream"]["behavioural"]["tests"] == {"tests/test_fake.py::test_helper_adds_two": "failed"}
    assert report["behavioural_evidence"].startswith("collected")
    assert (pair.root / "logs" / "pytest.log").read_text().count("test_helper_adds_two") >= 1


def test_failing_tests_withdraw_already_upstream(pair):
    fake = FAKE_TESTS.replace("requires_width is True", "requires_width is False")
    (pair.repo / "tests" / "test_fake.py").write_text(fake)
    report, _ = pair.run(stock_python(pair.root, THEIRS_FILES))
    width = report["changes"]["width-change"]
    assert width["upstream"]["static"] == "yes" and width["upstream"]["behavioural"]["status"] == "failed"
    assert width["verdicts"] == ["merged-cleanly"]


def test_behavioural_evidence_needs_an_unmodified_target(pair):
    overlaid = {**THEIRS_FILES, "vllm/mod.py": MOD_OURS}
    with pytest.raises(rebase.RebaseError, match="vllm/mod.py is not vLLM 2.0.0's stock file"):
        pair.run(stock_python(pair.root, overlaid))
    with pytest.raises(rebase.RebaseError, match="has vLLM 1.0.0, not 2.0.0"):
        pair.run(stock_python(pair.root / "old", BASE_FILES, "1.0.0"))


# --- inputs and command line ----------------------------------------------------------------------


def test_a_local_target_wheel_is_used_only_with_its_sha256(pair):
    path = pair.target.path
    assert rebase.local_target(path, pair.target.sha256) == (path, path.name, pair.target.sha256)
    for sha, message in (("", "needs --wheel-sha256"), ("0" * 64, "has sha256")):
        with pytest.raises(rebase.RebaseError, match=message) as raised:
            rebase.local_target(path, sha)
        assert raised.value.exit_code == overlay.BAD_INPUT


def test_the_target_wheel_is_the_one_manylinux_x86_64_wheel_the_index_lists(monkeypatch, tmp_path):
    listed = [wheels.IndexFile(name, f"https://example.invalid/{name}", sha256_bytes(name.encode())) for name in (
        "vllm-9.1.0-cp38-abi3-manylinux_2_28_x86_64.whl", "vllm-9.1.0-cp38-abi3-manylinux_2_28_aarch64.whl",
        "vllm-9.1.0.tar.gz", "vllm-9.1.01-cp38-abi3-manylinux_2_28_x86_64.whl")]
    fetched = []
    monkeypatch.setattr(wheels, "index_files", lambda project, index_url: listed)
    monkeypatch.setattr(wheels, "ensure_wheel", lambda f, s, i: fetched.append((f, s)) or tmp_path / f)
    path, filename, sha = rebase.resolve_target("9.1.0")
    assert fetched == [(listed[0].filename, listed[0].sha256)] == [(filename, sha)] and path == tmp_path / filename
    monkeypatch.setattr(wheels, "index_files", lambda project, index_url: listed + [
        wheels.IndexFile("vllm-9.1.0-cp39-abi3-manylinux_2_31_x86_64.whl", "u", "0" * 64)])
    with pytest.raises(rebase.RebaseError, match="expected one manylinux x86_64 wheel"):
        rebase.resolve_target("9.1.0")


def test_output_never_goes_into_the_overlay(tmp_path):
    overlay_dir = tmp_path / "overlay"
    (overlay_dir / "vllm").mkdir(parents=True)
    for bad in (overlay_dir, overlay_dir / "vllm" / "out", tmp_path, overlay.OVERLAY_ROOT / "vllm-9.9.9"):
        with pytest.raises(rebase.RebaseError, match="rebase never writes an overlay"):
            rebase._outside(bad, overlay_dir, "--out")
    assert rebase._outside(tmp_path / "build", overlay_dir, "--out") == (tmp_path / "build").resolve()


def test_the_command_line_refuses_bad_input_before_fetching_anything(tmp_path, capsys):
    missing_sha = rebase.main(["--vllm", "0.24.0", "--to", "0.33.0", "--wheel", str(tmp_path / "vllm.whl"),
                               "--out", str(tmp_path / "o")])
    assert missing_sha == overlay.BAD_INPUT and "--wheel needs --wheel-sha256" in capsys.readouterr().err
    # another base's overlay is as protected as the one re-based
    for base in ("0.24.0", "0.33.0"):
        merged = overlay.overlay_dir(base) / "vllm" / "merged"
        into_overlay = rebase.main(["--vllm", "0.24.0", "--to", "0.33.0", "--out", str(merged)])
        assert into_overlay == overlay.BAD_INPUT and "rebase never writes an overlay" in capsys.readouterr().err
        assert not merged.exists()
    unknown = rebase.main(["--vllm", "0.25.0", "--to", "0.33.0", "--out", str(tmp_path / "o")])
    assert unknown == overlay.BAD_INPUT and "no vLLM '0.25.0'" in capsys.readouterr().err
    onto_itself = rebase.main(["--vllm", "0.33.0", "--to", "0.33.0", "--out", str(tmp_path / "o")])
    assert onto_itself == overlay.BAD_INPUT and "--to 0.33.0 is the base itself" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_subcommand_parser_feeds_run_rebase():
    """What scripts/overlay.py wires: its --manifest/--overlay-dir and --vllm, then `rebase ...`."""
    import argparse

    main = argparse.ArgumentParser()
    main.add_argument("--manifest")
    main.add_argument("--overlay-dir")
    base = argparse.ArgumentParser(add_help=False)
    base.add_argument("--vllm")
    rebase.add_rebase_parser(main.add_subparsers(dest="command", required=True), parents=[base])
    report_dir = overlay.overlay_dir("0.24.0") / "r"
    args = main.parse_args(["rebase", "--vllm", "0.24.0", "--to", "0.33.0", "--report-dir", str(report_dir)])
    assert (args.command, args.to, args.target_python, args.wheel) == ("rebase", "0.33.0", None, None)
    overlay.resolve_base(args, args.vllm)
    assert args.manifest == str(overlay.manifest_path("0.24.0"))
    with pytest.raises(rebase.RebaseError, match=r"--report-dir .* \(rebase never writes an overlay\)"):
        rebase.run_rebase(args)


def test_the_regenerate_command_names_a_report_dir_in_the_repo():
    assert rebase.regenerate_command("0.24.0", "0.33.0", "glm5-dsa", REPO / "docs" / "rebase" / "x") == (
        "python3 scripts/overlay.py rebase --vllm 0.24.0 --to 0.33.0 --report-dir docs/rebase/x")
    assert rebase.regenerate_command("0.24.0", "0.33.0", "other", None) == (
        "python3 scripts/overlay.py rebase --vllm 0.24.0 --to 0.33.0 --recipe other")


# --- named changes in the manifest ---------------------------------------------------------------


def test_the_manifest_round_trips_its_changes(pair):
    raw = manifest_bytes(pair.manifest)
    assert parse_manifest(raw) == pair.manifest and manifest_bytes(parse_manifest(raw)) == raw
    doc = json.loads(raw)
    assert doc["files"][0]["changes"] == ["extra-change"]
    assert doc["changes"]["helper-change"]["tests"] == ["tests/test_fake.py::test_helper_adds_two"]
    legacy = Manifest("1.0.0", "w.whl", "0" * 64, (Entry("vllm/a.py", None, "1" * 64, "why"),))
    assert "changes" not in manifest_bytes(legacy).decode()


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["files"][0].update(changes=[]), "carries no named change"),
    (lambda d: d["files"][0].update(changes=["nope"]), r"names undefined change\(s\) nope"),
    (lambda d: d["changes"].update({"unused": {**d["changes"]["extra-change"]}}), "change unused is carried by no file"),
    (lambda d: d["changes"]["newmod-change"].update(anchors=["vllm/newmod.py:OURS"]), "must lie in an upstream file"),
    (lambda d: d["changes"]["extra-change"].update(introduces=["vllm/mod.py:x"]), "must lie in a file that carries"),
    (lambda d: d["changes"]["extra-change"].update(tests=["test_x"]), "is not a pytest node id"),
    (lambda d: d["changes"]["helper-change"]["signatures"][0].update(contains="("), "not a regular expression"),
    (lambda d: d["changes"].update({"Bad_Id": d["changes"].pop("extra-change")}), "lower-case words"),
    (lambda d: [f.pop("changes") for f in d["files"]], "names changes, but|carries no named change"),
])
def test_a_malformed_change_table_is_refused(pair, mutate, message):
    doc = json.loads(manifest_bytes(pair.manifest))
    mutate(doc)
    with pytest.raises(ManifestError, match=message):
        parse_manifest(json.dumps(doc).encode())


CHANGES_TOML = '''
[changes.helper-change]
title = "helper adds two"
files = ["vllm/mod.py"]
anchors = ["vllm/mod.py:helper"]
introduces = []
tests = []

[[changes.helper-change.signatures]]
at = "vllm/mod.py:helper"
contains = 'x \\+ 2'
means = "adds two"
'''


def test_record_folds_changes_toml_into_the_entries(tmp_path):
    legacy = Manifest("1.0.0", "w.whl", "0" * 64, (Entry("vllm/mod.py", "1" * 64, "2" * 64, "why"),))
    (tmp_path / "changes.toml").write_text(CHANGES_TOML)
    folded = fold_changes(legacy, tmp_path / "changes.toml")
    assert folded.files[0].changes == ("helper-change",)
    assert folded.change("helper-change").signatures == (Signature(("vllm/mod.py:helper",), "adds two", r"x \+ 2"),)
    assert fold_changes(folded, tmp_path / "absent.toml") == legacy
    (tmp_path / "changes.toml").write_text(CHANGES_TOML.replace('files = ["vllm/mod.py"]', 'files = ["vllm/gone.py"]'))
    with pytest.raises(ManifestError, match="lists vllm/gone.py, which has no manifest entry"):
        fold_changes(legacy, tmp_path / "changes.toml")
    (tmp_path / "changes.toml").write_text(CHANGES_TOML.replace('files = ["vllm/mod.py"]\n', ""))
    with pytest.raises(ManifestError, match="needs files"):
        fold_changes(legacy, tmp_path / "changes.toml")


def test_changes_toml_is_not_a_stray_overlay_file(tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "mod.py").write_text("x = 1\n")
    (tmp_path / "changes.toml").write_text(CHANGES_TOML)
    manifest = Manifest("1.0.0", "w.whl", "0" * 64, (Entry("vllm/mod.py", "1" * 64, "2" * 64, "why"),))
    assert overlay.unrecorded_files(manifest, tmp_path) == []


@pytest.mark.parametrize("version, changes", [
    ("0.24.0", {"b12x-indexer", "block-table-width", "envs-switch", "numpy-chunk-split", "prefill-kernel-prewarm",
                "sync-free-metadata"}),
    ("0.33.0", {"b12x-indexer", "dcp-prefill-sync", "metadata-kernel-warmup"}),
])
def test_the_repos_changes_toml_is_what_the_manifest_records(version, changes):
    """Each committed manifest carries exactly the changes its changes.toml defines (record
    folded them in; nobody edited the manifest by hand)."""
    manifest = parse_manifest(overlay.manifest_path(version).read_bytes())
    assert fold_changes(manifest, overlay.overlay_dir(version) / "changes.toml") == manifest
    assert {c.id for c in manifest.changes} == changes


# --- the real pair: vLLM 0.24.0 -> 0.33.0 ------------------------------------------------------------

REPORT_DIR = REPO / "docs" / "rebase" / "vllm-0.24.0-to-0.33.0"


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """`rebase --to 0.33.0` through its command line; the report it wrote and its exit code."""
    out, reports = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("reports")
    before = snapshot(overlay.OVERLAY_ROOT)
    code = rebase.main(["--vllm", "0.24.0", "--to", "0.33.0", "--out", str(out), "--report-dir", str(reports)])
    assert snapshot(overlay.OVERLAY_ROOT) == before, "rebase wrote into overlay/"
    return {"code": code, "out": out, "reports": reports, "report": json.loads((out / "report.json").read_text())}


@pytest.mark.wheel
def test_the_real_rebase_conflicts_and_records_nothing(real):
    assert real["code"] == rebase.CONFLICT == real["report"]["exit_code"]
    indexer = real["report"]["files"]["vllm/v1/attention/backends/mla/indexer.py"]
    assert indexer["status"] == "conflict" and indexer["conflicts"] >= 20
    assert (real["out"] / "merged/vllm/v1/attention/backends/mla/indexer.py").read_text().count("<<<<<<< ours") == \
        indexer["conflicts"]
    assert real["report"]["files"]["vllm/v1/attention/backends/mla/b12x_indexer.py"]["status"] == "new-file"
    assert (real["reports"] / "report.json").read_bytes() == (real["out"] / "report.json").read_bytes()


@pytest.mark.wheel
def test_what_each_change_became_on_0_33_0(real):
    changes = real["report"]["changes"]
    static = {cid: c["upstream"]["static"] for cid, c in changes.items()}
    assert static == {"b12x-indexer": "no", "block-table-width": "yes", "envs-switch": "no",
                      "numpy-chunk-split": "no", "prefill-kernel-prewarm": "yes", "sync-free-metadata": "partly"}
    for cid in ("block-table-width", "prefill-kernel-prewarm"):
        assert "already-upstream" in changes[cid]["verdicts"]
    assert all(c["upstream"]["behavioural"]["status"] in ("not-collected", "no-tests") for c in changes.values())
    sync_free = {s["means"]: s["holds"] for s in changes["sync-free-metadata"]["upstream"]["signatures"]}
    assert sync_free["a DCP prefill chunk's rank-local lengths are not read back from the GPU"] is False


@pytest.mark.wheel
def test_the_renames_upstream_made_are_named(real):
    anchors = {a["anchor"].rpartition(":")[2]: a for c in real["report"]["changes"].values() for a in c["anchors"]}
    assert anchors["_build_prefill_chunk_metadata_kernel"]["close_matches"][0] == "BuildPrefillChunkMetadataKernel"
    assert anchors["_prepare_uniform_decode_kernel"]["close_matches"][0] == "PrepareUniformDecodeKernel"
    assert anchors["split_indexer_prefill_chunks"]["close_matches"] == [
        "DeepseekV32IndexerMetadataBuilder._split_indexer_prefill_chunks"]
    vanished = {v["name"]: v for c in real["report"]["changes"].values() for v in c["vanished"]}
    assert {"_seq_lens_cpu", "storage_block_size"} <= set(vanished)
    assert vanished["storage_block_size"]["renamed_to"] == "num_states"


@pytest.mark.wheel
def test_every_conflict_is_placed_in_a_change_and_the_rest_is_listed(real):
    """changes.toml's anchors and introduced names place every conflict region; the few clean
    hunks nothing names (a split `if`, a comment) are listed in report.md, not guessed."""
    markdown = (real["out"] / "report.md").read_text()
    for path, item in real["report"]["files"].items():
        for hunk in item["hunks"]:
            assert hunk["changes"] or hunk["merge"] != "conflict", (path, hunk)
        unplaced = [h for h in item["hunks"] if h["hunk"] in item["unattributed_hunks"]]
        assert len(unplaced) <= 2 and all(h["merge"] == "clean" for h in unplaced), (path, unplaced)
        for hunk in unplaced:
            assert f"{hunk['hunk']} (clean; ours lines {rebase_report._span_words(hunk['ours'])})" in markdown


def test_the_committed_report_names_its_command_and_its_markdown_is_its_json():
    """docs/rebase/vllm-0.24.0-to-0.33.0 is a record: that it is what the tool writes from
    today's overlays is the release check's (`scripts/release_check.py --check rebase`)."""
    committed = json.loads((REPORT_DIR / "report.json").read_text())
    assert committed["command"] == (f"python3 scripts/overlay.py rebase --vllm 0.24.0 --to 0.33.0 "
                                    f"--report-dir {REPORT_DIR.relative_to(REPO)}")
    assert (REPORT_DIR / "report.md").read_text() == rebase.render_markdown(committed)
