#!/usr/bin/env python3
"""Put the overlay (overlay/vllm/...) over an installed vLLM and prove it is there.

commands:
  check                         manifest, overlay files and the pinned wheels agree (offline
                                once the wheels are cached; fetches them otherwise)
  apply --site-packages DIR     verify every upstream file, then copy, refresh bytecode, re-hash
        [--recipe ID] [--receipt FILE]
                                and write the receipt (default DIR/vllm_overlay_receipt.json);
                                all or nothing, never imports vLLM
  verify [--site-packages DIR] [--python EXE] [--receipt FILE]
                                re-hash against the receipt, then import every overlaid module
                                in a fresh EXE (default: this python) started outside the repo
                                and require it to come from DIR (default: EXE's purelib)
  diff                          unified diff of each overlay file against the pinned wheel
  record PATH... --why TEXT     add or update entries (PATH like vllm/envs.py); hashes are
                                computed from overlay/PATH and the pinned wheel
  record --refresh              recompute every entry's hashes, keeping each `why`
  record --remove PATH...       drop entries

exit codes:
  0  ok
  1  verification mismatch: an installed file or the receipt differs from what apply wrote
     (tampered receipt, file changed afterwards), or a module is imported from elsewhere
  2  bad usage or input: unknown recipe, malformed manifest, missing or unrecorded overlay
     file, overlay file changed without `record`, no vLLM in the target
  3  upstream drift: the installed (or pinned) vLLM is not the one the overlay was made for;
     nothing was changed
  4  cannot write: read-only target or a failed write; every file was restored
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsa_image import bake, overlay  # noqa: E402
from dsa_image.recipe import DEFAULT_RECIPE, REPO_ROOT, load_recipe  # noqa: E402


def say(message: str) -> None:
    print(message, file=sys.stderr)


def purelib_of(python: str) -> Path:
    """The site-packages of the environment `python` belongs to."""
    done = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, cwd="/")
    if done.returncode != 0:
        raise overlay.OverlayError(overlay.BAD_INPUT, f"{python}: cannot run it to find its site-packages: {done.stderr.strip()}")
    return Path(done.stdout.strip())


def run(args) -> int:
    manifest = Path(args.manifest)
    if args.command == "check":
        for line in overlay.check(args.recipe, manifest, Path(args.overlay_dir)):
            say(line)
    elif args.command == "apply":
        receipt = overlay.apply(Path(args.site_packages), args.recipe, manifest, Path(args.overlay_dir),
                                Path(args.receipt) if args.receipt else None)
        say(f"applied {len(receipt['files'])} files over vLLM {receipt['vllm_version']} in {args.site_packages}")
    elif args.command == "verify":
        site = Path(args.site_packages) if args.site_packages else purelib_of(args.python)
        for line in overlay.verify(site, manifest, Path(args.receipt) if args.receipt else None, args.python):
            say(line)
    elif args.command == "diff":
        sys.stdout.write(overlay.diff(args.recipe, manifest, Path(args.overlay_dir)))
    elif args.command == "record":
        if not args.paths and not args.refresh:
            raise overlay.OverlayError(overlay.BAD_INPUT, "record: give PATH... or --refresh")
        if args.remove and (args.refresh or args.why):
            raise overlay.OverlayError(overlay.BAD_INPUT, "record: --remove takes only PATH...")
        result = overlay.record(args.paths, args.why, args.refresh, args.remove, args.recipe, manifest, Path(args.overlay_dir))
        say(f"{args.manifest}: {len(result.files)} entries")
        if Path(args.manifest).resolve() == overlay.MANIFEST_PATH.resolve():
            # The image's receipt label is derived from the manifest: keep it in step.
            recipe = load_recipe(args.recipe)
            (REPO_ROOT / bake.BAKE_JSON).write_text(bake.render_bake_json(recipe))
            say(f"{bake.BAKE_JSON}: RECEIPT_SHA256 {bake.bake_variables(recipe)['RECEIPT_SHA256']}")
    return overlay.OK


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="scripts/overlay.py", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    main.add_argument("--manifest", default=str(overlay.MANIFEST_PATH), help="default: overlay/manifest.json of this repo")
    main.add_argument("--overlay-dir", default=str(overlay.OVERLAY_DIR), help="default: overlay/ of this repo")
    commands = main.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="manifest <-> overlay files <-> pinned wheels")
    check.add_argument("--recipe", default=DEFAULT_RECIPE)
    apply = commands.add_parser("apply", help="overlay a site-packages, all or nothing")
    apply.add_argument("--site-packages", required=True)
    apply.add_argument("--recipe", default=DEFAULT_RECIPE)
    apply.add_argument("--receipt", help="default: SITE_PACKAGES/vllm_overlay_receipt.json")
    verify = commands.add_parser("verify", help="re-hash and import-check an overlaid site-packages")
    verify.add_argument("--site-packages", help="default: the purelib of --python")
    verify.add_argument("--python", default=sys.executable, help="interpreter to import with (default: this one)")
    verify.add_argument("--receipt", help="default: SITE_PACKAGES/vllm_overlay_receipt.json")
    diff = commands.add_parser("diff", help="overlay vs upstream, unified diff")
    diff.add_argument("--recipe", default=DEFAULT_RECIPE)
    record = commands.add_parser("record", help="add, refresh or remove manifest entries")
    record.add_argument("paths", nargs="*", metavar="PATH")
    record.add_argument("--why", help="one line: why this file is overlaid")
    record.add_argument("--refresh", action="store_true", help="recompute the hashes of every entry")
    record.add_argument("--remove", action="store_true", help="drop the entries for PATH...")
    record.add_argument("--recipe", default=DEFAULT_RECIPE)
    return main


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except overlay.OverlayError as exc:
        say(f"error: {exc}")
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
