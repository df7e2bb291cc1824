"""The image's HEALTHCHECK: GET /health where `vllm serve` in this container really listens,
and, when the server runs under the warm-up supervisor, its readiness marker.

    python -m dsa_image.runtime.healthcheck        exit 0 healthy, 1 not (one line saying why)

The port and host come from the command line of the `vllm serve` process (the supervisor's
child, PID 1 when the entrypoint exec'd vLLM itself, another PID under `docker run --init`),
read from /proc: `--port 9000`, `--port=9000`, `--host`, https when `--ssl-certfile` is given,
the socket of `--uds PATH`, and the same keys of a `--config` file (read from the server's
working directory; dsa_image.runtime.serve_command, the reader the warm-up and the entrypoint use too).
A server the supervisor started (DSA_IMAGE_WARM_MARKER in its environment) is healthy only once
its marker says it is warm (dsa_image.runtime.warmup.warm_problem): vLLM's /health answers before the
first requests' kernels are compiled. Whatever it cannot read (a port that is no number, a host
with a space, a config file it cannot parse, a marker that is no JSON object) is an unhealthy
answer saying so, exit 1. Nothing is written here (a read-only root filesystem works). Stdlib only.
"""

from __future__ import annotations

import http.client
import socket
import sys
from pathlib import Path

from dsa_image.runtime import serve_command
from dsa_image.core.endpoint import Endpoint
from dsa_image.runtime.warmup import warm_problem
from dsa_image.core import status

PROC = Path("/proc")
TIMEOUT_S = 8  # under the Dockerfile's HEALTHCHECK --timeout

# How `vllm serve` shows up in argv: the console script (any path), or the module it runs.
_CLI_MODULE = "vllm.entrypoints.cli.main"
_API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # takes the serve flags directly
# The warm-up supervisor carries `vllm serve ...` in its own argv but is not the server: its
# child is (the marker names the child, and only the child has the marker in its environment).
_SUPERVISOR_MODULE = "dsa_image.runtime.warmup"


class NoServer(status.DsaImageError):
    """No `vllm serve` process in this container."""


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
    # `-m dsa_image.runtime.warmup` or the entrypoint's `-c "... from dsa_image.runtime.warmup import main ..."`.
    return any(_SUPERVISOR_MODULE in part for part in before_server)


def endpoint_of(args: list[str], cwd: Path | None = None) -> Endpoint:
    """Where the server with these arguments listens (its --config file read from `cwd`, the
    server's working directory). Raises ValueError (a ConfigError for the file)."""
    return serve_command.endpoint_of(serve_command.parse(args, cwd))


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
    first = " ".join(_pid1_cmdline(proc)) or "(empty or unreadable)"
    raise NoServer(f"no `vllm serve` process in this container (PID 1: {first})")


def probe(endpoint: Endpoint, timeout: float = TIMEOUT_S) -> str | None:
    """None when GET /health answers 200, else why not."""
    try:
        status = endpoint.request("/health", timeout=timeout)[0]
    except (OSError, http.client.HTTPException) as exc:
        return f"GET {endpoint.url('/health')}: {exc}"
    return None if status == 200 else f"GET {endpoint.url('/health')}: HTTP {status}"


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
    port_text = serve_command.cli_value(args, "--port") or "6379"
    if not port_text.isdigit():
        return f"the Ray head's --port {port_text!r} is no port number"
    port, host = int(port_text), serve_command.cli_value(args, "--node-ip-address") or "127.0.0.1"
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return f"the Ray head's GCS at {host}:{port} does not answer ({exc})"
    return None


def _pid1_cmdline(proc: Path) -> list[str]:
    try:
        return read_cmdline(proc / "1")
    except OSError:
        return []


def _say(line: str) -> None:
    # A path from /proc may be any bytes (os.fsdecode keeps them as surrogates): shown escaped.
    print(line.encode("utf-8", "backslashreplace").decode("utf-8"))


# Docker's HEALTHCHECK codes, not ours to number: 0 healthy, 1 unhealthy. They are the table's
# SUCCESS and FAILED (dsa_image/core/status.py's docstring), so those names say them.
HEALTHY, UNHEALTHY = status.SUCCESS, status.FAILED


def main(proc: Path = PROC) -> int:
    try:
        pid, args = find_server(proc)
        endpoint = endpoint_of(args, proc / str(pid) / "cwd")
    except (NoServer, ValueError) as exc:
        ray = ray_node_args(_pid1_cmdline(proc))
        if ray is not None:  # a Ray node of the cluster modes, serving nothing itself (yet)
            problem = ray_node_problem(ray)
            _say(f"unhealthy: {problem}" if problem else "healthy: Ray node (ray start) running")
            return UNHEALTHY if problem else HEALTHY
        _say(f"unhealthy: {exc}")
        return UNHEALTHY
    problem = probe(endpoint)
    if problem is None:
        warm = warm_problem(pid, proc)
        problem = f"{endpoint.url('/health')} answers, but {warm}" if warm else None
    _say(f"unhealthy: {problem}" if problem else f"healthy: {endpoint.url('/health')}")
    return UNHEALTHY if problem else HEALTHY


if __name__ == "__main__":
    sys.exit(main())
