"""dsa_image.core.site_path: the PYTHONPATH a `pip install --target` site needs (its .pth files do not
run from PYTHONPATH). No GPU, no vLLM."""

from __future__ import annotations

import os

import pytest

from dsa_image.core import site_path


@pytest.mark.parametrize("dsl", ["python_packages", "dsl_packages"])
def test_the_cute_dsl_packages_follow_the_site(tmp_path, dsl):
    (tmp_path / "nvidia_cutlass_dsl" / dsl).mkdir(parents=True)
    assert site_path.pythonpath(str(tmp_path)).split(os.pathsep) == [
        str(tmp_path), str(tmp_path / "nvidia_cutlass_dsl" / dsl)]


def test_a_site_without_the_cute_dsl_is_itself(tmp_path):
    (tmp_path / "nvidia_cutlass_dsl").mkdir()  # the package without its packages directory
    assert site_path.pythonpath(str(tmp_path)) == str(tmp_path)


def test_the_command_prints_it_and_refuses_what_is_not_a_directory(tmp_path, capsys):
    (tmp_path / "nvidia_cutlass_dsl" / "dsl_packages").mkdir(parents=True)
    assert site_path.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == site_path.pythonpath(str(tmp_path))
    assert site_path.main([str(tmp_path / "missing")]) == 2
    assert "a directory" in capsys.readouterr().err
