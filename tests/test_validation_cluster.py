"""The cluster harness's pure parts, on the CPU: layouts and waves, the isolation choice, each
node's addresses, ports, commands and environment, the evidence checks, the verdicts and the
comparison, and the shell phase that calls it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from dsa_image.core import status
from dsa_image.harness import server as serving
from dsa_image.validation import cluster, cluster_plan

REPO = Path(__file__).resolve().parent.parent


def _spec(name: str) -> cluster.RunSpec:
    return cluster.parse_waves(name)[0][0]


# -- layouts and waves -----------------------------------------------------------------------


def test_waves_split_on_spaces_and_commas_and_join_on_plus():
    waves = cluster.parse_waves("mp-tp2, ray1-tp2+ray2-pp2@shared  ray2-tp2")
    assert [[r.name for r in wave] for wave in waves] == [["mp-tp2"], ["ray1-tp2", "ray2-pp2@shared"], ["ray2-tp2"]]
    assert waves[1][1].method == "shared" and waves[2][0].method is None
    assert waves[1][1].stem == "ray2-pp2-shared"


@pytest.mark.parametrize("text, says", [
    ("mp-tp4", "unknown layout 'mp-tp4'; known: mp-tp2, mp-pp2, ray1-tp2, ray2-tp2, ray2-pp2"),
    ("ray2-tp2@vm", "unknown isolation method 'vm'"),
    ("ray1-tp2@netns", "applies to the two-Ray-node layouts only (ray2-tp2, ray2-pp2)"),
    ("mp-tp2 mp-tp2", "layouts named twice: mp-tp2"),
    ("  ", "no layouts given"),
])
def test_a_wrong_layout_list_is_refused_naming_what_is_known(text, says):
    with pytest.raises(cluster.Refused, match=None) as refused:
        cluster.parse_waves(text)
    assert says in str(refused.value)


def test_layout_server_args_name_the_executor_and_degrees():
    assert cluster.LAYOUTS["ray2-pp2"].server_args() == [
        "--tensor-parallel-size", "1", "--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray"]
    assert cluster.LAYOUTS["mp-tp2"].server_args()[-1] == "mp"


def test_only_tp_across_two_ray_nodes_sharing_shm_is_expected_to_fail():
    layouts = cluster.LAYOUTS
    assert cluster.expected_outcome(layouts["ray2-tp2"], "shared") == "index-error"
    assert cluster.expected_outcome(layouts["ray2-pp2"], "shared") == "serve"
    assert cluster.expected_outcome(layouts["ray2-tp2"], "netns") == "serve"
    assert cluster.expected_outcome(layouts["ray1-tp2"], None) == "serve"


def test_each_layout_is_compared_with_the_mp_layout_of_its_degrees():
    assert cluster.reference_for(cluster.LAYOUTS["ray2-tp2"]) == "mp-tp2"
    assert cluster.reference_for(cluster.LAYOUTS["ray1-tp2"]) == "mp-tp2"
    assert cluster.reference_for(cluster.LAYOUTS["ray2-pp2"]) == "mp-pp2"
    assert cluster.reference_for(cluster.LAYOUTS["mp-tp2"]) is None


# -- isolation ----------------------------------------------------------------------------------


def test_the_probe_runs_each_script_and_keeps_its_last_line():
    class Done:
        def __init__(self, code, out):
            self.returncode, self.stdout, self.stderr = code, out, ""

    def fake_run(cmd, **kwargs):
        script = cmd[-1]
        return Done(0, "ok\n") if "ip netns add" not in script else Done(4, "mount: permission denied\n")

    probes = cluster.probe_isolation(fake_run)
    assert probes["netns"] == {"ok": False, "exit": 4, "detail": "mount: permission denied"}
    assert probes["mountns"]["ok"] and probes["shared"]["ok"]
    assert cluster.choose_method(probes) == "mountns"


def test_no_isolation_is_refused_with_what_each_probe_said_and_what_to_do():
    probes = {"netns": {"ok": False, "detail": "no 'ip' command (iproute2)"},
              "mountns": {"ok": False, "detail": "unshare: unshare failed: Operation not permitted"},
              "shared": {"ok": True}}
    with pytest.raises(cluster.Refused) as refused:
        cluster.choose_method(probes)
    message = str(refused.value)
    assert "no 'ip' command" in message and "Operation not permitted" in message
    assert "CAP_SYS_ADMIN" in message and "@shared" in message


def test_methods_resolve_per_run_and_refuse_only_the_runs_that_need_the_missing_one():
    probes = {"netns": {"ok": False, "detail": "no ip"}, "mountns": {"ok": True}, "shared": {"ok": True}}
    runs = [r for wave in cluster.parse_waves("mp-tp2 ray2-tp2 ray2-tp2@shared ray2-pp2@netns") for r in wave]
    methods = cluster.resolve_methods(runs, probes, cluster.DEFAULT_METHOD_ORDER)
    assert methods["mp-tp2"] is None and methods["ray2-tp2"] == "mountns"
    assert methods["ray2-tp2@shared"] == "shared"
    assert isinstance(methods["ray2-pp2@netns"], cluster.Refused)
    assert "cannot do: no ip" in str(methods["ray2-pp2@netns"])


# -- plans, commands, environments ---------------------------------------------------------------


def test_netns_plan_gives_the_worker_its_own_address_interface_gpu_and_hostname():
    plan = cluster.plan_cluster(_spec("ray2-tp2"), "overlay", "netns", 3)
    head, worker = plan.head, plan.worker
    assert (head.ip, worker.ip) == ("10.231.4.1", "10.231.4.2")
    assert (head.gpus, worker.gpus, head.num_gpus, worker.num_gpus) == ("0", "1", 1, 1)
    assert plan.veth == ("dsarc3h", "dsarc3w") and all(len(name) <= 15 for name in plan.veth)
    assert (head.ifname, worker.ifname) == plan.veth
    assert worker.netns == "dsa-rc3" and worker.hostname == "dsa-overlay-3-b"
    assert worker.private_tmp == "/tmp/dsa-rc/3/w" and plan.temp_dir == "/tmp/dsa-rc/3/h"
    assert plan.address == f"10.231.4.1:{plan.gcs_port}"


def test_netns_network_commands_wire_the_pair_and_route_back_through_the_head():
    plan = cluster.plan_cluster(_spec("ray2-pp2"), "stock", "netns", 0)
    commands = [" ".join(c) for c in cluster.netns_setup_commands(plan)]
    assert commands[:3] == ["ip netns add dsa-rc0", "ip link add dsarc0h type veth peer name dsarc0w",
                            "ip link set dsarc0w netns dsa-rc0"]
    assert "ip addr add 10.231.1.1/24 dev dsarc0h" in commands
    assert "ip netns exec dsa-rc0 ip addr add 10.231.1.2/24 dev dsarc0w" in commands
    assert commands[-1] == "ip netns exec dsa-rc0 ip route add default via 10.231.1.1"
    assert [" ".join(c) for c in cluster.netns_teardown_commands(plan)] == [
        "ip netns del dsa-rc0", "ip link del dsarc0h"]


def test_every_port_of_every_node_and_cluster_in_a_call_is_distinct_and_below_the_ephemeral_range():
    seen = []
    for slot in range(cluster.MAX_SLOTS):
        plan = cluster.plan_cluster(_spec("ray2-tp2"), "stock", "mountns", slot)
        seen.append(plan.gcs_port)
        for node in plan.nodes:
            ports = node.ports
            seen += [p for k, p in ports.items() if not k.endswith("worker-port")]
            seen += list(range(ports["min-worker-port"], ports["max-worker-port"] + 1))
    assert len(seen) == len(set(seen))
    assert max(seen) < 32768 and min(seen) >= cluster.PORT_BASE


def test_a_slot_past_the_port_plan_is_refused():
    with pytest.raises(cluster.Refused, match="split the layouts over more calls"):
        cluster.plan_cluster(_spec("ray2-tp2"), "stock", "netns", cluster.MAX_SLOTS)


def test_the_netns_worker_starts_inside_its_namespaces_and_joins_the_head():
    plan = cluster.plan_cluster(_spec("ray2-tp2"), "stock", "netns", 1)
    cmd = cluster.node_command("python3", plan, plan.worker)
    assert cmd[:7] == ["ip", "netns", "exec", "dsa-rc1", "unshare", "--uts", "--"]
    assert cmd[7:9] == ["sh", "-c"] and cmd[9] == cluster.ISOLATE_SCRIPT
    assert cmd[10:14] == ["sh", "/tmp/dsa-rc/1/w", "/tmp/dsa-rc/1/h", "dsa-stock-1-b"]
    ray = cmd[14:]
    assert ray[:5] == ["python3", "-m", "ray.scripts.scripts", "start", "--block"]
    assert ray[ray.index("--address") + 1] == plan.address
    assert ray[ray.index("--num-gpus") + 1] == "1" and ray[ray.index("--node-ip-address") + 1] == "10.231.2.2"
    assert "--head" not in ray and "--temp-dir" not in ray
    # Ray aborts a worker given a head-only flag (the first 2x H200 call: --include-dashboard).
    assert not [a for a in ray for f in cluster.RAY_HEAD_ONLY_FLAGS if a == f or a.startswith(f + "=")]
    head = cluster.node_command("python3", plan, plan.head)
    assert "--include-dashboard=false" in head


def test_the_isolation_script_mounts_shm_and_the_temp_dir_then_runs_ray(tmp_path):
    # The script as a shell runs it, with `mount` and the hostname file replaced by stand-ins.
    script = (cluster.ISOLATE_SCRIPT.replace("mount ", "echo mount ")
              .replace("/proc/sys/kernel/hostname", str(tmp_path / "hostname")))
    done = subprocess.run(["sh", "-c", script, "sh", str(tmp_path / "w"), str(tmp_path / "h"), "node-b",
                           "echo", "ray", "start"], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == [
        f"mount -t tmpfs -o size={cluster.WORKER_SHM} tmpfs /dev/shm",
        f"mount --bind {tmp_path / 'w'} {tmp_path / 'h'}", "ray start"]
    assert (tmp_path / "hostname").read_text() == "node-b\n"


def test_mountns_and_shared_plans_use_loopback_addresses_and_differ_in_isolation():
    mountns = cluster.plan_cluster(_spec("ray2-tp2"), "stock", "mountns", 2)
    assert (mountns.head.ip, mountns.worker.ip) == ("127.0.12.1", "127.0.12.2")
    assert mountns.head.ifname == mountns.worker.ifname == "lo"
    cmd = cluster.node_command("python3", mountns, mountns.worker)
    assert cmd[:6] == ["unshare", "--mount", "--uts", "--propagation", "private", "--"]
    shared = cluster.plan_cluster(_spec("ray2-tp2@shared"), "stock", "shared", 2)
    assert shared.worker.private_tmp is None and shared.worker.hostname is None
    assert cluster.node_command("python3", shared, shared.worker)[:2] == ["python3", "-m"]


def test_one_ray_node_holds_both_gpus_and_no_worker_node():
    plan = cluster.plan_cluster(_spec("ray1-tp2"), "stock", None, 0)
    assert plan.worker is None and plan.head.gpus == "0,1" and plan.head.num_gpus == 2
    head = cluster.node_command("python3", plan, plan.head)
    assert head[head.index("--num-gpus") + 1] == "2" and head[head.index("--temp-dir") + 1] == plan.temp_dir
    assert head[head.index("--port") + 1] == str(plan.gcs_port)
    env = cluster.node_env_extra(plan, plan.head, "T")
    assert "NCCL_SOCKET_IFNAME" not in env and env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_two_ray_nodes_need_an_isolation_method():
    with pytest.raises(cluster.Refused, match="need an isolation method"):
        cluster.plan_cluster(_spec("ray2-tp2"), "stock", None, 0)


def test_node_and_server_environments_carry_address_interfaces_tag_and_the_safety_variables():
    plan = cluster.plan_cluster(_spec("ray2-tp2"), "stock", "netns", 0)
    worker = cluster.node_env_extra(plan, plan.worker, "dsa-cluster:x:ray2-tp2:stock:")
    assert worker["VLLM_HOST_IP"] == "10.231.1.2" and worker["CUDA_VISIBLE_DEVICES"] == "1"
    assert worker["NCCL_SOCKET_IFNAME"] == worker["GLOO_SOCKET_IFNAME"] == "dsarc0w"
    assert worker[cluster.TAG_VAR] == "dsa-cluster:x:ray2-tp2:stock:" and worker[cluster.NODE_VAR] == "stock-node-b"
    server = cluster.server_env_extra(plan_layout := cluster.LAYOUTS["ray2-tp2"], plan, "T")
    assert plan_layout.executor == "ray"
    assert server["RAY_ADDRESS"] == plan.address and server["VLLM_HOST_IP"] == "10.231.1.1"
    assert server["CUDA_VISIBLE_DEVICES"] == "0" and server["NCCL_SOCKET_IFNAME"] == "dsarc0h"
    assert server["RAY_DEDUP_LOGS"] == "0"
    mp = cluster.server_env_extra(cluster.LAYOUTS["mp-tp2"], None, "T")
    assert mp["CUDA_VISIBLE_DEVICES"] == "0,1" and "RAY_ADDRESS" not in mp
    for env in (worker, server, mp):
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert env["NVSHMEM_DISABLE_NVLS"] == "1"


def test_flashinfer_all_reduce_is_kept_off_nvlink_multicast_where_vllm_counts_one_node():
    # vLLM 0.33.0's "auto" takes FlashInfer's MNNVL backend (cuMulticastCreate) for a TP group on
    # one node; TRT-LLM's workspace has multicast off. vLLM counts nodes by /dev/shm.
    one_node = [(cluster.LAYOUTS["mp-tp2"], None),
                (cluster.LAYOUTS["ray1-tp2"], cluster.plan_cluster(_spec("ray1-tp2"), "stock", None, 0)),
                (cluster.LAYOUTS["ray2-tp2"], cluster.plan_cluster(_spec("ray2-tp2@shared"), "stock", "shared", 1))]
    for layout, plan in one_node:
        envs = [cluster.server_env_extra(layout, plan, "T")]
        envs += [cluster.node_env_extra(plan, node, "T") for node in (plan.nodes if plan else [])]
        for env in envs:
            assert env["VLLM_FLASHINFER_ALLREDUCE_BACKEND"] == "trtllm", (layout.name, env)
            assert "VLLM_ALLREDUCE_USE_FLASHINFER" not in env
        assert cluster.allreduce_args(layout, plan) == []


@pytest.mark.parametrize("method", ["netns", "mountns"])
def test_where_vllm_counts_two_nodes_flashinfer_all_reduce_and_the_fusion_pass_are_off(method):
    # "trtllm" refuses a two-node group (ValueError); 0.24.0's "auto" takes MNNVL for two nodes.
    plan = cluster.plan_cluster(_spec("ray2-tp2"), "overlay", method, 2)
    for env in [cluster.server_env_extra(cluster.LAYOUTS["ray2-tp2"], plan, "T")] + [
            cluster.node_env_extra(plan, node, "T") for node in plan.nodes]:
        assert env["VLLM_FLASHINFER_ALLREDUCE_BACKEND"] == "auto" and env["VLLM_ALLREDUCE_USE_FLASHINFER"] == "0"
        assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    flags = cluster.allreduce_args(cluster.LAYOUTS["ray2-tp2"], plan)
    assert flags[0] == "--compilation-config"
    assert json.loads(flags[1]) == {"pass_config": {"fuse_allreduce_rms": False}}
    # TP = 1 turns the pass off by itself: the PP layout keeps vLLM's flags.
    pp_plan = cluster.plan_cluster(_spec("ray2-pp2"), "overlay", method, 3)
    assert cluster.allreduce_args(cluster.LAYOUTS["ray2-pp2"], pp_plan) == []


def test_a_log_showing_flashinfers_mnnvl_workspace_fails_the_build():
    trtllm = ("(Worker_TP0 pid=5) INFO 12-01 10:00:00 [flashinfer_all_reduce.py:236] Initialized FlashInfer "
              "Allreduce norm fusion workspace with backend=trtllm\n")
    facts = cluster.log_facts(trtllm)
    assert facts["flashinfer_allreduce_workspaces"] == ["trtllm"] and not facts["flashinfer_mnnvl_tried"]
    report = {"healthy_after_s": 90.0, "results": _results([1]), "logged": facts}
    assert cluster.build_problems(report) == []
    for line in (trtllm.replace("backend=trtllm", "backend=mnnvl"),
                 "WARNING [flashinfer_all_reduce.py:218] FlashInfer mnnvl allreduce workspace unavailable (likely "
                 "no NVSwitch multicast support); falling back to trtllm backend for single node.\n"):
        report["logged"] = cluster.log_facts(line)
        assert any("NVLink multicast" in p for p in cluster.build_problems(report)), line


def test_server_env_puts_the_build_first_and_gives_it_its_own_caches(tmp_path):
    env = serving.server_env("/tmp/site-x", str(tmp_path / "home"), {"CUDA_VISIBLE_DEVICES": "1"})
    assert env["PYTHONPATH"] == "/tmp/site-x" and env["HOME"] == str(tmp_path / "home")
    assert env["DG_JIT_CACHE_DIR"] == f"{tmp_path / 'home'}/.cache/deep_gemm"
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and (tmp_path / "home").is_dir()


# -- our processes -------------------------------------------------------------------------------


def _fake_proc(root: Path, pid: int, env: dict[str, str], namespaces: dict[str, str] | None = None) -> None:
    directory = root / str(pid)
    (directory / "ns").mkdir(parents=True)
    (directory / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    for kind, target in (namespaces or {}).items():
        os.symlink(target, directory / "ns" / kind)


def test_only_processes_carrying_our_tag_are_ours(tmp_path):
    _fake_proc(tmp_path, 11, {"PATH": "/bin", cluster.TAG_VAR: "dsa-cluster:a1:ray2-tp2:stock:"})
    _fake_proc(tmp_path, 12, {"PATH": "/bin"})
    _fake_proc(tmp_path, 13, {cluster.TAG_VAR: "dsa-cluster:b2:mp-tp2:overlay:"})
    (tmp_path / "self").mkdir()
    assert cluster.tagged_pids("dsa-cluster:", str(tmp_path)) == {
        11: "dsa-cluster:a1:ray2-tp2:stock:", 13: "dsa-cluster:b2:mp-tp2:overlay:"}
    assert list(cluster.tagged_pids("dsa-cluster:a1:", str(tmp_path))) == [11]


def test_gpu_apps_are_mapped_to_gpu_indexes():
    gpus = "0, GPU-aaa, NVIDIA H200\n1, GPU-bbb, NVIDIA H200\n"
    apps = "GPU-bbb, 4242, 5120\nGPU-aaa, 4343, 4096\nGPU-ccc, 4444, 1\nbad line\n"
    assert cluster.parse_gpu_apps(gpus, apps) == {4242: {"gpu": 1, "used_mib": 5120},
                                                  4343: {"gpu": 0, "used_mib": 4096}}


def test_placement_names_the_gpu_and_namespaces_of_each_nodes_worker(tmp_path):
    plan = cluster.plan_cluster(_spec("ray2-tp2"), "stock", "netns", 0)
    tag = "dsa-cluster:c:ray2-tp2:stock:"
    host = {"net": "net:[1]", "mnt": "mnt:[1]", "uts": "uts:[1]"}
    _fake_proc(tmp_path, os.getpid(), {}, host)
    _fake_proc(tmp_path, 21, {cluster.TAG_VAR: tag, cluster.NODE_VAR: "stock-node-a"}, host)
    _fake_proc(tmp_path, 22, {cluster.TAG_VAR: tag, cluster.NODE_VAR: "stock-node-b"},
               {"net": "net:[2]", "mnt": "mnt:[2]", "uts": "uts:[2]"})
    _fake_proc(tmp_path, 23, {cluster.TAG_VAR: "dsa-cluster:c:ray2-tp2:overlay:", cluster.NODE_VAR: "x"}, host)
    apps = {21: {"gpu": 0, "used_mib": "1"}, 22: {"gpu": 1, "used_mib": "1"}, 23: {"gpu": 1, "used_mib": "1"}}
    rows = cluster.gpu_processes(apps, tag, str(tmp_path))
    assert [(r["pid"], r["gpu"], r["node"], r["own_netns"], r["own_mntns"]) for r in rows] == [
        (21, 0, "stock-node-a", False, False), (22, 1, "stock-node-b", True, True)]
    layout = cluster.LAYOUTS["ray2-tp2"]
    assert cluster.placement_problems(rows, plan, layout) == []
    shared_worker = [rows[0], {**rows[1], "own_netns": False}]
    assert cluster.placement_problems(shared_worker, plan, layout) == [
        "stock-node-b: its worker shares the ['net'] namespace(s) of the host"]
    swapped = [{**rows[0], "gpu": 1}, {**rows[1], "gpu": 0}]
    assert "stock-node-a: expected its worker on GPU 0, found GPUs [1]" in cluster.placement_problems(
        swapped, plan, layout)


# -- evidence from Ray ---------------------------------------------------------------------------


def _evidence(plan, gpus=(1, 1), hostnames=None, workers=("a", "b")):
    nodes = [{"node_id": f"n{i}", "name": n.name, "ip": n.ip, "hostname": (hostnames or {}).get(n.name, n.hostname or "host"),
              "gpus": gpus[i]} for i, n in enumerate(plan.nodes)]
    ip_of = {"a": plan.head.ip, "b": plan.nodes[-1].ip}
    actors = [{"class": "RayWorkerProc", "name": f"w{i}", "state": "ALIVE", "pid": 100 + i, "ip": ip_of[w],
               "node_id": "n0" if w == "a" else "n1"} for i, w in enumerate(workers)]
    return {"nodes": nodes, "actors": actors}


def test_two_nodes_with_one_gpu_each_and_a_worker_on_each_pass():
    plan = cluster.plan_cluster(_spec("ray2-tp2"), "stock", "netns", 0)
    evidence = _evidence(plan)
    assert cluster.node_problems(evidence, plan) == []
    assert cluster.worker_problems(evidence, plan, cluster.LAYOUTS["ray2-tp2"]) == []


def test_node_and_worker_evidence_name_what_differs_from_the_plan():
    plan = cluster.plan_cluster(_spec("ray2-tp2"), "stock", "netns", 0)
    missing = {"nodes": _evidence(plan)["nodes"][:1], "actors": []}
    problems = cluster.node_problems(missing, plan)
    assert problems[0].startswith("expected 2 alive Ray node(s), found 1")
    assert "expected one Ray node named stock-node-b (10.231.1.2), found 0" in problems
    assert cluster.node_problems(_evidence(plan, gpus=(1, 2)), plan) == [
        "stock-node-b at 10.231.1.2: expected 1 GPU(s), Ray lists 2"]
    assert cluster.node_problems(_evidence(plan, hostnames={"stock-node-b": "host"}), plan) == [
        "stock-node-b: expected hostname dsa-stock-0-b (own UTS namespace), Ray lists host"]
    both_on_head = cluster.worker_problems(_evidence(plan, workers=("a", "a")), plan, cluster.LAYOUTS["ray2-tp2"])
    assert both_on_head == [("vLLM workers per Ray node {'stock-node-a': 2, 'stock-node-b': 0}, "
                             "expected one per GPU of each node")]
    assert cluster.node_problems({"error": "no answer"}, plan) == ["no answer"]


def test_a_head_planned_at_127_0_0_1_passes_under_the_address_ray_registers_instead():
    """`ray start --node-ip-address 127.0.0.1` registers the host's address (the 2x H200: 192.0.2.2);
    any other planned address must match exactly."""
    plan = cluster.plan_cluster(_spec("ray1-tp2"), "stock", None, 0)
    assert plan.head.ip == "127.0.0.1"
    evidence = _evidence(plan, gpus=(2,), workers=("a", "a"))
    for row in evidence["nodes"] + evidence["actors"]:
        row["ip"] = "192.0.2.2"
    assert cluster.node_problems(evidence, plan) == []
    assert cluster.worker_problems(evidence, plan, cluster.LAYOUTS["ray1-tp2"]) == []
    two = cluster.plan_cluster(_spec("ray2-tp2"), "stock", "netns", 0)
    moved = _evidence(two)
    moved["nodes"][1]["ip"] = "192.0.2.2"
    assert cluster.node_problems(moved, two) == ["stock-node-b: expected address 10.231.1.2, Ray lists 192.0.2.2"]


# -- logs --------------------------------------------------------------------------------------

RAY2_LOG = """\
(APIServer pid=100) INFO 11-30 12:00:00 [api_server.py:1] vLLM API server version 0.24.0
(RayWorkerProc pid=201) INFO 11-30 12:00:05 [cuda_communicator.py:245] Using ['PYNCCL'] all-reduce backends (in dispatch order) for group 'tp:0' out of potential backends: ['CUSTOM'].
(RayWorkerProc pid=305, ip=10.231.1.2) WARNING 11-30 12:00:05 [custom_all_reduce.py:92] Custom allreduce is disabled because this process group spans across nodes.
(RayWorkerProc pid=305, ip=10.231.1.2) host-b:305:305 [0] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [send] via NET/Socket/0
(RayWorkerProc pid=201) host-a:201:201 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0
"""
CONTROL_LOG = """\
(RayWorkerProc pid=201) ERROR 11-30 12:00:05 [ray_executor_v2.py:212] RayWorkerProc failed
(RayWorkerProc pid=201) IndexError: device_id 1 is out of range for assigned_physical_gpu_ids [0] (1 devices assigned)
"""


def test_log_facts_name_workers_and_their_nodes_all_reduce_and_nccl_transports():
    facts = cluster.log_facts(RAY2_LOG)
    assert {"process": "RayWorkerProc", "pid": 305, "ip": "10.231.1.2"} in facts["processes"]
    assert {"process": "RayWorkerProc", "pid": 201, "ip": None} in facts["processes"]
    assert facts["all_reduce_backends"] == ["tp:0: ['PYNCCL']"]
    assert facts["custom_allreduce_disabled"] == ["this process group spans across nodes"]
    assert facts["nccl_transports"] == ["NET/Socket/0"]
    assert facts["index_error"] == []


def test_log_facts_read_vllm_0_33_0s_wording_of_the_custom_all_reduce_left_off_across_nodes():
    # custom_all_reduce.py:233-234 of 0.33.0; 0.24.0 said "Custom allreduce is disabled because ...".
    line = ("(RayWorkerProc pid=305, ip=10.231.1.2) (Worker_TP1 pid=305) WARNING 12-01 10:00:00 "
            "[custom_all_reduce.py:232] Custom collectives are disabled because this multi-node group does not "
            "have MNNVL-capable GPUs on every rank.\n")
    assert cluster.log_facts(line)["custom_allreduce_disabled"] == [
        "this multi-node group does not have MNNVL-capable GPUs on every rank"]


def test_log_facts_find_the_index_error_of_the_control():
    facts = cluster.log_facts(CONTROL_LOG)
    assert facts["index_error"] == ["IndexError: device_id 1 is out of range for assigned_physical_gpu_ids [0]"]


def test_a_control_server_is_settled_by_its_logged_index_error(tmp_path, monkeypatch):
    log = tmp_path / "server.log"
    log.write_text(CONTROL_LOG)
    healthy_log = tmp_path / "ok.log"
    healthy_log.write_text("")
    running = types.SimpleNamespace(poll=lambda: None)
    servers = [{"name": "control", "log": str(log), "started": 0.0, "proc": running},
               {"name": "fine", "log": str(healthy_log), "started": 0.0, "proc": running}]
    monkeypatch.setattr(cluster.serving, "is_healthy", lambda s: s["name"] == "fine")
    clock = iter(range(100, 1000))
    monkeypatch.setattr(cluster.time, "monotonic", lambda: next(clock))
    status = cluster.wait_servers(servers, deadline=10_000, expect_index_error={"control"}, poll_s=0)
    assert status == {"control": "error: logged the IndexError (the control's expected failure)", "fine": 100.0}


def test_the_isolated_workers_ray_session_is_found_under_its_private_dir(tmp_path):
    head_tmp, private = tmp_path / "h", tmp_path / "w"
    for temp in (head_tmp, private):
        (temp / "session_1" / "logs").mkdir(parents=True)
        # Both nodes wrote the same absolute link (the worker saw its private dir at head_tmp).
        os.symlink(head_tmp / "session_1", temp / "session_latest")
    (private / "session_1" / "logs" / "raylet.out").write_text("worker raylet\n")
    (head_tmp / "session_1" / "logs" / "raylet.out").write_text("head raylet\n")
    plan = cluster.plan_cluster(_spec("ray2-tp2"), "stock", "mountns", 0, root=str(tmp_path / "root"))
    plan = cluster.ClusterPlan(**{**plan.__dict__, "temp_dir": str(head_tmp),
                                  "worker": cluster.NodePlan(**{**plan.worker.__dict__, "private_tmp": str(private)})})
    copied = cluster.copy_ray_logs(plan, tmp_path / "out")
    assert (tmp_path / "out" / "ray-stock-node-b" / "raylet.out").read_text() == "worker raylet\n"
    assert (tmp_path / "out" / "ray-stock-node-a" / "raylet.out").read_text() == "head raylet\n"
    assert len(copied) == 2


# -- verdicts and the comparison -------------------------------------------------------------------


def _results(tokens, logprob=-1.0, text="x"):
    one = {"token_ids": tokens, "logprobs": [logprob] * len(tokens), "text": text}
    return {"sequential": [one] * len(cluster.PROMPT_LENGTHS), "concurrent": [one] * len(cluster.PROMPT_LENGTHS)}


def _run(name, stock_tokens=(1, 2), overlay_tokens=(1, 2), method=None, stock_text="x", overlay_text="x", **extra):
    spec = _spec(name)
    method = method or spec.method
    run = cluster.run_header(spec, method, {}, [name])
    for build, tokens, text in (("stock", stock_tokens, stock_text), ("overlay", overlay_tokens, overlay_text)):
        run["builds"][build] = {"healthy_after_s": 90.5, "results": _results(list(tokens), text=text),
                                "evidence_problems": [], **extra}
    run["finished_at"] = "2026-12-01T10:00:00Z"
    run.update(cluster.run_verdict(run))
    return run


def test_a_run_is_ok_when_both_builds_served_and_agree():
    run = _run("ray2-tp2", method="netns")
    assert run["ok"] and run["problems"] == [] and run["stock_vs_overlay"]["identical_tokens"]


def test_a_run_is_ok_when_both_builds_generate_the_same_tokens_that_decode_to_empty_text():
    # vLLM 0.33.0, random weights: a lone byte token repeated, "" as text. Recorded, not a problem.
    run = _run("ray2-tp2", stock_tokens=(257, 257), overlay_tokens=(257, 257), method="netns",
               stock_text="", overlay_text="")
    assert run["ok"] and run["problems"] == [], run["problems"]
    assert set(run["empty_text"]) == {"stock", "overlay"} and run["empty_text"]["stock"][0] == "sequential[0]"


def test_a_run_fails_when_a_build_generated_no_tokens_or_the_same_tokens_give_other_text():
    nothing = _run("ray2-tp2", stock_tokens=(), overlay_tokens=(), method="netns", stock_text="", overlay_text="")
    assert not nothing["ok"]
    assert nothing["problems"][0] == "stock: no tokens generated: " + ", ".join(
        f"{batch}[{i}]" for batch in ("sequential", "concurrent") for i in range(len(cluster.PROMPT_LENGTHS)))
    other = _run("ray2-tp2", method="netns", overlay_text="y")
    assert not other["ok"] and other["stock_vs_overlay"]["identical_tokens"]
    assert other["problems"] == ["the same tokens detokenized to other text: sequential[0] (20 tokens), "
                                 "sequential[1] (300 tokens), sequential[2] (3000 tokens), concurrent[0] (20 tokens), "
                                 "concurrent[1] (300 tokens), concurrent[2] (3000 tokens)"]


def test_a_run_fails_on_differing_tokens_an_unhealthy_build_or_evidence():
    differs = _run("ray2-tp2", overlay_tokens=(1, 3), method="netns")
    assert not differs["ok"] and differs["problems"][0].startswith("stock and overlay tokens differ: sequential[0]")
    run = cluster.run_header(_spec("ray1-tp2"), None, {}, ["ray1-tp2"])
    run["builds"] = {"stock": {"healthy_after_s": "error: not healthy in time; see x.log"},
                     "overlay": {"healthy_after_s": 80.0, "results": _results([1]),
                                 "evidence_problems": ["expected 1 alive Ray node(s), found 0: []"]}}
    verdict = cluster.run_verdict(run)
    assert not verdict["ok"]
    assert verdict["problems"] == ["stock: not healthy: error: not healthy in time; see x.log",
                                   "overlay: expected 1 alive Ray node(s), found 0: []"]


def test_the_control_is_ok_only_when_both_builds_reproduce_the_index_error():
    spec = _spec("ray2-tp2@shared")
    run = cluster.run_header(spec, "shared", {}, [spec.name])
    assert run["expected"] == "index-error"
    run["builds"] = {"stock": {"logged": cluster.log_facts(CONTROL_LOG)},
                     "overlay": {"logged": cluster.log_facts(""), "index_error_in_ray_logs": ["IndexError: ..."]}}
    assert cluster.run_verdict(run)["ok"]
    run["builds"]["overlay"] = {"logged": cluster.log_facts("")}
    verdict = cluster.run_verdict(run)
    assert not verdict["ok"] and verdict["problems"] == ["overlay: the IndexError was not logged"]


def test_the_comparison_checks_each_run_against_its_reference_and_says_when_none_ran():
    runs = {"mp-tp2": _run("mp-tp2"), "ray2-tp2": _run("ray2-tp2", method="netns"),
            "ray1-tp2": _run("ray1-tp2", stock_tokens=(1, 9), overlay_tokens=(1, 9)),
            "ray2-pp2": _run("ray2-pp2", method="netns")}
    doc = cluster.compare_runs(runs)
    assert doc["ok"]  # each run as expected; the reference comparison is reported beside it
    assert doc["runs"]["ray2-tp2"]["vs_reference"]["identical_tokens"] is True
    assert doc["runs"]["ray1-tp2"]["vs_reference"]["identical_tokens"] is False
    assert doc["runs"]["ray2-pp2"]["vs_reference"] == {"comparable": False, "why": "mp-pp2 was not run"}
    assert doc["runs"]["mp-tp2"]["vs_reference"] is None
    table = cluster.markdown(doc)
    assert "| ray1-tp2 | - | serve | 90.5 s / 90.5 s |" in table
    assert "NO (mp-tp2)" in table and "n/a (mp-pp2 was not run)" in table and "Overall: **PASS**" in table


def test_runs_are_gathered_from_result_dirs_and_earlier_cluster_json_latest_first(tmp_path):
    first, second = tmp_path / "call1", tmp_path / "call2"
    first.mkdir(), second.mkdir()
    old = _run("mp-tp2", stock_tokens=(5,), overlay_tokens=(5,))
    old["finished_at"] = "2026-12-01T09:00:00Z"
    (first / "cluster.json").write_text(json.dumps(cluster.compare_runs({"mp-tp2": old})))
    (second / "mp-tp2.json").write_text(json.dumps(_run("mp-tp2")))
    (second / "ray2-tp2.json").write_text(json.dumps(_run("ray2-tp2", method="netns")))
    runs = cluster.load_runs([str(first / "cluster.json"), str(second)])
    assert sorted(runs) == ["mp-tp2", "ray2-tp2"]
    assert runs["mp-tp2"]["finished_at"] == "2026-12-01T10:00:00Z" and "vs_reference" not in runs["mp-tp2"]


def test_compare_names_the_base_and_refuses_runs_of_two_bases(tmp_path, capsys):
    base_33 = {name: {**_run(name), "vllm": "0.33.0"} for name in ("mp-tp2", "ray1-tp2")}
    doc = cluster.compare_runs(base_33)
    assert doc["vllm"] == "0.33.0" and cluster.markdown(doc).startswith("# Stock vLLM 0.33.0 vs the overlay")
    assert "NVLink multicast" in cluster.markdown(doc)
    # Records of the 0.24.0 call carry no base: a comparison with them says so ...
    assert cluster.markdown(cluster.compare_runs({"mp-tp2": _run("mp-tp2")})).startswith(
        "# Stock vLLM (base not recorded) vs")
    # ... and never sets one base's run against another's reference.
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (tmp_path / "a" / "mp-tp2.json").write_text(json.dumps({**_run("mp-tp2"), "vllm": "0.24.0"}))
    (tmp_path / "b" / "ray1-tp2.json").write_text(json.dumps(base_33["ray1-tp2"]))
    assert cluster.main(["compare", "--out", str(tmp_path / "out"), str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "more than one vLLM base" in capsys.readouterr().err
    (tmp_path / "b" / "mp-tp2.json").write_text(json.dumps(base_33["mp-tp2"]))
    assert cluster.main(["compare", "--out", str(tmp_path / "out"), str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    assert "mp-tp2 was run on vLLM 0.24.0 and on 0.33.0" in capsys.readouterr().err


def test_run_refuses_a_base_other_than_the_sites_before_starting_anything(tmp_path, capsys):
    stock = fake_site(tmp_path / "stock", "0.33.0")
    overlay = fake_site(tmp_path / "overlay", "0.33.0")
    common = ["run", "--layouts", "mp-tp2", "--model", "m", "--stock-site", str(stock), "--overlay-site",
              str(overlay), "--out", str(tmp_path / "out")]
    assert cluster.main([*common, "--vllm", "0.24.0"]) == 2
    assert "--vllm 0.24.0, but vLLM 0.33.0 is installed" in capsys.readouterr().err
    fake_site(tmp_path / "overlay2", "0.24.0")
    assert cluster.main([*common[:-4], "--overlay-site", str(tmp_path / "overlay2"), "--out", str(tmp_path / "o")]) == 2
    assert "one base per run" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "o").exists()


def test_a_wave_is_given_the_time_a_cold_start_needs_by_default():
    args = cluster.parse_args(["run", "--layouts", "mp-tp2", "--model", "m", "--stock-site", "s",
                               "--overlay-site", "o", "--out", "d"])
    assert args.timeout == 470 and args.vllm is None


def test_compare_writes_json_and_markdown_and_refuses_an_empty_input(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    assert cluster.main(["compare", "--out", str(tmp_path / "out"), str(tmp_path / "in")]) == 2
    assert "nothing to compare" in capsys.readouterr().err
    (tmp_path / "in" / "mp-tp2.json").write_text(json.dumps(_run("mp-tp2")))
    assert cluster.main(["compare", "--out", str(tmp_path / "out"), str(tmp_path / "in")]) == 0
    assert json.loads((tmp_path / "out" / "cluster.json").read_text())["ok"] is True
    assert "mp-tp2" in (tmp_path / "out" / "cluster.md").read_text()


def test_a_not_run_record_fails_and_says_why():
    record = cluster.not_run(_spec("ray2-tp2"), None, {}, "no isolation here")
    assert record["ok"] is False and record["problems"] == ["not run: no isolation here"]
    assert "not run: no isolation here" in cluster.markdown(cluster.compare_runs({"ray2-tp2": record}))


# -- the command line and the shell phase -----------------------------------------------------------


def test_plan_prints_every_command_without_starting_anything(capsys):
    assert cluster.main(["plan", "--layouts", "ray2-tp2 mp-tp2", "--method", "netns"]) == 0
    out = capsys.readouterr().out
    assert "ip netns add dsa-rc0" in out and "ip netns add dsa-rc1" in out
    assert "ip netns exec dsa-rc1 unshare --uts -- sh -c" in out
    assert "vllm serve MODEL --tensor-parallel-size 2 --pipeline-parallel-size 1 --distributed-executor-backend mp" in out
    assert "--distributed-executor-backend ray --compilation-config '{\"pass_config\": {\"fuse_allreduce_rms\": false}}'" in out
    assert "VLLM_FLASHINFER_ALLREDUCE_BACKEND=auto" in out and "VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm" in out


def test_the_command_line_refuses_a_wrong_layout_with_exit_2(capsys):
    assert cluster.main(["plan", "--layouts", "ray3-tp2"]) == 2
    assert "unknown layout 'ray3-tp2'" in capsys.readouterr().err


def test_the_session_phase_refuses_to_run_without_its_inputs(tmp_path):
    script = REPO / "scripts" / "gpu_validation.py"
    done = subprocess.run([sys.executable, str(script), "--out", str(tmp_path / "out"), "--results-dir",
                           str(tmp_path / "results"), "--work-root", str(tmp_path), "--cluster-layouts", "mp-tp2",
                           "cluster"], capture_output=True, text=True, check=False, timeout=60)
    assert done.returncode == status.REFUSED
    assert "cluster: expected" in done.stderr and "run the prepare phase first" in done.stderr


def test_a_wave_or_call_too_large_for_the_port_plan_is_refused_before_anything_starts():
    with pytest.raises(cluster.Refused, match="at most 10 layouts go in one wave"):
        cluster.parse_waves("+".join(["mp-tp2"] + [f"ray2-tp2@{m}" for m in cluster.ISOLATION]
                                     + ["ray2-pp2@netns", "ray2-pp2@shared", "ray2-pp2@mountns", "ray2-pp2",
                                        "ray1-tp2", "mp-pp2", "ray2-tp2"]))
    many = " ".join(["ray1-tp2", "ray2-tp2", "ray2-pp2"] + [f"ray2-{d}@{m}" for d in ("tp2", "pp2")
                                                               for m in cluster.ISOLATION])
    assert len(cluster.parse_waves(many)) == 9  # 18 clusters: within the plan


# -- a whole call against fake Ray and vLLM processes ----------------------------------------------

# Stands in for the device's python3: `-m ray.scripts.scripts start|status`, `-m
# vllm.entrypoints.cli.main serve` and the evidence script, sharing what they know through files
# under $FAKE_REGISTRY. A server of TP > 1 across two nodes with one hostname logs the IndexError
# and hangs, as the control is expected to.
FAKE_PYTHON = r'''#!/usr/bin/env python3
import json, os, socket, sys, time, uuid
from pathlib import Path

REG = Path(os.environ["FAKE_REGISTRY"])


def flag(args, name, default=None):
    return args[args.index(name) + 1] if name in args else default


def cluster_dir(address):
    d = REG / address.replace(":", "_")
    (d / "nodes").mkdir(parents=True, exist_ok=True)
    (d / "actors").mkdir(parents=True, exist_ok=True)
    return d


def write_atomically(path, doc):
    """A reader polling the folder never meets half a file."""
    part = path.with_name(path.name + ".part")
    part.write_text(json.dumps(doc))
    os.replace(part, path)


def ray_start(args):
    ip, name = flag(args, "--node-ip-address"), flag(args, "--node-name")
    if "--head" in args:
        address, temp = f"{ip}:{flag(args, '--port')}", flag(args, "--temp-dir")
        gcs = socket.socket()
        gcs.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        gcs.bind((ip, int(flag(args, "--port"))))
        gcs.listen()
        (cluster_dir(address) / "temp_dir").write_text(temp)
    else:
        # As Ray 2.52.0 does (ray/scripts/scripts.py:1069-1086), which the first GPU call met.
        head_only = [f for f in ("--port", "--redis-shard-ports", "--include-dashboard")
                     if any(a == f or a.startswith(f + "=") for a in args)]
        if head_only:
            sys.exit(f"PANIC `{head_only[0]}` should only be specified when starting head node with `--head`.")
        address = flag(args, "--address")
        temp = (cluster_dir(address) / "temp_dir").read_text()
    session = Path(temp) / "session_fake"
    (session / "logs").mkdir(parents=True, exist_ok=True)
    (session / "logs" / "raylet.out").write_text(f"raylet of {name}\n")
    if not Path(temp, "session_latest").is_symlink():
        os.symlink(session, Path(temp, "session_latest"))
    node = {"node_id": uuid.uuid4().hex, "name": name, "ip": ip, "gpus": float(flag(args, "--num-gpus")),
            "hostname": Path("/proc/sys/kernel/hostname").read_text().strip()}
    write_atomically(cluster_dir(address) / "nodes" / f"{name}.json", node)
    print(f"started {name} at {ip}", flush=True)
    while True:
        time.sleep(1)


def evidence(args):
    # As the real script does: wait (up to its timeout) for the expected number of nodes, since a
    # worker node registers some time after the head opens its GCS port (slow on a loaded CI host).
    d, expected, deadline = cluster_dir(args[2]), int(args[3]), time.monotonic() + float(args[4])
    while len(list((d / "nodes").glob("*.json"))) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
    nodes = [json.loads(p.read_text()) for p in sorted((d / "nodes").glob("*.json"))]
    actors = [json.loads(p.read_text()) for p in sorted((d / "actors").glob("*.json"))]
    print("EVIDENCE " + json.dumps({"nodes": nodes, "actors": actors}))


def serve(args):
    tp, pp = int(flag(args, "--tensor-parallel-size")), int(flag(args, "--pipeline-parallel-size"))
    print("(APIServer pid=%d) INFO 11-30 12:00:00 [api_server.py:1] vLLM API server version 0.24.0" % os.getpid())
    if flag(args, "--distributed-executor-backend") == "ray":
        d = cluster_dir(os.environ["RAY_ADDRESS"])
        nodes = [json.loads(p.read_text()) for p in sorted((d / "nodes").glob("*.json"))]
        if len(nodes) == 2 and tp > 1 and len({n["hostname"] for n in nodes}) == 1:
            print("(RayWorkerProc pid=1) IndexError: device_id 1 is out of range for "
                  "assigned_physical_gpu_ids [0] (1 devices assigned)", flush=True)
            while True:
                time.sleep(1)
        for node in nodes:
            for g in range(int(node["gpus"])):
                actor = {"class": "RayWorkerProc", "name": f"w-{node['name']}-{g}", "state": "ALIVE",
                         "pid": os.getpid(), "ip": node["ip"], "node_id": node["node_id"]}
                write_atomically(d / "actors" / f"{actor['name']}.json", actor)
                print(f"(RayWorkerProc pid={os.getpid()}, ip={node['ip']}) INFO 11-30 12:00:01 [x.py:1] "
                      f"Using ['PYNCCL'] all-reduce backends (in dispatch order) for group 'tp:0' out of "
                      f"potential backends: ['CUSTOM'].")
    sys.stdout.flush()
    time.sleep(1)
    sys.path.insert(0, {tests_dir})  # the tests' fake vLLM server answers for it
    import fake_vllm
    fake_vllm.FakeServer(fake_vllm.FakeVllm(fake_vllm.served_name(args[2:])), int(flag(args, "--port"))).httpd.serve_forever()


def model_info_fill(args):
    # dsa_image.build.model_info_cache fill: one entry, and a count of fills per site in the registry.
    root = Path(flag(args, "--cache-root"))
    (root / "modelinfos").mkdir(parents=True)
    (root / "modelinfos" / "fake-GlmMoeDsaForCausalLM.json").write_text("{}")
    fills = REG / "model-info-fills"
    fills.mkdir(parents=True, exist_ok=True)
    (fills / uuid.uuid4().hex).write_text(os.environ["PYTHONPATH"])


args = sys.argv[1:]
if args[:1] == ["-c"]:
    evidence(args)
elif args[:3] == ["-m", "dsa_image.build.model_info_cache", "fill"]:
    model_info_fill(args)
elif args[:3] == ["-m", "ray.scripts.scripts", "start"]:
    ray_start(args)
elif args[:3] == ["-m", "ray.scripts.scripts", "status"]:
    print("fake ray status")
elif args[:2] == ["-m", "vllm.entrypoints.cli.main"]:
    serve(args)
else:
    sys.exit(f"fake python: unexpected {args}")
'''


def _free_port_base(count: int = 40) -> int:
    """`count` free ports below the ephemeral range (as the device's 8400 is): a base taken from
    the ephemeral range can meet the harness's own outgoing connections."""
    import socket
    for base in range(28000, 32000, count):
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range in 28000-32000")


def fake_site(path: Path, vllm: str) -> Path:
    """A site holding vLLM `vllm` as far as importlib.metadata can tell (the harness reads the base
    from it)."""
    info = path / f"vllm-{vllm}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm}\n")
    return path


def run_fake_call(tmp_path, monkeypatch, layouts: str, probes: dict, ray_root: Path | None = None,
                  extra: tuple[str, ...] = (), sites: tuple[str, str] = ("0.33.0", "0.33.0")) -> tuple[int, Path]:
    fake_site(tmp_path / "site-stock", sites[0])
    fake_site(tmp_path / "site-overlay", sites[1])
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_PYTHON.replace("{tests_dir}", repr(str(Path(__file__).resolve().parent))))
    fake.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1024}))
    monkeypatch.setenv("FAKE_REGISTRY", str(tmp_path / "registry"))
    monkeypatch.setattr(cluster, "probe_isolation", lambda: probes)
    # A tag of this test's own: the call's sweeps must not touch another run's processes. Patched
    # where the call reads it (cluster_plan.TAG_PREFIX), not a copy of it.
    monkeypatch.setattr(cluster_plan, "TAG_PREFIX", f"dsa-cluster-test-{os.getpid()}-{tmp_path.name}:")
    out = tmp_path / "out"
    code = cluster.main([
        "run", "--layouts", layouts, "--model", str(model), "--stock-site", str(tmp_path / "site-stock"),
        "--overlay-site", str(tmp_path / "site-overlay"), "--out", str(out), "--work-dir", str(tmp_path / "work"),
        "--python", str(fake), "--ray-root", str(ray_root or tmp_path / "rc"), "--deadline-s", "150",
        "--timeout", "40", "--min-wave-s", "20", "--port-base", str(_free_port_base()), *extra])
    return code, out


SHARED_ONLY = {"netns": {"ok": False, "detail": "not here"}, "mountns": {"ok": False, "detail": "not here"},
               "shared": {"ok": True, "detail": "needs nothing"}}


def test_a_whole_call_serves_compares_records_and_leaves_nothing_running(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "remove_stale_namespaces", list)
    code, out = run_fake_call(tmp_path, monkeypatch, "mp-tp2+ray1-tp2 ray2-pp2@shared+ray2-tp2@shared+ray2-tp2",
                              SHARED_ONLY)
    runs = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert sorted(runs) == ["mp-tp2", "ray1-tp2", "ray2-pp2-shared", "ray2-tp2", "ray2-tp2-shared"]
    for name in ("mp-tp2", "ray1-tp2", "ray2-pp2-shared"):
        assert runs[name]["ok"], (name, runs[name]["problems"])
    stock = runs["ray2-pp2-shared"]["builds"]["stock"]
    assert [n["gpus"] for n in stock["ray_serving"]["nodes"]] == [1.0, 1.0]
    assert stock["logged"]["all_reduce_backends"] == ["tp:0: ['PYNCCL']"]
    assert {p["ip"] for p in stock["logged"]["processes"] if p["ip"]} == {"127.0.12.1", "127.0.12.2"}
    assert (out / "ray2-pp2-shared" / "ray-stock-node-a" / "raylet.out").is_file()
    control = runs["ray2-tp2-shared"]
    assert control["ok"] and control["reproduced_index_error"] == {"stock": True, "overlay": True}
    # No isolation here: the two-node run without @METHOD is recorded as not run, with the reason.
    assert not runs["ray2-tp2"]["ok"] and "CAP_SYS_ADMIN" in runs["ray2-tp2"]["problems"][0]
    assert code == 1
    assert cluster.tagged_pids(cluster_plan.TAG_PREFIX) == {}
    assert cluster.main(["compare", "--out", str(out), str(out)]) == 1  # the not-run record fails it
    doc = json.loads((out / "cluster.json").read_text())
    assert doc["runs"]["ray1-tp2"]["vs_reference"]["identical_tokens"] is True
    # The base the sites hold is every run's label, and the comparison's title.
    assert {run["vllm"] for run in runs.values()} == {"0.33.0"} and doc["vllm"] == "0.33.0"
    assert (out / "cluster.md").read_text().startswith("# Stock vLLM 0.33.0 vs the overlay")
    # One FlashInfer JIT cache per build for every server of the call; the all-reduce guard.
    envs = {(name, build): runs[name]["builds"][build]["server_env"]
            for name in ("mp-tp2", "ray1-tp2", "ray2-pp2-shared") for build in cluster.BUILDS}
    for build in cluster.BUILDS:
        assert {env["FLASHINFER_WORKSPACE_BASE"] for (_, b), env in envs.items() if b == build} == {
            str(tmp_path / "work" / f"flashinfer-{build}")}
    assert {env["VLLM_FLASHINFER_ALLREDUCE_BACKEND"] for env in envs.values()} == {"trtllm"}
    # Every server started from the image's HOME, its model info made once per build for the call.
    for name in ("mp-tp2", "ray1-tp2", "ray2-pp2-shared", "ray2-tp2-shared"):
        for build in cluster.BUILDS:
            shipped = tmp_path / "work" / f"{name}-{build}-server" / ".cache" / "vllm" / "modelinfos"
            assert [p.name for p in shipped.iterdir()] == ["fake-GlmMoeDsaForCausalLM.json"]
    fills = [p.read_text() for p in (tmp_path / "registry" / "model-info-fills").iterdir()]
    assert len(fills) == 2 and {f.split(os.pathsep)[0] for f in fills} == {
        str(tmp_path / "site-stock"), str(tmp_path / "site-overlay")}
