#!/usr/bin/env python3
"""Put the overlay (overlay/vllm-<version>/vllm/...) over an installed vLLM and prove it is there.

Every command works on one base, the vLLM release `--vllm VERSION` names (default: the
recipe's default base; verify: $DSA_IMAGE_VLLM first, which the image sets): its overlay is
overlay/vllm-VERSION/ (--overlay-dir) with its manifest.json (--manifest).

commands:
  check                         manifest, overlay files and the pinned wheels agree (offline
                                once the wheels are cached; fetches them otherwise)
  apply --site-packages DIR     verify every upstream file, then copy, refresh bytecode, re-hash
        [--recipe ID] [--receipt FILE]
                                and write the receipt (default DIR/vllm_overlay_receipt.json);
                                one transaction: all or nothing, even on Ctrl-C/SIGTERM; never
                                imports vLLM. Also after `pip install --force-reinstall vllm`
                                (the overlay's own leftovers are taken over)
  revert --site-packages DIR    upstream vLLM back: the replaced files (kept by apply in
        [--receipt FILE]        DIR/.vllm_overlay_originals) restored, the overlay's new files,
                                their bytecode and the receipt (default DIR/vllm_overlay_receipt.json;
                                one apply wrote elsewhere only when named) removed; all or
                                nothing. After a pip reinstall it only removes the overlay's leftovers
  verify [--site-packages DIR] [--python EXE] [--receipt FILE] [--recipe ID]
                                re-hash against the receipt (written for --recipe, default
                                $DSA_IMAGE_RECIPE or glm5-dsa), then import every overlaid
                                module in a fresh EXE (default: this python) started outside
                                the repo, require it to come from DIR (default: EXE's purelib)
                                through Python's own finder and loader and to run code (its
                                functions' too) compiled from the installed file; names the
                                import hooks it cannot see through; writes nothing
  diff                          unified diff of each overlay file against the pinned wheel
  record PATH... --why TEXT     add or update entries (PATH like vllm/envs.py); hashes are
                                computed from overlay/PATH and the pinned wheel
  record --refresh              recompute every entry's hashes, keeping each `why`
  record --remove PATH...       drop entries
  rebase --to VERSION [--out DIR] [--report-dir DIR] [--target-python PY]
         [--wheel FILE --wheel-sha256 SHA]
                                3-way merge of each file of the --vllm overlay onto vLLM
                                VERSION (wheel hash-checked) into DIR (default
                                build/rebase/<from>-to-<to>/), never overlay/; report.md/.json
                                per named change (its changes.toml); records nothing

apply, revert and verify lock DIR (flock on the directory): a second one waits up to
--lock-timeout seconds (default 120), then exits 4. A run killed outright (SIGKILL) leaves
DIR/.vllm_overlay_txn; the next apply or revert finishes or rolls it back first, verify
exits 1 saying so. docs/overlay.md has the details.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsa_image.build import bake
from dsa_image.core import status
from dsa_image.overlay import cli as overlay
from dsa_image.rebase import cli as rebase
from dsa_image.core.recipe import DEFAULT_RECIPE, REPO_ROOT, load_recipe  # noqa: E402

# The image sets it to the base it was built on: verify there checks that base's overlay.
IMAGE_VLLM_ENV = "DSA_IMAGE_VLLM"
EXIT_CODES = status.epilog(
    (overlay.OK, "ok"),
    (overlay.MISMATCH, "verification mismatch: an installed file or the receipt differs from what apply wrote "
                       "(tampered receipt, file changed afterwards, another recipe), a module is imported from "
                       "elsewhere, through another finder or loader, or runs code not compiled from its file, a FIFO "
                       "at a bytecode path, a killed run left its journal or something not a directory is at "
                       "DIR/.vllm_overlay_txn"),
    (overlay.BAD_INPUT, "bad usage or input: unknown recipe, malformed or too deeply nested manifest or receipt (an "
                        "integer of more than 4300 digits too), a path with a NUL byte, missing or unrecorded overlay "
                        "file, overlay file changed without `record`, no vLLM or no directory at --site-packages, a "
                        "--python that cannot run, a --receipt inside vllm/ or naming a file that is not a receipt; "
                        "rebase: an --out whose base/ours/theirs/merged a rebase did not write"),
    (overlay.DRIFT, "upstream drift: the installed (or pinned) vLLM is not the one the overlay was made for, or "
                    "(revert) a file is neither upstream nor the overlay's; nothing was changed"),
    (overlay.CANNOT_WRITE, "cannot write: read-only target, a failed write, or the lock still busy after "
                           "--lock-timeout; or refused: something not our directory at DIR/.vllm_overlay_txn or "
                           "DIR/.vllm_overlay_originals (a FIFO, file, symlink, another user's directory), a symlink "
                           "on the way to a managed file, a journal or index this tool did not write or naming a "
                           "receipt the command does not; every file was restored, unless the message says RESTORE "
                           "FAILED: it then names each file, where its original is kept, and the revert command that "
                           "finishes it"),
    (overlay.CONFLICT, "rebase: the merge left conflicts (the report shows both sides); nothing was recorded"),
    notes=("SIGINT/SIGTERM/SIGHUP during apply or revert: every file is restored, then the tool exits by that "
           "signal (128+N in a shell)",))


def say(message: str) -> None:
    print(message, file=sys.stderr)


def purelib_of(python: str) -> Path:
    """The site-packages of the environment `python` belongs to."""
    try:
        done = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, cwd="/")
    except (OSError, ValueError) as exc:
        raise overlay.OverlayError(overlay.BAD_INPUT, f"{python}: cannot run it ({getattr(exc, 'strerror', None) or exc})") from exc
    if done.returncode != 0:
        raise overlay.OverlayError(overlay.BAD_INPUT, f"{python}: cannot run it to find its site-packages: {done.stderr.strip()}")
    return Path(done.stdout.strip())


def run(args) -> int:
    # verify in the image checks the base the image was built on.
    overlay.resolve_base(args, args.vllm or (os.environ.get(IMAGE_VLLM_ENV) if args.command == "verify" else None))
    if args.command == "rebase":
        return rebase.run_rebase(args)
    manifest, overlay_dir = Path(args.manifest), Path(args.overlay_dir)
    site = Path(args.site_packages) if getattr(args, "site_packages", None) is not None else None
    receipt = Path(args.receipt) if getattr(args, "receipt", None) is not None else None
    if args.command == "check":
        for line in overlay.check(args.recipe, manifest, overlay_dir):
            say(line)
    elif args.command == "apply":
        written = overlay.apply(required_site(site, "apply"), args.recipe, manifest, overlay_dir, receipt,
                                lock_timeout=args.lock_timeout, report=say)
        say(f"applied {len(written['files'])} files over vLLM {written['vllm_version']} in {site}")
    elif args.command == "revert":
        for line in overlay.revert(required_site(site, "revert"), manifest, receipt, lock_timeout=args.lock_timeout, report=say):
            say(line)
    elif args.command == "verify":
        site = site or purelib_of(args.python)
        for line in overlay.verify(site, manifest, receipt, args.python, args.recipe, lock_timeout=args.lock_timeout):
            say(line)
    elif args.command == "diff":
        sys.stdout.write(overlay.diff(args.recipe, manifest, overlay_dir))
    elif args.command == "record":
        record(args, manifest, overlay_dir)
    return overlay.OK


def required_site(site: Path | None, command: str) -> Path:
    if site is None:  # the parser requires it; a caller building the arguments by hand may not
        raise overlay.OverlayError(overlay.BAD_INPUT, f"{command}: --site-packages DIR is required")
    return site


def record(args, manifest: Path, overlay_dir: Path) -> None:
    if not args.paths and not args.refresh:
        raise overlay.OverlayError(overlay.BAD_INPUT, "record: give PATH... or --refresh")
    if args.remove and (args.refresh or args.why):
        raise overlay.OverlayError(overlay.BAD_INPUT, "record: --remove takes only PATH...")
    result = overlay.record(args.paths, args.why, args.refresh, args.remove, args.recipe, args.vllm, manifest,
                            overlay_dir)
    say(f"{args.manifest}: {len(result.files)} entries")
    if manifest.resolve() == overlay.manifest_path(args.vllm).resolve():
        # The image's receipt label is derived from the manifest: keep it in step.
        (REPO_ROOT / bake.BAKE_JSON).write_text(bake.render_bake_json(args.recipe))
        receipt = overlay.predicted_receipt_sha256(load_recipe(args.recipe, vllm=args.vllm))
        say(f"{bake.BAKE_JSON}: RECEIPT_SHA256 of vLLM {args.vllm} {receipt}")


def parser() -> argparse.ArgumentParser:
    main = argparse.ArgumentParser(prog="scripts/overlay.py", description=__doc__, epilog=EXIT_CODES,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    main.add_argument("--manifest", help="default: overlay/vllm-VERSION/manifest.json of this repo")
    main.add_argument("--overlay-dir", help="default: overlay/vllm-VERSION/ of this repo")
    commands = main.add_subparsers(dest="command", required=True)
    base = argparse.ArgumentParser(add_help=False)
    base.add_argument("--vllm", metavar="VERSION", help="the base: a vLLM release the recipe pins (default: the "
                                                        f"recipe's default; verify: ${IMAGE_VLLM_ENV} first)")
    check = commands.add_parser("check", parents=[base], help="manifest <-> overlay files <-> pinned wheels")
    check.add_argument("--recipe", default=DEFAULT_RECIPE)
    locked = argparse.ArgumentParser(add_help=False, parents=[base])
    locked.add_argument("--lock-timeout", type=float, default=overlay.LOCK_TIMEOUT, metavar="SECONDS",
                        help="how long to wait for another apply/revert on the same DIR (default: %(default)g)")
    apply = commands.add_parser("apply", parents=[locked], help="overlay a site-packages, all or nothing")
    apply.add_argument("--site-packages", required=True)
    apply.add_argument("--recipe", default=DEFAULT_RECIPE)
    apply.add_argument("--receipt", help="default: SITE_PACKAGES/vllm_overlay_receipt.json")
    revert = commands.add_parser("revert", parents=[locked], help="put upstream vLLM back, all or nothing")
    revert.add_argument("--site-packages", required=True)
    revert.add_argument("--receipt", help="default: SITE_PACKAGES/vllm_overlay_receipt.json (a receipt apply wrote "
                                          "elsewhere is removed only when named here)")
    verify = commands.add_parser("verify", parents=[locked], help="re-hash and import-check an overlaid site-packages")
    verify.add_argument("--site-packages", help="default: the purelib of --python")
    verify.add_argument("--python", default=sys.executable, help="interpreter to import with (default: this one)")
    verify.add_argument("--receipt", help="default: SITE_PACKAGES/vllm_overlay_receipt.json")
    verify.add_argument("--recipe", default=os.environ.get("DSA_IMAGE_RECIPE") or DEFAULT_RECIPE,
                        help=f"the recipe the receipt must name (default: $DSA_IMAGE_RECIPE if set, else {DEFAULT_RECIPE})")
    diff = commands.add_parser("diff", parents=[base], help="overlay vs upstream, unified diff")
    diff.add_argument("--recipe", default=DEFAULT_RECIPE)
    record = commands.add_parser("record", parents=[base], help="add, refresh or remove manifest entries")
    record.add_argument("paths", nargs="*", metavar="PATH")
    record.add_argument("--why", help="one line: why this file is overlaid")
    record.add_argument("--refresh", action="store_true", help="recompute the hashes of every entry")
    record.add_argument("--remove", action="store_true", help="drop the entries for PATH...")
    record.add_argument("--recipe", default=DEFAULT_RECIPE)
    rebase.add_rebase_parser(commands, parents=[base])
    return main


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return run(args)
    except overlay.OverlayError as exc:
        say(f"error: {exc}")
        return exc.exit_code
    except overlay.Interrupted as exc:
        say(f"error: {exc}")
        return die_by(exc.signum)
    except KeyboardInterrupt:
        say("error: interrupted by SIGINT outside a transaction: no file is half changed")
        return die_by(signal.SIGINT)


def die_by(signum: int) -> int:
    """Exit by the signal that stopped us (after the rollback), as an uncaught one would: the
    caller (a shell, make, docker build) then sees it was interrupted, not that it failed."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    return status.killed_by(signum)


if __name__ == "__main__":
    sys.exit(main())
