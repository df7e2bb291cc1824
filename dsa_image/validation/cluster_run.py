"""One wave of the cluster harness (dsa_image.validation.cluster `run`): its runs, each served by
every build (stock, overlay) side by side on the same GPUs. Wave starts each build's Ray cluster
and checks its nodes, starts the servers, waits for them (a control is settled by its logged
IndexError), gathers the evidence while they serve, sends the same greedy requests to each, stops
everything, and writes each run's record (run_header) with its verdict (cluster_compare).
run_wave carries a wave through those steps; not_run is the record of a run never started.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from dsa_image.build import model_info_cache
from dsa_image.harness import server as serving
from dsa_image.validation import cluster_plan, serving_modes
from dsa_image.validation.cluster_compare import run_verdict
from dsa_image.validation.cluster_host import (copy_ray_logs, gpu_apps, gpu_processes, log_facts, node_problems,
                                               placement_problems, ray_evidence, ray_status, run_commands,
                                               start_process, stop_process, sweep, tail, worker_problems)
from dsa_image.validation.cluster_plan import (BUILDS, INDEX_ERROR, ISOLATION, MAX_TOKENS, PROMPT_LENGTHS,
                                               SAFETY_ENV, TAG_VAR, ClusterPlan, NodePlan, RunSpec, allreduce_args,
                                               expected_outcome, netns_setup_commands, netns_teardown_commands,
                                               node_command, node_env_extra, plan_cluster, reference_for,
                                               server_env_extra)
from dsa_image.validation.recipes import port_accepts

# -- one wave -----------------------------------------------------------------------------------

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
        # cluster_plan.TAG_PREFIX, read at the call: a test gives its call a prefix of its own there.
        return f"{cluster_plan.TAG_PREFIX}{self.call_id}:{entry['spec'].stem}:{entry['build']}:"

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
        left = sweep(f"{cluster_plan.TAG_PREFIX}{self.call_id}:")
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
