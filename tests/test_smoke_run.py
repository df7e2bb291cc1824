"""A whole smoke run: the server is always stopped and the report always written, whether the
server never starts, exits early, never gets healthy, or the run is interrupted; the local
runtime end to end against a fake `vllm serve` process group."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_vllm import FakeServer, FakeVllm  # noqa: E402
from test_smoke_fakes import (SELFTEST_OUTPUT, free_port, make_fake_vllm_site, pid_alive,  # noqa: E402
                             startup_log)

from dsa_image.build import tiny_model
from dsa_image.core.recipe import load_recipe  # noqa: E402
from dsa_image.smoke import checks as C  # noqa: E402
from dsa_image.smoke.report import LOG_NAME, REPORT_NAME, Report  # noqa: E402
from dsa_image.smoke.run import StartError, print_summary, run_smoke, wait_healthy  # noqa: E402
from dsa_image.harness.client import Client  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scripts" / "smoke.py"
# The fakes play vLLM 0.24.0 (its dist-info, image label and log: FLASHMLA_SPARSE on sm_90); the
# base the smoke checks follows the served vLLM, so the expectations here are 0.24.0's.
RECIPE = load_recipe(vllm="0.24.0")

H200 = {"gpus": [{"name": "NVIDIA H200", "compute_capability": "9.0", "driver_version": "580.95.05"}],
        "source": "test"}


class ScriptedServer:
    """A Server whose behaviour a test scripts; it records every stop."""

    verify_command = "overlay.py verify"

    def __init__(self, base_url="http://127.0.0.1:9", start_error=None, exit_after_polls=None,
                 log="", verify=(0, "ok"), on_start=None, selftest=(0, SELFTEST_OUTPUT), warm_after=0):
        self.base_url = base_url
        self.warm_after = warm_after  # readiness asks answered "warming up" before it is ready
        self.warm_asks = 0
        self.start_error = start_error
        self.exit_after_polls = exit_after_polls
        self.log = log
        self.verify = verify
        self.selftest = selftest
        self.on_start = on_start
        self.polls = 0
        self.stops = 0
        self.started = False

    def start(self):
        if self.start_error:
            raise StartError(self.start_error)
        self.started = True
        if self.on_start:
            self.on_start()

    def exit_code(self):
        self.polls += 1
        if self.exit_after_polls is not None and self.polls > self.exit_after_polls:
            return 1
        return None

    def log_text(self):
        return self.log

    def run_verify(self):
        return self.verify

    def run_selftest(self):
        return self.selftest

    def warm_problem(self):
        self.warm_asks += 1
        return None if self.warm_asks > self.warm_after else "the warm-up has not finished: step decode-32"

    def receipt(self):
        return {"schema": 1, "recipe": "glm5-dsa", "vllm_version": "0.24.0", "manifest_sha256": "ab" * 32,
                "files": [{}, {}]}

    def gpu_info(self):
        return H200

    def layout_facts(self):
        return {"gpus_used": {"gpus": [{"index": 0, "uuid": "GPU-0", "name": "NVIDIA H200", "pids": [7],
                                        "used_memory_mib": 1024}], "source": "test"}}

    def describe(self, report):
        report.python = {"executable": "python3"}

    def stop(self):
        self.stops += 1


def smoke(server, tmp_path, target="sm90", health_timeout=5.0) -> tuple[Report, dict]:
    report = Report(runtime="test", served_model_name="glm-5")
    run_smoke(server, report, RECIPE, target, tmp_path, health_timeout, 10.0)
    written = json.loads((tmp_path / REPORT_NAME).read_text())
    assert (tmp_path / LOG_NAME).read_text() == server.log
    return report, written


def test_a_good_server_passes_and_is_stopped(tmp_path):
    log = "\n".join(startup_log("FLASHMLA_SPARSE", "deepgemm"))
    with FakeServer(FakeVllm()) as fake:
        server = ScriptedServer(fake.base_url, log=log)
        report, written = smoke(server, tmp_path)
    assert written["passed"] is True, written["checks"]
    assert [c["name"] for c in written["checks"]] == list(C.ALL_CHECKS)
    assert server.stops == 1
    assert written["gpu"] == H200 and written["target"] == "sm90"
    assert written["expected"]["attention_backend"] == "FLASHMLA_SPARSE"
    assert written["versions"]["receipt_vllm"] == "0.24.0" and written["versions"]["receipt_overlay_files"] == 2
    assert written["timings"]["time_to_healthy_s"] is not None
    assert set(written["timings"]["requests_s"]) == {"models", "completion_short", "completion_long", "stream", "chat",
                                                     "deterministic"}
    assert written["log_tail"] is None


def test_a_failed_verify_fails_the_run(tmp_path):
    log = "\n".join(startup_log("FLASHMLA_SPARSE", "deepgemm"))
    with FakeServer(FakeVllm()) as fake:
        report, written = smoke(ScriptedServer(fake.base_url, log=log, verify=(1, "vllm/envs.py differs")), tmp_path)
    assert written["passed"] is False and written["failed_checks"] == ["overlay_verify"]
    assert "vllm/envs.py differs" in {c["name"]: c for c in written["checks"]}["overlay_verify"]["reason"]
    assert "DSA sparse indexer kernels" in written["log_tail"]


def test_a_refused_start_is_reported_and_everything_else_not_run(tmp_path):
    server = ScriptedServer(start_error="could not select device driver with capabilities: [[gpu]]", log="")
    report, written = smoke(server, tmp_path)
    assert written["passed"] is False
    first = written["checks"][0]
    assert first["name"] == "server_healthy" and "could not select device driver" in first["reason"]
    assert all(c["reason"].startswith("not run: the server never became healthy") for c in written["checks"][1:])
    assert server.stops == 1


def test_an_early_exit_names_the_exit_code_and_the_log(tmp_path):
    server = ScriptedServer(exit_after_polls=2, log="RuntimeError: No CUDA GPUs are available\n")
    report, written = smoke(server, tmp_path)
    first = written["checks"][0]
    assert not first["passed"] and "exited with code 1" in first["reason"]
    assert "No CUDA GPUs are available" in first["reason"] and "No CUDA GPUs" in written["log_tail"]
    assert server.stops == 1


def console_summary(report: Report, tmp_path) -> list[str]:
    stream = io.StringIO()
    print_summary(report, tmp_path / REPORT_NAME, stream)
    return stream.getvalue().splitlines()


def test_the_console_shows_why_the_server_never_answered(tmp_path):
    log = "".join(f"INFO loading shard {i}\n" for i in range(60)) + "RuntimeError: No CUDA GPUs are available\n"
    report, written = smoke(ScriptedServer(exit_after_polls=1, log=log), tmp_path)
    lines = console_summary(report, tmp_path)
    at = next(i for i, line in enumerate(lines) if line.startswith("FAIL server_healthy: "))
    assert lines[at].endswith("before /health answered; log tail:")
    # The tail's last 40 lines follow it, the error last; where the rest is, above them.
    assert lines[at + 1] == (f"  | ... 21 earlier lines in {tmp_path / REPORT_NAME}, "
                             f"the whole log in {tmp_path / LOG_NAME}")
    assert lines[at + 2:at + 42] == [f"  | INFO loading shard {i}" for i in range(21, 60)] + [
        "  | RuntimeError: No CUDA GPUs are available"]
    assert lines[at + 42].startswith("FAIL models: not run")


def test_the_console_shows_a_timeouts_log_tail(tmp_path):
    report, written = smoke(ScriptedServer(log="INFO compiling CUDA graphs\n"), tmp_path, health_timeout=0.5)
    lines = console_summary(report, tmp_path)
    at = lines.index(next(line for line in lines if line.startswith("FAIL server_healthy: ")))
    assert lines[at + 1] == "  | INFO compiling CUDA graphs"


def test_the_console_says_so_when_the_server_wrote_nothing(tmp_path):
    report, written = smoke(ScriptedServer(exit_after_polls=1, log=""), tmp_path)
    lines = console_summary(report, tmp_path)
    at = lines.index(next(line for line in lines if line.startswith("FAIL server_healthy: ")))
    assert lines[at + 1] == "  | (the server wrote nothing to its log)"


def test_the_console_keeps_a_passed_check_to_one_line(tmp_path):
    log = "\n".join(startup_log("FLASHMLA_SPARSE", "deepgemm"))
    with FakeServer(FakeVllm()) as fake:
        report, written = smoke(ScriptedServer(fake.base_url, log=log, verify=(0, "ok\nsecond line")), tmp_path)
    lines = console_summary(report, tmp_path)
    assert written["passed"] and not any(line.startswith("  | ") for line in lines), lines


def test_a_server_that_never_gets_healthy_times_out_and_is_stopped(tmp_path):
    server = ScriptedServer(log="still compiling\n")
    start = time.monotonic()
    report, written = smoke(server, tmp_path, health_timeout=1.5)
    assert time.monotonic() - start < 10
    assert "did not answer 200 within 2 s" in written["checks"][0]["reason"]
    assert server.stops == 1


def test_ctrl_c_stops_the_server_and_still_writes_the_report(tmp_path):
    def interrupt():
        raise KeyboardInterrupt

    server = ScriptedServer(on_start=interrupt)
    report, written = smoke(server, tmp_path)
    assert written["interrupted"] is True and written["passed"] is False
    assert all(c["reason"] == "not run: interrupted" for c in written["checks"])
    assert server.stops == 1


def test_no_target_and_no_gpu_is_an_error_not_a_crash(tmp_path):
    server = ScriptedServer()
    server.gpu_info = lambda: {"error": "nvidia-smi: not found on this host"}
    report, written = smoke(server, tmp_path, target=None)
    assert "pass --target" in written["errors"][0] and not server.started
    assert written["passed"] is False


def test_wait_healthy_uses_the_clock_it_is_given():
    ticks = iter(range(0, 10_000, 100))
    check = wait_healthy(ScriptedServer(), Client("http://127.0.0.1:9"), 600, clock=lambda: next(ticks),
                         sleep=lambda s: None)
    assert not check.passed and "within 600 s" in check.reason


class AlwaysHealthy:
    def status(self, path, timeout_s=5.0):
        return 200


def test_wait_healthy_waits_for_the_warm_up_after_health_answers():
    ticks = iter(range(0, 10_000, 10))
    server = ScriptedServer(warm_after=3)
    check = wait_healthy(server, AlwaysHealthy(), 600, clock=lambda: next(ticks), sleep=lambda s: None)
    assert check.passed and server.warm_asks == 4
    assert check.details["health_answered_s"] < check.details["time_to_healthy_s"]


def test_wait_healthy_names_the_warm_up_when_it_never_finishes():
    ticks = iter(range(0, 10_000, 100))
    check = wait_healthy(ScriptedServer(warm_after=10**6), AlwaysHealthy(), 600, clock=lambda: next(ticks),
                         sleep=lambda s: None)
    assert not check.passed
    assert "/health answered after" in check.reason and "step decode-32" in check.reason


# --- the local runtime, end to end, against a fake `vllm serve` process ----------------------


@pytest.fixture
def fake_env(tmp_path, monkeypatch):
    site = make_fake_vllm_site(tmp_path / "site")
    files = {"FAKE_VLLM_ARGV_FILE": tmp_path / "argv.json", "FAKE_VLLM_CHILD_FILE": tmp_path / "child.pid",
             "FAKE_VLLM_MODEL_FILE": tmp_path / "model-files.json"}
    for key, path in files.items():
        monkeypatch.setenv(key, str(path))
    monkeypatch.setenv("FAKE_VLLM_ATTENTION", "FLASHMLA_SPARSE")
    monkeypatch.setenv("FAKE_VLLM_KERNELS", "deepgemm")
    return site, files


# The local runtime must work where neither the Docker SDK nor requests is installed.
WITHOUT_DOCKER_OR_REQUESTS = (
    "import runpy, sys; sys.modules.update(docker=None, requests=None); "
    "script = sys.argv.pop(1); sys.argv[0] = script; runpy.run_path(script, run_name='__main__')"
)


def run_local(tmp_path, site, *extra, timeout=120, **popen) -> subprocess.Popen:
    port = free_port()
    argv = [sys.executable, "-c", WITHOUT_DOCKER_OR_REQUESTS, str(SMOKE), "--runtime", "local", "--python", sys.executable,
            "--site-packages", str(site), "--target", "sm90", "--port", str(port),
            "--out", str(tmp_path / "out"), "--health-timeout", "60", *extra]
    # From another directory: the script must not depend on the cwd.
    return subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def child_pid(files) -> int:
    return int(Path(files["FAKE_VLLM_CHILD_FILE"]).read_text())


def wait_gone(pid: int, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return False


def test_local_runtime_runs_every_check_and_kills_the_process_group(tmp_path, fake_env):
    site, files = fake_env
    proc = run_local(tmp_path, site, "--", "--enforce-eager", "--gpu-memory-utilization", "0.15")
    out, err = proc.communicate(timeout=180)
    report = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    checks = {c["name"]: c for c in report["checks"]}
    # The fake has no overlay receipt and this Python no torch: verify and the self-test must run
    # the real tools and fail, nothing else.
    assert report["failed_checks"] == ["overlay_verify", "indexer_selftest"], err
    assert proc.returncode == 1
    assert "receipt" in checks["overlay_verify"]["reason"]
    assert "selftest exited 4" in checks["indexer_selftest"]["reason"], checks["indexer_selftest"]["reason"]
    assert "needs the environment that serves" in checks["indexer_selftest"]["reason"]
    assert report["python"]["executable"] == sys.executable and report["versions"]["vllm_installed"] == "0.24.0"
    argv = json.loads(Path(files["FAKE_VLLM_ARGV_FILE"]).read_text())
    model = report["model"]
    assert Path(model).name == "tiny-glm5" and not Path(model).exists(), "the scratch model must be removed"
    assert json.loads(Path(files["FAKE_VLLM_MODEL_FILE"]).read_text()) == sorted(tiny_model.model_files())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [LOG_NAME, REPORT_NAME]
    assert argv == ["serve", model, "--served-model-name", "glm-5", "--max-model-len", "8192",
                    "--kv-cache-dtype", "auto", "--load-format", "dummy", "--host", "127.0.0.1",
                    "--port", argv[argv.index("--port") + 1], "--enforce-eager", "--gpu-memory-utilization", "0.15"]
    assert "DSA sparse indexer kernels: deepgemm" in (tmp_path / "out" / LOG_NAME).read_text()
    assert "server| INFO Application startup complete." in err
    # The engine-core stand-in ignores SIGTERM: only a group SIGKILL ends it.
    assert wait_gone(child_pid(files)), "a child of the server outlived the smoke run"


def test_local_runtime_reports_an_early_exit(tmp_path, fake_env, monkeypatch):
    site, files = fake_env
    monkeypatch.setenv("FAKE_VLLM_EXIT_CODE", "3")
    proc = run_local(tmp_path, site, "--quiet")
    out, err = proc.communicate(timeout=120)
    report = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert proc.returncode == 1
    assert "exited with code 3" in report["checks"][0]["reason"]
    assert "No CUDA GPUs are available" in report["log_tail"]
    # --quiet silences the server's log as it comes, not the reason the run failed.
    assert "log tail:\n  | INFO fake vllm serve" in err, err
    assert "\n  | ERROR RuntimeError: No CUDA GPUs are available\n" in err, err
    assert wait_gone(child_pid(files))


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("sig, sigint_ignored_at_start", [
    (signal.SIGINT, False), (signal.SIGTERM, False),
    # As a job started with `&` by a non-interactive shell (a CI step) inherits it.
    (signal.SIGINT, True)])
def test_local_runtime_cleans_up_on_a_signal(tmp_path, fake_env, monkeypatch, sig, sigint_ignored_at_start):
    site, files = fake_env
    monkeypatch.setenv("FAKE_VLLM_START_DELAY", "120")  # never healthy while we wait
    proc = run_local(tmp_path, site, "--quiet", preexec_fn=_ignore_sigint if sigint_ignored_at_start else None)
    deadline = time.monotonic() + 60
    while not Path(files["FAKE_VLLM_CHILD_FILE"]).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err
    report = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert report["interrupted"] is True and report["passed"] is False
    assert wait_gone(child_pid(files))


def test_usage_errors_exit_2(tmp_path):
    site = make_fake_vllm_site(tmp_path / "site")
    for argv in (["--runtime", "docker"], ["--runtime", "local"], ["--runtime", "local", "--python", sys.executable,
                                                                      "--site-packages", str(site), "--target", "sm999"]):
        done = subprocess.run([sys.executable, str(SMOKE), *argv, "--out", str(tmp_path)], capture_output=True,
                              text=True, cwd=tmp_path)
        assert done.returncode == 2, (argv, done.stderr)
    assert "unknown target 'sm999'" in done.stderr


def test_an_environment_without_vllm_or_on_an_unpinned_release_exits_2(tmp_path):
    """The environment's vLLM picks the recipe base: none, or one the recipe does not pin, is bad input."""
    empty = tmp_path / "empty"
    empty.mkdir()
    unpinned = make_fake_vllm_site(tmp_path / "site", version="0.30.0")
    for site, expected in ((empty, "cannot report its vLLM version"), (unpinned, "serves vLLM 0.30.0")):
        done = subprocess.run([sys.executable, "-I", str(SMOKE), "--runtime", "local", "--python", sys.executable,
                               "--site-packages", str(site), "--out", str(tmp_path / "out")],
                              capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 2 and expected in done.stderr, done.stderr
    assert "this recipe pins: 0.24.0, 0.33.0" in done.stderr


def test_the_environments_vllm_picks_the_base_checked(tmp_path, fake_env, monkeypatch):
    """A site holding vLLM 0.33.0: the backends expected are 0.33.0's on sm_90 (FLASH_ATTN_MLA_SPARSE)
    and `verify` checks the site against 0.33.0's overlay, whatever the recipe's default base."""
    site = make_fake_vllm_site(tmp_path / "site-0.33.0", version="0.33.0")
    monkeypatch.setenv("FAKE_VLLM_ATTENTION", "FLASH_ATTN_MLA_SPARSE")
    proc = run_local(tmp_path, site, "--quiet")
    out, err = proc.communicate(timeout=180)
    report = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert report["versions"]["vllm_installed"] == "0.33.0"
    assert checks["backends"]["passed"], checks["backends"]["reason"]
    assert "verify --python" in checks["overlay_verify"]["reason"]
    assert "--vllm 0.33.0" in checks["overlay_verify"]["reason"], checks["overlay_verify"]["reason"]


def test_a_selftest_mismatch_fails_its_check_and_shows_the_table(tmp_path):
    """The image's indexer self-test is part of every smoke run: a mismatch fails the run,
    with the self-test's table in the reason and the report."""
    table = ("| case | kernel | shapes | max error | top-k agreement (min row) | time | result |\n"
             "| prefill-long | fp8_mqa_logits + top_k_per_row_prefill | 2048 rows | 2.3e-04 | 99.62% (6.49%) | 0.87 ms "
             "| MISMATCH: row 0 |\nSELFTEST: MISMATCH\n")
    with FakeServer(FakeVllm()) as fake:
        log = "\n".join(startup_log("FLASHMLA_SPARSE", "deepgemm"))
        report, written = smoke(ScriptedServer(fake.base_url, log=log, selftest=(1, table)), tmp_path)
    assert written["passed"] is False and written["failed_checks"] == ["indexer_selftest"]
    reason = {c["name"]: c for c in written["checks"]}["indexer_selftest"]["reason"]
    assert "selftest exited 1" in reason and "MISMATCH: row 0" in reason
