"""Which process owns a smoke container, and whether it still runs.

A smoke run killed with SIGKILL runs no `finally`: its container stays. The next run finds it
by its run label and must decide whether to remove it. A pid alone cannot decide that: the
container may come from another host sharing the engine, from a harness inside another
container (another PID namespace), or the pid may since have been reused. So each container
also names the owner's host, boot id, PID namespace and start time (clock ticks since boot,
/proc/PID/stat field 22). An owner is *gone* only when all of those name this host, this boot
and this namespace and that pid no longer runs the process that started (or is a zombie).
Anything else cannot be judged from here: such a container is kept, and the run says so.

Stdlib only; Linux's /proc supplies the identity. Where /proc is missing (Docker Desktop on
macOS) nothing can be judged and nothing is removed.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

RUN_LABEL = "dsa-image.smoke"
PID_LABEL = "dsa-image.smoke.pid"
START_LABEL = "dsa-image.smoke.pid-start"
HOST_LABEL = "dsa-image.smoke.host"
BOOT_LABEL = "dsa-image.smoke.boot-id"
PIDNS_LABEL = "dsa-image.smoke.pid-ns"
OWNER_LABELS = (PID_LABEL, START_LABEL, HOST_LABEL, BOOT_LABEL, PIDNS_LABEL)

# Removes every smoke container, whoever owns it: for when no smoke run is going on.
CLEANUP_COMMAND = f"docker ps -aq --filter label={RUN_LABEL} | xargs -r docker rm -f"

GONE, ALIVE, UNKNOWN = "gone", "alive", "unknown"


@dataclass(frozen=True)
class Host:
    hostname: str
    boot_id: str
    pid_namespace: str


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def this_host() -> Host:
    try:
        pid_namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_namespace = ""
    return Host(socket.gethostname(), _read("/proc/sys/kernel/random/boot_id"), pid_namespace)


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state, ppid, ...), or None when no process runs there:
    none at all, or a zombie, which runs no code and only waits for its parent."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    # comm (field 2) may hold spaces and parentheses: the fields after it follow the last ')'.
    fields = stat.rpartition(")")[2].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields


def process_start(pid: int) -> str | None:
    """The start time of `pid` (field 22 of /proc/PID/stat), or None when no process runs there."""
    fields = _stat_fields(pid)
    return fields[19] if fields else None


def parent_pid(pid: int) -> int | None:
    """The parent of `pid` (field 4 of /proc/PID/stat), or None when no process runs there."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def owner_labels(pid: int | None = None, host: Host | None = None) -> dict[str, str]:
    """The labels naming `pid` (default: this process) as a container's owner."""
    pid = os.getpid() if pid is None else pid
    host = host or this_host()
    return {PID_LABEL: str(pid), START_LABEL: process_start(pid) or "", HOST_LABEL: host.hostname,
            BOOT_LABEL: host.boot_id, PIDNS_LABEL: host.pid_namespace}


@dataclass(frozen=True)
class Verdict:
    state: str  # GONE, ALIVE or UNKNOWN
    why: str


def judge(labels: dict[str, str], host: Host,
          start_of: Callable[[int], str | None] = process_start) -> Verdict:
    """Whether the smoke run that owns a container with `labels` still runs, seen from `host`."""
    missing = [label for label in OWNER_LABELS if not labels.get(label)]
    if missing:
        return Verdict(UNKNOWN, "it names no owning process (started by hand or by an older smoke.py)")
    if not (host.hostname and host.boot_id and host.pid_namespace):
        return Verdict(UNKNOWN, "this host cannot tell whether its owner runs (no /proc)")
    pid = labels[PID_LABEL]
    where = f"process {pid} on {labels[HOST_LABEL]}"
    if labels[HOST_LABEL] != host.hostname:
        return Verdict(UNKNOWN, f"its owner, {where}, is on another host")
    if labels[PIDNS_LABEL] != host.pid_namespace:
        return Verdict(UNKNOWN, f"its owner, {where}, is in another PID namespace ({labels[PIDNS_LABEL]})")
    if labels[BOOT_LABEL] != host.boot_id:
        # Same name and namespace, other boot id: a reboot since, or another machine of the
        # same name sharing the engine. Only the first would make the owner gone.
        return Verdict(UNKNOWN, f"its owner, {where}, ran under boot id {labels[BOOT_LABEL]}, not this one")
    if not pid.isdigit():
        return Verdict(UNKNOWN, f"its pid label {pid!r} is not a pid")
    start = start_of(int(pid))
    if start is None:
        return Verdict(GONE, f"its owner, {where}, no longer runs")
    if start != labels[START_LABEL]:
        return Verdict(GONE, f"its owner, {where}, no longer runs (that pid now runs another process)")
    return Verdict(ALIVE, f"its owner, {where}, still runs")
