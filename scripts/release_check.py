#!/usr/bin/env python3
"""The release check: the docs' claims against the records and today's tree (see dsa_image/records/release_check.py; `--help`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_image.records.release_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
