"""The check of recipes/bugs/ against a base's pinned artefacts (`python3 scripts/recipe.py
check`): each bug's recorded decision against the base's locks and, online, against the source
of the pinned wheels; and the serving recipes' use of the bugs. Build-time code: it reads the
locks, which the image does not carry; the bug model itself is dsa_image.serving.workarounds."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Mapping

from dsa_image.build import lock, lock_parse
from dsa_image.core import wheels
from dsa_image.core.recipe import RECIPES_DIR, Recipe
from dsa_image.serving.recipes import bug_usage_problems
from dsa_image.serving.workarounds import (Bug, BugError, Source, load_bugs, source_problem, source_verdict,
                                           version_problem, wheel_members)


# -- the check of one base -----------------------------------------------------------------


def pinned(build: Recipe, package: str) -> tuple[str, frozenset[str]]:
    """(version, sha256s) of `package` in the locks of `build`'s base; one version across them."""
    name = lock_parse.normalize(package)
    found: dict[str, set[str]] = {}
    for job in lock.lock_jobs(build):
        path = lock.REPO_ROOT / job.output
        if job.arch is None or not path.is_file():
            continue
        pin = lock_parse.parse_lock(path.read_text()).get(name)
        if pin is not None:
            found.setdefault(pin.version, set()).update(pin.hashes)
    if len(found) != 1:
        raise BugError(f"{package}: the locks of vLLM {build.vllm_version} pin "
                       f"{', '.join(sorted(found)) or 'no version of it'}; expected one version")
    (version, hashes), = found.items()
    return version, frozenset(hashes)


def _wheel_preference(filename: str) -> tuple[int, str]:
    """Pure wheels first, then x86_64 ones (sources are the same in every platform's wheel)."""
    return (0 if filename.endswith("-none-any.whl") else 1 if "x86_64" in filename else 2), filename


def pinned_wheel(build: Recipe, package: str) -> Path:
    """The wheel of `package` the base's locks pin (a file of the index with a locked sha256),
    downloaded once into the cache and verified on every use."""
    version, hashes = pinned(build, package)
    files = sorted((f for f in wheels.index_files(package) if f.sha256 in hashes and f.filename.endswith(".whl")),
                   key=lambda f: _wheel_preference(f.filename))
    if not files:
        raise BugError(f"{package}=={version}: no wheel of the index has a sha256 the locks of vLLM "
                       f"{build.vllm_version} carry; re-run `python3 scripts/recipe.py lock --vllm "
                       f"{build.vllm_version}`")
    return wheels.ensure_wheel(files[0].filename, files[0].sha256)


def base_problems(bugs: Mapping[str, Bug], build: Recipe, online: bool,
                  wheel_for: Callable[[Recipe, str], Path] = pinned_wheel) -> list[str]:
    """Every bug's decision for `build`'s base against that base's locks (and, online, against
    the source of the pinned wheels)."""
    base, problems = build.vllm_version, []
    fetched: dict[str, Path] = {}  # one download and hash per package

    def members(bug: Bug, source: Source) -> tuple[Iterable[tuple[str, str]], str]:
        """The members of the wheel `bug.package` pinned that `source` (bug.source) reads."""
        if bug.package not in fetched:
            fetched[bug.package] = wheel_for(build, bug.package)
        return wheel_members(fetched[bug.package], source.files), fetched[bug.package].name

    for bug in bugs.values():
        stale = sorted(set(bug.bases) - set(build.vllm_versions))
        if stale:
            problems.append(f"{bug.path}: decisions for vLLM {', '.join(stale)}, which the build recipe does not pin; "
                            "remove them")
        version, _ = pinned(build, bug.package)
        if base not in bug.bases:
            found = ""
            if online and bug.source is not None:
                found = "; its source says: " + " ".join(source_verdict(bug.source, members(bug, bug.source)[0]))
            problems.append(f'{bug.path}: no [bases."{base}"] decision ({bug.package} {version} pinned{found}); '
                            f"record pinned and verdict (`python3 scripts/recipe.py check --online --vllm {base}` "
                            "reads the source)")
            continue
        problem = version_problem(bug, base, version)
        if problem is None and online and bug.source is not None:
            problem = source_problem(bug, base, *members(bug, bug.source))
        if problem:
            problems.append(problem)
    return problems


def check(build: Recipe, recipes_dir: Path = RECIPES_DIR, online: bool = False,
          wheel_for: Callable[[Recipe, str], Path] = pinned_wheel) -> list[str]:
    """`scripts/recipe.py check`'s part: the bug files against `build`'s base, and the serving
    recipes' use of them (a workaround or limitation that holds on no base)."""
    try:
        bugs = load_bugs(recipes_dir)
        return base_problems(bugs, build, online, wheel_for) + bug_usage_problems(recipes_dir, build)
    except BugError as exc:
        return [str(exc)]
