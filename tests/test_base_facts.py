"""What each base's stock vLLM does, read from its pinned wheel: the facts that decide what its
overlay carries (docs/decisions.md, "What no base can run" and "The vLLM 0.33.0 overlay").

Static, like the rebase report: no GPU and no vLLM install, the real wheels' source."""

from __future__ import annotations

import ast
import re

import pytest

from dsa_image.overlay import cli as overlay
from dsa_image.core import wheels
from dsa_image.core.recipe import load_every_base

pytestmark = pytest.mark.wheel

BASES = {recipe.vllm_version: recipe for recipe in load_every_base()}
MLA = "vllm/v1/attention/backends/mla"
# The sparse-MLA attention implementations GLM-5 runs on, per file.
SPARSE_MLA_IMPLS = {
    f"{MLA}/flashmla_sparse.py": "FlashMLASparseImpl",  # sm_90, sm_100
    f"{MLA}/flashinfer_mla_sparse.py": "FlashInferMLASparseImpl",  # sm_100
    f"{MLA}/flashinfer_mla_sparse_sm120.py": "FlashInferMLASparseSM120Impl",  # sm_12x
}


def source(version: str, member: str) -> str:
    data = wheels.read_member(overlay.reference_wheel(BASES[version]), member)
    assert data is not None, f"vLLM {version} has no {member}"
    return data.decode()


def returns_lse_for_decode(version: str, member: str, impl: str) -> bool:
    """Whether the impl class sets `can_return_lse_for_decode = True` (DCP needs it)."""
    tree = ast.parse(source(version, member))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == impl)
    return any(isinstance(s, ast.AnnAssign) and getattr(s.target, "id", None) == "can_return_lse_for_decode"
               and isinstance(s.value, ast.Constant) and s.value.value is True for s in cls.body)


def test_dcp_never_reaches_the_indexer_on_vllm_0_24_0():
    """Stock refuses DCP unless every attention impl returns the LSE for decode, before any
    metadata builder exists: the 0.24.0 overlay's DCP metadata could never run."""
    assert not any(returns_lse_for_decode("0.24.0", m, impl) for m, impl in SPARSE_MLA_IMPLS.items())
    check = source("0.24.0", "vllm/v1/worker/cp_utils.py")
    assert "assert layer_impl.need_to_return_lse_for_decode" in check
    runner = source("0.24.0", "vllm/v1/worker/gpu_model_runner.py")
    backends = runner.index("def initialize_attn_backend(")
    assert backends < runner.index("check_attention_cp_compatibility(self.vllm_config)") < runner.index(
        "def initialize_metadata_builders(")


def test_dcp_reaches_the_indexer_on_vllm_0_33_0_on_sm90_and_sm100_only():
    """So the 0.33.0 overlay keeps DCP's prefill chunk sync-free, and its b12x path (sm_12x)
    needs no DCP code."""
    lse = {impl: returns_lse_for_decode("0.33.0", m, impl) for m, impl in SPARSE_MLA_IMPLS.items()}
    assert lse == {"FlashMLASparseImpl": True, "FlashInferMLASparseImpl": True, "FlashInferMLASparseSM120Impl": False}


def test_stock_0_33_0_reads_a_dcp_prefill_chunks_totals_back_from_the_gpu_and_the_overlay_does_not():
    def chunk_builder(text: str) -> str:
        return text.split("def build_prefill_chunk_metadata(", 1)[1].split("\ndef ", 1)[0]

    device_reads = re.compile(r"local_(cu_)?seq_lens\b.*\.item\(\)")
    stock = chunk_builder(source("0.33.0", f"{MLA}/indexer.py"))
    ours = chunk_builder((overlay.overlay_dir("0.33.0") / MLA / "indexer.py").read_text())
    assert len(device_reads.findall(stock)) == 2 and device_reads.findall(ours) == []


def test_vllm_0_24_0_builds_metadata_outside_cuda_graph_capture():
    """The runner builds the metadata, then calls the model, whose wrapper captures: a guard
    against capture in the 0.24.0 overlay's block-table growth (called from build()) could
    never fire."""
    runner = source("0.24.0", "vllm/v1/worker/gpu_model_runner.py")
    dummy_run = runner.split("    def _dummy_run(", 1)[1].split("\n    def ", 1)[0]
    assert dummy_run.index("self._build_attention_metadata(") < dummy_run.index("self.model(")
    assert "torch.cuda.graph(" not in runner and "capture_begin(" not in runner
    assert "with torch.cuda.graph(" in source("0.24.0", "vllm/compilation/cuda_graph.py")


def test_stock_0_33_0_split_covers_the_batch_by_construction():
    """vLLM's split returns counts whose sums are the batch's, so the asserts after it (and any
    diagnostic there) cannot fail; on 0.24.0 the overlay's own split is tested likewise."""
    text = source("0.33.0", "vllm/v1/attention/backends/utils.py")
    split = text.split("def split_decodes_and_prefills(", 1)[1].split("\ndef ", 1)[0]
    returns = [line.strip() for line in split.splitlines() if line.strip().startswith("return ")]
    assert set(returns) == {"return num_reqs, 0, num_tokens, 0", "return 0, num_reqs, 0, num_tokens",
                            "return num_reqs, 0, num_tokens, 0  # all decodes",
                            "return (num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens)"}
    assert "num_prefills = num_reqs - num_decodes" in split
    assert "num_prefill_tokens = num_tokens - num_decode_tokens" in split


def test_vllm_0_33_0_sizes_the_expanded_block_table_from_the_runner():
    """Why the 0.33.0 overlay carries no block-table slack or growth."""
    text = source("0.33.0", f"{MLA}/indexer.py")
    assert "requires_block_table_width = True" in text
    assert "(scheduler_config.max_num_batched_tokens, block_table_width)" in text
