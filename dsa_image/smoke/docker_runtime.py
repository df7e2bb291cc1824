"""The image as a container, through the Docker SDK for Python (imported here only).

The container is created, then started, as two steps: when the start fails (no GPU, no
NVIDIA runtime) the created container still exists, and `stop` removes it. Every container
carries the label SMOKE_LABEL, so a test can prove none is left behind, and the labels naming
the process that owns it (`owner.py`): a run killed with SIGKILL cannot remove its container,
so each run, before starting its own, removes those whose owner is gone and names the others.
"""

from __future__ import annotations

import io
import json
import sys
import tarfile
import uuid
from pathlib import Path, PurePosixPath
from typing import IO

import docker
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.models.containers import Container
from docker.types import DeviceRequest

from dsa_image.smoke.gpu import gpus_held, host_runner, query_gpus
from dsa_image.smoke.layout import GpuRequest, query_shm
from dsa_image.smoke.owner import (ALIVE, CLEANUP_COMMAND, GONE, RUN_LABEL, UNKNOWN, Host, judge, owner_labels,
                                   this_host)
from dsa_image.smoke.report import Report
from dsa_image.smoke.run import LogFollower, StartError

SMOKE_LABEL = RUN_LABEL
RECEIPT_PATH = "/opt/dsa-image/receipt.json"
# The image's entrypoint offers `verify` (receipt hash + scripts/overlay.py verify against the
# image's own site-packages): exec'd in the running container, it checks the code that serves.
VERIFY_ARG = "verify"
VLLM_LABEL = "dsa-image.vllm.version"


def image_env(image) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in image.attrs.get("Config", {}).get("Env") or [])
    return {k: v for k, v in pairs}


def sweep_leftovers(client, console: IO[str], host: Host | None = None) -> list[dict]:
    """Remove the smoke containers whose owning run is gone; name every one found, one line
    each on `console`, removed or kept and why. What was found, for the report."""
    host = host or this_host()
    try:
        containers = client.containers.list(all=True, filters={"label": SMOKE_LABEL}, ignore_removed=True)
    except DockerException as e:
        console.write(f"smoke: could not look for smoke containers left by earlier runs: {e}\n")
        return []
    found = []
    for container in containers:
        labels = container.labels or {}
        verdict = judge(labels, host)
        entry = {"name": container.name, "id": container.short_id, "status": container.status,
                 "run": labels.get(SMOKE_LABEL), "owner": verdict.state, "why": verdict.why}
        what = f"smoke container {container.name} ({container.short_id}, {container.status})"
        if verdict.state == GONE:
            try:
                container.remove(force=True)
                entry["action"] = "removed"
            except NotFound:
                entry["action"] = "removed"  # another run swept it first
            except DockerException as e:
                entry["action"] = "kept"
                entry["why"] += f"; removing it failed: {e}"
        else:
            entry["action"] = "kept"
        line = f"smoke: {entry['action']} {what}: {entry['why']}"
        if entry["action"] == "kept" and verdict.state != ALIVE:
            line += f"; once no smoke run uses it: docker rm -f {container.name}"
        console.write(line + "\n")
        found.append(entry)
    if any(e["action"] == "kept" and e["owner"] == UNKNOWN for e in found):
        console.write(f"smoke: every smoke container, when no smoke run is going on: {CLEANUP_COMMAND}\n")
    return found


def engine_client():
    """The Docker SDK's client of the engine DOCKER_HOST (or the default socket) names, answering."""
    try:
        client = docker.from_env()
        client.ping()
    except DockerException as e:
        raise StartError(f"no Docker engine answers ({e}); start dockerd or use --runtime local") from None
    return client


def find_image(client, image_ref: str):
    """The image `image_ref` names, pulled when the engine has no such image."""
    try:
        return client.images.get(image_ref)
    except ImageNotFound:
        try:
            return client.images.pull(image_ref)
        except DockerException as e:
            raise StartError(f"image {image_ref} is not here and cannot be pulled: {e}") from None


class DockerServer:
    """`gpus`: what the container asks for (None: no GPU request); `env`: variables the
    container gets (the layout's, e.g. Ray's log settings)."""

    def __init__(self, image_ref: str, command: list[str], port: int, network: str, gpus: GpuRequest | None,
                 log_path: Path, echo: IO[str] | None, client=None, console: IO[str] | None = None,
                 env: dict[str, str] | None = None, image=None):
        self.image_ref = image_ref
        self.command = command
        self.port = port
        self.network = network
        self.gpus = gpus
        self.env = dict(env or {})
        self.run_host = host_runner  # nvidia-smi on this host; tests put a fake here
        self.log_path = log_path
        self.echo = echo
        # What the run itself says (leftover containers): shown even with --quiet, which
        # silences only the server's log.
        self.console = console
        self.leftovers: list[dict] = []
        self.run_id = uuid.uuid4().hex[:12]
        self.client = client
        self.image = image  # the Docker SDK's image of image_ref, when the caller has looked it up
        self.container: Container | None = None
        self.follower: LogFollower | None = None
        self.base_url = f"http://127.0.0.1:{port}"
        self.verify_command = f"docker exec CONTAINER <image entrypoint> {VERIFY_ARG}"
        self._final_log: str | None = None

    # -- start ---------------------------------------------------------------------------

    def _client(self):
        if self.client is None:
            self.client = engine_client()
        return self.client

    def _image(self):
        if self.image is None:
            self.image = find_image(self._client(), self.image_ref)
        return self.image

    def start(self) -> None:
        image = self._image()
        self.verify_command = "docker exec CONTAINER " + " ".join(self.verify_argv())
        self.leftovers = sweep_leftovers(self._client(), self.console or sys.stderr)
        # ipc=host: vLLM's workers and Ray's object store share memory through /dev/shm, and
        # with the host's IPC the container mounts the host's /dev/shm (Docker applies a
        # shm_size only to a private IPC namespace, so none is passed).
        options = dict(
            image=image.id, command=self.command or None, detach=True, name=f"dsa-smoke-{self.run_id}",
            labels={SMOKE_LABEL: self.run_id, **owner_labels()}, ipc_mode="host",
        )
        if self.env:
            options["environment"] = self.env
        if self.gpus is not None:
            options["device_requests"] = [DeviceRequest(capabilities=[["gpu"]], **self.gpus.docker_kwargs())]
        if self.network == "host":
            options["network_mode"] = "host"
        else:
            options["ports"] = {f"{self.port}/tcp": ("127.0.0.1", None)}
        try:
            # Kept before it starts: a container that fails to start is still one `stop` removes.
            self.container = container = self._client().containers.create(**options)
            container.start()
        except APIError as e:
            hint = (" (the GPU request failed: is the NVIDIA container toolkit installed and a GPU present?)"
                    if self.gpus is not None and "gpu" in str(e).lower() else "")
            raise StartError(f"docker refused to start {self.image_ref}: {e.explanation or e}{hint}") from None
        if self.network != "host":
            container.reload()
            host_port = container.ports[f"{self.port}/tcp"][0]["HostPort"]
            self.base_url = f"http://127.0.0.1:{host_port}"
        self.follower = LogFollower(container.logs(stream=True, follow=True), self.log_path, self.echo).start()

    # -- while running -------------------------------------------------------------------

    def exit_code(self) -> int | None:
        if self.container is None:
            return None
        try:
            self.container.reload()
        except NotFound:
            return -1
        state = self.container.attrs.get("State", {})
        return state.get("ExitCode") if state.get("Status") in ("exited", "dead") else None

    def log_text(self) -> str:
        if self._final_log is not None:
            return self._final_log
        if self.container is None:
            return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        try:
            return self.container.logs(stdout=True, stderr=True).decode(errors="replace")
        except NotFound:
            return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _exec(self, argv: list[str]) -> tuple[int, str]:
        if self.container is None or self.exit_code() is not None:
            return 125, "the container is not running"
        code, output = self.container.exec_run(argv)
        return code, output.decode(errors="replace")

    def warm_problem(self) -> str | None:
        """The image's own HEALTHCHECK command, exec'd now (not Docker's last periodic result, up to
        an interval old): None when it passes, else what it said."""
        test = (self._image().attrs.get("Config", {}).get("Healthcheck") or {}).get("Test") or []
        if not test or test[0] == "NONE":
            return None  # an image without a healthcheck: /health is all there is
        argv = test[1:] if test[0] == "CMD" else ["/bin/sh", "-c", " ".join(test[1:])]
        code, output = self._exec(argv)
        return None if code == 0 else (output.strip() or f"the healthcheck exited {code}")

    def verify_argv(self) -> list[str]:
        entrypoint = self._image().attrs.get("Config", {}).get("Entrypoint") or []
        return [*entrypoint, VERIFY_ARG]

    def run_verify(self) -> tuple[int, str]:
        return self._exec(self.verify_argv())

    def run_selftest(self) -> tuple[int, str]:
        """The image's `selftest` mode, exec'd in the serving container (same GPU, same image)."""
        entrypoint = self._image().attrs.get("Config", {}).get("Entrypoint") or []
        return self._exec([*entrypoint, "selftest", "--json", "-"])

    def receipt(self) -> dict | None:
        """The image's overlay receipt, copied out of the container: works whether it runs,
        exited, or was created and never started."""
        if self.container is None:
            return None
        try:
            chunks, _ = self.container.get_archive(RECEIPT_PATH)
            with tarfile.open(fileobj=io.BytesIO(b"".join(chunks))) as tar:
                member = tar.extractfile(PurePosixPath(RECEIPT_PATH).name)
                return json.loads(member.read()) if member else None
        except (DockerException, tarfile.TarError, KeyError, ValueError):
            return None

    def run_command(self) -> list[str]:
        """The `docker run` command line that starts the same container (for the report)."""
        argv = ["docker", "run", "--rm", "--ipc=host"]
        if self.gpus is not None:
            argv += ["--gpus", self.gpus.cli()]
        argv += ["--network", "host"] if self.network == "host" else ["-p", f"127.0.0.1::{self.port}"]
        argv += [part for key, value in sorted(self.env.items()) for part in ("-e", f"{key}={value}")]
        return [*argv, self.image_ref, *self.command]

    def _container_pids(self) -> set[int]:
        """The container's processes as the host numbers them (what the host's nvidia-smi lists)."""
        if self.container is None:
            return set()
        try:
            top = self.container.top()
        except DockerException:
            return set()
        titles = top.get("Titles") or []
        if "PID" not in titles:
            return set()
        column = titles.index("PID")
        return {int(row[column]) for row in top.get("Processes") or [] if str(row[column]).isdigit()}

    def layout_facts(self) -> dict:
        pids = self._container_pids()
        return {"gpus_used": gpus_held(pids.__contains__, self.run_host, "host"),
                "shm": query_shm(self._exec, "in the container")}

    def gpu_info(self) -> dict:
        info = query_gpus(host_runner, "host")
        if info.get("gpus") or self.container is None:
            return info
        return query_gpus(self._exec, "in the container")

    def describe(self, report: Report) -> None:
        image = self.image
        if image is None:
            return
        labels = image.labels or {}
        report.image = {
            "ref": self.image_ref,
            "id": image.id,
            "repo_digests": image.attrs.get("RepoDigests") or [],
            "created": image.attrs.get("Created"),
            "labels": {k: v for k, v in labels.items() if k.startswith(("dsa-image.", "org.opencontainers."))},
            "container": self.container.name if self.container is not None else None,
        }
        report.leftovers = self.leftovers
        if labels.get(VLLM_LABEL):
            report.versions["vllm_image_label"] = labels[VLLM_LABEL]

    def image_target(self) -> str | None:
        return (self._image().labels or {}).get("dsa-image.target")

    def image_port(self, default: int) -> int:
        return int(image_env(self._image()).get("DSA_IMAGE_PORT", default))

    # -- stop ----------------------------------------------------------------------------

    def stop(self) -> None:
        container, self.container = self.container, None
        if container is None:
            return
        try:
            self._final_log = container.logs(stdout=True, stderr=True).decode(errors="replace")
        except DockerException:
            pass
        try:
            container.remove(force=True)
        except NotFound:
            pass
        if self.follower:
            self.follower.join()
