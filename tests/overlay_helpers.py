"""Synthetic site-packages trees and real-filesystem helpers for the overlay tests.

A tree holds a fake vLLM (a dist-info and a few modules) and an overlay recorded against it
with the real recorder, so apply/revert/verify run unmodified and no vLLM is needed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dsa_image.overlay import cli as overlay
from dsa_image.overlay.manifest import Manifest, manifest_bytes, record_entry
from dsa_image.core.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "scripts" / "overlay.py"
RECIPE = load_recipe()
VERSION = RECIPE.vllm_version

UPSTREAM = {
    "vllm/__init__.py": b"",
    "vllm/envs.py": b"FLAG = 'upstream'\n",
    "vllm/a/__init__.py": b"",
    "vllm/a/mod.py": b"VALUE = 'upstream'\n",
}
OVERLAY = {
    "vllm/envs.py": b"FLAG = 'overlay'\n",
    "vllm/a/mod.py": b"VALUE = 'overlay'\n",
    "vllm/a/new.py": b"NEW = True\n",
}
SOURCES = sorted(OVERLAY)  # the managed source files, in manifest order


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def make_site(root: Path, version: str = VERSION, upstream: dict[str, bytes] = UPSTREAM) -> Path:
    write_tree(root, upstream)
    write_tree(root, {f"vllm-{version}.dist-info/METADATA":
                      f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n".encode()})
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file and symlink under root (hidden ones too: a stash left behind shows here)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class Tree:
    def __init__(self, base: Path, site: Path | None = None, upstream: dict[str, bytes] = UPSTREAM,
                 overlay_files: dict[str, bytes] = OVERLAY, installed: bool = False):
        """installed: `site` already holds the fake vLLM (installed by pip)."""
        self.upstream, self.overlay_files = upstream, overlay_files
        self.site = site if installed else make_site(site or base / "site", upstream=upstream)
        self.overlay_dir = base / "overlay"
        write_tree(self.overlay_dir, overlay_files)
        self.manifest_path = self.overlay_dir / "manifest.json"
        self.record()

    def record(self) -> None:
        """(Re)write the manifest with the real recorder, against the synthetic upstream files."""
        wheel = RECIPE.wheel("linux/amd64")
        entries = tuple(record_entry(path, f"test: {path}", self.overlay_dir, self.upstream.get, None)
                        for path in sorted(self.overlay_files))
        self.manifest = Manifest(VERSION, wheel.filename, wheel.sha256, entries)
        self.manifest_path.write_bytes(manifest_bytes(self.manifest))

    def apply(self, **kwargs) -> dict:
        return overlay.apply(self.site, "glm5-dsa", self.manifest_path, self.overlay_dir, **kwargs)

    def verify(self, **kwargs) -> list[str]:
        return overlay.verify(self.site, self.manifest_path, **kwargs)

    def revert(self, **kwargs) -> list[str]:
        return overlay.revert(self.site, self.manifest_path, **kwargs)

    def common(self) -> list[str]:
        return ["--manifest", str(self.manifest_path), "--overlay-dir", str(self.overlay_dir)]

    def state(self) -> str:
        """'upstream', 'overlay' (with its receipt, hashes verified) or a description of a
        mixed tree: after any interruption only the first two are allowed."""
        files = {rel: (self.site / rel).read_bytes() if (self.site / rel).is_file() else None for rel in SOURCES}
        receipt = (self.site / overlay.RECEIPT_NAME).is_file()
        stash = (self.site / ".vllm_overlay_txn").exists()  # overlay.TXN_DIR_NAME; literal: base code has none
        if all(files[r] == self.upstream.get(r) for r in SOURCES) and not receipt and not stash:
            return "upstream"
        if all(files[r] == self.overlay_files[r] for r in SOURCES) and receipt and not stash:
            overlay.verify_hashes(self.site, self.manifest_path)
            return "overlay"
        return f"mixed: {files}, receipt={receipt}, stash={stash}"


def syscall_path(path, dir_fd: int | None = None) -> Path:
    """The real path an os call names, for fault injection: overlay_fs passes a bare name and
    a descriptor of its directory (an *at() call)."""
    if dir_fd is None:
        return Path(os.path.realpath(path))
    return Path(os.readlink(f"/proc/self/fd/{dir_fd}")) / path


def expect_error(code: int, fn, *args, **kwargs) -> str:
    with pytest.raises(overlay.OverlayError) as caught:
        fn(*args, **kwargs)
    assert caught.value.exit_code == code, str(caught.value)
    return str(caught.value)


def run_cli(*args: str, env: dict | None = None, timeout: float = 120, python: str = sys.executable,
            **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-B", str(TOOL), *args], capture_output=True, text=True, env=env,
                          cwd="/", timeout=timeout, **kwargs)


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"{what} needs root (mount, chown or another user); run the tests as root to cover it")


@contextlib.contextmanager
def tmpfs(size: str, inodes: int):
    """A fresh tmpfs of `size` bytes and `inodes` inodes: a real full disk, not a mock. Skips
    where mounting is not allowed (an unprivileged container, a Docker build)."""
    need_root("a tmpfs mount")
    mountpoint = Path(tempfile.mkdtemp(prefix="overlay-tmpfs-"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes={inodes},mode=755", "tmpfs",
                           str(mountpoint)], capture_output=True, text=True)
    if done.returncode != 0:
        mountpoint.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): the full-disk cases "
                    "need one; they run where the tests run as root with CAP_SYS_ADMIN")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)
        shutil.rmtree(mountpoint, ignore_errors=True)


def fill_inodes(mountpoint: Path, leave: int) -> Path:
    """Create empty files until exactly `leave` inodes are free; returns their directory."""
    filler = mountpoint / "filler"
    filler.mkdir()
    i = 0
    while os.statvfs(mountpoint).f_ffree > leave:
        (filler / str(i)).touch()
        i += 1
    assert os.statvfs(mountpoint).f_ffree == leave
    return filler


def fill_bytes(mountpoint: Path, leave: int) -> Path:
    """One file taking all but about `leave` bytes of the filesystem (tmpfs counts pages)."""
    filler = mountpoint / "filler.bin"
    st = os.statvfs(mountpoint)
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return filler
