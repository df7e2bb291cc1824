"""The parallel layout of a smoke run: over how many GPUs vLLM spreads the model (tensor x
pipeline parallel) and with which executor (multiprocessing or Ray); whether that many GPUs
are visible before anything starts; and what the server log says ran.

What vLLM logs of its ranks (vLLM 0.24.0 and 0.33.0 alike, distributed/parallel_state.py):
every rank logs `world_size=W rank=R local_rank=L distributed_init_method=... backend=...`
(a plain `logger.info`: 0.33.0 :1929, 0.24.0 :1588), but only the first rank of each node logs
`rank R in world size W is assigned as DP rank d, PP rank p, PCP rank c, TP rank t, ...`
(`logger.info_once`, 0.33.0 :2385, 0.24.0 :1923, whose default scope "local" keeps the records of
local rank 0 only: logger.py `info_once` (0.33.0 :171, 0.24.0 :127) and `_should_log_with_scope`,
parallel_state.py `is_local_first_rank`). So TP=2 on one host logs the assignment of rank 0
alone; the ranks are counted from both lines. A worker's vLLM lines carry its name,
`(Worker_PP1_TP0 pid=...)` (multiproc_executor.py `setup_proc_title_and_log_prefix`, 0.33.0
:1196-1229: `_PP`/`_TP` only for a degree above 1; `(Worker pid=...)` before its groups exist,
which is when it logs the two rank lines): in 0.33.0 as part of vLLM's log format (logger.py
:28-32, `(%(vllm_process_name)s pid=%(process)d)`; lines not written by vLLM's loggers carry
none), in 0.24.0 as a prefix written to the process's stdout and stderr (utils/system_utils.py
:237-253 `decorate_logs`). Under Ray, Ray puts its own `(RayWorkerProc pid=...)` (with
`, ip=...` for a worker on another node) in front of each line it forwards to the driver.

With the Ray executor vLLM's `initialize_ray_cluster` (v1/executor/ray_utils.py) logs `No
current placement group found. Creating a new placement group.` or `Using the existing
placement group`. There, without RAY_ADDRESS, `ray.init()` joins the cluster a `ray start` on
this machine recorded (/tmp/ray/ray_current_cluster) or else starts a local Ray instance in the
engine process (Ray logs `Started a local Ray instance.` or `Connecting to existing Ray cluster
at address: A...`).

Stdlib only.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

from dsa_image.smoke.gpu import Runner
from dsa_image.core import status

BACKENDS = ("mp", "ray")
ALL_GPUS = -1

# The layout flags smoke.py owns: given after `--` they would escape the preflight and the
# report. vLLM's parser also takes --a_b for --a-b and --flag=value.
OWNED_FLAGS = {
    "--tensor-parallel-size": "--tensor-parallel-size", "-tp": "--tensor-parallel-size",
    "--pipeline-parallel-size": "--pipeline-parallel-size", "-pp": "--pipeline-parallel-size",
    "--distributed-executor-backend": "--distributed-executor-backend",
}
# Flags that spread a server over more GPUs or nodes than tensor x pipeline: the preflight
# and the rank check count only those two, so these are refused rather than miscounted.
UNCOUNTED_FLAGS = ("--data-parallel-size", "-dp", "--prefill-context-parallel-size", "-pcp", "--nnodes", "-n")

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
RANK_LOG = re.compile(r"rank (\d+) in world size (\d+) is assigned as DP rank (\d+), PP rank (\d+), "
                      r"PCP rank (\d+), TP rank (\d+)")
# Logged by every rank as it joins the world group (see the module's help); the assignment above
# by each node's first rank only.
RANK_INIT_LOG = re.compile(r"world_size=(\d+) rank=(\d+) local_rank=(-?\d+) distributed_init_method=\S+ backend=")
# A worker's name in vLLM's prefix once its parallel groups exist: Worker, then _DP/_PP/_PCP/_TP/
# _DCP/_EP and the rank in each group of more than one rank ("Worker" alone before that).
WORKER_NAME = re.compile(r"\(Worker((?:_[A-Z]+\d+)+) pid=\d+\)")
RAY_PLACEMENT_LOGS = ("Creating a new placement group", "Using the existing placement group")
RAY_LOCAL_LOG = "Started a local Ray instance"
RAY_JOIN_LOG = re.compile(r"Connecting to existing Ray cluster at address: (\S+?)\.\.\.")
# Ray prefixes a worker's forwarded line with its ip only when the worker runs on another node.
RAY_REMOTE_WORKER = re.compile(r"\(\w+ pid=\d+, ip=([^)\s]+)\)")
# The image's entrypoint logs the `vllm serve` argv it execs (dsa_image/runtime/entrypoint.py plan_serve).
ENTRYPOINT_SERVE_LOG = re.compile(r"^dsa-image \S+: .*?(?:recipe's defaults|Running): (vllm serve .*?)\s*$", re.M)
SHM_QUERY = ["df", "-kP", "/dev/shm"]


class LayoutError(status.DsaImageError):
    """A layout refused before anything starts (exit 2): the message says what was expected,
    what was found and what to do."""

    exit_code = status.USAGE


def positive_int(text: str) -> int:
    """argparse type: 1, 2, ... (argparse turns the error into a usage error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive whole number (1, 2, ...), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number (1, 2, ...), got {value}")
    return value


@dataclass(frozen=True)
class Layout:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    backend: str | None = None  # None: vLLM's choice (in-process on one GPU, mp on several of one host)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def server_flags(self) -> list[str]:
        """The `vllm serve` flags for this layout (none for vLLM's defaults)."""
        flags = []
        if self.tensor_parallel_size != 1:
            flags += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.pipeline_parallel_size != 1:
            flags += ["--pipeline-parallel-size", str(self.pipeline_parallel_size)]
        if self.backend:
            flags += ["--distributed-executor-backend", self.backend]
        return flags

    def server_env(self) -> dict[str, str]:
        # Ray folds forwarded lines that differ only in numbers ("rank 0 ..." and "rank 1 ...")
        # into one "[repeated 1x across cluster]": every worker's rank line must reach the log.
        return {"RAY_DEDUP_LOGS": "0"} if self.backend == "ray" else {}

    def describe(self) -> str:
        return (f"TP {self.tensor_parallel_size} x PP {self.pipeline_parallel_size} = {self.world_size} "
                f"GPU{'s' if self.world_size > 1 else ''}, executor {self.backend or 'vLLM default'}")

    def as_dict(self) -> dict:
        return {"tensor_parallel_size": self.tensor_parallel_size,
                "pipeline_parallel_size": self.pipeline_parallel_size,
                "world_size": self.world_size,
                "distributed_executor_backend": self.backend}


# vLLM's default: one GPU, the executor vLLM picks (in-process).
SINGLE_GPU = Layout()


def server_args_problem(server_args: list[str]) -> str | None:
    """Why these `vllm serve` arguments (after `--`) cannot go with the smoke's layout, or None."""
    for arg in server_args:
        if not arg.startswith("-"):
            continue
        name = arg.split("=", 1)[0]
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
        if name in OWNED_FLAGS:
            return (f"{arg} after `--`: give it to smoke.py as {OWNED_FLAGS[name]}, before `--`, so the "
                    f"preflight counts its GPUs and the report records it")
        if name in UNCOUNTED_FLAGS:
            return (f"{arg} after `--`: the smoke test counts a server's GPUs as tensor x pipeline parallel "
                    f"only (--tensor-parallel-size, --pipeline-parallel-size); it cannot check this layout")
    return None


@dataclass(frozen=True)
class GpuRequest:
    """What `docker run --gpus` asks for: every GPU, a count, or devices by index or UUID."""

    count: int = ALL_GPUS
    device_ids: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> "GpuRequest":
        """argparse type for --gpus: all, N, or device=I[,J...] (docker's own spellings)."""
        value = text.strip().strip("'\"")
        if value == "all":
            return cls()
        if value.startswith("device="):
            ids = tuple(part.strip() for part in value.removeprefix("device=").split(",") if part.strip())
            if ids:
                return cls(count=0, device_ids=ids)
        elif value.isdigit() and int(value) > 0:
            return cls(count=int(value))
        raise argparse.ArgumentTypeError(f"expected all, a count (2) or device=I[,J...] (device=0,1), got {text!r}")

    def cli(self) -> str:
        if self.device_ids:
            return f'"device={",".join(self.device_ids)}"'
        return "all" if self.count == ALL_GPUS else str(self.count)

    def docker_kwargs(self) -> dict:
        """For docker.types.DeviceRequest (with capabilities=[["gpu"]])."""
        return {"device_ids": list(self.device_ids)} if self.device_ids else {"count": self.count}


@dataclass(frozen=True)
class Visible:
    """How many GPUs a run may use (None: unknown), how that was found, and what to do for more."""

    count: int | None
    source: str
    hint: str
    gpus: list[dict] = field(default_factory=list)  # {index, uuid, name} where known

    def as_dict(self) -> dict:
        return {"count": self.count, "source": self.source, "gpus": self.gpus}


def _match_gpu(entry: str, gpus: list[dict]) -> dict | None:
    # CUDA and docker take an index or a UUID, the UUID also shortened to a unique prefix.
    for gpu in gpus:
        if entry == str(gpu["index"]) or (entry.startswith("GPU-") and gpu["uuid"].startswith(entry)):
            return gpu
    return None


def visible_local(cuda_visible_devices: str | None, inventory: dict) -> Visible:
    """The GPUs a local `vllm serve` sees: CUDA_VISIBLE_DEVICES of the host's (nvidia-smi) GPUs."""
    gpus = inventory.get("gpus")
    if cuda_visible_devices is None:
        if gpus is None:
            return Visible(None, f"CUDA_VISIBLE_DEVICES is unset and {inventory['source']} failed: "
                                 f"{inventory['error']}",
                           "make nvidia-smi work on this host, or name the GPUs: CUDA_VISIBLE_DEVICES=0,1")
        return Visible(len(gpus), f"every GPU {inventory['source']} lists (CUDA_VISIBLE_DEVICES unset)",
                       "use a host with more GPUs", gpus)
    entries = [e.strip() for e in cuda_visible_devices.split(",")] if cuda_visible_devices.strip() else []
    where = f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}"
    hint = "name more GPUs in CUDA_VISIBLE_DEVICES (or unset it)"
    if gpus is None:
        return Visible(len(entries), f"{where} (not checked: {inventory['source']} failed: {inventory['error']})",
                       hint)
    picked = []
    for entry in entries:
        gpu = _match_gpu(entry, gpus)
        if gpu is None:  # CUDA stops enumerating at the first entry that names no GPU
            break
        picked.append(gpu)
    return Visible(len(picked), f"{where} of the {len(gpus)} GPUs {inventory['source']} lists", hint, picked)


def visible_docker(request: GpuRequest | None, inventory: dict) -> Visible:
    """The GPUs a container started with `request` (None: no --gpus) gets, as far as the host's
    nvidia-smi tells (a remote engine's host is not this one: then name them explicitly)."""
    hint = "request more: --gpus all, --gpus N or --gpus device=I,J"
    if request is None:
        return Visible(0, "--no-gpus: no GPU requested", "drop --no-gpus")
    gpus = inventory.get("gpus")
    unchecked = f"not checked: {inventory.get('source')} failed: {inventory.get('error')}"
    if request.device_ids:
        if gpus is None:
            return Visible(len(request.device_ids), f"--gpus {request.cli()} ({unchecked})", hint)
        picked = [gpu for entry in request.device_ids if (gpu := _match_gpu(entry, gpus))]
        return Visible(len(picked), f"--gpus {request.cli()} names {len(picked)} of the {len(gpus)} GPUs "
                                    f"{inventory['source']} lists", hint, picked)
    if request.count == ALL_GPUS:
        if gpus is None:
            return Visible(None, f"--gpus all, and how many GPUs this host has is unknown "
                                 f"({inventory['source']} failed: {inventory['error']})",
                           "say how many: --gpus N or --gpus device=I,J")
        return Visible(len(gpus), f"--gpus all: the {len(gpus)} GPUs {inventory['source']} lists", hint, gpus)
    if gpus is None:
        return Visible(request.count, f"--gpus {request.count} ({unchecked})", hint)
    return Visible(min(request.count, len(gpus)), f"--gpus {request.count}, of the {len(gpus)} GPUs "
                                                  f"{inventory['source']} lists", hint)


def visible_ray_cluster(address: str, nodes: list[dict]) -> Visible:
    """The GPUs of the Ray cluster vLLM will join (its alive nodes' GPU resources)."""
    count = int(sum(node.get("resources", {}).get("GPU", 0) for node in nodes))
    return Visible(count, f"the GPU resources of the {len(nodes)} alive node(s) of the Ray cluster at {address}",
                   "join more GPU nodes to that cluster, or unset RAY_ADDRESS / `ray stop` so vLLM starts its own")


def check_fits(layout: Layout, visible: Visible) -> None:
    """Refuse a layout over more GPUs than visible (or when that count is unknown). A single-GPU
    layout is left to the run, which reports a missing GPU with the server's own words."""
    if layout.world_size == 1:
        return
    wanted = (f"--tensor-parallel-size {layout.tensor_parallel_size} x --pipeline-parallel-size "
              f"{layout.pipeline_parallel_size} needs {layout.world_size} GPUs")
    if visible.count is None:
        raise LayoutError(f"{wanted}, but how many this run may use is unknown: {visible.source}; {visible.hint}")
    if layout.world_size > visible.count:
        raise LayoutError(f"{wanted}, but {visible.count} {'is' if visible.count == 1 else 'are'} visible "
                          f"({visible.source}); lower the sizes or {visible.hint}")


def layout_record(layout: Layout, visible: Visible, ray: dict | None = None) -> dict:
    """The report's `parallel` section as known before the start."""
    record = {**layout.as_dict(), "server_flags": layout.server_flags(), "gpus_visible": visible.as_dict()}
    if ray is not None:
        record["ray"] = ray
    return record


# --- what the server log says ran -----------------------------------------------------------


def _clean(log: str) -> str:
    return ANSI.sub("", log)


def logged_ranks(log: str) -> list[dict]:
    """Each rank's assignment as vLLM logged it, once per (world size, rank, DP rank): the first
    rank of each node only (see the module's help)."""
    seen = {}
    for match in RANK_LOG.finditer(_clean(log)):
        rank, world, dp, pp, pcp, tp = map(int, match.groups())
        seen[(world, dp, rank)] = {"rank": rank, "world_size": world, "dp_rank": dp, "pp_rank": pp,
                                   "pcp_rank": pcp, "tp_rank": tp}
    return [seen[key] for key in sorted(seen)]


def started_ranks(log: str) -> list[dict]:
    """Every rank that joined vLLM's world group, as it logged it: {rank, world_size, local_rank}."""
    seen = {}
    for match in RANK_INIT_LOG.finditer(_clean(log)):
        world, rank, local = map(int, match.groups())
        seen[(world, rank)] = {"rank": rank, "world_size": world, "local_rank": local}
    return [seen[key] for key in sorted(seen)]


def worker_names(log: str) -> list[dict]:
    """The parallel ranks in the workers' names (`Worker_PP1_TP0` -> {"PP": 1, "TP": 0}), each once."""
    names = {match.group(1) for match in WORKER_NAME.finditer(_clean(log))}
    return [{part.rstrip("0123456789"): int(part[len(part.rstrip("0123456789")):])
             for part in name.strip("_").split("_")} for name in sorted(names)]


def ray_from_log(log: str) -> dict:
    """What the log says of Ray: which instance, whether vLLM's Ray executor placed workers,
    and the other nodes' addresses its workers logged from."""
    text = _clean(log)
    joined = RAY_JOIN_LOG.search(text)
    instance = (f"joined the cluster at {joined.group(1)}" if joined else
                "a local instance vLLM started" if RAY_LOCAL_LOG in text else None)
    return {"instance_logged": instance,
            "placement_group_logged": any(line in text for line in RAY_PLACEMENT_LOGS),
            "remote_worker_ips": sorted(set(RAY_REMOTE_WORKER.findall(text)))}


def entrypoint_serve_argv(log: str) -> list[str] | None:
    """The `vllm serve` argv the image's entrypoint logged it runs (docker), or None."""
    match = ENTRYPOINT_SERVE_LOG.search(_clean(log))
    return match.group(1).split() if match else None


def logged_layout(log: str, layout: Layout) -> dict:
    """The report's `parallel` fields read from the log."""
    found: dict[str, object] = {"ranks_logged": logged_ranks(log), "ranks_started": started_ranks(log),
             "worker_names": worker_names(log)}
    if layout.backend == "ray":
        found["ray_log"] = ray_from_log(log)
    argv = entrypoint_serve_argv(log)
    if argv:
        found["serve_argv"] = argv
    return found


def layout_problems(log: str, layout: Layout, gpus_used: dict | None) -> list[str]:
    """Every way the log and the GPUs held disagree with `layout` (empty: it ran as asked)."""
    return _rank_problems(log, layout) + _backend_problems(log, layout) + _gpu_problems(layout, gpus_used)


def _rank_problems(log: str, layout: Layout) -> list[str]:
    """The world size and each rank's TP/PP place, as vLLM logged them."""
    world = layout.world_size
    assigned, started = logged_ranks(log), started_ranks(log)
    worlds = sorted({r["world_size"] for r in assigned + started})
    if not worlds:
        return [f"the log names no rank (vLLM's 'rank R in world size W is assigned as ...' or "
                f"'world_size=W rank=R ...'); expected ranks 0-{world - 1} of world size {world}"]
    if worlds != [world]:
        return [f"world size: expected {world} (tensor x pipeline parallel), the log says "
                f"{', '.join(map(str, worlds))}"]
    problems = []
    # A rank counts when it logged either line: vLLM logs the assignment of each node's
    # first rank only, so TP=2 on one host names rank 1 in the world-group line alone.
    missing = sorted(set(range(world)) - {r["rank"] for r in assigned + started})
    if missing:
        problems.append(f"ranks {missing} of world size {world} never logged their assignment")
    if not assigned:
        problems.append("no rank logged its TP/PP assignment ('rank R in world size W is assigned as ...'; "
                        "vLLM logs it for the first rank of each node)")
    return problems + _placement_problems(log, layout, assigned)


def _placement_problems(log: str, layout: Layout, assigned: list[dict]) -> list[str]:
    problems = []
    world, tp_size, pp_size = layout.world_size, layout.tensor_parallel_size, layout.pipeline_parallel_size
    for what, size in (("tp_rank", tp_size), ("pp_rank", pp_size)):
        found = sorted({r[what] for r in assigned})
        if not set(found) <= set(range(size)):
            problems.append(f"{what.replace('_', ' ').upper()}s: expected 0-{size - 1}, the log names {found}")
    # vLLM orders ranks TP first, then PCP, then PP (parallel_state.py initialize_model_parallel:
    # arange(world_size).reshape(-1, DP, PP, PCP, TP)); the smoke refuses DP and PCP sizes.
    for r in assigned:
        want = (r["rank"] % tp_size, r["rank"] // tp_size % pp_size)
        if (r["tp_rank"], r["pp_rank"]) != want and r["rank"] < world:
            problems.append(f"rank {r['rank']} logged TP rank {r['tp_rank']}, PP rank {r['pp_rank']}; "
                            f"TP {tp_size} x PP {pp_size} puts it at TP rank {want[0]}, PP rank {want[1]}")
    # The workers' names tell the degrees apart where only rank 0 logged its assignment (TP=2
    # and PP=2 both put rank 0 at TP 0, PP 0).
    for name in worker_names(log):
        for key, size in (("TP", tp_size), ("PP", pp_size)):
            if key in name and name[key] >= size:
                problems.append(f"a worker named {key} rank {name[key]} ({name}); expected {key} ranks "
                                f"0-{size - 1}")
    return problems


def _backend_problems(log: str, layout: Layout) -> list[str]:
    placed_by_ray = ray_from_log(log)["placement_group_logged"]
    if layout.backend == "ray" and not placed_by_ray:
        return ["--distributed-executor-backend ray, but the log shows no Ray placement group "
                f"(vLLM logs '{RAY_PLACEMENT_LOGS[0]}' or '{RAY_PLACEMENT_LOGS[1]}')"]
    if layout.backend == "mp" and placed_by_ray:
        return ["--distributed-executor-backend mp, but the log shows vLLM placing workers with Ray"]
    return []


def _gpu_problems(layout: Layout, gpus_used: dict | None) -> list[str]:
    held = (gpus_used or {}).get("gpus")
    if held is not None and len(held) < layout.world_size:
        return [f"{layout.world_size} GPUs expected, the server's processes hold {len(held)}: "
                + (", ".join(f"{g['index']} ({g['name']})" for g in held) or "none")]
    return []


# --- /dev/shm, where vLLM's workers and Ray's object store share memory ---------------------


def query_shm(runner: Runner, where: str) -> dict:
    """{path, size_bytes, available_bytes, source} of /dev/shm, or {error, source}; never raises."""
    source = f"df ({where})"
    code, output = runner(SHM_QUERY)
    if code != 0:
        return {"error": f"{' '.join(SHM_QUERY)} exited {code}: {output.strip()[-300:]}", "source": source}
    try:
        fields = output.strip().splitlines()[-1].split()
        return {"path": "/dev/shm", "size_bytes": int(fields[1]) * 1024, "available_bytes": int(fields[3]) * 1024,
                "source": source}
    except (IndexError, ValueError):
        return {"error": f"unexpected df output: {output.strip()[-300:]!r}", "source": source}


# --- the console line -----------------------------------------------------------------------


def summary(parallel: dict) -> str:
    """One line for the console: the layout, where Ray ran, the GPUs used, the ranks logged."""
    layout = Layout(parallel.get("tensor_parallel_size", 1), parallel.get("pipeline_parallel_size", 1),
                    parallel.get("distributed_executor_backend"))
    parts = [layout.describe()]
    ray = parallel.get("ray") or {}
    ray_log = parallel.get("ray_log") or {}
    if layout.backend == "ray":
        instance = ray_log.get("instance_logged") or ray.get("instance") or "instance not logged"
        nodes = ray.get("node_count")
        parts.append(f"Ray: {instance}" + (f", {nodes} node{'s' if nodes != 1 else ''}" if nodes else ""))
    used = parallel.get("gpus_used") or {}
    if used.get("gpus"):
        parts.append("GPUs used: " + ", ".join(f"{g['index']} {g['name']}" for g in used["gpus"]))
    elif used.get("error"):
        parts.append(f"GPUs used: unknown ({used['error']})")
    ranks = parallel.get("ranks_logged")
    if ranks is not None:
        # Either line counts (the assignment is logged by each node's first rank only).
        logged = sorted({r["rank"] for r in ranks + (parallel.get("ranks_started") or [])})
        parts.append(f"ranks logged: {', '.join(map(str, logged)) or 'none'}")
    return "; ".join(parts)
