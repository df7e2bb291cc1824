"""Warm start, measured: time to healthy, and the first request after it against warm ones.

Start-to-healthy with empty and with warm compile caches, and the first 3,000-token request
after healthy against the same request once warm, with and without the image's warm-up
(dsa_image.runtime.warmup).

Each step starts one server per side (stock and/or overlay, side by side, each with its own
HOME, which holds every compile cache and is kept from step to step), waits for /health, runs
the warm-up when the step says so, then sends per side, one side at a time: one fresh
3,000-token request (the first) and five more (warm). The Triton kernels vLLM's JIT monitor
logs (verbose: every compile, with its key), the other runtimes' it logs (CuTeDSL, TileLang:
vLLM 0.33.0), the DeepGEMM compiler runs and the FlashInfer JIT modules built are split into
those before healthy, during the warm-up and during the first request. Then a probe, not
judged: a first request of a new length (3,500 tokens) against three more of it.

    cold          empty caches, no warm-up        (what a first `docker run` did)
    cold-warmup   empty caches, then the warm-up  (a first run of the image)
    warm          warm caches, no warm-up         (a restart with the cache volume, no warm-up)
    warm-warmup   warm caches, then the warm-up   (a restart of the image with the volume)

"Empty" is the image's HOME at a first `docker run`: no compile cache, but the model-info
entries the image builds in (dsa_image/build/model_info_cache.py), filled once per side into the work
directory with that side's vLLM and copied into its HOME.

On the H200 the steps go in pairs, a cold one first: cold then warm-warmup, cold-warmup then
warm, planned as one call of ten minutes per pair. A cold vLLM 0.33.0 server took
239-281 s to become healthy on the H200, about 100 s of it building FlashInfer's sampling
module (docs/validation/h200-2026-11-30-vllm0_33_0-run2); a pair may then not fit one call,
and the HOMEs stay in --work-dir between calls, so each step can have a call of its own, in
the same order. Goal: the first request within 2x the warm latency (--goal-factor). With
--require-warm the run fails unless every side of every step with the warm-up met the goal and
compiled nothing after the warm-up (start_problems), the check startup.py --require-warm holds
each of its starts to (GLM-5 at real width, the GPU session runner's realwidth-startup phase: goal
1.2x).

Stdlib only. Usage:
    python -m dsa_image.validation.warmstart --model DIR --stock-site S --overlay-site O \\
        --out DIR --steps cold,warm-warmup
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from dsa_image.build import model_info_cache
from dsa_image.runtime import warmup
from dsa_image.bench.client import stream_completion
from dsa_image.harness import server as serving
from dsa_image.validation.serving_modes import model_prompt_ids, prompt_token_ids
from dsa_image.core import status

STEPS = {  # name: (empty the caches first, run the warm-up)
    "cold": (True, False),
    "cold-warmup": (True, True),
    "warm": (False, False),
    "warm-warmup": (False, True),
}
FIRST_PROMPT_TOKENS = 3000  # the smoke test's long prompt, the first request
MAX_TOKENS = 16
WARM_REQUESTS = 5
# After the warm ones, a length neither they nor the warm-up prefilled (2,049-2,056 and 4,096
# tokens): its first request against its warm ones tells a cost paid once per new prefill
# length (kernels picked and loaded for that shape) from one paid once after ready. Not judged.
NEW_LENGTH_TOKENS = 3500
NEW_LENGTH_WARM = 3
GOAL_FACTOR = 2.0
# DeepGEMM's compiler runs, printed with DG_JIT_PRINT_COMPILER_COMMAND=1: "Running NVCC command:
# <cmd>" by vLLM 0.24.0's DeepGEMM, "Running command: <cmd>" by the deep_jit runtime of 0.33.0's
# (the strings of vllm/third_party/deep_gemm/_C_extension.abi3.so), which may run other
# commands (`which nvcc`, cuobjdump) the same way: a compiler run is a command calling nvcc.
DEEPGEMM_NVCC = re.compile(r"Running (?:NVCC )?command: (?!which )[^\n]*nvcc")
# FlashInfer logs a module's build only when its library is not in the JIT cache yet
# (flashinfer/jit/core.py, JitSpec.build): on vLLM 0.33.0 the sampling module, ~100 s of a cold
# H200 start (docs/validation/h200-2026-11-30-vllm0_33_0-run2), none of a warm one.
FLASHINFER_BUILD = re.compile(r"flashinfer\.jit: Building JIT module (\S+?);")


def log_size(server: dict) -> int:
    # vLLM's processes write their own lines; a moment lets the last ones reach the file.
    time.sleep(1.0)
    return os.path.getsize(server["log"])


def _read_slice(server: dict, start: int, end: int | None) -> str:
    with open(server["log"], "rb") as f:
        f.seek(start)
        return f.read(None if end is None else end - start).decode(errors="replace")


def log_slice(server: dict, start: int, end: int | None = None) -> dict:
    """The Triton kernels the JIT monitor saw and DeepGEMM's compiler runs between two offsets
    of the server log."""
    text = _read_slice(server, start, end)
    kernels = [m.group(2) for m in serving.JIT_LINE.finditer(text) if m.group(1) == "Triton"]
    return {"triton_jit": {k: kernels.count(k) for k in sorted(set(kernels))},
            "deepgemm_nvcc_runs": len(DEEPGEMM_NVCC.findall(text))}


def compiled_between(server: dict, start: int, end: int | None = None) -> dict:
    """log_slice(), with what else compiled: FlashInfer's JIT modules built (vLLM 0.33.0's cold
    start is mostly one) and kernels of the JIT monitor's other runtimes (CuTeDSL, TileLang on
    0.33.0), "Runtime:name" with their counts."""
    text = _read_slice(server, start, end)
    others = [serving.jit_kernel_name(m) for m in serving.JIT_LINE.finditer(text) if m.group(1) != "Triton"]
    return {**log_slice(server, start, end),
            "flashinfer_jit_builds": FLASHINFER_BUILD.findall(text),
            "other_jit": {k: others.count(k) for k in sorted(set(others))}}


DEEPGEMM_LINE = re.compile(r"(?i)[^\n]*deep_?gemm[^\n]*")


def deepgemm_lines(log_path: str, limit: int = 8) -> list[str]:
    """What the server said about DeepGEMM, compiler runs aside: on the H200 a DeepGEMM cache
    left by a stopped server once made the next one report DeepGEMM unavailable, and a warm
    cache volume must not do that."""
    with open(log_path, errors="replace") as f:
        lines = [m.group(0).strip() for m in DEEPGEMM_LINE.finditer(f.read()) if not DEEPGEMM_NVCC.search(m.group(0))]
    # The message after the logger's prefix, once each, in order.
    unique = list(dict.fromkeys(re.sub(r"^.*?\] ", "", line) for line in lines))
    return unique[:limit]


def cache_sizes(home: Path) -> dict:
    """MiB per directory two levels under HOME: which caches a start filled."""
    sizes = {}
    for top in sorted(p for p in home.glob("*") if p.is_dir()):
        for sub in sorted(p for p in [top, *top.glob("*")] if p.is_dir()):
            total = sum(f.stat().st_size for f in sub.rglob("*") if f.is_file())
            sizes[str(sub.relative_to(home))] = round(total / 2**20, 1)
    return sizes


def request(port: int, token_ids: list[int], key: str, tokens: int = FIRST_PROMPT_TOKENS) -> dict:
    prompt = model_prompt_ids(token_ids, tokens, f"warmstart:{key}")
    sample = stream_completion(port, serving.SERVED_NAME, prompt, MAX_TOKENS)
    if sample.error:
        raise RuntimeError(f"{tokens:,}-token request on port {port}: {sample.error}")
    if (ttft := sample.ttft) is None:
        raise RuntimeError(f"{tokens:,}-token request on port {port}: no token streamed")
    return {"latency_s": round(sample.end - sample.start, 4), "ttft_s": round(ttft, 4)}


def first_against_warm(first: dict, warm: list[dict]) -> dict:
    """A first request's timings beside its warm ones': their median latency and the ratio."""
    median = statistics.median(w["latency_s"] for w in warm)
    return {"first": first, "warm": warm, "warm_latency_s": median,
            "first_over_warm": round(first["latency_s"] / median, 2)}


def new_length_probe(server: dict, step: str, token_ids: list[int]) -> dict:
    """NEW_LENGTH_TOKENS' first request against its warm ones, and what compiled meanwhile."""
    start = log_size(server)
    key = f"{step}:{server['name']}:new-length"
    first = request(server["port"], token_ids, f"{key}:first", NEW_LENGTH_TOKENS)
    warm = [request(server["port"], token_ids, f"{key}:warm{i}", NEW_LENGTH_TOKENS) for i in range(NEW_LENGTH_WARM)]
    return {"tokens": NEW_LENGTH_TOKENS, **first_against_warm(first, warm),
            "compiled": compiled_names(compiled_between(server, start))}


def measure_side(server: dict, step: str, run_warmup: bool, token_ids: list[int],
                 goal_factor: float = GOAL_FACTOR) -> dict:
    """Warm-up (if asked), the first request, then the warm ones; compilations between."""
    result: dict[str, Any] = {}
    healthy_at = log_size(server)
    if run_warmup:
        endpoint = warmup.Endpoint.from_url(f"http://127.0.0.1:{server['port']}")
        report = warmup.warm(endpoint, warmup.Settings(), lambda line: None)
        result["warmup"] = {"seconds": report["seconds"], "steps": report["steps"]}
    ready_at = log_size(server)
    first = request(server["port"], token_ids, f"{step}:{server['name']}:first")
    first_done = log_size(server)
    warm = [request(server["port"], token_ids, f"{step}:{server['name']}:warm{i}") for i in range(WARM_REQUESTS)]
    warm_done = log_size(server)
    result.update(first_against_warm(first, warm))
    result["goal_met"] = result["first"]["latency_s"] <= goal_factor * result["warm_latency_s"]
    result["compiled"] = {"before_healthy": compiled_between(server, 0, healthy_at),
                          "during_warmup": compiled_between(server, healthy_at, ready_at),
                          "during_first_request": compiled_between(server, ready_at, first_done),
                          "during_warm_requests": compiled_between(server, first_done, warm_done)}
    result["new_length"] = new_length_probe(server, step, token_ids)
    result["compiled_after_ready"] = sorted({*compiled_names(result["compiled"]["during_first_request"]),
                                             *compiled_names(result["compiled"]["during_warm_requests"])})
    return result


def harness_server_args(args) -> list[str]:
    """What every warm-start server is given beyond serving.start_server's flags."""
    return ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes), "--gpu-memory-utilization",
            str(args.gpu_memory_utilization), "--jit-monitor-verbose", *shlex.split(args.server_args)]


def compiled_names(compiled: dict) -> list[str]:
    """What compiled_between() found, by name: Triton kernels, other runtimes' kernels, FlashInfer
    modules ("FlashInfer:name") and DeepGEMM's compiler runs ("DeepGEMM:nvcc")."""
    return [*compiled["triton_jit"], *compiled.get("other_jit", {}),
            *(f"FlashInfer:{m}" for m in compiled.get("flashinfer_jit_builds", [])),
            *(["DeepGEMM:nvcc"] if compiled["deepgemm_nvcc_runs"] else [])]


def warm_problems(doc: dict) -> list[str]:
    """--require-warm: per step with the warm-up and side, why it was not warm from its first
    request (the goal missed, something compiled after the warm-up, no first request)."""
    return [problem for step, report in doc["steps"].items() if STEPS[step][1]
            for problem in start_problems(step, report, doc["goal_factor"])]


def start_problems(name: str, report: dict, goal_factor: float) -> list[str]:
    """Why one start with the warm-up (a run_step report) was not warm from its first request."""
    problems = [f"{name}: {report['error']}"] if "error" in report else []
    for side, r in report.get("sides", {}).items():
        if "first" not in r:
            problems.append(f"{name} {side}: no first request")
            continue
        if not r["goal_met"]:
            problems.append(f"{name} {side}: first request {r['first_over_warm']}x the warm latency, goal {goal_factor}x")
        if r["compiled_after_ready"]:
            problems.append(f"{name} {side}: compiled after the warm-up: {', '.join(r['compiled_after_ready'])}")
    return problems


def run_step(step: str, args, sides: dict[str, str], work_dir: Path, out_dir: Path,
             server_args: list[str] | None = None, prepare_home=None) -> dict:
    """One step, every side at once. `server_args` replaces harness_server_args(args);
    `prepare_home(side, home)` runs on each side's emptied HOME before its server starts."""
    empty_first, run_warmup = STEPS[step]
    homes = {side: work_dir / f"home-{side}" for side in sides}
    if empty_first:
        try:
            entries = serving.image_model_info({side: (sys.executable, site) for side, site in sides.items()},
                                               Path(args.model), serving.model_info_root(args, work_dir))
            for side in sides:
                model_info_cache.image_home(homes[side], entries[side])
                if prepare_home is not None:
                    prepare_home(side, homes[side])
        except model_info_cache.FILL_ERRORS as exc:
            return {"empty_caches_at_start": True, "warmup": run_warmup, "sides": {},
                    "error": f"the image's cold HOME: {type(exc).__name__}: {exc}"}
    server_args = harness_server_args(args) if server_args is None else server_args
    servers = [serving.start_server(f"{step}-{side}", site, args.model, args.port_base + i, str(out_dir),
                                    server_args, home=str(homes[side]), env_extra={
                                        "DG_JIT_PRINT_COMPILER_COMMAND": "1", "PYTHONUNBUFFERED": "1"})
               for i, (side, site) in enumerate(sides.items())]
    report: dict[str, Any] = {"empty_caches_at_start": empty_first, "warmup": run_warmup, "sides": {}}
    try:
        healthy = serving.wait_all_healthy(servers, time.monotonic() + args.timeout)
        token_ids = prompt_token_ids(args.model)
        for side, server in zip(sides, servers, strict=True):
            side_report = measure_side(server, step, run_warmup, token_ids, args.goal_factor)
            side_report["healthy_after_s"] = healthy[server["name"]]
            ready = healthy[server["name"]] + side_report.get("warmup", {}).get("seconds", 0.0)
            side_report["ready_after_s"] = round(ready, 1)
            report["sides"][side] = side_report
    except Exception as exc:  # noqa: BLE001 - recorded; the servers stop and the next step runs
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for server in servers:
            serving.stop(server)
    for side, server in zip(sides, servers, strict=True):
        report["sides"].setdefault(side, {})["server_log"] = os.path.basename(server["log"])
        report["sides"][side]["cache_mib"] = cache_sizes(homes[side])
        report["sides"][side]["deepgemm_log"] = deepgemm_lines(server["log"])
    return report


def summary_lines(doc: dict) -> list[str]:
    lines = []
    for step, report in doc["steps"].items():
        for side, r in report.get("sides", {}).items():
            if "first" not in r:
                continue
            compiled = r["compiled"]["during_first_request"]
            in_first = [name for name in compiled_names(compiled) if name != "DeepGEMM:nvcc"]
            # A warm start shows that its caches were found: no FlashInfer module built at start-up.
            built = r["compiled"]["before_healthy"].get("flashinfer_jit_builds", [])
            lines.append(f"{step:<12} {side:<8} healthy {r['healthy_after_s']:>6.1f} s  ready {r['ready_after_s']:>6.1f} s  "
                         f"first {r['first']['latency_s']:.3f} s  warm {r['warm_latency_s']:.3f} s  "
                         f"x{r['first_over_warm']:<6} goal {'met' if r['goal_met'] else 'MISSED'}  "
                         f"FlashInfer built at start: {built or '-'}  "
                         f"compiled in first: {in_first or '-'}"
                         f"{', DeepGEMM x%d' % compiled['deepgemm_nvcc_runs'] if compiled['deepgemm_nvcc_runs'] else ''}"
                         f"{new_length_line(r)}")
    return lines


def new_length_line(side: dict) -> str:
    probe = side.get("new_length")  # absent from records made before the probe
    if probe is None:
        return ""
    return (f"  new length {probe['tokens']}: first x{probe['first_over_warm']} its warm "
            f"({probe['first']['latency_s']:.3f} s / {probe['warm_latency_s']:.3f} s), compiled: {probe['compiled'] or '-'}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--stock-site")
    parser.add_argument("--overlay-site", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--work-dir", help="the servers' HOMEs, kept between steps and calls (default: OUT/work)")
    serving.add_model_info_root(parser)
    parser.add_argument("--steps", default="cold,warm-warmup", help=f"comma-separated, of: {', '.join(STEPS)}")
    parser.add_argument("--port-base", type=int, default=8400)
    parser.add_argument("--timeout", type=float, default=480, help="seconds for the servers to become healthy")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    parser.add_argument("--server-args", default="", help="more vllm serve arguments, one string")
    parser.add_argument("--goal-factor", type=float, default=GOAL_FACTOR,
                        help="the goal: the first request within this many times the median warm latency")
    parser.add_argument("--require-warm", action="store_true",
                        help="fail unless every step with the warm-up met the goal and compiled nothing after it")
    args = parser.parse_args(argv)
    unknown = [s for s in args.steps.split(",") if s not in STEPS]
    if unknown:
        parser.error(f"unknown steps {unknown}; known: {', '.join(STEPS)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out)
    work_dir = Path(args.work_dir or out_dir / "work")
    out_dir.mkdir(parents=True, exist_ok=True)
    # The image keeps vLLM's compile cache (~/.cache/vllm); a warm start means nothing without it
    # on vLLM 0.24.0. On 0.33.0 GLM-5 runs without torch.compile (its breakable CUDA graphs set
    # CompilationMode.NONE: config/vllm.py, _maybe_enable_breakable_cudagraph), so the variable
    # changes nothing there: FlashInfer's JIT cache is the one that saves most of a start.
    disabled = os.environ.pop("VLLM_DISABLE_COMPILE_CACHE", None)
    sides = {k: v for k, v in (("stock", args.stock_site), ("overlay", args.overlay_site)) if v}
    doc = {"first_prompt_tokens": FIRST_PROMPT_TOKENS, "max_tokens": MAX_TOKENS, "warm_requests": WARM_REQUESTS,
           "goal": f"first request <= {args.goal_factor}x the median warm latency", "goal_factor": args.goal_factor,
           "warmup_plan_8192": [s.name for s in warmup.plan_steps(8192)],
           "compile_cache_env_removed": disabled, "steps": {}}
    path = out_dir / "warmstart.json"
    for step in args.steps.split(","):
        doc["steps"][step] = run_step(step, args, sides, work_dir, out_dir)
        path.write_text(json.dumps(doc, indent=1) + "\n")
    print("\n".join(summary_lines(doc)))
    errors = {s: r["error"] for s, r in doc["steps"].items() if "error" in r}
    print(json.dumps({"errors": errors}) if errors else f"results: {path}")
    if args.require_warm:
        doc["warm_problems"] = problems = warm_problems(doc)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print("\n".join(problems))
        print("WARM START:", "FAIL" if problems else "PASS")
        return status.FAILED if errors or problems else status.SUCCESS
    return status.FAILED if errors else status.SUCCESS


if __name__ == "__main__":
    sys.exit(main())
