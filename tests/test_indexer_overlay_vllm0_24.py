"""The vLLM 0.24.0 overlay's indexer modules against the real vLLM 0.24.0, on the CPU.

These import vLLM, so they run where vLLM 0.24.0 with its overlay is installed: the image's
`test` stage of that base (`docker buildx bake test-vllm0_24_0`). Elsewhere they skip. The GPU
half (metadata equivalence with stock, syncs, serving) is the GPU session (scripts/gpu_validation.py).
"""

import importlib.metadata
import re
import sys
import types

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip(
    "vllm", reason="vLLM 0.24.0 + overlay not installed: runs in the image's test stage")
if importlib.metadata.version("vllm") != "0.24.0":
    pytest.skip(f"vLLM {importlib.metadata.version('vllm')} is installed: these test the 0.24.0 overlay",
                allow_module_level=True)
torch = pytest.importorskip("torch")

from vllm.v1.attention.backends.mla import b12x_indexer  # noqa: E402
from vllm.v1.attention.backends.mla import indexer  # noqa: E402

from dsa_image.validation import batches as B  # noqa: E402
from indexer_overlay_helpers import FakePlatform  # noqa: E402

MB = 1024 * 1024


def test_overlaid_modules_are_the_overlay():
    import vllm.envs as envs
    from vllm.model_executor.layers import sparse_attn_indexer

    assert envs.VLLM_USE_B12X_SPARSE_INDEXER is False
    assert envs.B12X_NSA_TOPK_SUPERTILE_K == 32768
    assert "b12x_indexer" in vars(sparse_attn_indexer)
    assert hasattr(indexer, "split_decodes_and_prefills_host")
    assert "use_b12x" in indexer.DeepseekV32IndexerMetadata.__dataclass_fields__


def test_the_switch_reads_the_environment(monkeypatch):
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_USE_B12X_SPARSE_INDEXER", "1")
    assert envs.VLLM_USE_B12X_SPARSE_INDEXER is True
    assert b12x_indexer.kernel_family() == "b12x"


def test_b12x_is_refused_at_start_up_without_an_sm12x_gpu():
    with pytest.raises(RuntimeError, match="VLLM_USE_B12X_SPARSE_INDEXER=1 needs"):
        b12x_indexer.require_supported(2048, use_fp4_indexer_cache=False)


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
@given(st.one_of(st.none(), st.integers(1, 200000)))
def test_supertile_is_rounded_up_to_whole_tiles(raw):
    import vllm.envs as envs

    with pytest.MonkeyPatch.context() as mp:
        if raw is None:
            mp.delenv("B12X_NSA_TOPK_SUPERTILE_K", raising=False)
        else:
            mp.setenv("B12X_NSA_TOPK_SUPERTILE_K", str(raw))
        tokens = b12x_indexer.supertile_k()
        wanted = envs.B12X_NSA_TOPK_SUPERTILE_K
    assert tokens % 512 == 0
    assert tokens >= wanted
    assert tokens - wanted < 512
    if raw is None:
        assert tokens == 32768


@pytest.mark.parametrize("name, value, words", [
    ("VLLM_USE_B12X_SPARSE_INDEXER", "yes please",
     "VLLM_USE_B12X_SPARSE_INDEXER='yes please' is not a valid value"),
    ("VLLM_USE_B12X_SPARSE_INDEXER", "2", "use 1 (b12x indexer kernels"),
    ("B12X_NSA_TOPK_SUPERTILE_K", "32k", "B12X_NSA_TOPK_SUPERTILE_K='32k' is not a valid value"),
    ("B12X_NSA_TOPK_SUPERTILE_K", "0", "use a positive number of keys"),
    ("B12X_NSA_TOPK_SUPERTILE_K", "-512", "use a positive number of keys"),
])
def test_a_bad_value_fails_naming_the_variable_and_the_accepted_values(monkeypatch, name, value, words):
    import vllm.envs as envs

    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(words)):
        getattr(envs, name)


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), (" TRUE ", True), ("0", False),
                                       ("false", False), ("", False)])
def test_the_switch_accepts_0_1_true_false(monkeypatch, value, on):
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_USE_B12X_SPARSE_INDEXER", value)
    assert envs.VLLM_USE_B12X_SPARSE_INDEXER is on


def test_b12x_prefill_buffers_per_row_and_the_issues_numbers():
    # 4,096 rows at topk 2048 used to hold ~270 MB above the profiled peak; now the rows are
    # cut so that b12x's buffers fit the logits budget vLLM's profiling run reserves.
    per_row = b12x_indexer.prefill_row_bytes(32768, 2048)
    assert per_row == 4 * 32768 + 2048 * (2 * 8 + 4) + 4
    rows = b12x_indexer.prefill_rows_per_chunk(32768, 2048, 512 * MB)
    assert rows == 3104 and rows * per_row <= 512 * MB < 4096 * per_row


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 512).map(lambda t: t * 512), st.sampled_from([512, 1024, 2048]),
       st.integers(1, 4096).map(lambda mb: mb * MB // 4))
def test_b12x_prefill_buffers_fit_the_budget_in_whole_query_tiles(supertile, topk, budget):
    rows = b12x_indexer.prefill_rows_per_chunk(supertile, topk, budget)
    per_row = b12x_indexer.prefill_row_bytes(supertile, topk)
    if budget >= 32 * per_row:
        assert rows % 32 == 0 and rows * per_row <= budget < (rows + 32) * per_row
    else:
        assert rows == max(1, budget // per_row)


@settings(max_examples=200, deadline=None)
@given(prefill_batches, st.sampled_from([8, 64, 512]), st.integers(0, 5), st.sampled_from([512, 2048]))
def test_b12x_chunks_one_request_each_within_the_supertile_budget(batch, logits_mb, offset, topk):
    query = np.array([q for q, _ in batch], dtype=np.int32)
    chunks = b12x_indexer.split_prefill_chunks_by_supertile(query, offset, topk, logits_mb * MB)
    assert all(r.stop - r.start == 1 for r, _ in chunks)
    assert B.chunk_covers_every_row_once(chunks, query, offset)
    max_rows = b12x_indexer.prefill_rows_per_chunk(b12x_indexer.supertile_k(), topk, logits_mb * MB)
    assert all(c.stop - c.start <= max_rows for _, c in chunks)


def test_b12x_decode_flattens_every_mtp_step():
    assert not b12x_indexer.decode_flattens(1)
    assert all(b12x_indexer.decode_flattens(n) for n in (2, 3, 4))


@pytest.fixture
def on_gpu(monkeypatch):
    def use(capability):
        monkeypatch.setattr(b12x_indexer, "current_platform", FakePlatform(capability))
        monkeypatch.delenv("B12X_PAGED_INDEX_SUPERTILE_K", raising=False)

    return use


@pytest.mark.parametrize("capability, words", [
    ((9, 0), "this GPU is compute capability 9.0"),
    ((10, 0), "this GPU is compute capability 10.0"),
    (None, "this platform is not CUDA"),
])
def test_b12x_is_refused_off_sm12x(on_gpu, capability, words):
    on_gpu(capability)
    with pytest.raises(RuntimeError, match=re.escape(words)):
        b12x_indexer.require_supported(2048, False)


@pytest.mark.parametrize("topk", [None, 256, 1000, 4096])
def test_an_unsupported_topk_is_refused_at_start_up(on_gpu, topk):
    on_gpu((12, 0))
    with pytest.raises(RuntimeError, match=f"this model's index_topk is {topk}"):
        b12x_indexer.require_supported(topk, False)


def test_the_paged_paths_supertile_variable_is_refused_naming_its_replacement(on_gpu, monkeypatch):
    on_gpu((12, 1))
    monkeypatch.setenv("B12X_PAGED_INDEX_SUPERTILE_K", "16384")
    with pytest.raises(RuntimeError, match="reads B12X_NSA_TOPK_SUPERTILE_K"):
        b12x_indexer.require_supported(2048, False)


@pytest.mark.parametrize("version, supported", [
    ("0.30.2", True), ("0.20.0", True), ("0.30.9.post1", True), ("0.19.4", False), ("0.31.0", False),
    ("1.3.0", False), ("weird", False)])
def test_b12x_releases_with_the_api_called_here(version, supported):
    assert b12x_indexer._supported_release(version) is supported


def test_a_missing_b12x_is_refused_with_what_to_do(on_gpu, monkeypatch):
    on_gpu((12, 0))
    monkeypatch.setitem(sys.modules, "b12x", None)
    with pytest.raises(RuntimeError, match="b12x cannot be imported"):
        b12x_indexer.require_supported(2048, False)


def test_an_unsupported_b12x_release_is_refused(on_gpu, monkeypatch):
    on_gpu((12, 0))
    for name in ("b12x", "b12x.attention", "b12x.attention.indexer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["b12x"].attention = sys.modules["b12x.attention"]
    sys.modules["b12x.attention"].indexer = sys.modules["b12x.attention.indexer"]
    monkeypatch.setattr(b12x_indexer.importlib.metadata, "version", lambda name: "1.3.0")
    with pytest.raises(RuntimeError, match="b12x 1.3.0 is installed"):
        b12x_indexer.require_supported(2048, False)


def test_the_model_constructor_refuses_before_anything_is_allocated(monkeypatch):
    # SparseAttnIndexer is built with the model: the first point where the switch and the
    # model's top-k are both known.
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    monkeypatch.setenv("VLLM_USE_B12X_SPARSE_INDEXER", "1")
    with pytest.raises(RuntimeError, match="VLLM_USE_B12X_SPARSE_INDEXER=1 needs"):
        SparseAttnIndexer(None, 128, "ue8m0", 2048, 128, 8192, 8192 * 40, torch.empty(0))


def prefill_tensors(**changes):
    fp8 = torch.float8_e4m3fn
    tensors = dict(q=torch.zeros((4, 64, 128), dtype=fp8), weights=torch.zeros((4, 64)),
                   k=torch.zeros((9, 128), dtype=fp8), scale=torch.zeros(9),
                   ks=torch.zeros(4, dtype=torch.int32), ke=torch.ones(4, dtype=torch.int32),
                   out=torch.zeros((4, 2048), dtype=torch.int32))
    tensors.update(changes)
    return tuple(tensors.values())


@pytest.mark.parametrize("changes, problem", [
    ({}, None),
    (dict(weights=torch.zeros((4, 64), dtype=torch.bfloat16)), None),
    (dict(weights=torch.zeros((4, 64), dtype=torch.int32)), "weights must be (rows, heads) floating point"),
    (dict(weights=torch.zeros((4, 32))), "weights must be (rows, heads) floating point"),
    (dict(ks=torch.zeros(4, dtype=torch.int64)), "ks/ke must be rank-1 int32 of one length"),
    (dict(q=torch.zeros((4, 80, 128), dtype=torch.float8_e4m3fn), weights=torch.zeros((4, 80))),
     "more than 64 heads"),
    (dict(scale=torch.zeros(8)), "key scales must be (n,) float32"),
    (dict(out=torch.zeros((4, 2048), dtype=torch.int64)), "out must be (rows, topk) int32"),
])
def test_the_prefill_contract_names_each_breach(changes, problem):
    problems = b12x_indexer.prefill_contract_problems(*prefill_tensors(**changes))
    # On the CPU every call breaches the device rule; nothing else unless changed.
    assert "all tensors must be on one CUDA device" in problems
    assert [p for p in problems if "CUDA" not in p] == ([problem] if problem else [])


def test_prefill_topk_writes_positions_inside_each_rows_context(monkeypatch):
    """The overlay's conversion of b12x's absolute key rows, around a fake b12x."""
    calls = {}

    def contiguous_tiled_topk(*, q_fp8, weights, kv_fp8, metadata, topk, supertile_k, output_indices):
        calls.update(supertile_k=supertile_k, wrote_into_out=output_indices is not None)
        absolute = torch.tensor([[7, 5, -1, -1], [12, 10, 11, -1]], dtype=torch.int32)
        if output_indices is None:
            return absolute
        output_indices.copy_(absolute)
        return output_indices

    fake = types.ModuleType("b12x.attention.indexer")
    fake.contiguous_tiled_topk = contiguous_tiled_topk
    fake.IndexerContiguousMetadata = lambda k_start, k_end: None
    monkeypatch.setitem(sys.modules, "b12x.attention.indexer", fake)
    monkeypatch.setattr(b12x_indexer, "prefill_contract_problems", lambda *a: [])
    ks = torch.tensor([5, 10], dtype=torch.int32)
    for out in (torch.full((2, 4), 99, dtype=torch.int32), torch.full((2, 8), 99, dtype=torch.int32)[:, :4]):
        b12x_indexer.prefill_topk(None, None, None, None, ks, ks + 3, 4, out)
        assert out.tolist() == [[2, 0, -1, -1], [2, 0, 1, -1]]
        assert calls == {"supertile_k": b12x_indexer.supertile_k(), "wrote_into_out": out.is_contiguous()}


def test_prefill_topk_refuses_inputs_b12x_would_score_in_python(monkeypatch):
    fake = types.ModuleType("b12x.attention.indexer")
    fake.contiguous_tiled_topk = fake.IndexerContiguousMetadata = None
    monkeypatch.setitem(sys.modules, "b12x.attention.indexer", fake)
    with pytest.raises(RuntimeError, match="outside b12x's kernel contract: .*key scales must be"):
        b12x_indexer.prefill_topk(*prefill_tensors(scale=torch.zeros(9, dtype=torch.bfloat16))[:6],
                                  2048, prefill_tensors()[6])


def test_the_paged_cache_view_keeps_a_padded_block_stride():
    backing = torch.arange(5 * 9000, dtype=torch.int64).to(torch.uint8).view(5, 9000)
    cache = torch.as_strided(backing, (5, 64, 132), (9000, 132, 1))
    pages = b12x_indexer.paged_cache_pages(cache)
    assert pages.shape == (5, 64 * 132) and pages.stride() == (9000, 1)
    assert torch.equal(pages[3], backing[3, : 64 * 132])
    with pytest.raises(RuntimeError, match="one run of bytes"):
        b12x_indexer.paged_cache_pages(torch.zeros((5, 132, 64), dtype=torch.uint8).transpose(1, 2))


def test_the_b12x_path_never_asks_vllms_workspace_for_memory():
    # "Workspace is locked" is vLLM's WorkspaceManager refusing to grow after its profiling
    # run's reservation was locked. This module allocates through torch only; the dispatch
    # asks the workspace for what the DeepGEMM path asks (the K gather, the radix top-k).
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(b12x_indexer))
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {a.attr for a in ast.walk(tree) if isinstance(a, ast.Attribute)}
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "current_workspace_manager" not in names and "get_simultaneous" not in names
    assert not any("workspace" in (m or "") for m in modules)


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
    # The counts cover the batch by construction, so build() needs no check of them.
    assert got[0] + got[1] == len(query_lens) and got[2] + got[3] == int(qsl[-1])
