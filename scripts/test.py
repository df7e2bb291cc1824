#!/usr/bin/env python3
"""Run the test suite from a fresh machine that has only Python (3.11+, with venv) and Docker.

    python3 scripts/test.py [PYTEST ARGS...]

Creates .venv when missing, installs recipes/locks/dev.txt into it with --require-hashes
(again only when that lock changed), then runs pytest with the given arguments.

The Docker tests build on the base `scripts/preflight.py` picks: the recipe's when this engine
has it or a registry serves it, else dsa-image-base:bookworm when this engine has it (made by
`sudo bash scripts/bootstrap_base_image.sh dsa-image-base:bookworm`); with neither they skip,
saying so. Their build network too: the default one, or host networking on an engine without
a docker0 bridge.

Environment: DSA_IMAGE_REQUIRE_DOCKER=1 turns skipped Docker tests into failures (CI);
DSA_IMAGE_BASE_IMAGE=NAME builds on that base image instead (never replaced by another).

Exit codes: pytest's (0 all passed; 5 "no tests collected" is a failure too, like any
non-zero); 4 (ENVIRONMENT, dsa_image/core/status.py) the environment could not be prepared.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

# Stdlib only, like this script: it runs before any virtual environment exists.
from dsa_image.core import status  # noqa: E402

VENV = REPO_ROOT / ".venv"
DEV_LOCK = REPO_ROOT / "recipes" / "locks" / "dev.txt"
STAMP = VENV / ".dsa-image-dev-lock.sha256"
SYSTEM_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
SETUP_FAILED = status.ENVIRONMENT


def run(command: list[str]) -> None:
    print("+ " + " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, check=True)


def prepare_venv() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        run([sys.executable, "-m", "venv", str(VENV)])
    lock_sha = hashlib.sha256(DEV_LOCK.read_bytes()).hexdigest()
    if STAMP.is_file() and STAMP.read_text().strip() == lock_sha:
        return python
    # --isolated: only the public index and the lock's hashes count, not this machine's pip
    # configuration (local indexes, constraints). The system CA bundle still applies, for
    # TLS-intercepting proxies.
    cert = ["--cert", str(SYSTEM_CA_BUNDLE)] if SYSTEM_CA_BUNDLE.is_file() else []
    run([str(python), "-m", "pip", "install", "--isolated", *cert, "--disable-pip-version-check",
         "--index-url", "https://pypi.org/simple", "--require-hashes", "--no-deps", "-r", str(DEV_LOCK)])
    STAMP.write_text(lock_sha + "\n")
    return python


def main(argv: list[str]) -> int:
    started = time.monotonic()
    try:
        python = prepare_venv()
    except (OSError, subprocess.CalledProcessError) as exc:
        print(f"test.py: could not prepare {VENV} ({exc}); on Debian install python3-venv, "
              f"then re-run", file=sys.stderr)
        return SETUP_FAILED
    code = subprocess.run([str(python), "-m", "pytest", *argv], cwd=REPO_ROOT).returncode
    minutes = (time.monotonic() - started) / 60
    if code == 5:
        print("test.py: pytest collected no tests: that is a failure here", file=sys.stderr)
    print(f"test.py: pytest exit code {code} after {minutes:.1f} min", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
