"""Stock vLLM against the overlay across two GPUs: TP=2 (multiprocessing, one Ray node, two Ray
nodes) and PP=2 across two Ray nodes, default flags (CUDA graphs on) but for the all-reduce guard
below, tokens compared.

Layouts (LAYOUTS): `mp-tp2` and `mp-pp2` (vLLM's multiprocessing executor), `ray1-tp2` (one Ray
node with both GPUs), `ray2-tp2` and `ray2-pp2` (two Ray nodes of one GPU each). Each layout is
served by stock vLLM and by the overlay side by side, on the same GPUs, each build with its own
Ray cluster (started with that build's PYTHONPATH: Ray workers inherit the environment of
`ray start`), own ports, own Ray temp dir and HOME.

Two Ray nodes on one host are made two nodes the way vLLM tells nodes apart, 0.24.0 and 0.33.0
alike (docs/cluster.md, "Two Ray nodes on one host"): vLLM maps GPUs per Ray node, but decides
"same node" for its custom all-reduce by whether the ranks share POSIX shared memory, and NCCL by
hostname. The second node therefore gets (ISOLATION, first that the probe finds working):

    netns    its own network namespace (veth pair, own address), mount namespace (own /dev/shm,
             own Ray temp dir) and UTS namespace (own hostname)
    mountns  own mount and UTS namespaces; addresses on the loopback (127.0.x.y)
    shared   nothing of its own but a loopback address: the setup that failed at start-up with
             `IndexError: device_id 1 is out of range for assigned_physical_gpu_ids [0]`; a
             TP=2 run there is a control, expected to reproduce that error

The base (the vLLM release both sites hold, which `--vllm` asserts) is recorded in every run, and
`compare` refuses runs of different bases. Every server and Ray node gets an environment that
keeps FlashInfer's all-reduce off NVLink multicast (ALLREDUCE_GUARD: vLLM 0.33.0 would otherwise
ask FlashInfer for an MNNVL workspace, which calls cuMulticastCreate, for any TP group on one host;
0.24.0 for a TP group across two nodes).

A layout list is waves separated by spaces or commas; `+` runs layouts in one wave at once;
`LAYOUT@METHOD` forces an isolation method (e.g. `ray2-tp2@shared`, the control).

    python -m dsa_image.validation.cluster probe
    python -m dsa_image.validation.cluster plan --layouts "ray2-tp2 ray2-pp2" [--method netns]
    python -m dsa_image.validation.cluster run --layouts "mp-tp2 ray1-tp2" --model DIR \\
        --stock-site S --overlay-site O --out DIR [--vllm 0.33.0] [--deadline-s 540]
    python -m dsa_image.validation.cluster compare --out DIR INPUT...
    python -m dsa_image.validation.cluster cleanup

`run` writes DIR/<run>.json after each wave (the results so far survive a killed call) and the
servers' and Ray nodes' logs under DIR/<run>/; `compare` reads those files (and cluster.json files
of earlier calls) and writes cluster.json and cluster.md. Exit codes: 0 every run as expected,
1 a run was not, 2 usage (a layout, method or plan refused, with the reason).

Stdlib only, like the other validation harnesses (it starts vLLM and Ray, never imports them).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from dsa_image.build import model_info_cache
from dsa_image.smoke import gpu as smoke_gpu
from dsa_image.harness import server as serving
from dsa_image.validation import serving_modes, vllm_base
from dsa_image.validation.recipes import port_accepts

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


class Refused(ValueError):
    """A layout list or plan that cannot be carried out; the message says what was expected,
    what was found, and what to do."""


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


# -- isolation probe ------------------------------------------------------------------------------

# Each probe does, on a throw-away namespace, exactly what the node start does.
NETNS_PROBE = r"""
command -v ip >/dev/null || { echo "no 'ip' command (iproute2)"; exit 3; }
command -v unshare >/dev/null || { echo "no 'unshare' command (util-linux)"; exit 3; }
ns=dsa-probe-$$ host=dsapr$$h peer=dsapr$$w
trap 'ip netns del $ns 2>/dev/null; ip link del $host 2>/dev/null' EXIT
ip netns add $ns || exit 4
ip link add $host type veth peer name $peer || exit 4
ip link set $peer netns $ns || exit 4
ip netns exec $ns unshare --uts -- sh -c \
  'mount -t tmpfs tmpfs /dev/shm && echo dsa-probe > /proc/sys/kernel/hostname && ip link set lo up' || exit 4
test "$(cat /proc/sys/kernel/hostname)" != dsa-probe || { echo "the hostname leaked out of the UTS namespace"; exit 4; }
ip addr add 10.231.250.1/30 dev $host && ip link set $host up || exit 4
ip netns exec $ns ip addr add 10.231.250.2/30 dev $peer && ip netns exec $ns ip link set $peer up || exit 4
"$DSA_PYTHON" -c "$DSA_NETNS_CHECK" $ns || { echo "no TCP connection across the veth pair (a firewall?)"; exit 5; }
echo ok
"""
# TCP both ways across the probe's veth pair: Ray and NCCL connect from either end.
NETNS_CHECK = r"""
import socket, subprocess, sys
ns, python = sys.argv[1], sys.executable
server = socket.create_server(("10.231.250.1", 0))
server.settimeout(10)
client = f"import socket; socket.create_connection(('10.231.250.1', {server.getsockname()[1]}), timeout=10).close()"
subprocess.run(["ip", "netns", "exec", ns, python, "-c", client], check=True, timeout=30)
server.accept()[0].close()
listener = ("import socket; s = socket.create_server(('10.231.250.2', 0)); s.settimeout(10); "
            "print(s.getsockname()[1], flush=True); s.accept()[0].close()")
inside = subprocess.Popen(["ip", "netns", "exec", ns, python, "-c", listener], stdout=subprocess.PIPE, text=True)
port = int(inside.stdout.readline())
socket.create_connection(("10.231.250.2", port), timeout=10).close()
sys.exit(inside.wait(30))
"""
MOUNTNS_PROBE = r"""
command -v unshare >/dev/null || { echo "no 'unshare' command (util-linux)"; exit 3; }
unshare --mount --uts --propagation private -- sh -c \
  'mount -t tmpfs tmpfs /dev/shm && echo dsa-probe > /proc/sys/kernel/hostname' || exit 4
test "$(cat /proc/sys/kernel/hostname)" != dsa-probe || { echo "the hostname leaked out of the UTS namespace"; exit 4; }
echo ok
"""
PROBES = {"netns": NETNS_PROBE, "mountns": MOUNTNS_PROBE}


def probe_isolation(run=subprocess.run) -> dict[str, dict]:
    """Which isolation methods work on this machine (root and CAP_SYS_ADMIN/CAP_NET_ADMIN are
    not known in advance): each probe's exit code and last output line."""
    results = {}
    for method, script in PROBES.items():
        try:
            done = run(["sh", "-c", script], capture_output=True, text=True, check=False, timeout=60,
                       env={**os.environ, "DSA_PYTHON": sys.executable, "DSA_NETNS_CHECK": NETNS_CHECK})
            lines = (done.stdout + done.stderr).strip().splitlines()
            results[method] = {"ok": done.returncode == 0, "exit": done.returncode,
                               "detail": lines[-1] if lines else ""}
        except (OSError, subprocess.TimeoutExpired) as exc:
            results[method] = {"ok": False, "exit": None, "detail": f"{type(exc).__name__}: {exc}"}
    results["shared"] = {"ok": True, "exit": 0, "detail": "needs nothing"}
    return results


def choose_method(probes: dict[str, dict], order=DEFAULT_METHOD_ORDER) -> str:
    for method in order:
        if probes.get(method, {}).get("ok"):
            return method
    found = "; ".join(f"{m}: {probes.get(m, {}).get('detail', 'not probed')}" for m in order)
    raise Refused(f"no way to give the second Ray node its own /dev/shm and hostname here (tried "
                  f"{', '.join(order)}: {found}). These need root with CAP_SYS_ADMIN (and CAP_NET_ADMIN for "
                  f"netns). Without them vLLM (0.24.0 and 0.33.0) takes both Ray nodes for one node; run the control "
                  f"LAYOUT@shared to show the failure, or give the runs a privileged machine")


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


def netns_setup_commands(plan: ClusterPlan) -> list[list[str]]:
    """The network of a netns cluster: a veth pair, the worker's end in its namespace, a default
    route back through the head's end (so it reaches every address of the host)."""
    host_if, ns_if = plan.veth
    ns = plan.worker.netns
    in_ns = ["ip", "netns", "exec", ns]
    return [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if],
        ["ip", "link", "set", ns_if, "netns", ns],
        ["ip", "addr", "add", f"{plan.head.ip}/24", "dev", host_if],
        ["ip", "link", "set", host_if, "up"],
        [*in_ns, "ip", "addr", "add", f"{plan.worker.ip}/24", "dev", ns_if],
        [*in_ns, "ip", "link", "set", ns_if, "up"],
        [*in_ns, "ip", "link", "set", "lo", "up"],
        [*in_ns, "ip", "route", "add", "default", "via", plan.head.ip],
    ]


def netns_teardown_commands(plan: ClusterPlan) -> list[list[str]]:
    # Deleting the namespace deletes its veth end, and with it the host's end.
    return [["ip", "netns", "del", plan.worker.netns], ["ip", "link", "del", plan.veth[0]]]


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
    isolate = ["sh", "-c", ISOLATE_SCRIPT, "sh", node.private_tmp, plan.temp_dir, node.hostname, *ray]
    if plan.method == "netns":
        return ["ip", "netns", "exec", node.netns, "unshare", "--uts", "--", *isolate]
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
    return {"VLLM_HOST_IP": node.ip, "NCCL_SOCKET_IFNAME": node.ifname, "GLOO_SOCKET_IFNAME": node.ifname}


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


# -- processes ------------------------------------------------------------------------------------


def start_process(cmd: list[str], env: dict, log_path: Path, cwd: str) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                start_new_session=True)


def stop_process(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """SIGTERM to the process group (`ray start --block` stops the node's processes on it), then
    SIGKILL. Only while the leader is unreaped: its pid (the group id) cannot be reused then."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def read_environ(pid: str, proc_root: str = "/proc") -> dict[str, str]:
    try:
        raw = Path(proc_root, pid, "environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def tagged_pids(prefix: str, proc_root: str = "/proc") -> dict[int, str]:
    """Processes whose environment carries a DSA_CLUSTER_TAG starting with `prefix`: the servers,
    Ray nodes and Ray workers this harness started (all inherit the tag), none other."""
    found = {}
    for entry in os.listdir(proc_root):
        if entry.isdigit() and int(entry) != os.getpid():
            tag = read_environ(entry, proc_root).get(TAG_VAR, "")
            if tag.startswith(prefix):
                found[int(entry)] = tag
    return found


def sweep(prefix: str) -> dict[int, str]:
    """SIGKILL what is left of our processes under `prefix` (after an orderly stop, or from an
    earlier call that was killed)."""
    pids = tagged_pids(prefix)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


def run_commands(commands: list[list[str]], check: bool) -> list[dict]:
    done = []
    for cmd in commands:
        result = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=30)
        done.append({"cmd": " ".join(cmd), "exit": result.returncode, "output": (result.stdout + result.stderr).strip()})
        if check and result.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed with {result.returncode}: {done[-1]['output']}")
    return done


def remove_stale_namespaces() -> list[str]:
    """Network namespaces and veth ends named like ours, left by a killed earlier call."""
    if shutil.which("ip") is None:
        return []
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False, timeout=30).stdout
    removed = [line.split()[0] for line in listing.splitlines() if line.startswith("dsa-rc")]
    run_commands([["ip", "netns", "del", name] for name in removed], check=False)
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False, timeout=30).stdout
    stale = re.findall(r"^\d+: (dsarc\d+[hw])[@:]", links, re.MULTILINE)
    run_commands([["ip", "link", "del", name] for name in stale], check=False)
    return removed + stale


# -- evidence ----------------------------------------------------------------------------------

# Run with a build's PYTHONPATH: a Ray driver that lists the cluster's nodes (waiting for the
# expected number) and its actors with their pid, node and address, from the GCS.
EVIDENCE_SCRIPT = r"""
import json, sys, time
import ray
from ray._private import state
address, expected, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ray.init(address=address, log_to_driver=False, logging_level=40)
deadline = time.monotonic() + timeout
while True:
    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) >= expected or time.monotonic() > deadline:
        break
    time.sleep(1)
print("EVIDENCE " + json.dumps({
    "nodes": [{"node_id": n["NodeID"], "name": n.get("NodeName"), "ip": n["NodeManagerAddress"],
               "hostname": n["NodeManagerHostname"], "gpus": n["Resources"].get("GPU", 0)} for n in nodes],
    "actors": [{"class": a["ActorClassName"], "name": a["Name"], "state": a["State"], "pid": a["Pid"],
                "ip": a["Address"]["IPAddress"], "node_id": a["Address"]["NodeID"]}
               for a in state.actors().values()]}))
ray.shutdown()
"""
WORKER_CLASSES = ("RayWorkerProc", "RayWorkerWrapper")  # vLLM 0.24.0's V2 and old Ray executors


def ray_evidence(python: str, env: dict, plan: ClusterPlan, wait_s: float = 60) -> dict:
    cmd = [python, "-c", EVIDENCE_SCRIPT, plan.address, str(len(plan.nodes)), str(wait_s)]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=wait_s + 60)
    except subprocess.TimeoutExpired:
        return {"error": f"the Ray node listing did not answer within {wait_s + 60:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith("EVIDENCE "):
            return json.loads(line[len("EVIDENCE "):])
    return {"error": f"the Ray node listing exited with {done.returncode}: {(done.stdout + done.stderr)[-1500:]}"}


def ray_status(python: str, env: dict, plan: ClusterPlan) -> str:
    try:
        done = subprocess.run([python, "-m", "ray.scripts.scripts", "status", "--address", plan.address],
                              env=env, capture_output=True, text=True, check=False, timeout=45)
        return (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        return "ray status did not answer within 45 s"


# `ray start --node-ip-address 127.0.0.1` registers the host's routable address instead
# (Ray 2.52.0: ray/_private/services.py:607-621, called from ray/scripts/scripts.py:737; seen on
# the 2x H200: 192.0.2.2).
RAY_RESOLVES_TO_HOST = ("127.0.0.1", "::1", "localhost")


def node_problems(evidence: dict, plan: ClusterPlan) -> list[str]:
    """What the Ray node list shows against the plan: one alive node per planned node, at its
    address, with its GPU count; two nodes with distinct ids (and hostnames where isolated)."""
    if "error" in evidence:
        return [evidence["error"]]
    nodes = evidence.get("nodes", [])
    problems = []
    if len(nodes) != len(plan.nodes):
        problems.append(f"expected {len(plan.nodes)} alive Ray node(s), found {len(nodes)}: "
                        f"{[(n['ip'], n['gpus']) for n in nodes]}")
    for planned in plan.nodes:
        seen = [n for n in nodes if n["name"] == planned.name]
        if len(seen) != 1:
            problems.append(f"expected one Ray node named {planned.name} ({planned.ip}), found {len(seen)}")
        elif seen[0]["ip"] != planned.ip and planned.ip not in RAY_RESOLVES_TO_HOST:
            problems.append(f"{planned.name}: expected address {planned.ip}, Ray lists {seen[0]['ip']}")
        elif seen[0]["gpus"] != planned.num_gpus:
            problems.append(f"{planned.name} at {planned.ip}: expected {planned.num_gpus} GPU(s), Ray lists "
                            f"{seen[0]['gpus']}")
        elif planned.hostname and seen[0]["hostname"] != planned.hostname:
            problems.append(f"{planned.name}: expected hostname {planned.hostname} (own UTS namespace), Ray lists "
                            f"{seen[0]['hostname']}")
    if len({n["node_id"] for n in nodes}) != len(nodes):
        problems.append("two Ray nodes share a node id")
    return problems


def worker_problems(evidence: dict, plan: ClusterPlan, layout: Layout) -> list[str]:
    """vLLM's workers as Ray actors: tp x pp of them alive, one per GPU of the plan, so on two
    nodes one on each."""
    if "error" in evidence:
        return [evidence["error"]]
    workers = [a for a in evidence.get("actors", [])
               if a["class"].endswith(WORKER_CLASSES) and a["state"] == "ALIVE"]
    expected = layout.tp * layout.pp
    problems = []
    if len(workers) != expected:
        problems.append(f"expected {expected} alive vLLM worker actors, found {len(workers)}")
    # By Ray's node id, not address: Ray may register another address than planned (127.0.0.1).
    node_id = {n["name"]: n["node_id"] for n in evidence.get("nodes", [])}
    per_node = {node.name: sum(1 for w in workers if w["node_id"] == node_id.get(node.name)) for node in plan.nodes}
    if any(per_node[node.name] != node.num_gpus for node in plan.nodes):
        problems.append(f"vLLM workers per Ray node {per_node}, expected one per GPU of each node")
    return problems


def parse_gpu_apps(inventory: str, apps: str) -> dict[int, dict]:
    """pid -> GPU index and memory (MiB), from the smoke test's nvidia-smi queries
    (smoke.gpu.INVENTORY_QUERY and APPS_QUERY)."""
    index_of = {gpu["uuid"]: gpu["index"] for gpu in smoke_gpu.parse_inventory(inventory)}
    return {app["pid"]: {"gpu": index_of[app["gpu_uuid"]], "used_mib": app["used_memory_mib"]}
            for app in smoke_gpu.parse_apps(apps) if app["gpu_uuid"] in index_of}


def gpu_apps() -> dict[int, dict] | str:
    """parse_gpu_apps of this host, or why nvidia-smi could not say."""
    answers = [smoke_gpu.host_runner(query) for query in (smoke_gpu.INVENTORY_QUERY, smoke_gpu.APPS_QUERY)]
    for code, output in answers:
        if code != 0:
            return f"nvidia-smi exited {code}: {output.strip()[-500:]}"
    try:
        return parse_gpu_apps(answers[0][1], answers[1][1])
    except ValueError as exc:
        return f"nvidia-smi: {exc}"


def _namespace(pid: int | str, kind: str, proc_root: str = "/proc") -> str | None:
    try:
        return os.readlink(f"{proc_root}/{pid}/ns/{kind}")
    except OSError:
        return None


def gpu_processes(apps: dict[int, dict], tag_prefix: str, proc_root: str = "/proc") -> list[dict]:
    """Our processes on the GPUs: which node each belongs to (its DSA_CLUSTER_NODE), and whether it
    runs in namespaces other than this harness's (the isolated Ray node)."""
    mine = {kind: _namespace(os.getpid(), kind, proc_root) for kind in ("net", "mnt", "uts")}
    rows = []
    for pid, app in sorted(apps.items()):
        env = read_environ(str(pid), proc_root)
        if not env.get(TAG_VAR, "").startswith(tag_prefix):
            continue
        rows.append({"pid": pid, "gpu": app["gpu"], "used_mib": app["used_mib"], "node": env.get(NODE_VAR),
                     **{f"own_{kind}ns": _namespace(pid, kind, proc_root) not in (None, mine[kind])
                        for kind in ("net", "mnt", "uts")}})
    return rows


def placement_problems(rows: list[dict], plan: ClusterPlan | None, layout: Layout) -> list[str]:
    """The GPU each node's worker really used, and (isolated runs) that the second node's worker
    ran in the namespaces the method gives it."""
    if plan is None or plan.worker is None:
        used = sorted({row["gpu"] for row in rows})
        return [] if used == [0, 1] else [f"expected our processes on GPUs [0, 1], found {used}"]
    problems = []
    for node in plan.nodes:
        on_node = [row for row in rows if row["node"] == node.name]
        gpus = sorted({row["gpu"] for row in on_node})
        if gpus != [int(node.gpus)]:
            problems.append(f"{node.name}: expected its worker on GPU {node.gpus}, found GPUs {gpus}")
        if node.role == "worker" and plan.method in FAITHFUL:
            wanted = ("net", "mnt", "uts") if plan.method == "netns" else ("mnt", "uts")
            shared = [kind for kind in wanted for row in on_node if not row[f"own_{kind}ns"]]
            if shared:
                problems.append(f"{node.name}: its worker shares the {sorted(set(shared))} namespace(s) of the host")
    return problems


# -- what the server logged ------------------------------------------------------------------

WORKER_LINE = re.compile(r"\((?P<proc>[A-Za-z_][\w.-]*) pid=(?P<pid>\d+)(?:, ip=(?P<ip>[\d.]+))?\)")
ALL_REDUCE = re.compile(r"Using (\[[^\]]*\]) all-reduce backends \(in dispatch order\) for group '([^']+)'")
# 0.24.0: "Custom allreduce is disabled because this process group spans across nodes."; 0.33.0
# words the multi-node cases "Custom collectives are disabled because this multi-node group does
# not have MNNVL-capable GPUs on every rank." (device_communicators/custom_all_reduce.py:233-234,
# :351-352) and keeps the older wording for the others (:190, :269, :284).
CUSTOM_AR_OFF = re.compile(r"Custom (?:allreduce is|collectives are) disabled because ([^.\n]*)")
NCCL_CHANNEL = re.compile(r"Channel \d+/\d+ : .*? via (\S+)")


def log_facts(text: str) -> dict:
    workers = sorted({(m["proc"], int(m["pid"]), m["ip"]) for m in WORKER_LINE.finditer(text)},
                     key=lambda w: (w[0], w[1]))
    return {
        "processes": [{"process": p, "pid": pid, "ip": ip} for p, pid, ip in workers],
        "all_reduce_backends": sorted({f"{group}: {backends}" for backends, group in ALL_REDUCE.findall(text)}),
        "custom_allreduce_disabled": sorted(set(CUSTOM_AR_OFF.findall(text))),
        "nccl_transports": sorted(set(NCCL_CHANNEL.findall(text))),
        "index_error": sorted(set(INDEX_ERROR.findall(text))),
        "flashinfer_allreduce_workspaces": sorted(set(FI_AR_WORKSPACE.findall(text))),
        "flashinfer_mnnvl_tried": bool(FI_AR_MNNVL_TRIED.search(text)),
        "errors": serving.log_errors(text)[:10],
    }


def tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def session_dir(temp_dir: Path) -> Path | None:
    """The session directory under a Ray temp dir. session_latest is an absolute link as the
    node saw it: for the isolated worker that path is the head's, so only its name is used."""
    link = temp_dir / "session_latest"
    if not link.is_symlink():
        return None
    return temp_dir / os.path.basename(os.readlink(link))


def copy_ray_logs(plan: ClusterPlan, into: Path, per_file: int = 1 << 20) -> list[Path]:
    """Each node's Ray logs (the isolated worker's lie under its private temp dir), files up to
    1 MiB; the paths copied."""
    sources = {plan.head.name: Path(plan.temp_dir)}
    if plan.worker is not None and plan.worker.private_tmp:
        sources[plan.worker.name] = Path(plan.worker.private_tmp)
    copied = []
    for name, temp in sources.items():
        session = session_dir(temp)
        logs = session / "logs" if session else None
        if logs is None or not logs.is_dir():
            continue
        target = into / f"ray-{name}"
        target.mkdir(parents=True, exist_ok=True)
        for item in sorted(logs.iterdir()):
            if item.is_file() and item.suffix in (".out", ".err", ".log") and item.stat().st_size <= per_file:
                shutil.copy2(item, target / item.name)
                copied.append(target / item.name)
    return copied


# -- one wave -----------------------------------------------------------------------------------

PROMPT_LENGTHS = (20, 300, 3000)  # 3000 > index_topk (2048): the prefill reaches the sparse indexer
MAX_TOKENS = 16
BUILDS = ("stock", "overlay")
PORTS_PER_WAVE = 20  # API ports: a wave's servers never reuse the ports of an earlier wave's


def prompts(model: str) -> dict[str, list[list[int]]]:
    token_ids = serving_modes.prompt_token_ids(model)
    return {batch: [serving_modes.model_prompt_ids(token_ids, n, f"cluster:{batch}:{i}")
                    for i, n in enumerate(PROMPT_LENGTHS)] for batch in ("sequential", "concurrent")}


def wait_servers(servers: list[dict], deadline: float, expect_index_error: set[str], poll_s: float = 1.0) -> dict:
    """Seconds from start to healthy per server, or "error: ...". A control server (expected to
    fail with the IndexError) is settled once its log shows it: vLLM may not exit after a Ray
    worker fails, and waiting for it would hold the whole wave until the deadline."""
    def control_failed(server: dict) -> str | None:
        if server["name"] in expect_index_error and INDEX_ERROR.search(tail(Path(server["log"]), 1 << 20)):
            return "logged the IndexError (the control's expected failure)"
        return None
    return serving_modes.wait_each_healthy(servers, deadline, poll_s, settled=control_failed)


class Wave:
    """The runs of one wave, each served by every build: their clusters, servers, and findings."""

    def __init__(self, runs: list[RunSpec], methods: dict[str, str | None], probes: dict, args,
                 first_slot: int, first_port: int, call_id: str, base: str | None = None):
        self.runs, self.probes, self.args, self.call_id, self.base = runs, probes, args, call_id, base
        self.first_port = first_port
        self.entries = []  # one per (run, build)
        slot = first_slot
        for spec in runs:
            for build in BUILDS:
                plan = None
                if spec.layout.ray_nodes:
                    plan = plan_cluster(spec, build, methods[spec.name], slot, args.ray_root)
                    slot += 1
                self.entries.append({"spec": spec, "build": build, "method": methods[spec.name], "plan": plan,
                                     "site": args.stock_site if build == "stock" else args.overlay_site,
                                     "dir": Path(args.out) / spec.stem, "report": {}})
        self.next_slot = slot
        self.nodes: list[dict] = []  # {"entry", "node", "proc", "log"}
        self.servers: list[dict] = []
        self.networks: list[ClusterPlan] = []

    def home(self, entry: dict, who: str) -> str:
        # Kept across calls: DeepGEMM's and Triton's caches make a second start faster.
        return str(Path(self.args.work_dir) / f"{entry['spec'].stem}-{entry['build']}-{who}")

    def shared_caches(self, entry: dict) -> dict[str, str]:
        """FlashInfer's JIT cache, one per build for every server and Ray node of the call (and of
        later calls: it lives in the work dir). A cold vLLM 0.33.0 server spends about 100 s
        compiling FlashInfer's sampling module (docs/validation/h200-2026-11-30-vllm0_33_0-run2,
        "Start-up time found"); with a HOME each, every Ray node of every layout compiled it
        again, at once. FlashInfer builds a module under a file lock in that cache
        (flashinfer/jit/core.py:573, lock in FLASHINFER_JIT_DIR/tmp) and loads what another
        process built. Per build: the ninja files name the site's own include paths. FlashInfer's
        autotune cache moves with it (flashinfer/autotune_cache.py:167; written by atomic rename,
        :243-248): a build's servers may reuse each other's kernel choices, never another build's."""
        return {"FLASHINFER_WORKSPACE_BASE": str(Path(self.args.work_dir) / f"flashinfer-{entry['build']}")}

    def tag(self, entry: dict) -> str:
        """DSA_CLUSTER_TAG of the entry's server, Ray nodes and every process they start."""
        return f"{TAG_PREFIX}{self.call_id}:{entry['spec'].stem}:{entry['build']}:"

    def evidence_env(self, entry: dict) -> dict:
        return serving.server_env(entry["site"], self.home(entry, "evidence"), {**SAFETY_ENV, TAG_VAR: self.tag(entry)})

    # clusters

    def start_clusters(self, deadline: float) -> None:
        clustered = [e for e in self.entries if e["plan"]]
        for entry in clustered:
            self._prepare(entry)
        for entry in clustered:
            if not entry["report"].get("error"):
                self._start_node(entry, entry["plan"].head)
        for entry in clustered:
            if not entry["report"].get("error"):
                self._wait_gcs(entry, deadline)
        for entry in clustered:
            if entry["plan"].worker and not entry["report"].get("error"):
                self._start_node(entry, entry["plan"].worker)

    def _prepare(self, entry: dict) -> None:
        """Fresh Ray temp dirs, and for netns the worker's network."""
        plan = entry["plan"]
        entry["dir"].mkdir(parents=True, exist_ok=True)
        shutil.rmtree(Path(plan.temp_dir).parent, ignore_errors=True)
        for directory in (plan.temp_dir, *(n.private_tmp for n in plan.nodes if n.private_tmp)):
            Path(directory).mkdir(parents=True, exist_ok=True)
        if plan.method == "netns":
            self.networks.append(plan)
            try:
                entry["report"]["network_setup"] = run_commands(netns_setup_commands(plan), check=True)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                entry["report"]["error"] = f"the worker node's network could not be set up: {exc}"

    def _start_node(self, entry: dict, node: NodePlan) -> None:
        plan = entry["plan"]
        env = serving.server_env(entry["site"], self.home(entry, node.name),
                                 {**node_env_extra(plan, node, self.tag(entry)), **self.shared_caches(entry)})
        cmd = node_command(self.args.python, plan, node)
        log = entry["dir"] / f"ray-start-{node.name}.log"
        entry["report"].setdefault("node_commands", {})[node.name] = cmd
        self.nodes.append({"entry": entry, "node": node, "log": log,
                           "proc": start_process(cmd, env, log, self.home(entry, node.name))})

    def _wait_gcs(self, entry: dict, deadline: float) -> None:
        plan = entry["plan"]
        head = next(n for n in self.nodes if n["entry"] is entry and n["node"].role == "head")
        limit = min(deadline, time.monotonic() + 90)
        while not port_accepts(plan.gcs_port, plan.head.ip):
            if head["proc"].poll() is not None or time.monotonic() > limit:
                entry["report"]["error"] = (f"the Ray head of {plan.run}/{plan.build} did not open its GCS port "
                                            f"{plan.address} (exit code {head['proc'].poll()}); see {head['log'].name}")
                return
            time.sleep(1)

    def check_clusters(self) -> None:
        """Every cluster's nodes before any server starts: a server is not started on a cluster
        short of a node (vLLM would wait half an hour for its placement group)."""
        clustered = [e for e in self.entries if e["plan"] and not e["report"].get("error")]

        def check(entry):
            evidence = ray_evidence(self.args.python, self.evidence_env(entry), entry["plan"])
            entry["report"]["ray_before_serving"] = evidence
            problems = node_problems(evidence, entry["plan"])
            if problems:
                entry["report"]["error"] = "Ray cluster not as planned: " + "; ".join(problems)

        with concurrent.futures.ThreadPoolExecutor(max(1, len(clustered))) as pool:
            list(pool.map(check, clustered))

    # servers

    def ship_model_info(self) -> None:
        """Each server's HOME holds the model info the image ships, as a container's does (the API
        server resolves the model's classes; the Ray nodes do not): made once a machine per build
        (serving.image_model_info, in the root the other harnesses share), added to a kept HOME
        that lacks it. Without it a cold 0.33.0 server spent 42-44 s a class inspecting."""
        missing = [e for e in self.entries if not e["report"].get("error")
                   and not model_info_cache.shipped_dir(Path(self.home(e, "server"))).is_dir()]
        if not missing:
            return
        try:
            entries = serving.image_model_info({e["build"]: (self.args.python, e["site"]) for e in missing},
                                               Path(self.args.model), serving.model_info_root(self.args, self.args.work_dir))
        except model_info_cache.FILL_ERRORS as exc:
            for entry in missing:
                entry["report"]["error"] = f"the model info the image ships: {type(exc).__name__}: {exc}"
            return
        for entry in missing:
            model_info_cache.ship_into(Path(self.home(entry, "server")), entries[entry["build"]])

    def start_servers(self) -> None:
        for index, entry in enumerate(self.entries):
            port = self.first_port + index
            if not entry["report"].get("error") and port_accepts(port):
                entry["report"]["error"] = (f"port {port} already accepts connections before this server starts: "
                                            "another server would answer for it; stop it (cleanup) or pass --port-base")
            if entry["report"].get("error"):
                continue
            entry["dir"].mkdir(parents=True, exist_ok=True)
            layout = entry["spec"].layout
            extra = [*layout.server_args(), *allreduce_args(layout, entry["plan"]),
                     "--kv-cache-memory-bytes", str(self.args.kv_cache_memory_bytes),
                     "--gpu-memory-utilization", str(self.args.gpu_memory_utilization)]
            env_extra = {**server_env_extra(layout, entry["plan"], self.tag(entry)), **self.shared_caches(entry)}
            server = serving.start_server(f"{entry['spec'].stem}-{entry['build']}", entry["site"], self.args.model,
                                          port, str(entry["dir"]), extra,
                                          home=self.home(entry, "server"), python=self.args.python,
                                          env_extra=env_extra)
            entry["server"] = server
            entry["report"]["server_cmd"] = server["cmd"][1:]
            entry["report"]["server_env"] = env_extra
            self.servers.append(server)

    def wait_healthy(self, deadline: float) -> None:
        controls = {e["server"]["name"] for e in self.entries
                    if "server" in e and expected_outcome(e["spec"].layout, e["method"]) == "index-error"}
        status = wait_servers(self.servers, deadline, controls)
        for entry in self.entries:
            if "server" in entry:
                entry["report"]["healthy_after_s"] = status[entry["server"]["name"]]

    def gather_evidence(self) -> None:
        """While the servers run: our processes on each GPU, and each cluster's nodes and vLLM's
        worker actors."""
        apps = gpu_apps()
        healthy = [e for e in self.entries if isinstance(e["report"].get("healthy_after_s"), float)]

        def gather(entry):
            report, plan, layout = entry["report"], entry["plan"], entry["spec"].layout
            if isinstance(apps, dict) and apps:
                report["gpu_processes"] = gpu_processes(apps, self.tag(entry))
                problems = placement_problems(report["gpu_processes"], plan, layout)
            else:
                # A measurement this machine cannot make is reported, not counted against the run.
                report["gpu_processes"] = apps or "nvidia-smi listed no compute processes at all: placement not checked"
                problems = []
            if plan:
                evidence = ray_evidence(self.args.python, self.evidence_env(entry), plan, wait_s=5)
                report["ray_serving"] = evidence
                report["ray_status"] = ray_status(self.args.python, self.evidence_env(entry), plan)
                problems += node_problems(evidence, plan) + worker_problems(evidence, plan, layout)
            report["evidence_problems"] = problems

        with concurrent.futures.ThreadPoolExecutor(max(1, len(healthy))) as pool:
            list(pool.map(gather, healthy))

    def exercise(self, deadline: float) -> None:
        """The same greedy requests to every healthy server, one server at a time."""
        batch = prompts(self.args.model)
        for entry in self.entries:
            report = entry["report"]
            if not isinstance(report.get("healthy_after_s"), float):
                continue
            left = deadline - time.monotonic()
            if left < 20:
                report["error"] = f"no time left for the requests ({left:.0f} s before the call's deadline)"
                continue
            t0 = time.monotonic()
            try:
                report["results"] = serving_modes.run_mode_requests(entry["server"]["port"], batch, MAX_TOKENS,
                                                                    timeout=min(120.0, left))
            except Exception as exc:  # noqa: BLE001 - recorded; the other servers still answer
                report["error"] = f"{type(exc).__name__}: {exc}"
            report["request_time_s"] = round(time.monotonic() - t0, 2)

    # stop

    def stop(self) -> None:
        """Servers first (they hold the Ray drivers), then workers, then heads, then whatever of
        ours is left, then the network namespaces."""
        for server in self.servers:
            serving.stop(server)
        for role in ("worker", "head"):
            for node in self.nodes:
                if node["node"].role == role:
                    stop_process(node["proc"])
        left = sweep(f"{TAG_PREFIX}{self.call_id}:")
        for entry in self.entries:
            entry["report"]["killed_after_stop"] = sorted(p for p, t in left.items() if t == self.tag(entry))
        for plan in self.networks:
            run_commands(netns_teardown_commands(plan), check=False)

    def annotate(self) -> dict[str, dict]:
        """Each run's record, read from the logs once every process has stopped."""
        runs: dict[str, dict] = {}
        for entry in self.entries:
            spec, report = entry["spec"], entry["report"]
            try:
                self._read_logs(entry)
            except OSError as exc:  # recorded: the verdicts of the other runs still get written
                report["log_error"] = f"{type(exc).__name__}: {exc}"
            run = runs.setdefault(spec.name, run_header(spec, entry["method"], self.probes,
                                                        [r.name for r in self.runs], self.base))
            run["builds"][entry["build"]] = report
        for run in runs.values():
            run["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            run.update(run_verdict(run))
        return runs


    def _read_logs(self, entry: dict) -> None:
        report = entry["report"]
        if entry["plan"]:
            copied = copy_ray_logs(entry["plan"], entry["dir"])
            report["cluster"] = asdict(entry["plan"])
            report["ray_start_log_tails"] = {n["node"].name: tail(n["log"], 1500)
                                             for n in self.nodes if n["entry"] is entry}
            report["index_error_in_ray_logs"] = sorted({m for f in copied for m in INDEX_ERROR.findall(tail(f, 1 << 22))})
        if "server" in entry:
            log = Path(entry["server"]["log"])
            report["server_log"] = os.path.relpath(log, self.args.out)
            report["logged"] = log_facts(log.read_text(errors="replace"))
            report["log_tail"] = tail(log)


def run_header(spec: RunSpec, method: str | None, probes: dict, wave: list[str], base: str | None = None) -> dict:
    # The base: results of 0.24.0 and 0.33.0 must never meet in one comparison (compare_call).
    return {"run": spec.name, "vllm": base, "layout": asdict(spec.layout), "method": method,
            "method_description": ISOLATION.get(method) if method else None,
            "isolation_probe": probes if spec.layout.ray_nodes == 2 else None,
            "expected": expected_outcome(spec.layout, method), "reference": reference_for(spec.layout),
            "wave": wave, "prompt_lengths": list(PROMPT_LENGTHS), "max_tokens": MAX_TOKENS, "builds": {}}


def not_run(spec: RunSpec, method: str | None, probes: dict, why: str, base: str | None = None) -> dict:
    """The record of a run that was not started, and why: the comparison shows it as failed."""
    return {**run_header(spec, method, probes, [spec.name], base), "ok": False, "problems": [f"not run: {why}"],
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


# -- verdicts and the comparison -------------------------------------------------------------


def build_problems(report: dict) -> list[str]:
    problems = []
    healthy = report.get("healthy_after_s")
    if not isinstance(healthy, float):
        problems.append(report.get("error") or f"not healthy: {healthy}")
    elif report.get("error"):
        problems.append(report["error"])
    results = report.get("results")
    if isinstance(healthy, float) and not results and not report.get("error"):
        problems.append("no results")
    # Generated no tokens, not "empty text": random weights may generate tokens that detokenize
    # to nothing (serving.answered); run_verdict records those outputs.
    if results and (unanswered := serving.unanswered_outputs(results)):
        problems.append("no tokens generated: " + ", ".join(unanswered))
    problems += report.get("evidence_problems", [])
    # ALLREDUCE_GUARD should make these impossible; a log that shows one says the guard failed
    # (the workspace is made before the line is logged: this reports, it cannot prevent).
    logged = report.get("logged", {})
    if "mnnvl" in logged.get("flashinfer_allreduce_workspaces", []) or logged.get("flashinfer_mnnvl_tried"):
        problems.append("FlashInfer's MNNVL all-reduce workspace (NVLink multicast) was created or tried: "
                        "ALLREDUCE_GUARD did not hold")
    return problems


def run_verdict(run: dict) -> dict:
    """ok: the run went as expected. For 'serve': both builds healthy, answered (generated tokens;
    outputs that decoded to empty text are listed in `empty_text`), evidence as planned, identical
    tokens and texts; for 'index-error' (the control): both builds logged the IndexError."""
    builds = run["builds"]
    if run["expected"] == "index-error":
        reproduced = {b: bool(r.get("logged", {}).get("index_error") or r.get("index_error_in_ray_logs"))
                      for b, r in builds.items()}
        ok = len(reproduced) == len(BUILDS) and all(reproduced.values())
        return {"ok": ok, "reproduced_index_error": reproduced,
                "problems": [] if ok else [f"{b}: the IndexError was not logged" for b, r in reproduced.items() if not r]}
    problems = [f"{b}: {p}" for b, r in builds.items() for p in build_problems(r)]
    if any(b not in builds for b in BUILDS):
        problems.append(f"builds run: {sorted(builds)}, expected {list(BUILDS)}")
    verdict = {"problems": problems,
               "empty_text": serving.output_findings({b: r.get("results") or {} for b, r in builds.items()})["empty_text"]}
    if all(builds.get(b, {}).get("results") for b in BUILDS):
        verdict["stock_vs_overlay"] = serving.compare(builds["stock"]["results"], builds["overlay"]["results"],
                                                      PROMPT_LENGTHS)
        if not verdict["stock_vs_overlay"]["identical_tokens"]:
            problems.append("stock and overlay tokens differ: " + ", ".join(verdict["stock_vs_overlay"]["mismatches"]))
        if verdict["stock_vs_overlay"]["text_mismatches"]:
            problems.append("the same tokens detokenized to other text: "
                            + ", ".join(verdict["stock_vs_overlay"]["text_mismatches"]))
    verdict["ok"] = not problems and "stock_vs_overlay" in verdict
    return verdict


def compare_runs(runs: dict[str, dict]) -> dict:
    """Every run with its verdict, and each run against its multiprocessing reference (same TP and
    PP degree), build by build. Overall ok: every run went as expected (the reference comparison is
    reported beside it: a different all-reduce path may round differently)."""
    rows = {}
    for name, run in sorted(runs.items()):
        ref_name = run.get("reference")
        ref = runs.get(ref_name) if ref_name else None
        vs_ref = None
        if ref_name and run["expected"] != "serve":
            vs_ref = {"comparable": False, "why": "a control, expected not to serve"}
        elif ref_name and not any(b.get("results") for b in run["builds"].values()):
            vs_ref = {"comparable": False, "why": "no results"}
        elif ref_name and ref is None:
            vs_ref = {"comparable": False, "why": f"{ref_name} was not run"}
        elif ref is not None:
            vs_ref = {"comparable": True, "reference": ref_name, "builds": {}}
            for build in BUILDS:
                ours, theirs = run["builds"].get(build, {}).get("results"), ref["builds"].get(build, {}).get("results")
                vs_ref["builds"][build] = (serving.compare(ours, theirs, PROMPT_LENGTHS) if ours and theirs
                                           else {"identical_tokens": None, "why": "missing results"})
            vs_ref["identical_tokens"] = all(v.get("identical_tokens") for v in vs_ref["builds"].values())
        rows[name] = {**run, "vs_reference": vs_ref}
    bases = sorted({str(run.get("vllm")) for run in runs.values()})
    return {"ok": bool(rows) and all(r["ok"] for r in rows.values()),
            "vllm": bases[0] if len(bases) == 1 and bases[0] != "None" else None, "runs": rows}


def _cell(value) -> str:
    """A time to healthy, or what happened instead in a word (the run's section has it whole)."""
    if isinstance(value, float):
        return f"{value:.1f} s"
    if value is None:
        return "-"
    return "IndexError" if "IndexError" in str(value) else "not healthy"


def _nodes_cell(report: dict) -> str:
    evidence = report.get("ray_serving") or report.get("ray_before_serving")
    if not evidence or "nodes" not in evidence:
        return "-"
    return "; ".join(f"{n['ip']} {n['hostname']} {n['gpus']:g} GPU" for n in evidence["nodes"])


def _table_row(name: str, run: dict) -> str:
    builds, same, vs_ref = run["builds"], run.get("stock_vs_overlay"), run.get("vs_reference")
    ref_cell = ("-" if vs_ref is None else
                f"n/a ({vs_ref['why']})" if not vs_ref["comparable"] else
                f"{'yes' if vs_ref['identical_tokens'] else 'NO'} ({vs_ref['reference']})")
    same_cell = ("-" if same is None else
                 f"{'yes' if same['identical_tokens'] else 'NO'}, max Δ logprob {same['max_abs_logprob_diff']:.3g}")
    if run["expected"] == "index-error":
        same_cell = "IndexError reproduced: " + ", ".join(
            f"{b} {'yes' if r else 'no'}" for b, r in run.get("reproduced_index_error", {}).items())
    return (f"| {name} | {run.get('method') or '-'} | {run['expected']} | "
            f"{_cell(builds.get('stock', {}).get('healthy_after_s'))} / "
            f"{_cell(builds.get('overlay', {}).get('healthy_after_s'))} | {_nodes_cell(builds.get('stock', {}))} | "
            f"{same_cell} | {ref_cell} | {'ok' if run['ok'] else 'FAIL'} |")


def _build_lines(build: str, report: dict) -> list[str]:
    logged, healthy = report.get("logged", {}), report.get("healthy_after_s")
    facts = [f"healthy after {healthy:.1f} s" if isinstance(healthy, float) else f"{healthy or report.get('error')}"]
    facts += [f"{label} {logged[key]}" for key, label in (
        ("all_reduce_backends", "all-reduce backends"), ("nccl_transports", "NCCL transports"),
        ("custom_allreduce_disabled", "custom all-reduce off because"),
        ("flashinfer_allreduce_workspaces", "FlashInfer all-reduce workspaces")) if logged.get(key)]
    lines = [f"- **{build}**: " + "; ".join(facts)]
    gpu = report.get("gpu_processes")
    if isinstance(gpu, str):
        lines.append(f"  - GPU placement: {gpu}")
    for row in gpu if isinstance(gpu, list) else []:
        lines.append(f"  - pid {row['pid']} on GPU {row['gpu']} ({row['used_mib']} MiB), node {row['node']}, "
                     f"own netns {row['own_netns']}, own mount ns {row['own_mntns']}, own UTS ns {row['own_utsns']}")
    workers = [p for p in logged.get("processes", []) if "Worker" in p["process"]]
    if workers:
        lines.append("  - vLLM workers logged: " + ", ".join(
            f"{w['process']} pid {w['pid']}" + (f" ip {w['ip']}" if w["ip"] else "") for w in workers))
    if logged.get("errors"):
        lines.append(f"  - errors logged: {logged['errors'][:3]}")
    return lines


def markdown(doc: dict) -> str:
    lines = [
        f"# Stock vLLM {doc.get('vllm') or '(base not recorded)'} vs the overlay across two H200s: "
        "TP=2 / PP=2, mp and Ray",
        "",
        (f"Overall: **{'PASS' if doc['ok'] else 'FAIL'}** (PASS: every run went as expected). Prompts of "
         f"{', '.join(map(str, PROMPT_LENGTHS))} tokens, {MAX_TOKENS} greedy tokens each, one by one and as one "
         "batch; default vLLM flags (CUDA graphs on) plus a fixed KV-cache size. "
         f"{ALLREDUCE_GUARD} (dsa_image/validation/cluster.py)."),
        "",
        ("| run | isolation | expected | healthy stock / overlay | Ray nodes (stock) | stock = overlay | "
         "= mp reference | verdict |"),
        "|---|---|---|---|---|---|---|---|",
        *(_table_row(name, run) for name, run in doc["runs"].items()),
    ]
    for name, run in doc["runs"].items():
        lines += ["", f"## {name}", ""]
        if run.get("method"):
            lines.append(f"Isolation `{run['method']}`: {run.get('method_description')}.")
        lines += [f"- problem: {problem}" for problem in run.get("problems", [])]
        for build, report in run["builds"].items():
            lines += _build_lines(build, report)
    return "\n".join(lines) + "\n"


def load_runs(inputs: list[str]) -> dict[str, dict]:
    """Runs from result directories (DIR/*.json written by `run`) and cluster.json files of
    earlier calls; where a run appears twice, the one finished last."""
    runs: dict[str, dict] = {}

    def keep(run):
        earlier = runs.get(run["run"])
        if earlier is not None and earlier.get("vllm") != run.get("vllm"):
            # Not "the later wins": that would hide a base mixed into the inputs (compare_call).
            raise Refused(f"{run['run']} was run on vLLM {earlier.get('vllm') or '(not recorded)'} and on "
                          f"{run.get('vllm') or '(not recorded)'}; compare one base at a time")
        if earlier is None or run.get("finished_at", "") >= earlier.get("finished_at", ""):
            runs[run["run"]] = run

    for item in map(Path, inputs):
        files = sorted(item.glob("*.json")) if item.is_dir() else [item]
        for path in files:
            doc = json.loads(path.read_text())
            if "runs" in doc:
                for run in doc["runs"].values():
                    keep({k: v for k, v in run.items() if k != "vs_reference"})
            elif "run" in doc and "builds" in doc:
                keep(doc)
    return runs


# -- the call -----------------------------------------------------------------------------------


def _raise_on_sigterm(signum, frame):
    # `timeout` and the device's limit send SIGTERM: unwind, so every finally stops our processes.
    raise SystemExit(128 + signum)


def resolve_methods(runs: list[RunSpec], probes: dict, order: tuple[str, ...]) -> dict[str, str | None | Refused]:
    """Each run's isolation method: its own (LAYOUT@METHOD) when this machine can do it, else the
    first of `order` the probe found working; None without two Ray nodes; a Refused (the run is
    not started, its record says why) when none works."""
    methods: dict[str, str | None | Refused] = {}
    for spec in runs:
        if spec.layout.ray_nodes != 2:
            methods[spec.name] = None
        elif spec.method:
            working = probes.get(spec.method, {}).get("ok")
            methods[spec.name] = spec.method if working else Refused(
                f"{spec.name} asks for isolation {spec.method}, which this machine cannot do: "
                f"{probes.get(spec.method, {}).get('detail', 'not probed')}")
        else:
            try:
                methods[spec.name] = choose_method(probes, order)
            except Refused as exc:
                methods[spec.name] = exc
    return methods


def site_base(stock_site: str, overlay_site: str, requested: str | None) -> str:
    """The vLLM release both sites hold (the base the results are labelled with); `requested`
    (--vllm) must name it."""
    try:
        return vllm_base.sites_base(requested, [stock_site, overlay_site])
    except RuntimeError as exc:
        raise Refused(f"the base: {exc} (--stock-site {stock_site}, --overlay-site {overlay_site})") from None


def run_call(args) -> int:
    waves = parse_waves(args.layouts)
    base = site_base(args.stock_site, args.overlay_site, args.vllm)
    deadline = time.monotonic() + args.deadline_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    earlier, stale = sweep(TAG_PREFIX), remove_stale_namespaces()
    if earlier or stale:
        print(f"removed what an earlier call left: processes {sorted(earlier)}, namespaces and links {stale}")
    all_runs = [spec for wave in waves for spec in wave]
    probes = probe_isolation() if any(spec.layout.ray_nodes == 2 for spec in all_runs) else {}
    methods = resolve_methods(all_runs, probes, tuple(args.methods.split(",")))
    print(json.dumps({"vllm": base, "isolation_probe": probes,
                      "methods": {k: f"refused: {v}" if isinstance(v, Refused) else v
                                  for k, v in methods.items()}}, indent=1))
    call_id, slot, all_ok = uuid.uuid4().hex[:8], 0, True
    for wave_index, wave_runs in enumerate(waves):
        records = {spec.name: not_run(spec, None, probes, str(methods[spec.name]), base)
                   for spec in wave_runs if isinstance(methods[spec.name], Refused)}
        runnable = [spec for spec in wave_runs if spec.name not in records]
        left = deadline - time.monotonic()
        if runnable and left < args.min_wave_s:
            records.update({spec.name: not_run(spec, methods[spec.name], probes,
                                               f"{left:.0f} s left of this call's {args.deadline_s:.0f} s, a wave needs "
                                               f"{args.min_wave_s:.0f} s; run it in another call", base)
                            for spec in runnable})
            runnable = []
        if runnable:
            wave = Wave(runnable, methods, probes, args, slot, args.port_base + PORTS_PER_WAVE * wave_index, call_id,
                        base)
            slot = wave.next_slot
            records.update(run_wave(wave, deadline, args))
        for spec in wave_runs:
            run = records[spec.name]
            (out / f"{spec.stem}.json").write_text(json.dumps(run, indent=1) + "\n")
            print(f"{spec.name}: {'as expected' if run['ok'] else 'NOT as expected'}: {run.get('problems')}")
            all_ok &= run["ok"]
    print("CLUSTER RUNS (this call):", "PASS" if all_ok else "FAIL")
    return 0 if all_ok else 1


def run_wave(wave: Wave, deadline: float, args) -> dict[str, dict]:
    try:
        wave.ship_model_info()
        # The evidence, the requests and the stop need about a minute after the servers are healthy.
        health_deadline = min(deadline - 60, time.monotonic() + args.timeout)
        wave.start_clusters(health_deadline)
        wave.check_clusters()
        wave.start_servers()
        wave.wait_healthy(health_deadline)
        wave.gather_evidence()
        wave.exercise(deadline - 20)
    except Exception as exc:  # noqa: BLE001 - recorded on every run of the wave; the stop still runs
        for entry in wave.entries:
            entry["report"].setdefault("error", f"{type(exc).__name__}: {exc}")
    finally:
        wave.stop()
    return wave.annotate()


def compare_call(args) -> int:
    runs = load_runs(args.inputs)
    if not runs:
        print(f"nothing to compare: no run results in {args.inputs} (expected DIR/<run>.json from `run`, or "
              "cluster.json)", file=sys.stderr)
        return 2
    bases = {run.get("vllm") for run in runs.values()}
    if len(bases) > 1:
        # A run is compared with the mp run of its degrees by name: across bases that would set
        # one vLLM's tokens against another's.
        named = ", ".join(f"{b or 'not recorded'}: {sorted(n for n, r in runs.items() if r.get('vllm') == b)}"
                          for b in sorted(bases, key=str))
        print(f"the inputs hold runs of more than one vLLM base ({named}); compare one base at a time",
              file=sys.stderr)
        return 2
    doc = compare_runs(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "cluster.md").write_text(markdown(doc))
    print(markdown(doc))
    print("CLUSTER COMPARISON:", "PASS" if doc["ok"] else "FAIL")
    return 0 if doc["ok"] else 1


def plan_call(args) -> int:
    """Every command a run would start, without starting anything."""
    slot = 0
    for wave in parse_waves(args.layouts):
        print(f"wave: {' + '.join(r.name for r in wave)}")
        for spec in wave:
            for build in BUILDS:
                method = spec.method or (args.method if spec.layout.ray_nodes == 2 else None)
                plan = None
                if spec.layout.ray_nodes:
                    plan = plan_cluster(spec, build, method, slot)
                    slot += 1
                    if plan.method == "netns":
                        for cmd in netns_setup_commands(plan):
                            print("  " + shlex.join(cmd))
                    for node in plan.nodes:
                        env = node_env_extra(plan, node, "TAG")
                        print(f"  [{build} {node.name}] {' '.join(f'{k}={v}' for k, v in env.items())} \\\n"
                              f"      {shlex.join(node_command(args.python, plan, node))}")
                env = server_env_extra(spec.layout, plan, "TAG")
                args_ = [*spec.layout.server_args(), *allreduce_args(spec.layout, plan)]
                print(f"  [{build} vllm serve] {' '.join(f'{k}={v}' for k, v in env.items())} \\\n"
                      f"      vllm serve MODEL {shlex.join(args_)}")
    return 0


def cleanup_call(args) -> int:
    killed = sweep(TAG_PREFIX)
    removed = remove_stale_namespaces()
    print(json.dumps({"killed": sorted(killed), "removed_namespaces_and_links": removed}))
    return 0


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("probe", help="which isolation methods work here")
    plan = sub.add_parser("plan", help="print the commands a run would start")
    plan.add_argument("--layouts", required=True)
    plan.add_argument("--method", default="netns", choices=list(ISOLATION))
    plan.add_argument("--python", default="python3")
    run = sub.add_parser("run", help="serve the layouts, stock and overlay side by side")
    run.add_argument("--layouts", required=True, help=f"waves of {', '.join(LAYOUTS)} (see the module's help)")
    run.add_argument("--model", required=True, help="the tiny GLM-5 (scripts/make_tiny_model.py)")
    run.add_argument("--stock-site", required=True)
    run.add_argument("--overlay-site", required=True)
    run.add_argument("--vllm", help="the vLLM base: must be the one both sites hold (the default; recorded in "
                                    "every run)")
    run.add_argument("--out", required=True)
    run.add_argument("--work-dir", default="/tmp/dsa-cluster-homes", help="servers' and nodes' HOMEs (kept)")
    serving.add_model_info_root(run)
    run.add_argument("--python", default=sys.executable)
    run.add_argument("--ray-root", default=RAY_ROOT, help="the Ray clusters' temp dirs (kept short: socket paths)")
    run.add_argument("--methods", default=",".join(DEFAULT_METHOD_ORDER),
                     help="isolation methods to try, in order, for two-node runs without @METHOD")
    run.add_argument("--deadline-s", type=float, default=540, help="seconds this call may take in all")
    run.add_argument("--min-wave-s", type=float, default=200, help="a wave is not started with less left")
    # 330 s was short for a cold wave already on 0.24.0 (docs/validation/h200x2-2026-11-30-cluster: four
    # servers, 228 s of torch.compile each, none healthy); the call that passed gave 470 s. A cold 0.33.0
    # server took 270-281 s with three started together on one H200, about 100 s of it FlashInfer's
    # sampling JIT (docs/validation/h200-2026-11-30-vllm0_33_0-run2). The call's deadline less a minute
    # (run_wave) caps it either way.
    run.add_argument("--timeout", type=float, default=470, help="seconds for a wave's servers to become healthy")
    run.add_argument("--port-base", type=int, default=8400)
    run.add_argument("--kv-cache-memory-bytes", type=int, default=2 << 30)
    run.add_argument("--gpu-memory-utilization", type=float, default=0.2,
                     help="only vLLM's start-up check of free memory reads it (the KV cache size is fixed)")
    compare = sub.add_parser("compare", help="verdicts and comparisons over run results")
    compare.add_argument("--out", required=True)
    compare.add_argument("inputs", nargs="+", help="result directories of `run`, or cluster.json files")
    sub.add_parser("cleanup", help="stop every process and namespace an earlier run left")
    args = parser.parse_args(argv)
    if args.command == "run":
        unknown = [m for m in args.methods.split(",") if m not in ISOLATION]
        if unknown:
            parser.error(f"unknown isolation methods {unknown}; known: {', '.join(ISOLATION)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "probe":
            probes = probe_isolation()
            print(json.dumps(probes, indent=1))
            return 0 if any(probes[m]["ok"] for m in FAITHFUL) else 1
        return {"plan": plan_call, "run": run_call, "compare": compare_call, "cleanup": cleanup_call}[args.command](args)
    except Refused as exc:
        print(f"CLUSTER: refused: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
