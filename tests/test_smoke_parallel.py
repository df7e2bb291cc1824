"""The smoke test across GPUs: the layout options and their refusals, the GPUs counted as
visible (CUDA_VISIBLE_DEVICES, `--gpus`, a Ray cluster), the Ray probe of the served
environment, the `vllm serve` argv and the container built per layout, what the log and
nvidia-smi say ran (the `parallel` section and the `parallel_layout` check), and the local
runtime end to end with TP=2 over Ray against fake `vllm`, `ray` and `nvidia-smi`. No GPU."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_smoke_run as smoke_run  # noqa: E402
from fake_vllm import FakeServer, FakeVllm  # noqa: E402
from test_smoke_fakes import (free_port, make_fake_nvidia_smi, make_fake_ray, make_fake_vllm_site,  # noqa: E402
                              startup_log)

from dsa_image.runtime.entrypoint import plan_serve  # noqa: E402
from dsa_image.core.recipe import load_recipe  # noqa: E402
from dsa_image.smoke import checks as C  # noqa: E402
from dsa_image.smoke import cli  # noqa: E402
from dsa_image.smoke.gpu import gpus_held, parse_apps  # noqa: E402
from dsa_image.smoke.layout import (GpuRequest, Layout, LayoutError, Visible, check_fits,  # noqa: E402
                                    entrypoint_serve_argv, layout_problems, logged_ranks, query_shm,
                                    ray_from_log, server_args_problem, visible_docker, visible_local)
from dsa_image.smoke.local_runtime import preflight, server_env  # noqa: E402
from dsa_image.smoke.report import REPORT_NAME, Report  # noqa: E402
from dsa_image.smoke.run import print_summary, run_smoke  # noqa: E402

# The fakes play vLLM 0.24.0 (its dist-info, image label and log: FLASHMLA_SPARSE on sm_90); the
# base the smoke checks follows the served vLLM, so the expectations here are 0.24.0's.
RECIPE = load_recipe(vllm="0.24.0")
SM90 = RECIPE.target("sm90")
RAY_PIN = cli.ray_pin(RECIPE)
TWO_H200 = "0, GPU-aaaa-0, NVIDIA H200\n1, GPU-bbbb-1, NVIDIA H200\n"
INVENTORY = {"gpus": [{"index": 0, "uuid": "GPU-aaaa-0", "name": "NVIDIA H200"},
                      {"index": 1, "uuid": "GPU-bbbb-1", "name": "NVIDIA H200"}], "source": "nvidia-smi (host)"}
NO_SMI = {"error": "nvidia-smi exited 127: nvidia-smi: not found on this host", "source": "nvidia-smi (host)"}


def runner_answering(answers: dict | None = None):
    """A Runner: for a command line holding a key of `answers`, its output (or (code, output))."""
    def run(command):
        line = " ".join(command)
        for key, output in (answers or {}).items():
            if key in line:
                return (0, output) if isinstance(output, str) else output
        return 127, f"{command[0]}: not found on this host"
    return run


# --- options and their refusals --------------------------------------------------------------


def usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_sizes_must_be_positive_whole_numbers(value, capsys):
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size"):
        err = usage_error(["--runtime", "local", "--python", "python3", flag, value], capsys)
        assert f"argument {flag}: expected a positive whole number" in err


def test_the_backend_is_mp_or_ray(capsys):
    err = usage_error(["--runtime", "local", "--python", "python3", "--distributed-executor-backend", "uni"], capsys)
    assert "invalid choice: 'uni'" in err


@pytest.mark.parametrize("server_arg, says", [
    ("-tp", "give it to smoke.py as --tensor-parallel-size"),
    ("--tensor_parallel_size=2", "give it to smoke.py as --tensor-parallel-size"),
    ("-pp=2", "give it to smoke.py as --pipeline-parallel-size"),
    ("--distributed-executor-backend", "give it to smoke.py as --distributed-executor-backend"),
    ("--data-parallel-size", "counts a server's GPUs as tensor x pipeline parallel only"),
    ("-pcp", "counts a server's GPUs as tensor x pipeline parallel only"),
])
def test_layout_flags_after_the_separator_are_refused(server_arg, says, capsys):
    err = usage_error(["--runtime", "local", "--python", "python3", "--", server_arg, "2"], capsys)
    assert says in err and server_arg in err


def test_other_server_args_pass():
    assert server_args_problem(["--enforce-eager", "--gpu-memory-utilization", "0.15", "--max-num-seqs", "4"]) is None


@pytest.mark.parametrize("argv", [
    ["--runtime", "local", "--python", "python3", "--gpus", "2"],
    ["--runtime", "docker", "--image", "x", "--no-gpus", "--gpus", "2"],
])
def test_gpus_is_for_the_docker_runtime_with_a_gpu_request(argv, capsys):
    assert "--gpus is for --runtime docker without --no-gpus" in usage_error(argv, capsys)


@pytest.mark.parametrize("text", ["0", "none", "device=", "-2"])
def test_a_gpu_request_must_name_gpus(text, capsys):
    err = usage_error(["--runtime", "docker", "--image", "x", "--gpus", text], capsys)
    assert "expected all, a count (2) or device=I[,J...]" in err


@pytest.mark.parametrize("text, kwargs, cli_form", [
    ("all", {"count": -1}, "all"),
    ("2", {"count": 2}, "2"),
    ("device=0,2", {"device_ids": ["0", "2"]}, '"device=0,2"'),
    ('"device=GPU-aaaa"', {"device_ids": ["GPU-aaaa"]}, '"device=GPU-aaaa"'),
])
def test_gpu_requests_become_docker_device_requests(text, kwargs, cli_form):
    request = GpuRequest.parse(text)
    assert request.docker_kwargs() == kwargs and request.cli() == cli_form


def test_a_layout_adds_only_the_flags_it_changes():
    assert Layout().server_flags() == [] and Layout().server_env() == {}
    assert Layout(2, 1, "mp").server_flags() == ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]
    ray = Layout(2, 2, "ray")
    assert ray.world_size == 4
    assert ray.server_flags() == ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2",
                                  "--distributed-executor-backend", "ray"]
    # Ray folds rank lines that differ only in numbers: the run turns that off to see every rank.
    assert ray.server_env() == {"RAY_DEDUP_LOGS": "0"}


# --- GPUs visible, and the preflight ---------------------------------------------------------


@pytest.mark.parametrize("cvd, count, indices", [
    (None, 2, [0, 1]),
    ("1", 1, [1]),
    ("", 0, []),
    ("GPU-bbbb", 1, [1]),          # a UUID prefix names a GPU too
    ("1,7,0", 1, [1]),             # CUDA stops at the first entry that names no GPU
])
def test_visible_local_reads_cuda_visible_devices_against_the_inventory(cvd, count, indices):
    visible = visible_local(cvd, INVENTORY)
    assert visible.count == count and [g["index"] for g in visible.gpus] == indices


def test_visible_local_without_nvidia_smi():
    assert visible_local(None, NO_SMI).count is None
    unchecked = visible_local("0,1", NO_SMI)
    assert unchecked.count == 2 and "not checked" in unchecked.source


@pytest.mark.parametrize("request_, inventory, count", [
    (None, INVENTORY, 0),
    (GpuRequest(), INVENTORY, 2),
    (GpuRequest(), NO_SMI, None),
    (GpuRequest(count=1), INVENTORY, 1),
    (GpuRequest(count=4), INVENTORY, 2),
    (GpuRequest(count=4), NO_SMI, 4),
    (GpuRequest(count=0, device_ids=("1",)), INVENTORY, 1),
    (GpuRequest(count=0, device_ids=("0", "1")), NO_SMI, 2),
])
def test_visible_docker_follows_the_gpu_request(request_, inventory, count):
    assert visible_docker(request_, inventory).count == count


def test_one_gpu_is_left_to_the_run_even_with_none_visible():
    check_fits(Layout(), Visible(0, "--no-gpus: no GPU requested", "drop --no-gpus"))


def test_more_gpus_than_visible_is_refused_with_what_to_do():
    with pytest.raises(LayoutError) as refused:
        check_fits(Layout(2, 1, "ray"), visible_local("0", INVENTORY))
    message = str(refused.value)
    assert message == ("--tensor-parallel-size 2 x --pipeline-parallel-size 1 needs 2 GPUs, but 1 is visible "
                       "(CUDA_VISIBLE_DEVICES='0' of the 2 GPUs nvidia-smi (host) lists); lower the sizes or "
                       "name more GPUs in CUDA_VISIBLE_DEVICES (or unset it)")
    with pytest.raises(LayoutError, match=r"needs 4 GPUs, but 2 are visible \(--gpus all: the 2 GPUs"):
        check_fits(Layout(2, 2), visible_docker(GpuRequest(), INVENTORY))


def test_an_unknown_gpu_count_is_refused_for_several_gpus():
    with pytest.raises(LayoutError, match=r"how many this run may use is unknown: --gpus all, and how many GPUs "
                                          r"this host has is unknown .*; say how many: --gpus N"):
        check_fits(Layout(2), visible_docker(GpuRequest(), NO_SMI))
    with pytest.raises(LayoutError, match="make nvidia-smi work on this host, or name the GPUs"):
        check_fits(Layout(2), visible_local(None, NO_SMI))


# --- the local preflight: Ray in the served environment --------------------------------------


@pytest.fixture
def ray_site(tmp_path, monkeypatch):
    for name in ("RAY_ADDRESS", "FAKE_RAY_BROKEN", "FAKE_RAY_DEAD", "FAKE_RAY_NODES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return make_fake_ray(make_fake_vllm_site(tmp_path / "site"))


def local_preflight(site, layout, smi=TWO_H200):
    env = server_env(SM90, str(site), layout)
    return preflight(sys.executable, env, layout, RAY_PIN, runner_answering({"index,uuid,name": smi}))


def test_ray_that_does_not_import_is_refused(ray_site, monkeypatch):
    monkeypatch.setenv("FAKE_RAY_BROKEN", "1")
    with pytest.raises(LayoutError) as refused:
        local_preflight(ray_site, Layout(2, 1, "ray"))
    message = str(refused.value)
    assert f"needs Ray importable by {sys.executable}" in message
    assert "ImportError: libgcs_server.so: cannot open shared object file" in message
    assert "pip install ray==2.52.0" in message


def test_ray_absent_from_the_environment_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    site = make_fake_vllm_site(tmp_path / "site")
    with pytest.raises(LayoutError, match="ModuleNotFoundError: No module named 'ray'"):
        local_preflight(site, Layout(2, 1, "ray"))


def test_ray_without_a_cluster_means_a_local_instance_on_this_hosts_gpus(ray_site):
    record = local_preflight(ray_site, Layout(2, 1, "ray"))
    assert record["world_size"] == 2 and record["distributed_executor_backend"] == "ray"
    assert record["server_flags"] == ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]
    assert record["gpus_visible"]["count"] == 2
    ray = record["ray"]
    assert ray["version"] == "2.52.0" and ray["node_count"] == 1
    assert ray["instance"].startswith("a local instance vLLM starts")
    with pytest.raises(LayoutError, match="needs 4 GPUs, but 2 are visible"):
        local_preflight(ray_site, Layout(4, 1, "ray"))


def test_ray_joining_a_cluster_counts_the_clusters_gpus(ray_site, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "192.0.2.10:6379")
    nodes = [{"NodeManagerAddress": f"192.0.2.{i}", "Alive": True, "Resources": {"GPU": 1.0, "CPU": 20.0}}
             for i in (10, 11)]
    monkeypatch.setenv("FAKE_RAY_NODES", json.dumps(nodes))
    # One GPU on this host, two in the cluster: the cluster decides.
    record = local_preflight(ray_site, Layout(2, 1, "ray"), smi="0, GPU-aaaa-0, NVIDIA H200\n")
    assert record["ray"]["node_count"] == 2 and record["ray"]["address"] == "192.0.2.10:6379"
    assert record["gpus_visible"]["count"] == 2 and "Ray cluster at 192.0.2.10:6379" in record["gpus_visible"]["source"]


def test_a_dead_recorded_ray_cluster_is_refused(ray_site, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "192.0.2.10:6379")
    monkeypatch.setenv("FAKE_RAY_DEAD", "1")
    with pytest.raises(LayoutError) as refused:
        local_preflight(ray_site, Layout(2, 1, "ray"))
    assert "would join the Ray cluster at 192.0.2.10:6379" in str(refused.value)
    assert "Could not read 'session_name' from GCS" in str(refused.value) and "ray stop" in str(refused.value)


def test_a_ray_without_the_address_resolution_counts_this_hosts_gpus(ray_site):
    (ray_site / "ray" / "_private" / "services.py").unlink()  # a Ray whose private API moved
    record = local_preflight(ray_site, Layout(2, 1, "ray"))
    assert record["ray"]["instance"].startswith("unknown: cannot tell whether ray.init() joins a cluster")
    assert record["ray"]["node_count"] is None and record["gpus_visible"]["count"] == 2


def test_mp_does_not_probe_ray(tmp_path):
    record = local_preflight(make_fake_vllm_site(tmp_path / "site"), Layout(2, 1, "mp"))
    assert "ray" not in record and record["gpus_visible"]["count"] == 2


# --- what the log says ran ---------------------------------------------------------------------


def log_of(**layout) -> str:
    return "\n".join(startup_log("FLASHMLA_SPARSE", "deepgemm", **layout)) + "\n"


def test_ranks_are_read_through_worker_prefixes_and_colours():
    ranks = logged_ranks(log_of(tp=2, pp=2, ray=True))
    assert [(r["rank"], r["world_size"], r["pp_rank"], r["tp_rank"]) for r in ranks] == [
        (0, 4, 0, 0), (1, 4, 0, 1), (2, 4, 1, 0), (3, 4, 1, 1)]


# An excerpt of the smoke server's log of docs/validation/h200-2026-11-30-overlay-d121a8f4.
RECORDED_LOG = Path(__file__).resolve().parent / "data" / "h200-overlay-d121a8f4-smoke-server.log"


def test_a_real_vllm_0_24_log_passes_the_single_gpu_layout():
    """The rank line as vLLM 0.24.0 + the overlay wrote it on the H200 (the local smoke run)."""
    log = RECORDED_LOG.read_text()
    assert [(r["rank"], r["world_size"]) for r in logged_ranks(log)] == [(0, 1)]
    assert layout_problems(log, Layout(), None) == []
    assert "world size: expected 2" in layout_problems(log, Layout(2), None)[0]


def test_ray_lines_are_read_from_the_log():
    assert ray_from_log(log_of(tp=2, ray=True)) == {
        "instance_logged": "a local instance vLLM started", "placement_group_logged": True, "remote_worker_ips": []}
    joined = ("(EngineCore pid=4) INFO worker.py:1832 -- Connecting to existing Ray cluster at address: "
              "192.0.2.10:6379...\n(EngineCore pid=4) (RayWorkerProc pid=9, ip=192.0.2.11) INFO ready\n")
    found = ray_from_log(joined)
    assert found["instance_logged"] == "joined the cluster at 192.0.2.10:6379"
    assert found["remote_worker_ips"] == ["192.0.2.11"] and found["placement_group_logged"] is False


@pytest.mark.parametrize("args", [
    ["/opt/dsa-image/models/tiny-glm5", "--load-format", "dummy", "--tensor-parallel-size", "2",
     "--distributed-executor-backend", "ray"],
    [],  # the built-in model, no arguments
])
def test_the_serve_argv_is_read_from_the_entrypoints_own_log_line(args):
    plan = plan_serve(args, RECIPE, RECIPE.target("sm120"), {})
    log = f"{plan.log}\nINFO 11-30 12:00:00 [api_server.py:1] vLLM API server version 0.24.0\n"
    assert entrypoint_serve_argv(log) == plan.argv


GOOD_GPUS = {"gpus": [{"index": 0, "name": "NVIDIA H200"}, {"index": 1, "name": "NVIDIA H200"}]}


@pytest.mark.parametrize("layout, log, gpus, problem", [
    (Layout(2, 1, "ray"), log_of(tp=2, ray=True), GOOD_GPUS, None),
    (Layout(2, 1, "mp"), log_of(tp=2), GOOD_GPUS, None),
    (Layout(2, 1, "ray"), log_of(tp=2, ray=True), {"error": "nvidia-smi: not found"}, None),  # log alone
    (Layout(2, 1, "mp"), log_of(), GOOD_GPUS, "world size: expected 2 (tensor x pipeline parallel), the log says 1"),
    (Layout(2, 1, "mp"), log_of(tp=2).replace("rank 1 in world", "rank 7 in world"), GOOD_GPUS,
     "ranks [1] of world size 2 never logged their assignment"),
    (Layout(1, 2), log_of(tp=2), GOOD_GPUS, "TP RANKs: expected 0-0, the log names [0, 1]"),
    (Layout(2, 1, "ray"), log_of(tp=2), GOOD_GPUS, "--distributed-executor-backend ray, but the log shows no Ray "
                                                   "placement group"),
    (Layout(2, 1, "mp"), log_of(tp=2, ray=True), GOOD_GPUS, "mp, but the log shows vLLM placing workers with Ray"),
    (Layout(2, 1, "mp"), log_of(tp=2), {"gpus": GOOD_GPUS["gpus"][:1]},
     "2 GPUs expected, the server's processes hold 1: 0 (NVIDIA H200)"),
    (Layout(2), "INFO nothing about ranks\n", None, "the log names no rank"),
])
def test_layout_problems(layout, log, gpus, problem):
    problems = layout_problems(log, layout, gpus)
    assert problems == [] if problem is None else any(problem in p for p in problems), problems


# --- nvidia-smi's compute processes and /dev/shm --------------------------------------------


def test_gpus_held_are_the_gpus_of_the_servers_processes():
    apps = "GPU-aaaa-0, 100, 2048\nGPU-bbbb-1, 101, [N/A]\nGPU-bbbb-1, 999, 512\n"
    run = runner_answering({"index,uuid,name": TWO_H200, "compute-apps": apps})
    held = gpus_held({100, 101}.__contains__, run)
    assert held["gpus"] == [
        {"index": 0, "uuid": "GPU-aaaa-0", "name": "NVIDIA H200", "pids": [100], "used_memory_mib": 2048},
        {"index": 1, "uuid": "GPU-bbbb-1", "name": "NVIDIA H200", "pids": [101], "used_memory_mib": None}]
    # Only another user's process on the GPUs: the server's pids were not matched, not "no GPU".
    assert gpus_held({5}.__contains__, run) == {"error": "nvidia-smi lists no compute process of the server",
                                                "source": "nvidia-smi --query-compute-apps (host)"}
    assert "error" in gpus_held({100}.__contains__, runner_answering())


# A process whose child leaves its process group, as a Ray worker does under
# RAY_process_group_cleanup_enabled.
LEADER_OF_OWN_GROUP = ("import os, subprocess, sys, time; "
                       "child = subprocess.Popen([sys.executable, '-c', "
                       "'import os, time; os.setsid(); time.sleep(60)']); "
                       "print(child.pid, flush=True); time.sleep(60)")


def test_server_processes_are_its_group_and_its_descendants(tmp_path):
    """A Ray worker that leads a process group of its own (RAY_process_group_cleanup_enabled)
    still counts as the server's: it descends from it."""
    from dsa_image.smoke.local_runtime import LocalServer

    server = LocalServer(["x"], sys.executable, None, {}, free_port(), tmp_path / "log", None,
                         {"python": "3.11.7", "vllm": "0.24.0"})
    server.proc = subprocess.Popen([sys.executable, "-c", LEADER_OF_OWN_GROUP], stdout=subprocess.PIPE, text=True,
                                   start_new_session=True)
    child = int(server.proc.stdout.readline())
    try:
        deadline = time.monotonic() + 30
        while os.getpgid(child) == server.proc.pid and time.monotonic() < deadline:
            time.sleep(0.05)  # until the child has run its setsid()
        assert os.getpgid(child) != server.proc.pid
        assert server._is_server_process(server.proc.pid) and server._is_server_process(child)
        assert not server._is_server_process(os.getpid()) and not server._is_server_process(1)
    finally:
        for pid in (child, server.proc.pid):
            os.kill(pid, 9)
        server.proc.wait()
        server.proc.stdout.close()


def test_no_running_processes_parses_to_none():
    assert parse_apps("No running processes found\n") == []


def test_shm_size_is_read_with_df():
    df = ("Filesystem     1024-blocks  Used Available Capacity Mounted on\n"
          "shm                 65536     0     65536       0% /dev/shm\n")
    assert query_shm(runner_answering({"df": df}), "in the container") == {
        "path": "/dev/shm", "size_bytes": 67108864, "available_bytes": 67108864, "source": "df (in the container)"}
    assert "error" in query_shm(runner_answering({"df": (125, "the container is not running")}), "in the container")


# --- a whole run records the layout ----------------------------------------------------------


class LayoutServer(smoke_run.ScriptedServer):
    def __init__(self, base_url, log, gpus_used):
        super().__init__(base_url, log=log)
        self.gpus_used = gpus_used

    def layout_facts(self):
        return {"gpus_used": self.gpus_used, "shm": {"path": "/dev/shm", "size_bytes": 1 << 30}}


def run_with_layout(tmp_path, layout, log, gpus_used=GOOD_GPUS):
    with FakeServer(FakeVllm()) as fake:
        report = Report(runtime="test", served_model_name="glm-5")
        run_smoke(LayoutServer(fake.base_url, log, gpus_used), report, RECIPE, "sm90", tmp_path, 5.0, 10.0, layout)
    return report, json.loads((tmp_path / REPORT_NAME).read_text())


def test_a_run_records_the_layout_and_checks_it(tmp_path):
    report, written = run_with_layout(tmp_path, Layout(2, 1, "ray"), log_of(tp=2, ray=True))
    assert written["passed"], written["failed_checks"]
    assert [c["name"] for c in written["checks"]] == list(C.ALL_CHECKS)
    parallel = written["parallel"]
    assert parallel["world_size"] == 2 and parallel["tensor_parallel_size"] == 2
    assert parallel["distributed_executor_backend"] == "ray"
    assert [r["rank"] for r in parallel["ranks_logged"]] == [0, 1]
    assert parallel["ray_log"]["instance_logged"] == "a local instance vLLM started"
    assert parallel["gpus_used"] == GOOD_GPUS and parallel["shm"]["size_bytes"] == 1 << 30
    check = {c["name"]: c for c in written["checks"]}["parallel_layout"]
    assert check["reason"] == "TP 2 x PP 1 = 2 GPUs, executor ray: ranks 0-1 logged; its processes hold GPUs 0, 1"
    stream = io.StringIO()
    print_summary(report, tmp_path / REPORT_NAME, stream)
    assert stream.getvalue().splitlines()[0] == (
        "LAYOUT TP 2 x PP 1 = 2 GPUs, executor ray; Ray: a local instance vLLM started; "
        "GPUs used: 0 NVIDIA H200, 1 NVIDIA H200; ranks logged: 0, 1")


def test_a_run_on_fewer_ranks_than_asked_fails_the_layout_check(tmp_path):
    report, written = run_with_layout(tmp_path, Layout(2, 1, "mp"), log_of())
    assert written["failed_checks"] == ["parallel_layout"]
    reason = {c["name"]: c for c in written["checks"]}["parallel_layout"]["reason"]
    assert "world size: expected 2 (tensor x pipeline parallel), the log says 1" in reason


def test_a_run_that_never_serves_still_records_what_its_log_says(tmp_path):
    server = smoke_run.ScriptedServer(exit_after_polls=1, log=log_of(tp=2, ray=True) + "ValueError: ...\n")
    report = Report(runtime="test", served_model_name="glm-5")
    run_smoke(server, report, RECIPE, "sm90", tmp_path, 5.0, 10.0, Layout(2, 1, "ray"))
    written = json.loads((tmp_path / REPORT_NAME).read_text())
    assert [r["rank"] for r in written["parallel"]["ranks_logged"]] == [0, 1]
    assert "gpus_used" not in written["parallel"]
    assert {c["name"]: c for c in written["checks"]}["parallel_layout"]["reason"].startswith("not run")


# --- the docker runtime: the container and the command per layout ---------------------------


@pytest.fixture
def fake_docker(monkeypatch, tmp_path):
    """The Docker SDK answering with test_smoke_docker's fake client, nvidia-smi with two H200s."""
    pytest.importorskip("docker", reason="the Docker SDK (`docker`) is in the dev lock")
    import test_smoke_docker as docker_fakes

    from dsa_image.smoke import docker_runtime

    class Client(docker_fakes.FakeClient):
        def ping(self):
            return True

    client = Client(free_port())
    monkeypatch.setattr(docker_runtime.docker, "from_env", lambda: client)
    bin_dir = tmp_path / "bin"
    make_fake_nvidia_smi(bin_dir)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_NVIDIA_SMI_GPUS", "2")
    return client


def build_docker(tmp_path, *argv):
    args, server_args = cli.parse_args(["--runtime", "docker", "--image", "dsa-image:0.24.0-sm90",
                                        "--out", str(tmp_path / "out"), *argv])
    report = Report(runtime="docker")
    server, target, recipe = cli.build_docker(args, server_args, report, None, tmp_path)
    assert recipe.vllm_version == "0.24.0"  # the image's dsa-image.vllm.version label picks the base
    return server, report


def test_docker_command_per_layout(fake_docker, tmp_path):
    server, report = build_docker(tmp_path, "--gpus", "2", "--tensor-parallel-size", "2",
                                  "--distributed-executor-backend", "ray", "--", "--enforce-eager")
    image_args = ["/opt/dsa-image/models/tiny-glm5", "--load-format", "dummy", "--tensor-parallel-size", "2",
                  "--distributed-executor-backend", "ray", "--enforce-eager"]
    assert server.command == image_args
    assert report.server_command == ["docker", "run", "--rm", "--ipc=host", "--gpus", "2", "--network", "host",
                                     "-e", "RAY_DEDUP_LOGS=0", "dsa-image:0.24.0-sm90", *image_args]
    assert report.parallel["gpus_visible"]["count"] == 2
    assert report.parallel["ray"] == {"instance": "a local instance vLLM starts in the container", "node_count": 1}
    server.start()
    try:
        options = fake_docker.created[0].options
        assert options["environment"] == {"RAY_DEDUP_LOGS": "0"} and options["ipc_mode"] == "host"
        assert options["device_requests"][0]["Count"] == 2
        assert options["command"] == image_args
    finally:
        server.stop()


def test_docker_device_list_and_default_layout(fake_docker, tmp_path):
    server, report = build_docker(tmp_path, "--gpus", "device=1,0", "--pipeline-parallel-size", "2")
    assert report.server_command[:6] == ["docker", "run", "--rm", "--ipc=host", "--gpus", '"device=1,0"']
    assert "-e" not in report.server_command  # no Ray: no Ray settings
    server.start()
    try:
        request = fake_docker.created[0].options["device_requests"][0]
        assert request["DeviceIDs"] == ["1", "0"] and request["Count"] == 0
        assert "environment" not in fake_docker.created[0].options
    finally:
        server.stop()
    server, report = build_docker(tmp_path)
    assert server.command == [] and report.parallel["server_flags"] == []  # the image's built-in serve


def test_docker_gpus_held_are_the_containers_processes(fake_docker, tmp_path):
    server, report = build_docker(tmp_path, "--tensor-parallel-size", "2")
    server.run_host = runner_answering({"index,uuid,name": TWO_H200,
                                        "compute-apps": "GPU-aaaa-0, 4242, 1000\nGPU-bbbb-1, 4242, 1000\n"
                                                        "GPU-bbbb-1, 31337, 9000\n"})
    server.start()
    try:
        facts = server.layout_facts()
    finally:
        server.stop()
    assert [(g["index"], g["pids"]) for g in facts["gpus_used"]["gpus"]] == [(0, [4242]), (1, [4242])]
    assert "error" in facts["shm"]  # the fake container runs no df


@pytest.mark.parametrize("argv, says", [
    (["--gpus", "1", "--tensor-parallel-size", "2"], "needs 2 GPUs, but 1 is visible (--gpus 1, of the 2 GPUs"),
    (["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"], "needs 4 GPUs, but 2 are visible (--gpus all"),
    (["--no-gpus", "--tensor-parallel-size", "2"], "needs 2 GPUs, but 0 are visible (--no-gpus"),
])
def test_docker_refusals_exit_2_before_any_container(argv, says, tmp_path):
    bin_dir = tmp_path / "bin"
    make_fake_nvidia_smi(bin_dir)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_NVIDIA_SMI_GPUS": "2",
           "DOCKER_HOST": "unix:///nonexistent/docker.sock"}  # nothing may reach an engine
    done = subprocess.run([sys.executable, str(smoke_run.SMOKE), "--runtime", "docker", "--image", "x",
                           "--out", str(tmp_path / "out"), *argv],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "lower the sizes or" in done.stderr


# --- the local runtime end to end: TP=2 over Ray, fake vllm / ray / nvidia-smi -----------------


@pytest.fixture
def fake_gpu_host(tmp_path, monkeypatch):
    site = make_fake_ray(make_fake_vllm_site(tmp_path / "site"))
    files = {"FAKE_VLLM_ARGV_FILE": tmp_path / "argv.json", "FAKE_VLLM_CHILD_FILE": tmp_path / "child.pid",
             "FAKE_VLLM_ENV_FILE": tmp_path / "env.json", "FAKE_GPU_APPS_FILE": tmp_path / "apps.csv"}
    for key, path in files.items():
        monkeypatch.setenv(key, str(path))
    for name in ("RAY_ADDRESS", "FAKE_RAY_BROKEN", "FAKE_RAY_DEAD", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FAKE_VLLM_ATTENTION", "FLASHMLA_SPARSE")
    monkeypatch.setenv("FAKE_VLLM_KERNELS", "deepgemm")
    monkeypatch.setenv("FAKE_NVIDIA_SMI_GPUS", "2")
    make_fake_nvidia_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return site, files


def test_local_runtime_tp2_over_ray_records_the_layout(tmp_path, fake_gpu_host):
    site, files = fake_gpu_host
    proc = smoke_run.run_local(tmp_path, site, "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
                               "--", "--enforce-eager")
    out, err = proc.communicate(timeout=180)
    report = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    # As in the single-GPU run: no receipt and no torch here, so only verify and the self-test fail.
    assert report["failed_checks"] == ["overlay_verify", "indexer_selftest"], err
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["parallel_layout"]["passed"], checks["parallel_layout"]["reason"]
    argv = json.loads(Path(files["FAKE_VLLM_ARGV_FILE"]).read_text())
    flags = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"]
    port = argv.index("--port")
    assert argv[port + 2:] == [*flags, "--enforce-eager"]
    assert json.loads(Path(files["FAKE_VLLM_ENV_FILE"]).read_text())["RAY_DEDUP_LOGS"] == "0"
    parallel = report["parallel"]
    assert parallel["serve_argv"] == report["server_command"]
    assert parallel["serve_argv"][-5:] == [*flags, "--enforce-eager"]
    assert parallel["gpus_visible"]["count"] == 2 and parallel["ray"]["version"] == "2.52.0"
    child = int(Path(files["FAKE_VLLM_CHILD_FILE"]).read_text())
    assert [(g["index"], g["pids"]) for g in parallel["gpus_used"]["gpus"]] == [(0, [child]), (1, [child])]
    assert [r["rank"] for r in parallel["ranks_logged"]] == [0, 1]
    assert parallel["ray_log"]["placement_group_logged"] is True
    assert ("LAYOUT TP 2 x PP 1 = 2 GPUs, executor ray; Ray: a local instance vLLM started, 1 node; "
            "GPUs used: 0 NVIDIA H200, 1 NVIDIA H200; ranks logged: 0, 1") in err.splitlines()
    assert smoke_run.wait_gone(child)


@pytest.mark.parametrize("argv, env, says", [
    (["--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"], {"FAKE_RAY_BROKEN": "1"},
     "needs Ray importable by"),
    (["--tensor-parallel-size", "2"], {"CUDA_VISIBLE_DEVICES": "1"},
     "needs 2 GPUs, but 1 is visible (CUDA_VISIBLE_DEVICES='1' of the 2 GPUs nvidia-smi (host) lists)"),
])
def test_local_refusals_exit_2_and_start_nothing(tmp_path, fake_gpu_host, monkeypatch, argv, env, says):
    site, files = fake_gpu_host
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    proc = smoke_run.run_local(tmp_path, site, *argv)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert says in err
    assert not Path(files["FAKE_VLLM_ARGV_FILE"]).exists() and not (tmp_path / "out" / REPORT_NAME).exists()
