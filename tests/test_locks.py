"""The committed generated files of every base: locks produced by `scripts/recipe.py lock`,
consistent with the recipe, layered so that a target's extras lock only adds packages on top of
the common lock; recipes/requirements/vllm-<version>/*.in and docker-bake.json identical to what
the recipe generates."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsa_image.build import bake, lock, lock_check
from dsa_image.build.lock_parse import Pin, parse_lock
from dsa_image.core.recipe import ARCH_OF_PLATFORM, load_every_base, load_recipe

REPO = Path(__file__).resolve().parent.parent
RECIPE = load_recipe()
BASES = {recipe.vllm_version: recipe for recipe in load_every_base()}
# torch as each base's vLLM pins it (its wheel's METADATA), and the cuda-toolkit release that
# torch requires, whose nvcc/crt/nvvm/cccl/cudart/curand the recipe pins.
TORCH = {"0.24.0": ("2.11.0", "13.0.2"), "0.33.0": ("2.14.0", "13.0.3.0")}



def copy_recipe(tmp_path: Path, edit) -> Path:
    directory = tmp_path / "recipes"
    directory.mkdir(parents=True)
    (directory / "glm5-dsa.toml").write_text(edit(RECIPE.path.read_text()))
    return directory


def read_lock(path: Path) -> dict[str, Pin]:
    return parse_lock((REPO / path).read_text())


@pytest.mark.parametrize("version", BASES)
def test_locks_agree_with_the_recipe(version):
    assert lock_check.lock_problems(BASES[version]) == []


@pytest.mark.parametrize("version, arch", [(v, ARCH_OF_PLATFORM[p]) for v, r in BASES.items() for p in r.platforms])
def test_common_lock_pins(version, arch):
    recipe = BASES[version]
    pins = read_lock(lock.common_lock(recipe, arch))
    assert pins["vllm"].version == recipe.vllm_version
    assert recipe.wheel(arch).sha256 in pins["vllm"].hashes
    torch, toolkit_release = TORCH[version]
    assert pins["torch"].version == torch and pins["cuda-toolkit"].version == toolkit_release
    for requirement in recipe.cuda_toolkit:
        name, version = requirement.split("==")
        assert pins[name].version == version
    toolkit = {n: p.version for n, p in pins.items() if n.startswith("nvidia-cuda-") or n == "nvidia-nvvm"}
    assert toolkit and all(v.startswith("13.0.") for v in toolkit.values()), toolkit


@pytest.mark.parametrize("version, target, arch", [(v, t.id, a) for v, r in BASES.items()
                                                   for t in r.targets.values() if t.extras for a in t.arches])
def test_extras_lock_only_adds(version, target, arch):
    recipe = BASES[version]
    common = read_lock(lock.common_lock(recipe, arch))
    full = read_lock(lock.target_lock(recipe, recipe.target(target), arch))
    for name, pin in common.items():
        assert full.get(name) == pin, f"{name}: {full.get(name)} != {pin}"
    added = set(full) - set(common)
    assert {e.name for e in recipe.target(target).extras} <= added


@pytest.mark.parametrize("path", [job.output for recipe in BASES.values() for job in lock.lock_jobs(recipe) if job.arch])
def test_cuda_python_is_the_metapackage_of_the_locked_cuda_bindings(path):
    """Old cuda-python releases (12.6.2.post1, which the resolver picked for vLLM 0.33.0 before
    the recipe pinned cuda-python) are one monolithic wheel whose cuda/bindings/*.so overwrite
    cuda-bindings' files, and no declared conflict says so (pip check passes). The 13.x
    releases are metapackages of the cuda-bindings release of their own major.minor."""
    pins = read_lock(path)
    if "cuda-python" in pins and "cuda-bindings" in pins:
        major_minor = lambda name: pins[name].version.split(".")[:2]  # noqa: E731
        assert major_minor("cuda-python") == major_minor("cuda-bindings"), (
            pins["cuda-python"].version, pins["cuda-bindings"].version)


@pytest.mark.parametrize("version", BASES)
def test_only_listed_platforms_are_locked(version):
    recipe = BASES[version]
    present = sorted(p.name for p in (REPO / lock.locks_dir(recipe)).glob("*.txt"))
    assert present == sorted(p.name for p in lock.expected_locks(recipe) if p.parent == lock.locks_dir(recipe))
    for target in recipe.targets.values():
        for arch in ("amd64", "arm64"):
            if target.extras and arch not in target.arches:
                assert not (REPO / lock.target_lock(recipe, target, arch)).exists()


def test_each_base_has_one_directory_of_locks_and_inputs():
    for directory in (lock.LOCKS_DIR, lock.REQUIREMENTS_DIR):
        assert sorted(p.name for p in (REPO / directory).iterdir() if p.is_dir()) == sorted(
            f"vllm-{v}" for v in BASES)
    assert lock.stale_bases(RECIPE) == []


@pytest.mark.parametrize("version", BASES)
def test_every_lock_is_hashed_and_names_its_command(version):
    for job in lock.lock_jobs(BASES[version]):
        text = (REPO / job.output).read_text()
        assert text.splitlines()[1] == f"#    {job.command}"
        assert parse_lock(text)  # every requirement has at least one --hash (parse_lock checks)


def test_dev_lock_has_what_the_tests_import():
    pins = read_lock(lock.DEV_LOCK)
    assert {"pytest", "hypothesis", "numpy", "docker", "uv"} <= set(pins)


def test_lock_problems_catch_a_moved_pin(tmp_path):
    """A hand-edited or stale lock is caught: copy the locks, move torch in one extras lock."""
    recipe = BASES["0.24.0"]  # its vLLM pins torch 2.11.0 (TORCH)
    (tmp_path / lock.locks_dir(recipe)).mkdir(parents=True)
    for path in [*lock.expected_locks(recipe), *lock.lock_sums(recipe)]:
        (tmp_path / path).write_text((REPO / path).read_text())
    extras, common = lock.target_lock(recipe, recipe.target("sm120"), "amd64"), lock.common_lock(recipe, "amd64")
    victim = tmp_path / extras
    victim.write_text(victim.read_text().replace("\ntorch==2.11.0 ", "\ntorch==2.12.0 "))
    problems = lock_check.lock_problems(recipe, root=tmp_path)
    assert problems[1:] == [f"{extras}: torch differs from {common} (the extras lock must only add packages)"]
    assert problems[0].startswith(f"{extras}: its sha256 is ")  # SHA256SUMS
    (tmp_path / lock.common_lock(recipe, "arm64")).unlink()
    assert (f"{lock.common_lock(recipe, 'arm64')}: missing; run `python3 scripts/recipe.py lock --vllm 0.24.0`"
            in lock_check.lock_problems(recipe, root=tmp_path))
    (tmp_path / lock.LOCKS_DIR / "vllm-0.20.0").mkdir()
    assert ("recipes/locks/vllm-0.20.0: a directory of a vLLM release the recipe does not pin; delete it"
            in lock_check.lock_problems(recipe, root=tmp_path))


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


@pytest.mark.parametrize("version", BASES)
def test_generated_files_agree_with_the_recipe(version):
    recipe = BASES[version]
    files = {**lock.requirement_files(recipe), bake.BAKE_JSON: bake.render_bake_json(recipe.id)}
    assert lock.drift(files, lock.lock_command(version)) == []
    assert lock.stale_generated(files, lock.requirements_dir(recipe)) == []


def test_drift_is_detected(tmp_path):
    # The first curand pin in the file is vLLM 0.24.0's.
    recipes = copy_recipe(tmp_path, lambda t: t.replace('"nvidia-curand==10.4.0.35"', '"nvidia-curand==10.4.0.36"', 1))
    changed = load_recipe("glm5-dsa", recipes, vllm="0.24.0")
    command = lock.lock_command("0.24.0")
    problems = lock.drift(lock.requirement_files(changed), command)
    assert problems == [f"{lock.common_in(changed)}: differs from what the recipe generates; run `{command}`"]
    renamed = copy_recipe(tmp_path / "b", lambda t: t.replace('port = 8000', 'port = 8001'))
    assert lock.drift({bake.BAKE_JSON: bake.render_bake_json("glm5-dsa", renamed)}, command) == [
        f"{bake.BAKE_JSON}: differs from what the recipe generates; run `{command}`"]


def test_bake_variables_are_what_docker_bake_hcl_uses():
    variables = {k: v["default"] for k, v in json.loads((REPO / bake.BAKE_JSON).read_text())["variable"].items()}
    assert variables["DEFAULT_VLLM"] == RECIPE.vllm_version and variables["VLLM_VERSIONS"] == list(BASES)
    assert variables["BASE_IMAGE"] == RECIPE.base_ref
    assert variables["TARGET_ARGS"]["sm120"] == {"CUDA_ARCH_LIST": "12.0;12.1", "EXTRAS_LOCK": "sm120",
                                                 "PLATFORMS": "linux/amd64,linux/arm64"}
    assert variables["TARGET_ARGS"]["sm90"] == {"CUDA_ARCH_LIST": "9.0", "EXTRAS_LOCK": "", "PLATFORMS": "linux/amd64"}
    for version, recipe in BASES.items():
        assert variables["VLLM"][version]["VLLM_WHEEL_SHA256_ARM64"] == recipe.wheel("arm64").sha256
    hcl = re.sub(r"#.*", "", (REPO / "docker-bake.hcl").read_text())
    declared = set(re.findall(r'^variable "(\w+)"', hcl, re.M))
    used = set(re.findall(r"\b([A-Z][A-Z0-9_]+)\b", hcl)) - {"BAKE_LOCAL_PLATFORM"}
    # Every upper-case name docker-bake.hcl reads is declared there or generated here; the
    # per-base and per-target names are keys of VLLM and TARGET_ARGS.
    keys = set(variables["TARGET_ARGS"]["sm120"]) | set(variables["VLLM"][RECIPE.vllm_version])
    assert used - declared - keys - {"TARGET"} <= set(variables), used - declared - keys - {"TARGET"} - set(variables)


@pytest.mark.parametrize("version", BASES)
def test_cli_check_passes_offline(version):
    done = subprocess.run([sys.executable, str(REPO / "scripts/recipe.py"), "check", "--vllm", version],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
