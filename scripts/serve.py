#!/usr/bin/env python3
"""GLM-5.x serving recipes (recipes/serve/): list them, print a dry run, launch solo or across nodes.

    python3 scripts/serve.py --list
    python3 scripts/serve.py glm-5.2-nvfp4-8xspark --dry-run --nodes 10.0.0.1,10.0.0.2,...
    python3 scripts/serve.py glm-5-fp8-8xb200 --set max_model_len=65536 -- --enable-log-requests

Needs only Python 3.11+ (no GPU for --list and --dry-run). The same runs inside the image:
docker run IMAGE recipe --list. Exit codes: `--help`; dsa_image/serving/cli.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsa_image.serving.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="scripts/serve.py"))
