"""Build the sm120 image for linux/arm64 (DGX Spark) and check it: CI's arm64 step (.ci/run).

    python3 scripts/build_arm64.py [--vllm VERSION] [--base-image NAME] [--log-dir DIR]

On an x86-64 machine everything arm64 runs under QEMU user emulation, registered with the
F flag (scripts/install_qemu.sh; checked first, nothing is built without it).

1. `docker buildx bake sm120 --set sm120.platform=linux/arm64` (for a base other than the
   default, given with --vllm: its own target, e.g. `sm120-vllm0_24_0`), TAG=<vLLM version>-arm64, so
   the image is dsa-image:<vLLM version>-arm64-sm120, with the options this host needs (host
   network, the host's CA bundle for pip) and BASE_IMAGE=NAME (default: the recipe's base).
   It always runs: BuildKit's cache decides what is rebuilt. After a change of a lock, the
   Dockerfile or the overlay the steps that depend on it run again; with nothing changed every
   step comes from the cache. Printed: a digest of the build's inputs (and of the locks, the
   Dockerfile and the overlay alone) and the disk space left to build steps, then each
   Dockerfile step that ran now, and how many came from the cache. While it runs, a line a
   minute: the time so far, the steps done and the step running (a cold build spends most of
   its time in one pip step). The bake's log: build/logs/bake-<target>-arm64.log (DIR/...).
2. The image is arm64: its config says so, and `uname -m` in it prints aarch64; its labels
   carry the recipe's capabilities and the receipt sha256 docker-bake.json predicts.
3. The build-time arch checks, run again inside the image (the build's own step may have come
   from the cache): scripts/arch_check.py toolchain (the image's nvcc builds SASS for each of
   the recipe's capabilities) and extensions (vLLM's extensions carry code for them).
4. `docker run IMAGE verify`: the receipt is the one the build recorded (and the one
   docker-bake.json predicts), and overlay.py verify passes.

Steps 2-4 run in the arm64 image on every run. Exit codes: --help (EXIT_CODES).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsa_image.build import image_build
from dsa_image.core.recipe import Recipe, RecipeError, load_recipe
from dsa_image.core import status

REPO_ROOT = Path(__file__).resolve().parents[2]
EXIT_CODES = status.epilog(
    (status.SUCCESS, "built and every check passed"),
    (status.FAILED, "QEMU is not ready, the build or a check failed (the message says which)"),
    (status.USAGE, "usage, or an unknown base (--vllm)"))

TARGET = "sm120"
PLATFORM = "linux/arm64"
# What the sm120 runtime is built from: the build context (.dockerignore's allow-list, less
# tests/, which only the `test` stage copies) and the bake files that pass the pins.
INPUTS = ("Dockerfile", "docker-bake.hcl", "docker-bake.json", "pyproject.toml",
          "dsa_image", "scripts", "recipes", "overlay")
# The parts the CI requirement names; each is printed with its own digest too.
NAMED_INPUTS = {"locks": ("recipes/locks",), "Dockerfile": ("Dockerfile",), "overlay": ("overlay",)}
# Docker runs of the checks: each may take minutes emulated.
RUN_TIMEOUT = 1800
IN_IMAGE = "/opt/dsa-image/ci"  # where the repository's arch_check is mounted in the container
# Seconds between the progress lines printed while the bake runs (CI's log shows them).
HEARTBEAT_S = 60
# A cold arm64 build writes the deps layer (9.3 GB) next to pip's downloads: an estimate with margin.
COLD_BUILD_GB = 14
# QEMU's user emulation has no arm64 sysfs CPU identification, and torch 2.14's oneDNN
# (xbyak_aarch64, util_impl_linux.h:444) aborts the import when it cannot read
# /sys/devices/system/cpu/cpuN/regs/identification/midr_el1 (torch 2.11 did not need it). Emulated,
# the checks see a CPU directory that has it: a Cortex-X925, one of GB10's two core kinds (MIDR
# 0x410FD850, arm-trusted-firmware include/lib/cpus/aarch64/cortex_x925.h).
CPU_SYSFS = "/sys/devices/system/cpu"
EMULATED_MIDR = "0x00000000410fd850"


class CheckFailed(status.DsaImageError):
    pass


def say(message: str) -> None:
    print(f"build_arm64: {message}", file=sys.stderr, flush=True)


def input_files(repo: Path, parts: tuple[str, ...]) -> list[Path]:
    files = []
    for part in parts:
        path = repo / part
        found = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        files += [p for p in found if "__pycache__" not in p.parts and p.suffix != ".pyc"]
    return files


def inputs_digest(repo: Path, parts: tuple[str, ...]) -> str:
    """sha256 over the sorted `sha256  path` lines of the files (like sha256sum's output)."""
    lines = sorted(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(repo)}\n"
                   for p in input_files(repo, parts))
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def docker(*args: str, timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


def run_in_image(image: str, *args: str, entrypoint: str | None = None,
                 mounts: tuple[tuple[Path, str], ...] = ()) -> tuple[int, str, float]:
    """`docker run` in the arm64 image, without network (an engine without a bridge has no
    default network; nothing here needs one)."""
    command = ["run", "--rm", "--platform", PLATFORM, "--network", "none"]
    for source, target in mounts:
        command += ["-v", f"{source}:{target}:ro"]
    if entrypoint:
        command += ["--entrypoint", entrypoint]
    started = time.monotonic()
    done = docker(*command, image, *args)
    return done.returncode, done.stdout, time.monotonic() - started


def qemu_ready(repo: Path) -> None:
    if platform.machine() == "aarch64":
        return
    done = subprocess.run(["bash", str(repo / "scripts" / "install_qemu.sh"), "--check"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    print(done.stdout, end="", file=sys.stderr)
    if done.returncode != 0:
        raise CheckFailed("QEMU user emulation for arm64 is not ready (above); as root: bash scripts/install_qemu.sh")


def write_cpu_sysfs(directory: Path, cpus: int) -> Path:
    """A /sys/devices/system/cpu for the emulated image: the CPU lists and each CPU's MIDR_EL1."""
    span = f"0-{cpus - 1}\n" if cpus > 1 else "0\n"
    for name in ("online", "possible", "present"):
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(span)
    for cpu in range(cpus):
        identification = directory / f"cpu{cpu}" / "regs" / "identification"
        identification.mkdir(parents=True, exist_ok=True)
        (identification / "midr_el1").write_text(EMULATED_MIDR + "\n")
        (identification / "revidr_el1").write_text("0x0000000000000000\n")
    return directory


def docker_disk() -> tuple[str, float]:
    """The Docker root directory and the GB its file system has available to build steps: df's
    Avail, since a build step (no CAP_SYS_RESOURCE) cannot use ext4's blocks reserved for root."""
    try:
        root = docker("info", "--format", "{{.DockerRootDir}}", timeout=60).stdout.strip() or "/var/lib/docker"
        stat = os.statvfs(root)
    except (OSError, subprocess.TimeoutExpired):
        root, stat = "/", os.statvfs("/")
    return root, stat.f_bavail * stat.f_frsize / 1e9


def bake_target(recipe: Recipe) -> str:
    """The plain name for the default base (the command users and docs show), else the base's own."""
    return TARGET if recipe.vllm_version == recipe.default_vllm else recipe.bake_target(TARGET)


def build(repo: Path, recipe: Recipe, base_image: str | None, log_dir: Path) -> tuple[str, float]:
    target = bake_target(recipe)
    options = image_build.BakeOptions.for_this_machine(base_image, log_dir).with_variables(
        TAG=f"{recipe.vllm_version}-arm64")
    say(f"build inputs sha256 {inputs_digest(repo, INPUTS)} ({', '.join(INPUTS)}); "
        + ", ".join(f"{name} {inputs_digest(repo, parts)[:16]}" for name, parts in NAMED_INPUTS.items()))
    root, free_gb = docker_disk()
    say(f"{root}: {free_gb:.1f} GB available to build steps (a cold arm64 build needs ~{COLD_BUILD_GB} GB)")
    say("$ " + image_build.bake_invocation(options, target) + f" --set {target}.platform={PLATFORM}")
    try:
        result = image_build.bake(repo, target, options, [f"{target}.platform={PLATFORM}"], timeout=5400,
                                  log_name=f"bake-{target}-arm64",
                                  progress=lambda line: say(f"baking {target} for {PLATFORM}: {line}"),
                                  heartbeat_s=HEARTBEAT_S)
    except (image_build.BuildError, subprocess.TimeoutExpired) as exc:
        hint = ""
        if "No space left on device" in str(exc):
            hint = (f"\nout of disk: {root} had {free_gb:.1f} GB available to build steps; a cold arm64 build "
                    f"needs ~{COLD_BUILD_GB} GB. Free some: docker image prune; docker builder prune -af "
                    f"--filter until=24h (cache not used for a day)")
        raise CheckFailed(f"the {PLATFORM} build of {target} failed: {exc}{hint}") from None
    steps = [s for s in result.steps if s.stage is not None and "] FROM " not in s.name]
    rebuilt = result.rebuilt()
    say(f"built {result.tags[0]} in {result.seconds:.0f} s; log: {result.log_path}")
    if rebuilt:
        say(f"{len(rebuilt)} of {len(steps)} Dockerfile steps ran now, {len(steps) - len(rebuilt)} from the cache:")
        for step in rebuilt:
            say(f"  ran  {step.seconds or 0:7.1f} s  {step.name[:150]}")
    else:
        say(f"all {len(steps)} Dockerfile steps came from the cache: no input of the arm64 image changed "
            f"since it was last built here")
    return result.tags[0], result.seconds


def check_image(repo: Path, recipe: Recipe, image: str, cpu_mounts: tuple[tuple[Path, str], ...] = ()) -> None:
    """The image's platform, labels, arch checks and verify, each run in it with `cpu_mounts`."""
    cuda_arch = ";".join(recipe.target(TARGET).cuda_arch)
    bake_vars = json.loads((repo / "docker-bake.json").read_text())["variable"]
    predicted = bake_vars["VLLM"]["default"][recipe.vllm_version]["RECEIPT_SHA256"]

    done = docker("image", "inspect", "--format", "{{.Os}}/{{.Architecture}} {{json .Config.Labels}}", image)
    if done.returncode != 0:
        raise CheckFailed(f"docker image inspect {image} failed: {done.stdout.strip()}")
    os_arch, labels_json = done.stdout.strip().split(" ", 1)
    labels = json.loads(labels_json) or {}
    if os_arch != PLATFORM:
        raise CheckFailed(f"{image} is {os_arch}, not {PLATFORM}")
    if labels.get("dsa-image.cuda-arch") != cuda_arch or labels.get("dsa-image.receipt.sha256") != predicted:
        raise CheckFailed(f"{image}'s labels say cuda-arch {labels.get('dsa-image.cuda-arch')!r}, receipt "
                          f"{labels.get('dsa-image.receipt.sha256')!r}; the recipe and docker-bake.json say "
                          f"{cuda_arch!r}, {predicted!r}")
    code, out, _ = run_in_image(image, "-m", entrypoint="uname", mounts=cpu_mounts)
    if code != 0 or out.strip() != "aarch64":
        raise CheckFailed(f"uname -m in {image} exited {code} printing {out.strip()!r}, not aarch64")
    say(f"{image}: {os_arch}, uname -m in it: aarch64, labels: cuda-arch {cuda_arch}, receipt {predicted[:16]}")

    script = (f'python -B {IN_IMAGE}/scripts/arch_check.py toolchain --cuda-arch "$1" && '
              f'python -B {IN_IMAGE}/scripts/arch_check.py extensions --cuda-arch "$1" '
              '--site-packages "$DSA_IMAGE_SITE_PACKAGES"')
    mounts = ((repo / "scripts" / "arch_check.py", f"{IN_IMAGE}/scripts/arch_check.py"),
              (repo / "dsa_image", f"{IN_IMAGE}/dsa_image"), *cpu_mounts)
    code, out, seconds = run_in_image(image, "-c", script, "arch_check", cuda_arch, entrypoint="/bin/bash",
                                      mounts=mounts)
    print(out, end="", file=sys.stderr)
    if code != 0:
        raise CheckFailed(f"the arch checks (toolchain, extensions; {cuda_arch}) failed in {image}: exit {code}")
    say(f"arch checks passed in {image} ({cuda_arch}, emulated): {seconds:.0f} s")

    code, out, seconds = run_in_image(image, "verify", mounts=cpu_mounts)
    print(out, end="", file=sys.stderr)
    if code != 0 or f"sha256 {predicted} matches the build" not in out:
        raise CheckFailed(f"verify in {image} exited {code}" + ("" if code else f" without 'sha256 {predicted} "
                                                                    "matches the build'"))
    say(f"verify passed in {image} (emulated): {seconds:.0f} s")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", metavar="VERSION", help="the recipe's base to build (default: its default)")
    parser.add_argument("--base-image", help="BASE_IMAGE for the bake, an arm64 image (default: the recipe's)")
    parser.add_argument("--log-dir", type=Path, default=REPO_ROOT / "build" / "logs",
                        help="where the bake's log goes, as bake-<target>-arm64.log (default: build/logs)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        recipe = load_recipe(vllm=args.vllm)
    except RecipeError as exc:
        say(f"{exc}")
        return status.USAGE
    try:
        qemu_ready(REPO_ROOT)
        image, _ = build(REPO_ROOT, recipe, args.base_image, args.log_dir)
        with tempfile.TemporaryDirectory(prefix="dsa-image-arm64-cpu-") as tmp:
            cpu_mounts: tuple[tuple[Path, str], ...] = ()
            if platform.machine() != "aarch64":
                cpu_mounts = ((write_cpu_sysfs(Path(tmp) / "cpu", os.cpu_count() or 1), CPU_SYSFS),)
                say(f"emulated: the checks see {CPU_SYSFS} with MIDR_EL1 {EMULATED_MIDR} (Cortex-X925); "
                    "QEMU provides none, and torch 2.14 needs it to import")
            check_image(REPO_ROOT, recipe, image, cpu_mounts)
    except CheckFailed as exc:
        say(f"FAILED after {time.monotonic() - started:.0f} s: {exc}")
        return status.FAILED
    say(f"passed: {image} built and checked in {time.monotonic() - started:.0f} s")
    return status.SUCCESS
