"""Stage the wheels the H200 validation run installs, split for the device transfer.

The device machine has no network, and each call carries at most 64 MiB of the
repository: the wheels travel as one tarball in parts of 60 MB under ``.stage/``
(git-ignored), one part per call, and scripts/h200_validation.sh reassembles them.

What goes in, for the base --vllm names (default: the recipe's default): the vLLM
wheel it pins (sha256 checked), the serving dependencies the H200's Python lacks
(docs/validation/h200-serving-wheels.txt: the list for vLLM 0.24.0, established on
the H200's torch 2.11.0), b12x with the CuTe DSL at the versions the base's sm120
lock pins (for the b12x metadata check), and the base's pip CUDA toolkit (its
[vllm."X.Y.Z".cuda] pins, for the toolchain check), and Ray at the recipe's [cluster]
pin (for the two-GPU cluster proof; its own dependencies are already on the H200).
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tarfile
from pathlib import Path

from dsa_image import lock, wheels
from dsa_image.recipe import Recipe, load_recipe

REPO = Path(__file__).resolve().parents[2]
SERVING_LIST = REPO / "docs" / "validation" / "h200-serving-wheels.txt"
FROM_SM120_LOCK = ("b12x", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base",
                   "nvidia-cutlass-dsl-libs-cu13")
PART_BYTES = 60_000_000
# The H200's Python (3.12, x86_64); pip matches manylinux tags exactly.
PLATFORM_ARGS = ["--python-version", "3.12", "--implementation", "cp"] + [
    arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64",
                    "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                    "manylinux_2_31_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")
    for arg in ("--platform", tag)]


def requirements(recipe: Recipe) -> list[str]:
    serving = [line.strip() for line in SERVING_LIST.read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    pins = lock.parse_lock(lock.target_lock(recipe, recipe.targets["sm120"], "amd64").read_text())
    return (serving + [f"{name}=={pins[name].version}" for name in FROM_SM120_LOCK]
            + list(recipe.cuda_toolkit) + list(recipe.cluster_packages))


def download(into: Path, recipe: Recipe) -> list[Path]:
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--index-url", "https://pypi.org/simple",
                    *PLATFORM_ARGS, "-d", str(into), *requirements(recipe)], check=True)
    vllm = recipe.wheel("linux/amd64")
    return sorted(into.glob("*.whl")) + [wheels.ensure_wheel(vllm.filename, vllm.sha256)]


def split(bundle: Path, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(f"{bundle.name}.part*"):
        old.unlink()
    parts, digest = [], hashlib.sha256()
    with bundle.open("rb") as f:
        while chunk := f.read(PART_BYTES):
            digest.update(chunk)
            part = out / f"{bundle.name}.part{len(parts):02d}"
            part.write_bytes(chunk)
            parts.append(part)
    (out / "SHA256SUMS").write_text(f"{digest.hexdigest()}  {bundle.name}\n")
    return parts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=wheels.cache_dir() / "h200-wheels")
    parser.add_argument("--out", type=Path, default=REPO / ".stage")
    parser.add_argument("--vllm", metavar="VERSION", help="the recipe's base to stage (default: its default)")
    args = parser.parse_args(argv)
    files = download(args.cache, load_recipe(vllm=args.vllm))
    bundle = args.cache.parent / "bundle.tar"
    with tarfile.open(bundle, "w") as tar:
        for path in files:
            tar.add(path, arcname=path.name)
    parts = split(bundle, args.out)
    print(f"{len(files)} wheels, {bundle.stat().st_size / 1e6:.0f} MB in {len(parts)} parts "
          f"under {args.out}; carry one part per device call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
