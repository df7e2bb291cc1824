"""dsa_image.image_build without building: the in-image results, the local export, failure
hints, and the preflight that says what this host needs (`scripts/preflight.py`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsa_image import image_build
from dsa_image.image_build import BuildError, HostFacts
from dsa_image.recipe import load_recipe

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPE = load_recipe()


def _junit(tests: int, failures: int = 0, errors: int = 0, skipped: int = 0,
           classnames: tuple[str, ...] = ("tests.test_overlay", "tests.test_image_entrypoint.TestX")) -> str:
    cases = "".join(f'<testcase classname="{c}" name="t{i}" />' for i, c in enumerate(classnames))
    return (f'<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="{errors}" '
            f'failures="{failures}" skipped="{skipped}" tests="{tests}">{cases}</testsuite></testsuites>')


def test_read_test_results_counts_and_names_the_test_files(tmp_path):
    (tmp_path / "junit.xml").write_text(_junit(10, failures=1, errors=2, skipped=3))
    (tmp_path / "verify.txt").write_text("verified 12 files\n")
    (tmp_path / "model-info.txt").write_text("model info fresh for A, B\n")
    run = image_build.read_test_results(tmp_path)
    assert (run.tests, run.failures, run.errors, run.skipped, run.passed) == (10, 1, 2, 3, 4)
    assert run.files == ("tests/test_image_entrypoint.py", "tests/test_overlay.py")
    assert run.verify == "verified 12 files\n"
    assert run.model_info == "model info fresh for A, B\n"


@pytest.mark.parametrize("missing", ["junit.xml", "verify.txt", "model-info.txt"])
def test_read_test_results_fails_when_a_file_is_missing(tmp_path, missing):
    (tmp_path / "junit.xml").write_text(_junit(1))
    (tmp_path / "verify.txt").write_text("ok\n")
    (tmp_path / "model-info.txt").write_text("ok\n")
    (tmp_path / missing).unlink()
    with pytest.raises(BuildError, match=missing):
        image_build.read_test_results(tmp_path)


def test_local_output_is_resolved_in_the_repository_and_cleared_only_under_build(tmp_path):
    assert image_build.local_output(tmp_path, {"output": [{"type": "docker"}]}) is None
    dest = image_build.local_output(tmp_path, {"output": [{"type": "local", "dest": "build/test-results"}]})
    assert dest == (tmp_path / "build" / "test-results").resolve()
    dest.mkdir(parents=True)
    (dest / "junit.xml").write_text("stale")
    image_build._clear_export(tmp_path, dest)
    assert not dest.exists()
    with pytest.raises(BuildError, match="not emptying"):
        image_build._clear_export(tmp_path, tmp_path / "docs")


def test_a_missing_bridge_in_a_build_log_points_to_the_docs_and_the_preflight():
    hint = image_build.failure_hint("#5 ERROR: executor failed running [/bin/sh -c true]: network bridge not found")
    assert "BUILD_NETWORK=host" in hint and "--allow network.host" in hint
    assert image_build.HOST_DOCS in hint and "scripts/preflight.py" in hint
    assert image_build.failure_hint("some other failure") == ""


def test_buildx_hint_points_to_the_repositorys_docs(monkeypatch):
    def no_buildx(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "docker: 'buildx' is not a docker command.")
    monkeypatch.setattr(image_build.subprocess, "run", no_buildx)
    problem = image_build.buildx_problem()
    assert image_build.DOCKER_DOCS in problem and "/work" not in problem


def _facts(**overrides) -> HostFacts:
    fine = dict(engine_problem=None, buildx_problem=None, bridge=True, base_image=RECIPE.base_ref,
                base_local=False, base_pullable=True, local_base=False, tls_intercepted=False,
                ca_bundle=Path("/etc/ssl/certs/ca-certificates.crt"), public_bundle="/x/cacert.pem")
    return HostFacts(**{**fine, **overrides})


def _command(facts: HostFacts, target: str = "sm120") -> tuple[str, image_build.Preflight]:
    result = image_build.preflight_options(facts, RECIPE.base_ref)
    return image_build.bake_invocation(result.options, target), result


def test_a_normal_host_gets_the_readmes_plain_command():
    command, result = _command(_facts())
    assert command == "docker buildx bake sm120" and result.blockers == []


def test_no_bridge_means_host_network():
    command, result = _command(_facts(bridge=False))
    assert command == "BUILD_NETWORK=host docker buildx bake sm120 --allow network.host"
    assert any(image_build.BRIDGE_MISSING in note for note in result.notes)


def test_an_intercepted_pypi_means_the_hosts_ca_bundle_as_pip_ca():
    command, _ = _command(_facts(tls_intercepted=True))
    assert command == ("PIP_CA=/etc/ssl/certs/ca-certificates.crt docker buildx bake sm120 "
                       "--allow fs.read=/etc/ssl/certs")
    _, result = _command(_facts(tls_intercepted=True, ca_bundle=None))
    assert any("PIP_CA" in blocker for blocker in result.blockers)


def test_no_registry_means_the_local_base_or_making_it_first():
    command, result = _command(_facts(base_pullable=False, local_base=True))
    assert command == f"BASE_IMAGE={image_build.LOCAL_BASE_IMAGE} docker buildx bake sm120" and not result.blockers
    command, result = _command(_facts(base_pullable=False, local_base=False))
    assert f"BASE_IMAGE={image_build.LOCAL_BASE_IMAGE}" in command
    assert any("scripts/bootstrap_base_image.sh" in blocker for blocker in result.blockers)
    command, _ = _command(_facts(base_local=True, base_pullable=None))
    assert command == "docker buildx bake sm120"


def test_ci_like_host_gets_the_command_docs_image_md_shows():
    command, _ = _command(_facts(bridge=False, tls_intercepted=True, base_pullable=False, local_base=True))
    shown = " ".join((REPO_ROOT / "docs" / "image.md").read_text().split("CI has all three:")[1]
                     .split("\n\n")[1].replace("\\\n", " ").split())
    assert command == shown


def test_no_engine_is_a_blocker_and_nothing_else_is_guessed():
    _, result = _command(_facts(engine_problem="no Docker engine answers", bridge=False))
    assert result.blockers == ["no Docker engine answers"] and result.notes == []


@pytest.mark.docker
def test_preflight_on_this_host_agrees_with_the_engine(buildx, base_image):
    """The real script against this machine's engine: host networking exactly when the engine
    has no bridge, and a base image this engine can build from."""
    bridge = subprocess.run(["docker", "network", "inspect", "bridge"], capture_output=True).returncode == 0
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "preflight.py"), "sm120"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "BASE_IMAGE": base_image})
    command = re.search(r"^    (.*docker buildx bake sm120.*)$", done.stdout, re.M)
    assert command, done.stdout + done.stderr
    assert ("BUILD_NETWORK=host" in command.group(1)) == (not bridge), done.stdout
    assert ("--allow network.host" in command.group(1)) == (not bridge)
    base_here = subprocess.run(["docker", "image", "inspect", base_image], capture_output=True).returncode == 0
    if base_here:
        assert done.returncode == 0, done.stdout
