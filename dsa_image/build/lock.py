"""`scripts/recipe.py lock`: the only writer of pins.

It works on one base (a vLLM release of the recipe, `--vllm`): it fills that base's wheel
and sdist sha256 from the downloaded files, tries the base image digest, generates the resolver inputs
(recipes/requirements/vllm-<version>/*.in) from the recipe and runs the real resolver
(uv pip compile --generate-hashes) into recipes/locks/:

  vllm-<version>/vllm-<arch>.txt      vLLM + the CUDA toolkit pins + the cluster packages
                                      (Ray), shared by every target (one per arch)
  vllm-<version>/<target>-<arch>.txt  the common lock plus the target's extras, for targets
                                      with extras, resolved with the common lock as
                                      constraints so that it never moves a pin of the common
                                      lock (the Dockerfile installs it on top)
  vllm-<version>/SHA256SUMS           the sha256 of each lock above, as written
  dev.txt, SHA256SUMS                 the test runner's venv (requirements-dev.in), shared by
                                      every base and resolved by every `lock`; its sha256
  upstream-tests.txt                  what vLLM's own tests import beyond vLLM and the dev lock
                                      (the recipe's [upstream_tests] packages, from the generated
                                      recipes/requirements/upstream-tests.in), shared by every
                                      base: exactly those packages (--no-deps: their requirements
                                      are vLLM's and the test runner's), installed into the
                                      upstream tests' bundle (dsa_image/upstream/bundle.py)

Every hash in a lock comes from the index, through the resolver (`resolver_seed` keeps the
previous lock's versions but never its hashes), except the vllm pin's: it carries exactly the
sha256 of the recipe's wheel for that arch, computed from the downloaded file.

Reading a lock back lives in `dsa_image.build.lock_parse`; `check`, the committed locks held
to the recipe and the index, in `dsa_image.build.lock_check`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dsa_image.build import registry
from dsa_image.build.lock_parse import LOCK_HASH, LOCK_REQUIREMENT, LockError, has_option, normalize
from dsa_image.core import wheels
from dsa_image.core.recipe import ARCH_OF_PLATFORM, REPO_ROOT, Recipe, Target, Wheel, set_base_digest, set_sdist_sha256, set_wheel_sha256, vllm_dir

REQUIREMENTS_DIR = Path("recipes/requirements")
LOCKS_DIR = Path("recipes/locks")
DEV_IN = Path("requirements-dev.in")
DEV_LOCK = LOCKS_DIR / "dev.txt"
UPSTREAM_TESTS_IN = REQUIREMENTS_DIR / "upstream-tests.in"
UPSTREAM_TESTS_LOCK = LOCKS_DIR / "upstream-tests.txt"
COMPILE_COMMAND = "python3 scripts/recipe.py lock"
# In each directory of locks: the sha256 of every lock there as `lock` wrote it; `check`
# (offline) notices any later edit of a lock.
SUMS_NAME = "SHA256SUMS"
CHECK_ONLINE_COMMAND = "python3 scripts/recipe.py check --online"
VLLM = "vllm"
PYTHON_PLATFORM = {"amd64": "x86_64-manylinux_2_28", "arm64": "aarch64-manylinux_2_28"}
_GENERATED = "# Generated from recipes/{recipe}.toml by `{command}`. Do not edit.\n"


@dataclass(frozen=True)
class LockJob:
    """One resolver run: inputs (repo-relative) -> output lock."""

    output: Path
    inputs: tuple[Path, ...]
    arch: str | None  # None: universal (dev lock)
    command: str  # what writes this lock: its header, and what every message about it says
    constraints: tuple[Path, ...] = ()
    overrides: Path | None = None
    no_deps: bool = False  # exactly the inputs' packages, none of their requirements


def lock_command(version: str) -> str:
    """The command that writes one base's locks."""
    return f"{COMPILE_COMMAND} --vllm {version}"


def requirements_dir(recipe: Recipe) -> Path:
    return REQUIREMENTS_DIR / vllm_dir(recipe.vllm_version)


def locks_dir(recipe: Recipe) -> Path:
    return LOCKS_DIR / vllm_dir(recipe.vllm_version)


def common_in(recipe: Recipe) -> Path:
    return requirements_dir(recipe) / "vllm.in"


def target_in(recipe: Recipe, target: Target) -> Path:
    return requirements_dir(recipe) / f"{target.id}.in"


def overrides_in(recipe: Recipe, target: Target) -> Path:
    return requirements_dir(recipe) / f"{target.id}.overrides.in"


def common_lock(recipe: Recipe, arch: str) -> Path:
    return locks_dir(recipe) / f"vllm-{arch}.txt"


def target_lock(recipe: Recipe, target: Target, arch: str) -> Path:
    """The lock the image of `target` installs on `arch` after the common one (its extras)."""
    return locks_dir(recipe) / f"{target.id}-{arch}.txt" if target.extras else common_lock(recipe, arch)


def requirement_files(recipe: Recipe) -> dict[Path, str]:
    """Every resolver input of the recipe's base, generated from it: {repo-relative path: text}."""
    header = _GENERATED.format(recipe=recipe.id, command=lock_command(recipe.vllm_version))
    common = (f"vllm=={recipe.vllm_version}", *recipe.cuda_toolkit, *recipe.cluster_packages)
    files = {common_in(recipe): header + "".join(f"{pin}\n" for pin in common)}
    shared = _GENERATED.format(recipe=recipe.id, command=COMPILE_COMMAND)
    files[UPSTREAM_TESTS_IN] = shared + "".join(f"{name}\n" for name in recipe.upstream_test_packages)
    for target in recipe.targets.values():
        if not target.extras:
            continue
        extras = "".join(f"{extra.requirement}\n" for extra in target.extras)
        files[target_in(recipe, target)] = f"{header}-r vllm.in\n{extras}"
        if target.overrides:
            files[overrides_in(recipe, target)] = header + "".join(f"{pin}\n" for pin in target.overrides)
    return files


def lock_jobs(recipe: Recipe) -> list[LockJob]:
    """The resolver runs of the recipe's base, common locks first (target locks are constrained
    by them), then the dev lock every base shares."""
    command = lock_command(recipe.vllm_version)
    arches = [ARCH_OF_PLATFORM[p] for p in recipe.platforms]
    jobs = [LockJob(common_lock(recipe, arch), (common_in(recipe),), arch, command) for arch in arches]
    for target in recipe.targets.values():
        if not target.extras:
            continue
        for arch in target.arches:
            jobs.append(LockJob(
                target_lock(recipe, target, arch), (target_in(recipe, target),), arch, command,
                constraints=(common_lock(recipe, arch),),
                overrides=overrides_in(recipe, target) if target.overrides else None,
            ))
    jobs.append(LockJob(DEV_LOCK, (DEV_IN,), None, COMPILE_COMMAND))
    jobs.append(LockJob(UPSTREAM_TESTS_LOCK, (UPSTREAM_TESTS_IN,), None, COMPILE_COMMAND, no_deps=True))
    return jobs


def uv_command(job: LockJob, python_version: str, uv: str) -> list[str]:
    argv = [
        uv, "pip", "compile", "--quiet", "--no-config",
        "--index-url", wheels.PYPI_SIMPLE,
        "--generate-hashes",
        "--python-version", python_version,
        "--custom-compile-command", job.command,
        "--output-file", str(job.output),
    ]
    argv += ["--python-platform", PYTHON_PLATFORM[job.arch]] if job.arch else ["--universal"]
    for constraint in job.constraints:
        argv += ["--constraint", str(constraint)]
    if job.overrides:
        argv += ["--overrides", str(job.overrides)]
    if job.no_deps:
        argv.append("--no-deps")
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


def resolver_seed(text: str) -> str:
    """A lock reduced to its pins, no hashes: what the resolver reads back as preferences.

    uv keeps the versions of an existing output file (so `lock` does not move pins) but also
    reuses its hashes: seeded with a hand-edited lock, the edited hash would survive `lock`.
    Seeded with this, every hash comes from the index again."""
    pins = []
    for line in text.splitlines():
        match = LOCK_REQUIREMENT.match(line)
        if match and not has_option(line):
            pins.append(f"{match.group(1)}=={match.group(2)}{match.group(3) or ''}\n")
    return "".join(pins)


def pin_vllm_wheel(text: str, wheel: Wheel, where: Path) -> str:
    """The resolver's lock with the vllm pin narrowed to the one hash of the recipe's wheel.

    uv writes a hash for every file of the release (the other platform's wheel and the sdist
    too): with those, `pip install --require-hashes` would also accept a source build of vLLM.
    The image installs exactly the wheel `lock` downloaded and whose sha256 the recipe records."""
    if not wheel.sha256:
        raise LockError(f"{where}: the recipe has no sha256 for {wheel.filename}; `lock` downloads it first")
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    found = False
    i = 0
    while i < len(lines):
        match = LOCK_REQUIREMENT.match(lines[i].rstrip("\n"))
        if not (match and normalize(match.group(1)) == VLLM):
            out.append(lines[i])
            i += 1
            continue
        hashes = []
        i += 1
        while i < len(lines) and (digest := LOCK_HASH.match(lines[i].rstrip("\n"))):
            hashes.append(digest.group(1))
            i += 1
        if wheel.sha256 not in hashes:
            raise LockError(
                f"{where}: the resolver's {match.group(1)}=={match.group(2)} has no file with the recipe's "
                f"{wheel.filename} sha256 {wheel.sha256} (it has: {', '.join(hashes) or 'none'}); the recipe and "
                "the index disagree: re-run the whole `python3 scripts/recipe.py lock`")
        out += [lines[i - len(hashes) - 1], f"    --hash=sha256:{wheel.sha256}\n"]
        found = True
    if not found:
        raise LockError(f"{where}: the resolver's output has no vllm pin to narrow to {wheel.filename}")
    return "".join(out)


def resolve(job: LockJob, recipe: Recipe, uv: str, root: Path = REPO_ROOT) -> None:
    """One lock as `lock` writes it: resolved with the previous lock's versions (never its
    hashes) as preferences, the vllm pin narrowed to the recipe's wheel. On failure the
    previous lock is put back."""
    output = root / job.output
    previous = output.read_text() if output.exists() else None
    if previous is not None:
        output.write_text(resolver_seed(previous))
    done = False
    try:
        run_resolver(job, recipe.python, uv, root)
        if job.arch:
            output.write_text(pin_vllm_wheel(output.read_text(), recipe.wheel(job.arch), job.output))
        done = True
    finally:
        if not done and previous is not None:
            output.write_text(previous)


def sums_file(directory: Path) -> Path:
    return directory / SUMS_NAME


def lock_sums(recipe: Recipe, root: Path = REPO_ROOT) -> dict[Path, str]:
    """{SHA256SUMS path: text} as `lock` writes them, one per directory of the base's locks
    (the base's own, and recipes/locks/ for dev.txt); `sha256sum -c` reads them too."""
    by_directory: dict[Path, list[Path]] = {}
    for path in expected_locks(recipe):
        by_directory.setdefault(path.parent, []).append(path)
    return {sums_file(directory): "".join(f"{wheels.sha256_bytes((root / p).read_bytes())}  {p.name}\n" for p in paths)
            for directory, paths in by_directory.items()}


def write_lock_sums(recipe: Recipe, root: Path = REPO_ROOT) -> None:
    for path, text in lock_sums(recipe, root).items():
        (root / path).write_text(text)


def lock_vllm_pins(text: str, recipe: Recipe, report) -> str:
    """Download every vLLM wheel and the sdist of the recipe's base, return the recipe text
    with their computed sha256."""
    for platform, wheel in recipe.wheels.items():
        path, sha = wheels.lock_wheel(wheel.filename)
        report(f"{wheel.filename}: sha256 {sha} ({path})")
        text = set_wheel_sha256(text, recipe.vllm_version, platform, sha)
    path, sha = wheels.lock_wheel(recipe.sdist.filename)
    report(f"{recipe.sdist.filename}: sha256 {sha} ({path})")
    return set_sdist_sha256(text, recipe.vllm_version, sha)


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


def drift(expected: dict[Path, str], command: str, root: Path = REPO_ROOT) -> list[str]:
    """One line per generated file that differs from what the recipe generates; `command`
    writes them again."""
    problems = []
    for rel, text in expected.items():
        path = root / rel
        if not path.exists():
            problems.append(f"{rel}: missing; run `{command}`")
        elif path.read_text() != text:
            problems.append(f"{rel}: differs from what the recipe generates; run `{command}`")
    return problems


def stale_bases(recipe: Recipe, root: Path = REPO_ROOT) -> list[Path]:
    """Directories of locks or resolver inputs named after a vLLM release the recipe no longer
    pins (a dropped base)."""
    wanted = {vllm_dir(v) for v in recipe.vllm_versions}
    return sorted(p.relative_to(root) for directory in (REQUIREMENTS_DIR, LOCKS_DIR)
                  for p in (root / directory).glob("vllm-*") if p.is_dir() and p.name not in wanted)


def expected_locks(recipe: Recipe) -> list[Path]:
    return [job.output for job in lock_jobs(recipe)]
