"""Records: the evidence of past runs under docs/validation/ and docs/benchmarks/, one directory a run.

A record keeps in the working tree what a reader reads: its README.md (and any other Markdown
report) and its plots (*.png). Every other file the run produced (server logs, JSON reports,
receipts, environment listings) is packed into one `raw.tar.xz` in the record's directory by
`pack`, which also writes the README's last section: the archive's sha256 and size, and each
member's path, size and sha256, all computed here from the bytes, never typed. The README's
text names a raw file by its path in the archive (`pack` turns the links to packed files into
such names).

`problems` checks a record against what its README cites (the unit tests run it on every
record); `extract` unpacks one for the tools and tests that re-derive a record's tables from its
raw data. Records are history: nothing here compares them with today's tree (the release check,
dsa_image/records/release_check.py, does that where a document claims it).

The archive is untrusted input like any file read back: only regular members with relative,
normalised names, each once. Stdlib only (tarfile, lzma).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import io
import json
import lzma
import posixpath
import re
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from dsa_image.core.atomic import read_regular, write_atomic, write_new
from dsa_image.core import status

REPO = Path(__file__).resolve().parents[2]
RECORD_ROOTS = ("docs/validation", "docs/benchmarks")
ARCHIVE = "raw.tar.xz"
README = "README.md"
KEPT = ("*.md", "*.png")  # what stays readable in the tree; everything else is raw data
BEGIN = "<!-- raw data: written by `python3 scripts/records.py pack`; do not edit -->"
END = "<!-- end of raw data -->"
# One preset for every archive: the largest record is a few MB, within preset 6's 8 MiB dictionary.
XZ_PRESET = 6 | lzma.PRESET_EXTREME
_ROW = re.compile(r"^\| `([^`]+)` \| ([\d,]+) \| `([0-9a-f]{64})` \|$")
_ARCHIVE_LINE = re.compile(r"\(([\d,]+) bytes, sha256 `([0-9a-f]{64})`\)")
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


class RecordError(status.DsaImageError):
    """A record that cannot be packed or read: the message says which file and what to do."""

    exit_code = status.USAGE


@dataclass(frozen=True)
class Member:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Cited:
    """What a record's README says about its archive."""
    size: int
    sha256: str
    members: tuple[Member, ...]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record_dirs(repo: Path = REPO) -> list[Path]:
    """Every record: each directory right under a record root that has a README.md."""
    return sorted(d for root in RECORD_ROOTS for d in (repo / root).glob("*/") if (d / README).is_file())


def is_kept(name: str) -> bool:
    return any(fnmatch.fnmatch(posixpath.basename(name), pattern) for pattern in KEPT)


def loose_files(record: Path) -> list[str]:
    """The record's raw files not yet packed, as archive names."""
    return sorted(p.relative_to(record).as_posix() for p in record.rglob("*")
                  if p.is_file() and p.name != ARCHIVE and not is_kept(p.name))


# -- the archive ---------------------------------------------------------------------------------


def archive_bytes(files: dict[str, bytes]) -> bytes:
    """The same bytes for the same files: sorted members, no times, owners or modes of the packer."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(_checked_name(name, "pack"))
            info.size, info.mode, info.mtime = len(files[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(files[name]))
    return lzma.compress(buffer.getvalue(), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=XZ_PRESET)


def _checked_name(name: str, where: str) -> str:
    parts = name.split("/")
    if not name or name.startswith("/") or "\\" in name or any(p in ("", ".", "..") for p in parts):
        raise RecordError(f"{where}: member name {name!r} is not a relative, normalised path")
    return name


def read_archive(record: Path) -> dict[str, bytes]:
    """The members of `record`'s raw.tar.xz by name (read once per file version)."""
    path = record / ARCHIVE
    try:
        status = path.stat()
    except FileNotFoundError:
        raise RecordError(f"{path}: missing; `python3 scripts/records.py pack {record}` makes it") from None
    return dict(_members(str(path), status.st_size, status.st_mtime_ns))


@functools.lru_cache(maxsize=32)
def _members(path: str, size: int, mtime_ns: int) -> tuple[tuple[str, bytes], ...]:
    del size, mtime_ns  # the cache key: a rewritten archive is read again
    try:
        tar_bytes = lzma.decompress(read_regular(path))
        with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tar:
            found: dict[str, bytes] = {}
            for info in tar:
                name = _checked_name(info.name, path)
                member = tar.extractfile(info) if info.isreg() else None
                if member is None or name in found:
                    raise RecordError(f"{path}: member {name!r} is {'twice in it' if name in found else 'not a regular file'}")
                found[name] = member.read()
    except (lzma.LZMAError, tarfile.TarError, OSError) as exc:
        raise RecordError(f"{path}: not a readable tar.xz ({exc})") from exc
    return tuple(sorted(found.items()))


# -- what a run ran --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Receipt:
    """An overlay receipt a record holds: a receipt file, or a build a benchmark's results name."""
    where: str  # the member, and the build for a benchmark's
    vllm: str
    sha256: str
    manifest_sha256: str | None = None


def receipts(files: dict[str, bytes]) -> list[Receipt]:
    found = []
    for name, data in sorted(files.items()):
        try:
            doc = json.loads(data) if name.endswith(".json") else None
        except ValueError:
            continue
        if isinstance(doc, dict) and {"schema", "files", "manifest_sha256", "vllm_version"} <= set(doc):
            found.append(Receipt(f"`{name}`", str(doc["vllm_version"]), sha256(data), str(doc["manifest_sha256"])))
        for build, versions in _build_versions(doc):
            if versions.get("overlay_receipt_sha256"):
                found.append(Receipt(f"`{name}` build {build}", str(versions.get("vllm")), str(versions["overlay_receipt_sha256"])))
    return found


def _build_versions(doc: object) -> list[tuple[str, dict]]:
    """(side, versions) of each build a benchmark's results.json names (none for another file)."""
    environment = doc.get("environment") if isinstance(doc, dict) else None
    builds = environment.get("builds") if isinstance(environment, dict) else None
    return [(side, b["versions"]) for side, b in sorted(builds.items()) if isinstance(b, dict)
            and isinstance(b.get("versions"), dict)] if isinstance(builds, dict) else []


# -- the README's section ------------------------------------------------------------------------


def section(archive: bytes, files: dict[str, bytes]) -> str:
    rows = "".join(f"| `{name}` | {len(data):,} | `{sha256(data)}` |\n" for name, data in sorted(files.items()))
    ran = "".join(f"- {r.where}: vLLM {r.vllm}, receipt sha256 `{r.sha256}`"
                  + (f", overlay manifest sha256 `{r.manifest_sha256}`" if r.manifest_sha256 else "") + "\n"
                  for r in receipts(files))
    ran = f"The overlay receipts among them, what the run ran:\n\n{ran}\n" if ran else ""
    return (f"{BEGIN}\n## Raw data\n\n"
            f"The run's other {len(files)} files are packed in [{ARCHIVE}]({ARCHIVE}) "
            f"({len(archive):,} bytes, sha256 `{sha256(archive)}`); the text above names each by its path "
            f"there. `python3 scripts/records.py extract DIR DEST` unpacks them, checked against this "
            f"table.\n\n{ran}| file | bytes | sha256 |\n|---|---|---|\n{rows}{END}\n")


def cited(readme_text: str, where: str = README) -> Cited | None:
    """The archive and members the README's raw-data section cites; None if it has none."""
    if BEGIN not in readme_text:
        return None
    body = readme_text.split(BEGIN, 1)[1].split(END, 1)
    archive = _ARCHIVE_LINE.search(body[0])
    if len(body) != 2 or not archive:
        raise RecordError(f"{where}: its raw-data section is cut or edited; run `python3 scripts/records.py pack` again")
    members = tuple(Member(m[1], int(m[2].replace(",", "")), m[3])
                    for m in map(_ROW.match, body[0].splitlines()) if m)
    return Cited(int(archive[1].replace(",", "")), archive[2], members)


def _with_section(text: str, block: str) -> str:
    """`text` with `block` in place of its raw-data section, or appended."""
    if BEGIN not in text:
        return text.rstrip("\n") + "\n\n" + block
    before, rest = text.split(BEGIN, 1)
    return before + block + rest.partition(END)[2].lstrip("\n")


def relink(text: str, members: set[str]) -> str:
    """Links to packed files become their names in the archive: `name`, or `text (name)`; in a
    heading the link's own text, so that the heading's anchor stays what other pages link to."""
    directories = {posixpath.dirname(m) + "/" for m in members if "/" in m}

    def replace(match: re.Match, heading: bool) -> str:
        image, label, target = match.groups()
        name = target.split("#", 1)[0]
        if image or re.match(r"[a-z]+:", name) or name not in members | directories:
            return match.group(0)
        shown = label.strip("`")
        if heading:
            return f"`{shown}`"
        return f"`{name}`" if name == shown or name.endswith(shown) else f"{label} (`{name}`)"

    def relinked(line: str) -> str:
        heading = line.startswith("#")
        return _LINK.sub(lambda m: replace(m, heading), line)

    return "".join(relinked(line) for line in text.splitlines(keepends=True))


# -- pack, check, extract ------------------------------------------------------------------------


def pack(record: Path) -> Cited:
    """Pack `record`'s loose raw files (beside what its archive holds) and rewrite its README's
    links and raw-data section. Run again after a crash: a loose file equal to its member is
    taken as packed."""
    readme = record / README
    if not readme.is_file():
        raise RecordError(f"{record}: no {README}; a record is its README and its raw data")
    files = read_archive(record) if (record / ARCHIVE).exists() else {}
    loose = {name: read_regular(record / name) for name in loose_files(record)}
    clashes = [name for name, data in loose.items() if files.get(name, data) != data]
    if clashes:
        raise RecordError(f"{record}: {', '.join(clashes)} differ from the same names in {ARCHIVE}; "
                          "rename the new files or remove the stale ones")
    files |= loose
    if not files:
        raise RecordError(f"{record}: no raw files to pack (everything is {' or '.join(KEPT)})")
    data = archive_bytes(files)
    text = _with_section(relink(readme.read_text(), set(files)), section(data, files))
    write_atomic(record / ARCHIVE, data)
    write_atomic(readme, text.encode())
    for name in loose:
        (record / name).unlink()
    for directory in sorted({(record / n).parent for n in loose}, key=lambda p: -len(p.parts)):
        if directory != record and not any(directory.iterdir()):
            directory.rmdir()
    claim = cited(text, str(readme))
    if claim is None:  # _with_section wrote the section; losing it would be a bug here
        raise RecordError(f"{readme}: the raw-data section just written is missing")
    return claim


def problems(record: Path) -> list[str]:
    """What is wrong with `record` against its own README: nothing when it is intact."""
    if not (record / README).is_file():
        return [f"{record}: no {README}"]
    return [f"{record / name}: not packed; run `python3 scripts/records.py pack {record}`"
            for name in loose_files(record)] + _archive_problems(record)


def _archive_problems(record: Path) -> list[str]:
    readme = record / README
    try:
        claim = cited(readme.read_text(), str(readme))
        if claim is None:
            return [f"{readme}: no raw-data section for its {ARCHIVE}"] if (record / ARCHIVE).exists() else []
        raw = read_regular(record / ARCHIVE)
        if (len(raw), sha256(raw)) != (claim.size, claim.sha256):
            return [f"{record / ARCHIVE}: {len(raw):,} bytes, sha256 {sha256(raw)}; "
                    f"{README} cites {claim.size:,} bytes, sha256 {claim.sha256}"]
        files = read_archive(record)
    except (RecordError, FileNotFoundError) as exc:
        return [str(exc)]
    members = {name: Member(name, len(data), sha256(data)) for name, data in files.items()}
    listed = {m.name: m for m in claim.members}
    found = [f"{readme}: lists {name}, which {ARCHIVE} " + ("lacks" if name not in members else
             f"holds with {members[name].size:,} bytes, sha256 {members[name].sha256}")
             for name in sorted(listed) if listed[name] != members.get(name)]
    found += [f"{record / ARCHIVE}: {name} is not listed in {README}" for name in sorted(set(members) - set(listed))]
    written = BEGIN + readme.read_text().split(BEGIN, 1)[1].split(END, 1)[0] + END + "\n"
    if not found and written != section(raw, files):
        found.append(f"{readme}: its raw-data section is not what `pack` writes for {ARCHIVE}; "
                     f"run `python3 scripts/records.py pack {record}`")
    return found


def extract(record: Path, dest: Path) -> list[str]:
    """Unpack `record`'s raw files into `dest` (new files only) once the archive is as cited."""
    found = _archive_problems(record)
    if found:
        raise RecordError("; ".join(found))
    names = []
    for name, data in read_archive(record).items():
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        write_new(target, data)
        names.append(name)
    return names


# -- excerpts for the tests ------------------------------------------------------------------------


def excerpt(text: str, lines: str, head: int = 0) -> str:
    """The first `head` lines of `text` and every later line matching the regex `lines`, whole
    (a line ends at a newline only: a progress bar's carriage returns stay inside it)."""
    parts = text.split("\n")
    kept = [line + "\n" for line in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    pattern = re.compile(lines)
    return "".join(kept[:head] + [line for line in kept[head:] if pattern.search(line)])


def excerpts(spec: Path, repo: Path = REPO) -> dict[Path, str]:
    """Each excerpt a spec (tests/data/excerpts.toml) defines, made from its record's archive: its
    `lines` regex, or the one `pattern` names in the spec's [patterns]."""
    doc = tomllib.loads(spec.read_text())
    made = {}
    for name, item in doc["excerpt"].items():
        text = read_archive(repo / item["record"])[item["member"]].decode(errors="replace")
        lines = item["lines"] if "lines" in item else doc["patterns"][item["pattern"]]
        made[spec.parent / name] = excerpt(text, lines, item.get("head", 0))
    return made


# -- the command line ----------------------------------------------------------------------------

USAGE = status.epilog(
    (status.SUCCESS, "ok"),
    (status.FAILED, "`check` found a problem (each printed with what to do)"),
    (status.USAGE, "bad usage or input (no README, an unreadable archive, a loose file that differs from its packed "
                   "namesake, a DEST that already holds a member)"),
    notes=("Nothing is half-written: pack writes the archive, then the README, and only then removes the loose "
           "files (run it again after a crash).",))


def _parser():
    import argparse

    parser = argparse.ArgumentParser(prog="scripts/records.py", description=__doc__.split("\n\n")[0], epilog=USAGE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("pack", help="pack each record's raw files into its raw.tar.xz and cite it").add_argument(
        "records", nargs="+", type=Path)
    commands.add_parser("check", help="each record (default: all) against its README").add_argument(
        "records", nargs="*", type=Path)
    unpack = commands.add_parser("extract", help="unpack a record's raw files, checked, into DEST")
    unpack.add_argument("record", type=Path)
    unpack.add_argument("dest", type=Path)
    commands.add_parser("excerpts", help="write the test excerpts a spec defines from the records' archives").add_argument(
        "spec", type=Path, nargs="?", default=REPO / "tests" / "data" / "excerpts.toml")
    return parser


def main(argv: list[str] | None = None) -> int:
    import sys

    args = _parser().parse_args(argv)
    try:
        if args.command == "pack":
            for record in args.records:
                claim = pack(record)
                print(f"{record / ARCHIVE}: {len(claim.members)} files, {claim.size:,} bytes, sha256 {claim.sha256}")
        elif args.command == "check":
            found = [p for record in args.records or record_dirs() for p in problems(record)]
            print("\n".join(found) or f"{len(args.records or record_dirs())} records intact")
            return status.FAILED if found else status.SUCCESS
        elif args.command == "extract":
            print(f"{args.dest}: {len(extract(args.record, args.dest))} files")
        else:
            for path, text in excerpts(args.spec).items():
                write_atomic(path, text.encode())
                print(f"{path}: {text.count(chr(10))} lines")
    except (RecordError, FileExistsError) as exc:
        print(f"records: {exc}", file=sys.stderr)
        return status.USAGE
    return status.SUCCESS
