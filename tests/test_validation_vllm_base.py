"""Which vLLM base a validation run is for (dsa_image.validation.vllm_base): the installed
vLLM's, which --vllm may only confirm."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsa_image.core.dist_info import DistInfoError
from dsa_image.validation import vllm_base


def fake_site(root: Path, vllm: str | None) -> str:
    """A site-packages directory holding vLLM `vllm`'s dist-info (none for None)."""
    root.mkdir(parents=True)
    if vllm:
        info = root / f"vllm-{vllm}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm}\n")
    return str(root)


def test_the_base_is_the_installed_vllm():
    assert vllm_base.choose(None, {"0.33.0"}) == "0.33.0"
    assert vllm_base.choose("0.33.0", {"0.33.0"}) == "0.33.0"
    with pytest.raises(RuntimeError, match="--vllm 0.24.0, but vLLM 0.33.0 is installed"):
        vllm_base.choose("0.24.0", {"0.33.0"})
    with pytest.raises(RuntimeError, match="one base per run"):
        vllm_base.choose(None, {"0.24.0", "0.33.0"})


def test_the_sites_base_is_the_vllm_every_site_holds(tmp_path):
    a, b = fake_site(tmp_path / "a", "0.33.0"), fake_site(tmp_path / "b", "0.33.0")
    assert vllm_base.sites_base(None, [a, b]) == "0.33.0"
    with pytest.raises(RuntimeError, match="--vllm 0.24.0, but vLLM 0.33.0 is installed"):
        vllm_base.sites_base("0.24.0", [a, b])
    with pytest.raises(RuntimeError, match="one base per run"):
        vllm_base.sites_base(None, [a, fake_site(tmp_path / "c", "0.24.0")])
    bare = fake_site(tmp_path / "bare", None)
    with pytest.raises(DistInfoError, match=f"{bare}: expected one vllm-"):
        vllm_base.sites_base("0.33.0", [a, bare])
