"""Running the bundle against a site, file by file: each selected file in its own pytest
process against one side's vLLM (a Python and, for a `pip install --target` site, its
directory on PYTHONPATH), junit XML per file, a timeout per file, the results in
out/<side>/run.json. A file whose import needs a module the site lacks is not run; the
result says which. A run cut short resumes: a file with a result is not run again.

A file that outlives its timeout is not lost: `recorder` wrote each test's outcome as it
finished, so the file is `partial` and its next run (a part) deselects what finished. The test
a kill or a crash caught is rerun in the next part, unless it had the whole part to itself (it
is then that test's `timeout`) or the process crashed under it (`crashed`): every part
finishes a test or ends the file, so a file of any length ends in parts, across calls.

A file of many slow tests can also run in shards: `shards` pytest processes at once on the one
side, each taking the tests whose node id hashes to it (`recorder.in_shard`), each with its own
record, junit and log, the whole file's timeout shared. A shard that ran to its end is not run
again; the others resume in the next part. The file has a result when every shard has one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dsa_image.core.atomic import write_atomic
from dsa_image.core.site_path import pythonpath
from dsa_image.overlay.core import RECEIPT_NAME
from dsa_image.upstream import recorder
from dsa_image.upstream.bundle import LIBS, Bundle
from dsa_image.upstream.selection import UpstreamTestsError

SIDES = ("stock", "overlay")
RUN_FILE = "run.json"
RUN_SCHEMA = 1
# Asked in a fresh interpreter of the site: what vLLM it imports, whether the overlay's receipt
# lies beside it, and which of the modules collection needs it cannot find (with the libs).
_PROBE = """
import importlib.metadata, importlib.util, json, os, sys
sys.path.extend(json.loads(sys.argv[1]))
import vllm
site = os.path.dirname(os.path.dirname(os.path.abspath(vllm.__file__)))
print(json.dumps({"python": sys.version.split()[0], "vllm_version": importlib.metadata.version("vllm"),
                  "vllm_site": site, "receipt": os.path.exists(os.path.join(site, sys.argv[2])),
                  "missing": [m for m in json.loads(sys.argv[3]) if importlib.util.find_spec(m) is None]}))
"""
_LOG_TAIL = 3000  # characters of a crashed file's output kept in run.json
# Outcomes only the runner writes into a record: the test a kill or a crash caught.
TIMEOUT, CRASHED = "timeout", "crashed"
STATUSES = ("ran", "partial", "not-runnable", "timeout", "crashed")
_RECORD_LIMIT = 64 << 20  # bytes: far above any file's record (2,400 tests: ~0.5 MB)


@dataclass(frozen=True)
class Site:
    """Where one side's vLLM is: `python` runs it; `site` is a `pip install --target`
    directory put first on PYTHONPATH (None: the python's own site-packages); `libs` are
    appended to sys.path (the image's test runner, pytest)."""

    side: str
    python: str
    site: Path | None = None
    libs: tuple[Path, ...] = ()

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        if self.site is not None:
            env["PYTHONPATH"] = pythonpath(str(self.site))
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # the bundle may be read-only, and stays as written
        # Offline unless the caller says otherwise: a test that would download a model fails
        # at once, alike on both sides, instead of waiting on an unreachable hub.
        env.setdefault("HF_HUB_OFFLINE", "1")
        return env


def junit_name(path: str, shard: Shard | None = None) -> str:
    """A result file name for a test file: tests/v1/x.py -> tests__v1__x.xml; its shard 2 of 4,
    tests__v1__x.shard2of4.xml."""
    stem = path.removesuffix(".py").replace("/", "__")
    return f"{stem}.shard{shard.index + 1}of{shard.count}.xml" if shard else f"{stem}.xml"


def probe_site(site: Site, bundle: Bundle, needs: list[str], timeout: float = 300) -> dict:
    """What `site` imports, checked against the bundle's base and the side it is named for."""
    libs = [str(p) for p in (*site.libs, bundle.root / LIBS)]
    with tempfile.TemporaryDirectory() as empty:  # nothing in the cwd shadows the site
        done = subprocess.run([site.python, "-B", "-c", _PROBE, json.dumps(libs), RECEIPT_NAME, json.dumps(needs)],
                              cwd=empty, env=site.environment(dict(os.environ)),
                              capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise UpstreamTestsError(f"{site.side}: {site.python} cannot import vllm"
                                 f"{f' with {site.site} first on PYTHONPATH' if site.site else ''}: "
                                 f"{done.stderr.strip()[-1500:]}")
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    if facts["vllm_version"] != bundle.vllm_version:
        raise UpstreamTestsError(f"{site.side}: the site's vLLM is {facts['vllm_version']} ({facts['vllm_site']}), "
                                 f"the bundle holds vLLM {bundle.vllm_version}'s tests; run a bundle of that base")
    overlaid = facts["receipt"]
    if overlaid != (site.side == "overlay"):
        found = "carries the overlay (its receipt is there)" if overlaid else "has no overlay receipt"
        raise UpstreamTestsError(f"{site.side}: {facts['vllm_site']} {found}; the {site.side} side needs "
                                 f"{'a site with the overlay applied' if site.side == 'overlay' else 'stock vLLM'}")
    return facts


@dataclass(frozen=True)
class Shard:
    """Shard `index` (from 0) of a file run in `count` at once."""

    index: int
    count: int

    @property
    def spec(self) -> str:
        return f"{self.index}/{self.count}"


def shards_of(count: int) -> list[Shard | None]:
    """A file's shards: [None] for a file run in one process."""
    return [Shard(i, count) for i in range(count)] if count > 1 else [None]


@dataclass(frozen=True)
class FileResult:
    """One test file's run on one side. status: ran (junit written; with `parts`, in that many
    runs, the outcomes in its record), partial (a part was killed or crashed after finishing
    tests: the next run resumes it), not-runnable (a module collection imports is missing),
    timeout (killed before any test began), crashed (no junit and no test to blame). A file run
    in shards has each shard's status in `shards`, and its outcomes in the shards' records."""

    status: str
    seconds: float
    exit_code: int | None = None
    reason: str = ""
    parts: int = 0  # 0: run whole, in one process; else the parts it took so far
    shards: tuple[str, ...] = ()  # each shard's status; () for a file run in one process

    def doc(self) -> dict:
        doc = {"status": self.status, "seconds": round(self.seconds, 1), "exit_code": self.exit_code,
               "reason": self.reason}
        doc = {**doc, "parts": self.parts} if self.parts else doc
        return {**doc, "shards": list(self.shards)} if self.shards else doc


def record_path(out: Path, path: str, shard: Shard | None = None) -> Path:
    """out/<side>/records/<name>.jsonl: what each of the file's (or shard's) tests did, over all its parts."""
    return out / "records" / junit_name(path, shard).replace(".xml", ".jsonl")


def file_record_results(out: Path, path: str, shards: int) -> tuple[dict[str, str], dict[str, str]]:
    """({node id: outcome}, {node id: reason}) over a file's records: its own, or each of its shards'."""
    outcomes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    for shard in shards_of(shards):
        progress = read_record(record_path(out, path, shard), path)
        if set(progress.outcomes) & set(outcomes):
            raise UpstreamTestsError(f"{record_path(out, path, shard)}: tests another shard of {path} ran too "
                                     f"({sorted(set(progress.outcomes) & set(outcomes))[0]}); remove its records and its "
                                     "entry in run.json to run it again")
        outcomes.update(progress.outcomes)
        reasons.update(progress.reasons)
    return outcomes, reasons


@dataclass(frozen=True)
class Progress:
    """A file's record, read back: the parts begun, the first part's collection (the whole
    file), each finished test's outcome, and the last part's test that began and did not end."""

    parts: int
    collected: tuple[str, ...]
    outcomes: dict[str, str]
    running: str | None
    finished_in_last_part: int
    reasons: dict[str, str]  # a failed or errored test's: what it raised (recorder.failure_reason)


def read_record(path: Path, test_file: str) -> Progress:
    """A record (untrusted: every line checked, and every node id must be one of `test_file`'s)."""
    if not path.exists():
        return Progress(0, (), {}, None, 0, {})
    if path.stat().st_size > _RECORD_LIMIT:
        raise UpstreamTestsError(f"{path}: {path.stat().st_size} bytes, over the {_RECORD_LIMIT} a record may be")
    parts, collected, outcomes, running, finished, reasons = 0, None, {}, None, 0, {}
    for number, line in enumerate(path.read_bytes().decode(errors="replace").splitlines(), 1):
        try:
            doc = json.loads(line)
        except ValueError:
            doc = None
        kind = _record_line(doc, test_file)
        if kind is None:
            raise UpstreamTestsError(f"{path}:{number}: not a record line of {test_file}: {line[:200]!r}; expected "
                                     '{"part": N}, {"collected": [...]}, {"start": ID} or {"done": ID, "outcome": O[, "reason": R]} '
                                     f"(remove {path} and the file's entry in run.json to run it again whole)")
        if kind == "part":
            parts, running, finished = parts + 1, None, 0
        elif kind == "collected":
            collected = tuple(doc["collected"]) if collected is None else collected
        elif kind == "start":
            running = doc["start"]
        else:
            outcomes[doc["done"]] = doc["outcome"]
            if doc.get("reason"):
                reasons[doc["done"]] = doc["reason"]
            finished += doc["outcome"] in recorder.OUTCOMES
            running = None if running == doc["done"] else running
    return Progress(parts, collected or (), outcomes, running, finished, reasons)


def _record_line(doc, test_file: str) -> str | None:
    """The kind of one record line, or None if it is not one."""
    def ours(node: object) -> bool:
        return isinstance(node, str) and (node == test_file or node.startswith(f"{test_file}::"))
    if not isinstance(doc, dict):
        return None
    keys = set(doc)
    if keys == {"part"} and isinstance(doc["part"], int) and not isinstance(doc["part"], bool):
        return "part"
    if keys == {"collected"} and isinstance(doc["collected"], list) and all(map(ours, doc["collected"])):
        return "collected"
    if keys == {"start"} and ours(doc["start"]):
        return "start"
    if keys in ({"done", "outcome"}, {"done", "outcome", "reason"}) and ours(doc["done"]) and \
            doc["outcome"] in (*recorder.OUTCOMES, TIMEOUT, CRASHED) and _reason_ok(doc.get("reason", "")):
        return "done"
    return None


def _reason_ok(reason: object) -> bool:
    return isinstance(reason, str) and reason == recorder.one_line(reason)  # as the recorder writes it


def _append(path: Path, doc: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(doc) + "\n")


@dataclass
class _Launched:
    shard: Shard | None
    junit: Path
    log: Path
    record: Path
    done: Path
    process: subprocess.Popen


def _launch(site: Site, bundle: Bundle, path: str, out: Path, resume: bool, shard: Shard | None) -> _Launched:
    """Start one part of `path` (or of its shard): its junit and log afresh, its record afresh
    unless it resumes, the tests its record has finished deselected."""
    junit, record = out / "junit" / junit_name(path, shard), record_path(out, path, shard)
    log = out / "logs" / junit_name(path, shard).replace(".xml", ".log")
    for p in (junit, log, record):
        p.parent.mkdir(parents=True, exist_ok=True)
    for p in (junit, log) if resume else (junit, log, record):
        p.unlink(missing_ok=True)
    before = read_record(record, path)
    _append(record, {"part": before.parts + 1})
    done = record.with_suffix(".done.json")
    write_atomic(done, json.dumps(sorted(before.outcomes)).encode())
    libs = json.dumps([str(p) for p in (*site.libs, bundle.root / LIBS)])
    argv = [site.python, "-B", "-c", recorder.program(), libs, str(record.resolve()), str(done.resolve()),
            shard.spec if shard else "0/1", path, "--rootdir", ".", "-p", "no:cacheprovider", f"--junitxml={junit}",
            "-q", "-rfE", "--color=no"]
    with open(log, "wb") as output:
        process = subprocess.Popen(argv, cwd=bundle.root, env=site.environment(dict(os.environ)),
                                   stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
    return _Launched(shard, junit, log, record, done, process)


def _wait(launched: _Launched, until: float) -> int | None:
    """The part's exit code, or None when it was still running at `until` (then killed)."""
    try:
        return launched.process.wait(timeout=max(0.0, until - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None
    finally:
        _end_session(launched.process)
        launched.done.unlink(missing_ok=True)


def run_file(site: Site, bundle: Bundle, path: str, out: Path, timeout: float,
             prior: dict | None = None, shards: int = 1) -> FileResult:
    """One run (part) of `path` against `site`, in its own pytest process or in `shards` at once:
    junit to out/junit/, output to out/logs/, each test's outcome to its record. `prior`: the
    file's partial result, which this part resumes (its shards that ran are not run again);
    without it the file starts afresh."""
    states = list((prior or {}).get("shards") or ["partial"] * shards) if shards > 1 else ["partial"]
    todo = [shard for shard, state in zip(shards_of(shards), states, strict=True) if state == "partial"]
    started = time.monotonic()
    launched = [_launch(site, bundle, path, out, prior is not None, shard) for shard in todo]
    codes = [_wait(one, started + timeout) for one in launched]
    seconds = time.monotonic() - started + (prior or {}).get("seconds", 0.0)
    results = [_part_result(read_record(one.record, path), one.record, one.log, one.junit, code, seconds, timeout)
               for one, code in zip(launched, codes, strict=True)]
    if shards == 1:
        return results[0]
    return _sharded_result(prior or {}, states, launched, results, seconds)


def _sharded_result(prior: dict, states: list[str], launched: list[_Launched], results: list[FileResult],
                    seconds: float) -> FileResult:
    """A sharded file after a part: each shard's status (those not run keep theirs), and the
    file's: crashed or timeout if a shard is, partial while one is, else ran."""
    reasons = []
    for one, result in zip(launched, results, strict=True):
        assert one.shard is not None  # a sharded file's parts are its shards'
        states[one.shard.index] = result.status
        reasons += [f"shard {one.shard.spec}: {result.reason}"] if result.reason else []
    status = next((s for s in ("crashed", "timeout", "partial") if s in states), "ran")
    known = [c for c in (*(r.exit_code for r in results), prior.get("exit_code")) if c is not None]
    parts = max([r.parts or 1 for r in results] + [prior.get("parts", 1)])
    return FileResult(status, seconds, max(known) if known else None, "; ".join(reasons), parts if parts > 1 else 0,
                      tuple(states))


def _part_result(progress: Progress, record: Path, log: Path, junit: Path, code: int | None, seconds: float,
                 timeout: float) -> FileResult:
    """What a part's end makes of the file: ran, partial (resume), timeout or crashed."""
    part = progress.parts
    if code is not None and junit.is_file():
        return FileResult("ran", seconds, code, parts=part if part > 1 else 0)
    if progress.running:
        caught = CRASHED if code is not None else TIMEOUT if not progress.finished_in_last_part else None
        if caught:  # a crash under it, or a kill when it had the whole part: that test's outcome
            _append(record, {"done": progress.running, "outcome": caught})
        what = f"pytest exited {code}" if code is not None else f"killed after {timeout:.0f} s"
        return FileResult("partial", seconds, code, f"part {part}: {what} in {progress.running} "
                          f"({caught or 'rerun next part'}); {len(progress.outcomes) + bool(caught)} of "
                          f"{len(progress.collected)} tests done", part)
    if progress.finished_in_last_part:
        return FileResult("partial", seconds, code, f"part {part}: ended between tests; "
                          f"{len(progress.outcomes)} of {len(progress.collected)} tests done", part)
    if code is None:
        return FileResult("timeout", seconds, None, f"killed after {timeout:.0f} s, before a test began", part)
    tail = log.read_bytes()[-_LOG_TAIL:].decode(errors="replace")
    return FileResult("crashed", seconds, code, f"pytest exited {code} without junit XML: ...{tail}", part)


def _end_session(process: subprocess.Popen) -> None:
    """Kill what is left of the session pytest led (it, on a timeout; the workers a test started
    and left behind, which could hold the GPU for the next file)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def load_run(out: Path, side: str, bundle_sha256: str | None = None) -> dict:
    """out/<side>/run.json (untrusted: checked); a fresh one when absent and `bundle_sha256` given."""
    path = out / side / RUN_FILE
    if not path.exists():
        if bundle_sha256 is None:
            raise UpstreamTestsError(f"{path}: missing; run `python3 scripts/upstream_tests.py run --side {side} "
                                     f"--out {out} ...` first")
        return {"schema": RUN_SCHEMA, "side": side, "bundle_sha256": bundle_sha256, "site": None, "files": {}}
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise UpstreamTestsError(f"{path}: not a run's results ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("schema") != RUN_SCHEMA or doc.get("side") != side \
            or not isinstance(doc.get("files"), dict) or not isinstance(doc.get("bundle_sha256"), str):
        raise UpstreamTestsError(f"{path}: not a schema {RUN_SCHEMA} run of the {side} side")
    for rel, result in doc["files"].items():
        if not (isinstance(result, dict) and result.get("status") in STATUSES):
            raise UpstreamTestsError(f"{path}: files[{rel!r}] has no known status")
        parts = result.get("parts", 1)
        if not (isinstance(parts, int) and not isinstance(parts, bool) and parts > 0):
            raise UpstreamTestsError(f"{path}: files[{rel!r}] has parts {parts!r}; expected a count of runs")
        shards = result.get("shards")
        if "shards" in result and not (isinstance(shards, list) and len(shards) > 1 and all(s in STATUSES for s in shards)):
            raise UpstreamTestsError(f"{path}: files[{rel!r}] has shards {shards!r}; expected each shard's status")
    if bundle_sha256 is not None and doc["bundle_sha256"] != bundle_sha256:
        raise UpstreamTestsError(f"{path}: results of another bundle (sha256 {doc['bundle_sha256']}, this one "
                                 f"{bundle_sha256}); use a new --out, or remove {out / side}")
    return doc


def _save_run(out: Path, doc: dict) -> None:
    (out / doc["side"]).mkdir(parents=True, exist_ok=True)
    write_atomic(out / doc["side"] / RUN_FILE, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())


def _result_files(out: Path, path: str) -> list[Path]:
    """What a run of `path` left in out/<side>/{junit,logs,records}: its own and its shards'."""
    stem = re.escape(junit_name(path).removesuffix(".xml"))
    name = re.compile(stem + r"(\.shard\d+of\d+)?\.(xml|log|jsonl|done\.json)")
    folders = [out / d for d in ("junit", "logs", "records")]
    linked = [f for f in (out, *folders) if f.is_symlink()]
    if linked:  # what it lists it removes: never in a folder elsewhere
        raise UpstreamTestsError(f"{linked[0]}: a symlink (to {os.readlink(linked[0])}); expected a folder of results")
    return [f for d in folders if d.is_dir() for f in sorted(d.iterdir())
            if name.fullmatch(f.name) and (f.is_symlink() or f.is_file())]


def forget_files(out: Path, files: list[str]) -> list[Path]:
    """Drop the results of `files` on both sides (run.json entries, junit, logs, records), so that
    the next run runs them afresh. Each must have a result on a side; nothing changes otherwise.
    Returns what it removed."""
    runs = {side: load_run(out, side) for side in SIDES}
    unknown = sorted(p for p in files if not any(p in r["files"] for r in runs.values()))
    if unknown:
        raise UpstreamTestsError(f"{out}: no result on either side for {', '.join(unknown)}; the files with one: "
                                 f"{', '.join(sorted(set().union(*(r['files'] for r in runs.values()))))}")
    removed = [f for side in SIDES for p in files for f in _result_files(out / side, p)]
    for doc in runs.values():
        doc["files"] = {p: r for p, r in doc["files"].items() if p not in files}
        _save_run(out, doc)
    for f in removed:
        f.unlink()
    return removed


@dataclass(frozen=True)
class Task:
    site: Site
    path: str


def run_tasks(bundle: Bundle, sites: list[Site], out: Path, timeout: float, files: list[str] | None = None,
              jobs: int = 1, deadline_s: float | None = None, report=print, shards: int = 1) -> dict[str, dict]:
    """Run each selected file (or `files`) on each site, `jobs` at a time, interleaved by file (with
    jobs=2 a file's stock and overlay runs go together), each in `shards` processes at once. A
    file with a result in out/ already is not run again, a partial one resumes (in the shards it
    began with); after `deadline_s` no file or part is started (the next call resumes). Returns
    each side's run.json document."""
    if shards < 1:
        raise UpstreamTestsError(f"--shards {shards}: expected 1 (a file in one process) or more")
    selected = {s["path"]: s for s in bundle.selected}
    unknown = sorted(set(files or ()) - set(selected))
    if unknown:
        raise UpstreamTestsError(f"not selected in {bundle.root}: {', '.join(unknown)} (the selection: "
                                 "`python3 scripts/upstream_tests.py select`)")
    wanted = [p for p in selected if not files or p in files]
    needs = sorted({n for p in wanted for n in selected[p]["needs"]})
    runs = {}
    for site in sites:
        facts = probe_site(site, bundle, needs)
        runs[site.side] = load_run(out, site.side, bundle.sha256)
        seen = {"python": site.python, "site": str(site.site) if site.site else None,
                "libs": [str(p) for p in site.libs], **{k: v for k, v in facts.items() if k != "missing"}}
        if runs[site.side]["site"] not in (None, seen):
            raise UpstreamTestsError(f"{out / site.side}: results of another site ({runs[site.side]['site']}, this "
                                     f"one {seen}); use a new --out, or remove {out / site.side}")
        runs[site.side]["site"] = seen
        for path in wanted:
            missing = sorted(set(selected[path]["needs"]) & set(facts["missing"]))
            if missing and path not in runs[site.side]["files"]:
                runs[site.side]["files"][path] = FileResult(
                    "not-runnable", 0.0, None, f"its collection imports {', '.join(missing)}, which "
                    f"{site.python} cannot import here").doc()
        _save_run(out, runs[site.side])
    tasks = [Task(site, path) for path in wanted for site in sites
             if runs[site.side]["files"].get(path, {"status": "partial"})["status"] == "partial"]
    for task in tasks:
        prior = runs[task.site.side]["files"].get(task.path)
        begun = (len(prior.get("shards", ())) or 1) if prior else shards
        if begun != shards:
            raise UpstreamTestsError(f"{task.path} [{task.site.side}]: begun in {begun} shard(s), this run asks for "
                                     f"{shards}; resume it with --shards {begun}, or remove its entry in "
                                     f"{out / task.site.side / RUN_FILE} to run it afresh")
    started, lock = time.monotonic(), threading.Lock()

    def one(task: Task) -> None:
        prior = runs[task.site.side]["files"].get(task.path)
        while deadline_s is None or time.monotonic() - started <= deadline_s:  # a part at a time
            result = run_file(task.site, bundle, task.path, out / task.site.side, timeout, prior, shards)
            with lock:
                runs[task.site.side]["files"][task.path] = prior = result.doc()
                _save_run(out, runs[task.site.side])
                parts = f" (part {result.parts})" if result.parts else ""
                report(f"{task.site.side:8} {result.status:12} {result.seconds:6.0f} s  {task.path}{parts}")
            if result.status != "partial":
                return

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, tasks))
    return runs
