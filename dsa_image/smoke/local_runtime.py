"""`vllm serve` as a subprocess of a given Python environment, for GPU hosts without Docker.

The server runs in its own process group (vLLM starts an engine-core process and compile
workers): stopping it signals the whole group, SIGTERM then SIGKILL.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

from dsa_image.core.recipe import Recipe, Target
from dsa_image.core.site_path import pythonpath
from dsa_image.smoke.gpu import gpus_held, host_runner, query_gpus, query_inventory
from dsa_image.smoke.layout import (SINGLE_GPU, Layout, LayoutError, check_fits, layout_record, query_shm,
                                    visible_local, visible_ray_cluster)
from dsa_image.smoke.owner import parent_pid
from dsa_image.smoke.report import Report
from dsa_image.smoke.run import LogFollower, StartError

REPO = Path(__file__).resolve().parents[2]
OVERLAY_TOOL = REPO / "scripts" / "overlay.py"
RECEIPT_NAME = "vllm_overlay_receipt.json"
STOP_GRACE_S = 30.0
RAY_PROBE_TIMEOUT_S = 120
VERSIONS_PROBE_TIMEOUT_S = 60  # reads dist-info metadata, imports no vLLM: seconds even on a cold disk
MAX_PROCESS_DEPTH = 32  # server -> engine core -> raylet -> worker -> ...: far fewer in practice

# Run by the served environment's Python (its env, cwd "/"): is Ray importable, and which cluster
# will vLLM's `ray.init(address=None)` use? Ray's own resolution (RAY_ADDRESS, else the cluster a
# `ray start` here recorded, else None: a new local instance). A cluster to join is asked for its
# alive nodes, so the preflight counts its GPUs and a dead recorded address is caught before vLLM
# hits it. Prints one JSON line.
VERSIONS_PROBE = ("import importlib.metadata as m, json, sys; "
                  "print(json.dumps({'python': sys.version.split()[0], 'vllm': m.version('vllm')}))")

RAY_PROBE = """\
import json, sys
out = {}
try:
    import ray
except BaseException as e:
    print(json.dumps({"import_error": f"{type(e).__name__}: {e}"}))
    sys.exit(0)
out["version"] = getattr(ray, "__version__", None)
out["module"] = getattr(ray, "__file__", None)
try:
    from ray._private.services import canonicalize_bootstrap_address
    out["joins"] = canonicalize_bootstrap_address(None)
except Exception as e:
    out["joins_error"] = f"{type(e).__name__}: {e}"
if out.get("joins"):
    try:
        ray.init(address=out["joins"], logging_level="ERROR", log_to_driver=False)
        out["nodes"] = [{"ip": n.get("NodeManagerAddress"), "resources": n.get("Resources", {})}
                        for n in ray.nodes() if n.get("Alive")]
        ray.shutdown()
    except Exception as e:
        out["cluster_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def serve_command(python: str, model: str, recipe: Recipe, target: Target, port: int, load_format: str,
                  extra_args: list[str]) -> list[str]:
    """`vllm serve` with the recipe's serving defaults for `target`; extra args come last (win)."""
    serving = recipe.serving
    return [
        python, "-m", "vllm.entrypoints.cli.main", "serve", model,
        "--served-model-name", serving["served_model_name"],
        "--max-model-len", str(serving["max_model_len"]),
        "--kv-cache-dtype", target.kv_cache_dtype,
        "--load-format", load_format,
        "--host", "127.0.0.1",
        "--port", str(port),
        *extra_args,
    ]


class LocalServer:
    def __init__(self, command: list[str], python: str, site_packages: str | None, env: dict[str, str],
                 port: int, log_path: Path, echo: IO[str] | None, versions: dict[str, str]):
        """`versions`: environment_versions() of `python` with the site (its vLLM is the base checked)."""
        self.command = command
        self.python = python
        self.site_packages = site_packages
        self.env = env
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.echo = echo
        self.proc: subprocess.Popen | None = None
        self.follower: LogFollower | None = None
        self._stopped = False
        self.run_host = host_runner  # nvidia-smi and df on this host; tests put fakes here
        self.versions = versions
        verify = [str(OVERLAY_TOOL), "verify", "--python", python, "--vllm", versions["vllm"]]
        if site_packages:
            verify += ["--site-packages", site_packages]
        self.verify_argv = [python, "-B", *verify]
        self.verify_command = " ".join(verify)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_bytes(b"")
        try:
            # cwd "/": vLLM must be imported from the environment, never from a checkout here.
            self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env, cwd="/", start_new_session=True)
        except OSError as e:
            raise StartError(f"{self.command[0]}: {e}") from None
        stdout = self.proc.stdout
        if not isinstance(stdout, io.BufferedReader):  # stdout=PIPE, default buffering: always one
            self.stop()
            raise StartError(f"{self.command[0]}: started without a pipe to read its log from")
        chunks = iter(lambda: stdout.read1(65536), b"")
        self.follower = LogFollower(chunks, self.log_path, self.echo).start()

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def warm_problem(self) -> str | None:
        return None  # `vllm serve` itself, no warm-up supervisor: ready when /health answers

    def run_verify(self) -> tuple[int, str]:
        done = subprocess.run(self.verify_argv, capture_output=True, text=True, env=self.env, cwd="/", timeout=600)
        return done.returncode, done.stdout + done.stderr

    def run_selftest(self) -> tuple[int, str]:
        """dsa_image.runtime.selftest with the served environment's vLLM first on the path, then this
        checkout (for dsa_image itself); cwd "/" as for the server."""
        paths = [str(p) for p in (self._site(), REPO) if p]
        env = {**self.env, "PYTHONPATH": os.pathsep.join(paths)}
        done = subprocess.run([self.python, "-m", "dsa_image.runtime.selftest", "--json", "-"], capture_output=True,
                              text=True, env=env, cwd="/", timeout=900)
        return done.returncode, done.stdout + done.stderr

    def _site(self) -> Path | None:
        if self.site_packages:
            return Path(self.site_packages)
        done = subprocess.run([self.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, env=self.env, cwd="/")
        return Path(done.stdout.strip()) if done.returncode == 0 else None

    def receipt(self) -> dict | None:
        site = self._site()
        path = site / RECEIPT_NAME if site else None
        try:
            return json.loads(path.read_text()) if path else None
        except (OSError, ValueError):
            return None

    def gpu_info(self) -> dict:
        return query_gpus()

    def _is_server_process(self, pid: int) -> bool:
        """In the server's process group (what `stop` signals: vLLM's workers, and the raylet
        and workers of the Ray instance its engine starts, inherit it), or below the server:
        Ray workers that lead process groups of their own (RAY_process_group_cleanup_enabled)."""
        if self.proc is None:
            return False
        try:
            if os.getpgid(pid) == self.proc.pid:
                return True
        except OSError:
            return False
        for _ in range(MAX_PROCESS_DEPTH):
            parent = parent_pid(pid)
            if parent is None or parent <= 1:
                return False
            if parent == self.proc.pid:
                return True
            pid = parent
        return False

    def layout_facts(self) -> dict:
        return {"gpus_used": gpus_held(self._is_server_process, self.run_host, "host"),
                "shm": query_shm(self.run_host, "host")}

    def describe(self, report: Report) -> None:
        report.python = {"executable": self.python, "site_packages": self.site_packages,
                         "version": self.versions["python"]}
        report.versions["vllm_installed"] = self.versions["vllm"]

    def stop(self) -> None:
        if self.proc is None or self._stopped:
            return
        self._stopped = True
        proc = self.proc
        _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        # The group outlives its leader when children ignore SIGTERM: kill what is left.
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
        if self.follower:
            self.follower.join()
        if proc.stdout:
            proc.stdout.close()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def site_env(site_packages: str | None, env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: ours) with the --site-packages dir first on PYTHONPATH (a `pip install
    --target` tree, with the directories its .pth files would add)."""
    env = dict(os.environ if env is None else env)
    if site_packages:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath(site_packages), env.get("PYTHONPATH")) if p)
    return env


def server_env(target: Target, site_packages: str | None, layout: Layout = SINGLE_GPU) -> dict[str, str]:
    """The environment of the server: ours, the target's env (e.g. the b12x switch), the
    layout's (Ray's log settings), the site first on PYTHONPATH (site_env)."""
    env = site_env(site_packages, {**os.environ, **target.env, **layout.server_env()})
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def environment_versions(python: str, env: dict[str, str]) -> dict[str, str]:
    """The Python and vLLM versions `python` runs under `env` (cwd "/", as the server): the
    vLLM release is the recipe base whose expectations the run checks."""
    try:
        done = subprocess.run([python, "-c", VERSIONS_PROBE], capture_output=True, text=True, env=env, cwd="/",
                              timeout=VERSIONS_PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise StartError(f"{python}: cannot run it to read its vLLM version: {e}") from None
    if done.returncode != 0:
        raise StartError(f"{python} cannot report its vLLM version (is vLLM installed there, or in "
                         f"--site-packages?): {done.stderr.strip()[-300:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def probe_ray(python: str, env: dict[str, str]) -> dict:
    """RAY_PROBE's answer from the served environment, or {"error": ...} when it gave none."""
    try:
        done = subprocess.run([python, "-c", RAY_PROBE], capture_output=True, text=True, env=env, cwd="/",
                              timeout=RAY_PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{python} could not run the Ray probe: {e}"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    try:
        if done.returncode == 0 and lines:
            return json.loads(lines[-1])
    except ValueError:
        pass
    return {"error": f"the Ray probe exited {done.returncode}: {(done.stderr or done.stdout).strip()[-500:]}"}


def ray_problem(probe: dict, python: str, ray_pin: str) -> str | None:
    """Why vLLM's Ray executor cannot start from this environment, or None."""
    if probe.get("error"):
        return f"--distributed-executor-backend ray: {probe['error']}"
    if probe.get("import_error"):
        return (f"--distributed-executor-backend ray needs Ray importable by {python} (with --site-packages "
                f"first on PYTHONPATH), but `import ray` failed: {probe['import_error']}; install the recipe's "
                f"pin into that environment (pip install {ray_pin}, with --target DIR for a --site-packages DIR)")
    if probe.get("cluster_error"):
        return (f"--distributed-executor-backend ray: vLLM's ray.init() would join the Ray cluster at "
                f"{probe['joins']} (RAY_ADDRESS, or the address a `ray start` here recorded in "
                f"/tmp/ray/ray_current_cluster), which does not answer: {probe['cluster_error']}; start that "
                f"cluster, or unset RAY_ADDRESS / run `ray stop` so vLLM starts its own local instance")
    return None


def ray_record(probe: dict) -> dict:
    """The report's `ray` section from the probe: version, and the cluster vLLM joins or starts."""
    record = {"version": probe.get("version"), "module": probe.get("module")}
    if probe.get("joins"):
        nodes = probe.get("nodes") or []
        record.update(instance=f"joins the cluster at {probe['joins']}", address=probe["joins"], nodes=nodes,
                      node_count=len(nodes))
    elif probe.get("joins_error"):  # Ray's resolution is private API: another Ray may lack it
        record.update(instance=f"unknown: cannot tell whether ray.init() joins a cluster ({probe['joins_error']})",
                      node_count=None)
    else:
        record.update(instance="a local instance vLLM starts (no RAY_ADDRESS, no `ray start` cluster "
                               "recorded here)", node_count=1)
    return record


def preflight(python: str, env: dict[str, str], layout: Layout, ray_pin: str, run_host=host_runner) -> dict:
    """Refuse (LayoutError) what cannot serve this layout: Ray not importable or its cluster
    dead, more GPUs than visible. Returns the report's `parallel` section."""
    ray = None
    if layout.backend == "ray":
        probe = probe_ray(python, env)
        problem = ray_problem(probe, python, ray_pin)
        if problem:
            raise LayoutError(problem)
        ray = ray_record(probe)
    if ray and ray.get("address"):
        visible = visible_ray_cluster(ray["address"], ray["nodes"])
    else:
        visible = visible_local(env.get("CUDA_VISIBLE_DEVICES"), query_inventory(run_host))
    check_fits(layout, visible)
    return layout_record(layout, visible, ray)
