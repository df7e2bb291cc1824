"""The overlay contract on synthetic site-packages trees: fast, CPU only, no vLLM needed."""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from dsa_image.overlay import cli as overlay
from dsa_image.core import status, wheels
from dsa_image.overlay.manifest import Entry, ManifestError, manifest_bytes, parse_manifest, record_entry
from dsa_image.core.wheels import sha256_bytes

from overlay_helpers import OVERLAY, RECIPE, REPO, UPSTREAM, VERSION, Tree, expect_error, run_cli, snapshot, write_tree


@pytest.fixture
def tree(tmp_path) -> Tree:
    return Tree(tmp_path)


@pytest.fixture
def on_path(monkeypatch, tree):
    """The fresh interpreter of verify finds the synthetic site through PYTHONPATH."""
    monkeypatch.setenv("PYTHONPATH", str(tree.site))
    return tree


# --- apply -----------------------------------------------------------------------------------


def test_apply_then_verify(on_path):
    tree = on_path
    receipt = tree.apply()
    for rel, data in OVERLAY.items():
        assert (tree.site / rel).read_bytes() == data
    assert receipt["vllm_version"] == VERSION and receipt["recipe"] == "glm5-dsa"
    assert receipt["manifest_sha256"] == sha256_bytes(tree.manifest_path.read_bytes())
    assert [f["path"] for f in receipt["files"]] == sorted(OVERLAY)
    new = next(f for f in receipt["files"] if f["path"] == "vllm/a/new.py")
    assert new["upstream_sha256"] is None
    assert json.loads((tree.site / overlay.RECEIPT_NAME).read_text()) == receipt
    lines = tree.verify()
    assert any(line.startswith("vllm.a.mod: ") and line.endswith("site/vllm/a/mod.py") for line in lines)


def test_bytecode_is_replaced_not_stale(tree):
    source = tree.site / "vllm/a/mod.py"
    stale = Path(importlib.util.cache_from_source(str(source)))
    stale.parent.mkdir()
    stale.write_bytes(b"stale bytecode of the upstream module")
    other_tag = stale.parent / "mod.cpython-39.opt-1.pyc"
    other_tag.write_bytes(b"stale too")
    tree.apply()
    assert not other_tag.exists()
    pyc = stale.read_bytes()
    # flags = 0b11: hash-based pyc, checked against the source: never trusted for other bytes
    assert int.from_bytes(pyc[4:8], "little") == 0b11
    assert pyc[8:16] == importlib.util.source_hash(OVERLAY["vllm/a/mod.py"])
    assert len(list((tree.site / "vllm/a/__pycache__").glob("new.*.pyc"))) == 1


def test_drift_fails_with_message_and_changes_nothing(tree):
    (tree.site / "vllm/a/mod.py").write_bytes(b"VALUE = 'upstream!'\n")
    before = snapshot(tree.site)
    message = expect_error(overlay.DRIFT, tree.apply)
    assert message.startswith(f"vllm/a/mod.py: the overlay was made for vLLM {VERSION} (upstream sha256 ")
    assert f"the installed vLLM is {VERSION}. Nothing was changed." in message
    assert f"install vLLM {VERSION}" in message
    assert snapshot(tree.site) == before


def test_wrong_vllm_version_fails(tmp_path):
    tree = Tree(tmp_path)
    info = tree.site / f"vllm-{VERSION}.dist-info"
    info.rename(tree.site / "vllm-0.25.0.dist-info")
    (tree.site / "vllm-0.25.0.dist-info/METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.25.0\n")
    before = snapshot(tree.site)
    message = expect_error(overlay.DRIFT, tree.apply)
    assert f"made for vLLM {VERSION}, but the installed vLLM is 0.25.0" in message
    assert snapshot(tree.site) == before


def test_new_file_never_overwrites(tree):
    (tree.site / "vllm/a/new.py").write_bytes(b"something installed\n")
    before = snapshot(tree.site)
    message = expect_error(overlay.DRIFT, tree.apply)
    assert "vllm/a/new.py:" in message and "never overwrites" in message
    assert snapshot(tree.site) == before


def test_second_apply_refuses(tree):
    tree.apply()
    before = snapshot(tree.site)
    assert "already carries the overlay" in expect_error(overlay.DRIFT, tree.apply)
    assert snapshot(tree.site) == before


def test_no_vllm_in_target(tree):
    for metadata in tree.site.glob("vllm-*.dist-info/METADATA"):
        metadata.unlink()
    before = snapshot(tree.site)
    assert "expected one vllm-*.dist-info/METADATA with a Version, found none" in expect_error(overlay.BAD_INPUT, tree.apply)
    assert snapshot(tree.site) == before


def test_target_is_not_a_directory(tree, tmp_path):
    assert "not a directory" in expect_error(overlay.BAD_INPUT, overlay.apply, tmp_path / "absent", "glm5-dsa",
                                             tree.manifest_path, tree.overlay_dir)


def test_missing_overlay_file(tree):
    (tree.overlay_dir / "vllm/a/mod.py").unlink()
    before = snapshot(tree.site)
    assert "overlay file missing" in expect_error(overlay.BAD_INPUT, tree.apply)
    assert snapshot(tree.site) == before


def test_overlay_file_edited_without_record(tree):
    (tree.overlay_dir / "vllm/envs.py").write_bytes(b"FLAG = 'edited'\n")
    before = snapshot(tree.site)
    assert "record --refresh" in expect_error(overlay.BAD_INPUT, tree.apply)
    assert snapshot(tree.site) == before


@pytest.mark.parametrize("mutate", [
    lambda doc: "{not json",
    lambda doc: json.dumps({**doc, "schema": 2}),
    lambda doc: json.dumps({**doc, "files": list(reversed(doc["files"]))}),
    lambda doc: json.dumps({**doc, "files": doc["files"] + doc["files"][:1]}),
    lambda doc: json.dumps({**doc, "files": [{**doc["files"][0], "overlay_sha256": "abc"}]}),
    lambda doc: json.dumps({**doc, "files": [{**doc["files"][0], "path": "vllm/../evil.py"}]}),
    lambda doc: json.dumps({**doc, "files": [{**doc["files"][0], "path": "/etc/passwd"}]}),
    lambda doc: json.dumps({**doc, "files": [{**doc["files"][0], "path": "torch/x.py"}]}),
    lambda doc: json.dumps({**doc, "files": [{**doc["files"][0], "why": ""}]}),
    lambda doc: json.dumps({k: v for k, v in doc.items() if k != "wheel"}),
    lambda doc: json.dumps({**doc, "extra": 1}),
], ids=["not-json", "schema", "unsorted", "duplicate", "bad-sha", "dotdot", "absolute", "outside-vllm",
        "empty-why", "no-wheel", "unknown-key"])
def test_malformed_manifest(tree, mutate):
    doc = json.loads(tree.manifest_path.read_bytes())
    tree.manifest_path.write_text(mutate(doc))
    before = snapshot(tree.site)
    message = expect_error(overlay.BAD_INPUT, tree.apply)
    assert "\n" not in message and str(tree.manifest_path) in message
    assert snapshot(tree.site) == before


def test_manifest_for_another_vllm_than_the_recipe(tree):
    doc = json.loads(tree.manifest_path.read_bytes())
    tree.manifest_path.write_text(json.dumps({**doc, "vllm_version": "0.25.0"}))
    assert "made for vLLM 0.25.0, but recipe glm5-dsa pins vLLM 0.24.0, 0.33.0" in expect_error(overlay.BAD_INPUT,
                                                                                               tree.apply)


def test_unknown_recipe(tree):
    message = expect_error(overlay.BAD_INPUT, overlay.apply, tree.site, "nope", tree.manifest_path, tree.overlay_dir)
    assert message == "unknown recipe 'nope'; valid recipes: glm5-dsa"


def test_copy_failing_midway_restores_every_file(tree, monkeypatch):
    pyc = Path(importlib.util.cache_from_source(str(tree.site / "vllm/envs.py")))
    pyc.parent.mkdir()
    pyc.write_bytes(b"pre-existing bytecode")
    before = snapshot(tree.site)
    from dsa_image.overlay import fs as overlay_fs

    real_write = overlay_fs.write_new
    calls = []

    def fail_on_second(site, path, *args):
        if path.name != "journal.json.new":  # the files' new contents only
            calls.append(path)
            if len(calls) == 2:
                raise OSError(errno.EIO, "simulated I/O error", str(path))
        real_write(site, path, *args)

    monkeypatch.setattr(overlay_fs, "write_new", fail_on_second)
    message = expect_error(overlay.CANNOT_WRITE, tree.apply)
    assert "every file was restored" in message
    assert len(calls) == 2
    assert snapshot(tree.site) == before


def test_compile_failure_after_copy_restores_every_file(tmp_path):
    tree = Tree(tmp_path)
    (tree.overlay_dir / "vllm/a/new.py").write_bytes(b"def broken(:\n")
    tree.record()
    before = snapshot(tree.site)
    assert "every file was restored" in expect_error(overlay.CANNOT_WRITE, tree.apply)
    assert snapshot(tree.site) == before


def test_read_only_target_changes_nothing(tree, monkeypatch):
    """A read-only mount (EROFS) refuses writes even to root, so simulate it at the syscall
    the tool uses to create files (chmod would not stop root)."""
    real_mkstemp = tempfile.mkstemp
    site = str(tree.site)

    def read_only_mkstemp(*args, dir=None, **kwargs):
        if dir is not None and str(dir).startswith(site):
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", read_only_mkstemp)
    before = snapshot(tree.site)
    message = expect_error(overlay.CANNOT_WRITE, tree.apply)
    assert "Read-only file system" in message and "Nothing was changed" in message
    assert snapshot(tree.site) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod; the EROFS test covers root")
def test_unwritable_directory_changes_nothing(tree):
    directory = tree.site / "vllm/a"
    directory.chmod(0o555)
    try:
        before = snapshot(tree.site)
        assert "cannot write" in expect_error(overlay.CANNOT_WRITE, tree.apply)
        assert snapshot(tree.site) == before
    finally:
        directory.chmod(0o755)


def test_receipts_are_reproducible(tmp_path):
    first, second = Tree(tmp_path / "one"), Tree(tmp_path / "two")
    first.apply()
    second.apply()
    one, two = snapshot(first.site), snapshot(second.site)
    assert one[overlay.RECEIPT_NAME] == two[overlay.RECEIPT_NAME]
    assert b"time" not in one[overlay.RECEIPT_NAME]


def test_the_receipt_is_predicted_from_the_manifest(tree):
    """The image label carries the receipt's sha256 before the build: it must be exactly the
    sha256 of the receipt apply then writes, and change when the manifest does."""
    predicted = overlay.predicted_receipt_sha256(RECIPE, tree.manifest_path)
    tree.apply()
    assert wheels.sha256_file(tree.site / overlay.RECEIPT_NAME) == predicted
    another = dataclasses.replace(RECIPE, id="another-recipe")
    assert overlay.predicted_receipt_sha256(another, tree.manifest_path) != predicted


def test_same_path_same_bytes(tmp_path):
    """Applied twice at the same path (as in a Docker build), every byte is the same, bytecode
    and the originals' index included: checked-hash pycs carry no mtime (the source path is in
    them, hence same path), the index no pid."""
    first = Tree(tmp_path / "build")
    first.apply()
    one = snapshot(first.site)
    shutil.rmtree(tmp_path / "build")
    second = Tree(tmp_path / "build")
    os.utime(second.overlay_dir / "vllm/envs.py", (1, 1))  # a different mtime must not matter
    done = run_cli(*second.common(), "apply", "--site-packages", str(second.site))  # another process
    assert done.returncode == 0, done.stderr
    assert snapshot(second.site) == one


def test_receipt_elsewhere(tree, tmp_path):
    receipt = tmp_path / "out" / "receipt.json"
    receipt.parent.mkdir()
    tree.apply(receipt_path=receipt)
    assert receipt.exists() and not (tree.site / overlay.RECEIPT_NAME).exists()
    overlay.verify_hashes(tree.site, tree.manifest_path, receipt)


# --- verify ----------------------------------------------------------------------------------


def test_verify_detects_file_changed_after_apply(on_path):
    on_path.apply()
    (on_path.site / "vllm/a/mod.py").write_bytes(b"VALUE = 'changed later'\n")
    assert "changed after apply" in expect_error(overlay.MISMATCH, on_path.verify)


@pytest.mark.parametrize("tamper", [
    lambda r: {**r, "files": [{**r["files"][0], "installed_sha256": "0" * 64}, *r["files"][1:]]},
    lambda r: {**r, "manifest_sha256": "1" * 64},
    lambda r: {**r, "vllm_version": "0.25.0"},
    lambda r: {**r, "files": r["files"][1:]},
    lambda r: {**r, "extra": True},
    lambda r: {**r, "recipe": "another-recipe"},
    lambda r: {**r, "recipe": "../recipes/glm5-dsa"},
], ids=["installed-hash", "manifest-hash", "version", "dropped-file", "extra-key", "recipe", "recipe-path"])
def test_verify_detects_tampered_receipt(on_path, tamper):
    receipt_path = on_path.site / overlay.RECEIPT_NAME
    receipt_path.write_text(json.dumps(tamper(on_path.apply())))
    expect_error(overlay.MISMATCH, on_path.verify)


def test_verify_of_another_bases_receipt_names_the_base_to_check(on_path):
    """A receipt apply wrote for another base's overlay (another vLLM, another manifest): verify
    says which base to check, rather than to re-apply."""
    receipt_path = on_path.site / overlay.RECEIPT_NAME
    receipt = on_path.apply()
    receipt_path.write_text(json.dumps({**receipt, "vllm_version": "0.25.0", "manifest_sha256": "1" * 64}))
    message = expect_error(overlay.MISMATCH, on_path.verify)
    assert f"apply wrote it for vLLM 0.25.0's overlay; verify checks base {VERSION}" in message
    assert "verify --vllm 0.25.0 --site-packages" in message and "re-apply" not in message


def test_verify_without_or_with_garbage_receipt(on_path):
    assert "no receipt" in expect_error(overlay.MISMATCH, on_path.verify)
    on_path.apply()
    (on_path.site / overlay.RECEIPT_NAME).write_text("{")
    assert "not JSON" in expect_error(overlay.MISMATCH, on_path.verify)


def test_verify_detects_pythonpath_shadowing(tree, tmp_path, monkeypatch):
    tree.apply()
    checkout = tmp_path / "checkout"
    write_tree(checkout, {**UPSTREAM, **OVERLAY})
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(checkout), str(tree.site)]))
    message = expect_error(overlay.MISMATCH, tree.verify)
    assert f"imported from {checkout}" in message and "shadowed" in message


def test_verify_is_not_fooled_by_the_working_directory(on_path, tmp_path, monkeypatch):
    """A vllm/ in the caller's cwd does not shadow: the probe runs in an empty directory."""
    on_path.apply()
    cwd = tmp_path / "cwd"
    write_tree(cwd, {**UPSTREAM, **OVERLAY})
    monkeypatch.chdir(cwd)
    on_path.verify()


def test_verify_says_when_site_is_not_on_sys_path(tree, monkeypatch):
    tree.apply()
    monkeypatch.delenv("PYTHONPATH", raising=False)
    message = expect_error(overlay.MISMATCH, tree.verify)
    assert f"{tree.site} is not on sys.path of {sys.executable}" in message


def test_module_names():
    def module(path):
        return Entry(path, None, "0" * 64, "w").module
    assert module("vllm/v1/attention/backends/mla/indexer.py") == "vllm.v1.attention.backends.mla.indexer"
    assert module("vllm/a/__init__.py") == "vllm.a"
    assert module("vllm/a/data.json") is None


# --- manifest and record -------------------------------------------------------------------


def test_manifest_bytes_round_trip_and_are_stable(tree):
    raw = tree.manifest_path.read_bytes()
    assert manifest_bytes(parse_manifest(raw)) == raw
    assert raw.endswith(b"}\n") and json.loads(raw)["schema"] == 1


def test_record_entry_needs_why_and_keeps_it(tree):
    with pytest.raises(ManifestError, match="needs --why"):
        record_entry("vllm/envs.py", None, tree.overlay_dir, UPSTREAM.get, None)
    previous = tree.manifest.entry("vllm/envs.py")
    (tree.overlay_dir / "vllm/envs.py").write_bytes(b"FLAG = 'v2'\n")
    fresh = record_entry("vllm/envs.py", None, tree.overlay_dir, UPSTREAM.get, previous)
    assert fresh.why == previous.why
    assert fresh.overlay_sha256 == sha256_bytes(b"FLAG = 'v2'\n") != previous.overlay_sha256
    assert fresh.upstream_sha256 == sha256_bytes(UPSTREAM["vllm/envs.py"])


def test_unrecorded_overlay_file_is_reported(tree):
    write_tree(tree.overlay_dir, {"vllm/stray.py": b"x = 1\n", "vllm/__pycache__/envs.cpython-311.pyc": b"ignored"})
    assert overlay.unrecorded_files(tree.manifest, tree.overlay_dir) == ["vllm/stray.py"]


# --- the CLI -------------------------------------------------------------------------------


def test_cli_help_documents_exit_codes():
    done = run_cli("--help")
    assert done.returncode == 0
    for code, meaning in ((overlay.OK, "ok"), (overlay.MISMATCH, "verification mismatch"), (overlay.BAD_INPUT, "bad usage"),
                          (overlay.DRIFT, "upstream drift"), (overlay.CANNOT_WRITE, "cannot write"),
                          (overlay.CONFLICT, "rebase: the merge left conflicts")):
        assert f"\n  {code:<3}{status.name(code):<{status.NAME_WIDTH}}{meaning}" in done.stdout
    # the tool's names are the table's codes
    assert (overlay.OK, overlay.MISMATCH, overlay.BAD_INPUT, overlay.DRIFT, overlay.CANNOT_WRITE, overlay.CONFLICT) == (
        status.SUCCESS, status.FAILED, status.USAGE, status.DRIFT, status.ENVIRONMENT, status.CONFLICT)


def test_cli_apply_and_verify(tree):
    common = ["--manifest", str(tree.manifest_path), "--overlay-dir", str(tree.overlay_dir)]
    (tree.site / "vllm/envs.py").write_bytes(b"drifted\n")
    drift = run_cli(*common, "apply", "--site-packages", str(tree.site))
    assert drift.returncode == overlay.DRIFT and drift.stderr.startswith("error: vllm/envs.py: the overlay was made")
    (tree.site / "vllm/envs.py").write_bytes(UPSTREAM["vllm/envs.py"])
    assert run_cli(*common, "apply", "--site-packages", str(tree.site)).returncode == 0
    env = {**os.environ, "PYTHONPATH": str(tree.site)}
    done = run_cli(*common, "verify", "--site-packages", str(tree.site), env=env)
    assert done.returncode == 0, done.stderr
    assert run_cli(*common, "apply", "--site-packages", str(tree.site), "--recipe", "nope").returncode == overlay.BAD_INPUT
    assert run_cli("apply").returncode == 2  # usage: --site-packages is required


def test_cli_vllm_picks_the_base_and_refuses_a_release_the_recipe_does_not_pin(tree):
    unknown = run_cli("check", "--vllm", "0.25.0")
    assert unknown.returncode == overlay.BAD_INPUT
    assert "no vLLM '0.25.0'; this recipe pins: 0.24.0, 0.33.0" in unknown.stderr
    # verify in the image reads the base from DSA_IMAGE_VLLM: a wrong one is refused, not ignored
    env = {**os.environ, "DSA_IMAGE_VLLM": "0.25.0"}
    done = run_cli("verify", "--site-packages", str(tree.site), env=env)
    assert done.returncode == overlay.BAD_INPUT and "no vLLM '0.25.0'" in done.stderr


# --- the receipt path may never be a managed file ------------------------------------------


@pytest.mark.parametrize("rel", ["vllm/envs.py", "vllm/a/new.py", "vllm/a/__init__.py", "vllm/receipt.json"])
def test_receipt_may_not_go_inside_the_managed_package(tree, rel):
    """`--receipt DIR/vllm/envs.py` exited 0 and left envs.py holding JSON."""
    before = snapshot(tree.site)
    done = run_cli(*tree.common(), "apply", "--site-packages", str(tree.site), "--receipt", str(tree.site / rel))
    assert done.returncode == overlay.BAD_INPUT, done.stderr
    assert "may not go inside" in done.stderr and done.stderr.count("\n") == 1
    assert snapshot(tree.site) == before


def test_receipt_never_replaces_a_file_that_is_not_a_receipt(tree, tmp_path):
    precious = tmp_path / "notes.txt"
    precious.write_text("not a receipt\n")
    before = snapshot(tree.site)
    message = expect_error(overlay.BAD_INPUT, tree.apply, receipt_path=precious)
    assert "not an overlay receipt" in message
    assert precious.read_text() == "not a receipt\n" and snapshot(tree.site) == before


def test_verify_checks_the_recipe_it_is_asked_for(on_path):
    on_path.apply()
    assert "unknown recipe 'nope'" in expect_error(overlay.BAD_INPUT, on_path.verify, recipe_id="nope")
    on_path.verify(recipe_id="glm5-dsa")


# --- bad input: exit 2 and one line, never a traceback ------------------------------------


def deep_json(depth: int = 100_000) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("case", ["python-missing", "python-missing-no-site", "site-missing", "deep-manifest",
                                  "deep-manifest-verify", "deep-receipt", "recipe-outside", "recipe-absolute",
                                  "huge-int-manifest", "huge-int-manifest-revert"])
def test_cli_bad_input_is_exit_2_and_one_line(tree, case):
    site = str(tree.site)
    if case.startswith("deep-manifest"):
        tree.manifest_path.write_bytes(deep_json())
    if case.startswith("huge-int-manifest"):  # past Python's int-from-text limit (4300 digits): a ValueError
        tree.manifest_path.write_bytes(b'{"schema": ' + b"1" * 5000 + b"}")
    if case == "deep-receipt":
        tree.apply()
        (tree.site / overlay.RECEIPT_NAME).write_bytes(deep_json())
    args = {
        "python-missing": ["verify", "--site-packages", site, "--python", "/nonexistent/python"],
        "python-missing-no-site": ["verify", "--python", "/nonexistent/python"],
        "site-missing": ["verify", "--site-packages", str(tree.site / "absent")],
        "deep-manifest": ["apply", "--site-packages", site],
        "deep-manifest-verify": ["verify", "--site-packages", site],
        "deep-receipt": ["verify", "--site-packages", site],
        "recipe-outside": ["apply", "--site-packages", site, "--recipe", "../recipes/glm5-dsa"],
        "recipe-absolute": ["apply", "--site-packages", site, "--recipe", str(REPO / "recipes" / "glm5-dsa")],
        "huge-int-manifest": ["apply", "--site-packages", site],
        "huge-int-manifest-revert": ["revert", "--site-packages", site],
    }[case]
    before = snapshot(tree.site)
    done = run_cli(*tree.common(), *args)
    assert done.returncode == overlay.BAD_INPUT, done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert snapshot(tree.site) == before


@pytest.mark.parametrize("where", ["manifest", "site", "receipt", "overlay-dir"])
def test_a_nul_byte_in_a_path_is_bad_input(tree, where):
    """argv cannot carry a NUL, but paths reach the library from other code too."""
    bad = {"manifest": tree.manifest_path, "site": tree.site, "receipt": tree.site / "r.json",
           "overlay-dir": tree.overlay_dir}[where]
    nul = Path(f"{bad}\0x")
    kwargs = {"manifest": {"manifest_path": nul}, "site": {}, "receipt": {"receipt_path": nul},
              "overlay-dir": {"overlay_dir": nul}}[where]
    site = nul if where == "site" else tree.site
    args = {"manifest_path": tree.manifest_path, "overlay_dir": tree.overlay_dir, **kwargs}
    message = expect_error(overlay.BAD_INPUT, overlay.apply, site, "glm5-dsa", **args)
    assert "\n" not in message
    if where != "overlay-dir":
        verify_args = {k: v for k, v in args.items() if k != "overlay_dir"}
        assert "\n" not in expect_error(overlay.BAD_INPUT, overlay.verify_hashes, site, **verify_args)


def test_drift_and_verify_messages_show_full_sha256(on_path):
    tree = on_path
    edited = b"VALUE = 'upstream!'\n"
    (tree.site / "vllm/a/mod.py").write_bytes(edited)
    message = expect_error(overlay.DRIFT, tree.apply)
    assert sha256_bytes(edited) in message and sha256_bytes(UPSTREAM["vllm/a/mod.py"]) in message
    (tree.site / "vllm/a/mod.py").write_bytes(UPSTREAM["vllm/a/mod.py"])
    tree.apply()
    (tree.site / "vllm/envs.py").write_bytes(edited)
    message = expect_error(overlay.MISMATCH, tree.verify)
    assert sha256_bytes(edited) in message and sha256_bytes(OVERLAY["vllm/envs.py"]) in message


def test_a_huge_integer_in_changes_toml_is_a_manifest_error(tmp_path):
    from dsa_image.overlay.manifest import load_changes

    changes = tmp_path / "changes.toml"
    changes.write_text("[changes.a]\ntitle = " + "1" * 5000 + "\n")
    with pytest.raises(ManifestError, match="cannot read the named changes"):
        load_changes(changes)
