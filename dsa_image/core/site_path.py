"""PYTHONPATH for a `pip install --target` site: the site, then the directories its packages'
.pth files would have added had it been a real site dir (Python runs no .pth file found on
PYTHONPATH).

The one such package in our locks is the CuTe DSL (nvidia-cutlass-dsl, for b12x and, in vLLM
0.33.0, GLM-5's own attention: `vllm/models/deepseek_v32/nvidia/ops/fused_q_cutedsl.py`
imports `cutlass` on every GPU). Its .pth adds nvidia_cutlass_dsl/python_packages (4.5.x,
vLLM 0.24.0) or nvidia_cutlass_dsl/dsl_packages (4.8.x, vLLM 0.33.0). Without it, stock vLLM
0.33.0 served from such a site fails its first forward with "No module named 'cutlass'".

Usage: python -m dsa_image.core.site_path SITE   (prints the PYTHONPATH; exits SUCCESS, or USAGE
when SITE is not one directory: dsa_image/core/status.py)
"""

from __future__ import annotations

import os
import sys

from dsa_image.core import status

CUTE_DSL_DIRS = ("nvidia_cutlass_dsl/python_packages", "nvidia_cutlass_dsl/dsl_packages")


def pythonpath(site: str) -> str:
    """The site, then each of CUTE_DSL_DIRS it holds."""
    extra = [os.path.join(site, d) for d in CUTE_DSL_DIRS if os.path.isdir(os.path.join(site, d))]
    return os.pathsep.join([site, *extra])


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not os.path.isdir(args[0]):
        print(f"usage: python -m dsa_image.core.site_path SITE (a directory); got {args!r}", file=sys.stderr)
        return status.USAGE
    print(pythonpath(args[0]))
    return status.SUCCESS


if __name__ == "__main__":
    sys.exit(main())
