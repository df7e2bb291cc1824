"""docker-bake.hcl + docker-bake.json: what `docker buildx bake --print` resolves, per target and
base. Expected values come from the recipe; the bake file and the Dockerfile must not repeat pins.

The plain names (sm120, sm100, sm90, test, the default group) build the recipe's default base;
every base also builds as <target>-vllm<version, _ for .>."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsa_image.build import image_build
from dsa_image.build.bake import bake_variables
from dsa_image.overlay.cli import predicted_receipt_sha256
from dsa_image.core.recipe import load_every_base, load_recipe
from test_image_tree import stage

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPE = load_recipe()
BASES = load_every_base()
VARIABLES = bake_variables(BASES)
pytestmark = pytest.mark.docker


def _print(targets: list[str], **variables: str) -> dict:
    # Start from an environment without any bake variable, so only the files decide.
    clean = {k: v for k, v in os.environ.items() if k not in VARIABLES and k not in
             {"REGISTRY", "IMAGE", "TAG", "BUILD_NETWORK", "PIP_CA", "CACHE_FROM", "CACHE_TO", "PUSH"}}
    options = image_build.BakeOptions(network="default", variables=variables)
    env = {**options.environment(), **variables}
    saved = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(clean)
        return image_build.bake_print(REPO_ROOT, targets, options, env)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_default_group_is_every_recipe_target_of_the_default_base(buildx):
    printed = _print([])
    assert sorted(printed["group"]["default"]["targets"]) == sorted(RECIPE.targets)
    assert {t["args"]["VLLM_VERSION"] for t in printed["target"].values()} == {RECIPE.default_vllm}


@pytest.mark.parametrize("target_id, recipe, name", [
    *((t, RECIPE, t) for t in RECIPE.targets),
    *((t, recipe, recipe.bake_target(t)) for recipe in BASES for t in recipe.targets)])
def test_each_target_passes_the_recipes_pins_as_args(buildx, target_id, recipe, name):
    target = recipe.target(target_id)
    resolved = _print([name])["target"][name]
    assert resolved["context"] == "." and resolved["dockerfile"] == "Dockerfile"
    assert resolved["target"] == "runtime"
    assert resolved["args"] == {
        "BASE_IMAGE": recipe.base_ref,
        "PYTHON_VERSION": recipe.python,
        "VLLM_VERSION": recipe.vllm_version,
        "RECIPE": recipe.id,
        "DEFAULT_MODEL": recipe.serving["default_model"],
        "PORT": str(recipe.serving["port"]),
        "TARGET": target_id,
        "PLATFORMS": ",".join(target.platforms),
        "CUDA_ARCH_LIST": ";".join(target.cuda_arch),
        "EXTRAS_LOCK": target_id if target.extras else "",
        "RECEIPT_SHA256": predicted_receipt_sha256(recipe),
        "VLLM_WHEEL_SHA256_AMD64": recipe.wheel("linux/amd64").sha256,
        "VLLM_WHEEL_SHA256_ARM64": recipe.wheel("linux/arm64").sha256,
    }
    assert resolved["tags"] == [f"dsa-image:{recipe.vllm_version}-{target_id}"]
    assert resolved["network"] == "default"
    assert len(resolved["platforms"]) == 1  # a local build loads this machine's platform only
    assert resolved["output"] == [{"type": "docker"}]
    assert "attest" not in resolved and "secret" not in resolved


@pytest.mark.parametrize("target_id", list(RECIPE.targets))
def test_push_builds_every_recipe_platform_with_attestations(buildx, target_id):
    resolved = _print([target_id], PUSH="true", REGISTRY="registry.example/team", TAG="t1")["target"][target_id]
    assert resolved["platforms"] == list(RECIPE.target(target_id).platforms)
    assert resolved["tags"] == [f"registry.example/team/dsa-image:t1-{target_id}"]
    assert resolved["output"] == [{"type": "registry"}]
    kinds = {a["type"]: a for a in resolved["attest"]}
    assert set(kinds) == {"provenance", "sbom"} and kinds["provenance"]["mode"] == "max"


def test_network_ca_secret_and_cache_variables_reach_the_targets(buildx):
    resolved = _print(["sm120"], BUILD_NETWORK="host", PIP_CA="/etc/ssl/certs/ca-certificates.crt",
                      CACHE_FROM="type=local,src=/tmp/c", CACHE_TO="type=local,dest=/tmp/c",
                      BASE_IMAGE="local-base:1")["target"]["sm120"]
    assert resolved["network"] == "host"
    assert resolved["secret"] == [{"id": "pip-ca", "src": "/etc/ssl/certs/ca-certificates.crt"}]
    assert resolved["cache-from"] == [{"type": "local", "src": "/tmp/c"}]
    assert resolved["cache-to"] == [{"type": "local", "dest": "/tmp/c"}]
    assert resolved["args"]["BASE_IMAGE"] == "local-base:1"


def test_test_target_builds_the_sm120_test_stage_and_exports_its_results(buildx):
    """Every `test` build, cached or not, hands over the in-image results: the stage that holds
    them only, written to build/test-results (a base's own: build/test-results-vllm<version>),
    which the image tests read."""
    names = ["test", *(recipe.bake_target("test") for recipe in BASES)]
    printed = _print(names)["target"]
    for name, recipe in zip(names, [RECIPE, *BASES], strict=True):
        resolved = printed[name]
        assert resolved["target"] == "test-results"
        assert resolved["args"]["TARGET"] == "sm120" and resolved["args"]["VLLM_VERSION"] == recipe.vllm_version
        dest = "build/test-results" if name == "test" else f"build/test-results-{name.removeprefix('test-')}"
        assert resolved["output"] == [{"type": "local", "dest": dest}]
        assert "tags" not in resolved or resolved["tags"] == []
    assert [line for line in stage("test-results").splitlines() if not line.startswith("#") and line] == [
        "FROM scratch AS test-results",
        "COPY --from=test /opt/dsa-image/test-results/ /",  # and upstream's tests: the gate (docs/upstream-tests.md)
        "COPY --from=upstream-overlay /opt/dsa-image/upstream-results/ /upstream-tests/",
        "COPY --from=upstream-bundle /opt/dsa-image/upstream-tests/bundle.json /upstream-tests/"]
    test_stage = stage("test")
    assert "--junitxml=/opt/dsa-image/test-results/junit.xml" in test_stage
    assert "| tee /opt/dsa-image/test-results/verify.txt" in test_stage


def _pins() -> list[str]:
    """Every pinned value of the recipe, of every base, a bake file or Dockerfile could copy."""
    pins = []
    for recipe in BASES:
        pins += [recipe.vllm_version, recipe.vllm_version.replace(".", "_"), recipe.base_image, f"python{recipe.python}"]
        pins += [pin.split("==")[1] for pin in recipe.cuda_toolkit]
        pins += [w.sha256 for w in recipe.wheels.values() if w.sha256] + [w.filename for w in recipe.wheels.values()]
        pins += [recipe.sdist.filename, recipe.sdist.sha256]
        pins += [e.version for t in recipe.targets.values() for e in t.extras]
        pins += [recipe.serving["default_model"], recipe.serving["served_model_name"]]
        pins += [t.kv_cache_dtype for t in recipe.targets.values() if t.kv_cache_dtype != "auto"]
    return sorted(set(pins))


@pytest.mark.parametrize("path", ["docker-bake.hcl", "Dockerfile"])
def test_no_pin_is_written_outside_the_recipe(path):
    text = (REPO_ROOT / path).read_text()
    assert [pin for pin in _pins() if pin in text] == []
