"""The vLLM 0.33.0 overlay's indexer modules against the real vLLM 0.33.0, on the CPU.

These import vLLM, so they run where vLLM 0.33.0 with its overlay is installed: the image's
`test` stage of that base (`docker buildx bake test-vllm0_33_0`). Elsewhere they skip. b12x's
own kernels need an sm_120/121 GPU; here they are replaced by fakes that record the calls.
"""

import importlib.metadata
import re
import sys
import types

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("vllm", reason="vLLM 0.33.0 + overlay not installed: runs in the image's test stage")
if importlib.metadata.version("vllm") != "0.33.0":
    pytest.skip(f"vLLM {importlib.metadata.version('vllm')} is installed: these test the 0.33.0 overlay",
                allow_module_level=True)
torch = pytest.importorskip("torch")

from vllm.v1.attention.backends.mla import b12x_indexer  # noqa: E402
from vllm.v1.attention.backends.mla import indexer  # noqa: E402

from dsa_image.validation import batches as B  # noqa: E402
from indexer_overlay_helpers import FakePlatform  # noqa: E402

MB = 1024 * 1024
SWITCH = "VLLM_USE_B12X_SPARSE_INDEXER"
SUPERTILE = "B12X_DSA_TOPK_SUPERTILE_K"


def test_overlaid_modules_are_the_overlay():
    from vllm.model_executor.layers import sparse_attn_indexer

    assert "b12x_indexer" in vars(sparse_attn_indexer)
    assert "use_b12x" in indexer.DeepseekV32IndexerMetadata.__dataclass_fields__


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), (" TRUE ", True), ("0", False),
                                       ("false", False), ("", False), (None, False)])
def test_the_switch_reads_the_environment(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(SWITCH, raising=False)
    else:
        monkeypatch.setenv(SWITCH, value)
    assert b12x_indexer.enabled() is on
    assert b12x_indexer.kernel_family() == ("b12x" if on else "deepgemm")


@pytest.mark.parametrize("name, value, words", [
    (SWITCH, "yes please", f"{SWITCH}='yes please' is not a valid value"),
    (SWITCH, "2", "use 1 (b12x indexer kernels"),
    (SUPERTILE, "32k", f"{SUPERTILE}='32k' is not a valid value"),
    (SUPERTILE, "0", "use a positive number of keys"),
    (SUPERTILE, "-512", "use a positive number of keys"),
])
def test_a_bad_value_fails_naming_the_variable_and_the_accepted_values(monkeypatch, name, value, words):
    monkeypatch.setenv(name, value)
    read = b12x_indexer.enabled if name == SWITCH else b12x_indexer.supertile_k
    with pytest.raises(ValueError, match=re.escape(words)):
        read()


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.integers(1, 200000)))
def test_supertile_is_rounded_up_to_whole_tiles(raw):
    with pytest.MonkeyPatch.context() as mp:
        if raw is None:
            mp.delenv(SUPERTILE, raising=False)
        else:
            mp.setenv(SUPERTILE, str(raw))
        tokens = b12x_indexer.supertile_k()
    wanted = 32768 if raw is None else raw
    assert tokens % 512 == 0 and 0 <= tokens - wanted < 512


def test_b12x_prefill_buffers_per_row_and_the_budget():
    per_row = b12x_indexer.prefill_row_bytes(32768, 2048)
    assert per_row == 4 * 32768 + 2048 * (2 * 8 + 4) + 4
    rows = b12x_indexer.prefill_rows_per_chunk(32768, 2048, 512 * MB)
    assert rows == 3104 and rows * per_row <= 512 * MB


prefill_batches = st.lists(
    st.tuples(st.integers(1, 3000), st.integers(0, 20000)), min_size=1, max_size=24)


@settings(max_examples=200, deadline=None)
@given(prefill_batches, st.sampled_from([8, 64, 512]), st.integers(0, 5), st.sampled_from([512, 2048]))
def test_b12x_chunks_one_request_each_within_the_supertile_budget(batch, logits_mb, offset, topk):
    query = torch.tensor([q for q, _ in batch], dtype=torch.int32)  # 0.33.0 hands CPU tensors
    chunks = b12x_indexer.split_prefill_chunks_by_supertile(query, offset, topk, logits_mb * MB)
    assert all(r.stop - r.start == 1 for r, _ in chunks)
    assert B.chunk_covers_every_row_once(chunks, query.numpy(), offset)
    max_rows = b12x_indexer.prefill_rows_per_chunk(b12x_indexer.supertile_k(), topk, logits_mb * MB)
    assert all(c.stop - c.start <= max_rows for _, c in chunks)


@pytest.fixture
def on_gpu(monkeypatch):
    def use(capability):
        monkeypatch.setattr(b12x_indexer, "current_platform", FakePlatform(capability))
        for name in b12x_indexer.IGNORED_VARIABLES:
            monkeypatch.delenv(name, raising=False)

    return use


@pytest.mark.parametrize("capability, words", [
    ((9, 0), "this GPU is compute capability 9.0"),
    ((10, 0), "this GPU is compute capability 10.0"),
    (None, "this platform is not CUDA"),
])
def test_b12x_is_refused_at_start_up_without_an_sm12x_gpu(on_gpu, capability, words):
    on_gpu(capability)
    with pytest.raises(RuntimeError, match=re.escape(words)):
        b12x_indexer.require_supported(2048, False, 1)


@pytest.mark.parametrize("args, words", [
    ((1000, False, 1), "this model's index_topk is 1000"),
    ((2048, True, 1), "indexer_kv_dtype='mxfp4'"),
    ((2048, False, 4), "compress_ratio=4"),
])
def test_what_b12x_cannot_serve_is_refused_at_start_up(on_gpu, args, words):
    on_gpu((12, 0))
    with pytest.raises(RuntimeError, match=re.escape(words)):
        b12x_indexer.require_supported(*args)


@pytest.mark.parametrize("name", ["B12X_PAGED_INDEX_SUPERTILE_K", "B12X_NSA_TOPK_SUPERTILE_K"])
def test_supertile_variables_b12x_1_5_ignores_are_refused_naming_its_own(on_gpu, monkeypatch, name):
    on_gpu((12, 1))
    monkeypatch.setenv(name, "16384")
    with pytest.raises(RuntimeError, match=f"{name} is set.*reads {SUPERTILE}"):
        b12x_indexer.require_supported(2048, False, 1)


@pytest.mark.parametrize("version, supported", [
    ("1.5.1", True), ("1.5.9.post1", True), ("1.4.2", False), ("1.6.0", False), ("0.30.2", False), ("weird", False)])
def test_b12x_releases_with_the_api_called_here(version, supported):
    assert b12x_indexer._supported_release(version) is supported


def test_a_missing_b12x_is_refused_with_what_to_do(on_gpu, monkeypatch):
    on_gpu((12, 0))
    monkeypatch.setitem(sys.modules, "b12x", None)
    with pytest.raises(RuntimeError, match="b12x cannot be imported"):
        b12x_indexer.require_supported(2048, False, 1)


def test_the_model_constructor_refuses_before_anything_is_allocated(monkeypatch):
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    monkeypatch.setenv(SWITCH, "1")
    with pytest.raises(RuntimeError, match=f"{SWITCH}=1 needs"):
        SparseAttnIndexer(None, 128, "ue8m0", 2048, 128, 8192, 8192 * 40, torch.empty(0))


def fake_b12x(monkeypatch, **functions) -> None:
    module = types.ModuleType("b12x.attention.dsa_indexer._impl")
    for name in ("IndexerContiguousMetadata", "IndexerPagedDecodeMetadata", "contiguous_tiled_topk",
                 "paged_decode_logits", "build_paged_mqa_schedule_metadata", "uses_paged_mqa_schedule"):
        setattr(module, name, functions.get(name, lambda *a, **k: dict(k)))
    monkeypatch.setitem(sys.modules, "b12x.attention.dsa_indexer._impl", module)


def test_prefill_topk_writes_positions_inside_each_rows_context(monkeypatch):
    calls = {}

    def contiguous_tiled_topk(*, q_fp8, weights, kv_fp8, metadata, topk, supertile_k, output_indices):
        calls.update(supertile_k=supertile_k, wrote_into_out=output_indices is not None)
        absolute = torch.tensor([[7, 5, -1, -1], [12, 10, 11, -1]], dtype=torch.int32)
        if output_indices is None:
            return absolute
        output_indices.copy_(absolute)
        return output_indices

    fake_b12x(monkeypatch, contiguous_tiled_topk=contiguous_tiled_topk)
    monkeypatch.setattr(b12x_indexer, "prefill_contract_problems", lambda *a: [])
    ks = torch.tensor([5, 10], dtype=torch.int32)
    for out in (torch.full((2, 4), 99, dtype=torch.int32), torch.full((2, 8), 99, dtype=torch.int32)[:, :4]):
        b12x_indexer.prefill_topk(None, None, None, None, ks, ks + 3, 4, out)
        assert out.tolist() == [[2, 0, -1, -1], [2, 0, 1, -1]]
        assert calls == {"supertile_k": b12x_indexer.supertile_k(), "wrote_into_out": out.is_contiguous()}


def test_decode_scores_the_paged_cache_with_b12xs_own_active_width(monkeypatch):
    fake_b12x(monkeypatch)
    cache = torch.zeros((3, 64, 132), dtype=torch.uint8)
    table = torch.zeros((2, 3), dtype=torch.int32)
    lens = torch.tensor([[70], [5]], dtype=torch.int32)
    call = b12x_indexer.decode_logits("q", "w", cache, table, lens, None)
    assert call["page_size"] == 64 and call["index_k_cache"].shape == (3, 64 * 132)
    assert "active_width_override" not in call  # b12x bounds the window on the device
    assert call["metadata"]["cache_seqlens_int32"].tolist() == [70, 5]


def test_the_b12x_path_never_asks_vllms_workspace_for_memory():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(b12x_indexer))
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {a.attr for a in ast.walk(tree) if isinstance(a, ast.Attribute)}
    assert "current_workspace_manager" not in names and "get_simultaneous" not in names


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([2, 4]), st.sampled_from([1, 8, 64]),
       st.lists(st.integers(0, 4096), min_size=1, max_size=16), st.data())
def test_a_dcp_prefill_chunk_takes_its_rank_totals_from_the_host(world, interleave, lens, data):
    """The rank-local totals of a DCP prefill chunk are what stock vLLM 0.33.0 reads back from
    the GPU (local_cu_seq_lens[-1] and the largest rank's sum), computed from the host lengths."""
    from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

    rank = data.draw(st.integers(0, world - 1))
    seq = torch.tensor(lens, dtype=torch.int32)
    query = torch.ones(len(lens), dtype=torch.int32)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(query, 0, dtype=torch.int32)])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(indexer, "_BUILD_PREFILL_CHUNK_METADATA_KERNEL", lambda *a, **k: None)  # a GPU kernel
        chunk = indexer.build_prefill_chunk_metadata(
            0, len(lens), qsl, qsl, seq, seq, seq, torch.zeros((len(lens), 1), dtype=torch.int32), 1,
            dcp_rank=rank, dcp_world_size=world, cp_kv_cache_interleave_size=interleave)
    if chunk is None:
        assert sum(lens) == 0
        return
    per_rank = get_dcp_local_seq_lens(seq, world, None, interleave)
    assert chunk.local_total_seq_lens == int(chunk.local_cu_seq_lens[-1]) == int(per_rank[:, rank].sum())
    assert chunk.max_local_total_seq_lens == int(per_rank.sum(dim=0).max())


def test_the_indexer_layer_registers_the_metadata_kernels_for_warmup():
    """Measured on an H200 (docs/validation/h200-2026-11-30-vllm0_33_0): with sm_90's
    FLASH_ATTN_MLA_SPARSE, stock 0.33.0 never registers BuildPrefillChunkMetadataKernel and the
    first prefill compiles it. Built under a warm-up registry, as both model runners build the
    model, the overlay's indexer layer registers the builder's kernels (compile-only keys)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    assert config.kernel_config.enable_jit_warmup  # vLLM's default
    registry = JitWarmupRegistry(config)
    with set_current_vllm_config(config), registry.activate():
        for _ in range(2):  # one per indexer layer: registered once
            SparseAttnIndexer(None, 128, "ue8m0", 2048, 128, 8192, 8192,
                              torch.empty(1, 2048, dtype=torch.int32))
    registered = {type(kernel).__name__: calls for kernel, calls in registry._registrations.items()}
    assert registered["BuildPrefillChunkMetadataKernel"] == [((), {})]
    assert registered["PrepareUniformDecodeKernel"] == [((), {})]


def test_a_builder_made_without_init_refreshes_draft_metadata_as_stock_does(monkeypatch):
    """vLLM's own tests (tests/v1/attention/test_indexer_deepseek_v4_slot_mapping.py, the
    draft-decode refresh tests) make the builder with object.__new__, set the few attributes
    stock's update_draft_decode_metadata reads, and call it. On the H200 the overlay failed them
    (AttributeError: use_b12x, which only the overlay's __init__ set): the b12x decision has a
    class-level default, the DeepGEMM builder such a builder was. Their construction, on the CPU
    (compress_ratio 1: no Triton kernel; no DeepGEMM, as their refresh test has)."""
    monkeypatch.setattr(indexer, "has_deep_gemm", lambda: False)
    num_reqs, width = 3, 8
    builder = object.__new__(indexer.DeepseekV32IndexerMetadataBuilder)
    builder.dcp_world_size = 1
    builder.compress_ratio = 1
    builder.arange_buffer = torch.arange(num_reqs + 1, dtype=torch.int32)
    builder.kv_cache_spec = types.SimpleNamespace(block_size=64, num_states=64)

    def stale(*shape):
        return torch.full(shape, -7, dtype=torch.int32)

    decode = indexer.DeepSeekV32IndexerDecodeMetadata(
        block_table=stale(num_reqs, width), seq_lens=stale(num_reqs, 1), decode_lens=stale(num_reqs),
        requires_padding=False, schedule_metadata=stale(1), indices=stale(num_reqs),
        per_req_decode_lens=stale(num_reqs))
    request_block_table = torch.randint(0, 1000, (num_reqs, width), dtype=torch.int32)
    seq_lens = torch.tensor([17, 33, 65], dtype=torch.int32)
    metadata = indexer.DeepseekV32IndexerMetadata(
        seq_lens=seq_lens, max_seq_len=128, slot_mapping=torch.zeros(num_reqs, dtype=torch.int64),
        num_decodes=num_reqs, num_decode_tokens=num_reqs, num_prefills=0, num_prefill_tokens=0,
        decode=decode, block_table=request_block_table)

    builder.update_draft_decode_metadata(metadata)

    assert builder.use_b12x is False
    torch.testing.assert_close(decode.block_table, request_block_table)
    torch.testing.assert_close(decode.indices, builder.arange_buffer[:num_reqs])
    assert torch.all(decode.per_req_decode_lens == 1) and torch.all(decode.decode_lens == 1)
    torch.testing.assert_close(decode.seq_lens.flatten(), seq_lens)
    assert torch.all(decode.schedule_metadata == -7)  # neither DeepGEMM nor b12x rewrote it
