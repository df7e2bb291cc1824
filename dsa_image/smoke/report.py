"""The smoke report: one JSON file beside the server log, written even when the server never
came up (then the failing check says why and the report carries the log's tail)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from dsa_image.core.atomic import write_atomic
from dsa_image.smoke.checks import Check

SCHEMA = 1
REPORT_NAME = "smoke-report.json"
LOG_NAME = "server.log"
LOG_TAIL_CHARS = 6000


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def log_tail(text: str, chars: int = LOG_TAIL_CHARS) -> str:
    return text if len(text) <= chars else "...\n" + text[-chars:]


def summarize_receipt(receipt: dict | None) -> dict:
    """The versions a receipt (scripts/overlay.py apply) proves: vLLM, recipe, overlay manifest."""
    if not isinstance(receipt, dict):
        return {}
    return {
        "vllm": receipt.get("vllm_version"),
        "recipe": receipt.get("recipe"),
        "overlay_manifest_sha256": receipt.get("manifest_sha256"),
        "overlay_files": len(receipt.get("files") or []),
    }


@dataclass
class Report:
    runtime: str
    target: str | None = None
    served_model_name: str | None = None
    model: str | None = None
    server_command: list[str] | None = None
    image: dict | None = None
    python: dict | None = None
    gpu: dict | None = None
    # The parallel layout: asked (tp, pp, backend, world size, flags), GPUs visible, Ray, then
    # what ran (GPUs held, /dev/shm, ranks and Ray lines of the log, the serve argv).
    parallel: dict | None = None
    expected: dict | None = None
    versions: dict = field(default_factory=dict)
    receipt: dict | None = None
    timings: dict = field(default_factory=dict)
    server_exit: dict | None = None
    checks: list[Check] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # what went wrong outside the checks
    started_at: str = field(default_factory=utc_now)
    finished_at: str | None = None
    interrupted: bool = False
    # Docker: the smoke containers of earlier runs found at start, removed or kept and why.
    leftovers: list[dict] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks) and not self.errors and not self.interrupted

    def as_dict(self, log: str) -> dict:
        return {
            "schema": SCHEMA,
            "passed": self.passed,
            "runtime": self.runtime,
            "target": self.target,
            "served_model_name": self.served_model_name,
            "model": self.model,
            "server_command": self.server_command,
            "image": self.image,
            "python": self.python,
            "gpu": self.gpu,
            "parallel": self.parallel,
            "expected": self.expected,
            "versions": self.versions,
            "receipt": self.receipt,
            "timings": self.timings,
            "server_exit": self.server_exit,
            "checks": [c.as_dict() for c in self.checks],
            "failed_checks": [c.name for c in self.checks if not c.passed],
            "errors": self.errors,
            "interrupted": self.interrupted,
            "leftover_containers": self.leftovers,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "log_file": LOG_NAME,
            # The whole log is in LOG_NAME; a failed run carries its end here too, so a CI page
            # that shows only the report still shows why.
            "log_tail": None if self.passed else log_tail(log),
        }


def write_report(out_dir: Path, report: Report, log: str) -> Path:
    """Write the log and the report (report last, atomically: a report on disk is complete)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report.finished_at = report.finished_at or utc_now()
    (out_dir / LOG_NAME).write_text(log, errors="replace")
    path = out_dir / REPORT_NAME
    write_atomic(path, (json.dumps(report.as_dict(log), indent=2, allow_nan=True) + "\n").encode(), mode=0o644)
    return path
