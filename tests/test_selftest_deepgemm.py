"""The self-test calls DeepGEMM's indexer kernels as the installed vLLM release does: fake
wrappers with each release's signature record the call. No torch, no GPU."""

from types import SimpleNamespace

import pytest

from dsa_image.runtime import selftest


# The wrappers' signatures, copied from each release's vllm/utils/deep_gemm.py.
def mqa_024(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits):
    return ("mqa", (q, kv, weights, cu_seqlen_ks, cu_seqlen_ke), {"clean_logits": clean_logits})


def paged_024(q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len,
              clean_logits):
    return ("paged", (q, kv_cache, weights, context_lens, block_tables, schedule_metadata),
            {"max_model_len": max_model_len, "clean_logits": clean_logits})


def mqa_033(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k):
    return ("mqa", (q, kv, weights, cu_seqlen_ks, cu_seqlen_ke), {"max_seqlen_k": max_seqlen_k})


def paged_033(q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len,
              indices=None):
    return ("paged", (q, kv_cache, weights, context_lens, block_tables, schedule_metadata),
            {"max_model_len": max_model_len, "indices": indices})


class Lens:
    """The bits of a 1-D int tensor the call builders use."""

    def __init__(self, values):
        self.values = list(values)
        self.shape = (len(self.values),)

    def __sub__(self, other):
        return Lens(a - b for a, b in zip(self.values, other.values, strict=True))

    def __eq__(self, other):
        return isinstance(other, Lens) and self.values == other.values

    def max(self):
        return max(self.values)

    def new_zeros(self, shape):
        return Lens([0] * shape[0])

    def view(self, *shape):
        return ("flat", self)


def mx_inputs(q, q_scale, weights):
    """0.33.0's mqa_logits_mx_inputs off SM100: (q_scale, weights) unchanged, marked as seen."""
    return q_scale, ("adapted", weights)


def upcast(logits, row_ends):
    return ("fp32", logits, row_ends)


DG_024 = SimpleNamespace(fp8_fp4_mqa_logits=mqa_024, fp8_fp4_paged_mqa_logits=paged_024)
DG_033 = SimpleNamespace(fp8_fp4_mqa_logits=mqa_033, fp8_fp4_paged_mqa_logits=paged_033,
                         mqa_logits_mx_inputs=mx_inputs)


def calls(version, dg):
    return selftest.deepgemm_calls(version, dg.fp8_fp4_mqa_logits, dg.fp8_fp4_paged_mqa_logits)


def test_0_24_0_passes_clean_logits_false_and_ranks_within_ks_ke():
    ks, ke = Lens([0, 0, 0]), Lens([5, 6, 7])
    logits, starts, ends = selftest.prefill_logits(calls("0.24.0", DG_024), DG_024, None, "q", "k", "s",
                                                   "w", ks, ke)
    assert logits == ("mqa", (("q", None), ("k", "s"), "w", ks, ke), {"clean_logits": False})
    assert (starts, ends) == (ks, ke)
    logits = selftest.paged_logits(calls("0.24.0", DG_024), DG_024, None, "q", "c", "w", "lens", "t",
                                   "sched", 4096)
    assert logits == ("paged", (("q", None), "c", "w", "lens", "t", "sched"),
                      {"max_model_len": 4096, "clean_logits": False})


def test_0_33_0_passes_max_seqlen_k_and_ranks_compressed_rows_from_zero():
    ks, ke = Lens([2, 2, 3]), Lens([5, 9, 7])
    logits, starts, ends = selftest.prefill_logits(calls("0.33.0", DG_033), DG_033, upcast, "q", "k", "s",
                                                   "w", ks, ke)
    ranked = Lens([3, 7, 4])  # ke - ks: compressed row i holds keys [ks[i], ke[i]) from column 0
    assert logits == ("fp32", ("mqa", (("q", None), ("k", "s"), ("adapted", "w"), ks, ke),
                               {"max_seqlen_k": 7}), ranked)
    assert (starts, ends) == (Lens([0, 0, 0]), ranked)


def test_0_33_0_paged_call_has_no_clean_logits_and_upcasts_by_row_length():
    lens = Lens([100, 4096])
    logits = selftest.paged_logits(calls("0.33.0", DG_033), DG_033, upcast, "q", "c", "w", lens, "t",
                                   "sched", 4096)
    assert logits == ("fp32", ("paged", (("q", None), "c", ("adapted", "w"), lens, "t", "sched"),
                               {"max_model_len": 4096, "indices": None}), ("flat", lens))


@pytest.mark.parametrize("version, dg, wrapper",
                         [("0.24.0", DG_033, "mqa_033"), ("0.33.0", DG_024, "mqa_024")])
def test_a_wrapper_of_the_other_release_fails_closed_naming_the_parameters(version, dg, wrapper):
    with pytest.raises(RuntimeError, match=rf"vLLM {version}: {wrapper}\(q, .*\), not the \(q, .*\) "
                                           rf"vLLM {version} calls; DEEPGEMM_CALLS is out of date"):
        calls(version, dg)


def test_a_changed_paged_wrapper_fails_closed_too():
    dg = SimpleNamespace(fp8_fp4_mqa_logits=mqa_033, fp8_fp4_paged_mqa_logits=paged_024)
    with pytest.raises(RuntimeError, match=r"paged_024\(.*clean_logits\), not the \(.*indices\)"):
        calls("0.33.0", dg)


def test_an_unknown_release_fails_closed():
    with pytest.raises(RuntimeError, match=r"vLLM 0\.99\.0: .*knows how vLLM 0\.24\.0, 0\.33\.0 call"):
        calls("0.99.0", DG_033)


def test_the_kernels_read_the_release_once_from_the_installed_vllm(monkeypatch):
    monkeypatch.setattr(selftest, "installed_vllm_version", lambda: "0.33.0")
    kernels = selftest.DeepGemmKernels()
    assert kernels._calls(DG_033) is selftest.DEEPGEMM_CALLS["0.33.0"]
    monkeypatch.setattr(selftest, "installed_vllm_version", lambda: "0.24.0")
    assert kernels._calls(DG_033) is selftest.DEEPGEMM_CALLS["0.33.0"]


@pytest.mark.parametrize("version", ["0.24.0", "0.33.0"])
def test_the_installed_version_is_read_from_the_dist_info(tmp_path, monkeypatch, version):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    info = tmp_path / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    monkeypatch.setattr("importlib.util.find_spec", lambda name: SimpleNamespace(
        origin=str(tmp_path / "vllm" / "__init__.py")) if name == "vllm" else None)
    assert selftest.installed_vllm_version() == version


def test_the_installed_vllm_wrappers_match_the_table():
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm",
                                    reason="needs vLLM (the image's test stage has it)")
    version = selftest.installed_vllm_version()
    found = selftest.deepgemm_calls(version, deep_gemm.fp8_fp4_mqa_logits,
                                    deep_gemm.fp8_fp4_paged_mqa_logits)
    assert found is selftest.DEEPGEMM_CALLS[version]
