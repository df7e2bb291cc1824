"""verify: the receipt is the one apply wrote, every installed file still hashes to it, and
what Python actually executes for each overlaid module is compiled from those files.

The last part matters because Python may run bytecode without reading the source: an
unchecked-hash .pyc is trusted blindly, and a timestamp .pyc whenever its header matches the
source's mtime and size. So verify refuses unchecked-hash bytecode of an overlaid module (apply
writes only checked-hash .pyc), and its import probe, in the target interpreter, compares the
code of every .pyc that interpreter would load (each optimization level) and of the loaded
module itself with the code compiled from the installed source. The probe runs with -B and
PYTHONDONTWRITEBYTECODE=1: verify writes nothing into the target.
`dsa_image.overlay.cli` re-exports it; import from there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from dsa_image.overlay import txn
from dsa_image.core.atomic import NotRegularFile, read_regular
from dsa_image.overlay.manifest import Entry, Manifest
from dsa_image.overlay.core import BAD_INPUT, LOCK_TIMEOUT, MISMATCH, RECEIPT_NAME, TOOL, TXN_DIR_NAME, OverlayError, expected_receipt, file_sha256, installed_vllm_version, load_inputs, load_receipt, reinstall_advice, require_dir, stale_bytecode
from dsa_image.core.recipe import DEFAULT_RECIPE, RECIPES_DIR

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
    problem = txn.stash_problem(site, TXN_DIR_NAME, owned=False)  # apply may have run as another user
    if problem:
        raise OverlayError(MISMATCH, problem)
    if os.path.lexists(site / TXN_DIR_NAME) and not os.path.lexists(site / TXN_DIR_NAME / txn.INDEX):
        raise OverlayError(MISMATCH, (
            f"{site}: an apply or revert was killed mid-way and left {journal}: the files may be half changed. "
            f"`{TOOL} apply --site-packages {site}` rolls it back, then applies (or finds the overlay applied); "
            f"`{TOOL} revert --site-packages {site}` rolls it back, then reverts to upstream vLLM"))


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
                flags = int.from_bytes(read_regular(pyc)[4:8], "little")
            except NotRegularFile:  # a FIFO would hang the import
                raise OverlayError(MISMATCH, f"{pyc}: not a regular file, where Python reads {source}'s bytecode. "
                                             f"Delete it (`rm {pyc}`) and re-run verify") from None
            except OSError:
                continue
            if flags & _FLAG_HASH and not flags & _FLAG_CHECK:
                raise OverlayError(MISMATCH, (
                    f"{pyc}: unchecked-hash bytecode: Python runs it without reading {source}, whatever that holds "
                    f"(apply never writes one). Delete it (`rm {pyc}`) and re-run verify"))


_IMPORT_PROBE = r"""
import importlib, importlib.machinery, importlib.util, json, marshal, os, site, stat, sys, types
MAGIC, FLAG_HASH, FLAG_CHECK = importlib.util.MAGIC_NUMBER, 0b01, 0b10
OWN = {"_frozen_importlib", "_frozen_importlib_external", "zipimport"}  # Python's own import machinery

def loadable(pyc, origin, source):
    # The code in `pyc` when this interpreter would run it instead of compiling the source.
    try:
        fd = os.open(pyc, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read() if stat.S_ISREG(os.fstat(fd).st_mode) else b""
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

def loader_problems(name, module):
    # Python's own finder and source loader, as it makes them: an import hook shows here.
    spec = module.__spec__
    loader = spec.loader
    if type(loader) is not importlib.machinery.SourceFileLoader:
        return [f"loaded by {type(loader).__module__}.{type(loader).__qualname__}, not Python's own source loader"]
    found = []
    patched = sorted(set(vars(loader)) - {"name", "path"})
    if patched:
        found.append(f"its loader's {', '.join(patched)} was replaced (an import hook)")
    if getattr(module, "__loader__", None) is not loader or getattr(module, "__file__", None) != spec.origin:
        found.append("its __loader__ or __file__ is not its spec's")
    parent = sys.modules.get(name.rpartition(".")[0])
    stock = importlib.machinery.PathFinder.find_spec(name, getattr(parent, "__path__", None))
    if stock is None or stock.origin != spec.origin:
        found.append(f"Python's path finder finds {stock and stock.origin}: another finder supplied it")
    return found

def codes(code):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from codes(const)

def functions(module, name):
    # (binding, function) for the module's functions and its own classes' methods.
    for key, value in vars(module).items():
        if isinstance(value, types.FunctionType):
            yield key, value
        elif isinstance(value, type) and value.__module__ == name:
            for attr, member in vars(value).items():
                member = getattr(member, "__func__", member)  # staticmethod, classmethod
                parts = [member.fget, member.fset, member.fdel] if isinstance(member, property) else [member]
                for part in parts:
                    if isinstance(part, types.FunctionType):
                        yield f"{value.__qualname__}.{attr}", part

def function_problems(module, name, origin, compiled):
    # Each function the file defines must run the code compiled from it (through decorators
    # that keep __wrapped__); one bound where the file defines none is checked when it is
    # the file's own code. What a hook does to other values (constants, data) is not seen.
    by_name = {}
    for code in codes(compiled):
        by_name.setdefault(code.co_qualname, []).append(code)
    found = []
    for binding, function in functions(module, name):
        for _ in range(100):
            if not isinstance(getattr(function, "__wrapped__", None), types.FunctionType):
                break
            function = function.__wrapped__
        code = function.__code__
        defined = binding in by_name
        if not defined and code.co_filename != origin:
            continue  # made elsewhere (a dataclass's __init__, another module's function)
        if code.co_filename != origin or code not in by_name.get(binding if defined else code.co_qualname, []):
            found.append(f"{binding} does not run the code the file defines for it (rewritten at import or "
                         f"replaced after; its code comes from {code.co_filename})")
    return found

def problems(name, module):
    spec = module.__spec__
    found = loader_problems(name, module)
    if found and not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
        return found
    origin = spec.origin
    with open(origin, "rb") as f:
        source = f.read()
    compiled = compile(source, origin, "exec", dont_inherit=True)
    if spec.loader.get_code(name) != compiled:
        found.append("the code Python ran is not compiled from it")
    found += function_problems(module, name, origin, compiled)
    for opt in ("", 1, 2):
        pyc = importlib.util.cache_from_source(origin, optimization=opt)
        code = loadable(pyc, origin, source)
        expected = compile(source, origin, "exec", dont_inherit=True, optimize=opt or 0)
        if code is not None and code != expected:
            found.append(f"{pyc} is not compiled from it; delete it (rm {pyc})")
    return found

def foreign(objects):
    # Import machinery that is not Python's own, by name.
    names = []
    for obj in objects:
        kind = obj if isinstance(obj, (type, types.FunctionType)) else type(obj)  # a class, a hook function, an instance
        if kind.__module__ not in OWN:
            names.append(f"{kind.__module__}.{kind.__qualname__}")
    return names

def startup_code():
    # .pth lines that run code at start-up, and the customize modules site imported.
    dirs = [*site.getsitepackages(), site.getusersitepackages()] if hasattr(site, "getsitepackages") else []
    found = []
    for directory in dict.fromkeys(dirs):
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".pth"))
        except OSError:
            continue
        for pth in names:
            try:
                with open(os.path.join(directory, pth), "rb") as f:
                    lines = f.read().decode("utf-8", "replace").splitlines()
            except OSError:
                continue
            if any(line.startswith(("import ", "import\t")) for line in lines):
                found.append(os.path.join(directory, pth))
    return found + [m for m in ("sitecustomize", "usercustomize") if m in sys.modules]

modules, out = json.loads(sys.argv[1]), sys.argv[2]
result = {"sys_path": sys.path, "modules": {}}
imported = {}
for name in modules:  # all first: a hook that patches a module on a later import shows too
    try:
        imported[name] = importlib.import_module(name)
    except BaseException as exc:
        result["modules"][name] = {"error": f"{type(exc).__name__}: {exc}"}
for name, module in imported.items():
    result["modules"][name] = {"file": getattr(module, "__file__", None), "problems": problems(name, module)}
result["hooks"] = {"sys.meta_path": foreign(sys.meta_path), "sys.path_hooks": foreign(sys.path_hooks),
                   "start-up code": startup_code()}
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
    return lines + [_hooks_line(python, result["hooks"])]


def _hooks_line(python: str, hooks: dict[str, list[str]]) -> str:
    """What verify cannot see, said: import machinery and start-up code that are not Python's
    own may change a module's values at import in ways no check of its code shows."""
    found = [f"{where}: {', '.join(names)}" for where, names in hooks.items() if names]
    if not found:
        return (f"import machinery of {python}: Python's own only (no other sys.meta_path or sys.path_hooks "
                "entry, no start-up code from a .pth file or sitecustomize)")
    return (f"note: {python} runs import machinery or start-up code that is not Python's own ({'; '.join(found)}). "
            "verify checked each overlaid module's finder and loader, the code Python ran, its bytecode and the code "
            "of its functions and methods; what such code does to the modules' other values (constants, data) at "
            "import it cannot see")


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
