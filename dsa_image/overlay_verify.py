"""verify: the receipt is the one apply wrote, every installed file still hashes to it, and
what Python actually executes for each overlaid module is compiled from those files.

The last part matters because Python may run bytecode without reading the source: an
unchecked-hash .pyc is trusted blindly, and a timestamp .pyc whenever its header matches the
source's mtime and size. So verify refuses unchecked-hash bytecode of an overlaid module (apply
writes only checked-hash .pyc), and its import probe, in the target interpreter, compares the
code of every .pyc that interpreter would load (each optimization level) and of the loaded
module itself with the code compiled from the installed source. The probe runs with -B and
PYTHONDONTWRITEBYTECODE=1: verify writes nothing into the target.
`dsa_image.overlay` re-exports it; import from there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import overlay_txn as txn
from .manifest import Entry, Manifest
from .overlay_core import (BAD_INPUT, LOCK_TIMEOUT, MISMATCH, RECEIPT_NAME, TOOL, TXN_DIR_NAME,
                           OverlayError, expected_receipt, file_sha256, installed_vllm_version, load_inputs,
                           load_receipt, reinstall_advice, require_dir, stale_bytecode)
from .recipe import DEFAULT_RECIPE, RECIPES_DIR

_FLAG_HASH, _FLAG_CHECK = 0b01, 0b10  # PEP 552 .pyc flags


def verify(site: Path, manifest_path: Path, receipt_path: Path | None = None,
           python: str = sys.executable, recipe_id: str = DEFAULT_RECIPE, lock_timeout: float = LOCK_TIMEOUT) -> list[str]:
    """Re-hash, then import in a fresh interpreter; raise OverlayError(MISMATCH) on any difference."""
    if "\0" in python or shutil.which(python) is None:
        raise OverlayError(BAD_INPUT, f"{python!r}: no such executable (--python)")
    manifest, lines = verify_hashes(site, manifest_path, receipt_path, recipe_id, lock_timeout=lock_timeout)
    return lines + check_imports(site, manifest.files, python)


def verify_hashes(site: Path, manifest_path: Path, receipt_path: Path | None = None,
                  recipe_id: str = DEFAULT_RECIPE, recipes_dir: Path = RECIPES_DIR,
                  lock_timeout: float = LOCK_TIMEOUT) -> tuple[Manifest, list[str]]:
    """The receipt is the one apply wrote for this recipe and manifest, every installed file
    still hashes to it, and no overlaid module has bytecode Python would run unchecked."""
    require_dir(site)
    _, manifest, raw = load_inputs(recipe_id, manifest_path, recipes_dir)
    receipt_path = receipt_path or site / RECEIPT_NAME
    with txn.site_lock(site, exclusive=False, timeout=lock_timeout):
        _no_interrupted_run(site)
        receipt = load_receipt(receipt_path, site)
        _check_receipt(receipt, receipt_path, site, recipe_id, manifest, raw)
        installed_version = installed_vllm_version(site)
        if installed_version != receipt["vllm_version"]:
            raise OverlayError(MISMATCH, (
                f"{site}: the receipt is for vLLM {receipt['vllm_version']}, the installed vLLM is {installed_version}. "
                f"{reinstall_advice(receipt['vllm_version'], site)}, then re-run `{TOOL} apply --site-packages {site}`"))
        for item in receipt["files"]:
            _unchanged(site, item, installed_version)
        _no_unchecked_bytecode(site, manifest)
    return manifest, [f"{len(receipt['files'])} files match the receipt {receipt_path}"]


def _unchanged(site: Path, item: dict, version: str) -> None:
    target = site / item["path"]
    found = file_sha256(target)
    if found == item["installed_sha256"]:
        return
    if item["upstream_sha256"]:
        fix = f"{reinstall_advice(version, site)}, then re-run `{TOOL} apply --site-packages {site}`"
    else:  # a file the overlay added: no reinstall touches it
        fix = f"delete it (`rm {target}`), then run `{TOOL} revert --site-packages {site}` and `apply` again"
    raise OverlayError(MISMATCH, f"{item['path']}: installed file has sha256 {found}, the receipt records "
                                 f"{item['installed_sha256']} (changed after apply). {fix}")


def _no_interrupted_run(site: Path) -> None:
    journal = site / TXN_DIR_NAME / txn.JOURNAL
    if os.path.lexists(site / TXN_DIR_NAME) and not os.path.lexists(site / TXN_DIR_NAME / txn.INDEX):
        raise OverlayError(MISMATCH, (
            f"{site}: an apply or revert was killed mid-way and left {journal}: the files may be half changed. "
            f"`{TOOL} apply --site-packages {site}` rolls it back and applies; `{TOOL} revert --site-packages {site}` "
            f"rolls it back to upstream vLLM"))


def _check_receipt(receipt: dict, receipt_path: Path, site: Path, recipe_id: str, manifest: Manifest,
                   manifest_raw: bytes) -> None:
    """The receipt must be the one apply writes for this recipe and manifest: any edit shows."""
    expected = expected_receipt(recipe_id, manifest, manifest_raw)
    applied_for = receipt["vllm_version"]
    if applied_for != manifest.vllm_version and receipt["manifest_sha256"] != expected["manifest_sha256"]:
        # Another base's overlay, applied as it should be: the base checked is the wrong one.
        raise OverlayError(MISMATCH, (
            f"{receipt_path}: apply wrote it for vLLM {applied_for}'s overlay; verify checks base "
            f"{manifest.vllm_version} (--vllm, default the recipe's default base). Check the base that is "
            f"installed: `{TOOL} verify --vllm {applied_for} --site-packages {site}`"))
    again = (f"re-apply with the recipe and manifest you mean: `{TOOL} revert --site-packages {site}`, "
             f"then `{TOOL} apply --site-packages {site}`")
    for key, what in (("manifest_sha256", "manifest sha256"), ("recipe", "recipe")):
        if receipt[key] != expected[key]:
            raise OverlayError(MISMATCH, f"{receipt_path}: written for {what} {receipt[key]!r}, verify expects "
                                         f"{expected[key]!r} (--recipe, --manifest); {again}")
    if receipt != expected:
        raise OverlayError(MISMATCH, f"{receipt_path}: does not match what apply writes for this manifest "
                                     f"(tampered receipt); {again}")


def _no_unchecked_bytecode(site: Path, manifest: Manifest) -> None:
    """Any interpreter tag, any optimization level: unchecked-hash bytecode runs whatever the
    source says, and apply never writes it."""
    for entry in manifest.files:
        source = site / entry.path
        for pyc in stale_bytecode(source) if source.suffix == ".py" else []:
            try:
                with open(pyc, "rb") as f:
                    flags = int.from_bytes(f.read(8)[4:8], "little")
            except OSError:
                continue
            if flags & _FLAG_HASH and not flags & _FLAG_CHECK:
                raise OverlayError(MISMATCH, (
                    f"{pyc}: unchecked-hash bytecode: Python runs it without reading {source}, whatever that holds "
                    f"(apply never writes one). Delete it (`rm {pyc}`) and re-run verify"))


_IMPORT_PROBE = r"""
import importlib, importlib.machinery, importlib.util, json, marshal, os, sys
MAGIC, FLAG_HASH, FLAG_CHECK = importlib.util.MAGIC_NUMBER, 0b01, 0b10

def loadable(pyc, origin, source):
    # The code in `pyc` when this interpreter would run it instead of compiling the source.
    try:
        with open(pyc, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if len(data) < 16 or data[:4] != MAGIC:
        return None
    flags = int.from_bytes(data[4:8], "little")
    if flags & FLAG_HASH:
        if flags & FLAG_CHECK and data[8:16] != importlib.util.source_hash(source):
            return "stale"  # ignored by default, run under --check-hash-based-pycs never
    else:
        st = os.stat(origin)
        if data[8:16] != ((int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")):
            return None  # stale timestamp: Python recompiles from the source
    return marshal.loads(data[16:])

def problems(name, module):
    spec = module.__spec__
    if not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
        return [f"loaded by {type(spec.loader).__name__}, not from its source"]
    origin = spec.origin
    with open(origin, "rb") as f:
        source = f.read()
    found = []
    if spec.loader.get_code(name) != compile(source, origin, "exec", dont_inherit=True):
        found.append("the code Python ran is not compiled from it")
    for opt in ("", 1, 2):
        pyc = importlib.util.cache_from_source(origin, optimization=opt)
        code = loadable(pyc, origin, source)
        expected = compile(source, origin, "exec", dont_inherit=True, optimize=opt or 0)
        if code is not None and code != expected:
            found.append(f"{pyc} is not compiled from it; delete it (rm {pyc})")
    return found

modules, out = json.loads(sys.argv[1]), sys.argv[2]
result = {"sys_path": sys.path, "modules": {}}
for name in modules:
    try:
        module = importlib.import_module(name)
        result["modules"][name] = {"file": getattr(module, "__file__", None), "problems": problems(name, module)}
    except BaseException as exc:
        result["modules"][name] = {"error": f"{type(exc).__name__}: {exc}"}
with open(out, "w") as f:
    json.dump(result, f)
"""


def check_imports(site: Path, entries: tuple[Entry, ...], python: str = sys.executable, timeout: float = 600) -> list[str]:
    """Import every overlaid module in a fresh `python` (cwd: an empty temp dir, environment as
    is, so a PYTHONPATH checkout or an editable install would win and be caught), require it
    to come from the installed path and to run code compiled from the installed source."""
    expected = {e.module: (site / e.path) for e in entries if e.module}
    result = _run_probe(python, sorted(expected), timeout)
    on_path = {os.path.realpath(p) for p in result["sys_path"] if p}
    site_note = "" if os.path.realpath(site) in on_path else (
        f" ({site} is not on sys.path of {python}; run verify with the python of that environment: --python)")
    lines = []
    for module, path in sorted(expected.items()):
        got = result["modules"][module]
        if "error" in got:
            raise OverlayError(MISMATCH, f"{module}: import failed in {python}: {got['error']}{site_note}")
        if not got["file"] or os.path.realpath(got["file"]) != os.path.realpath(path):
            raise OverlayError(MISMATCH, f"{module}: imported from {got['file']}, not the installed {path} "
                                         f"(shadowed by PYTHONPATH, an editable install or a checkout){site_note}")
        if got["problems"]:
            raise OverlayError(MISMATCH, f"{module}: Python does not run the installed {path}: {'; '.join(got['problems'])}")
        lines.append(f"{module}: {got['file']}")
    return lines


def _run_probe(python: str, modules: list[str], timeout: float) -> dict:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    with tempfile.TemporaryDirectory(prefix="overlay-verify-") as cwd:
        out = Path(cwd) / "result.json"
        try:
            done = subprocess.run([python, "-B", "-c", _IMPORT_PROBE, json.dumps(modules), str(out)],
                                  cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        except (OSError, ValueError) as exc:
            raise OverlayError(BAD_INPUT, f"{python}: cannot run it ({getattr(exc, 'strerror', None) or exc})") from exc
        except subprocess.TimeoutExpired:
            raise OverlayError(MISMATCH, f"{python}: the import probe did not finish within {timeout:g} s") from None
        if done.returncode != 0 or not out.exists():
            raise OverlayError(MISMATCH, f"{python}: import probe failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        return json.loads(out.read_text())
