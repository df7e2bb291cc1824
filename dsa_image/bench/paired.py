"""Paired serving benchmark: two vLLM builds (A, B) side by side on one GPU, in alternating rounds.

A shared GPU drifts by more than the differences worth finding (single runs swung +-15% on the
H200), so A and B are never compared across separate runs. Both servers run at once, each with
its own HOME (compile caches) and the same fixed KV-cache size, and take turns: a round runs a
fixed, seeded set of requests on one and then the same set on the other, and the order flips
every round so that a drift within a pair of rounds cancels. Each round gives one ratio B/A per
metric; the summary is the median of those ratios with a seeded percentile-bootstrap interval.

Ratios are B/A: above 1 means B is faster for output tokens/s and B is slower for TTFT and TPOT.
A workload of an MTP group also records each side's draft acceptance (vLLM's spec-decode counters
on /metrics) and fails when a side counted no drafts: it would not have measured MTP. Every
workload counts the prompts whose texts A and B answered alike (reported, not judged: two bases
may compute differently).

    python3 scripts/bench.py plan [--workloads ...]            # what would run, estimated time
    python3 scripts/bench.py run --a-site S --b-site O --model DIR --out DIR [...]
    python3 scripts/bench.py run --a-site S --b-site S --b-name NAME --b-env KEY=VALUE ...  # a setting
    python3 scripts/bench.py run --a-site S --b-site S --b-name NAME --b-server-args "--flag V" ...  # a flag
    python3 scripts/bench.py plot RESULTS.json [...] [--out DIR] # PNGs, no GPU needed
    python3 scripts/bench.py table RESULTS.json [...]           # markdown rows for a README
    python3 scripts/bench.py table --levels RESULTS.json [...]  # each build's medians, order effect

`run` needs only the standard library (it starts vLLM with another Python's site-packages);
`plot` needs matplotlib.

This module starts the servers, runs the rounds and is the command line. The rest of the
benchmark, in dsa_image.bench: `schedule` (the workloads, the alternating order, the plan and
its time estimate), `client` (one streamed request, one round), `stats` (the ratios B/A and
their bootstrap intervals), `report` (the results file and its tables), `plots` (the PNGs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dsa_image.bench.client import run_round, sample_record, side_stats
from dsa_image.bench.plots import plot
from dsa_image.bench.report import SCHEMA, levels_table, load_results, table
from dsa_image.bench.schedule import GROUPS, SIDES, WORKLOADS, Group, Plan, Workload, describe, estimate, round_order, round_prompts, speculative
from dsa_image.bench.stats import round_ratios, summarize, texts_compared
from dsa_image.build import model_info_cache
from dsa_image.core.site_path import pythonpath
from dsa_image.runtime.spec_decode_metrics import (
    SPEC_COUNTERS,
    acceptance,
    counter_delta,
    scrape_spec_counters,
    settled_spec_counters,
)
from dsa_image.harness import server as serving
from dsa_image.harness.prompts import long_context_model, prompt_token_ids
from dsa_image.harness.server import wait_each_healthy
from dsa_image.core import status

# With --deadline-s: what stopping the servers and writing the results may take after it.
STOP_MARGIN_S = 60.0


# -- speculative decoding: vLLM's counters, summed over a workload's rounds -----------------------


def sum_deltas(deltas: list[dict | None]) -> dict | None:
    present = [d for d in deltas if d]
    if not present:
        return None
    total = {k: sum(d[k] for d in present) for k in SPEC_COUNTERS}
    width = max(len(d["accepted_per_position"]) for d in present)
    total["accepted_per_position"] = [sum(d["accepted_per_position"][i] for d in present
                                          if i < len(d["accepted_per_position"])) for i in range(width)]
    return total


# -- the environment ----------------------------------------------------------------------------

_VERSIONS_SNIPPET = ("import importlib.metadata as m, json, sys\n"
                     "out = {'python': sys.version.split()[0]}\n"
                     "for d in ('vllm', 'torch', 'triton', 'flashinfer-python', 'deep-gemm'):\n"
                     "    try: out[d] = m.version(d)\n"
                     "    except m.PackageNotFoundError: pass\n"
                     "print(json.dumps(out))")


def build_versions(python: str, site: str) -> dict:
    """Package versions as that build's server sees them (its site-packages first)."""
    env = dict(os.environ, PYTHONPATH=pythonpath(site))
    done = subprocess.run([python, "-c", _VERSIONS_SNIPPET], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tempfile.gettempdir())
    versions = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-500:]}
    receipt = Path(site) / "vllm_overlay_receipt.json"
    if receipt.is_file():
        versions["overlay_receipt_sha256"] = hashlib.sha256(receipt.read_bytes()).hexdigest()
    return versions


def gpu_info() -> dict:
    query = "name,driver_version,memory.total,compute_cap"
    try:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"nvidia-smi: {exc}"}
    rows = [[part.strip() for part in line.split(",")] for line in done.stdout.splitlines() if line.strip()]
    return {"gpus": [dict(zip(query.split(","), row, strict=False)) for row in rows]} if rows else {"error": done.stderr[-300:]}


# -- running ------------------------------------------------------------------------------------


@dataclass
class Build:
    side: str  # "A" or "B"
    name: str
    site: str
    python: str
    # Variables this build's servers get on top of the harness's own (--a-env, --b-env), and
    # vllm serve flags after every other (--a-server-args, --b-server-args, so they win): one
    # build with a setting or a flag against the same build without it.
    env: dict[str, str] = field(default_factory=dict)
    server_args: tuple[str, ...] = ()


def _server_args(args, group: Group) -> list[str]:
    # A fixed KV-cache size: memory profiling would count the other server's allocations. The
    # low utilisation only passes vLLM's start-up check of free memory with two servers.
    return ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            *group.server_args, *shlex.split(args.server_args)]


def _home(work_dir: Path, group: str, build: Build) -> Path:
    # Named for the build, not its side: a run comparing other builds on the same work
    # directory gets its own HOMEs, never another build's caches or model info.
    return work_dir / f"home-{group}-{build.name}"


def caches_present(homes: list[Path]) -> bool:
    """Every HOME holds compile caches: a file besides the model info the image ships."""
    def compiled(home: Path) -> bool:
        shipped = model_info_cache.shipped_dir(home)
        return home.is_dir() and any(p.is_file() and shipped not in p.parents for p in home.rglob("*"))

    return all(compiled(h) for h in homes)


def model_dirs(args, work_dir: Path, plan: Plan) -> dict[str, str]:
    dirs = {"base": args.model}
    kinds = {g.model for g in plan.groups}
    if "long" in kinds:
        longest = max(g.max_model_len for g in plan.groups if g.model == "long")
        dirs["long"] = str(long_context_model(Path(args.model), work_dir / "model-long", longest))
    if "mtp" in kinds:
        if not args.mtp_model:
            raise SystemExit("MTP workloads need --mtp-model DIR (the tiny GLM-5 with its MTP layer)")
        dirs["mtp"] = args.mtp_model
    return dirs


def image_homes(plan: Plan, builds: list[Build], work_dir: Path, dirs: dict[str, str], root: Path) -> None:
    """Each HOME without caches starts as the image's first `docker run` does: with the model info
    the image ships (serving.image_model_info), made once per build from the MTP model where a
    group serves it (its classes include the base model's), keyed by the build's name as the other
    harnesses key theirs (stock, overlay). A HOME with caches is kept as it is."""
    empty = [(home, build) for group in plan.groups for build in builds
             if not caches_present([home := _home(work_dir, group.name, build)])]
    if not empty:
        return
    entries = serving.require_image_model_info({b.name: (b.python or sys.executable, b.site) for b in builds},
                                               Path(dirs.get("mtp", dirs["base"])), root)
    for home, build in empty:
        model_info_cache.image_home(home, entries[build.name])


def start_servers(args, plan: Plan, builds: list[Build], work_dir: Path, out_dir: Path) -> list[dict]:
    dirs = model_dirs(args, work_dir, plan)
    image_homes(plan, builds, work_dir, dirs, serving.model_info_root(args, work_dir))
    servers = []
    for gi, group in enumerate(plan.groups):
        for si, build in enumerate(builds):
            home = _home(work_dir, group.name, build)
            server = serving.start_server(
                f"bench-{group.name}-{build.side}", build.site, dirs[group.model],
                args.port_base + 2 * gi + si, str(out_dir), [*_server_args(args, group), *build.server_args],
                home=str(home), max_model_len=group.max_model_len, python=build.python, env_extra=build.env)
            servers.append({**server, "group": group.name, "side": build.side})
    return servers


def _run_side(server: dict, prompts, w: Workload, timeout: float) -> dict:
    before = scrape_spec_counters(server["port"])
    samples = run_round(server["port"], serving.SERVED_NAME, prompts, w.output_len, w.concurrency, timeout)
    # Settled only where there are counters (MTP): the wait is outside the timed requests.
    after = settled_spec_counters(server["port"]) if before is not None else None
    spec = counter_delta(before, after)
    return {"stats": side_stats(samples), "samples": [sample_record(s) for s in samples], "spec_decode": spec}


def run_one_round(pair: dict, w: Workload, index: int, token_ids: list[int], seed: int, timeout: float) -> dict:
    prompts = round_prompts(w, index, token_ids, seed)
    order = round_order(index)
    sides = {side: _run_side(pair[side], prompts, w, timeout) for side in order}
    return {"index": index, "order": list(order), "sides": sides,
            "ratios": round_ratios(sides["A"]["stats"], sides["B"]["stats"]),
            "texts": texts_compared(sides["A"]["samples"], sides["B"]["samples"])}


def run_workload(pair: dict, w: Workload, token_ids: list[int], args, deadline: float | None) -> dict:
    t0 = time.monotonic()
    # One unrecorded round per side first: the shapes of this workload compile here, not in
    # the first measured round.
    warmup = run_one_round(pair, w, -1, token_ids, args.seed, args.request_timeout)
    warm_round_s = (time.monotonic() - t0) / 2
    print(f"  {w.name}: warm-up round {warm_round_s:.1f} s per side; projected "
          f"{2 * w.rounds * warm_round_s:.0f} s for {w.rounds} rounds", flush=True)
    rounds, truncated = [], False
    for index in range(w.rounds):
        if index % 2 == 0 and deadline and time.monotonic() + 4 * warm_round_s * 1.2 > deadline:
            truncated = True  # whole pairs only: each build keeps going first equally often
            break
        rounds.append(run_one_round(pair, w, index, token_ids, args.seed, args.request_timeout))
    texts = workload_texts(rounds)
    print(f"  {w.name}: texts equal for {texts['equal']} of {texts['compared']} prompts", flush=True)
    return {**asdict(w), "rounds_planned": w.rounds, "rounds_done": len(rounds), "truncated": truncated,
            "warmup_errors": {s: warmup["sides"][s]["stats"]["errors"] for s in SIDES},
            "rounds": rounds, "seconds": round(time.monotonic() - t0, 1),
            "summary": summarize(rounds, args.resamples, args.confidence, args.seed),
            "spec_decode": workload_acceptance(rounds), "texts": texts}


def workload_texts(rounds: list[dict]) -> dict:
    counts = [r.get("texts") or {"compared": 0, "equal": 0} for r in rounds]
    return {k: sum(c[k] for c in counts) for k in ("compared", "equal")}


def workload_acceptance(rounds: list[dict]) -> dict | None:
    per_side = {s: acceptance(sum_deltas([r["sides"][s]["spec_decode"] for r in rounds])) for s in SIDES}
    return per_side if any(per_side.values()) else None


def missing_drafts(result: dict) -> str | None:
    """Why an MTP workload's rounds do not measure speculative decoding, or None when both sides
    drafted. An MTP server registers vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py,
    the same names in 0.24.0 and 0.33.0) and counts every draft; a side without counters, or with
    no draft tokens over the rounds, served without its draft path, and comparing it would pass
    for an MTP result."""
    if not result["rounds_done"]:
        return None
    spec = result.get("spec_decode") or {}
    problems = []
    for side in SIDES:
        if not (spec.get(side) or {}).get("draft_tokens"):
            deltas = [r["sides"][side]["spec_decode"] for r in result["rounds"]]
            problems.append(f"{side}: " + ("no spec-decode counters on /metrics" if not any(deltas)
                                           else "no draft tokens counted"))
    return "; ".join(problems) or None


def new_results(args, plan: Plan, builds: list[Build], argv: list[str]) -> dict:
    return {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["scripts/bench.py", *argv]),
        "environment": {"gpu": gpu_info(), "platform": platform.platform(),
                        "builds": {b.side: {"name": b.name, "site": b.site, "python": b.python, "env": b.env,
                                            "server_args": list(b.server_args),
                                            "versions": build_versions(b.python, b.site)} for b in builds}},
        "settings": {"seed": args.seed, "resamples": args.resamples, "confidence": args.confidence,
                     "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
                     "gpu_memory_utilization": args.gpu_memory_utilization, "server_args": args.server_args,
                     "ratio": "B/A per round; output tokens/s: above 1 is B faster; times: above 1 is B slower",
                     "prompts": "token ids, new in every round, the same for A and B; greedy, ignore_eos"},
        "groups": {g.name: {**asdict(g), "server_args": _server_args(args, g)} for g in plan.groups},
        "workloads": [],
    }


def write_json(doc: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def run(args, argv: list[str]) -> int:
    plan = Plan.select(args.workloads, args.rounds_scale, args.requests_scale)
    out_dir, work_dir = Path(args.out), Path(args.work_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    builds = [Build("A", args.a_name, args.a_site, args.a_python, dict(args.a_env),
                    tuple(shlex.split(args.a_server_args))),
              Build("B", args.b_name, args.b_site, args.b_python, dict(args.b_env),
                    tuple(shlex.split(args.b_server_args)))]
    homes = [_home(work_dir, g.name, b) for g in plan.groups for b in builds]
    if args.fresh_caches:
        for home in homes:
            shutil.rmtree(home, ignore_errors=True)
    print(describe(plan, estimate(plan, caches_present(homes))), flush=True)
    deadline = time.monotonic() + args.deadline_s if args.deadline_s else None
    doc = new_results(args, plan, builds, argv)
    doc["caches_warm_at_start"] = caches_present(homes)
    path = out_dir / "results.json"
    servers = start_servers(args, plan, builds, work_dir, out_dir)
    try:
        run_groups(args, plan, servers, doc, path, deadline)
    except Exception as exc:  # noqa: BLE001 - recorded in the results, then servers stop
        doc["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for server in servers:
            serving.stop(server)
    doc["jit_during_inference"] = {s["name"]: serving.jit_kernels_during_inference(s["log"]) for s in servers}
    write_json(doc, path)
    print(table([doc]))
    print(f"results: {path}")
    failed = "error" in doc or doc.get("group_errors") or any(w.get("failed") for w in doc["workloads"])
    return status.FAILED if failed else status.SUCCESS


def run_groups(args, plan: Plan, servers: list[dict], doc: dict, path: Path, deadline: float | None) -> None:
    health_deadline = time.monotonic() + args.timeout
    if deadline:  # a call cut off by its time limit keeps nothing: leave time to stop and write
        health_deadline = min(health_deadline, deadline - STOP_MARGIN_S)
    doc["healthy_after_s"] = wait_each_healthy(servers, health_deadline)
    token_ids = prompt_token_ids(args.model)
    for group in plan.groups:
        pair = {s["side"]: s for s in servers if s["group"] == group.name}
        failed = {s["name"]: doc["healthy_after_s"][s["name"]] for s in pair.values()
                  if isinstance(doc["healthy_after_s"][s["name"]], str)}
        if failed:  # the other groups still run
            doc.setdefault("group_errors", {})[group.name] = failed
            continue
        for w in (w for w in plan.workloads if w.group == group.name):
            result = run_workload(pair, w, token_ids, args, deadline)
            if speculative(_server_args(args, group)) and (problem := missing_drafts(result)):
                result["spec_decode_problem"] = problem
                print(f"  {w.name}: not an MTP measurement: {problem}", flush=True)
            result["failed"] = bool(result["rounds_done"] > 0 and not any(r["ratios"] for r in result["rounds"])
                                    or result.get("spec_decode_problem"))
            doc["workloads"].append(result)
            write_json(doc, path)  # a run cut short still leaves every finished workload


# -- command line -------------------------------------------------------------------------------


def _add_selection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", nargs="*", metavar="NAME",
                        help=f"workloads or groups ({', '.join(GROUPS)}); default all: "
                             + ", ".join(w.name for w in WORKLOADS))
    parser.add_argument("--rounds-scale", type=float, default=1.0,
                        help="multiply each workload's rounds (rounded up to an even number, at least 2)")
    parser.add_argument("--requests-scale", type=float, default=1.0,
                        help="multiply each workload's requests per round (at least its concurrency)")


def env_assignment(text: str) -> tuple[str, str]:
    """KEY=VALUE, as --a-env / --b-env take it."""
    key, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with KEY an environment variable name, got {text!r}")
    return key, value


def _add_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--a-site", required=True, help="site-packages of build A (e.g. stock vLLM)")
    parser.add_argument("--b-site", required=True, help="site-packages of build B (e.g. with the overlay)")
    parser.add_argument("--a-name", default="stock")
    parser.add_argument("--b-name", default="overlay")
    parser.add_argument("--a-python", default=sys.executable, help="the Python that serves A")
    parser.add_argument("--b-python", default=sys.executable, help="the Python that serves B")
    for side in ("a", "b"):
        parser.add_argument(f"--{side}-env", action="append", type=env_assignment, default=[], metavar="KEY=VALUE",
                            help=f"an environment variable for build {side.upper()}'s servers (repeatable), "
                                 "e.g. one build with a vLLM setting against itself without it")
        parser.add_argument(f"--{side}-server-args", default="", metavar="ARGS",
                            help=f"more vllm serve arguments for build {side.upper()}'s servers alone, one string, "
                                 "after every other (e.g. --attention-backend X against the build's own choice; "
                                 f"one flag alone as --{side}-server-args=--flag)")
    parser.add_argument("--model", required=True, help="the tiny GLM-5 directory (scripts/make_tiny_model.py)")
    parser.add_argument("--mtp-model", help="the tiny GLM-5 with its MTP layer, for the mtp groups")
    parser.add_argument("--out", required=True, help="results.json and the server logs go here")
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "dsa-bench"),
                        help="the servers' HOMEs (compile caches, kept between runs) and derived models")
    parser.add_argument("--fresh-caches", action="store_true", help="empty the servers' HOMEs first")
    serving.add_model_info_root(parser)
    parser.add_argument("--port-base", type=int, default=8200)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    parser.add_argument("--server-args", default="", help="more vllm serve arguments for every server, one string")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for all servers to become healthy")
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--deadline-s", type=float,
                        help="stop starting round pairs when the next pair would end past this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resamples", type=int, default=10_000)
    parser.add_argument("--confidence", type=float, default=0.95)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="serve A and B side by side and run the paired rounds")
    _add_selection(run_parser)
    _add_run(run_parser)
    _add_selection(commands.add_parser("plan", help="print the workloads, rounds and an estimated time"))
    plot_parser = commands.add_parser("plot", help="PNG plots from results files (matplotlib, no GPU)")
    plot_parser.add_argument("results", nargs="+")
    plot_parser.add_argument("--out", help="directory for the PNGs (default: beside the first file)")
    table_parser = commands.add_parser("table", help="markdown table of the ratios")
    table_parser.add_argument("results", nargs="+")
    table_parser.add_argument("--levels", action="store_true",
                              help="each build's medians and the ratio by which build went first, "
                                   "instead of the ratios with their intervals")
    args = parser.parse_args(argv)
    if args.command == "run" and args.a_name == args.b_name:
        # The names label the results and key each build's model info (shared with other harnesses).
        run_parser.error(f"--a-name and --b-name must differ; both are {args.a_name!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.command == "plan":
        plan = Plan.select(args.workloads, args.rounds_scale, args.requests_scale)
        print(describe(plan, estimate(plan, warm_caches=False)))
        return 0
    if args.command == "run":
        return run(args, argv)
    docs = [load_results(p) for p in args.results]
    if args.command == "table":
        print(levels_table(docs) if args.levels else table(docs))
        return 0
    for path in plot(args.results, args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
