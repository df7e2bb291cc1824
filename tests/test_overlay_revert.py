"""The way back, and every piece of advice the tool prints, followed to the letter.

revert restores upstream vLLM from the originals apply kept. The pip cases use real pip on a
real (fake, offline) vLLM wheel in a real virtual environment: `pip install --force-reinstall`
rewrites only what the wheel's RECORD lists, leaving the overlay's new file, its bytecode, the
receipt and the kept originals behind."""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import py_compile
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dsa_image.overlay import cli as overlay

from overlay_helpers import (OVERLAY, SOURCES, UPSTREAM, VERSION, Tree, expect_error, run_cli, snapshot,
                             syscall_path)

ORIGINALS = ".vllm_overlay_originals"


@pytest.fixture
def tree(tmp_path, monkeypatch) -> Tree:
    tree = Tree(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tree.site))
    return tree


def cli(tree: Tree, *args: str, python: str | None = None) -> subprocess.CompletedProcess:
    extra = ["--python", python] if python and args[0] == "verify" else []
    return run_cli(*tree.common(), *args, "--site-packages", str(tree.site), *extra)


def advised(message: str, command: str) -> list[str]:
    """The `scripts/overlay.py COMMAND ...` the message tells the user to run, as argv."""
    found = re.findall(rf"`python3 scripts/overlay\.py ({command} --site-packages [^`]+)`", message)
    assert found, f"no `{command}` advice in: {message}"
    return shlex.split(found[0])


def follow(tree: Tree, message: str, command: str) -> subprocess.CompletedProcess:
    return run_cli(*tree.common(), *advised(message, command))


# --- revert on a plain tree --------------------------------------------------------------------


def test_revert_restores_upstream_byte_for_byte_bytecode_included(tree):
    for rel in UPSTREAM:  # as pip leaves it: timestamp bytecode of every upstream module
        py_compile.compile(str(tree.site / rel), doraise=True)
    before = snapshot(tree.site)
    tree.apply()
    assert (tree.site / ORIGINALS).is_dir()
    lines = tree.revert()
    assert any(line.startswith("restored ") for line in lines) and any(line.startswith("removed ") for line in lines)
    assert snapshot(tree.site) == before and tree.state() == "upstream"
    assert not (tree.site / ORIGINALS).exists()
    assert "nothing to revert" in tree.revert()[-1]
    tree.apply()
    tree.verify()


def test_revert_cli_then_apply_again(tree):
    before = snapshot(tree.site)
    assert cli(tree, "apply").returncode == 0
    done = cli(tree, "revert")
    assert done.returncode == 0, done.stderr
    assert snapshot(tree.site) == before
    assert cli(tree, "apply").returncode == 0 and cli(tree, "verify").returncode == 0


def test_revert_failing_midway_leaves_the_overlay_whole(tree, monkeypatch):
    """revert is a transaction too: refused at the overlay's new file, after vllm/a/mod.py was
    already swapped back to upstream, it puts mod.py's overlay back as well."""
    tree.apply()
    applied = snapshot(tree.site)
    real_rename = os.rename

    def rename(src, dst, *args, src_dir_fd=None, **kwargs):
        if syscall_path(src, src_dir_fd) == syscall_path(tree.site / "vllm/a/new.py"):
            raise PermissionError(errno.EACCES, "injected refusal", str(src))
        return real_rename(src, dst, *args, src_dir_fd=src_dir_fd, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    message = expect_error(overlay.CANNOT_WRITE, tree.revert)
    monkeypatch.setattr(os, "rename", real_rename)
    assert "every file was restored" in message
    assert snapshot(tree.site) == applied and tree.state() == "overlay"
    tree.revert()
    assert tree.state() == "upstream"


def test_revert_refuses_a_file_it_does_not_recognise_and_its_advice_is_a_reinstall(tree):
    tree.apply()
    (tree.site / "vllm/envs.py").write_bytes(b"edited by hand\n")
    applied = snapshot(tree.site)
    message = expect_error(overlay.DRIFT, tree.revert)
    assert f"python -m pip install --force-reinstall --no-deps vllm=={VERSION}" in message
    assert snapshot(tree.site) == applied


# --- advice on plain trees, followed -----------------------------------------------------------


def test_second_apply_advice_revert_works(tree):
    assert cli(tree, "apply").returncode == 0
    again = cli(tree, "apply")
    assert again.returncode == overlay.DRIFT and "already carries the overlay" in again.stderr
    done = follow(tree, again.stderr, "revert")
    assert done.returncode == 0, done.stderr
    assert cli(tree, "apply").returncode == 0 and tree.state() == "overlay"


def test_missing_receipt_advice_chain_works(tree):
    assert cli(tree, "apply").returncode == 0
    (tree.site / overlay.RECEIPT_NAME).unlink()
    verify = cli(tree, "verify")
    assert verify.returncode == overlay.MISMATCH
    apply = follow(tree, verify.stderr, "apply")
    assert apply.returncode == overlay.DRIFT  # the files still carry the overlay, so:
    assert follow(tree, apply.stderr, "revert").returncode == 0
    assert cli(tree, "apply").returncode == 0 and cli(tree, "verify").returncode == 0


@pytest.mark.parametrize("garbage", [b"{", b"[]", b"[" * 100_000 + b"]" * 100_000])
def test_broken_receipt_advice_works(tree, garbage):
    assert cli(tree, "apply").returncode == 0
    (tree.site / overlay.RECEIPT_NAME).write_bytes(garbage)
    verify = cli(tree, "verify")
    assert verify.returncode in (overlay.MISMATCH, overlay.BAD_INPUT) and "Traceback" not in verify.stderr
    if verify.returncode == overlay.MISMATCH:
        assert follow(tree, verify.stderr, "revert").returncode == 0
    else:  # too deeply nested: still a receipt file at the default path, revert removes it
        assert cli(tree, "revert").returncode == 0
    assert cli(tree, "apply").returncode == 0 and cli(tree, "verify").returncode == 0


def test_new_file_changed_after_apply_advice_works(tree):
    assert cli(tree, "apply").returncode == 0
    new = tree.site / "vllm/a/new.py"
    new.write_bytes(b"NEW = 'edited'\n")
    verify = cli(tree, "verify")
    assert verify.returncode == overlay.MISMATCH and f"`rm {new}`" in verify.stderr, verify.stderr
    new.unlink()
    assert follow(tree, verify.stderr, "revert").returncode == 0
    assert cli(tree, "apply").returncode == 0 and cli(tree, "verify").returncode == 0


def test_a_foreign_file_where_the_overlay_adds_one_advice_works(tree):
    new = tree.site / "vllm/a/new.py"
    new.write_bytes(b"someone else's\n")
    apply = cli(tree, "apply")
    assert apply.returncode == overlay.DRIFT and "never overwrites" in apply.stderr
    move = re.search(r"`(mv [^`]+)`", apply.stderr)
    assert move, apply.stderr
    subprocess.run(shlex.split(move.group(1)), check=True)
    assert cli(tree, "apply").returncode == 0 and tree.state() == "overlay"


# --- pip on a real environment -------------------------------------------------------------------


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(directory: Path, version: str) -> Path:
    """A pure-python vllm wheel holding the synthetic upstream files, with a proper RECORD."""
    info = f"vllm-{version}.dist-info"
    files = {**UPSTREAM, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: overlay-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},{record_hash(data)},{len(data)}\n" for name, data in files.items()) + f"{info}/RECORD,,\n"
    wheel = directory / f"vllm-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in {**files, f"{info}/RECORD": record.encode()}.items():
            archive.writestr(name, data)
    return wheel


class Env:
    """A virtual environment with the fake vLLM installed by pip (run from this python with
    --python, so the environment itself needs no pip)."""

    def __init__(self, root: Path):
        self.wheels = root / "wheels"
        self.wheels.mkdir(parents=True)
        for version in (VERSION, "0.25.0"):
            build_wheel(self.wheels, version)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
        self.python = str(root / "venv" / "bin" / "python")
        self.site = Path(subprocess.run([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        capture_output=True, text=True, check=True).stdout.strip())

    def pip(self, *args: str) -> None:
        done = subprocess.run([sys.executable, "-m", "pip", "--python", self.python, *args, "--no-index", "--find-links",
                               str(self.wheels), "--disable-pip-version-check", "--no-cache-dir"],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr

    def follow_pip_advice(self, message: str) -> None:
        found = re.findall(r"`python -m pip (install [^`]+)`", message)
        assert found, f"no pip advice in: {message}"
        self.pip(*shlex.split(found[0]))


@pytest.fixture
def env(tmp_path) -> Env:
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        pytest.skip(f"pip is not installed for {sys.executable}: the reinstall cases need it")
    env = Env(tmp_path / "env")
    env.pip("install", "--no-deps", f"vllm=={VERSION}")
    return env


@pytest.fixture
def pip_tree(tmp_path, env) -> Tree:
    return Tree(tmp_path, site=env.site, installed=True)


def overlay_leftovers(site: Path) -> list[str]:
    names = ["vllm/a/new.py", overlay.RECEIPT_NAME, ORIGINALS]
    return [n for n in names if (site / n).exists()] + [p.name for p in (site / "vllm/a/__pycache__").glob("new.*.pyc")]


def test_apply_after_pip_force_reinstall_works(pip_tree, env):
    """The reported dead end: the reinstall left the overlay's own files, and apply then
    refused with `install vLLM 0.24.0`, which is what had just been done."""
    assert cli(pip_tree, "apply").returncode == 0
    env.pip("install", "--force-reinstall", "--no-deps", f"vllm=={VERSION}")
    assert {rel: (pip_tree.site / rel).read_bytes() for rel in SOURCES if rel in UPSTREAM} == \
        {rel: UPSTREAM[rel] for rel in SOURCES if rel in UPSTREAM}
    assert "vllm/a/new.py" in overlay_leftovers(pip_tree.site) and overlay.RECEIPT_NAME in overlay_leftovers(pip_tree.site)
    done = cli(pip_tree, "apply")
    assert done.returncode == 0, done.stderr
    verify = cli(pip_tree, "verify", python=env.python)
    assert verify.returncode == 0, verify.stderr


def test_revert_after_pip_force_reinstall_removes_only_the_leftovers(tmp_path, env):
    fresh = snapshot(env.site)
    tree = Tree(tmp_path, site=env.site, installed=True)
    assert cli(tree, "apply").returncode == 0
    env.pip("install", "--force-reinstall", "--no-deps", f"vllm=={VERSION}")
    reinstalled = snapshot(env.site)
    done = cli(tree, "revert")
    assert done.returncode == 0, done.stderr
    assert overlay_leftovers(env.site) == []
    after = snapshot(env.site)
    assert set(after) == {k for k in reinstalled if k in fresh}  # exactly pip's files, nothing of ours
    assert all(after[k] == reinstalled[k] for k in after)


@pytest.mark.parametrize("damage", ["edited", "deleted", "directory-gone"])
def test_drift_advice_reinstall_then_apply_works(pip_tree, env, damage):
    target = pip_tree.site / "vllm/a/mod.py"
    if damage == "edited":
        target.write_bytes(b"VALUE = 'edited'\n")
    elif damage == "deleted":
        target.unlink()
    else:
        shutil.rmtree(target.parent)
    apply = cli(pip_tree, "apply")
    assert apply.returncode == overlay.DRIFT and "Nothing was changed" in apply.stderr, apply.stderr
    env.follow_pip_advice(apply.stderr)
    done = cli(pip_tree, "apply")
    assert done.returncode == 0, done.stderr
    assert cli(pip_tree, "verify", python=env.python).returncode == 0


def test_replaced_file_changed_after_apply_advice_works(pip_tree, env):
    assert cli(pip_tree, "apply").returncode == 0
    (pip_tree.site / "vllm/envs.py").write_bytes(b"FLAG = 'edited after apply'\n")
    verify = cli(pip_tree, "verify", python=env.python)
    assert verify.returncode == overlay.MISMATCH and "changed after apply" in verify.stderr
    env.follow_pip_advice(verify.stderr)
    assert follow(pip_tree, verify.stderr, "apply").returncode == 0
    assert cli(pip_tree, "verify", python=env.python).returncode == 0


def test_revert_refusal_advice_reinstall_then_revert_works(pip_tree, env):
    assert cli(pip_tree, "apply").returncode == 0
    (pip_tree.site / "vllm/envs.py").write_bytes(b"edited by hand\n")
    revert = cli(pip_tree, "revert")
    assert revert.returncode == overlay.DRIFT, revert.stderr
    env.follow_pip_advice(revert.stderr)
    done = cli(pip_tree, "revert")
    assert done.returncode == 0, done.stderr
    assert overlay_leftovers(pip_tree.site) == [] and pip_tree.state() == "upstream"


def test_wrong_vllm_version_advice_works(tmp_path, env):
    env.pip("install", "--no-deps", "vllm==0.25.0")
    tree = Tree(tmp_path, site=env.site, installed=True)
    apply = cli(tree, "apply")
    assert apply.returncode == overlay.DRIFT and "installed vLLM is 0.25.0" in apply.stderr, apply.stderr
    env.follow_pip_advice(apply.stderr)
    assert cli(tree, "apply").returncode == 0
    assert cli(tree, "verify", python=env.python).returncode == 0
    assert set(OVERLAY) <= {p.relative_to(env.site).as_posix() for p in env.site.rglob("*.py")}


def test_vllm_upgraded_after_apply_advice_works(pip_tree, env):
    assert cli(pip_tree, "apply").returncode == 0
    env.pip("install", "--no-deps", "vllm==0.25.0")
    verify = cli(pip_tree, "verify", python=env.python)
    assert verify.returncode == overlay.MISMATCH and "installed vLLM is 0.25.0" in verify.stderr, verify.stderr
    env.follow_pip_advice(verify.stderr)
    assert follow(pip_tree, verify.stderr, "apply").returncode == 0
    assert cli(pip_tree, "verify", python=env.python).returncode == 0
