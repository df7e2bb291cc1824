"""`vllm serve` as a subprocess of a given Python environment, for GPU hosts without Docker.

The server runs in its own process group (vLLM starts an engine-core process and compile
workers): stopping it signals the whole group, SIGTERM then SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

from dsa_image.recipe import Recipe, Target
from dsa_image.smoke.gpu import query_gpus
from dsa_image.smoke.report import Report
from dsa_image.smoke.run import LogFollower, StartError

REPO = Path(__file__).resolve().parents[2]
OVERLAY_TOOL = REPO / "scripts" / "overlay.py"
RECEIPT_NAME = "vllm_overlay_receipt.json"
STOP_GRACE_S = 30.0


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
                 port: int, log_path: Path, echo: IO[str] | None):
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
        verify = [str(OVERLAY_TOOL), "verify", "--python", python]
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
        chunks = iter(lambda: self.proc.stdout.read1(65536), b"")
        self.follower = LogFollower(chunks, self.log_path, self.echo).start()

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def run_verify(self) -> tuple[int, str]:
        done = subprocess.run(self.verify_argv, capture_output=True, text=True, env=self.env, cwd="/", timeout=600)
        return done.returncode, done.stdout + done.stderr

    def run_selftest(self) -> tuple[int, str]:
        """dsa_image.selftest with the served environment's vLLM first on the path, then this
        checkout (for dsa_image itself); cwd "/" as for the server."""
        paths = [str(p) for p in (self._site(), REPO) if p]
        env = {**self.env, "PYTHONPATH": os.pathsep.join(paths)}
        done = subprocess.run([self.python, "-m", "dsa_image.selftest", "--json", "-"], capture_output=True,
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

    def describe(self, report: Report) -> None:
        probe = ("import importlib.metadata as m, json, sys; "
                 "print(json.dumps({'python': sys.version.split()[0], 'vllm': m.version('vllm')}))")
        done = subprocess.run([self.python, "-c", probe], capture_output=True, text=True, env=self.env, cwd="/")
        report.python = {"executable": self.python, "site_packages": self.site_packages}
        if done.returncode == 0:
            found = json.loads(done.stdout)
            report.python["version"] = found["python"]
            report.versions["vllm_installed"] = found["vllm"]
        else:
            report.errors.append(f"{self.python} cannot report its vLLM version: {done.stderr.strip()[-300:]}")

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


def server_env(target: Target, site_packages: str | None) -> dict[str, str]:
    """The environment of the server: ours, the target's env (e.g. the b12x switch), and the
    --site-packages dir first on PYTHONPATH (a `pip install --target` tree)."""
    env = dict(os.environ)
    env.update(target.env)
    if site_packages:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site_packages, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
