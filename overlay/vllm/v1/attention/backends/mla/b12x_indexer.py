# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""b12x kernels for the DSA sparse-attention indexer (dsa-image overlay).

Everything this overlay calls in b12x goes through this module, so the b12x API
surface we depend on is in one place (and checked against the pinned b12x wheel
by the repository's tests). b12x is imported lazily: vLLM without b12x installed
must import this module without error, and only fail when the path is asked for.

The API lives in ``b12x.attention.indexer`` for b12x 0.20 .. 0.30.x, the release
line the recipe pins.
"""

import numpy as np
import torch

import vllm.envs as envs
from vllm.platforms import current_platform

# b12x supertiles are whole 512-row tiles; the env value is rounded up.
SUPERTILE_ALIGNMENT = 512

# Compute capability families b12x has kernels for (sm_120, sm_121).
SUPPORTED_CAPABILITY_FAMILY = 120


def enabled() -> bool:
    return envs.VLLM_USE_B12X_SPARSE_INDEXER


def kernel_family() -> str:
    """The name the start-up log and the smoke test use for the indexer kernels."""
    return "b12x" if enabled() else "deepgemm"


def supertile_k() -> int:
    """K rows per b12x supertile: ``B12X_PAGED_INDEX_SUPERTILE_K`` rounded up."""
    tokens = max(envs.B12X_PAGED_INDEX_SUPERTILE_K, SUPERTILE_ALIGNMENT)
    return -(-tokens // SUPERTILE_ALIGNMENT) * SUPERTILE_ALIGNMENT


def require_supported(use_fp4_indexer_cache: bool) -> None:
    """Fail at start-up, with what to do, when b12x cannot serve this setup."""
    if not current_platform.is_cuda():
        raise RuntimeError(
            "VLLM_USE_B12X_SPARSE_INDEXER=1 needs an NVIDIA GPU of compute "
            "capability 12.0/12.1; this platform is not CUDA. Unset "
            "VLLM_USE_B12X_SPARSE_INDEXER to use the DeepGEMM indexer."
        )
    if not current_platform.is_device_capability_family(SUPPORTED_CAPABILITY_FAMILY):
        capability = current_platform.get_device_capability()
        found = f"{capability.major}.{capability.minor}" if capability else "unknown"
        raise RuntimeError(
            "VLLM_USE_B12X_SPARSE_INDEXER=1 needs compute capability 12.0/12.1 "
            "(RTX PRO 6000, RTX 50, DGX Spark); this GPU is compute capability "
            f"{found}. Unset VLLM_USE_B12X_SPARSE_INDEXER to use the DeepGEMM "
            "indexer."
        )
    if use_fp4_indexer_cache:
        raise RuntimeError(
            "VLLM_USE_B12X_SPARSE_INDEXER=1 scores the FP8 indexer cache; it "
            "cannot be combined with use_fp4_indexer_cache."
        )
    try:
        import b12x.attention.indexer  # noqa: F401
    except ImportError as e:
        raise RuntimeError(
            "VLLM_USE_B12X_SPARSE_INDEXER=1 but b12x cannot be imported "
            f"({e}). Install the b12x release the image recipe pins, or unset "
            "VLLM_USE_B12X_SPARSE_INDEXER."
        ) from e


def split_prefill_chunks_by_supertile(
    query_lens: np.ndarray,
    request_offset: int,
    workspace_size: int,
    max_logits_bytes: int,
    split_chunks,
) -> list[tuple[slice, slice]]:
    """One request per chunk, its query rows split against the supertile budget.

    b12x scores K in supertiles, so the logits a chunk holds at once are
    ``rows x supertile`` whatever the context length: budget each request as if
    its context were one supertile.
    """
    budget = np.array([supertile_k()], dtype=np.int64)
    chunks: list[tuple[slice, slice]] = []
    for i in range(len(query_lens)):
        chunks.extend(
            split_chunks(
                budget,
                query_lens[i : i + 1],
                workspace_size,
                max_logits_bytes,
                request_offset=request_offset + i,
            )
        )
    return chunks


def build_schedule_metadata(
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    num_sms: int,
    out: torch.Tensor,
) -> torch.Tensor | None:
    """b12x paged-MQA schedule for the decode scorer, or None when it runs unscheduled.

    Decode rows here are always one query each (the builder flattens MTP when
    b12x is on), so ``seq_lens`` is (rows, 1) or (rows,).
    """
    from b12x.attention.indexer import (
        build_paged_mqa_schedule_metadata,
        uses_paged_mqa_schedule,
    )

    rows = seq_lens.reshape(-1)
    if not uses_paged_mqa_schedule(
        q_rows=int(rows.shape[0]), max_pages=int(block_table.shape[1])
    ):
        return None
    return build_paged_mqa_schedule_metadata(
        rows.contiguous(), block_size, num_sms, out=out
    )


def prefill_topk(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_quant: torch.Tensor,
    k_scale: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    topk_tokens: int,
    out: torch.Tensor,
) -> None:
    """Top-k K positions per prefill query row, relative to the row's ``ks``.

    ``out`` gets what vLLM's ``top_k_per_row_prefill`` writes: positions inside
    the row's own context, -1 where the row has fewer than ``topk_tokens``.
    """
    from b12x.attention.indexer import IndexerContiguousMetadata, contiguous_tiled_topk

    absolute = contiguous_tiled_topk(
        q_fp8=q_fp8,
        weights=weights,
        kv_fp8=(k_quant, k_scale),
        metadata=IndexerContiguousMetadata(k_start=cu_seqlen_ks, k_end=cu_seqlen_ke),
        topk=topk_tokens,
        supertile_k=supertile_k(),
    )
    relative = absolute - cu_seqlen_ks[:, None]
    row_len = (cu_seqlen_ke - cu_seqlen_ks)[:, None]
    valid = (absolute >= 0) & (relative >= 0) & (relative < row_len)
    out.copy_(torch.where(valid, relative, -1).to(out.dtype))


def decode_logits(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    schedule_metadata: torch.Tensor | None,
    active_width: torch.Tensor | None,
    block_size: int,
) -> torch.Tensor:
    """(rows, width) float32 logits over the paged FP8 indexer cache, -inf past each row."""
    from b12x.attention.indexer import IndexerPagedDecodeMetadata, paged_decode_logits

    num_blocks = kv_cache.shape[0]
    return paged_decode_logits(
        q_fp8=q_fp8,
        weights=weights,
        # vLLM's indexer cache already has b12x's page layout: per block,
        # block_size x 128 fp8 values then block_size fp32 scales.
        index_k_cache=kv_cache.view(num_blocks, -1),
        metadata=IndexerPagedDecodeMetadata(
            real_page_table=block_table,
            cache_seqlens_int32=seq_lens.reshape(-1),
            paged_mqa_schedule_metadata=schedule_metadata,
        ),
        page_size=block_size,
        active_width_override=active_width,
    )
