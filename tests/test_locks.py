"""The committed generated files: locks produced by `scripts/recipe.py lock`, consistent with
the recipe, layered so that a target's extras lock only adds packages on top of the common
lock; recipes/requirements/*.in and docker-bake.json identical to what the recipe generates."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsa_image import bake, lock
from dsa_image.lock import Pin, parse_lock
from dsa_image.recipe import ARCH_OF_PLATFORM, load_recipe

REPO = Path(__file__).resolve().parent.parent
RECIPE = load_recipe()
ARCHES = [ARCH_OF_PLATFORM[p] for p in RECIPE.platforms]

# The image's test stage carries the recipe but not these generated repository files.
pytestmark = pytest.mark.skipif(os.environ.get("DSA_IMAGE_IN_IMAGE") == "1",
                                reason="checks generated repository files the image does not carry")


def copy_recipe(tmp_path: Path, edit) -> Path:
    directory = tmp_path / "recipes"
    directory.mkdir(parents=True)
    (directory / "glm5-dsa.toml").write_text(edit(RECIPE.path.read_text()))
    return directory


def read_lock(path: Path) -> dict[str, Pin]:
    return parse_lock((REPO / path).read_text())


def test_locks_agree_with_the_recipe():
    assert lock.lock_problems(RECIPE) == []


@pytest.mark.parametrize("arch", ARCHES)
def test_common_lock_pins(arch):
    pins = read_lock(lock.common_lock(arch))
    assert pins["vllm"].version == RECIPE.vllm_version
    assert RECIPE.wheel(arch).sha256 in pins["vllm"].hashes
    assert pins["torch"].version == "2.11.0"
    for requirement in RECIPE.cuda_toolkit:
        name, version = requirement.split("==")
        assert pins[name].version == version
    toolkit = {n: p.version for n, p in pins.items() if n.startswith("nvidia-cuda-") or n == "nvidia-nvvm"}
    assert toolkit and all(v.startswith("13.0.") for v in toolkit.values()), toolkit


@pytest.mark.parametrize("target, arch", [(t.id, a) for t in RECIPE.targets.values() if t.extras for a in t.arches])
def test_extras_lock_only_adds(target, arch):
    common = read_lock(lock.common_lock(arch))
    full = read_lock(lock.target_lock(RECIPE.target(target), arch))
    for name, pin in common.items():
        assert full.get(name) == pin, f"{name}: {full.get(name)} != {pin}"
    added = set(full) - set(common)
    assert {e.name for e in RECIPE.target(target).extras} <= added


def test_only_listed_platforms_are_locked():
    present = sorted(p.name for p in (REPO / lock.LOCKS_DIR).glob("*.txt"))
    assert present == sorted(p.name for p in lock.expected_locks(RECIPE))
    for target in RECIPE.targets.values():
        for arch in ("amd64", "arm64"):
            if target.extras and arch not in target.arches:
                assert not (REPO / lock.target_lock(target, arch)).exists()


def test_every_lock_is_hashed_and_names_its_command():
    for path in lock.expected_locks(RECIPE):
        text = (REPO / path).read_text()
        assert lock.COMPILE_COMMAND in text.splitlines()[1]
        assert parse_lock(text)  # every requirement has at least one --hash (parse_lock checks)


def test_dev_lock_has_what_the_tests_import():
    pins = read_lock(lock.DEV_LOCK)
    assert {"pytest", "hypothesis", "numpy", "docker", "uv"} <= set(pins)


def test_lock_problems_catch_a_moved_pin(tmp_path):
    """A hand-edited or stale lock is caught: copy the locks, move torch in one extras lock."""
    (tmp_path / lock.LOCKS_DIR).mkdir(parents=True)
    for path in [*lock.expected_locks(RECIPE), lock.LOCK_SUMS]:
        (tmp_path / path).write_text((REPO / path).read_text())
    victim = tmp_path / lock.target_lock(RECIPE.target("sm120"), "amd64")
    victim.write_text(victim.read_text().replace("\ntorch==2.11.0 ", "\ntorch==2.12.0 "))
    problems = lock.lock_problems(RECIPE, root=tmp_path)
    assert problems[1:] == [
        f"{lock.target_lock(RECIPE.target('sm120'), 'amd64')}: torch differs from {lock.common_lock('amd64')} "
        "(the extras lock must only add packages)"]
    assert problems[0].startswith(f"{lock.target_lock(RECIPE.target('sm120'), 'amd64')}: its sha256 is ")  # SHA256SUMS
    (tmp_path / lock.common_lock("arm64")).unlink()
    assert f"{lock.common_lock('arm64')}: missing; run `{lock.COMPILE_COMMAND}`" in lock.lock_problems(RECIPE, root=tmp_path)


def test_parse_lock():
    text = (
        "# header\n"
        "colorama==0.4.6 ; sys_platform == 'win32' \\\n"
        "    --hash=sha256:" + "a" * 64 + " \\\n"
        "    --hash=sha256:" + "b" * 64 + "\n"
        "    # via pytest\n"
        "Foo_Bar==1.0 \\\n"
        "    --hash=sha256:" + "c" * 64 + "\n"
    )
    assert parse_lock(text) == {
        "colorama": Pin("0.4.6", frozenset({"a" * 64, "b" * 64})),
        "foo-bar": Pin("1.0", frozenset({"c" * 64})),
    }
    with pytest.raises(lock.LockError, match="no --hash"):
        parse_lock("foo==1.0\n")


# --- generated files --------------------------------------------------------------------------


def test_generated_files_agree_with_the_recipe():
    files = {**lock.requirement_files(RECIPE), bake.BAKE_JSON: bake.render_bake_json(RECIPE)}
    assert lock.drift(files) == []
    assert lock.stale_generated(files, lock.REQUIREMENTS_DIR) == []


def test_drift_is_detected(tmp_path):
    recipes = copy_recipe(tmp_path, lambda t: t.replace('"nvidia-curand==10.4.0.35"', '"nvidia-curand==10.4.0.36"'))
    changed = load_recipe("glm5-dsa", recipes)
    problems = lock.drift({**lock.requirement_files(changed), bake.BAKE_JSON: bake.render_bake_json(changed)})
    assert problems == [f"{lock.common_in()}: differs from what the recipe generates; run `{lock.COMPILE_COMMAND}`"]
    renamed = load_recipe("glm5-dsa", copy_recipe(tmp_path / "b", lambda t: t.replace('max_model_len = 8192', 'max_model_len = 4096')))
    assert lock.drift({bake.BAKE_JSON: bake.render_bake_json(renamed)}) == [
        f"{bake.BAKE_JSON}: differs from what the recipe generates; run `{lock.COMPILE_COMMAND}`"]


def test_bake_variables_are_what_docker_bake_hcl_uses():
    variables = json.loads((REPO / bake.BAKE_JSON).read_text())["variable"]
    assert variables["VLLM_VERSION"]["default"] == RECIPE.vllm_version
    assert variables["BASE_IMAGE"]["default"] == RECIPE.base_ref
    assert variables["SM120_CUDA_ARCH_LIST"]["default"] == "12.0;12.1"
    assert variables["SM120_EXTRAS_LOCK"]["default"] == "sm120" and variables["SM90_EXTRAS_LOCK"]["default"] == ""
    assert variables["SM90_PLATFORMS"]["default"] == "linux/amd64"
    hcl = REPO / "docker-bake.hcl"
    if hcl.exists():  # every recipe variable bake.hcl reads must be generated here
        declared = set(re.findall(r'^variable "(\w+)"', hcl.read_text(), re.M))
        used = set(re.findall(r"\b([A-Z][A-Z0-9_]+)\b", hcl.read_text()))
        recipe_like = {v for v in used - declared if v.startswith(("SM", "VLLM_", "BASE_", "PYTHON_", "RECIPE", "DEFAULT_", "PORT"))}
        assert recipe_like <= set(variables), recipe_like - set(variables)


def test_cli_check_passes_offline():
    done = subprocess.run([sys.executable, str(REPO / "scripts/recipe.py"), "check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
