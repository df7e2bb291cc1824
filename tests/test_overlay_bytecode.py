"""verify checks what Python executes, not only which file it names: bytecode planted next to
an overlaid module (unchecked-hash, a timestamp .pyc whose header matches the source, a stale
checked-hash .pyc, one under PYTHONPYCACHEPREFIX) runs upstream code while __file__ still
points at the overlay. Each plant is first shown to work (a fresh python runs upstream code),
then verify must refuse it, and its advice must clear it. verify itself writes no bytecode."""

from __future__ import annotations

import importlib.util
import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

from dsa_image.overlay import cli as overlay

from overlay_helpers import UPSTREAM, Tree, expect_error, run_cli

MODES = py_compile.PycInvalidationMode


@pytest.fixture
def applied(tmp_path, monkeypatch) -> Tree:
    tree = Tree(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tree.site))
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    tree.apply()
    return tree


def plant(tree: Tree, pyc: Path, mode: MODES, opt: int = -1, rel: str = "vllm/envs.py") -> None:
    """Bytecode of the upstream source at `pyc`; a timestamp one gets the header of the
    installed overlay file (its mtime and size), so Python trusts it."""
    source = tree.site / rel
    upstream = pyc.parent / "upstream-source.py"
    pyc.parent.mkdir(parents=True, exist_ok=True)
    upstream.write_bytes(UPSTREAM[rel])
    py_compile.compile(str(upstream), cfile=str(pyc), dfile=str(source), doraise=True, invalidation_mode=mode,
                       optimize=opt)
    upstream.unlink()
    if mode == MODES.TIMESTAMP:
        st = source.stat()
        header = (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
        data = pyc.read_bytes()
        pyc.write_bytes(data[:8] + header + data[16:])


def runs(flags: list[str], env: dict | None = None) -> str:
    """What vllm.envs.FLAG a fresh python sees (-B: this check writes nothing either)."""
    done = subprocess.run([sys.executable, "-B", *flags, "-c", "import vllm.envs; print(vllm.envs.FLAG)"],
                          capture_output=True, text=True, cwd="/", env=env, check=True)
    return done.stdout.strip()


def cache(tree: Tree, opt: int | str = "") -> Path:
    return Path(importlib.util.cache_from_source(str(tree.site / "vllm/envs.py"), optimization=opt))


@pytest.mark.parametrize("mode, opt, flags", [
    (MODES.UNCHECKED_HASH, "", []),
    (MODES.UNCHECKED_HASH, 1, ["-O"]),
    (MODES.TIMESTAMP, "", []),
    (MODES.TIMESTAMP, 2, ["-OO"]),
    (MODES.CHECKED_HASH, "", ["--check-hash-based-pycs", "never"]),
], ids=["unchecked-hash", "unchecked-hash-opt1", "timestamp-header-matches", "timestamp-opt2", "stale-checked-hash"])
def test_verify_refuses_bytecode_that_runs_upstream_code(applied, mode, opt, flags):
    pyc = cache(applied, opt)
    plant(applied, pyc, mode, opt=opt or 0)
    assert runs([]) == ("upstream" if not flags else "overlay")
    assert runs(flags) == "upstream"  # the plant really takes over the module
    message = expect_error(overlay.MISMATCH, applied.verify)
    assert str(pyc) in message and "vllm/envs.py" in message, message
    assert f"rm {pyc}" in message  # the advice, followed:
    pyc.unlink()
    applied.verify()
    assert runs(flags) == "overlay"


def test_verify_cli_exits_1_on_an_unchecked_hash_pyc(applied):
    plant(applied, cache(applied), MODES.UNCHECKED_HASH)
    done = run_cli(*applied.common(), "verify", "--site-packages", str(applied.site))
    assert done.returncode == overlay.MISMATCH and "unchecked-hash" in done.stderr, done.stderr


def test_verify_checks_the_bytecode_python_reads_under_a_pycache_prefix(applied, tmp_path, monkeypatch):
    prefix = tmp_path / "pycache-prefix"
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(prefix)}
    pyc = Path(subprocess.run([sys.executable, "-c", "import importlib.util, sys; "
                               "print(importlib.util.cache_from_source(sys.argv[1]))", str(applied.site / "vllm/envs.py")],
                              capture_output=True, text=True, env=env, check=True).stdout.strip())
    assert pyc.is_relative_to(prefix)
    plant(applied, pyc, MODES.TIMESTAMP)
    assert runs([], env) == "upstream"
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(prefix))
    message = expect_error(overlay.MISMATCH, applied.verify)
    assert "vllm.envs" in message and str(pyc) in message, message


def test_apply_writes_only_checked_hash_bytecode_verify_accepts(applied):
    for pyc in applied.site.rglob("*.pyc"):
        flags = int.from_bytes(pyc.read_bytes()[4:8], "little")
        assert flags == 0b11, pyc
    applied.verify()


def test_verify_writes_no_bytecode_into_the_target(applied):
    before = sorted(p.relative_to(applied.site) for p in applied.site.rglob("*.pyc"))
    assert not (applied.site / f"vllm/__pycache__/__init__.{sys.implementation.cache_tag}.pyc").exists()
    applied.verify()
    done = run_cli(*applied.common(), "verify", "--site-packages", str(applied.site))
    assert done.returncode == 0, done.stderr
    assert sorted(p.relative_to(applied.site) for p in applied.site.rglob("*.pyc")) == before
