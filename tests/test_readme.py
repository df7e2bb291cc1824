"""The README's first commands are the ones that work: right image tag, the test command CI runs."""

import re
from pathlib import Path

from dsa_image.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def code_lines() -> list[str]:
    return [line.strip() for line in README.splitlines() if line.startswith("    ")]


def test_the_first_command_builds_and_serves_the_recipes_sm120_image():
    recipe = load_recipe()
    first = code_lines()[0]
    assert first.startswith("docker buildx bake sm120 && docker run ")
    assert f"dsa-image:{recipe.vllm_version}-sm120" in first


def test_every_image_tag_in_the_readme_is_the_recipes_version():
    version = load_recipe().vllm_version
    tags = re.findall(r"dsa-image:([0-9][^\s-]*)-sm\d+", README)
    assert tags and set(tags) == {version}


def test_the_second_command_is_the_one_ci_runs():
    assert code_lines()[1] == "python3 scripts/test.py"
    assert "python3 scripts/test.py" in (REPO / ".ci" / "run").read_text()
