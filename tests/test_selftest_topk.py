"""The self-test's decode top-k is the one the installed vLLM release runs on the GPU: 0.33.0's
own get_indexer_topk("auto") (called through fakes here), 0.24.0's inline rule (mirrored, and
pinned to the overlay's source text); and DeepGEMM under 0.33.0 on sm_100 is refused, not
checked with inputs in a format vLLM never gives it there. No torch, no GPU (the wheel-marked
tests read the pinned 0.33.0 wheel's source)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsa_image.runtime import selftest
from dsa_image.core.dist_info import DistInfoError

REPO = Path(__file__).resolve().parents[1]
INDEXER = "vllm/model_executor/layers/sparse_attn_indexer.py"


def overlay_source(version: str) -> str:
    return (REPO / "overlay" / f"vllm-{version}" / INDEXER).read_text()


def flat(text: str) -> str:
    return " ".join(text.split())


# -- vLLM 0.24.0: the inline rule -------------------------------------------------------------


@pytest.mark.parametrize("rows, topk, stride, capability, backend", [
    (32, 2048, 8192, (9, 0), "cooperative"),
    (33, 2048, 8192, (9, 0), "persistent"),
    (4, 2048, 65536, (10, 0), "cooperative"),
    (32, 2048, 8192, (12, 0), "cooperative"),  # 0.24.0 does not exclude sm_12x
    (32, 2048, 8190, (9, 0), "persistent"),  # rows not 16-byte aligned for TMA
    (4, 2048, 8192, (8, 9), "persistent"),
    (4, 4096, 8192, (9, 0), "per_row"),
])
def test_0_24_0_chooses_as_its_sparse_attn_indexer(rows, topk, stride, capability, backend):
    assert selftest.topk_backend_0_24_0(rows, topk, stride, capability) == backend


def test_the_0_24_0_rule_is_the_overlays_source_text():
    text = flat(overlay_source("0.24.0"))
    sizes = str(selftest.TOPK_0_24_0_SIZES)
    cooperative = ("use_cooperative_topk = ( current_platform.is_cuda() "
                   f"and topk_tokens in {sizes} "
                   f"and num_rows <= {selftest.TOPK_0_24_0_COOPERATIVE_ROWS} "
                   "and logits.stride(0) % 4 == 0 # TMA 16-byte alignment "
                   "and current_platform.has_device_capability(90) )")
    persistent = "use_persistent_topk = current_platform.is_cuda() and topk_tokens in ( 512, 1024, 2048, )"
    assert cooperative in text and persistent in text
    assert sizes == "(512, 1024, 2048)"
    order = [text.index(s) for s in ("if use_cooperative_topk:", "torch.ops._C.cooperative_topk(",
                                      "elif use_persistent_topk:", "torch.ops._C.persistent_topk(",
                                      "else: ops.top_k_per_row_decode(")]
    assert order == sorted(order)


# -- vLLM 0.33.0: vLLM's own selector -----------------------------------------------------------


class FakeWorkspace:
    def __init__(self, initialized: bool):
        self.initialized, self.inits = initialized, []

    def is_workspace_manager_initialized(self):
        return self.initialized

    def init_workspace_manager(self, device):
        self.inits.append(device)
        self.initialized = True


class FakeSelector:
    """vLLM's SparseIndexerTopk: resolves a backend per call, then runs it."""

    def __init__(self, backend: str):
        self.backend, self.runs = backend, []

    def resolve_backend(self, logits, topk_tokens, num_rows):
        return self.backend

    def __call__(self, *args):
        self.runs.append(args)


class FakeIndexerTopk:
    def __init__(self, backend: str):
        self.selector, self.asked = FakeSelector(backend), []

    def get_indexer_topk(self, backend):
        self.asked.append(backend)
        return self.selector


LOGITS = SimpleNamespace(shape=(32, 8192), device="cuda:0")


@pytest.mark.parametrize("backend", ["persistent", "cooperative"])  # e.g. sm_12x, sm_90 at 32 rows
def test_0_33_0_runs_vllms_auto_selector_and_reports_its_choice(backend):
    module, workspace = FakeIndexerTopk(backend), FakeWorkspace(initialized=False)
    found = selftest.indexer_topk_decode(module, workspace, LOGITS, "lens", "out", 2048, 8192)
    assert found == backend and module.asked == ["auto"]
    # As the overlay's sparse_attn_indexer calls it: next_n 1, max_seq_len the longest context.
    assert module.selector.runs == [(LOGITS, "lens", 1, "out", 2048, 8192)]
    assert workspace.inits == ["cuda:0"]


def test_the_engines_workspace_manager_is_kept_when_there_is_one():
    workspace = FakeWorkspace(initialized=True)
    selftest.indexer_topk_decode(FakeIndexerTopk("persistent"), workspace, LOGITS, "l", "o", 2048, 1)
    assert workspace.inits == []


def test_the_0_33_0_overlay_calls_the_selector_as_the_selftest_does():
    text = flat(overlay_source("0.33.0"))
    assert ("get_indexer_topk(topk_backend)( logits, seq_lens, next_n, topk_indices, topk_tokens, "
            "attn_metadata_narrowed.max_seq_len, )") in text
    assert f'topk_backend: str = "{selftest.TOPK_0_33_0_BACKEND}"' in text
    assert "self.topk_backend = vllm_config.kernel_config.sparse_indexer_topk_backend" in text


def test_the_image_leaves_the_topk_backend_at_vllms_default():
    configs = [*REPO.glob("recipes/**/*"), REPO / "Dockerfile"]
    assert not [p for p in configs if p.is_file() and "topk_backend" in p.read_text(errors="ignore")]


def test_each_release_has_its_decode_topk_and_an_unknown_one_fails_closed():
    assert set(selftest.DECODE_TOPK) == set(selftest.DEEPGEMM_CALLS) == {"0.24.0", "0.33.0"}
    with pytest.raises(RuntimeError, match=r"vLLM 0\.99\.0: .*knows how vLLM 0\.24\.0, 0\.33\.0 "
                                           r"choose the decode top-k, not this release; add it"):
        selftest.vllm_decode_topk("0.99.0", LOGITS, "lens", 2048, 8192)


# -- 0.33.0 on sm_100: refused ----------------------------------------------------------------


@pytest.mark.parametrize("dg", [SimpleNamespace(), SimpleNamespace(mqa_logits_use_mx_scales=lambda: False)])
def test_fp32_scaled_releases_and_gpus_are_checked(dg):
    assert selftest.mx_scales_refusal("0.33.0", dg) is None


def test_mx_scaled_deepgemm_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(selftest, "gpu_or_none", lambda: ("NVIDIA B200", (10, 0)))
    monkeypatch.setattr(selftest, "installed_vllm_version", lambda: "0.33.0")
    monkeypatch.setattr(selftest, "_vllm_deep_gemm", lambda: SimpleNamespace(mqa_logits_use_mx_scales=lambda: True))
    assert selftest.main([]) == selftest.REFUSED
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("selftest: refused: vLLM 0.33.0 runs DeepGEMM's indexer on this GPU with MX inputs")
    assert "has not been validated on the sm_100 family" in err and "scripts/smoke.py" in err


def test_deepgemm_without_mx_scales_is_not_refused(monkeypatch):
    monkeypatch.setattr(selftest, "_vllm_deep_gemm", lambda: SimpleNamespace())
    selftest.DeepGemmKernels(version="0.24.0").check_covered()


def test_an_unreadable_vllm_is_a_broken_environment_in_one_line(monkeypatch, capsys):
    def unreadable():
        raise DistInfoError("expected one vllm-*.dist-info/METADATA with a Version, found none")

    monkeypatch.setattr(selftest, "gpu_or_none", lambda: ("NVIDIA H200", (9, 0)))
    monkeypatch.setattr(selftest, "installed_vllm_version", unreadable)
    assert selftest.main([]) == selftest.BROKEN_ENV == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "DistInfoError: expected one vllm-*.dist-info" in err


def test_b12x_is_never_refused_for_scales():
    selftest.B12xKernels(version="0.33.0").check_covered()


# -- the pinned 0.33.0 wheel: what the self-test relies on --------------------------------------


def wheel_source(member: str) -> str:
    from dsa_image.overlay import cli as overlay
    from dsa_image.core import wheels
    from dsa_image.core.recipe import load_every_base

    base = next(r for r in load_every_base() if r.vllm_version == "0.33.0")
    data = wheels.read_member(overlay.reference_wheel(base), member)
    assert data is not None, f"vLLM 0.33.0 has no {member}"
    return data.decode()


@pytest.mark.wheel
def test_0_33_0_auto_never_gives_sm_12x_cooperative_topk_and_never_picks_deep_select():
    text = flat(wheel_source("vllm/model_executor/layers/indexer_topk.py"))
    assert ("self._cooperative_capable = self._is_cuda and ( current_platform.has_device_capability(90) "
            "and not current_platform.is_device_capability_family(120) )") in text
    auto = text[text.index("def _resolve_auto("):text.index("def _cooperative_constraints(")]
    assert re.findall(r'return "(\w+)"', auto) == ["cooperative", "persistent", "per_row"]
    assert "def resolve_backend( self, logits: torch.Tensor, topk_tokens: int, num_rows: int )" in text
    assert ("def forward( self, logits: torch.Tensor, seq_lens: torch.Tensor, next_n: int, "
            "topk_indices: torch.Tensor, topk_tokens: int, max_seq_len: int, ) -> None:") in text


@pytest.mark.wheel
def test_0_33_0_workspace_manager_can_be_made_outside_the_engine():
    text = wheel_source("vllm/v1/worker/workspace.py")
    assert "def is_workspace_manager_initialized() -> bool:" in text
    assert "def init_workspace_manager(\n    device: torch.device," in text


@pytest.mark.wheel
def test_0_33_0_uses_mx_scales_on_the_sm_100_family_only():
    text = flat(wheel_source("vllm/utils/deep_gemm.py"))
    assert ("def mqa_logits_use_mx_scales() -> bool:" in text
            and "return current_platform.is_cuda() and current_platform.is_device_capability_family( 100 )"
            in text)
