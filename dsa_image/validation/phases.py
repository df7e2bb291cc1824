"""What each phase of a GPU validation session needs and does (the table: session.py).

Each step returns 0 or an exit status (a failure); one that raises runner.Refused leaves its
phase refused, saying what is missing and which phase makes it. Stdlib only.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Callable

from dsa_image.build import realwidth_model, tiny_model
from dsa_image.core.recipe import load_recipe
from dsa_image.harness import server as serving
from dsa_image.validation import dist_copy, stage
from dsa_image.validation.runner import FAILED, OK, REFUSED, Paths, Refused, Session, copy_out, log, matching, tail

# GLM-5 at real width (about 24 GiB of bf16 weights; 43 GiB with the MTP layer, whose two servers
# need an H200): two servers side by side on one GPU, each with a fixed KV cache of 4 GiB (836,224
# tokens without MTP, far more than any workload holds), the image's own default: with 8 GiB each,
# vLLM 0.24.0's server ran out of memory beside 0.33.0's on an 80 GB H100 (run 12). The
# utilisation only passes vLLM's start-up check of free memory with two servers starting together;
# VLLM_DEBUG_WORKSPACE=1 logs the workspaces that check takes off loading memory (memory_check.py).
REALWIDTH_SERVERS = ("--kv-cache-memory-bytes", str(4 << 30), "--gpu-memory-utilization", "0.4")
REALWIDTH_ENV = {"VLLM_DEBUG_WORKSPACE": "1"}
# The image's start (cold and restart), the first 3,000-token request within 1.2x the warm ones,
# nothing compiled after the warm-up (issue 26).
REALWIDTH_STARTUP = ("--starts", "after-cold,after-restart", "--goal-factor", "1.2", "--require-warm")
BENCH_STOP_S, BENCH_KEEP_S = 30.0, 5.0  # a benchmark's time to stop after its deadline; then collecting


# -- what a phase needs -----------------------------------------------------------------------------


def parts_here(p: Paths) -> tuple[int, int]:
    sums = p.stage / "SHA256SUMS"
    total = sum("bundle.tar.part" in line for line in sums.read_text().splitlines()) if sums.is_file() else 0
    return len(list(p.stage.glob("bundle.tar.part*"))), total


def need_staged(s: Session) -> None:
    p = s.paths
    here, total = parts_here(p)
    if (p.wheels / ".complete").is_file() or (total and here == total):
        return
    raise Refused(f"expected every part of `python3 scripts/stage_h200_wheels.py --vllm {p.vllm}` in {p.stage} "
                  f"(SHA256SUMS and selection.txt with them; {here} of {total or '?'} parts here) or the unpacked "
                  f"wheels in {p.wheels}; carry the missing ones (the receive phase)")


def need_sites(s: Session) -> None:
    p = s.paths
    missing = [f for f in (p.site_stock / "vllm" / "__init__.py", p.site_overlay / "vllm_overlay_receipt.json")
               if not f.exists()]
    if missing:
        raise Refused(f"expected stock vLLM {p.vllm} in {p.site_stock} and the overlaid copy in {p.site_overlay}; "
                      f"missing: {', '.join(map(str, missing))}; run the install, prepare or sites phase first")


def need_model(s: Session) -> None:
    need_sites(s)
    if not (s.paths.model / "config.json").is_file():
        raise Refused(f"expected the tiny GLM-5 in {s.paths.model}; run the install, prepare or sites phase first")


def need_wheels(s: Session) -> None:
    if not (s.paths.wheels / ".complete").is_file():
        raise Refused(f"expected the unpacked wheels in {s.paths.wheels}; run the install phase first")


def upstream_bundle(s: Session) -> Path:
    return s.opts.upstream_bundle or s.paths.repo / "build" / f"upstream-tests-{s.paths.vllm}"


def need_upstream_bundle(s: Session) -> None:
    bundle = upstream_bundle(s)
    if not bundle.is_dir():
        raise Refused(f"upstream: expected the bundle {bundle}: make it here with `python3 scripts/upstream_tests.py "
                      f"bundle --vllm {s.paths.vllm} --python-version 3.12 --out build/upstream-tests-{s.paths.vllm}` "
                      "and carry it with the call (docs/upstream-tests.md)")


def need_bench_builds(s: Session) -> None:
    bench_builds(s)


def need_cluster(s: Session) -> None:
    p = s.paths
    missing = [str(f) for f in (p.site_stock / "vllm" / "__init__.py", p.site_stock / "ray" / "__init__.py",
                                p.site_overlay / "vllm_overlay_receipt.json", p.site_overlay / "ray" / "__init__.py",
                                p.model / "config.json") if not f.exists()]
    if missing:
        raise Refused(f"cluster: expected stock vLLM {p.vllm} and Ray in {p.site_stock}, the overlaid copy in "
                      f"{p.site_overlay} and the tiny GLM-5 in {p.model}; missing: {' '.join(missing)}; run the "
                      "prepare phase first (its staged wheels must hold Ray, the recipe's [cluster] pin)")


BUILD = re.compile(r"(stock|overlay)-\d+\.\d+\.\d+")


def bench_builds(s: Session) -> list[str]:
    """bench.py's build arguments: this base's stock (A) and overlay (B), or --bench-a/--bench-b,
    each stock-X.Y.Z or overlay-X.Y.Z of a base installed here; the same build twice is the A/A
    control, B then named BUILD-control."""
    p, o = s.paths, s.opts
    if not (o.bench_a or o.bench_b):
        return ["--a-site", str(p.site_stock), "--b-site", str(p.site_overlay),
                "--a-name", "stock", "--b-name", "overlay"]
    builds = {"a": o.bench_a or f"stock-{p.vllm}", "b": o.bench_b or f"overlay-{p.vllm}"}
    args = []
    for side, build in builds.items():
        if not BUILD.fullmatch(build) or not (p.site(build) / "vllm" / "__init__.py").exists():
            raise Refused(f"bench: --bench-{side} {build}: expected stock-X.Y.Z or overlay-X.Y.Z of a base installed "
                          f"here, with vLLM in {p.site(build)}; run `python3 scripts/gpu_validation.py --vllm X.Y.Z "
                          "sites` (or prepare) first")
        name = f"{build}-control" if side == "b" and build == builds["a"] else build
        args += [f"--{side}-site", str(p.site(build)), f"--{side}-name", name]
    return args


# -- the steps phases are made of -------------------------------------------------------------------
# Each returns 0 or an exit status (a failure); one that raises Refused leaves the phase refused.


def show_paths(s: Session) -> int:
    print("\n".join(f"{k}={v}" for k, v in s.paths.shown().items()))
    return OK


def environment(s: Session) -> int:
    p, lines = s.paths, [f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%dT%H:%M:%SZ}"]
    try:
        lines.append(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
                                     "--format=csv,noheader"], capture_output=True, text=True).stdout.rstrip())
    except OSError as exc:
        lines.append(f"nvidia-smi: {exc}")
    lines.append(f"vLLM base {p.vllm}; sites {p.site_stock}, {p.site_overlay}")
    # What the runs import: the stock site first on PYTHONPATH (its torch, where it has one).
    snippet = ("import sys, torch, triton\nprint(sys.version.split()[0], 'torch', torch.__version__, "
               "'triton', triton.__version__, 'torch from', torch.__file__)")
    done = subprocess.run([sys.executable, "-c", snippet], cwd="/tmp", capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(p.site_stock)})
    lines.append((done.stdout + done.stderr).rstrip())
    # The device's copy of the repository carries no reliable git state: name the overlay by its
    # manifest (which hashes every overlaid file).
    digest = hashlib.sha256(p.manifest.read_bytes()).hexdigest() if p.manifest.is_file() else f"missing: {p.manifest}"
    lines.append(f"overlay manifest sha256 {digest}")
    lines.append(f"settings: {' '.join(serving.settings_set(os.environ)) or 'none'}")
    (p.results / "environment.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return OK


def inventory(s: Session) -> int:
    """The H200's own packages (its venv, no site on the path), and what they mean for this base."""
    p = s.paths
    log(f"inventory: the H200's Python against vLLM {p.vllm}'s locks and the staged bundle")
    freeze = p.results / "h200-pip-freeze.txt"
    if s.python("-m", "pip", "list", "--format=freeze", log_path=freeze, unset=("PYTHONPATH",)):
        return FAILED
    copy_out(freeze, p.out / freeze.name)
    copy_out(p.results / "environment.txt", p.out / "environment.txt")
    staged = ["--staged", p.stage / "selection.txt"] if (p.stage / "selection.txt").is_file() else []
    report = p.results / "inventory.txt"
    status = s.repo_python("dsa_image.validation.stage", "--vllm", p.vllm, "--check-freeze", freeze, *staged,
                           log_path=report, echo=True)
    copy_out(report, p.out / report.name)
    return status


def receive(s: Session) -> int:
    """What this call carried (.stage/vllm-X.Y.Z/ of the device's copy of the repository) moves to
    the stage directory: moved, not copied, so a part is not copied again by every later call.
    Only what arrived is hashed (hashing every part so far made the transfer quadratic: 3 s a
    call by part 45); the install phase checks the whole bundle."""
    p = s.paths
    carried, arrived = p.repo / ".stage" / f"vllm-{p.vllm}", []
    p.stage.mkdir(parents=True, exist_ok=True)
    for part in sorted(carried.glob("*")) if carried.is_dir() else []:
        shutil.move(str(part), p.stage / part.name)
        arrived.append(part.name)
    sums = p.stage / "SHA256SUMS"
    if not sums.is_file():
        print(f"receive: expected {sums}; carry .stage/vllm-{p.vllm}/SHA256SUMS and selection.txt (with the "
              "first part)", file=sys.stderr)
        return FAILED
    listed = {name: digest for digest, name in (line.split("  ", 1) for line in sums.read_text().splitlines()
                                                 if "  " in line)}
    damaged = [name for name in arrived if name in listed
               and hashlib.sha256((p.stage / name).read_bytes()).hexdigest() != listed[name]]
    for name in damaged:
        print(f"{name}: FAILED")
    if damaged:
        print("receive: a part differs from SHA256SUMS (above); carry it again", file=sys.stderr)
        return FAILED
    here, total = parts_here(p)
    log(f"received: {here} of {total} parts in {p.stage}")
    return OK


def unpack(s: Session) -> int:
    """The parts, then the bundle, are removed once used: a 4 GB bundle is on disk once at a
    time. A second install of the same base on this machine reuses the unpacked wheels."""
    p = s.paths
    if (p.wheels / ".complete").is_file():
        return OK
    log(f"reassembling the staged wheels in {p.stage}")
    bundle = p.stage / "bundle.tar"
    with bundle.open("wb") as whole:
        for part in sorted(p.stage.glob("bundle.tar.part*")):
            with part.open("rb") as piece:
                shutil.copyfileobj(piece, whole, 16 << 20)
    if s.run(["sha256sum", "-c", "SHA256SUMS"], cwd=str(p.stage)):
        print(f"expected every part of `python3 scripts/stage_h200_wheels.py --vllm {p.vllm}` in {p.stage} "
              "(SHA256SUMS and selection.txt with them); carry the missing ones", file=sys.stderr)
        return FAILED
    for part in p.stage.glob("bundle.tar.part*"):
        part.unlink()
    shutil.rmtree(p.wheels, ignore_errors=True)
    p.wheels.mkdir(parents=True)
    if s.run(["tar", "-xf", bundle, "-C", p.wheels]):
        return FAILED
    bundle.unlink()
    (p.wheels / ".complete").touch()
    return OK


def install(s: Session) -> int:
    p = s.paths
    if unpack(s):
        return FAILED
    log(f"installing stock vLLM {p.vllm} into {p.site_stock}")
    for site in (p.site_stock, p.site_overlay):
        shutil.rmtree(site, ignore_errors=True)
    pip_log = p.results / "pip-install.log"
    if s.python("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", p.site_stock,
                *sorted(p.wheels.glob("*.whl")), log_path=pip_log):
        tail(pip_log, 20)
        return FAILED
    if dist_copy.copy_listed(p.stage / stage.SELECTION, p.site_stock, log) or torch_libs(s) or s.run(["cp", "-a", p.site_stock, p.site_overlay]):
        return FAILED
    log("applying the overlay with our tool")
    overlay = [p.repo / "scripts" / "overlay.py"]
    if s.python(*overlay, "apply", "--vllm", p.vllm, "--site-packages", p.site_overlay,
                log_path=p.results / "overlay-apply.log", echo=True, cwd=str(p.repo)):
        return FAILED
    copy_out(p.site_overlay / "vllm_overlay_receipt.json", p.results / "vllm_overlay_receipt.json")
    if s.python(*overlay, "verify", "--vllm", p.vllm, "--site-packages", p.site_overlay,
                pythonpath=str(p.site_overlay), log_path=p.results / "overlay-verify.log", echo=True):
        return FAILED
    if not p.model.is_dir():
        tiny_model.write_model(p.model)
    return OK


def torch_libs(s: Session) -> int:
    """Which torch and which CUDA libraries the site really loads (a base with its own torch
    must shadow the H200's torch 2.11.0 and its CUDA libraries entirely)."""
    p = s.paths
    log(f"torch and its CUDA libraries as {p.site_stock} loads them")
    return s.repo_python("dsa_image.validation.torch_libs", "--vllm", p.vllm, "--site", p.site_stock,
                         site=str(p.site_stock), log_path=p.results / "torch-libs.txt", echo=True)


def probes(s: Session) -> int:
    p, r = s.paths, s.paths.results
    for side, site, extra in (("stock", p.site_stock, ()), ("overlay", p.site_overlay, ("--overlay-checks",))):
        log(f"indexer probe: {side}")
        s.repo_python("dsa_image.validation.indexer_probe", "--model", p.model, "--out", r / f"probe-{side}.pt",
                      *extra, site=s.site_path(site), log_path=r / f"probe-{side}.log")
        tail(r / f"probe-{side}.log", 5)
    return s.repo_python("dsa_image.validation.compare", r / "probe-stock.pt", r / "probe-overlay.pt", "--json",
                         r / "metadata-equivalence.json", site=str(p.site_overlay),
                         log_path=r / "metadata-equivalence.txt", echo=True)


def harness(s: Session, name: str, module: str, *args, lines: int, keep: Callable[[str], bool] = lambda line: True,
            **kw) -> int:
    """A harness of dsa_image.validation, logged to RESULTS/NAME.log: its exit and its last lines."""
    log_path = s.paths.results / f"{name}.log"
    status = s.repo_python(module, *args, log_path=log_path, **kw)
    with log_path.open("a") as f:
        f.write(f"{name} exit: {status}\n")
    print(f"{name} exit: {status}")
    tail(log_path, lines, keep)
    return status


def serve(s: Session) -> int:
    p = s.paths
    log("serving equivalence: stock, stock, overlay, side by side")
    return harness(s, "serving", "dsa_image.validation.serving", "--model", p.model, "--stock-site", p.site_stock,
                   "--overlay-site", p.site_overlay, "--out", p.results / "serving",
                   "--timeout", f"{s.seconds(480):.0f}", lines=40)


def upstream(s: Session) -> int:
    """vLLM's own tests that import an overlaid module (scripts/upstream_tests.py gate), stock and
    overlay at once on the one GPU, file by file; the results in RESULTS/upstream-tests resume in
    the next call, whose gate runs what is left (its INCOMPLETE, the phase's too), then compares."""
    p, o = s.paths, s.opts
    bundle, out = upstream_bundle(s), p.results / "upstream-tests"
    log(f"upstream's tests: stock vs overlay, file by file, {o.upstream_jobs} runs at once, "
        f"{o.upstream_shards} shard(s) a run ({bundle})")
    out.mkdir(parents=True, exist_ok=True)
    # A file started at the gate's deadline may run its timeout: with less left than the two
    # together, both shrink alike, so that the last file still ends before the session's deadline.
    share = min(1.0, s.seconds(o.upstream_deadline_s + o.upstream_timeout_s) / (o.upstream_deadline_s
                                                                               + o.upstream_timeout_s))
    deadline, timeout = max(1.0, o.upstream_deadline_s * share), max(1.0, o.upstream_timeout_s * share)
    log_path = p.results / "upstream-tests.log"
    status = s.python(p.repo / "scripts" / "upstream_tests.py", "gate", "--bundle", bundle, "--out", out, "--python",
                      sys.executable, "--stock-site", p.site_stock, "--overlay-site", p.site_overlay, "--jobs", str(o.upstream_jobs),
                      "--shards", str(o.upstream_shards),
                      "--timeout", f"{timeout:.0f}", "--deadline-s", f"{deadline:.0f}", "--json", out / "compare.json",
                      log_path=out / "compare.txt", errors=log_path)
    with log_path.open("a") as f:
        f.write(f"upstream exit: {status}\n")
    print(f"upstream exit: {status}")
    tail(log_path, 8)
    tail(out / "compare.txt", 100_000)
    for name in ("compare.txt", "compare.json"):
        copy_out(out / name, p.out / name)
    with tarfile.open(p.out / "upstream-tests.tgz", "w:gz") as tar:
        tar.add(out, arcname="upstream-tests")
        tar.add(log_path, arcname=log_path.name)
    return status  # the gate's INCOMPLETE is the session's


def hosttime(s: Session) -> int:
    p = s.paths
    log("host time of build(): stock and overlay in one process, interleaved")
    status = s.repo_python("dsa_image.validation.host_time", "--overlay-checks", "--model", p.model, "--json",
                           p.results / "host-time.json", "--stock-indexer",
                           p.site_stock / "vllm" / "v1" / "attention" / "backends" / "mla" / "indexer.py",
                           site=s.site_path(p.site_overlay), log_path=p.results / "host-time.log")
    tail(p.results / "host-time.log", 100_000, lambda line: not re.match(r"INFO|.*WARNING", line))
    copy_out(p.results / "host-time.json", p.out / "host-time.json")
    return status


def toolchain(s: Session) -> int:
    """The image's CUDA toolkit is pip's (the recipe's [cuda] pins) made usable by the same link
    script the Dockerfile runs. Serve the overlay with only that toolkit: CUDA_HOME there, the
    system CUDA off PATH, empty JIT caches, so DeepGEMM and FlashInfer compile every kernel with it."""
    p, r = s.paths, s.paths.results
    log("toolchain: the image's pip CUDA toolkit under the smoke test")
    for path in (p.cuda_pip, p.toolchain_home):
        shutil.rmtree(path, ignore_errors=True)
    # The CUDA home is the toolkit's NVIDIA wheels; the base's other toolkit pins (cuda-python, a
    # binding pinned for the resolver) are not part of it, and may be the H200's own (unstaged).
    names = [pin.split("==")[0].replace("-", "_") for pin in load_recipe(vllm=p.vllm).cuda_toolkit
             if pin.startswith("nvidia-")]
    wheels = {name: sorted(p.wheels.glob(f"{name}-*.whl")) for name in names}
    if missing := [name for name, found in wheels.items() if not found]:
        print(f"toolchain: expected the toolkit's wheels {missing} in {p.wheels}", file=sys.stderr)
        return FAILED
    if s.python("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", p.cuda_pip,
                *[w for found in wheels.values() for w in found]):
        return FAILED
    cuda_home = p.cuda_pip / "nvidia" / "cu13"
    ldconfig = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    libcuda = next((line.split()[-1] for line in ldconfig.splitlines() if "libcuda.so.1 " in line), "")
    if s.run(["bash", p.repo / "scripts" / "link_cuda_toolkit.sh", cuda_home, libcuda]) or s.run(
            [cuda_home / "bin" / "nvcc", "--version"], r / "toolchain-nvcc.txt", echo=True):
        return FAILED
    p.toolchain_home.mkdir(parents=True, exist_ok=True)
    search_path = os.pathsep.join([str(cuda_home / "bin"), *(d for d in os.environ.get("PATH", "").split(os.pathsep)
                                                             if "cuda" not in d)])
    env = {"HOME": str(p.toolchain_home), "CUDA_HOME": str(cuda_home), "PATH": search_path,
           "DG_JIT_CACHE_DIR": str(p.toolchain_home / "deep_gemm"), "DG_JIT_PRINT_COMPILER_COMMAND": "1"}
    status = smoke_run(s, "toolchain", [], env, said="toolchain smoke")
    # Which compiler built the kernels: DeepGEMM prints each command (DG_JIT_PRINT_COMPILER_COMMAND).
    server_log = r / "toolchain" / "server.log"
    found = re.findall(r"[^ \n]*/nvcc ", server_log.read_text(errors="replace")) if server_log.is_file() else []
    counted = "".join(f"{found.count(c):>7} {c}\n" for c in sorted(set(found)))
    (r / "toolchain-compilers.txt").write_text(counted)
    print(counted, end="")
    cache = p.toolchain_home / "deep_gemm"
    listing = sorted(str(f.relative_to(cache)) for f in cache.rglob("*"))[:20] if cache.is_dir() else []
    with (r / "toolchain.log").open("a") as f:
        f.write("\n".join(listing) + "\n")
    tail(r / "toolchain.log", 15)
    return status


def smoke_run(s: Session, label: str, layout: list[str], env: dict | None = None, said: str | None = None) -> int:
    p, said = s.paths, said or label
    log_path = p.results / f"{label}.log"
    status = s.python(p.repo / "scripts" / "smoke.py", "--runtime", "local", "--python", sys.executable,
                      "--site-packages", p.site_overlay, "--target", "sm90", "--out", p.results / label, "--quiet",
                      *layout, "--", "--gpu-memory-utilization", "0.12", log_path=log_path, env=env)
    with log_path.open("a") as f:
        f.write(f"{said} exit: {status}\n")
    print(f"{said} exit: {status}")
    return status


def smoke(s: Session) -> int:
    """--smoke-args: smoke.py's layout flags (e.g. --tensor-parallel-size 2
    --distributed-executor-backend ray on two GPUs); --smoke-label names the results."""
    log(f"smoke test, local runtime, overlay, CUDA graphs on {s.opts.smoke_args}")
    status = smoke_run(s, s.opts.smoke_label, shlex.split(s.opts.smoke_args))
    tail(s.paths.results / f"{s.opts.smoke_label}.log", 30)
    return status


def mtp_model(s: Session) -> None:
    """The tiny GLM-5 with its MTP layer, for the MTP modes and the MTP benchmark."""
    if not s.paths.mtp_model.is_dir():
        tiny_model.write_model(s.paths.mtp_model, tiny_model.MTP_CONFIG)


def realwidth(s: Session) -> Path:
    """GLM-5 at real width, written (again, where it differs from what this repository writes)."""
    target = s.paths.realwidth
    if target.is_dir() and realwidth_model.model_dir_differences(target):
        log(f"{target} differs from what this repository writes: written again")
        shutil.rmtree(target)
    if not target.is_dir():
        realwidth_model.write_model(target)
    return target


def model_info(s: Session, model: Path, mtp: Path | None) -> int:
    """The model info the image ships, per side, into --model-info-root (made once a machine per
    side and model): the servers of later calls start as the image's do (a cold 0.33.0 server
    spent 42-44 s a class inspecting). The MTP model's entries serve the mode servers."""
    p = s.paths
    status = s.repo_python("dsa_image.validation.serving_modes", "--model-info-only", "--model", model,
                           *(["--mtp-model", mtp] if mtp else []), "--stock-site", p.site_stock, "--overlay-site",
                           p.site_overlay, "--model-info-root", p.model_info, "--out", p.results / "model-info",
                           "--vllm", p.vllm, log_path=p.results / "model-info.log", append=True)
    if status:
        print(f"model info: failed, see {p.results / 'model-info.log'}", file=sys.stderr)
        tail(p.results / "model-info.log", 5)
    return status


def model_infos(s: Session) -> int:
    log(f"model info as the image ships it, per side, into {s.paths.model_info}")
    mtp_model(s)
    status = model_info(s, s.paths.model, s.paths.mtp_model) or model_info(s, s.paths.model, None)
    if not status:
        tail(s.paths.results / "model-info.log", 100_000)
    return status


def modes(s: Session, name: str, chosen: str, model: Path, mtp: Path, *extra, env: dict | None = None) -> int:
    """Stock against the overlay per serving mode (four servers for two modes, started together)."""
    p = s.paths
    log(f"serving modes {chosen}: stock vs overlay, side by side")
    status = harness(s, name, "dsa_image.validation.serving_modes", *modes_args(s, name, chosen, model, mtp, *extra),
                     lines=20, keep=matching("PASS|FAIL|error"), env=env)
    copy_out(p.results / name / "serving-modes.json", p.out / f"{name}-serving-modes.json")
    shutil.rmtree(p.results / name / "work", ignore_errors=True)  # the servers' compile caches: not results
    return status


def modes_args(s: Session, name: str, chosen: str, model: Path, mtp: Path, *extra) -> list:
    p = s.paths
    return ["--modes", chosen, "--model", model, "--mtp-model", mtp, "--model-info-root", p.model_info,
            "--stock-site", p.site_stock, "--overlay-site", p.site_overlay, "--out", p.results / name,
            "--timeout", f"{s.seconds(s.opts.modes_timeout_s):.0f}", "--vllm", p.vllm, *extra]


def tiny_modes(name: str, chosen: str) -> Callable[[Session], int]:
    def step(s: Session) -> int:
        mtp_model(s)
        return modes(s, name, chosen, s.paths.model, s.paths.mtp_model)
    return step


def warmstart(s: Session, label: str, model: Path, homes: Path, steps: str, *extra, env: dict | None = None) -> int:
    """Compile caches are the subject here: the image keeps vLLM's, so this phase does too."""
    p = s.paths
    log(f"warm start: steps {steps}, stock and overlay side by side")
    status = harness(s, f"{label}-{steps}", "dsa_image.validation.warmstart",
                     *warmstart_args(s, label, model, homes, steps, *extra), lines=12,
                     unset=("VLLM_DISABLE_COMPILE_CACHE",), env=env)
    copy_out(p.results / label / "warmstart.json", p.out / f"{label}-{steps.replace(',', '+')}.json")
    return status


def warmstart_args(s: Session, label: str, model: Path, homes: Path, steps: str, *extra) -> list:
    p = s.paths
    return ["--model", model, "--stock-site", p.site_stock, "--overlay-site", p.site_overlay, "--out",
            p.results / label, "--work-dir", homes, "--model-info-root", p.model_info, "--steps", steps,
            "--timeout", f"{s.seconds(480):.0f}", *extra]


def tiny_warmstart(s: Session) -> int:
    steps = s.opts.warmstart_steps or "cold,warm-warmup"
    return warmstart(s, "warmstart", s.paths.model, s.paths.warmstart_homes, steps)


def startup(s: Session) -> int:
    """Start-up before/after the image's precompiled FlashInfer modules and start-up defaults, the
    overlay alone, one server at a time (dsa_image.validation.startup; ~9 min, 560 s at most)."""
    log("start-up: before/after the precompiled modules and the start-up defaults, the overlay alone")
    return startup_run(s, "startup", s.paths.model)


def startup_run(s: Session, label: str, model: Path, *extra, env: dict | None = None) -> int:
    """Compile caches are its subject: vLLM's are kept, as the image keeps them. Its results go
    out as LABEL.json and LABEL-phases.md."""
    p = s.paths
    status = harness(s, label, "dsa_image.validation.startup", *startup_args(s, label, model, *extra), lines=8,
                     unset=("VLLM_DISABLE_COMPILE_CACHE",), env=env)
    copy_out(p.results / label / "startup.json", p.out / f"{label}.json")
    copy_out(p.results / label / "startup-phases.md", p.out / f"{label}-phases.md")
    return status


def bench(s: Session, label: str, model: Path, mtp: Path, work: Path, *extra, env: dict | None = None) -> int:
    """--bench-args come last on bench.py's command line: a setting measured against the same
    build renames B itself (--b-name X-setting --b-env K=V; argparse: the last wins)."""
    p, o = s.paths, s.opts
    builds = bench_builds(s)
    log(f"benchmark {label}: {' '.join(builds)}; {o.bench_args or 'all workloads'}")
    log_path = p.results / f"{label}.log"
    status = s.python(*bench_command(s, builds, label, model, mtp, work, *extra), log_path=log_path,
                      unset=("VLLM_DISABLE_COMPILE_CACHE",), env=env, keep=BENCH_KEEP_S)
    with log_path.open("a") as f:
        f.write(f"bench exit: {status}\n")
    print(f"bench exit: {status}")
    tail(log_path, 25)
    copy_out(p.results / label / "results.json", p.out / f"{label}-results.json")
    return status


def bench_command(s: Session, builds: list[str], label: str, model: Path, mtp: Path, work: Path, *extra) -> list:
    p, o = s.paths, s.opts
    # Past its own deadline the benchmark stops its servers and writes its results (a few
    # seconds; the old script gave it what was left of the call's 600 s: 35 s at most).
    deadline = s.seconds(o.bench_deadline_s, BENCH_STOP_S + BENCH_KEEP_S)
    return [p.repo / "scripts" / "bench.py", "run", *builds, "--model", model, "--mtp-model", mtp, "--work-dir", work,
            "--model-info-root", p.model_info, "--out", p.results / label, "--deadline-s", f"{deadline:.0f}", *extra,
            *shlex.split(o.bench_args)]


def tiny_bench(s: Session) -> int:
    mtp_model(s)
    return bench(s, s.opts.bench_label or "bench", s.paths.model, s.paths.mtp_model, s.paths.bench_work)


def b12x(s: Session) -> int:
    """emulation/ first on PYTHONPATH: `import b12x` finds the emulation; the b12x wheel stays
    installed in the site (the overlay's start-up check reads its release)."""
    p = s.paths
    log("b12x path, emulated kernels: glue exactness and cross-checks")
    status = harness(s, "b12x-glue", "dsa_image.validation.b12x_glue", "--model", p.model, "--json",
                     p.results / "b12x-glue.json", "--vllm", p.vllm, lines=70,
                     keep=lambda line: not re.search(r"compute-capability check bypassed|^INFO|^WARNING|^DEBUG", line),
                     site=f"{p.repo / 'emulation'}{os.pathsep}{s.site_path(p.site_overlay)}")
    copy_out(p.results / "b12x-glue.json", p.out / "b12x-glue.json")
    return status


def selftest(s: Session) -> int:
    p, worst = s.paths, OK
    log("self-test: this GPU's kernels, the b12x refusal, a broken kernel")
    overlay = s.site_path(p.site_overlay)
    for step, args in (("auto", []), ("refusal", ["--kernels", "b12x"]), ("broken", ["--break", "prefill-long"])):
        report = p.results / f"selftest-{step}.txt"
        status = s.repo_python("dsa_image.runtime.selftest", *args, "--json", p.results / f"selftest-{step}.json",
                               site=overlay, log_path=report)
        with report.open("a") as f:
            f.write(f"selftest {step} exit: {status}\n")
        print(f"selftest {step} exit: {status}")
        tail(report, 12, lambda line: not re.match(r"INFO|WARNING|DEBUG", line))
        copy_out(report, p.out / report.name)
        # The three exit as the self-test's contract says: this GPU's kernels agree, b12x is refused, the
        # broken kernel fails.
        expected = {"auto": OK, "refusal": REFUSED, "broken": FAILED}[step]
        worst = worst or int(status != expected)
    return worst


def b12xserve(s: Session) -> int:
    p = s.paths
    log("serving on the emulated b12x path beside stock, CUDA graphs on")
    status = harness(s, "b12xserve", "dsa_image.validation.b12x_serving", "--model", p.model, "--stock-site",
                     p.site_stock, "--overlay-site", p.site_overlay, "--emulation", p.repo / "emulation", "--repo",
                     p.repo, "--out", p.results / "b12xserve", "--timeout", f"{s.seconds(480):.0f}",
                     "--vllm", p.vllm, lines=60)
    copy_out(p.results / "b12xserve" / "serving-b12x.json", p.out / "serving-b12x.json")
    return status


def cluster(s: Session) -> int:
    """Stock and overlay side by side per layout; the harness stops every process and namespace
    it started (also on SIGTERM); the cut-off guards a hang, `cleanup` catches what a kill left."""
    p, o, r = s.paths, s.opts, s.paths.results
    budget, out = s.seconds(o.cluster_deadline_s), r / "cluster"
    log(f"cluster: {o.cluster_layouts}, stock vs overlay side by side, within {budget:.0f} s")
    run_log = r / "cluster-run.log"
    status = s.repo_python("dsa_image.validation.cluster", "run", "--layouts", o.cluster_layouts, "--model", p.model,
                           "--stock-site", p.site_stock, "--overlay-site", p.site_overlay, "--out", out,
                           "--deadline-s", f"{budget - 50:.0f}", "--vllm", p.vllm, "--model-info-root", p.model_info,
                           *shlex.split(o.cluster_args), log_path=run_log, limit=budget - 20,
                           stop_signal=signal.SIGTERM, grace=20)
    with run_log.open("a") as f:
        f.write(f"cluster run exit: {status}\n")
    print(f"cluster run exit: {status}")
    s.repo_python("dsa_image.validation.cluster", "cleanup", log_path=run_log, append=True)
    tail(run_log, 30, matching(r'"(netns|mountns|shared|detail|ray[12]-[tp]p2[^"]*)": |as expected|CLUSTER|refused'
                               r'|Traceback'))
    # Every run in the results' cluster/, this call's and an earlier call's on the same machine.
    compared = harness(s, "cluster-compare", "dsa_image.validation.cluster", "compare", "--out", out, out, lines=20,
                       keep=matching(r"^\| |^Overall|COMPARISON"))
    for name in ("cluster.json", "cluster.md"):
        copy_out(out / name, p.out / name)
    copy_out(r / "environment.txt", p.out / "cluster-environment.txt")
    with tarfile.open(p.out / "cluster-logs.tgz", "w:gz") as tar:
        for name in ("cluster", "cluster-run.log", "cluster-compare.log"):
            if (r / name).exists():
                tar.add(r / name, arcname=name)
    return status or compared


# -- GLM-5 at real width ------------------------------------------------------------------------------


def memory_check(s: Session, logs_dir: Path, name: str) -> int:
    """Every server log of a real-width phase against the memory plan (memory_check.py)."""
    logs = sorted(logs_dir.glob("server-*.log"))
    if not logs:
        print(f"memory plan: no server log in {logs_dir}", file=sys.stderr)
        return FAILED
    report = logs_dir / "memory-plan.json"
    status = s.repo_python("dsa_image.validation.memory_check", "--model", s.paths.realwidth, "--json", report, *logs,
                           log_path=logs_dir / "memory-plan.txt", echo=True)
    copy_out(report, s.paths.out / f"{name}-memory-plan.json")
    return status


def realwidth_prepare(s: Session) -> int:
    """The model, and its model info per side (the later real-width calls start without the wait)."""
    log(f"GLM-5 at real width in {s.paths.realwidth}, and its model info per side")
    model = realwidth(s)
    status = model_info(s, model, model)
    if not status:
        tail(s.paths.results / "model-info.log", 5)
    return status


def realwidth_equiv(s: Session) -> int:
    model, chosen = realwidth(s), s.opts.realwidth_modes
    name = f"realwidth-equiv-{chosen}"
    status = modes(s, name, chosen, model, model, *REALWIDTH_SERVERS, env=REALWIDTH_ENV)
    return memory_check(s, s.paths.results / name, name) or status


def startup_args(s: Session, label: str, model: Path, *extra) -> list:
    p = s.paths
    return ["--model", model, "--site", p.site_overlay, "--out", p.results / label, "--work-dir",
            p.root / f"{label}-homes-{p.vllm}", "--model-info-root", p.model_info, "--vllm", p.vllm,
            "--budget-s", f"{s.seconds(560, 60):.0f}", *extra]


def realwidth_startup(s: Session) -> int:
    """The image's start at real width: startup.py's after-cold and after-restart (FlashInfer's
    precompiled module, the recipe's start-up defaults, the warm-up), the overlay alone, held to
    nothing compiled after ready and the first 3,000-token request within 1.2x the warm ones."""
    log("GLM-5 at real width: the image's start-up from empty caches and on a restart, the overlay alone")
    status = startup_run(s, "realwidth-startup", realwidth(s), *REALWIDTH_STARTUP, env=REALWIDTH_ENV)
    return memory_check(s, s.paths.results / "realwidth-startup" / "after", "realwidth-startup") or status


def realwidth_bench(s: Session) -> int:
    model, label = realwidth(s), s.opts.bench_label or "realwidth-bench"
    status = bench(s, label, model, model, s.paths.realwidth_bench_work, *REALWIDTH_SERVERS, env=REALWIDTH_ENV)
    return memory_check(s, s.paths.results / label, label) or status


def collect(s: Session, phase: str) -> None:
    p, r = s.paths, s.paths.results
    for name in ("metadata-equivalence.json", "metadata-equivalence.txt", "serving/serving-equivalence.json",
                 f"{s.opts.smoke_label}/smoke-report.json", "toolchain/smoke-report.json", "toolchain-compilers.txt",
                 "environment.txt", "torch-libs.txt"):
        copy_out(r / name, p.out / f"{phase}-{Path(name).name}")
    with tarfile.open(p.out / f"{phase}-results.tgz", "w:gz") as tar:
        tar.add(r, arcname=".", filter=lambda info: None if info.name.endswith(".pt") else info)
    if probes_found := sorted(r.glob("*.pt")):
        with tarfile.open(p.out / f"{phase}-probes.tgz", "w:gz") as tar:
            for probe in probes_found:
                tar.add(probe, arcname=probe.name)
    for entry in sorted(p.out.iterdir()):
        print(f"{entry.stat().st_size:>12}  {entry.name}")
