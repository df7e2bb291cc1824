"""Verdicts and the comparison of the cluster harness (dsa_image.validation.cluster `compare`):
each build's problems and each run's verdict (as expected: served identical tokens, or for the
control the IndexError), every run against the multiprocessing run of its TP and PP degrees, the
markdown report, and the run records read back from result directories and earlier cluster.json
files (never two vLLM bases in one comparison).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dsa_image.harness import server as serving
from dsa_image.validation.cluster_plan import ALLREDUCE_GUARD, BUILDS, MAX_TOKENS, PROMPT_LENGTHS, Refused

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
        vs_ref: dict[str, Any] | None = None
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
         f"{ALLREDUCE_GUARD} (dsa_image/validation/cluster_plan.py)."),
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
