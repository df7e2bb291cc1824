"""The b12x names and signatures each base's overlay calls exist in the b12x wheel that base's
recipe pins (b12x 0.30.2 for vLLM 0.24.0, 1.5.1 for 0.33.0).

b12x kernels need an sm_120/sm_121 GPU, so the API is checked statically
(dsa_image.build.b12x_api) against the real wheel, fetched by the hash the sm120 lock records.
"""

import zipfile
from pathlib import Path

import pytest

from dsa_image.build import b12x_api, lock, lock_parse
from dsa_image.overlay import cli as overlay
from dsa_image.core import wheels
from dsa_image.core.recipe import Recipe, load_every_base

BASES = {recipe.vllm_version: recipe for recipe in load_every_base()}
# Per base: the b12x package whose indexer functions its overlay calls, the module it imports
# them from, and the shared modules those import (what the workspace check reads).
B12X = {
    "0.24.0": ("b12x.attention.indexer", "b12x.attention.indexer", ("b12x.cute",)),
    "0.33.0": ("b12x.attention.dsa_indexer", "b12x.attention.dsa_indexer._impl",
               ("b12x._lib", "b12x.attention._shared")),
}


def overlay_source(version: str) -> str:
    return (overlay.overlay_dir(version) / b12x_api.OVERLAY_MODULE).read_text()


def pinned_b12x(recipe: Recipe) -> tuple[str, str]:
    """(wheel filename, sha256) of the b12x wheel the base's sm120 image installs."""
    target = recipe.targets["sm120"]
    extra = next(e for e in target.extras if e.name == "b12x")
    pins = lock_parse.parse_lock(lock.target_lock(recipe, target, "amd64").read_text())
    pin = pins["b12x"]
    assert pin.version == extra.version, "the sm120 lock and the recipe disagree on b12x"
    filename = f"b12x-{extra.version}-py3-none-any.whl"
    sha256 = wheels.index_file(filename).sha256
    assert sha256 in pin.hashes, f"{filename}: the index's sha256 is not in the lock"
    return filename, sha256


def pinned_wheel_sources(version: str) -> b12x_api.WheelSources:
    return b12x_api.WheelSources(wheels.ensure_wheel(*pinned_b12x(BASES[version])))


@pytest.mark.wheel
@pytest.mark.parametrize("version", BASES)
def test_overlay_fits_the_pinned_b12x_wheel(version):
    wheel = wheels.ensure_wheel(*pinned_b12x(BASES[version]))
    assert b12x_api.problems(wheel, overlay_source(version)) == []


def test_each_overlay_imports_what_it_calls():
    for version, (_, module, _) in B12X.items():
        usage = b12x_api.overlay_usage(overlay_source(version))
        assert set(usage) == {module}
        assert {"build_paged_mqa_schedule_metadata", "uses_paged_mqa_schedule",
                "contiguous_tiled_topk", "paged_decode_logits"} <= usage[module].names


@pytest.mark.wheel
@pytest.mark.parametrize("version", BASES)
def test_the_supertile_variable_is_the_one_b12xs_contiguous_path_reads(version):
    """The overlay's prefill takes contiguous_tiled_topk: its supertile variable is the one
    the overlay reads and passes; the paged path's (index_topk_fp8) is another, refused."""
    package = B12X[version][0]
    files = pinned_wheel_sources(version).files
    tiled = b12x_api.module_constants(files[f"{package}.tiled_topk"])
    paged = b12x_api.module_constants(files[f"{package}.paged"])
    assert tiled["_SUPERTILE_K_DEFAULT"] == 32768
    source = overlay_source(version)
    assert f'"{paged["_PAGED_INDEX_SUPERTILE_K_ENV"]}"' in source
    if version == "0.24.0":  # the switch and the supertile live in the overlaid vllm.envs
        envs = (overlay.overlay_dir(version) / "vllm" / "envs.py").read_text()
        assert tiled["_SUPERTILE_K_ENV"] == "B12X_NSA_TOPK_SUPERTILE_K"
        assert '"B12X_NSA_TOPK_SUPERTILE_K": lambda' in envs and '"32768"' in envs
    else:
        ours = b12x_api.module_constants(source)
        assert (ours["SUPERTILE_VARIABLE"], ours["SUPERTILE_DEFAULT"]) == (tiled["_SUPERTILE_K_ENV"], 32768)


@pytest.mark.wheel
@pytest.mark.parametrize("version", BASES)
def test_b12xs_paged_topk_needs_a_scratch_plan_binding(version):
    # Why the overlay does not take index_topk_fp8: without a plan binding it refuses.
    paged = pinned_wheel_sources(version).files[f"{B12X[version][0]}.paged"]
    assert "paged indexer launch requires a plan binding" in paged
    assert "binding=binding" in paged.split("def index_topk_fp8")[1].split("def ")[0]


@pytest.mark.wheel
@pytest.mark.parametrize("version", BASES)
def test_b12xs_indexer_cannot_ask_vllms_workspace_for_memory(version):
    # "Workspace is locked" is vLLM's WorkspaceManager; b12x allocates through torch only.
    package, _, shared = B12X[version]
    files = pinned_wheel_sources(version).files
    indexer = {m: src for m, src in files.items() if m.startswith((package, *shared))}
    assert len(indexer) > 10
    assert [m for m, src in indexer.items() if "vllm" in src or "workspace_manager" in src] == []


# The calls the b12x API checker is tested with (b12x 0.30's module; the checker takes any).
CALLS = '''
def schedule(rows, table, out):
    from b12x.attention.indexer import build_paged_mqa_schedule_metadata, uses_paged_mqa_schedule
    if not uses_paged_mqa_schedule(q_rows=1, max_pages=2):
        return None
    return build_paged_mqa_schedule_metadata(rows, 64, 132, out=out)


def prefill(q, w, k, s, ks, ke, out):
    from b12x.attention.indexer import IndexerContiguousMetadata, contiguous_tiled_topk
    return contiguous_tiled_topk(q_fp8=q, weights=w, kv_fp8=(k, s),
                                 metadata=IndexerContiguousMetadata(k_start=ks, k_end=ke),
                                 topk=2048, supertile_k=32768, output_indices=out)


def decode(q, w, cache, table, lens, schedule, width):
    from b12x.attention.indexer import IndexerPagedDecodeMetadata, paged_decode_logits
    return paged_decode_logits(q_fp8=q, weights=w, index_k_cache=cache,
                               metadata=IndexerPagedDecodeMetadata(real_page_table=table,
                                                                   cache_seqlens_int32=lens,
                                                                   paged_mqa_schedule_metadata=schedule),
                               page_size=64, active_width_override=width)
'''


def fake_wheel(tmp_path: Path, files: dict[str, str]) -> Path:
    path = tmp_path / "b12x-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


GOOD_API = '''
from dataclasses import dataclass
@dataclass(frozen=True)
class IndexerPagedDecodeMetadata:
    real_page_table: object
    cache_seqlens_int32: object
    paged_mqa_schedule_metadata: object = None
@dataclass(frozen=True)
class IndexerContiguousMetadata:
    k_start: object
    k_end: object
def build_paged_mqa_schedule_metadata(context_lens, block_kv, num_sms=None, out=None): ...
def uses_paged_mqa_schedule(*, q_rows, max_pages): ...
def contiguous_tiled_topk(*, q_fp8, weights, kv_fp8, metadata=None, topk=None, output_indices=None,
                          supertile_k=None): ...
def paged_decode_logits(*, q_fp8, weights, index_k_cache, metadata=None, page_size=64,
                        active_width_override=None): ...
'''
INIT = "from .api import (IndexerPagedDecodeMetadata, IndexerContiguousMetadata,\n" \
       "  build_paged_mqa_schedule_metadata, uses_paged_mqa_schedule,\n" \
       "  contiguous_tiled_topk, paged_decode_logits)\n"


def test_a_matching_fake_wheel_has_no_problems(tmp_path):
    wheel = fake_wheel(tmp_path, {"b12x/attention/indexer/__init__.py": INIT,
                                  "b12x/attention/indexer/api.py": GOOD_API})
    assert b12x_api.problems(wheel, CALLS) == []


def test_a_moved_module_is_reported(tmp_path):
    # b12x >= 1.3 keeps the API in b12x.attention.dsa_indexer._impl.
    wheel = fake_wheel(tmp_path, {"b12x/attention/dsa_indexer/_impl.py": GOOD_API})
    assert b12x_api.problems(wheel, CALLS) == [
        f"module b12x.attention.indexer is not in {wheel.name}"]


def test_a_renamed_keyword_is_reported(tmp_path):
    api = GOOD_API.replace("active_width_override=None", "active_width=None")
    wheel = fake_wheel(tmp_path, {"b12x/attention/indexer/__init__.py": INIT,
                                  "b12x/attention/indexer/api.py": api})
    assert b12x_api.problems(wheel, CALLS) == [
        "b12x.attention.indexer.paged_decode_logits: no parameter 'active_width_override'"]


def test_a_new_required_parameter_is_reported(tmp_path):
    api = GOOD_API.replace("def uses_paged_mqa_schedule(*, q_rows, max_pages)",
                           "def uses_paged_mqa_schedule(*, q_rows, max_pages, page_size)")
    wheel = fake_wheel(tmp_path, {"b12x/attention/indexer/__init__.py": INIT,
                                  "b12x/attention/indexer/api.py": api})
    assert b12x_api.problems(wheel, CALLS) == [
        "b12x.attention.indexer.uses_paged_mqa_schedule: required parameter 'page_size' "
        "not passed"]


def test_a_missing_export_is_reported(tmp_path):
    wheel = fake_wheel(tmp_path, {
        "b12x/attention/indexer/__init__.py": INIT.replace("paged_decode_logits)", ")"),
        "b12x/attention/indexer/api.py": GOOD_API})
    assert b12x_api.problems(wheel, CALLS) == [
        f"b12x.attention.indexer.paged_decode_logits is not defined in {wheel.name}"]
