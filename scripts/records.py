#!/usr/bin/env python3
"""Pack, check and unpack the records' raw data (see dsa_image/records/store.py; `--help`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_image.records.store import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
