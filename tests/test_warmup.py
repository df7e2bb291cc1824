"""The warm-up (dsa_image/runtime/warmup.py) and the warm-start measurement's pure parts, on the CPU,
against the fake OpenAI-compatible vLLM of tests/test_bench.py: what is sent, the readiness
marker and its identity check, and the supervisor (a real child process, signals, exit codes)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

import test_bench as fakes
from dsa_image.runtime import spec_decode_metrics, warmup
from dsa_image.validation import warmstart

REPO = Path(__file__).resolve().parent.parent


# -- where the server listens -------------------------------------------------------------------


@pytest.mark.parametrize("argv, url", [
    (["vllm", "serve", "m"], "http://127.0.0.1:8000"),
    (["vllm", "serve", "m", "--port", "9000"], "http://127.0.0.1:9000"),
    (["vllm", "serve", "m", "--port=9001", "--host", "0.0.0.0"], "http://127.0.0.1:9001"),
    (["vllm", "serve", "m", "--host", "::", "--port", "1"], "http://[::1]:1"),
    (["vllm", "serve", "m", "--host=10.0.0.5", "--ssl-certfile", "c.pem"], "https://10.0.0.5:8000"),
    (["vllm", "serve", "m", "--port", "1", "--port", "2"], "http://127.0.0.1:2"),
])
def test_serve_endpoint_reads_the_flags(argv, url):
    assert warmup.serve_endpoint(argv, {}).base_url == url


def test_a_unix_socket_server_is_reached_through_its_socket(tmp_path):
    import socketserver
    import threading

    class UnixHttpd(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

    state = fakes.FakeVllm()
    path = str(tmp_path / "vllm.sock")
    endpoint = warmup.serve_endpoint(["vllm", "serve", "m", "--uds", path, "--port", "1"], {})
    assert endpoint.uds == path and endpoint.base_url == f"http+unix://{path}"
    httpd = UnixHttpd(path, fakes.make_handler(state))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        assert warmup.is_healthy(endpoint)
        warmup.warm(endpoint, warmup.Settings(prefill=(), concurrency=(2,)), lambda line: None)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert len(state.completions) == 3


def test_api_key_from_the_flag_or_vllms_variable():
    assert warmup.serve_endpoint(["--api-key", "k1"], {"VLLM_API_KEY": "k2"}).api_key == "k1"
    assert warmup.serve_endpoint([], {"VLLM_API_KEY": "k2"}).api_key == "k2"
    assert warmup.serve_endpoint([], {}).api_key is None


# -- what is sent -------------------------------------------------------------------------------


def test_plan_covers_prefill_over_topk_decode_batches_and_a_mixed_batch():
    steps = {s.name: s for s in warmup.plan_steps(8192)}
    assert list(steps) == ["prefill-2049", "prefill-2050", "prefill-2052", "prefill-2056", "prefill-4096",
                           "decode-c1-sampled", "decode-c1", "decode-c8", "decode-c32", "mixed-prefill-2049+decode-c7"]
    assert all(r.prompt_len > 2048 for name in steps if name.startswith("prefill") for r in steps[name].requests)
    assert [len(steps[f"decode-c{c}"].requests) for c in (1, 8, 32)] == [1, 8, 32]
    assert steps["decode-c1-sampled"].requests[0].sampling == warmup.SAMPLED
    assert not steps["decode-c1"].requests[0].sampling
    mixed = steps["mixed-prefill-2049+decode-c7"].requests
    assert [r.prompt_len for r in mixed][:2] == [2049, 61] and len(mixed) == 8


def test_prefill_lengths_cover_every_power_of_two_pattern_of_a_token_count():
    # Triton specialises on divisibility by 16; counts reach kernels times 1, 2, 4 or 8.
    def pattern(n):
        return tuple((n * k) % 16 == 0 for k in (1, 2, 4, 8))

    covered = {pattern(n) for n in warmup.DEFAULT_PREFILL}
    assert all(pattern(n) in covered for n in range(2049, 70000))


def test_decode_batches_shrink_through_every_size():
    # Each request ends one step after the previous one: batch sizes c, c-1, ..., 1 all run.
    batch = warmup.decode_batch(32, sampled=True)
    assert sorted(r.max_tokens for r in batch) == list(range(warmup.DECODE_TOKENS, warmup.DECODE_TOKENS + 32))


def test_plan_fits_max_model_len_and_adds_a_long_prefill_when_it_allows():
    assert [s.name for s in warmup.plan_steps(3000) if "prefill" in s.name] == [
        "prefill-2049", "prefill-2050", "prefill-2052", "prefill-2056", "mixed-prefill-2049+decode-c7"]
    assert "long-prefill-32768" in [s.name for s in warmup.plan_steps(65536)]
    assert "long-prefill-10000" in [s.name for s in warmup.plan_steps(20000)]
    assert not [s for s in warmup.plan_steps(None) if s.name.startswith("long")]
    assert [s.name for s in warmup.plan_steps(8192, prefill=(), concurrency=(4,))] == ["decode-c1-sampled", "decode-c4"]


def test_every_planned_request_fits_the_served_max_model_len():
    """Issue #24 item 16: the decode steps asked for up to 92 + 47 tokens whatever max_model_len
    was; vLLM cut max_tokens to what was left, the answer came back short and the container
    stayed unhealthy for good."""
    for max_model_len in [*range(2, 400), 2052, 2053, 2060, 2065, 3000, 8192, 16384, 20000, 65536]:
        for step in warmup.plan_steps(max_model_len):
            for r in step.requests:
                assert r.prompt_len >= 1 and r.max_tokens >= 1, (max_model_len, step.name)
                assert r.prompt_len + r.max_tokens <= max_model_len, (max_model_len, step.name, r)
    assert [s.name for s in warmup.plan_steps(2056)][:3] == ["prefill-2049", "prefill-2050", "prefill-2052"]
    with pytest.raises(warmup.WarmupError, match="max_model_len 1 leaves no room"):
        warmup.plan_steps(1)


def test_a_server_with_a_short_max_model_len_is_warmed_within_it():
    state = fakes.FakeVllm(max_model_len=100, enforce_max_model_len=True)
    with fakes.FakeServer(state) as server:
        report = warmup.warm(warmup.Endpoint.from_url(f"http://127.0.0.1:{server.port}"), log=lambda line: None)
    assert list(report["steps"]) == ["decode-c1-sampled", "decode-c1", "decode-c8", "decode-c32"]
    assert max(len(r["prompt"]) + r["max_tokens"] for r in state.completions) == 100


def test_settings_from_the_environment():
    assert warmup.Settings.from_env({}) == warmup.Settings()
    assert warmup.Settings.from_env({"DSA_IMAGE_WARMUP": "1", "DSA_IMAGE_WARMUP_PREFILL": ""}) == warmup.Settings()
    s = warmup.Settings.from_env({"DSA_IMAGE_WARMUP": "0", "DSA_IMAGE_WARMUP_PREFILL": "3000, 5000",
                                  "DSA_IMAGE_WARMUP_CONCURRENCY": "2", "DSA_IMAGE_WARMUP_TIMEOUT_S": "60"})
    assert s == warmup.Settings(enabled=False, prefill=(3000, 5000), concurrency=(2,), timeout_s=60.0)
    assert [warmup.Settings.from_env({"DSA_IMAGE_WARMUP": v}).enabled for v in ("true", "False", "1")] == [True, False, True]


@pytest.mark.parametrize("name, value", [
    ("DSA_IMAGE_WARMUP", "off"), ("DSA_IMAGE_WARMUP", "O"),  # a typo must not quietly serve cold
    ("DSA_IMAGE_WARMUP_PREFILL", "3000;5000"), ("DSA_IMAGE_WARMUP_PREFILL", "-1"), ("DSA_IMAGE_WARMUP_PREFILL", ","),
    ("DSA_IMAGE_WARMUP_CONCURRENCY", "0"),
    ("DSA_IMAGE_WARMUP_TIMEOUT_S", "0"), ("DSA_IMAGE_WARMUP_TIMEOUT_S", "nan"), ("DSA_IMAGE_WARMUP_TIMEOUT_S", "1h"),
    # issue #24 item 17: accepted, then the socket refused the timeout and the warm-up thread died
    ("DSA_IMAGE_WARMUP_TIMEOUT_S", "inf"), ("DSA_IMAGE_WARMUP_TIMEOUT_S", "1e10"), ("DSA_IMAGE_WARMUP_TIMEOUT_S", "-inf"),
    ("DSA_IMAGE_WARMUP_TIMEOUT_S", "604801"),
])
def test_settings_refuse_what_they_cannot_read_naming_the_variable_and_what_is_expected(name, value):
    with pytest.raises(ValueError, match=f"^{name}={value!r}: expected"):
        warmup.Settings.from_env({name: value})


def test_warm_sends_each_step_with_its_batch_in_flight_together():
    state = fakes.FakeVllm(ttft_s=0.5, max_model_len=8192)  # long enough for 32 clients to overlap
    with fakes.FakeServer(state) as server:
        report = warmup.warm(warmup.Endpoint.from_url(f"http://127.0.0.1:{server.port}"), log=lambda line: None)
    assert list(report["steps"]) == [s.name for s in warmup.plan_steps(8192)]
    assert report["model"] == "glm-5" and report["max_model_len"] == 8192
    assert state.max_active == 32  # the c=32 batch reached the server at once
    prompts = [tuple(r["prompt"]) for r in state.completions]
    assert len(prompts) == len(set(prompts)) == 5 + 1 + 1 + 8 + 32 + 8  # none repeats: no prefix-cache hit
    assert {len(p) for p in prompts} >= set(warmup.DEFAULT_PREFILL)
    assert all(r["ignore_eos"] and r["model"] == "glm-5" for r in state.completions)
    sampled = [r for r in state.completions if r["temperature"] > 0]
    assert sampled and all(r["top_p"] == 0.9 and r["logprobs"] == 1 for r in sampled)


def test_warm_sends_the_api_key():
    seen = []
    with fakes.FakeServer(fakes.FakeVllm()) as server:
        handler = server.httpd.RequestHandlerClass
        get, post = handler.do_GET, handler.do_POST
        handler.do_GET = lambda self: seen.append((self.path, self.headers.get("Authorization"))) or get(self)
        handler.do_POST = lambda self: seen.append((self.path, self.headers.get("Authorization"))) or post(self)
        warmup.warm(warmup.Endpoint.from_url(f"http://127.0.0.1:{server.port}", "sekret"),
                    warmup.Settings(prefill=(), concurrency=(1,)), lambda line: None)
    # /v1/models, /metrics (no spec-decode counters there: no second read), then decode-c1-sampled
    # and decode-c1
    assert seen == [("/v1/models", "Bearer sekret"), ("/metrics", "Bearer sekret")] + [
        ("/v1/completions", "Bearer sekret")] * 2


@pytest.mark.parametrize("fault, message", [("http_500", "HTTP 500"), ("short", "prefill-2049: 3 tokens for max_tokens=4")])
def test_warm_fails_on_a_bad_answer(fault, message):
    with fakes.FakeServer(fakes.FakeVllm(faults={fault})) as server:
        with pytest.raises(warmup.WarmupError, match=message):
            warmup.warm(warmup.Endpoint.from_url(f"http://127.0.0.1:{server.port}"), log=lambda line: None)


def test_a_busy_server_is_sent_the_request_again(monkeypatch):
    """vLLM 0.33.0 refuses a request over its admission limits with HTTP 503, "try again later"
    (QueueOverflowError; 0.24.0 has no such answer): the c=32 step under --max-num-queued-reqs
    must wait, not fail the warm-up and leave the container unhealthy for good."""
    monkeypatch.setattr(warmup, "RETRY_PAUSE_S", 0.01)
    state = fakes.FakeVllm(busy=5)
    lines = []
    with fakes.FakeServer(state) as server:
        report = warmup.warm(warmup.Endpoint.from_url(f"http://127.0.0.1:{server.port}"),
                             warmup.Settings(prefill=(), concurrency=(4,)), lines.append)
    assert state.refused == 5 and len(state.completions) == 1 + 4  # each request answered once in the end
    assert list(report["steps"]) == ["decode-c1-sampled", "decode-c4"]


def test_a_server_busy_until_the_budget_ends_fails_saying_so(monkeypatch):
    monkeypatch.setattr(warmup, "RETRY_PAUSE_S", 0.05)
    with fakes.FakeServer(fakes.FakeVllm(busy=10**6)) as server:
        with pytest.raises(warmup.WarmupError, match=r"decode-c1-sampled: HTTP 503 \(busy\) \d+ time\(s\) until out "
                                                     r"of time .*currently busy"):
            warmup.warm(warmup.Endpoint.from_url(f"http://127.0.0.1:{server.port}"),
                        warmup.Settings(prefill=(), concurrency=(1,), timeout_s=0.5), lambda line: None)


def test_other_errors_are_not_sent_again():
    state = fakes.FakeVllm(faults={"http_500"})
    with fakes.FakeServer(state) as server:
        with pytest.raises(warmup.WarmupError, match="HTTP 500"):
            warmup.warm(warmup.Endpoint.from_url(f"http://127.0.0.1:{server.port}"),
                        warmup.Settings(prefill=(), concurrency=(1,)), lambda line: None)
    assert len(state.completions) == 1


def test_the_report_says_what_the_mtp_draft_path_did(monkeypatch):
    """An MTP server has vLLM's spec-decode counters on /metrics: the warm-up records the drafts
    its requests made (the README's "through MTP's draft path when configured", checked)."""
    monkeypatch.setattr(warmup, "SPEC_SETTLE_PAUSE_S", 0.01)
    state, lines = fakes.FakeVllm(spec=True), []
    with fakes.FakeServer(state) as server:
        report = warmup.warm(warmup.Endpoint.from_url(f"http://127.0.0.1:{server.port}"),
                             warmup.Settings(prefill=(2500,), concurrency=(2,)), lines.append)
    c = state.counters
    assert report["spec_decode"] == {"drafts": c["drafts"], "draft_tokens": c["draft_tokens"],
                                     "accepted_tokens": c["accepted"]}
    assert report["spec_decode"]["drafts"] > 0
    assert any("speculative decoding (MTP) ran in the warm-up" in line for line in lines)


def test_no_drafts_on_an_mtp_server_is_a_warning_and_none_without_mtp(monkeypatch):
    monkeypatch.setattr(warmup, "SPEC_SETTLE_PAUSE_S", 0.01)
    for spec, expected in (("idle", {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}), (False, None)):
        lines = []
        with fakes.FakeServer(fakes.FakeVllm(spec=spec)) as server:
            report = warmup.warm(warmup.Endpoint.from_url(f"http://127.0.0.1:{server.port}"),
                                 warmup.Settings(prefill=(), concurrency=(1,)), lines.append)
        assert report["spec_decode"] == expected
        assert any("WARNING" in line and "no drafts" in line for line in lines) == (spec == "idle")


def test_spec_counters_of_a_real_vllm_0_33_exposition():
    """Counter lines laid out as prometheus_client writes vLLM 0.33.0's SpecDecodingProm (labels
    model_name and engine, the per-position one with position; `_total` and `_created` samples;
    vllm/v1/spec_decode/metrics.py, vllm/v1/metrics/loggers.py); the values are made up."""
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="glm-5"} 12.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="glm-5"} 1.7646e+09',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="glm-5"} 36.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="glm-5"} 9.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="glm-5",position="0"} 6.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="glm-5",position="1"} 2.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="glm-5",position="2"} 1.0'])
    before = {"drafts": 2.0, "draft_tokens": 6.0, "accepted_tokens": 1.0, "accepted_per_position": [1.0, 0.0, 0.0]}
    assert warmup.spec_decode_report(before, spec_decode_metrics.parse_spec_counters(text)) == {
        "drafts": 10.0, "draft_tokens": 30.0, "accepted_tokens": 8.0}


def test_warm_fails_when_out_of_time():
    with fakes.FakeServer(fakes.FakeVllm(ttft_s=0.3)) as server:
        with pytest.raises(warmup.WarmupError, match="out of time"):
            warmup.warm(warmup.Endpoint.from_url(f"http://127.0.0.1:{server.port}"), warmup.Settings(timeout_s=0.5),
                        lambda line: None)


def test_wait_healthy_polls_until_200_and_gives_up_when_the_server_is_gone():
    with fakes.FakeServer(fakes.FakeVllm(unhealthy_polls=3)) as server:
        endpoint = warmup.Endpoint.from_url(f"http://127.0.0.1:{server.port}")
        assert warmup.wait_healthy(endpoint, lambda: True, time.monotonic() + 10, poll_s=0.01)
        assert not warmup.wait_healthy(endpoint, lambda: False, time.monotonic() + 10)


# -- the marker ---------------------------------------------------------------------------------


def fake_proc(root: Path, pid: int, starttime: int, environ: dict[str, str] | None = None) -> Path:
    (root / str(pid)).mkdir(parents=True, exist_ok=True)
    # The command name may hold spaces and parentheses; field 22 is the start time.
    fields = ["S", *["0"] * 18, str(starttime), "0"]
    (root / str(pid) / "stat").write_text(f"{pid} (vllm serve (x)) " + " ".join(fields) + "\n")
    (root / str(pid) / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in (environ or {}).items()))
    (root / "sys" / "kernel" / "random").mkdir(parents=True, exist_ok=True)
    (root / "sys" / "kernel" / "random" / "boot_id").write_text("boot-1\n")
    return root


def test_process_identity_reads_the_start_time_after_the_command_name(tmp_path):
    proc = fake_proc(tmp_path, 42, 123456)
    assert warmup.process_identity(42, proc) == {"pid": 42, "starttime": 123456, "boot_id": "boot-1"}
    mine = warmup.process_identity(os.getpid())  # the real /proc
    assert mine["pid"] == os.getpid() and mine["starttime"] > 0


def test_marker_counts_only_for_the_server_it_names(tmp_path):
    proc = fake_proc(tmp_path / "proc", 42, 1000)
    marker = tmp_path / "warm.json"
    assert "no readiness marker" in warmup.marker_problem(marker, 42, proc)
    warmup.write_marker(marker, 42, {"seconds": 1.5}, proc)
    assert warmup.marker_problem(marker, 42, proc) is None
    assert json.loads(marker.read_text())["warmup"] == {"seconds": 1.5}
    fake_proc(tmp_path / "proc", 42, 2000)  # pid 42 again, a later process: a restarted server
    assert "another server's (starttime differ)" in warmup.marker_problem(marker, 42, proc)
    assert "server pid 7" in warmup.marker_problem(marker, 7, proc)
    marker.write_text("{half")
    assert "unreadable" in warmup.marker_problem(marker, 42, proc)
    warmup.clear_marker(marker)
    assert not marker.exists()
    warmup.clear_marker(marker)  # nothing there: no error
    assert [p.name for p in tmp_path.iterdir()] == ["proc"]  # no temporary file left behind


def test_a_failure_marker_names_the_failure_for_its_server_only(tmp_path):
    proc = fake_proc(tmp_path / "proc", 42, 1000)
    marker = tmp_path / "warm.json"
    warmup.write_marker(marker, 42, {}, proc, failed="out of time (1800 s) before step decode-c32")
    problem = warmup.marker_problem(marker, 42, proc)
    assert problem.startswith("the warm-up FAILED: out of time (1800 s) before step decode-c32;")
    assert "DSA_IMAGE_WARMUP=0" in problem
    fake_proc(tmp_path / "proc", 42, 2000)  # a later server: the failure was another's
    assert "another server's" in warmup.marker_problem(marker, 42, proc)


def test_a_fifo_in_place_of_the_marker_cannot_hang_the_check(tmp_path):
    proc = fake_proc(tmp_path / "proc", 42, 1000)
    marker = tmp_path / "warm.json"
    os.mkfifo(marker)
    assert "unreadable" in warmup.marker_problem(marker, 42, proc)


def test_only_a_supervised_server_needs_the_marker(tmp_path):
    marker = tmp_path / "warm.json"
    proc = fake_proc(tmp_path / "proc", 42, 1000, {"PATH": "/bin", warmup.MARKER_ENV: str(marker)})
    fake_proc(proc, 43, 1000, {"PATH": "/bin"})
    assert warmup.required_marker(42, proc) == marker
    assert "no readiness marker" in warmup.warm_problem(42, proc)
    warmup.write_marker(marker, 42, {}, proc)
    assert warmup.warm_problem(42, proc) is None
    assert warmup.warm_problem(43, proc) is None  # started without the supervisor: /health decides
    assert "cannot read" in warmup.warm_problem(44, proc)


# -- the supervisor, as a real process ----------------------------------------------------------


def start_supervisor(tmp_path: Path, marker: Path, sigint_ignored: bool = False,
                     **options) -> tuple[subprocess.Popen, int]:
    site = fakes.fake_vllm_site(tmp_path / "site", **options)
    port = fakes.free_ports(1)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": f"{REPO}:{site}",
           "DSA_IMAGE_WARMUP_PREFILL": "2500", "DSA_IMAGE_WARMUP_CONCURRENCY": "1,4"}
    server = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "m", "--port", str(port)]
    proc = subprocess.Popen([sys.executable, "-m", "dsa_image.runtime.warmup", "supervise", "--marker", str(marker), "--", *server],
                            env=env, cwd=str(tmp_path), stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ignore_sigint if sigint_ignored else None)
    return proc, port


def _ignore_sigint():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def wait_for(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def children(supervisor: subprocess.Popen) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{supervisor.pid}/task/{supervisor.pid}/children").read_text().split()]
    except OSError:
        return []


def child_pid(supervisor: subprocess.Popen) -> int:
    return children(supervisor)[0]


def kill_all(supervisor: subprocess.Popen) -> None:
    """After a failed assertion: the child has its own process group and would outlive us."""
    for pid in children(supervisor):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    supervisor.kill()
    supervisor.wait(30)


def test_supervisor_marks_the_warm_server_and_forwards_sigterm(tmp_path):
    marker = tmp_path / "warm.json"
    term = tmp_path / "term"
    supervisor, port = start_supervisor(tmp_path, marker, term_file=str(term), term_exit=3,
                                        fake={"ttft_s": 0.01, "unhealthy_polls": 2})
    try:
        assert wait_for(marker.exists), supervisor.stderr.read() if supervisor.poll() is not None else "no marker"
        server = child_pid(supervisor)
        doc = json.loads(marker.read_text())
        assert doc["pid"] == server and "prefill-2500" in doc["warmup"]["steps"]
        assert warmup.warm_problem(server) is None
        check = subprocess.run([sys.executable, "-m", "dsa_image.runtime.warmup", "check", "--pid", str(server)],
                               env={"PYTHONPATH": str(REPO)}, capture_output=True, text=True)
        assert check.returncode == 0 and check.stdout.strip() == "ready"
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(30) == 3  # the child's status is the supervisor's
    finally:
        kill_all(supervisor)
    assert term.read_text() == str(server)  # vLLM got the SIGTERM
    assert not marker.exists()
    assert "dsa-image warmup: done" in supervisor.stderr.read()


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["plain", "sigint-ignored-at-start"])
def test_supervisor_stays_unhealthy_when_the_warmup_fails_and_says_why(tmp_path, sigint_ignored):
    """Decided: a failed warm-up keeps vLLM running (its log and state can be looked at; a restart
    loop would reload the model and lose them), unhealthy, and the health check names the failure.
    The SIGINT it forwards stops the server even when the supervisor started with SIGINT ignored
    (a background job of a non-interactive shell, as a CI step's)."""
    marker = tmp_path / "warm.json"
    supervisor, port = start_supervisor(tmp_path, marker, sigint_ignored, fake={"faults": ["http_500"]})
    try:
        assert wait_for(marker.exists)
        server = child_pid(supervisor)
        assert supervisor.poll() is None
        assert "the warm-up FAILED: step prefill-2500: HTTP 500" in warmup.warm_problem(server)
        supervisor.send_signal(signal.SIGINT)  # forwarded: the fake dies of it, as Python does
        assert supervisor.wait(30) == 128 + signal.SIGINT
    finally:
        kill_all(supervisor)
    err = supervisor.stderr.read()
    assert "FAILED: step prefill-2500: HTTP 500" in err and "DSA_IMAGE_WARMUP=0" in err
    assert not marker.exists()  # the supervisor removes it when the server is gone


def test_a_supervised_server_with_a_short_max_model_len_becomes_warm(tmp_path):
    marker = tmp_path / "warm.json"
    supervisor, _ = start_supervisor(tmp_path, marker, fake={"max_model_len": 64, "enforce_max_model_len": True})
    try:
        assert wait_for(marker.exists)
        doc = json.loads(marker.read_text())
    finally:
        kill_all(supervisor)
    assert "failed" not in doc, doc["failed"]
    assert list(doc["warmup"]["steps"]) == ["decode-c1-sampled", "decode-c1", "decode-c4"]


# tests/fake_vllm.py in a process of its own, as `vllm serve m`; what it answers out of the
# ordinary is scripted_env's answers (path -> {body, delay_s, trickle_s}, fake_vllm.FakeVllm's).
def scripted_server_argv(tmp_path: Path, port: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve().parent / "fake_vllm.py"), "serve", "m", "--port", str(port)]


def scripted_env(answers: dict) -> dict:
    return {"FAKE_VLLM_OPTIONS": json.dumps({"answers": answers})}


@pytest.mark.parametrize("path, body, reason", [
    ("/v1/models", "[]", "GET /v1/models: not vLLM's answer"),
    ("/v1/models", '{"data": []}', "GET /v1/models: not vLLM's answer"),
    ("/v1/models", '{"data": [{"id": "m", "max_model_len": "8192"}]}', "GET /v1/models: not vLLM's answer"),
    ("/v1/completions", "[]", "step prefill-3000: not vLLM's answer (no usage.completion_tokens): b'[]'"),
    ("/v1/completions", '{"usage": null}', "step prefill-3000: not vLLM's answer (no usage.completion_tokens)"),
    ("/v1/completions", "<html>busy</html>", "step prefill-3000: not vLLM's answer"),
])
def test_a_malformed_answer_fails_the_warmup_with_a_marker_saying_why(tmp_path, path, body, reason):
    """Issue #24 item 17: these answers raised TypeError / IndexError / AttributeError in the
    warm-up thread, which died without a marker: the health check said "warming up" for good."""
    marker, port = tmp_path / "warm.json", fakes.free_ports(1)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), "DSA_IMAGE_WARMUP_PREFILL": "3000",
           "DSA_IMAGE_WARMUP_CONCURRENCY": "1", **scripted_env({path: {"body": body}})}
    supervisor = subprocess.Popen([sys.executable, "-m", "dsa_image.runtime.warmup", "supervise", "--marker", str(marker), "--",
                                   *scripted_server_argv(tmp_path, port)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(marker.exists, 30), "no marker: the warm-up ended without one"
        doc = json.loads(marker.read_text())
        assert supervisor.poll() is None  # the server keeps running, unhealthy
    finally:
        kill_all(supervisor)
    assert doc["failed"].startswith(reason), doc["failed"]
    assert "FAILED: " + reason in supervisor.stderr.read()


def test_a_fault_of_the_warmup_itself_still_leaves_a_marker(tmp_path, monkeypatch):
    """The last line of defence: whatever raises in the warm-up thread, the marker says what."""
    marker, port = tmp_path / "warm.json", fakes.free_ports(1)
    monkeypatch.setattr(warmup, "plan_steps", lambda *a: {}["a bug"])
    server = subprocess.Popen(scripted_server_argv(tmp_path, port))
    try:
        exited = __import__("threading").Event()
        argv = ["vllm", "serve", "m", "--port", str(port)]
        assert not warmup.warm_and_mark(server, exited, argv, {}, marker, warmup.Settings(), 30)
        assert json.loads(marker.read_text())["failed"] == "KeyError: 'a bug'"
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("value", ["inf", "1e10"])
def test_the_supervisor_refuses_a_budget_a_socket_cannot_take_before_starting_the_server(value):
    done = subprocess.run([sys.executable, "-m", "dsa_image.runtime.warmup", "supervise", "--", "sleep", "60"],
                          env={"PYTHONPATH": str(REPO), "DSA_IMAGE_WARMUP_TIMEOUT_S": value},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and f"DSA_IMAGE_WARMUP_TIMEOUT_S={value!r}: expected" in done.stderr
    assert "at most 604800" in done.stderr


@pytest.mark.parametrize("answers, during", [
    ({"/v1/completions": {"trickle_s": 0.25}}, "step decode-c1-sampled"),
    ({"/v1/models": {"delay_s": 3}}, "GET /v1/models"),
])
def test_the_budget_is_one_deadline_for_the_whole_warmup(tmp_path, answers, during):
    """Issue #24 item 18: 2 s took 19 s. A socket timeout bounds each read, not a request: a
    server sending a byte every 0.25 s (or /v1/models, which had 30 s of its own) ran past the
    budget. Measured: the warm-up ends within its budget and says where it was."""
    port = fakes.free_ports(1)
    server = subprocess.Popen(scripted_server_argv(tmp_path, port), env={**os.environ, **scripted_env(answers)})
    try:
        endpoint = warmup.Endpoint.from_url(f"http://127.0.0.1:{port}")
        assert wait_for(lambda: warmup.is_healthy(endpoint))
        start = time.monotonic()
        with pytest.raises(warmup.WarmupError, match=f"out of time \\(1 s, DSA_IMAGE_WARMUP_TIMEOUT_S\\) during {during}"):
            warmup.warm(endpoint, warmup.Settings(prefill=(), concurrency=(1,), timeout_s=1.0), lambda line: None)
        elapsed = time.monotonic() - start
    finally:
        server.kill()
        server.wait()
    assert 1.0 <= elapsed < 2.0, elapsed  # unbounded, it took 9 s (36 bytes at 0.25 s) and 3 s


def test_supervisor_refuses_a_setting_it_cannot_read_before_starting_the_server(tmp_path):
    done = subprocess.run([sys.executable, "-m", "dsa_image.runtime.warmup", "supervise", "--", "sleep", "60"],
                          env={"PYTHONPATH": str(REPO), "DSA_IMAGE_WARMUP_CONCURRENCY": "8,many"},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "DSA_IMAGE_WARMUP_CONCURRENCY='8,many': expected" in done.stderr


def test_supervisor_exits_with_the_servers_status(tmp_path):
    supervisor, _ = start_supervisor(tmp_path, tmp_path / "warm.json", crash_exit=7)
    assert supervisor.wait(30) == 7


def test_supervisor_reports_a_server_killed_by_a_signal_as_128_plus_n(tmp_path):
    marker = tmp_path / "warm.json"
    supervisor, _ = start_supervisor(tmp_path, marker, fake={})
    try:
        assert wait_for(marker.exists)
        os.kill(child_pid(supervisor), signal.SIGKILL)
        assert supervisor.wait(30) == 128 + signal.SIGKILL
    finally:
        kill_all(supervisor)


def test_supervisor_without_a_server_command_is_a_usage_error():
    done = subprocess.run([sys.executable, "-m", "dsa_image.runtime.warmup", "supervise", "--"],
                          env={"PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert done.returncode == 2 and "needs the server's command" in done.stderr


# -- the image: one cache volume ----------------------------------------------------------------


def runtime_stage() -> str:
    from test_image_tree import stage
    return stage("runtime")


def runtime_env() -> dict[str, str]:
    """KEY=VALUE of the runtime stage's ENV instructions (continuation lines joined)."""
    text = runtime_stage().replace("\\\n", " ")
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(part.split("=", 1) for part in line[4:].split())
    return env


def test_every_compile_cache_of_the_image_lies_under_the_one_directory_a_volume_holds():
    """The image's ENV is compile_caches.cache_env of its HOME: the validation's servers get the
    same layout under their own HOMEs, so what it measures of caches is what the image does."""
    from dsa_image.core.compile_caches import cache_env
    from dsa_image.runtime.entrypoint import CACHE_DIR

    env = runtime_env()
    assert env["HOME"] + "/.cache" == env["XDG_CACHE_HOME"] == CACHE_DIR
    assert f"--home-dir {env['HOME']} " in runtime_stage() and "\nUSER vllm\n" in runtime_stage()
    assert f"install -d -o vllm -g vllm {CACHE_DIR} " in runtime_stage()  # a new volume copies its owner
    expected = cache_env(env["HOME"])
    assert {name: env.get(name) for name in expected} == expected


def test_the_readmes_run_commands_keep_the_caches_in_a_named_volume():
    from dsa_image.runtime.entrypoint import CACHE_DIR

    readme = (REPO / "README.md").read_text()
    runs = [line for line in readme.splitlines() if line.startswith("    ") and "docker run" in line and "--gpus" in line]
    assert runs and all(f"-v dsa-image-cache:{CACHE_DIR}" in line for line in runs), runs
    assert "DSA_IMAGE_WARMUP=0" in readme


# -- the warm-start measurement -----------------------------------------------------------------


def test_log_slices_split_compilations_by_offset(tmp_path):
    log = tmp_path / "server.log"
    before = "INFO start\nINFO Running NVCC command: nvcc -o x\n"
    during = ("WARNING Triton kernel JIT compilation during inference: fused_moe_kernel (key=a).\n"
              "WARNING Triton kernel JIT compilation during inference: fused_moe_kernel (key=b).\n"
              "WARNING Triton kernel JIT compilation during inference: _compute_slot_mapping_kernel. This causes\n")
    log.write_text(before + during)
    server = {"log": str(log)}
    cut = len(before.encode())
    assert warmstart.log_slice(server, 0, cut) == {"triton_jit": {}, "deepgemm_nvcc_runs": 1}
    assert warmstart.log_slice(server, cut) == {
        "triton_jit": {"_compute_slot_mapping_kernel": 1, "fused_moe_kernel": 2}, "deepgemm_nvcc_runs": 0}


def test_cache_sizes_list_what_a_start_filled(tmp_path):
    (tmp_path / "vllm" / "torch_compile_cache").mkdir(parents=True)
    (tmp_path / "vllm" / "torch_compile_cache" / "a.bin").write_bytes(b"x" * 2**20)
    (tmp_path / "deep_gemm").mkdir()
    assert warmstart.cache_sizes(tmp_path) == {"deep_gemm": 0.0, "vllm": 1.0, "vllm/torch_compile_cache": 1.0}


def test_warmstart_attributes_compilations_to_the_first_request_or_the_warmup(tmp_path):
    from dsa_image.build.tiny_model import write_model

    write_model(tmp_path / "model")
    site = fakes.fake_vllm_site(tmp_path / "site", fake={"ttft_s": 0.002, "jit_line_on_first": True})
    code = warmstart.main(["--model", str(tmp_path / "model"), "--overlay-site", str(site), "--out", str(tmp_path / "out"),
                           "--steps", "cold,warm-warmup", "--port-base", str(fakes.free_ports(1)), "--timeout", "60"])
    doc = json.loads((tmp_path / "out" / "warmstart.json").read_text())
    assert code == 0, doc
    cold, warm = doc["steps"]["cold"]["sides"]["overlay"], doc["steps"]["warm-warmup"]["sides"]["overlay"]
    assert cold["compiled"]["during_first_request"]["triton_jit"] == {"fake_kernel": 1}
    assert warm["compiled"]["during_warmup"]["triton_jit"] == {"fake_kernel": 1}
    assert warm["compiled"]["during_first_request"]["triton_jit"] == {}
    assert "warmup" not in cold and warm["warmup"]["seconds"] > 0
    assert warm["ready_after_s"] >= warm["healthy_after_s"]
    assert cold["first_over_warm"] == pytest.approx(cold["first"]["latency_s"] / cold["warm_latency_s"], abs=0.01)
    assert isinstance(cold["goal_met"], bool) and len(cold["warm"]) == warmstart.WARM_REQUESTS
    # The new-length probe comes after the judged requests; the fake compiles only on the first.
    probe = cold["new_length"]
    assert probe["tokens"] == warmstart.NEW_LENGTH_TOKENS != warmstart.FIRST_PROMPT_TOKENS
    assert len(probe["warm"]) == warmstart.NEW_LENGTH_WARM and probe["compiled"] == []
    assert probe["warm_latency_s"] == statistics.median(w["latency_s"] for w in probe["warm"])
    assert probe["first_over_warm"] == round(probe["first"]["latency_s"] / probe["warm_latency_s"], 2)
    assert "new length 3500: first x" in "\n".join(warmstart.summary_lines(doc))
    assert doc["steps"]["cold"]["empty_caches_at_start"] and not doc["steps"]["warm-warmup"]["empty_caches_at_start"]
    # The cold HOME is the image's: no compile cache, the model info the image ships.
    shipped = sorted(p.name for p in (tmp_path / "out" / "work" / "home-overlay" / ".cache" / "vllm" / "modelinfos").iterdir())
    assert shipped == ["vllm-models-fake-DeepseekV32MTPModel.json", "vllm-models-fake-GlmMoeDsaForCausalLM.json"]


def _warm_start(tmp_path, *extra: str) -> tuple[int, dict]:
    from dsa_image.build.tiny_model import write_model

    write_model(tmp_path / "model")
    site = fakes.fake_vllm_site(tmp_path / "site", fake={"ttft_s": 0.05, "jit_line_on_first": True})
    code = warmstart.main(["--model", str(tmp_path / "model"), "--overlay-site", str(site), "--out", str(tmp_path / "out"),
                           "--port-base", str(fakes.free_ports(1)), "--timeout", "60", "--require-warm", *extra])
    return code, json.loads((tmp_path / "out" / "warmstart.json").read_text())


def test_require_warm_passes_a_warm_up_that_took_every_compilation(tmp_path):
    code, doc = _warm_start(tmp_path, "--steps", "cold,cold-warmup", "--goal-factor", "3")
    cold, warmed = doc["steps"]["cold"]["sides"]["overlay"], doc["steps"]["cold-warmup"]["sides"]["overlay"]
    assert cold["compiled_after_ready"] == ["fake_kernel"]  # a cold step without the warm-up is not judged
    assert warmed["compiled_after_ready"] == [] and warmed["compiled"]["during_warmup"]["triton_jit"] == {"fake_kernel": 1}
    assert (code, doc["warm_problems"], doc["goal_factor"]) == (0, [], 3.0)


def test_require_warm_fails_a_first_request_over_the_goal(tmp_path):
    code, doc = _warm_start(tmp_path, "--steps", "cold-warmup", "--goal-factor", "0.5")
    (problem,) = doc["warm_problems"]
    assert code == 1 and problem.startswith("cold-warmup overlay: first request") and problem.endswith("goal 0.5x")


def test_what_compiled_after_the_warm_up_is_a_problem_by_name():
    compiled = {"triton_jit": {"_fused_q_kernel": 1}, "deepgemm_nvcc_runs": 2, "flashinfer_jit_builds": ["sampling"],
                "other_jit": {"CuTeDSL:x": 1}}
    assert warmstart.compiled_names(compiled) == ["_fused_q_kernel", "CuTeDSL:x", "FlashInfer:sampling", "DeepGEMM:nvcc"]
    side = {"first": {}, "goal_met": True, "first_over_warm": 1.0, "compiled_after_ready": ["fused_moe_kernel"]}
    doc = {"goal_factor": 1.2, "steps": {"warm": {"sides": {"stock": {**side}}}, "warm-warmup": {"sides": {"stock": side}}}}
    assert warmstart.warm_problems(doc) == ["warm-warmup stock: compiled after the warm-up: fused_moe_kernel"]


def test_a_cold_step_takes_the_model_info_kept_in_the_shared_root(tmp_path):
    from dsa_image.build.tiny_model import write_model

    write_model(tmp_path / "model")
    site = fakes.fake_vllm_site(tmp_path / "site")
    args = ["--model", str(tmp_path / "model"), "--overlay-site", str(site), "--model-info-root", str(tmp_path / "info"),
            "--steps", "cold", "--timeout", "30"]
    assert warmstart.main([*args, "--out", str(tmp_path / "first"), "--port-base", str(fakes.free_ports(1))]) == 0
    (site / "vllm" / "model_executor" / "models" / "registry.py").unlink()  # a new fill would fail
    assert warmstart.main([*args, "--out", str(tmp_path / "second"), "--port-base", str(fakes.free_ports(1))]) == 0
    assert sorted(p.name for p in (tmp_path / "info").iterdir()) == ["overlay-model"]


def test_a_cold_home_that_cannot_be_made_as_the_images_fails_the_step_not_the_run(tmp_path):
    from dsa_image.build.tiny_model import write_model

    write_model(tmp_path / "model")
    site = fakes.fake_vllm_site(tmp_path / "site")
    (site / "vllm" / "model_executor" / "models" / "registry.py").unlink()
    code = warmstart.main(["--model", str(tmp_path / "model"), "--overlay-site", str(site), "--out", str(tmp_path / "out"),
                           "--steps", "cold", "--port-base", str(fakes.free_ports(1)), "--timeout", "30"])
    doc = json.loads((tmp_path / "out" / "warmstart.json").read_text())
    assert code == 1
    assert doc["steps"]["cold"]["error"].startswith("the image's cold HOME: RuntimeError: model_info_cache fill")


def test_deepgemm_lines_show_what_the_server_said_about_it(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("(EngineCore pid=1) INFO 11-30 06:18:32 [deep_gemm.py:175] deep_gemm not found in site-packages\n"
                   "(EngineCore pid=1) INFO 11-30 06:18:33 [deep_gemm.py:202] DeepGEMM PDL enabled.\n"
                   "Running NVCC command: nvcc deep_gemm/x.cu\n"
                   "(EngineCore pid=1) INFO 11-30 06:19:00 [deep_gemm.py:202] DeepGEMM PDL enabled.\n"
                   "INFO unrelated\n")
    assert warmstart.deepgemm_lines(str(log)) == ["deep_gemm not found in site-packages", "DeepGEMM PDL enabled."]
