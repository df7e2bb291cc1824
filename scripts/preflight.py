#!/usr/bin/env python3
"""Before the first build: what this host needs, and the exact `docker buildx bake` command.

    python3 scripts/preflight.py [TARGET]        (default sm120; BASE_IMAGE=... is honoured)

Checks the Docker engine and buildx, whether the engine has a docker0 bridge (without one a
default build fails with "network bridge not found"), whether the base image is here or a
registry serves it (else, for the recipe's, the local one from scripts/bootstrap_base_image.sh;
one named in BASE_IMAGE is never swapped; the tests choose theirs by the same rule), and whether
HTTPS to PyPI is intercepted (then pip needs the host's CA bundle). Prints one line per finding,
then the command. Nothing is built, pulled or changed. docs/image.md explains each part
("Hosts without a registry, a bridge or direct TLS").

Exit codes: printed with the usage, `preflight.py --help` (EXIT_CODES, rendered by
dsa_image/core/status.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from dsa_image.build import image_build  # noqa: E402
from dsa_image.core import status  # noqa: E402
from dsa_image.core.recipe import load_recipe  # noqa: E402

EXIT_CODES = status.epilog(
    (status.SUCCESS, "the printed command should work here"),
    status.USAGE,
    (status.ENVIRONMENT, "this host lacks something the build needs: do the FIRST steps listed"))


def main(argv: list[str]) -> int:
    recipe = load_recipe()
    if len(argv) > 1 or (argv and (argv[0].startswith("-") or argv[0] not in [*recipe.targets, "test", "default"])):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        print(f"TARGET: one of {', '.join([*recipe.targets, 'test', 'default'])}", file=sys.stderr)
        print(EXIT_CODES, end="", file=sys.stderr)
        return status.SUCCESS if argv and argv[0] in ("-h", "--help") else status.USAGE
    target = argv[0] if argv else "sm120"
    base = os.environ.get("BASE_IMAGE") or recipe.base_ref
    facts = image_build.host_facts(base, repo=REPO_ROOT)
    result = image_build.preflight_options(facts, recipe.base_ref)
    for note in result.notes:
        print(f"preflight: {note}")
    for blocker in result.blockers:
        print(f"preflight: FIRST: {blocker}")
    print(f"\n    {image_build.bake_invocation(result.options, target)}\n")
    if result.blockers:
        print(f"preflight: do the FIRST steps above, then run that command ({image_build.HOST_DOCS})")
        return status.ENVIRONMENT
    return status.SUCCESS


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
