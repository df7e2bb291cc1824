"""Bugs of the pinned artefacts that serving recipes work around, are limited by, or cannot run with.

One file per upstream bug, recipes/bugs/<id>.toml:

    schema = 1
    id = "flashinfer-3610"              # the file's name
    title = "..."                       # what goes wrong, and where
    link = "https://..."                # the bug
    fix = "https://..."                 # the change that fixed it ("" while there is none)
    package = "flashinfer-python"       # the distribution it lives in, as the base's locks pin it
    fixed_in = "0.6.14"                 # the first release of `package` with the fix ("" unknown)
    targets = ["sm120"]                 # the image targets it concerns ([]: every one)
    [source]                            # how it shows in the package's pinned wheel (optional)
    files = "flashinfer/data/..."       # a member of the wheel, or a folder ending in "/"
    code = "..."                        # marks the code the bug lives in (optional)
    before = "..."                      # a line the fix removed (optional)
    after = "..."                       # a line the fix added
    [bases."0.33.0"]                    # the decision for each vLLM base the build recipe pins
    pinned = "0.7.2.post1"              # `package`'s version in that base's locks
    verdict = "fixed"                   # present | fixed | absent (its code is not in the artefact)

A recipe names bugs in its `[env.NAME]` and `[workarounds.SETTING]` entries (`bugs = [...]`:
applied on a base where one of them is present), in `limitations` (what shaped the recipe, e.g.
no decode context parallelism) and in `blockers` (the plan refuses the recipe on a base where
one is present). The verdicts are decisions, and the tools hold them to the artefacts:
`python3 scripts/recipe.py check` (offline: every base has one, `pinned` is the lock's version,
`present` only below `fixed_in` and `fixed` only at or above it, and no recipe keeps a workaround
that applies on no base) and `check --online` (the patterns in the pinned wheel give the
recorded verdict). Patterns match with runs of whitespace collapsed, so one may span lines.

Stdlib only: the image's entrypoint imports this through dsa_image.serving.cli. The check
against a base's locks and wheels is build code: dsa_image.build.bug_check.
"""

from __future__ import annotations

import re
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from dsa_image.core.recipe import RECIPES_DIR
from dsa_image.core import status

BUGS_DIR_NAME = "bugs"
VERDICTS = ("present", "fixed", "absent")
_TOP = {"schema", "id", "title", "link", "fix", "package", "fixed_in", "targets", "source", "bases"}
_SOURCE = {"files", "code", "before", "after"}
_VERSION = re.compile(r"([0-9]+(?:\.[0-9]+)*)(?:(a|b|rc)([0-9]+))?(?:\.post([0-9]+))?(?:\.dev([0-9]+))?")


class BugError(status.DsaImageError):
    """A bug file is malformed, or an artefact cannot be read as its evidence says."""

    exit_code = status.USAGE


@dataclass(frozen=True)
class Source:
    files: str
    code: str
    before: str
    after: str


@dataclass(frozen=True)
class Decision:
    pinned: str
    verdict: str


@dataclass(frozen=True)
class Bug:
    id: str
    path: Path
    title: str
    link: str
    fix: str
    package: str
    fixed_in: str
    targets: tuple[str, ...]
    source: Source | None
    bases: Mapping[str, Decision]

    def present(self, base: str, target: str | None = None) -> bool:
        """Whether the pinned artefacts of `base` have the bug, on image target `target`."""
        decision = self.bases.get(base)
        return (decision is not None and decision.verdict == "present"
                and (target is None or not self.targets or target in self.targets))

    def why(self, base: str) -> str:
        """The recorded evidence for `base`, in words."""
        decision = self.bases.get(base)
        if decision is None:
            return f"no decision for vLLM {base} in {self.path.name}"
        fixed = f", fixed in {self.fixed_in}" if self.fixed_in else ""
        source = ""
        if self.source is not None:
            source = {"present": "; its source has the bug", "fixed": "; its source has the fix",
                      "absent": "; the code the bug lives in is not in it"}[decision.verdict]
        return f"{decision.verdict}: {self.package} {decision.pinned}{fixed}{source}"


# -- loading -------------------------------------------------------------------------------


def bugs_dir(recipes_dir: Path) -> Path:
    return recipes_dir / BUGS_DIR_NAME


def load_bugs(recipes_dir: Path) -> dict[str, Bug]:
    """Every bug file of recipes/bugs/, checked; {} when the folder is absent."""
    return {path.stem: load_bug(path) for path in sorted(bugs_dir(recipes_dir).glob("*.toml"))}


def _str(table: Mapping[str, Any], key: str, where: str, required: bool = True) -> str:
    if key not in table:
        if required:
            raise BugError(f"{where}: missing key {key!r}")
        return ""
    if not isinstance(table[key], str):
        raise BugError(f"{where}.{key}: expected a string, found {table[key]!r}")
    return table[key]


def _https(url: str, where: str, empty_ok: bool = False) -> str:
    if not (url.startswith("https://") or (empty_ok and url == "")):
        alternative = ' or ""' if empty_ok else ""
        raise BugError(f"{where}: expected an https:// URL{alternative}, found {url!r}")
    return url


def load_bug(path: Path) -> Bug:
    where = str(path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise BugError(f"{where}: not valid TOML: {exc}") from exc
    unknown = sorted(set(raw) - _TOP)
    if unknown:
        raise BugError(f"{where}: unknown keys {', '.join(unknown)}; known: {', '.join(sorted(_TOP))}")
    if raw.get("schema") != 1:
        raise BugError(f"{where}: schema must be 1, found {raw.get('schema')!r}")
    if raw.get("id") != path.stem:
        raise BugError(f"{where}: id {raw.get('id')!r} must equal the file name {path.stem!r}")
    fixed_in = _str(raw, "fixed_in", where)
    if fixed_in:
        version_key(fixed_in, f"{where}: fixed_in")
    targets = raw.get("targets", [])
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise BugError(f"{where}.targets: expected a list of image targets, found {targets!r}")
    source = _load_source(raw.get("source"), f"{where}: source")
    bases = _load_bases(raw.get("bases"), f"{where}: bases")
    if source is None and (not fixed_in or any(d.verdict == "absent" for d in bases.values())):
        raise BugError(f"{where}: without a [source] only fixed_in is evidence: it needs fixed_in, and no verdict "
                       "can be \"absent\"")
    return Bug(path.stem, path, _str(raw, "title", where), _https(_str(raw, "link", where), f"{where}.link"),
               _https(_str(raw, "fix", where), f"{where}.fix", empty_ok=True), _str(raw, "package", where), fixed_in,
               tuple(targets), source, bases)


def _load_source(table: Any, where: str) -> Source | None:
    if table is None:
        return None
    if not isinstance(table, dict) or set(table) - _SOURCE:
        raise BugError(f"{where}: expected a table of {', '.join(sorted(_SOURCE))}, found {table!r}")
    source = Source(_str(table, "files", where), _str(table, "code", where, False),
                    _str(table, "before", where, False), _str(table, "after", where))
    if not source.files or not source.after:
        raise BugError(f"{where}: files and after must not be empty")
    return source


def _load_bases(table: Any, where: str) -> dict[str, Decision]:
    if not isinstance(table, dict) or not table:
        raise BugError(f'{where}: needs a [bases."X.Y.Z"] table for each vLLM base')
    bases = {}
    for base, entry in table.items():
        at = f"{where}.{base}"
        if not isinstance(entry, dict) or set(entry) != {"pinned", "verdict"}:
            raise BugError(f"{at}: needs exactly pinned and verdict")
        decision = Decision(_str(entry, "pinned", at), _str(entry, "verdict", at))
        if decision.verdict not in VERDICTS:
            raise BugError(f"{at}.verdict: one of {', '.join(VERDICTS)}, found {decision.verdict!r}")
        version_key(decision.pinned, f"{at}.pinned")
        bases[base] = decision
    return bases


# -- versions ------------------------------------------------------------------------------


def version_key(version: str, where: str = "version") -> tuple:
    """An ordering key for the PEP 440 versions the locks pin (N.N.N, aN/bN/rcN, .postN, .devN)."""
    match = _VERSION.fullmatch(version.strip().lower())
    if not match:
        raise BugError(f"{where}: {version!r} is not a release version (N.N[.N][rcN][.postN][.devN])")
    release, pre, pre_n, post, dev = match.groups()
    numbers = [int(n) for n in release.split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    if pre:
        pre_key = ({"a": 0, "b": 1, "rc": 2}[pre], int(pre_n))
    else:  # X.devN sorts before X's pre-releases, X and X.postN after them
        pre_key = (-1, 0) if dev is not None and post is None else (3, 0)
    dev_key = (0, int(dev)) if dev is not None else (1, 0)
    return tuple(numbers), pre_key, int(post) if post is not None else -1, dev_key


def version_problem(bug: Bug, base: str, pinned: str) -> str | None:
    """What the base's lock says against the recorded decision, offline, or None."""
    decision = bug.bases[base]
    where = f"{bug.path}: vLLM {base}"
    if decision.pinned != pinned:
        return (f"{where}: records {bug.package} {decision.pinned}, the base's locks pin {pinned}: decide again "
                f"from the new artefact (`python3 scripts/recipe.py check --online --vllm {base}` reads its source) "
                "and record pinned and verdict")
    if not bug.fixed_in:
        return None
    below = version_key(pinned) < version_key(bug.fixed_in)
    if decision.verdict == "present" and not below:
        return (f"{where}: recorded present, but {bug.package} {pinned} is at or above {bug.fixed_in}, which fixed "
                f"it: the bug is gone from this base; record verdict = \"fixed\" (the recipes then stop applying "
                "what works around it there) and remove workarounds that apply on no base")
    if decision.verdict == "fixed" and below:
        return (f"{where}: recorded fixed, but {bug.package} {pinned} is below {bug.fixed_in}, the first release "
                "with the fix: record verdict = \"present\" (or correct fixed_in)")
    return None


# -- source evidence -----------------------------------------------------------------------


def _flat(text: str) -> str:
    return " ".join(text.split())


def _selects(files: str, name: str) -> bool:
    return name == files or (files.endswith("/") and name.startswith(files))


def source_verdict(source: Source, members: Iterable[tuple[str, str]]) -> tuple[str, str]:
    """(verdict, what was found) from `members`, (name, text) pairs of an artefact."""
    texts = {name: _flat(text) for name, text in members if _selects(source.files, name)}
    if not texts:
        return "absent", f"no {source.files} in it"
    if source.code and not any(_flat(source.code) in t for t in texts.values()):
        return "absent", f"no `{source.code}` in {source.files}"
    after = sorted(name for name, t in texts.items() if _flat(source.after) in t)
    before = sorted(name for name, t in texts.items() if source.before and _flat(source.before) in t)
    if after and not before:
        return "fixed", f"the fix's `{source.after}` in {', '.join(after)}"
    if not after and (before or not source.before):
        found = f"`{source.before}` in {', '.join(before)}" if before else f"no `{source.after}` in {source.files}"
        return "present", found
    found = "both the fix's line and the line it removed" if after else "neither the fix's line nor the removed one"
    raise BugError(f"{source.files}: {found} (after {source.after!r}, before {source.before!r}): the patterns no "
                   "longer tell; read the release's source and update [source]")


def wheel_members(wheel: Path, files: str) -> Iterable[tuple[str, str]]:
    """(name, text) of the members of a wheel that `files` selects (undecodable bytes replaced)."""
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if _selects(files, name):
                yield name, archive.read(name).decode(errors="replace")


def installed_members(package: str, files: str) -> Iterable[tuple[str, str]]:
    """(name, text) of the files of an installed distribution (its RECORD) that `files` selects:
    the same names as its wheel's members. For the image's tests."""
    from importlib import metadata  # noqa: PLC0415 - only the image's tests read installed files

    for file in metadata.distribution(package).files or ():
        name = str(file).replace("\\", "/")
        path = Path(str(file.locate()))
        if _selects(files, name) and path.is_file():
            yield name, path.read_text(errors="replace")


def source_problem(bug: Bug, base: str, members: Iterable[tuple[str, str]], artefact: str) -> str | None:
    """What the artefact's source says against the recorded decision, or None."""
    if bug.source is None:
        return None
    try:
        verdict, found = source_verdict(bug.source, members)
    except BugError as exc:
        return f"{bug.path}: vLLM {base}: {artefact}: {exc}"
    recorded = bug.bases[base].verdict
    if verdict == recorded:
        return None
    gone = (f" the bug is gone from a base it is recorded on: record verdict = \"{verdict}\" (the recipes then stop "
            "applying what works around it there) and remove workarounds that apply on no base"
            if recorded == "present" else f" record verdict = \"{verdict}\"")
    return f"{bug.path}: vLLM {base}: recorded {recorded}, but {artefact} shows {verdict}: {found};{gone}"


# -- command line --------------------------------------------------------------------------

EXIT_CODES = status.epilog(
    (status.SUCCESS, "each wheel's verdict printed"),
    (status.FAILED, "the patterns do not tell for some wheel"),
    (status.USAGE, "bad input: usage, an unknown bug or one without a [source], an unreadable wheel"))


def main(argv: list[str] | None = None) -> int:
    """`python3 -m dsa_image.serving.workarounds verdict BUG WHEEL...`: what a bug's source evidence says
    of any wheel (e.g. the releases around a fix, to find `fixed_in`)."""
    import argparse  # noqa: PLC0415
    import sys  # noqa: PLC0415

    parser = argparse.ArgumentParser(prog="python3 -m dsa_image.serving.workarounds", description=main.__doc__,
                                     epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    reading = commands.add_parser("verdict", help="a bug's source verdict for each wheel given")
    reading.add_argument("bug", help="a file of recipes/bugs/ (its id)")
    reading.add_argument("wheels", nargs="+", type=Path)
    args = parser.parse_args(argv)
    try:
        bug = load_bugs(RECIPES_DIR).get(args.bug)
    except BugError as exc:
        print(f"workarounds: {exc}", file=sys.stderr)
        return status.USAGE
    if bug is None or bug.source is None:
        print(f"workarounds: {args.bug}: no such bug with a [source] in {bugs_dir(RECIPES_DIR)}", file=sys.stderr)
        return status.USAGE
    code = status.SUCCESS
    for wheel in args.wheels:
        try:
            verdict, found = source_verdict(bug.source, wheel_members(wheel, bug.source.files))
            print(f"{wheel.name}: {verdict}: {found}")
        except BugError as exc:
            print(f"{wheel.name}: unclear: {exc}")
            code = status.FAILED
        except (OSError, zipfile.BadZipFile) as exc:
            print(f"workarounds: {wheel}: {exc}", file=sys.stderr)
            return status.USAGE
    return code


if __name__ == "__main__":
    raise SystemExit(main())
