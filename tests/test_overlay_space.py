"""apply on a real full disk (tmpfs out of inodes, out of bytes), as a user a sticky directory
refuses, and with files owned by other users: a failure midway restores every file without
needing new space, keeps each file's owner, and the message says exactly what is true."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dsa_image.overlay import cli as overlay

from overlay_helpers import (OVERLAY, SOURCES, UPSTREAM, Tree, expect_error, fill_bytes, fill_inodes, need_root,
                             run_cli, snapshot, syscall_path, tmpfs)

# Sources big enough that a few pages of free space run out in the middle of apply.
BIG_UPSTREAM = {**UPSTREAM, **{rel: data + b"# " + b"u" * 12000 + b"\n" for rel, data in UPSTREAM.items()
                               if rel in OVERLAY}}
BIG_OVERLAY = {rel: data + b"# " + b"o" * 12000 + b"\n" for rel, data in OVERLAY.items()}
NOBODY = 65534


def failed_truthfully(tree: Tree, before: dict[str, bytes], message: str) -> None:
    """A failed apply restored everything, and says so rather than RESTORE FAILED."""
    assert "RESTORE FAILED" not in message, message
    assert "every file was restored" in message or "nothing was changed" in message.lower(), message
    assert snapshot(tree.site) == before
    assert tree.state() == "upstream"


@pytest.mark.parametrize("free", range(0, 18))
def test_out_of_inodes_anywhere_in_apply_restores_every_file(tmp_path, free):
    """The reported case is free=2: restoring wrote each original through a new temp inode,
    so the rollback itself failed and indexer.py kept the overlay."""
    with tmpfs("4m", 200) as mnt:
        tree = Tree(tmp_path, site=mnt / "site")
        filler = fill_inodes(mnt, free)
        before = snapshot(tree.site)
        try:
            tree.apply()
        except overlay.OverlayError as exc:
            assert exc.exit_code == overlay.CANNOT_WRITE, str(exc)
            failed_truthfully(tree, before, str(exc))
            shutil.rmtree(filler)
            tree.apply()  # with inodes again, a re-run works
        assert tree.state() == "overlay"


@pytest.mark.parametrize("free_kib", [0, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 128])
def test_out_of_space_anywhere_in_apply_restores_every_file_and_says_so(tmp_path, free_kib):
    """The reported case is 40 KiB: the write that failed was the one being restored, so
    apply said RESTORE FAILED (reinstall vLLM) while every file was in fact unchanged."""
    with tmpfs("2m", 400) as mnt:
        tree = Tree(tmp_path, site=mnt / "site", upstream=BIG_UPSTREAM, overlay_files=BIG_OVERLAY)
        filler = fill_bytes(mnt, free_kib * 1024)
        before = snapshot(tree.site)
        try:
            tree.apply()
        except overlay.OverlayError as exc:
            assert exc.exit_code == overlay.CANNOT_WRITE, str(exc)
            failed_truthfully(tree, before, str(exc))
            filler.unlink()
            tree.apply()
        assert tree.state() == "overlay"


def python_for(uid: int) -> str:
    """An interpreter (3.11+) the user `uid` may run: this one, or the system python3."""
    for candidate in (sys.executable, "/usr/bin/python3"):
        try:
            done = subprocess.run([candidate, "-c", "import sys; assert sys.version_info >= (3, 11)"], user=uid,
                                  group=uid, extra_groups=[], capture_output=True)
        except OSError:
            continue  # not executable for that user (e.g. an interpreter under /root)
        if done.returncode == 0:
            return candidate
    pytest.skip(f"no python 3.11+ that uid {uid} may run (tried {sys.executable}, /usr/bin/python3)")


def test_a_sticky_directory_refusal_says_every_file_was_restored():
    """As a non-root user, a root-owned file in a sticky directory can be neither replaced
    nor moved aside: apply fails before changing it, and must not claim it is broken."""
    need_root("a file owned by another user")
    base = Path(tempfile.mkdtemp(prefix="overlay-sticky-"))
    try:
        base.chmod(0o755)
        tree = Tree(base)
        for path in [tree.site, *tree.site.rglob("*")]:
            os.lchown(path, NOBODY, NOBODY)
        sticky = tree.site / "vllm" / "a"
        for path in [sticky, *sticky.rglob("*")]:
            os.lchown(path, 0, 0)
        sticky.chmod(0o1777)
        python = python_for(NOBODY)
        before = snapshot(tree.site)
        done = run_cli(*tree.common(), "apply", "--site-packages", str(tree.site), python=python, user=NOBODY,
                       group=NOBODY, extra_groups=[])
        assert done.returncode == overlay.CANNOT_WRITE, done.stderr
        failed_truthfully(tree, before, done.stderr)
    finally:
        shutil.rmtree(base)


def owners(tree: Tree) -> dict[str, tuple[int, int, int]]:
    return {rel: (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode))
            for rel in SOURCES if (tree.site / rel).exists() for st in [os.stat(tree.site / rel)]}


def test_rollback_keeps_owner_and_mode_and_apply_keeps_them_too(tmp_path):
    need_root("chown")
    tree = Tree(tmp_path)
    os.chown(tree.site / "vllm/envs.py", 1234, 2345)
    os.chown(tree.site / "vllm/a/mod.py", 4321, 5432)
    (tree.site / "vllm/a/mod.py").chmod(0o640)
    before, owned = snapshot(tree.site), owners(tree)
    (tree.overlay_dir / "vllm/a/new.py").write_bytes(b"def broken(:\n")  # compile fails after every copy
    tree.record()
    assert "every file was restored" in expect_error(overlay.CANNOT_WRITE, tree.apply)
    assert snapshot(tree.site) == before and owners(tree) == owned
    (tree.overlay_dir / "vllm/a/new.py").write_bytes(OVERLAY["vllm/a/new.py"])
    tree.record()
    tree.apply()
    assert {rel: v for rel, v in owners(tree).items() if rel in owned} == owned


def test_a_failed_restore_names_the_file_and_its_advice_works(tmp_path, monkeypatch):
    """When a restore really fails, the message says which file still differs, where its
    original is, and a command; running that command restores it."""
    tree = Tree(tmp_path)
    before = snapshot(tree.site)
    first, second = (tree.site / rel for rel in SOURCES[:2])
    real_replace, state = os.replace, {"failed_forward": False, "failed_restore": False}

    def replace(src, dst, *args, dst_dir_fd=None, **kwargs):
        target = syscall_path(dst, dst_dir_fd)
        if target == syscall_path(second) and not state["failed_forward"]:
            state["failed_forward"] = True
            raise OSError(errno.EIO, "injected I/O error", str(target))
        if target == syscall_path(first) and state["failed_forward"] and not state["failed_restore"]:
            state["failed_restore"] = True
            raise OSError(errno.EACCES, "injected refusal", str(target))
        return real_replace(src, dst, *args, dst_dir_fd=dst_dir_fd, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    message = expect_error(overlay.CANNOT_WRITE, tree.apply)
    monkeypatch.setattr(os, "replace", real_replace)
    assert f"RESTORE FAILED for {first}" in message and "its original is kept at" in message, message
    assert first.read_bytes() == OVERLAY[SOURCES[0]]  # what the message says is true
    assert SOURCES[1] not in UPSTREAM and not second.exists()
    command = f"scripts/overlay.py revert --site-packages {tree.site}"
    assert command in message
    done = run_cli(*tree.common(), "revert", "--site-packages", str(tree.site))
    assert done.returncode == 0, done.stderr
    assert tree.state() == "upstream" and snapshot(tree.site) == before
    tree.apply()
    assert tree.state() == "overlay"
