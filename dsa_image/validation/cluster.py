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
of earlier calls) and writes cluster.json and cluster.md. Exit codes: --help (EXIT_CODES).

Stdlib only, like the other validation harnesses (it starts vLLM and Ray, never imports them).

This module is the command line (its verbs and main); the harness lives beside it:
cluster_plan (layouts, waves, cluster plans, commands and environments, ALLREDUCE_GUARD),
cluster_host (the isolation probe, processes and namespaces, the evidence read from the host),
cluster_run (one wave: Wave, run_wave, the run records) and cluster_compare (verdicts, the
comparison, the markdown, loading results). The names tests and callers use are importable from
here too (__all__).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
import uuid
from pathlib import Path

from dsa_image.core import status
from dsa_image.harness import server as serving
from dsa_image.validation import cluster_plan, vllm_base
from dsa_image.validation.cluster_compare import build_problems, compare_runs, load_runs, markdown, run_verdict
from dsa_image.validation.cluster_host import (choose_method, copy_ray_logs, gpu_processes, log_facts, node_problems,
                                               parse_gpu_apps, placement_problems, probe_isolation,
                                               remove_stale_namespaces, sweep, tagged_pids, worker_problems)
from dsa_image.validation.cluster_plan import (BUILDS, DEFAULT_METHOD_ORDER, FAITHFUL, ISOLATE_SCRIPT, ISOLATION,
                                               LAYOUTS, MAX_SLOTS, NODE_VAR, PORT_BASE, PORTS_PER_WAVE,
                                               PROMPT_LENGTHS, RAY_HEAD_ONLY_FLAGS, RAY_ROOT, TAG_VAR, WORKER_SHM,
                                               ClusterPlan, NodePlan, Refused, RunSpec, allreduce_args,
                                               expected_outcome, netns_setup_commands, netns_teardown_commands,
                                               node_command, node_env_extra, parse_waves, plan_cluster,
                                               reference_for, server_env_extra)
from dsa_image.validation.cluster_run import Wave, not_run, run_header, run_wave, wait_servers

# What tests and callers reach as cluster.X. TAG_PREFIX is not among them: it is read as
# cluster_plan.TAG_PREFIX at the call, so that is where to look it up or patch it.
__all__ = [
    "BUILDS", "DEFAULT_METHOD_ORDER", "FAITHFUL", "ISOLATE_SCRIPT", "ISOLATION", "LAYOUTS", "MAX_SLOTS", "NODE_VAR",
    "PORT_BASE", "PROMPT_LENGTHS", "RAY_HEAD_ONLY_FLAGS", "TAG_VAR", "WORKER_SHM", "ClusterPlan", "NodePlan",
    "Refused", "RunSpec", "Wave", "allreduce_args", "build_problems", "choose_method", "compare_runs",
    "copy_ray_logs", "expected_outcome", "gpu_processes", "load_runs", "log_facts", "main", "markdown",
    "netns_setup_commands", "netns_teardown_commands", "node_command", "node_env_extra", "node_problems", "not_run",
    "parse_args", "parse_gpu_apps", "parse_waves", "placement_problems", "plan_cluster", "probe_isolation",
    "reference_for", "resolve_methods", "run_header", "run_verdict", "run_wave", "server_env_extra", "tagged_pids",
    "wait_servers", "worker_problems",
]

EXIT_CODES = status.epilog(
    (status.SUCCESS, "every run as expected (probe: a faithful isolation method works here)"),
    (status.FAILED, "a run was not (probe: none works)"),
    (status.USAGE, "usage: a layout, method or plan refused, with the reason; compare: no run results, or runs "
                   "of more than one base"))


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
    earlier, stale = sweep(cluster_plan.TAG_PREFIX), remove_stale_namespaces()
    if earlier or stale:
        print(f"removed what an earlier call left: processes {sorted(earlier)}, namespaces and links {stale}")
    all_runs = [spec for wave in waves for spec in wave]
    probes = probe_isolation() if any(spec.layout.ray_nodes == 2 for spec in all_runs) else {}
    methods = resolve_methods(all_runs, probes, tuple(args.methods.split(",")))
    # The runs that may start, by their method (the others are recorded as not run).
    usable = {name: m for name, m in methods.items() if not isinstance(m, Refused)}
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
            records.update({spec.name: not_run(spec, usable[spec.name], probes,
                                               f"{left:.0f} s left of this call's {args.deadline_s:.0f} s, a wave needs "
                                               f"{args.min_wave_s:.0f} s; run it in another call", base)
                            for spec in runnable})
            runnable = []
        if runnable:
            wave = Wave(runnable, usable, probes, args, slot, args.port_base + PORTS_PER_WAVE * wave_index, call_id,
                        base)
            slot = wave.next_slot
            records.update(run_wave(wave, deadline, args))
        for spec in wave_runs:
            run = records[spec.name]
            (out / f"{spec.stem}.json").write_text(json.dumps(run, indent=1) + "\n")
            print(f"{spec.name}: {'as expected' if run['ok'] else 'NOT as expected'}: {run.get('problems')}")
            all_ok &= run["ok"]
    print("CLUSTER RUNS (this call):", "PASS" if all_ok else "FAIL")
    return status.SUCCESS if all_ok else status.FAILED


def compare_call(args) -> int:
    runs = load_runs(args.inputs)
    if not runs:
        print(f"nothing to compare: no run results in {args.inputs} (expected DIR/<run>.json from `run`, or "
              "cluster.json)", file=sys.stderr)
        return status.USAGE
    bases = {run.get("vllm") for run in runs.values()}
    if len(bases) > 1:
        # A run is compared with the mp run of its degrees by name: across bases that would set
        # one vLLM's tokens against another's.
        named = ", ".join(f"{b or 'not recorded'}: {sorted(n for n, r in runs.items() if r.get('vllm') == b)}"
                          for b in sorted(bases, key=str))
        print(f"the inputs hold runs of more than one vLLM base ({named}); compare one base at a time",
              file=sys.stderr)
        return status.USAGE
    doc = compare_runs(runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cluster.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "cluster.md").write_text(markdown(doc))
    print(markdown(doc))
    print("CLUSTER COMPARISON:", "PASS" if doc["ok"] else "FAIL")
    return status.SUCCESS if doc["ok"] else status.FAILED


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
    killed = sweep(cluster_plan.TAG_PREFIX)
    removed = remove_stale_namespaces()
    print(json.dumps({"killed": sorted(killed), "removed_namespaces_and_links": removed}))
    return 0


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
            return status.SUCCESS if any(probes[m]["ok"] for m in FAITHFUL) else status.FAILED
        return {"plan": plan_call, "run": run_call, "compare": compare_call, "cleanup": cleanup_call}[args.command](args)
    except Refused as exc:
        print(f"CLUSTER: refused: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
