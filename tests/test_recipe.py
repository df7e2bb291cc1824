"""The recipe: loading, validation, accessors, the pin-writing text edits, generated files."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from dsa_image import lock
from dsa_image.recipe import (
    ARCH_OF_PLATFORM, PLATFORM_OF_ARCH, RecipeError, format_value, load_recipe, set_base_digest, set_wheel_sha256,
)
from dsa_image.registry import split_reference

REPO = Path(__file__).resolve().parent.parent
RECIPE = load_recipe()


def test_accessors():
    assert RECIPE.vllm_version == "0.24.0"
    assert set(RECIPE.targets) == {"sm120", "sm100", "sm90"}
    sm120 = RECIPE.target("sm120")
    assert sm120.cuda_arch == ("12.0", "12.1") and sm120.arches == ("amd64", "arm64")
    assert [e.requirement for e in sm120.extras] == [f"b12x=={RECIPE.raw['b12x']['version']}"]
    assert sm120.overrides == ("torch==2.11.0",)
    assert sm120.env == {"VLLM_USE_B12X_SPARSE_INDEXER": "1"}
    assert RECIPE.target("sm90").platforms == ("linux/amd64",) and RECIPE.target("sm90").extras == ()
    assert RECIPE.wheel("amd64") == RECIPE.wheel("linux/amd64")
    assert RECIPE.platforms == ("linux/amd64", "linux/arm64")
    assert PLATFORM_OF_ARCH["arm64"] == "linux/arm64" and ARCH_OF_PLATFORM["linux/amd64"] == "amd64"


def test_wheel_pins_are_locked():
    for wheel in RECIPE.wheels.values():
        assert len(wheel.sha256) == 64, f"{wheel.filename}: run scripts/recipe.py lock"


def test_base_ref_uses_digest_only_when_locked():
    assert RECIPE.base_ref == (f"{RECIPE.base_image}@{RECIPE.base_digest}" if RECIPE.base_digest else RECIPE.base_image)


def test_unknown_ids_name_the_valid_ones():
    with pytest.raises(RecipeError, match=r"^unknown target 'sm75' in recipe glm5-dsa; valid targets: sm120, sm100, sm90$"):
        RECIPE.target("sm75")
    with pytest.raises(RecipeError, match=r"^unknown recipe 'glm6'; valid recipes: glm5-dsa$"):
        load_recipe("glm6")
    with pytest.raises(RecipeError, match="no key 'vllm.nope'"):
        RECIPE.get("vllm.nope")


def test_get_and_format():
    assert format_value(RECIPE.get("targets.sm120.kv_cache_dtype")) == "fp8_ds_mla"
    assert format_value(RECIPE.get("targets.sm120.cuda_arch")) == "12.0\n12.1"
    assert format_value(RECIPE.get("targets.sm120.env")) == '{"VLLM_USE_B12X_SPARSE_INDEXER": "1"}'
    assert format_value(True) == "true"


def test_cli_get():
    done = subprocess.run([sys.executable, str(REPO / "scripts/recipe.py"), "get", "vllm.version"],
                          capture_output=True, text=True, cwd="/")
    assert (done.returncode, done.stdout) == (0, "0.24.0\n")
    bad = subprocess.run([sys.executable, str(REPO / "scripts/recipe.py"), "--recipe", "x", "get", "vllm.version"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "valid recipes: glm5-dsa" in bad.stderr


def copy_recipe(tmp_path: Path, edit=lambda text: text) -> Path:
    directory = tmp_path / "recipes"
    directory.mkdir(parents=True)
    (directory / "glm5-dsa.toml").write_text(edit(RECIPE.path.read_text()))
    return directory


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('kv_cache_dtype = "auto"', 'kv_cache_dtype = 3'), "kv_cache_dtype: expected str"),
    (lambda t: t.replace('platforms = ["linux/amd64"]\n', 'platforms = ["linux/riscv64"]\n'), "platform 'linux/riscv64'"),
    (lambda t: t.replace('extras = []', 'extras = ["nope"]', 1), "extra 'nope' needs a [nope] section"),
    (lambda t: t.replace('digest = ""', 'digest = "sha256:abc"'), "base.digest must be empty or sha256"),
    (lambda t: t.replace('"nvidia-curand==10.4.0.35"', '"nvidia-curand>=10"'), "is not name==version"),
    (lambda t: t.replace('schema = 1', 'schema = 2'), "schema must be 1"),
    (lambda t: t + "[[[", "not valid TOML"),
])
def test_validation_errors(tmp_path, edit, message):
    with pytest.raises(RecipeError) as caught:
        load_recipe("glm5-dsa", copy_recipe(tmp_path, edit))
    assert message in str(caught.value)


@given(st.sampled_from(["linux/amd64", "linux/arm64"]), st.text("0123456789abcdef", min_size=64, max_size=64))
def test_set_wheel_sha256_edits_only_that_line(platform, sha):
    text = RECIPE.path.read_text()
    edited = set_wheel_sha256(text, platform, sha)
    parsed = tomllib.loads(edited)
    assert parsed["vllm"]["wheels"][platform]["sha256"] == sha
    changed = [(a, b) for a, b in zip(text.splitlines(), edited.splitlines()) if a != b]
    assert len(edited.splitlines()) == len(text.splitlines()) and len(changed) <= 1
    assert set_wheel_sha256(edited, platform, sha) == edited  # idempotent, deterministic


def test_set_pins_refuse_invented_values():
    text = RECIPE.path.read_text()
    with pytest.raises(RecipeError):
        set_wheel_sha256(text, "linux/amd64", "not-a-hash")
    with pytest.raises(RecipeError):
        set_base_digest(text, "latest")
    digest = "sha256:" + "a" * 64
    assert tomllib.loads(set_base_digest(text, digest))["base"]["digest"] == digest


def test_split_reference():
    assert split_reference("docker.io/library/debian:bookworm-slim") == ("docker.io", "library/debian", "bookworm-slim")
    assert split_reference("debian") == ("docker.io", "library/debian", "latest")
    assert split_reference("localhost:5000/x:2") == ("localhost:5000", "x", "2")
    assert split_reference("ghcr.io/o/n:1") == ("ghcr.io", "o/n", "1")


def test_lock_jobs_layout():
    outputs = [str(job.output) for job in lock.lock_jobs(RECIPE)]
    assert outputs == ["recipes/locks/vllm-amd64.txt", "recipes/locks/vllm-arm64.txt",
                       "recipes/locks/sm120-amd64.txt", "recipes/locks/sm120-arm64.txt", "recipes/locks/dev.txt"]
    sm120 = next(j for j in lock.lock_jobs(RECIPE) if str(j.output) == "recipes/locks/sm120-arm64.txt")
    argv = lock.uv_command(sm120, "3.11", "uv")
    assert argv[argv.index("--python-platform") + 1] == "aarch64-manylinux_2_28"
    assert argv[argv.index("--constraint") + 1] == "recipes/locks/vllm-arm64.txt"
    assert argv[argv.index("--overrides") + 1] == "recipes/requirements/sm120.overrides.in"
    assert argv[argv.index("--index-url") + 1] == "https://pypi.org/simple" and "--no-config" in argv
