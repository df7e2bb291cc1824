"""Copying an installed distribution into a validation site (dsa_image/validation/dist_copy.py):
its RECORD is untrusted input. No GPU, no network: a made-up installation under tmp_path."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest

from dsa_image.validation import dist_copy


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def install(root: Path, name: str = "nvidia-foo", version: str = "12.0.0.61", files: dict[str, bytes] | None = None,
            extra_rows: tuple[str, ...] = ()) -> Path:
    """A pip-style installation of `name` under `root`: its files, METADATA and RECORD."""
    files = files if files is not None else {"nvidia/foo/lib/libfoo.so.12": b"\x7fELF" + b"x" * 5000,
                                             "nvidia/foo/__init__.py": b""}
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()}
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    rows = [f"{rel},{record_hash(data)},{len(data)}" for rel, data in files.items()]
    rows += [*extra_rows, f"{info}/RECORD,,"]
    (root / info / "RECORD").write_text("\n".join(rows) + "\n")
    return root


def test_the_installed_files_arrive_in_the_site_each_as_recorded(tmp_path):
    root, site = install(tmp_path / "venv"), tmp_path / "site"
    (site / "nvidia" / "bar").mkdir(parents=True)  # another library's folder of the shared namespace
    count = dist_copy.copy_dist("nvidia_foo", "12.0.0.61", site, [root])
    assert count == 4  # two files, METADATA, RECORD
    assert (site / "nvidia/foo/lib/libfoo.so.12").read_bytes() == (root / "nvidia/foo/lib/libfoo.so.12").read_bytes()
    assert (site / "nvidia_foo-12.0.0.61.dist-info/RECORD").is_file()


def test_bytecode_pip_recorded_without_a_hash_is_left_out(tmp_path):
    root = install(tmp_path / "venv", extra_rows=("nvidia/foo/__pycache__/__init__.cpython-312.pyc,,",))
    (root / "nvidia/foo/__pycache__").mkdir()
    (root / "nvidia/foo/__pycache__/__init__.cpython-312.pyc").write_bytes(b"cache")
    dist_copy.copy_dist("nvidia-foo", "12.0.0.61", tmp_path / "site", [root])
    assert not (tmp_path / "site/nvidia/foo/__pycache__").exists()


@pytest.mark.parametrize("row", ["../../bin/evil,sha256=AAAA,4", "/etc/evil,sha256=AAAA,4"])
def test_a_record_entry_outside_the_installation_is_refused_before_anything_is_written(tmp_path, row):
    root, site = install(tmp_path / "venv", extra_rows=(row,)), tmp_path / "site"
    with pytest.raises(dist_copy.CopyError, match="is outside"):
        dist_copy.copy_dist("nvidia-foo", "12.0.0.61", site, [root])
    assert not site.exists()


def test_a_file_that_differs_from_its_record_fails_and_leaves_the_site_as_it_was(tmp_path):
    root, site = install(tmp_path / "venv"), tmp_path / "site"
    (site / "nvidia" / "bar").mkdir(parents=True)
    (root / "nvidia/foo/lib/libfoo.so.12").write_bytes(b"damaged")
    with pytest.raises(dist_copy.CopyError, match="differs from its RECORD") as caught:
        dist_copy.copy_dist("nvidia-foo", "12.0.0.61", site, [root])
    assert caught.value.exit_code == dist_copy.status.ENVIRONMENT
    assert sorted(p.relative_to(site).as_posix() for p in site.rglob("*")) == ["nvidia", "nvidia/bar"]


def test_an_unhashed_file_other_than_record_or_bytecode_is_refused(tmp_path):
    root = install(tmp_path / "venv", extra_rows=("nvidia/foo/lib/libunchecked.so,,",))
    with pytest.raises(dist_copy.CopyError, match="without a sha256"):
        dist_copy.copy_dist("nvidia-foo", "12.0.0.61", tmp_path / "site", [root])


def test_a_site_that_already_has_a_file_of_it_is_refused(tmp_path):
    root, site = install(tmp_path / "venv"), tmp_path / "site"
    (site / "nvidia/foo").mkdir(parents=True)
    (site / "nvidia/foo/__init__.py").write_text("# the site's own")
    with pytest.raises(dist_copy.CopyError, match="already has nvidia/foo/__init__.py"):
        dist_copy.copy_dist("nvidia-foo", "12.0.0.61", site, [root])
    assert (site / "nvidia/foo/__init__.py").read_text() == "# the site's own"


def test_another_version_or_none_installed_is_refused_saying_to_stage_it(tmp_path):
    root = install(tmp_path / "venv")
    with pytest.raises(dist_copy.CopyError, match=r"expected 12\.0\.0\.62 installed, found 12\.0\.0\.61; stage it"):
        dist_copy.copy_dist("nvidia-foo", "12.0.0.62", tmp_path / "site", [root])
    with pytest.raises(dist_copy.CopyError, match="nvidia-bar==1: expected it installed under .*found none"):
        dist_copy.copy_dist("nvidia-bar", "1", tmp_path / "site", [root])


def test_the_installed_roots_are_this_pythons_site_packages_not_sys_path():
    import sysconfig

    assert dist_copy.installed_roots()[0] == Path(sysconfig.get_paths()["purelib"])


def test_the_install_phase_copies_exactly_the_selections_rows_left_to_the_h200(tmp_path, monkeypatch):
    from dsa_image.validation import stage

    selection = tmp_path / stage.SELECTION
    selection.write_text(
        "torch==2.14.0  torch-2.14.0-cp312-cp312-manylinux_2_28_x86_64.whl  the H200 has 2.11.0\n"
        f"nvidia-cufft==12.0.0.61  {stage.FROM_H200}  {stage.COPIED}\n")
    copied, said = [], []
    monkeypatch.setattr(dist_copy, "copy_dist", lambda name, version, site: copied.append((name, version, site)) or 3)
    assert dist_copy.copy_listed(selection, tmp_path / "site", said.append) == dist_copy.status.SUCCESS
    assert copied == [("nvidia-cufft", "12.0.0.61", tmp_path / "site")]
    assert said == [f"nvidia-cufft==12.0.0.61: 3 files of the H200's installation into {tmp_path / 'site'}"]
    selection.unlink()
    assert dist_copy.copy_listed(selection, tmp_path / "site", said.append) == dist_copy.status.FAILED


@pytest.mark.parametrize("bad", ["nvidia-cublas", "nvidia-cublas==13.1.0.3", "nvidia-cublas  -  no version",
                                 "==13.1.0.3  -  no name", "nvidia-cublas==13.1.0.3  cublas.tar.gz  not a wheel",
                                 "nvidia-cufft==12.0.0.62  -  listed twice"])
def test_a_malformed_selection_line_is_refused_by_number_and_text_before_anything_is_copied(tmp_path, monkeypatch,
                                                                                            capsys, bad):
    from dsa_image.validation import stage

    # the good row comes first: a refusal must not leave it copied
    selection = tmp_path / stage.SELECTION
    selection.write_text(f"nvidia-cufft==12.0.0.61  {stage.FROM_H200}  {stage.COPIED}\n\n{bad}\n")
    copied: list[str] = []
    monkeypatch.setattr(dist_copy, "copy_dist", lambda name, version, site: copied.append(name) or 3)
    assert dist_copy.copy_listed(selection, tmp_path / "site", print) == dist_copy.status.FAILED
    err = capsys.readouterr().err
    assert copied == [] and f"{selection}:3: expected `name==version" in err and repr(bad) in err
    assert "python3 scripts/stage_h200_wheels.py" in err
    with pytest.raises(dist_copy.CopyError, match=r"selection\.txt:3"):
        dist_copy.left_to_h200(selection)


@pytest.mark.parametrize("linked", ["nvidia", "nvidia/foo"])
def test_a_symlinked_folder_in_the_site_is_refused_before_anything_is_written_inside_or_outside(tmp_path, linked):
    root, site, elsewhere = install(tmp_path / "venv"), tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    (site / linked).parent.mkdir(parents=True, exist_ok=True)
    (site / linked).symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(dist_copy.CopyError, match=rf"nvidia/foo/\S+ would be written through {site / linked}, "
                                                  rf"a symlink \(to {elsewhere}\).*Remove the symlink"):
        dist_copy.copy_dist("nvidia-foo", "12.0.0.61", site, [root])
    assert list(elsewhere.iterdir()) == []
    # the site holds only what the test made: the symlink and the folders on the way to it
    assert sorted(p.relative_to(site).as_posix() for p in site.rglob("*")) == sorted(
        {linked, *(q.as_posix() for q in Path(linked).parents if q.parts)})
