"""The real images, built with bake: the `test` stage, the sm120 runtime, and how an
overlay-only change rebuilds. Slow (the first build downloads ~9 GB of wheels)."""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from pathlib import Path

import pytest

from dsa_image import image_build
from dsa_image.overlay import predicted_receipt_sha256
from dsa_image.recipe import load_recipe

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPE = load_recipe()
pytestmark = [pytest.mark.docker, pytest.mark.slow]

# Stages before `overlay`: an overlay-only change must take every one of their steps from cache.
HEAVY_STAGES = {"base", "pins", "deps", "extras", "tiny-model"}
AFTER_OVERLAY = {"overlay", "test", "runtime"}


def _run(client, image: str, *args: str, entrypoint: str | None = None) -> tuple[int, str]:
    container = client.containers.run(image, list(args), entrypoint=entrypoint, network_mode="host",
                                      detach=True)
    try:
        code = container.wait(timeout=600)["StatusCode"]
        return code, container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)


def test_test_stage_runs_verify_and_the_tests_in_the_image(test_stage_build):
    steps = [s for s in test_stage_build.steps if s.stage == "test"]
    ran = [s for s in steps if not s.cached]
    assert steps, "the test target built no step of the `test` stage"
    if any("pytest" in s.name for s in ran):  # a cached step passed in an earlier build
        assert " passed" in test_stage_build.log and " failed" not in test_stage_build.log


def test_runtime_verify_passes(docker_client, runtime_image):
    code, logs = _run(docker_client, runtime_image, "verify")
    assert code == 0, logs
    assert "matches the build" in logs


def test_labels_name_the_recipe_and_vllm(docker_client, runtime_image):
    labels = docker_client.images.get(runtime_image).labels
    target = RECIPE.target("sm120")
    assert labels["dsa-image.vllm.version"] == RECIPE.vllm_version
    assert labels["dsa-image.recipe"] == RECIPE.id
    assert labels["dsa-image.target"] == "sm120"
    assert labels["dsa-image.cuda-arch"] == ";".join(target.cuda_arch)
    assert labels["org.opencontainers.image.version"] == f"{RECIPE.vllm_version}-sm120"
    assert labels["dsa-image.receipt"] == "/opt/dsa-image/receipt.json"
    assert labels["dsa-image.receipt.sha256"] == predicted_receipt_sha256(RECIPE.id)
    for platform, wheel in RECIPE.wheels.items():
        arch = platform.split("/")[1]
        assert labels[f"dsa-image.vllm.wheel-sha256.{arch}"] == wheel.sha256


def _file_in_image(client, image: str, path: str) -> str:
    code, out = _run(client, image, path, entrypoint="cat")
    assert code == 0, out
    return out


def test_receipt_names_the_overlay_hashes_and_its_recorded_sha256(docker_client, runtime_image):
    receipt_text = _file_in_image(docker_client, runtime_image, "/opt/dsa-image/receipt.json")
    receipt = json.loads(receipt_text)
    manifest_raw = (REPO_ROOT / "overlay" / "manifest.json").read_bytes()
    manifest = json.loads(manifest_raw)
    assert receipt["recipe"] == RECIPE.id and receipt["vllm_version"] == RECIPE.vllm_version
    assert receipt["manifest_sha256"] == hashlib.sha256(manifest_raw).hexdigest()
    assert sorted(f["path"] for f in receipt["files"]) == sorted(e["path"] for e in manifest["files"])
    assert all(f["installed_sha256"] == f["overlay_sha256"] for f in receipt["files"])
    recorded = _file_in_image(docker_client, runtime_image, "/opt/dsa-image/receipt.json.sha256").split()[0]
    assert recorded == hashlib.sha256(receipt_text.encode()).hexdigest()


def test_runtime_config_user_health_entrypoint_and_cuda_environment(docker_client, runtime_image):
    config = docker_client.api.inspect_image(runtime_image)["Config"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert config["User"] == "vllm"
    assert "/health" in " ".join(config["Healthcheck"]["Test"])
    assert config["Entrypoint"][-2:] == ["-m", "dsa_image.entrypoint"]
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert env["CUDA_HOME"].endswith("/site-packages/nvidia/cu13")
    assert env["DG_JIT_CACHE_DIR"].startswith("/home/vllm/")
    # The toolkit links resolve (libcuda.so is the driver's, mounted at run time: it may dangle).
    probe = ('set -e; cd "$CUDA_HOME"; test "$(readlink lib64)" = lib; test -e lib64/libcudart.so; '
             'readlink lib/stubs/libcuda.so; nvcc --version | tail -1; id -un; '
             'touch "$DG_JIT_CACHE_DIR/w" "$TRITON_CACHE_DIR/w" "$XDG_CACHE_HOME/w"; '
             'test ! -e /root/.cache/pip; test ! -e /run/secrets/pip-ca; echo ok')
    code, out = _run(docker_client, runtime_image, "-c", probe, entrypoint="/bin/bash")
    assert code == 0, out
    assert out.strip().endswith("ok") and "vllm" in out and "libcuda.so.1" in out


def test_default_command_serves_the_built_in_model_and_says_so(docker_client, runtime_image):
    """Without --gpus the container has no GPU, so vLLM stops at device detection: far enough
    to show the entrypoint's log line and that `vllm serve` of the tiny model really started."""
    code, logs = _run(docker_client, runtime_image)
    model = RECIPE.serving["default_model"]
    assert f"serving the built-in tiny GLM-5 at {model}" in logs
    assert f"vllm serve {model} --load-format {RECIPE.serving['default_load_format']}" in logs
    assert "vllm/entrypoints/cli" in logs and code != 0  # vLLM ran, and found no GPU


def test_built_in_model_is_exactly_what_the_generator_writes(docker_client, runtime_image):
    check = ("from pathlib import Path; from dsa_image.tiny_model import model_dir_differences; "
             f"d = model_dir_differences(Path({RECIPE.serving['default_model']!r})); print(d or 'identical')")
    code, out = _run(docker_client, runtime_image, "-c", check,
                     entrypoint="/usr/bin/env PYTHONPATH=/opt/dsa-image/tool /opt/venv/bin/python")
    assert code == 0 and out.strip().endswith("identical"), out


def _copy_build_context(destination: Path) -> None:
    for name in ["Dockerfile", "docker-bake.hcl", "docker-bake.json", ".dockerignore", "pyproject.toml"]:
        shutil.copy2(REPO_ROOT / name, destination / name)
    for name in ["dsa_image", "scripts", "recipes", "overlay", "tests"]:
        shutil.copytree(REPO_ROOT / name, destination / name, ignore=shutil.ignore_patterns("__pycache__"))


def test_overlay_only_change_rebuilds_only_the_overlay_and_later_stages(docker_client, runtime_image, bake_options, tmp_path):
    """Change one byte that only the overlay stage copies (a comment in the overlay tool) in a
    copy of the repository, rebuild the runtime, and count the steps that did not come from the
    build cache."""
    _copy_build_context(tmp_path)
    tool = tmp_path / "scripts" / "overlay.py"
    # A new byte string every run: a change built once before would come from the cache.
    tool.write_text(tool.read_text() + f"# overlay-only rebuild probe {uuid.uuid4().hex}\n")
    options = bake_options.with_variables(TAG="overlay-rebuild-probe")
    result = image_build.bake(tmp_path, "sm120", options, log_name="bake-overlay-rebuild")
    try:
        rebuilt = result.rebuilt()
        stages_seen = {s.stage for s in result.steps if s.stage}
        summary = {
            "seconds": round(result.seconds, 1),
            "rebuilt": [s.name[:100] for s in rebuilt],
            "cached_heavy_steps": sum(1 for s in result.steps if s.stage in HEAVY_STAGES and s.cached),
        }
        (REPO_ROOT / "build" / "logs").mkdir(parents=True, exist_ok=True)
        (REPO_ROOT / "build" / "logs" / "overlay-rebuild.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"overlay-only rebuild: {summary}")
        assert HEAVY_STAGES - {"tiny-model"} <= stages_seen, f"stages in the build output: {stages_seen}"
        assert {s.stage for s in rebuilt} <= AFTER_OVERLAY, f"rebuilt outside overlay/runtime: {summary['rebuilt']}"
        assert any(s.stage == "overlay" for s in rebuilt), "the changed file did not rebuild the overlay stage"
    finally:
        for tag in result.tags:
            docker_client.images.remove(tag, noprune=True)
