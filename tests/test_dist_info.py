"""The installed vLLM's version, read from the one vllm-*.dist-info in a site-packages
directory (dsa_image.core.dist_info): what overlay, arch_check, the self-test and the validation
harnesses all read."""

from __future__ import annotations

import pytest

from dsa_image.core.dist_info import DistInfoError, installed_vllm_version


def add_dist_info(site, directory: str, metadata: str) -> None:
    (site / directory).mkdir(parents=True)
    (site / directory / "METADATA").write_text(metadata)


def test_the_one_vllm_install_is_read(tmp_path):
    add_dist_info(tmp_path, "vllm-0.33.0.dist-info", "Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n")
    add_dist_info(tmp_path, "vllm_extra-1.0.dist-info", "Metadata-Version: 2.1\nName: vllm-extra\nVersion: 1.0\n")
    assert installed_vllm_version(tmp_path) == "0.33.0"


@pytest.mark.parametrize("infos, found", [
    ({}, "none"),
    ({"vllm-0.24.0.dist-info": "0.24.0", "vllm-0.33.0.dist-info": "0.33.0"}, "2 (0.24.0, 0.33.0)"),
    ({"vllm-0.33.0.dist-info": None}, "1 (no Version)"),
])
def test_anything_but_one_install_with_a_version_says_what_was_found_and_what_to_do(tmp_path, infos, found):
    for directory, version in infos.items():
        add_dist_info(tmp_path, directory, "Metadata-Version: 2.1\nName: vllm\n"
                      + (f"Version: {version}\n" if version else ""))
    with pytest.raises(DistInfoError) as caught:
        installed_vllm_version(tmp_path)
    assert str(caught.value) == (
        f"{tmp_path}: expected one vllm-*.dist-info/METADATA with a Version, found {found}; "
        "point at the site-packages of one vLLM install, or reinstall vLLM there with pip")
