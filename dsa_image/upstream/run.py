"""Running the bundle against a site, file by file: each selected file in its own pytest
process against one side's vLLM (a Python and, for a `pip install --target` site, its
directory on PYTHONPATH), junit XML per file, a timeout per file, the results in
out/<side>/run.json. A file whose import needs a module the site lacks is not run; the
result says which. A run cut short resumes: a file with a result is not run again.
"""

from __future__ import annotations

import json
import os
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
# Runs pytest with the libs appended to sys.path (after the site's packages, which they never
# shadow); the bundle root (cwd) is sys.path[0], so `tests.` and upstream's config resolve there.
_PYTEST = "import json, sys; sys.path.extend(json.loads(sys.argv.pop(1))); import pytest; sys.exit(pytest.main(sys.argv[1:]))"
_LOG_TAIL = 3000  # characters of a crashed file's output kept in run.json


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


def junit_name(path: str) -> str:
    """A result file name for a test file: tests/v1/x.py -> tests__v1__x.xml."""
    return path.removesuffix(".py").replace("/", "__") + ".xml"


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
class FileResult:
    """One test file's run on one side. status: ran (junit written), not-runnable (a module
    collection imports is missing), timeout, crashed (no junit: killed, internal error)."""

    status: str
    seconds: float
    exit_code: int | None = None
    reason: str = ""

    def doc(self) -> dict:
        return {"status": self.status, "seconds": round(self.seconds, 1), "exit_code": self.exit_code,
                "reason": self.reason}


def run_file(site: Site, bundle: Bundle, path: str, out: Path, timeout: float) -> FileResult:
    """`path` in its own pytest process against `site`, junit to out/junit/, output to out/logs/."""
    junit = out / "junit" / junit_name(path)
    log = out / "logs" / junit_name(path).replace(".xml", ".log")
    for p in (junit, log):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.unlink(missing_ok=True)
    libs = json.dumps([str(p) for p in (*site.libs, bundle.root / LIBS)])
    argv = [site.python, "-B", "-c", _PYTEST, libs, path, "--rootdir", ".", "-p", "no:cacheprovider",
            f"--junitxml={junit}", "-q", "-rfE", "--color=no"]
    started = time.monotonic()
    with open(log, "wb") as output:
        process = subprocess.Popen(argv, cwd=bundle.root, env=site.environment(dict(os.environ)),
                                   stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            _end_session(process)
    seconds = time.monotonic() - started
    if code is None:
        return FileResult("timeout", seconds, None, f"killed after {timeout:.0f} s")
    if junit.is_file():
        return FileResult("ran", seconds, code)
    tail = log.read_bytes()[-_LOG_TAIL:].decode(errors="replace")
    return FileResult("crashed", seconds, code, f"pytest exited {code} without junit XML: ...{tail}")


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
        if not (isinstance(result, dict) and result.get("status") in ("ran", "not-runnable", "timeout", "crashed")):
            raise UpstreamTestsError(f"{path}: files[{rel!r}] has no known status")
    if bundle_sha256 is not None and doc["bundle_sha256"] != bundle_sha256:
        raise UpstreamTestsError(f"{path}: results of another bundle (sha256 {doc['bundle_sha256']}, this one "
                                 f"{bundle_sha256}); use a new --out, or remove {out / side}")
    return doc


def _save_run(out: Path, doc: dict) -> None:
    (out / doc["side"]).mkdir(parents=True, exist_ok=True)
    write_atomic(out / doc["side"] / RUN_FILE, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())


@dataclass(frozen=True)
class Task:
    site: Site
    path: str


def run_tasks(bundle: Bundle, sites: list[Site], out: Path, timeout: float, files: list[str] | None = None,
              jobs: int = 1, deadline_s: float | None = None, report=print) -> dict[str, dict]:
    """Run each selected file (or `files`) on each site, `jobs` at a time, interleaved by file (with
    jobs=2 a file's stock and overlay runs go together). A file with a result in out/ already is
    not run again; after `deadline_s` no file is started (the next call resumes). Returns each
    side's run.json document."""
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
    tasks = [Task(site, path) for path in wanted for site in sites if path not in runs[site.side]["files"]]
    started, lock = time.monotonic(), threading.Lock()

    def one(task: Task) -> None:
        if deadline_s is not None and time.monotonic() - started > deadline_s:
            return
        result = run_file(task.site, bundle, task.path, out / task.site.side, timeout)
        with lock:
            runs[task.site.side]["files"][task.path] = result.doc()
            _save_run(out, runs[task.site.side])
            report(f"{task.site.side:8} {result.status:12} {result.seconds:6.0f} s  {task.path}")

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, tasks))
    return runs
