"""b12x's DSA/NSA indexer functions emulated in torch, for validation only.

The functions the dsa-image overlays call, with the signatures and semantics of the release
``_release.current()`` names (b12x 0.30.2: b12x/attention/indexer/api.py; 1.5.1:
b12x/attention/dsa_indexer/_impl.py; both: schedule_metadata.py, tiled_topk.py, kernel.py,
contiguous_kernel.py), computed by ``dsa_image.runtime.indexer_reference``. The release's own modules
(``b12x.attention.indexer``, ``b12x.attention.dsa_indexer._impl``) re-export them:

- ``contiguous_tiled_topk``: scores the gathered keys a supertile at a time and folds each
  supertile's top-k into the next, returning absolute key rows (``k_start`` + position), -1
  where a row has fewer keys than ``topk``; the supertile is resolved as b12x does (the
  argument, else the release's ``B12X_{NSA,DSA}_TOPK_SUPERTILE_K``, rounded up to the prefill
  tile), and the buffers b12x would allocate are allocated (their bytes are recorded in
  ``LAST_PREFILL``).
- ``paged_decode_logits``: (rows, pages * page_size) fp32 logits through each row's page-table
  row, -inf at or past min(length, active width); the active width is the override, else the
  rows' longest length computed on the device, as b12x does; capturable in a CUDA graph.
- ``build_paged_mqa_schedule_metadata`` / ``uses_paged_mqa_schedule``: b12x's schedule.

Stricter than b12x on purpose: where b12x would silently score rows in its Python reference
(inputs outside the kernel contract), this raises; outside CUDA graph capture it checks that a
scheduled decode's schedule metadata describes the batch it is given. Ties among equal logits
are broken by lower position (b12x's radix select breaks them arbitrarily; 0.30.2's could also
drop winners when more than 4,096 candidates share the threshold bucket, which 1.5.1 rescans
exactly: the emulation is exact in both).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dsa_image.runtime import indexer_reference as ref

from . import _release as R

RELEASE = R.current()
# The kernels' contract; False lets tests run the emulation on CPU tensors.
REQUIRE_CUDA = True

# b12x's _normalize_weights converts these to fp32 before its kernel-contract checks.
_FLOAT_WEIGHTS = (torch.float32, torch.bfloat16, torch.float16)

# What the last contiguous_tiled_topk / paged_decode_logits call outside CUDA graph capture
# did, and counters the harness reports.
LAST_PREFILL: dict = {}
LAST_DECODE: dict = {}
STATS = {"prefill_calls": 0, "decode_calls": 0, "scheduled_decode_calls": 0,
         "schedules_verified": 0, "max_supertiles": 0, "max_b12x_buffer_bytes": 0,
         "supertile_k_values": []}


@dataclass(frozen=True)
class IndexerPagedDecodeMetadata:
    real_page_table: torch.Tensor
    cache_seqlens_int32: torch.Tensor
    paged_mqa_schedule_metadata: torch.Tensor | None = None


@dataclass(frozen=True)
class IndexerContiguousMetadata:
    k_start: torch.Tensor
    k_end: torch.Tensor


# -- schedule ---------------------------------------------------------------------------------


def uses_paged_mqa_schedule(*, q_rows: int, max_pages: int) -> bool:
    """b12x schedules a decode of 1..8 rows whose page table has >= 1024 pages."""
    return 0 < q_rows <= R.SCHEDULE_MULTI_ROW_MAX_Q_ROWS and max_pages >= R.SCHEDULE_MIN_PAGES


def build_paged_mqa_schedule_metadata(context_lens: torch.Tensor, block_kv: int,
                                      num_sms: int | None = None,
                                      out: torch.Tensor | None = None) -> torch.Tensor:
    """(num_sms + 1, 2) int32: per SM, the first (row, kv split) of its equal share of splits
    of block_kv * 4 keys."""
    _validate_schedule_inputs(context_lens, block_kv, out)
    num_sms = _schedule_num_sms(context_lens, num_sms, out)
    out = out if out is not None else torch.empty(
        (num_sms + 1, 2), dtype=torch.int32, device=context_lens.device)
    lens = (context_lens[:, -1] if context_lens.ndim == 2 else context_lens).long().clamp_min(0)
    if lens.numel() == 0:
        return out.zero_()
    split = int(block_kv) * R.SCHEDULE_PAGES_PER_SPLIT
    prefix = torch.cumsum((lens + split - 1) // split, dim=0)
    total = prefix[-1]
    sm = torch.arange(num_sms + 1, device=lens.device)
    starts = sm * (total // num_sms) + torch.minimum(sm, total % num_sms)
    row = torch.searchsorted(prefix, starts, right=True)
    before = prefix.gather(0, (row - 1).clamp(0, prefix.numel() - 1))
    before = torch.where(row > 0, before, torch.zeros_like(before))
    out[:, 0].copy_(row.to(torch.int32))
    out[:, 1].copy_((starts - before).to(torch.int32))
    return out


def _validate_schedule_inputs(context_lens, block_kv, out) -> None:
    if context_lens.ndim not in (1, 2) or context_lens.dtype != torch.int32:
        raise ValueError("context_lens must be rank-1 or rank-2 int32")
    if context_lens.ndim == 2 and context_lens.shape[1] == 0:
        raise ValueError("context_lens rank-2 input must have a non-empty trailing dimension")
    if not context_lens.is_contiguous():
        raise ValueError("context_lens must be contiguous")
    if block_kv <= 0:
        raise ValueError(f"block_kv must be positive, got {block_kv}")
    if out is not None and (out.ndim != 2 or out.shape[1] != 2 or out.dtype != torch.int32
                            or not out.is_contiguous() or out.device != context_lens.device):
        raise ValueError("out must be a contiguous (num_sms + 1, 2) int32 tensor on context_lens' device")


def _schedule_num_sms(context_lens, num_sms, out) -> int:
    if num_sms is None:
        num_sms = out.shape[0] - 1 if out is not None else (
            torch.cuda.get_device_properties(context_lens.device).multi_processor_count
            if context_lens.is_cuda else 1)
    if num_sms <= 0 or (out is not None and out.shape[0] != num_sms + 1):
        raise ValueError(f"num_sms {num_sms} does not fit out of shape {tuple(out.shape) if out is not None else None}")
    return int(num_sms)


# -- decode -----------------------------------------------------------------------------------


def paged_decode_logits(*, q_fp8: torch.Tensor, weights: torch.Tensor, index_k_cache: torch.Tensor,
                        metadata: IndexerPagedDecodeMetadata | None = None, page_size: int = 64,
                        preinitialize_invalid_logits: bool = True,
                        active_width_override: torch.Tensor | None = None,
                        score_mode: int = 0, binding=None) -> torch.Tensor:
    """(q rows, pages * page_size) fp32 logits; rows past the page table's are all -inf."""
    if binding is not None:
        raise NotImplementedError("the b12x emulation does not emulate scratch-plan bindings")
    if metadata is None:
        raise TypeError("paged_decode_logits requires metadata or binding")
    if int(score_mode) != 0:
        raise NotImplementedError(f"the b12x emulation emulates {RELEASE.tag}_RELU_SUM scoring (0) only")
    table, lens = metadata.real_page_table, metadata.cache_seqlens_int32
    problems = _paged_problems(q_fp8, weights, index_k_cache, table, lens, page_size)
    if problems:
        raise NotImplementedError("b12x paged logits outside the kernel contract: " + "; ".join(problems))
    rows, width = table.shape[0], table.shape[1] * page_size
    STATS["decode_calls"] += 1
    out = torch.full((q_fp8.shape[0], width), ref.NEG_INF, dtype=torch.float32, device=q_fp8.device)
    if not rows or not width:  # b12x returns before it computes a width or a schedule
        return out
    active = _active_width(active_width_override, lens, width, q_fp8.device)
    _check_schedule(metadata, table, lens, page_size, q_fp8.device)
    limits = torch.minimum(lens, active)
    out[:rows] = ref.paged_logits(q_fp8[:rows], weights[:rows].float(), index_k_cache, page_size, table, limits)
    if not _capturing(q_fp8.device):  # reading the width back would break a capture
        LAST_DECODE.clear()
        LAST_DECODE.update(rows=rows, width=width, active_width=int(active),
                           width_overridden=active_width_override is not None)
    return out


def _paged_problems(q, weights, cache, table, lens, page_size) -> list[str]:
    checks = (
        (page_size == R.PAGE_SIZE, f"page_size {page_size} != 64"),
        (q.ndim == 3 and q.shape[2] == ref.HEAD_DIM and q.dtype == ref.FP8, "q must be (rows, heads, 128) fp8"),
        (q.ndim == 3 and _head_tiles(q.shape[1]) in (1, 2, 4), "heads must be <= 16, <= 32, or 49..64"),
        (weights.dtype in _FLOAT_WEIGHTS and weights.shape == q.shape[:2], "weights must be (rows, heads) floats"),
        (cache.ndim == 2 and cache.dtype == torch.uint8 and cache.stride(-1) == 1
         and cache.shape[1] == R.PAGE_SIZE * (ref.HEAD_DIM + ref.SCALE_BYTES),
         "index_k_cache must be (pages, 64 * 132) uint8 with unit inner stride"),
        (table.ndim == 2 and table.dtype == torch.int32, "real_page_table must be rank-2 int32"),
        (lens.ndim == 1 and lens.dtype == torch.int32 and lens.shape[0] == table.shape[0],
         "cache_seqlens_int32 must be rank-1 int32, one per page-table row"),
        (table.shape[0] <= q.shape[0], "more page-table rows than q rows"),
        (_on_one_device(q, weights, cache, table, lens), "all tensors must be on one CUDA device"),
    )
    return [problem for ok, problem in checks if not ok]


def _head_tiles(heads: int) -> int:
    return max(-(-heads // 16), 1)


def _on_one_device(*tensors) -> bool:
    device = tensors[0].device
    return all(t.device == device for t in tensors) and (device.type == "cuda" or not REQUIRE_CUDA)


def _active_width(override, lens, width, device) -> torch.Tensor:
    """The override, else the rows' longest length capped at the width, on the device (b12x's
    _make_active_width_tensor; it does not clamp a negative maximum outside capture, which
    vLLM's lengths never are)."""
    if override is None:
        return lens.amax().reshape(1).clamp(0, width).to(torch.int32)
    if override.shape != (1,) or override.dtype != torch.int32 or override.device != device:
        raise ValueError("active_width_override must be a (1,) int32 tensor on q's device")
    return override


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_schedule(metadata, table, lens, page_size, device) -> None:
    if not uses_paged_mqa_schedule(q_rows=table.shape[0], max_pages=table.shape[1]):
        return
    STATS["scheduled_decode_calls"] += 1
    schedule = metadata.paged_mqa_schedule_metadata
    capturing = _capturing(device)
    if schedule is None:
        if capturing:
            raise ValueError("paged_mqa_schedule_metadata must be precomputed before CUDA graph "
                             "capture for the scheduled decode path")
        return
    if schedule.ndim != 2 or schedule.shape[1] != 2 or schedule.shape[0] < 2 \
            or schedule.dtype != torch.int32 or not schedule.is_contiguous():
        raise ValueError("paged_mqa_schedule_metadata must be a contiguous (n >= 2, 2) int32 tensor")
    if not capturing:
        expected = build_paged_mqa_schedule_metadata(lens.contiguous(), page_size, schedule.shape[0] - 1)
        if not torch.equal(schedule, expected):
            raise RuntimeError("paged_mqa_schedule_metadata does not describe this batch's lengths")
        STATS["schedules_verified"] += 1


# -- prefill ----------------------------------------------------------------------------------


def contiguous_tiled_topk(*, q_fp8: torch.Tensor, weights: torch.Tensor,
                          kv_fp8: tuple[torch.Tensor, torch.Tensor],
                          metadata: IndexerContiguousMetadata | None = None, topk: int | None = None,
                          tile_logits=None, lengths=None, output_values=None,
                          output_indices: torch.Tensor | None = None, candidate_values=None,
                          candidate_indices=None, merge_positions=None,
                          supertile_k: int | None = None, binding=None) -> torch.Tensor:
    """(rows, topk) int32 absolute key rows of each row's top-k over [k_start, k_end)."""
    _refuse_unemulated(binding=binding, tile_logits=tile_logits, lengths=lengths,
                       output_values=output_values, candidate_values=candidate_values,
                       candidate_indices=candidate_indices, merge_positions=merge_positions)
    if metadata is None or topk is None:
        raise TypeError("contiguous_tiled_topk requires metadata and topk")
    topk = int(topk)
    if topk not in R.SUPPORTED_TOPK:
        raise ValueError(f"run_tiled_topk supports topk values {R.SUPPORTED_TOPK}, got topk={topk}")
    k_quant, k_scale = kv_fp8
    ks, ke = metadata.k_start, metadata.k_end
    problems = _contiguous_problems(q_fp8, weights, k_quant, k_scale, ks, ke)
    if problems:
        raise RuntimeError("b12x would score these rows in its Python reference, not its "
                           "kernels: " + "; ".join(problems))
    rows, keys = ks.shape[0], k_quant.shape[0]
    if keys == 0:
        # b12x's run_tiled_topk gets num_k_tiles=0 and refuses it (tiled_topk.py, both releases).
        raise ValueError("Cannot determine num_k_tiles: b12x's tiled top-k needs at least one key")
    block_k = _prefill_block_k(rows, keys, q_fp8.shape[1])
    supertile = _resolve_supertile_k(supertile_k, block_k)
    out = _output_indices(output_indices, rows, topk, q_fp8.device)
    buffers = _b12x_buffers(rows, keys, topk, block_k, supertile, q_fp8.device)
    _fold(q_fp8, weights, kv_fp8, ks, ke, topk, supertile, buffers, out)
    _record_prefill(rows=rows, keys=keys, topk=topk, block_k=block_k, supertile_k=supertile,
                    supertiles=-(-keys // supertile),
                    b12x_buffer_bytes=sum(t.numel() * t.element_size() for t in buffers.values()))
    return out


def _record_prefill(**facts) -> None:
    LAST_PREFILL.clear()
    LAST_PREFILL.update(facts)
    STATS["prefill_calls"] += 1
    STATS["max_supertiles"] = max(STATS["max_supertiles"], facts["supertiles"])
    STATS["max_b12x_buffer_bytes"] = max(STATS["max_b12x_buffer_bytes"], facts["b12x_buffer_bytes"])
    STATS["supertile_k_values"] = sorted({*STATS["supertile_k_values"], facts["supertile_k"]})


def _refuse_unemulated(**arguments) -> None:
    given = [name for name, value in arguments.items() if value is not None]
    if given:
        raise NotImplementedError(f"the b12x emulation does not emulate {', '.join(given)}")


def _contiguous_problems(q, weights, k_quant, k_scale, ks, ke) -> list[str]:
    checks = (
        (q.ndim == 3 and q.shape[2] == ref.HEAD_DIM and q.dtype == ref.FP8, "q must be (rows, heads, 128) fp8"),
        (q.ndim == 3 and q.shape[1] <= R.MAX_HEADS, "more than 64 heads"),
        (weights.dtype in _FLOAT_WEIGHTS and weights.shape == q.shape[:2], "weights must be (rows, heads) floats"),
        (k_quant.ndim == 2 and k_quant.shape[1] == ref.HEAD_DIM and k_quant.dtype == ref.FP8,
         "keys must be (n, 128) fp8"),
        (k_scale.ndim == 1 and k_scale.shape[0] == k_quant.shape[0] and k_scale.dtype == torch.float32,
         "key scales must be (n,) fp32"),
        (ks.ndim == 1 and ks.shape == ke.shape and ks.dtype == ke.dtype == torch.int32,
         "k_start/k_end must be rank-1 int32 of one length"),
        (ks.shape[0] <= q.shape[0], "more key ranges than q rows"),
        (_on_one_device(q, weights, k_quant, k_scale, ks, ke), "all tensors must be on one CUDA device"),
    )
    return [problem for ok, problem in checks if not ok]


def _prefill_block_k(rows: int, keys: int, heads: int) -> int:
    """The prefill tile width b12x picks for this shape (256 or 512 keys): its
    resolve_contiguous_prefill_block_k, 256 where that picks the decode scorer."""
    threshold = os.environ.get(RELEASE.prefill_threshold_variable)
    prefill_scorer = int(threshold) > 0 if threshold is not None else rows >= R.PREFILL_SCORER_MIN_ROWS
    variable = RELEASE.prefill_block_k_variable
    choice = os.environ.get(variable, "auto").strip().lower()
    if rows <= 0 or keys <= 0 or not prefill_scorer or choice == str(R.PREFILL_BLOCK_K):
        return R.PREFILL_BLOCK_K
    wide = rows >= R.PREFILL512_MIN_Q_ROWS and keys >= R.PREFILL512_MIN_K_ROWS and heads in R.PREFILL512_HEADS
    if choice == str(R.PREFILL512_BLOCK_K) and not wide:
        raise ValueError(f"{variable}=512 is unsupported for this shape")
    if choice not in ("", "auto", str(R.PREFILL512_BLOCK_K)):
        raise ValueError(f"{variable} must be auto, 256, or 512; got {choice!r}")
    return R.PREFILL512_BLOCK_K if wide else R.PREFILL_BLOCK_K


def _resolve_supertile_k(supertile_k: int | None, block_k: int) -> int:
    """tiled_topk._resolve_supertile_k: the argument, else the release's variable, else 32768,
    at least one tile and rounded up to whole tiles."""
    if supertile_k is None:
        variable = RELEASE.supertile_variable
        raw = os.environ.get(variable)
        try:
            supertile_k = R.SUPERTILE_K_DEFAULT if raw is None else int(raw)
        except ValueError as exc:
            raise ValueError(f"{variable} must be an integer, got {raw!r}") from exc
    supertile_k = max(int(supertile_k), block_k)
    return -(-supertile_k // block_k) * block_k


def _output_indices(given, rows: int, topk: int, device) -> torch.Tensor:
    if given is None:
        return torch.empty((rows, topk), dtype=torch.int32, device=device)
    if given.shape != (rows, topk) or not given.is_contiguous() or given.dtype != torch.int32:
        raise ValueError(f"output_indices must be a contiguous ({rows}, {topk}) int32 tensor, "
                         f"got {tuple(given.shape)} {given.dtype}")
    return given


def _b12x_buffers(rows, keys, topk, block_k, supertile, device) -> dict[str, torch.Tensor]:
    """The buffers b12x allocates for this call (contiguous_tiled_topk, run_tiled_topk)."""
    q_tiles = -(-rows // R.BLOCK_Q)
    key_tiles = -(-keys // block_k)
    tiles = min(supertile // block_k, key_tiles)
    buffers = {
        "tile_logits": torch.empty(q_tiles * R.BLOCK_Q * tiles * block_k, dtype=torch.float32, device=device),
        "lengths": torch.empty(rows, dtype=torch.int32, device=device),
        "values": torch.empty((rows, topk), dtype=torch.float32, device=device),
    }
    if key_tiles > supertile // block_k:
        buffers["carry_values"] = torch.empty((2, rows, topk), dtype=torch.float32, device=device)
        buffers["carry_indices"] = torch.empty((2, rows, topk), dtype=torch.int32, device=device)
    return buffers


def _fold(q, weights, kv_fp8, ks, ke, topk, supertile, buffers, out) -> None:
    """Each supertile's logits go through b12x's tile buffer; its top-k, merged with the
    previous supertiles' (the carry), is the new carry; the last is the answer."""
    k_quant, k_scale = kv_fp8
    rows, keys = ks.shape[0], k_quant.shape[0]
    step = max(1, ref.BLOCK_ELEMENTS // (supertile + topk))
    carry_v = torch.full((rows, 0), ref.NEG_INF, device=q.device)
    carry_i = torch.full((rows, 0), -1, dtype=torch.int32, device=q.device)
    for chunk, start in enumerate(range(0, keys, supertile)):
        end = min(start + supertile, keys)
        tile = buffers["tile_logits"][: rows * (end - start)].view(rows, end - start)
        new_v, new_i = buffers["values"], out
        if "carry_values" in buffers and end < keys:
            new_v, new_i = buffers["carry_values"][chunk % 2], buffers["carry_indices"][chunk % 2]
        for first in range(0, rows, step):
            part = slice(first, min(first + step, rows))
            logits = ref.relu_weighted_logits(q[part], weights[part], k_quant[start:end], k_scale[start:end])
            tile[part] = ref.masked_logits(logits, ks[part], ke[part], offset=start)
            positions = torch.arange(start, end, device=q.device, dtype=torch.int32).expand(tile[part].shape)
            top_v, top_i = ref.select_topk(torch.cat([carry_v[part], tile[part]], 1),
                                           torch.cat([carry_i[part], positions], 1), topk)
            new_v[part], new_i[part] = top_v, top_i
        carry_v, carry_i = new_v, new_i
    torch.sub(ke, ks, out=buffers["lengths"])
