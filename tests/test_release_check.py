"""The release check (dsa_image/records/release_check.py) on made-up trees, and when CI runs it; then the
sequence the split exists for: a comment-only overlay edit and `overlay.py record --refresh`
leave the record-derived unit tests green and make the release check, not them, name the claim
that no longer holds. These tests never run the release check against the committed tree: that
would compare the records with today's tree, which is the release check's own business."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from dsa_image.records import store as records, release_check
from dsa_image.overlay.manifest import load_manifest
from dsa_image.overlay.core import expected_receipt, receipt_bytes

REPO = Path(__file__).resolve().parent.parent
GIT = shutil.which("git")


def _receipt(version: str, tag: str) -> bytes:
    return json.dumps({"schema": 1, "files": [], "manifest_sha256": tag, "vllm_version": version}).encode()


def _tree(tmp_path: Path, readme: str, record_readme: str, receipt: bytes, bake: str) -> release_check.Tree:
    repo = tmp_path / "repo"
    record = repo / "docs" / "validation" / "run"
    record.mkdir(parents=True)
    (repo / "README.md").write_text(readme)
    (repo / "docker-bake.json").write_text(json.dumps(
        {"variable": {"VLLM": {"default": {"0.33.0": {"RECEIPT_SHA256": bake}}}}}))
    (record / "README.md").write_text(record_readme)
    (record / "receipt.json").write_bytes(receipt)
    records.pack(record)
    (tmp_path / "scratch").mkdir()
    return release_check.Tree(repo, tmp_path / "scratch")


def test_blocks_are_paragraphs_list_items_and_table_rows():
    text = "A paragraph\nover two lines.\n\n- an item\n  continued\n- another\n\n| a | b |\n| c | d |\ntail"
    assert release_check.blocks(text) == ["A paragraph over two lines.", "- an item continued", "- another",
                                          "| a | b |", "| c | d |", "tail"]


def test_a_claim_naming_the_bakes_receipt_holds_while_the_bake_has_it(tmp_path):
    receipt = _receipt("0.33.0", "m1")
    sha = records.sha256(receipt)
    claim = f"Receipt `{sha[:8]}…`, the bake's `RECEIPT_SHA256`.\n"
    tree = _tree(tmp_path, "# x\n", claim, receipt, bake=sha)
    assert release_check.check_receipts(tree) == []
    tree = _tree(tmp_path / "later", "# x\n", claim, receipt, bake="f" * 64)
    (problem,) = release_check.check_receipts(tree)
    assert problem.startswith("docs/validation/run/README.md: ") and f"calls receipt {sha[:12]}… (vLLM 0.33.0) the bake's" in problem
    assert "docker-bake.json has ffffffffffff… for 0.33.0" in problem and "re-run it on today's overlay" in problem


def test_a_readme_claim_speaks_for_the_records_it_links(tmp_path):
    receipt = _receipt("0.33.0", "m1")
    readme = "| run | receipt = the bake's `RECEIPT_SHA256` | [run](docs/validation/run/README.md) |\n"
    assert release_check.check_receipts(_tree(tmp_path, readme, "# run\n", receipt, records.sha256(receipt))) == []
    (problem,) = release_check.check_receipts(_tree(tmp_path / "later", readme, "# run\n", receipt, "e" * 64))
    assert problem.startswith("README.md: ") and "no run it speaks for ran eeeeeeeeeeee…" in problem
    unlinked = "Every image's receipt is the bake's `RECEIPT_SHA256`.\n"
    (problem,) = release_check.check_receipts(_tree(tmp_path / "none", unlinked, "# run\n", receipt, "e" * 64))
    assert "names no record whose raw data holds a receipt" in problem


def test_the_summaries_the_readmes_details_moved_to_are_claim_docs_too(tmp_path):
    """The README points to docs/validation/README.md and docs/benchmarks/README.md for the
    details: a claim there speaks for the records it links, relative to its own directory."""
    receipt = _receipt("0.33.0", "m1")
    tree = _tree(tmp_path, "# x\n", "# run\n", receipt, "e" * 64)
    summary = tree.repo / "docs" / "benchmarks" / "README.md"
    summary.parent.mkdir()
    summary.write_text("| run | receipt = the bake's `RECEIPT_SHA256` | [run](../validation/run/README.md) |\n")
    assert release_check.linked_records(tree, Path("docs/benchmarks/README.md"), summary.read_text()) == [
        Path("docs/validation/run")]
    (problem,) = release_check.check_receipts(tree)
    assert problem.startswith("docs/benchmarks/README.md: ") and "no run it speaks for ran eeeeeeeeeeee…" in problem
    (tree.repo / "docs" / "validation" / "README.md").write_text("See [run](run/README.md#x), [it](https://example.com/a).\n")
    assert release_check.linked_records(tree, Path("docs/validation/README.md"), "[run](run/README.md#x) [it](https://x/y)") == [
        Path("docs/validation/run")]


def test_a_figure_a_summary_states_is_held_to_the_results(tmp_path):
    tree = _tree(tmp_path, "It serves 10–16% fewer output tokens/s.\n", "# run\n", _receipt("0.33.0", "m"), "e" * 64)
    assert release_check._readme_says(tree, r"\d+–\d+% fewer output tokens/s", "10–16% fewer output tokens/s")[0]
    (tree.repo / "docs" / "benchmarks").mkdir()
    (tree.repo / "docs" / "benchmarks" / "README.md").write_text("0.33.0 serves 10–17% fewer output\ntokens/s.\n")
    holds, message = release_check._readme_says(tree, r"\d+–\d+% fewer output tokens/s", "10–16% fewer output tokens/s")
    assert not holds and message.startswith("docs/benchmarks/README.md says '10–17% fewer output tokens/s'")


def test_a_receipt_said_in_the_past_is_no_claim(tmp_path):
    receipt = _receipt("0.33.0", "m1")
    text = "Its receipt was the `RECEIPT_SHA256` that `docker-bake.json` predicted then.\n"
    assert release_check.check_receipts(_tree(tmp_path, "# x\n", text, receipt, "d" * 64)) == []


def test_the_receipts_of_a_record_are_its_receipt_files_and_its_benchmark_builds(tmp_path):
    record = tmp_path / "run"
    record.mkdir()
    (record / "README.md").write_text("# run\n")
    (record / "receipt.json").write_bytes(_receipt("0.24.0", "m"))
    (record / "results.json").write_text(json.dumps({"environment": {"builds": {
        "A": {"versions": {"vllm": "0.33.0"}}, "B": {"versions": {"vllm": "0.33.0", "overlay_receipt_sha256": "ab" * 32}}}}}))
    (record / "other.json").write_text("[1, 2]")
    records.pack(record)
    tree = release_check.Tree(tmp_path, tmp_path)
    assert release_check.receipts(tree, Path("run")) == {records.sha256(_receipt("0.24.0", "m")): "0.24.0", "ab" * 32: "0.33.0"}


def _bench_doc(ratio: float) -> dict:
    from dsa_image.bench import report
    from dsa_image.bench.stats import METRICS
    summary = {m: {"n": 6, "median_ratio": ratio, "ci_low": ratio - 0.01, "ci_high": ratio + 0.01} for m in METRICS}
    workload = {"name": "512x128-c32", "group": "base", "input_len": 512, "output_len": 128, "concurrency": 32,
                "requests": 64, "rounds_planned": 0, "rounds_done": 0, "rounds": [], "summary": summary}
    return {"schema": report.SCHEMA, "created": "t", "command": "c", "environment": {}, "settings": {}, "groups": {},
            "workloads": [workload]}


def test_a_ratio_row_is_held_to_the_benchmark_results_of_any_record(tmp_path):
    """A validation run whose phase ran the benchmark (the real-width runs) backs a table row as
    a benchmark's own record does; a results.json of another kind backs nothing."""
    from dsa_image.bench import report
    repo = tmp_path / "repo"
    record = repo / "docs" / "validation" / "run"
    (record / "bench").mkdir(parents=True)
    (record / "other").mkdir()
    (record / "README.md").write_text("# run\n")
    (record / "bench" / "results.json").write_text(json.dumps(_bench_doc(0.51)))
    (record / "other" / "results.json").write_text(json.dumps([1, 2]))
    records.pack(record)
    (tmp_path / "scratch").mkdir()
    tree = release_check.Tree(repo, tmp_path / "scratch")
    row = report.table([_bench_doc(0.51)]).splitlines()[-1]
    (repo / "README.md").write_text(f"{row}\n")
    assert release_check._readme_tables(tree) == []
    (repo / "README.md").write_text(row.replace("0.510", "0.511") + "\n")
    (problem,) = release_check._readme_tables(tree)
    assert problem.startswith("README.md: the row '| 512x128-c32 | 0 | 0.511") and "is no benchmark record's" in problem


def test_the_command_line_prints_each_checks_problems_and_exits_1(monkeypatch, capsys):
    monkeypatch.setattr(release_check, "CHECKS", {"good": lambda tree: [], "bad": lambda tree: ["x is wrong"]})
    assert release_check.main([]) == 1
    assert capsys.readouterr().out.splitlines() == ["release check: good: PASS", "release check: bad: FAIL",
                                                    "  - x is wrong"]
    assert release_check.main(["--check", "good"]) == 0
    monkeypatch.setattr(release_check, "due", lambda repo: (False, "nothing of it changed"))
    assert release_check.main(["--if-records-changed"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "release check: not due: nothing of it changed"


# -- when CI runs it ----------------------------------------------------------------------------------

def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _commit(repo: Path, path: str, text: str = "x\n") -> None:
    (repo / path).parent.mkdir(parents=True, exist_ok=True)
    (repo / path).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", path)


@pytest.fixture
def repo(tmp_path):
    if GIT is None:
        pytest.skip("git is not installed")
    _git(tmp_path, "init", "-q", "-b", "main")
    _commit(tmp_path, "dsa_image/x.py")
    return tmp_path


def test_the_first_commit_and_no_git_run_the_check(repo, tmp_path_factory):
    assert release_check.due(repo) == (True, "HEAD is the first commit: cannot tell what changed, so the check runs")
    bare = tmp_path_factory.mktemp("copy")
    assert release_check.due(bare)[0] is True and "not a git checkout" in release_check.due(bare)[1]


def test_a_commit_of_code_only_is_not_due_and_one_of_a_record_or_the_readme_is(repo):
    _commit(repo, "dsa_image/y.py")
    assert release_check.due(repo)[0] is False
    _commit(repo, "docs/validation/run/README.md")
    assert release_check.due(repo) == (True, "HEAD^1..HEAD and the work tree touch docs/validation/run/README.md")
    _commit(repo, "dsa_image/z.py")
    (repo / "README.md").write_text("edited, not committed\n")
    assert release_check.due(repo)[0] is True and "README.md" in release_check.due(repo)[1]


def test_a_merge_is_judged_by_all_it_brings_to_the_first_parent(repo):
    _git(repo, "checkout", "-q", "-b", "side")
    _commit(repo, "docs/benchmarks/run/README.md")
    _commit(repo, "dsa_image/y.py")
    _git(repo, "checkout", "-q", "main")
    _commit(repo, "dsa_image/z.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@example.com", "merge", "-q", "--no-ff", "-m", "merge", "side")
    assert release_check.due(repo)[0] is True


def test_a_shallow_clone_without_the_parent_runs_the_check(repo, tmp_path_factory):
    _commit(repo, "dsa_image/y.py")
    clone = tmp_path_factory.mktemp("shallow") / "clone"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(clone)], check=True)
    assert release_check.due(clone) == (True, "a shallow clone without HEAD's parent: cannot tell what changed, "
                                              "so the check runs")


# -- a comment-only overlay edit, then `record --refresh` ----------------------------------------------

# What a copy of the repository needs for the record tool, the record-derived tests and the check.
COPIED = ["dsa_image", "scripts", "tests", "overlay", "recipes", "docs", "docker-bake.json", "docker-bake.hcl",
          "pyproject.toml", "README.md"]
# The unit tests that read the records: they must stay green (the rebase report's record test too).
RECORD_TESTS = ["tests/test_records.py", "tests/test_benchmark_record.py", "tests/test_validation_records.py",
                "tests/test_rebase.py::test_the_committed_report_names_its_command_and_its_markdown_is_its_json"]
OVERLAY_FILE = Path("overlay/vllm-0.33.0/vllm/v1/attention/backends/mla/indexer.py")


def _copy(dest: Path) -> Path:
    for name in COPIED:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache"))
        else:
            shutil.copy2(source, dest / name)
    return dest


def _edit_a_comment(path: Path) -> None:
    """Append a word to the first comment that has a line of its own (found by the tokenizer, so
    never inside a string)."""
    text = path.read_text()
    comments = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
                if t.type == tokenize.COMMENT and t.line.strip() == t.string and t.start[0] > 2]
    lines = text.splitlines(keepends=True)
    row = comments[0].start[0] - 1
    lines[row] = lines[row].rstrip("\n") + " (a comment-only edit)\n"
    path.write_text("".join(lines))


def _bake_receipt(repo: Path) -> str:
    return json.loads((repo / "docker-bake.json").read_text())["variable"]["VLLM"]["default"]["0.33.0"]["RECEIPT_SHA256"]


def _run(repo: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "DSA_IMAGE_REQUIRE"))}
    return subprocess.run([sys.executable, *argv], cwd=repo, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.wheel
def test_a_comment_only_overlay_edit_and_refresh_leave_the_record_tests_green(tmp_path):
    repo = _copy(tmp_path / "repo")
    # A record whose README says it ran the bake's receipt: the one the copy's 0.33.0 overlay makes now.
    manifest, raw = load_manifest(repo / "overlay" / "vllm-0.33.0" / "manifest.json")
    receipt = receipt_bytes(expected_receipt("glm5-dsa", manifest, raw))
    assert records.sha256(receipt) == _bake_receipt(repo)
    claim = repo / "docs" / "validation" / "h200-2099-01-01-claim"
    claim.mkdir()
    (claim / "README.md").write_text(f"# A run\n\nReceipt `{records.sha256(receipt)[:8]}…`, the bake's `RECEIPT_SHA256`.\n")
    (claim / "receipt.json").write_bytes(receipt)
    records.pack(claim)

    _edit_a_comment(repo / OVERLAY_FILE)
    refreshed = _run(repo, "scripts/overlay.py", "record", "--refresh", "--vllm", "0.33.0")
    assert refreshed.returncode == 0, refreshed.stderr
    assert _bake_receipt(repo) != records.sha256(receipt)  # the edit changed the receipt the bake predicts
    checked = _run(repo, "scripts/overlay.py", "check", "--vllm", "0.33.0")
    assert checked.returncode == 0, checked.stdout + checked.stderr

    tests = _run(repo, "-m", "pytest", "-q", "-p", "no:cacheprovider", *RECORD_TESTS)
    assert tests.returncode == 0, tests.stdout[-3000:]
    released = _run(repo, "scripts/release_check.py", "--check", "records", "--check", "receipts")
    assert released.returncode == 1 and "release check: records: PASS" in released.stdout
    assert f"docs/validation/{claim.name}/README.md: " in released.stdout
    assert f"docker-bake.json has {_bake_receipt(repo)[:12]}… for 0.33.0" in released.stdout
