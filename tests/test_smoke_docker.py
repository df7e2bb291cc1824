"""The Docker runtime: the container is removed on success, a refused start, an early exit, a
timeout and Ctrl-C (proven on a fake Docker client, then on the real engine with the real
image: in CI, without a GPU, the start-up failure is reported with the log, the run exits
non-zero and no container is left behind). On a GPU host, the full smoke must pass."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_vllm import FakeServer, FakeVllm  # noqa: E402
from test_smoke_fakes import SELFTEST_OUTPUT, free_port, startup_log  # noqa: E402

docker = pytest.importorskip("docker", reason="the Docker SDK (`docker`) is in the dev lock")
from docker.errors import APIError, DockerException, NotFound  # noqa: E402

from dsa_image.core.recipe import load_recipe  # noqa: E402
from dsa_image.core import status  # noqa: E402
from dsa_image.smoke import checks as C  # noqa: E402
from dsa_image.smoke.docker_runtime import SMOKE_LABEL, DockerServer  # noqa: E402
from dsa_image.smoke.layout import GpuRequest  # noqa: E402
from dsa_image.smoke.expect import target_for_capability  # noqa: E402
from dsa_image.smoke.gpu import capability_of, query_gpus  # noqa: E402
from dsa_image.smoke.owner import HOST_LABEL, START_LABEL, owner_labels  # noqa: E402
from dsa_image.smoke.report import REPORT_NAME, Report  # noqa: E402
from dsa_image.smoke.run import run_smoke  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scripts" / "smoke.py"
# The fakes play vLLM 0.24.0 (its dist-info, image label and log: FLASHMLA_SPARSE on sm_90); the
# base the smoke checks follows the served vLLM, so the expectations here are 0.24.0's.
RECIPE = load_recipe(vllm="0.24.0")
ENTRYPOINT = ["/usr/bin/env", "PYTHONPATH=/opt/dsa-image/tool", "/opt/venv/bin/python", "-m", "dsa_image.runtime.entrypoint"]


# --- a fake Docker SDK client: only what DockerServer uses ----------------------------------


class FakeImage:
    def __init__(self, port: int):
        self.id = "sha256:" + "1" * 64
        self.labels = {"dsa-image.target": "sm90", "dsa-image.vllm.version": "0.24.0", "maintainer": "x"}
        self.attrs = {"Config": {"Env": [f"DSA_IMAGE_PORT={port}", "PATH=/usr/bin"], "Entrypoint": ENTRYPOINT},
                      "RepoDigests": ["registry.example/dsa@sha256:" + "2" * 64], "Created": "2026-11-30"}


class FakeContainer:
    def __init__(self, options, behaviour):
        self.options = options
        self.name = options["name"]
        self.short_id = self.name[-12:]
        self.labels = options["labels"]
        self.behaviour = behaviour
        self.status = "created"
        self.removed = False
        self.execs = []
        self.polls = 0
        self.attrs = {}

    def start(self):
        if self.behaviour.get("start_error"):
            raise APIError("500 Server Error", explanation=self.behaviour["start_error"])
        self.status = "running"
        if self.behaviour.get("on_start"):
            self.behaviour["on_start"]()

    def reload(self):
        if self.removed:
            raise NotFound("gone")
        self.polls += 1
        exit_after = self.behaviour.get("exit_after_polls")
        if self.status == "running" and exit_after is not None and self.polls > exit_after:
            self.status = "exited"
        self.attrs = {"State": {"Status": self.status, "ExitCode": 1 if self.status == "exited" else 0}}

    def logs(self, stream=False, follow=False, **kw):
        data = self.behaviour.get("log", "").encode()
        return iter([data]) if stream else data

    def top(self):
        return {"Titles": ["UID", "PID", "PPID", "C", "STIME", "TTY", "TIME", "CMD"],
                "Processes": [["1000", "4242", "1", "0", "12:00", "?", "00:00:01", "vllm serve"]]}

    def exec_run(self, argv):
        self.execs.append(argv)
        if argv[-1] == "verify":
            return 0, b"3 files match the receipt"
        if "selftest" in argv:
            return 0, SELFTEST_OUTPUT.encode()
        return 127, b"not found"

    def get_archive(self, path):
        assert path == "/opt/dsa-image/receipt.json"
        data = json.dumps({"schema": 1, "vllm_version": "0.24.0", "recipe": "glm5-dsa",
                           "manifest_sha256": "ab" * 32, "files": [{}]}).encode()
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            info = tarfile.TarInfo("receipt.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        return iter([buffer.getvalue()]), {"name": "receipt.json"}

    def remove(self, force=False):
        assert force
        self.removed = True


class FakeLeftover:
    """A container an earlier run left: what the sweep reads of it."""

    def __init__(self, name, labels, status="running"):
        self.name = name
        self.short_id = name[-12:]
        self.labels = labels
        self.status = status
        self.removed = False

    def remove(self, force=False):
        assert force
        self.removed = True


class FakeClient:
    def __init__(self, port, leftovers=(), **behaviour):
        self.image = FakeImage(port)
        self.behaviour = behaviour
        self.created: list[FakeContainer] = []
        self.leftovers = list(leftovers)
        self.images = self
        self.containers = self

    def get(self, ref):
        return self.image

    def list(self, all=False, filters=None, **kw):
        if self.behaviour.get("list_error"):
            raise DockerException(self.behaviour["list_error"])
        assert all and filters == {"label": SMOKE_LABEL}
        return [c for c in [*self.leftovers, *self.created] if not c.removed and SMOKE_LABEL in c.labels]

    def create(self, **options):
        container = FakeContainer(options, self.behaviour)
        self.created.append(container)
        return container


def fake_run(tmp_path, port, target="sm90", health_timeout=5.0, console=None, **behaviour):
    client = FakeClient(port, **behaviour)
    server = DockerServer("dsa-image:sm90", [], port, "host", GpuRequest(), tmp_path / "server.log", None,
                          client=client, console=console or io.StringIO())
    server.gpu_info = lambda: {"gpus": [{"name": "NVIDIA H200", "compute_capability": "9.0",
                                         "driver_version": "580"}], "source": "test"}
    report = run_smoke(server, Report(runtime="docker", served_model_name="glm-5"), RECIPE, target, tmp_path,
                       health_timeout, 10.0)
    assert len(client.created) == 1 and client.created[0].removed, "the container was not removed"
    return report, client.created[0], json.loads((tmp_path / REPORT_NAME).read_text())


def test_fake_docker_good_run_passes_and_removes_the_container(tmp_path):
    log = "\n".join(startup_log("FLASHMLA_SPARSE", "deepgemm"))
    with FakeServer(FakeVllm()) as fake:
        report, container, written = fake_run(tmp_path, fake.port, log=log)
    assert written["passed"], written["checks"]
    assert container.options["device_requests"][0]["Capabilities"] == [["gpu"]]
    assert container.options["device_requests"][0]["Count"] == -1
    assert container.options["labels"] == {SMOKE_LABEL: container.name.removeprefix("dsa-smoke-"), **owner_labels()}
    assert container.options["network_mode"] == "host"
    assert ENTRYPOINT + ["verify"] in container.execs  # the image's own verify, in the running container
    assert written["image"]["id"] == "sha256:" + "1" * 64
    assert written["image"]["repo_digests"] == ["registry.example/dsa@sha256:" + "2" * 64]
    assert written["image"]["labels"] == {"dsa-image.target": "sm90", "dsa-image.vllm.version": "0.24.0"}
    assert written["versions"]["receipt_vllm"] == "0.24.0"


def test_fake_docker_refused_gpu_request_is_named_and_the_container_removed(tmp_path):
    report, container, written = fake_run(
        tmp_path, free_port(), start_error='could not select device driver "" with capabilities: [[gpu]]')
    reason = written["checks"][0]["reason"]
    assert "could not select device driver" in reason and "NVIDIA container toolkit" in reason
    assert written["passed"] is False and written["image"]["id"].startswith("sha256:")
    assert written["versions"]["receipt_vllm"] == "0.24.0"  # read from the created container


def test_fake_docker_early_exit_is_named_and_the_container_removed(tmp_path):
    report, container, written = fake_run(tmp_path, free_port(), exit_after_polls=1,
                                          log="RuntimeError: Failed to infer device type\n")
    assert "exited with code 1" in written["checks"][0]["reason"]
    assert "Failed to infer device type" in written["log_tail"]


def test_fake_docker_timeout_removes_the_container(tmp_path):
    report, container, written = fake_run(tmp_path, free_port(), health_timeout=1.0)
    assert "did not answer 200 within 1 s" in written["checks"][0]["reason"]


def test_fake_docker_ctrl_c_removes_the_container(tmp_path):
    def interrupt():
        raise KeyboardInterrupt

    report, container, written = fake_run(tmp_path, free_port(), on_start=interrupt)
    assert written["interrupted"] is True


def gone_owner_labels() -> dict[str, str]:
    """The owner labels of a process that ran and is gone, as a smoke run killed with SIGKILL is."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    labels = owner_labels(child.pid)
    child.kill()
    child.wait()
    return labels


def test_fake_docker_removes_leftovers_whose_owner_is_gone_and_names_the_others(tmp_path):
    gone = FakeLeftover("dsa-smoke-aaaaaaaaaaaa", {SMOKE_LABEL: "aaaaaaaaaaaa", **gone_owner_labels()})
    # Our own pid with another start time: the pid of a gone run, since reused.
    reused = FakeLeftover("dsa-smoke-bbbbbbbbbbbb", {SMOKE_LABEL: "bbbbbbbbbbbb", **owner_labels(),
                                                     START_LABEL: "1"}, status="exited")
    alive = FakeLeftover("dsa-smoke-cccccccccccc", {SMOKE_LABEL: "cccccccccccc", **owner_labels()})
    remote = FakeLeftover("dsa-smoke-dddddddddddd", {SMOKE_LABEL: "dddddddddddd",
                                                     **gone_owner_labels(), HOST_LABEL: "elsewhere"})
    by_hand = FakeLeftover("dsa-smoke-eeeeeeeeeeee", {SMOKE_LABEL: "tiny-model-check"})
    leftovers = [gone, reused, alive, remote, by_hand]
    console = io.StringIO()
    report, container, written = fake_run(tmp_path, free_port(), health_timeout=0.5, console=console,
                                          leftovers=leftovers)
    assert [c.removed for c in leftovers] == [True, True, False, False, False]
    lines = console.getvalue().splitlines()
    assert lines[0].startswith(f"smoke: removed smoke container {gone.name} ({gone.short_id}, running): its owner, "
                               f"process {gone.labels['dsa-image.smoke.pid']} on "), lines
    assert lines[0].endswith("no longer runs")
    assert lines[1].startswith(f"smoke: removed smoke container {reused.name}") and "another process" in lines[1]
    assert lines[2].startswith(f"smoke: kept smoke container {alive.name}") and lines[2].endswith("still runs")
    assert lines[3].startswith(f"smoke: kept smoke container {remote.name}") and "on another host" in lines[3]
    assert lines[3].endswith(f"once no smoke run uses it: docker rm -f {remote.name}")
    assert lines[4].startswith(f"smoke: kept smoke container {by_hand.name}") and "no owning process" in lines[4]
    assert lines[5] == ("smoke: every smoke container, when no smoke run is going on: "
                        "docker ps -aq --filter label=dsa-image.smoke | xargs -r docker rm -f")
    assert len(lines) == 6
    found = {e["name"]: (e["action"], e["owner"]) for e in written["leftover_containers"]}
    assert found == {gone.name: ("removed", "gone"), reused.name: ("removed", "gone"), alive.name: ("kept", "alive"),
                     remote.name: ("kept", "unknown"), by_hand.name: ("kept", "unknown")}
    # Swept before this run's own container exists: a run never reports its own.
    assert container.name not in found


def test_fake_docker_says_nothing_without_leftovers(tmp_path):
    console = io.StringIO()
    report, container, written = fake_run(tmp_path, free_port(), health_timeout=0.5, console=console)
    assert console.getvalue() == "" and written["leftover_containers"] == []


def test_fake_docker_run_goes_on_when_leftovers_cannot_be_listed(tmp_path):
    console = io.StringIO()
    report, container, written = fake_run(tmp_path, free_port(), health_timeout=0.5, console=console,
                                          list_error="permission denied")
    assert console.getvalue() == ("smoke: could not look for smoke containers left by earlier runs: "
                                  "permission denied\n")
    assert "did not answer 200" in written["checks"][0]["reason"]


# --- the real engine with a small stand-in image (seconds, not a 10 GB build) ---------------

STAND_IN_ENTRY = """\
import os, sys, time
sys.path.insert(0, "/opt/fake")
if sys.argv[1:] == ["verify"]:
    print("stand-in verify: the overlay matches the receipt")
    sys.exit(0)
import fake_vllm, test_smoke_fakes as fakes
if sys.argv[1:2] == ["selftest"]:
    print(fakes.SELFTEST_OUTPUT, end="")
    sys.exit(0)
import threading
time.sleep(float(os.environ.get("STAND_IN_START_DELAY", "0")))
for line in fakes.startup_log("FLASHMLA_SPARSE", "deepgemm"):
    print(line, flush=True)
server = fake_vllm.FakeServer(fake_vllm.FakeVllm("glm-5"), int(os.environ["DSA_IMAGE_PORT"]))
print("INFO Application startup complete.", flush=True)
# The image's warm-up finishing after /health answers: its healthcheck passes only then.
threading.Timer(float(os.environ["STAND_IN_WARM_DELAY"]), open, ("/tmp/stand-in-warm", "w")).start()
server.httpd.serve_forever()
"""
STAND_IN_WARM_DELAY_S = 3


def build_stand_in(client, base_image: str, context: Path, port: int, start_delay: float = 0) -> str:
    """An image that behaves like ours to the harness (labels, DSA_IMAGE_PORT, an entrypoint
    with `verify`) but serves the fake: the real Docker SDK path, end to end, in seconds.
    `base_image` needs /opt/venv/bin/python (the runtime image has it)."""
    context.mkdir()
    (context / "fake").mkdir()
    for module in ("fake_vllm.py", "test_smoke_fakes.py"):  # the fake server and what it logs
        shutil.copy(Path(__file__).resolve().parent / module, context / "fake")
    (context / "fake" / "entry.py").write_text(STAND_IN_ENTRY)
    (context / "Dockerfile").write_text(
        f"FROM {base_image}\n"
        "COPY fake/ /opt/fake/\n"
        f"ENV DSA_IMAGE_PORT={port} STAND_IN_START_DELAY={start_delay} STAND_IN_WARM_DELAY={STAND_IN_WARM_DELAY_S}\n"
        'ENTRYPOINT ["/opt/venv/bin/python", "/opt/fake/entry.py"]\n'
        # Our image's healthcheck wants a `vllm serve` process and its warm-up marker; the
        # stand-in's says the same thing of its own warm-up: healthy once it is done.
        'HEALTHCHECK CMD ["/opt/venv/bin/python", "-c", "import os, sys; sys.exit(0 if os.path.exists(\'/tmp/stand-in-warm\') else 1)"]\n'
        "LABEL dsa-image.target=sm90 dsa-image.vllm.version=0.24.0\n"
    )
    tag = f"dsa-image-smoke-stand-in:{port}"
    client.images.build(path=str(context), tag=tag, network_mode="host", rm=True)
    return tag


@pytest.fixture
def stand_in(docker_client, runtime_image, tmp_path):
    """Stand-in images built on the runtime image (for its Python; nothing of it runs)."""
    made = []

    def make(start_delay: float = 0) -> tuple[str, int]:
        port = free_port()
        tag = build_stand_in(docker_client, runtime_image, tmp_path / f"ctx{len(made)}", port, start_delay)
        made.append(tag)
        return tag, port

    yield make
    for tag in made:
        docker_client.images.remove(tag, force=True)


@pytest.mark.docker
def test_stand_in_passes_every_check_through_the_real_engine(docker_client, stand_in, tmp_path):
    image, port = stand_in()
    before = smoke_containers(docker_client)
    done = run_smoke_cli(image, tmp_path / "out", "--no-gpus", "--target", "sm90", timeout=300)
    report = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert done.returncode == 0, {c["name"]: c["reason"] for c in report["checks"] if not c["passed"]}
    assert report["image"]["id"] == docker_client.images.get(image).id
    assert report["image"]["labels"]["dsa-image.target"] == "sm90"
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["overlay_verify"]["details"]["output"] == "stand-in verify: the overlay matches the receipt"
    assert checks["indexer_selftest"]["passed"] and "decode-bs32" in checks["indexer_selftest"]["details"]["table"]
    assert "Application startup complete." in (tmp_path / "out" / "server.log").read_text()
    # The checks waited for the image's healthcheck (its warm-up), not only for /health.
    healthy = checks["server_healthy"]["details"]
    assert healthy["time_to_healthy_s"] >= healthy["health_answered_s"] + STAND_IN_WARM_DELAY_S - 1.5, healthy
    assert smoke_containers(docker_client) == before


@pytest.mark.docker
def test_stand_in_gpu_request_refused_by_an_engine_without_gpus(docker_client, stand_in, tmp_path):
    if query_gpus().get("gpus"):
        pytest.skip("this host has a GPU: the request would be granted")
    image, port = stand_in()
    before = smoke_containers(docker_client)
    done = run_smoke_cli(image, tmp_path / "out", "--target", "sm90", timeout=300)
    report = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert done.returncode == 1
    reason = report["checks"][0]["reason"]
    assert reason.startswith("the server did not start: docker refused to start"), reason
    assert "gpu" in reason.lower()
    assert smoke_containers(docker_client) == before


@pytest.mark.docker
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stand_in_container_removed_on_a_signal(docker_client, stand_in, tmp_path, sig):
    image, port = stand_in(start_delay=300)
    before = smoke_containers(docker_client)
    argv = [sys.executable, str(SMOKE), "--runtime", "docker", "--image", image, "--no-gpus", "--target", "sm90",
            "--out", str(tmp_path / "out"), "--quiet"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(smoke_containers(docker_client)) == len(before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(smoke_containers(docker_client)) == len(before) + 1, "the smoke container never appeared"
    time.sleep(1)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert json.loads((tmp_path / "out" / REPORT_NAME).read_text())["interrupted"] is True
    assert smoke_containers(docker_client) == before


@pytest.fixture
def sleeper_image(docker_client, base_image, tmp_path):
    """An image the harness starts and that never answers /health: `sleep` on the base image,
    labelled like ours (no Python, no vLLM: it builds in seconds)."""
    port = free_port()
    context = tmp_path / "sleeper"
    context.mkdir()
    (context / "Dockerfile").write_text(
        f"FROM {base_image}\n"
        f"ENV DSA_IMAGE_PORT={port}\n"
        "LABEL dsa-image.target=sm90\n"
        'ENTRYPOINT ["sleep", "infinity"]\n'
    )
    tag = f"dsa-image-smoke-sleeper:{port}"
    docker_client.images.build(path=str(context), tag=tag, network_mode="host", rm=True)
    yield tag
    docker_client.images.remove(tag, force=True)


def container_status(client, name: str) -> str | None:
    try:
        return client.containers.get(name).status
    except NotFound:
        return None


@pytest.mark.docker
def test_a_container_left_by_a_sigkilled_run_is_removed_by_the_next_run(docker_client, sleeper_image, tmp_path):
    before = set(smoke_containers(docker_client))
    sleeper_run = ("--no-gpus", "--target", "sm90", "--quiet")
    argv = [sys.executable, str(SMOKE), "--runtime", "docker", "--image", sleeper_image, "--out",
            str(tmp_path / "killed"), "--health-timeout", "600", *sleeper_run]
    killed = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    left = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            new = set(smoke_containers(docker_client)) - before
            if new and container_status(docker_client, next(iter(new))) == "running":
                left = next(iter(new))
                break
            time.sleep(0.2)
        assert left, "the smoke container never ran"

        # Beside a live run, a run keeps that run's container and says whose it is.
        beside = run_smoke_cli(sleeper_image, tmp_path / "beside", "--health-timeout", "1", *sleeper_run,
                               timeout=120)
        assert f"smoke: kept smoke container {left} (" in beside.stderr, beside.stderr
        assert f"its owner, process {killed.pid} on " in beside.stderr and "still runs" in beside.stderr
        assert container_status(docker_client, left) == "running"

        killed.kill()
        killed.wait()
        # SIGKILL runs no cleanup: the container outlives its run.
        assert container_status(docker_client, left) == "running"

        after = run_smoke_cli(sleeper_image, tmp_path / "after", "--health-timeout", "1", *sleeper_run,
                              timeout=120)
        said = [line for line in after.stderr.splitlines()
                if line.startswith(f"smoke: removed smoke container {left} (")]
        assert said, after.stderr
        assert said[0].endswith(f"its owner, process {killed.pid} on {os.uname().nodename}, no longer runs")
        assert container_status(docker_client, left) is None
        report = json.loads((tmp_path / "after" / REPORT_NAME).read_text())
        assert {e["name"]: e["action"] for e in report["leftover_containers"]}[left] == "removed"
        # Other smoke runs may share the engine: count only containers of this test's image.
        assert docker_client.containers.list(all=True, filters={"ancestor": sleeper_image}) == []
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
        if left and container_status(docker_client, left) is not None:
            docker_client.containers.get(left).remove(force=True)


# --- the real engine and the real image -----------------------------------------------------


def smoke_containers(client) -> list[str]:
    return [c.name for c in client.containers.list(all=True, filters={"label": SMOKE_LABEL})]


def run_smoke_cli(image: str, out: Path, *extra: str, timeout: int = 900) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(SMOKE), "--runtime", "docker", "--image", image, "--out", str(out), *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=out.parent)


IN_IMAGE_MODEL_CHECK = """\
import sys
from dsa_image.build.tiny_model import CONFIG, model_dir_differences
from transformers import AutoConfig, AutoTokenizer
model = sys.argv[1]
differences = model_dir_differences(model)
config, tokenizer = AutoConfig.from_pretrained(model), AutoTokenizer.from_pretrained(model)
print(f"differences={differences} model_type={config.model_type} tokens={len(tokenizer)}")
sys.exit(1 if differences or len(tokenizer) != CONFIG["vocab_size"] else 0)
"""


@pytest.mark.docker
def test_the_image_carries_the_generators_tiny_model(docker_client, runtime_image):
    """The built-in model is byte-for-byte what the generator writes, and the image's own
    transformers (the one vLLM uses) loads it offline with vocab_size tokens."""
    generator = "/tmp/dsa-image-generator"  # build code the runtime image does not carry: this checkout's
    output = docker_client.containers.run(
        runtime_image, entrypoint=["/opt/venv/bin/python", "-B", "-c", IN_IMAGE_MODEL_CHECK,
                                   RECIPE.serving["default_model"]],
        volumes={str(REPO / "dsa_image"): {"bind": f"{generator}/dsa_image", "mode": "ro"}},
        environment={"PYTHONPATH": generator, "HF_HUB_OFFLINE": "1"}, network_mode="host",
        labels={SMOKE_LABEL: "tiny-model-check"}, remove=True, stderr=True).decode()
    assert "differences=[] model_type=glm_moe_dsa tokens=1024" in output, output


@pytest.mark.docker
@pytest.mark.slow
def test_real_image_without_a_gpu_fails_cleanly(docker_client, runtime_image, tmp_path):
    """CI has Docker and no GPU: the GPU request is refused (or, where the NVIDIA runtime exists,
    the server exits); the report names it, the run exits 1, and no container is left."""
    if query_gpus().get("gpus"):
        pytest.skip("this host has a GPU: the full smoke runs in test_real_image_on_a_gpu")
    before = smoke_containers(docker_client)
    done = run_smoke_cli(runtime_image, tmp_path / "out", "--health-timeout", "600")
    report = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert done.returncode == 1, done.stderr[-3000:]
    first = report["checks"][0]
    assert first["name"] == "server_healthy" and not first["passed"]
    assert "did not start" in first["reason"] or "exited with code" in first["reason"], first["reason"]
    assert report["image"]["labels"]["dsa-image.target"] == "sm120"
    # The runtime image is the default base's: its label, its receipt and the recipe agree.
    assert (report["image"]["labels"]["dsa-image.vllm.version"] == report["receipt"]["vllm_version"]
            == load_recipe().vllm_version) and report["receipt"]["recipe"]
    assert (tmp_path / "out" / "server.log").exists() and report["log_tail"] is not None
    assert "FAIL server_healthy" in done.stderr
    assert smoke_containers(docker_client) == before


@pytest.mark.docker
@pytest.mark.slow
def test_real_image_without_a_gpu_request_exits_early_with_its_log(docker_client, runtime_image, tmp_path):
    """Started without a GPU request, the image refuses to serve in one line (NO_GPU, no
    traceback): the exit code and that line are in the report, and the container is gone."""
    if query_gpus().get("gpus"):
        pytest.skip("this host has a GPU")
    before = smoke_containers(docker_client)
    done = run_smoke_cli(runtime_image, tmp_path / "out", "--no-gpus", "--health-timeout", "600")
    report = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert done.returncode == 1, done.stderr[-3000:]
    reason = report["checks"][0]["reason"]
    assert f"exited with code {status.NO_GPU}" in reason, reason
    log = (tmp_path / "out" / "server.log").read_text()
    assert "dsa-image: no usable NVIDIA GPU is visible" in log and "Traceback" not in log
    assert log.strip() and log.strip()[-200:] in report["log_tail"]
    assert smoke_containers(docker_client) == before


@pytest.mark.docker
@pytest.mark.gpu
@pytest.mark.slow
def test_real_image_on_a_gpu(docker_client, gpu, request, bake_options, tmp_path):
    """On a GPU runner: the image of the GPU's target passes every check."""
    from dsa_image.build import image_build

    capability = capability_of(query_gpus())
    if capability is None:
        pytest.skip("nvidia-smi does not report one compute capability for the GPUs")
    target = target_for_capability(RECIPE, capability).id
    if target == "sm120":
        image = request.getfixturevalue("runtime_image")
    else:
        image = image_build.bake(REPO, target, bake_options).tags[0]
    before = smoke_containers(docker_client)
    done = run_smoke_cli(image, tmp_path / "out", "--health-timeout", "900", timeout=1800)
    report = json.loads((tmp_path / "out" / REPORT_NAME).read_text())
    assert done.returncode == 0, {c["name"]: c["reason"] for c in report["checks"] if not c["passed"]}
    assert [c["name"] for c in report["checks"]] == list(C.ALL_CHECKS)
    assert smoke_containers(docker_client) == before
