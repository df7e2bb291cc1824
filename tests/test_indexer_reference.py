"""The indexer math reference (dsa_image/runtime/indexer_reference.py) on the CPU.

Needs torch: runs in the image's test stage and wherever torch is installed; skips elsewhere."""

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dsa_image.runtime import indexer_reference as ref


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def inputs(rows=5, heads=4, keys=300, seed=0):
    g = gen(seed)
    return (ref.random_fp8((rows, heads, 128), g), ref.random_weights(rows, heads, g),
            ref.random_fp8((keys, 128), g), ref.random_scales(keys, g))


def float32_formula(q, w, k, scale):
    return (torch.relu(torch.einsum("rhd,nd->rhn", q.float(), k.float())) * w[:, :, None]).sum(1) * scale


def test_logits_are_the_relu_weighted_sum_over_heads():
    q, w, k, scale = inputs()
    got = ref.relu_weighted_logits(q, w, k, scale)
    want = float32_formula(q, w, k, scale)
    assert got.dtype == torch.float32 and got.shape == (5, 300)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def test_relu_is_per_head_not_on_the_sum():
    q, w, k, scale = inputs()
    no_relu = (torch.einsum("rhd,nd->rhn", q.float(), k.float()) * w[:, :, None]).sum(1) * scale
    assert not torch.allclose(ref.relu_weighted_logits(q, w, k, scale), no_relu, rtol=1e-3)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.integers(64, 4096), st.integers(0, 10**6))
def test_logits_do_not_depend_on_how_rows_are_blocked(rows, block, seed):
    q, w, k, scale = inputs(rows=rows, keys=97, seed=seed)
    whole = ref.relu_weighted_logits(q, w, k, scale)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ref, "BLOCK_ELEMENTS", block)
        assert torch.equal(ref.relu_weighted_logits(q, w, k, scale), whole)
    one_by_one = torch.cat([ref.relu_weighted_logits(q[i:i + 1], w[i:i + 1], k, scale) for i in range(rows)])
    assert torch.equal(one_by_one, whole)
    per_row_keys = ref.relu_weighted_logits(q, w, k.expand(rows, -1, -1), scale.expand(rows, -1))
    assert torch.equal(per_row_keys, whole)


def test_fp8_dot_products_are_exact_in_float64():
    # The largest e4m3 values: 128 * 448^2 = 25,690,112 must come out exactly.
    q = torch.full((1, 1, 128), 448.0).to(ref.FP8)
    k = torch.full((1, 128), 448.0).to(ref.FP8)
    got = ref.relu_weighted_logits(q, torch.ones(1, 1), k, torch.ones(1))
    assert float(got) == 128 * 448.0 ** 2


def test_topk_prefers_larger_then_lower_position_and_never_picks_minus_inf():
    logits = torch.tensor([[1.0, 3.0, 3.0, float("-inf"), 2.0, 3.0]])
    assert ref.topk_positions(logits, 4).tolist() == [[1, 2, 5, 4]]
    assert ref.topk_positions(logits, 8).tolist() == [[1, 2, 5, 4, 0, -1, -1, -1]]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 300), st.integers(1, 64), st.integers(1, 90), st.integers(0, 10**6))
def test_folding_chunks_gives_the_global_topk(rows, keys, k, chunk, seed):
    # Few distinct values: ties everywhere, where only the tie rule makes the fold exact.
    g = gen(seed)
    logits = torch.randint(0, 5, (rows, keys), generator=g).float()
    logits[torch.rand((rows, keys), generator=g) < 0.2] = float("-inf")
    carry_v, carry_i = torch.empty((rows, 0)), torch.empty((rows, 0), dtype=torch.int32)
    for start in range(0, keys, chunk):
        positions = torch.arange(start, min(start + chunk, keys), dtype=torch.int32).expand(rows, -1)
        carry_v, carry_i = ref.select_topk(torch.cat([carry_v, logits[:, start:start + chunk]], 1),
                                           torch.cat([carry_i, positions], 1), k)
    assert torch.equal(carry_i, ref.topk_positions(logits, k))


def test_the_cache_page_is_values_then_scales():
    g = gen()
    cache = ref.random_cache(3, 64, g)
    pages = ref.cache_pages(cache)
    values, scales = ref.split_pages(pages, 64)
    raw = cache.view(3, 64 * 132)
    assert torch.equal(values[2, 5].view(torch.uint8), raw[2, 5 * 128: 6 * 128])
    assert torch.equal(scales[2, 5].reshape(1).view(torch.uint8), raw[2, 64 * 128 + 20: 64 * 128 + 24])
    assert bool((scales > 0).all()) and not bool(values.float().isnan().any())


def test_a_padded_cache_reads_like_a_packed_one():
    # vLLM pads pages to the largest page size of a model's KV cache specs: a strided view.
    g = gen(1)
    packed = ref.random_cache(6, 64, g)
    backing = torch.zeros((6, 64 * 132 + 512), dtype=torch.uint8)
    backing[:, : 64 * 132] = packed.view(6, -1)
    padded = torch.as_strided(backing, (6, 64, 132), (backing.stride(0), 132, 1))
    q, w = ref.random_fp8((2, 4, 128), g), ref.random_weights(2, 4, g)
    table = torch.tensor([[3, 1, 5, 0], [2, 4, 0, 1]], dtype=torch.int32)
    lens = torch.tensor([200, 256])
    assert torch.equal(ref.paged_logits(q, w, ref.cache_pages(padded), 64, table, lens),
                       ref.paged_logits(q, w, ref.cache_pages(packed), 64, table, lens))


def test_paged_logits_equal_a_request_at_a_time_bit_for_bit():
    g = gen(2)
    pages = ref.cache_pages(ref.random_cache(20, 64, g))
    table = torch.randperm(20, generator=g)[:12].view(2, 6).to(torch.int32)
    q, w = ref.random_fp8((2, 8, 128), g), ref.random_weights(2, 8, g)
    lens = torch.tensor([5, 384])
    paged = ref.paged_logits(q, w, pages, 64, table, lens)
    for r in range(2):
        one = ref.request_logits(q[r:r + 1], w[r:r + 1], pages, 64, table[r], lens[r:r + 1], 384)
        assert torch.equal(paged[r], one[0])
    assert bool(torch.isinf(paged[0, 5:]).all()) and bool(torch.isfinite(paged[1]).all())


def test_paged_logits_skip_pages_outside_the_cache():
    g = gen(3)
    pages = ref.cache_pages(ref.random_cache(4, 64, g))
    table = torch.tensor([[0, -1, 7]], dtype=torch.int32)
    out = ref.paged_logits(ref.random_fp8((1, 2, 128), g), ref.random_weights(1, 2, g), pages, 64,
                           table, torch.tensor([192]))
    assert bool(torch.isfinite(out[0, :64]).all()) and bool(torch.isinf(out[0, 64:]).all())


def test_an_exact_selection_passes_and_ties_may_go_either_way():
    logits = torch.tensor([5.0, 1.0, 3.0, 3.0, float("-inf")])
    assert ref.selection_problems([0, 2], logits, 2) == []
    assert ref.selection_problems([0, 3, -1], logits, 2) == []
    assert ref.selection_problems([0, 1, 2, 3], logits, 8) == []


@pytest.mark.parametrize("chosen, problem", [
    ([0, 1], "below the k-th"),
    ([2, 3], "above the k-th logit not chosen"),
    ([0, 0], "chosen twice"),
    ([0], "1 positions chosen, 2 expected"),
    ([0, 4], "outside the row's keys"),
    ([0, 9], "outside the row's keys"),
])
def test_a_wrong_selection_is_named(chosen, problem):
    logits = torch.tensor([5.0, 1.0, 3.0, 3.0, float("-inf")])
    problems = ref.selection_problems(chosen, logits, 2)
    assert any(problem in p for p in problems), problems


def test_a_tolerance_admits_near_ties_only():
    logits = torch.tensor([5.0, 2.999, 3.0, 0.0])
    assert ref.selection_problems([0, 1], logits, 2) != []
    assert ref.selection_problems([0, 1], logits, 2, tol=0.01) == []
    assert ref.selection_problems([0, 3], logits, 2, tol=0.01) != []


def test_agreement_is_the_share_of_the_reference_found():
    assert ref.agreement([1, 2, 3, -1], [3, 2, 9, 8]) == 0.5
    assert ref.agreement([-1], [-1, -1]) == 1.0
