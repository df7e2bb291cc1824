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
                                      upstream tests' bundle (dsa_image/upstream/gate.py)

Every hash in a lock comes from the index, through the resolver (`resolver_seed` keeps the
previous lock's versions but never its hashes), except the vllm pin's: it carries exactly the
sha256 of the recipe's wheel for that arch, computed from the downloaded file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dsa_image.build import registry
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


class LockError(Exception):
    """The resolver or a download failed; the message carries what it said."""


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
        match = _LOCK_REQUIREMENT.match(line)
        if match and not _has_option(line):
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
        match = _LOCK_REQUIREMENT.match(lines[i].rstrip("\n"))
        if not (match and normalize(match.group(1)) == VLLM):
            out.append(lines[i])
            i += 1
            continue
        hashes = []
        i += 1
        while i < len(lines) and (digest := _LOCK_HASH.match(lines[i].rstrip("\n"))):
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


_VIA_ONE = re.compile(r"^\s+# via (\S.*)$")
_VIA_OPEN = re.compile(r"^\s+# via\s*$")
_VIA_MORE = re.compile(r"^\s+#   (\S.*)$")


def parse_via(text: str) -> dict[str, frozenset[str]]:
    """{normalized name: the normalized names that require it} from the `# via` comments uv
    writes under each pin (`# via a`, or `# via` then one `#   a` per line). Requirement files
    (`-r ...`, `-c ...`) are not packages and are left out."""
    via: dict[str, set[str]] = {}
    name = None
    listing = False
    for line in text.splitlines():
        requirement = _REQUIREMENT_LINE.match(line)
        if requirement:
            name, listing = normalize(requirement.group(1)), False
            via[name] = set()
            continue
        one, more = _VIA_ONE.match(line), _VIA_MORE.match(line)
        if name is None:
            continue
        if _VIA_OPEN.match(line):
            listing = True
        elif one or (listing and more):
            parent = (one or more).group(1).strip()
            if not parent.startswith("-"):
                via[name].add(normalize(parent))
    return {n: frozenset(parents) for n, parents in via.items()}


def requirements_of(via: dict[str, frozenset[str]], root: str) -> set[str]:
    """Every pin that `root` requires, directly or through other pins (not `root` itself)."""
    found: set[str] = set()
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for name, parents in via.items():
            if parent in parents and name not in found and name != root:
                found.add(name)
                frontier.append(name)
    return found


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def split_pin(pin: str) -> tuple[str, str]:
    name, _, version = pin.partition("==")
    return normalize(name), version


def expected_locks(recipe: Recipe) -> list[Path]:
    return [job.output for job in lock_jobs(recipe)]


def _expect_pin(pins: dict[str, Pin], pin: str, where: Path) -> list[str]:
    name, version = split_pin(pin)
    found = pins.get(name)
    if found is None:
        return [f"{where}: {pin} from the recipe is missing"]
    if found.version != version:
        return [f"{where}: the recipe pins {pin}, the lock has {name}=={found.version}"]
    return []


_REGENERATE = f"run `{COMPILE_COMMAND} --vllm VERSION` for that lock's base (never edit a lock by hand)"


def _regenerate(recipe: Recipe) -> str:
    return f"run `{lock_command(recipe.vllm_version)}` (never edit a lock by hand)"

# The only lines `uv pip compile --generate-hashes` writes; `scan_lock` refuses any other, since
# pip would read it (an inline --hash, an index option, a sha512 hash) and no rule here would.
_LOCK_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)(\s+;[^\\]*?)?(\s+\\)?$")
_LOCK_HASH = re.compile(r"^\s+--hash=sha256:([0-9a-f]{64})(\s+\\)?$")
_LOCK_COMMENT = re.compile(r"^\s*(#.*)?$")


def _has_option(line: str) -> bool:
    """pip reads every whitespace-separated token from the first one starting with '-' as
    options of the requirement (--hash=..., --index-url ...)."""
    return any(token.startswith("-") for token in line.split()[1:])


@dataclass(frozen=True)
class LockedPin:
    """A requirement of a lock, with where it is: its line and each hash's line."""

    name: str
    version: str
    marker: str  # "" or the environment marker (universal locks pin a name once per marker)
    line: int
    hashes: dict[str, int]  # sha256 -> line number

    @property
    def pin(self) -> Pin:
        return Pin(self.version, frozenset(self.hashes))


def scan_lock(text: str, where: Path, regenerate: str = _REGENERATE) -> tuple[list[LockedPin], list[str]]:
    """(pins in file order, problems) of a lock, strictly: a line uv does not write, a second
    requirement for a name and marker or a pin without a hash is a problem (file:line)."""
    pins: dict[tuple[str, str], LockedPin] = {}
    problems: list[str] = []
    current: LockedPin | None = None
    continued = False  # the previous line ended in a backslash: pip joins this one to it
    refused = False  # ... to a line already reported: the rest of it is not reported again
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if refused:
            refused = continued = line.rstrip().endswith("\\")
            continue
        digest = _LOCK_HASH.match(line)
        if digest and continued and current is not None:
            current.hashes.setdefault(digest.group(1), number)
            continued = bool(digest.group(2))
            continue
        if not continued:
            if _LOCK_COMMENT.match(line):
                current = None
                continue
            requirement = _LOCK_REQUIREMENT.match(line)
            if requirement and not _has_option(line):
                name = normalize(requirement.group(1))
                marker = (requirement.group(3) or "").strip().removeprefix(";").strip()
                current = LockedPin(name, requirement.group(2), marker, number, {})
                if (name, marker) in pins:
                    problems.append(f"{where}:{number}: a second requirement for {name} (the first is on line "
                                    f"{pins[name, marker].line}); pip would merge their hashes; {regenerate}")
                else:
                    pins[name, marker] = current
                continued = bool(requirement.group(4))
                continue
        inside = continued and current is not None  # the requirement's hashes go on after it
        joined = " (pip joins it to the requirement above)" if continued else ""
        problems.append(f"{where}:{number}: `{line.strip()}` is not a line `uv pip compile --generate-hashes` "
                        f"writes{joined}: only `name==version [; marker] \\`, `    --hash=sha256:<64 hex>` "
                        f"and comments are; {regenerate}")
        continued = line.rstrip().endswith("\\")
        if not inside:
            current = None
            refused = continued
    if continued:
        problems.append(f"{where}:{len(lines)}: the lock ends in a continued line; {regenerate}")
    for pin in pins.values():
        if not pin.hashes:
            problems.append(f"{where}:{pin.line}: {pin.name}=={pin.version} has no --hash, so "
                            f"`pip install --require-hashes` refuses the lock; {regenerate}")
    return list(pins.values()), problems


def _by_name(pins: list[LockedPin]) -> dict[str, Pin]:
    """{name: Pin} of a lock for one platform (no name twice there)."""
    found: dict[str, Pin] = {}
    for pin in pins:
        found.setdefault(pin.name, pin.pin)
    return found


def _places(places: list[tuple[Path, int]]) -> str:
    return ", ".join(f"{path}:{line}" for path, line in places)


def _hash_list(hashes) -> str:
    return ", ".join(f"--hash=sha256:{h}" for h in sorted(hashes))


def _sums_problems(expected: list[Path], present: list[Path], root: Path, regenerate: str) -> list[str]:
    """Each lock must have the sha256 `lock` recorded for it in its directory's SHA256SUMS."""
    problems = []
    by_directory: dict[Path, list[Path]] = {}
    for path in expected:
        by_directory.setdefault(path.parent, []).append(path)
    for directory, paths in by_directory.items():
        problems += _directory_sums_problems(sums_file(directory), paths, present, root, regenerate)
    return problems


def _directory_sums_problems(sums: Path, expected: list[Path], present: list[Path], root: Path,
                             regenerate: str) -> list[str]:
    if not (root / sums).is_file():
        return [f"{sums}: missing; {regenerate}"]
    problems = []
    recorded: dict[str, tuple[str, int]] = {}
    for number, line in enumerate((root / sums).read_text().splitlines(), 1):
        match = re.fullmatch(r"([0-9a-f]{64})  (\S+)", line)
        if match:
            recorded[match.group(2)] = (match.group(1), number)
        else:
            problems.append(f"{sums}:{number}: not `<sha256>  <lock file name>`; {regenerate}")
    for path in expected:
        entry = recorded.pop(path.name, None)
        if path not in present:
            continue
        found = wheels.sha256_bytes((root / path).read_bytes())
        if entry is None:
            problems.append(f"{sums}: no line for {path.name} (expected `{found}  {path.name}`); {regenerate}")
        elif entry[0] != found:
            problems.append(
                f"{path}: its sha256 is {found}, {sums}:{entry[1]} records {entry[0]} as `lock` wrote it: "
                f"the lock changed since. `{CHECK_ONLINE_COMMAND}` names every hash the index does not list; "
                f"{regenerate}")
    problems += [f"{sums}:{number}: {name} is not a lock the recipe generates; {regenerate}"
                 for name, (_, number) in sorted(recorded.items())]
    return problems


def _vllm_problems(recipe: Recipe, scans: dict[Path, list[LockedPin]], regenerate: str) -> list[str]:
    """In every lock of an arch, vllm carries exactly one hash: the recipe's wheel's."""
    problems = []
    for job in lock_jobs(recipe):
        if not job.arch:
            continue
        for pin in scans.get(job.output, []):  # a missing pin is reported with the recipe's other pins
            if pin.name == VLLM:
                problems += _vllm_pin_problems(recipe, recipe.wheel(job.arch), job.output, pin, regenerate)
    return problems


def _vllm_pin_problems(recipe: Recipe, wheel: Wheel, path: Path, pin: LockedPin, regenerate: str) -> list[str]:
    if not wheel.sha256:
        return [f"{_shown(recipe.path)}: no sha256 for {wheel.filename}; {regenerate}"]
    problems = []
    for digest, line in sorted(pin.hashes.items(), key=lambda item: item[1]):
        if digest != wheel.sha256:
            problems.append(
                f"{path}:{line}: vllm=={pin.version} carries --hash=sha256:{digest}, expected only "
                f"--hash=sha256:{wheel.sha256} (the recipe's {wheel.filename}, hashed from the file `lock` "
                f"downloaded): any other hash widens what `pip install --require-hashes` accepts; {regenerate}")
    if wheel.sha256 not in pin.hashes:
        problems.append(f"{path}:{pin.line}: vllm=={pin.version} lacks --hash=sha256:{wheel.sha256} "
                        f"(the recipe's {wheel.filename}); {regenerate}")
    return problems


def _consistency_problems(scans: dict[Path, list[LockedPin]], regenerate: str) -> list[str]:
    """A release has the same files on the index whichever lock pins it, and uv writes one hash
    per file: the same name==version must carry the same hashes in every lock (vllm aside,
    narrowed per arch and checked against the recipe)."""
    seen: dict[tuple[str, str], dict[frozenset[str], list[tuple[Path, int]]]] = {}
    for path, pins in scans.items():
        for pin in pins:
            if pin.name != VLLM:
                seen.setdefault((pin.name, pin.version), {}).setdefault(frozenset(pin.hashes), []).append((path, pin.line))
    problems = []
    for (name, version), groups in seen.items():
        if len(groups) < 2:
            continue
        shared = frozenset.intersection(*groups)
        ordered = sorted(groups.items(), key=lambda item: (len(item[1]), str(item[1][0][0])))
        parts = [f"{_places(places)} {'has' if len(places) == 1 else 'have'} "
                 f"{_hash_list(hashes - shared) if hashes - shared else 'no hash beyond the ones all share'}"
                 for hashes, places in ordered]
        problems.append(
            f"{name}=={version} has different hashes in different locks, where `lock` writes the same ones "
            f"(one per file the index lists for that release): {'; '.join(parts)}. `{CHECK_ONLINE_COMMAND}` "
            f"names the one the index does not list; {regenerate}")
    return problems


def lock_problems(recipe: Recipe, root: Path = REPO_ROOT) -> list[str]:
    """Everything that makes the committed locks of the recipe's base (and the dev lock)
    disagree with the recipe or with what `lock` wrote, one line each (offline: see
    `online_problems` for the index)."""
    command = lock_command(recipe.vllm_version)
    regenerate = _regenerate(recipe)
    problems = []
    jobs = lock_jobs(recipe)
    expected = [job.output for job in jobs]
    present = {p.relative_to(root) for directory in (LOCKS_DIR, locks_dir(recipe))
               for p in (root / directory).glob("*.txt")}
    problems += [f"{p}: not generated by the recipe any more; run `{command}`" for p in sorted(present - set(expected))]
    problems += [f"{p}: a directory of a vLLM release the recipe does not pin; delete it" for p in stale_bases(recipe, root)]
    missing = [p for p in expected if p not in present]
    problems += [f"{p}: missing; run `{command}`" for p in missing]
    locks = {job.output: (root / job.output).read_text() for job in jobs if job.output not in missing}
    for job in jobs:
        if job.output in locks and not _header_names(locks[job.output], job.command):
            problems.append(f"{job.output}: header does not name `{job.command}`; {regenerate}")
    scans: dict[Path, list[LockedPin]] = {}
    for path, text in locks.items():
        scans[path], syntax = scan_lock(text, path, regenerate)
        problems += syntax
    problems += _sums_problems(expected, list(locks), root, regenerate)
    torch_pins = {o for t in recipe.targets.values() for o in t.overrides if split_pin(o)[0] == "torch"}
    for platform in recipe.platforms:
        arch = ARCH_OF_PLATFORM[platform]
        common_path = common_lock(recipe, arch)
        if common_path not in scans:
            continue
        common = _by_name(scans[common_path])
        problems += _expect_pin(common, f"{VLLM}=={recipe.vllm_version}", common_path)
        for pin in (*recipe.cuda_toolkit, *recipe.cluster_packages, *torch_pins):
            problems += _expect_pin(common, pin, common_path)
        for target in recipe.targets.values():
            path = target_lock(recipe, target, arch)
            if not target.extras or platform not in target.platforms or path not in scans:
                continue
            full = _by_name(scans[path])
            for name, pin in sorted(common.items()):
                # hashes: _consistency_problems and _vllm_problems say which ones differ
                if name not in full or full[name].version != pin.version:
                    problems.append(f"{path}: {name} differs from {common_path} (the extras lock must only add packages)")
            for extra in target.extras:
                problems += _expect_pin(full, extra.requirement, path)
    problems += _vllm_problems(recipe, scans, regenerate)
    problems += _consistency_problems(scans, regenerate)
    if not recipe.sdist.sha256:
        problems.append(f"{_shown(recipe.path)}: no sha256 for {recipe.sdist.filename}; {regenerate}")
    return problems


def _header_names(text: str, command: str) -> bool:
    """uv writes the compile command as the header's second line: `#    <command>`."""
    return text.splitlines()[1:2] == [f"#    {command}"]


def _shown(path: Path) -> Path:
    return path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path


def _release_problems(path: Path, pin: LockedPin, listed: list[wheels.IndexFile], index_url: str,
                      regenerate: str) -> list[str]:
    """Each hash of `pin` must be the sha256 of a file the index lists for exactly that release."""
    release = wheels.release_files(listed, pin.version)
    allowed = {f.sha256 for f in release}
    by_sha = {f.sha256: f for f in listed}
    page = f"{index_url.rstrip('/')}/{pin.name}/"
    if len(release) <= 4:
        expected = ", ".join(f"{f.filename} sha256 {f.sha256}" for f in release) or "none"
    else:
        expected = f"{len(release)} files"
    problems = []
    for digest, line in sorted(pin.hashes.items(), key=lambda item: item[1]):
        if digest in allowed:
            continue
        other = by_sha.get(digest)
        found = (f"it is {other.filename}, a file of another release" if other
                 else f"{page} lists no file with that sha256")
        problems.append(
            f"{path}:{line}: {pin.name}=={pin.version} carries --hash=sha256:{digest}, which is not a file of "
            f"{pin.name}=={pin.version}: {found}. Expected only hashes of the files {page} lists for that "
            f"release ({expected}). Every hash must come from the index; {regenerate}")
    return problems


def online_problems(recipe: Recipe, root: Path = REPO_ROOT, paths: list[Path] | None = None,
                    index_url: str = wheels.PYPI_SIMPLE, workers: int = 16) -> list[str]:
    """What only the index can tell (`check --online`): every hash of every pin of `paths`
    (default: every lock) is the sha256 of a file the index lists for that name==version, and
    each recipe wheel's sha256 is the one the index lists for its filename.

    The index's PEP 691 listing, the one `lock` resolves from, not PyPI's JSON API (which
    mirrors do not serve). A file of the release whose hash the lock lacks is not a problem:
    it narrows what pip accepts, and a project may add files to a release after `lock` ran.
    Raises wheels.WheelError when the index cannot be read."""
    paths = expected_locks(recipe) if paths is None else list(paths)
    scans = {path: scan_lock((root / path).read_text(), path)[0] for path in paths}
    names = sorted({pin.name for pins in scans.values() for pin in pins} | {VLLM})
    with ThreadPoolExecutor(max_workers=workers) as pool:
        listed = dict(zip(names, pool.map(lambda name: wheels.index_files(name, index_url), names)))
    regenerate = _regenerate(recipe)
    problems = []
    vllm_files = {f.filename: f for f in listed[VLLM]}
    for platform, wheel in recipe.wheels.items():
        entry = vllm_files.get(wheel.filename)
        if entry is None:
            problems.append(f"{_shown(recipe.path)}: {wheel.filename} ([vllm.\"{recipe.vllm_version}\".wheels.\"{platform}\"]) is not "
                            f"listed by {index_url.rstrip('/')}/{VLLM}/; fix the filename, then {regenerate}")
        elif entry.sha256 != wheel.sha256:
            problems.append(f"{_shown(recipe.path)}: vllm.\"{recipe.vllm_version}\".wheels.\"{platform}\".sha256 is "
                            f"{wheel.sha256 or '(empty)'}, "
                            f"expected {entry.sha256}, the sha256 {index_url.rstrip('/')}/{VLLM}/ lists for "
                            f"{wheel.filename}; {regenerate}")
    sdist = vllm_files.get(recipe.sdist.filename)
    if sdist is None:
        problems.append(f"{_shown(recipe.path)}: {recipe.sdist.filename} ([vllm.\"{recipe.vllm_version}\".sdist]) is not "
                        f"listed by {index_url.rstrip('/')}/{VLLM}/; fix the filename, then {regenerate}")
    elif sdist.sha256 != recipe.sdist.sha256:
        problems.append(f"{_shown(recipe.path)}: vllm.\"{recipe.vllm_version}\".sdist.sha256 is "
                        f"{recipe.sdist.sha256 or '(empty)'}, expected {sdist.sha256}, the sha256 "
                        f"{index_url.rstrip('/')}/{VLLM}/ lists for {recipe.sdist.filename}; {regenerate}")
    for path, pins in scans.items():
        for pin in pins:
            problems += _release_problems(path, pin, listed[pin.name], index_url, regenerate)
    return problems
