"""Where a vLLM server's start-up goes, phase by phase, read from its own log.

One server log (vLLM's lines carry their time to the second, FlashInfer's and torch's to the
millisecond) and the warm-up's record (the warm-start harness's JSON, or the image's warm-up
supervisor's "dsa-image warmup: STEP: ... in X s" lines in the same log) become one row per
phase: process start -> imports, config and model inspection, engine init, weight load, the
profile run, the KV cache, vLLM's kernel warm-ups, FlashInfer's autotune, the warm-up forward
steps, CUDA graph capture, the API server, healthy, the image's warm-up steps, ready. Each row
counts the JIT work its lines show: DeepGEMM's compiler runs (printed with
DG_JIT_PRINT_COMPILER_COMMAND=1), FlashInfer modules built, and the kernels vLLM's JIT monitor
reports (Triton, CuTeDSL, ...; only once the engine is ready).

A phase starts at its marker, the first log line of vLLM 0.33.0 that names it (the message texts
below, read from that wheel's source), and lasts until the next marker found; a marker that a
start does not log (no JIT warm-up, memory profiling instead of a given KV size) leaves its
phase out, its time in the phase before. Seconds are as exact as the lines: vLLM's to 1 s.

Process start is the harness's "dsa-image: server process started at ..." line where the log
has one (dsa_image.harness.server writes it), else healthy minus the record's
`healthy_after_s`, "healthy" being the "Starting vLLM server on" line (the health poll answers
within about a second of it): such a start is marked derived.

    python -m dsa_image.validation.startup_phases \\
        --start "cold" SERVER.log WARMSTART.json:STEP:SIDE \\
        --start "restart" SERVER2.log WARMSTART2.json:STEP:SIDE [--json OUT.json]

Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

from dsa_image.harness.server import JIT_LINE, STARTED, jit_kernel_name
from dsa_image.validation.warmstart import DEEPGEMM_NVCC, FLASHINFER_BUILD
from dsa_image.core import status

# "(APIServer pid=4385) INFO 12-01 04:03:45 [startup.py:38] ..." (vLLM's format, datefmt %m-%d
# %H:%M:%S); found anywhere in a line, since a tqdm bar can precede it without a newline.
VLLM_LINE = re.compile(r"\((?P<proc>[\w-]+) pid=(?P<pid>\d+)\) (?P<level>[A-Z]+) "
                       r"(?P<month>\d\d)-(?P<day>\d\d) (?P<clock>\d\d:\d\d:\d\d) \[[^\]]+\] (?P<msg>.*)")
# "2026-12-01 04:04:24,311 - INFO - core.py:594 - flashinfer.jit: ..." (FlashInfer's JIT logger).
FLASHINFER_LINE = re.compile(r"(?P<date>\d{4}-\d\d-\d\d) (?P<clock>\d\d:\d\d:\d\d),(?P<ms>\d{3}) - "
                             r"[A-Z]+ - \S+ - flashinfer\.jit: (?P<msg>.*)")
# "W1201 04:03:29.866000 4385 torch/_opaque_base.py:6] ..." (torch's glog-style warnings).
GLOG_LINE = re.compile(r"^[WIEF](?P<month>\d\d)(?P<day>\d\d) (?P<clock>\d\d:\d\d:\d\d)\.(?P<us>\d+) +"
                       r"(?P<pid>\d+) \S+\] (?P<msg>.*)")
STARTED_LINE = re.compile(re.escape(STARTED) + r"(?P<stamp>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)")
WARMUP_STEP = re.compile(r"dsa-image warmup: (?P<step>[\w+.-]+): \d+ request\(s\) in (?P<s>[\d.]+) s")
HEALTHY_LINE = "Starting vLLM server on"
CAPTURE_DONE = re.compile(r"Graph capturing finished in (?P<s>\d+) secs")


@dataclass(frozen=True)
class Line:
    at: datetime | None  # None: the line carries no time (DeepGEMM's commands, tqdm, uvicorn)
    pid: int | None
    text: str


# Each phase by the message that starts it (vLLM 0.33.0: v1/engine/core.py, v1/worker/gpu_worker.py,
# v1/worker/gpu/model_runner.py, model_executor/warmup/kernel_warmup.py, entrypoints/launchers/
# api_server/entry.py; FlashInfer 0.7.2.post1's autotuner). Alternatives: either message starts it.
MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engine init (distributed, device, model runner)", ("Initializing a V1 LLM engine",)),
    ("weight load", ("Loading model from scratch", "Starting to load model")),
    ("profile run (dummy forward and sampler; memory profiling unless the KV size is given)",
     ("Model loading took",)),
    ("KV cache allocation", ("skipped memory profiling", "Available KV cache memory")),
    ("vLLM JIT kernel warm-up (registered Triton kernels)", ("JIT kernel warmup starting",)),
    ("vLLM kernel warm-ups after the JIT registry", ("JIT kernel warmup finished",)),
    ("CuTe DSL router GEMM warm-up (ll_bf16)", ("Warming up ll_bf16 router GEMM",)),
    ("FlashInfer autotune", ("Using FlashInfer managed autotune cache", "Using FlashInfer autotune cache file",
                             "Skipping FlashInfer autotune")),
    ("warm-up forward steps (model runner warmup_kernels)", ("Autotuning process ends",)),
    # "CUDA graph capture" starts where "Graph capturing finished in N secs" says it did.
    ("engine finalize (JIT monitor, handshake)", ("Graph capturing finished",)),
    ("API server start (routes, uvicorn)", ("init engine (profile, create kv cache, warmup model) took",)),
)
CAPTURE = "CUDA graph capture"


def read_lines(text: str, year: int) -> list[Line]:
    """Every line of a server log with the time it carries (vLLM's lines have no year: `year`)."""
    lines = []
    for raw in re.split(r"[\r\n]", text):
        if raw.strip():
            lines.append(_timed(raw, year))
    return lines


def _timed(raw: str, year: int) -> Line:
    if m := STARTED_LINE.search(raw):
        return Line(datetime.fromisoformat(m["stamp"]), None, raw)
    if m := VLLM_LINE.search(raw):
        return Line(_stamp(year, m["month"], m["day"], m["clock"]), int(m["pid"]), raw)
    if m := FLASHINFER_LINE.search(raw):
        return Line(datetime.fromisoformat(f"{m['date']} {m['clock']}.{m['ms']}"), None, raw)
    if m := GLOG_LINE.search(raw):
        return Line(_stamp(year, m["month"], m["day"], m["clock"]) + timedelta(microseconds=int(m["us"][:6])),
                    int(m["pid"]), raw)
    return Line(None, None, raw)


def _stamp(year: int, month: str, day: str, clock: str) -> datetime:
    return datetime.fromisoformat(f"{year:04d}-{month}-{day} {clock}")


def log_year(text: str, default: int) -> int:
    """The year of FlashInfer's first line (vLLM's own lines carry none), else `default`."""
    m = FLASHINFER_LINE.search(text)
    return int(m["date"][:4]) if m else default


@dataclass
class Phase:
    name: str
    start: datetime
    end: datetime | None = None
    first: int = 0  # index of its first line in the log
    last: int = 0  # index after its last line
    jit: dict[str, int] = field(default_factory=dict)
    note: str = ""

    @property
    def seconds(self) -> float:
        if self.end is None:
            raise ValueError(f"phase {self.name!r} has no end")
        return round((self.end - self.start).total_seconds(), 1)


@dataclass
class Record:
    """What the warm-up's record says of one start: seconds from process start to healthy
    (None if not recorded) and each warm-up step's seconds, in order."""

    healthy_after_s: float | None = None
    warmup_steps: dict[str, float] = field(default_factory=dict)


def record_from_warmstart(path: Path, step: str, side: str) -> Record:
    """One side of one step of dsa_image.validation.warmstart's JSON."""
    doc = json.loads(path.read_text())
    try:
        side_report = doc["steps"][step]["sides"][side]
    except KeyError:
        raise ValueError(f"{path}: no step {step!r} side {side!r}; it has "
                         f"{ {s: sorted(r.get('sides', {})) for s, r in doc.get('steps', {}).items()} }") from None
    return Record(side_report.get("healthy_after_s"), dict(side_report.get("warmup", {}).get("steps", {})))


def record_from_log(lines: list[Line]) -> Record:
    """The image's warm-up supervisor's own lines, when it ran in this log."""
    steps = {}
    for line in lines:
        if m := WARMUP_STEP.search(line.text):
            steps[m["step"]] = float(m["s"])
    return Record(None, steps)


def _time(lines: list[Line], i: int) -> datetime:
    """The time of line `i`, one picked as a timed line (a marker, healthy, a build's start)."""
    at = lines[i].at
    if at is None:
        raise ValueError(f"log line {i + 1} carries no time: {lines[i].text[:120]!r}")
    return at


def _first(lines: list[Line], needles: tuple[str, ...], after: int = 0) -> int | None:
    for i in range(after, len(lines)):
        if lines[i].at is not None and any(n in lines[i].text for n in needles):
            return i
    return None


def _engine_fork(lines: list[Line]) -> int | None:
    """The last line of the first process (the API server) before another process's first
    line: the engine core process starts there."""
    api_pid = next((ln.pid for ln in lines if ln.pid is not None), None)
    last_api = None
    for i, line in enumerate(lines):
        if line.pid is None or line.at is None:
            continue
        if line.pid != api_pid:
            return last_api
        last_api = i
    return None


def _starts(lines: list[Line]) -> list[tuple[str, int, datetime]]:
    """(phase, line index, start) for every phase marker found after process start."""
    first_vllm = next((i for i, ln in enumerate(lines) if ln.at and VLLM_LINE.search(ln.text)), None)
    fork = _engine_fork(lines)
    found: list[tuple[str, int, datetime]] = []
    if first_vllm is not None:
        found.append(("config and model inspection (API server)", first_vllm, _time(lines, first_vllm)))
    if fork is not None:
        found.append(("import: engine core process", fork, _time(lines, fork)))
    after = fork or 0
    for name, needles in MARKERS:
        i = _first(lines, needles, after)
        if i is not None:
            found.append((name, i, _time(lines, i)))
    if (capture := _capture(lines, after)) is not None:
        found.append(capture)
    found.sort(key=lambda f: f[1])
    # A start said in whole seconds ("finished in N secs") can fall before the millisecond line
    # of the phase before it: that phase then took no time.
    for k in range(1, len(found)):
        if found[k][2] < found[k - 1][2]:
            found[k] = (found[k][0], found[k][1], found[k - 1][2])
    return found


def _capture(lines: list[Line], after: int) -> tuple[str, int, datetime] | None:
    """CUDA graph capture: its lines from the first progress bar or "Breakable CUDA graph enabled"
    (DeepGEMM's compiles during capture print there), its start from "finished in N secs"."""
    done = _first(lines, ("Graph capturing finished",), after)
    if done is None:
        return None
    first = next((i for i in range(after, done) if "Capturing CUDA graphs" in lines[i].text
                  or "Breakable CUDA graph enabled" in lines[i].text), done)
    said = CAPTURE_DONE.search(lines[done].text)
    if said is None:
        raise ValueError(f"log line {done + 1} says capture finished but not in how many secs: "
                         f"{lines[done].text[:120]!r}")
    return CAPTURE, first, _time(lines, done) - timedelta(seconds=int(said["s"]))


def _count_jit(lines: list[Line]) -> dict[str, int]:
    jit: dict[str, int] = {}
    for line in lines:
        for key in _jit_keys(line.text):
            jit[key] = jit.get(key, 0) + 1
    return jit


def _jit_keys(text: str) -> list[str]:
    keys = [f"FlashInfer:{name}" for name in FLASHINFER_BUILD.findall(text)]
    keys += ["DeepGEMM nvcc"] * len(DEEPGEMM_NVCC.findall(text))
    keys += [f"monitor:{jit_kernel_name(m)}" for m in JIT_LINE.finditer(text)]
    return keys


def _flashinfer_notes(lines: list[Line], first: int, last: int) -> list[str]:
    """A FlashInfer build logs its start only: its span is up to the next timed line."""
    notes = []
    for i in range(first, last):
        if m := FLASHINFER_BUILD.search(lines[i].text):
            nxt = next((ln.at for ln in lines[i + 1:] if ln.at is not None), None)
            if nxt is not None:
                notes.append(f"FlashInfer {m[1]} built in <= {(nxt - _time(lines, i)).total_seconds():.0f} s")
    return notes


def phases(text: str, record: Record, year: int = 2000) -> dict:
    """The per-phase table of one start: {"phases": [...], "healthy_s", "ready_s", ...}."""
    lines = read_lines(text, log_year(text, year))
    healthy_i = _first(lines, (HEALTHY_LINE,))
    if healthy_i is None:
        raise ValueError(f"the log has no {HEALTHY_LINE!r} line: the server never listened")
    healthy_at = _time(lines, healthy_i)
    start, derived = _process_start(lines, record, healthy_at)
    rows = [Phase("import: API server process (Python, torch, vLLM, plugins)", start, first=0)]
    for name, index, at in _starts(lines):
        if index > healthy_i:
            continue
        rows[-1].end, rows[-1].last = at, index
        rows.append(Phase(name, at, first=index))
    rows[-1].end, rows[-1].last = healthy_at, healthy_i + 1
    for row in rows:
        row.jit = _count_jit(lines[row.first:row.last])
        row.note = "; ".join(_flashinfer_notes(lines, row.first, row.last))
    return _table(rows, lines[healthy_i + 1:], record, start, healthy_at, derived)


def _process_start(lines: list[Line], record: Record, healthy_at: datetime) -> tuple[datetime, bool]:
    marked = next((ln.at for ln in lines if STARTED_LINE.search(ln.text)), None)
    if marked is not None:
        return marked, False
    if record.healthy_after_s is None:
        raise ValueError(f"the log has no {STARTED!r} line and the record no healthy_after_s: "
                         "process start is unknown")
    return healthy_at - timedelta(seconds=record.healthy_after_s), True


def _table(rows: list[Phase], after_healthy: list[Line], record: Record, start: datetime,
           healthy_at: datetime, derived: bool) -> dict:
    healthy_s = round((healthy_at - start).total_seconds(), 1)
    warmup = [{"phase": f"image warm-up: {step}", "seconds": round(s, 1), "jit": {}, "note": ""}
              for step, s in record.warmup_steps.items()]
    if warmup:  # what compiled during the warm-up (the JIT monitor's lines after healthy)
        warmup[-1]["note"] = "compiled during the warm-up: " + (
            ", ".join(f"{k} x{v}" for k, v in sorted(_count_jit(after_healthy).items())) or "nothing logged")
    warmup_s = round(sum(record.warmup_steps.values()), 1)
    return {"process_start": start.isoformat(sep=" "), "process_start_derived": derived,
            "phases": [{"phase": r.name, "seconds": r.seconds, "jit": r.jit, "note": r.note} for r in rows] + warmup,
            "healthy_s": healthy_s, "warmup_s": warmup_s, "ready_s": round(healthy_s + warmup_s, 1)}


# -- output ----------------------------------------------------------------------------------


def _jit_cell(jit: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(jit.items())) or "–"


def markdown(label: str, table: dict) -> str:
    """One start as a markdown table, its totals under it."""
    out = [f"**{label}**" + (" (process start derived from the record's healthy_after_s)"
                             if table["process_start_derived"] else ""), "",
           "| phase | s | JIT in it | note |", "|---|---|---|---|"]
    for row in table["phases"]:
        out.append(f"| {row['phase']} | {row['seconds']:.1f} | {_jit_cell(row['jit'])} | {row['note'] or '–'} |")
    out += [f"| **healthy** | **{table['healthy_s']:.1f}** | | |",
            f"| **ready** (healthy + warm-up {table['warmup_s']:.1f} s) | **{table['ready_s']:.1f}** | | |"]
    return "\n".join(out)


def comparison(tables: dict[str, dict]) -> str:
    """The phases side by side, one column of seconds per start."""
    labels = list(tables)
    names = list(dict.fromkeys(r["phase"] for t in tables.values() for r in t["phases"]))
    seconds = {label: {r["phase"]: r["seconds"] for r in t["phases"]} for label, t in tables.items()}
    out = ["| phase | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for name in names:
        out.append(f"| {name} | " + " | ".join(_cell(seconds[lb].get(name)) for lb in labels) + " |")
    for total in ("healthy_s", "ready_s"):
        out.append(f"| **{total[:-2]}** | " + " | ".join(f"**{tables[lb][total]:.1f}**" for lb in labels) + " |")
    return "\n".join(out)


def _cell(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _parse_record(spec: str | None, lines_text: str) -> Record:
    if spec is None:
        return record_from_log(read_lines(lines_text, 2000))
    path, _, rest = spec.partition(":")
    step, _, side = rest.partition(":")
    if not step or not side:
        raise ValueError(f"record {spec!r}: expected WARMSTART.json:STEP:SIDE")
    return record_from_warmstart(Path(path), step, side)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", nargs="+", action="append", required=True, metavar="LABEL LOG [RECORD]",
                        help="a start: its label, its server log and (optional) WARMSTART.json:STEP:SIDE")
    parser.add_argument("--json", help="also write the tables as JSON here")
    args = parser.parse_args(argv)
    tables = {}
    for spec in args.start:
        if len(spec) not in (2, 3):
            parser.error(f"--start {' '.join(spec)}: expected LABEL LOG [WARMSTART.json:STEP:SIDE]")
        label, log = spec[0], Path(spec[1])
        text = log.read_text(errors="replace")
        try:
            tables[label] = phases(text, _parse_record(spec[2] if len(spec) == 3 else None, text))
        except ValueError as exc:
            print(f"startup_phases: {log}: {exc}", file=sys.stderr)
            return status.FAILED
    print("\n\n".join(markdown(label, t) for label, t in tables.items()))
    if len(tables) > 1:
        print("\n" + comparison(tables))
    if args.json:
        Path(args.json).write_text(json.dumps(tables, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
