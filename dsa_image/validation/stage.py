"""Stage the wheels an H200 validation run of one base installs, split for the device transfer.

The device machine has no network, and each call carries at most 64 MiB: the repository's
files and what it names in `carry`. The wheels travel as one tarball in parts under
``.stage/vllm-X.Y.Z/`` (git-ignored), one part per call, each as large as the carry leaves room
for beside the repository (`part_bytes`), and the GPU session runner (scripts/gpu_validation.py)
reassembles them in /tmp/stage-X.Y.Z.

What the H200 has: its Python's ``pip list --format=freeze``, as the `inventory` phase of
scripts/gpu_validation.py recorded it (`H200_RECORD`, recipes/hosts/h200-pip-freeze.txt; the
header says when and where). Staging selects against that record; the inventory phase, the
first call of a session, checks on the device that the record still holds there and that the
bundle and the H200 together cover every pin of the base (`--check-freeze`).

What goes in (`selection`): every pin of the base's amd64 locks (the common lock, the sm90
image's set with vLLM, the pip CUDA toolkit and Ray; plus what the sm120 lock adds: b12x) whose
name==version the H200 lacks, each checked against the lock's sha256 after download. When
torch is among them, every NVIDIA library torch requires belongs in the site too (`torch_stack`):
those the H200 has at the lock's version are not carried but listed, and the install phase copies
them from the H200's venv into the site, each file checked against its RECORD
(dsa_image.validation.dist_copy). The pip CUDA
toolkit's NVIDIA wheels always travel (`toolkit_wheels`): the toolchain phase installs them.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from dsa_image.build import lock, lock_parse
from dsa_image.core import wheels
from dsa_image.core.recipe import Recipe, RecipeError, load_recipe
from dsa_image.core import status

REPO = Path(__file__).resolve().parents[2]
H200_RECORD = REPO / "recipes" / "hosts" / "h200-pip-freeze.txt"
ARCH = "amd64"
EXTRAS_TARGET = "sm120"  # its lock adds b12x to the common set (the CuTe DSL is in both)
CARRY_LIMIT = 64 * 2**20  # the device tool's limit on one call's files
# SHA256SUMS and selection.txt ride with the first part; the rest covers the device tool's own
# accounting (it refused a 60 MB part beside a 7 MB repository, 2026-11-30).
CARRY_HEADROOM = 2 * 2**20
MIN_PART_BYTES = 16_000_000  # below this a 4 GB bundle needs more than 250 calls
BUNDLE = "bundle.tar"
SELECTION = "selection.txt"
SUMS = "SHA256SUMS"
PYTHON = "3.12"  # the H200's Python
EXIT_CODES = status.epilog(
    (status.SUCCESS, "staged, planned, or (--check-freeze) every pin covered"),
    (status.FAILED, "--check-freeze found pins neither staged nor on the H200"),
    (status.USAGE, "usage, an unknown base, or a malformed record"),
    (status.DRIFT, "the locks are not what staging needs (re-lock, as the message says)"),
    (status.ENVIRONMENT, "a download, the wheel cache, git or a write failed, or the bundle cannot fit a call"),
    (status.REFUSED, "the H200's record is missing (the inventory phase writes it)"))
# The newest glibc a wheel that ran on the H200 required: llguidance 1.7.6 has only a
# manylinux_2_31 wheel (the 0.24.0 runs installed it). The locks were resolved for
# manylinux_2_28 (lock.PYTHON_PLATFORM) but pin such releases too. `--check-freeze` on the device
# checks every staged file's tags against its Python.
H200_GLIBC = (2, 31)


def platform_args() -> list[str]:
    """pip download's tags for the H200: pip matches --platform tags exactly, so every manylinux
    up to its glibc, and PEP 600's legacy aliases."""
    major, minor = H200_GLIBC
    legacy = {"manylinux1": 5, "manylinux2010": 12, "manylinux2014": 17}
    tags = [f"manylinux_{major}_{m}_x86_64" for m in range(minor, 4, -1)]
    tags += [f"{alias}_x86_64" for alias, glibc in legacy.items() if glibc <= minor]
    return ["--python-version", PYTHON, "--implementation", "cp"] + [a for t in tags for a in ("--platform", t)]


class StageError(status.DsaImageError):
    """The locks, the H200 record or a download are not what staging needs; says what to do.
    ENVIRONMENT unless the raise says otherwise (DRIFT for the locks, USAGE for a malformed
    record, REFUSED for a missing one)."""

    exit_code = status.ENVIRONMENT

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


@dataclass(frozen=True)
class Staged:
    name: str
    version: str
    hashes: frozenset[str]
    why: str
    carried: bool = True  # False: the H200's installed copy goes into the site (dist_copy)


# selection.txt's file column for a pin that is not carried: the H200's installed copy
FROM_H200 = "-"
# One line of it (selection_text): the pin, the wheel's filename or FROM_H200, then why
SELECTION_LINE = re.compile(rf"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s+(\S+\.whl|{re.escape(FROM_H200)})(\s.*)?")
COPIED = "on the H200: its installed copy goes into the site with torch (its CUDA library set)"


# --- what a base needs, and what the H200 has ----------------------------------------------


def _read_lock(path: Path) -> str:
    return (REPO / path).read_text()


def needed(recipe: Recipe) -> dict[str, lock_parse.Pin]:
    """Every pin of the base's amd64 locks: the common lock plus what the sm120 lock adds."""
    common_path = lock.common_lock(recipe, ARCH)
    extras_path = lock.target_lock(recipe, recipe.target(EXTRAS_TARGET), ARCH)
    common, extras = lock_parse.parse_lock(_read_lock(common_path)), lock_parse.parse_lock(_read_lock(extras_path))
    moved = [f"{name}: {common[name].version} in {common_path}, {pin.version} in {extras_path}"
             for name, pin in extras.items() if name in common and common[name].version != pin.version]
    if moved:
        raise StageError(f"the sm120 lock must only add to the common lock, but moves {'; '.join(moved)}; "
                         f"run `{lock.lock_command(recipe.vllm_version)}`", status.DRIFT)
    return {**common, **extras}


def parse_freeze(text: str, where: str) -> dict[str, str]:
    """{name: version} of `pip list --format=freeze` (a record's `#` header lines skipped)."""
    found = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.strip().partition("==")
        if not sep or not name or not version:
            raise StageError(f"{where}:{number}: expected `name==version` (pip list --format=freeze), "
                             f"found {line.strip()!r}", status.USAGE)
        found[lock_parse.normalize(name)] = version
    return found


def has(present: dict[str, str], name: str, version: str) -> bool:
    """Whether the H200 has name==version. Its torch is PyTorch's index build `2.11.0+cu130`: a
    local label names the CUDA build of the same release, so it is compared without it."""
    found = present.get(name)
    return found is not None and same_release(found, version)


def same_release(found: str, version: str) -> bool:
    """Whether an installed version is the lock's, a local label (+cu130) aside."""
    return wheels.canonical_version(found.split("+", 1)[0]) == wheels.canonical_version(version)


# --- the selection -------------------------------------------------------------------------


def torch_stack(via: dict[str, frozenset[str]]) -> set[str]:
    """The NVIDIA libraries torch requires (the lock's `# via` chains). They belong in the site
    with torch, also those whose version the H200 has: torch 2.14.0's _load_global_deps preloads
    each CUDA library from the first sys.path entry that has it, so one missing from the site
    would be the H200's venv's copy, beside the site's others (and torch_libs would refuse it).
    Those the H200 has are copied from its venv on the device, not carried (`COPIED`)."""
    return {name for name in lock_parse.requirements_of(via, "torch") if name.startswith("nvidia-")}


def toolkit_wheels(recipe: Recipe) -> set[str]:
    """The pip CUDA toolkit's NVIDIA wheels: the toolchain phase builds a CUDA home from these
    files, so they travel even where the H200 has them installed (cuda-python, pinned there for
    the resolver, is no part of it)."""
    return {name for name, _ in map(lock_parse.split_pin, recipe.cuda_toolkit) if name.startswith("nvidia-")}


def selection(pins: dict[str, lock_parse.Pin], present: dict[str, str], stack: set[str],
              always: frozenset[str] | set[str] = frozenset()) -> list[Staged]:
    """The pins to stage: those the H200 lacks at the lock's version, `always`, and torch's
    NVIDIA libraries whenever torch itself is staged (those the H200 has not carried: `COPIED`)."""
    chosen = {}
    for name, pin in sorted(pins.items()):
        found = present.get(name)
        if not has(present, name, pin.version):
            chosen[name] = Staged(name, pin.version, pin.hashes, f"the H200 has {found}" if found else "not on the H200")
        elif name in always:
            chosen[name] = Staged(name, pin.version, pin.hashes, "on the H200, staged for the toolchain's CUDA home")
    if "torch" in chosen:
        for name in sorted(stack - set(chosen)):
            chosen[name] = Staged(name, pins[name].version, pins[name].hashes, COPIED, carried=False)
    return [chosen[name] for name in sorted(chosen)]


def plan(recipe: Recipe, present: dict[str, str]) -> list[Staged]:
    via = lock_parse.parse_via(_read_lock(lock.common_lock(recipe, ARCH)))
    pins = needed(recipe)
    locked = {(name, p.version) for name, p in pins.items()}
    missing = [pin for pin in (*recipe.cuda_toolkit, *recipe.cluster_packages) if lock_parse.split_pin(pin) not in locked]
    if missing:
        raise StageError(f"the {recipe.vllm_version} locks lack the recipe's {', '.join(missing)}; "
                         f"run `{lock.lock_command(recipe.vllm_version)}`", status.DRIFT)
    return selection(pins, present, torch_stack(via), toolkit_wheels(recipe))


# --- download, verify, bundle --------------------------------------------------------------


def download(staged: list[Staged], recipe: Recipe, cache: Path) -> dict[str, Path]:
    """{name: wheel file} of every carried pin, each file's sha256 one of the lock's for it.
    vLLM is the recipe's wheel (its sha256 is the lock's only hash for it); pip fetches the rest
    with --require-hashes, and each file is hashed again here."""
    cache.mkdir(parents=True, exist_ok=True)
    others = [s for s in staged if s.carried and s.name != lock.VLLM]
    if others:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="stage-", delete=False) as f:
            f.write("".join(f"{s.name}=={s.version} " + " ".join(f"--hash=sha256:{h}" for h in sorted(s.hashes))
                            + "\n" for s in others))
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--require-hashes",
                            "--only-binary=:all:", "--index-url", wheels.PYPI_SIMPLE, *platform_args(),
                            "-d", str(cache), "-r", f.name], check=True)
        except subprocess.CalledProcessError as exc:
            raise StageError(f"pip download failed (exit {exc.returncode}, its message above); "
                             "a hash mismatch there means the index no longer serves the locked file: "
                             f"re-lock with `{lock.lock_command(recipe.vllm_version)}`") from exc
        finally:
            Path(f.name).unlink()
    files = {s.name: verified_wheel(cache, s) for s in others}
    if any(s.name == lock.VLLM for s in staged):
        vllm = recipe.wheel(ARCH)
        files[lock.VLLM] = wheels.ensure_wheel(vllm.filename, vllm.sha256)
    return files


def verified_wheel(cache: Path, staged: Staged) -> Path:
    """The one wheel of staged.name==version in `cache` whose sha256 the lock lists."""
    candidates = [p for p in cache.glob("*.whl") if wheels.project_of(p.name) == staged.name
                  and wheels.canonical_version(wheels.distribution_version(p.name) or "")
                  == wheels.canonical_version(staged.version)]
    good = [p for p in candidates if wheels.sha256_file(p) in staged.hashes]
    if len(good) != 1:
        found = ", ".join(f"{p.name} (sha256 {wheels.sha256_file(p)})" for p in candidates) or "none"
        raise StageError(f"{cache}: expected one wheel of {staged.name}=={staged.version} with a sha256 of the "
                         f"lock's {len(staged.hashes)}, found {len(good)} among: {found}; delete those files and "
                         "stage again (pip downloads the locked file)")
    return good[0]


class _Parts:
    """A file-like sink that writes part_bytes-sized parts and hashes the whole stream and each
    part, so the bundle is never on disk twice."""

    def __init__(self, out: Path, part_bytes: int):
        self.out, self.part_bytes, self.digest, self.size = out, part_bytes, hashlib.sha256(), 0
        self.paths: list[Path] = []
        self.part_digests: list = []
        self._file: BinaryIO | None = None

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            file = self._file
            if file is None or file.tell() == self.part_bytes:
                file = self._next()
            take = min(len(view), self.part_bytes - file.tell())
            file.write(view[:take])
            self.digest.update(view[:take])
            self.part_digests[-1].update(view[:take])
            self.size += take
            view = view[take:]
        return len(data)

    def _next(self) -> BinaryIO:
        """Close the part being written and open the next: the file now written."""
        self.close()
        self.paths.append(self.out / f"{BUNDLE}.part{len(self.paths):02d}")
        self.part_digests.append(hashlib.sha256())
        self._file = file = self.paths[-1].open("wb")
        return file

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def selection_text(staged: list[Staged], files: dict[str, Path]) -> str:
    return "".join(f"{s.name}=={s.version}  {files[s.name].name if s.carried else FROM_H200}  {s.why}\n"
                   for s in staged)


def write_stage(staged: list[Staged], files: dict[str, Path], out: Path, part_bytes: int) -> _Parts:
    """out/bundle.tar.partNN, out/selection.txt (what the bundle holds) and out/SHA256SUMS (each
    part's sha256, checked as it arrives on the device, the reassembled bundle's and the
    selection's, for `sha256sum -c`)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob(f"{BUNDLE}.part*"), out / SUMS, out / SELECTION]:
        old.unlink(missing_ok=True)
    parts = _Parts(out, part_bytes)
    try:
        # typeshed asks any fileobj for read, tell and seek; a stream ("w|") only writes to it.
        with tarfile.open(fileobj=parts, mode="w|") as tar:  # type: ignore[call-overload]
            for s in staged:
                if s.carried:
                    tar.add(files[s.name], arcname=files[s.name].name)
    finally:
        parts.close()
    text = selection_text(staged, files)
    (out / SELECTION).write_text(text)
    sums = [(d.hexdigest(), path.name) for d, path in zip(parts.part_digests, parts.paths, strict=True)]
    sums += [(parts.digest.hexdigest(), BUNDLE), (wheels.sha256_bytes(text.encode()), SELECTION)]
    (out / SUMS).write_text("".join(f"{digest}  {name}\n" for digest, name in sums))
    return parts


# --- on the device: does the bundle cover the base on this H200? --------------------------


def parse_selection(text: str, where: str = SELECTION) -> dict[str, tuple[str, str]]:
    """{name: (version, wheel filename)} of a bundle's selection.txt; the filename is `FROM_H200`
    for a pin the H200's installed copy stands for. The file rides to the device with the
    bundle: a line selection_text would not write is refused (StageError, USAGE), not guessed at."""
    found: dict[str, tuple[str, str]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = SELECTION_LINE.fullmatch(line.strip())
        if not match or (name := lock_parse.normalize(match[1])) in found:
            raise StageError(f"{where}:{number}: expected `name==version  <wheel file or {FROM_H200}>  <why>`, one "
                             f"line per pin, as staging writes it; found {line.strip()!r}. Re-stage "
                             "(`python3 scripts/stage_h200_wheels.py`) and carry the new parts", status.USAGE)
        found[name] = (match[2], match[3])
    return found


def unsupported(filenames: list[str]) -> list[str]:
    """The wheels whose tags this Python does not accept (pip would refuse them)."""
    try:
        from packaging.tags import sys_tags
        from packaging.utils import parse_wheel_filename
    except ImportError:  # pip's own copy, always there where pip is
        # The same functions; mypy sees another module's types (pip's vendored packaging).
        from pip._vendor.packaging.tags import sys_tags  # type: ignore[assignment]
        from pip._vendor.packaging.utils import parse_wheel_filename  # type: ignore[assignment]
    accepted = set(sys_tags())
    return [f for f in filenames if not set(parse_wheel_filename(f)[3]) & accepted]


def record_changes(recorded: dict[str, str], real: dict[str, str]) -> list[str]:
    """How this H200's packages differ from the record staging used."""
    return sorted([f"{n}: recorded {v}, here {real[n]}" for n, v in recorded.items() if n in real and real[n] != v]
                  + [f"{n}: recorded {v}, not here" for n, v in recorded.items() if n not in real]
                  + [f"{n}: not recorded, here {v}" for n, v in real.items() if n not in recorded])


def check_freeze(recipe: Recipe, real: dict[str, str], recorded: dict[str, str],
                 staged: dict[str, tuple[str, str]] | None) -> tuple[list[str], list[str]]:
    """(report lines, problems): this H200's packages against the record staging used; with the
    bundle's selection, every pin of the base neither in the bundle nor on the H200 at its
    version, and every staged wheel this Python would refuse. A change from the record is a
    problem only where it leaves a pin uncovered."""
    changes = record_changes(recorded, real)
    report = [f"this H200: {len(real)} packages; " + (f"{len(changes)} differ from the record staging used:"
                                                      if changes else "the same as the record staging used"),
              *(f"  {line}" for line in changes)]
    if staged is None:
        return report + ["no selection.txt given: the bundle's coverage was not checked"], []
    pins = needed(recipe)
    # A pin listed as the H200's copy is covered only where the H200 has it (dist_copy copies it).
    bundled = {n: (v, f) for n, (v, f) in staged.items() if f != FROM_H200}
    uncovered = sorted(f"{n}=={p.version}: neither in the bundle nor on the H200"
                       + (f" (it has {real[n]})" if n in real else "")
                       for n, p in pins.items()
                       if bundled.get(n, ("",))[0] != p.version and not has(real, n, p.version))
    refused = [f"{f}: this Python accepts none of its tags (staging assumed Python {PYTHON}, glibc "
               f"{'.'.join(map(str, H200_GLIBC))}: H200_GLIBC in {Path(__file__).name})"
               for f in unsupported([f for _, f in bundled.values()])]
    copied = len(staged) - len(bundled)
    report.append(f"vLLM {recipe.vllm_version}: {len(pins)} pins; {len(bundled)} in the bundle, {copied} copied "
                  f"from the H200's venv into the site, {len(pins) - len(staged) - len(uncovered)} on the H200 only, "
                  f"{len(uncovered)} in neither; {len(refused)} staged wheels this Python refuses")
    return report, uncovered + refused


# --- command line --------------------------------------------------------------------------


def read_record(freeze: Path) -> dict[str, str]:
    try:
        return parse_freeze(freeze.read_text(), str(freeze))
    except FileNotFoundError as exc:
        raise StageError(f"expected the H200's `pip list --format=freeze` at {freeze}; the inventory phase "
                         "(`python3 scripts/gpu_validation.py inventory`) writes it", status.REFUSED) from exc


def present_on_h200(freeze: Path) -> tuple[dict[str, str], str]:
    return read_record(freeze), f"the H200's recorded `pip list` ({_shown(freeze)})"


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def repository_bytes(repo: Path) -> int:
    """What a device call carries of the repository: its tracked and untracked-not-ignored files."""
    try:
        listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise StageError(f"{repo}: cannot list the files a device call carries (git ls-files): {exc}; "
                         "stage from a git checkout of the repository") from None
    paths = (repo / name for name in listed.decode().split("\0") if name)
    return sum(path.stat().st_size for path in paths if path.is_file())


def part_bytes(repo_bytes: int) -> int:
    """The largest part (in whole MB) that fits one call beside the repository."""
    room = (CARRY_LIMIT - CARRY_HEADROOM - repo_bytes) // 1_000_000 * 1_000_000
    if room < MIN_PART_BYTES:
        raise StageError(
            f"a device call carries at most {CARRY_LIMIT // 2**20} MiB; the repository takes "
            f"{repo_bytes / 1e6:.1f} MB, leaving {max(room, 0) / 1e6:.0f} MB for a part (expected at least "
            f"{MIN_PART_BYTES / 1e6:.0f} MB): remove large untracked files or move them under a git-ignored path")
    return room


def stage(recipe: Recipe, freeze: Path, cache: Path, out: Path) -> int:
    size = part_bytes(repository_bytes(REPO))
    present, source = present_on_h200(freeze)
    staged = plan(recipe, present)
    files = download(staged, recipe, cache)
    directory = out / f"vllm-{recipe.vllm_version}"
    parts = write_stage(staged, files, directory, size)
    print(f"vLLM {recipe.vllm_version}: {sum(s.carried for s in staged)} wheels (against {source}; "
          f"{sum(not s.carried for s in staged)} more copied from the H200's installation), {parts.size / 1e6:.0f} MB "
          f"in {len(parts.paths)} parts of {size / 1e6:.0f} MB under {directory}; carry one part per device call "
          f"({SUMS} and {SELECTION} with the first)")
    return status.SUCCESS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", metavar="VERSION", help="the recipe's base to stage (default: its default)")
    parser.add_argument("--h200-freeze", type=Path, metavar="FILE", default=H200_RECORD,
                        help="the H200's `pip list --format=freeze` to stage against (default: the committed "
                             f"record, {_shown(H200_RECORD)}; the inventory phase writes a new one)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--plan", action="store_true", help="print the selection, download nothing")
    mode.add_argument("--check-freeze", type=Path, metavar="FREEZE",
                      help="on the device: compare this `pip list --format=freeze` with the record (--h200-freeze), "
                           "and with --staged check that bundle + H200 hold every pin of the base")
    parser.add_argument("--staged", type=Path, metavar="SELECTION", help=f"the bundle's {SELECTION} (--check-freeze)")
    parser.add_argument("--cache", type=Path, default=wheels.cache_dir() / "h200-wheels")
    parser.add_argument("--out", type=Path, default=REPO / ".stage")
    args = parser.parse_args(argv)
    try:
        recipe = load_recipe(vllm=args.vllm)
        if args.check_freeze:
            return _check(recipe, args.check_freeze, args.h200_freeze, args.staged)
        if args.plan:
            present, source = present_on_h200(args.h200_freeze)
            staged = plan(recipe, present)
            print(f"vLLM {recipe.vllm_version}: {sum(s.carried for s in staged)} wheels to stage and "
                  f"{sum(not s.carried for s in staged)} to copy from the H200's installation, against {source}")
            print("".join(f"{s.name}=={s.version}  # {s.why}\n" for s in staged), end="")
            return status.SUCCESS
        return stage(recipe, args.h200_freeze, args.cache, args.out)
    except (StageError, RecipeError, lock.LockError, wheels.WheelError) as exc:
        print(f"stage: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        print(f"stage: {exc}", file=sys.stderr)
        return status.ENVIRONMENT


def _check(recipe: Recipe, freeze: Path, record: Path, selection_file: Path | None) -> int:
    staged = parse_selection(selection_file.read_text(), str(selection_file)) if selection_file else None
    report, problems = check_freeze(recipe, read_record(freeze), read_record(record), staged)
    print("\n".join(report))
    if problems:
        print(f"expected the bundle and this H200 to hold every pin of vLLM {recipe.vllm_version}, found:\n  "
              + "\n  ".join(problems)
              + f"\nStage against this record (here, not on the device): `python3 scripts/stage_h200_wheels.py "
                f"--vllm {recipe.vllm_version} --h200-freeze h200-pip-freeze.txt` (or commit it as "
                f"{_shown(H200_RECORD)} with its header) and carry the new parts",
              file=sys.stderr)
        return status.FAILED
    print("INVENTORY: " + ("the bundle and this H200 hold every pin of the base" if staged is not None
                           else "recorded; the bundle's coverage not checked (no --staged)"))
    return status.SUCCESS


if __name__ == "__main__":
    sys.exit(main())
