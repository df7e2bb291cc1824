"""`scripts/recipe.py check`: the committed locks of a base against the recipe, what `lock`
wrote (SHA256SUMS) and, online, the index.

`lock_problems` (offline) reads every lock strictly (`scan_lock`: only the lines uv writes),
checks the pins the recipe makes, the extras locks against the common one, the vllm pin's one
hash and that a release carries the same hashes in every lock; `online_problems` asks the
index whether each hash is the sha256 of a file of that release. Each problem is one line
that says how to regenerate.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dsa_image.build.lock import (
    CHECK_ONLINE_COMMAND, COMPILE_COMMAND, LOCKS_DIR, VLLM, common_lock, expected_locks, lock_command, lock_jobs,
    locks_dir, stale_bases, sums_file, target_lock,
)
from dsa_image.build.lock_parse import LOCK_COMMENT, LOCK_HASH, LOCK_REQUIREMENT, Pin, has_option, normalize, split_pin
from dsa_image.core import wheels
from dsa_image.core.recipe import ARCH_OF_PLATFORM, REPO_ROOT, Recipe, Wheel


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
        digest = LOCK_HASH.match(line)
        if digest and continued and current is not None:
            current.hashes.setdefault(digest.group(1), number)
            continued = bool(digest.group(2))
            continue
        if not continued:
            if LOCK_COMMENT.match(line):
                current = None
                continue
            requirement = LOCK_REQUIREMENT.match(line)
            if requirement and not has_option(line):
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
    for platform in recipe.platforms:
        problems += _platform_problems(recipe, platform, scans)
    problems += _vllm_problems(recipe, scans, regenerate)
    problems += _consistency_problems(scans, regenerate)
    if not recipe.sdist.sha256:
        problems.append(f"{_shown(recipe.path)}: no sha256 for {recipe.sdist.filename}; {regenerate}")
    return problems


def _platform_problems(recipe: Recipe, platform: str, scans: dict[Path, list[LockedPin]]) -> list[str]:
    """One platform's common lock carries the recipe's pins, and each extras lock of it only adds."""
    arch = ARCH_OF_PLATFORM[platform]
    common_path = common_lock(recipe, arch)
    if common_path not in scans:
        return []
    torch_pins = {o for t in recipe.targets.values() for o in t.overrides if split_pin(o)[0] == "torch"}
    common = _by_name(scans[common_path])
    problems = _expect_pin(common, f"{VLLM}=={recipe.vllm_version}", common_path)
    for pin in (*recipe.cuda_toolkit, *recipe.cluster_packages, *torch_pins):
        problems += _expect_pin(common, pin, common_path)
    for target in recipe.targets.values():
        path = target_lock(recipe, target, arch)
        if not target.extras or platform not in target.platforms or path not in scans:
            continue
        full = _by_name(scans[path])
        for name, locked in sorted(common.items()):
            # hashes: _consistency_problems and _vllm_problems say which ones differ
            if name not in full or full[name].version != locked.version:
                problems.append(f"{path}: {name} differs from {common_path} (the extras lock must only add packages)")
        for extra in target.extras:
            problems += _expect_pin(full, extra.requirement, path)
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
        listed = dict(zip(names, pool.map(lambda name: wheels.index_files(name, index_url), names), strict=True))
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
