"""dsa_image.build.precompile on the CPU, without FlashInfer: the driver link stub (real gcc, nm,
readelf), the build file FlashInfer 0.7.2.post1 wrote for `sampling` (tests/data, real output),
manifests that ship nothing or cannot be used, and the command's refusals. The check against
real artefacts runs in the image (tests/test_image_precompile.py)."""

import shutil
import subprocess
from pathlib import Path

import pytest

from dsa_image.build import arch_check, precompile

DATA = Path(__file__).parent / "data"
TOOLS = all(shutil.which(t) for t in ("gcc", "c++", "nm", "readelf"))
needs_tools = pytest.mark.skipif(not TOOLS, reason="gcc, c++, nm and readelf (binutils) are not installed")


def _object(tmp_path: Path, body: str) -> Path:
    source = tmp_path / "kernel_host.c"
    source.write_text(body)
    obj = tmp_path / "kernel_host.o"
    subprocess.run(["gcc", "-fPIC", "-c", str(source), "-o", str(obj)], check=True)
    return obj


def _link(tmp_path: Path, obj: Path, library_path: Path) -> Path:
    """The module's link step as FlashInfer writes it: -lcuda from a stubs directory whose
    libcuda.so dangles (the image at build time), LIBRARY_PATH naming the stub."""
    stubs = tmp_path / "cuda" / "lib64" / "stubs"
    stubs.mkdir(parents=True)
    (stubs / "libcuda.so").symlink_to("/nonexistent/libcuda.so.1")
    out = tmp_path / "module.so"
    subprocess.run(["c++", str(obj), "-shared", f"-L{stubs}", "-lcuda", "-o", str(out)], check=True,
                   env={"PATH": "/usr/bin:/bin", "LIBRARY_PATH": str(library_path)})
    return out


@needs_tools
def test_a_module_that_calls_the_driver_links_it_through_the_stub(tmp_path):
    obj = _object(tmp_path, "int cuInit(unsigned); int cudaFree(void *);\n"
                            "int use(void) { return cuInit(0) + cudaFree(0); }\n")
    stub_dir = tmp_path / "stub"
    stub_dir.mkdir()
    stub = precompile._driver_stub([obj], stub_dir) / "libcuda.so"
    dynamic = subprocess.run(["readelf", "-d", str(stub)], capture_output=True, text=True, check=True).stdout
    assert "(SONAME)" in dynamic and "[libcuda.so.1]" in dynamic
    exported = subprocess.run(["nm", "-D", "--defined-only", str(stub)], capture_output=True, text=True).stdout
    assert " cuInit" in exported and "cudaFree" not in exported  # cudart's comes from -lcudart
    module = _link(tmp_path, obj, stub_dir)
    assert "[libcuda.so.1]" in subprocess.run(["readelf", "-d", str(module)], capture_output=True, text=True).stdout
    assert precompile.driver_link_problems("m", module) == []


@needs_tools
def test_a_module_calling_the_driver_without_linking_it_is_refused(tmp_path):
    obj = _object(tmp_path, "int cuInit(unsigned);\nint use(void) { return cuInit(0); }\n")
    unlinked = tmp_path / "unlinked.so"
    subprocess.run(["c++", str(obj), "-shared", "-o", str(unlinked)], check=True)
    assert "calls the driver (cuInit...)" in precompile.driver_link_problems("m", unlinked)[0]


@needs_tools
def test_a_module_that_does_not_call_the_driver_needs_no_stub_symbols(tmp_path):
    # FlashInfer's sampling module calls the runtime API only: --as-needed drops -lcuda.
    obj = _object(tmp_path, "int cudaFree(void *);\nint use(void) { return cudaFree(0); }\n")
    stub_dir = tmp_path / "stub"
    stub_dir.mkdir()
    module = _link(tmp_path, obj, precompile._driver_stub([obj], stub_dir))
    assert precompile.driver_link_problems("m", module) == []


def test_the_objects_are_read_from_flashinfers_build_file():
    text = (DATA / "flashinfer-0.7.2.post1-sampling-90a-build.ninja").read_text()
    objects = precompile._objects(text)
    assert [o.name for o in objects] == ["csrc_sampling.cuda.o", "csrc_renorm.cuda.o",
                                         "csrc_flashinfer_sampling_binding.cuda.o"]
    assert "-gencode=arch=compute_90a,code=sm_90a" in text  # what FLASHINFER_CUDA_ARCH_LIST=9.0 gives


def test_a_manifest_that_ships_nothing_says_why(tmp_path, capsys):
    manifest = tmp_path / "m.json"
    assert precompile.main(["skip", "--manifest", str(manifest), "--reason", "built under emulation"]) == 0
    assert precompile.main(["check", "--manifest", str(manifest)]) == 0
    assert "none shipped: built under emulation" in capsys.readouterr().out


def test_a_missing_or_foreign_manifest_fails_the_check(tmp_path, capsys):
    assert precompile.main(["check", "--manifest", str(tmp_path / "absent.json")]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert "rebuild the image" in precompile.check_doc({"schema": 0})[0]


def test_a_server_looking_elsewhere_is_caught_before_any_artefact_is_read():
    doc = {"schema": precompile.SCHEMA, "workspace_base": "/home/vllm", "artefacts": [{"module": "sampling"}]}
    problems = precompile.check_doc(doc, {"FLASHINFER_WORKSPACE_BASE": "/somewhere/else"})
    assert len(problems) == 1 and "FlashInfer would look elsewhere" in problems[0]


def test_the_command_refuses_unknown_modules_and_capabilities(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        precompile.main(["build", "--cuda-arch", "9.0", "--modules", "nope", "--workspace-base", str(tmp_path),
                         "--manifest", str(tmp_path / "m.json")])
    assert exc.value.code == 2 and "unknown modules ['nope']" in capsys.readouterr().err
    with pytest.raises(arch_check.ArchCheckError, match="not a compute capability"):
        precompile.build(["9"], ["sampling"], tmp_path, tmp_path / "m.json")
    assert not (tmp_path / "m.json").exists()



def test_the_capabilities_are_read_as_bake_passes_the_recipes_list(tmp_path):
    parser, args = precompile.parse_args(["build", "--cuda-arch", "12.0;12.1", "--workspace-base", str(tmp_path),
                                          "--manifest", str(tmp_path / "m.json")])
    assert precompile._what_to_build(args, parser) == (["12.0", "12.1"], ["sampling"])


def test_the_precompile_stage_copies_every_module_of_ours_the_tool_imports():
    """The Dockerfile's precompile stage copies the tool file by file (its cache follows only
    them); a module missing there fails only the image build."""
    from test_image_tree import REPO, closure, copied

    dockerfile = (REPO / "Dockerfile").read_text()
    stage = dockerfile.split("FROM deps AS precompile\n", 1)[1].split("\nFROM ", 1)[0]
    files, _ = copied(stage)
    needed = closure({REPO / "dsa_image" / "build" / "precompile.py"})
    assert REPO / "dsa_image" / "core" / "status.py" in needed
    assert needed <= files, sorted(str(p.relative_to(REPO)) for p in needed - files)
