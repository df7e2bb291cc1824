#!/usr/bin/env python3
"""Write the tiny GLM-5 model directory (config + tokenizer, no weights; serve it with
`--load-format dummy`), or check that a directory is exactly what this writes.

    python3 scripts/make_tiny_model.py OUT_DIR
    python3 scripts/make_tiny_model.py --check DIR

Exit codes: --help (dsa_image/core/status.py renders them).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsa_image.build.tiny_model import TinyModelError, model_dir_differences, write_model  # noqa: E402
from dsa_image.core import status  # noqa: E402

EXIT_CODES = status.epilog(
    (status.SUCCESS, "written; --check: identical"),
    (status.FAILED, "--check: the directory differs (each difference printed); else it cannot be written"),
    status.USAGE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="where to write the model (must not exist or be empty)")
    parser.add_argument("--check", action="store_true", help="compare DIR with what would be written; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        differences = model_dir_differences(args.directory)
        for line in differences:
            print(f"{args.directory}: {line}", file=sys.stderr)
        if differences:
            print("regenerate it with: python3 scripts/make_tiny_model.py DIR", file=sys.stderr)
        return status.FAILED if differences else status.SUCCESS
    try:
        written = write_model(args.directory)
    except (TinyModelError, OSError) as e:
        print(f"make_tiny_model: {e}", file=sys.stderr)
        return status.FAILED
    for path in written:
        print(path)
    return status.SUCCESS


if __name__ == "__main__":
    sys.exit(main())
