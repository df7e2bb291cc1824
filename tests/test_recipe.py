"""The recipe: loading, validation, accessors, the pin-writing text edits, generated files."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from dsa_image.build import lock
from dsa_image.core.recipe import (
    ARCH_OF_PLATFORM, PLATFORM_OF_ARCH, RecipeError, format_value, load_every_base, load_recipe, set_base_digest,
    set_sdist_sha256, set_wheel_sha256,
)
from dsa_image.build.registry import split_reference

REPO = Path(__file__).resolve().parent.parent
RECIPE = load_recipe()
BASES = load_every_base()


def test_accessors():
    # Without --vllm: the base [vllm] default names, read here from the file itself.
    assert RECIPE.vllm_version == RECIPE.default_vllm == tomllib.loads(RECIPE.path.read_text())["vllm"]["default"]
    assert RECIPE.vllm_versions == ("0.24.0", "0.33.0")
    assert set(RECIPE.targets) == {"sm120", "sm100", "sm90"}
    sm120 = RECIPE.target("sm120")
    assert sm120.cuda_arch == ("12.0", "12.1") and sm120.arches == ("amd64", "arm64")
    assert [e.requirement for e in sm120.extras] == [f"b12x=={RECIPE.raw['b12x']['version']}"]
    # vLLM 0.24.0 keeps its torch 2.11.0 against b12x 0.30.2's torch>=2.12.0 floor.
    assert load_recipe(vllm="0.24.0").target("sm120").overrides == ("torch==2.11.0",)
    assert sm120.env == {"VLLM_USE_B12X_SPARSE_INDEXER": "1"}
    assert RECIPE.target("sm90").platforms == ("linux/amd64",) and RECIPE.target("sm90").extras == ()
    assert RECIPE.wheel("amd64") == RECIPE.wheel("linux/amd64")
    assert RECIPE.platforms == ("linux/amd64", "linux/arm64")
    assert PLATFORM_OF_ARCH["arm64"] == "linux/arm64" and ARCH_OF_PLATFORM["linux/amd64"] == "amd64"


def test_each_base_has_its_own_pins_and_shares_the_rest():
    older, newer = load_recipe(vllm="0.24.0"), load_recipe(vllm="0.33.0")
    # The default first, then the others in file order.
    assert [b.vllm_version for b in BASES] == [RECIPE.default_vllm,
                                               *(v for v in RECIPE.vllm_versions if v != RECIPE.default_vllm)]
    assert older.vllm_version == "0.24.0" and newer.vllm_version == "0.33.0"
    assert older.default_vllm == newer.default_vllm == RECIPE.default_vllm  # whichever base is loaded
    assert older.wheel("amd64").filename == "vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    assert newer.wheel("amd64").filename == "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    # vLLM 0.33.0 pins b12x 1.5.1 for its `b12x` extra, whose torch floor its torch 2.14.0 meets.
    assert [e.requirement for e in newer.target("sm120").extras] == ["b12x==1.5.1"]
    assert newer.target("sm120").overrides == ()
    assert newer.get("vllm.version") == "0.33.0" and newer.get("vllm.versions") == ["0.24.0", "0.33.0"]
    for shared in ("base", "serving", "cluster"):
        assert newer.raw[shared] == older.raw[shared]
    # The targets are shared; a base adjusts only the keys its release decides differently.
    assert newer.target("sm90").attention_backend == "FLASH_ATTN_MLA_SPARSE"
    assert older.target("sm90").attention_backend == "FLASHMLA_SPARSE"
    differing = {(tid, key) for tid, target in older.raw["targets"].items()
                 for key in target if newer.raw["targets"][tid][key] != target[key]}
    assert differing == {("sm90", "attention_backend")}


def test_wheel_pins_are_locked():
    for recipe in BASES:
        for wheel in recipe.wheels.values():
            assert len(wheel.sha256) == 64, f"{wheel.filename}: run scripts/recipe.py lock --vllm {recipe.vllm_version}"


def test_base_ref_uses_digest_only_when_locked():
    assert RECIPE.base_ref == (f"{RECIPE.base_image}@{RECIPE.base_digest}" if RECIPE.base_digest else RECIPE.base_image)


def test_unknown_ids_name_the_valid_ones():
    with pytest.raises(RecipeError, match=r"^unknown target 'sm75' in recipe glm5-dsa; valid targets: sm120, sm100, sm90$"):
        RECIPE.target("sm75")
    with pytest.raises(RecipeError, match=r"^unknown recipe 'glm6'; valid recipes: glm5-dsa$"):
        load_recipe("glm6")
    with pytest.raises(RecipeError, match="no key 'vllm.nope'"):
        RECIPE.get("vllm.nope")
    with pytest.raises(RecipeError, match=r"no vLLM '0.25.0'; this recipe pins: 0.24.0, 0.33.0 \(--vllm takes one"):
        load_recipe(vllm="0.25.0")


def test_get_and_format():
    assert format_value(RECIPE.get("targets.sm120.kv_cache_dtype")) == "fp8_ds_mla"
    assert format_value(RECIPE.get("targets.sm120.cuda_arch")) == "12.0\n12.1"
    assert format_value(RECIPE.get("targets.sm120.env")) == '{"VLLM_USE_B12X_SPARSE_INDEXER": "1"}'
    assert format_value(True) == "true"


def test_cli_get():
    done = subprocess.run([sys.executable, str(REPO / "scripts/recipe.py"), "get", "vllm.version"],
                          capture_output=True, text=True, cwd="/")
    assert (done.returncode, done.stdout) == (0, f"{RECIPE.default_vllm}\n")  # no --vllm: the default base
    bad = subprocess.run([sys.executable, str(REPO / "scripts/recipe.py"), "--recipe", "x", "get", "vllm.version"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "valid recipes: glm5-dsa" in bad.stderr
    newer = subprocess.run([sys.executable, str(REPO / "scripts/recipe.py"), "get", "--vllm", "0.33.0", "b12x.version"],
                           capture_output=True, text=True, cwd="/")
    assert (newer.returncode, newer.stdout) == (0, "1.5.1\n")


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
    (lambda t: t.replace('schema = 2', 'schema = 1'), "schema must be 2"),
    (lambda t: t + "[[[", "not valid TOML"),
    (lambda t: t.replace(f'default = "{RECIPE.default_vllm}"', 'default = "0.25.0"'),
     "vllm.default '0.25.0' is not one of the pinned"),
    (lambda t: t.replace('[vllm."0.33.0".b12x]', '[vllm."0.33.0".flashinfer]'),
     '[vllm."0.33.0"] has flashinfer: a base pins only wheels, cuda, sdist and the extras its targets name (b12x), '
     'and adjusts [targets.*] keys'),
    (lambda t: t.replace('[vllm."0.33.0".targets.sm90]', '[vllm."0.33.0".targets.sm75]'),
     'vllm."0.33.0".targets.sm75: adjusts no shared target; targets: sm120, sm100, sm90'),
    (lambda t: t.replace('attention_backend = "FLASH_ATTN_MLA_SPARSE"', 'backend = "FLASH_ATTN_MLA_SPARSE"'),
     'vllm."0.33.0".targets.sm90: backend not keys of [targets.sm90]; a base adjusts a target\'s keys, it adds none'),
    (lambda t: t + '\n[b12x]\nversion = "1.5.1"\n', 'b12x is both shared and in [vllm."0.24.0"]'),
    (lambda t: t.replace('[vllm."0.33.0".wheels."linux/arm64"]', '[vllm."latest".wheels."linux/arm64"]'),
     "expected a [vllm.\"X.Y.Z\"] table named after a vLLM release"),
    (lambda t: t.replace('filename = "vllm-0.33.0.tar.gz"', 'filename = "vllm-0.24.0.tar.gz"'),
     "sdist: filename 'vllm-0.24.0.tar.gz', expected vllm-0.33.0.tar.gz"),
    (lambda t: t.replace('[vllm."0.33.0".sdist]', '[vllm."0.33.0".source]'),
     'vllm."0.33.0"] has source: a base pins only'),
    (lambda t: t.replace('packages = ["tblib"', 'packages = ["tblib==3.2.2"'),
     "upstream_tests.packages entry 'tblib==3.2.2' is not a package name"),
])
def test_validation_errors(tmp_path, edit, message):
    with pytest.raises(RecipeError) as caught:
        load_recipe("glm5-dsa", copy_recipe(tmp_path, edit))
    assert message in str(caught.value)


@given(st.sampled_from(["0.24.0", "0.33.0"]), st.sampled_from(["linux/amd64", "linux/arm64"]),
       st.text("0123456789abcdef", min_size=64, max_size=64))
def test_set_wheel_sha256_edits_only_that_line(version, platform, sha):
    text = RECIPE.path.read_text()
    edited = set_wheel_sha256(text, version, platform, sha)
    parsed = tomllib.loads(edited)
    assert parsed["vllm"][version]["wheels"][platform]["sha256"] == sha
    changed = [(a, b) for a, b in zip(text.splitlines(), edited.splitlines(), strict=True) if a != b]
    assert len(edited.splitlines()) == len(text.splitlines()) and len(changed) <= 1
    assert set_wheel_sha256(edited, version, platform, sha) == edited  # idempotent, deterministic


@given(st.sampled_from(["0.24.0", "0.33.0"]), st.text("0123456789abcdef", min_size=64, max_size=64))
def test_set_sdist_sha256_edits_only_that_line(version, sha):
    text = RECIPE.path.read_text()
    edited = set_sdist_sha256(text, version, sha)
    assert tomllib.loads(edited)["vllm"][version]["sdist"]["sha256"] == sha
    assert load_recipe("glm5-dsa", vllm=version).sdist.filename == f"vllm-{version}.tar.gz"
    changed = [(a, b) for a, b in zip(text.splitlines(), edited.splitlines(), strict=True) if a != b]
    assert len(edited.splitlines()) == len(text.splitlines()) and len(changed) <= 1
    with pytest.raises(RecipeError):
        set_sdist_sha256(text, version, "0" * 63)


def test_every_base_pins_its_sdist_by_the_sha256_lock_wrote():
    for base in load_every_base():
        assert base.sdist.filename == f"vllm-{base.vllm_version}.tar.gz"
        assert re.fullmatch(r"[0-9a-f]{64}", base.sdist.sha256), base.sdist


def test_set_pins_refuse_invented_values():
    text = RECIPE.path.read_text()
    with pytest.raises(RecipeError):
        set_wheel_sha256(text, "0.24.0", "linux/amd64", "not-a-hash")
    with pytest.raises(RecipeError, match='no \\[vllm."0.25.0".wheels."linux/amd64"\\] section'):
        set_wheel_sha256(text, "0.25.0", "linux/amd64", "a" * 64)
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
    older = load_recipe(vllm="0.24.0")  # the base whose sm120 extras carry a torch override
    outputs = [str(job.output) for job in lock.lock_jobs(older)]
    assert outputs == ["recipes/locks/vllm-0.24.0/vllm-amd64.txt", "recipes/locks/vllm-0.24.0/vllm-arm64.txt",
                       "recipes/locks/vllm-0.24.0/sm120-amd64.txt", "recipes/locks/vllm-0.24.0/sm120-arm64.txt",
                       "recipes/locks/dev.txt", "recipes/locks/upstream-tests.txt"]
    sm120 = next(j for j in lock.lock_jobs(older) if str(j.output) == "recipes/locks/vllm-0.24.0/sm120-arm64.txt")
    argv = lock.uv_command(sm120, "3.11", "uv")
    assert argv[argv.index("--python-platform") + 1] == "aarch64-manylinux_2_28"
    assert argv[argv.index("--constraint") + 1] == "recipes/locks/vllm-0.24.0/vllm-arm64.txt"
    assert argv[argv.index("--overrides") + 1] == "recipes/requirements/vllm-0.24.0/sm120.overrides.in"
    assert argv[argv.index("--custom-compile-command") + 1] == "python3 scripts/recipe.py lock --vllm 0.24.0"
    assert argv[argv.index("--index-url") + 1] == "https://pypi.org/simple" and "--no-config" in argv
    newer = lock.lock_jobs(load_recipe(vllm="0.33.0"))
    # every base resolves the one dev lock and the one lock of upstream's test packages
    assert [str(j.output) for j in newer][-2:] == ["recipes/locks/dev.txt", "recipes/locks/upstream-tests.txt"]
    upstream = lock.uv_command(newer[-1], "3.11", "uv")
    assert "--no-deps" in upstream and "--universal" in upstream  # exactly the recipe's packages
    assert all(j.overrides is None for j in newer)  # b12x 1.5.1 needs no torch override
