"""The GPU validation session: one base's phases on a lent GPU machine, several in one call.

The machine (an H200, or two) has no network; files reach it only with a device call, at most
64 MiB each (the repository and what the call carries); a call runs at most 10 minutes, and
/tmp lasts only while the machine stays warm (30 s after a call returns). So the staged wheels
arrive one part a call (`receive`), the last part's call goes on to install them, and each
call runs as many phases as its deadline allows:

    python3 scripts/gpu_validation.py [--vllm X.Y.Z] [options] PHASE [PHASE ...]
    python3 scripts/gpu_validation.py --vllm 0.33.0 receive sites realwidth-model

Each phase is a row of PHASES: what it needs first (checked when it is its turn: a missing
input refuses it, saying which phase makes it), what it does, the options it reads, and the
seconds it needs of the call (measured where the docs record it). A phase starts only while
that many seconds are left before --deadline-s (default 540, counted from the start: a call
ends well inside its 10 minutes); the phases not reached are reported, each with the seconds
it needed and those left. A harness still running at the deadline is interrupted (its
servers stop) and its phase fails. A failed setup phase (receive, install, prepare, sites,
realwidth-model) ends the session; a failed check leaves the next phases to run.

Everything a base installs or writes is named after it, under --work-root (default /tmp), so
two bases share a machine (`paths` prints them): stage-X.Y.Z, wheels-X.Y.Z, site-stock-X.Y.Z,
site-overlay-X.Y.Z, model-info-X.Y.Z, results-X.Y.Z (--results-dir) ...; the tiny GLM-5
(tiny-glm5) and GLM-5 at real width (glm5-realwidth) are written from the repository alone,
the same for every base. Results go to --out (default $OUT, which the device call sets): each
phase's summaries, PHASE-results.tgz, and a line per run in session.jsonl (each phase passed,
failed, refused or not reached).

Records made before this runner (docs/validation/*/, docs/benchmarks/*/) ran the bash script
scripts/h200_validation.sh, whose environment variables docs/validation/README.md maps to
these options.

Exit codes: --help lists them (EXIT_CODES).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsa_image.core import status
from dsa_image.core.recipe import RecipeError, load_recipe
from dsa_image.validation import phases as ph
from dsa_image.validation.runner import FAILED, INCOMPLETE, OK, REFUSED, Paths, Refused, Session, log

USAGE = status.USAGE
EXIT_CODES = status.epilog(
    (OK, "every phase ran and passed"), (FAILED, "a phase failed"),
    (USAGE, "usage: an unknown base or phase, an option a phase needs"),
    (REFUSED, "a phase was refused, its inputs missing (the message names the phase that makes them)"),
    (INCOMPLETE, "a phase was not reached before the deadline, or did not finish (upstream: test files left for "
                 "the next call)"),
    notes=(f"Of several, the first of {FAILED}, {REFUSED}, {INCOMPLETE}.",))
DEFAULT_DEADLINE_S = 540.0
# These GPUs are shared: NVLink multicast stays off in NCCL, PyTorch and NVSHMEM, and FlashInfer's
# all-reduce (vLLM 0.33.0's default, GLM-5's fused all-reduce + RMSNorm) takes its TRT-LLM
# workspace, which creates no multicast object (its MNNVL one calls cuMulticastCreate). The
# cluster phase sets its own per layout (dsa_image/validation/cluster_plan.py, ALLREDUCE_GUARD).
SESSION_ENV = {"PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
               "NVSHMEM_DISABLE_NVLS": "1", "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm",
               "VLLM_DISABLE_COMPILE_CACHE": "1"}
Step = Callable[[Session], int]
STATUS = {OK: "passed", FAILED: "failed", REFUSED: "refused", INCOMPLETE: "incomplete"}
REALWIDTH_MODES = ("long-fp8-mtp3", "long-mtp1")  # serving_modes.MODES past 32k with MTP, one a call


@dataclass(frozen=True)
class Phase:
    name: str
    needs: tuple[Callable[[Session], None], ...]  # each raises Refused, saying what is missing
    steps: tuple[Step, ...]  # in order; the phase fails when one does, and its results are collected
    knobs: tuple[str, ...]  # the options it reads
    seconds: Callable[[argparse.Namespace], float]  # what it needs of the deadline to start
    does: str
    setup: bool = False  # a failure ends the session
    collects: bool = True  # its results go to --out as PHASE-results.tgz


def _s(seconds: float) -> Callable[[argparse.Namespace], float]:
    return lambda opts: seconds


# Seconds a warm-start step took on the H200 (0.33.0, docs/validation/README.md: cold 242,
# warm 98, cold-warmup 268).
WARMSTART_S = {"cold": 250, "cold-warmup": 280, "warm": 110, "warm-warmup": 120}


def _warmstart_s(table: dict[str, int], default: str) -> Callable[[argparse.Namespace], float]:
    return lambda opts: sum(table[step] for step in (opts.warmstart_steps or default).split(","))


def _env(phase_steps: tuple[Step, ...]) -> tuple[Step, ...]:
    return (ph.environment, *phase_steps)


PHASES = {p.name: p for p in (
    Phase("paths", (), (ph.show_paths,), (), _s(0), "print the base and its paths; change nothing (no GPU)",
          collects=False),
    Phase("receive", (), (ph.receive,), (), _s(10),
          "move the parts this call carried into the stage, check each against SHA256SUMS, count them (no GPU)",
          setup=True, collects=False),
    Phase("inventory", (), _env((ph.inventory,)), (), _s(60),
          "record the H200's pip list, compare it with the record staging used, and check that the bundle and "
          "the H200 hold every pin of the base (exit 1 says what to stage); with the first part", collects=False),
    Phase("install", (ph.need_staged,), _env((ph.install, ph.probes, ph.model_infos)), (), _s(270),
          "reassemble the wheels, install stock, copy it and apply the overlay with our tool, verify, check "
          "the torch/CUDA libraries, write the tiny GLM-5; the indexer metadata probes on both; the model info",
          setup=True),
    Phase("prepare", (ph.need_staged,), _env((ph.install, ph.model_infos)), (), _s(230),
          "install without the probes (to serve on a fresh machine)", setup=True),
    Phase("sites", (ph.need_staged,), _env((ph.install,)), (), _s(160),
          "install alone: the two sites, verified, and the tiny GLM-5, no model info (a bench makes its own)",
          setup=True),
    Phase("upstream", (ph.need_sites, ph.need_upstream_bundle), _env((ph.upstream,)),
          ("upstream_bundle", "upstream_timeout_s", "upstream_deadline_s", "upstream_jobs",
           "upstream_shards"), _s(180),
          "vLLM's own tests that import an overlaid module (scripts/upstream_tests.py gate, docs/upstream-tests.md), "
          "each selected file on stock and on the overlay, two at once, compared test by test; a later call "
          f"resumes what is left (not finished: exit {INCOMPLETE})", collects=False),
    Phase("hosttime", (ph.need_model,), (ph.hosttime,), (), _s(60),
          "build() host time, stock and overlay interleaved in one process", collects=False),
    Phase("toolchain", (ph.need_model, ph.need_wheels), _env((ph.toolchain,)), (), _s(420),
          "the smoke test with the image's pip CUDA toolkit as the only toolkit"),
    Phase("serve", (ph.need_model,), _env((ph.serve,)), (), _s(320),
          "stock twice and the overlay once side by side, CUDA graphs on: tokens, JIT during inference"),
    Phase("smoke", (ph.need_sites,), _env((ph.smoke,)), ("smoke_args", "smoke_label"), _s(400),
          "the smoke test's local runtime against the overlay, CUDA graphs on"),
    Phase("mtp", (ph.need_model,), _env((ph.tiny_modes("mtp", "mtp-paths"),)), ("modes_timeout_s",), _s(290),
          "stock vs overlay with MTP on both of the base's indexer decode paths, native and flattened"),
    Phase("longctx", (ph.need_model,), _env((ph.tiny_modes("longctx", "long-bf16,long-fp8"),)),
          ("modes_timeout_s",), _s(220), "stock vs overlay at max_model_len 65536, prompts of 20k-65k, bf16 and fp8"),
    Phase("deploy", (ph.need_model,), _env((ph.tiny_modes("deploy", "fp8,long-fp8-mtp3"),)), ("modes_timeout_s",),
          _s(290), "stock vs overlay: fp8 KV at 8k, and 65536 + fp8 KV + MTP 3 together"),
    Phase("warmstart", (ph.need_model,), _env((ph.tiny_warmstart,)), ("warmstart_steps",),
          _warmstart_s(WARMSTART_S, "cold,warm-warmup"),
          "start-to-healthy with empty / warm caches, the first 3,000-token request with and without the warm-up"),
    Phase("startup", (ph.need_model,), _env((ph.startup,)), (), _s(570),
          "start-up before/after the image's precompiled FlashInfer modules and start-up defaults (cold and "
          "restart), the overlay alone, one server at a time: per-phase tables, nothing compiled after ready"),
    Phase("bench", (ph.need_model, ph.need_bench_builds), _env((ph.tiny_bench,)),
          ("bench_a", "bench_b", "bench_args", "bench_label", "bench_deadline_s"), _s(400),
          "the paired benchmark (scripts/bench.py run) of this base's stock and overlay, or of two builds"),
    Phase("b12x", (ph.need_model,), _env((ph.b12x,)), (), _s(130),
          "the overlay's b12x path with b12x's kernels emulated: exactness, cross-checks, the workspace"),
    Phase("selftest", (ph.need_sites,), _env((ph.selftest,)), (), _s(130),
          "dsa_image.runtime.selftest with this GPU's kernels, its refusal of b12x here and a broken kernel "
          f"({OK}, {REFUSED}, {FAILED})"),
    Phase("b12xserve", (ph.need_model,), _env((ph.b12xserve,)), (), _s(320),
          "the tiny GLM-5 served on the emulated b12x path beside stock, CUDA graphs on"),
    Phase("cluster", (ph.need_cluster,), _env((ph.cluster,)), ("cluster_layouts", "cluster_args",
                                                               "cluster_deadline_s"), _s(300),
          "stock vs overlay on both GPUs per layout wave (health, Ray nodes, tokens), then the comparison",
          collects=False),
    Phase("realwidth-model", (ph.need_sites,), (ph.realwidth_prepare,), (), _s(120),
          "write GLM-5 at real width, 4 layers (dsa_image/build/realwidth_model.py), and its model info per side",
          setup=True),
    Phase("realwidth-equiv", (ph.need_sites,), _env((ph.realwidth_equiv,)), ("realwidth_modes", "modes_timeout_s"),
          _s(420), "GLM-5 at real width, stock vs overlay past 32k tokens with MTP (long-fp8-mtp3: fp8_ds_mla and "
          "3 tokens; long-mtp1: bf16 and 1 token), one mode a call; the memory plan against vLLM's numbers"),
    Phase("realwidth-startup", (ph.need_sites,), _env((ph.realwidth_startup,)), (), _s(420),
          "GLM-5 at real width, the image's start-up (precompiled FlashInfer, the recipe's start-up defaults, the "
          "warm-up) from empty caches and on a restart, the overlay alone: per-phase tables; nothing compiles "
          "after ready, the first 3,000-token request within 1.2x the warm ones; the memory plan against vLLM's "
          "numbers"),
    Phase("realwidth-bench", (ph.need_sites, ph.need_bench_builds), _env((ph.realwidth_bench,)),
          ("bench_a", "bench_b", "bench_args", "bench_label", "bench_deadline_s"), _s(420),
          "the paired benchmark at real width: stock vs overlay, or two bases (--bench-a/--bench-b); the "
          "memory plan against vLLM's numbers"),
)}


def phase_table() -> str:
    """--help's table: each phase, what it needs first, the options it reads, what it does."""
    rows = []
    for p in PHASES.values():
        needs = ", ".join(n.__name__.removeprefix("need_").replace("_", " ") for n in p.needs) or "-"
        knobs = ", ".join(f"--{k.replace('_', '-')}" for k in p.knobs) or "-"
        rows.append(f"  {p.name:<20} needs: {needs}; options: {knobs}; starts with {p.seconds(DEFAULTS):.0f} s left\n"
                    + textwrap.fill(p.does, 100, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "phases:\n" + "\n".join(rows)


DEFAULTS = argparse.Namespace(warmstart_steps=None)  # the seconds --help shows: the default steps


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_validation.py", description=__doc__.splitlines()[0],
                                     epilog=phase_table() + "\n" + EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phases", nargs="+", metavar="PHASE", help="one or more phases, run in the order given")
    parser.add_argument("--vllm", help="the base: one of the recipe's vLLM releases (default: its default)")
    parser.add_argument("--work-root", type=Path, default=Path("/tmp"), help="where every base keeps its things")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/out"),
                        help="where the results go (default: $OUT, which the device call sets, else /tmp/out)")
    parser.add_argument("--results-dir", type=Path, help="the base's results (default: WORK_ROOT/results-X.Y.Z)")
    parser.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S,
                        help="seconds from the start after which no phase starts, and a running harness stops")
    knobs = parser.add_argument_group("phase options")
    knobs.add_argument("--smoke-args", default="", help="smoke.py's layout flags, one string")
    knobs.add_argument("--smoke-label", default="smoke", help="names the smoke results")
    knobs.add_argument("--modes-timeout-s", type=float, default=480, help="for the mode servers to be healthy")
    knobs.add_argument("--warmstart-steps", help="comma-separated of cold, warm-warmup, cold-warmup, warm "
                       "(default: cold,warm-warmup)")
    knobs.add_argument("--bench-a", help="build A: stock-X.Y.Z or overlay-X.Y.Z of a base installed here")
    knobs.add_argument("--bench-b", help="build B, the same (the same build twice: the A/A control)")
    knobs.add_argument("--bench-args", default="", help="bench.py run's workloads and round counts, one string, "
                       "last on its command line (realwidth-bench: default --workloads base)")
    knobs.add_argument("--bench-label", help="names the results (default: bench, realwidth-bench)")
    knobs.add_argument("--bench-deadline-s", type=float, default=520, help="the benchmark's own deadline")
    knobs.add_argument("--cluster-layouts", help='waves of layouts, e.g. "mp-tp2+ray1-tp2" (the cluster phase)')
    knobs.add_argument("--cluster-args", default="", help="more options of `cluster run`, one string")
    knobs.add_argument("--cluster-deadline-s", type=float, default=540, help="bounds the cluster phase")
    knobs.add_argument("--upstream-bundle", type=Path, help="what `upstream_tests.py bundle` made here and the call "
                       "carried (default: the repository's build/upstream-tests-X.Y.Z)")
    knobs.add_argument("--upstream-timeout-s", type=float, default=420, help="seconds per run (part) of a test file on a "
                       "side; a file it cuts short goes on in parts")
    knobs.add_argument("--upstream-deadline-s", type=float, default=120, help="no test file or part starts after this")
    knobs.add_argument("--upstream-jobs", type=int, default=2, help="test-file runs at once on the one GPU (2: a "
                       "file's stock and overlay runs together; 6: three files at once)")
    knobs.add_argument("--upstream-shards", type=int, default=1, help="pytest processes each of those runs is split "
                       "into, a share of the file's tests each (a file begun in N resumes in N)")
    knobs.add_argument("--realwidth-modes", default=REALWIDTH_MODES[0],
                       help=f"realwidth-equiv's serving mode, one of {', '.join(REALWIDTH_MODES)} (two servers each)")
    opts = parser.parse_args(argv)
    unknown = [p for p in opts.phases if p not in PHASES]
    if unknown:
        parser.error(f"unknown phases {unknown}; known: {', '.join(PHASES)}")
    if "cluster" in opts.phases and not opts.cluster_layouts:
        parser.error('cluster: expected --cluster-layouts, e.g. "mp-tp2+ray1-tp2" or '
                     '"ray2-tp2+ray2-tp2@shared ray2-pp2+mp-pp2"; python3 -m dsa_image.validation.cluster plan '
                     "--layouts ... prints what each starts")
    if opts.realwidth_modes not in REALWIDTH_MODES:
        parser.error(f"--realwidth-modes {opts.realwidth_modes}: expected one of {', '.join(REALWIDTH_MODES)} "
                     "(one mode a call: two servers of GLM-5 at real width with its MTP layer, 43 GiB each, fill "
                     "an H200)")
    if "realwidth-bench" in opts.phases and not opts.bench_args:
        opts.bench_args = "--workloads base"
    return opts


def base_paths(opts: argparse.Namespace) -> Paths:
    """The base --vllm names (the recipe's default without it), refused unless the recipe pins it."""
    try:
        recipe = load_recipe(vllm=opts.vllm)
    except RecipeError:
        bases = " ".join(load_recipe().vllm_versions)
        raise SystemExit(f"--vllm {opts.vllm}: expected one of the recipe's bases: {bases}") from None
    return Paths.of(recipe.vllm_version, opts.work_root, opts.out, opts.results_dir)


def run_phase(s: Session, phase: Phase) -> tuple[int, str]:
    """(status, what happened) of one phase whose turn it is."""
    try:
        for need in phase.needs:
            need(s)
    except Refused as exc:
        return REFUSED, str(exc)
    status = OK
    try:
        for step in phase.steps:
            done = step(s)
            if done == INCOMPLETE and status == OK:
                status = INCOMPLETE
            elif done and done != INCOMPLETE:
                status = FAILED
                if step is ph.install:  # nothing after it has a site to run on
                    break
    except Refused as exc:
        return REFUSED, str(exc)
    finally:
        if phase.collects:
            ph.collect(s, phase.name)
    return status, STATUS[status]


def run(opts: argparse.Namespace, paths: Paths) -> int:
    s, started = Session(opts, paths), time.monotonic()
    os.environ.update(SESSION_ENV)
    paths.results.mkdir(parents=True, exist_ok=True)
    paths.out.mkdir(parents=True, exist_ok=True)
    record, ended = [], None
    for name in opts.phases:
        phase, needed, left = PHASES[name], PHASES[name].seconds(opts), s.left()
        if ended or needed > left:
            why = ended or f"needs {needed:.0f} s, {left:.0f} s were left before the deadline"
            ended = ended or f"after {name}, not reached"
            record.append({"phase": name, "status": "not reached", "detail": why})
            continue
        log(f"== {name}: {phase.does}")
        t0 = time.monotonic()
        status, detail = run_phase(s, phase)
        record.append({"phase": name, "status": STATUS[status],
                       "seconds": round(time.monotonic() - t0, 1), "detail": detail})
        if status == REFUSED:
            print(f"{name}: refused: {detail}", file=sys.stderr)
        if status != OK and phase.setup:
            ended = f"after {name} {record[-1]['status']}"
    return report(opts, paths, record, time.monotonic() - started)


def report(opts: argparse.Namespace, paths: Paths, record: list[dict], seconds: float) -> int:
    print(f"session of vLLM {paths.vllm}, {seconds:.0f} s of a {opts.deadline_s:.0f} s deadline:")
    for r in record:
        took = f" in {r['seconds']} s" if "seconds" in r else ""
        detail = "" if r["detail"] == r["status"] else f": {r['detail']}"
        print(f"  {r['phase']:<20} {r['status']}{took}{detail}")
    line = {"at": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%dT%H:%M:%SZ}", "vllm": paths.vllm,
            "deadline_s": opts.deadline_s, "seconds": round(seconds, 1), "phases": record}
    with (paths.out / "session.jsonl").open("a") as f:
        f.write(json.dumps(line) + "\n")
    statuses = {r["status"] for r in record}
    for said, code in (("failed", FAILED), ("refused", REFUSED), ("not reached", INCOMPLETE),
                       ("incomplete", INCOMPLETE)):
        if said in statuses:
            return code
    return OK


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    try:
        paths = base_paths(opts)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return USAGE
    if set(opts.phases) == {"paths"}:  # changes nothing, not even --out
        return ph.show_paths(Session(opts, paths))
    return run(opts, paths)
