# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""b12x kernels for the DSA sparse-attention indexer (dsa-image overlay).

Everything this overlay calls in b12x goes through this module, so the b12x API
surface we depend on is in one place (and checked against the pinned b12x wheel
by the repository's tests). b12x is imported lazily: vLLM without b12x installed
must import this module without error, and only fail when the path is asked for.

The API lives in ``b12x.attention.indexer`` for b12x 0.20 .. 0.30.x, the release
line the recipe pins. The paths taken there:

- prefill: vLLM gathers each request's keys, as for DeepGEMM, and
  ``contiguous_tiled_topk`` scores them ``B12X_NSA_TOPK_SUPERTILE_K`` keys at a
  time, folding each supertile's top-k into the next. b12x's paged top-k
  (``index_topk_fp8``, tuned by ``B12X_PAGED_INDEX_SUPERTILE_K``) runs only with
  a scratch-plan binding, whose buffers would have to come from vLLM's locked
  workspace or be reserved per plan size; this overlay does not take it.
- decode: ``paged_decode_logits`` scores the paged cache, vLLM's top-k selects.
  Multi-token (MTP) decode is always flattened (``decode_flattens``).
"""

import importlib.metadata
import os

import torch

import vllm.envs as envs
from vllm.platforms import current_platform

# Whole 512-key multiples are whole tiles for both of b12x's prefill tile widths
# (256 and 512 keys), so b12x scores exactly the supertile the builder budgets.
SUPERTILE_ALIGNMENT = 512

# b12x's prefill scorer and top-k work on 32-row query tiles and size their
# buffers in whole tiles.
QUERY_TILE_ROWS = 32

# Compute capability families b12x has kernels for (sm_120, sm_121).
SUPPORTED_CAPABILITY_FAMILY = 120

# The only sizes b12x's tiled top-k (run_tiled_topk) selects.
SUPPORTED_TOPK = (512, 1024, 2048)

# b12x releases (major, minor) whose b12x.attention.indexer has this API.
SUPPORTED_RELEASES = ((0, 20), (0, 30))

# The paged top-k path's variable, which this overlay's path never reads.
PAGED_SUPERTILE_VARIABLE = "B12X_PAGED_INDEX_SUPERTILE_K"

HEAD_DIM = 128
MAX_HEADS = 64
# b12x converts these to fp32 itself before checking its kernel contract.
FLOAT_WEIGHTS = (torch.float32, torch.bfloat16, torch.float16)


def enabled() -> bool:
    return envs.VLLM_USE_B12X_SPARSE_INDEXER


def kernel_family() -> str:
    """The name the start-up log and the smoke test use for the indexer kernels."""
    return "b12x" if enabled() else "deepgemm"


def supertile_k() -> int:
    """Keys per prefill supertile: ``B12X_NSA_TOPK_SUPERTILE_K`` rounded up."""
    tiles = -(-envs.B12X_NSA_TOPK_SUPERTILE_K // SUPERTILE_ALIGNMENT)
    return tiles * SUPERTILE_ALIGNMENT


def decode_flattens(next_n: int) -> bool:
    """Whether b12x decode flattens MTP rows: always, when there are drafts.

    b12x's ``paged_decode_logits`` scores one query row per page-table row and
    takes rank-1 lengths (``cache_seqlens_int32``); it has no (batch, next_n)
    form like DeepGEMM's native next_n=2. Each draft token gets its own row.
    """
    return next_n > 1


def prefill_row_bytes(supertile: int, topk: int) -> int:
    """Device bytes ``contiguous_tiled_topk`` allocates per query row.

    One supertile of fp32 tile logits, the (2, rows, topk) fp32 + int32 carry
    double buffer of the supertile fold, the fp32 top-k values and the int32
    row length. The indices go straight into vLLM's top-k buffer.
    """
    return 4 * supertile + topk * (2 * (4 + 4) + 4) + 4


def prefill_rows_per_chunk(supertile: int, topk: int, budget_bytes: int) -> int:
    """Query rows per prefill chunk so that b12x's buffers fit ``budget_bytes``.

    vLLM's profiling run reserves the indexer's logits budget
    (``VLLM_SPARSE_INDEXER_MAX_LOGITS_MB``); b12x allocates its buffers outside
    that profile, so they are held to the same budget. b12x pads rows to whole
    query tiles, so chunks are whole tiles; never fewer than one row.
    """
    rows = budget_bytes // prefill_row_bytes(supertile, topk)
    if rows >= QUERY_TILE_ROWS:
        rows -= rows % QUERY_TILE_ROWS
    return max(1, rows)


def split_prefill_chunks_by_supertile(
    query_lens,
    request_offset: int,
    topk: int,
    max_logits_bytes: int,
) -> list[tuple[slice, slice]]:
    """One request per chunk, its query rows cut to ``prefill_rows_per_chunk``.

    A chunk's keys are its request's context, which b12x scores a supertile at
    a time, so the rows a chunk may hold do not depend on the context length.
    """
    rows = prefill_rows_per_chunk(supertile_k(), topk, max_logits_bytes)
    return [
        (
            slice(request_offset + i, request_offset + i + 1),
            slice(start, min(start + rows, length)),
        )
        for i, length in enumerate(int(q) for q in query_lens)
        for start in range(0, length, rows)
    ]


def require_supported(index_topk: int | None, use_fp4_indexer_cache: bool) -> None:
    """Fail at start-up, with one message saying what to do, when b12x cannot
    serve this setup."""
    _require_cuda_capability()
    if index_topk not in SUPPORTED_TOPK:
        raise RuntimeError(
            "VLLM_USE_B12X_SPARSE_INDEXER=1: b12x selects a top-k of "
            f"{', '.join(map(str, SUPPORTED_TOPK))} keys; this model's "
            f"index_topk is {index_topk}. Unset VLLM_USE_B12X_SPARSE_INDEXER to "
            "use the DeepGEMM indexer."
        )
    if use_fp4_indexer_cache:
        raise RuntimeError(
            "VLLM_USE_B12X_SPARSE_INDEXER=1 scores the FP8 indexer cache; it "
            "cannot be combined with use_fp4_indexer_cache."
        )
    _require_contiguous_supertile_variable()
    _require_b12x_release()


def _require_cuda_capability() -> None:
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


def _require_contiguous_supertile_variable() -> None:
    # A value tuned for the paged path would be silently ignored here: the
    # prefill memory it was meant to bound would change without notice.
    if PAGED_SUPERTILE_VARIABLE in os.environ:
        raise RuntimeError(
            f"{PAGED_SUPERTILE_VARIABLE} is set, but this image's b12x prefill "
            "takes b12x's contiguous path, which reads B12X_NSA_TOPK_SUPERTILE_K "
            f"(now {supertile_k()} keys): set that instead and unset "
            f"{PAGED_SUPERTILE_VARIABLE}."
        )


def _require_b12x_release() -> None:
    try:
        import b12x.attention.indexer  # noqa: F401

        version = importlib.metadata.version("b12x")
    except ImportError as e:
        raise RuntimeError(
            "VLLM_USE_B12X_SPARSE_INDEXER=1 but b12x cannot be imported "
            f"({e}). Install the b12x release the image recipe pins, or unset "
            "VLLM_USE_B12X_SPARSE_INDEXER."
        ) from e
    if not _supported_release(version):
        raise RuntimeError(
            f"VLLM_USE_B12X_SPARSE_INDEXER=1 but b12x {version} is installed; "
            "this overlay calls the b12x.attention.indexer API of b12x 0.20 to "
            "0.30.x (the image pins 0.30.2). Install that release, or unset "
            "VLLM_USE_B12X_SPARSE_INDEXER."
        )


def _supported_release(version: str) -> bool:
    try:
        release = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    low, high = SUPPORTED_RELEASES
    return low <= release <= high


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

    problems = prefill_contract_problems(
        q_fp8, weights, k_quant, k_scale, cu_seqlen_ks, cu_seqlen_ke, out
    )
    if problems:
        # b12x would not fail here: it would score every row in a Python loop
        # (contiguous_tiled_topk's reference fallback), minutes per prefill.
        raise RuntimeError(
            "b12x prefill top-k: inputs outside b12x's kernel contract: "
            + "; ".join(problems)
        )
    # b12x writes absolute key rows into a contiguous ``out`` directly, so the
    # conversion below needs no temporary of rows x topk.
    target = out if out.is_contiguous() else None
    result = contiguous_tiled_topk(
        q_fp8=q_fp8,
        weights=weights,
        kv_fp8=(k_quant, k_scale),
        metadata=IndexerContiguousMetadata(k_start=cu_seqlen_ks, k_end=cu_seqlen_ke),
        topk=topk_tokens,
        supertile_k=supertile_k(),
        output_indices=target,
    )
    if target is None:
        out.copy_(result)
    # Absolute key row -> position in the row's context. b12x's -1 (fewer keys
    # than topk) becomes -1 - ks <= -1, which the clamp returns to -1.
    out.sub_(cu_seqlen_ks.unsqueeze(1)).clamp_(min=-1)


def prefill_contract_problems(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    k_quant: torch.Tensor,
    k_scale: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    out: torch.Tensor,
) -> list[str]:
    """How the prefill inputs miss b12x's contiguous kernel contract; [] if not."""
    fp8 = torch.float8_e4m3fn
    tensors = (q_fp8, weights, k_quant, k_scale, ks, ke, out)
    checks = (
        (q_fp8.dtype == fp8 and q_fp8.ndim == 3, "q must be (rows, heads, 128) fp8"),
        (q_fp8.shape[-1] == HEAD_DIM, f"q head dim {q_fp8.shape[-1]} != 128"),
        (q_fp8.ndim == 3 and q_fp8.shape[1] <= MAX_HEADS, "more than 64 heads"),
        (
            weights.dtype in FLOAT_WEIGHTS and weights.shape == q_fp8.shape[:2],
            "weights must be (rows, heads) floating point",
        ),
        (
            k_quant.dtype == fp8
            and k_quant.ndim == 2
            and k_quant.shape[-1] == HEAD_DIM,
            "keys must be (n, 128) fp8",
        ),
        (
            k_scale.dtype == torch.float32 and k_scale.shape == k_quant.shape[:1],
            "key scales must be (n,) float32",
        ),
        (
            ks.dtype == ke.dtype == torch.int32
            and ks.ndim == 1
            and ks.shape == ke.shape,
            "ks/ke must be rank-1 int32 of one length",
        ),
        (ks.shape[0] <= q_fp8.shape[0], "more key ranges than query rows"),
        (
            out.dtype == torch.int32 and tuple(out.shape[:1]) == tuple(ks.shape),
            "out must be (rows, topk) int32",
        ),
        (
            all(t.is_cuda and t.device == q_fp8.device for t in tensors),
            "all tensors must be on one CUDA device",
        ),
    )
    return [problem for ok, problem in checks if not ok]


def paged_cache_pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """vLLM's (blocks, block_size, 132) indexer cache as b12x's 2-D pages.

    vLLM's page already has b12x's layout: block_size x 128 fp8 values, then
    block_size fp32 scales. The block stride is kept, not assumed: vLLM pads
    pages to the largest page size of the model's KV cache specs
    (``page_size_padded``), which makes the cache a strided view.
    """
    blocks, block_size, width = kv_cache.shape
    if kv_cache.stride(2) != 1 or kv_cache.stride(1) != width:
        raise RuntimeError(
            "b12x reads each indexer-cache page as one run of bytes; this cache "
            f"has shape {tuple(kv_cache.shape)}, strides {tuple(kv_cache.stride())}"
        )
    return torch.as_strided(
        kv_cache, (blocks, block_size * width), (kv_cache.stride(0), 1)
    )


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

    return paged_decode_logits(
        q_fp8=q_fp8,
        weights=weights,
        index_k_cache=paged_cache_pages(kv_cache),
        metadata=IndexerPagedDecodeMetadata(
            real_page_table=block_table,
            cache_seqlens_int32=seq_lens.reshape(-1),
            paged_mqa_schedule_metadata=schedule_metadata,
        ),
        page_size=block_size,
        active_width_override=active_width,
    )
