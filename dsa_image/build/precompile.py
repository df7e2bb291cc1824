"""FlashInfer's JIT modules compiled at build time for the image's GPUs, and the proof that the
runtime will load them as they are.

A cold vLLM 0.33.0 start on the H200 spent 104 s building FlashInfer's `sampling` module before
it could serve (docs/validation/h200-2026-12-01-startup-phases). FlashInfer 0.7.2.post1 builds a
module into FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/<archs>/cached_ops/<name>/
(flashinfer/jit/env.py), <archs> being the capabilities it compiles for: FLASHINFER_CUDA_ARCH_LIST
when set, else the visible GPUs' (compilation_context.py; 9.0 -> "90a", 10.0 -> "100a",
12.0 -> "120f", 12.1 -> "121a" with CUDA 13). So one build per capability of the target, with
FLASHINFER_CUDA_ARCH_LIST set to it, lands exactly where a server on that GPU looks, and needs no
GPU: nvcc only. At every load FlashInfer regenerates the module's build.ninja (written only if
different) and runs ninja, which rebuilds whatever is stale: a changed command line (.ninja_log),
a source or header newer than its object (.ninja_deps), a missing object. `check` asks the same
questions without building: the regenerated build.ninja equals the shipped one and `ninja -n`
has no work to do. It also proves the .so is the one the manifest records (sha256), carries SASS
for its capability (cuobjdump) and, where it calls the driver API, links the driver.

The link step takes `-lcuda` from CUDA_HOME/lib64/stubs, which in the image is a link to the
driver library the NVIDIA container runtime mounts at run time (docs/image.md): at build time it
dangles. There, and only there, the build links against a stub with the driver's soname,
exporting the cu* symbols the objects use, found through LIBRARY_PATH so that no command line
changes; the driver satisfies them at load time.

    python -m dsa_image.build.precompile build --cuda-arch "12.0;12.1" --workspace-base /home/vllm \\
        --manifest /precompiled/manifest.json
    python -m dsa_image.build.precompile check --manifest M
    python -m dsa_image.build.precompile skip --manifest M --reason TEXT

Stdlib only; the per-capability work runs in a child Python that imports FlashInfer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsa_image.build import arch_check
from dsa_image.core.atomic import write_atomic
from dsa_image.core.wheels import sha256_file
from dsa_image.core import status

EXIT_CODES = status.epilog(
    (status.SUCCESS, "built, checked (every artefact loads as built) or skipped"),
    (status.FAILED, "build: a module did not build; check: the manifest cannot be read, or an artefact would not "
                    "load as built (each problem printed)"),
    status.USAGE)
SCHEMA = 1
# The FlashInfer modules the served path builds at start on every target -> the function in
# flashinfer.jit that makes each one's spec. `sampling`: vLLM 0.33.0 samples top-k/top-p with
# FlashInfer on any CUDA GPU it supports with more than 16 SMs (v1/sample/ops/topk_topp_sampler.py,
# flashinfer_sampler_supported); the only module the H200's cold start built.
MODULES = {"sampling": ("flashinfer.jit.sampling", "gen_sampling_module")}
NO_WORK = "ninja: no work to do."
DRIVER_SONAME = "libcuda.so.1"
DRIVER_SYMBOL = re.compile(r"^cu[A-Z]\w*$")  # the driver API (cudart's are cudaX, from -lcudart)


class PrecompileError(status.DsaImageError):
    """An artefact could not be built, or is not what the runtime would load."""


def tool_root() -> Path:
    return Path(__file__).resolve().parents[2]


# -- the child: one module, one capability, FlashInfer imported -------------------------------


def _spec(module: str):
    import importlib

    where, name = MODULES[module]
    return getattr(importlib.import_module(where), name)()


def _ninja_text(spec) -> str:
    """The build.ninja FlashInfer would write for `spec` now: JitSpec.write_ninja's call, without
    writing it. FlashInfer 0.7.2.post1 (vLLM 0.33.0) passes two arguments that 0.6.12 (vLLM
    0.24.0) has not: each is passed where the spec has it."""
    from flashinfer.jit.cpp_ext import generate_ninja_build_for_op

    if getattr(spec, "embedded_cubin_factory", None) is not None:
        raise PrecompileError(f"{spec.name}: embeds cubins, which `check` cannot regenerate without writing")
    newer = {"embedded_cubins": None, "extra_cuda_cflags_by_source": spec.extra_cuda_cflags_by_source} \
        if hasattr(spec, "extra_cuda_cflags_by_source") else {}
    return generate_ninja_build_for_op(
        name=spec.name, sources=spec.sources, extra_cflags=spec.extra_cflags,
        extra_cuda_cflags=spec.extra_cuda_cflags, extra_ldflags=spec.extra_ldflags,
        extra_include_dirs=spec.extra_include_dirs, needs_device_linking=spec.needs_device_linking,
        **newer)


def _driver_stub(objects: list[Path], into: Path) -> Path:
    """A libcuda.so with the driver's soname exporting the cu* symbols `objects` use."""
    names: set[str] = set()
    for obj in objects:
        out = subprocess.run(["nm", "-u", "--format=posix", str(obj)], capture_output=True, text=True, check=True)
        names.update(w.split()[0] for w in out.stdout.splitlines() if DRIVER_SYMBOL.match(w.split()[0]))
    source = into / "libcuda_stub.c"
    source.write_text("".join(f"void {n}(void) {{}}\n" for n in sorted(names)))
    subprocess.run(["gcc", "-shared", "-fPIC", f"-Wl,-soname,{DRIVER_SONAME}", "-o", str(into / "libcuda.so"),
                    str(source)], check=True, capture_output=True, text=True)
    return into


def _objects(ninja_text: str) -> list[Path]:
    return [Path(m) for m in re.findall(r"^build (\S+\.o): (?:cuda_)?compile ", ninja_text, re.M)]


def child_build(module: str) -> dict:
    from flashinfer.jit import cpp_ext

    spec = _spec(module)
    spec.write_ninja()
    cuda_home = Path(cpp_ext.get_cuda_path())
    started = time.monotonic()
    if not (cuda_home / "lib64" / "stubs" / "libcuda.so").exists():  # dangles in the image at build time
        objects = _objects(spec.ninja_path.read_text())
        compiled = subprocess.run(["ninja", "-C", str(spec.build_dir), "-f", str(spec.ninja_path),
                                   *map(str, objects)], capture_output=True, text=True)
        if compiled.returncode != 0:
            raise PrecompileError(f"compiling {spec.name}'s objects failed:\n{(compiled.stdout + compiled.stderr)[-3000:]}")
        with tempfile.TemporaryDirectory() as stub_dir:
            os.environ["LIBRARY_PATH"] = str(_driver_stub(objects, Path(stub_dir)))
            spec.build(verbose=False)  # required by FlashInfer 0.6.12, optional in 0.7.2.post1
    else:
        spec.build(verbose=False)
    return {**child_state(module), "seconds": round(time.monotonic() - started, 1)}


def child_state(module: str) -> dict:
    """What the runtime would find for `module` on this capability: its paths, whether its
    build.ninja is the one FlashInfer would write, and ninja's verdict."""
    from flashinfer.jit import core
    from flashinfer.version import __version__

    spec = _spec(module)
    shipped = spec.ninja_path.read_text() if spec.ninja_path.is_file() else ""
    dry = subprocess.run(["ninja", "-n", "-C", str(spec.build_dir), "-f", str(spec.ninja_path)],
                         capture_output=True, text=True) if shipped else None
    (major, minor), = core.current_compilation_context.TARGET_CUDA_ARCHS
    return {"module": module, "flashinfer": __version__, "arch": f"sm_{major}{minor}",
            "library": str(spec.jit_library_path), "build_dir": str(spec.build_dir),
            "ninja_current": shipped == _ninja_text(spec),
            "ninja_dry_run": (dry.stdout + dry.stderr).strip() if dry else "no build.ninja"}


# -- the parent: every capability, the manifest, the check ------------------------------------


def _child(action: str, module: str, capability: str, base: Path, env: dict[str, str]) -> dict:
    child_env = {**env, "FLASHINFER_CUDA_ARCH_LIST": capability, "FLASHINFER_WORKSPACE_BASE": str(base),
                 "PYTHONPATH": os.pathsep.join(p for p in (str(tool_root()), env.get("PYTHONPATH", "")) if p)}
    result = subprocess.run([sys.executable, "-m", "dsa_image.build.precompile", "_child", action, module],
                            env=child_env, capture_output=True, text=True)
    if result.returncode != 0:
        raise PrecompileError(f"{action} of FlashInfer {module} for {capability} failed "
                              f"(exit {result.returncode}):\n{(result.stdout + result.stderr)[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def build(capabilities: list[str], modules: list[str], base: Path, manifest: Path,
          env: dict[str, str] | None = None) -> dict:
    """Build every module for every capability into `base`'s cache, then check each and write
    the manifest (only once all passed)."""
    env = dict(os.environ if env is None else env)
    artefacts = []
    for capability in capabilities:
        arch_check.parse_capability(capability)
        for module in modules:
            state = _child("build", module, capability, base, env)
            library = Path(state["library"])
            artefacts.append({"module": module, "capability": capability, "arch": state["arch"],
                              "flashinfer": state["flashinfer"], "path": str(library.relative_to(base)),
                              "sha256": sha256_file(library), "bytes": library.stat().st_size,
                              "build_seconds": state["seconds"]})
    doc = {"schema": SCHEMA, "workspace_base": str(base), "artefacts": artefacts, "skipped": None}
    problems = check_doc(doc, env)
    if problems:
        raise PrecompileError("the artefacts just built would not load as built:\n" + "\n".join(problems))
    _write(manifest, doc)
    return doc


def check_doc(doc: dict, env: dict[str, str] | None = None) -> list[str]:
    """Problems with the manifest's artefacts, one line each saying what was expected, what was
    found and what to do; [] when every one would load as built."""
    env = dict(os.environ if env is None else env)
    if doc.get("schema") != SCHEMA:
        return [f"manifest schema {doc.get('schema')!r}, expected {SCHEMA}: rebuild the image"]
    base = Path(doc["workspace_base"])
    given = env.get("FLASHINFER_WORKSPACE_BASE")
    if given and Path(given) != base:
        return [f"FLASHINFER_WORKSPACE_BASE is {given}, the artefacts were built for {base}: FlashInfer "
                "would look elsewhere and build again; set it to the manifest's workspace_base"]
    problems = []
    for art in doc["artefacts"]:
        problems += _check_artefact(art, base, env)
    return problems


def _check_artefact(art: dict, base: Path, env: dict[str, str]) -> list[str]:
    where = f"FlashInfer {art['module']} for {art['capability']} ({art['arch']})"
    library = base / art["path"]
    if not library.is_file():
        return [f"{where}: {library} missing; the image's cache layout lost it: rebuild the image"]
    problems = []
    if (found := sha256_file(library)) != art["sha256"]:
        problems.append(f"{where}: {library} has sha256 {found}, the manifest {art['sha256']}: "
                        "not the library that was built; rebuild the image")
    state = _child("state", art["module"], art["capability"], base, env)
    if state["library"] != str(library) or state["flashinfer"] != art["flashinfer"]:
        problems.append(f"{where}: this FlashInfer ({state['flashinfer']}) looks for {state['library']}, "
                        f"the artefact is {library} (FlashInfer {art['flashinfer']}): it would build again")
    if not state["ninja_current"]:
        problems.append(f"{where}: the build.ninja FlashInfer writes now differs from the shipped one "
                        "(compiler flags, paths or environment changed since the build): it would build again")
    if state["ninja_dry_run"].splitlines()[-1:] != [NO_WORK]:
        problems.append(f"{where}: ninja would rebuild ({state['ninja_dry_run'][-600:]}): sources or "
                        "objects changed since the build; rebuild the image's precompile stage")
    return problems + _binary_problems(where, library, art["capability"], env)


def _binary_problems(where: str, library: Path, capability: str, env: dict[str, str]) -> list[str]:
    major, minor = arch_check.parse_capability(capability)
    codes = arch_check.list_codes(arch_check.find_cuobjdump(env.get("CUDA_HOME")), library)
    problems = [] if any(c.kind == "sass" and c.runs_on(major, minor) for c in codes) else [
        f"{where}: {library} carries {[str(c) for c in codes] or 'no device code'}, no SASS that runs on {capability}"]
    return problems + driver_link_problems(where, library)


def driver_link_problems(where: str, library: Path) -> list[str]:
    """Linked with --as-needed (Debian's gcc does), a library needs the driver only where it
    calls a cu* function: then it must name libcuda.so.1, or those calls would not resolve."""
    undefined = subprocess.run(["nm", "-D", "--undefined-only", "--format=posix", str(library)],
                               capture_output=True, text=True, check=True).stdout.splitlines()
    driver = sorted(w.split()[0] for w in undefined if w and DRIVER_SYMBOL.match(w.split()[0]))
    needed = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    if driver and f"[{DRIVER_SONAME}]" not in needed:
        return [f"{where}: {library} calls the driver ({', '.join(driver[:3])}...) but does not link "
                f"{DRIVER_SONAME}: those calls would not resolve at load"]
    return []


def _write(manifest: Path, doc: dict) -> None:
    manifest.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(manifest, (json.dumps(doc, indent=1) + "\n").encode())


def check(manifest: Path) -> int:
    try:
        doc = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        print(f"precompile check: cannot read {manifest}: {exc}", file=sys.stderr)
        return status.FAILED
    if doc.get("skipped"):
        print(f"precompile check: none shipped: {doc['skipped']}")
        return 0
    try:
        problems = check_doc(doc)
    except (PrecompileError, arch_check.ArchCheckError) as exc:
        problems = [str(exc)]
    for art in doc.get("artefacts", []):
        print(f"precompile check: FlashInfer {art['module']} {art['arch']} {art['path']} sha256 {art['sha256'][:12]}…")
    if problems:
        print("precompile check: FAILED\n" + "\n".join(problems), file=sys.stderr)
        return status.FAILED
    print(f"precompile check: {len(doc['artefacts'])} artefact(s) load as built (ninja: no work to do)")
    return status.SUCCESS


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile the modules into WORKSPACE_BASE/.cache/flashinfer")
    b.add_argument("--cuda-arch", required=True,
                   help="the target's capabilities, separated by ; , or spaces (its CUDA_ARCH_LIST: 12.0;12.1)")
    b.add_argument("--modules", default=",".join(MODULES), help=f"comma-separated, of {', '.join(MODULES)}")
    b.add_argument("--workspace-base", type=Path, required=True, help="FLASHINFER_WORKSPACE_BASE of the runtime")
    b.add_argument("--manifest", type=Path, required=True)
    c = sub.add_parser("check", help=f"the manifest's artefacts load as built; exit {status.FAILED} when not")
    c.add_argument("--manifest", type=Path, required=True)
    s = sub.add_parser("skip", help="write a manifest that ships none, saying why")
    s.add_argument("--manifest", type=Path, required=True)
    s.add_argument("--reason", required=True)
    child = sub.add_parser("_child")
    child.add_argument("action", choices=("build", "state"))
    child.add_argument("module", choices=sorted(MODULES))
    return parser, parser.parse_args(argv)


def main(argv=None) -> int:
    parser, args = parse_args(argv)
    if args.command == "_child":
        print(json.dumps((child_build if args.action == "build" else child_state)(args.module)))
        return 0
    if args.command == "check":
        return check(args.manifest)
    if args.command == "skip":
        _write(args.manifest, {"schema": SCHEMA, "artefacts": [], "skipped": args.reason})
        print(f"precompile: none built: {args.reason}")
        return 0
    try:
        caps, modules = _what_to_build(args, parser)
        doc = build(caps, modules, args.workspace_base.resolve(), args.manifest)
    except (PrecompileError, arch_check.ArchCheckError) as exc:
        print(f"precompile: {exc}", file=sys.stderr)
        return status.FAILED
    for art in doc["artefacts"]:
        print(f"precompile: FlashInfer {art['module']} {art['arch']}: {art['path']} ({art['bytes']} bytes, "
              f"sha256 {art['sha256']}) in {art['build_seconds']} s")
    return 0


def _what_to_build(args, parser) -> tuple[list[str], list[str]]:
    caps = [c for c in re.split(r"[;,\s]+", args.cuda_arch.strip()) if c]
    modules = args.modules.split(",")
    unknown = [m for m in modules if m not in MODULES]
    if unknown:
        parser.error(f"unknown modules {unknown}; known: {', '.join(MODULES)}")
    return caps, modules


if __name__ == "__main__":
    sys.exit(main())
