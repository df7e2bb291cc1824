"""b12x 1.5.1's ``b12x.attention.dsa_indexer._impl`` (the vLLM 0.33.0 overlay's API), emulated:
the functions ``b12x._emulated_indexer`` computes, with 1.5.1's names (its variables read
B12X_DSA_*)."""

from ..._release import require

require(__name__)

from ..._emulated_indexer import (  # noqa: E402,F401 - the release's surface
    LAST_DECODE,
    LAST_PREFILL,
    STATS,
    IndexerContiguousMetadata,
    IndexerPagedDecodeMetadata,
    build_paged_mqa_schedule_metadata,
    contiguous_tiled_topk,
    paged_decode_logits,
    uses_paged_mqa_schedule,
)
