"""The image's HEALTHCHECK: GET /health where `vllm serve` in this container really listens,
and, when the server runs under the warm-up supervisor, its readiness marker.

    python -m dsa_image.healthcheck        exit 0 healthy, 1 not (one line saying why)

The port and host come from the command line of the `vllm serve` process (the supervisor's
child, PID 1 when the entrypoint exec'd vLLM itself, another PID under `docker run --init`),
read from /proc: `--port 9000`, `--port=9000`, `--host`, https when `--ssl-certfile` is given,
the socket of `--uds PATH`. A server the supervisor started (DSA_IMAGE_WARM_MARKER in its
environment) is healthy only once its marker says it is warm (dsa_image.warmup.warm_problem):
vLLM's /health answers before the first requests' kernels are compiled. Nothing is written
here (a read-only root filesystem works). A port set only in a `--config` file is not seen:
pass --port on the command line. Stdlib only.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# vLLM's own default when no --port is given (the entrypoint always passes one).
VLLM_DEFAULT_PORT = 8000
PROC = Path("/proc")
TIMEOUT_S = 8  # under the Dockerfile's HEALTHCHECK --timeout

# How `vllm serve` shows up in argv: the console script (any path), or the module it runs.
_CLI_MODULE = "vllm.entrypoints.cli.main"
_API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # takes the serve flags directly
# The warm-up supervisor carries `vllm serve ...` in its own argv but is not the server: its
# child is (the marker names the child, and only the child has the marker in its environment).
_SUPERVISOR_MODULE = "dsa_image.warmup"


class NoServer(Exception):
    """No `vllm serve` process in this container."""


@dataclass(frozen=True)
class Endpoint:
    scheme: str
    host: str
    port: int
    uds: str | None = None  # vLLM's --uds: a Unix socket instead of host and port

    @property
    def url(self) -> str:
        if self.uds:
            return f"http+unix://{self.uds}:/health"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}/health"


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over vLLM's --uds socket (also used by dsa_image.warmup)."""

    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def serve_args(cmdline: list[str]) -> list[str] | None:
    """The arguments vLLM's server was given, or None when `cmdline` is not a vLLM server."""
    for i in range(len(cmdline) - 1):
        if cmdline[i + 1] == "serve" and (Path(cmdline[i]).name == "vllm" or cmdline[i] == _CLI_MODULE):
            return None if _supervisor(cmdline[:i]) else cmdline[i + 2:]
    if _API_SERVER_MODULE in cmdline:
        i = cmdline.index(_API_SERVER_MODULE)
        return None if _supervisor(cmdline[:i]) else cmdline[i + 1:]
    return None


def _supervisor(before_server: list[str]) -> bool:
    # `-m dsa_image.warmup` or the entrypoint's `-c "... from dsa_image.warmup import main ..."`.
    return any(_SUPERVISOR_MODULE in part for part in before_server)


def _flag(args: list[str], name: str) -> str | None:
    """The value of --name, the last one given wins (as argparse does); vLLM takes _ for -."""
    value = None
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        if not flag.startswith("--") or flag.replace("_", "-") != name:
            continue
        if eq:
            value = inline
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


def endpoint_of(args: list[str]) -> Endpoint:
    port = _flag(args, "--port")
    host = _flag(args, "--host") or ""
    # A wildcard address listens on loopback too; a specific one only there.
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    scheme = "https" if _flag(args, "--ssl-certfile") else "http"
    return Endpoint(scheme, host, int(port) if port else VLLM_DEFAULT_PORT, _flag(args, "--uds"))


def read_cmdline(pid_dir: Path) -> list[str]:
    raw = (pid_dir / "cmdline").read_bytes()
    return [part.decode(errors="replace") for part in raw.split(b"\0")[:-1]] if raw else []


def find_server(proc: Path = PROC) -> tuple[int, list[str]]:
    """The pid and arguments of the `vllm serve` process: PID 1 first, then the lowest other
    (vLLM's own workers rename themselves VLLM::..., and start after it)."""
    pids = sorted((int(p.name) for p in proc.iterdir() if p.name.isdigit()), key=lambda pid: (pid != 1, pid))
    for pid in pids:
        try:
            args = serve_args(read_cmdline(proc / str(pid)))
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if args is not None:
            return pid, args
    try:
        first = " ".join(read_cmdline(proc / "1")) or "(empty)"
    except OSError as exc:
        first = f"(unreadable: {exc})"
    raise NoServer(f"no `vllm serve` process in this container (PID 1: {first})")


def probe(endpoint: Endpoint, timeout: float = TIMEOUT_S) -> str | None:
    """None when GET /health answers 200, else why not."""
    if endpoint.uds:
        connection = UnixHTTPConnection(endpoint.uds, timeout)
        try:
            connection.request("GET", "/health")
            status = connection.getresponse().status
        except OSError as exc:
            return f"GET {endpoint.url}: {exc}"
        finally:
            connection.close()
        return None if status == 200 else f"GET {endpoint.url}: HTTP {status}"
    context = None
    if endpoint.scheme == "https":
        # Liveness of our own server: its certificate may name a public host, not 127.0.0.1.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(endpoint.url, timeout=timeout, context=context) as response:
            status = response.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (OSError, ValueError) as exc:
        return f"GET {endpoint.url}: {getattr(exc, 'reason', exc)}"
    return None if status == 200 else f"GET {endpoint.url}: HTTP {status}"


def ray_node_args(cmdline: list[str]) -> list[str] | None:
    """The flags of `ray start` (the image's ray-head / ray-worker modes), or None."""
    for i in range(len(cmdline) - 1):
        if Path(cmdline[i]).name == "ray" and cmdline[i + 1] == "start":
            return cmdline[i + 2:]
    return None


def ray_node_problem(args: list[str], timeout: float = TIMEOUT_S) -> str | None:
    """A Ray node is up while its `ray start --block` runs (it is PID 1: the container ends with
    it); the head, also when its GCS port takes connections."""
    if "--head" not in args:
        return None
    port = int(_flag(args, "--port") or 6379)
    host = _flag(args, "--node-ip-address") or "127.0.0.1"
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return f"the Ray head's GCS at {host}:{port} does not answer ({exc})"
    return None


def main(proc: Path = PROC) -> int:
    try:
        pid, args = find_server(proc)
        endpoint = endpoint_of(args)
    except (NoServer, ValueError) as exc:
        ray = ray_node_args(read_cmdline(proc / "1")) if (proc / "1").is_dir() else None
        if ray is not None:  # a Ray node of the cluster modes, serving nothing itself (yet)
            problem = ray_node_problem(ray)
            print(f"unhealthy: {problem}" if problem else "healthy: Ray node (ray start) running")
            return 1 if problem else 0
        print(f"unhealthy: {exc}")
        return 1
    problem = probe(endpoint)
    if problem is None:
        from .warmup import warm_problem  # imported here: dsa_image.warmup imports this module

        warm = warm_problem(pid, proc)
        problem = f"{endpoint.url} answers, but {warm}" if warm else None
    print(f"unhealthy: {problem}" if problem else f"healthy: {endpoint.url}")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
