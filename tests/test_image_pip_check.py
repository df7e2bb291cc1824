"""dsa_image.build.pip_check: only the recipe's recorded override passes."""

from __future__ import annotations

from dsa_image.build import pip_check
from dsa_image.core.recipe import load_every_base

# A base whose sm120 extras override a requirement (vLLM 0.24.0: b12x's torch floor).
RECIPE = next(r for r in load_every_base() if any(e.overrides for e in r.target("sm120").extras))


def _override_line(target_id: str) -> str:
    """The line pip check prints for the recipe's own override (b12x's torch floor)."""
    extra = next(e for e in RECIPE.target(target_id).extras if e.overrides)
    name, version = extra.overrides[0].split("==")
    return f"{extra.name} {extra.version} has requirement {name}>=99.0, but you have {name} {version}."


def test_the_recipes_override_is_accepted_for_its_target_only():
    line = _override_line("sm120")
    assert pip_check.problems(line, RECIPE.target("sm120")) == []
    assert pip_check.problems(line, RECIPE.target("sm90")) != []  # sm90 has no b12x


def test_a_different_installed_version_is_not_the_override():
    extra = next(e for e in RECIPE.target("sm120").extras if e.overrides)
    name, _ = extra.overrides[0].split("==")
    line = f"{extra.name} {extra.version} has requirement {name}>=99.0, but you have {name} 0.0.1."
    assert pip_check.problems(line, RECIPE.target("sm120")) == [f"{extra.name} requires {name}>=99.0, installed {name}==0.0.1"]


def test_other_conflicts_and_missing_packages_fail():
    output = ("vllm 0.24.0 has requirement torch==2.11.0, but you have torch 2.12.0.\n"
              "vllm 0.24.0 requires numba, which is not installed.\n")
    found = pip_check.problems(output, RECIPE.target("sm120"))
    assert found == ["vllm 0.24.0 requires numba, which is not installed.",
                     "vllm requires torch==2.11.0, installed torch==2.12.0"]


def test_clean_output_has_no_problems():
    assert pip_check.problems("No broken requirements found.\n", RECIPE.target("sm100")) == []
