"""Prove at image build time that the image can run on its GPU family.

Two checks, both without a GPU:

* `check_extensions`: every compiled vLLM extension that must run on the target's compute
  capabilities carries SASS for them (same major, minor <= target's) or PTX the driver can
  JIT-compile (PTX for an older capability). Read with `cuobjdump --list-elf/--list-ptx`.
* `check_toolchain`: the image's nvcc (pip's CUDA toolkit under CUDA_HOME) compiles and links
  a small CUDA library for each target capability, and the result carries that SASS. DeepGEMM
  and FlashInfer do exactly this at run time, so a broken toolkit fails the build, not the
  first request on a GPU host.

Stdlib only (with dist_info): this runs in a bare build stage.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dsa_image.core.dist_info import DistInfoError, installed_vllm_version
from dsa_image.core import status


@dataclass(frozen=True)
class ExtensionTable:
    """What one vLLM release's wheel carries, measured with `cuobjdump --list-elf/--list-ptx`.
    `family`: extensions whose kernels exist for some GPU families only, by design upstream,
    with the compute-capability majors they must cover when a target is of that family (and
    must then exist). `host_only`: extensions without device code. Every other extension must
    carry code for every target arch; one without device code fails: a new vLLM must be looked at."""

    family: dict[str, frozenset[int]]
    host_only: frozenset[str]


_FAMILY_0_24 = {
    "_flashmla_C": frozenset({9, 10}),  # FlashMLA: Hopper and datacenter Blackwell only
    "_flashmla_extension_C": frozenset({9, 10}),
    "_vllm_fa3_C": frozenset({9}),  # FlashAttention 3: Hopper only
    "_qutlass_C": frozenset({10}),  # QuTLASS FP4 kernels: datacenter Blackwell only
}
# Per vLLM release, from its amd64 wheel; the arm64 wheel carries the same set. A release
# without a table is refused: its extensions have not been looked at.
EXTENSION_TABLES: dict[str, ExtensionTable] = {
    # DeepGEMM's `_C` compiles its kernels at run time.
    "0.24.0": ExtensionTable(_FAMILY_0_24, frozenset({"cumem_allocator", "spinloop", "_rust_tool_parser", "_C"})),
    # New in 0.33.0: `_deepselect_C` (sm_100 SASS only), `_flashkda_C` (sm_90a, sm_100, sm_120:
    # every target, so no family entry), host-only `fs_io_C` and DeepGEMM's `_C_extension`
    # (its kernels still compiled at run time); `_rust_tool_parser` and DeepGEMM's `_C` are gone.
    "0.33.0": ExtensionTable({**_FAMILY_0_24, "_deepselect_C": frozenset({10})},
                             frozenset({"cumem_allocator", "spinloop", "fs_io_C", "_C_extension"})),
}

# Extensions that must exist and carry device code: the model's own kernels. Their absence
# means a CPU-only or otherwise different wheel was installed.
CORE_EXTENSIONS = ("_C_stable_libtorch", "_moe_C_stable_libtorch")

_ARCH = re.compile(r"\.sm_(\d+)([af]?)\.(cubin|ptx)$")

# A kernel plus a host function calling into libcudart: compiling and linking it exercises
# nvcc, ptxas, the host compiler, the CUDA headers and the `lib64` / `libcudart.so` links.
PROBE_SOURCE = r"""
#include <cuda_runtime.h>
__global__ void add_one(float *x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] += 1.0f;
}
extern "C" int probe_launch(float *x, int n) {
  add_one<<<(n + 255) / 256, 256>>>(x, n);
  return (int)cudaGetLastError();
}
"""


class ArchCheckError(status.DsaImageError):
    """The image cannot run (or compile kernels) on its target GPU family."""


@dataclass(frozen=True)
class Code:
    """One embedded device-code image: SASS (`kind="sass"`) or PTX, for capability
    `major.minor`, `variant` "" (portable), "a" (this exact capability only) or "f"
    (this family)."""

    kind: str
    major: int
    minor: int
    variant: str

    def runs_on(self, major: int, minor: int) -> bool:
        if self.variant == "a":
            return (self.major, self.minor) == (major, minor)
        if self.kind == "sass":  # SASS is compatible within one major, forward in minor
            return self.major == major and self.minor <= minor
        if self.variant == "f":
            return self.major == major and self.minor <= minor
        return (self.major, self.minor) <= (major, minor)  # the driver JIT-compiles PTX forward

    def __str__(self) -> str:
        prefix = "sm" if self.kind == "sass" else "compute"
        return f"{prefix}_{self.major}{self.minor}{self.variant}"


def parse_capability(text: str) -> tuple[int, int]:
    """"12.0" -> (12, 0), the recipe's `cuda_arch` spelling."""
    match = re.fullmatch(r"(\d+)\.(\d)", text.strip())
    if not match:
        raise ArchCheckError(f"not a compute capability: {text!r}; expected MAJOR.MINOR like 12.0")
    return int(match.group(1)), int(match.group(2))


def _code_from_sm(number: str, variant: str, kind: str) -> Code:
    # sm_90 -> 9.0, sm_100 -> 10.0, sm_121 -> 12.1: the last digit is the minor.
    return Code(kind, int(number[:-1]), int(number[-1]), variant)


def parse_listing(listing: str, kind: str) -> list[Code]:
    """Parse `cuobjdump --list-elf` (kind "sass") or `--list-ptx` (kind "ptx") output.

    Lines look like `ELF file    1: _C.abi3.14.sm_120.cubin` / `PTX file 1: x.1.sm_80.ptx`;
    "does not contain device code" / "No PTX file found" lines carry none."""
    codes = []
    for line in listing.splitlines():
        if ":" not in line:
            continue
        match = _ARCH.search(line.rsplit(":", 1)[1].strip())
        if match:
            codes.append(_code_from_sm(match.group(1), match.group(2), kind))
    return sorted(set(codes), key=lambda c: (c.kind, c.major, c.minor, c.variant))


def find_cuobjdump(cuda_home: str | None = None) -> Path:
    """cuobjdump from CUDA_HOME, PATH, or Triton's wheel (which ships one)."""
    candidates = []
    if cuda_home:
        candidates.append(Path(cuda_home) / "bin" / "cuobjdump")
    on_path = shutil.which("cuobjdump")
    if on_path:
        candidates.append(Path(on_path))
    spec = importlib.util.find_spec("triton")  # locates the package without importing it
    if spec and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidates.append(Path(location) / "backends" / "nvidia" / "bin" / "cuobjdump")
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise ArchCheckError(
        "cuobjdump not found (looked in: " + ", ".join(map(str, candidates)) + "); "
        "install triton (its wheel ships cuobjdump) or pass --cuobjdump PATH"
    )


def list_codes(cuobjdump: Path, binary: Path) -> list[Code]:
    """All SASS and PTX embedded in `binary`. cuobjdump exits non-zero for host-only files
    ("does not contain device code"); an unreadable file is an error."""
    if not binary.is_file():
        raise ArchCheckError(f"{binary}: no such file")
    codes = []
    for flag, kind in (("--list-elf", "sass"), ("--list-ptx", "ptx")):
        result = subprocess.run([str(cuobjdump), flag, str(binary)], capture_output=True, text=True)
        output = result.stdout + result.stderr
        if result.returncode != 0 and "does not contain device code" not in output:
            raise ArchCheckError(f"{cuobjdump} {flag} {binary} failed ({result.returncode}): {output.strip()}")
        codes += parse_listing(result.stdout, kind)
    return codes


def extension_name(path: Path) -> str:
    """`_C_stable_libtorch.abi3.so` -> `_C_stable_libtorch`; `_C.cpython-311-x86_64-linux-gnu.so` -> `_C`."""
    return path.name.split(".", 1)[0]


def extension_table(version: str) -> ExtensionTable:
    try:
        return EXTENSION_TABLES[version]
    except KeyError:
        raise ArchCheckError(
            f"vLLM {version}: no extension table in arch_check (known: {', '.join(EXTENSION_TABLES)}); list "
            "each vllm/**/*.so of its wheel with `cuobjdump --list-elf --list-ptx` and add one to "
            "EXTENSION_TABLES") from None


def required_capabilities(name: str, targets: list[tuple[int, int]], table: ExtensionTable) -> list[tuple[int, int]]:
    """The target capabilities extension `name` must run on."""
    families = table.family.get(name)
    if families is None:
        return list(targets)
    return [t for t in targets if t[0] in families]


@dataclass(frozen=True)
class ExtensionResult:
    path: str
    codes: tuple[str, ...]
    required: tuple[str, ...]
    missing: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.missing


def evaluate_extension(path: str, name: str, codes: list[Code], targets: list[tuple[int, int]],
                       table: ExtensionTable) -> ExtensionResult:
    required = [] if name in table.host_only else required_capabilities(name, targets, table)
    missing = [t for t in required if not any(c.runs_on(*t) for c in codes)]
    return ExtensionResult(
        path=path,
        codes=tuple(str(c) for c in codes),
        required=tuple(f"{a}.{b}" for a, b in required),
        missing=tuple(f"{a}.{b}" for a, b in missing),
    )


def check_extensions(site_packages: Path, targets: list[tuple[int, int]], cuobjdump: Path) -> list[ExtensionResult]:
    """Check every compiled extension under site-packages/vllm against the installed release's
    table; raise when one that must run on a target capability cannot, or when a core extension
    is missing or host-only."""
    package = site_packages / "vllm"
    if not package.is_dir():
        raise ArchCheckError(f"{package}: not a directory; expected vLLM installed in {site_packages}")
    try:
        version = installed_vllm_version(site_packages)
    except DistInfoError as exc:
        raise ArchCheckError(str(exc)) from None
    table = extension_table(version)
    results: list[ExtensionResult] = []
    found: dict[str, list[bool]] = {}
    for binary in sorted(package.rglob("*.so")):
        name = extension_name(binary)
        codes = list_codes(cuobjdump, binary)
        found.setdefault(name, []).append(bool(codes))
        results.append(evaluate_extension(str(binary.relative_to(site_packages)), name, codes, targets, table))
    problems = [
        f"{r.path}: carries {', '.join(r.codes) or 'no device code'}; nothing that runs on {', '.join(r.missing)}"
        for r in results if not r.ok
    ]
    problems += [
        f"{r.path}: no device code, and it is not a host-only extension of vLLM {version} "
        f"({', '.join(sorted(table.host_only))}); look at it and extend its EXTENSION_TABLES entry"
        for r in results if r.ok and not r.codes and extension_name(Path(r.path)) not in table.host_only
    ]
    for name in CORE_EXTENSIONS:
        if not any(found.get(name, [])):
            problems.append(f"vllm/{name}*.so: missing or without device code; a CUDA build of vLLM has it")
    for name, families in table.family.items():
        if any(t[0] in families for t in targets) and not any(found.get(name, [])):
            problems.append(f"vllm/**/{name}*.so: missing or without device code; targets "
                            f"{', '.join(f'{a}.{b}' for a, b in targets)} need it")
    if problems:
        raise ArchCheckError(f"vLLM {version} cannot run on the image's GPUs:\n  " + "\n  ".join(problems))
    return results


def gencode_flags(targets: list[tuple[int, int]]) -> list[str]:
    return [f"-gencode=arch=compute_{a}{b},code=sm_{a}{b}" for a, b in targets]


def check_toolchain(cuda_home: Path, targets: list[tuple[int, int]], cuobjdump: Path) -> list[Code]:
    """Compile and link PROBE_SOURCE with CUDA_HOME's nvcc for every target; raise unless it
    builds and carries SASS for each."""
    nvcc = cuda_home / "bin" / "nvcc"
    if not nvcc.is_file():
        raise ArchCheckError(f"{nvcc}: no such file; CUDA_HOME must point at the CUDA toolkit (pip's nvidia/cu13)")
    with tempfile.TemporaryDirectory(prefix="dsa-image-probe-") as tmp:
        source, library = Path(tmp) / "probe.cu", Path(tmp) / "libprobe.so"
        source.write_text(PROBE_SOURCE)
        command = [str(nvcc), "-shared", "-Xcompiler", "-fPIC", *gencode_flags(targets),
                   "-o", str(library), str(source), f"-L{cuda_home / 'lib64'}", "-lcudart"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise ArchCheckError(f"nvcc could not build the probe ({result.returncode}):\n"
                                 f"  {' '.join(command)}\n{result.stdout}{result.stderr}")
        codes = list_codes(cuobjdump, library)
    missing = [t for t in targets if Code("sass", t[0], t[1], "") not in codes]
    if missing:
        raise ArchCheckError(f"nvcc built the probe but it carries {', '.join(map(str, codes)) or 'no device code'}; "
                             f"expected SASS for {', '.join(f'{a}.{b}' for a, b in missing)}")
    return codes
