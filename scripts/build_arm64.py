#!/usr/bin/env python3
"""Build the sm120 image for linux/arm64 (DGX Spark) and check it: CI's arm64 step (.ci/run). (see dsa_image/build/arm64_build.py).

    python3 scripts/build_arm64.py [--base-image NAME] [--log-dir DIR]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_image.build.arm64_build import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
