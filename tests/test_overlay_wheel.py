"""The overlay against the real pinned vLLM wheel (downloaded once into the cache through
dsa_image.wheels, so this works from a clean clone)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from dsa_image import overlay, wheels
from dsa_image.manifest import load_manifest, manifest_bytes
from dsa_image.recipe import load_recipe

pytestmark = pytest.mark.wheel

RECIPE = load_recipe()


@pytest.fixture(scope="module")
def wheel() -> Path:
    return overlay.reference_wheel(RECIPE)


def site_from_wheel(wheel: Path, root: Path) -> Path:
    """A bare site-packages with vLLM's dist-info and every file the overlay replaces, plus the
    directories its new files go into: what apply needs (it never imports vLLM)."""
    manifest, _ = load_manifest(overlay.MANIFEST_PATH)
    wanted = {e.path for e in manifest.files if not e.new}
    with zipfile.ZipFile(wheel) as archive:
        members = [m for m in archive.namelist() if m in wanted or m.startswith(f"vllm-{RECIPE.vllm_version}.dist-info/")]
        archive.extractall(root, members)
    for entry in manifest.files:
        (root / entry.path).parent.mkdir(parents=True, exist_ok=True)
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_check_passes_on_the_repo():
    assert overlay.check(platforms=["linux/amd64"]) == [
        f"{RECIPE.wheel('linux/amd64').filename}: {len(load_manifest(overlay.MANIFEST_PATH)[0].files)} entries agree"]


def test_apply_then_verify_on_the_real_wheel(wheel, tmp_path):
    site = site_from_wheel(wheel, tmp_path / "site")
    receipt = overlay.apply(site)
    manifest, _ = load_manifest(overlay.MANIFEST_PATH)
    for entry in manifest.files:
        assert (site / entry.path).read_bytes() == (overlay.OVERLAY_DIR / entry.path).read_bytes()
    assert receipt["vllm_version"] == RECIPE.vllm_version
    # the import half of verify needs torch; tests/test_overlay.py covers it on synthetic trees
    overlay.verify_hashes(site)


def test_one_changed_byte_upstream_fails_and_changes_nothing(wheel, tmp_path):
    site = site_from_wheel(wheel, tmp_path / "site")
    manifest, _ = load_manifest(overlay.MANIFEST_PATH)
    victim = site / next(e.path for e in manifest.files if not e.new)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    before = snapshot(site)
    with pytest.raises(overlay.OverlayError) as caught:
        overlay.apply(site)
    assert caught.value.code == overlay.DRIFT
    message = str(caught.value)
    assert message.startswith(f"{victim.relative_to(site).as_posix()}: the overlay was made for vLLM {RECIPE.vllm_version}")
    assert "Nothing was changed." in message
    assert snapshot(site) == before


def test_record_refresh_reproduces_the_committed_manifest(tmp_path):
    """The committed manifest is exactly what the tool computes from the overlay files and the
    pinned wheel: nobody edited hashes by hand, and no overlay file changed since `record`."""
    manifest_path = tmp_path / "manifest.json"
    manifest_path.write_bytes(overlay.MANIFEST_PATH.read_bytes())
    refreshed = overlay.record([], refresh=True, manifest_path=manifest_path)
    assert manifest_bytes(refreshed) == overlay.MANIFEST_PATH.read_bytes()


def test_diff_shows_each_overlay_file(wheel):
    text = overlay.diff()
    manifest, _ = load_manifest(overlay.MANIFEST_PATH)
    for entry in manifest.files:
        assert f"+++ b/{entry.path} (overlay)" in text
        assert (f"--- a/{entry.path} (vLLM {RECIPE.vllm_version} wheel)" in text) != entry.new


def test_revert_on_the_real_wheel_restores_every_upstream_byte(wheel, tmp_path):
    site = site_from_wheel(wheel, tmp_path / "site")
    before = snapshot(site)
    overlay.apply(site)
    overlay.revert(site)
    assert snapshot(site) == before
    manifest, _ = load_manifest(overlay.MANIFEST_PATH)
    for entry in (e for e in manifest.files if not e.new):
        assert (site / entry.path).read_bytes() == wheels.read_member(wheel, entry.path)
    overlay.apply(site)
    overlay.verify_hashes(site)
