"""Start-up time before and after the image's precompiled artefacts and start-up defaults.

One GPU, the overlay's site, one server at a time, the image's warm-up on (what `docker run`
does), up to four starts (--starts names them; all by default):

    before-cold     today's image: the built-in model with the entrypoint's flags as they were,
                    from a HOME as the image's first `docker run` has it (no compile cache, the
                    model info it ships); meanwhile `dsa_image.build.precompile build` compiles
                    FlashInfer's modules for this GPU into the after-HOME (CPU only, the
                    Dockerfile's precompile stage)
    after-cold      that HOME: the precompiled modules and the recipe's default_model_args
    before-restart  before's HOME again (a restart with the cache volume)
    after-restart   after's HOME again

Each start records what dsa_image.validation.warmstart does (healthy, the warm-up's steps, the
first 3,000-token request against five warm ones, what compiled before healthy, during the
warm-up and after it) and its per-phase table (startup_phases). The after-cold start must build
no FlashInfer module, and the manifest's check must still pass after it (the start used the
precompiled library as it was). About 9 minutes on the H200, bounded by --budget-s.

    python -m dsa_image.validation.startup --model DIR --site SITE --out DIR \\
        [--work-dir DIR] [--model-info-root DIR] [--cuda-arch 9.0] [--target sm90] [--vllm X.Y.Z]

Stdlib only (the precompile build and check run FlashInfer in child processes).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dsa_image.runtime import entrypoint
from dsa_image.build import precompile
from dsa_image.core import status
from dsa_image.core.recipe import load_recipe
from dsa_image.harness import server as serving
from dsa_image.validation import startup_phases, warmstart

# Flags serving.start_server gives every server itself (the recipe's values for them).
GIVEN_BY_HARNESS = ("--load-format", "--served-model-name", "--max-model-len", "--port")
# name: (variant, warmstart step), in the order they run.
STARTS = {"before-cold": ("before", "cold-warmup"), "after-cold": ("after", "cold-warmup"),
          "before-restart": ("before", "warm-warmup"), "after-restart": ("after", "warm-warmup")}
MANIFEST = "precompiled.json"
MIN_START_S = 100  # a start needs this much of the budget left: a restart took 74 s, its requests ~6 s


def image_flags(target: str, vllm: str | None) -> dict[str, list[str]]:
    """The flags the image's no-argument `docker run` gives vLLM beyond the harness's own:
    "after" as the entrypoint plans it now, "before" without the recipe's default_model_args."""
    recipe = load_recipe(vllm=vllm)
    plan = entrypoint.plan_serve([], recipe, recipe.target(target), {})
    argv, after = plan.argv[3:], []  # past "vllm serve MODEL"
    while argv:
        flag, value, argv = argv[0], argv[1], argv[2:]
        if flag not in GIVEN_BY_HARNESS:
            after += [flag, value]
    added = [str(a) for a in recipe.serving.get("default_model_args", [])]
    if after[:len(added)] != added:  # default_model_argv puts them first, after the model's own
        raise ValueError(f"the image's flags {after} do not start with the recipe's default_model_args {added}")
    return {"before": after[len(added):], "after": after}


def _tool_env(args, home: Path) -> dict[str, str]:
    """The environment `home`'s server has, with this repository importable (dsa_image)."""
    env = serving.server_env(args.site, str(home))
    return {**env, "PYTHONPATH": f"{precompile.tool_root()}:{env['PYTHONPATH']}"}


def _precompile(args, home: Path, manifest: Path) -> subprocess.Popen:
    """`precompile build` into `home`'s cache, as the Dockerfile's precompile stage runs it."""
    log = open(Path(args.out) / "precompile-build.log", "w")
    return subprocess.Popen([sys.executable, "-m", "dsa_image.build.precompile", "build", "--cuda-arch", args.cuda_arch,
                             "--workspace-base", str(home), "--manifest", str(manifest)],
                            env=_tool_env(args, home), stdout=log, stderr=subprocess.STDOUT, cwd="/tmp")


def _check(args, home: Path, manifest: Path) -> dict:
    result = subprocess.run([sys.executable, "-m", "dsa_image.build.precompile", "check", "--manifest", str(manifest)],
                            env=_tool_env(args, home), capture_output=True, text=True, cwd="/tmp")
    return {"exit": result.returncode, "output": (result.stdout + result.stderr).strip()[-2000:]}


# Where the API server's import goes, in a server's environment: the seconds to import torch,
# then vLLM's serving entry points, then its plugins (what the process does before its banner).
IMPORT_PROBE = """import json, time
t = time.monotonic(); import torch; a = time.monotonic()
import vllm.entrypoints.cli.main, vllm.entrypoints.openai.api_server; b = time.monotonic()
from vllm.plugins import load_general_plugins; load_general_plugins(); c = time.monotonic()
print(json.dumps({"torch_s": round(a - t, 2), "vllm_api_s": round(b - a, 2), "plugins_s": round(c - b, 2)}))"""


def import_probe(args, home: Path) -> dict:
    try:
        result = subprocess.run([sys.executable, "-c", IMPORT_PROBE], env=serving.server_env(args.site, str(home)),
                                capture_output=True, text=True, cwd=str(home), timeout=MIN_START_S - 10)
    except subprocess.TimeoutExpired:
        return {"error": f"the import took over {MIN_START_S - 10} s"}
    if result.returncode != 0:
        return {"error": (result.stdout + result.stderr)[-1000:]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_start(variant: str, step: str, args, flags: dict, prepare_home=None) -> dict:
    """One start of one variant through warmstart.run_step, its HOME in WORK/variant."""
    out = Path(args.out) / variant
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report = warmstart.run_step(step, args, {"overlay": args.site}, Path(args.work_dir) / variant, out,
                                server_args=[*flags[variant], "--jit-monitor-verbose"], prepare_home=prepare_home)
    report["flags"], report["wall_s"] = flags[variant], round(time.monotonic() - started, 1)
    side = report["sides"].get("overlay", {})
    if "healthy_after_s" in side:
        record = startup_phases.Record(side["healthy_after_s"], side.get("warmup", {}).get("steps", {}))
        try:
            report["phases"] = startup_phases.phases((out / side["server_log"]).read_text(errors="replace"), record)
        except ValueError as exc:  # a log without vLLM's lines: the start's other results still count
            report["phases_error"] = str(exc)
    return report


def run(args) -> dict:
    """The starts in order (--starts), the document rewritten after each. The precompile build
    runs into the after-HOME while the first start runs; its cache is kept aside while run_step
    empties that HOME for the cold start (as the image's first `docker run` has it), then put back."""
    flags = image_flags(args.target, args.vllm)
    work, out = Path(args.work_dir), Path(args.out)
    after_home, manifest, kept = work / "after" / "home-overlay", work / "after" / MANIFEST, work / "after" / "flashinfer"
    for stale in (after_home, kept):
        shutil.rmtree(stale, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"flags": flags, "cuda_arch": args.cuda_arch, "starts": {}}
    build = _precompile(args, after_home, manifest) if "after-cold" in args.starts else None
    end = time.monotonic() + args.budget_s
    for name in args.starts:
        variant, step = STARTS[name]
        prepare = None
        if build is not None and name == "after-cold":
            doc["precompile_build"] = {"exit": build.wait(), "log": "precompile-build.log"}
            if doc["precompile_build"]["exit"] != 0:
                doc["starts"][name] = {"error": "the precompile build failed; see precompile-build.log"}
                continue
            (after_home / ".cache" / "flashinfer").rename(kept)
            prepare = lambda side, home: kept.rename(home / ".cache" / "flashinfer")  # noqa: E731
        left = end - time.monotonic()
        if left < MIN_START_S:
            doc["starts"][name] = {"error": f"not started: {left:.0f} s of the {args.budget_s:.0f} s budget left"}
            continue
        args.timeout = min(args.health_timeout, left - 30)  # every start ends within the budget
        doc["starts"][name] = run_start(variant, step, args, flags, prepare)
        if variant == "after":
            doc["starts"][name]["precompile_check"] = _check(args, after_home, manifest)
        (out / "startup.json").write_text(json.dumps(doc, indent=1) + "\n")
    if build is not None:
        build.wait()
    if end - time.monotonic() > MIN_START_S:  # after the starts: it must not share the machine with one
        first_variant = STARTS[args.starts[0]][0]
        doc["import_probe"] = import_probe(args, work / first_variant / "home-overlay")
        (out / "startup.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def summary(doc: dict) -> list[str]:
    lines = []
    for name, start in doc["starts"].items():
        side = start.get("sides", {}).get("overlay", {})
        if "phases" not in start:
            lines.append(f"{name:<15} {start.get('error') or start.get('phases_error', 'no result')}")
            continue
        compiled = side["compiled"]
        after_ready = [k for part in ("during_first_request", "during_warm_requests")
                       for k in (*compiled[part]["triton_jit"], *compiled[part]["other_jit"],
                                 *compiled[part]["flashinfer_jit_builds"],
                                 *["DeepGEMM"] * compiled[part]["deepgemm_nvcc_runs"])]
        built = compiled["before_healthy"]["flashinfer_jit_builds"]
        lines.append(f"{name:<15} healthy {start['phases']['healthy_s']:6.1f} s  ready {start['phases']['ready_s']:6.1f} s  "
                     f"first/warm x{side['first_over_warm']}  FlashInfer built: {built or '-'}  "
                     f"compiled after ready: {after_ready or '-'}  check: {start.get('precompile_check', {}).get('exit', '-')}"
                     f"{warmstart.new_length_line(side)}")
    return lines


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--site", required=True, help="the overlay's site-packages (the image's vLLM)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--work-dir", help="the HOMEs, one per variant (default: OUT/work)")
    serving.add_model_info_root(parser)
    parser.add_argument("--target", default="sm90", help="the image target whose defaults are measured")
    parser.add_argument("--vllm", help="the recipe's base (default: its default)")
    parser.add_argument("--cuda-arch", default="9.0", help="this GPU's capability, for the precompile build")
    parser.add_argument("--port-base", type=int, default=8500)
    parser.add_argument("--health-timeout", type=float, default=420, help="seconds for a server to become healthy")
    parser.add_argument("--goal-factor", type=float, default=2.0,
                        help="the first 3,000-token request within this many times the warm latency (issue 27: 2)")
    parser.add_argument("--budget-s", type=float, default=560,
                        help="every start ends within this many seconds of the first (a device call has 600)")
    parser.add_argument("--starts", default=",".join(STARTS),
                        help=f"comma-separated, run in this order, of: {', '.join(STARTS)} (default: all)")
    parser.add_argument("--require-warm", action="store_true",
                        help="fail unless every start met the goal and compiled nothing after ready")
    args = parser.parse_args(argv)
    args.starts = args.starts.split(",")
    if unknown := [name for name in args.starts if name not in STARTS]:
        parser.error(f"--starts: unknown {unknown}; known: {', '.join(STARTS)}")
    for name in args.starts:  # a restart reuses the HOME its variant's cold start left
        variant, step = STARTS[name]
        if step == "warm-warmup" and f"{variant}-cold" not in args.starts[:args.starts.index(name)]:
            parser.error(f"--starts: {name} needs {variant}-cold before it (the HOME a restart reuses)")
    args.work_dir = str(Path(args.work_dir or Path(args.out) / "work").resolve())
    args.model_info_root = args.model_info_root or str(Path(args.work_dir) / "model-info")  # both variants
    args.timeout = args.health_timeout  # what warmstart.run_step reads
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    doc = run(args)
    print("\n".join(summary(doc)))
    tables = {name: s["phases"] for name, s in doc["starts"].items() if "phases" in s}
    if tables:
        (Path(args.out) / "startup-phases.md").write_text(
            "\n\n".join(startup_phases.markdown(n, t) for n, t in tables.items())
            + "\n\n" + startup_phases.comparison(tables) + "\n")
    errors = {n: s["error"] for n, s in doc["starts"].items() if "error" in s}
    print(json.dumps({"errors": errors}) if errors else f"results: {Path(args.out) / 'startup.json'}")
    if args.require_warm:
        doc["warm_problems"] = problems = [p for name, start in doc["starts"].items()
                                           for p in warmstart.start_problems(name, start, args.goal_factor)]
        (Path(args.out) / "startup.json").write_text(json.dumps(doc, indent=1) + "\n")
        print("\n".join(problems))
        print("WARM START:", "FAIL" if problems else "PASS")
        return status.FAILED if errors or problems else status.SUCCESS
    return status.FAILED if errors else status.SUCCESS


if __name__ == "__main__":
    sys.exit(main())
