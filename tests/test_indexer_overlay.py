"""The overlaid indexer modules against the real vLLM 0.24.0, on the CPU.

These import vLLM, so they run where vLLM 0.24.0 with our overlay is installed: the
image's `test` stage (`docker buildx bake test`). Elsewhere they skip. The GPU half
(metadata equivalence with stock, syncs, serving) is scripts/h200_validation.sh.
"""

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip(
    "vllm", reason="vLLM 0.24.0 + overlay not installed: runs in the image's test stage")
torch = pytest.importorskip("torch")

from vllm.v1.attention.backends.mla import b12x_indexer  # noqa: E402
from vllm.v1.attention.backends.mla import indexer  # noqa: E402

from dsa_image.validation import batches as B  # noqa: E402

MB = 1024 * 1024


def test_overlaid_modules_are_the_overlay():
    import vllm.envs as envs
    from vllm.model_executor.layers import sparse_attn_indexer

    assert envs.VLLM_USE_B12X_SPARSE_INDEXER is False
    assert envs.B12X_PAGED_INDEX_SUPERTILE_K == 32768
    assert "b12x_indexer" in vars(sparse_attn_indexer)
    assert hasattr(indexer, "dcp_local_lens")
    assert "use_b12x" in indexer.DeepseekV32IndexerMetadata.__dataclass_fields__


def test_the_switch_reads_the_environment(monkeypatch):
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_USE_B12X_SPARSE_INDEXER", "1")
    assert envs.VLLM_USE_B12X_SPARSE_INDEXER is True
    assert b12x_indexer.kernel_family() == "b12x"


def test_b12x_is_refused_at_start_up_without_an_sm12x_gpu():
    with pytest.raises(RuntimeError, match="VLLM_USE_B12X_SPARSE_INDEXER=1 needs"):
        b12x_indexer.require_supported(use_fp4_indexer_cache=False)


prefill_batches = st.lists(
    st.tuples(st.integers(1, 3000), st.integers(0, 20000)), min_size=1, max_size=24)


def _split(batch, workspace, logits_mb, offset):
    query = np.array([q for q, _ in batch], dtype=np.int32)
    seq = np.array([q + c for q, c in batch], dtype=np.int32)
    return query, seq, indexer.split_indexer_prefill_chunks(
        seq, query, workspace, logits_mb * MB, request_offset=offset)


@settings(max_examples=300, deadline=None)
@given(prefill_batches, st.integers(2048, 200000), st.sampled_from([1, 8, 64, 512]),
       st.integers(0, 7))
def test_every_query_row_lands_in_exactly_one_chunk(batch, workspace, logits_mb, offset):
    query, _, chunks = _split(batch, workspace, logits_mb, offset)
    assert B.chunk_covers_every_row_once(chunks, query, offset)


@settings(max_examples=300, deadline=None)
@given(prefill_batches, st.integers(2048, 200000), st.sampled_from([1, 8, 64, 512]))
def test_chunks_respect_the_workspace_and_logits_budgets(batch, workspace, logits_mb):
    query, seq, chunks = _split(batch, workspace, logits_mb, 0)
    max_elems = logits_mb * MB // 4
    for req_slice, query_slice in chunks:
        n = int(seq[req_slice].sum())
        rows = query_slice.stop - query_slice.start
        single = req_slice.stop - req_slice.start == 1
        # Several requests share a chunk only within both budgets; one request
        # alone may exceed the workspace (nothing smaller exists), but its query
        # rows are then cut so that rows x keys stays within the logits budget
        # (down to one row per chunk).
        assert single or n <= workspace
        assert rows * n <= max_elems or rows == 1


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 3000), st.integers(10000, 160000), st.sampled_from([1, 4, 16]))
def test_one_oversized_request_is_split_on_the_query_axis(q, context, logits_mb):
    query = np.array([q], dtype=np.int32)
    seq = np.array([q + context], dtype=np.int32)
    chunks = indexer.split_indexer_prefill_chunks(seq, query, 10**9, logits_mb * MB)
    rows_per_chunk = max(1, logits_mb * MB // 4 // int(seq[0]))
    assert all(r == slice(0, 1) for r, _ in chunks)
    assert [c.stop - c.start for _, c in chunks][:-1] == [rows_per_chunk] * (len(chunks) - 1)
    assert chunks[-1][1].stop == q


@settings(max_examples=100, deadline=None)
@given(prefill_batches, st.integers(2048, 200000))
def test_numpy_and_cpu_tensor_lengths_give_the_same_chunks(batch, workspace):
    query, seq, chunks = _split(batch, workspace, 64, 3)
    as_tensors = indexer.split_indexer_prefill_chunks(
        torch.from_numpy(seq), torch.from_numpy(query), workspace, 64 * MB,
        request_offset=3)
    assert as_tensors == chunks


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.integers(-5, 200000)))
def test_supertile_is_rounded_up_to_whole_tiles(raw):
    import vllm.envs as envs

    with pytest.MonkeyPatch.context() as mp:
        if raw is None:
            mp.delenv("B12X_PAGED_INDEX_SUPERTILE_K", raising=False)
        else:
            mp.setenv("B12X_PAGED_INDEX_SUPERTILE_K", str(raw))
        tokens = b12x_indexer.supertile_k()
        wanted = envs.B12X_PAGED_INDEX_SUPERTILE_K
    assert tokens % 512 == 0
    assert tokens >= max(wanted, 512)
    assert tokens - max(wanted, 512) < 512
    if raw is None:
        assert tokens == 32768


@settings(max_examples=200, deadline=None)
@given(prefill_batches, st.sampled_from([8, 64, 512]), st.integers(0, 5))
def test_b12x_chunks_one_request_each_within_the_supertile_budget(batch, logits_mb, offset):
    query = np.array([q for q, _ in batch], dtype=np.int32)
    chunks = b12x_indexer.split_prefill_chunks_by_supertile(
        query, offset, 10**9, logits_mb * MB, indexer.split_indexer_prefill_chunks)
    assert all(r.stop - r.start == 1 for r, _ in chunks)
    assert B.chunk_covers_every_row_once(chunks, query, offset)
    max_rows = max(1, logits_mb * MB // 4 // b12x_indexer.supertile_k())
    assert all(c.stop - c.start <= max_rows for _, c in chunks)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([2, 4]), st.sampled_from([1, 8, 64]),
       st.lists(st.integers(0, 4096), min_size=1, max_size=32))
def test_dcp_local_lens_match_the_dealing_reference(world, interleave, seq_lens):
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    layout = B.DcpLayout(world, interleave, 4097)
    lens = np.array(seq_lens, dtype=np.int32)
    for rank in range(world):
        want = [layout.local_len(s, rank) for s in seq_lens]
        assert indexer.dcp_local_lens(lens, world, rank, interleave).tolist() == want
        as_tensor = indexer.dcp_local_lens(torch.from_numpy(lens), world, rank, interleave)
        assert as_tensor.tolist() == want
        assert get_dcp_local_seq_lens(
            torch.from_numpy(lens), world, rank, interleave).tolist() == want
    # The ranks together hold every position once.
    totals = sum(indexer.dcp_local_lens(lens, world, r, interleave) for r in range(world))
    assert totals.tolist() == seq_lens


def test_a_split_mismatch_names_the_counts_and_first_lengths():
    from types import SimpleNamespace

    from vllm.v1.attention.backend import CommonAttentionMetadata

    query_lens = [1, 1, 300, 2]
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    seq = torch.tensor([700, 12, 300, 4000], dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl), query_start_loc_cpu=torch.from_numpy(qsl),
        seq_lens=seq, num_reqs=4, num_actual_tokens=304, max_query_len=300, max_seq_len=4000,
        block_table_tensor=torch.zeros((4, 1), dtype=torch.int32),
        slot_mapping=torch.zeros((304,), dtype=torch.int64), _seq_lens_cpu=seq)
    builder = SimpleNamespace(reorder_batch_threshold=1, use_flattening=False)
    with pytest.raises(RuntimeError) as raised:
        indexer.DeepseekV32IndexerMetadataBuilder._raise_split_mismatch(
            builder, cm, query_start_loc_np=qsl, counts=(2, 1, 2, 300))
    message = str(raised.value)
    assert "2 decodes + 1 prefills for 4 requests" in message
    assert "2 + 300 tokens for 304" in message
    assert "first query lens [1, 1, 300, 2]" in message
    assert "first seq lens [700, 12, 300, 4000]" in message


# Query lengths as the runner orders them (decodes, then extends and prefills) and
# shuffled, with 0-length padding rows; max_query_len as the runner reports it or any
# other value, since vLLM's split trusts it for its early return.
split_batches = st.tuples(
    st.lists(st.integers(0, 9), min_size=1, max_size=40),
    st.lists(st.integers(0, 3000), max_size=8),
    st.booleans(),
    st.integers(1, 9),
    st.booleans(),
    st.integers(-2, 2),
)


@settings(max_examples=2000, deadline=None)
@given(split_batches)
def test_the_numpy_split_equals_vllms(batch):
    from types import SimpleNamespace

    from vllm.v1.attention.backends.utils import split_decodes_and_prefills

    short, long, shuffle, threshold, require_uniform, max_query_len_offset = batch
    query_lens = short + long
    if shuffle:
        query_lens = list(reversed(query_lens))
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    max_query_len = max(query_lens) + max_query_len_offset
    cm = SimpleNamespace(
        max_query_len=max_query_len, num_reqs=len(query_lens),
        num_actual_tokens=int(qsl[-1]), query_start_loc_cpu=torch.from_numpy(qsl))
    want = split_decodes_and_prefills(
        cm, decode_threshold=threshold, require_uniform=require_uniform)
    got = indexer.split_decodes_and_prefills_host(
        qsl, len(query_lens), int(qsl[-1]), max_query_len,
        decode_threshold=threshold, require_uniform=require_uniform)
    assert got == want
    assert all(type(count) is int for count in got)
