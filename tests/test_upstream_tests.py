"""dsa_image.upstream (its face: gate): vLLM's own tests as the overlay's gate.

Selection on a synthetic tests tree with the imports that are easy to miss; the sdist read as
bytes, never extracted; the bundle refusing any change; the comparison's rule; and the runner
for real (pytest in a subprocess per file) against two synthetic `pip install --target` sites, a
stand-in for a stock and an overlaid vLLM that exercises only the tool's mechanics. The real
sdists (`wheel`) are selected and bundled; the real vLLM runs in the image's upstream-stock and
upstream-overlay stages (tests/test_image.py reads their results).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from dsa_image.build import lock, lock_parse
from dsa_image.upstream import gate as ut
from dsa_image.core import status, wheels
from dsa_image.overlay.manifest import load_manifest
from dsa_image.overlay.core import RECEIPT_NAME, manifest_path
from dsa_image.core.recipe import REPO_ROOT, load_every_base

SCRIPT = REPO_ROOT / "scripts" / "upstream_tests.py"
INDEXER = "vllm.v1.attention.backends.mla.indexer"
LAYER = "vllm.model_executor.layers.sparse_attn_indexer"
OVERLAID = (INDEXER, LAYER)

# A tests tree with every way a file can import a module, and every way pytest loads helpers.
TREE = {
    "tests/__init__.py": "",
    "tests/conftest.py": "import tblib\nfrom tests.utils import helper\npytest_plugins = ['tests.plugin']\n",
    "tests/plugin.py": "import plugin_dependency\n",
    "tests/utils.py": "import os\nfrom tests.models import registry\n\ndef helper():\n    pass\n",
    "tests/models/__init__.py": "",
    "tests/models/registry.py": "X = 1\n",
    "tests/unrelated/__init__.py": "",
    "tests/unrelated/conftest.py": "import not_on_the_way\n",
    "tests/unrelated/test_other.py": "import vllm.config\n",
    "tests/v1/__init__.py": "",
    "tests/v1/conftest.py": "import numpy\n",
    "tests/v1/shared.py": ("try:\n    import optional_package\nexcept ImportError:\n    optional_package = None\n"
                           "if sys.platform == 'rocm':\n    import rocm_only\n"),
    # tests/v1/attention is not a package: pytest's prepend mode puts it on sys.path
    "tests/v1/attention/conftest.py": "def pytest_configure():\n    import aiter\n",
    "tests/v1/attention/helpers.py": f"import {INDEXER}\n\ndef make():\n    pass\n",
    "tests/v1/attention/test_direct.py": f"import {INDEXER} as idx\n",
    "tests/v1/attention/test_from_package.py": "from vllm.v1.attention.backends.mla import indexer\nfrom helpers import make\n",
    "tests/v1/attention/test_in_a_function.py": f"def test_x():\n    from {LAYER} import SparseAttnIndexer\n",
    "tests/v1/attention/test_import_module.py": f"import importlib\n\ndef test_y():\n    importlib.import_module('{INDEXER}')\n",
    "tests/v1/attention/test_importorskip.py": f"import pytest\nfoo = pytest.importorskip('foo_missing')\nimport {INDEXER}\n",
    "tests/v1/attention/test_not_selected.py": (
        "from vllm.v1.attention.backends import mla\n"  # the package, not the module
        f"import {INDEXER}_utils\n"  # a longer name, not a submodule
        f"# import {INDEXER}\n"
        f"S = '{INDEXER}'\n"),
    "tests/v1/worker/__init__.py": "",
    "tests/v1/worker/utils.py": "from ..shared import thing\n",
    "tests/v1/worker/test_relative.py": f"from .utils import build\nfrom {INDEXER} import DeepseekV32IndexerMetadataBuilder\n",
    "tests/v1/envs_test.py": "from vllm import envs\n",
}
SELECTED = {"tests/v1/attention/test_direct.py", "tests/v1/attention/test_from_package.py",
            "tests/v1/attention/test_in_a_function.py", "tests/v1/attention/test_import_module.py",
            "tests/v1/attention/test_importorskip.py", "tests/v1/worker/test_relative.py"}


def tree(files: dict[str, str] = TREE) -> ut.UpstreamTree:
    return ut.UpstreamTree({path: text.encode() for path, text in files.items()})


def by_path(selection: ut.Selection) -> dict[str, ut.Selected]:
    return {s.path: s for s in selection.selected}


def test_selection_finds_every_import_of_an_overlaid_module_and_nothing_else():
    selection = ut.select(tree(), OVERLAID)
    assert set(by_path(selection)) == SELECTED
    assert by_path(selection)["tests/v1/attention/test_in_a_function.py"].imports == (
        f"tests/v1/attention/test_in_a_function.py:2 {LAYER}",)
    assert "tests/v1/attention/helpers.py" not in by_path(selection)  # not a test file: support only


def test_a_name_loads_an_overlaid_module_when_it_or_a_parent_is_one():
    assert ut.loads_module(f"{INDEXER}.DeepseekV32IndexerMetadataBuilder", OVERLAID) == INDEXER
    assert ut.loads_module(INDEXER, OVERLAID) == INDEXER
    assert ut.loads_module(f"{INDEXER}_utils", OVERLAID) is None
    assert ut.loads_module("vllm.v1.attention.backends.mla", OVERLAID) is None
    assert ut.loads_module("vllm.envs.X", ("vllm.envs",)) == "vllm.envs"


def test_an_overlaid_vllm_envs_selects_from_vllm_import_envs():
    """0.24.0's overlay carries vllm/envs.py: `from vllm import envs` imports it."""
    assert set(by_path(ut.select(tree(), ("vllm.envs",)))) == {"tests/v1/envs_test.py"}


def test_the_overlaid_modules_are_the_manifests_install_paths():
    for base in load_every_base():
        manifest, _ = load_manifest(manifest_path(base.vllm_version))
        modules = ut.overlaid_modules(manifest)
        assert {INDEXER, LAYER, "vllm.v1.attention.backends.mla.b12x_indexer"} <= set(modules)
        assert ("vllm.envs" in modules) == (base.vllm_version == "0.24.0")


def test_support_is_the_conftests_on_the_way_up_their_packages_and_what_they_import():
    selection = ut.select(tree(), OVERLAID)
    assert set(selection.support) == {
        "tests/__init__.py", "tests/conftest.py", "tests/plugin.py", "tests/utils.py", "tests/models/__init__.py",
        "tests/models/registry.py", "tests/v1/__init__.py", "tests/v1/conftest.py", "tests/v1/shared.py",
        "tests/v1/attention/conftest.py", "tests/v1/attention/helpers.py", "tests/v1/worker/__init__.py",
        "tests/v1/worker/utils.py"}
    assert not any(p.startswith("tests/unrelated/") for p in selection.support)


def test_needs_are_the_third_party_modules_collection_always_imports():
    needs = {s.path: set(s.needs) for s in ut.select(tree(), OVERLAID).selected}
    on_the_way = {"tblib", "plugin_dependency", "numpy", "vllm"}  # conftests, pytest_plugins, the file
    assert needs["tests/v1/attention/test_from_package.py"] == on_the_way
    # a function body (aiter), a guarded try, an `if`, importorskip: none is required
    assert needs["tests/v1/worker/test_relative.py"] == on_the_way
    assert needs["tests/v1/attention/test_importorskip.py"] == on_the_way | {"pytest"}
    assert needs["tests/v1/attention/test_import_module.py"] == {"tblib", "plugin_dependency", "numpy"}


def test_a_file_that_is_not_python_is_refused_with_its_name():
    with pytest.raises(ut.UpstreamTestsError, match="tests/test_bad.py: cannot parse it as Python"):
        ut.select(tree({**TREE, "tests/test_bad.py": "def (:\n"}), OVERLAID)


# --- the sdist ------------------------------------------------------------------------------------


def sdist(path: Path, members: dict[str, bytes], links: dict[str, str] | None = None) -> Path:
    with tarfile.open(path, "w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            archive.addfile(info)
    return path


def test_the_sdist_is_read_as_bytes_and_nothing_outside_its_tests_is_taken(tmp_path):
    archive = sdist(tmp_path / "vllm-9.9.9.tar.gz", {
        "vllm-9.9.9/tests/conftest.py": b"", "vllm-9.9.9/tests/test_a.py": b"import vllm\n",
        "vllm-9.9.9/tests/data.json": b"{}", "vllm-9.9.9/pyproject.toml": b"[tool.pytest.ini_options]\n",
        "vllm-9.9.9/vllm/__init__.py": b"", "vllm-9.9.9/../evil/tests/test_x.py": b"",
        "other-1.0/tests/test_b.py": b""}, links={"vllm-9.9.9/tests/test_link.py": "/etc/passwd"})
    found, config = ut.read_sdist(archive, "9.9.9")
    assert set(found.files) == {"tests/conftest.py", "tests/test_a.py"}
    assert config == {"pyproject.toml": b"[tool.pytest.ini_options]\n"}
    assert not (tmp_path / "evil").exists() and not (tmp_path / "vllm-9.9.9").exists()


def test_an_sdist_without_tests_or_not_a_tarball_is_refused(tmp_path):
    with pytest.raises(ut.UpstreamTestsError, match="no vllm-9.9.9/tests/conftest.py"):
        ut.read_sdist(sdist(tmp_path / "a.tar.gz", {"vllm-9.9.9/setup.py": b""}), "9.9.9")
    (tmp_path / "b.tar.gz").write_bytes(b"not gzip")
    with pytest.raises(ut.UpstreamTestsError, match="cannot read it as a gzip'd tar"):
        ut.read_sdist(tmp_path / "b.tar.gz", "9.9.9")


def test_the_pinned_sdist_is_rehashed_on_every_use_and_a_changed_one_refused(tmp_path, monkeypatch):
    """Fail closed without the network: a cached file that is not the recipe's pin is never read."""
    monkeypatch.setenv("DSA_IMAGE_CACHE", str(tmp_path))
    base = load_every_base()[0]
    cached = wheels.wheel_cache_path(base.sdist.filename)
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"a changed sdist")
    with pytest.raises(wheels.WheelError, match=f"cached file has sha256 .*, the recipe pins {base.sdist.sha256}"):
        ut.pinned_sdist(base)
    done = subprocess.run([sys.executable, str(SCRIPT), "select", "--vllm", base.vllm_version],
                          capture_output=True, text=True, env={**os.environ, "DSA_IMAGE_CACHE": str(tmp_path)})
    assert done.returncode == 4 and "Delete the cached file" in done.stderr, done.stderr


# --- the bundle ---------------------------------------------------------------------------------


def bundle(tmp_path: Path, files: dict[str, str] = TREE, overlaid=OVERLAID, version="0.33.0", libs=None) -> Path:
    upstream = tree(files)
    selection = ut.select(upstream, overlaid)
    doc = ut.selection_doc(selection, version, f"vllm-{version}.tar.gz", "0" * 64)
    out = tmp_path / "bundle"
    ut.write_bundle(out, upstream, {"pyproject.toml": b"[tool.pytest.ini_options]\n"}, selection, doc, libs)
    return out


def test_a_bundle_holds_the_selection_and_refuses_any_change(tmp_path):
    root = bundle(tmp_path)
    loaded = ut.load_bundle(root)
    assert {s["path"] for s in loaded.selected} == SELECTED and loaded.vllm_version == "0.33.0"
    assert not (root / "tests/unrelated").exists() and (root / "pyproject.toml").is_file()
    (root / "tests/v1/conftest.py").write_text("import numpy  # edited\n")
    with pytest.raises(ut.UpstreamTestsError, match=r"tests/v1/conftest.py: sha256 \w+, bundle.json records"):
        ut.load_bundle(root)
    (root / "tests/v1/conftest.py").write_text(TREE["tests/v1/conftest.py"])
    (root / "tests/v1/extra.py").write_text("")
    with pytest.raises(ut.UpstreamTestsError, match="tests/v1/extra.py: not listed"):
        ut.load_bundle(root)
    (root / "tests/v1/extra.py").unlink()
    (root / "tests/utils.py").unlink()
    with pytest.raises(ut.UpstreamTestsError, match="tests/utils.py: missing"):
        ut.load_bundle(root)


def test_a_bundle_is_written_whole_or_not_at_all(tmp_path):
    def failing(target: Path):
        target.mkdir()
        raise wheels.WheelError("pip failed")
    with pytest.raises(wheels.WheelError):
        bundle(tmp_path, libs=failing)
    assert list(tmp_path.iterdir()) == []
    bundle(tmp_path)
    with pytest.raises(ut.UpstreamTestsError, match="exists; a bundle is written into a new directory"):
        bundle(tmp_path)


def test_the_bundles_packages_are_the_recipes_with_the_locks_hashes():
    base = load_every_base()[0]
    requirements = ut.lib_requirements(base, REPO_ROOT / lock.UPSTREAM_TESTS_LOCK)
    pins = lock_parse.parse_lock((REPO_ROOT / lock.UPSTREAM_TESTS_LOCK).read_text())
    lines = requirements.splitlines()
    assert [line.split("==")[0] for line in lines] == list(base.upstream_test_packages)
    for line in lines:
        name, rest = line.split("==", 1)
        version, *hashes = rest.split()
        assert pins[lock_parse.normalize(name)].version == version
        assert {h.removeprefix("--hash=sha256:") for h in hashes} == pins[lock_parse.normalize(name)].hashes


# --- the comparison's rule --------------------------------------------------------------------------


@pytest.mark.parametrize("stock, overlay, regression", [
    ("passed", "passed", False), ("passed", "failed", True), ("passed", "error", True),
    ("passed", "skipped", True), ("passed", "missing", True),
    ("skipped", "failed", True), ("skipped", "error", True), ("skipped", "missing", True),
    ("skipped", "skipped", False), ("skipped", "passed", False),
    ("failed", "failed", False), ("error", "failed", False), ("failed", "passed", False),
    ("failed", "missing", False), ("missing", "failed", True), ("missing", "error", True),
    ("missing", "passed", False), ("missing", "skipped", False),
])
def test_the_rule(stock, overlay, regression):
    assert ut.is_regression(stock, overlay) is regression


def junit(path: Path, cases: list[tuple[str, str]]) -> None:
    body = {"passed": "", "failed": "<failure message='x'/>", "error": "<error message='x'/>",
            "skipped": "<skipped message='x'/>", "xfail": "<skipped type='pytest.xfail' message='x'/>"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("<testsuites><testsuite>" + "".join(
        f"<testcase classname='tests.test_a' name='{name}'>{body[kind]}</testcase>" for name, kind in cases)
        + "</testsuite></testsuites>")


def test_junit_outcomes_keep_the_worse_of_a_test_reported_twice(tmp_path):
    junit(tmp_path / "a.xml", [("ok", "passed"), ("bad", "failed"), ("err", "error"), ("skip", "skipped"),
                               ("xf", "xfail"), ("teardown", "passed"), ("teardown", "error")])
    assert ut.junit_outcomes(tmp_path / "a.xml", "tests/test_a.py") == {
        "tests/test_a.py::ok": "passed", "tests/test_a.py::bad": "failed", "tests/test_a.py::err": "error",
        "tests/test_a.py::skip": "skipped", "tests/test_a.py::xf": "skipped", "tests/test_a.py::teardown": "error"}


def test_node_ids_are_pytests():
    assert ut.node_id("tests/v1/test_x.py", "tests.v1.test_x", "test_a[1]") == "tests/v1/test_x.py::test_a[1]"
    assert ut.node_id("tests/v1/test_x.py", "tests.v1.test_x.TestC", "test_a") == "tests/v1/test_x.py::TestC::test_a"
    assert ut.node_id("tests/v1/test_x.py", "", "tests.v1.test_x") == "tests/v1/test_x.py"  # collection


def selecting(out: Path, *paths: str) -> None:
    """out/bundle: a bundle that selects the test files `paths` (each imports vllm.mod)."""
    files = {"tests/__init__.py": "", **{p: "import vllm.mod\n" for p in paths}}
    upstream = tree(files)
    selection = ut.select(upstream, ("vllm.mod",))
    assert {s.path for s in selection.selected} == set(paths)
    doc = ut.selection_doc(selection, "0.33.0", "vllm-0.33.0.tar.gz", "0" * 64)
    ut.write_bundle(out / "bundle", upstream, {"pyproject.toml": b""}, selection, doc, None)


def results(out: Path, side: str, files: dict[str, list | str], receipt: bool, bundle_sha=None) -> None:
    """out/<side>: run.json and junit per file (a list of (test, outcome)), or a status; of the
    bundle out/bundle unless `bundle_sha` says another."""
    bundle_sha = bundle_sha or ut.load_bundle(out / "bundle").sha256
    doc = {"schema": ut.RUN_SCHEMA, "side": side, "bundle_sha256": bundle_sha, "files": {},
           "site": {"python": "python3", "site": None, "vllm_version": "0.33.0", "vllm_site": f"/{side}",
                    "receipt": receipt}}
    for path, cases in files.items():
        if isinstance(cases, str):
            doc["files"][path] = {"status": cases, "seconds": 1.0, "exit_code": None, "reason": f"{cases} here"}
            continue
        junit(out / side / "junit" / ut.junit_name(path), cases)
        doc["files"][path] = {"status": "ran", "seconds": 1.0, "exit_code": 0, "reason": ""}
    (out / side).mkdir(parents=True, exist_ok=True)
    (out / side / ut.RUN_FILE).write_text(json.dumps(doc))


def compare(out: Path, *args: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, str(SCRIPT), "compare", str(out), "--bundle", str(out / "bundle"),
                           "--json", str(out / "c.json"), *args], capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


def test_a_skip_on_stock_that_fails_on_the_overlay_is_a_regression_and_fails_on_both_are_listed(tmp_path):
    selecting(tmp_path, "tests/test_a.py")
    results(tmp_path, "stock", {"tests/test_a.py": [("ok", "passed"), ("skip", "skipped"), ("both", "failed")]}, False)
    results(tmp_path, "overlay", {"tests/test_a.py": [("ok", "passed"), ("skip", "failed"), ("both", "error")]}, True)
    code, output = compare(tmp_path)
    assert code == 1, output
    assert "tests/test_a.py::skip: skipped -> failed" in output
    assert "failing on both" in output and "tests/test_a.py::both: failed -> error" in output
    assert output.rstrip().endswith("1 regression")
    row = next(line for line in output.splitlines() if line.startswith("tests/test_a.py"))
    assert row.split()[1:7] == ["1", "1", "1", "1", "2", "0"] and "1 regression(s)" in row
    assert json.loads((tmp_path / "c.json").read_text())["verdict"] == "regressions"


def test_no_regression_is_exit_0_with_the_table_and_0_regressions(tmp_path):
    selecting(tmp_path, "tests/test_a.py")
    results(tmp_path, "stock", {"tests/test_a.py": [("ok", "passed"), ("bad", "failed")]}, False)
    results(tmp_path, "overlay", {"tests/test_a.py": [("ok", "passed"), ("bad", "passed")]}, True)
    code, output = compare(tmp_path)
    assert code == 0, output
    assert "other differences" in output and "bad: failed -> passed" in output
    assert output.rstrip().endswith("0 regressions")


def test_an_overlay_file_that_timed_out_where_stock_ran_is_a_regression(tmp_path):
    selecting(tmp_path, "tests/test_a.py", "tests/test_b.py")
    results(tmp_path, "stock", {"tests/test_a.py": [("ok", "passed")], "tests/test_b.py": [("bad", "failed")]}, False)
    results(tmp_path, "overlay", {"tests/test_a.py": "timeout", "tests/test_b.py": "crashed"}, True)
    code, output = compare(tmp_path)
    assert code == 1, output
    assert "tests/test_a.py::ok: passed -> missing" in output
    assert "tests/test_b.py (the whole file): ran -> crashed" in output
    assert output.rstrip().endswith("2 regressions")


def test_a_file_without_a_result_on_a_side_or_nothing_passing_is_incomplete(tmp_path):
    selecting(tmp_path, "tests/test_a.py", "tests/test_b.py")
    results(tmp_path, "stock", {"tests/test_a.py": [("ok", "passed")], "tests/test_b.py": "not-runnable"}, False)
    results(tmp_path, "overlay", {"tests/test_a.py": [("ok", "passed")], "tests/test_b.py": "not-runnable"}, True)
    code, output = compare(tmp_path)
    assert code == status.INCOMPLETE, output
    assert "tests/test_b.py [stock] not-runnable: not-runnable here" in output
    other = tmp_path / "none-passed"
    selecting(other, "tests/test_a.py")
    results(other, "stock", {"tests/test_a.py": [("bad", "failed")]}, False)
    results(other, "overlay", {"tests/test_a.py": [("bad", "failed")]}, True)
    code, output = compare(other)
    assert code == status.INCOMPLETE and "no test passed on stock" in output, output


def test_a_selected_file_neither_side_reached_makes_the_comparison_incomplete(tmp_path):
    """A run cut short (a deadline, a killed call) has results for some files only: the files
    it never reached count, so the verdict is incomplete, never "0 regressions" and exit 0."""
    selecting(tmp_path, "tests/test_a.py", "tests/test_b.py")
    results(tmp_path, "stock", {"tests/test_a.py": [("ok", "passed")]}, False)
    results(tmp_path, "overlay", {"tests/test_a.py": [("ok", "passed")]}, True)
    code, output = compare(tmp_path)
    assert code == status.INCOMPLETE, output
    assert "tests/test_b.py [stock] not run: not run yet" in output
    assert "tests/test_b.py [overlay] not run: not run yet" in output
    row = next(line for line in output.splitlines() if line.startswith("tests/test_b.py"))
    assert row.split()[1:] == ["not", "run", "not", "run"]
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["verdict"] == "incomplete" and set(doc["files"]) == {"tests/test_a.py", "tests/test_b.py"}
    code, output = compare(tmp_path, "--files", "tests/test_a.py")  # the subset asked for is complete
    assert code == 0 and "tests/test_b.py" not in output, output


def test_the_bundle_json_alone_as_exported_results_carry_it_is_enough_to_compare(tmp_path):
    selecting(tmp_path, "tests/test_a.py", "tests/test_b.py")
    results(tmp_path, "stock", {"tests/test_a.py": [("ok", "passed")]}, False)
    results(tmp_path, "overlay", {"tests/test_a.py": [("ok", "passed")]}, True)
    exported = tmp_path / "exported"
    exported.mkdir()
    shutil.copy(tmp_path / "bundle" / "bundle.json", exported / "bundle.json")
    done = subprocess.run([sys.executable, str(SCRIPT), "compare", str(tmp_path), "--bundle",
                           str(exported / "bundle.json")], capture_output=True, text=True)
    assert done.returncode == status.INCOMPLETE and "tests/test_b.py [stock] not run" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("edit, message", [
    (lambda out: results(out, "overlay", {}, True, bundle_sha="c" * 64), "come from different bundles"),
    (lambda out: [results(out, side, {}, side == "overlay", bundle_sha="c" * 64) for side in ut.SIDES],
     "results of another bundle"),
    (lambda out: results(out, "overlay", {"tests/test_z.py": [("ok", "passed")]}, True),
     "results for files"),
    (lambda out: results(out, "overlay", {}, False), "the overlay side one"),
    (lambda out: (out / "overlay" / ut.RUN_FILE).write_text("[]"), "not a schema 1 run of the overlay side"),
    (lambda out: shutil.rmtree(out / "overlay"), "overlay/run.json: missing"),
])
def test_results_that_cannot_be_compared_are_refused(tmp_path, edit, message):
    selecting(tmp_path, "tests/test_a.py")
    results(tmp_path, "stock", {"tests/test_a.py": [("ok", "passed")]}, False)
    results(tmp_path, "overlay", {"tests/test_a.py": [("ok", "passed")]}, True)
    edit(tmp_path)
    code, output = compare(tmp_path)
    assert code == 2 and message in output, output


# --- the runner, for real: pytest per file against two `pip install --target` sites ---------------

STOCK_MOD = "ONE, TWO, STOCK, SLOW = 1, 2, True, False\n"
OVERLAY_MOD = "ONE, TWO, STOCK, SLOW = 1, 3, False, True\n"
GATED = {
    "tests/__init__.py": "",
    "tests/conftest.py": "import pytest\n",
    "tests/test_gate.py": (
        "import pytest\nimport vllm.mod as mod\n\n"
        "def test_passes_on_both():\n    assert mod.ONE == 1\n\n"
        "def test_broken_by_the_overlay():\n    assert mod.TWO == 2\n\n"
        "@pytest.mark.skipif(mod.STOCK, reason='skips on stock')\n"
        "def test_skipped_on_stock_fails_on_the_overlay():\n    assert mod.TWO == 2\n\n"
        "def test_fails_on_both():\n    assert False\n"),
    "tests/test_slow.py": "import time\nimport vllm.mod as mod\n\ndef test_sleeps():\n    time.sleep(60 if mod.SLOW else 0)\n",
    "tests/test_needs.py": "import vllm.mod\nimport a_module_no_site_has\n",
    "tests/test_fine.py": "import vllm.mod as mod\n\ndef test_fine():\n    assert mod.ONE == 1\n",
}


def site(root: Path, module: str, version: str = "0.33.0", receipt: bool = False) -> Path:
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "mod.py").write_text(module)
    (root / f"vllm-{version}.dist-info").mkdir()
    (root / f"vllm-{version}.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    if receipt:
        (root / RECEIPT_NAME).write_text("{}")
    return root


@pytest.fixture
def gate(tmp_path):
    root = bundle(tmp_path, GATED, ("vllm.mod",))
    stock, overlay = site(tmp_path / "stock", STOCK_MOD), site(tmp_path / "overlay", OVERLAY_MOD, receipt=True)

    def run(*args: str) -> tuple[int, str]:
        done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
        return done.returncode, done.stdout + done.stderr
    return {"bundle": root, "stock": stock, "overlay": overlay, "out": tmp_path / "out", "run": run}


@pytest.mark.parametrize("shards", [1, 2], ids=["one-process", "in-shards"])
def test_the_gate_runs_each_file_on_both_sites_and_counts_the_regressions(gate, shards):
    code, output = gate["run"]("gate", "--bundle", str(gate["bundle"]), "--out", str(gate["out"]),
                               "--stock-site", str(gate["stock"]), "--overlay-site", str(gate["overlay"]),
                               "--timeout", "10", "--jobs", "2", "--shards", str(shards))
    assert code == 1, output
    for line in ("tests/test_gate.py::test_broken_by_the_overlay: passed -> failed",
                 "tests/test_gate.py::test_skipped_on_stock_fails_on_the_overlay: skipped -> failed",
                 "tests/test_slow.py::test_sleeps: passed -> timeout",
                 "tests/test_gate.py::test_fails_on_both: failed -> failed  (assert False)"):
        assert line in output
    assert "tests/test_needs.py [stock] not-runnable: its collection imports a_module_no_site_has" in output
    assert "\n3 regressions\n" in output
    overlay_run = json.loads((gate["out"] / "overlay" / ut.RUN_FILE).read_text())
    # The test had the whole part to itself: its outcome is a timeout, the next part ends the file.
    assert overlay_run["files"]["tests/test_slow.py"]["status"] == "ran"
    assert overlay_run["files"]["tests/test_slow.py"]["parts"] == 2
    assert overlay_run["site"]["receipt"] is True and overlay_run["site"]["vllm_version"] == "0.33.0"
    logs = list((gate["out"] / "stock" / "logs").glob("tests__test_gate*.log"))
    assert len(logs) == shards and sum(log.read_text().count("passed") for log in logs) >= 1
    assert not list(gate["bundle"].rglob("__pycache__"))  # the bundle stays as written


def test_a_run_resumes_and_refuses_results_of_another_bundle_or_site(gate, tmp_path):
    args = ["run", "--side", "stock", "--bundle", str(gate["bundle"]), "--out", str(gate["out"]),
            "--site", str(gate["stock"]), "--files", "tests/test_fine.py"]
    code, output = gate["run"](*args)
    assert code == 0 and "stock    ran" in output, output
    code, output = gate["run"](*args)
    assert code == 0 and "stock    ran" not in output, output  # nothing run again
    other = bundle(tmp_path / "other", {**GATED, "tests/test_fine.py": GATED["tests/test_fine.py"] + "\n"}, ("vllm.mod",))
    code, output = gate["run"]("run", "--side", "stock", "--bundle", str(other), "--out", str(gate["out"]),
                               "--site", str(gate["stock"]))
    assert code == 2 and "results of another bundle" in output, output
    code, output = gate["run"](*args[:-2], "--python", sys.executable, "--site", str(gate["stock"]),
                               "--libs", str(tmp_path))
    assert code == 2 and "results of another site" in output, output


# The test files' header: begun(name) writes a marker and says whether the test began before.
BEGUN = ("import os, time\nimport pytest\nimport vllm.mod\n\n"
         "def begun(name):\n    path = os.path.join(os.environ['PARTS_MARKERS'], name)\n"
         "    seen = os.path.exists(path)\n    open(path, 'a').write('x')\n    return seen\n\n")
# Each test writes a marker when it begins; test_hangs_once hangs in its first part only.
PARTED = {
    "tests/__init__.py": "",
    "tests/test_parts.py": (
        BEGUN +
        "def test_first():\n    begun('first')\n\n"
        "def test_hangs_once():\n    if not begun('hangs_once'):\n        time.sleep(60)\n\n"
        "@pytest.mark.parametrize('n', [1, 2])\ndef test_after(n):\n    begun(f'after{n}')\n\n"
        "def test_hangs_always():\n    begun('hangs_always')\n    time.sleep(60)\n\n"
        "def test_last():\n    begun('last')\n    assert False\n"),
}


def run_marked(tmp_path: Path, monkeypatch, files: dict[str, str], timeout: float, **options):
    """Run `files` on a stock site; returns the runs, the results' folder and how often each test began."""
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("PARTS_MARKERS", str(markers))
    root, stock, out = bundle(tmp_path, files, ("vllm.mod",)), site(tmp_path / "stock", STOCK_MOD), tmp_path / "out"
    runs = ut.run_tasks(ut.load_bundle(root), [ut.Site("stock", sys.executable, stock)], out, timeout, **options)
    return runs, out, {m.name: len(m.read_text()) for m in markers.iterdir()}


def test_a_file_longer_than_its_timeout_ends_in_parts_each_test_once(tmp_path, monkeypatch):
    runs, out, begun = run_marked(tmp_path, monkeypatch, PARTED, 6, report=lambda line: None)
    result = runs["stock"]["files"]["tests/test_parts.py"]
    # part 1: first, then killed in hangs_once (rerun); part 2: hangs_once, after[1], after[2],
    # killed in hangs_always (rerun); part 3: hangs_always alone, its timeout; part 4: last.
    assert (result["status"], result["parts"]) == ("ran", 4), result
    progress = ut.read_record(out / "stock" / "records" / "tests__test_parts.jsonl", "tests/test_parts.py")
    test = "tests/test_parts.py::"
    assert progress.outcomes == {f"{test}test_first": "passed", f"{test}test_hangs_once": "passed",
                                 f"{test}test_after[1]": "passed", f"{test}test_after[2]": "passed",
                                 f"{test}test_hangs_always": "timeout", f"{test}test_last": "failed"}
    assert len(progress.collected) == 6
    assert progress.reasons == {f"{test}test_last": "assert False"}
    assert begun == {"first": 1, "hangs_once": 2, "after1": 1, "after2": 1, "hangs_always": 2, "last": 1}


SHARDED = {
    "tests/__init__.py": "",
    "tests/test_shards.py": (
        BEGUN +
        "@pytest.mark.parametrize('n', range(8))\ndef test_n(n):\n    begun(f'n{n}')\n\n"
        "def test_hangs_once():\n    if not begun('hangs_once'):\n        time.sleep(60)\n"),
}


def test_a_file_in_shards_runs_each_test_once_in_one_shard_and_resumes_only_the_unfinished(tmp_path, monkeypatch):
    lines: list[str] = []
    runs, out, begun = run_marked(tmp_path, monkeypatch, SHARDED, 8, report=lines.append, shards=3)
    path = "tests/test_shards.py"
    result = runs["stock"]["files"][path]
    assert (result["status"], result["shards"], result["parts"]) == ("ran", ["ran"] * 3, 2), result
    tests = {f"{path}::test_n[{n}]" for n in range(8)} | {f"{path}::test_hangs_once"}
    shards = [ut.Shard(i, 3) for i in range(3)]
    progress = [ut.read_record(ut.record_path(out / "stock", path, shard), path) for shard in shards]
    assert [p.parts for p in progress].count(2) == 1  # the shard of hangs_once alone took a second part
    collected = [set(p.collected) for p in progress]
    assert set().union(*collected) == tests and sum(map(len, collected)) == len(tests)  # a partition
    assert ut.file_outcomes(out, "stock", path, result) == {t: "passed" for t in tests}
    assert begun == {**{f"n{n}": 1 for n in range(8)}, "hangs_once": 2}, begun
    assert len(lines) == 2 and "partial" in lines[0] and "ran" in lines[1], lines


def test_a_file_begun_in_shards_resumes_only_in_as_many(tmp_path):
    root = bundle(tmp_path, SHARDED, ("vllm.mod",))
    stock, out = site(tmp_path / "stock", STOCK_MOD), tmp_path / "out"
    run = {"schema": ut.RUN_SCHEMA, "side": "stock", "bundle_sha256": ut.load_bundle(root).sha256, "site": None,
           "files": {"tests/test_shards.py": {"status": "partial", "seconds": 1.0, "exit_code": None, "reason": "",
                                              "parts": 1, "shards": ["ran", "partial"]}}}
    (out / "stock").mkdir(parents=True)
    (out / "stock" / ut.RUN_FILE).write_text(json.dumps(run))
    with pytest.raises(ut.UpstreamTestsError, match=r"begun in 2 shard\(s\), this run asks for 3; resume it with "
                       r"--shards 2"):
        ut.run_tasks(ut.load_bundle(root), [ut.Site("stock", sys.executable, stock)], out, 8, report=print, shards=3)
    assert not (out / "stock" / "records").exists()  # refused before any file ran
    run["files"]["tests/test_shards.py"]["shards"] = ["ran"]
    (out / "stock" / ut.RUN_FILE).write_text(json.dumps(run))
    with pytest.raises(ut.UpstreamTestsError, match=r"has shards \['ran'\]; expected each shard's status"):
        ut.load_run(out, "stock")


def test_the_parts_outcomes_are_what_compare_reads(tmp_path):
    selecting(tmp_path, "tests/test_a.py")
    results(tmp_path, "stock", {"tests/test_a.py": [("ok", "passed"), ("slow", "passed")]}, False)
    results(tmp_path, "overlay", {"tests/test_a.py": [("ok", "passed")]}, True)
    record = tmp_path / "overlay" / "records" / "tests__test_a.jsonl"
    record.parent.mkdir(parents=True)
    record.write_text("\n".join(json.dumps(line) for line in (
        {"part": 1}, {"collected": ["tests/test_a.py::ok", "tests/test_a.py::slow"]}, {"start": "tests/test_a.py::ok"},
        {"done": "tests/test_a.py::ok", "outcome": "passed"}, {"start": "tests/test_a.py::slow"}, {"part": 2},
        {"collected": ["tests/test_a.py::ok", "tests/test_a.py::slow"]}, {"start": "tests/test_a.py::slow"},
        {"done": "tests/test_a.py::slow", "outcome": "timeout"})) + "\n")
    run = json.loads((tmp_path / "overlay" / ut.RUN_FILE).read_text())
    run["files"]["tests/test_a.py"]["parts"] = 3
    (tmp_path / "overlay" / ut.RUN_FILE).write_text(json.dumps(run))
    code, output = compare(tmp_path)
    assert code == 1 and "tests/test_a.py::slow: passed -> timeout" in output, output
    assert re.search(r"tests/test_a\.py +2 +0 +0 +1 +1 +0  1 regression\(s\)", output), output


def _partial(out: Path, side: str, path: str, done: dict[str, str], reasons: dict[str, str] | None = None) -> None:
    """out/<side>: `path` partial after one part that finished the tests `done` ({name: outcome})."""
    doc = json.loads((out / side / ut.RUN_FILE).read_text())
    doc["files"][path] = {"status": "partial", "seconds": 1.0, "exit_code": None, "reason": "killed", "parts": 1}
    (out / side / ut.RUN_FILE).write_text(json.dumps(doc))
    lines = [{"part": 1}, {"collected": [f"{path}::{name}" for name in done] + [f"{path}::later"]}]
    for name, outcome in done.items():
        reason = (reasons or {}).get(name)
        lines += [{"start": f"{path}::{name}"},
                  {"done": f"{path}::{name}", "outcome": outcome, **({"reason": reason} if reason else {})}]
    record = ut.record_path(out / side, path)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_side_still_running_a_file_is_incomplete_not_a_regression(tmp_path):
    selecting(tmp_path, "tests/test_a.py")
    results(tmp_path, "stock", {"tests/test_a.py": [("ok", "passed"), ("bad", "failed")]}, False)
    results(tmp_path, "overlay", {}, True)
    code, output = compare(tmp_path)
    assert code == status.INCOMPLETE and output.rstrip().endswith("0 regressions"), output
    _partial(tmp_path, "overlay", "tests/test_a.py", {"ok": "passed"})
    code, output = compare(tmp_path)
    assert code == status.INCOMPLETE and "missing" not in output, output
    assert "tests/test_a.py: 1 tests finished on both sides so far, compared above" in output
    assert json.loads((tmp_path / "c.json").read_text())["files"]["tests/test_a.py"]["so_far"] == 1


def test_a_regression_among_the_tests_a_partial_file_finished_is_one_already(tmp_path):
    selecting(tmp_path, "tests/test_a.py")
    results(tmp_path, "stock", {}, False)
    results(tmp_path, "overlay", {}, True)
    _partial(tmp_path, "stock", "tests/test_a.py", {"ok": "passed", "both": "failed", "only_stock": "passed"},
             {"both": "ValueError: no config"})
    _partial(tmp_path, "overlay", "tests/test_a.py", {"ok": "failed", "both": "error"},
             {"ok": "AssertionError: assert 2 == 3", "both": "ValueError: no config"})
    code, output = compare(tmp_path)
    assert code == 1 and output.rstrip().endswith("1 regression"), output
    assert "tests/test_a.py::ok: passed -> failed  (AssertionError: assert 2 == 3)" in output
    assert "tests/test_a.py::both: failed -> error  (ValueError: no config)" in output
    assert "only_stock" not in output  # the overlay has not run it yet
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["verdict"] == "regressions" and doc["files"]["tests/test_a.py"]["regressions"] == [
        {"test": "tests/test_a.py::ok", "stock": "passed", "overlay": "failed", "reason": "AssertionError: assert 2 == 3"}]


def test_a_reason_is_one_printable_line_of_at_most_the_limit():
    assert ut.one_line("ValueError: no\n  config\x1b[2J for x") == "ValueError: no config?[2J for x"
    assert len(ut.one_line("y" * 2000)) == 500


@pytest.mark.parametrize("text", ["x" * 499 + " tail", "x" * 499 + "\n\t tail", " lead\x00 " + "z" * 600, "a\u3000b "],
                         ids=["cut-on-a-space", "cut-on-a-newline", "control-and-lead", "wide-space"])
def test_a_reason_is_its_own_one_line_so_the_reader_takes_back_what_the_recorder_wrote(tmp_path, text):
    """vLLM 0.24.0's gate on the CPU: a 500-character cut that ended on a space made a reason the
    reader refused (not one_line of itself), and the whole stock run failed."""
    reason = ut.one_line(text)
    assert reason == ut.one_line(reason) and not reason.endswith(" ")
    record = tmp_path / "r.jsonl"
    record.write_text(json.dumps({"done": "tests/test_a.py::t", "outcome": "failed", "reason": reason}) + "\n")
    assert ut.read_record(record, "tests/test_a.py").reasons == {"tests/test_a.py::t": reason}


def test_junit_keeps_a_failures_message_as_its_reason(tmp_path):
    junit(tmp_path / "a.xml", [("ok", "passed"), ("bad", "failed"), ("err", "error"), ("skip", "skipped")])
    assert ut.junit_results(tmp_path / "a.xml", "tests/test_a.py")[1] == {"tests/test_a.py::bad": "x",
                                                                          "tests/test_a.py::err": "x"}


def test_forget_drops_only_the_named_files_results_on_both_sides(tmp_path):
    selecting(tmp_path, "tests/test_a.py", "tests/test_a_b.py")
    for side, receipt in (("stock", False), ("overlay", True)):
        results(tmp_path, side, {"tests/test_a.py": [("ok", "passed")], "tests/test_a_b.py": [("ok", "passed")]}, receipt)
        for name in ("records/tests__test_a.shard1of2.jsonl", "logs/tests__test_a.log", "records/tests__test_a_b.jsonl"):
            (tmp_path / side / name).parent.mkdir(exist_ok=True)
            (tmp_path / side / name).write_text("{}\n")
    outside = tmp_path / "outside.txt"
    outside.write_text("kept")
    (tmp_path / "stock" / "records" / "tests__test_a.jsonl").symlink_to(outside)
    done = subprocess.run([sys.executable, str(SCRIPT), "forget", str(tmp_path), "--files", "tests/test_a.py"],
                          capture_output=True, text=True)
    assert done.returncode == 0 and "7 files removed" in done.stderr, done.stdout + done.stderr
    left = sorted(str(f.relative_to(tmp_path)) for f in tmp_path.rglob("*") if f.is_file() and "bundle" not in f.parts)
    assert left == ["outside.txt", "overlay/junit/tests__test_a_b.xml", "overlay/records/tests__test_a_b.jsonl",
                    "overlay/run.json", "stock/junit/tests__test_a_b.xml", "stock/records/tests__test_a_b.jsonl",
                    "stock/run.json"], left
    assert set(ut.load_run(tmp_path, "stock")["files"]) == {"tests/test_a_b.py"}
    code, output = compare(tmp_path)
    assert code == status.INCOMPLETE and "tests/test_a.py [stock] not run" in output, output
    done = subprocess.run([sys.executable, str(SCRIPT), "forget", str(tmp_path), "--files", "tests/test_a.py"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "no result on either side for tests/test_a.py" in done.stdout + done.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "tests__test_a_b.log").write_text("not ours")
    (tmp_path / "overlay" / "logs").rmdir()  # empty now
    (tmp_path / "overlay" / "logs").symlink_to(elsewhere)
    with pytest.raises(ut.UpstreamTestsError, match=r"overlay/logs: a symlink \(to .*elsewhere\); expected a folder"):
        ut.forget_files(tmp_path, ["tests/test_a_b.py"])
    assert (elsewhere / "tests__test_a_b.log").exists() and set(ut.load_run(tmp_path, "stock")["files"])


@pytest.mark.parametrize("line, why", [
    ('{"done": "tests/other.py::x", "outcome": "passed"}', "another file's test"),
    ('{"done": "tests/test_a.py::x", "outcome": "great"}', "an unknown outcome"),
    ('{"start": "tests/test_a.py::x", "extra": 1}', "a key too many"),
    ('{"done": "tests/test_a.py::x", "outcome": "failed", "reason": 7}', "a reason that is no text"),
    ('{"done": "tests/test_a.py::x", "outcome": "failed", "reason": "' + "x" * 501 + '"}', "a reason too long"),
    ('{"done": "tests/test_a.py::x", "outcome": "failed", "reason": "a\\u001b[2Jb"}', "a reason with a terminal escape"),
    ('{"part": true}', "a part that is no count"),
    ('{"collected": "tests/test_a.py::x"}', "a collection that is no list"),
    ('not json', "not JSON"),
])
def test_a_record_line_that_is_not_one_is_refused_with_its_place(tmp_path, line, why):
    record = tmp_path / "r.jsonl"
    record.write_text('{"part": 1}\n' + line + "\n")
    with pytest.raises(ut.UpstreamTestsError, match=r"r\.jsonl:2: not a record line of tests/test_a\.py"):
        ut.read_record(record, "tests/test_a.py")


@pytest.mark.parametrize("side, which, version, message", [
    ("overlay", "stock", "0.33.0", "has no overlay receipt; the overlay side needs a site with the overlay applied"),
    ("stock", "overlay", "0.33.0", "carries the overlay (its receipt is there); the stock side needs stock vLLM"),
    ("stock", "old", "0.24.0", "the site's vLLM is 0.24.0"),
])
def test_a_site_on_the_wrong_side_or_of_another_base_is_refused(gate, tmp_path, side, which, version, message):
    where = gate.get(which) or site(tmp_path / which, STOCK_MOD, version)
    code, output = gate["run"]("run", "--side", side, "--bundle", str(gate["bundle"]), "--out", str(gate["out"]),
                               "--site", str(where))
    assert code == 2 and message in output, output
    assert not (gate["out"] / side / "junit").exists()


def test_a_deadline_leaves_the_rest_for_the_next_call(gate):
    args = ["run", "--side", "stock", "--bundle", str(gate["bundle"]), "--out", str(gate["out"]),
            "--site", str(gate["stock"]), "--deadline-s", "0"]
    code, output = gate["run"](*args)
    assert code == status.INCOMPLETE and "not run before the deadline; run the same command again to resume" in output, output
    run = json.loads((gate["out"] / "stock" / ut.RUN_FILE).read_text())
    assert set(run["files"]) == {"tests/test_needs.py"}  # known not runnable without starting pytest


# --- the real sdists ---------------------------------------------------------------------------


@pytest.mark.wheel
@pytest.mark.parametrize("base", load_every_base(), ids=lambda b: b.vllm_version)
def test_the_pinned_sdist_selects_the_indexer_tests(base):
    manifest, _ = load_manifest(manifest_path(base.vllm_version))
    upstream, config = ut.read_sdist(ut.pinned_sdist(base), base.vllm_version)
    selection = ut.select(upstream, ut.overlaid_modules(manifest))
    paths = {s.path for s in selection.selected}
    # the file of the three tests the overlay failed on the H200 (issue #26)
    assert "tests/v1/attention/test_indexer_deepseek_v4_slot_mapping.py" in paths
    assert "tests/v1/attention/test_sparse_mla_backends.py" in paths
    assert "tests/conftest.py" in selection.support and "pyproject.toml" in config
    needs = {n for s in selection.selected for n in s.needs}
    assert "tblib" in needs  # tests/conftest.py: why [upstream_tests] names it
    if base.vllm_version == "0.33.0":
        assert len(paths) >= 14  # the 14 files first run by hand on the H200, and more


@pytest.mark.wheel
def test_a_bundle_of_the_pinned_sdist_is_small_and_carries_its_packages(tmp_path):
    base = load_every_base()[0]
    manifest, _ = load_manifest(manifest_path(base.vllm_version))
    written = ut.make_bundle(base, manifest, tmp_path / "b", REPO_ROOT / lock.UPSTREAM_TESTS_LOCK, "3.12")
    loaded = ut.load_bundle(tmp_path / "b")
    assert loaded.doc["sdist"] == {"filename": base.sdist.filename, "sha256": base.sdist.sha256}
    assert {p.split("==")[0] for p in written["libs"]} == set(base.upstream_test_packages)
    assert (tmp_path / "b" / "libs" / "tblib" / "__init__.py").is_file()
    assert sum((tmp_path / "b" / rel).stat().st_size for rel in written["files"]) < 5_000_000


# --- the image's stages ---------------------------------------------------------------------------


def test_the_bundle_stage_copies_every_module_of_ours_the_tool_imports():
    """The upstream-bundle stage copies the tool module by module (its cache then follows only
    them); the runs bind-mount that copy. A module missing there fails only the image build."""
    from test_image_tree import closure, copied

    stage = (REPO_ROOT / "Dockerfile").read_text().split("FROM base AS upstream-bundle\n", 1)[1].split("\nFROM ", 1)[0]
    files, _ = copied(stage)
    needed = closure({SCRIPT}) - {SCRIPT}
    assert needed <= files, sorted(str(p.relative_to(REPO_ROOT)) for p in needed - files)
    assert "scripts/upstream_tests.py" in stage
