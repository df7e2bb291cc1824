"""Each base's overlay against its real pinned vLLM wheel (downloaded once into the cache
through dsa_image.core.wheels, so this works from a clean clone)."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest

from dsa_image.overlay import cli as overlay
from dsa_image.core import wheels
from dsa_image.overlay.manifest import load_manifest, manifest_bytes
from dsa_image.core.recipe import Recipe, load_every_base

pytestmark = pytest.mark.wheel

BASES = {recipe.vllm_version: recipe for recipe in load_every_base()}


@pytest.fixture(params=list(BASES))
def base(request) -> Recipe:
    return BASES[request.param]


@pytest.fixture
def wheel(base) -> Path:
    return overlay.reference_wheel(base)


def manifest_of(base: Recipe):
    return load_manifest(overlay.manifest_path(base.vllm_version))[0]


def apply(base: Recipe, site: Path) -> dict:
    version = base.vllm_version
    return overlay.apply(site, base.id, overlay.manifest_path(version), overlay.overlay_dir(version))


def site_from_wheel(base: Recipe, wheel: Path, root: Path) -> Path:
    """A bare site-packages with vLLM's dist-info and every file the overlay replaces, plus the
    directories its new files go into: what apply needs (it never imports vLLM)."""
    manifest = manifest_of(base)
    wanted = {e.path for e in manifest.files if not e.new}
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m in wanted or m.startswith(f"vllm-{base.vllm_version}.dist-info/")]
        archive.extractall(root, members)
    for entry in manifest.files:
        (root / entry.path).parent.mkdir(parents=True, exist_ok=True)
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_check_passes_on_the_repo(base):
    version = base.vllm_version
    assert overlay.check(base.id, overlay.manifest_path(version), overlay.overlay_dir(version),
                         platforms=["linux/amd64"]) == [
        f"{base.wheel('linux/amd64').filename}: {len(manifest_of(base).files)} entries agree"]


def test_overlay_holds_one_directory_per_base():
    assert sorted(p.name for p in overlay.OVERLAY_ROOT.iterdir()) == sorted(f"vllm-{v}" for v in BASES)
    assert overlay.stray_overlays(next(iter(BASES.values())), overlay.OVERLAY_ROOT) == []


def test_a_stray_overlay_fails_check(monkeypatch, tmp_path):
    """overlay/ with an overlay for no pinned release (a leftover, or a base dropped from the
    recipe) is refused: the repo must say which overlay belongs to which vLLM."""
    root = tmp_path / "overlay"
    shutil.copytree(overlay.OVERLAY_ROOT, root)
    (root / "vllm").mkdir()
    monkeypatch.setattr(overlay, "OVERLAY_ROOT", root)
    recipe = next(iter(BASES.values()))
    with pytest.raises(overlay.OverlayError, match="overlay: vllm is not the overlay of a vLLM release"):
        overlay.check(recipe.id, root / f"vllm-{recipe.vllm_version}" / "manifest.json",
                      root / f"vllm-{recipe.vllm_version}", platforms=[])


def test_apply_then_verify_on_the_real_wheel(base, wheel, tmp_path):
    site = site_from_wheel(base, wheel, tmp_path / "site")
    receipt = apply(base, site)
    for entry in manifest_of(base).files:
        assert (site / entry.path).read_bytes() == (overlay.overlay_dir(base.vllm_version) / entry.path).read_bytes()
    assert receipt["vllm_version"] == base.vllm_version
    # the import half of verify needs torch; tests/test_overlay.py covers it on synthetic trees
    overlay.verify_hashes(site, overlay.manifest_path(base.vllm_version))


def test_a_base_overlay_refuses_the_other_vllm(tmp_path):
    """Each overlay applies only to the vLLM it was made for: the other base's install is drift."""
    older, newer = BASES["0.24.0"], BASES["0.33.0"]
    site = site_from_wheel(older, overlay.reference_wheel(older), tmp_path / "site")
    with pytest.raises(overlay.OverlayError) as caught:
        apply(newer, site)
    assert caught.value.exit_code == overlay.DRIFT and "the installed vLLM is 0.24.0" in str(caught.value)


def test_one_changed_byte_upstream_fails_and_changes_nothing(base, wheel, tmp_path):
    site = site_from_wheel(base, wheel, tmp_path / "site")
    victim = site / next(e.path for e in manifest_of(base).files if not e.new)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    before = snapshot(site)
    with pytest.raises(overlay.OverlayError) as caught:
        apply(base, site)
    assert caught.value.exit_code == overlay.DRIFT
    message = str(caught.value)
    assert message.startswith(f"{victim.relative_to(site).as_posix()}: the overlay was made for vLLM {base.vllm_version}")
    assert "Nothing was changed." in message
    assert snapshot(site) == before


def test_record_refresh_reproduces_the_committed_manifest(base, tmp_path):
    """The committed manifest is exactly what the tool computes from the overlay files and the
    pinned wheel: nobody edited hashes by hand, and no overlay file changed since `record`."""
    version = base.vllm_version
    manifest_path = tmp_path / "manifest.json"
    manifest_path.write_bytes(overlay.manifest_path(version).read_bytes())
    refreshed = overlay.record([], None, True, False, base.id, version, manifest_path, overlay.overlay_dir(version))
    assert manifest_bytes(refreshed) == overlay.manifest_path(version).read_bytes()


def test_diff_shows_each_overlay_file(base, wheel):
    version = base.vllm_version
    text = overlay.diff(base.id, overlay.manifest_path(version), overlay.overlay_dir(version))
    for entry in manifest_of(base).files:
        assert f"+++ b/{entry.path} (overlay)" in text
        assert (f"--- a/{entry.path} (vLLM {version} wheel)" in text) != entry.new


def test_revert_on_the_real_wheel_restores_every_upstream_byte(base, wheel, tmp_path):
    site = site_from_wheel(base, wheel, tmp_path / "site")
    manifest_path = overlay.manifest_path(base.vllm_version)
    before = snapshot(site)
    apply(base, site)
    overlay.revert(site, manifest_path)
    assert snapshot(site) == before
    for entry in (e for e in manifest_of(base).files if not e.new):
        assert (site / entry.path).read_bytes() == wheels.read_member(wheel, entry.path)
    apply(base, site)
    overlay.verify_hashes(site, manifest_path)
