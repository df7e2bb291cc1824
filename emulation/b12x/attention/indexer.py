"""b12x 0.30.2's ``b12x.attention.indexer`` (the vLLM 0.24.0 overlay's API), emulated: the
functions ``b12x._emulated_indexer`` computes, importable only when the emulated release is
0.30.2 (b12x 1.5.1 has no such module)."""

from .._release import require

require(__name__)

from .._emulated_indexer import (  # noqa: E402,F401 - the release's surface
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
