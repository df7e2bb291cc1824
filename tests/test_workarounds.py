"""dsa_image.serving.workarounds: the bug files of recipes/bugs/, their evidence in the pinned locks and
wheels, and the check that fails once a base no longer has a bug that a recipe works around
(fake wheels here; the real pinned ones under the `wheel` marker)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dsa_image.build import bug_check
from dsa_image.serving import workarounds as w
from dsa_image.core.recipe import load_every_base

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
BASES = {build.vllm_version: build for build in load_every_base()}
OLD, NEW = BASES["0.24.0"], BASES["0.33.0"]
SAMPLER = "flashinfer-3610"
TOPK = "flashinfer/data/include/flashinfer/topk.cuh"
BEFORE = "    // Only leading CTA clears the buffers using release semantics\n    if (cta_in_group == 0) {\n"
AFTER = "    RadixGroupResetStateLastCTA<BLOCK_THREADS>(state, nullptr, barrier_phase, ctas_per_group, tx);\n"


def fake_wheel(tmp_path: Path, members: dict[str, str]) -> Path:
    """A wheel-shaped zip holding `members` (name -> text), named as the pinned FlashInfer."""
    path = tmp_path / "flashinfer_python-0.6.12-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("flashinfer/__init__.py", "")
        for name, text in members.items():
            archive.writestr(name, text)
    return path


def sampler_bug(root: Path = RECIPES) -> dict[str, w.Bug]:
    return {SAMPLER: w.load_bug(root / "bugs" / f"{SAMPLER}.toml")}


def copy_recipes(tmp_path: Path) -> Path:
    root = tmp_path / "recipes"
    shutil.copytree(RECIPES, root, ignore=shutil.ignore_patterns("locks", "requirements"))
    return root


def edit_bug(root: Path, bug: str, old: str, new: str) -> None:
    path = root / "bugs" / f"{bug}.toml"
    assert old in path.read_text(), old
    path.write_text(path.read_text().replace(old, new, 1))


# -- the fake-wheel check: passes while the bug is there, fails once it is gone --------------


def test_the_check_passes_while_the_pinned_wheel_still_has_the_bug(tmp_path):
    wheel = fake_wheel(tmp_path, {TOPK: f"// topk\n{BEFORE}"})
    assert bug_check.base_problems(sampler_bug(), OLD, online=True, wheel_for=lambda build, package: wheel) == []


def test_the_check_fails_when_the_bug_is_gone_from_a_base_it_is_applied_to(tmp_path):
    wheel = fake_wheel(tmp_path, {TOPK: f"// topk\n{AFTER}"})
    problems = bug_check.base_problems(sampler_bug(), OLD, online=True, wheel_for=lambda build, package: wheel)
    assert len(problems) == 1
    assert ("vLLM 0.24.0: recorded present, but flashinfer_python-0.6.12-py3-none-any.whl shows fixed: the fix's "
            "`RadixGroupResetStateLastCTA` in flashinfer/data/include/flashinfer/topk.cuh; the bug is gone from a "
            "base it is recorded on") in problems[0]
    # offline, the versions alone cannot tell (the fake carries the pinned version): the source does
    assert bug_check.base_problems(sampler_bug(), OLD, online=False, wheel_for=lambda build, package: wheel) == []


def test_the_check_fails_when_the_patterns_no_longer_tell(tmp_path):
    wheel = fake_wheel(tmp_path, {TOPK: "// rewritten\n"})
    problems = bug_check.base_problems(sampler_bug(), OLD, online=True, wheel_for=lambda build, package: wheel)
    assert len(problems) == 1 and "the patterns no longer tell; read the release's source" in problems[0]


def test_the_check_fails_when_a_lock_moves_to_the_release_that_fixed_it(tmp_path):
    """Offline, from the lock: the sampler bug recorded present on 0.24.0 with fixed_in at or
    below the version its lock pins (as after a FlashInfer bump) is gone there."""
    root = copy_recipes(tmp_path)
    edit_bug(root, SAMPLER, 'fixed_in = "0.6.14"', 'fixed_in = "0.6.12"')
    problems = bug_check.check(OLD, root)
    assert len(problems) == 1 and (
        "vLLM 0.24.0: recorded present, but flashinfer-python 0.6.12 is at or above 0.6.12, which fixed it: the bug "
        "is gone from this base") in problems[0]
    assert bug_check.check(NEW, root) == []  # recorded fixed on 0.33.0: nothing to say


def test_the_check_holds_every_decision_to_the_lock(tmp_path):
    root = copy_recipes(tmp_path)
    edit_bug(root, SAMPLER, 'pinned = "0.7.2.post1"', 'pinned = "0.7.1"')
    edit_bug(root, "flashinfer-3700", '[bases."0.33.0"]\npinned = "0.7.2.post1"\nverdict = "fixed"\n', "")
    edit_bug(root, "flashinfer-5095", 'verdict = "fixed"', 'verdict = "present"')
    problems = "\n".join(bug_check.check(NEW, root))
    assert ("flashinfer-3610.toml: vLLM 0.33.0: records flashinfer-python 0.7.1, the base's locks pin 0.7.2.post1"
            in problems)
    assert 'flashinfer-3700.toml: no [bases."0.33.0"] decision (flashinfer-python 0.7.2.post1 pinned)' in problems
    assert "flashinfer-5095.toml: vLLM 0.33.0: recorded present, but flashinfer-python 0.7.2.post1 is at or above " \
           "0.7.1" in problems
    edit_bug(root, "flashinfer-5095", 'verdict = "present"', 'verdict = "fixed"')
    edit_bug(root, "flashinfer-5001", 'fixed_in = "0.7.0"', 'fixed_in = "0.8.0"')
    assert any("recorded fixed, but flashinfer-python 0.7.2.post1 is below 0.8.0" in p for p in bug_check.check(NEW, root))


def test_the_committed_decisions_agree_with_every_base_offline():
    for build in BASES.values():
        assert bug_check.check(build, RECIPES) == [], build.vllm_version


# -- source verdicts ------------------------------------------------------------------------

SOURCE = w.Source(files="pkg/kernels/", code="KernelX", before="old_line(1);", after="new_line(1, 5);")


@pytest.mark.parametrize("members, verdict", [
    ({"pkg/kernels/a.cuh": "KernelX\n  old_line(1);"}, "present"),
    ({"pkg/kernels/a.cuh": "KernelX", "pkg/kernels/b.cuh": "new_line(1,\n   5);"}, "fixed"),  # across lines
    ({"pkg/other/a.cuh": "KernelX old_line(1);"}, "absent"),  # nothing under files
    ({"pkg/kernels/a.cuh": "old_line(1);"}, "absent"),  # not the code the bug lives in
])
def test_source_verdicts(members, verdict):
    assert w.source_verdict(SOURCE, members.items())[0] == verdict


@pytest.mark.parametrize("members, message", [
    ({"pkg/kernels/a.cuh": "KernelX old_line(1); new_line(1, 5);"}, "both the fix's line and the line it removed"),
    ({"pkg/kernels/a.cuh": "KernelX rewritten"}, "neither the fix's line nor the removed one"),
])
def test_source_verdicts_that_do_not_tell_are_errors(members, message):
    with pytest.raises(w.BugError, match=message):
        w.source_verdict(SOURCE, members.items())


def test_a_fix_line_alone_is_present_until_it_appears():
    after_only = w.Source(files="pkg/a.py", code="", before="", after="can_return_lse_for_decode")
    assert w.source_verdict(after_only, [("pkg/a.py", "class Impl: pass")]) == (
        "present", "no `can_return_lse_for_decode` in pkg/a.py")
    assert w.source_verdict(after_only, [("pkg/a.py", "can_return_lse_for_decode = True")])[0] == "fixed"


def test_wheel_and_installed_members_select_by_files(tmp_path):
    wheel = fake_wheel(tmp_path, {TOPK: "x", "flashinfer/data/include/flashinfer/other.cuh": "y"})
    assert [name for name, _ in w.wheel_members(wheel, TOPK)] == [TOPK]
    assert len(list(w.wheel_members(wheel, "flashinfer/data/include/flashinfer/"))) == 2
    assert [name for name, _ in w.installed_members("pytest", "pytest/__init__.py")] == ["pytest/__init__.py"]


def test_versions_order_as_pep_440():
    ordered = ["0.6.12", "0.6.14.dev1", "0.6.14rc1", "0.6.14", "0.6.14.post1", "0.7.0", "0.7.2", "0.7.2.post1",
               "0.7.10"]
    assert sorted(reversed(ordered), key=w.version_key) == ordered
    assert w.version_key("1.0") == w.version_key("1.0.0")
    with pytest.raises(w.BugError, match="is not a release version"):
        w.version_key("main")


# -- bug files ------------------------------------------------------------------------------


@pytest.mark.parametrize("old, new, message", [
    ("schema = 1\n", "schema = 1\ncolour = 1\n", "unknown keys colour"),
    ('id = "flashinfer-3610"', 'id = "flashinfer-1"', "must equal the file name"),
    ('verdict = "present"', 'verdict = "gone"', "one of present, fixed, absent"),
    ('pinned = "0.6.12"\n', "", "needs exactly pinned and verdict"),
    ('link = "https://github.com/flashinfer-ai/flashinfer/issues/3610"', 'link = "issue 3610"',
     "expected an https:// URL"),
    ('after = "RadixGroupResetStateLastCTA"', 'after = ""', "files and after must not be empty"),
    ('fixed_in = "0.6.14"', 'fixed_in = "soon"', "is not a release version"),
    ("[bases.", "[[bases.", "not valid TOML"),
])
def test_bug_file_errors_name_the_problem(tmp_path, old, new, message):
    root = copy_recipes(tmp_path)
    edit_bug(root, SAMPLER, old, new)
    with pytest.raises(w.BugError, match=message):
        w.load_bugs(root)


def test_without_a_source_only_a_fixed_release_is_evidence(tmp_path):
    root = copy_recipes(tmp_path)
    path = root / "bugs" / "flashinfer-3700.toml"
    text = path.read_text()
    path.write_text(text[:text.index("[source]")] + text[text.index("[bases."):])
    with pytest.raises(w.BugError, match='it needs fixed_in, and no verdict can be "absent"'):
        w.load_bugs(root)


def test_every_bug_has_evidence_and_a_decision_per_base():
    bugs = w.load_bugs(RECIPES)
    assert bugs and all(set(bug.bases) == set(BASES) for bug in bugs.values())
    assert all(bug.fixed_in or bug.source for bug in bugs.values())


# -- the verdict command line ---------------------------------------------------------------


def test_cli_verdict_reads_any_wheel(tmp_path):
    present = fake_wheel(tmp_path, {TOPK: BEFORE})
    done = subprocess.run([sys.executable, "-m", "dsa_image.serving.workarounds", "verdict", SAMPLER, str(present)],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0 and done.stdout.startswith("flashinfer_python-0.6.12-py3-none-any.whl: present: ")
    unclear = fake_wheel(tmp_path, {TOPK: "rewritten"})
    done = subprocess.run([sys.executable, "-m", "dsa_image.serving.workarounds", "verdict", SAMPLER, str(unclear)],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 1 and ": unclear: " in done.stdout


# -- the real pinned wheels -----------------------------------------------------------------


@pytest.mark.wheel
@pytest.mark.parametrize("base", sorted(BASES))
def test_the_pinned_wheels_give_the_recorded_verdicts(base):
    """Downloads (once, into ~/.cache/dsa-image) each base's pinned FlashInfer wheel and its vLLM
    wheel, and reads every bug's source patterns in them."""
    assert bug_check.check(BASES[base], RECIPES, online=True) == []


@pytest.mark.wheel
def test_the_pinned_flashinfers_decide_the_sm120_workarounds():
    bugs = w.load_bugs(RECIPES)
    verdicts = {}
    for base, build in BASES.items():
        wheel = bug_check.pinned_wheel(build, "flashinfer-python")
        for bug in bugs.values():
            if bug.package == "flashinfer-python":
                verdicts[bug.id, base] = w.source_verdict(bug.source, w.wheel_members(wheel, bug.source.files))[0]
    assert verdicts == {
        ("flashinfer-3610", "0.24.0"): "present", ("flashinfer-3610", "0.33.0"): "fixed",  # the sampler env
        ("flashinfer-3700", "0.24.0"): "absent", ("flashinfer-3700", "0.33.0"): "fixed",  # the 64-token cap's
        ("flashinfer-5001", "0.24.0"): "absent", ("flashinfer-5001", "0.33.0"): "fixed",  # three bugs
        ("flashinfer-5095", "0.24.0"): "absent", ("flashinfer-5095", "0.33.0"): "fixed",
        ("vllm-sm120-flashinfer-sparse-mla-api", "0.24.0"): "present",
        ("vllm-sm120-flashinfer-sparse-mla-api", "0.33.0"): "fixed",
    }
