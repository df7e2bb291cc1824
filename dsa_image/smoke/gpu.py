"""GPU facts for the report, read with nvidia-smi (the host's, or one run inside a container)."""

from __future__ import annotations

import shutil
import subprocess
from typing import Callable

from dsa_image.smoke.expect import parse_capability

QUERY = ["nvidia-smi", "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"]

# Runs a command, returns (exit code, output).
Runner = Callable[[list[str]], "tuple[int, str]"]


def parse_query(output: str) -> list[dict]:
    """One dict per GPU from QUERY's CSV: name, compute_capability, driver_version."""
    gpus = []
    for line in output.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3:
            raise ValueError(f"unexpected nvidia-smi line {line!r}: expected name, compute_cap, driver_version")
        name, cap, driver = fields
        parse_capability(cap)
        gpus.append({"name": name, "compute_capability": cap, "driver_version": driver})
    return gpus


def host_runner(command: list[str]) -> tuple[int, str]:
    if shutil.which(command[0]) is None:
        return 127, f"{command[0]}: not found on this host"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(command)}: no answer in 60 s"
    return done.returncode, done.stdout + done.stderr


def query_gpus(runner: Runner = host_runner, where: str = "host") -> dict:
    """{"gpus": [...], "source": ...} or {"error": ..., "source": ...}; never raises."""
    code, output = runner(QUERY)
    source = f"nvidia-smi ({where})"
    if code != 0:
        return {"error": f"nvidia-smi exited {code}: {output.strip()[-500:]}", "source": source}
    try:
        gpus = parse_query(output)
    except ValueError as e:
        return {"error": str(e), "source": source}
    if not gpus:
        return {"error": "nvidia-smi listed no GPU", "source": source}
    return {"gpus": gpus, "source": source}


def capability_of(gpu_info: dict) -> tuple[int, int] | None:
    """The compute capability of the GPUs the server uses (all must agree), or None if unknown."""
    caps = {g["compute_capability"] for g in gpu_info.get("gpus", [])}
    if len(caps) != 1:
        return None
    return parse_capability(caps.pop())
