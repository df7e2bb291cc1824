#!/usr/bin/env python3
"""Paired serving benchmark: two vLLM builds side by side on one GPU, alternating rounds.

    python3 scripts/bench.py plan [--workloads ...] [--rounds-scale F]      what would run, how long
    python3 scripts/bench.py run --a-site S --b-site O --model DIR --out DIR [--workloads ...]
    python3 scripts/bench.py plot RESULTS.json [...] [--out DIR]             PNGs (matplotlib, no GPU)
    python3 scripts/bench.py table RESULTS.json [...]                        markdown rows

The code is dsa_image/bench/ (paired.py runs it and is this command line);
docs/benchmarks/README.md says how to read the results.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsa_image.bench.paired import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
