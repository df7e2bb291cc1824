"""`scripts/recipe.py lock`: the only writer of pins.

It fills the recipe's wheel sha256 from the downloaded wheels, tries the base image digest,
generates the resolver inputs (recipes/requirements/*.in) from the recipe and runs the real
resolver (uv pip compile --generate-hashes) into recipes/locks/:

  vllm-<arch>.txt      vLLM + the CUDA toolkit pins, shared by every target (one per arch)
  <target>-<arch>.txt  the common lock plus the target's extras, for targets with extras,
                       resolved with the common lock as constraints so that it never moves a
                       pin of the common lock (the Dockerfile installs it on top)
  dev.txt              the test runner's venv (requirements-dev.in)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from . import registry, wheels
from .recipe import ARCH_OF_PLATFORM, REPO_ROOT, Recipe, Target, set_base_digest, set_wheel_sha256

REQUIREMENTS_DIR = Path("recipes/requirements")
LOCKS_DIR = Path("recipes/locks")
DEV_IN = Path("requirements-dev.in")
DEV_LOCK = LOCKS_DIR / "dev.txt"
COMPILE_COMMAND = "python3 scripts/recipe.py lock"
PYTHON_PLATFORM = {"amd64": "x86_64-manylinux_2_28", "arm64": "aarch64-manylinux_2_28"}
_GENERATED = "# Generated from recipes/{recipe}.toml by `python3 scripts/recipe.py lock`. Do not edit.\n"


class LockError(Exception):
    """The resolver or a download failed; the message carries what it said."""


@dataclass(frozen=True)
class LockJob:
    """One resolver run: inputs (repo-relative) -> output lock."""

    output: Path
    inputs: tuple[Path, ...]
    arch: str | None  # None: universal (dev lock)
    constraints: tuple[Path, ...] = ()
    overrides: Path | None = None


def common_in() -> Path:
    return REQUIREMENTS_DIR / "vllm.in"


def target_in(target: Target) -> Path:
    return REQUIREMENTS_DIR / f"{target.id}.in"


def overrides_in(target: Target) -> Path:
    return REQUIREMENTS_DIR / f"{target.id}.overrides.in"


def common_lock(arch: str) -> Path:
    return LOCKS_DIR / f"vllm-{arch}.txt"


def target_lock(target: Target, arch: str) -> Path:
    """The lock the image of `target` installs on `arch` after the common one (its extras)."""
    return LOCKS_DIR / f"{target.id}-{arch}.txt" if target.extras else common_lock(arch)


def requirement_files(recipe: Recipe) -> dict[Path, str]:
    """Every resolver input, generated from the recipe: {repo-relative path: text}."""
    header = _GENERATED.format(recipe=recipe.id)
    files = {common_in(): header + "".join(f"{pin}\n" for pin in (f"vllm=={recipe.vllm_version}", *recipe.cuda_toolkit))}
    for target in recipe.targets.values():
        if not target.extras:
            continue
        extras = "".join(f"{extra.requirement}\n" for extra in target.extras)
        files[target_in(target)] = f"{header}-r vllm.in\n{extras}"
        if target.overrides:
            files[overrides_in(target)] = header + "".join(f"{pin}\n" for pin in target.overrides)
    return files


def lock_jobs(recipe: Recipe) -> list[LockJob]:
    """The resolver runs, common locks first (target locks are constrained by them)."""
    arches = [ARCH_OF_PLATFORM[p] for p in recipe.platforms]
    jobs = [LockJob(common_lock(arch), (common_in(),), arch) for arch in arches]
    for target in recipe.targets.values():
        if not target.extras:
            continue
        for arch in target.arches:
            jobs.append(LockJob(
                target_lock(target, arch), (target_in(target),), arch,
                constraints=(common_lock(arch),),
                overrides=overrides_in(target) if target.overrides else None,
            ))
    jobs.append(LockJob(DEV_LOCK, (DEV_IN,), None))
    return jobs


def uv_command(job: LockJob, python_version: str, uv: str) -> list[str]:
    argv = [
        uv, "pip", "compile", "--quiet", "--no-config",
        "--index-url", wheels.PYPI_SIMPLE,
        "--generate-hashes",
        "--python-version", python_version,
        "--custom-compile-command", COMPILE_COMMAND,
        "--output-file", str(job.output),
    ]
    argv += ["--python-platform", PYTHON_PLATFORM[job.arch]] if job.arch else ["--universal"]
    for constraint in job.constraints:
        argv += ["--constraint", str(constraint)]
    if job.overrides:
        argv += ["--overrides", str(job.overrides)]
    return argv + [str(p) for p in job.inputs]


def find_uv() -> str:
    """uv next to this interpreter (the dev venv) first, then on PATH."""
    beside = Path(sys.executable).with_name("uv")
    found = str(beside) if beside.exists() else shutil.which("uv")
    if not found:
        raise LockError("uv not found (neither next to this python nor on PATH); install the dev lock: "
                        "pip install --require-hashes -r recipes/locks/dev.txt")
    return found


def _uv_env() -> dict[str, str]:
    # Only PyPI: a UV_* index variable from the caller's environment must not leak into a lock.
    return {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_")) or k == "UV_CACHE_DIR"}


def run_resolver(job: LockJob, python_version: str, uv: str, root: Path = REPO_ROOT) -> None:
    argv = uv_command(job, python_version, uv)
    (root / job.output).parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(argv, cwd=root, env=_uv_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise LockError(f"resolving {job.output} failed ({' '.join(argv)}):\n{done.stderr.strip()}")


def lock_wheel_pins(text: str, recipe: Recipe, report) -> str:
    """Download every listed vLLM wheel, return the recipe text with their computed sha256."""
    for platform, wheel in recipe.wheels.items():
        path, sha = wheels.lock_wheel(wheel.filename)
        report(f"{wheel.filename}: sha256 {sha} ({path})")
        text = set_wheel_sha256(text, platform, sha)
    return text


def lock_base_digest(text: str, recipe: Recipe, report) -> str:
    try:
        digest = registry.resolve_digest(recipe.base_image)
    except registry.RegistryError as exc:
        report(f"base image digest not locked, base.digest left as {recipe.base_digest!r}: {exc}")
        return text
    report(f"{recipe.base_image}: {digest}")
    return set_base_digest(text, digest)


def write_files(files: dict[Path, str], root: Path = REPO_ROOT) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def stale_generated(files: dict[Path, str], directory: Path, root: Path = REPO_ROOT) -> list[Path]:
    """Files in `directory` that the recipe no longer generates (e.g. a removed target)."""
    present = {p.relative_to(root) for p in (root / directory).glob("*") if p.is_file()}
    return sorted(present - set(files))


def drift(expected: dict[Path, str], root: Path = REPO_ROOT) -> list[str]:
    """One line per generated file that differs from what the recipe generates."""
    problems = []
    for rel, text in expected.items():
        path = root / rel
        if not path.exists():
            problems.append(f"{rel}: missing; run `{COMPILE_COMMAND}`")
        elif path.read_text() != text:
            problems.append(f"{rel}: differs from what the recipe generates; run `{COMPILE_COMMAND}`")
    return problems


# --- reading locks back: what `check` and the tests assert about them ---------------------

_REQUIREMENT_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)(\s*;.*?)?\s*\\?$")
_HASH_LINE = re.compile(r"^\s+--hash=sha256:([0-9a-f]{64})")


@dataclass(frozen=True)
class Pin:
    version: str
    hashes: frozenset[str]


def parse_lock(text: str) -> dict[str, Pin]:
    """{normalized name: Pin} of a `uv pip compile --generate-hashes` output."""
    pins: dict[str, Pin] = {}
    name = version = None
    hashes: set[str] = set()

    def flush() -> None:
        if name is not None:
            if not hashes:
                raise LockError(f"{name}=={version}: no --hash in the lock")
            pins[name] = Pin(version, frozenset(hashes))

    for line in text.splitlines():
        requirement = _REQUIREMENT_LINE.match(line)
        digest = _HASH_LINE.match(line)
        if requirement:
            flush()
            name, version, hashes = normalize(requirement.group(1)), requirement.group(2), set()
        elif digest and name is not None:
            hashes.add(digest.group(1))
    flush()
    return pins


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _split_pin(pin: str) -> tuple[str, str]:
    name, _, version = pin.partition("==")
    return normalize(name), version


def expected_locks(recipe: Recipe) -> list[Path]:
    return [job.output for job in lock_jobs(recipe)]


def _expect_pin(pins: dict[str, Pin], pin: str, where: Path) -> list[str]:
    name, version = _split_pin(pin)
    found = pins.get(name)
    if found is None:
        return [f"{where}: {pin} from the recipe is missing"]
    if found.version != version:
        return [f"{where}: the recipe pins {pin}, the lock has {name}=={found.version}"]
    return []


def lock_problems(recipe: Recipe, root: Path = REPO_ROOT) -> list[str]:
    """Everything that makes the committed locks disagree with the recipe, one line each."""
    problems = []
    expected = expected_locks(recipe)
    present = {p.relative_to(root) for p in (root / LOCKS_DIR).glob("*.txt")}
    problems += [f"{p}: not generated by the recipe any more; run `{COMPILE_COMMAND}`" for p in sorted(present - set(expected))]
    missing = [p for p in expected if p not in present]
    problems += [f"{p}: missing; run `{COMPILE_COMMAND}`" for p in missing]
    locks = {p: (root / p).read_text() for p in expected if p not in missing}
    for path, text in locks.items():
        if COMPILE_COMMAND not in text.split("\n\n", 1)[0]:
            problems.append(f"{path}: header does not name `{COMPILE_COMMAND}`")
    torch_pins = {o for t in recipe.targets.values() for o in t.overrides if _split_pin(o)[0] == "torch"}
    for platform in recipe.platforms:
        arch = ARCH_OF_PLATFORM[platform]
        common_path = common_lock(arch)
        if common_path not in locks:
            continue
        common = parse_lock(locks[common_path])
        wheel = recipe.wheels[platform]
        vllm = common.get("vllm")
        problems += _expect_pin(common, f"vllm=={recipe.vllm_version}", common_path)
        if vllm and wheel.sha256 not in vllm.hashes:
            problems.append(f"{common_path}: vllm hashes do not include the recipe's {wheel.filename} sha256 {wheel.sha256 or '(empty)'}")
        for pin in (*recipe.cuda_toolkit, *torch_pins):
            problems += _expect_pin(common, pin, common_path)
        for target in recipe.targets.values():
            path = target_lock(target, arch)
            if not target.extras or platform not in target.platforms or path not in locks:
                continue
            full = parse_lock(locks[path])
            for name, pin in sorted(common.items()):
                if full.get(name) != pin:
                    problems.append(f"{path}: {name} differs from {common_path} (the extras lock must only add packages)")
            for extra in target.extras:
                problems += _expect_pin(full, extra.requirement, path)
    return problems
