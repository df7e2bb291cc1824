"""The DSA indexer's math in plain torch: what its kernels compute, to check them against.

For query row r, key position n:

    logit[r, n] = scale[n] * sum_h weights[r, h] * relu(q[r, h] . k[n])

with q (rows, heads, 128) and k (keys, 128) FP8 e4m3, scale[n] the key's fp32 dequant scale
(k[n] * scale[n] is the key), weights fp32 (vLLM folds the query's own scale into them).
ReLU of q.k times scale equals ReLU of q.(k * scale) because scales are positive; DeepGEMM and
b12x differ only in where they round. vLLM's indexer cache holds, per block of block_size
tokens, block_size x 128 fp8 values and then block_size fp32 scales (the page b12x reads too).

The logits here are bit-reproducible whatever the batching, device or chunking: each q.k of FP8
values is exact in float64 (products of two 4-bit significands summed over 128 terms stay
within 43 bits), and the heads are accumulated elementwise in a fixed order. So two computations
that feed the same bytes through these functions agree exactly, not approximately.

Top-k order: larger logit first, lower position first among equal logits (a total order, so the
top-k set is unique). Positions whose logit is -inf are never selected (-1 instead).

Stdlib + torch only; in the image (the self-test uses it).
"""

from __future__ import annotations

import torch

HEAD_DIM = 128
SCALE_BYTES = 4
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
NEG_INF = float("-inf")
# Float64 elements per intermediate (key block x rows): bounds memory at ~128 MiB per buffer.
BLOCK_ELEMENTS = 1 << 24


def relu_weighted_logits(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor,
                         k_scale: torch.Tensor) -> torch.Tensor:
    """(rows, keys) float32 logits; k (keys, 128) shared by all rows, or (rows, keys, 128)."""
    rows, keys = q.shape[0], k.shape[-2]
    out = torch.empty((rows, keys), dtype=torch.float32, device=q.device)
    step = max(1, BLOCK_ELEMENTS // max(1, keys * (HEAD_DIM if k.ndim == 3 else 1)))
    for start in range(0, rows, step):
        part = slice(start, min(start + step, rows))
        out[part] = _logits_block(q[part], weights[part], k if k.ndim == 2 else k[part],
                                  k_scale if k_scale.ndim == 1 else k_scale[part])
    return out


def _logits_block(q, weights, k, k_scale) -> torch.Tensor:
    q64 = q.to(torch.float64)
    k64 = k.to(torch.float64)
    w64 = weights.to(torch.float64)
    acc = torch.zeros((q.shape[0], k.shape[-2]), dtype=torch.float64, device=q.device)
    for h in range(q.shape[1]):
        if k64.ndim == 2:
            score = q64[:, h, :] @ k64.T
        else:
            score = torch.bmm(k64, q64[:, h, :, None]).squeeze(-1)
        acc = acc + torch.relu(score) * w64[:, h, None]
    return (acc * k_scale.to(torch.float64)).to(torch.float32)


def masked_logits(logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                  offset: int = 0) -> torch.Tensor:
    """``logits`` with -inf outside each row's [start, end); columns are positions offset+j."""
    pos = torch.arange(logits.shape[1], device=logits.device) + offset
    inside = (pos >= starts[:, None].to(pos.device)) & (pos < ends[:, None].to(pos.device))
    return torch.where(inside, logits, torch.full_like(logits, NEG_INF))


def select_topk(values: torch.Tensor, indices: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best (value, index) pairs per row: larger value first, lower index among equals.

    Returns (values, int32 indices) of shape (rows, k); -inf values get index -1, and rows with
    fewer than k candidates are padded with (-inf, -1).
    """
    by_index = torch.argsort(indices, dim=1, stable=True)
    values, indices = values.gather(1, by_index), indices.gather(1, by_index)
    by_value = torch.argsort(values, dim=1, descending=True, stable=True)[:, :k]
    top_v, top_i = values.gather(1, by_value), indices.gather(1, by_value)
    top_i = torch.where(torch.isinf(top_v) & (top_v < 0), torch.full_like(top_i, -1), top_i)
    pad = k - top_v.shape[1]
    if pad > 0:
        top_v = torch.nn.functional.pad(top_v, (0, pad), value=NEG_INF)
        top_i = torch.nn.functional.pad(top_i, (0, pad), value=-1)
    return top_v, top_i.to(torch.int32)


def topk_positions(logits: torch.Tensor, k: int) -> torch.Tensor:
    """(rows, k) int32 column positions of each row's top-k, -1 past its finite logits."""
    positions = torch.arange(logits.shape[1], device=logits.device).expand_as(logits)
    return select_topk(logits, positions, k)[1]


# -- vLLM's paged indexer cache --------------------------------------------------------------


def cache_pages(cache: torch.Tensor) -> torch.Tensor:
    """The cache as (blocks, block_size * 132) bytes, from (blocks, block_size, 132) or 2-D pages.

    Strided block dimensions are kept (vLLM may pad pages); each page must be one byte run.
    """
    if cache.ndim == 2:
        return cache
    blocks, block_size, width = cache.shape
    assert cache.stride(2) == 1 and cache.stride(1) == width, "page bytes must be contiguous"
    return torch.as_strided(cache, (blocks, block_size * width), (cache.stride(0), 1))


def split_pages(pages: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values fp8 (blocks, block_size, 128), scales fp32 (blocks, block_size)) views of pages."""
    data = block_size * HEAD_DIM
    values = pages[:, :data].view(FP8).reshape(pages.shape[0], block_size, HEAD_DIM)
    scales = pages[:, data:data + block_size * SCALE_BYTES].view(torch.float32)
    return values, scales


def gather_keys(pages: torch.Tensor, block_size: int, table: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and scales at token ``positions`` through block-table row(s) ``table``.

    table (columns,) with positions (n,), or table (rows, columns) with positions (rows, n).
    Positions past the table read block 0 (callers mask them).
    """
    values, scales = split_pages(pages, block_size)
    column = torch.clamp(positions // block_size, max=table.shape[-1] - 1)
    block = torch.gather(table, -1, column).long() if table.ndim == 2 else table[column].long()
    block = block.clamp(0, values.shape[0] - 1)
    slot = positions % block_size
    return values[block, slot], scales[block, slot]


def request_logits(q: torch.Tensor, weights: torch.Tensor, pages: torch.Tensor, block_size: int,
                   table_row: torch.Tensor, context_lens: torch.Tensor, width: int) -> torch.Tensor:
    """(rows, width) logits of a request's query rows over its context; row r sees positions
    [0, context_lens[r]), -inf elsewhere."""
    positions = torch.arange(width, device=q.device)
    k, scale = gather_keys(pages, block_size, table_row, positions)
    logits = relu_weighted_logits(q, weights, k, scale)
    return masked_logits(logits, torch.zeros_like(context_lens), context_lens)


def paged_logits(q: torch.Tensor, weights: torch.Tensor, pages: torch.Tensor, block_size: int,
                 table: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """(rows, columns * block_size) logits, row r through its own table row, over [0, limits[r]).

    No host synchronisation and shapes fixed by the inputs: usable inside CUDA graph capture.
    """
    rows, width = table.shape[0], table.shape[1] * block_size
    out = torch.full((rows, width), NEG_INF, dtype=torch.float32, device=q.device)
    span = max(block_size, BLOCK_ELEMENTS // (HEAD_DIM * max(1, rows)) // block_size * block_size)
    for start in range(0, width, span):
        cols = torch.arange(start, min(start + span, width), device=q.device)
        positions = cols.expand(rows, -1)
        k, scale = gather_keys(pages, block_size, table, positions)
        block = relu_weighted_logits(q, weights, k, scale)
        valid = _valid_pages(table, positions // block_size, pages.shape[0])
        inside = valid & (positions < limits[:, None])
        out[:, start:start + cols.shape[0]] = torch.where(inside, block, out[:, start:start + cols.shape[0]])
    return out


def _valid_pages(table: torch.Tensor, columns: torch.Tensor, num_pages: int) -> torch.Tensor:
    ids = torch.gather(table, 1, columns.clamp(max=table.shape[1] - 1))
    return (ids >= 0) & (ids < num_pages)


# -- inputs ----------------------------------------------------------------------------------


def random_fp8(shape, generator: torch.Generator, device="cpu", spread: float = 2.0) -> torch.Tensor:
    """Normal values (std ``spread``) in FP8 e4m3, never NaN."""
    values = torch.randn(shape, generator=generator, dtype=torch.float32) * spread
    return values.clamp(-FP8_MAX, FP8_MAX).to(FP8).to(device)


def random_scales(n, generator: torch.Generator, device="cpu") -> torch.Tensor:
    """Positive fp32 scales spread over two octaves, so equal logits are rare."""
    exponent = torch.rand(n, generator=generator, dtype=torch.float32) * 2 - 8
    return torch.exp2(exponent).to(device)


def random_weights(rows: int, heads: int, generator: torch.Generator, device="cpu") -> torch.Tensor:
    return torch.randn((rows, heads), generator=generator, dtype=torch.float32).to(device)


def random_cache(num_blocks: int, block_size: int, generator: torch.Generator,
                 device="cpu") -> torch.Tensor:
    """A (blocks, block_size, 132) uint8 indexer cache, every slot a valid key and scale."""
    pages = torch.empty((num_blocks, block_size * (HEAD_DIM + SCALE_BYTES)), dtype=torch.uint8)
    values, scales = split_pages(pages, block_size)
    values.copy_(random_fp8(values.shape, generator))
    scales.copy_(random_scales(scales.shape, generator))
    return pages.view(num_blocks, block_size, HEAD_DIM + SCALE_BYTES).to(device)


# -- comparing a selection with the reference ------------------------------------------------


def selection_problems(selected, ref_logits: torch.Tensor, k: int, tol: float = 0.0) -> list[str]:
    """Why ``selected`` is not a top-k of ``ref_logits`` (one row); [] when it is.

    ``selected``: the positions a kernel chose (-1 entries ignored). With ``tol`` 0 the check
    is exact yet admits any choice among logits equal to the k-th: every logit above the k-th
    must be chosen, every chosen one must be at least the k-th, and the count must be
    min(k, finite logits). A positive ``tol`` widens "equal" to within tol of the k-th.
    """
    ref = ref_logits.detach().to("cpu", torch.float64)
    chosen = [int(i) for i in selected if int(i) >= 0]
    finite = int(torch.isfinite(ref).sum())
    want = min(k, finite)
    problems = []
    if len(set(chosen)) != len(chosen):
        problems.append("a position is chosen twice")
    if len(chosen) != want:
        problems.append(f"{len(chosen)} positions chosen, {want} expected")
    outside = [i for i in chosen if i >= ref.numel() or not torch.isfinite(ref[i])]
    if outside:
        problems.append(f"positions outside the row's keys: {outside[:5]}")
        return problems
    if want == 0:
        return problems
    kth = float(torch.topk(ref, want).values[-1])
    missed = sorted(set(torch.nonzero(ref > kth + tol).flatten().tolist()) - set(chosen))
    below = [i for i in chosen if float(ref[i]) < kth - tol]
    if missed:
        problems.append(f"{len(missed)} positions above the k-th logit not chosen, e.g. {missed[:5]}")
    if below:
        problems.append(f"{len(below)} chosen positions below the k-th logit, e.g. {below[:5]}")
    return problems


def agreement(selected, reference) -> float:
    """Share of the reference's chosen positions that ``selected`` chose too (1.0 when both
    choose none)."""
    ref = {int(i) for i in reference if int(i) >= 0}
    got = {int(i) for i in selected if int(i) >= 0}
    return 1.0 if not ref else len(ref & got) / len(ref)
