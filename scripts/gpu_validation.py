#!/usr/bin/env python3
"""The GPU validation session runner: a base's phases on a lent GPU machine (see
dsa_image/validation/session.py, or --help for the table of phases)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_image.validation.session import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
