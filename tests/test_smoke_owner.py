"""Whether the smoke run owning a container is gone (its container may be removed), alive, or
cannot be judged from here: from the container's owner labels, against a scripted host and
process table, then against this host's real /proc."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsa_image.smoke.owner import (
    ALIVE, BOOT_LABEL, CLEANUP_COMMAND, GONE, HOST_LABEL, OWNER_LABELS, PID_LABEL, PIDNS_LABEL, START_LABEL, UNKNOWN,
    Host, judge, owner_labels, process_start, this_host,
)

REPO = Path(__file__).resolve().parent.parent
HERE = Host("runner-1", "5f0c1a2e-0000-4000-8000-000000000001", "pid:[4026531836]")
LABELS = {PID_LABEL: "4242", START_LABEL: "987654", HOST_LABEL: HERE.hostname, BOOT_LABEL: HERE.boot_id,
          PIDNS_LABEL: HERE.pid_namespace}

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def table(**starts):
    """A process table: pid -> start time; a pid not in it runs no process."""
    return lambda pid: starts.get(f"p{pid}")


def never_asked(pid):
    raise AssertionError(f"the process table was read for pid {pid}: the owner is not on this host")


def test_owner_still_running_is_alive():
    verdict = judge(LABELS, HERE, table(p4242="987654"))
    assert verdict.state == ALIVE and "its owner, process 4242 on runner-1, still runs" in verdict.why


def test_owner_that_no_longer_runs_is_gone():
    verdict = judge(LABELS, HERE, table())
    assert verdict.state == GONE and "its owner, process 4242 on runner-1, no longer runs" in verdict.why


def test_a_reused_pid_is_not_the_owner():
    verdict = judge(LABELS, HERE, table(p4242="999999"))
    assert verdict.state == GONE and "another process" in verdict.why


@pytest.mark.parametrize("label, value, words", [
    (HOST_LABEL, "runner-2", "another host"),
    (PIDNS_LABEL, "pid:[4026532001]", "another PID namespace"),
    (BOOT_LABEL, "5f0c1a2e-0000-4000-8000-000000000002", "boot id"),
    (PID_LABEL, "12a", "not a pid"),
])
def test_an_owner_elsewhere_cannot_be_judged(label, value, words):
    verdict = judge({**LABELS, label: value}, HERE, never_asked)
    assert verdict.state == UNKNOWN and words in verdict.why


@pytest.mark.parametrize("missing", OWNER_LABELS)
def test_a_container_without_owner_labels_cannot_be_judged(missing):
    labels = {k: v for k, v in LABELS.items() if k != missing}
    verdict = judge(labels, HERE, never_asked)
    assert verdict.state == UNKNOWN and "names no owning process" in verdict.why


def test_a_host_without_proc_judges_nothing():
    verdict = judge({**LABELS, BOOT_LABEL: ""}, Host("runner-1", "", ""), never_asked)
    assert verdict.state == UNKNOWN


# --- this host's real /proc ------------------------------------------------------------------


@needs_proc
def test_this_process_is_alive_to_itself():
    labels = owner_labels()
    assert labels[PID_LABEL] == str(os.getpid()) and labels[START_LABEL].isdigit()
    assert judge(labels, this_host()).state == ALIVE


@needs_proc
def test_a_reaped_process_is_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    labels = owner_labels(child.pid)
    assert judge(labels, this_host()).state == ALIVE
    child.kill()
    child.wait()
    assert judge(labels, this_host()).state == GONE


@needs_proc
def test_a_zombie_is_gone():
    """A SIGKILLed smoke run whose parent has not reaped it yet runs no code: gone."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    labels = owner_labels(child.pid)
    os.kill(child.pid, 9)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child never became a zombie"
        time.sleep(0.05)
    try:
        assert judge(labels, this_host()).state == GONE
    finally:
        child.wait()


@needs_proc
def test_start_time_is_read_past_a_name_with_spaces_and_parentheses(tmp_path):
    sleeper = tmp_path / "x) 1 2 (y"
    shutil.copy(shutil.which("sleep"), sleeper)
    child = subprocess.Popen([str(sleeper), "60"])
    try:
        start = process_start(child.pid)
        assert start is not None and start.isdigit()
        # Started after this process: field 22 is ticks since boot.
        assert int(start) >= int(process_start(os.getpid()))
    finally:
        child.kill()
        child.wait()


def test_the_cleanup_the_run_prints_is_the_one_documented():
    assert f"    {CLEANUP_COMMAND}\n" in (REPO / "docs" / "smoke.md").read_text()
