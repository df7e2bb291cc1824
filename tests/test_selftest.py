"""The self-test's choosing, comparing and reporting, on the CPU with kernels made of the
reference: exact ones pass, rounding noise passes, wrong ones fail with a named mismatch.

Needs torch (the image's test stage); the GPU half is scripts/gpu_validation.py b12x."""

import json
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from dsa_image.runtime import indexer_reference as ref
from dsa_image.runtime import selftest

SMALL = [
    selftest.Case("decode-small", "decode", 5, 1500, heads=4, topk=512),
    selftest.Case("prefill-small", "prefill", 96, 700, heads=4, topk=512, checked_rows=24),
]


class ReferenceKernels:
    """The reference as kernels: what a correct kernel returns."""

    family = "reference"

    def kernel_name(self, kind):
        return f"reference {kind}"

    def logits(self, inputs, case):
        if case.kind == "decode":
            return ref.paged_logits(inputs["q"], inputs["weights"], ref.cache_pages(inputs["cache"]), 64,
                                    inputs["table"], inputs["lens"])
        logits = ref.relu_weighted_logits(inputs["q"], inputs["weights"], inputs["k"], inputs["k_scale"])
        return ref.masked_logits(logits, inputs["ks"], inputs["ke"])

    def decode(self, inputs, case):
        logits = self.logits(inputs, case)
        return logits, ref.topk_positions(logits, case.topk)

    prefill = decode


class Float32Kernels(ReferenceKernels):
    """Same math in float32 with another summation order: a kernel's rounding."""

    def logits(self, inputs, case):
        if case.kind == "decode":
            return super().logits(inputs, case)
        scores = torch.einsum("rhd,nd->rhn", inputs["q"].float(), inputs["k"].float())
        logits = (torch.relu(scores) * inputs["weights"][:, :, None]).sum(1) * inputs["k_scale"]
        return ref.masked_logits(logits, inputs["ks"], inputs["ke"])


class NoReluKernels(ReferenceKernels):
    def logits(self, inputs, case):
        logits = super().logits(inputs, case)
        if case.kind == "decode":
            return logits
        scores = torch.einsum("rhd,nd->rhn", inputs["q"].float(), inputs["k"].float())
        raw = (scores * inputs["weights"][:, :, None]).sum(1) * inputs["k_scale"]
        return ref.masked_logits(raw, inputs["ks"], inputs["ke"])


class ShiftedKernels(ReferenceKernels):
    """Right logits, positions off by one (an index-convention bug)."""

    def decode(self, inputs, case):
        logits, positions = super().decode(inputs, case)
        return logits, torch.where(positions > 0, positions - 1, positions)

    prefill = decode


class ScaledKernels(ReferenceKernels):
    def decode(self, inputs, case):
        logits, positions = super().decode(inputs, case)
        return logits * 1.05, positions

    prefill = decode


class RaisingKernels(ReferenceKernels):
    def decode(self, inputs, case):
        raise RuntimeError("kernel launch failed")

    prefill = decode


def test_correct_kernels_pass_with_full_agreement():
    results, code = selftest.run_suite(ReferenceKernels(), SMALL, "cpu")
    assert code == selftest.OK
    assert all(r.passed and r.agreement == 1.0 and r.max_error == 0.0 for r in results)


def test_a_kernels_rounding_passes():
    results, code = selftest.run_suite(Float32Kernels(), SMALL, "cpu")
    assert code == selftest.OK, selftest.format_table(results)
    assert 0 < results[1].max_error < selftest.TOLERANCE


@pytest.mark.parametrize("kernels, words", [
    (NoReluKernels(), "logit error"),
    (ShiftedKernels(), "below the k-th logit"),
    (ScaledKernels(), "logit error"),
])
def test_a_wrong_kernel_is_a_mismatch(kernels, words):
    results, code = selftest.run_suite(kernels, SMALL, "cpu")
    assert code == selftest.MISMATCH
    assert any(words in p for r in results for p in r.problems), selftest.format_table(results)
    assert "MISMATCH" in selftest.format_table(results)


def test_the_break_hook_fails_exactly_the_case_it_names():
    results, code = selftest.run_suite(ReferenceKernels(), SMALL, "cpu", broken="prefill-small")
    assert code == selftest.MISMATCH
    assert [r.passed for r in results] == [True, False]


def test_a_raising_kernel_is_an_error_and_the_table_says_which():
    results, code = selftest.run_suite(RaisingKernels(), SMALL, "cpu")
    assert code == selftest.ERROR
    assert "ERROR: RuntimeError: kernel launch failed" in selftest.format_table(results)


def test_default_cases_fold_at_least_two_supertiles_and_reach_the_schedule_path():
    cases = {c.name: c for c in selftest.default_cases(8192)}
    long = cases["prefill-long"]
    assert long.context + long.rows > 8192 and long.rows >= 1024  # b12x's 512-key prefill tile
    assert cases["prefill-short"].context + cases["prefill-short"].rows < 2048
    assert cases["decode-65536"].context // 64 >= 1024 and cases["decode-65536"].rows <= 8


@pytest.mark.parametrize("choice, capability, family", [
    ("auto", (12, 0), "b12x"), ("auto", (12, 1), "b12x"), ("auto", (9, 0), "deepgemm"),
    ("auto", (10, 0), "deepgemm"), ("deepgemm", (10, 3), "deepgemm"), ("b12x", (12, 0), "b12x"),
])
def test_the_kernels_the_image_uses_on_each_gpu(choice, capability, family):
    assert selftest.pick_kernels(choice, capability, "GPU").family == family


@pytest.mark.parametrize("choice, capability, words", [
    ("b12x", (9, 0), "the b12x kernels run on compute capability 12.0/12.1"),
    ("deepgemm", (12, 0), "DeepGEMM's indexer kernels run on compute capability 9.0 and 10.x"),
    ("auto", (8, 0), "this GPU (GPU) is compute capability 8.0"),
])
def test_kernels_without_code_for_the_gpu_are_refused(choice, capability, words):
    with pytest.raises(selftest.Refused, match=words.replace("(", r"\(").replace(")", r"\)")):
        selftest.pick_kernels(choice, capability, "GPU")


def test_no_gpu_is_one_line_and_its_own_exit_code(monkeypatch, capsys):
    monkeypatch.setattr(selftest, "gpu_or_none", lambda: None)
    assert selftest.main([]) == selftest.NO_GPU
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no NVIDIA GPU visible" in err and "--gpus all" in err


def test_b12x_on_an_h200_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(selftest, "gpu_or_none", lambda: ("NVIDIA H200", (9, 0)))
    assert selftest.main(["--kernels", "b12x"]) == selftest.REFUSED
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("selftest: refused: the b12x kernels")
    assert "NVIDIA H200" in err and "9.0" in err


def test_usage_errors_have_their_exit_code(capsys):
    assert selftest.main(["--kernels", "cutlass"]) == selftest.USAGE
    assert selftest.main(["--help"]) == selftest.OK


def test_the_report_prints_the_table_and_writes_json(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(selftest, "default_cases", lambda supertile: SMALL)
    args = SimpleNamespace(json=str(tmp_path / "out.json"), broken=None)
    assert selftest.report(ReferenceKernels(), ("CPU", (0, 0)), args, device="cpu") == selftest.OK
    out = capsys.readouterr().out
    assert "| decode-small | reference decode |" in out and "SELFTEST: PASS" in out
    doc = json.loads((tmp_path / "out.json").read_text())
    assert doc["exit_code"] == 0 and [r["passed"] for r in doc["results"]] == [True, True]
    args.broken = "no-such-case"
    assert selftest.report(ReferenceKernels(), ("CPU", (0, 0)), args, device="cpu") == selftest.USAGE


class PersistentTopkKernels(ReferenceKernels):
    """Kernels that say which top-k they ran, as the image's do."""

    def decode(self, inputs, case):
        self.last_topk = "persistent" if case.kind == "decode" else "top_k_per_row_prefill"
        return super().decode(inputs, case)

    prefill = decode


def test_the_report_names_the_topk_kernel_that_ran(monkeypatch, capsys):
    monkeypatch.setattr(selftest, "default_cases", lambda supertile: SMALL)
    args = SimpleNamespace(json="-", broken=None)
    assert selftest.report(PersistentTopkKernels(), ("CPU", (0, 0)), args, device="cpu") == selftest.OK
    out = capsys.readouterr().out
    assert "| decode-small | reference decode | persistent |" in out
    assert "| prefill-small | reference prefill | top_k_per_row_prefill |" in out
    doc = json.loads(out.splitlines()[-1])
    assert [r["topk_kernel"] for r in doc["results"]] == ["persistent", "top_k_per_row_prefill"]
