"""dsa_image.runtime.healthcheck: the HEALTHCHECK probes the port and host `vllm serve` was given.

Runs on the host and in the image's `test` stage (stdlib, a real /proc, real sockets)."""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import sys
from pathlib import Path

import pytest

from dsa_image.runtime import healthcheck, warmup
from dsa_image.runtime.serve_command import VLLM_DEFAULT_PORT, Endpoint

# The free-port helper the smoke tests use (tests/ is on sys.path as pytest runs them).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_vllm import FakeServer, FakeVllm, make_handler  # noqa: E402
from test_smoke_fakes import free_port  # noqa: E402

VLLM = ["/opt/venv/bin/python", "/opt/venv/bin/vllm", "serve"]


@pytest.mark.parametrize("cmdline, args", [
    ([*VLLM, "m", "--port", "9000"], ["m", "--port", "9000"]),
    (["vllm", "serve"], []),
    (["/usr/bin/python3", "-m", "vllm.entrypoints.cli.main", "serve", "m"], ["m"]),
    (["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--port", "1"], ["--model", "m", "--port", "1"]),
    # the entrypoint before it execs, and other processes: not vLLM's server
    (["/usr/bin/env", "PYTHONPATH=/opt/dsa-image/tool", "/opt/venv/bin/python", "-m", "dsa_image.runtime.entrypoint", "serve"], None),
    # the warm-up supervisor carries vLLM's argv, but its child is the server
    (["/opt/venv/bin/python", "-m", "dsa_image.runtime.warmup", "supervise", "--", "vllm", "serve", "m"], None),
    (["/opt/venv/bin/python", "-c", "import sys; from dsa_image.runtime.warmup import main", "/opt/dsa-image/tool",
      "supervise", "--", "vllm", "serve", "m"], None),
    (["python", "-m", "dsa_image.runtime.warmup", "supervise", "--", "python", "-m", "vllm.entrypoints.openai.api_server"], None),
    (["/opt/venv/bin/python", "/opt/venv/bin/vllm", "bench", "serve"], None),
    (["sleep", "infinity"], None),
    ([], None),
])
def test_serve_args_recognises_vllm_serve_only(cmdline, args):
    assert healthcheck.serve_args(cmdline) == args


@pytest.mark.parametrize("args, endpoint", [
    ([], Endpoint("http", "127.0.0.1", VLLM_DEFAULT_PORT)),
    (["m", "--port", "9000"], Endpoint("http", "127.0.0.1", 9000)),
    (["m", "--port=9000"], Endpoint("http", "127.0.0.1", 9000)),
    (["m", "--port", "8000", "--port", "9001"], Endpoint("http", "127.0.0.1", 9001)),
    (["m", "--host", "0.0.0.0", "--port", "9000"], Endpoint("http", "127.0.0.1", 9000)),
    (["m", "--host=::"], Endpoint("http", "::1", VLLM_DEFAULT_PORT)),
    (["m", "--host", "10.1.2.3"], Endpoint("http", "10.1.2.3", VLLM_DEFAULT_PORT)),
    (["m", "--ssl_certfile", "/c.pem", "--port", "443"], Endpoint("https", "127.0.0.1", 443)),
    (["m", "--uds", "/tmp/v.sock", "--port", "9000"], Endpoint(uds="/tmp/v.sock")),
    # a trailing --port without its value (vLLM refuses it): the default, not a crash
    (["--served-model-name", "--port"], Endpoint("http", "127.0.0.1", VLLM_DEFAULT_PORT)),
])
def test_endpoint_follows_the_command_line(args, endpoint):
    assert healthcheck.endpoint_of(args) == endpoint


@pytest.mark.parametrize("args", [
    [], ["m", "--port", "9000"], ["m", "--port=9000", "--host", "::"], ["m", "--port", "1", "--port", "2"],
    ["m", "--ssl_certfile", "/c.pem", "--host=10.0.0.5"], ["m", "--uds", "/tmp/v.sock"],
    ["m", "--port", "9000", "--port"],  # a trailing --port without its value: the one before it
    ["m", "--port", "9000", "--", "--port", "1"],  # after a bare --, no flag
])
def test_the_warmup_and_the_healthcheck_read_one_command_line_alike(args):
    """Issue #24's review: two parsers read a trailing --port differently (the warm-up took it as
    none, the healthcheck as the earlier one). Both now call dsa_image.runtime.serve_command."""
    assert warmup.serve_endpoint(["vllm", "serve", *args], {}) == healthcheck.endpoint_of(args)


def test_endpoint_urls():
    assert Endpoint("http", "127.0.0.1", 9000).url("/health") == "http://127.0.0.1:9000/health"
    assert Endpoint("http", "::1", 8000).url("/health") == "http://[::1]:8000/health"


def _fake_proc(root: Path, processes: dict[int, list[str]], environ: dict[int, dict[str, str]] | None = None) -> Path:
    """/proc with these processes' cmdline, environ (empty unless given) and start time."""
    for pid, cmdline in processes.items():
        (root / str(pid)).mkdir(parents=True)
        (root / str(pid) / "cmdline").write_bytes(b"".join(part.encode() + b"\0" for part in cmdline))
        env = (environ or {}).get(pid, {})
        (root / str(pid) / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
        (root / str(pid) / "stat").write_text(f"{pid} (python) S " + " ".join(["0"] * 18) + " 4242 0\n")
    (root / "self").mkdir()  # /proc has non-PID entries too
    (root / "sys" / "kernel" / "random").mkdir(parents=True)
    (root / "sys" / "kernel" / "random" / "boot_id").write_text("boot-1\n")
    return root


def test_find_server_prefers_pid_1_and_finds_vllm_under_an_init(tmp_path):
    proc = _fake_proc(tmp_path / "a", {1: [*VLLM, "m", "--port", "1"], 30: [*VLLM, "m", "--port", "2"]})
    assert healthcheck.find_server(proc) == (1, ["m", "--port", "1"])
    proc = _fake_proc(tmp_path / "b", {1: ["/sbin/docker-init", "--", "/usr/bin/env", "x"], 7: [*VLLM, "m", "--port=9000"]})
    assert healthcheck.find_server(proc) == (7, ["m", "--port=9000"])


def test_find_server_passes_over_the_warmup_supervisor_to_its_child(tmp_path):
    supervisor = ["/opt/venv/bin/python", "-m", "dsa_image.runtime.warmup", "supervise", "--", "vllm", "serve", "m", "--port", "1"]
    proc = _fake_proc(tmp_path, {1: supervisor, 12: [*VLLM, "m", "--port", "1"]})
    assert healthcheck.find_server(proc) == (12, ["m", "--port", "1"])


def test_find_server_says_what_runs_when_vllm_does_not(tmp_path):
    proc = _fake_proc(tmp_path, {1: ["sleep", "infinity"]})
    with pytest.raises(healthcheck.NoServer, match="PID 1: sleep infinity"):
        healthcheck.find_server(proc)


def test_read_cmdline_reads_the_real_proc():
    assert healthcheck.read_cmdline(healthcheck.PROC / str(os.getpid()))[0].split("/")[-1].startswith("python")


@pytest.fixture
def server():
    """The fake vLLM on a free loopback port; yields (port, its state, whose health_status the
    test sets)."""
    with FakeServer(FakeVllm()) as fake:
        yield fake.port, fake.state


def test_probe_is_healthy_only_on_200(server):
    port, state = server
    assert healthcheck.probe(Endpoint("http", "127.0.0.1", port)) is None
    state.health_status = 503
    assert "HTTP 503" in healthcheck.probe(Endpoint("http", "127.0.0.1", port))


def test_probe_of_a_closed_port_says_why():
    free = free_port()
    assert f"127.0.0.1:{free}/health" in healthcheck.probe(Endpoint("http", "127.0.0.1", free), timeout=2)


def test_main_probes_the_port_vllm_was_given_not_the_default(server, tmp_path, capsys):
    port, _ = server
    serving_there = _fake_proc(tmp_path / "there", {1: [*VLLM, "m", "--port", str(port), "--port-unrelated", "1"]})
    assert healthcheck.main(serving_there) == 0
    assert f"healthy: http://127.0.0.1:{port}/health" in capsys.readouterr().out
    # The same server, but vLLM was told another port: not healthy (the server there is not vLLM's).
    elsewhere = _fake_proc(tmp_path / "elsewhere", {1: [*VLLM, "m", f"--port={free_port()}"]})
    assert healthcheck.main(elsewhere) == 1
    assert "unhealthy: GET" in capsys.readouterr().out


def _supervised(tmp_path: Path, port: int, marker: Path) -> Path:
    """The image's serve: the supervisor as PID 1, vLLM its child with the marker's path."""
    supervisor = ["/opt/venv/bin/python", "-c", "from dsa_image.runtime.warmup import main", "/opt/dsa-image/tool",
                  "supervise", "--", "vllm", "serve", "m", "--port", str(port)]
    return _fake_proc(tmp_path / "proc", {1: supervisor, 9: [*VLLM, "m", "--port", str(port)]},
                      {9: {"PATH": "/bin", warmup.MARKER_ENV: str(marker)}})


def test_a_supervised_server_is_unhealthy_until_its_warmup_marker_says_warm(server, tmp_path, capsys):
    port, _ = server
    marker = tmp_path / "warm.json"
    proc = _supervised(tmp_path, port, marker)
    assert healthcheck.main(proc) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"unhealthy: http://127.0.0.1:{port}/health answers, but warming up: no readiness marker")
    assert warmup.SWITCH_ENV + "=0" in out and out.count("\n") == 1
    warmup.write_marker(marker, 9, {"seconds": 1.0}, proc)
    assert healthcheck.main(proc) == 0
    assert capsys.readouterr().out == f"healthy: http://127.0.0.1:{port}/health\n"


def test_a_failed_warmup_keeps_the_server_unhealthy_and_says_why(server, tmp_path, capsys):
    port, _ = server
    marker = tmp_path / "warm.json"
    proc = _supervised(tmp_path, port, marker)
    warmup.write_marker(marker, 9, {}, proc, failed="step prefill-2049: HTTP 500")
    assert healthcheck.main(proc) == 1
    out = capsys.readouterr().out
    assert "the warm-up FAILED: step prefill-2049: HTTP 500" in out and "docker logs" in out


def test_a_marker_of_an_earlier_server_does_not_count(server, tmp_path, capsys):
    port, _ = server
    marker = tmp_path / "warm.json"
    proc = _supervised(tmp_path, port, marker)
    warmup.write_marker(marker, 9, {}, proc)
    (proc / "9" / "stat").write_text("9 (python) S " + " ".join(["0"] * 18) + " 9999 0\n")  # pid 9 reused
    assert healthcheck.main(proc) == 1
    assert "another server's (starttime differ)" in capsys.readouterr().out


def test_without_the_warmup_health_alone_decides_and_an_unreadable_environment_fails_closed(server, tmp_path, capsys):
    port, _ = server
    proc = _fake_proc(tmp_path, {1: [*VLLM, "m", "--port", str(port)]})  # DSA_IMAGE_WARMUP=0: vLLM is PID 1
    assert healthcheck.main(proc) == 0
    (proc / "1" / "environ").unlink()
    assert healthcheck.main(proc) == 1
    assert "cannot read the server's environment" in capsys.readouterr().out.splitlines()[-1]


# -- what the healthcheck cannot read is an unhealthy answer, never a traceback (issue #24 item 19) --


def test_a_marker_that_is_a_json_list_is_unhealthy_saying_so(server, tmp_path, capsys):
    port, _ = server
    marker = tmp_path / "warm.json"
    proc = _supervised(tmp_path, port, marker)
    marker.write_text("[9, 4242]\n")
    assert healthcheck.main(proc) == 1
    out = capsys.readouterr().out
    assert out == (f"unhealthy: http://127.0.0.1:{port}/health answers, but readiness marker {marker} unreadable: "
                   "a JSON list, not the object the warm-up writes\n")


def test_a_marker_path_that_is_not_utf8_is_followed(server, tmp_path, capsys):
    port, _ = server
    marker = os.fsencode(tmp_path) + b"/warm-\xff.json"  # a path is bytes; this one is no UTF-8
    proc = _supervised(tmp_path, port, tmp_path / "unused")
    (proc / "9" / "environ").write_bytes(b"PATH=/bin\0" + warmup.MARKER_ENV.encode() + b"=" + marker + b"\0")
    assert healthcheck.main(proc) == 1
    assert "warming up: no readiness marker" in capsys.readouterr().out
    warmup.write_marker(Path(os.fsdecode(marker)), 9, {"seconds": 1.0}, proc)
    assert healthcheck.main(proc) == 0
    assert capsys.readouterr().out == f"healthy: http://127.0.0.1:{port}/health\n"


@pytest.mark.parametrize("args, message", [
    (["--host", "a b"], "--host 'a b': not a host name or address"),
    (["--port", "99999"], "--port '99999': not a port number (1-65535)"),
    (["--config", "/nonexistent/serve.yaml"], "--config /nonexistent/serve.yaml: cannot read it"),
])
def test_a_command_line_it_cannot_probe_is_unhealthy_saying_so(tmp_path, capsys, args, message):
    assert healthcheck.main(_fake_proc(tmp_path, {1: [*VLLM, "m", *args]})) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"unhealthy: {message}") and out.count("\n") == 1, out


def test_the_port_a_config_file_sets_is_the_one_probed(server, tmp_path, capsys):
    """The entrypoint leaves a --config file's port to it now (issue #24 item 14), so the
    healthcheck reads the file too, relative to the server's working directory."""
    port, _ = server
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "serve.yaml").write_text(f"# the user's\nport: {port}\n")
    proc = _fake_proc(tmp_path / "proc", {1: [*VLLM, "m", "--config", "serve.yaml"]})
    (proc / "1" / "cwd").symlink_to(tmp_path / "work")  # as /proc/PID/cwd is
    assert healthcheck.main(proc) == 0
    assert capsys.readouterr().out == f"healthy: http://127.0.0.1:{port}/health\n"


def test_main_without_vllm_is_unhealthy_and_says_why(tmp_path, capsys):
    assert healthcheck.main(_fake_proc(tmp_path, {1: ["bash"]})) == 1
    assert "no `vllm serve` process" in capsys.readouterr().out


def test_main_with_a_port_that_is_no_number_is_unhealthy(tmp_path, capsys):
    assert healthcheck.main(_fake_proc(tmp_path, {1: [*VLLM, "--port", "http"]})) == 1
    assert "unhealthy" in capsys.readouterr().out


def test_probe_over_vllms_unix_socket(tmp_path):
    class UnixHealth(socketserver.UnixStreamServer):
        def get_request(self):  # http.server wants a (host, port) client address
            request, _ = super().get_request()
            return request, ("local", 0)

    path = str(tmp_path / "vllm.sock")
    httpd = UnixHealth(path, make_handler(FakeVllm()))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = healthcheck.endpoint_of(["m", "--uds", path])
        assert healthcheck.probe(endpoint, timeout=5) is None
        assert path in healthcheck.probe(healthcheck.endpoint_of(["m", "--uds", path + ".gone"]), timeout=5)
    finally:
        httpd.shutdown()
        httpd.server_close()


RAY = ["/opt/venv/bin/python", "/opt/venv/bin/ray", "start"]


def test_a_ray_head_is_healthy_only_while_its_gcs_port_answers(tmp_path, capsys):
    """The cluster modes run `ray start --block` as PID 1 and serve nothing themselves: the head
    is healthy once its GCS port takes connections, not before."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        head = _fake_proc(tmp_path / "up", {1: [*RAY, "--head", f"--port={port}", "--block"]})
        assert healthcheck.main(head) == 0
        assert "healthy: Ray node" in capsys.readouterr().out
    closed = _fake_proc(tmp_path / "down", {1: [*RAY, "--head", f"--port={free_port()}", "--block"]})
    assert healthcheck.main(closed) == 1
    assert "Ray head's GCS" in capsys.readouterr().out


def test_a_ray_worker_is_healthy_while_it_runs_and_vllm_serve_still_wins(server, tmp_path, capsys):
    worker = _fake_proc(tmp_path / "worker", {1: [*RAY, "--address=10.0.0.1:6379", "--block"]})
    assert healthcheck.main(worker) == 0
    # On the head, once `vllm serve` runs beside the Ray node, its /health is what counts.
    port, _ = server
    head_serving = _fake_proc(tmp_path / "serving", {1: [*RAY, "--head", f"--port={free_port()}", "--block"],
                                                    42: [*VLLM, "m", "--port", str(port)]})
    assert healthcheck.main(head_serving) == 0
    assert f"healthy: http://127.0.0.1:{port}/health" in capsys.readouterr().out.splitlines()[-1]
