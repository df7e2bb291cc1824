#!/usr/bin/env python3
"""Stage the H200 validation run's wheels into .stage/ (see dsa_image/validation/stage.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_image.validation.stage import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
