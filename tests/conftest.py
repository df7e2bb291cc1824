"""Shared fixtures: a Docker engine with buildx, the base image, the built images, a GPU.

Docker-marked tests skip when there is no engine, no buildx or no base image to build on, with
the reason and the fix; with DSA_IMAGE_REQUIRE_DOCKER=1 (CI) they fail instead, so a broken
engine cannot pass as a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# Tests import dsa_image from this checkout whichever way pytest was started (`pytest`,
# `python -m pytest`, from another directory, inside the image).
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from dsa_image.build import image_build
from dsa_image.core.recipe import load_recipe  # noqa: E402


def _require_docker() -> bool:
    return os.environ.get("DSA_IMAGE_REQUIRE_DOCKER") == "1"


def _unavailable(reason: str):
    if _require_docker():
        pytest.fail(f"{reason} (DSA_IMAGE_REQUIRE_DOCKER=1: a missing engine is a failure, not a skip)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def docker_client():
    """A Docker SDK client for an engine that answers and has buildx."""
    try:
        import docker
    except ImportError:
        _unavailable("the Docker SDK (pip package `docker`) is not installed; run python3 scripts/test.py")
    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:  # the SDK raises several types for "no engine"
        _unavailable(f"no Docker engine answers ({exc})")
    problem = image_build.buildx_problem()
    if problem:
        _unavailable(problem)
    yield client
    client.close()


@pytest.fixture(scope="session")
def buildx():
    """buildx usable here (bake --print needs the CLI plugin, not an engine)."""
    problem = image_build.buildx_problem()
    if problem:
        _unavailable(problem)


BASE_IMAGE_VARIABLE = "DSA_IMAGE_BASE_IMAGE"


@pytest.fixture(scope="session")
def base_image() -> str:
    """The base image to build on, chosen as `scripts/preflight.py` chooses it
    (image_build.choose_base): DSA_IMAGE_BASE_IMAGE when set (CI: a local debootstrap import),
    else the recipe's when this engine has it or a registry serves it, else the local
    dsa-image-base:bookworm of scripts/bootstrap_base_image.sh. None of them: the tests that
    build skip with the command that makes one (fail under DSA_IMAGE_REQUIRE_DOCKER=1)."""
    recipe_base = load_recipe().base_ref
    facts = image_build.host_facts(os.environ.get(BASE_IMAGE_VARIABLE) or recipe_base, check_tls=False)
    if facts.engine_problem:
        _unavailable(facts.engine_problem)
    choice = image_build.choose_base(facts, recipe_base, BASE_IMAGE_VARIABLE)
    if choice.problem:
        _unavailable(f"no base image to build on: {choice.problem}")
    return choice.image


@pytest.fixture(scope="session")
def bake_options(base_image) -> image_build.BakeOptions:
    return image_build.BakeOptions.for_this_machine(base_image=base_image, log_dir=REPO_ROOT / "build" / "logs")


@pytest.fixture(scope="session")
def test_stage_build(docker_client, bake_options) -> image_build.BuildResult:
    """Build the `test` target (overlay verify + CPU tests inside the image); fail with the
    build log's tail when it fails."""
    return bake_or_fail("test", bake_options)


@pytest.fixture(scope="session")
def runtime_image(docker_client, bake_options) -> str:
    """Build the sm120 runtime image once per session (loaded into the engine); its tag."""
    result = bake_or_fail("sm120", bake_options)
    return result.tags[0]


@pytest.fixture(scope="session")
def build_target(docker_client, bake_options):
    """Build any bake target by name, failing the test with the build log's tail."""
    return lambda target: bake_or_fail(target, bake_options)


def bake_or_fail(target: str, options: image_build.BakeOptions, sets: list[str] = (),
                 repo: Path = REPO_ROOT) -> image_build.BuildResult:
    """Build a bake target; a failed build fails the test with the log's tail."""
    try:
        return image_build.bake(repo, target, options, sets)
    except (image_build.BuildError, subprocess.TimeoutExpired) as exc:
        pytest.fail(str(exc), pytrace=False)


def _has_nvidia_gpu() -> bool:
    if not shutil.which("nvidia-smi"):
        return False
    done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return done.returncode == 0 and "GPU" in done.stdout


@pytest.fixture(scope="session")
def gpu():
    """Skip (with the reason) unless an NVIDIA GPU is visible."""
    if not _has_nvidia_gpu():
        pytest.skip("no NVIDIA GPU (nvidia-smi -L lists none)")
