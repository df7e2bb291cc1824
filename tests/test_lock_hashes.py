"""Every hash in a lock traces back to an artefact: the vLLM wheel `lock` downloaded (the
recipe's sha256) or a file the index lists for that name==version.

Offline (`scripts/recipe.py check`, `lock_check.lock_problems`): the vllm pin carries exactly the
recipe's wheel sha256 for the lock's arch; a release carries the same hashes in every lock; each
lock has the sha256 `lock` recorded in its directory's SHA256SUMS; a lock has only lines uv writes.
The locks checked are the default base's (and the dev lock every base shares).
Online (`check --online`, `lock_check.online_problems`): every hash is a file of that release on the
index. The edits below are made to copies of the real locks, with hashes derived from real ones.
The tests that reach the index (and uv's) are marked `wheel`, like the repository's other
tests that need PyPI.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dsa_image.build import lock, lock_check, lock_parse
from dsa_image.core import wheels
from dsa_image.build.lock_parse import parse_lock
from dsa_image.core.recipe import load_recipe, set_sdist_sha256, set_wheel_sha256

REPO = Path(__file__).resolve().parent.parent
RECIPE = load_recipe()
AMD64_LOCKS = [lock.common_lock(RECIPE, "amd64"), lock.target_lock(RECIPE, RECIPE.target("sm120"), "amd64")]
ARM64_LOCKS = [lock.common_lock(RECIPE, "arm64"), lock.target_lock(RECIPE, RECIPE.target("sm120"), "arm64")]
ARCH_LOCKS = [(job.output, job.arch) for job in lock.lock_jobs(RECIPE) if job.arch]
REGENERATE = f"run `{lock.lock_command(RECIPE.vllm_version)}` (never edit a lock by hand)"



def copy_locks(root: Path) -> Path:
    """recipes/locks/ (every lock and SHA256SUMS) copied under `root`."""
    shutil.copytree(REPO / lock.LOCKS_DIR, root / lock.LOCKS_DIR)
    return root


def derived(digest: str) -> str:
    """A well-formed sha256 that no file has: the sha256 of `digest`'s bytes."""
    return hashlib.sha256(bytes.fromhex(digest)).hexdigest()


def pin_of(path: Path, name: str, root: Path = REPO) -> lock_parse.Pin:
    return parse_lock((root / path).read_text())[name]


def line_of(root: Path, path: Path, text: str) -> int:
    """1-based number of the first line of `path` that starts with `text`."""
    return next(n for n, line in enumerate((root / path).read_text().splitlines(), 1) if line.startswith(text))


def replace(root: Path, path: Path, old: str, new: str) -> None:
    text = (root / path).read_text()
    assert text.count(old) == 1, f"{path}: {old!r} occurs {text.count(old)} times"
    (root / path).write_text(text.replace(old, new))


def sums_line(path: Path) -> tuple[int, str]:
    """(line number, recorded sha256) of `path` in the committed SHA256SUMS of its directory."""
    sums = lock.sums_file(path.parent)
    for number, line in enumerate((REPO / sums).read_text().splitlines(), 1):
        digest, _, name = line.partition("  ")
        if name == path.name:
            return number, digest
    raise AssertionError(f"{sums} has no line for {path.name}")


def sums_problem(root: Path, path: Path) -> str:
    number, recorded = sums_line(path)
    found = hashlib.sha256((root / path).read_bytes()).hexdigest()
    return (f"{path}: its sha256 is {found}, {lock.sums_file(path.parent)}:{number} records {recorded} as `lock` wrote it: "
            f"the lock changed since. `{lock.CHECK_ONLINE_COMMAND}` names every hash the index does not list; "
            f"{REGENERATE}")


# --- the committed locks ----------------------------------------------------------------------


@pytest.mark.parametrize("path, arch", ARCH_LOCKS)
def test_vllm_pin_carries_exactly_the_recipe_wheel(path, arch):
    assert pin_of(path, "vllm").hashes == {RECIPE.wheel(arch).sha256}


def test_sha256sums_records_every_lock():
    sums = lock.lock_sums(RECIPE)
    assert list(sums) == [lock.sums_file(lock.locks_dir(RECIPE)), lock.sums_file(lock.LOCKS_DIR)]
    for path, text in sums.items():
        assert (REPO / path).read_text() == text
        listed = [line.partition("  ")[2] for line in text.splitlines()]
        assert listed == [p.name for p in lock.expected_locks(RECIPE) if p.parent == path.parent]


def test_every_release_has_the_same_hashes_in_every_lock():
    seen: dict[tuple[str, str], frozenset[str]] = {}
    for path in lock.expected_locks(RECIPE):
        for pin in lock_check.scan_lock((REPO / path).read_text(), path)[0]:
            if pin.name != "vllm":
                assert seen.setdefault((pin.name, pin.version), pin.pin.hashes) == pin.pin.hashes, (path, pin.name)
    assert len(seen) > 200


# --- offline: `check` notices hand edits ------------------------------------------------------


def test_same_hash_edited_in_both_amd64_locks(tmp_path):
    root = copy_locks(tmp_path)
    torch = pin_of(lock.common_lock(RECIPE, "amd64"), "torch")
    old = min(torch.hashes)
    new = derived(old)
    for path in AMD64_LOCKS:
        replace(root, path, f"--hash=sha256:{old}", f"--hash=sha256:{new}")
    problems = lock_check.lock_problems(RECIPE, root=root)
    assert any(new in problem for problem in problems), f"check did not notice --hash=sha256:{new}: {problems}"
    places = {path: f"{path}:{line_of(root, path, f'torch=={torch.version} ')}" for path in AMD64_LOCKS + ARM64_LOCKS}
    inconsistent = (
        f"torch=={torch.version} has different hashes in different locks, where `lock` writes the same ones "
        f"(one per file the index lists for that release): "
        f"{places[AMD64_LOCKS[0]]}, {places[AMD64_LOCKS[1]]} have --hash=sha256:{new}; "
        f"{places[ARM64_LOCKS[0]]}, {places[ARM64_LOCKS[1]]} have --hash=sha256:{old}. "
        f"`{lock.CHECK_ONLINE_COMMAND}` names the one the index does not list; {REGENERATE}")
    assert problems == [sums_problem(root, AMD64_LOCKS[0]), sums_problem(root, AMD64_LOCKS[1]), inconsistent]
    # SHA256SUMS rewritten to match the edit: the arm64 locks still disagree.
    lock.write_lock_sums(RECIPE, root)
    assert lock_check.lock_problems(RECIPE, root=root) == [inconsistent]


@pytest.mark.parametrize("extra", ["other arch's wheel", "no file"])
def test_extra_hash_on_the_vllm_pin(tmp_path, extra):
    """Added to the vllm pin of every lock alike, and SHA256SUMS rewritten: still an error."""
    root = copy_locks(tmp_path)
    expected = []
    for path, arch in ARCH_LOCKS:
        own = RECIPE.wheel(arch).sha256
        other = RECIPE.wheel("arm64" if arch == "amd64" else "amd64").sha256 if extra == "other arch's wheel" else derived(own)
        replace(root, path, f"\nvllm=={RECIPE.vllm_version} \\\n",
                f"\nvllm=={RECIPE.vllm_version} \\\n    --hash=sha256:{other} \\\n")
        line = line_of(root, path, f"vllm=={RECIPE.vllm_version} ") + 1
        expected.append(
            f"{path}:{line}: vllm=={RECIPE.vllm_version} carries --hash=sha256:{other}, expected only "
            f"--hash=sha256:{own} (the recipe's {RECIPE.wheel(arch).filename}, hashed from the file `lock` "
            f"downloaded): any other hash widens what `pip install --require-hashes` accepts; {REGENERATE}")
    problems = lock_check.lock_problems(RECIPE, root=root)
    assert all(problem in problems for problem in expected), problems
    lock.write_lock_sums(RECIPE, root)
    assert lock_check.lock_problems(RECIPE, root=root) == expected


def test_changed_hash_in_dev_lock(tmp_path):
    root = copy_locks(tmp_path)
    pytest_pin = pin_of(lock.DEV_LOCK, "pytest")
    old = min(pytest_pin.hashes)
    replace(root, lock.DEV_LOCK, old, derived(old))  # a pin only dev.txt has: SHA256SUMS notices
    problems = lock_check.lock_problems(RECIPE, root=root)
    assert problems, "check did not notice the edited dev.txt"
    assert problems == [sums_problem(root, lock.DEV_LOCK)]


def test_changed_hash_of_a_shared_release_in_dev_lock(tmp_path):
    root = copy_locks(tmp_path)
    packaging = pin_of(lock.DEV_LOCK, "packaging")
    assert pin_of(lock.common_lock(RECIPE, "amd64"), "packaging") == packaging
    old = min(packaging.hashes)
    replace(root, lock.DEV_LOCK, old, derived(old))
    assert lock_check.lock_problems(RECIPE, root=root), "check did not notice the edited dev.txt"
    lock.write_lock_sums(RECIPE, root)  # as if SHA256SUMS had been edited too
    problems = lock_check.lock_problems(RECIPE, root=root)
    assert len(problems) == 1
    assert problems[0].startswith(
        f"packaging=={packaging.version} has different hashes in different locks, where `lock` writes the same "
        f"ones (one per file the index lists for that release): "
        f"{lock.DEV_LOCK}:{line_of(root, lock.DEV_LOCK, 'packaging==')} has --hash=sha256:{derived(old)}; ")
    assert f"have --hash=sha256:{old}." in problems[0]


def _inline_hash(text: str, digest: str) -> str:
    return text.replace(f"\npytest=={pin_of(lock.DEV_LOCK, 'pytest').version} \\\n",
                        f"\npytest=={pin_of(lock.DEV_LOCK, 'pytest').version} --hash=sha256:{derived(digest)} \\\n")


def _sha512_line(text: str, digest: str) -> str:
    version = pin_of(lock.DEV_LOCK, "pytest").version
    sha512 = hashlib.sha512(bytes.fromhex(digest)).hexdigest()
    return text.replace(f"\npytest=={version} \\\n", f"\npytest=={version} \\\n    --hash=sha512:{sha512} \\\n")


def _index_option(text: str, digest: str) -> str:
    lines = text.splitlines(keepends=True)
    return "".join(lines[:2] + ["--extra-index-url https://example.invalid/simple\n"] + lines[2:])


def _duplicate(text: str, digest: str) -> str:
    version = pin_of(lock.DEV_LOCK, "pytest").version
    return text + f"pytest=={version} \\\n    --hash=sha256:{derived(digest)}\n"


@pytest.mark.parametrize("edit, line_text, message", [
    (_inline_hash, "pytest==", "is not a line `uv pip compile --generate-hashes` writes"),
    (_sha512_line, "    --hash=sha512:", "is not a line `uv pip compile --generate-hashes` writes (pip joins it"),
    (_index_option, "--extra-index-url", "is not a line `uv pip compile --generate-hashes` writes:"),
    (_duplicate, None, "a second requirement for pytest (the first is on line"),
])
def test_lines_uv_does_not_write_are_refused(tmp_path, edit, line_text, message):
    """pip reads these lines; `check` must not skip them (SHA256SUMS rewritten to match)."""
    root = copy_locks(tmp_path)
    digest = min(pin_of(lock.DEV_LOCK, "pytest").hashes)
    (root / lock.DEV_LOCK).write_text(edit((root / lock.DEV_LOCK).read_text(), digest))
    assert lock_check.lock_problems(RECIPE, root=root), "check did not notice the edited dev.txt"
    lock.write_lock_sums(RECIPE, root)
    lines = (root / lock.DEV_LOCK).read_text().splitlines()
    number = len(lines) - 1 if line_text is None else next(
        n for n, line in enumerate(lines, 1) if line.startswith(line_text) and (line_text != "pytest==" or "--hash" in line))
    problems = lock_check.lock_problems(RECIPE, root=root)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{lock.DEV_LOCK}:{number}: ") and message in problems[0], problems[0]
    assert problems[0].endswith(REGENERATE)


def test_scan_lock_reads_what_uv_writes():
    text = (REPO / lock.DEV_LOCK).read_text()
    pins, problems = lock_check.scan_lock(text, lock.DEV_LOCK)
    assert problems == []
    assert {p.name: p.pin for p in pins if not p.marker or p.name != "numpy"} == {
        n: p for n, p in parse_lock(text).items() if n != "numpy"}
    numpy = [(p.version, p.marker) for p in pins if p.name == "numpy"]  # universal: one pin per marker
    assert len(numpy) == 2 and numpy[0][1] != numpy[1][1]


# --- `lock` itself: hashes from the index, vllm narrowed to the recipe's wheel ----------------


def test_resolver_seed_keeps_versions_not_hashes():
    text = (REPO / lock.DEV_LOCK).read_text()
    seed = lock.resolver_seed(text)
    assert "--hash" not in seed and "\\" not in seed
    pins, _ = lock_check.scan_lock(text, lock.DEV_LOCK)
    expected = [f"{p.name}=={p.version}" + (f" ; {p.marker}" if p.marker else "") for p in pins]
    assert [lock_parse.normalize(line.split("==")[0]) + "==" + line.split("==", 1)[1] for line in seed.splitlines()] == expected


@pytest.mark.parametrize("path, arch", ARCH_LOCKS)
def test_pin_vllm_wheel_narrows_what_uv_writes(path, arch):
    """uv writes a hash per file of the release (both wheels, the sdist); `lock` keeps the
    recipe's wheel only, which gives exactly the committed lock."""
    committed = (REPO / path).read_text()
    own = RECIPE.wheel(arch).sha256
    others = sorted({w.sha256 for w in RECIPE.wheels.values()} - {own} | {derived(own)})
    widened = committed.replace(
        f"    --hash=sha256:{own}\n",
        "".join(f"    --hash=sha256:{h} \\\n" for h in sorted([own, *others])[:-1]) + f"    --hash=sha256:{sorted([own, *others])[-1]}\n")
    assert widened != committed
    assert lock.pin_vllm_wheel(widened, RECIPE.wheel(arch), path) == committed
    without = widened.replace(f"    --hash=sha256:{own} \\\n", "").replace(f"    --hash=sha256:{own}\n", "")
    with pytest.raises(lock.LockError, match=f"no file with the recipe's {RECIPE.wheel(arch).filename} sha256 {own}"):
        lock.pin_vllm_wheel(without, RECIPE.wheel(arch), path)


@pytest.mark.parametrize("uv", ["false", "/nonexistent/uv"])
def test_a_failed_resolve_leaves_the_lock_as_it_was(tmp_path, uv):
    root = copy_locks(tmp_path)
    job = next(j for j in lock.lock_jobs(RECIPE) if j.output == lock.common_lock(RECIPE, "amd64"))
    with pytest.raises((lock.LockError, OSError)):
        lock.resolve(job, RECIPE, shutil.which(uv) or uv, root)
    assert (root / job.output).read_bytes() == (REPO / job.output).read_bytes()


@pytest.mark.wheel
def test_lock_replaces_hand_edited_hashes(tmp_path):
    """uv reuses the hashes of the lock it overwrites; `lock` must not: a widened vllm pin and an
    edited torch hash are gone after resolving again (versions kept)."""
    root = copy_locks(tmp_path)
    shutil.copytree(REPO / lock.REQUIREMENTS_DIR, root / lock.REQUIREMENTS_DIR)
    path = lock.common_lock(RECIPE, "amd64")
    torch = pin_of(path, "torch")
    old = min(torch.hashes)
    replace(root, path, old, derived(old))
    replace(root, path, f"\nvllm=={RECIPE.vllm_version} \\\n",
            f"\nvllm=={RECIPE.vllm_version} \\\n    --hash=sha256:{RECIPE.wheel('arm64').sha256} \\\n")
    job = next(j for j in lock.lock_jobs(RECIPE) if j.output == path)
    lock.resolve(job, RECIPE, lock.find_uv(), root)
    resolved = parse_lock((root / path).read_text())
    assert resolved["vllm"].hashes == {RECIPE.wheel("amd64").sha256}
    assert resolved["torch"] == torch
    assert {n: p.version for n, p in resolved.items()} == {n: p.version for n, p in parse_lock((REPO / path).read_text()).items()}


# --- online: every hash is a file the index lists for its pin ---------------------------------


@pytest.mark.wheel
@pytest.mark.parametrize("version", RECIPE.vllm_versions)
def test_cli_check_online_passes(version):
    """The full online check of every committed lock of each base (about 15 s: one index page
    per project)."""
    done = subprocess.run([sys.executable, str(REPO / "scripts/recipe.py"), "check", "--online", "--vllm", version],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "every lock hash is a file the index lists for its pin" in done.stderr


@pytest.mark.wheel
def test_online_names_a_hash_the_index_does_not_list(tmp_path):
    """The same edit everywhere, SHA256SUMS rewritten: offline cannot tell, the index can."""
    root = copy_locks(tmp_path)
    pin = pin_of(lock.DEV_LOCK, "pytest")
    old = min(pin.hashes)
    replace(root, lock.DEV_LOCK, old, derived(old))
    lock.write_lock_sums(RECIPE, root)
    assert lock_check.lock_problems(RECIPE, root=root) == []
    problems = lock_check.online_problems(RECIPE, root=root, paths=[lock.DEV_LOCK])
    line = line_of(root, lock.DEV_LOCK, f"    --hash=sha256:{derived(old)}")
    assert len(problems) == 1
    assert problems[0].startswith(
        f"{lock.DEV_LOCK}:{line}: pytest=={pin.version} carries --hash=sha256:{derived(old)}, which is not a "
        f"file of pytest=={pin.version}: https://pypi.org/simple/pytest/ lists no file with that sha256. "
        f"Expected only hashes of the files https://pypi.org/simple/pytest/ lists for that release (")
    assert all(f"sha256 {h}" in problems[0] for h in pin.hashes)  # what was expected, in full
    assert problems[0].endswith(REGENERATE)


@pytest.mark.wheel
def test_online_flags_a_file_of_another_release(tmp_path):
    root = copy_locks(tmp_path)
    pin = pin_of(lock.DEV_LOCK, "pytest")
    files = wheels.index_files("pytest")
    other = next(f for f in files if wheels.distribution_version(f.filename) not in (None, pin.version))
    kept = min(pin.hashes)
    replace(root, lock.DEV_LOCK, f"    --hash=sha256:{kept} \\\n",
            f"    --hash=sha256:{kept} \\\n    --hash=sha256:{other.sha256} \\\n")
    problems = lock_check.online_problems(RECIPE, root=root, paths=[lock.DEV_LOCK])
    assert len(problems) == 1
    assert (f"carries --hash=sha256:{other.sha256}, which is not a file of pytest=={pin.version}: "
            f"it is {other.filename}, a file of another release.") in problems[0]


@pytest.mark.wheel
def test_online_checks_the_recipe_wheels_against_the_index(tmp_path):
    """A recipe sha256 that is a real vLLM file, but not the one its filename names."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    swapped = RECIPE.wheel("arm64").sha256
    (recipes / RECIPE.path.name).write_text(set_wheel_sha256(RECIPE.path.read_text(), RECIPE.vllm_version, "linux/amd64", swapped))
    edited = load_recipe(RECIPE.id, recipes)
    assert lock_check.online_problems(edited, paths=[]) == [
        f"{edited.path}: vllm.\"{RECIPE.vllm_version}\".wheels.\"linux/amd64\".sha256 is {swapped}, expected {RECIPE.wheel('amd64').sha256}, "
        f"the sha256 https://pypi.org/simple/vllm/ lists for {RECIPE.wheel('amd64').filename}; {REGENERATE}"]


@pytest.mark.wheel
def test_online_checks_the_recipe_sdist_against_the_index(tmp_path):
    """The sdist (upstream's tests) pinned with another vLLM file's sha256: refused online."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    swapped = RECIPE.wheel("amd64").sha256
    (recipes / RECIPE.path.name).write_text(set_sdist_sha256(RECIPE.path.read_text(), RECIPE.vllm_version, swapped))
    edited = load_recipe(RECIPE.id, recipes)
    assert lock_check.online_problems(edited, paths=[]) == [
        f"{edited.path}: vllm.\"{RECIPE.vllm_version}\".sdist.sha256 is {swapped}, expected {RECIPE.sdist.sha256}, "
        f"the sha256 https://pypi.org/simple/vllm/ lists for {RECIPE.sdist.filename}; {REGENERATE}"]


def test_online_check_needs_the_index():
    with pytest.raises(wheels.WheelError, match="cannot read the package index http://127.0.0.1:9/simple/"):
        lock_check.online_problems(RECIPE, paths=[lock.DEV_LOCK], index_url="http://127.0.0.1:9/simple")


def test_distribution_version():
    assert wheels.distribution_version(RECIPE.wheel("amd64").filename) == RECIPE.vllm_version
    assert wheels.distribution_version(f"vllm-{RECIPE.vllm_version}.tar.gz") == RECIPE.vllm_version
    assert wheels.distribution_version("nvidia-cuda-nvcc-13.0.88.zip") == "13.0.88"
    assert wheels.distribution_version("foo-1.0-1-py3-none-any.whl") == "1.0"
    assert wheels.distribution_version("foo-1.0-py2.7.egg") is None
    assert wheels.canonical_version("1.0.0") == wheels.canonical_version("1") == "1"
    assert wheels.canonical_version("2026.01.19.POST1") == "2026.1.19.post1"
