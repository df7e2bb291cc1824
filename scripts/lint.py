#!/usr/bin/env python3
"""The lint and type gates, as CI runs them: ruff (pyflakes, bugbear, complexity) over the
repository and mypy over dsa_image/ and scripts/, both configured in pyproject.toml.

    python3 scripts/lint.py

Prepares .venv from recipes/locks/dev.txt as scripts/test.py does. Exit codes
(dsa_image/core/status.py): 0 both clean; 1 either found a problem (each printed); 4
(ENVIRONMENT) the environment could not be prepared.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test  # noqa: E402  (scripts/test.py: the one venv the gates and the tests share)

GATES = (["ruff", "check", "."], ["mypy"])


def main() -> int:
    try:
        python = test.prepare_venv()
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"lint.py: could not prepare {test.VENV} ({exc})", file=sys.stderr)
        return test.SETUP_FAILED
    failed = [gate[0] for gate in GATES
              if subprocess.run([str(python), "-m", *gate], cwd=test.REPO_ROOT).returncode != 0]
    print(f"lint.py: {'failed: ' + ', '.join(failed) if failed else 'ruff and mypy clean'}", file=sys.stderr)
    return test.status.FAILED if failed else test.status.SUCCESS


if __name__ == "__main__":
    sys.exit(main())
