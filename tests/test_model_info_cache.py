"""The build-time model-info cache (dsa_image/model_info_cache.py) and its wiring in the image.

The real vLLM runs it in the image build: `fill` in the model-info stage, `check` in the test
stage against the overlaid site (Dockerfile). Here: its refusals, its use of vLLM's lookup
against a registry that behaves as vLLM 0.24.0's and 0.33.0's do (an entry keyed by the
module's source hash, else a subprocess), and the Dockerfile's paths."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest

from dsa_image import model_info_cache as mic

REPO = Path(__file__).resolve().parents[1]


class FakeLazyModel:
    """vLLM's _LazyRegisteredModel as far as the cache goes: modelinfos/<file>.json holding the
    module's source hash, written after an inspection in a subprocess."""

    def __init__(self, registry_module, name, source):
        self.registry_module, self.name, self.source = registry_module, name, source

    @staticmethod
    def _get_cache_dir():
        import os

        return Path(os.environ["VLLM_CACHE_ROOT"]) / "modelinfos"

    def _get_cache_filename(self):
        return f"vllm-models-{self.name}.json"

    def inspect(self):
        path = self._get_cache_dir() / self._get_cache_filename()
        if path.is_file() and json.loads(path.read_text())["hash"] == self.source:
            return {"cached": True}
        info = self.registry_module._run_in_subprocess(lambda: {"cached": False})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"hash": self.source, "modelinfo": info}))
        return info


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    registry = types.ModuleType("vllm.model_executor.models.registry")
    registry._run_in_subprocess = lambda fn: fn()
    models = {"GlmMoeDsaForCausalLM": FakeLazyModel(registry, "glm", "v1"),
              "DeepseekV32MTPModel": FakeLazyModel(registry, "mtp", "v1")}

    class ModelRegistry:
        pass

    ModelRegistry.models = models

    def try_inspect(arch):  # vLLM logs the failure and returns None
        try:
            return models[arch].inspect()
        except Exception:  # noqa: BLE001
            return None

    ModelRegistry._try_inspect_model_cls = staticmethod(try_inspect)
    registry.ModelRegistry = ModelRegistry
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.models"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.models.registry", registry)
    sys.modules["vllm.model_executor.models"].registry = registry
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    return registry, models


ARCHS = ["GlmMoeDsaForCausalLM", "DeepseekV32MTPModel"]


def test_fill_writes_an_entry_per_architecture_that_check_then_finds_fresh(fake_vllm, tmp_path):
    written = mic.fill(ARCHS)
    assert [p.name for p in written] == ["vllm-models-glm.json", "vllm-models-mtp.json"]
    assert mic.stale(ARCHS) == []


def test_an_entry_for_other_sources_is_stale_and_the_subprocess_fallback_is_restored(fake_vllm):
    registry, models = fake_vllm
    mic.fill(ARCHS)
    original = registry._run_in_subprocess
    models["DeepseekV32MTPModel"].source = "v2"  # an overlay or another vLLM changed the module
    assert mic.stale(ARCHS) == ["DeepseekV32MTPModel"]
    assert registry._run_in_subprocess is original


def test_an_empty_cache_is_all_stale(fake_vllm):
    assert mic.stale(ARCHS) == ARCHS


def test_time_reports_seconds_per_architecture_and_fills_a_missing_entry(fake_vllm):
    seconds = mic.timed(ARCHS)
    assert list(seconds) == ARCHS and all(s >= 0 for s in seconds.values())
    assert mic.stale(ARCHS) == []


def test_an_architecture_vllm_does_not_register_is_refused(fake_vllm):
    with pytest.raises(mic.ModelInfoError, match="NoSuchForCausalLM: not a model class vLLM registers") as exc:
        mic.fill(["NoSuchForCausalLM"])
    assert exc.value.code == mic.BAD_INPUT


def test_a_failed_inspection_fails_fill(fake_vllm):
    registry, _ = fake_vllm

    def broken(_fn):
        raise ImportError("no module named deep_gemm")

    registry._run_in_subprocess = broken
    with pytest.raises(mic.ModelInfoError, match="could not inspect") as exc:
        mic.fill(ARCHS)
    assert exc.value.code == mic.STALE


def test_a_directory_without_config_json_is_bad_input(tmp_path, capsys):
    code = mic.main(["check", "--model", str(tmp_path), "--cache-root", str(tmp_path / "c")])
    assert code == mic.BAD_INPUT
    assert "expected a Hugging Face config.json" in capsys.readouterr().err


def _stage(dockerfile: str, header: str) -> str:
    return dockerfile.split(header + "\n", 1)[1].split("\nFROM ", 1)[0]


def test_the_model_info_stage_copies_every_module_of_ours_the_tool_imports():
    import ast

    tree = ast.parse((REPO / "dsa_image" / "model_info_cache.py").read_text())
    ours = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
            and node.module.startswith("dsa_image.")}
    copied = re.search(r"COPY (dsa_image/\S+ )+/tmp/dsa-image/tool/dsa_image/",
                       _stage((REPO / "Dockerfile").read_text(), "FROM extras AS model-info")).group(0)
    assert ours and all(f"{module.replace('.', '/')}.py" in copied for module in ours), (ours, copied)


def test_the_image_ships_the_entries_where_its_vllm_looks_and_the_test_stage_checks_those():
    dockerfile = (REPO / "Dockerfile").read_text()
    fill = _stage(dockerfile, "FROM extras AS model-info")
    root = re.search(r"model_info_cache fill \\\s+--model (\S+) --cache-root (\S+)", fill)
    assert root, fill
    runtime = _stage(dockerfile, "FROM overlay AS runtime")
    cache_root = re.search(r"VLLM_CACHE_ROOT=(\S+)", runtime).group(1)
    copy = f"COPY --from=model-info --chown=vllm:vllm {root.group(2)}/modelinfos/ {cache_root}/modelinfos/"
    assert copy in runtime
    assert cache_root in re.search(r"install -d -o vllm -g vllm [^\n]*\\\n[^\n]*", runtime).group(0)
    test = _stage(dockerfile, "FROM overlay AS test")
    assert f"COPY --from=model-info {root.group(2)}/ /tmp/dsa-image/model-info/" in test
    assert "model_info_cache check --model /tmp/dsa-image/tiny-glm5 \\\n        --cache-root /tmp/dsa-image/model-info" in test
