"""What a call of the cluster harness (dsa_image.validation.cluster) runs, decided before anything
starts: the layouts and isolation methods, the waves of a layout list, each run's expected outcome
and reference, each Ray cluster's plan (addresses, ports, namespaces, the netns network), and the
commands and environments of its Ray nodes and servers, among them ALLREDUCE_GUARD (FlashInfer's
all-reduce kept off NVLink multicast).

Pure: nothing here starts a process or reads the host (cluster_host does; cluster_run runs a wave).
TAG_PREFIX is read as cluster_plan.TAG_PREFIX where a call uses it, so a test can give its call a
tag of its own by patching it here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TypeVar

from dsa_image.core import status

# -- layouts ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    name: str
    executor: str  # vLLM's --distributed-executor-backend: "mp" or "ray"
    ray_nodes: int  # 0 for mp
    tp: int
    pp: int

    def server_args(self) -> list[str]:
        return ["--tensor-parallel-size", str(self.tp), "--pipeline-parallel-size", str(self.pp),
                "--distributed-executor-backend", self.executor]


LAYOUTS = {layout.name: layout for layout in (
    Layout("mp-tp2", "mp", 0, 2, 1),
    Layout("mp-pp2", "mp", 0, 1, 2),
    Layout("ray1-tp2", "ray", 1, 2, 1),
    Layout("ray2-tp2", "ray", 2, 2, 1),
    Layout("ray2-pp2", "ray", 2, 1, 2),
)}

ISOLATION = {
    "netns": "the second Ray node in its own network, mount and UTS namespaces: a veth pair with "
             "its own address, its own /dev/shm and Ray temp dir, its own hostname",
    "mountns": "the second Ray node in its own mount and UTS namespaces (own /dev/shm, Ray temp dir, "
               "hostname); both nodes on loopback addresses of the host's network",
    "shared": "both Ray nodes share /dev/shm, hostname and network (loopback addresses of their "
              "own): the setup that failed with the IndexError",
}
# The methods under which vLLM sees two nodes; "shared" is the control that shows why.
FAITHFUL = ("netns", "mountns")
DEFAULT_METHOD_ORDER = ("netns", "mountns")
INDEX_ERROR = re.compile(r"IndexError: device_id \d+ is out of range for assigned_physical_gpu_ids \[[^\]]*\]")

# The requests every server gets, the builds that serve each layout, and the API ports a wave
# holds (parse_waves refuses a wave that does not fit them).
PROMPT_LENGTHS = (20, 300, 3000)  # 3000 > index_topk (2048): the prefill reaches the sparse indexer
MAX_TOKENS = 16
BUILDS = ("stock", "overlay")
PORTS_PER_WAVE = 20  # API ports: a wave's servers never reuse the ports of an earlier wave's


class Refused(status.DsaImageError, ValueError):
    """A layout list or plan that cannot be carried out; the message says what was expected,
    what was found, and what to do."""

    exit_code = status.USAGE


@dataclass(frozen=True)
class RunSpec:
    layout: Layout
    method: str | None  # asked for with LAYOUT@METHOD; None: the probe's choice (two-node layouts)

    @property
    def name(self) -> str:
        return f"{self.layout.name}@{self.method}" if self.method else self.layout.name

    @property
    def stem(self) -> str:
        """The run's name as a file name."""
        return self.name.replace("@", "-")


def parse_waves(text: str) -> list[list[RunSpec]]:
    """'mp-tp2 ray1-tp2+ray2-pp2@shared' -> [[mp-tp2], [ray1-tp2, ray2-pp2@shared]]."""
    waves = []
    for wave_text in re.split(r"[\s,]+", text.strip()):
        if not wave_text:
            continue
        waves.append([_parse_run(item) for item in wave_text.split("+")])
    if not waves:
        raise Refused(f"no layouts given; expected names of {', '.join(LAYOUTS)}, "
                         "waves separated by spaces or commas, '+' inside one wave")
    names = [run.name for wave in waves for run in wave]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise Refused(f"layouts named twice: {', '.join(repeated)}; each run writes one result file")
    widest = max(len(wave) for wave in waves)
    if widest * len(BUILDS) > PORTS_PER_WAVE:
        raise Refused(f"a wave of {widest} layouts starts {widest * len(BUILDS)} servers; at most "
                      f"{PORTS_PER_WAVE // len(BUILDS)} layouts go in one wave")
    clusters = sum(len(BUILDS) for run in names if LAYOUTS[run.partition("@")[0]].ray_nodes)
    if clusters > MAX_SLOTS:
        raise Refused(f"{clusters} Ray clusters in one call, the port plan holds {MAX_SLOTS}; split the layouts "
                      "over more calls")
    return waves


def _parse_run(item: str) -> RunSpec:
    name, _, method = item.partition("@")
    if name not in LAYOUTS:
        raise Refused(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}")
    layout = LAYOUTS[name]
    if method and method not in ISOLATION:
        raise Refused(f"unknown isolation method {method!r} in {item!r}; known: {', '.join(ISOLATION)}")
    if method and layout.ray_nodes != 2:
        raise Refused(f"{item!r}: an isolation method applies to the two-Ray-node layouts only "
                         f"({', '.join(n for n, lay in LAYOUTS.items() if lay.ray_nodes == 2)})")
    return RunSpec(layout, method or None)


def expected_outcome(layout: Layout, method: str | None) -> str:
    """'serve', or 'index-error' for the control: TP across two Ray nodes that share /dev/shm
    makes vLLM's custom all-reduce index the peer's GPU in a one-GPU map. 0.33.0 as 0.24.0:
    `same_node` from shared memory (device_communicators/custom_all_reduce.py:201), then
    `_can_p2p` (:279-281, :86-100) maps the peer's local rank through the node's list
    (platforms/interface.py:296-303), which raises `IndexError: device_id 1 is out of range for
    assigned_physical_gpu_ids [0] (1 devices assigned)` (0.33.0 adds the part in brackets)."""
    if layout.ray_nodes == 2 and layout.tp > 1 and method == "shared":
        return "index-error"
    return "serve"


def reference_for(layout: Layout) -> str | None:
    """The multiprocessing layout whose tokens this one must repeat: the same TP and PP degree.
    vLLM's dummy weights are drawn per shard from the shard's size alone
    (model_loader/weight_utils.py, initialize_dummy_weights), so TP=2 and PP=2 hold different
    models and only layouts of the same degrees can agree."""
    if layout.executor == "mp":
        return None
    matches = [name for name, lay in LAYOUTS.items()
               if lay.executor == "mp" and (lay.tp, lay.pp) == (layout.tp, layout.pp)]
    return matches[0] if matches else None


# -- cluster plans ------------------------------------------------------------------------------

PORT_BASE = 20000  # below the kernel's ephemeral range (32768-): no outgoing socket takes these
PORTS_PER_CLUSTER = 400
MAX_SLOTS = (32768 - PORT_BASE) // PORTS_PER_CLUSTER
RAY_ROOT = "/tmp/dsa-rc"  # short: Ray's socket paths must stay under 107 bytes
OBJECT_STORE_BYTES = 1 << 30
WORKER_SHM = "4g"


@dataclass(frozen=True)
class NodePlan:
    role: str  # "head" or "worker"
    name: str  # the Ray node name, also DSA_CLUSTER_NODE in its processes' environment
    ip: str
    ifname: str | None  # the interface NCCL and gloo use (two-node clusters)
    gpus: str  # CUDA_VISIBLE_DEVICES of the node
    ports: dict
    hostname: str | None  # own UTS namespace with this hostname
    private_tmp: str | None  # own mount namespace: this directory is mounted over the Ray temp dir
    netns: str | None

    @property
    def num_gpus(self) -> int:
        return len(self.gpus.split(","))


@dataclass(frozen=True)
class ClusterPlan:
    run: str
    build: str
    method: str | None
    slot: int
    temp_dir: str
    gcs_port: int
    head: NodePlan
    worker: NodePlan | None
    veth: tuple[str, str] | None  # (host end, namespace end)

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{self.gcs_port}"

    @property
    def nodes(self) -> list[NodePlan]:
        return [self.head] + ([self.worker] if self.worker else [])


def node_ports(base: int, head: bool) -> dict[str, int]:
    """Every port a Ray node listens on, fixed: two clusters (stock, overlay) and two nodes share
    the host, and Ray's fixed defaults (dashboard agent 52365, client server 10001) collide."""
    ports = {"node-manager-port": base, "object-manager-port": base + 1,
             "dashboard-agent-listen-port": base + 2, "dashboard-agent-grpc-port": base + 3,
             "runtime-env-agent-port": base + 4, "metrics-export-port": base + 5,
             "min-worker-port": base + 100, "max-worker-port": base + 199}
    if head:
        ports["ray-client-server-port"] = base + 6
    return ports


def plan_cluster(spec: RunSpec, build: str, method: str | None, slot: int, root: str = RAY_ROOT) -> ClusterPlan:
    if not 0 <= slot < MAX_SLOTS:
        raise Refused(f"cluster slot {slot} is outside 0..{MAX_SLOTS - 1}: that many Ray clusters in one call "
                      f"would take ports past {PORT_BASE + MAX_SLOTS * PORTS_PER_CLUSTER}; split the layouts "
                      "over more calls")
    layout = spec.layout
    if layout.ray_nodes not in (1, 2):
        raise Refused(f"{layout.name} uses no Ray cluster")
    base = PORT_BASE + slot * PORTS_PER_CLUSTER
    temp_dir = f"{root}/{slot}/h"
    if layout.ray_nodes == 1:
        # One node with both GPUs, as `ray start --head --num-gpus=2` on a 2-GPU host.
        head = NodePlan("head", f"{build}-node", "127.0.0.1", None, "0,1", node_ports(base, True),
                        None, None, None)
        return ClusterPlan(spec.name, build, None, slot, temp_dir, base + 7, head, None, None)
    if method not in ISOLATION:
        raise Refused(f"{spec.name}: two Ray nodes need an isolation method ({', '.join(ISOLATION)}), got {method!r}")
    head_ip, worker_ip, veth, netns = _addresses(method, slot)
    isolated = method in FAITHFUL
    head = NodePlan("head", f"{build}-node-a", head_ip, veth[0] if veth else "lo", "0",
                    node_ports(base, True), None, None, None)
    worker = NodePlan("worker", f"{build}-node-b", worker_ip, veth[1] if veth else "lo", "1",
                      node_ports(base + PORTS_PER_CLUSTER // 2, False),
                      f"dsa-{build}-{slot}-b" if isolated else None,
                      f"{root}/{slot}/w" if isolated else None, netns)
    return ClusterPlan(spec.name, build, method, slot, temp_dir, base + 7, head, worker, veth)


def _addresses(method: str, slot: int):
    """(head ip, worker ip, veth names or None, netns name or None) of a two-node cluster."""
    if method == "netns":
        subnet = f"10.231.{slot + 1}"
        # Interface names: at most 15 characters.
        return f"{subnet}.1", f"{subnet}.2", (f"dsarc{slot}h", f"dsarc{slot}w"), f"dsa-rc{slot}"
    # Linux routes all of 127/8 to lo: distinct addresses need no setup.
    return f"127.0.{slot + 10}.1", f"127.0.{slot + 10}.2", None, None


_T = TypeVar("_T")


def _planned(value: _T | None, what: str) -> _T:
    """`value`, which plan_cluster sets wherever a command or environment uses it: a plan without
    it (made some other way) is refused rather than run with "None" in a command."""
    if value is None:
        raise Refused(f"the cluster plan has no {what}: plan_cluster sets it for this isolation method")
    return value


def netns_setup_commands(plan: ClusterPlan) -> list[list[str]]:
    """The network of a netns cluster: a veth pair, the worker's end in its namespace, a default
    route back through the head's end (so it reaches every address of the host)."""
    host_if, ns_if = _planned(plan.veth, "veth pair")
    worker = _planned(plan.worker, "worker node")
    ns = _planned(worker.netns, "network namespace")
    in_ns = ["ip", "netns", "exec", ns]
    return [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
        ["ip", "link", "set", ns_if, "netns", ns],
        ["ip", "addr", "add", f"{plan.head.ip}/24", "dev", host_if],
        ["ip", "link", "set", host_if, "up"],
        [*in_ns, "ip", "addr", "add", f"{worker.ip}/24", "dev", ns_if],
        [*in_ns, "ip", "link", "set", ns_if, "up"],
        [*in_ns, "ip", "link", "set", "lo", "up"],
        [*in_ns, "ip", "route", "add", "default", "via", plan.head.ip],
    ]


def netns_teardown_commands(plan: ClusterPlan) -> list[list[str]]:
    # Deleting the namespace deletes its veth end, and with it the host's end.
    ns = _planned(_planned(plan.worker, "worker node").netns, "network namespace")
    return [["ip", "netns", "del", ns], ["ip", "link", "del", _planned(plan.veth, "veth pair")[0]]]


# -- commands and environments --------------------------------------------------------------------

# Inside the worker node's new mount namespace: its own /dev/shm (vLLM's "same node" test and
# Ray's object store), its own Ray temp dir (on a second host /tmp/ray is that host's), its own
# hostname (NCCL's host hash), then `ray start` itself (exec: the process we signal is Ray's).
ISOLATE_SCRIPT = ('mount -t tmpfs -o size=' + WORKER_SHM + ' tmpfs /dev/shm && mkdir -p "$1" "$2" && '
                  'mount --bind "$1" "$2" && echo "$3" > /proc/sys/kernel/hostname && shift 3 && exec "$@"')
# What no program on these machines may change (docs: NVLink multicast can take the host's GPUs
# out of service): set again here because every process below gets an environment of ours.
SAFETY_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# NCCL names the transport of each channel ("via NET/Socket/0", "via P2P/CUMEM"): the evidence of
# whether NCCL saw one host or two. Logging only.
DIAGNOSTIC_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}
TAG_VAR, NODE_VAR = "DSA_CLUSTER_TAG", "DSA_CLUSTER_NODE"
TAG_PREFIX = "dsa-cluster:"


# `ray start` aborts a worker given any of these (Ray 2.52.0 ray/scripts/scripts.py:1069-1086).
RAY_HEAD_ONLY_FLAGS = ("--port", "--redis-shard-ports", "--include-dashboard")


def ray_start_command(python: str, plan: ClusterPlan, node: NodePlan) -> list[str]:
    cmd = [python, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats",
           "--node-ip-address", node.ip, "--node-name", node.name,
           "--num-gpus", str(node.num_gpus), "--num-cpus", "4",
           "--object-store-memory", str(OBJECT_STORE_BYTES)]
    if node.role == "head":
        cmd += ["--head", "--port", str(plan.gcs_port), "--temp-dir", plan.temp_dir, "--include-dashboard=false"]
    else:
        cmd += ["--address", plan.address]
    for flag, port in node.ports.items():
        cmd += [f"--{flag}", str(port)]
    return cmd


def node_command(python: str, plan: ClusterPlan, node: NodePlan) -> list[str]:
    """`ray start` for the node, wrapped in the namespaces the isolation method gives it."""
    ray = ray_start_command(python, plan, node)
    if node.role == "head" or plan.method == "shared":
        return ray
    isolate = ["sh", "-c", ISOLATE_SCRIPT, "sh", _planned(node.private_tmp, f"private Ray temp dir of {node.name}"),
               plan.temp_dir, _planned(node.hostname, f"hostname of {node.name}"), *ray]
    if plan.method == "netns":
        ns = _planned(node.netns, f"network namespace of {node.name}")
        return ["ip", "netns", "exec", ns, "unshare", "--uts", "--", *isolate]
    return ["unshare", "--mount", "--uts", "--propagation", "private", "--", *isolate]


# FlashInfer's all-reduce, which no variable of SAFETY_ENV reaches: its MNNVL workspace calls
# cuMulticastCreate itself (flashinfer-python 0.7.2.post1 comm/mnnvl.py:1117, through
# McastGPUBuffer; 0.6.12, vLLM 0.24.0's, comm/mnnvl.py:1216). vLLM's automatic choice
# (VLLM_FLASHINFER_ALLREDUCE_BACKEND=auto) takes it
#   - in 0.33.0 for a TP group on one node (distributed/device_communicators/flashinfer_all_reduce.py
#     :156-163, "MNNVL decodes faster ... on single-node NVSwitch systems"), asked for by GLM-5's own
#     layers whatever VLLM_ALLREDUCE_USE_FLASHINFER says (models/deepseek_v32/nvidia/model.py:144,
#     158, 319 -> models/common/ops/fused_allreduce_rms_norm.py -> model_executor/layers/
#     fused_allreduce_gemma_rms_norm.py:91 get_fi_ar_workspace), by the standalone all-reduce
#     (VLLM_ALLREDUCE_USE_FLASHINFER, default 1 in 0.33.0: envs.py:1961-1963) and by the
#     all-reduce + RMSNorm fusion pass (on by default on sm90 with TP > 1: config/vllm.py:179-203);
#   - in 0.24.0 for a group vLLM counts as two nodes (flashinfer_all_reduce.py:101-104), through
#     that fusion pass (compilation/passes/fusion/allreduce_rms_fusion.py:988).
# vLLM counts nodes by shared memory (parallel_state.py _node_count / in_the_same_node_as), so:
#   - one node (mp, one Ray node, two Ray nodes sharing /dev/shm): the TRT-LLM backend, whose
#     workspace is IPC memory with multicast off (flashinfer 0.7.2.post1 comm/trtllm_ar.py:512-520,
#     enable_multicast=False) and which is 0.24.0's own choice for one node (:105-110);
#   - two nodes: "trtllm" would refuse the group (ValueError: 0.33.0 flashinfer_all_reduce.py:203-207,
#     0.24.0 :137-141), so "auto", under which 0.33.0 picks no FlashInfer backend on a GPU below
#     sm_100 (:164-174); and FlashInfer's standalone all-reduce and vLLM's fusion pass off, so
#     that 0.24.0's "auto" (MNNVL for two nodes) is never asked.
ONE_NODE_ALLREDUCE_ENV = {"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm"}
TWO_NODE_ALLREDUCE_ENV = {"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "auto", "VLLM_ALLREDUCE_USE_FLASHINFER": "0"}
TWO_NODE_ALLREDUCE_ARGS = ["--compilation-config", json.dumps({"pass_config": {"fuse_allreduce_rms": False}})]
# What a server's log says FlashInfer's all-reduce did (both releases log the first; 0.33.0 the
# second when MNNVL was tried and failed): the evidence that multicast was not used.
FI_AR_WORKSPACE = re.compile(r"Initialized FlashInfer Allreduce norm (?:quantization )?fusion workspace "
                             r"with backend=(\w+)")
FI_AR_MNNVL_TRIED = re.compile(r"FlashInfer mnnvl allreduce (?:quantization fusion )?workspace unavailable")


def vllm_node_count(plan: ClusterPlan | None) -> int:
    """How many nodes vLLM counts for the layout's ranks: two only for two Ray nodes that do not
    share /dev/shm (vLLM's same-node test is shared memory)."""
    return 2 if plan is not None and plan.worker is not None and plan.method in FAITHFUL else 1


def allreduce_env(plan: ClusterPlan | None) -> dict[str, str]:
    """ALLREDUCE_GUARD's variables for every process of a layout: its server, Ray nodes and
    (through them) Ray workers, which keep a node's own value over the driver's
    (v1/executor/ray_executor_v2.py:173-175)."""
    return dict(TWO_NODE_ALLREDUCE_ENV if vllm_node_count(plan) == 2 else ONE_NODE_ALLREDUCE_ENV)


def allreduce_args(layout: Layout, plan: ClusterPlan | None) -> list[str]:
    """ALLREDUCE_GUARD's `vllm serve` flags: the fusion pass off where TP spans two nodes (with
    TP = 1 the pass turns itself off: allreduce_rms_fusion.py:989-991)."""
    return list(TWO_NODE_ALLREDUCE_ARGS) if vllm_node_count(plan) == 2 and layout.tp > 1 else []


ALLREDUCE_GUARD = ("FlashInfer's all-reduce kept off NVLink multicast: VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm "
                   "where vLLM counts one node; where it counts two, 'auto' (no FlashInfer backend below sm_100 "
                   "in 0.33.0), VLLM_ALLREDUCE_USE_FLASHINFER=0 and the all-reduce + RMSNorm fusion pass off")


def _two_node_env(node: NodePlan) -> dict[str, str]:
    # What docs/cluster.md asks of every node of a real cluster: its own address, and the
    # interface NCCL and gloo bootstrap over.
    ifname = _planned(node.ifname, f"network interface of {node.name}")
    return {"VLLM_HOST_IP": node.ip, "NCCL_SOCKET_IFNAME": ifname, "GLOO_SOCKET_IFNAME": ifname}


def node_env_extra(plan: ClusterPlan, node: NodePlan, tag: str) -> dict[str, str]:
    env = {**SAFETY_ENV, **allreduce_env(plan), **DIAGNOSTIC_ENV, "CUDA_VISIBLE_DEVICES": node.gpus,
           "RAY_USAGE_STATS_ENABLED": "0", TAG_VAR: tag, NODE_VAR: node.name}
    if plan.worker is not None:
        env.update(_two_node_env(node))
    return env


def server_env_extra(layout: Layout, plan: ClusterPlan | None, tag: str) -> dict[str, str]:
    """The `vllm serve` process's variables. With Ray it runs on the head node (as in
    `docker exec HEAD vllm serve`), sees the head's GPUs, and finds its cluster by RAY_ADDRESS."""
    env = {**SAFETY_ENV, **allreduce_env(plan), **DIAGNOSTIC_ENV, TAG_VAR: tag, NODE_VAR: "server"}
    if plan is None:
        env["CUDA_VISIBLE_DEVICES"] = "0,1"
        return env
    # Ray folds lines repeated across workers into one: each worker's lines are evidence here.
    env.update({"RAY_ADDRESS": plan.address, "RAY_DEDUP_LOGS": "0", "CUDA_VISIBLE_DEVICES": plan.head.gpus})
    if plan.worker is not None:
        env.update(_two_node_env(plan.head))
    return env
