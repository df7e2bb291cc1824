#!/usr/bin/env python3
"""vLLM's own tests as the overlay's gate: the test files of a base's pinned sdist that import an
overlaid module, run per file against a stock site and an overlaid site, compared test by test.

  select  [--vllm X] [--json FILE]         print what the base's sdist selects, and why
  bundle  [--vllm X] --out DIR [--python-version 3.12]
                                           extract the selection, its support files and the
                                           packages of recipes/locks/upstream-tests.txt into DIR
  run     --bundle DIR --side stock|overlay --out OUT [--python EXE] [--site DIR] [--libs DIR...]
                                           each selected file in its own pytest, junit XML per
                                           file in OUT/SIDE/ (resumes: files with a result are
                                           not run again; a file its --timeout cut short goes
                                           on in parts, each test run once)
  compare OUT --bundle DIR [--json FILE]   the per-file table over every file the bundle selects
                                           (none left out for lack of results), the regressions,
                                           "N regressions"
  forget  OUT --files PATH...              drop these files' results on both sides (run.json
                                           entries, junit, logs, records): the next run runs
                                           them afresh
  gate    --bundle DIR --out OUT --stock-site DIR --overlay-site DIR [--python EXE] [--jobs 2]
          [--shards N]                     run both sides (interleaved by file, --jobs at once,
                                           each file in --shards processes), then compare

The rule: no test that passes on stock may fail, error, be skipped or go missing on the overlay,
no test stock skips may fail or go missing there, and no test only the overlay has may fail. A
test failing on both is listed, not counted. Sites: `--python` (default: this interpreter) runs
the tests; `--site` is a `pip install --target` directory put first on PYTHONPATH (the H200's
/tmp/site-stock-X.Y.Z); `--libs` are appended to sys.path after the site's packages (the image's
test runner). The stock side must have no overlay receipt in its site, the overlay side must.
Details: docs/upstream-tests.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsa_image.build import lock
from dsa_image.upstream import gate as ut
from dsa_image.core import status, wheels
from dsa_image.overlay.manifest import ManifestError, load_manifest  # noqa: E402
from dsa_image.overlay.core import manifest_path  # noqa: E402
from dsa_image.core.recipe import DEFAULT_RECIPE, REPO_ROOT, RecipeError, load_recipe  # noqa: E402

OK, REGRESSIONS, BAD_INPUT, FETCH_FAILED, INCOMPLETE = (status.SUCCESS, status.FAILED, status.USAGE,
                                                      status.ENVIRONMENT, status.INCOMPLETE)
EXIT_CODES = status.epilog(
    (OK, "ok: no regression, every selected file ran on both sides (run: every file ran)"),
    (REGRESSIONS, "regressions (listed)"),
    (BAD_INPUT, "bad usage or input: unknown base, a bundle that changed since it was written, a site whose vLLM "
                "is not the bundle's base or is on the wrong side, results of another bundle or site"),
    (FETCH_FAILED, "the pinned sdist or the lock's packages could not be fetched or did not match their sha256"),
    (INCOMPLETE, "incomplete, no regression: some selected file has no result on a side (not run yet after "
                 "--deadline-s, timed out, crashed, or not runnable: a module its collection imports is missing), "
                 "each listed with the reason; or no test passed on stock (nothing was compared)"))


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _base(args):
    recipe = load_recipe(args.recipe, vllm=args.vllm)
    manifest, _ = load_manifest(manifest_path(recipe.vllm_version))
    return recipe, manifest


def cmd_select(args) -> int:
    recipe, manifest = _base(args)
    tree, _ = ut.read_sdist(ut.pinned_sdist(recipe), recipe.vllm_version)
    selection = ut.select(tree, ut.overlaid_modules(manifest))
    doc = ut.selection_doc(selection, recipe.vllm_version, recipe.sdist.filename, recipe.sdist.sha256)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    print(f"vLLM {recipe.vllm_version} ({recipe.sdist.filename}, sha256 {recipe.sdist.sha256}): "
          f"{len(selection.selected)} test files import an overlaid module ({', '.join(selection.overlaid)}); "
          f"{len(selection.support)} support files")
    for item in selection.selected:
        print(f"  {item.path}  (collection imports {', '.join(item.needs) or 'nothing third-party'})")
        print("".join(f"      {line}\n" for line in item.imports), end="")
    return OK


def cmd_bundle(args) -> int:
    recipe, manifest = _base(args)
    bundle = ut.make_bundle(recipe, manifest, args.out, REPO_ROOT / lock.UPSTREAM_TESTS_LOCK, args.python_version)
    size = sum((args.out / rel).stat().st_size for rel in bundle["files"])
    say(f"wrote {args.out}: {len(bundle['selected'])} selected test files, {len(bundle['support'])} support files, "
        f"packages {', '.join(bundle['libs']) or 'none'}; {size / 1e6:.1f} MB")
    return OK


def _site(side: str, python: str, site: Path | None, libs: list[Path]) -> ut.Site:
    if site is not None and not site.is_dir():
        raise ut.UpstreamTestsError(f"--site {site}: not a directory")
    return ut.Site(side, python, site.resolve() if site else None, tuple(p.resolve() for p in libs))


def _finish(runs: dict, out: Path) -> int:
    pending = [p for r in runs.values() for p, f in r["files"].items() if f["status"] != "ran"]
    say(f"results in {out}")
    return INCOMPLETE if pending else OK


def cmd_run(args) -> int:
    bundle = ut.load_bundle(args.bundle)
    site = _site(args.side, args.python, args.site, args.libs)
    runs = ut.run_tasks(bundle, [site], args.out, args.timeout, args.files, args.jobs, args.deadline_s, say,
                        args.shards)
    expected = {s["path"] for s in bundle.selected if not args.files or s["path"] in args.files}
    missing = expected - set(runs[args.side]["files"])
    if missing:
        say(f"{len(missing)} files not run before the deadline; run the same command again to resume")
        return INCOMPLETE
    return _finish(runs, args.out)


def report_comparison(out: Path, bundle: ut.Bundle, files: list[str] | None, json_path: Path | None) -> int:
    comparison = ut.compare_runs(out, bundle, files)
    print(ut.format_comparison(comparison), end="")
    if json_path:
        json_path.write_text(json.dumps(ut.comparison_doc(comparison), indent=2, sort_keys=True) + "\n")
    return {"regressions": REGRESSIONS, "incomplete": INCOMPLETE, "ok": OK}[comparison.verdict]


def cmd_compare(args) -> int:
    return report_comparison(args.out, ut.load_bundle(args.bundle), args.files, args.json)


def cmd_forget(args) -> int:
    removed = ut.forget_files(args.out, args.files)
    say(f"forgot {', '.join(args.files)} on both sides of {args.out} ({len(removed)} files removed); the next run "
        "runs them afresh")
    return OK


def cmd_gate(args) -> int:
    bundle = ut.load_bundle(args.bundle)
    sites = [_site("stock", args.python, args.stock_site, args.libs),
             _site("overlay", args.python, args.overlay_site, args.libs)]
    ut.run_tasks(bundle, sites, args.out, args.timeout, args.files, args.jobs, args.deadline_s, say, args.shards)
    return report_comparison(args.out, bundle, args.files, args.json)


def _run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bundle", type=Path, required=True, help="a directory `bundle` wrote")
    parser.add_argument("--out", type=Path, required=True, help="results: OUT/stock/, OUT/overlay/")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the site (default: this one)")
    parser.add_argument("--libs", type=Path, action="append", default=[],
                        help="a directory appended to sys.path after the site's packages (repeatable)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run of a test file on a side (default "
                        "600); a file it cuts short goes on in parts, the test a part's kill caught rerun, or, if it "
                        "had the whole part, its outcome `timeout`")
    parser.add_argument("--deadline-s", type=float, help="start no file after this many seconds (resume later)")
    parser.add_argument("--jobs", type=int, default=1, help="test files run at once (default 1)")
    parser.add_argument("--shards", type=int, default=1, help="pytest processes a file runs in at once, each a share of "
                        "its tests by node id (default 1); a file begun in N shards resumes in N")
    parser.add_argument("--files", nargs="+", metavar="PATH", help="only these selected files (tests/...py)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/upstream_tests.py", description=__doc__, epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"recipe id (default {DEFAULT_RECIPE})")
    commands = parser.add_subparsers(dest="command", required=True)
    base = argparse.ArgumentParser(add_help=False)
    base.add_argument("--vllm", metavar="VERSION", help="the base (default: the recipe's default)")
    select = commands.add_parser("select", parents=[base], help="print the selection of the base's sdist")
    select.add_argument("--json", type=Path, help="also write it as JSON")
    select.set_defaults(run=cmd_select)
    bundle = commands.add_parser("bundle", parents=[base], help="write the selection into a new directory")
    bundle.add_argument("--out", type=Path, required=True)
    bundle.add_argument("--python-version", help="the Python that will run the tests, e.g. 3.12 (default: this one)")
    bundle.set_defaults(run=cmd_bundle)
    run = commands.add_parser("run", help="run the bundle against one site")
    _run_options(run)
    run.add_argument("--side", choices=ut.SIDES, required=True)
    run.add_argument("--site", type=Path, help="a `pip install --target` directory, first on PYTHONPATH")
    run.set_defaults(run=cmd_run)
    compare = commands.add_parser("compare", help="compare OUT/stock with OUT/overlay")
    compare.add_argument("out", type=Path)
    compare.add_argument("--bundle", type=Path, required=True,
                         help="the bundle both sides ran (its directory, or its bundle.json alone, as the image's "
                              "exported results carry it): each file it selects counts, with or without results")
    compare.add_argument("--files", nargs="+", metavar="PATH", help="only these selected files (tests/...py)")
    compare.add_argument("--json", type=Path, help="also write the comparison as JSON")
    compare.set_defaults(run=cmd_compare)
    forget = commands.add_parser("forget", help="drop some files' results on both sides (to run them afresh)")
    forget.add_argument("out", type=Path)
    forget.add_argument("--files", nargs="+", metavar="PATH", required=True, help="files with a result (tests/...py)")
    forget.set_defaults(run=cmd_forget)
    gate = commands.add_parser("gate", help="run both sides, then compare")
    _run_options(gate)
    gate.add_argument("--stock-site", type=Path, help="stock vLLM's `pip install --target` directory")
    gate.add_argument("--overlay-site", type=Path, help="the overlaid vLLM's `pip install --target` directory")
    gate.add_argument("--json", type=Path, help="also write the comparison as JSON")
    gate.set_defaults(run=cmd_gate)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (RecipeError, ManifestError, ut.UpstreamTestsError) as exc:
        say(f"error: {exc}")
        return BAD_INPUT
    except wheels.WheelError as exc:
        say(f"error: {exc}")
        return FETCH_FAILED


if __name__ == "__main__":
    sys.exit(main())
