"""dsa_image.build.arch_check: which device code runs where, and the build-time checks.

The last tests use the real toolchain and the real vLLM extensions; they run inside the
image's `test` stage (pip's CUDA toolkit + Triton's cuobjdump present) and skip elsewhere.
"""

from __future__ import annotations

import os
import stat
import sysconfig
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsa_image.build import arch_check
from dsa_image.build.arch_check import ArchCheckError, Code


def test_sass_runs_on_its_major_from_its_minor_on():
    sm120 = Code("sass", 12, 0, "")
    assert sm120.runs_on(12, 0) and sm120.runs_on(12, 1)
    assert not sm120.runs_on(10, 0) and not sm120.runs_on(13, 0)
    assert not Code("sass", 12, 1, "").runs_on(12, 0)
    assert not Code("sass", 10, 0, "").runs_on(12, 0)  # datacenter Blackwell SASS is not sm_120's


def test_arch_specific_code_runs_on_exactly_its_capability():
    assert Code("sass", 10, 0, "a").runs_on(10, 0)
    assert not Code("sass", 10, 0, "a").runs_on(10, 3)
    assert not Code("ptx", 9, 0, "a").runs_on(10, 0)


def test_ptx_is_compiled_forward_family_ptx_within_its_family():
    assert Code("ptx", 8, 0, "").runs_on(12, 1)
    assert not Code("ptx", 9, 0, "").runs_on(8, 9)
    assert Code("ptx", 10, 0, "f").runs_on(10, 3)
    assert not Code("ptx", 10, 0, "f").runs_on(12, 0)


@given(st.integers(1, 15), st.integers(0, 9), st.integers(1, 15), st.integers(0, 9))
def test_sass_never_crosses_a_major(major, minor, target_major, target_minor):
    runs = Code("sass", major, minor, "").runs_on(target_major, target_minor)
    assert runs == (major == target_major and minor <= target_minor)


def test_parse_listing_reads_cuobjdump_lines():
    listing = textwrap.dedent("""\
        ELF file    1: _C_stable_libtorch.abi3.1.sm_75.cubin
        ELF file   14: _C_stable_libtorch.abi3.14.sm_120.cubin
        ELF file   15: _C_stable_libtorch.abi3.15.sm_75.cubin
        ELF file    2: x.2.sm_100a.cubin
    """)
    assert [str(c) for c in arch_check.parse_listing(listing, "sass")] == ["sm_75", "sm_100a", "sm_120"]
    ptx = "PTX file    1: _moe_C_stable_libtorch.abi3.1.sm_80.ptx\n"
    assert [str(c) for c in arch_check.parse_listing(ptx, "ptx")] == ["compute_80"]
    assert arch_check.parse_listing("cuobjdump info    : File 'x.so' does not contain device code", "sass") == []


@pytest.mark.parametrize("text", ["12", "sm_120", "12.10", ""])
def test_parse_capability_rejects_other_spellings(text):
    with pytest.raises(ArchCheckError, match="compute capability"):
        arch_check.parse_capability(text)


def test_family_extensions_are_required_only_on_their_family():
    targets, table = [(12, 0), (12, 1)], arch_check.EXTENSION_TABLES["0.24.0"]
    assert arch_check.required_capabilities("_flashmla_C", targets, table) == []
    assert arch_check.required_capabilities("_flashmla_C", [(9, 0)], table) == [(9, 0)]
    assert arch_check.required_capabilities("_vllm_fa3_C", [(10, 0)], table) == []
    assert arch_check.required_capabilities("_some_new_C", targets, table) == targets


def test_every_base_of_the_recipe_has_an_extension_table():
    from dsa_image.core.recipe import load_recipe

    assert set(load_recipe().vllm_versions) <= set(arch_check.EXTENSION_TABLES)


def test_extension_name_strips_abi_and_platform_tags():
    assert arch_check.extension_name(Path("vllm/_moe_C_stable_libtorch.abi3.so")) == "_moe_C_stable_libtorch"
    assert arch_check.extension_name(Path("deep_gemm/_C.cpython-311-x86_64-linux-gnu.so")) == "_C"


# --- check_extensions against a fake site-packages and a fake cuobjdump ---------------------


def _fake_cuobjdump(tmp_path: Path, listings: dict[str, list[str]]) -> Path:
    """A cuobjdump stand-in that prints cuobjdump's line format for the given file names."""
    script = tmp_path / "cuobjdump"
    script.write_text(textwrap.dedent(f"""\
        #!{os.sys.executable}
        import os, sys
        listings = {listings!r}
        flag, path = sys.argv[1], sys.argv[2]
        name = os.path.basename(path)
        kind = ".cubin" if flag == "--list-elf" else ".ptx"
        lines = [f"{{'ELF' if kind == '.cubin' else 'PTX'}} file {{i + 1}}: {{name}}.{{i + 1}}.{{arch}}"
                 for i, arch in enumerate(a for a in listings.get(name, []) if a.endswith(kind))]
        if not listings.get(name):
            print(f"cuobjdump info    : File '{{path}}' does not contain device code", file=sys.stderr)
            sys.exit(255)
        print("\\n".join(lines))
    """))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def _site(tmp_path: Path, names: list[str], version: str = "0.24.0") -> Path:
    site = tmp_path / "site-packages"
    (site / f"vllm-{version}.dist-info").mkdir(parents=True, exist_ok=True)
    (site / f"vllm-{version}.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    for name in names:
        path = site / "vllm" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x7fELF")
    return site


WHEEL_LIKE = {
    "_C_stable_libtorch.abi3.so": ["sm_90.cubin", "sm_100.cubin", "sm_120.cubin", "sm_80.ptx"],
    "_moe_C_stable_libtorch.abi3.so": ["sm_90.cubin", "sm_100.cubin", "sm_120.cubin"],
    "_flashmla_C.abi3.so": ["sm_90.cubin", "sm_100.cubin"],
    "_flashmla_extension_C.abi3.so": ["sm_90.cubin", "sm_100.cubin"],
    "_qutlass_C.abi3.so": ["sm_100.cubin"],
    "vllm_flash_attn/_vllm_fa3_C.abi3.so": ["sm_90.cubin"],
    "vllm_flash_attn/_vllm_fa2_C.abi3.so": ["sm_80.cubin", "sm_80.ptx"],
    "cumem_allocator.abi3.so": [],
}


# vLLM 0.33.0's wheel, as cuobjdump lists it (sm_90a SASS shown as sm_90 here: the "a" variant
# runs on 9.0 only, which is what the sm90 target asks for).
WHEEL_LIKE_0_33 = {
    **{k: v for k, v in WHEEL_LIKE.items()},
    "_deepselect_C.abi3.so": ["sm_100.cubin"],
    "_flashkda_C.abi3.so": ["sm_90.cubin", "sm_100.cubin", "sm_120.cubin"],
    "fs_io_C.abi3.so": [],
    "third_party/deep_gemm/_C_extension.abi3.so": [],
}


def _listings(layout: dict[str, list[str]]) -> dict[str, list[str]]:
    return {Path(k).name: v for k, v in layout.items()}


@pytest.mark.parametrize("targets", [[(12, 0), (12, 1)], [(10, 0)], [(9, 0)]])
def test_wheel_like_layout_passes_for_every_recipe_family(tmp_path, targets):
    cuobjdump = _fake_cuobjdump(tmp_path, _listings(WHEEL_LIKE))
    results = arch_check.check_extensions(_site(tmp_path, list(WHEEL_LIKE)), targets, cuobjdump)
    assert all(r.ok for r in results) and len(results) == len(WHEEL_LIKE)


@pytest.mark.parametrize("targets", [[(12, 0), (12, 1)], [(10, 0)], [(9, 0)]])
def test_the_0_33_layout_passes_for_every_recipe_family_with_its_own_table(tmp_path, targets):
    cuobjdump = _fake_cuobjdump(tmp_path, _listings(WHEEL_LIKE_0_33))
    results = arch_check.check_extensions(_site(tmp_path, list(WHEEL_LIKE_0_33), "0.33.0"), targets, cuobjdump)
    assert all(r.ok for r in results) and len(results) == len(WHEEL_LIKE_0_33)


def test_a_table_is_the_releases_own(tmp_path):
    # 0.33.0's host-only extensions under 0.24.0's table are unknown: a new vLLM must be looked at.
    cuobjdump = _fake_cuobjdump(tmp_path, _listings(WHEEL_LIKE_0_33))
    with pytest.raises(ArchCheckError, match=r"(?s)vLLM 0.24.0 cannot run.*_deepselect_C.abi3.so: carries sm_100; "
                                             r"nothing that runs on 12.0.*fs_io_C.abi3.so: carries no device code"):
        arch_check.check_extensions(_site(tmp_path, list(WHEEL_LIKE_0_33), "0.24.0"), [(12, 0)], cuobjdump)


def test_0_33s_sm100_only_extension_is_required_on_sm100(tmp_path):
    layout = {k: v for k, v in WHEEL_LIKE_0_33.items() if "deepselect" not in k}
    cuobjdump = _fake_cuobjdump(tmp_path, _listings(layout))
    arch_check.check_extensions(_site(tmp_path, list(layout), "0.33.0"), [(12, 0)], cuobjdump)
    with pytest.raises(ArchCheckError, match=r"vllm/\*\*/_deepselect_C\*\.so: missing"):
        arch_check.check_extensions(_site(tmp_path / "b", list(layout), "0.33.0"), [(10, 0)], cuobjdump)


def test_a_vllm_without_a_table_or_without_dist_info_is_refused(tmp_path):
    cuobjdump = _fake_cuobjdump(tmp_path, _listings(WHEEL_LIKE))
    with pytest.raises(ArchCheckError, match=r"vLLM 0.99.0: no extension table in arch_check \(known: 0.24.0, 0.33.0\)"):
        arch_check.check_extensions(_site(tmp_path, list(WHEEL_LIKE), "0.99.0"), [(12, 0)], cuobjdump)
    bare = tmp_path / "bare"
    (bare / "vllm").mkdir(parents=True)
    with pytest.raises(ArchCheckError, match="expected one vllm-\\*.dist-info/METADATA with a Version, found none"):
        arch_check.check_extensions(bare, [(12, 0)], cuobjdump)


def test_core_extension_without_the_targets_sass_fails_and_says_what_it_carries(tmp_path):
    layout = {**WHEEL_LIKE, "_moe_C_stable_libtorch.abi3.so": ["sm_90.cubin", "sm_100.cubin"]}
    cuobjdump = _fake_cuobjdump(tmp_path, _listings(layout))
    with pytest.raises(ArchCheckError, match=r"_moe_C_stable_libtorch.abi3.so: carries sm_90, sm_100; nothing that runs on 12.0, 12.1"):
        arch_check.check_extensions(_site(tmp_path, list(layout)), [(12, 0), (12, 1)], cuobjdump)


def test_family_extension_missing_for_its_family_fails(tmp_path):
    layout = {k: v for k, v in WHEEL_LIKE.items() if "fa3" not in k}
    cuobjdump = _fake_cuobjdump(tmp_path, _listings(layout))
    arch_check.check_extensions(_site(tmp_path, list(layout)), [(12, 0)], cuobjdump)  # not needed there
    with pytest.raises(ArchCheckError, match="_vllm_fa3_C"):
        arch_check.check_extensions(_site(tmp_path, list(layout)), [(9, 0)], cuobjdump)


def test_missing_core_extension_fails(tmp_path):
    layout = {k: v for k, v in WHEEL_LIKE.items() if not k.startswith("_C_")}
    cuobjdump = _fake_cuobjdump(tmp_path, _listings(layout))
    with pytest.raises(ArchCheckError, match=r"vllm/_C_stable_libtorch\*\.so: missing"):
        arch_check.check_extensions(_site(tmp_path, list(layout)), [(12, 0)], cuobjdump)


@pytest.mark.parametrize("targets", [[(12, 0)], [(9, 0)]])
def test_unknown_extension_without_device_code_fails(tmp_path, targets):
    layout = {**WHEEL_LIKE, "_new_kernels_C.abi3.so": []}
    cuobjdump = _fake_cuobjdump(tmp_path, _listings(layout))
    with pytest.raises(ArchCheckError, match=r"_new_kernels_C.abi3.so: (no device code|carries no device code)"):
        arch_check.check_extensions(_site(tmp_path, list(layout)), targets, cuobjdump)


def test_no_vllm_directory_is_an_error(tmp_path):
    with pytest.raises(ArchCheckError, match="expected vLLM installed"):
        arch_check.check_extensions(tmp_path, [(12, 0)], tmp_path / "cuobjdump")


# --- the real toolchain and wheel (inside the image) -------------------------------------------


def _real_tools() -> tuple[Path, Path]:
    cuda_home = os.environ.get("CUDA_HOME")
    if not cuda_home or not (Path(cuda_home) / "bin" / "nvcc").is_file():
        pytest.skip("no CUDA toolkit at $CUDA_HOME (runs in the image's test stage)")
    try:
        return Path(cuda_home), arch_check.find_cuobjdump(cuda_home)
    except ArchCheckError as exc:
        pytest.skip(str(exc))


def _installed_site_packages() -> Path:
    site = Path(sysconfig.get_paths()["purelib"])
    if not (site / "vllm" / "_C_stable_libtorch.abi3.so").is_file():
        pytest.skip(f"no CUDA vLLM installed in {site} (runs in the image's test stage)")
    return site


def test_real_nvcc_builds_sass_for_every_recipe_capability():
    cuda_home, cuobjdump = _real_tools()
    codes = arch_check.check_toolchain(cuda_home, [(9, 0), (10, 0), (12, 0), (12, 1)], cuobjdump)
    assert {str(c) for c in codes} >= {"sm_90", "sm_100", "sm_120", "sm_121"}


def test_real_extensions_pass_for_the_recipe_and_fail_for_a_gpu_they_do_not_support():
    from dsa_image.core.recipe import load_recipe

    _, cuobjdump = _real_tools()
    site = _installed_site_packages()
    for target in load_recipe().targets.values():
        capabilities = [arch_check.parse_capability(c) for c in target.cuda_arch]
        assert all(r.ok for r in arch_check.check_extensions(site, capabilities, cuobjdump))
    # Volta (7.0): the 0.24.0 wheel's oldest SASS is sm_75 and its oldest PTX compute_80.
    with pytest.raises(ArchCheckError, match="nothing that runs on 7.0"):
        arch_check.check_extensions(site, [(7, 0)], cuobjdump)
