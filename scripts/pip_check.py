#!/usr/bin/env python3
"""`pip check` for an image target, accepting only the conflicts its recipe overrides.

  pip_check.py --target sm120 [--recipe glm5-dsa] [--vllm VERSION] [--recipes-dir DIR]

--vllm: the base the image was built on (default: the recipe's default); its extras say which
conflicts are overridden.

Exit codes: below (EXIT_CODES, rendered by dsa_image/core/status.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsa_image.build import pip_check
from dsa_image.core import status  # noqa: E402
from dsa_image.core.recipe import DEFAULT_RECIPE, RECIPES_DIR, RecipeError, load_recipe  # noqa: E402

EXIT_CODES = status.epilog(
    (status.SUCCESS, "nothing broken but the conflicts the recipe overrides"),
    (status.FAILED, "other broken requirements (listed)"),
    (status.USAGE, "usage, or an unknown recipe, base or target"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--recipe", default=DEFAULT_RECIPE)
    parser.add_argument("--vllm", metavar="VERSION")
    parser.add_argument("--recipes-dir", type=Path, default=RECIPES_DIR)
    args = parser.parse_args(argv)
    try:
        target = load_recipe(args.recipe, args.recipes_dir, args.vllm).target(args.target)
    except RecipeError as exc:
        print(f"pip_check: {exc}", file=sys.stderr)
        return status.USAGE
    output = pip_check.run_pip_check()
    found = pip_check.problems(output, target)
    if found:
        print("pip_check: broken requirements the recipe does not override:\n  " + "\n  ".join(found), file=sys.stderr)
        return status.FAILED
    accepted = [str(c) for c in pip_check.parse_conflicts(output)[0]]
    print("pip_check: ok" + (f" (recipe overrides: {'; '.join(accepted)})" if accepted else ""))
    return status.SUCCESS


if __name__ == "__main__":
    sys.exit(main())
