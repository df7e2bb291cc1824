"""The build-time model-info cache (dsa_image/build/model_info_cache.py) and its wiring in the image.

The real vLLM runs it in the image build: `fill` in the model-info stage, `check` in the test
stage against the overlaid site (Dockerfile). Here: its refusals, its use of vLLM's lookup
against the serving tests' fake registry, which behaves as vLLM 0.24.0's and 0.33.0's do (an
entry keyed by the module's source hash, else a subprocess), and the Dockerfile's paths."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from dsa_image.build import model_info_cache as mic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bench import add_fake_model_registry  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """The fake vLLM of the serving tests (its registry keys an entry on its module's source),
    importable here; every vllm module is dropped again afterwards."""
    site = add_fake_model_registry(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    before = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "vllm"}
    for name in before:
        del sys.modules[name]
    from vllm.model_executor.models import registry

    yield registry, site / "vllm" / "model_executor" / "models" / "registry.py"
    for name in [name for name in sys.modules if name.split(".")[0] == "vllm"]:
        del sys.modules[name]
    sys.modules.update(before)


ARCHS = ["GlmMoeDsaForCausalLM", "DeepseekV32MTPModel"]


def test_fill_writes_an_entry_per_architecture_that_check_then_finds_fresh(fake_vllm, tmp_path):
    written = mic.fill(ARCHS)
    assert [p.name for p in written] == [f"vllm-models-fake-{arch}.json" for arch in ARCHS]
    assert mic.stale(ARCHS) == []


def test_an_entry_for_other_sources_is_stale_and_the_subprocess_fallback_is_restored(fake_vllm):
    registry, module_file = fake_vllm
    mic.fill(ARCHS)
    original = registry._run_in_subprocess
    module_file.write_text(module_file.read_text() + "# changed\n")  # an overlay or another vLLM
    assert mic.stale(ARCHS) == ARCHS
    assert registry._run_in_subprocess is original


def test_an_empty_cache_is_all_stale(fake_vllm):
    assert mic.stale(ARCHS) == ARCHS


def test_time_reports_seconds_per_architecture_and_fills_a_missing_entry(fake_vllm):
    seconds = mic.timed(ARCHS)
    assert list(seconds) == ARCHS and all(s >= 0 for s in seconds.values())
    assert mic.stale(ARCHS) == []


def test_the_architectures_are_the_models_and_the_drafter_vllm_maps_it_to(fake_vllm, tmp_path):
    pytest.importorskip("transformers")
    from dsa_image.build.tiny_model import write_model

    write_model(tmp_path / "model")
    assert mic.architectures(tmp_path / "model") == ARCHS


def test_an_architecture_vllm_does_not_register_is_refused(fake_vllm):
    with pytest.raises(mic.ModelInfoError, match="NoSuchForCausalLM: not a model class vLLM registers") as exc:
        mic.fill(["NoSuchForCausalLM"])
    assert exc.value.exit_code == mic.BAD_INPUT


def test_a_failed_inspection_fails_fill(fake_vllm, monkeypatch):
    registry, _ = fake_vllm

    def broken(self):
        raise ImportError("no module named deep_gemm")

    monkeypatch.setattr(registry._LazyRegisteredModel, "inspect", broken)
    with pytest.raises(mic.ModelInfoError, match="could not inspect") as exc:
        mic.fill(ARCHS)
    assert exc.value.exit_code == mic.STALE


def test_fill_inspects_in_this_process_and_gives_vllm_its_subprocess_back(fake_vllm):
    """One process for every class; vLLM's subprocess is for keeping CUDA out of a server."""
    registry, _ = fake_vllm

    def no_subprocess(_inspect):
        raise AssertionError("fill started a subprocess")

    registry._run_in_subprocess = no_subprocess
    mic.fill(ARCHS)
    assert registry._run_in_subprocess is no_subprocess


def test_a_directory_without_config_json_is_bad_input(tmp_path, capsys):
    code = mic.main(["check", "--model", str(tmp_path), "--cache-root", str(tmp_path / "c")])
    assert code == mic.BAD_INPUT
    assert "expected a Hugging Face config.json" in capsys.readouterr().err


def test_the_model_info_stage_copies_every_module_of_ours_the_tool_imports():
    from test_image_tree import closure, copied, stage

    tool = REPO / "dsa_image" / "build" / "model_info_cache.py"
    files, _ = copied(stage("model-info"))
    needed = closure({tool})
    assert len(needed) > 2 and needed <= files, sorted(str(p.relative_to(REPO)) for p in needed - files)


def test_the_image_ships_the_entries_where_its_vllm_looks_and_the_test_stage_checks_those():
    from test_image_tree import stage

    fill = stage("model-info")
    root = re.search(r"model_info_cache fill \\\s+--model (\S+) --cache-root ([^\s;]+)", fill)
    assert root, fill
    # Emulated (the arm64 image on x86-64) the stage ships an empty directory and says so.
    assert 'if [[ "${BUILDPLATFORM}" != "${TARGETPLATFORM}" ]]' in fill
    assert f"mkdir -p {root.group(2)}/modelinfos" in fill and "no model info cached" in fill
    runtime = stage("runtime")
    cache_root = re.search(r"VLLM_CACHE_ROOT=(\S+)", runtime).group(1)
    copy = f"COPY --from=model-info --chown=vllm:vllm {root.group(2)}/modelinfos/ {cache_root}/modelinfos/"
    assert copy in runtime
    assert cache_root in re.search(r"install -d -o vllm -g vllm [^\n]*\\\n[^\n]*", runtime).group(0)
    test = stage("test")
    assert f"COPY --from=model-info {root.group(2)}/ /tmp/dsa-image/model-info/" in test
    assert "model_info_cache check --model /tmp/dsa-image/tiny-glm5 \\\n        --cache-root /tmp/dsa-image/model-info" in test
