"""GPU facts for the report, read with nvidia-smi (the host's, or one run inside a container):
what the GPUs are, which ones a run may use, and which ones the server's processes hold."""

from __future__ import annotations

import shutil
import subprocess
from typing import Callable

from dsa_image.smoke.expect import parse_capability

QUERY = ["nvidia-smi", "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"]
# Which GPUs there are, by the index CUDA_VISIBLE_DEVICES and `--gpus device=` name and by UUID,
# the name the compute-process list gives.
INVENTORY_QUERY = ["nvidia-smi", "--query-gpu=index,uuid,name", "--format=csv,noheader"]
APPS_QUERY = ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"]

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


def parse_inventory(output: str) -> list[dict]:
    """One dict per GPU from INVENTORY_QUERY's CSV: index, uuid, name."""
    gpus = []
    for line in output.strip().splitlines():
        fields = [f.strip() for f in line.split(",", 2)]
        if len(fields) != 3 or not fields[0].isdigit():
            raise ValueError(f"unexpected nvidia-smi line {line!r}: expected index, uuid, name")
        gpus.append({"index": int(fields[0]), "uuid": fields[1], "name": fields[2]})
    return gpus


def query_inventory(runner: Runner = host_runner, where: str = "host") -> dict:
    """{"gpus": [{index, uuid, name}], "source": ...} or {"error": ..., "source": ...}; never raises."""
    code, output = runner(INVENTORY_QUERY)
    source = f"nvidia-smi ({where})"
    if code != 0:
        return {"error": f"nvidia-smi exited {code}: {output.strip()[-500:]}", "source": source}
    try:
        return {"gpus": parse_inventory(output), "source": source}
    except ValueError as e:
        return {"error": str(e), "source": source}


def parse_apps(output: str) -> list[dict]:
    """The compute processes of APPS_QUERY's CSV: gpu_uuid, pid, used_memory_mib (None when
    the driver does not say, "[N/A]"). Lines of another shape are skipped: nvidia-smi words
    "no processes" differently across versions."""
    apps = []
    for line in output.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3 or not fields[1].isdigit():
            continue
        memory = int(fields[2]) if fields[2].isdigit() else None
        apps.append({"gpu_uuid": fields[0], "pid": int(fields[1]), "used_memory_mib": memory})
    return apps


def gpus_held(is_ours: Callable[[int], bool], runner: Runner = host_runner, where: str = "host") -> dict:
    """The GPUs on which a process `is_ours` (pid -> bool) runs, from nvidia-smi's compute
    processes: {"gpus": [{index, uuid, name, pids, used_memory_mib}], "source"} or
    {"error", "source"}. None of ours found is an error, not an empty list: a healthy vLLM holds
    its GPUs, so it means the pids could not be matched (another PID namespace, a remote engine)."""
    inventory = query_inventory(runner, where)
    if "error" in inventory:
        return inventory
    source = f"nvidia-smi --query-compute-apps ({where})"
    code, output = runner(APPS_QUERY)
    if code != 0:
        return {"error": f"nvidia-smi exited {code}: {output.strip()[-500:]}", "source": source}
    ours = [app for app in parse_apps(output) if is_ours(app["pid"])]
    if not ours:
        return {"error": "nvidia-smi lists no compute process of the server", "source": source}
    held = []
    for gpu in inventory["gpus"]:
        apps = [a for a in ours if a["gpu_uuid"] == gpu["uuid"]]
        if apps:
            memory = [a["used_memory_mib"] for a in apps]
            held.append({**gpu, "pids": sorted(a["pid"] for a in apps),
                         "used_memory_mib": None if None in memory else sum(memory)})
    return {"gpus": held, "source": source}
