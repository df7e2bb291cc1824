"""The image as a container, through the Docker SDK for Python (imported here only).

The container is created, then started, as two steps: when the start fails (no GPU, no
NVIDIA runtime) the created container still exists, and `stop` removes it. Every container
carries the label SMOKE_LABEL, so a test can prove none is left behind.
"""

from __future__ import annotations

import io
import json
import tarfile
import uuid
from pathlib import Path, PurePosixPath
from typing import IO

import docker
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.types import DeviceRequest

from dsa_image.smoke.gpu import host_runner, query_gpus
from dsa_image.smoke.report import Report
from dsa_image.smoke.run import LogFollower, StartError

SMOKE_LABEL = "dsa-image.smoke"
RECEIPT_PATH = "/opt/dsa-image/receipt.json"
# The image's entrypoint offers `verify` (receipt hash + scripts/overlay.py verify against the
# image's own site-packages): exec'd in the running container, it checks the code that serves.
VERIFY_ARG = "verify"


def image_env(image) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in image.attrs.get("Config", {}).get("Env") or [])
    return {k: v for k, v in pairs}


class DockerServer:
    def __init__(self, image_ref: str, command: list[str], port: int, network: str, gpus: bool,
                 log_path: Path, echo: IO[str] | None, client=None):
        self.image_ref = image_ref
        self.command = command
        self.port = port
        self.network = network
        self.gpus = gpus
        self.log_path = log_path
        self.echo = echo
        self.run_id = uuid.uuid4().hex[:12]
        self.client = client
        self.image = None
        self.container = None
        self.follower: LogFollower | None = None
        self.base_url = f"http://127.0.0.1:{port}"
        self.verify_command = f"docker exec CONTAINER <image entrypoint> {VERIFY_ARG}"
        self._final_log: str | None = None

    # -- start ---------------------------------------------------------------------------

    def _client(self):
        if self.client is None:
            try:
                self.client = docker.from_env()
                self.client.ping()
            except DockerException as e:
                raise StartError(f"no Docker engine answers ({e}); start dockerd or use --runtime local") from None
        return self.client

    def _image(self):
        if self.image is None:
            client = self._client()
            try:
                self.image = client.images.get(self.image_ref)
            except ImageNotFound:
                try:
                    self.image = client.images.pull(self.image_ref)
                except DockerException as e:
                    raise StartError(f"image {self.image_ref} is not here and cannot be pulled: {e}") from None
        return self.image

    def start(self) -> None:
        image = self._image()
        self.verify_command = "docker exec CONTAINER " + " ".join(self.verify_argv())
        options = dict(
            image=image.id, command=self.command or None, detach=True, name=f"dsa-smoke-{self.run_id}",
            labels={SMOKE_LABEL: self.run_id}, ipc_mode="host",  # vLLM's workers share memory
        )
        if self.gpus:
            options["device_requests"] = [DeviceRequest(count=-1, capabilities=[["gpu"]])]
        if self.network == "host":
            options["network_mode"] = "host"
        else:
            options["ports"] = {f"{self.port}/tcp": ("127.0.0.1", None)}
        try:
            self.container = self._client().containers.create(**options)
            self.container.start()
        except APIError as e:
            hint = (" (the GPU request failed: is the NVIDIA container toolkit installed and a GPU present?)"
                    if self.gpus and "gpu" in str(e).lower() else "")
            raise StartError(f"docker refused to start {self.image_ref}: {e.explanation or e}{hint}") from None
        if self.network != "host":
            self.container.reload()
            host_port = self.container.ports[f"{self.port}/tcp"][0]["HostPort"]
            self.base_url = f"http://127.0.0.1:{host_port}"
        self.follower = LogFollower(self.container.logs(stream=True, follow=True), self.log_path, self.echo).start()

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

    def verify_argv(self) -> list[str]:
        entrypoint = self._image().attrs.get("Config", {}).get("Entrypoint") or []
        return [*entrypoint, VERIFY_ARG]

    def run_verify(self) -> tuple[int, str]:
        return self._exec(self.verify_argv())

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
        if labels.get("dsa-image.vllm.version"):
            report.versions["vllm_image_label"] = labels["dsa-image.vllm.version"]

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
