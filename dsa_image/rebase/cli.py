"""Re-base the overlay onto another vLLM release: a 3-way merge per overlaid file and a report
per named change (the overlay's changes.toml, folded into its manifest.json by `record`).

  base    the upstream file the overlay was made from (pinned wheel, hash-checked)
  ours    the overlay file
  theirs  the same path in the target release's wheel (hash-checked against the index)

Writes only into its output directory (default build/rebase/<from>-to-<to>/): base/, ours/,
theirs/ and merged/ trees mirroring site-packages, report.md and report.json. Never writes
overlay/ or the manifest: a merged file becomes overlay only through a person and `record`.

Per change the report says whether its hunks merged cleanly or conflict (both sides shown),
whether it is already upstream (static signatures checked against the target's source, and,
with --target-python, the change's own tests run against the stock target vLLM), and which
upstream code it touches moved or was renamed.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import zipfile
from pathlib import Path

from dsa_image.overlay import cli as overlay
from dsa_image.core import status, wheels
from dsa_image.overlay.manifest import Change, Entry, Manifest
from dsa_image.core.recipe import DEFAULT_RECIPE, REPO_ROOT
from dsa_image.rebase.changes import (Inputs, attribute, change_report, check_inputs, check_stock_target, run_tests,
                                      vanished_uses)
from dsa_image.rebase.merge import Chunk, FileMerge, diff3_chunks, merge_entry, render_merge
from dsa_image.rebase.report import (CONFLICT, MAX_EXCERPT_LINES, VERDICT_WORDS, build_report, check_out_dir,
                                     render_markdown, report_bytes, write_outputs, write_report)
from dsa_image.rebase.symbols import KNOWN_RENAMES, RebaseError, Wheel, close_matches, parse_source

# This module is the rebase's public face (as dsa_image.overlay.cli is the overlay's): the
# names its callers use are importable from here, wherever they live in the package.
__all__ = [
    "CONFLICT", "KNOWN_RENAMES", "MAX_EXCERPT_LINES", "Chunk", "FileMerge", "Inputs", "RebaseError", "Wheel",
    "add_rebase_arguments", "add_rebase_parser", "close_matches", "diff3_chunks", "load", "local_target", "main",
    "parse_source", "rebase", "regenerate_command", "render_markdown", "render_merge", "report_bytes",
    "resolve_target", "run_rebase", "wheel_version", "write_outputs",
]

TARGET_PLATFORM_SUFFIX = "_x86_64.whl"  # the reference platform's wheel (overlay.REFERENCE_PLATFORM)


# --- the target wheel ---------------------------------------------------------------------------


def wheel_version(path: Path) -> str:
    """The Version in the wheel's vllm-*.dist-info/METADATA."""
    with zipfile.ZipFile(path) as archive:
        metadata = [n for n in archive.namelist() if re.fullmatch(r"vllm-[^/]+\.dist-info/METADATA", n)]
        if len(metadata) != 1:
            raise RebaseError(overlay.BAD_INPUT, f"{path}: not a vLLM wheel (no single vllm-*.dist-info/METADATA)")
        found = re.search(r"^Version: (\S+)$", archive.read(metadata[0]).decode(errors="replace"), re.MULTILINE)
    if not found:
        raise RebaseError(overlay.BAD_INPUT, f"{path}: {metadata[0]} has no Version")
    return found.group(1)


def resolve_target(version: str, index_url: str = wheels.PYPI_SIMPLE) -> tuple[Path, str, str]:
    """The target release's x86_64 manylinux wheel (the platform `record` and `diff` read),
    downloaded with the sha256 the index states and re-hashed (cached like every wheel)."""
    try:
        listed = [f for f in wheels.index_files("vllm", index_url)
                  if f.filename.startswith(f"vllm-{version}-") and "manylinux" in f.filename
                  and f.filename.endswith(TARGET_PLATFORM_SUFFIX)]
    except wheels.WheelError as exc:
        raise RebaseError(overlay.BAD_INPUT, str(exc)) from exc
    if len(listed) != 1:
        names = ", ".join(f.filename for f in listed) or "none"
        raise RebaseError(overlay.BAD_INPUT, f"vLLM {version}: expected one manylinux x86_64 wheel on {index_url}, "
                                             f"found {names}")
    entry = listed[0]
    try:
        return wheels.ensure_wheel(entry.filename, entry.sha256, index_url), entry.filename, entry.sha256
    except wheels.WheelError as exc:
        raise RebaseError(overlay.BAD_INPUT, str(exc)) from exc


def local_target(path: Path, sha256: str) -> tuple[Path, str, str]:
    """An offline target wheel, trusted only when it hashes to the sha256 given for it."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256 or ""):
        raise RebaseError(overlay.BAD_INPUT, "--wheel needs --wheel-sha256 (64 lower-case hex) to check it against")
    if not path.is_file():
        raise RebaseError(overlay.BAD_INPUT, f"{path}: no such wheel")
    found = wheels.sha256_file(path)
    if found != sha256:
        raise RebaseError(overlay.BAD_INPUT, f"{path}: has sha256 {found}, --wheel-sha256 says {sha256}")
    return path, path.name, sha256


# --- the rebase ------------------------------------------------------------------------------------


def rebase(inputs: Inputs, command: str, target_python: str | None = None,
           log_dir: Path | None = None) -> tuple[dict, list[FileMerge]]:
    """Merge every overlay file onto the target and judge every change; returns the report
    (a JSON-able dict) and the merges (what `write_outputs` puts on disk)."""
    check_inputs(inputs)
    manifest, base, target = inputs.manifest, inputs.base, inputs.target
    merges = [_merge_and_place(entry, inputs) for entry in manifest.files]
    outcomes = None
    if target_python:
        tests = sorted({t for c in manifest.changes for t in c.tests})
        check_stock_target(target_python, target, [e.path for e in manifest.files])
        outcomes = run_tests(target_python, tests, inputs.repo_root, log_dir or Path(tempfile.mkdtemp())) if tests else {}
    changes = {c.id: change_report(c, merges, base, target, outcomes) for c in manifest.changes}
    return build_report(inputs, command, merges, changes, outcomes is not None), merges


def _changes_of(entry: Entry, manifest: Manifest) -> list[Change]:
    """The changes an entry carries (parse_manifest has checked that each is defined)."""
    changes = []
    for change_id in entry.changes:
        change = manifest.change(change_id)
        if change is None:
            raise RebaseError(overlay.BAD_INPUT, f"{entry.path}: names undefined change {change_id}")
        changes.append(change)
    return changes


def _merge_and_place(entry: Entry, inputs: Inputs) -> FileMerge:
    """Merge one file, place its hunks in changes, and (Python, both sides there) find the
    names its hunks use that the target lost."""
    base, target = inputs.base, inputs.target
    merge = merge_entry(entry, inputs.ours[entry.path], base, target)
    changes = _changes_of(entry, inputs.manifest)
    if not entry.path.endswith(".py"):
        attribute(merge, changes, None, None)
        return merge
    ours = parse_source(merge.ours, f"overlay/{entry.path}")
    attribute(merge, changes, base.source(entry.path) if merge.base is not None else None, ours)
    if merge.base is not None and merge.theirs is not None:
        merge.vanished = vanished_uses(merge, ours, changes, base, target)
    return merge


# --- command line ------------------------------------------------------------------------------


def add_rebase_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--to", required=True, metavar="VERSION", help="the vLLM release to re-base onto, e.g. 0.33.0")
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--out", help="output directory (default: build/rebase/<from>-to-<to>/ of this repo)")
    parser.add_argument("--report-dir", help="also write report.md and report.json here (e.g. docs/rebase/...)")
    parser.add_argument("--wheel", help="offline: the target wheel file, used only if it hashes to --wheel-sha256")
    parser.add_argument("--wheel-sha256", help="sha256 the --wheel file must have")
    parser.add_argument("--target-python", help="an interpreter with the stock target vLLM: run each change's tests "
                                                "against it (behavioural evidence)")
    parser.add_argument("--index-url", default=wheels.PYPI_SIMPLE, help="PEP 691 simple index (default: PyPI)")


def add_rebase_parser(commands, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """The `rebase` subcommand, for scripts/overlay.py's subparsers (`parents` give --vllm)."""
    parser = commands.add_parser("rebase", parents=parents,
                                 help="3-way merge the overlay onto another vLLM; report per named change")
    add_rebase_arguments(parser)
    return parser


def _outside(directory: Path, overlay_dir: Path, what: str) -> Path:
    """`directory`, refused when it is, holds or lies inside the overlay or any of the repo's."""
    directory = directory.resolve()
    for protected in (overlay_dir.resolve(), overlay.OVERLAY_ROOT.resolve()):
        if directory == protected or protected in directory.parents or directory in protected.parents:
            raise RebaseError(overlay.BAD_INPUT, f"{what} {directory}: must not be, hold or lie inside the overlay "
                                                 f"directory {protected} (rebase never writes an overlay)")
    return directory


def regenerate_command(base: str, version: str, recipe_id: str, report_dir: Path | None) -> str:
    """The command that rewrites this report (both spellings work: the module is the tool)."""
    parts = ["python3 scripts/overlay.py rebase", f"--vllm {base}", f"--to {version}"]
    if recipe_id != DEFAULT_RECIPE:
        parts.append(f"--recipe {recipe_id}")
    if report_dir is not None and REPO_ROOT in report_dir.parents:
        parts.append(f"--report-dir {report_dir.relative_to(REPO_ROOT).as_posix()}")
    return " ".join(parts)


def load(args) -> Inputs:
    """Recipe, manifest, overlay files and both wheels, each checked before use."""
    recipe, manifest, raw = overlay.load_inputs(args.recipe, Path(args.manifest))
    ours = {path: data.decode() for path, data in overlay.read_overlay_files(manifest, Path(args.overlay_dir)).items()}
    if args.wheel:
        target_path, filename, sha256 = local_target(Path(args.wheel), args.wheel_sha256 or "")
    else:
        target_path, filename, sha256 = resolve_target(args.to, args.index_url)
    found = wheel_version(target_path)
    if found != args.to:
        raise RebaseError(overlay.BAD_INPUT, f"{target_path}: is vLLM {found}, not --to {args.to}")
    base_path = overlay.reference_wheel(recipe)
    base_version = wheel_version(base_path)
    if base_version != manifest.vllm_version:
        raise RebaseError(overlay.DRIFT, f"{base_path}: is vLLM {base_version}, the manifest is for {manifest.vllm_version}")
    return Inputs(manifest, wheels.sha256_bytes(raw), ours,
                  Wheel(base_path, manifest.wheel_filename, manifest.wheel_sha256, base_version),
                  Wheel(target_path, filename, sha256, found))


def run_rebase(args) -> int:
    """scripts/overlay.py rebase: merge, report, and exit CONFLICT when any region conflicts."""
    if args.to == args.vllm:
        # A merge onto its own release "merges cleanly" and says nothing.
        raise RebaseError(overlay.BAD_INPUT, (
            f"--to {args.to} is the base itself (--vllm; without it the recipe's default): rebase moves one base's "
            f"overlay onto another release, e.g. `--vllm OLDER --to {args.to}`"))
    overlay_dir = Path(args.overlay_dir)
    report_dir = _outside(Path(args.report_dir), overlay_dir, "--report-dir") if args.report_dir else None
    out_dir = _outside(Path(args.out), overlay_dir, "--out") if args.out else None
    if out_dir is not None:
        check_out_dir(out_dir)  # before any download
    inputs = load(args)
    default_out = REPO_ROOT / "build" / "rebase" / f"{inputs.manifest.vllm_version}-to-{args.to}"
    out_dir = out_dir or _outside(default_out, overlay_dir, "--out")
    command = regenerate_command(args.vllm, args.to, args.recipe, report_dir)
    try:
        report, merges = rebase(inputs, command, args.target_python, out_dir / "behaviour")
    finally:
        inputs.base.close()
        inputs.target.close()
    write_outputs(out_dir, merges, report)
    if report_dir is not None:
        write_report(report_dir, report)
    for change_id, change in report["changes"].items():
        print(f"{change_id}: {', '.join(VERDICT_WORDS[v] for v in change['verdicts'])}", file=sys.stderr)
    print(f"{report['conflicts']} conflict region(s); report: {out_dir / 'report.md'}"
          + (f" and {report_dir / 'report.md'}" if report_dir else ""), file=sys.stderr)
    return report["exit_code"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m dsa_image.rebase.cli", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=status.epilog(
                                         (overlay.OK, "merged without conflict"), (overlay.BAD_INPUT, "bad input"),
                                         (overlay.DRIFT, "the pinned wheel is not what the overlay was made from"),
                                         (CONFLICT, "conflicts"), notes=("Nothing is recorded in any case.",)))
    parser.add_argument("--manifest", help="default: the --vllm base's overlay/vllm-VERSION/manifest.json")
    parser.add_argument("--overlay-dir", help="default: the --vllm base's overlay/vllm-VERSION/")
    parser.add_argument("--vllm", metavar="VERSION", help="the base to re-base from (default: the recipe's default)")
    add_rebase_arguments(parser)
    args = parser.parse_args(argv)
    try:
        overlay.resolve_base(args, args.vllm)
        return run_rebase(args)
    except overlay.OverlayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
