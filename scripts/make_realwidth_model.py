#!/usr/bin/env python3
"""Write GLM-5 at real width, 4 layers deep (config + tokenizer + README, no weights; serve it
with `--load-format dummy`), or check that a directory is exactly what this writes: see
dsa_image/build/realwidth_model.py.

    python3 scripts/make_realwidth_model.py OUT_DIR
    python3 scripts/make_realwidth_model.py --check DIR

Exit codes: 0 written / identical; 1 the directory differs (--check) or cannot be written;
2 usage error.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsa_image.build.realwidth_model import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
