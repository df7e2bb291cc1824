"""The real images, built with bake: the `test` stage, the sm120 runtime, and how an
overlay-only change rebuilds. Slow (the first build downloads ~9 GB of wheels)."""

from __future__ import annotations

import hashlib
import json
import platform as host
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

import pytest

from dsa_image.build import image_build, precompile
from dsa_image.core import status
from dsa_image.upstream import gate as upstream_tests
from dsa_image.overlay.cli import manifest_path, predicted_receipt_sha256
from dsa_image.core.recipe import load_every_base, load_recipe
from test_image_tree import stage

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPE = load_recipe()
pytestmark = [pytest.mark.docker, pytest.mark.slow]

# Stages before `overlay`: an overlay-only change must take every one of their steps from cache.
HEAVY_STAGES = {"base", "pins", "deps", "extras", "tiny-model", "precompile"}
AFTER_OVERLAY = {"overlay", "runtime-code", "test", "runtime"}


def _run(client, image: str, *args: str, entrypoint: str | None = None,
         environment: dict[str, str] | None = None, volumes: dict | None = None) -> tuple[int, str]:
    container = client.containers.run(image, list(args), entrypoint=entrypoint, network_mode="host",
                                      environment=environment, volumes=volumes, detach=True)
    try:
        code = container.wait(timeout=600)["StatusCode"]
        return code, container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)


def _overlay_test_file(base) -> str:
    """The test file of a base's overlaid indexer: tests/test_indexer_overlay_vllm<major>_<minor>.py."""
    return f"tests/test_indexer_overlay_vllm{base.vllm_version.rsplit('.', 1)[0].replace('.', '_')}.py"


def _in_image_test_files() -> set[str]:
    """The test files the Dockerfile's `test` stage runs and reports for the default base (the
    `test` target's): its globs expanded, less the other bases' overlay tests, which skip as a
    whole module there (tests/test_indexer_overlay_vllm<major>_<minor>.py)."""
    named = {str(path.relative_to(REPO_ROOT)) for pattern in re.findall(r"tests/test_[\w*]+\.py", stage("test"))
             for path in REPO_ROOT.glob(pattern)}
    other_bases = {_overlay_test_file(base) for base in load_every_base()
                   if base.vllm_version != load_recipe().vllm_version}
    return named - other_bases


def _upstream_gate(exported: Path, base) -> str:
    """The gate's verdict, recomputed here from each side's junit files (not read from its
    summary): every file the base's bundle selected from its pinned sdist ran on stock and on
    the overlay, some test passed on stock, and no test regressed (docs/upstream-tests.md)."""
    results = exported / "upstream-tests"
    summary = (results / "compare.txt").read_text()
    comparison = upstream_tests.compare_runs(results, upstream_tests.load_bundle(results / "bundle.json"))
    assert comparison.vllm_version == base.vllm_version
    assert comparison.verdict == "ok" and summary.endswith("\n0 regressions\n"), summary
    selected = json.loads((results / "bundle.json").read_text())
    assert selected["sdist"] == {"filename": base.sdist.filename, "sha256": base.sdist.sha256}
    assert {f.path for f in comparison.files} == {s["path"] for s in selected["selected"]}
    return (f"upstream's tests: {len(comparison.files)} files, {comparison.stock_passed} tests passing on stock, "
            f"{len(comparison.regressions)} regressions")


def test_test_stage_results_are_exported_and_passed_whether_or_not_the_step_was_cached(test_stage_build):
    """The results come out of the image on every build (build/test-results, emptied first), so
    a warm-cache run checks what the cached step proved, not only that a stage exists."""
    assert test_stage_build.exported == (REPO_ROOT / "build" / "test-results").resolve()
    run = image_build.read_test_results(test_stage_build.exported)
    assert run.failures == 0 and run.errors == 0, run
    assert run.passed > 0, run
    assert set(run.files) == _in_image_test_files(), run.files
    assert "tests/test_image_entrypoint.py" in run.files and "tests/test_image_healthcheck.py" in run.files
    assert run.verify.strip(), "overlay.py verify printed nothing"
    assert "model info fresh for GlmMoeDsaForCausalLM, " in run.model_info, run.model_info
    pytest_step = [s for s in test_stage_build.steps if s.stage == "test" and "pytest" in s.name]
    assert pytest_step, "the build log names no pytest step of the `test` stage"
    print(f"in-image tests: {run.passed} passed, {run.skipped} skipped "
          f"({'from cache' if pytest_step[0].cached else 'ran now'}); "
          f"{_upstream_gate(test_stage_build.exported, RECIPE)}")


OTHER_BASES = [base for base in load_every_base() if base.vllm_version != RECIPE.vllm_version]


@pytest.mark.parametrize("base", OTHER_BASES, ids=[b.vllm_version for b in OTHER_BASES])
def test_every_other_base_builds_its_test_target_and_passes_its_in_image_tests_and_its_gate(build_target, base):
    """A base that is not the default still builds, passes its arch checks and overlay verify,
    passes the in-image tests against its own vLLM (shared code, arch_check, the memory plan,
    the recipes, the precompile step, changes under it too) and its own gate of upstream's
    tests, stock vs overlay: the gate re-runs only when that base's overlay, the overlay tool,
    the gate's tool or its `extras` changes, the stock side only with the bundle or `extras`
    (docs/upstream-tests.md)."""
    result = build_target(base.bake_target("test"))
    assert result.exported == (REPO_ROOT / "build" / base.bake_target("test-results")).resolve()
    run = image_build.read_test_results(result.exported)
    assert run.failures == 0 and run.errors == 0 and run.passed > 0, run
    assert _overlay_test_file(base) in run.files and "tests/test_serving_recipes_vllm.py" in run.files, run.files
    assert run.verify.strip(), "overlay.py verify printed nothing"
    assert "model info fresh for GlmMoeDsaForCausalLM, " in run.model_info, run.model_info
    print(f"vLLM {base.vllm_version} in-image tests: {run.passed} passed, {run.skipped} skipped; "
          f"{_upstream_gate(result.exported, base)}")


@pytest.mark.parametrize("target", sorted(RECIPE.targets))
def test_every_target_precompiles_each_module_for_each_of_its_capabilities(build_target, target):
    """The precompile stage of every target, not only the sm120 image CI builds: its own check
    (the stage fails otherwise) proved each library loads as built and carries SASS for its
    capability (cuobjdump); here the exported manifest must list one library per module and
    capability of the recipe's target, each in the directory FlashInfer looks in for it."""
    here = "linux/arm64" if host.machine() == "aarch64" else "linux/amd64"
    if here not in RECIPE.targets[target].platforms:
        pytest.skip(f"{target} is built for {', '.join(RECIPE.targets[target].platforms)}, this machine is {here}")
    result = build_target(f"precompiled-{target}")
    doc = json.loads((result.exported / "manifest.json").read_text())
    assert doc["skipped"] is None, doc["skipped"]
    capabilities = RECIPE.targets[target].cuda_arch
    built = [(art["module"], art["capability"]) for art in doc["artefacts"]]
    assert built == [(module, cap) for cap in capabilities for module in precompile.MODULES], built
    for art in doc["artefacts"]:
        major, minor = art["capability"].split(".")
        assert art["arch"].startswith(f"sm_{major}{minor}") and f"/{major}{minor}" in art["path"], art
        assert len(art["sha256"]) == 64 and art["bytes"] > 0, art
    print(f"{target}: " + ", ".join(f"{a['module']} {a['arch']} {a['build_seconds']:.0f} s" for a in doc["artefacts"]))


def test_a_failing_in_image_test_fails_the_build_and_leaves_no_results(docker_client, bake_options, tmp_path):
    """In a copy of the repository, the in-image test files are replaced by quick ones, one of
    them failing: the `test` build must fail, and no results (not even an earlier build's) may
    be left where the passing results are read."""
    _copy_build_context(tmp_path)
    files = sorted(_in_image_test_files())
    for name in files:
        (tmp_path / name).write_text("def test_passes():\n    pass\n")
    (tmp_path / files[0]).write_text(f"def test_fails_on_purpose():\n    assert False, 'probe {uuid.uuid4().hex}'\n")
    stale = tmp_path / "build" / "test-results"
    stale.mkdir(parents=True)
    (stale / "junit.xml").write_text('<testsuite tests="1" failures="0" errors="0" skipped="0"/>')
    with pytest.raises(image_build.BuildError) as failed:
        image_build.bake(tmp_path, "test", bake_options, log_name="bake-test-failing-probe")
    assert "1 failed" in str(failed.value) and "test_fails_on_purpose" in str(failed.value)
    assert not (stale / "junit.xml").exists()


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
    assert labels["dsa-image.receipt.sha256"] == predicted_receipt_sha256(RECIPE)
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
    manifest_raw = manifest_path(RECIPE.vllm_version).read_bytes()
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
    assert config["Healthcheck"]["Test"][0] == "CMD" and config["Healthcheck"]["Test"][-2:] == ["-m", "dsa_image.runtime.healthcheck"]
    assert config["Entrypoint"][-2:] == ["-m", "dsa_image.runtime.entrypoint"]
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
    """Without --gpus the container has no GPU; with the GPU check skipped vLLM stops at device
    detection: far enough to show the entrypoint's log line and that `vllm serve` of the tiny
    model really started."""
    code, logs = _run(docker_client, runtime_image, environment={"DSA_IMAGE_SKIP_GPU_CHECK": "1"})
    model = RECIPE.serving["default_model"]
    assert f"serving the built-in tiny GLM-5 at {model}" in logs
    assert f"vllm serve {model} --load-format {RECIPE.serving['default_load_format']}" in logs
    assert "vllm/entrypoints/cli" in logs and code != 0  # vLLM ran, and found no GPU


def test_help_works_without_a_gpu_and_lists_modes_and_defaults(docker_client, runtime_image):
    target = RECIPE.target("sm120")
    for flag in ("--help", "-h", "help"):
        code, out = _run(docker_client, runtime_image, flag)
        assert code == 0 and "Traceback" not in out, out
        assert out.startswith("usage: ") and "\n  serve " in out and "\n  verify" in out
        assert f"--max-model-len {RECIPE.serving['max_model_len']}" in out
        assert f"--kv-cache-dtype {target.kv_cache_dtype}" in out and f"--port {RECIPE.serving['port']}" in out
        assert all(f"{k}={v}" in out for k, v in target.env.items())


@pytest.mark.parametrize("args", [(), ("zai-org/GLM-5", "--tensor-parallel-size", "4"), ("--bogus-flag",),
                                  ("selftest",), ("selftest", "--kernels", "b12x")])
def test_serving_without_a_gpu_is_one_line_and_exits_no_gpu(docker_client, runtime_image, args):
    code, out = _run(docker_client, runtime_image, *args)
    assert code == status.NO_GPU, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and "no usable NVIDIA GPU is visible" in lines[0] and "--gpus all" in lines[0], out


def test_vllms_serve_help_without_a_gpu_says_where_its_flags_are(docker_client, runtime_image):
    """vLLM's parser detects the device even for --help; instead of its traceback one line
    naming the pinned version's CLI docs."""
    code, out = _run(docker_client, runtime_image, "serve", "--help")
    lines = out.strip().splitlines()
    assert code == status.NO_GPU and len(lines) == 1, out
    assert f"https://docs.vllm.ai/en/v{RECIPE.vllm_version}/cli/serve/" in lines[0]


def test_selftest_help_and_the_recipe_list_work_without_a_gpu(docker_client, runtime_image):
    code, out = _run(docker_client, runtime_image, "selftest", "--help")
    assert code == 0 and "--kernels" in out and "Traceback" not in out, out
    code, out = _run(docker_client, runtime_image, "recipe", "--list")
    assert code == 0 and "tiny-glm5" in out and "Traceback" not in out, out


def test_the_cluster_parts_are_in_the_image(docker_client, runtime_image):
    """Ray (the recipe's pin, for vLLM's Ray executor), the RDMA user space NCCL loads for
    InfiniBand/RoCE, and `dsa-image` on PATH for `docker exec` into a ray-head container."""
    ray_pin = next(p for p in RECIPE.cluster_packages if p.startswith("ray=="))
    code, out = _run(docker_client, runtime_image, "--version", entrypoint="ray")
    assert code == 0 and ray_pin.split("==")[1] in out, out
    code, out = _run(docker_client, runtime_image, "-c", "ldconfig -p | grep -E 'libibverbs.so.1|librdmacm.so.1'; "
                     "ls /usr/lib/*/libibverbs/ | grep -c mlx5", entrypoint="sh")
    assert code == 0 and "libibverbs.so.1" in out and "librdmacm.so.1" in out, out
    code, out = _run(docker_client, runtime_image, "--help", entrypoint="dsa-image")
    assert code == 0 and "\n  ray-head" in out and "\n  ray-worker HEAD_IP" in out, out


def test_verify_with_an_argument_is_a_usage_error(docker_client, runtime_image):
    code, out = _run(docker_client, runtime_image, "verify", "extra")
    assert code == 2 and "`verify` takes no arguments" in out and "Traceback" not in out, out


def test_healthcheck_follows_the_port_served(docker_client, runtime_image):
    """A stand-in for `vllm serve --port N` (its argv as PID 1, /health on N): the image's own
    HEALTHCHECK command must probe N, not the recipe's port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert port != RECIPE.serving["port"]
    server = ("import http.server, sys\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200 if self.path == '/health' else 404); self.end_headers()\n"
              "http.server.HTTPServer(('127.0.0.1', int(sys.argv[-1])), H).serve_forever()\n")
    check = docker_client.api.inspect_image(runtime_image)["Config"]["Healthcheck"]["Test"]
    assert check[0] == "CMD"
    container = docker_client.containers.run(runtime_image, ["-c", server, "vllm", "serve", "--port", str(port)],
                                             entrypoint="/opt/venv/bin/python", network_mode="host", detach=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            code, out = container.exec_run(check[1:])
            if code == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert code == 0, out.decode(errors="replace") + container.logs().decode(errors="replace")
        assert f"healthy: http://127.0.0.1:{port}/health" in out.decode()
    finally:
        container.remove(force=True)


# The generator is build code, which the runtime image does not carry: mounted from this checkout.
GENERATOR = "/tmp/dsa-image-generator"
GENERATOR_MOUNT = {str(REPO_ROOT / "dsa_image"): {"bind": f"{GENERATOR}/dsa_image", "mode": "ro"}}


def test_built_in_model_is_exactly_what_the_generator_writes(docker_client, runtime_image):
    check = ("from pathlib import Path; from dsa_image.build.tiny_model import model_dir_differences; "
             f"d = model_dir_differences(Path({RECIPE.serving['default_model']!r})); print(d or 'identical')")
    code, out = _run(docker_client, runtime_image, "-c", check, volumes=GENERATOR_MOUNT,
                     entrypoint=f"/usr/bin/env PYTHONPATH={GENERATOR} PYTHONDONTWRITEBYTECODE=1 /opt/venv/bin/python")
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
