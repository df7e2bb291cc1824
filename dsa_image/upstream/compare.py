"""Comparing the stock and overlaid runs of one bundle, test by test, from their junit XML (or,
for a file run in parts or shards, its records).

The rule: no test that passes (or is skipped) on stock may fail, error, be skipped (if it
passed) or be missing on the overlay; a test failing on both is listed, not fixed. A file
without a result on a side makes the comparison incomplete, never a pass. While a side's run of
a file is partial (or not begun), only the tests both sides finished are compared: a regression
among them is one already, and what is still to run is never "missing".
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from dsa_image.upstream.bundle import Bundle
from dsa_image.upstream.recorder import ERROR, FAILED, PASSED, SKIPPED, one_line
from dsa_image.upstream.run import CRASHED, SIDES, TIMEOUT, file_record_results, junit_name, load_run
from dsa_image.upstream.selection import UpstreamTestsError

MISSING = "missing"
# A test a part's kill or crash caught fails like one that failed: on the overlay alone, a regression.
_FAILS = (FAILED, ERROR, TIMEOUT, CRASHED)
_COUNTED = (PASSED, FAILED, ERROR, SKIPPED, TIMEOUT, CRASHED)


def node_id(test_file: str, classname: str, name: str) -> str:
    """pytest's node id of a junit testcase of `test_file` (classname: the file's dotted path and
    its class; none for the file itself: a collection error, a module-level skip)."""
    module = test_file.removesuffix(".py").replace("/", ".")
    if not classname:
        return test_file
    if classname == module:
        return f"{test_file}::{name}"
    inner = classname[len(module) + 1:] if classname.startswith(f"{module}.") else classname
    return f"{test_file}::{inner.replace('.', '::')}::{name}"


def junit_outcomes(path: Path, test_file: str) -> dict[str, str]:
    """{node id: outcome} of the junit XML of `test_file`: passed, failed, error or skipped
    (pytest writes an xfail as skipped). A test with a failure and an error (a failed call, then
    a failed teardown) is failed."""
    return junit_results(path, test_file)[0]


def junit_results(path: Path, test_file: str) -> tuple[dict[str, str], dict[str, str]]:
    """junit_outcomes, and {node id: reason} of the failed and errored tests: their failure's
    or error's message, on one line, as the records keep it."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        raise UpstreamTestsError(f"{path}: not junit XML ({exc})") from exc
    outcomes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for case in root.iter("testcase"):
        kinds = {child.tag: child for child in case}
        outcome = FAILED if "failure" in kinds else ERROR if "error" in kinds else SKIPPED if "skipped" in kinds else PASSED
        test = node_id(test_file, case.get("classname", ""), case.get("name", ""))
        # A test reported twice (a passed call, then an error in its teardown) keeps the worse.
        if outcomes.get(test) not in _FAILS:
            outcomes[test] = outcome
        failed = kinds.get("failure", kinds.get("error"))
        if failed is not None and test not in reasons:
            reasons[test] = one_line(failed.get("message") or "")
    return outcomes, reasons


@dataclass(frozen=True)
class Change:
    path: str
    test: str
    stock: str
    overlay: str
    reason: str = ""  # what the overlay's failure raised, else stock's ("" when neither failed or none was kept)


@dataclass
class FileComparison:
    path: str
    stock: dict  # run.json's entry, or {} when the side has none yet
    overlay: dict
    counts: dict[str, dict[str, int]]  # side -> outcome -> count
    regressions: list[Change]
    fail_on_both: list[Change]
    other: list[Change]  # fixed on the overlay, skipped where stock failed, only on one side
    so_far: int = 0  # while a side is partial: the tests both sides finished, compared

    @property
    def complete(self) -> bool:
        return self.stock.get("status") == "ran" and self.overlay.get("status") == "ran"


def is_regression(stock: str, overlay: str) -> bool:
    """The rule: what passes on stock must pass on the overlay; what stock skips may not fail
    there; a test only the overlay has may not fail."""
    if stock == PASSED:
        return overlay != PASSED  # failed, error, skipped or not run at all
    if stock == SKIPPED:
        return overlay in (*_FAILS, MISSING)
    return stock == MISSING and overlay in _FAILS


def file_outcomes(out: Path, side: str, path: str, result: dict) -> dict[str, str]:
    """{node id: outcome} of a file's finished run on one side: its junit XML, or for a file run
    in parts or shards its records (each part's junit holds only that part's tests)."""
    return side_results(out, side, path, result)[0] if result.get("status") == "ran" else {}


def side_results(out: Path, side: str, path: str, result: dict) -> tuple[dict[str, str], dict[str, str]]:
    """({node id: outcome}, {node id: reason}) of what one side finished of a file: every test
    of a run that ran, the tests a partial run finished so far (its records), else none."""
    status = result.get("status")
    if status == "ran" and not (result.get("parts") or result.get("shards")):
        return junit_results(out / side / "junit" / junit_name(path), path)
    if status in ("ran", "partial"):
        return file_record_results(out / side, path, len(result.get("shards", ())) or 1)
    return {}, {}


def compare_file(path: str, stock: dict, overlay: dict, out: Path) -> FileComparison:
    sides = {"stock": stock, "overlay": overlay}
    found = {side: side_results(out, side, path, r) for side, r in sides.items()}
    outcomes = {side: found[side][0] for side in SIDES}
    counts = {side: {k: sum(1 for o in outcomes[side].values() if o == k) if sides[side].get("status") == "ran" else 0
                     for k in _COUNTED} for side in SIDES}
    comparison = FileComparison(path, stock, overlay, counts, [], [], [])
    if stock.get("status") not in ("ran", "partial"):
        return comparison  # no baseline: incomplete, never a verdict
    finished = all(r.get("status") not in (None, "partial") for r in sides.values())
    if finished:
        tests = set(outcomes["stock"]) | set(outcomes["overlay"])
    else:  # what a side has still to run is not missing: compare what both finished
        tests = set(outcomes["stock"]) & set(outcomes["overlay"])
        comparison.so_far = len(tests)
    for test in sorted(tests):
        reason = found["overlay"][1].get(test) or found["stock"][1].get(test, "")
        change = Change(path, test, outcomes["stock"].get(test, MISSING), outcomes["overlay"].get(test, MISSING), reason)
        if is_regression(change.stock, change.overlay):
            comparison.regressions.append(change)
        elif change.stock in _FAILS and change.overlay in _FAILS:
            comparison.fail_on_both.append(change)
        elif change.stock != change.overlay:
            comparison.other.append(change)
    if finished and overlay.get("status") != "ran" and not comparison.regressions:
        # The overlay's run gave nothing where stock's did: that is a regression by itself.
        comparison.regressions.append(Change(path, f"{path} (the whole file)", "ran", overlay["status"]))
    return comparison


def _change_line(change: Change) -> str:
    reason = f"  ({change.reason[:200]})" if change.reason else ""
    return f"  {change.test}: {change.stock} -> {change.overlay}{reason}"


@dataclass(frozen=True)
class Comparison:
    vllm_version: str
    files: tuple[FileComparison, ...]

    @property
    def regressions(self) -> list[Change]:
        return [c for f in self.files for c in f.regressions]

    @property
    def incomplete(self) -> list[FileComparison]:
        return [f for f in self.files if not f.complete]

    @property
    def stock_passed(self) -> int:
        """Tests passing on stock: none means the gate compared nothing (a broken site)."""
        return sum(f.counts["stock"][PASSED] for f in self.files)

    @property
    def verdict(self) -> str:
        """regressions, incomplete (a file without a result, or nothing passing on stock) or ok."""
        if self.regressions:
            return "regressions"
        return "incomplete" if self.incomplete or not self.stock_passed else "ok"


def compare_runs(out: Path, bundle: Bundle, files: list[str] | None = None) -> Comparison:
    """The stock and overlay runs in out/stock and out/overlay, test by test, over every file
    `bundle` selects (or `files` of them): a selected file neither side has a result for is
    compared too, as incomplete, so a run cut short can never read as a pass."""
    stock, overlay = load_run(out, "stock"), load_run(out, "overlay")
    if stock["bundle_sha256"] != overlay["bundle_sha256"]:
        raise UpstreamTestsError(f"{out}: the stock and overlay results come from different bundles "
                                 f"({stock['bundle_sha256']} vs {overlay['bundle_sha256']}); run both from one")
    if stock["bundle_sha256"] != bundle.sha256:
        raise UpstreamTestsError(f"{out}: results of another bundle (sha256 {stock['bundle_sha256']}, "
                                 f"{bundle.root} is {bundle.sha256}); compare with the bundle they ran")
    selected = [s["path"] for s in bundle.selected]
    unknown = sorted(set(files or ()) - set(selected))
    if unknown:
        raise UpstreamTestsError(f"not selected in {bundle.root}: {', '.join(unknown)}")
    strays = sorted((set(stock["files"]) | set(overlay["files"])) - set(selected))
    if strays:
        raise UpstreamTestsError(f"{out}: results for files {bundle.root} does not select: {', '.join(strays[:5])}")
    sites = (stock.get("site") or {}), (overlay.get("site") or {})
    versions = {s.get("vllm_version") for s in sites}
    if len(versions) != 1 or None in versions:
        raise UpstreamTestsError(f"{out}: expected both sides on one vLLM, found {sorted(map(str, versions))}")
    if sites[0].get("receipt") or not sites[1].get("receipt"):
        raise UpstreamTestsError(f"{out}: the stock side must have no overlay receipt and the overlay side one")
    paths = sorted(p for p in selected if not files or p in files)
    compared = tuple(compare_file(p, stock["files"].get(p, {}), overlay["files"].get(p, {}), out) for p in paths)
    return Comparison(str(versions.pop()), compared)  # one version, not None: checked above


def _cell(result: dict, counts: dict[str, int]) -> str:
    if result.get("status") != "ran":
        return f"{result.get('status', 'not run'):>17}"
    return f"{counts[PASSED]:5} {sum(counts[k] for k in _FAILS):5} {counts[SKIPPED]:5}"


def format_comparison(comparison: Comparison) -> str:
    """The per-file table (passed / failed, errors, timeouts, crashes / skipped on each side), then every regression,
    every test failing on both, every file without a result, and the count of regressions."""
    width = max([len(f.path) for f in comparison.files] + [4])
    lines = [f"vLLM {comparison.vllm_version}: upstream's tests, stock vs overlay",
             f"{'file':{width}}  {'stock':^17}  {'overlay':^17}",
             f"{'':{width}}  {'pass':>5} {'fail':>5} {'skip':>5}  {'pass':>5} {'fail':>5} {'skip':>5}"]
    for f in comparison.files:
        note = f"  {len(f.regressions)} regression(s)" if f.regressions else ""
        lines.append(f"{f.path:{width}}  {_cell(f.stock, f.counts['stock'])}  {_cell(f.overlay, f.counts['overlay'])}{note}")
    total = {side: {k: sum(f.counts[side][k] for f in comparison.files) for k in _COUNTED} for side in SIDES}
    lines.append(f"{'total':{width}}  {_cell({'status': 'ran'}, total['stock'])}  {_cell({'status': 'ran'}, total['overlay'])}")
    sections = [("regressions (pass or skip on stock, fail/error/skip/missing on the overlay)", comparison.regressions),
                ("failing on both (listed, not the overlay's)", [c for f in comparison.files for c in f.fail_on_both]),
                ("other differences (not regressions)", [c for f in comparison.files for c in f.other])]
    for title, changes in sections:
        if changes:
            lines += ["", f"{title}:"] + [_change_line(c) for c in changes]
    if comparison.incomplete:
        lines += ["", "files without a result on a side (the comparison is incomplete):"]
        for f in comparison.incomplete:
            for side, result in (("stock", f.stock), ("overlay", f.overlay)):
                if result.get("status") != "ran":
                    reason = result.get("reason") or "not run yet (run again: it resumes)"
                    lines.append(f"  {f.path} [{side}] {result.get('status', 'not run')}: {reason.strip()[:300]}")
            if f.so_far:
                lines.append(f"  {f.path}: {f.so_far} tests finished on both sides so far, compared above")
    if not comparison.stock_passed:
        lines += ["", "no test passed on stock: the comparison proves nothing (is the stock site broken?)"]
    count = len(comparison.regressions)
    lines += ["", f"{count} regression{'' if count == 1 else 's'}"]
    return "\n".join(lines) + "\n"


def comparison_doc(comparison: Comparison) -> dict:
    def changes(items):
        return [{"test": c.test, "stock": c.stock, "overlay": c.overlay, **({"reason": c.reason} if c.reason else {})}
                for c in items]
    return {"vllm_version": comparison.vllm_version, "regressions": len(comparison.regressions),
            "complete": not comparison.incomplete, "verdict": comparison.verdict,
            "files": {f.path: {"stock": {**f.stock, "counts": f.counts["stock"]},
                               "overlay": {**f.overlay, "counts": f.counts["overlay"]},
                               "regressions": changes(f.regressions), "fail_on_both": changes(f.fail_on_both),
                               "other": changes(f.other), "so_far": f.so_far} for f in comparison.files}}
