"""The host side of the cluster harness (dsa_image.validation.cluster): which isolation methods
this machine can do (the probe), the processes and network namespaces a call starts and stops
(every one tagged with DSA_CLUSTER_TAG, so a sweep finds what a killed call left), and the
evidence read back from the host: Ray's node and actor lists against the plan, the GPU and
namespaces each of our processes used (nvidia-smi, /proc), and what the servers and Ray nodes
logged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from dsa_image.harness import server as serving
from dsa_image.smoke import gpu as smoke_gpu
from dsa_image.validation.cluster_plan import (DEFAULT_METHOD_ORDER, FAITHFUL, FI_AR_MNNVL_TRIED, FI_AR_WORKSPACE,
                                               INDEX_ERROR, NODE_VAR, TAG_VAR, ClusterPlan, Layout, Refused)

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
