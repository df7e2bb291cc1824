"""dsa_image.runtime.entrypoint: what the container runs for each kind of `docker run` arguments.

Expected values come from the recipe (load_recipe), never typed here."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsa_image.runtime import entrypoint, warmup
from dsa_image.runtime.entrypoint import EntrypointError
from dsa_image.core.recipe import REPO_ROOT, load_recipe

RECIPE = load_recipe()
SM120 = RECIPE.target("sm120")
ENVIRON = {"DSA_IMAGE_TOOL": str(REPO_ROOT), "DSA_IMAGE_RECIPE": RECIPE.id, "DSA_IMAGE_VLLM": RECIPE.vllm_version,
           "DSA_IMAGE_TARGET": "sm120", "DSA_IMAGE_SITE_PACKAGES": "/nonexistent"}


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _server(argv: list[str]) -> list[str]:
    """The server's command the warm-up supervisor runs (after its `--`)."""
    assert "supervise" in argv, argv
    return argv[argv.index("--") + 1:]


def test_no_arguments_serves_the_tiny_model_with_dummy_weights_and_says_so():
    plan = entrypoint.plan([], ENVIRON)
    plan = entrypoint.Plan(_server(plan.argv), plan.env, plan.log)
    serving = RECIPE.serving
    assert plan.argv[:3] == ["vllm", "serve", serving["default_model"]]
    assert _value(plan.argv, "--load-format") == serving["default_load_format"]
    assert _value(plan.argv, "--served-model-name") == serving["served_model_name"]
    assert _value(plan.argv, "--max-model-len") == str(serving["max_model_len"])
    assert _value(plan.argv, "--kv-cache-dtype") == SM120.kv_cache_dtype
    assert _value(plan.argv, "--port") == str(serving["port"])
    assert "tiny GLM-5" in plan.log and "random weights" in plan.log and serving["default_model"] in plan.log


@pytest.mark.parametrize("target_id", list(RECIPE.targets))
def test_each_target_gets_its_own_kv_cache_dtype_and_environment(target_id):
    plan = entrypoint.plan([], {**ENVIRON, "DSA_IMAGE_TARGET": target_id})
    target = RECIPE.target(target_id)
    assert _value(plan.argv, "--kv-cache-dtype") == target.kv_cache_dtype
    assert plan.env == target.env


def test_the_containers_own_environment_wins_over_the_targets():
    name = next(iter(SM120.env))
    plan = entrypoint.plan([], {**ENVIRON, name: "0"})
    assert name not in plan.env


def test_arguments_go_to_vllm_serve_with_defaults_only_for_flags_not_given():
    argv = _server(entrypoint.plan(["some/model", "--max_model_len=4096", "--kv-cache-dtype", "auto", "-tp", "8"],
                                   ENVIRON).argv)
    assert argv[:3] == ["vllm", "serve", "some/model"]
    assert argv.count("--kv-cache-dtype") == 1 and _value(argv, "--kv-cache-dtype") == "auto"
    assert "--max-model-len" not in argv and "--max_model_len=4096" in argv
    assert "--load-format" not in argv  # dummy weights only for the built-in model
    assert _value(argv, "--served-model-name") == RECIPE.serving["served_model_name"]


# -- a user's --config file and a bare `--` (issue #24 item 14) -----------------------------------

USERS_CONFIG = """# a user's vLLM config: flag names without the dashes, as vLLM reads them
port: 9001
max_model_len: 1024   # vLLM takes _ for -
"served-model-name": mine
compilation-config:
  level: 3
"""


def test_defaults_for_flags_a_config_file_sets_are_left_to_the_file(tmp_path):
    """vLLM ranks the command line over --config: the defaults the entrypoint added as flags
    silently overrode the file's port, max-model-len and served-model-name."""
    config = tmp_path / "serve.yaml"
    config.write_text(USERS_CONFIG)
    argv = _server(entrypoint.plan(["some/model", "--config", str(config)], ENVIRON).argv)
    assert argv == ["vllm", "serve", "some/model", "--config", str(config), "--kv-cache-dtype", SM120.kv_cache_dtype]


def test_a_relative_config_file_is_read_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "serve.yaml").write_text("port: 9001\n")
    monkeypatch.chdir(tmp_path)
    argv = _server(entrypoint.plan(["some/model", "--config=serve.yaml"], ENVIRON).argv)
    assert "--port" not in argv and "--max-model-len" in argv


def test_defaults_go_before_a_bare_double_dash():
    """After `--` vLLM's parser takes every word as positional: defaults there were
    "unrecognized arguments"; and a flag after it is no flag given."""
    argv = _server(entrypoint.plan(["--tensor-parallel-size", "2", "--", "some/model"], ENVIRON).argv)
    end = argv.index("--")
    assert argv[end:] == ["--", "some/model"]
    assert [_value(argv, f) for f in ("--port", "--max-model-len")] == [str(RECIPE.serving["port"]),
                                                                      str(RECIPE.serving["max_model_len"])]


@pytest.mark.parametrize("text, message", [
    (None, "cannot read it"),
    ("{port: 9001}\n", "line 1 ('{port: 9001}'): not a top-level `key: value` line"),
    ("base: &b 1\n<<: *b\n", "line 2 ('<<: *b'): not a top-level"),
    ("port: 1\n---\nport: 2\n", "line 2 ('---'): not a top-level"),
    ("port: 1\n\tmax-model-len: 2\n", "line 2 ('max-model-len: 2'): a tab indents it"),
    (b"port: 9\xff\n", "cannot read it ('utf-8' codec can't decode"),
])
def test_a_config_file_it_cannot_read_for_certain_is_refused_in_one_line(no_exec, capsys, tmp_path, text, message):
    config = tmp_path / "serve.yaml"
    if isinstance(text, bytes):
        config.write_bytes(text)
    elif text is not None:
        config.write_text(text)
    assert entrypoint.main(["some/model", "--config", str(config)], gpu_check=_gpu_check_must_not_run) == entrypoint.USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"dsa-image: --config {config}") and message in err and err.count("\n") == 1, err


# -- a mistyped mode (issue #24 item 23) ----------------------------------------------------------

@pytest.mark.parametrize("word, meant", [("verfiy", "verify"), ("selftset", "selftest"), ("recipes", "recipe"),
                                         ("ray-haed", "ray-head")])
def test_a_mistyped_mode_is_refused_naming_the_mode_meant(no_exec, capsys, monkeypatch, tmp_path, word, meant):
    """`docker run IMAGE verfiy` was served as a model named verfiy ("no usable NVIDIA GPU")."""
    monkeypatch.chdir(tmp_path)  # where no path of that name exists
    assert entrypoint.main([word], gpu_check=_gpu_check_must_not_run) == entrypoint.USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"dsa-image: unknown mode {word!r}, did you mean {meant}?") and err.count("\n") == 1
    assert f"docker run IMAGE serve {word}" in err


def test_a_model_id_or_path_that_looks_like_a_mode_is_served(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "verfiy").mkdir()  # a local model directory of that name
    for word in ("verfiy", "org/verfiy", "gpt2", "./recipes"):  # a path; a repository id; close to no mode
        assert entrypoint.split_mode([word, "-tp", "2"]) == ("serve", [word, "-tp", "2"]), word


# -- the warm-up: healthy only once the first requests' kernels are compiled ---------------------

def test_serve_runs_vllm_under_the_warmup_supervisor_from_the_images_tool():
    plan = entrypoint.plan(["some/model"], ENVIRON)
    assert plan.argv[:2] == [sys.executable, "-c"] and "from dsa_image.runtime.warmup import main" in plan.argv[2]
    assert plan.argv[3:6] == [ENVIRON["DSA_IMAGE_TOOL"], "supervise", "--"]
    assert _server(plan.argv)[:3] == ["vllm", "serve", "some/model"]
    assert plan.gpu_for == entrypoint.SERVE_NEEDS_GPU and plan.env == SM120.env
    assert "warm-up requests" in plan.log and "DSA_IMAGE_WARMUP=0" in plan.log


def test_the_supervisor_command_imports_the_warmup_from_the_tool_path_without_pythonpath():
    """The command the entrypoint execs (PYTHONPATH dropped) reaches dsa_image.runtime.warmup's CLI: its
    `check` of this process, which no supervisor started, answers ready."""
    prefix = entrypoint.plan(["some/model"], ENVIRON).argv[:4]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", warmup.MARKER_ENV)}
    done = subprocess.run([*prefix, "check", "--pid", str(os.getpid())], env=env, cwd="/", capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ready", done.stderr


def test_warmup_off_execs_vllm_itself_and_says_so():
    plan = entrypoint.plan(["some/model"], {**ENVIRON, "DSA_IMAGE_WARMUP": "0"})
    assert plan.argv[:3] == ["vllm", "serve", "some/model"] and "supervise" not in plan.argv
    assert "DSA_IMAGE_WARMUP=0: no warm-up" in plan.log


@pytest.mark.parametrize("name, value", [("DSA_IMAGE_WARMUP", "no"), ("DSA_IMAGE_WARMUP_PREFILL", "3000,x"),
                                         ("DSA_IMAGE_WARMUP_CONCURRENCY", "0"), ("DSA_IMAGE_WARMUP_TIMEOUT_S", "soon")])
def test_a_warmup_setting_it_cannot_read_stops_the_start_naming_it(name, value):
    with pytest.raises(EntrypointError, match=f"{name}={value!r}: expected") as raised:
        entrypoint.plan(["some/model"], {**ENVIRON, name: value})
    assert raised.value.exit_code == entrypoint.IMAGE_PROBLEM and "--help" in str(raised.value)


def test_a_recipes_serve_is_warmed_up_too_and_its_dry_run_is_not():
    plan = entrypoint.plan(["recipe", "tiny-glm5"], ENVIRON)
    assert "supervise" in plan.argv and _server(plan.argv)[:2] == ["vllm", "serve"]
    assert plan.gpu_for == entrypoint.SERVE_NEEDS_GPU
    off = entrypoint.plan(["recipe", "tiny-glm5"], {**ENVIRON, "DSA_IMAGE_WARMUP": "0"})
    assert off.argv == _server(plan.argv)
    dry = entrypoint.plan(["recipe", "tiny-glm5", "--dry-run"], ENVIRON)
    assert dry.argv == [] and "tiny-glm5" in dry.output and not dry.gpu_for


def test_help_lists_the_warmup_variables_and_the_cache_volume():
    text = entrypoint.plan(["--help"], ENVIRON).output
    for name in entrypoint.WARMUP_ENV:
        assert f"\n  {name} " in text or f"\n  {name}\n" in text, name
    assert "DSA_IMAGE_WARMUP         1 (default)" in text
    assert f"-v dsa-image-cache:{entrypoint.CACHE_DIR}" in text
    assert max(len(line) for line in text.splitlines()) <= 130


def test_missing_image_environment_is_an_error_naming_the_variable():
    with pytest.raises(EntrypointError, match="DSA_IMAGE_TARGET"):
        entrypoint.plan([], {k: v for k, v in ENVIRON.items() if k != "DSA_IMAGE_TARGET"})


def test_unknown_target_is_an_error_listing_the_valid_ones():
    with pytest.raises(EntrypointError, match="valid targets"):
        entrypoint.plan([], {**ENVIRON, "DSA_IMAGE_TARGET": "sm75"})


def _receipts(tmp_path: Path, data: bytes = b'{"files": []}\n') -> tuple[Path, Path, Path]:
    site = tmp_path / "site-packages"
    site.mkdir()
    (site / entrypoint.SITE_RECEIPT_NAME).write_bytes(data)
    receipt, recorded = tmp_path / "receipt.json", tmp_path / "receipt.json.sha256"
    receipt.write_bytes(data)
    recorded.write_text(f"{hashlib.sha256(data).hexdigest()}  receipt.json\n")
    return site, receipt, recorded


def test_check_receipt_returns_the_recorded_sha256(tmp_path):
    site, receipt, recorded = _receipts(tmp_path)
    assert entrypoint.check_receipt(site, receipt, recorded) == hashlib.sha256(receipt.read_bytes()).hexdigest()


def test_check_receipt_fails_on_an_edited_receipt(tmp_path):
    site, receipt, recorded = _receipts(tmp_path)
    receipt.write_bytes(b'{"files": ["x"]}\n')
    with pytest.raises(EntrypointError, match="the build recorded"):
        entrypoint.check_receipt(site, receipt, recorded)


def test_check_receipt_fails_when_site_packages_holds_another_receipt(tmp_path):
    site, receipt, recorded = _receipts(tmp_path)
    (site / entrypoint.SITE_RECEIPT_NAME).write_bytes(b"{}\n")
    with pytest.raises(EntrypointError, match="differs from"):
        entrypoint.check_receipt(site, receipt, recorded)


def test_check_receipt_fails_when_missing(tmp_path):
    site, receipt, recorded = _receipts(tmp_path)
    recorded.unlink()
    with pytest.raises(EntrypointError, match="missing"):
        entrypoint.check_receipt(site, receipt, recorded)


def test_verify_runs_the_overlay_tools_verify(tmp_path, monkeypatch):
    site, receipt, recorded = _receipts(tmp_path)
    monkeypatch.setattr(entrypoint, "RECEIPT", receipt)
    monkeypatch.setattr(entrypoint, "RECEIPT_SHA256", recorded)
    plan = entrypoint.plan(["verify"], {**ENVIRON, "DSA_IMAGE_SITE_PACKAGES": str(site)})
    assert plan.argv[1:] == [str(REPO_ROOT / "scripts" / "overlay.py"), "verify", "--site-packages", str(site)]


# -- modes, usage, the GPU check ------------------------------------------------------------

@pytest.mark.parametrize("args, mode, rest", [
    ([], "serve", []),
    (["serve"], "serve", []),
    (["serve", "some/model", "-tp", "2"], "serve", ["some/model", "-tp", "2"]),
    (["some/model", "-tp", "2"], "serve", ["some/model", "-tp", "2"]),
    (["--port", "9000"], "serve", ["--port", "9000"]),
    (["--bogus-flag"], "serve", ["--bogus-flag"]),
    (["verify"], "verify", []),
    (["verify", "extra"], "verify", ["extra"]),
    (["--help"], "help", []),
    (["-h"], "help", []),
    (["help"], "help", []),
])
def test_the_first_argument_picks_the_mode_and_anything_else_is_serves(args, mode, rest):
    assert entrypoint.split_mode(args) == (mode, rest)


def test_help_lists_every_mode_the_serving_defaults_and_the_environment():
    plan = entrypoint.plan(["--help"], ENVIRON)
    assert plan.argv == [] and plan.exit_code == entrypoint.OK and not plan.gpu_for
    text = plan.output
    for mode in entrypoint.MODES:
        assert f"\n  {mode}" in text
    for flag, value in entrypoint.serving_defaults(RECIPE, SM120):
        assert f"{flag} {value}" in text
    assert RECIPE.serving["default_model"] in text
    for name, value in SM120.env.items():
        assert f"{name}={value}" in text
    for name in [*entrypoint.IMAGE_ENV, entrypoint.SKIP_GPU_CHECK, "CUDA_VISIBLE_DEVICES"]:
        assert name in text
    assert "serve --help" in text and entrypoint.vllm_serve_docs(RECIPE.vllm_version) in text  # vLLM's own flags
    assert text.endswith(entrypoint.EXIT_CODES)
    for code, name in ((entrypoint.OK, "SUCCESS"), (entrypoint.IMAGE_PROBLEM, "ENVIRONMENT"), (entrypoint.USAGE, "USAGE"),
                       (entrypoint.REFUSED, "REFUSED"), (entrypoint.NO_GPU, "NO_GPU")):
        assert f"\n  {code:<3}{name} " in text


def test_help_works_without_the_images_environment():
    plan = entrypoint.plan(["-h"], {})
    assert "verify" in plan.output and "cannot show them" in plan.output and "DSA_IMAGE_TOOL" in plan.output


@pytest.mark.parametrize("args", [["verify", "extra"], ["verify", "--site-packages", "/x"], ["help", "me"]])
def test_arguments_a_mode_does_not_take_are_a_usage_error(args):
    with pytest.raises(entrypoint.UsageError, match=f"`{args[0]}` takes no arguments"):
        entrypoint.plan(args, ENVIRON)


def test_vllms_own_help_is_passed_through_without_defaults_and_says_where_its_flags_are_without_gpu():
    """vLLM 0.24.0 builds its parser from config defaults that detect the device, so its help
    needs a GPU too (checked in the image: without one it is the 'Failed to infer device type'
    traceback); the GPU check's line then points to the pinned version's docs."""
    for args in (["serve", "--help"], ["serve", "-h"], ["some/model", "--help=ModelConfig"]):
        plan = entrypoint.plan(args, ENVIRON)
        rest = args[1:] if args[0] == "serve" else args
        assert plan.argv == ["vllm", "serve", *rest]
        assert entrypoint.vllm_serve_docs(RECIPE.vllm_version) in plan.gpu_for


def test_serving_needs_a_gpu_and_verify_does_not(tmp_path, monkeypatch):
    assert entrypoint.plan([], ENVIRON).gpu_for == entrypoint.SERVE_NEEDS_GPU
    assert entrypoint.plan(["some/model"], ENVIRON).gpu_for == entrypoint.SERVE_NEEDS_GPU
    site, receipt, recorded = _receipts(tmp_path)
    monkeypatch.setattr(entrypoint, "RECEIPT", receipt)
    monkeypatch.setattr(entrypoint, "RECEIPT_SHA256", recorded)
    assert not entrypoint.plan(["verify"], {**ENVIRON, "DSA_IMAGE_SITE_PACKAGES": str(site)}).gpu_for


def test_a_new_mode_is_one_entry_in_the_table(monkeypatch):
    ran = entrypoint.Plan(["true"])
    monkeypatch.setitem(entrypoint.MODES, "selftest",
                        entrypoint.Mode(lambda args, environ: ran, "[N]", "a mode added for this test"))
    assert entrypoint.plan(["selftest", "3"], ENVIRON) is ran
    assert "selftest [N]" in entrypoint.usage(ENVIRON) and "a mode added for this test" in entrypoint.usage(ENVIRON)


class _Exec(Exception):
    """Raised by the stand-in for os.execvpe: what would have replaced the process."""


@pytest.fixture
def no_exec(monkeypatch):
    def fake_execvpe(file, argv, env):
        raise _Exec(argv, env)
    monkeypatch.setattr(entrypoint.os, "execvpe", fake_execvpe)
    for name, value in ENVIRON.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(entrypoint.SKIP_GPU_CHECK, raising=False)
    monkeypatch.delenv(next(iter(SM120.env)), raising=False)
    monkeypatch.setenv("PYTHONPATH", "/opt/dsa-image/tool")


def _gpu_check_must_not_run():
    raise AssertionError("the GPU check ran")


def test_main_help_prints_usage_exits_success_and_never_checks_the_gpu(no_exec, capsys):
    assert entrypoint.main(["--help"], gpu_check=_gpu_check_must_not_run) == entrypoint.OK
    out = capsys.readouterr()
    assert out.out.startswith("usage: ") and "verify" in out.out and out.err == ""


@pytest.mark.parametrize("args", [[], ["some/model"], ["--bogus-flag"], ["serve", "--port", "9000"], ["serve", "--help"]])
def test_main_without_a_gpu_says_so_in_one_line_and_exits_no_gpu(no_exec, capsys, args):
    assert entrypoint.main(args, gpu_check=lambda: "a cause for this test") == entrypoint.NO_GPU
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dsa-image: no usable NVIDIA GPU is visible (a cause for this test)")
    assert "docker run --gpus all" in err and "NVIDIA Container Toolkit" in err
    assert entrypoint.plan(args, ENVIRON).gpu_for in err


def test_main_usage_error_exits_usage_with_one_line(no_exec, capsys):
    assert entrypoint.main(["verify", "extra"], gpu_check=_gpu_check_must_not_run) == entrypoint.USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "`verify` takes no arguments" in err and "--help" in err


def test_main_with_a_gpu_execs_vllm_with_the_targets_environment_and_no_pythonpath(no_exec, capsys):
    with pytest.raises(_Exec) as raised:
        entrypoint.main(["some/model"], gpu_check=lambda: None)
    argv, env = raised.value.args
    assert _server(argv)[:3] == ["vllm", "serve", "some/model"]
    assert all(env[k] == v for k, v in SM120.env.items()) and "PYTHONPATH" not in env
    assert "vllm serve with the recipe's defaults" in capsys.readouterr().err


def test_main_skips_the_gpu_check_when_asked(no_exec, monkeypatch):
    monkeypatch.setenv(entrypoint.SKIP_GPU_CHECK, "1")
    with pytest.raises(_Exec):
        entrypoint.main([], gpu_check=_gpu_check_must_not_run)


def test_main_image_problem_exits_environment(no_exec, monkeypatch, capsys):
    monkeypatch.delenv("DSA_IMAGE_TARGET")
    assert entrypoint.main([], gpu_check=_gpu_check_must_not_run) == entrypoint.IMAGE_PROBLEM
    assert "DSA_IMAGE_TARGET" in capsys.readouterr().err


def test_no_driver_library_means_no_gpu():
    for check in (entrypoint.cuda_device_problem, entrypoint.gpu_problem):
        problem = check("libcuda-not-here-dsa-image-test.so.1")
        assert problem == "libcuda-not-here-dsa-image-test.so.1, the NVIDIA driver, is not in the container"


FAKE_LIBCUDA = r"""
#include <stdlib.h>
#ifdef __cplusplus
extern "C" {
#endif
static int env_int(const char *name) { const char *v = getenv(name); return v ? atoi(v) : 0; }
int cuInit(unsigned int flags) { return flags == 0 ? env_int("FAKE_CUINIT") : 1; }
int cuDeviceGetCount(int *count) { *count = env_int("FAKE_COUNT"); return env_int("FAKE_COUNT_STATUS"); }
#ifdef __cplusplus
}
#endif
"""


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory) -> str:
    """A libcuda stand-in whose cuInit / cuDeviceGetCount answer what FAKE_* say: the check's
    real ctypes calls, in a real child process, without a GPU."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C compiler to build the libcuda stand-in")
    directory = tmp_path_factory.mktemp("fake-libcuda")
    (directory / "fake.c").write_text(FAKE_LIBCUDA)
    library = directory / "libcuda.so.1"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(directory / "fake.c")], check=True)
    return str(library)


@pytest.mark.parametrize("cuinit, count, count_status, expected", [
    ("0", "2", "0", None),
    ("0", "0", "0", "cuDeviceGetCount gave 0 devices"),
    ("0", "1", "3", "CUDA error 3"),
    ("100", "0", "0", "lists no device"),
    ("35", "0", "0", "too old"),
    ("999", "0", "0", "CUDA error 999"),
])
def test_the_gpu_check_reads_the_drivers_answers(fake_libcuda, monkeypatch, cuinit, count, count_status, expected):
    monkeypatch.setenv("FAKE_CUINIT", cuinit)
    monkeypatch.setenv("FAKE_COUNT", count)
    monkeypatch.setenv("FAKE_COUNT_STATUS", count_status)
    problem = entrypoint.gpu_problem(fake_libcuda)
    if expected is None:
        assert problem is None
    else:
        assert problem and expected in problem and "\n" not in problem


def test_ray_head_starts_a_blocking_head_on_this_nodes_address_and_needs_a_gpu():
    plan = entrypoint.plan(["ray-head", "--num-gpus=1"], {**ENVIRON, "VLLM_HOST_IP": "192.0.2.10", "RAY_PORT": "6380"})
    assert plan.argv == ["ray", "start", "--head", "--port=6380", "--node-ip-address=192.0.2.10", "--block",
                         "--num-gpus=1"]
    assert plan.gpu_for and "--distributed-executor-backend ray" in plan.log


def test_ray_worker_joins_the_head_given_first_with_the_default_port():
    plan = entrypoint.plan(["ray-worker", "192.0.2.10"], {**ENVIRON, "VLLM_HOST_IP": "192.0.2.11"})
    assert plan.argv == ["ray", "start", "--address=192.0.2.10:6379", "--node-ip-address=192.0.2.11", "--block"]
    no_ip = entrypoint.plan(["ray-worker", "192.0.2.10:7000"], ENVIRON)
    assert no_ip.argv == ["ray", "start", "--address=192.0.2.10:7000", "--block"] and no_ip.gpu_for


@pytest.mark.parametrize("args", [["ray-worker"], ["ray-worker", "--num-gpus=1"]])
def test_ray_worker_without_the_heads_address_is_a_usage_error(args):
    with pytest.raises(entrypoint.UsageError, match="needs the head's address"):
        entrypoint.plan(args, ENVIRON)


def test_help_shows_the_cluster_modes_and_the_variables_multi_node_serving_reads():
    text = entrypoint.plan(["--help"], ENVIRON).output
    assert "\n  ray-head" in text and "\n  ray-worker HEAD_IP" in text
    for name in ("VLLM_HOST_IP", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA", "RAY_PORT"):
        assert name in text


# -- start-up defaults of the built-in model ------------------------------------------------------

def test_the_built_in_model_gets_the_recipes_start_up_flags_and_any_arguments_replace_them():
    added = [str(a) for a in RECIPE.serving["default_model_args"]]
    assert "--kv-cache-memory-bytes" in added and "--max-num-seqs" in added
    argv = _server(entrypoint.plan([], ENVIRON).argv)
    assert argv[3:5] == ["--load-format", RECIPE.serving["default_load_format"]] and argv[5:5 + len(added)] == added
    own = _server(entrypoint.plan([RECIPE.serving["default_model"], "--load-format", "dummy"], ENVIRON).argv)
    assert not set(added[::2]) & set(own)


def test_help_says_how_to_serve_the_built_in_model_without_the_start_up_flags():
    text = entrypoint.usage(ENVIRON)
    assert " ".join(entrypoint.default_model_argv(RECIPE)) in text
    assert f"{RECIPE.serving['default_model']} --load-format {RECIPE.serving['default_load_format']})" in text
