"""apply interrupted for real: signals sent to a running CLI, SIGKILL, a FIFO at the receipt
path, and a second apply on the same tree. After any of them the tree is all upstream or
all overlay with its receipt, and running the tool again works."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsa_image.overlay import cli as overlay

from overlay_helpers import OVERLAY, SOURCES, TOOL, Tree, run_cli, snapshot

STASH = ".vllm_overlay_txn"

# Runs scripts/overlay.py with os.replace wrapped: on the nth replace of a watched path it
# either pauses right after it (the test then signals the process), or waits for a release
# file before it and then fails it with EIO (a deterministic interleaving of two applies).
DRIVER = r"""
import errno, json, os, runpy, sys, time
tool, marker, release, mode, nth, watched = sys.argv[1:7]
nth, watched = int(nth), {os.path.realpath(p) for p in json.loads(watched)}
real_replace, seen = os.replace, [0]

def replace(src, dst, *args, **kwargs):
    fd = kwargs.get("dst_dir_fd")  # overlay_fs: a bare name in the directory fd refers to
    hit = (os.path.join(os.readlink(f"/proc/self/fd/{fd}"), dst) if fd is not None else os.path.realpath(dst)) in watched
    if hit and mode == "fail-before":
        seen[0] += 1
        if seen[0] == nth:
            open(marker, "w").close()
            while not os.path.exists(release):
                time.sleep(0.02)
            raise OSError(errno.EIO, "injected I/O error", os.fspath(dst))
    real_replace(src, dst, *args, **kwargs)
    if hit and mode == "pause-after":
        seen[0] += 1
        if seen[0] == nth:
            open(marker, "w").close()
            time.sleep(120)

os.replace = replace
sys.argv = [tool, *sys.argv[7:]]
runpy.run_path(tool, run_name="__main__")
"""


@pytest.fixture
def tree(tmp_path, monkeypatch) -> Tree:
    tree = Tree(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tree.site))  # for verify's import probe
    return tree


def start(tree: Tree, tmp_path: Path, mode: str, nth: int, watched: list[Path], *command: str) -> subprocess.Popen:
    marker, release = tmp_path / "marker", tmp_path / "release"
    for path in (marker, release):
        path.unlink(missing_ok=True)
    args = [str(TOOL), str(marker), str(release), mode, str(nth), json.dumps([str(p) for p in watched]),
            *tree.common(), *(command or ("apply", "--site-packages", str(tree.site)))]
    proc = subprocess.Popen([sys.executable, "-B", "-c", DRIVER, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the tool never reached replace #{nth} (exit {proc.wait()}): {proc.communicate()[1]}")
        time.sleep(0.02)
    return proc


def sources(tree: Tree) -> list[Path]:
    return [tree.site / rel for rel in SOURCES]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("nth", [1, 2, 3])
def test_a_signal_mid_apply_restores_every_file_and_a_rerun_works(tree, tmp_path, signum, nth):
    """nth 2 is the reported case: SIGINT right after the 2nd os.replace left two files
    overlaid, one upstream and no receipt; SIGTERM killed the process outright."""
    before = snapshot(tree.site)
    proc = start(tree, tmp_path, "pause-after", nth, sources(tree))
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signum, stderr
    assert "every file was restored" in stderr and "Traceback" not in stderr, stderr
    assert tree.state() == "upstream"
    assert snapshot(tree.site) == before
    again = run_cli(*tree.common(), "apply", "--site-packages", str(tree.site))
    assert again.returncode == 0, again.stderr
    assert tree.state() == "overlay"


def test_a_signal_after_the_receipt_still_leaves_one_of_the_two_states(tree, tmp_path):
    proc = start(tree, tmp_path, "pause-after", 4, [*sources(tree), tree.site / overlay.RECEIPT_NAME])
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert tree.state() in ("upstream", "overlay")
    if tree.state() == "upstream":
        assert run_cli(*tree.common(), "apply", "--site-packages", str(tree.site)).returncode == 0
    assert run_cli(*tree.common(), "verify", "--site-packages", str(tree.site)).returncode == 0


@pytest.mark.parametrize("then", ["apply", "revert"])
def test_after_sigkill_mid_apply_verify_says_what_to_do_and_that_works(tree, tmp_path, then):
    """SIGKILL cannot be caught: the stash and its journal are what the next run recovers from."""
    before = snapshot(tree.site)
    proc = start(tree, tmp_path, "pause-after", 2, sources(tree))
    proc.kill()
    proc.communicate(timeout=60)
    assert tree.state().startswith("mixed")
    verify = run_cli(*tree.common(), "verify", "--site-packages", str(tree.site))
    assert verify.returncode == overlay.MISMATCH
    advice = f"scripts/overlay.py {then} --site-packages {tree.site}"
    assert advice in verify.stderr, verify.stderr
    done = run_cli(*tree.common(), then, "--site-packages", str(tree.site))
    assert done.returncode == 0, done.stderr
    assert "rolled back the apply" in done.stderr
    if then == "apply":
        assert tree.state() == "overlay"
        assert run_cli(*tree.common(), "verify", "--site-packages", str(tree.site)).returncode == 0
    else:
        assert tree.state() == "upstream" and snapshot(tree.site) == before


def test_after_sigkill_at_the_commit_point_the_next_run_finishes_it(tree, tmp_path):
    before = snapshot(tree.site)
    proc = start(tree, tmp_path, "pause-after", 1, [tree.site / STASH / "index.json"])
    proc.kill()
    proc.communicate(timeout=60)
    assert (tree.site / STASH / "index.json").exists()
    assert run_cli(*tree.common(), "verify", "--site-packages", str(tree.site)).returncode == 0
    reverted = run_cli(*tree.common(), "revert", "--site-packages", str(tree.site))
    assert reverted.returncode == 0, reverted.stderr
    assert "finished the apply" in reverted.stderr
    assert tree.state() == "upstream" and snapshot(tree.site) == before


@pytest.mark.parametrize("where", ["default", "elsewhere"])
def test_a_fifo_at_the_receipt_path_is_refused_without_hanging(tree, tmp_path, where):
    fifo = tree.site / overlay.RECEIPT_NAME if where == "default" else tmp_path / "receipt.fifo"
    os.mkfifo(fifo)
    extra = [] if where == "default" else ["--receipt", str(fifo)]
    before = snapshot(tree.site)
    try:
        done = run_cli(*tree.common(), "apply", "--site-packages", str(tree.site), *extra, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("apply hung opening the FIFO at the receipt path")
    assert done.returncode == overlay.BAD_INPUT, done.stderr
    assert "not a regular file" in done.stderr and "nothing was changed" in done.stderr
    assert snapshot(tree.site) == before and tree.state() == "upstream"
    try:
        verify = run_cli(*tree.common(), "verify", "--site-packages", str(tree.site), *extra, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("verify hung reading the FIFO at the receipt path")
    assert verify.returncode == overlay.BAD_INPUT and "not a regular file" in verify.stderr, verify.stderr


def test_two_concurrent_applies_leave_one_consistent_tree(tree, tmp_path):
    """The reported race: apply A has checked every file and is about to write; apply B runs;
    then A's first write fails and A rolls back. Without a lock B completes in between and A's
    rollback puts upstream bytes under B's receipt."""
    first = start(tree, tmp_path, "fail-before", 1, sources(tree))
    second = subprocess.Popen([sys.executable, "-B", str(TOOL), *tree.common(), "apply", "--site-packages",
                               str(tree.site)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        second.wait(timeout=3)  # with the lock it waits for the first, without it finishes now
    except subprocess.TimeoutExpired:
        pass
    (tmp_path / "release").touch()
    _, first_err = first.communicate(timeout=60)
    _, second_err = second.communicate(timeout=60)
    assert first.returncode == overlay.CANNOT_WRITE and "every file was restored" in first_err, first_err
    assert tree.state() in ("upstream", "overlay"), (tree.state(), second_err)
    assert second.returncode == 0 and tree.state() == "overlay", second_err


def test_a_second_apply_gives_up_after_the_lock_timeout(tree):
    before = snapshot(tree.site)
    fd = os.open(tree.site, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        started = time.monotonic()
        done = run_cli(*tree.common(), "apply", "--site-packages", str(tree.site), "--lock-timeout", "0.5")
        waited = time.monotonic() - started
    finally:
        os.close(fd)
    assert done.returncode == overlay.CANNOT_WRITE, done.stderr
    assert "still holds the lock" in done.stderr and "nothing was changed" in done.stderr
    assert 0.5 <= waited < 30
    assert snapshot(tree.site) == before
    assert run_cli(*tree.common(), "apply", "--site-packages", str(tree.site)).returncode == 0
    assert tree.state() == "overlay"


def test_the_stash_names_are_the_documented_ones():
    assert (overlay.TXN_DIR_NAME, overlay.ORIGINALS_DIR_NAME) == (STASH, ".vllm_overlay_originals")
    assert set(OVERLAY) == set(SOURCES)


def test_recovery_never_follows_a_journal_outside_the_site(tree, tmp_path):
    """The journal is read back as root from a directory others may write: a path in it that
    leaves the site is refused, not deleted."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    stash = tree.site / STASH
    stash.mkdir()
    (stash / "journal.json").write_text(json.dumps({
        "kind": "apply", "receipt": overlay.RECEIPT_NAME, "dirs": [],
        "slots": [{"path": "../victim.txt", "orig": None, "new": "0.new"}]}))
    done = run_cli(*tree.common(), "apply", "--site-packages", str(tree.site))
    assert done.returncode == overlay.CANNOT_WRITE and "unreadable" in done.stderr, done.stderr
    assert victim.read_text() == "keep me\n"
    assert tree.state().startswith("mixed")
    remove = re.search(r"`(rm -r [^`]+)`", done.stderr)  # the advice, followed (this tree needs no reinstall)
    assert remove, done.stderr
    subprocess.run(shlex.split(remove.group(1)), check=True)
    assert run_cli(*tree.common(), "apply", "--site-packages", str(tree.site)).returncode == 0
    assert tree.state() == "overlay" and victim.read_text() == "keep me\n"


@pytest.mark.parametrize("then", ["apply", "revert"])
def test_after_sigkill_mid_revert_verify_says_what_to_do_and_that_works(tree, tmp_path, then):
    """The reported case: verify advised apply, and apply rolled the revert back, then exited
    3 with "Nothing was changed" (a Dockerfile `RUN apply` failed). apply now ends with the
    overlay applied, revert with upstream vLLM."""
    upstream = snapshot(tree.site)
    assert run_cli(*tree.common(), "apply", "--site-packages", str(tree.site)).returncode == 0
    applied = snapshot(tree.site)
    proc = start(tree, tmp_path, "pause-after", 1, sources(tree), "revert", "--site-packages", str(tree.site))
    proc.kill()
    proc.communicate(timeout=60)
    assert tree.state().startswith("mixed")
    verify = run_cli(*tree.common(), "verify", "--site-packages", str(tree.site))
    assert verify.returncode == overlay.MISMATCH
    advice = f"scripts/overlay.py {then} --site-packages {tree.site}"
    assert advice in verify.stderr, verify.stderr
    done = run_cli(*tree.common(), then, "--site-packages", str(tree.site))
    assert done.returncode == 0, done.stderr
    assert "rolled back the revert" in done.stderr and "Nothing was changed" not in done.stderr, done.stderr
    if then == "apply":
        assert tree.state() == "overlay" and snapshot(tree.site) == applied
        assert run_cli(*tree.common(), "verify", "--site-packages", str(tree.site)).returncode == 0
    else:
        assert tree.state() == "upstream" and snapshot(tree.site) == upstream


def test_a_killed_apply_with_a_receipt_elsewhere_is_recovered_only_with_that_receipt(tree, tmp_path):
    """A path outside the site comes from the command line, never from the journal: the
    recovery asks for the same --receipt, then rolls back (the receipt it wrote removed)."""
    receipt = tmp_path / "out" / "receipt.json"
    receipt.parent.mkdir()
    before = snapshot(tree.site)
    proc = start(tree, tmp_path, "pause-after", 1, [receipt], "apply", "--site-packages", str(tree.site),
                 "--receipt", str(receipt))
    proc.kill()
    proc.communicate(timeout=60)
    assert receipt.exists()
    plain = run_cli(*tree.common(), "revert", "--site-packages", str(tree.site))
    assert plain.returncode == overlay.CANNOT_WRITE and f"--receipt {receipt}" in plain.stderr, plain.stderr
    assert receipt.exists()
    done = run_cli(*tree.common(), "revert", "--site-packages", str(tree.site), "--receipt", str(receipt))
    assert done.returncode == 0 and "rolled back the apply" in done.stderr, done.stderr
    assert not receipt.exists() and snapshot(tree.site) == before and tree.state() == "upstream"
