"""The release check: what the docs claim of the records and of today's tree, checked where the
unit tests must not look. A record is history: the unit tests check that it parses and that its
tables are what the code makes of its raw data, never that it matches today's overlay or that a
sentence reads a certain way, so an overlay edit with `overlay.py record --refresh` leaves them
green. The claims that do tie history to today, or figures to prose, are checked here:

  records    every record is what its README cites (archive and members by sha256)
  receipts   a sentence that calls a receipt "the bake's `RECEIPT_SHA256`", or says
             `docker-bake.json` predicts it, holds for today's docker-bake.json: each receipt it
             names by hash (`a3d21063…`), else one of each vLLM version among the receipts of
             the records it speaks for (its own record; in README.md and the summaries of
             docs/validation/ and docs/benchmarks/, CLAIM_DOCS, the records it links)
  benchmarks the figures the benchmark records state in prose are what their results give, and
             so is each of them a claim doc (README.md, the two summaries) states and each
             row of their ratio tables (a doc may drop a claim; it may not get one wrong)
  rebase     docs/rebase/vllm-0.24.0-to-0.33.0 is what `overlay.py rebase` writes today
  h200       recipes/hosts/h200-pip-freeze.txt (staging's input) holds the Python, torch and
             Triton the H200 runs recorded

CI (.ci/run) runs it with --if-records-changed: only when the commit (or the work tree) touches a
record, the README or what this check reads (TRIGGERS); where git cannot tell (no git, a shallow
clone without the parent, the first commit) it runs. Run it before committing records or claims.

Exit codes: 0 every check passed (or none was due); 1 a check failed, each problem printed with
what to do; 2 bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dsa_image.bench import report, schedule, stats
from dsa_image.records import store as records
from dsa_image.core import status

REPO = Path(__file__).resolve().parents[2]
TRIGGERS = ("docs/validation/", "docs/benchmarks/", "docs/rebase/", "README.md", "recipes/hosts/",
            "dsa_image/records/store.py", "dsa_image/records/release_check.py", "scripts/records.py", "scripts/release_check.py")
REBASE_REPORT = Path("docs/rebase/vllm-0.24.0-to-0.33.0")
H200_RUN = Path("docs/validation/h200-2026-11-30-overlay-f1d4805b")  # the latest 0.24.0 H200 run
BENCH_RUN = Path("docs/benchmarks/h200-2026-12-01-vllm0_33_0")
BASES = Path("docs/benchmarks/h200-2026-12-01-vllm0_24_0-vs-vllm0_33_0")
MTP2 = Path("docs/benchmarks/h200-2026-12-01-vllm0_33_0-mtp2")
HOST_TIME_RUN = Path("docs/validation/h200-2026-11-30-overlay-c2b8469b")
README = Path("README.md")
# The docs that state claims about several records: the README and the summaries its details
# moved to. Each is checked where it exists (a made-up tree may have only the README).
CLAIM_DOCS = (README, Path("docs/validation/README.md"), Path("docs/benchmarks/README.md"))
CLAIM = re.compile(r"the bake's `RECEIPT_SHA256`|`docker-bake\.json` predicts|`RECEIPT_SHA256` of .{0,60}? in `docker-bake\.json`")
HASH = re.compile(r"`([0-9a-f]{8,64})(?:…([0-9a-f]{2,}))?…?`")
LINK = re.compile(r"\]\(([^)\s#]+)")
RECORD_ROOTS = ("docs/validation", "docs/benchmarks")


@dataclass
class Tree:
    """The checked tree, and its records' raw files unpacked once into `scratch`."""
    repo: Path
    scratch: Path

    def raw(self, record: Path) -> Path:
        dest = self.scratch / record
        if not dest.exists():
            records.extract(self.repo / record, dest)
        return dest

    def flat(self, doc: Path) -> str:
        """A document's text with its line breaks and runs of spaces as single spaces."""
        return " ".join((self.repo / doc).read_text().split())

    def results(self, record: Path, name: str = "results.json") -> dict:
        return report.load_results(self.raw(record) / name)


def _failed(claims: list[tuple[bool, str]]) -> list[str]:
    return [message for holds, message in claims if not holds]


# -- records --------------------------------------------------------------------------------------


def check_records(tree: Tree) -> list[str]:
    return [problem for record in records.record_dirs(tree.repo) for problem in records.problems(record)]


# -- receipts ---------------------------------------------------------------------------------------


def receipts(tree: Tree, record: Path) -> dict[str, str]:
    """Every overlay receipt a record's raw data holds, sha256 -> vLLM version."""
    return {r.sha256: r.vllm for r in records.receipts(records.read_archive(tree.repo / record))}


def blocks(text: str) -> list[str]:
    """A Markdown text's paragraphs, list items and table rows, each on one line."""
    found: list[str] = []
    current: list[str] = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("|") or re.match(r"\s*(?:[-*]|\d+\.) ", line):
            found.append(" ".join(current))
            current = []
        current += line.split()
        if line.startswith("|"):
            found.append(" ".join(current))
            current = []
    return [block for block in [*found, " ".join(current)] if block]


def _claim_docs(tree: Tree) -> list[Path]:
    return [doc for doc in CLAIM_DOCS if (tree.repo / doc).is_file()]


def linked_records(tree: Tree, doc: Path, block: str) -> list[Path]:
    """The records (docs/validation/NAME, docs/benchmarks/NAME) a block of `doc` links to, its
    relative links resolved from the doc's own directory."""
    found = set()
    for link in LINK.findall(block):
        if re.match(r"[a-z]+:", link):
            continue
        parts = Path(*(tree.repo / doc).parent.relative_to(tree.repo).parts, link).parts
        resolved: list[str] = []
        for part in parts:
            if part == "..":
                if resolved:
                    resolved.pop()
            elif part != ".":
                resolved.append(part)
        if len(resolved) >= 4 and "/".join(resolved[:2]) in RECORD_ROOTS:
            found.add(Path(*resolved[:3]))
    return sorted(found)


def _bake_receipts(repo: Path) -> dict[str, str]:
    bases = json.loads((repo / "docker-bake.json").read_text())["variable"]["VLLM"]["default"]
    return {version: entry["RECEIPT_SHA256"] for version, entry in bases.items()}


def _claim_problems(block: str, claim: re.Match[str], ran: dict[str, str], bake: dict[str, str],
                    where: str) -> list[str]:
    quoted = f'{where}: "…{block[max(0, claim.start() - 80):claim.end()]}…"'
    advice = ("the overlay changed since that run: re-run it on today's overlay, or say what it ran "
              "(its receipt's sha256) without calling it the bake's")
    if not ran:
        return [f"{quoted} claims the bake's receipt, but names no record whose raw data holds a receipt"]
    named = {sha: version for sha, version in ran.items()
             for start, end in HASH.findall(block) if sha.startswith(start) and sha.endswith(end)}
    if named:
        return [f"{quoted} calls receipt {sha[:12]}… (vLLM {version}) the bake's; docker-bake.json has "
                f"{bake.get(version, 'none')[:12]}… for {version}: {advice}"
                for sha, version in sorted(named.items()) if bake.get(version) != sha]
    return [f"{quoted} claims the bake's receipt for vLLM {version}, but no run it speaks for ran "
            f"{bake.get(version, 'none')[:12]}… (they ran {', '.join(s[:12] + '…' for s, v in ran.items() if v == version)}): {advice}"
            for version in sorted(set(ran.values())) if bake.get(version) not in ran]


def check_receipts(tree: Tree) -> list[str]:
    bake = _bake_receipts(tree.repo)
    docs = [(doc, None) for doc in _claim_docs(tree)] + [(r.relative_to(tree.repo) / records.README, r.relative_to(tree.repo))
                                           for r in records.record_dirs(tree.repo)]
    found = []
    for doc, record in docs:
        for block in blocks((tree.repo / doc).read_text()):
            claim = CLAIM.search(block)
            if claim:
                spoken_for = [record] if record else linked_records(tree, doc, block)
                ran = {sha: v for r in spoken_for for sha, v in receipts(tree, r).items()}
                found += _claim_problems(block, claim, ran, bake, str(doc))
    return found


# -- the benchmarks' figures in prose ---------------------------------------------------------------


def _says(tree: Tree, doc: Path, phrase: str) -> tuple[bool, str]:
    """A record states `phrase`, the figure its results give."""
    return phrase in tree.flat(doc), f"{doc} does not say {phrase!r}, which the recorded results give"


def _readme_says(tree: Tree, pattern: str, phrase: str) -> tuple[bool, str]:
    """Where a claim doc states the claim `pattern` finds, it reads `phrase` (a doc that no
    longer makes the claim is not wrong)."""
    wrong = [(doc, said) for doc in _claim_docs(tree) for said in re.findall(pattern, tree.flat(doc)) if said != phrase]
    doc, said = wrong[0] if wrong else (README, "")
    return not wrong, f"{doc} says {said!r} where the recorded results give {phrase!r}"


def check_benchmarks(tree: Tree) -> list[str]:
    return [*_readme_tables(tree), *_start_up(tree), *_bases(tree), *_mtp2(tree), *_interval_count(tree),
            *_build_saving(tree)]


def _bench_results(tree: Tree, record: Path) -> list[dict]:
    """The benchmark results (`scripts/bench.py run`'s results.json) a record's raw data holds: a
    benchmark's own record, or a validation run whose phase ran the benchmark."""
    found = []
    for name, data in sorted(records.read_archive(record).items()):
        if name.rsplit("/", 1)[-1] == "results.json" and _schema(data) == report.SCHEMA:
            found.append(tree.results(record.relative_to(tree.repo), name))
    return found


def _schema(data: bytes) -> object:
    doc = json.loads(data)
    return doc.get("schema") if isinstance(doc, dict) else None


def _readme_tables(tree: Tree) -> list[str]:
    """Every row of a ratio table in a claim doc is a row `scripts/bench.py table` prints for a
    benchmark record or a validation record holding a benchmark's results."""
    rows = set()
    for record in records.record_dirs(tree.repo):
        rows |= set(report.table(_bench_results(tree, record)).splitlines())
    ratio_row = re.compile(r"^\| [\w.-]+ \| \d+ \| \d+\.\d{3} \[")
    return [f"{doc}: the row {line!r} is no benchmark record's (`scripts/bench.py table RESULTS`)"
            for doc in _claim_docs(tree)
            for line in (tree.repo / doc).read_text().splitlines() if ratio_row.match(line) and line not in rows]


def _start_up(tree: Tree) -> list[str]:
    healthy = {**tree.results(BENCH_RUN, "base/results.json")["healthy_after_s"],
               **tree.results(BENCH_RUN, "mtp-long/results.json")["healthy_after_s"]}
    first = (f"base {healthy['bench-base-A']:.0f} s (A) / {healthy['bench-base-B']:.0f} s (B); "
             + "; ".join(f"{g} {healthy[f'bench-{g}-A']:.0f} / {healthy[f'bench-{g}-B']:.0f} s" for g in ("long", "mtp1", "mtp3")))
    bases, mtp2 = tree.results(BASES)["healthy_after_s"], tree.results(MTP2)["healthy_after_s"]
    return _failed([
        _says(tree, BENCH_RUN / "README.md", first),
        _says(tree, BASES / "README.md", f"{bases['bench-base-A']:.0f} s (A, 0.24.0) / {bases['bench-base-B']:.0f} s (B, 0.33.0)"),
        _says(tree, MTP2 / "README.md", f"{mtp2['bench-mtp2-A']:.0f} s (A) / {mtp2['bench-mtp2-B']:.0f} s (B)"),
    ])


def _bases(tree: Tree) -> list[str]:
    doc = tree.results(BASES)
    medians = [w["summary"]["output_tok_s"]["median_ratio"] for w in doc["workloads"]]
    fewer = f"{round(100 * (1 - max(medians)))}–{round(100 * (1 - min(medians)))}% fewer output tokens/s"
    equal, compared = (sum(w["texts"][key] for w in doc["workloads"]) for key in ("equal", "compared"))
    return _failed([_says(tree, BASES / "README.md", fewer), _readme_says(tree, r"\d+–\d+% fewer output tokens/s", fewer),
                    _says(tree, BASES / "README.md", f"{equal} of the {compared:,} prompts")])


def _mtp2(tree: Tree) -> list[str]:
    workloads = tree.results(MTP2)["workloads"]
    drafts = [_says(tree, MTP2 / "README.md", f"{w['spec_decode']['A'][key]:,.0f}")
              for w in workloads for key in ("drafts", "draft_tokens")]
    (c8,) = [w for w in workloads if w["name"] == "mtp2-512x128-c8"]
    low = [r["ratios"]["output_tok_s"] for r in c8["rounds"] if r["ratios"]["output_tok_s"] < 0.9]
    lean = f"{len(low)} of its {len(c8['rounds'])} rounds gave the overlay {min(low):.2f}–{max(low):.2f}"
    return _failed([*drafts, _says(tree, MTP2 / "README.md", lean)])


def _interval_count(tree: Tree) -> list[str]:
    docs = [tree.results(BENCH_RUN, "base/results.json"), tree.results(BENCH_RUN, "mtp-long/results.json"), tree.results(MTP2)]
    workloads = [w for doc in docs for w in doc["workloads"]]
    verdicts = [s["verdict"] for w in workloads for s in w["summary"].values()]
    ahead = [f"`{w['name']}` {stats.METRICS[m][0]}" for w in workloads for m, s in w["summary"].items()
             if s["verdict"] == "B ahead"]
    said = (f"Of the {len(verdicts)} intervals ({len(workloads)} workloads, {len(stats.METRICS)} metrics), "
            f"{verdicts.count('within interval')} contain 1 and one lies below it, in the overlay's favour ({', '.join(ahead)})")
    return _failed([(len(ahead) == 1 == len(verdicts) - verdicts.count("within interval"),
                     f"the docs count one interval in the overlay's favour and none against; the results have "
                     f"{', '.join(ahead) or 'none'} in favour, {len(verdicts) - verdicts.count('within interval') - len(ahead)} against"),
                    _readme_says(tree, r"Of the \d+ intervals \(.*?\), \d+ contain 1 and [^(]*\([^)]*\)", said)])


def _build_saving(tree: Tree) -> list[str]:
    """The 0.24.0 overlay's build() saving (its H200 host-time record) set against the TPOT gap of
    the bases' run, as the claim docs and the bases' record cite them."""
    host = json.loads((tree.raw(HOST_TIME_RUN) / "host-time.json").read_text())
    (bs1,) = [s for s in host["scenarios"] if s["scenario"] == "decode_bs1"]
    (c1,) = [w for w in tree.results(BASES)["workloads"] if w["name"] == "512x128-c1"]
    tpot = [statistics.median(r["sides"][side]["stats"]["tpot_s"] for r in c1["rounds"]) for side in schedule.SIDES]
    saved = round(bs1["host_us_stock"] - bs1["host_us_overlay"])
    cited = {r"saves about \d+ µs a decode step": f"saves about {saved} µs a decode step",
             r"\([\d.]+ → [\d.]+ µs": f"({bs1['host_us_stock']} → {bs1['host_us_overlay']} µs",
             r"TPOT \d+ µs longer on 0\.33\.0 at concurrency 1 \([\d.]+ → [\d.]+ ms\)":
                 f"TPOT {1e6 * (tpot[1] - tpot[0]):.0f} µs longer on 0.33.0 at concurrency 1 "
                 f"({1e3 * tpot[0]:.2f} → {1e3 * tpot[1]:.2f} ms)"}
    return _failed([check for pattern, phrase in cited.items()
                    for check in (_says(tree, BASES / "README.md", phrase), _readme_says(tree, pattern, phrase))])


# -- the rebase report and the H200's inventory -------------------------------------------------------


def check_rebase(tree: Tree) -> list[str]:
    from dsa_image.rebase import cli as rebase

    committed = json.loads((tree.repo / REBASE_REPORT / "report.json").read_text())
    out = tree.scratch / "rebase"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = rebase.main(["--vllm", "0.24.0", "--to", "0.33.0", "--out", str(out)])
    fresh = json.loads((out / "report.json").read_text())
    fresh["command"] = committed["command"]  # this run was not told to write into docs/
    return _failed([(code == committed["exit_code"] and fresh == committed,
                     f"{REBASE_REPORT} is not what the tool writes from today's overlays: run `{committed['command']}`")])


def check_h200(tree: Tree) -> list[str]:
    from dsa_image.validation import stage

    freeze = stage.read_record(stage.H200_RECORD)
    python, _, torch, _, triton = (tree.raw(H200_RUN) / "environment.txt").read_text().splitlines()[2].split()
    where = f"{stage.H200_RECORD.relative_to(tree.repo)} against {H200_RUN}/environment.txt"
    return _failed([
        (python.startswith(stage.PYTHON + "."), f"{where}: the run's Python {python}, staging's {stage.PYTHON}"),
        (stage.has(freeze, "torch", torch.split("+")[0]), f"{where}: the run's torch {torch} is not in the freeze"),
        (freeze.get("triton") == triton, f"{where}: the run's Triton {triton}, the freeze's {freeze.get('triton')}"),
        ("vllm" not in freeze and "b12x" not in freeze, f"{where}: the freeze holds vllm or b12x, which every run brings"),
    ])


CHECKS = {"records": check_records, "receipts": check_receipts, "benchmarks": check_benchmarks,
          "rebase": check_rebase, "h200": check_h200}


# -- when CI runs it --------------------------------------------------------------------------------


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)


def changed_paths(repo: Path) -> tuple[list[str] | None, str]:
    """The paths the last commit (against its first parent) and the work tree change; None
    where git cannot tell, with why."""
    if _git(repo, "rev-parse", "--is-inside-work-tree").returncode != 0:
        return None, "not a git checkout"
    if _git(repo, "rev-parse", "--verify", "--quiet", "HEAD^1").returncode != 0:
        shallow = _git(repo, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"
        return None, "a shallow clone without HEAD's parent" if shallow else "HEAD is the first commit"
    paths = set()
    for args in (("diff", "--name-only", "HEAD^1", "HEAD"), ("diff", "--name-only", "HEAD"),
                 ("ls-files", "--others", "--exclude-standard")):
        done = _git(repo, *args)
        if done.returncode != 0:
            return None, f"git {' '.join(args)} failed: {done.stderr.strip()}"
        paths |= set(done.stdout.split())
    return sorted(paths), "HEAD^1..HEAD and the work tree"


def due(repo: Path) -> tuple[bool, str]:
    paths, source = changed_paths(repo)
    if paths is None:
        return True, f"{source}: cannot tell what changed, so the check runs"
    touched = [p for p in paths if p.startswith(TRIGGERS)]
    if touched:
        return True, f"{source} touch {', '.join(touched[:5])}{' ...' if len(touched) > 5 else ''}"
    return False, f"{source} touch no record, README or input of this check ({len(paths)} paths changed)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/release_check.py", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--if-records-changed", action="store_true",
                        help="run only when the last commit or the work tree touches what this checks (CI)")
    parser.add_argument("--check", action="append", choices=sorted(CHECKS), help="only these checks (repeatable)")
    args = parser.parse_args(argv)
    if args.if_records_changed:
        run, why = due(REPO)
        print(f"release check: {'running' if run else 'not due'}: {why}")
        if not run:
            return 0
    failed = 0
    with tempfile.TemporaryDirectory(prefix="release-check-") as scratch:
        tree = Tree(REPO, Path(scratch))
        for name in args.check or CHECKS:
            found = CHECKS[name](tree)
            print(f"release check: {name}: {'FAIL' if found else 'PASS'}" + "".join(f"\n  - {p}" for p in found))
            failed += bool(found)
    return status.FAILED if failed else status.SUCCESS


if __name__ == "__main__":
    sys.exit(main())
