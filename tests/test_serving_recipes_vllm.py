"""Every serving recipe against the pinned vLLM itself (the image's `test` stage; skipped where vLLM
is not installed): each node's `vllm serve` arguments parse with vLLM's own serve parser and
engine-argument constructor, every parser, backend, speculative method and variable a recipe names
exists in this vLLM, and the cache layouts the memory plan assumes are vLLM's."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
import types
import typing
from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm", reason="needs the pinned vLLM (the image's test stage has it)")

from dsa_image.serving import launch as sl, memory_plan, recipes as sr
from dsa_image.core.recipe import load_recipe  # noqa: E402
from dsa_image.validation import recipes as scaled  # noqa: E402

BUILD = load_recipe(vllm=os.environ.get("DSA_IMAGE_VLLM"))  # the image's base
BACKENDS = memory_plan.backends(BUILD.vllm_version)
NAMES = sr.serve_recipe_names()
GLM5 = sr.load_model("glm-5").config
MLA_HEAD = GLM5["kv_lora_rank"] + GLM5["qk_rope_head_dim"]  # 576, the sparse-MLA head of every recipe's model
HOSTS = {n: [f"10.0.0.{i}" for i in range(1, n + 1)] for n in (2, 4, 8)}


def test_the_pinned_vllm():
    assert vllm.__version__ == BUILD.vllm_version


# The module vllm/entrypoints/cli/serve.py takes make_arg_parser and validate_parsed_serve_args from.
SERVE_CLI_ARGS = {"0.24.0": "vllm.entrypoints.openai.cli_args", "0.33.0": "vllm.entrypoints.common.cli_args"}


def serve_cli_args():
    if BUILD.vllm_version not in SERVE_CLI_ARGS:
        pytest.fail(f"vLLM {BUILD.vllm_version}: add the module its vllm/entrypoints/cli/serve.py imports "
                    "make_arg_parser from to SERVE_CLI_ARGS")
    return importlib.import_module(SERVE_CLI_ARGS[BUILD.vllm_version])


@pytest.fixture(scope="module")
def serve_parser():
    """The base's `vllm serve` parser, as vllm/entrypoints/cli/serve.py builds it. Building it
    resolves the device; on a host without a GPU that is vLLM's UnspecifiedPlatform, which has no
    device type, so a CUDA-typed one stands in for the parser's defaults (nothing runs on it)."""
    import vllm.platforms as platforms
    from vllm.platforms.interface import UnspecifiedPlatform
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    saved = platforms._current_platform
    if not platforms.current_platform.device_type:
        class CudaTyped(UnspecifiedPlatform):
            device_type = "cuda"
            device_name = "cuda"

        platforms._current_platform = CudaTyped()
    try:
        yield serve_cli_args().make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    finally:
        platforms._current_platform = saved


def forms(name: str, target: str) -> list[tuple[str, list[str]]]:
    """Every `vllm serve` argument list a launch of this recipe runs: one per distinct node role."""
    recipe = sr.load_serve_recipe(name, build=BUILD)
    # vllm_args: what a launch runs (tests/test_serving_recipes.py checks the dry run prints it),
    # also for the layouts the memory plan refuses
    if recipe.nodes == 1:
        return [("solo", sl.vllm_args(recipe, target, BUILD))]
    out = []
    for backend in sr.CLUSTER_BACKENDS:
        variant = sr.apply_overrides(recipe, [f"cluster_backend={backend}"], BUILD)
        args = sl.vllm_args(variant, target, BUILD)
        if backend == "ray":
            out.append(("ray head", [*args, "--distributed-executor-backend", "ray"]))
        else:
            for rank in (0, 1):
                extra = ["--nnodes", str(recipe.nodes), "--node-rank", str(rank), "--master-addr", "10.0.0.1",
                         "--master-port", str(sl.MP_MASTER_PORT)] + (["--headless"] if rank else [])
                out.append((f"mp rank {rank}", [*args, *extra]))
    return out


CASES = [(n, t, role, args) for n in NAMES for t in sr.load_serve_recipe(n, build=BUILD).targets
         for role, args in forms(n, t)]


@pytest.mark.parametrize("name, target, role, args", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_recipe_arguments_parse_with_vllm(serve_parser, name, target, role, args):
    from vllm.engine.arg_utils import AsyncEngineArgs

    recipe = sr.load_serve_recipe(name, build=BUILD)
    parsed = serve_parser.parse_args(args)
    serve_cli_args().validate_parsed_serve_args(parsed)
    engine = AsyncEngineArgs.from_cli_args(parsed)
    assert parsed.model_tag == recipe.hf_id
    assert engine.tensor_parallel_size == recipe.tp and engine.pipeline_parallel_size == recipe.pp
    assert engine.kv_cache_dtype == sr.kv_cache_dtype(recipe, target, BUILD)
    assert str(engine.attention_backend).split(".")[-1] == sr.attention_backend(recipe, target, BUILD)
    assert engine.max_model_len == recipe.vllm["max_model_len"]
    if recipe.uses_mtp:
        assert engine.speculative_config == {"method": "mtp",
                                             "num_speculative_tokens": recipe.vllm["num_speculative_tokens"]}
    if "hf_overrides" in recipe.vllm:
        assert engine.hf_overrides == recipe.vllm["hf_overrides"]
    if role.startswith("mp"):
        assert engine.nnodes == recipe.nodes and parsed.headless == (role == "mp rank 1")


@pytest.mark.parametrize("run", scaled.scaled_runs(NAMES, BUILD, gpus=1), ids=lambda r: r.name)
def test_scaled_down_arguments_parse_with_vllm(serve_parser, run):
    parsed = serve_parser.parse_args(["/models/tiny-glm5", *run.args])
    assert parsed.attention_backend is not None and parsed.load_format == "dummy"


def test_named_parsers_methods_and_backends_exist():
    from vllm.config.cache import CacheDType
    from vllm.config.speculative import SpeculativeMethod
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    tools, reasoning = set(ToolParserManager.list_registered()), set(ReasoningParserManager.list_registered())
    backends = {b.name for b in AttentionBackendEnum}
    for name in NAMES:
        recipe = sr.load_serve_recipe(name, build=BUILD)
        vllm_settings = recipe.vllm
        assert vllm_settings.get("tool_call_parser", "glm47") in tools, name
        assert vllm_settings.get("reasoning_parser", "glm45") in reasoning, name
        assert vllm_settings.get("speculative_method", "mtp") in typing.get_args(SpeculativeMethod), name
        for target in recipe.targets:
            assert sr.attention_backend(recipe, target, BUILD) in backends, (name, target)
            assert sr.kv_cache_dtype(recipe, target, BUILD) in typing.get_args(CacheDType), (name, target)
    assert set(BACKENDS) <= backends


def test_named_environment_variables_exist():
    import importlib.metadata

    import vllm.envs as envs

    from dsa_image.overlay import cli as overlay

    # The overlay's own variables exist in the overlaid vLLM (the image's): in its vllm.envs,
    # or read by one of the overlay files of the installed base.
    installed = overlay.overlay_dir(importlib.metadata.version("vllm"))
    overlay_sources = [path.read_text() for path in installed.rglob("*.py")]
    for name in NAMES:
        recipe = sr.load_serve_recipe(name, build=BUILD)
        for target in recipe.targets:
            # the target's, and every variable of the recipe's, applied on this base or not
            for var in {*sl.environment(recipe, target, BUILD), *(e.name for e in recipe.env)}:
                if var.startswith("VLLM_"):
                    assert var in envs.environment_variables or any(
                        f'"{var}"' in text for text in overlay_sources), (name, var)


def test_the_installed_packages_show_the_recorded_bug_verdicts():
    """The image's own FlashInfer and (overlaid) vLLM: each bug's source patterns (recipes/bugs/)
    give the verdict recorded for this base, as `scripts/recipe.py check --online` finds in the
    pinned wheels: the workarounds this image's recipes apply are the ones its packages need."""
    from dsa_image.serving import workarounds

    for bug in workarounds.load_bugs(sr.RECIPES_DIR).values():
        if bug.source is None:
            continue
        members = workarounds.installed_members(bug.package, bug.source.files)
        verdict, found = workarounds.source_verdict(bug.source, members)
        assert verdict == bug.bases[BUILD.vllm_version].verdict, (bug.id, found)


# vLLM's FlashAttention package refuses to import where its CUDA extensions cannot load (no GPU
# driver in the test stage), and 0.33.0's FLASH_ATTN_MLA_SPARSE module imports a kernel from it
# at the top. The facts read here (dtypes, block sizes, capabilities) need none of its kernels.
_FLASH_ATTN = ("vllm.vllm_flash_attn", "vllm.vllm_flash_attn.flash_attn_interface")


def _kernel_stand_in(name: str):
    def unavailable(*args, **kwargs):
        raise RuntimeError(f"{name}: a stand-in for the CUDA FlashAttention kernels, not callable here")
    return unavailable


@contextlib.contextmanager
def _flash_attn_stand_in(module: str):
    """`module` importable with stand-ins for vllm.vllm_flash_attn; afterwards none of them (and
    not `module` itself, which holds their references) stays in sys.modules."""
    saved = {n: sys.modules.get(n) for n in (*_FLASH_ATTN, module)}
    package = types.ModuleType(_FLASH_ATTN[0])
    package.__path__ = []
    interface = types.ModuleType(_FLASH_ATTN[1])
    interface.__getattr__ = _kernel_stand_in  # PEP 562: `from ... import name` asks it
    package.flash_attn_interface = interface
    sys.modules.update(zip(_FLASH_ATTN, (package, interface), strict=True))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = value


def backend_class(name: str):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = AttentionBackendEnum[name]
    try:
        return backend.get_class()
    except ImportError as e:
        if "flash attention extensions" not in str(e):
            raise
    with _flash_attn_stand_in(backend.get_path().rpartition(".")[0]):
        return backend.get_class()


def test_backend_table_is_vllms():
    import torch
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import MultipleOf

    for name, spec in BACKENDS.items():
        cls = backend_class(name)
        assert tuple(cls.supported_kv_cache_dtypes) == spec.kv_cache_dtypes, name
        blocks = tuple(memory_plan.MultipleOf(s.base) if isinstance(s, MultipleOf) else s
                       for s in cls.get_supported_kernel_block_sizes())
        assert blocks == spec.block_sizes, name
        majors = tuple(m for m in range(7, 13) if cls.supports_compute_capability(DeviceCapability(m, 0)))
        assert majors == spec.capability_majors, name
        assert cls.supports_head_size(MLA_HEAD), name  # 0.33.0's also serve 512 (rope-free MLA)
        for dtype, only in spec.dtype_majors.items():
            runs = tuple(m for m in majors if cls.supports_combination(
                head_size=MLA_HEAD, dtype=torch.bfloat16, kv_cache_dtype=dtype, block_size=64, use_mla=True,
                has_sink=False, use_sparse=True, use_mm_prefix=False, device_capability=DeviceCapability(m, 0),
            ) is None)
            assert runs == only, (name, dtype)


def _packed_row_0_24(backend, layer_spec) -> int:
    return backend.get_kv_cache_shape(1, layer_spec.block_size, 1, layer_spec.head_size,
                                      layer_spec.cache_dtype_str)[-1]


def _packed_row_0_33(backend, layer_spec) -> int:
    from vllm.v1.kv_cache_interface import compute_layer_kv_cache_shape_bytes

    return compute_layer_kv_cache_shape_bytes(layer_spec, num_blocks=1)[-1]  # (B, H, N, C bytes)


# Bytes of one token's row in the cache tensor of a packed layout: 0.24.0's backends shape the
# tensor (get_kv_cache_shape); 0.33.0 views every layer's cache from its spec alone.
PACKED_ROW = {"0.24.0": _packed_row_0_24, "0.33.0": _packed_row_0_33}


def mla_cache_spec(stored: str, head_size: int, block_size: int):
    """The cache spec vLLM's MLA layer gives a layer storing `stored` (MLAAttention.get_kv_cache_spec,
    whose page size is what vLLM allocates per block), for a bf16 model."""
    import torch
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layer = SimpleNamespace(kv_cache_dtype=stored, head_size=head_size, sliding_window=None, topk_buffer_width=None,
                            indexer=None, non_causal_multi_token_decode=False)
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=block_size, cache_dtype=stored),
                             model_config=SimpleNamespace(dtype=torch.bfloat16))
    return MLAAttention.get_kv_cache_spec(layer, config)


def test_kv_layouts_are_vllms():
    """Per backend and kv_cache_dtype: the layout vLLM stores and its bytes per token, as the plan has them."""
    import torch
    from vllm.model_executor.layers.attention.mla_attention import _canonicalize_sparse_mla_kv_cache_dtype
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if BUILD.vllm_version not in PACKED_ROW:
        pytest.fail(f"vLLM {BUILD.vllm_version}: add how its cache tensors are shaped to PACKED_ROW")
    version = BUILD.vllm_version
    for name, spec in BACKENDS.items():
        cls = backend_class(name)
        for dtype in spec.kv_cache_dtypes:
            stored = _canonicalize_sparse_mla_kv_cache_dtype(cls, dtype)
            assert memory_plan.stored_kv_dtype(name, dtype, version) == stored, (name, dtype)
            per_token = memory_plan.mla_bytes_per_token(GLM5, name, dtype, version)
            layer_spec = mla_cache_spec(stored, MLA_HEAD, block_size=64)
            assert layer_spec.page_size_bytes == 64 * per_token, (name, dtype)
            if stored in memory_plan.release(version).packed_bytes:
                assert PACKED_ROW[version](cls, layer_spec) == per_token, (name, dtype)
    indexer = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=memory_plan.indexer_bytes_per_token(GLM5),
                               dtype=torch.uint8)
    assert indexer.page_size_bytes == 64 * 132


def test_the_rules_the_plan_mirrors_are_in_this_vllm():
    """Rules the plan reimplements, pinned to the source lines they come from."""
    from vllm.model_executor.layers.attention import mla_attention
    from vllm.model_executor.models import deepseek_v2
    from vllm.v1.spec_decode import llm_base_proposer

    v2 = inspect.getsource(deepseek_v2)
    assert "max(layer_id - _index_skip_topk_offset + 1, 0) % _index_topk_freq" in v2
    assert 'getattr(config, "index_skip_topk_offset", 2)' in v2
    assert "head_dim=self.head_dim + self.head_dim // self.quant_block_size * 4" in v2
    canonical = inspect.getsource(mla_attention._canonicalize_sparse_mla_kv_cache_dtype)
    assert '"FLASHINFER_MLA_SPARSE_SM120"' in canonical and '"FLASHMLA_SPARSE"' in canonical
    proposer = inspect.getsource(llm_base_proposer)
    assert "if get_pp_group().world_size == 1:" in proposer  # MTP shares the embedding only without PP
