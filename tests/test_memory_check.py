"""The memory plan against vLLM's own numbers (dsa_image/validation/memory_check.py): real server
logs of the tiny GLM-5 (tests/data/, excerpts of H200 runs), the lines vLLM's source writes, and
the real-width figures, truncated and full, from the plan's one formula. No GPU."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from dsa_image.serving import memory_plan
from dsa_image.overlay import cli as overlay
from dsa_image.build import realwidth_model, tiny_model
from dsa_image.core import wheels
from dsa_image.core.recipe import load_every_base
from dsa_image.serving.recipes import load_model
from dsa_image.validation import memory_check

DATA = Path(__file__).resolve().parent / "data"
TINY, TINY_MTP = tiny_model.CONFIG, tiny_model.MTP_CONFIG
REALWIDTH = realwidth_model.config()  # GLM-5 at real width, 4 layers and its MTP layer


def report(name: str, cfg: dict) -> dict:
    return memory_check.check(cfg, (DATA / name).read_text())


@pytest.mark.parametrize("name, cfg, tokens, per_token", [
    ("h200-vllm0_33_0-run4-server-cold-stock-memory.log", TINY, 836_224, 4 * (576 * 2 + 132)),  # 0.33.0, bf16
    ("h200-vllm0_33_0-run4-server-mtp2-stock-memory.log", TINY_MTP, 668_992, 5 * (576 * 2 + 132)),  # + the MTP layer's
    ("h200-vllm0_33_0-run4-server-long-fp8-mtp3-stock-memory.log", TINY_MTP, 1_090_048, 5 * (656 + 132)),  # fp8_ds_mla
    ("h200-overlay-f1d4805b-server-b12x-stock-memory.log", TINY, 836_224, 4 * (576 * 2 + 132)),  # 0.24.0
    ("h200-vllm0_33_0-run9-realwidth-long-fp8-mtp3-stock-memory.log", REALWIDTH, 1_090_048, 5 * (656 + 132)),
    ("h200-vllm0_33_0-run9-realwidth-long-mtp1-overlay-memory.log", REALWIDTH, 668_992, 5 * (576 * 2 + 132)),
])
def test_the_plans_kv_tokens_are_what_vllm_allocated(name, cfg, tokens, per_token):
    kv = report(name, cfg)["kv"]
    assert (kv["vllm_tokens"], kv["plan_tokens"], kv["plan_bytes_per_token"]) == (tokens, tokens, per_token)
    assert kv["ok"]


@pytest.mark.parametrize("name, cfg", [
    ("h200-vllm0_33_0-run4-server-cold-stock-memory.log", TINY),
    ("h200-vllm0_33_0-run4-server-mtp2-stock-memory.log", TINY_MTP),
    ("h200-overlay-f1d4805b-server-b12x-stock-memory.log", TINY),
    ("h200-vllm0_33_0-run9-realwidth-long-mtp1-overlay-memory.log", REALWIDTH),  # 43.01 GiB: the MTP layer's MoE too
])
def test_a_bf16_cache_leaves_the_plans_weights_within_the_slack(name, cfg):
    weights = report(name, cfg)["weights"]
    assert weights["ok"] and 0 < weights["over_plan_gib"] <= memory_check.WEIGHTS_SLACK_GIB


def test_an_fp8_cache_without_workspace_lines_is_a_weights_mismatch_saying_what_to_do():
    doc = report("h200-vllm0_33_0-run4-server-long-fp8-mtp3-stock-memory.log", TINY_MTP)
    assert not doc["ok"] and doc["kv"]["ok"] and not doc["weights"]["workspace_logged"]
    assert doc["weights"]["vllm_loading_gib"] == 2.19 and doc["weights"]["over_plan_gib"] > 1.5
    assert "VLLM_DEBUG_WORKSPACE=1" in memory_check.summary("x.log", doc)


def test_the_plan_with_one_layer_fewer_is_a_kv_mismatch():
    doc = report("h200-vllm0_33_0-run4-server-cold-stock-memory.log", {**TINY, "num_hidden_layers": 3})
    assert not doc["kv"]["ok"] and doc["kv"]["plan_tokens"] > doc["kv"]["vllm_tokens"] * 1.3


def test_the_workspaces_of_each_lane_at_the_end_of_loading_are_taken_off():
    line = "(EngineCore pid=1) INFO 12-01 00:00:00 [workspace.py:270] [WORKSPACE DEBUG] Resized workspace from "
    text = "\n".join([line + "'a.py:1:f': 0.00 MB -> 100.00 MB (ubatch 0, lane 0)",
                      line + "'b.py:2:g': 100.00 MB -> 1536.00 MB (ubatch 0, lane 0)",
                      line + "'c.py:3:h': 0.00 MB -> 512.00 MB (ubatch 0, lane 1)"])
    assert memory_check.workspace_bytes(text) == ((1536 + 512) * 2**20, True)
    assert memory_check.workspace_bytes("") == (0, False)


def test_a_log_without_a_line_the_check_needs_is_refused(tmp_path):
    text = "\n".join(l for l in (DATA / "h200-vllm0_33_0-run4-server-cold-stock-memory.log").read_text().splitlines()
                     if "KV cache size" not in l)
    with pytest.raises(memory_check.MemoryCheckError, match="no KV cache size line"):
        memory_check.check(TINY, text)


def test_the_command_line_exits_0_1_and_2(tmp_path, capsys):
    model = tmp_path / "tiny"
    tiny_model.write_model(model)
    good, bad = DATA / "h200-vllm0_33_0-run4-server-cold-stock-memory.log", tmp_path / "bad.log"
    bad.write_text("nothing")
    out = tmp_path / "memory.json"
    assert memory_check.main(["--model", str(model), "--json", str(out), str(good)]) == 0
    assert json.loads(out.read_text())[good.name]["ok"] and "MEMORY PLAN: PASS" in capsys.readouterr().out
    model_mtp = tmp_path / "tiny-mtp"
    tiny_model.write_model(model_mtp, TINY_MTP)
    assert memory_check.main(["--model", str(model_mtp), str(DATA / "h200-vllm0_33_0-run4-server-long-fp8-mtp3-stock-memory.log")]) == 1
    assert memory_check.main(["--model", str(model), str(bad)]) == 2


# -- GLM-5 at real width: the truncated model's figures, and the full model's from the same formula --


def real_width_plan(cfg: dict, kv_cache_dtype: str = "auto", mtp: bool = False) -> memory_plan.KvPerToken:
    backend = "FLASHMLA_SPARSE" if kv_cache_dtype != "auto" else "FLASH_ATTN_MLA_SPARSE"
    return memory_plan.kv_per_token(cfg, backend, kv_cache_dtype, range(cfg["num_hidden_layers"]), mtp,
                                    last_stage=True, vllm="0.33.0")


def test_the_truncated_model_holds_what_vllm_held_at_real_width():
    """The earlier real-width run (issue 26): 1,672,448 tokens in 8 GiB = 5,136 bytes a token."""
    kv = real_width_plan(realwidth_model.config())
    assert kv.total == 5136 == 4 * (576 * 2 + 132)
    assert (8 << 30) // (kv.total * 64) * 64 == 1_672_448


def test_the_full_model_from_the_same_formula():
    full, truncated = load_model("glm-5").config, realwidth_model.config()
    for dtype, mla in (("auto", 576 * 2), ("fp8_ds_mla", 656)):
        per_layer = mla + 128 + 4  # the indexer's fp8 keys and one fp32 scale per 128
        assert real_width_plan(full, dtype).total == 78 * per_layer
        assert real_width_plan(full, dtype, mtp=True).total == 79 * per_layer
        assert real_width_plan(truncated, dtype).total == 4 * per_layer
    bf16 = memory_plan.SCHEMES["bf16"]
    layers = [memory_plan.layer_parts(full, memory_plan.is_moe_layer(full, i)) for i in range(78)]
    vocab = 2 * full["vocab_size"] * full["hidden_size"] + full["hidden_size"]
    assert memory_plan.parameter_count(full, with_mtp=False) == sum(sum(p.values()) for p in layers) + vocab
    # 3 dense and 75 more MoE layers than the truncated model's one: the full model's bf16 bytes.
    moe = sum(memory_plan.layer_parts(full, True).values())
    assert memory_plan.checkpoint_bytes(full, bf16, False) == pytest.approx(
        memory_plan.checkpoint_bytes(truncated, bf16, False) + 74 * moe * 2)


# -- the lines the check reads, as each base's vLLM writes them -------------------------------------

BASES = {recipe.vllm_version: recipe for recipe in load_every_base()}
# member -> (what its format string holds, the pattern that reads the line, the value read)
LINES = {
    "vllm/v1/worker/workspace.py": ("[WORKSPACE DEBUG] Resized workspace from", memory_check.WORKSPACE, "1536.00"),
    "vllm/v1/worker/gpu_model_runner.py": ("Model loading took", memory_check.MODEL_LOADING, "24.3"),
    "vllm/v1/worker/gpu/model_runner.py": ("Model loading took", memory_check.MODEL_LOADING, "24.3"),
    "vllm/v1/core/kv_cache_utils.py": ("KV cache size: %s tokens", memory_check.KV_TOKENS, "1,672,448"),
    "vllm/platforms/interface.py": ("Setting kv cache block size to", memory_check.BLOCK_SIZE, "64"),
    "vllm/v1/engine/core.py": ("Initializing a V1 LLM engine", memory_check.VERSION, None),
}


def formats(version: str, member: str, holds: str) -> list[str]:
    """The string constants of `member` in base `version`'s wheel that hold `holds`."""
    tree = ast.parse(wheels.read_member(overlay.reference_wheel(BASES[version]), member).decode())
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and holds in n.value]


def render(fmt: str, strings: list[str]) -> str:
    """`fmt` as vLLM's logger fills it: each %s the next of `strings`, numbers as measured."""
    values = iter(strings)
    numbers = {"d": 64, "f": 1536.0}
    return re.sub(r"%[.\d]*[sdf]", lambda m: m.group(0) % (next(values) if m.group(0) == "%s"
                                                            else numbers[m.group(0)[-1]]), fmt)


@pytest.mark.wheel
@pytest.mark.parametrize("version", sorted(BASES))
def test_every_line_the_check_reads_is_one_vllm_writes(version):
    for member, (holds, pattern, value) in LINES.items():
        found = formats(version, member, holds)
        assert found, f"vLLM {version} {member}: no format string holding {holds!r}"
        strings = {"vllm/v1/worker/workspace.py": ["gpu_model_runner.py:1:load_model"],
                   "vllm/v1/core/kv_cache_utils.py": (["GPU"] if found[0].startswith("%s") else []) + ["1,672,448"],
                   "vllm/v1/engine/core.py": [version]}.get(member, ["24.3"])
        match = pattern.search(render(found[0], strings + ["x"] * 4))
        assert match and match.group(1) == (value or version), (member, found[0])
