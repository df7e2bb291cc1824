#!/usr/bin/env python3
"""Smoke-test a GLM-5 DSA server: the image (`--runtime docker`) or a local `vllm serve`
(`--runtime local`). `--help` lists the options and exit codes; docs/smoke.md explains them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsa_image.smoke.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
