"""The b12x names and signatures the overlay calls exist in the b12x wheel the recipe pins.

b12x kernels need an sm_120/sm_121 GPU, so the API is checked statically
(dsa_image.b12x_api) against the real wheel, fetched by the hash the sm120 lock records.
"""

import zipfile
from pathlib import Path

import pytest

from dsa_image import b12x_api, lock, wheels
from dsa_image.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
OVERLAY_SOURCE = (REPO / "overlay" / b12x_api.OVERLAY_MODULE).read_text()


def pinned_b12x() -> tuple[str, str]:
    """(wheel filename, sha256) of the b12x wheel the sm120 image installs."""
    target = load_recipe().targets["sm120"]
    extra = next(e for e in target.extras if e.name == "b12x")
    pins = lock.parse_lock(lock.target_lock(target, "amd64").read_text())
    pin = pins["b12x"]
    assert pin.version == extra.version, "the sm120 lock and the recipe disagree on b12x"
    filename = f"b12x-{extra.version}-py3-none-any.whl"
    sha256 = wheels.index_file(filename).sha256
    assert sha256 in pin.hashes, f"{filename}: the index's sha256 is not in the lock"
    return filename, sha256


@pytest.mark.wheel
def test_overlay_fits_the_pinned_b12x_wheel():
    filename, sha256 = pinned_b12x()
    wheel = wheels.ensure_wheel(filename, sha256)
    assert b12x_api.problems(wheel, OVERLAY_SOURCE) == []


def pinned_wheel_sources() -> b12x_api.WheelSources:
    return b12x_api.WheelSources(wheels.ensure_wheel(*pinned_b12x()))


@pytest.mark.wheel
def test_the_supertile_variable_is_the_one_b12xs_contiguous_path_reads():
    """The overlay's prefill takes contiguous_tiled_topk: its supertile variable is the one
    the overlay reads and passes; the paged path's (index_topk_fp8) is another."""
    files = pinned_wheel_sources().files
    tiled = b12x_api.module_constants(files["b12x.attention.indexer.tiled_topk"])
    paged = b12x_api.module_constants(files["b12x.attention.indexer.paged"])
    envs = (REPO / "overlay" / "vllm" / "envs.py").read_text()
    assert tiled["_SUPERTILE_K_ENV"] == "B12X_NSA_TOPK_SUPERTILE_K" and tiled["_SUPERTILE_K_DEFAULT"] == 32768
    assert '"B12X_NSA_TOPK_SUPERTILE_K": lambda' in envs and '"32768"' in envs
    assert paged["_PAGED_INDEX_SUPERTILE_K_ENV"] == "B12X_PAGED_INDEX_SUPERTILE_K"
    assert f'PAGED_SUPERTILE_VARIABLE = "{paged["_PAGED_INDEX_SUPERTILE_K_ENV"]}"' in OVERLAY_SOURCE


@pytest.mark.wheel
def test_b12xs_paged_topk_needs_a_scratch_plan_binding():
    # Why the overlay does not take index_topk_fp8: without a plan binding it refuses.
    paged = pinned_wheel_sources().files["b12x.attention.indexer.paged"]
    assert "paged indexer launch requires a plan binding" in paged
    assert "binding=binding" in paged.split("def index_topk_fp8")[1].split("def ")[0]


@pytest.mark.wheel
def test_b12xs_indexer_cannot_ask_vllms_workspace_for_memory():
    # "Workspace is locked" is vLLM's WorkspaceManager; b12x allocates through torch only.
    files = pinned_wheel_sources().files
    indexer = {m: src for m, src in files.items() if m.startswith(("b12x.attention.indexer", "b12x.cute"))}
    assert len(indexer) > 10
    assert [m for m, src in indexer.items() if "vllm" in src or "workspace_manager" in src] == []


def test_overlay_imports_what_it_calls():
    usage = b12x_api.overlay_usage(OVERLAY_SOURCE)
    assert set(usage) == {"b12x.attention.indexer"}
    names = usage["b12x.attention.indexer"].names
    assert {"build_paged_mqa_schedule_metadata", "uses_paged_mqa_schedule",
            "contiguous_tiled_topk", "paged_decode_logits"} <= names


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
    assert b12x_api.problems(wheel, OVERLAY_SOURCE) == []


def test_a_moved_module_is_reported(tmp_path):
    # b12x >= 1.3 keeps the API in b12x.attention.dsa_indexer._impl.
    wheel = fake_wheel(tmp_path, {"b12x/attention/dsa_indexer/_impl.py": GOOD_API})
    assert b12x_api.problems(wheel, OVERLAY_SOURCE) == [
        f"module b12x.attention.indexer is not in {wheel.name}"]


def test_a_renamed_keyword_is_reported(tmp_path):
    api = GOOD_API.replace("active_width_override=None", "active_width=None")
    wheel = fake_wheel(tmp_path, {"b12x/attention/indexer/__init__.py": INIT,
                                  "b12x/attention/indexer/api.py": api})
    assert b12x_api.problems(wheel, OVERLAY_SOURCE) == [
        "b12x.attention.indexer.paged_decode_logits: no parameter 'active_width_override'"]


def test_a_new_required_parameter_is_reported(tmp_path):
    api = GOOD_API.replace("def uses_paged_mqa_schedule(*, q_rows, max_pages)",
                           "def uses_paged_mqa_schedule(*, q_rows, max_pages, page_size)")
    wheel = fake_wheel(tmp_path, {"b12x/attention/indexer/__init__.py": INIT,
                                  "b12x/attention/indexer/api.py": api})
    assert b12x_api.problems(wheel, OVERLAY_SOURCE) == [
        "b12x.attention.indexer.uses_paged_mqa_schedule: required parameter 'page_size' "
        "not passed"]


def test_a_missing_export_is_reported(tmp_path):
    wheel = fake_wheel(tmp_path, {
        "b12x/attention/indexer/__init__.py": INIT.replace("paged_decode_logits)", ")"),
        "b12x/attention/indexer/api.py": GOOD_API})
    assert b12x_api.problems(wheel, OVERLAY_SOURCE) == [
        f"b12x.attention.indexer.paged_decode_logits is not defined in {wheel.name}"]
