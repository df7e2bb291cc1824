#!/usr/bin/env python3
"""Prove, without a GPU, that an image runs on its GPU family (thin CLI over dsa_image.build.arch_check).

  arch_check.py extensions --site-packages DIR --cuda-arch 12.0,12.1
      every vLLM compiled extension that must run on those capabilities carries SASS for
      them or PTX the driver can compile (cuobjdump --list-elf / --list-ptx)
  arch_check.py toolchain --cuda-home DIR --cuda-arch 12.0,12.1
      CUDA_HOME's nvcc compiles and links a probe library carrying SASS for each

Exit codes: below (EXIT_CODES, rendered by dsa_image/core/status.py).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsa_image.build import arch_check
from dsa_image.core import status

EXIT_CODES = status.epilog(
    (status.SUCCESS, "the check passed"),
    (status.FAILED, "it failed (the message says what was expected and found)"),
    status.USAGE)


def _capabilities(text: str) -> list[tuple[int, int]]:
    try:
        # "12.0,12.1" or, as bake passes the recipe's list (TORCH_CUDA_ARCH_LIST style), "12.0;12.1"
        return [arch_check.parse_capability(part) for part in re.split(r"[,;]", text) if part.strip()]
    except arch_check.ArchCheckError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuobjdump", type=Path, help="default: CUDA_HOME/bin, PATH, then Triton's wheel")
    sub = parser.add_subparsers(dest="command", required=True)
    ext = sub.add_parser("extensions", help="check vLLM's compiled extensions")
    ext.add_argument("--site-packages", type=Path, required=True)
    tool = sub.add_parser("toolchain", help="compile a probe with CUDA_HOME's nvcc")
    tool.add_argument("--cuda-home", type=Path, default=os.environ.get("CUDA_HOME"))
    for p in (ext, tool):
        p.add_argument("--cuda-arch", type=_capabilities, required=True,
                       help="compute capabilities separated by , or ;, e.g. 12.0,12.1")
    args = parser.parse_args(argv)
    if not args.cuda_arch:
        parser.error("--cuda-arch: give at least one capability")
    try:
        cuobjdump = args.cuobjdump or arch_check.find_cuobjdump(os.environ.get("CUDA_HOME"))
        if args.command == "extensions":
            for r in arch_check.check_extensions(args.site_packages, args.cuda_arch, cuobjdump):
                need = ", ".join(r.required) or "-"
                print(f"ok  {r.path}: needs {need}; carries {', '.join(r.codes) or 'no device code'}")
        else:
            if args.cuda_home is None:
                parser.error("toolchain: set CUDA_HOME or pass --cuda-home")
            codes = arch_check.check_toolchain(args.cuda_home, args.cuda_arch, cuobjdump)
            print(f"ok  {args.cuda_home}/bin/nvcc built a probe carrying {', '.join(map(str, codes))}")
    except arch_check.ArchCheckError as exc:
        print(f"arch_check: {exc}", file=sys.stderr)
        return status.FAILED
    return status.SUCCESS


if __name__ == "__main__":
    sys.exit(main())
