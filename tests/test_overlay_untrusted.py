"""What apply, revert and verify read back from a site others may write, tried the way an
attacker would: planted journals and originals' indexes, symlinks inside vllm/, FIFOs, files,
symlinks and someone else's directories at the stash names, an import hook a .pth file
installs, and the probe file a SIGKILL leaves. Real files, FIFOs, symlinks, a real virtual
environment and real second processes; each case checks that a victim file (outside the site,
or in it but not the overlay's) is untouched, and that the tool neither hangs nor tracebacks.
"""

from __future__ import annotations

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

from overlay_helpers import TOOL, UPSTREAM, Tree, need_root, run_cli, snapshot

TXN, ORIGINALS = ".vllm_overlay_txn", ".vllm_overlay_originals"
NOBODY = 65534
PYC = f"mod.{sys.implementation.cache_tag}.pyc"


@pytest.fixture
def tree(tmp_path, monkeypatch) -> Tree:
    tree = Tree(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tree.site))  # for verify's import probe
    return tree


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory outside the site holding a file no command asked the tool to touch."""
    directory = tmp_path / "outside"
    directory.mkdir()
    (directory / "victim.txt").write_text("keep me\n")
    (directory / PYC).write_bytes(b"someone's bytecode-named file\n")
    return directory


def cli(tree: Tree, command: str, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        return run_cli(*tree.common(), command, "--site-packages", str(tree.site), *extra, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`{command}` hung (killed after {timeout:g} s)")


def refused(done: subprocess.CompletedProcess, *words: str) -> None:
    """Exit 4 with one `error:` message (no traceback) holding `words`."""
    assert done.returncode == overlay.CANNOT_WRITE, done.stderr
    assert "Traceback" not in done.stderr and "error: " in done.stderr, done.stderr
    for word in words:
        assert word in done.stderr, done.stderr


def advised(message: str, command: str) -> list[str]:
    found = re.findall(rf"`python3 scripts/overlay\.py ({command} --site-packages [^`]+)`", message)
    assert found, f"no `{command}` advice in: {message}"
    return shlex.split(found[-1])


# --- item 1, 2: a journal a killed run "left" -----------------------------------------------------


def plant_journal(tree: Tree, outside: Path, case: str) -> None:
    receipt = str(outside / "r.json")
    if case == "through-a-symlinked-directory":
        (tree.site / "vllm" / "evil").symlink_to(outside)
    if case == "managed-path-through-a-symlinked-pycache":
        (tree.site / "vllm" / "a" / "__pycache__").symlink_to(outside)
    slots = {
        "receipt-outside-the-site": [{"path": receipt, "orig": None, "new": "victim.txt"}],
        "receipt-outside-renamed-over": [{"path": receipt, "orig": "victim.txt", "new": ".r.json.vllm-overlay.new"}],
        "a-file-the-manifest-does-not-name": [{"path": "six.py", "orig": None, "new": "0.new"}],
        "through-a-symlinked-directory": [{"path": "vllm/evil/victim.txt", "orig": None, "new": "0.new"}],
        "managed-path-through-a-symlinked-pycache": [{"path": f"vllm/a/__pycache__/{PYC}", "orig": None, "new": "0.new"}],
    }[case]
    (tree.site / TXN).mkdir()
    (tree.site / TXN / "journal.json").write_text(json.dumps({
        "kind": "apply", "receipt": receipt if case.startswith("receipt") else overlay.RECEIPT_NAME,
        "dirs": [], "slots": slots}))


@pytest.mark.parametrize("command", ["apply", "revert"])
@pytest.mark.parametrize("case", ["receipt-outside-the-site", "receipt-outside-renamed-over",
                                  "a-file-the-manifest-does-not-name", "through-a-symlinked-directory",
                                  "managed-path-through-a-symlinked-pycache"])
def test_a_planted_journal_is_refused_and_touches_nothing(tree, outside, case, command):
    (tree.site / "six.py").write_text("another package's module\n")
    plant_journal(tree, outside, case)
    before, around = snapshot(tree.site), snapshot(outside)
    done = cli(tree, command)
    assert snapshot(outside) == around and (tree.site / "six.py").read_text() == "another package's module\n"
    refused(done, "nothing was changed")
    assert snapshot(tree.site) == before


def test_apply_never_writes_through_a_symlinked_directory_in_vllm(tree, outside):
    """`vllm/a -> elsewhere` holding copies of the upstream files: apply would stash, replace
    and create files there."""
    for rel in ("vllm/a/__init__.py", "vllm/a/mod.py"):
        (outside / Path(rel).name).write_bytes(UPSTREAM[rel])
    (tree.site / "vllm" / "a" / "__init__.py").unlink()
    (tree.site / "vllm" / "a" / "mod.py").unlink()
    (tree.site / "vllm" / "a").rmdir()
    (tree.site / "vllm" / "a").symlink_to(outside)
    before, around = snapshot(tree.site), snapshot(outside)
    for command in ("apply", "revert"):
        done = cli(tree, command)
        assert snapshot(outside) == around
        refused(done, f"{tree.site / 'vllm' / 'a'} is a symlink", "Nothing was changed", "rm ")
        assert snapshot(tree.site) == before


# --- item 3, 5, 6: something that is not our directory at a stash name -----------------------------


def plant_at(tree: Tree, outside: Path, name: str, kind: str) -> None:
    path = tree.site / name
    index = {"kind": "apply", "receipt": overlay.RECEIPT_NAME, "dirs": [], "slots": []}
    (outside / "index.json").write_text(json.dumps(index))  # what would make a finish empty the directory
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "file":
        path.write_text("not a directory\n")
    elif kind == "symlink-to-a-directory":
        path.symlink_to(outside)
    elif kind == "dangling-symlink":
        path.symlink_to(outside / "absent")
    else:
        need_root("a directory owned by another user")
        path.mkdir()
        (path / "index.json").write_text(json.dumps(index))
        (path / "theirs.txt").write_text("keep me\n")
        for planted in (path, path / "index.json", path / "theirs.txt"):
            os.lchown(planted, NOBODY, NOBODY)


WHAT = {"fifo": "a FIFO", "file": "a regular file", "symlink-to-a-directory": "a symlink",
        "dangling-symlink": "a dangling symlink", "someone-elses-directory": f"owned by uid {NOBODY}"}


@pytest.mark.parametrize("command", ["apply", "revert"])
@pytest.mark.parametrize("name", [TXN, ORIGINALS])
@pytest.mark.parametrize("kind", list(WHAT))
def test_anything_but_our_directory_at_a_stash_name_is_refused_without_hanging(tree, outside, name, kind, command):
    """A FIFO there hung apply and revert for good (signals blocked, lock held); a file or a
    symlink was a traceback; a symlink to a directory holding an index.json made apply delete
    every other file in it."""
    plant_at(tree, outside, name, kind)
    before, around = snapshot(tree.site), snapshot(outside)
    done = cli(tree, command, timeout=30)
    assert snapshot(outside) == around
    refused(done, WHAT[kind], "not a stash directory this tool made", "Nothing was changed", "mv ")
    assert snapshot(tree.site) == before
    move = re.search(r"`(mv [^`]+)`", done.stderr)
    subprocess.run(shlex.split(move.group(1)), check=True)  # the advice, followed
    again = cli(tree, "apply")
    assert again.returncode == 0 and tree.state() == "overlay", again.stderr
    assert snapshot(outside) == around


@pytest.mark.parametrize("kind", ["fifo", "file", "dangling-symlink"])
def test_verify_says_what_is_at_the_stash_name(tree, outside, kind):
    assert cli(tree, "apply").returncode == 0
    plant_at(tree, outside, TXN, kind)
    done = cli(tree, "verify", timeout=30)
    assert done.returncode == overlay.MISMATCH and WHAT[kind] in done.stderr and "mv " in done.stderr, done.stderr
    assert "killed" not in done.stderr


def test_verify_refuses_a_fifo_at_a_bytecode_path_without_hanging(tree):
    assert cli(tree, "apply").returncode == 0
    fifo = tree.site / "vllm" / "a" / "__pycache__" / "mod.cpython-39.pyc"
    os.mkfifo(fifo)
    done = cli(tree, "verify", timeout=30)
    assert done.returncode == overlay.MISMATCH and "not a regular file" in done.stderr and f"rm {fifo}" in done.stderr


# --- item 4: the receipt the originals' index names -------------------------------------------------


@pytest.mark.parametrize("where", ["in-the-site", "outside"])
def test_revert_never_deletes_the_file_a_planted_index_names_as_the_receipt(tree, outside, where):
    """No killed run needed: the index kept after apply named any regular file as the receipt,
    and revert deleted it, leaving the real receipt behind."""
    victim = tree.site / "six.py" if where == "in-the-site" else outside / "victim.txt"
    victim.write_text("keep me\n")
    assert cli(tree, "apply").returncode == 0
    index_path = tree.site / ORIGINALS / "index.json"
    index = json.loads(index_path.read_text())
    index["receipt"] = "six.py" if where == "in-the-site" else str(victim)
    index_path.write_text(json.dumps(index))
    applied = snapshot(tree.site)
    done = cli(tree, "revert")
    assert victim.exists() and victim.read_text() == "keep me\n"
    refused(done, f"names the receipt {victim}", "nothing was changed")
    assert snapshot(tree.site) == applied
    real = tree.site / overlay.RECEIPT_NAME
    follow = run_cli(*tree.common(), *advised(done.stderr, "revert"))  # the "otherwise" advice: the real receipt
    assert follow.returncode == 0, follow.stderr
    assert not real.exists() and victim.read_text() == "keep me\n"
    assert tree.state() == "upstream"


# --- item 10: an import hook a .pth file installs ---------------------------------------------------


HOOKS = {
    # Python's own loader, its exec_module replaced on the instance: isinstance and get_code agree.
    "loader-patched": '''
import importlib.machinery, sys
class Finder:
    def find_spec(self, name, path=None, target=None):
        if name != "vllm.a.mod":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        real = spec.loader.exec_module
        def exec_module(module):
            real(module)
            module.VALUE = "hooked"
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Finder())
''',
    # A subclass of the source loader that only changes exec_module.
    "loader-subclass": '''
import importlib.machinery, sys
class Loader(importlib.machinery.SourceFileLoader):
    def exec_module(self, module):
        super().exec_module(module)
        module.value = lambda: "hooked"
class Finder:
    def find_spec(self, name, path=None, target=None):
        if name != "vllm.a.mod":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        spec.loader = Loader(spec.loader.name, spec.loader.path)
        return spec
sys.meta_path.insert(0, Finder())
''',
    # The genuine import, then the module's function replaced when a later import asks.
    "function-replaced-later": '''
import sys
class Finder:
    def find_spec(self, name, path=None, target=None):
        mod = sys.modules.get("vllm.a.mod")
        if mod is not None:
            mod.value = lambda: "hooked"
        return None
sys.meta_path.insert(0, Finder())
''',
}
HOOKED_OVERLAY = {"vllm/envs.py": b"FLAG = 'overlay'\n", "vllm/a/mod.py": b"VALUE = 'overlay'\n\ndef value():\n    return VALUE\n",
                  "vllm/a/new.py": b"NEW = True\n"}


@pytest.fixture
def venv(tmp_path) -> tuple[str, Path]:
    """A real virtual environment: .pth files in its site-packages run at start-up."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    return python, Path(site)


def install_hook(site: Path, hook: str) -> None:
    (site / "overlay_hook.py").write_text(hook)
    (site / "overlay_hook.pth").write_text("import overlay_hook\n")


@pytest.mark.parametrize("hook", list(HOOKS))
def test_verify_catches_an_import_hook_that_changes_what_an_overlaid_module_runs(tmp_path, venv, hook, monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    python, site = venv
    tree = Tree(tmp_path, site=site, overlay_files=HOOKED_OVERLAY)
    assert cli(tree, "apply").returncode == 0
    assert cli(tree, "verify", "--python", python).returncode == 0
    install_hook(site, HOOKS[hook])
    done = cli(tree, "verify", "--python", python)
    assert done.returncode == overlay.MISMATCH, done.stderr
    assert "vllm.a.mod: Python does not run the installed" in done.stderr and "Traceback" not in done.stderr


def test_verify_says_what_a_hook_could_do_that_it_cannot_see(tmp_path, venv, monkeypatch):
    """A constant rewritten after import leaves every code object intact: verify cannot prove
    it away, so it names the hook and says what it did not check."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    python, site = venv
    tree = Tree(tmp_path, site=site, overlay_files=HOOKED_OVERLAY)
    assert cli(tree, "apply").returncode == 0
    clean = cli(tree, "verify", "--python", python)
    assert clean.returncode == 0 and "Python's own only" in clean.stderr, clean.stderr
    install_hook(site, HOOKS["function-replaced-later"].replace('mod.value = lambda: "hooked"', 'mod.VALUE = "hooked"'))
    done = cli(tree, "verify", "--python", python)
    assert done.returncode == 0, done.stderr
    assert "overlay_hook.Finder" in done.stderr and "overlay_hook.pth" in done.stderr, done.stderr
    assert "cannot see" in done.stderr and "constants" in done.stderr


# --- item 11: the writability probe and SIGKILL ------------------------------------------------------

PROBE_DRIVER = r"""
import os, runpy, sys, tempfile, time
tool, marker = sys.argv[1:3]
real_mkstemp = tempfile.mkstemp

def mkstemp(*args, **kwargs):
    made = real_mkstemp(*args, **kwargs)
    if kwargs.get("prefix") == ".overlay-probe.":
        open(marker, "w").close()
        time.sleep(120)
    return made

tempfile.mkstemp = mkstemp
sys.argv = [tool, *sys.argv[3:]]
runpy.run_path(tool, run_name="__main__")
"""


def probes(site: Path) -> list[Path]:
    return sorted(site.rglob(".overlay-probe.*"))


@pytest.mark.parametrize("then", ["apply", "revert"])
def test_a_probe_file_a_sigkill_left_is_removed_by_the_next_run(tree, tmp_path, then):
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-B", "-c", PROBE_DRIVER, str(TOOL), str(marker), *tree.common(),
                             "apply", "--site-packages", str(tree.site)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert len(probes(tree.site)) == 1
    done = cli(tree, then)
    assert done.returncode == 0, done.stderr
    assert probes(tree.site) == []
    assert tree.state() == ("overlay" if then == "apply" else "upstream")
