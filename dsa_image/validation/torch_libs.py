"""Which torch, and which CUDA libraries, a validation site really loads on the GPU host.

    PYTHONPATH=SITE:REPO python3 -m dsa_image.validation.torch_libs --vllm VERSION --site SITE

The GPU session runner (scripts/gpu_validation.py) installs a base's staged wheels into SITE
with `pip install --target` and runs everything with SITE first on PYTHONPATH, ahead of the
H200's venv (torch 2.11.0 and its CUDA 13.0 libraries). A base whose torch differs (vLLM 0.33.0:
torch 2.14.0) has torch and its whole NVIDIA library set in SITE
(dsa_image.validation.stage.torch_stack). torch finds
those libraries through its RPATH ($ORIGIN/../../nvidia/...) and then preloads each from the
first sys.path entry that has it (torch/__init__.py, _load_global_deps), so the order of
PYTHONPATH decides, and this checks what it decided: after a matmul (cuBLAS) and a convolution
(cuDNN) it reads /proc/self/maps.

Expected: torch imported from SITE when SITE has torch, else from outside it, at the version the
base's lock pins (a local label such as +cu130 aside); libcublas and libcudnn from torch's own
tree; and with torch in SITE, every CUDA library of torch's from SITE. With torch from the
H200's venv (vLLM 0.24.0), libraries SITE also holds (the pip CUDA toolkit's cudart and curand)
may be preloaded from SITE too, as torch 2.11.0 does: they are listed, not refused.
Exit codes: --help lists them (EXIT_CODES).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dsa_image.core import status

EXIT_CODES = status.epilog((status.SUCCESS, "as expected"), (status.FAILED, "not (each difference named)"),
                           status.USAGE, (status.NO_GPU, "no CUDA device visible"))

# The libraries the check requires from torch's tree: two that a tiny matmul and convolution
# are sure to load, and whose versions differ between the bases.
REQUIRED = ("libcublas", "libcudnn")
# torch's CUDA libraries, by name (torch/__init__.py's _preload_cuda_deps list); not the driver
# (libcuda.so), which is the machine's.
CUDA_LIBRARIES = ("libcublas", "libcudnn", "libcudart", "libcufft", "libcufile", "libcurand", "libcusolver",
                  "libcusparse", "libnccl", "libnvrtc", "libnvJitLink", "libcupti", "libnvshmem", "libnvToolsExt")


def mapped_libraries(maps: str) -> list[str]:
    """The shared objects in a /proc/<pid>/maps text, each path once, in first-mapped order."""
    seen: dict[str, None] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/") and ".so" in Path(fields[5]).name:
            seen.setdefault(fields[5].strip(), None)
    return list(seen)


def cuda_libraries(paths: list[str]) -> list[str]:
    return [p for p in paths if Path(p).name.startswith(CUDA_LIBRARIES)]


def within(path: str, tree: Path) -> bool:
    return Path(path).resolve().is_relative_to(tree.resolve())


def evaluate(torch_file: str, torch_version: str, expected_version: str, site: Path,
             libraries: list[str]) -> tuple[list[str], list[str]]:
    """(problems, notes) for the torch imported from `torch_file` and the CUDA libraries mapped."""
    tree = Path(torch_file).parent.parent  # the sys.path entry torch was imported from
    in_site = (site / "torch" / "__init__.py").is_file()
    problems, notes = [], []
    if in_site and not within(torch_file, site):
        problems.append(f"torch: expected {site}/torch (the site has torch {expected_version}), imported "
                        f"{torch_file}; put {site} first on PYTHONPATH")
    if not in_site and within(torch_file, site):
        problems.append(f"torch: imported from {torch_file} although {site} has no torch/__init__.py")
    if torch_version.split("+", 1)[0] != expected_version:
        problems.append(f"torch: expected {expected_version} (the base's lock), found {torch_version} at {torch_file}")
    for name in REQUIRED:
        found = [p for p in libraries if Path(p).name.startswith(name + ".") or Path(p).name.startswith(name + "Lt.")]
        if not found:
            problems.append(f"{name}: not mapped after a matmul and a convolution on the GPU; expected it from {tree}")
    for path in libraries:
        if within(path, tree):
            continue
        if in_site or Path(path).name.startswith(REQUIRED):
            problems.append(f"{Path(path).name}: expected from {tree} (torch's tree), mapped from {path}")
        else:
            notes.append(f"{Path(path).name}: also mapped from {path} "
                         "(torch is the H200's; the site holds this library too)")
    return problems, notes


# Libraries cuda-bindings, the CuTe DSL and FlashInfer load through cuda.pathfinder. It reuses a
# library already loaded (torch preloads nvrtc and nvJitLink) but otherwise searches the venv's
# site-packages (site.getsitepackages()), not PYTHONPATH: recorded here, not checked.
PATHFINDER_LIBRARIES = ("nvrtc", "nvJitLink", "nvvm")


def pathfinder_picks() -> list[str]:
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError as exc:
        return [f"cuda.pathfinder not importable ({exc})"]
    picks = []
    for name in PATHFINDER_LIBRARIES:
        try:
            loaded = load_nvidia_dynamic_lib(name)
            how = "already loaded" if loaded.was_already_loaded_from_elsewhere else getattr(loaded, "found_via", "found")
            picks.append(f"cuda.pathfinder {name}: {loaded.abs_path} ({how})")
        except Exception as exc:  # noqa: BLE001  # a record: what it could not find is a finding too
            picks.append(f"cuda.pathfinder {name}: not loaded ({type(exc).__name__}: {exc})")
    return picks


def _load(expected_version: str, site: Path) -> int:
    import torch  # here: the module is imported for its pure functions by the tests

    if not torch.cuda.is_available():
        print("torch_libs: no CUDA device visible", file=sys.stderr)
        return status.NO_GPU
    x = torch.randn(64, 64, device="cuda")
    (x @ x).sum().item()
    image = torch.randn(1, 3, 16, 16, device="cuda")
    torch.nn.functional.conv2d(image, torch.randn(4, 3, 3, 3, device="cuda")).sum().item()
    libraries = cuda_libraries(mapped_libraries(Path("/proc/self/maps").read_text()))
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}) "
          f"from {torch.__file__}")
    for path in libraries:
        print(f"  {path}")
    problems, notes = evaluate(torch.__file__, torch.__version__, expected_version, site, libraries)
    for line in notes + pathfinder_picks():
        print(f"note: {line}")
    for line in problems:
        print(f"FAIL {line}", file=sys.stderr)
    print("TORCH LIBRARIES: " + ("FAIL" if problems else "as expected"))
    return status.FAILED if problems else status.SUCCESS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", metavar="VERSION",
                        help="the base whose lock's torch is expected (default: the recipe's default)")
    parser.add_argument("--site", type=Path, required=True, help="the site dir first on PYTHONPATH")
    args = parser.parse_args(argv)
    from dsa_image.core.recipe import load_recipe
    from dsa_image.validation.stage import needed

    return _load(needed(load_recipe(vllm=args.vllm))["torch"].version, args.site)


if __name__ == "__main__":
    sys.exit(main())
