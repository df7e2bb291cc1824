"""dsa_image.build.image_build without building: the in-image results, the local export, failure
hints, and the preflight that says what this host needs (`scripts/preflight.py`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsa_image.build import image_build
from dsa_image.build.image_build import BuildError, HostFacts
from dsa_image.core.recipe import load_recipe

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


_PLAIN_PROGRESS = ("import sys, time\n"
                   "print('#5 [deps 1/2] RUN pip install --require-hashes', flush=True)\n"
                   "time.sleep(float(sys.argv[1]))\n"
                   "print('#5 DONE 1.2s', flush=True)\n")


def test_run_build_reports_the_running_step_and_keeps_the_whole_output(tmp_path):
    lines = []
    done = image_build.run_build([sys.executable, "-c", _PLAIN_PROGRESS, "1.2"], tmp_path, dict(os.environ),
                                 timeout=60, progress=lines.append, heartbeat_s=0.3)
    assert done.returncode == 0 and done.stdout.endswith("#5 DONE 1.2s\n"), done.stdout
    running = [line for line in lines if "running for " in line]
    assert running and all(line.endswith(": [deps 1/2] RUN pip install --require-hashes") for line in running)
    assert re.match(r"0 min [1-9] s, 0 steps done; running for 0 min [0-9] s: ", lines[-1]), lines


def test_run_build_kills_a_build_past_its_timeout_and_keeps_what_it_printed(tmp_path):
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        image_build.run_build([sys.executable, "-c", _PLAIN_PROGRESS, "60"], tmp_path, dict(os.environ),
                              timeout=1.5, progress=lambda line: None, heartbeat_s=0.5)
    assert time.monotonic() - started < 30
    assert "[deps 1/2] RUN pip install" in expired.value.output


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


# -- the base image: one rule for preflight and the tests (image_build.choose_base) ----------

def test_a_base_the_user_names_is_never_swapped_for_the_local_one():
    command, result = _command(_facts(base_image="mine:1", base_pullable=False, local_base=True))
    assert command == "BASE_IMAGE=mine:1 docker buildx bake sm120"
    assert any("mine:1" in blocker and "unset BASE_IMAGE" in blocker for blocker in result.blockers), result


def test_no_base_anywhere_names_the_one_line_fix():
    _, result = _command(_facts(base_pullable=False, local_base=False))
    assert any(f"sudo bash scripts/bootstrap_base_image.sh {image_build.LOCAL_BASE_IMAGE}" in blocker
               for blocker in result.blockers), result.blockers
    choice = image_build.choose_base(_facts(base_pullable=False, local_base=False), RECIPE.base_ref,
                                     "DSA_IMAGE_BASE_IMAGE")
    assert choice.image == image_build.LOCAL_BASE_IMAGE and "DSA_IMAGE_BASE_IMAGE=" in choice.problem


def _preflight(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "preflight.py"), "sm120"],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.docker
def test_the_tests_build_on_the_base_preflight_picks(base_image):
    """With no registry and no DSA_IMAGE_BASE_IMAGE (a new user's `python3 scripts/test.py`),
    the tests find the local base as preflight does instead of pulling the recipe's."""
    env = {k: v for k, v in os.environ.items() if k != "BASE_IMAGE"}
    if os.environ.get("DSA_IMAGE_BASE_IMAGE"):
        env["BASE_IMAGE"] = os.environ["DSA_IMAGE_BASE_IMAGE"]
    done = _preflight(env)
    named = re.search(r"^    .*\bBASE_IMAGE=(\S+) .*docker buildx bake sm120", done.stdout, re.M)
    assert (named.group(1) if named else RECIPE.base_ref) == base_image, done.stdout


@pytest.mark.docker
@pytest.mark.parametrize("required", [False, True], ids=["skip", "required"])
def test_with_no_base_to_build_on_the_docker_tests_skip_with_the_fix(buildx, required):
    """A base that is neither in the engine nor served by a registry: the tests that build skip
    with the reason and the fix, or fail under DSA_IMAGE_REQUIRE_DOCKER=1; never an error from
    a pull."""
    missing = f"dsa-image-missing-base-probe:{os.getpid()}"
    env = {**{k: v for k, v in os.environ.items() if k != "DSA_IMAGE_REQUIRE_DOCKER"},
           "DSA_IMAGE_BASE_IMAGE": missing, **({"DSA_IMAGE_REQUIRE_DOCKER": "1"} if required else {})}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/test_image_build.py::test_preflight_on_this_host_agrees_with_the_engine"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert f"base image {missing}: not in this engine and no registry serves it" in out, out
    assert f"scripts/bootstrap_base_image.sh {missing}" in out and "unset DSA_IMAGE_BASE_IMAGE" in out, out
    if required:
        assert done.returncode == 1 and "DSA_IMAGE_REQUIRE_DOCKER=1" in out, out
    else:
        assert done.returncode == 0 and "1 skipped" in out, out


# -- a Docker engine without a bridge (image_build.engine_has_bridge) ---------------------------

def _docker_build(*args: str) -> subprocess.CompletedProcess:
    """`docker buildx build` of this repository's Dockerfile, nothing exported."""
    return subprocess.run(["docker", "buildx", "build", "--progress", "plain", "-o", "type=cacheonly", *args, "."],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.docker
def test_the_dockerfile_checks_python_version_before_any_step_runs(buildx, base_image):
    done = _docker_build("--target", "base", "--build-arg", f"BASE_IMAGE={base_image}")
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "PYTHON_VERSION: is empty: build with docker buildx bake" in out, out
    assert "] RUN " not in out, "a step ran before the empty PYTHON_VERSION was refused"


def _no_bridge_here():
    if image_build.engine_has_bridge():
        pytest.skip("this engine has a docker0 bridge: the default network works here (nothing to refuse)")


@pytest.mark.docker
def test_without_a_bridge_the_first_error_names_the_network_not_python_version(buildx, base_image):
    _no_bridge_here()
    done = _docker_build("--no-cache", "--target", "base", "--build-arg", f"BASE_IMAGE={base_image}",
                         "--build-arg", f"PYTHON_VERSION={RECIPE.python}")
    out = done.stdout + done.stderr
    assert done.returncode != 0 and image_build.BRIDGE_MISSING in out, out
    assert "PYTHON_VERSION is empty" not in out, out


@pytest.mark.docker
def test_bake_refuses_the_default_network_without_a_bridge_before_building(buildx, base_image, tmp_path):
    _no_bridge_here()
    (tmp_path / "Dockerfile").write_text(f"FROM {base_image}\nRUN true\n")
    (tmp_path / "docker-bake.hcl").write_text(
        'variable "BUILD_NETWORK" {\n  default = "default"\n}\n'
        'target "probe" {\n  network = BUILD_NETWORK\n  output = ["type=cacheonly"]\n}\n')
    options = image_build.BakeOptions(network="default", log_dir=tmp_path / "logs")
    with pytest.raises(BuildError) as refused:
        image_build.bake(tmp_path, "probe", options)
    message = str(refused.value)
    assert "BUILD_NETWORK=host" in message and "--allow network.host" in message and "Nothing was built" in message
    assert not (tmp_path / "logs").exists(), "the bake was started"


@pytest.mark.docker
def test_the_tests_bake_on_the_network_preflight_picks(buildx, monkeypatch):
    monkeypatch.delenv("BUILD_NETWORK", raising=False)
    facts = image_build.host_facts(RECIPE.base_ref, check_tls=False)
    picked = image_build.preflight_options(facts, RECIPE.base_ref).options.network
    assert image_build.BakeOptions.for_this_machine(None, None).network == picked
    monkeypatch.setenv("BUILD_NETWORK", "host")
    assert image_build.BakeOptions.for_this_machine(None, None).network == "host"
