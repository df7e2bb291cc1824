"""Randomised batches for the DSA indexer metadata builder, and plain references.

A batch is described host-side (``BatchSpec``: per request, query length and
context length) and turned into vLLM's ``CommonAttentionMetadata`` on a device.
Decode requests come first, as vLLM's reorder puts them. The reference
functions here are deliberately naive (Python loops over positions): the
builder's vectorised and Triton code is checked against them.

Needs numpy; torch/vLLM only where a function says so.
"""

from __future__ import annotations

import dataclasses

import numpy as np

BLOCK_SIZE = 64


@dataclasses.dataclass(frozen=True)
class BatchSpec:
    name: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]

    def __post_init__(self):
        assert len(self.query_lens) == len(self.seq_lens)
        assert all(0 <= q <= s for q, s in zip(self.query_lens, self.seq_lens, strict=True))

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))


def decode_batch(rng, name, batch_size, next_n, max_len, variable=False):
    """``batch_size`` decode requests of ``next_n`` tokens (fewer when variable)."""
    query_lens = [next_n] * batch_size
    if variable:
        query_lens = [int(rng.integers(1, next_n + 1)) for _ in range(batch_size)]
        query_lens[0] = next_n  # the uniform check looks at the first request
        if batch_size > 1 and all(q == next_n for q in query_lens):
            query_lens[-1] = next_n - 1
    seq_lens = [int(rng.integers(next_n + 1, max_len + 1)) for _ in range(batch_size)]
    return BatchSpec(name, tuple(query_lens), tuple(seq_lens))


def mixed_batch(rng, name, num_decodes, prefill_query_lens, max_len, next_n=1):
    decode = decode_batch(rng, name, num_decodes, next_n, max_len)
    query_lens = list(decode.query_lens)
    seq_lens = list(decode.seq_lens)
    for q in prefill_query_lens:
        context = int(rng.integers(0, max_len - q + 1))
        query_lens.append(q)
        seq_lens.append(context + q)
    return BatchSpec(name, tuple(query_lens), tuple(seq_lens))


def standard_batches(seed: int, max_len: int) -> dict[int, list[BatchSpec]]:
    """The equivalence scenarios, keyed by MTP next_n (1: no speculation)."""
    rng = np.random.default_rng(seed)
    plain = [decode_batch(rng, f"decode_bs{bs}", bs, 1, max_len) for bs in (1, 8, 64, 256)]
    plain += [
        mixed_batch(rng, "mixed_4dec_2pre", 4, (37, 700), max_len),
        mixed_batch(rng, "mixed_16dec_long_pre", 16, (3000,), max_len),
        mixed_batch(rng, "prefill_long_x2", 0, (2500, 4096), max_len),
        mixed_batch(rng, "prefill_7000", 0, (7000,), max_len),
        mixed_batch(rng, "prefill_many_short", 0, tuple(range(1, 200, 13)), max_len),
    ]
    batches = {1: plain}
    for next_n in (2, 4):
        batches[next_n] = [
            decode_batch(rng, f"mtp{next_n}_uniform_bs{bs}", bs, next_n, max_len)
            for bs in (4, 32)
        ] + [
            decode_batch(rng, f"mtp{next_n}_variable_bs16", 16, next_n, max_len, True),
            mixed_batch(rng, f"mtp{next_n}_mixed", 8, (3000,), max_len, next_n=next_n),
        ]
    return batches


def random_block_table(rng, num_reqs: int, width: int, num_blocks: int) -> np.ndarray:
    """Distinct physical blocks per request, like the KV manager hands out."""
    table = np.zeros((num_reqs, width), dtype=np.int32)
    for r in range(num_reqs):
        table[r] = rng.choice(num_blocks, size=width, replace=False)
    return table


# --- references -------------------------------------------------------------


def chunk_covers_every_row_once(chunks, prefill_query_lens, request_offset) -> bool:
    """Each (request, query row) appears in exactly one (req_slice, query_slice)."""
    seen: dict[int, int] = {}
    starts = np.concatenate([[0], np.cumsum(prefill_query_lens)])
    for req_slice, query_slice in chunks:
        base = starts[req_slice.start - request_offset]
        for row in range(query_slice.start, query_slice.stop):
            # query_slice indexes the chunk's rows, which run over its requests.
            key = int(base + row)
            seen[key] = seen.get(key, 0) + 1
    total = int(starts[-1])
    return sorted(seen) == list(range(total)) and all(v == 1 for v in seen.values())
