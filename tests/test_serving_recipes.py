"""Serving recipes: model facts, memory plans, schema errors, overrides, refusals, dry runs, launches,
the image's recipe mode and the scaled-down forms. No GPU, no vLLM (tests/test_serving_recipes_vllm.py
checks the recipes against the pinned vLLM)."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsa_image.serving import cli as sc, execute as sx, launch as sl, memory_plan, recipes as sr
from dsa_image.build import tiny_model
from dsa_image.core import status
from dsa_image.serving.memory_plan import GIB, GPUS, SCHEMES

# The free-port helper the smoke tests use (tests/ is on sys.path as pytest runs them).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bench import add_fake_model_registry  # noqa: E402
from test_smoke_fakes import free_port  # noqa: E402
from dsa_image.core.recipe import load_recipe, recipe_ids
from dsa_image.validation import recipes as scaled

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
SERVE = REPO / "scripts" / "serve.py"
BUILD = load_recipe()
ALL = sr.serve_recipe_names()
FITTING = {"tiny-glm5", "glm-5-fp8-8xb200", "glm-5.2-nvfp4-8xrtxpro6000", "glm-5.2-nvfp4-8xspark",
           "glm-5.2-w4a16-4xspark"}
# Layouts no shipped recipe has because they can never fit (docs/recipes.md says which checkpoint
# each would need): a shipped recipe with the layout set, and the plan's refusal.
REFUSED_LAYOUTS = {
    "NVFP4 on 4x RTX PRO 6000": ("glm-5.2-nvfp4-8xrtxpro6000", ["gpus_per_node=4", "tensor_parallel_size=4"],
                                 "111.6 GiB of weights per GPU (stage 0) exceed the 86.0 GiB"),
    "NVFP4 on 4 Sparks": ("glm-5.2-nvfp4-8xspark", ["nodes=4", "tensor_parallel_size=4"],
                          "111.6 GiB of weights per GPU (stage 0) exceed the 103.4 GiB"),
    "NVFP4 on 2 Sparks": ("glm-5.2-nvfp4-8xspark", ["nodes=2", "tensor_parallel_size=2"],
                          "219.0 GiB of weights per GPU (stage 0) exceed the 103.4 GiB"),
    "W4A16 on 4x RTX PRO 6000": ("glm-5.2-w4a16-4xspark", ["hardware.sm120=rtx-pro-6000",
                                                           "gpu_memory_utilization=0.9"],
                                 "97.3 GiB of weights per GPU (stage 0) exceed the 86.0 GiB"),
    "W4A16 on 2 Sparks": ("glm-5.2-w4a16-4xspark", ["nodes=2", "tensor_parallel_size=2"],
                          "191.7 GiB of weights per GPU (stage 0) exceed the 107.1 GiB"),
}
SPARK8_HOSTS = [f"10.0.0.{i}" for i in range(1, 9)]


def model_config(name: str) -> dict:
    return sr.load_model(name).config


def load(name: str, overrides: list[str] = ()) -> sr.ServeRecipe:
    return sr.apply_overrides(sr.load_serve_recipe(name, build=BUILD), list(overrides), BUILD)


# -- model facts ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["glm-5", "glm-5.2"])
def test_vendored_config_is_transformers_defaults(model):
    transformers = pytest.importorskip("transformers", reason="transformers is in the dev lock")
    raw = tomllib.loads((RECIPES / "models" / f"{model}.toml").read_text())
    source = raw["config_source"]
    assert (Path(transformers.__file__).parent.parent / source["file"]).is_file()
    defaults = getattr(transformers, source["class"])()
    assert {key: getattr(defaults, key) for key in raw["config"]} == raw["config"]


def test_tiny_model_facts_are_tiny_model_config():
    raw = tomllib.loads((RECIPES / "models" / "tiny-glm5.toml").read_text())
    assert raw["config"] == {key: tiny_model.CONFIG[key] for key in raw["config"]}


def test_every_published_value_has_a_source():
    for path in (RECIPES / "models").glob("*.toml"):
        raw = tomllib.loads(path.read_text())
        assert set(raw["published"]) <= set(raw["published_sources"]), path
        assert all(s.startswith("https://") for s in raw["published_sources"].values()), path


def test_parameter_counts_match_published_totals():
    glm5, glm52 = model_config("glm-5"), model_config("glm-5.2")
    published = tomllib.loads((RECIPES / "models" / "glm-5.toml").read_text())["published_totals"]
    assert memory_plan.parameter_count(glm5, with_mtp=False) == pytest.approx(published["parameters_without_mtp"],
                                                                              rel=0.002)
    published = tomllib.loads((RECIPES / "models" / "glm-5.2.toml").read_text())["published_totals"]
    assert memory_plan.parameter_count(glm52, with_mtp=True) == pytest.approx(published["parameters_with_mtp"],
                                                                              rel=0.002)
    # "40B active" (GLM-5's model card, NVIDIA's GLM-5.2 card): rounded, hence the looser bound
    assert memory_plan.active_parameter_count(glm5) == pytest.approx(40e9, rel=0.03)
    # The tiny model: "about 83M parameters" (dsa_image/build/tiny_model.py)
    assert round(memory_plan.parameter_count(tiny_model.CONFIG, with_mtp=False) / 1e6) == 83


def test_one_decoder_layer_by_hand():
    cfg = model_config("glm-5")
    parts = memory_plan.layer_parts(cfg, moe=True)
    assert parts["attn.q_b"] == 2048 * 64 * (192 + 64)
    assert parts["attn.kv_b"] == 512 * 64 * (192 + 256)
    assert parts["attn.o"] == 64 * 256 * 6144
    assert parts["indexer.wq_b"] == 2048 * 32 * 128
    assert parts["mlp.routed_experts"] == 256 * 3 * 6144 * 2048
    assert "mlp.dense" not in parts and "mlp.routed_experts" not in memory_plan.layer_parts(cfg, moe=False)


def test_checkpoint_sizes_match_published_sizes():
    glm52, glm5 = model_config("glm-5.2"), model_config("glm-5")
    nvfp4 = memory_plan.checkpoint_bytes(glm52, SCHEMES["nvfp4-routed-experts"], with_mtp=True)
    assert nvfp4 == pytest.approx(465e9, rel=0.01)  # eugr's recipe: ~465GB
    assert nvfp4 / GIB == pytest.approx(433, rel=0.01)  # InferenceX #2335: 433 (GiB) total
    fp8 = memory_plan.checkpoint_bytes(glm5, SCHEMES["fp8-block"], with_mtp=True)
    assert fp8 / GIB == pytest.approx(704, rel=0.01)  # eugr's 8x-Spark GLM-5-FP8 recipe: ~704 GiB
    # What the W4A16 checkpoint stores (without the bf16 W_UK/W_UV vLLM derives from its INT8 kv_b):
    # "405GB of weights" (joesinvestments' 4x-Spark recipe), "379GiB on disk" with an INT8 lm_head
    # sidecar of 0.9 GiB added (0xdfi).
    w4a16 = memory_plan.stage_weights(glm52, SCHEMES["w4a16-int4-int8mix"], tp=1, pp=1, mtp=True)[0].breakdown
    stored = sum(size for part, size in w4a16.items() if not part.endswith("_bf16_copy"))
    assert stored == pytest.approx(405e9, rel=0.01)
    assert stored / GIB == pytest.approx(379 - 154880 * 6144 / GIB, rel=0.01)


def test_w4a16_plan_matches_the_published_weights_per_rank():
    """0xdfi's 4x-Spark recipe: ~94.75 GiB of weights per rank at TP 4 (379 GiB / 4). The plan is
    within 3% above it: it also counts what every rank holds whole (the indexer, q_a/kv_a, norms,
    router: ~2.5 GiB) and the bf16 W_UK/W_UV copies of the INT8 kv_b (0.5 GiB), and leaves out the
    INT8 lm_head sidecar (0.2 GiB per rank)."""
    plan = sl.memory_plan_of(load("glm-5.2-w4a16-4xspark"), "sm120", BUILD)
    assert plan.weights_per_gpu / GIB == pytest.approx(94.75, rel=0.03)
    assert plan.weights_per_gpu / GIB > 94.75
    assert plan.fits and plan.kv_tokens >= 2 * 65536
    layer0 = memory_plan.stage_weights(model_config("glm-5.2"), SCHEMES["w4a16-int4-int8mix"], tp=1, pp=1,
                                       mtp=False)[0]
    bf16 = memory_plan.stage_weights(model_config("glm-5.2"), SCHEMES["bf16"], tp=1, pp=1, mtp=False)[0]
    assert layer0.breakdown["mlp.dense"] < bf16.breakdown["mlp.dense"]  # layers 1-2 INT8, layer 0 bf16
    assert SCHEMES["w4a16-int4-int8mix"].part_bytes("mlp.dense", False, 0) == memory_plan.BF16
    assert SCHEMES["w4a16-int4-int8mix"].part_bytes("mlp.routed_experts", True) == memory_plan.INT8_CHANNEL


def test_index_topk_pattern_is_vllms_and_the_published_one():
    recipe_pattern = sr.load_serve_recipe("glm-5.2-nvfp4-8xspark", build=BUILD).vllm["hf_overrides"][
        "index_topk_pattern"]
    pattern = memory_plan.index_topk_pattern(model_config("glm-5.2"))
    assert pattern == recipe_pattern and len(pattern) == 78 and pattern.count("F") == 21
    assert memory_plan.index_topk_pattern(model_config("glm-5")) == "F" * 78
    assert memory_plan.index_topk_pattern({"num_hidden_layers": 4, "index_topk_pattern": "FS"}) == "FSFF"


@pytest.mark.parametrize("vllm", BUILD.vllm_versions)
@pytest.mark.parametrize("backend, dtype, stored, per_layer", [
    ("FLASHINFER_MLA_SPARSE_SM120", "fp8_ds_mla", "fp8_ds_mla", 656),
    ("FLASHINFER_MLA_SPARSE_SM120", "auto", "fp8_ds_mla", 656),
    ("FLASHINFER_MLA_SPARSE", "fp8", "fp8", 576),
    ("FLASHINFER_MLA_SPARSE", "auto", "auto", 1152),
    ("FLASHMLA_SPARSE", "fp8", "fp8_ds_mla", 656),
    ("FLASHMLA_SPARSE", "auto", "auto", 1152),
])
def test_kv_bytes_per_token_follow_vllms_layouts(vllm, backend, dtype, stored, per_layer):
    cfg = model_config("glm-5")
    assert memory_plan.stored_kv_dtype(backend, dtype, vllm) == stored
    assert memory_plan.mla_bytes_per_token(cfg, backend, dtype, vllm) == per_layer
    assert memory_plan.indexer_bytes_per_token(cfg) == 128 + 4
    kv = memory_plan.kv_per_token(cfg, backend, dtype, range(78), mtp=True, last_stage=True, vllm=vllm)
    assert (kv.mla_layers, kv.indexer_layers, kv.total) == (79, 79, 79 * (per_layer + 132))


def test_nvfp4_ds_mla_is_0_33s_on_sm100_only():
    new = load_recipe(vllm="0.33.0")
    tiny = sr.load_serve_recipe("tiny-glm5", build=new)
    nvfp4 = dataclasses.replace(tiny, vllm={**tiny.vllm, "attention_backend": "FLASHMLA_SPARSE",
                                            "kv_cache_dtype": "nvfp4_ds_mla"})
    sr.check_backend(nvfp4, "sm100", new)
    assert sl.memory_plan_of(nvfp4, "sm100", new).kv.mla_per_layer == 352
    with pytest.raises(sr.RecipeFileError, match="does not take kv_cache_dtype 'nvfp4_ds_mla' on the NVIDIA H200"):
        sr.check_backend(nvfp4, "sm90", new)
    with pytest.raises(sr.RecipeFileError, match="does not take kv_cache_dtype 'nvfp4_ds_mla'"):
        sr.check_backend(nvfp4, "sm100", load_recipe(vllm="0.24.0"))


def test_every_base_has_kv_facts_and_an_unknown_one_is_refused():
    assert set(BUILD.vllm_versions) <= set(memory_plan.KV_RELEASES)
    with pytest.raises(ValueError, match="vLLM 0.25.0: no KV facts in memory_plan .* add an entry to KV_RELEASES"):
        memory_plan.backends("0.25.0")


def test_indexshare_layers_have_no_indexer_cache():
    kv = memory_plan.kv_per_token(model_config("glm-5.2"), "FLASHINFER_MLA_SPARSE_SM120", "fp8_ds_mla",
                                  range(78), mtp=True, last_stage=True, vllm=BUILD.vllm_version)
    assert (kv.mla_layers, kv.indexer_layers) == (79, 22)  # 21 full layers + the MTP layer


def test_pipeline_stages_split_layers_and_embeddings():
    cfg, scheme = model_config("glm-5"), SCHEMES["bf16"]
    one = memory_plan.stage_weights(cfg, scheme, tp=1, pp=1, mtp=False)
    two = memory_plan.stage_weights(cfg, scheme, tp=1, pp=2, mtp=True)
    assert [list(s.layers)[:1] + list(s.layers)[-1:] for s in two] == [[0, 38], [39, 77]]
    assert "embed" in two[0].breakdown and "lm_head" not in two[0].breakdown
    assert "lm_head" in two[1].breakdown and "mtp.embed" in two[1].breakdown  # drafter's own copy under PP
    assert "mtp.embed" not in memory_plan.stage_weights(cfg, scheme, tp=1, pp=1, mtp=True)[0].breakdown
    assert sum(s.bytes_per_gpu for s in memory_plan.stage_weights(cfg, scheme, 1, 2, False)) == pytest.approx(
        one[0].bytes_per_gpu)


def test_tensor_parallel_shards_only_sharded_parts():
    cfg, scheme = model_config("glm-5"), SCHEMES["bf16"]
    one = memory_plan.stage_weights(cfg, scheme, tp=1, pp=1, mtp=False)[0].breakdown
    eight = memory_plan.stage_weights(cfg, scheme, tp=8, pp=1, mtp=False)[0].breakdown
    assert eight["mlp.routed_experts"] == one["mlp.routed_experts"] / 8
    assert eight["attn.q_a"] == one["attn.q_a"]  # replicated on every rank


def test_fp8_keeps_bf16_copies_of_kv_b():
    cfg = model_config("glm-5")
    fp8 = memory_plan.stage_weights(cfg, SCHEMES["fp8-block"], tp=8, pp=1, mtp=False)[0].breakdown
    bf16 = memory_plan.stage_weights(cfg, SCHEMES["bf16"], tp=8, pp=1, mtp=False)[0].breakdown
    assert fp8["attn.kv_b_bf16_copy"] == bf16["attn.kv_b"]
    assert "attn.kv_b_bf16_copy" not in bf16


def test_plan_numbers_by_hand_for_8_sparks():
    recipe = load("glm-5.2-nvfp4-8xspark")
    plan = sl.memory_plan_of(recipe, "sm120", BUILD)
    budget = 0.85 * 121.69 * GIB
    per_token = 79 * 656 + 22 * 132
    assert plan.kv.total == per_token
    assert plan.kv_tokens == int((budget - plan.weights_per_gpu) // (per_token * 64)) * 64
    assert plan.fits and plan.full_length_sequences == plan.kv_tokens // 393216 >= 1


@pytest.mark.parametrize("layout", sorted(REFUSED_LAYOUTS))
def test_layouts_that_never_fit_are_refused_with_the_numbers(layout):
    name, overrides, numbers = REFUSED_LAYOUTS[layout]
    recipe = load(name, overrides)
    plan = sl.memory_plan_of(recipe, recipe.targets[0], BUILD)
    assert not plan.fits and f"does not fit: {numbers}" in plan.problem()
    with pytest.raises(sr.LayoutError, match="does not fit"):
        sl.plan_launch(recipe, recipe.targets[0], BUILD, hosts=None, solo=False)


def test_which_recipes_fit():
    fits = {name for name in ALL for t in load(name).targets if sl.memory_plan_of(load(name), t, BUILD).fits}
    assert fits == FITTING and set(ALL) == FITTING


def test_a_plan_refuses_too_little_kv_for_one_request():
    recipe = load("glm-5.2-nvfp4-8xrtxpro6000", ["max_model_len=1048576"])
    problem = sl.memory_plan_of(recipe, "sm120", BUILD).problem()
    assert "fewer than max_model_len 1048576" in problem


def test_gpu_memory_parsing():
    assert GPUS["h200"].memory_bytes == 143771 * 2**20
    assert memory_plan.parse_memory("121.69 GiB") == int(121.69 * GIB)
    with pytest.raises(ValueError):
        memory_plan.parse_memory("96 GB")


# -- recipe files --------------------------------------------------------------------------


def test_every_recipe_loads_and_build_recipes_are_unaffected():
    assert set(ALL) == FITTING
    for name in ALL:
        recipe = sr.load_serve_recipe(name, build=BUILD)
        assert recipe.name == name and recipe.targets
    assert recipe_ids() == ["glm5-dsa"]  # recipes/serve and recipes/models are not build recipes


def test_every_workaround_names_its_bugs_with_evidence_for_every_base():
    for name in ALL:
        recipe = load(name)
        for entry in (*recipe.env, *recipe.workarounds):
            assert entry.reason and entry.link.startswith("https://") and entry.bugs, (name, entry)
        for bug_id in {b for e in (*recipe.env, *recipe.workarounds) for b in e.bugs} | set(recipe.limitations):
            assert set(recipe.bugs[bug_id].bases) == set(BUILD.vllm_versions), (name, bug_id)


def test_no_recipe_keeps_an_expired_workaround():
    assert sr.bug_usage_problems(RECIPES, BUILD) == []


def copy_recipes(tmp_path: Path, name: str, edit) -> Path:
    root = tmp_path / "recipes"
    shutil.copytree(RECIPES, root, ignore=shutil.ignore_patterns("locks", "requirements"))
    path = root / "serve" / f"{name}.toml"
    path.write_text(edit(path.read_text()))
    return root


SPARK = "glm-5.2-nvfp4-8xspark"


@pytest.mark.parametrize("name, edit, error, message", [
    (SPARK, lambda t: "bogus = 1\n" + t, sr.RecipeFileError, "unknown keys bogus"),
    (SPARK, lambda t: t.replace('hf_id = "nvidia/GLM-5.2-NVFP4"\n', ""), sr.RecipeFileError, "missing key 'hf_id'"),
    (SPARK, lambda t: t.replace("max_model_len = 393216", 'max_model_len = "long"'), sr.RecipeFileError,
     "vllm.max_model_len: expected int"),
    (SPARK, lambda t: t.replace('model = "glm-5.2"', 'model = "glm-9"'), sr.RecipeFileError, "unknown model 'glm-9'"),
    (SPARK, lambda t: t.replace('quantization = "nvfp4-routed-experts"', 'quantization = "int3"'),
     sr.RecipeFileError, "quantization 'int3' unknown"),
    (SPARK, lambda t: t.replace('sm120 = "dgx-spark"', 'sm120 = "b200"'), sr.RecipeFileError, "needs the sm100 image"),
    (SPARK, lambda t: t.replace('sm120 = "dgx-spark"', 'sm75 = "dgx-spark"'), sr.RecipeFileError,
     "not a target of glm5-dsa"),
    (SPARK, lambda t: t.replace('link = "https://github.com/flashinfer-ai/flashinfer/issues/3610"\n', ""),
     sr.RecipeFileError, "needs exactly value, reason, link and bugs"),
    (SPARK, lambda t: t.replace('bugs = ["flashinfer-3610"]\n', ""), sr.RecipeFileError,
     "needs exactly value, reason, link and bugs"),
    (SPARK, lambda t: t.replace('bugs = ["flashinfer-3610"]', 'bugs = ["flashinfer-9"]'), sr.RecipeFileError,
     "env.VLLM_USE_FLASHINFER_SAMPLER: unknown bugs flashinfer-9"),
    (SPARK, lambda t: t.replace('bugs = ["flashinfer-3610"]', "bugs = []"), sr.RecipeFileError,
     "expected a list of bug ids"),
    (SPARK, lambda t: t.replace('blockers = ["vllm-sm120-flashinfer-sparse-mla-api"]', 'blockers = ["x"]'),
     sr.RecipeFileError, "blockers: unknown bugs x"),
    (SPARK, lambda t: t.replace("https://github.com/flashinfer-ai/flashinfer/issues/3610", "see chat"),
     sr.RecipeFileError, "must be an https:// URL"),
    (SPARK, lambda t: t + '[workarounds.max_num_batched_tokens]\nreason = "r"\nlink = "https://x"\n'
                          'bugs = ["flashinfer-3700"]\n', sr.RecipeFileError, "sets no vllm.max_num_batched_tokens"),
    (SPARK, lambda t: t.replace('max_num_seqs = 4', 'max_num_seqs = 4\nmax_num_batched_tokens = 64') +
     '[workarounds.max_num_batched_tokens]\nreason = "r"\nlink = "https://x"\n', sr.RecipeFileError,
     "workarounds.max_num_batched_tokens: needs exactly reason, link and bugs"),
    (SPARK, lambda t: t.replace('kv_cache_dtype = "fp8_ds_mla"', 'kv_cache_dtype = "bfloat16"'),
     sr.RecipeFileError, "does not take kv_cache_dtype 'bfloat16'"),
    (SPARK, lambda t: t.replace('index_topk_pattern = "FFFS', 'index_topk_pattern = "FFFF'), sr.RecipeFileError,
     "differs from the one glm-5.2's config gives"),
    (SPARK, lambda t: t.replace("max_model_len = 393216", "max_model_len = 2000000"), sr.RecipeFileError,
     "exceeds the model's max_position_embeddings 1048576"),
    (SPARK, lambda t: t.replace('attention_backend = "FLASHINFER_MLA_SPARSE_SM120"',
                                'attention_backend = "FLASHINFER_MLA_SPARSE"'), sr.TargetError,
     "runs on compute capability 10.x"),
    ("tiny-glm5", lambda t: t.replace('port = 8000', 'port = 8000\nspeculative_method = "mtp"\n'
                                      'num_speculative_tokens = 1'), sr.RecipeFileError,
     "MTP needs a model with an MTP layer"),
    (SPARK, lambda t: t.replace("tensor_parallel_size = 8", "tensor_parallel_size = 3"), sr.LayoutError,
     "tensor_parallel_size 3 does not divide the 64 attention heads"),
    (SPARK, lambda t: t.replace("pipeline_parallel_size = 1", "pipeline_parallel_size = 5"), sr.LayoutError,
     "pipeline_parallel_size 5 does not divide the 78 layers"),
    (SPARK, lambda t: t.replace("nodes = 8", "nodes = 4"), sr.LayoutError, "4 node(s) x 1 GPU(s) = 4 GPUs"),
    (SPARK, lambda t: t + "[[", sr.RecipeFileError, "not valid TOML"),
])
def test_schema_errors_name_the_problem(tmp_path, name, edit, error, message):
    root = copy_recipes(tmp_path, name, edit)
    with pytest.raises(error) as caught:
        sr.load_serve_recipe(name, root, BUILD)
    assert message in str(caught.value)
    assert type(caught.value) is error


TINY = "tiny-glm5"
TINY_HARDWARE = '[hardware]\nsm120 = "rtx-pro-6000"\nsm100 = "b200"\nsm90 = "h200"\n'


@pytest.mark.parametrize("name, edit, message", [
    # issue #24 item 15: each of these was a traceback, or accepted
    (TINY, lambda t: t.replace('sm120 = "rtx-pro-6000"', 'sm120 = ["rtx-pro-6000"]'),
     "hardware.sm120: expected str, found ['rtx-pro-6000']"),
    (TINY, lambda t: t.replace(TINY_HARDWARE, '[hardware.sm120]\ngpu = "rtx-pro-6000"\n'),
     "hardware.sm120: expected str, found {'gpu': 'rtx-pro-6000'}"),
    (TINY, lambda t: 'hardware = ["sm120"]\n' + t.replace(TINY_HARDWARE, ""), "hardware: expected dict"),
    (TINY, lambda t: t.replace("max_model_len = 8192", "max_model_len = 0"), "vllm.max_model_len = 0: must be at least 1"),
    (TINY, lambda t: t.replace("max_model_len = 8192", "max_model_len = -5"), "vllm.max_model_len = -5: must be at least 1"),
    (TINY, lambda t: t.replace("port = 8000", "port = -1"), "vllm.port = -1: must be at least 1 and at most 65535"),
    (TINY, lambda t: t.replace("port = 8000", "port = 99999999999"), "vllm.port = 99999999999: must be at least 1"),
    (TINY, lambda t: t.replace("block_size = 64", "block_size = -64"), "vllm.block_size = -64: must be at least 1"),
    (SPARK, lambda t: t.replace("max_num_seqs = 4", "max_num_seqs = -3"), "vllm.max_num_seqs = -3: must be at least 1"),
    (TINY, lambda t: t.replace("nodes = 1", "nodes = 0"), "layout.nodes = 0: must be at least 1"),
    (TINY, lambda t: t.replace('model = "tiny-glm5"', 'model = "../glm5-dsa"'), "model '../glm5-dsa': not a plain file name"),
    (TINY, lambda t: t + '[env.""]\nvalue = "1"\nreason = "r"\nlink = "https://x"\nbugs = ["flashinfer-3610"]\n', "env.: '' is not an environment"),
    (TINY, lambda t: t.replace('hf_id = "/opt/dsa-image/models/tiny-glm5"', 'hf_id = "--load-format=x"'),
     "hf_id '--load-format=x': expected a model id or path"),
])
def test_recipe_values_out_of_the_schemas_range_are_one_clear_error(tmp_path, name, edit, message):
    root = copy_recipes(tmp_path, name, edit)
    with pytest.raises(sr.RecipeFileError) as caught:
        sr.load_serve_recipe(name, root, BUILD)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_recipe_that_is_not_utf8_is_named_and_the_list_shows_the_others(tmp_path, capsys):
    root = copy_recipes(tmp_path, TINY, lambda t: t)
    (root / "serve" / "broken.toml").write_bytes(b'description = "caf\xe9"\n')
    with pytest.raises(sr.RecipeFileError, match=r"broken.toml: not UTF-8 \(byte 18\)"):
        sr.load_serve_recipe("broken", root, BUILD)
    assert sc.main(["--list"], recipes_dir=root) == 0
    listing = capsys.readouterr().out.splitlines()
    broken = next(line for line in listing if line.startswith("broken "))
    assert "INVALID" in broken and "not UTF-8" in broken
    assert {line.split()[0] for line in listing[1:]} == {*ALL, "broken"}


@pytest.mark.parametrize("escape", ["../outside", "ABSOLUTE"])
def test_a_recipe_name_is_a_plain_file_name(tmp_path, capsys, escape):
    """`../x` and `/tmp/x` loaded the file there (and named the container dsa-/tmp/x)."""
    root = copy_recipes(tmp_path, TINY, lambda t: t)
    shutil.copy(root / "serve" / f"{TINY}.toml", root / "outside.toml")  # recipes/serve/../outside.toml
    name = str(root / "outside") if escape == "ABSOLUTE" else escape
    assert sc.main([name, "--dry-run"], recipes_dir=root) == 2
    err = capsys.readouterr().err
    assert err == f"serve: recipe {name!r}: not a plain file name (letters, digits, '.', '_', '-'; no '/')\n"


@pytest.mark.parametrize("assignment, message", [
    ("block_size=0", "vllm.block_size = 0: must be at least 1"),  # was a ZeroDivisionError
    ("tensor_parallel_size=0", "layout.tensor_parallel_size = 0: must be at least 1"),  # ZeroDivisionError too
    ("max_model_len=-5", "vllm.max_model_len = -5: must be at least 1"),
    ("port=99999999999", "vllm.port = 99999999999: must be at least 1 and at most 65535"),
    ("max_num_seqs=-3", "vllm.max_num_seqs = -3: must be at least 1"),
    ("gpu_memory_utilization=nan", "vllm.gpu_memory_utilization = nan: must be above 0 and at most 1"),
    ("env.=1", "env.: '' is not an environment variable name"),
    ("env.A B=1", "env.A B: 'A B' is not an environment variable name"),
    ("hf_id=", "hf_id '': expected a model id or path"),
    ("hardware.sm75=b200", "hardware target 'sm75' is not a target of glm5-dsa"),
])
def test_cli_overrides_out_of_range_exit_2_with_one_line(assignment, message):
    done = serve(TINY, "--dry-run", "--set", assignment)
    assert done.returncode == 2 and message in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr


def test_the_images_recipe_mode_refuses_an_empty_variable_name():
    """`--set env.=1` reached os.execvpe, which raised on the empty name."""
    plan = sc.image_mode([TINY, "--set", "env.=1"], IMAGE_ENV)
    assert (plan.exit_code, plan.argv) == (2, []) and "not an environment variable name" in plan.error


def test_recipe_without_a_name_in_the_image_names_its_own_recipes_apart_from_other_images():
    """Issue #24 item 23: it listed every recipe, and naming one of another image was exit 5."""
    plan = sc.image_mode([], IMAGE_ENV)
    assert plan.exit_code == 2
    ours, _, others = plan.error.partition("; for other images: ")
    sm120 = sorted(n for n in ALL if "sm120" in load(n).targets)
    assert ours == f"name a recipe (or --list); recipes for this image (sm120): {', '.join(sm120)}"
    assert others == "glm-5-fp8-8xb200 (sm100)"


# The block sizes a backend takes are its release's: FLASHINFER_MLA_SPARSE_SM120 takes 64 and 256 on
# vLLM 0.24.0, any multiple of 64 on 0.33.0 (memory_plan.KV_RELEASES).
@pytest.mark.parametrize("vllm, block, message", [
    ("0.24.0", 128, "FLASHINFER_MLA_SPARSE_SM120 takes block sizes 64, 256, not 128"),
    ("0.33.0", 96, "FLASHINFER_MLA_SPARSE_SM120 takes block sizes multiples of 64, not 96"),
])
def test_a_block_size_the_releases_backend_does_not_take_is_named(tmp_path, vllm, block, message):
    root = copy_recipes(tmp_path, SPARK, lambda t: t.replace("block_size = 64", f"block_size = {block}"))
    with pytest.raises(sr.RecipeFileError) as caught:
        sr.load_serve_recipe(SPARK, root, load_recipe(vllm=vllm))
    assert message in str(caught.value)
    assert type(caught.value) is sr.RecipeFileError


def test_model_file_errors(tmp_path):
    root = copy_recipes(tmp_path, "tiny-glm5", lambda t: t)
    model = root / "models" / "glm-5.2.toml"
    model.write_text(model.read_text().replace('index_skip_topk_offset = "https://github.com/eugr/spark-vllm-docker/'
                                               'blob/main/recipes/glm-5.2-nvfp4.yaml"\n', ""))
    with pytest.raises(sr.RecipeFileError, match="without a source in \\[published_sources\\]: index_skip_topk_offset"):
        sr.load_model("glm-5.2", root)


# -- overrides and vLLM arguments ----------------------------------------------------------


def test_overrides_are_typed_and_rendered():
    recipe = load(SPARK, ["max_model_len=65536", "enable_prefix_caching=false", "num_speculative_tokens=3",
                          "env.NCCL_DEBUG=INFO", "hf_id=/models/glm52"])
    args = sl.vllm_args(recipe, "sm120", BUILD, ["--enable-log-requests"])
    assert args[0] == "/models/glm52"
    assert args[args.index("--max-model-len") + 1] == "65536"
    assert "--no-enable-prefix-caching" in args and "--enable-prefix-caching" not in args
    assert args[args.index("--speculative-config") + 1] == '{"method":"mtp","num_speculative_tokens":3}'
    assert args[-1] == "--enable-log-requests"
    assert sl.environment(recipe, "sm120", BUILD)["NCCL_DEBUG"] == "INFO"


def test_unsetting_a_setting_falls_back_to_the_target_default():
    # The sm90 target's attention backend is one a base adjusts: each release's own default.
    for vllm, backend in [("0.24.0", "FLASHMLA_SPARSE"), ("0.33.0", "FLASH_ATTN_MLA_SPARSE")]:
        build = load_recipe(vllm=vllm)
        recipe = sr.apply_overrides(sr.load_serve_recipe("tiny-glm5", build=build), ["attention_backend="], build)
        args = sl.vllm_args(recipe, "sm90", build)
        assert args[args.index("--attention-backend") + 1] == backend, vllm
        assert args[args.index("--kv-cache-dtype") + 1] == "auto", vllm


@pytest.mark.parametrize("assignment, error, message", [
    ("gpu_memory_utilization=lots", sr.RecipeFileError, "is not float"),
    ("enable_prefix_caching=maybe", sr.RecipeFileError, "is not a boolean"),
    ("colour=blue", sr.RecipeFileError, "unknown key 'colour'"),
    ("max_model_len", sr.RecipeFileError, "expected KEY=VALUE"),
    ("tensor_parallel_size=6", sr.LayoutError, "does not divide the 64 attention heads"),
    ("gpu_memory_utilization=1.5", sr.RecipeFileError, "must be above 0 and at most 1"),
    ("hardware.sm120=nope", sr.RecipeFileError, "unknown GPU 'nope'"),
])
def test_bad_overrides(assignment, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(SPARK, [assignment])


# -- workarounds per base -------------------------------------------------------------------

OLD = load_recipe(vllm="0.24.0")
# A recipe with a [vllm] setting that works around flashinfer-3610 (present on 0.24.0 only).
CAPPED = (lambda t: t.replace("max_num_seqs = 4", "max_num_seqs = 4\nmax_num_batched_tokens = 64")
          + '[workarounds.max_num_batched_tokens]\nreason = "r"\nlink = "https://x"\nbugs = ["flashinfer-3610"]\n')
RTX8 = "glm-5.2-nvfp4-8xrtxpro6000"


def test_a_workaround_applies_only_on_a_base_that_has_its_bug(tmp_path):
    root = copy_recipes(tmp_path, RTX8, CAPPED)
    for build, applied in ((BUILD, False), (OLD, True)):
        recipe = sr.load_serve_recipe(RTX8, root, build)
        args = sl.vllm_args(recipe, "sm120", build)
        assert ("--max-num-batched-tokens" in args) is applied, build.vllm_version
        assert ("VLLM_USE_FLASHINFER_SAMPLER" in sl.environment(recipe, "sm120", build)) is applied
        assert sl.unapplied_settings(recipe, "sm120", build) == (set() if applied else {"max_num_batched_tokens"})


def test_setting_a_workarounds_value_makes_it_the_users_on_every_base(tmp_path):
    root = copy_recipes(tmp_path, RTX8, CAPPED)
    recipe = sr.apply_overrides(sr.load_serve_recipe(RTX8, root, BUILD), ["max_num_batched_tokens=64",
                                                                          "env.VLLM_USE_FLASHINFER_SAMPLER=0"], BUILD)
    args = sl.vllm_args(recipe, "sm120", BUILD)
    assert args[args.index("--max-num-batched-tokens") + 1] == "64"
    assert sl.environment(recipe, "sm120", BUILD)["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert recipe.workarounds == ()


def test_the_plan_prints_per_base_which_workarounds_apply_and_why(tmp_path):
    root = copy_recipes(tmp_path, RTX8, CAPPED)
    launch = sl.plan_launch(sr.load_serve_recipe(RTX8, root, BUILD), "sm120", BUILD, hosts=None, solo=True)
    text = sl.describe(launch)
    block = text[text.index("workarounds, per vLLM base"):text.index("blockers")]
    assert "  max_num_batched_tokens=64: r\n    vLLM 0.33.0 (this plan): not applied: flashinfer-3610 fixed" in block
    assert "    vLLM 0.24.0: applied: flashinfer-3610 present: flashinfer-python 0.6.12, fixed in 0.6.14" in block
    assert "  env VLLM_USE_FLASHINFER_SAMPLER=0: " in block
    w4a16 = sl.describe(sl.plan_launch(load("glm-5.2-w4a16-4xspark"), "sm120", BUILD, hosts=None, solo=False))
    assert ("limitations (what shaped this recipe):\n  vllm-sm120-sparse-mla-lse: " in w4a16
            and "    vLLM 0.33.0 (this plan): vllm-sm120-sparse-mla-lse present: vllm 0.33.0; its source has the bug"
            in w4a16)


def test_a_blocker_refuses_its_base_and_target_only():
    for name in ALL:
        recipe = load(name)
        for target in recipe.targets:
            blocked = sr.blocking(sr.load_serve_recipe(name, build=OLD), target, OLD)
            assert [b.id for b in blocked] == (["vllm-sm120-flashinfer-sparse-mla-api"] if target == "sm120" else [])
            assert sr.blocking(recipe, target, BUILD) == []
    with pytest.raises(sr.TargetError, match="cannot run on the vLLM 0.24.0 sm120 image.*Use --vllm 0.33.0"):
        sl.plan_launch(sr.load_serve_recipe("tiny-glm5", build=OLD), "sm120", OLD, hosts=None, solo=True)
    sl.plan_launch(sr.load_serve_recipe("tiny-glm5", build=OLD), "sm90", OLD, hosts=None, solo=True)


def test_a_workaround_whose_bugs_no_base_has_is_expired(tmp_path):
    root = copy_recipes(tmp_path, SPARK, lambda t: t.replace('bugs = ["flashinfer-3610"]',
                                                             'bugs = ["flashinfer-3700"]'))
    problems = sr.bug_usage_problems(root, BUILD)
    assert len(problems) == 1
    assert "env.VLLM_USE_FLASHINFER_SAMPLER: flashinfer-3700 present on no vLLM base" in problems[0]
    gone = root / "bugs" / "vllm-sm120-sparse-mla-lse.toml"
    gone.write_text(gone.read_text().replace('verdict = "present"', 'verdict = "fixed"'))
    assert any("limitations: vllm-sm120-sparse-mla-lse present on no vLLM base" in p
               for p in sr.bug_usage_problems(root, BUILD))


# -- dry runs and refusals from the command line --------------------------------------------


def serve(*args: str) -> subprocess.CompletedProcess:
    # From / and with the checkout's python alone: a fresh clone without a GPU, as a user runs it.
    return subprocess.run([sys.executable, str(SERVE), *args], capture_output=True, text=True, cwd="/")


def test_cli_list():
    done = serve("--list")
    assert done.returncode == 0, done.stderr
    for name in ALL:
        assert name in done.stdout
    assert "REFUSED" not in done.stdout and "BLOCKED" not in done.stdout
    assert "glm-5.2-w4a16-4xspark       sm120   4x1 NVIDIA DGX Spark (GB10) (cluster)" in done.stdout
    old = serve("--list", "--vllm", "0.24.0").stdout.splitlines()
    assert [line.split()[0] for line in old if "BLOCKED on vLLM 0.24.0" in line] == [
        name for name in ALL if "sm120" in load(name).targets]


def test_cli_dry_run_solo_prints_the_exact_commands():
    done = serve("glm-5.2-nvfp4-8xrtxpro6000", "--dry-run")
    assert done.returncode == 0, done.stderr
    docker = next(shlex.split(line) for line in done.stdout.splitlines() if line.startswith("docker run"))
    recipe = load("glm-5.2-nvfp4-8xrtxpro6000")
    image = docker.index(f"dsa-image:{BUILD.vllm_version}-sm120")  # no --vllm: the default base's image
    assert docker[image + 1:] == ["serve", *sl.vllm_args(recipe, "sm120", BUILD)]
    for expected in (["--gpus", "all"], ["--ipc=host"], ["-p", "8000:8000"], ["-e", "VLLM_USE_B12X_SPARSE_INDEXER=1"]):
        assert any(docker[i:i + len(expected)] == expected for i in range(image)), expected
    # flashinfer-3610 is fixed in 0.33.0's FlashInfer: its workaround is not applied, and the plan says why
    assert "VLLM_USE_FLASHINFER_SAMPLER=0" not in docker
    assert ("    vLLM 0.33.0 (this plan): not applied: flashinfer-3610 fixed: flashinfer-python 0.7.2.post1, fixed in "
            "0.6.14; its source has the fix\n    vLLM 0.24.0: applied: flashinfer-3610 present: flashinfer-python "
            "0.6.12, fixed in 0.6.14; its source has the bug\n") in done.stdout
    assert any(w.endswith(":/home/vllm/.cache/huggingface") for w in docker)
    assert "KV tokens that fit: 553216" in done.stdout


@pytest.mark.parametrize("args, code, message", [
    (["glm-5.2-nvfp4-8xspark", "--solo", "--dry-run"], status.REFUSED, "is cluster-only: it needs 8 nodes"),
    (["glm-5.2-nvfp4-8xrtxpro6000", "--dry-run", "--set", "gpus_per_node=4", "--set", "tensor_parallel_size=4"], status.REFUSED,
     "111.6 GiB of weights per GPU"),
    (["glm-5.2-w4a16-4xspark", "--dry-run", "--vllm", "0.24.0"], status.REFUSED,
     "cannot run on the vLLM 0.24.0 sm120 image: vllm-sm120-flashinfer-sparse-mla-api"),
    (["glm-5.2-nvfp4-8xrtxpro6000", "--dry-run", "--target", "sm90"], status.REFUSED, "runs on the sm120 image(s), not sm90"),
    (["glm-5.2-nvfp4-8xspark", "--dry-run", "--nodes", "a,b"], status.REFUSED, "needs 8 node(s), --nodes gave 2"),
    (["glm-5.2-nvfp4-8xspark", "--dry-run", "--set", "tensor_parallel_size=5"], status.REFUSED, "does not divide the 64"),
    (["glm-5.2-nvfp4-8xspark", "--dry-run", "--set", "pipeline_parallel_size=5", "--set", "nodes=40"], status.REFUSED,
     "does not divide the 78 layers"),
    (["glm-9", "--dry-run"], status.USAGE, "unknown recipe 'glm-9'"),
    (["--dry-run"], status.USAGE, "name a recipe"),
])
def test_cli_refusals(args, code, message):
    done = serve(*args)
    assert (done.returncode, message in done.stderr) == (code, True), done.stderr


def cluster(backend: str) -> sl.Launch:
    recipe = load(SPARK, [f"cluster_backend={backend}"])
    return sl.plan_launch(recipe, "sm120", BUILD, hosts=SPARK8_HOSTS, solo=False, ifname="enp1s0")


def test_mp_cluster_runs_headless_workers():
    launch = cluster("mp")
    for node in launch.nodes:
        words = node.docker
        assert words[words.index("--node-rank") + 1] == str(node.rank)
        assert words[words.index("--master-addr") + 1] == "10.0.0.1"
        assert ("--headless" in words) == (node.rank > 0) and ("-d" in words) == (node.rank > 0)
        assert "--network" in words and "NCCL_SOCKET_IFNAME=enp1s0" in words
    assert launch.vllm[:2] == ["vllm", "serve"] and "--headless" not in launch.vllm
    assert not any("PENDING" in n for n in launch.notes)


def test_ray_cluster_follows_run_cluster_sh():
    launch = cluster("ray")
    head, workers = launch.nodes[0], launch.nodes[1:]
    assert head.docker[-1:] == ["ray-head"] and "RAY_PORT=6379" in head.docker
    assert all(w.docker[-2:] == ["ray-worker", "10.0.0.1:6379"] for w in workers)
    assert head.then[:3] == ["docker", "exec", "dsa-glm-5.2-nvfp4-8xspark-head"]
    assert head.then[-2:] == ["--distributed-executor-backend", "ray"]
    assert any(f"VLLM_HOST_IP={w.address}" in w.docker for w in workers)
    assert not any("PENDING" in n for n in launch.notes)


# -- launching -----------------------------------------------------------------------------


class Recorder:
    def __init__(self, nvidia_smi: str = "NVIDIA RTX PRO 6000 Blackwell, 12.0\n"):
        self.calls, self.nvidia_smi = [], nvidia_smi

    def __call__(self, argv, **_):
        self.calls.append(argv)
        out = self.nvidia_smi if argv[0] == "nvidia-smi" else ""
        return SimpleNamespace(returncode=0, stdout=out, stderr="")


@pytest.fixture
def with_nvidia_smi(monkeypatch):
    monkeypatch.setattr(sx.shutil, "which", lambda name: f"/usr/bin/{name}")


def test_launch_solo_runs_docker_here(with_nvidia_smi, capsys):
    run = Recorder()
    assert sc.main(["glm-5.2-nvfp4-8xrtxpro6000"], run=run) == 0
    assert run.calls[0][0] == "nvidia-smi"
    assert run.calls[1][:3] == ["docker", "run", "--rm"] and len(run.calls) == 2


def test_launch_mp_cluster_starts_workers_over_ssh_then_the_head(with_nvidia_smi, monkeypatch):
    monkeypatch.setattr(sx, "host_gpu_problem", lambda *a, **k: None)
    run = Recorder()
    code = sc.main([SPARK, "--set", "cluster_backend=mp", "--nodes", ",".join(SPARK8_HOSTS)], run=run)
    assert code == 0
    assert [c[:2] for c in run.calls[:7]] == [["ssh", h] for h in SPARK8_HOSTS[1:]]
    assert "--node-rank 1" in run.calls[0][2] and run.calls[7][:2] == ["docker", "run"]
    # the head's vllm ended: the workers it needs are stopped, the last started first
    assert run.calls[8:] == [["ssh", h, f"docker stop dsa-{SPARK}-node{i}"] for i, h in reversed(
        list(enumerate(SPARK8_HOSTS))[1:])]


def test_wrong_gpu_family_is_refused(with_nvidia_smi):
    run = Recorder(nvidia_smi="NVIDIA H200, 9.0\n")
    problem = sx.host_gpu_problem("sm120", BUILD, run)
    assert "built for compute capability 12.0, 12.1; this host has NVIDIA H200 (9.0)" in problem
    assert sc.main(["glm-5.2-nvfp4-8xrtxpro6000"], run=run) == sr.REFUSED
    assert sx.host_gpu_problem("sm90", BUILD, run) is None


def test_no_driver_is_refused_but_dry_run_needs_none(monkeypatch):
    monkeypatch.setattr(sx.shutil, "which", lambda name: None)
    assert "nvidia-smi not found" in sx.host_gpu_problem("sm120", BUILD)
    assert sc.main(["tiny-glm5", "--dry-run"], run=Recorder()) == 0


# -- launching on a real host: real processes, a fake docker / ssh / nvidia-smi ------------------
#
# The launcher's own subprocess.run starts them: ssh runs the command it is handed through a real
# /bin/sh (as a worker's login shell does, with that worker's HOME), docker records its argv.

FAKE_DOCKER = """#!{python}
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_DOCKER_LOG"], "a") as log:
    log.write(json.dumps({{"node": os.environ.get("FAKE_NODE", "here"), "argv": args}}) + "\\n")
if args[:1] == ["run"] and "-d" not in args:  # the foreground container: the head's (or solo)
    sys.exit(int(os.environ.get("FAKE_HEAD_EXIT", "0")))
"""
FAKE_SSH = """#!/bin/sh
FAKE_NODE="$1"; export FAKE_NODE; shift
HOME="$FAKE_REMOTE_HOME" exec /bin/sh -c "$*"
"""
FAKE_NVIDIA_SMI = """#!/bin/sh
echo "NVIDIA RTX PRO 6000 Blackwell, 12.0"
"""


@pytest.fixture
def host_tools(tmp_path, monkeypatch) -> SimpleNamespace:
    """docker, ssh and nvidia-smi stand-ins first on PATH; this host's HOME and the workers' apart."""
    bin_dir, here, remote = tmp_path / "bin", tmp_path / "home-here", tmp_path / "home-remote"
    for directory in (bin_dir, here, remote):
        directory.mkdir()
    for name, text in (("docker", FAKE_DOCKER.format(python=sys.executable)), ("ssh", FAKE_SSH),
                       ("nvidia-smi", FAKE_NVIDIA_SMI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "docker.log"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(here))
    monkeypatch.setenv("FAKE_REMOTE_HOME", str(remote))
    monkeypatch.setenv("FAKE_DOCKER_LOG", str(log))

    def calls() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return SimpleNamespace(here=here, remote=remote, calls=calls, bin=bin_dir)


def _volume(argv: list[str]) -> str:
    return argv[argv.index("-v") + 1]


MP_CLUSTER = [SPARK, "--set", "cluster_backend=mp", "--nodes", ",".join(SPARK8_HOSTS)]


def test_a_launch_hands_docker_real_paths_and_a_failed_head_stops_the_workers_it_started(host_tools, monkeypatch):
    """Issue #24 item 12: the head's docker run got the literal `"$HOME/.cache/huggingface":...`
    (rejected by the engine), and a failed head left the seven workers running."""
    monkeypatch.setenv("FAKE_HEAD_EXIT", "125")
    assert sc.main(MP_CLUSTER) == 125
    calls = host_tools.calls()
    workers = [f"dsa-{SPARK}-node{i}" for i in range(1, 8)]
    starts, head, stops = calls[:7], calls[7], calls[8:]
    assert [(c["node"], c["argv"][:2]) for c in starts] == [(h, ["run", "-d"]) for h in SPARK8_HOSTS[1:]]
    assert head["node"] == "here" and head["argv"][:2] == ["run", "--rm"]
    cache = ".cache/huggingface:/home/vllm/.cache/huggingface"
    assert _volume(head["argv"]) == f"{host_tools.here}/{cache}"  # this host's home, expanded here
    assert {_volume(c["argv"]) for c in starts} == {f"{host_tools.remote}/{cache}"}  # each worker's own
    assert [(c["node"], c["argv"]) for c in stops] == [(h, ["stop", n]) for h, n in
                                                       reversed(list(zip(SPARK8_HOSTS[1:], workers, strict=True)))]


def test_a_worker_that_fails_to_start_stops_the_ones_before_it_and_starts_no_head(host_tools, monkeypatch):
    fail_third = host_tools.bin / "ssh"
    fail_third.write_text(FAKE_SSH.replace('FAKE_NODE="$1"', f'[ "$1" = {SPARK8_HOSTS[3]} ] && exit 255\nFAKE_NODE="$1"'))
    assert sc.main(MP_CLUSTER) == 255
    calls = host_tools.calls()
    assert [c["node"] for c in calls] == [*SPARK8_HOSTS[1:3], *reversed(SPARK8_HOSTS[1:3])]
    assert [c["argv"][0] for c in calls] == ["run", "run", "stop", "stop"]


INJECTED = ['~/x";touch {pwned}/hf;"', "eth0;touch {pwned}/ifname", "$(touch {pwned}/env)", "';touch {pwned}/name;'",
            "`touch {pwned}/extra`"]


def test_user_values_reach_docker_verbatim_through_every_shell_and_run_nothing(host_tools, tmp_path, capsys):
    """Issue #24 item 13: --hf-cache was pasted unquoted into the printed command and the
    worker's ssh command. Each value below goes through the worker's real shell (ssh) and through
    a shell running each printed command; none may run anything, each must arrive as it was."""
    pwned = tmp_path / "pwned"
    pwned.mkdir()
    hf, ifname, env, name, extra = (v.format(pwned=pwned) for v in INJECTED)
    argv = [*MP_CLUSTER, "--hf-cache", hf, "--ifname", ifname, "--set", f"env.NCCL_DEBUG={env}",
            "--set", f"served_model_name={name}", "--", "--extra", extra]
    code = sc.main(argv)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("docker ")]
    pasted = [subprocess.run(["/bin/sh", "-c", line], env={**os.environ, "FAKE_NODE": "pasted"}).returncode
              for line in printed]  # what a user pastes into a shell on each node
    assert sorted(p.name for p in pwned.iterdir()) == []
    assert (code, pasted) == (0, [0] * 8)
    calls = [c for c in host_tools.calls() if c["argv"][0] == "run"]
    assert len(calls) == 2 * 8  # the launch's eight containers and the eight printed commands
    rest = hf[2:] + ":/home/vllm/.cache/huggingface"
    for call in calls:
        words = call["argv"]
        home = host_tools.remote if call["node"] in SPARK8_HOSTS else host_tools.here
        assert _volume(words) == f"{home}/{rest}", call["node"]
        for expected in (f"NCCL_SOCKET_IFNAME={ifname}", f"NCCL_DEBUG={env}", name, extra):
            assert expected in words, (expected, call["node"])


@pytest.mark.parametrize("option, message", [
    ("--hf-cache=hf:/etc", "--hf-cache 'hf:/etc': expected ~/PATH, an absolute path or a Docker volume name"),
    ("--hf-cache=./cache", "--hf-cache './cache': expected ~/PATH"),
    ("--image=-v/:/host", "--image '-v/:/host': not an image repository"),
    ("--nodes=-oProxyCommand=touch x", "--nodes: '-oProxyCommand=touch x' is not a host name or address"),
])
def test_launcher_options_docker_or_ssh_would_misread_are_refused(option, message):
    done = serve("tiny-glm5", "--dry-run", option)
    assert done.returncode == 2 and done.stderr.startswith(f"serve: {message}"), done.stderr
    assert done.stderr.count("\n") == 1 and done.stdout == ""


@pytest.mark.docker
def test_the_engine_accepts_every_argument_of_the_tiny_recipes_docker_run(docker_client, base_image, tmp_path,
                                                                           monkeypatch):
    """The argv `scripts/serve.py tiny-glm5` hands subprocess.run, given to the real engine as
    `docker create` (nothing starts, no GPU needed) with only the image swapped for one this
    engine has (the tag the recipe names is built later, or elsewhere; the `base_image` fixture's,
    which is here or served by a registry, or the test skips saying how to make one): the engine
    must take every other argument as the launcher wrote it. Issue #24 item 12: it refused the
    literal "$HOME/..." word."""
    from conftest import _unavailable

    image = base_image
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(sx, "host_gpu_problem", lambda *a, **k: None)
    run = Recorder()
    assert sc.main(["tiny-glm5"], run=run) == 0
    (argv,) = run.calls
    recipe_image = image_ref_of(argv)
    assert argv[:2] == ["docker", "run"]
    created = ["docker", "create", *argv[2:]]
    created[created.index(recipe_image)] = image
    name = argv[argv.index("--name") + 1]
    if subprocess.run(["docker", "container", "inspect", name], capture_output=True).returncode == 0:
        _unavailable(f"a container named {name} exists in this engine; remove it (docker rm -f {name}) to run this")
    done = subprocess.run(created, capture_output=True, text=True, timeout=120)
    try:
        assert done.returncode == 0, f"{shlex.join(created)}\n{done.stderr}"
        info = docker_client.api.inspect_container(done.stdout.strip())
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
    host = info["HostConfig"]
    assert host["Binds"] == [f"{tmp_path}/.cache/huggingface:/home/vllm/.cache/huggingface"]
    assert host["IpcMode"] == "host" and host["AutoRemove"] and host["PortBindings"]["8000/tcp"][0]["HostPort"] == "8000"
    assert [r["Count"] for r in host["DeviceRequests"]] == [-1]  # --gpus all
    assert info["Config"]["Cmd"] == argv[argv.index(recipe_image) + 1:]
    assert "VLLM_USE_B12X_SPARSE_INDEXER=1" in info["Config"]["Env"]


def image_ref_of(argv: list[str]) -> str:
    return next(w for w in argv if w.startswith(f"{sl.IMAGE_REPOSITORY}:"))


# -- the image's recipe mode ---------------------------------------------------------------

IMAGE_ENV = {"DSA_IMAGE_TOOL": str(REPO), "DSA_IMAGE_TARGET": "sm120", "DSA_IMAGE_RECIPE": "glm5-dsa"}


def test_image_mode_list_and_dry_run():
    listing = sc.image_mode(["--list"], IMAGE_ENV)
    assert listing.exit_code == 0 and "tiny-glm5" in listing.output and "sm90" not in listing.output
    dry = sc.image_mode(["glm-5.2-nvfp4-8xspark", "--dry-run"], IMAGE_ENV)
    assert dry.exit_code == 0 and not dry.argv and "ray-worker HEAD_ADDR:6379" in dry.output


def test_image_mode_serves_in_this_container():
    plan = sc.image_mode(["tiny-glm5"], {**IMAGE_ENV, "VLLM_USE_B12X_SPARSE_INDEXER": "0"})
    assert plan.argv[:3] == ["vllm", "serve", "/opt/dsa-image/models/tiny-glm5"]
    assert plan.argv[plan.argv.index("--attention-backend") + 1] == "FLASHINFER_MLA_SPARSE_SM120"
    assert "VLLM_USE_B12X_SPARSE_INDEXER" not in plan.env  # the container's own value wins


@pytest.mark.parametrize("args, environ, code, message", [
    (["glm-5-fp8-8xb200"], IMAGE_ENV, status.REFUSED, "runs on the sm100 image(s), not sm120"),
    (["glm-5.2-nvfp4-8xspark", "--nodes", ",".join(SPARK8_HOSTS)], IMAGE_ENV, status.REFUSED, "start it from a host"),
    (["glm-5.2-nvfp4-8xspark", "--set", "nodes=4", "--set", "tensor_parallel_size=4"], IMAGE_ENV, status.REFUSED, "does not fit"),
    (["tiny-glm5"], {**IMAGE_ENV, "DSA_IMAGE_VLLM": "0.24.0"}, status.REFUSED, "cannot run on the vLLM 0.24.0 sm120 image"),
    (["tiny-glm5"], {}, status.ENVIRONMENT, "DSA_IMAGE_TOOL is not set"),
])
def test_image_mode_refusals(args, environ, code, message):
    plan = sc.image_mode(args, environ)
    assert (plan.exit_code, not plan.argv) == (code, True) and message in plan.error


# -- scaled-down forms ---------------------------------------------------------------------


def test_scaled_down_keeps_what_sm90_runs_and_names_what_it_changes():
    run = scaled.scale_down(load("glm-5.2-nvfp4-8xspark"), BUILD)
    args = run.args
    assert args[args.index("--attention-backend") + 1] == "FLASHMLA_SPARSE"
    for kept in (["--kv-cache-dtype", "fp8_ds_mla"], ["--block-size", "64"], ["--reasoning-parser", "glm45"],
                 ["--tool-call-parser", "glm47"], ["--load-format", "dummy"], ["--max-model-len", "8192"]):
        assert args[args.index(kept[0]) + 1] == kept[1], kept
    assert "--tensor-parallel-size" not in args and run.mtp
    assert run.env == {}  # VLLM_USE_FLASHINFER_SAMPLER=0: flashinfer-3610 is fixed in 0.33.0's FlashInfer
    w4a16 = scaled.scale_down(load("glm-5.2-w4a16-4xspark"), BUILD).args
    assert w4a16[w4a16.index("--max-num-batched-tokens") + 1] == "2048"
    assert w4a16[w4a16.index("--speculative-config") + 1] == '{"method":"mtp","num_speculative_tokens":3}'
    sm90 = {c.what for c in run.changes if c.sm90}
    assert sm90 == {"--attention-backend", "VLLM_USE_B12X_SPARSE_INDEXER"}


@pytest.mark.parametrize("vllm, name, backend, kv", [
    ("0.24.0", "glm-5-fp8-8xb200", "FLASHMLA_SPARSE", "fp8"),
    ("0.33.0", "glm-5-fp8-8xb200", "FLASHMLA_SPARSE", "fp8"),  # FLASH_ATTN_MLA_SPARSE takes no fp8
    ("0.33.0", "glm-5.2-nvfp4-8xspark", "FLASHMLA_SPARSE", "fp8_ds_mla"),
])
def test_scaled_down_keeps_the_kv_cache_on_an_sm90_backend_that_takes_it(vllm, name, backend, kv):
    """The sm90 target's backend on 0.33.0 (FLASH_ATTN_MLA_SPARSE) stores bf16 only: a recipe's
    quantized cache moves to the sm_90 backend that takes it rather than losing its dtype."""
    build = load_recipe(vllm=vllm)
    run = scaled.scale_down(sr.load_serve_recipe(name, build=build), build)
    assert run.args[run.args.index("--attention-backend") + 1] == backend
    assert run.args[run.args.index("--kv-cache-dtype") + 1] == kv
    change = next(c for c in run.changes if c.what == "--attention-backend")
    assert change.scaled == backend
    assert [c.scaled for c in run.changes if c.what == "--kv-cache-dtype"] in ([], [kv])


def test_scaled_down_runs_are_deduplicated():
    # Every recipe's scaled-down form differs now (GPU memory fraction, MTP depth, batching); a
    # name twice is served once.
    runs = scaled.scaled_runs([*ALL, "tiny-glm5"], BUILD, gpus=1)
    assert sorted(len(r.recipes) for r in runs) == [1, 1, 1, 1, 2]
    assert sorted(r for run in runs for r in run.recipes) == sorted([*ALL, "tiny-glm5"])


def test_scaled_down_layout_uses_the_gpus_given():
    run = scaled.scale_down(load("glm-5.2-nvfp4-8xrtxpro6000"), BUILD, gpus=2)
    assert run.args[run.args.index("--tensor-parallel-size") + 1] == "2"


# -- code shape ----------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["recipes.py", "launch.py", "execute.py", "cli.py", "memory_plan.py",
                                    "workarounds.py"])
def test_runner_modules_are_stdlib_only(module):
    tree = ast.parse((REPO / "dsa_image" / "serving" / module).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert imported - set(sys.stdlib_module_names) - {"dsa_image"} == set()


def test_docs_name_every_recipe():
    text = (REPO / "docs" / "recipes.md").read_text()
    assert [name for name in ALL if f"`{name}`" not in text] == []


def test_gpu_table_sources_and_targets():
    for gpu in GPUS.values():
        assert gpu.target in BUILD.targets and gpu.source
        assert f"{gpu.capability[0]}.{gpu.capability[1]}" in BUILD.target(gpu.target).cuda_arch
    assert math.isclose(GPUS["b200"].memory_bytes / GIB, 179.06, rel_tol=1e-3)


# `python -m vllm.entrypoints.cli.main serve ...`: tests/fake_vllm.py's server, after the start-up
# line the harness records; `--fail` makes it die first, as a server that cannot start.
FAKE_VLLM = f'''
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import fake_vllm
args = sys.argv[1:]
assert args[0] == "serve"
if "--fail" in args:
    sys.exit(7)
print("fake vllm", " ".join(args), flush=True)
fake_vllm.main(args)
'''


def fake_vllm_site(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    cli = site / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for package in (site / "vllm", site / "vllm" / "entrypoints", cli):
        (package / "__init__.py").write_text("")
    (cli / "main.py").write_text(FAKE_VLLM)
    return add_fake_model_registry(site)


def test_validation_runner_serves_asks_and_records(tmp_path):
    site, out, work = fake_vllm_site(tmp_path), tmp_path / "out", tmp_path / "work"
    code = scaled.main(["--out", str(out), "--work", str(work), "--only", "glm-5.2-nvfp4-8xspark",
                        "--site-packages", str(site), "--port", str(free_port()), "--timeout", "60"])
    assert code == 0
    result = __import__("json").loads((out / "glm-5.2-nvfp4-8xspark.json").read_text())
    assert result["ok"] and result["long"]["prompt_tokens"] == scaled.LONG_PROMPT
    assert result["short"]["prompt_tokens"] == scaled.SHORT_PROMPT and result["chat_with_tool"]["ok"]
    assert str(work / "models" / "tiny-glm5-mtp") in (out / "glm-5.2-nvfp4-8xspark.log").read_text()
    assert result["env"] == {}  # on the default base (0.33.0) flashinfer-3610 is fixed: no sampler workaround
    assert tiny_model.model_dir_differences(work / "models" / "tiny-glm5-mtp", tiny_model.MTP_CONFIG) == []
    # The server's HOME starts as the image's: the model info it ships, no compile cache.
    shipped = work / "home-glm-5.2-nvfp4-8xspark" / ".cache" / "vllm" / "modelinfos"
    assert sorted(p.name for p in shipped.iterdir()) == [
        "vllm-models-fake-DeepseekV32MTPModel.json", "vllm-models-fake-GlmMoeDsaForCausalLM.json"]
    summary = __import__("json").loads((out / "summary.json").read_text())
    assert summary["ok"] and [r["run"] for r in summary["runs"]] == ["glm-5.2-nvfp4-8xspark"]


def test_validation_runner_records_a_cold_home_it_cannot_make_and_serves_nothing(tmp_path):
    site, out = fake_vllm_site(tmp_path), tmp_path / "out"
    (site / "vllm" / "model_executor" / "models" / "registry.py").unlink()
    code = scaled.main(["--out", str(out), "--work", str(tmp_path / "work"), "--only", "tiny-glm5",
                        "--site-packages", str(site), "--port", str(free_port()), "--timeout", "60"])
    result = __import__("json").loads((out / "tiny-glm5.json").read_text())
    assert code == 1 and not result["ok"]
    assert result["error"].startswith("RuntimeError: model_info_cache fill exited with")
    assert "healthy_after_s" not in result and (out / "tiny-glm5.log").read_text() == ""


def test_validation_runner_reports_a_server_that_dies(tmp_path, monkeypatch):
    site, out = fake_vllm_site(tmp_path), tmp_path / "out"
    real = scaled.scale_down
    monkeypatch.setattr(scaled, "scale_down", lambda *a, **k: (lambda r: scaled.ScaledRun(
        r.name, r.recipes, r.mtp, [*r.args, "--fail"], r.env, r.changes))(real(*a, **k)))
    code = scaled.main(["--out", str(out), "--work", str(tmp_path / "work"), "--only", "tiny-glm5",
                        "--site-packages", str(site), "--port", str(free_port()), "--timeout", "60"])
    result = __import__("json").loads((out / "tiny-glm5.json").read_text())
    assert code == 1 and not result["ok"] and "exited with 7" in result["error"]
