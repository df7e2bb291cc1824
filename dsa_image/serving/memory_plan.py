"""Memory plan of a GLM-5.x serving layout: weights per GPU, KV bytes per token, KV tokens that fit.

Everything is computed from a model's config (recipes/models/*.toml), a quantisation scheme, a
GPU and the cache layouts of the vLLM release served (KV_RELEASES); every constant below names
where it comes from. It is an estimate, and an upper bound on the KV cache: vLLM also subtracts,
at start-up, the activation peak of its profiling run, CUDA graphs, NCCL buffers and the CUDA
context, which this plan does not model. What it does decide reliably is the gross case, that a
layout's weights leave no room (or not enough for one request of max_model_len), which is when a
recipe is refused.

Stdlib only: the image's entrypoint imports this through dsa_image.serving.cli.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

GIB = 2**30
MIB = 2**20

# -- GPUs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    id: str
    name: str
    target: str  # the image target (recipes/glm5-dsa.toml [targets.*]) built for it
    capability: tuple[int, int]
    memory: str  # as published, "<number> MiB|GiB"
    source: str
    note: str = ""

    @property
    def memory_bytes(self) -> int:
        return parse_memory(self.memory)


def parse_memory(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(MiB|GiB)\s*", text)
    if not match:
        raise ValueError(f"memory {text!r} is not '<number> MiB' or '<number> GiB'")
    return int(float(match.group(1)) * (MIB if match.group(2) == "MiB" else GIB))


# Total memory as the driver reports it (what vLLM's gpu_memory_utilization is a fraction of).
GPUS: dict[str, Gpu] = {
    "b200": Gpu("b200", "NVIDIA B200", "sm100", (10, 0), "183359 MiB",
                "https://github.com/NVIDIA/TensorRT-LLM/issues/10278 (nvidia-smi on an 8x B200 host)"),
    "rtx-pro-6000": Gpu("rtx-pro-6000", "NVIDIA RTX PRO 6000 Blackwell", "sm120", (12, 0), "97887 MiB",
                        "https://github.com/vllm-project/vllm/issues/27542 (nvidia-smi)"),
    "dgx-spark": Gpu("dgx-spark", "NVIDIA DGX Spark (GB10)", "sm120", (12, 1), "121.69 GiB",
                     "https://github.com/MiaAI-Lab/GLM-5.3-Flash-EXL3-2x-DGX-Sparks/issues/47 (CUDA total on "
                     "cuda:0 of a DGX Spark)",
                     note="128 GB of LPDDR5X unified memory shared with the CPU and the OS: the GPU fraction is "
                          "kept at 0.85 (https://github.com/vllm-project/recipes/pull/632: GB10 cannot satisfy "
                          "vLLM's default 0.92). Some hosts report only ~102 GiB free at start, which caps the "
                          "fraction near 0.83 (same issue #47): lower it with --set gpu_memory_utilization=0.83."),
    "h200": Gpu("h200", "NVIDIA H200", "sm90", (9, 0), "143771 MiB",
                "docs/validation/h200-2026-11-30-overlay-c2b8469b/environment.txt (nvidia-smi, this project's H200)"),
}

# -- quantisation schemes ------------------------------------------------------------------

# Parts of a GLM-5 decoder layer and of the model, as vLLM 0.24.0 builds them
# (model_executor/models/deepseek_v2.py, deepseek_mtp.py). `sharded`: split over tensor-parallel
# ranks (column/row-parallel, vocab-parallel, experts without expert parallelism); otherwise
# every rank holds a copy (ReplicatedLinear, disable_tp, norms, the router).
PART_SHARDED = {
    "attn.q_a": False,             # fused_qkv_a_proj (q_a + kv_a), disable_tp
    "attn.kv_a": False,
    "attn.q_b": True,
    "attn.kv_b": True,
    "attn.o": True,
    "attn.norms": False,
    "indexer.wq_b": False,         # ReplicatedLinear
    "indexer.wk_weights_proj": False,  # disable_tp, quant_config=None: bf16
    "indexer.k_norm": False,
    "layer.norms": False,
    "mlp.dense": True,
    "mlp.routed_experts": True,
    "mlp.shared_experts": True,
    "mlp.router": False,
    "embed": True,                 # VocabParallelEmbedding
    "lm_head": True,               # ParallelLMHead
    "final_norm": False,
    "mtp.eh_proj": False,          # nn.Linear in DeepSeekMultiTokenPredictorLayer
    "mtp.norms": False,            # enorm, hnorm, shared_head.norm
}


@dataclass(frozen=True)
class Scheme:
    id: str
    description: str
    # part -> bytes per parameter, for parts stored quantised; everything else is bf16 (2 bytes)
    quantised: Mapping[str, float]
    # quantised parts of the MTP layer too (False: the MTP layer is all bf16)
    mtp_quantised: bool
    sources: tuple[str, ...]
    # backbone layers stored all bf16 whatever `quantised` says (a checkpoint's ignore list)
    bf16_layers: frozenset[int] = frozenset()
    # the MTP layer's own part -> bytes per parameter, when it is quantised differently from the
    # backbone (None: `quantised` when mtp_quantised)
    mtp_parts: Mapping[str, float] | None = None

    def part_bytes(self, part: str, in_mtp: bool, layer: int | None = None) -> float:
        """Bytes per parameter of `part` in backbone layer `layer` (None: not a layer's part)
        or in the MTP layer."""
        if in_mtp:
            if self.mtp_parts is not None:
                return self.mtp_parts.get(part, BF16)
            return self.quantised.get(part, BF16) if self.mtp_quantised else BF16
        return BF16 if layer in self.bf16_layers else self.quantised.get(part, BF16)


BF16 = 2.0
# FP8 weights with one fp32 scale per 128x128 block (DeepSeek-V3's FP8 format, vLLM's
# weight_block_size [128, 128]).
FP8_BLOCK = 1.0 + 4.0 / (128 * 128)
# NVFP4: 4-bit E2M1 values, one FP8 E4M3 scale per 16 values (the per-tensor fp32 global scale
# is left out: 4 bytes per tensor).
NVFP4 = 0.5 + 1.0 / 16
# compressed-tensors INT4 / INT8 weights, symmetric (no zero points), one bf16 scale per group of
# 128 values (pack-quantized: eight INT4 values per int32).
INT4_G128 = 0.5 + 2.0 / 128
INT8_G128 = 1.0 + 2.0 / 128
# INT8 with one bf16 scale per output channel: the scale (2 B per row of thousands of values) is
# left out.
INT8_CHANNEL = 1.0

_LINEAR_PARTS = ("attn.q_a", "attn.kv_a", "attn.q_b", "attn.kv_b", "attn.o", "indexer.wq_b",
                 "mlp.dense", "mlp.routed_experts", "mlp.shared_experts")

SCHEMES: dict[str, Scheme] = {
    "bf16": Scheme("bf16", "every weight bf16", {}, False,
                   ("dsa_image/build/tiny_model.py (dtype bfloat16); zai-org/GLM-5 is published in BF16",)),
    "fp8-block": Scheme(
        "fp8-block",
        "linear layers (attention, indexer wq_b, dense MLP, routed and shared experts, MTP layer) FP8 with "
        "128x128 block scales; embeddings, lm_head, norms, the router, the indexer's wk/weights_proj and "
        "MTP eh_proj bf16",
        {part: FP8_BLOCK for part in _LINEAR_PARTS}, True,
        ("https://github.com/eugr/spark-vllm-docker/blob/main/recipes/8x-spark-cluster/glm-5-fp8.yaml "
         "(zai-org/GLM-5-FP8: ~704 GiB of weights; this scheme computes 704 GiB, a test checks it)",
         "vLLM 0.24.0 deepseek_v2.py: wk_weights_proj built with quant_config=None, FP8 wk upcast to BF16")),
    "nvfp4-routed-experts": Scheme(
        "nvfp4-routed-experts",
        "routed experts of the 78 backbone layers NVFP4 (FP8 scale per 16 values); attention, indexer, "
        "dense MLP, shared experts, router, embeddings, lm_head and the whole MTP layer bf16",
        {"mlp.routed_experts": NVFP4}, False,
        ("https://huggingface.co/festr2/GLM-5-NVFP4-MTP (only the routed expert MLPs of layers 0-77 are "
         "NVFP4, attention BF16, the MTP layer entirely BF16, ~19 GB)",
         "https://github.com/SemiAnalysisAI/InferenceX/pull/2335 (nvidia/GLM-5.2-NVFP4 keeps the shared "
         "expert BF16; loads to 433 GB total, 56 GB per GPU at TP 8)",
         "https://github.com/eugr/spark-vllm-docker/blob/main/recipes/glm-5.2-nvfp4.yaml (NVFP4 experts + "
         "BF16 attention/shared experts, ~465GB of weights)")),
    # QuantTrio/GLM-5.2-Int4-Int8Mix, the W4A16 checkpoint 4-Spark clusters serve.
    "w4a16-int4-int8mix": Scheme(
        "w4a16-int4-int8mix",
        "compressed-tensors W4A16/W8A16: routed experts INT4 (group 128); attention, dense MLP and shared "
        "experts INT8 (group 128), in layers 1-77; layer 0 bf16; the MTP layer INT8 per channel, its experts "
        "too; router, indexer, norms, embeddings and lm_head bf16",
        {"mlp.routed_experts": INT4_G128,
         **{part: INT8_G128 for part in ("attn.q_a", "attn.kv_a", "attn.q_b", "attn.kv_b", "attn.o", "mlp.dense",
                                          "mlp.shared_experts")}},
        True,
        ("https://huggingface.co/festr2/GLM-5.2-Int8Mix-NVFP4 (QuantTrio/GLM-5.2-Int4-Int8Mix's layout: layer 0 "
         "BF16; dense attention, ordinary linears and shared experts of layers 1-77 W8A16 INT8, symmetric, group "
         "size 128; routed experts INT4 group size 128; the layer-78 MTP block W8A16 INT8 channel-wise; "
         "mlp.gate, the attention indexer, norms, embeddings and heads BF16)",
         "https://github.com/joesinvestments/GLM-5.2-QuantTrio-TP4-DCP2-4x-DGX-Spark (405GB of weights; this "
         "scheme computes 378.3 GiB = 406.2 GB, a test checks it)",
         "https://github.com/0xdfi/glm-5.2-dgx-spark-vllm027 (the W4A16 checkpoint: 379GiB on disk, ~94.75GiB of "
         "weights per rank at TP 4; a test checks this plan against it)"),
        bf16_layers=frozenset({0}),
        mtp_parts={part: INT8_CHANNEL for part in (*_LINEAR_PARTS, "mtp.eh_proj") if part != "indexer.wq_b"},
    ),
}

# -- the model's parts ---------------------------------------------------------------------

REQUIRED_CONFIG = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "n_shared_experts", "n_routed_experts", "first_k_dense_replace",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "index_head_dim", "index_n_heads", "max_position_embeddings", "num_nextn_predict_layers",
)
# Of those, the counts a model may have none of (the rest are sizes, at least 1).
CONFIG_MAY_BE_ZERO = ("n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers")


def layer_parts(cfg: Mapping[str, Any], moe: bool) -> dict[str, int]:
    """Parameters of one GLM-5 decoder layer by part (dense MLP or MoE)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    ql, kvl, rope = cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    ih, inh = cfg["index_head_dim"], cfg["index_n_heads"]
    parts = {
        "attn.q_a": h * ql,
        "attn.kv_a": h * (kvl + rope),
        "attn.q_b": ql * heads * (nope + rope),
        "attn.kv_b": kvl * heads * (nope + v),
        "attn.o": heads * v * h,
        "attn.norms": ql + kvl,
        "indexer.wq_b": ql * inh * ih,
        "indexer.wk_weights_proj": h * (ih + inh),
        "indexer.k_norm": 2 * ih,  # LayerNorm: weight and bias
        "layer.norms": 2 * h,
    }
    if moe:
        experts, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        parts["mlp.routed_experts"] = experts * 3 * h * mi
        parts["mlp.shared_experts"] = cfg["n_shared_experts"] * 3 * h * mi
        parts["mlp.router"] = experts * h + experts  # gate weight + e_score_correction_bias
    else:
        parts["mlp.dense"] = 3 * h * cfg["intermediate_size"]
    return parts


def is_moe_layer(cfg: Mapping[str, Any], layer: int) -> bool:
    return layer >= cfg["first_k_dense_replace"]


def mtp_extra_parts(cfg: Mapping[str, Any]) -> dict[str, int]:
    h = cfg["hidden_size"]
    return {"mtp.eh_proj": 2 * h * h, "mtp.norms": 3 * h}


def parameter_count(cfg: Mapping[str, Any], with_mtp: bool) -> int:
    """Every parameter of the checkpoint (the MTP layers' when with_mtp)."""
    layers = cfg["num_hidden_layers"]
    total = sum(sum(layer_parts(cfg, is_moe_layer(cfg, i)).values()) for i in range(layers))
    total += 2 * cfg["vocab_size"] * cfg["hidden_size"] + cfg["hidden_size"]  # embed, lm_head, final norm
    if with_mtp:
        per_mtp = sum(layer_parts(cfg, True).values()) + sum(mtp_extra_parts(cfg).values())
        total += cfg["num_nextn_predict_layers"] * per_mtp
    return total


def active_parameter_count(cfg: Mapping[str, Any]) -> int:
    """Parameters one token passes through in the backbone (no embeddings, no MTP)."""
    layers = cfg["num_hidden_layers"]
    per_expert = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
    total = 0
    for i in range(layers):
        parts = layer_parts(cfg, is_moe_layer(cfg, i))
        if "mlp.routed_experts" in parts:
            parts["mlp.routed_experts"] = cfg["num_experts_per_tok"] * per_expert
        total += sum(parts.values())
    return total + cfg["hidden_size"] * cfg["vocab_size"]  # lm_head


def checkpoint_bytes(cfg: Mapping[str, Any], scheme: Scheme, with_mtp: bool) -> float:
    """Bytes of all weights as vLLM holds them on one GPU (tensor parallel 1)."""
    return sum(s.bytes_per_gpu for s in stage_weights(cfg, scheme, tp=1, pp=1, mtp=with_mtp))


# -- per GPU -------------------------------------------------------------------------------


def pp_layers(num_layers: int, pp: int, stage: int) -> range:
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


@dataclass(frozen=True)
class StageWeights:
    stage: int
    layers: range
    bytes_per_gpu: float
    breakdown: dict[str, float]  # part -> bytes on one GPU of this stage


def stage_weights(cfg: Mapping[str, Any], scheme: Scheme, tp: int, pp: int, mtp: bool) -> list[StageWeights]:
    """Weights on one GPU of each pipeline stage, for tensor parallel `tp`."""
    stages = []
    for stage in range(pp):
        layers = pp_layers(cfg["num_hidden_layers"], pp, stage)
        breakdown = _stage_breakdown(cfg, scheme, tp, pp, mtp, stage, layers)
        stages.append(StageWeights(stage, layers, sum(breakdown.values()), breakdown))
    return stages


def _stage_breakdown(cfg: Mapping[str, Any], scheme: Scheme, tp: int, pp: int, mtp: bool, stage: int,
                     layers: range) -> dict[str, float]:
    """Part -> bytes on one GPU of pipeline stage `stage`."""
    breakdown: dict[str, float] = {}

    def add(part: str, params: int, in_mtp: bool = False, layer: int | None = None) -> None:
        size = params * scheme.part_bytes(part, in_mtp, layer) / (tp if PART_SHARDED[part] else 1)
        key = f"mtp.{part}" if in_mtp and not part.startswith("mtp.") else part
        breakdown[key] = breakdown.get(key, 0.0) + size

    def add_layer(parts: dict[str, int], in_mtp: bool, layer: int | None = None) -> None:
        for part, params in parts.items():
            add(part, params, in_mtp, layer)
        # vLLM keeps bf16 copies of kv_b_proj (W_UK, W_UV) when it is stored quantised
        # (mla_attention.py process_weights_after_loading); a bf16 kv_b is only viewed.
        if scheme.part_bytes("attn.kv_b", in_mtp, layer) != BF16:
            key = "mtp.attn.kv_b_bf16_copy" if in_mtp else "attn.kv_b_bf16_copy"
            breakdown[key] = breakdown.get(key, 0.0) + parts["attn.kv_b"] * BF16 / tp

    for i in layers:
        add_layer(layer_parts(cfg, is_moe_layer(cfg, i)), False, i)
    vocab = cfg["vocab_size"] * cfg["hidden_size"]
    if stage == 0:
        add("embed", vocab)
    if stage == pp - 1:
        add("lm_head", vocab)
        add("final_norm", cfg["hidden_size"])
        if mtp:
            for _ in range(cfg["num_nextn_predict_layers"]):
                add_layer(layer_parts(cfg, True), True)
                for part, params in mtp_extra_parts(cfg).items():
                    add(part, params, True)
            # The drafter shares the target's embedding only without pipeline parallelism
            # (llm_base_proposer.py _maybe_share_embeddings); lm_head is always shared.
            if pp > 1:
                add("embed", vocab, True)
    return breakdown


# -- KV cache ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MultipleOf:
    """A kernel block size of any multiple of `base`, as vLLM declares one (v1/attention/backend.py
    MultipleOf); a plain int in a table below is that size exactly (worker/utils.py
    _block_size_is_supported in 0.33.0)."""

    base: int

    def __str__(self) -> str:
        return f"multiples of {self.base}"


@dataclass(frozen=True)
class Backend:
    """What one vLLM release's sparse-MLA backend accepts (tests check this table against the classes)."""

    name: str
    capability_majors: tuple[int, ...]
    kv_cache_dtypes: tuple[str, ...]
    block_sizes: tuple[int | MultipleOf, ...]
    source: str
    # kv_cache_dtypes the backend refuses on some of its capability_majors (supports_combination)
    dtype_majors: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def kv_cache_dtypes_on(self, major: int) -> tuple[str, ...]:
        """The kv_cache_dtypes it takes on a GPU of compute capability `major`.x."""
        return tuple(d for d in self.kv_cache_dtypes if major in self.dtype_majors.get(d, self.capability_majors))

    def takes_block_size(self, block: int) -> bool:
        return any(block == s if isinstance(s, int) else block % s.base == 0 for s in self.block_sizes)

    @property
    def first_block_size(self) -> int:
        first = self.block_sizes[0]
        return first if isinstance(first, int) else first.base


@dataclass(frozen=True)
class KvRelease:
    """One vLLM release's sparse-MLA backends and packed MLA layouts: those stored as one opaque
    record per token, by name -> bytes per token."""

    backends: dict[str, Backend]
    packed_bytes: dict[str, int]


_FLASHINFER_MLA_SPARSE = "vllm/v1/attention/backends/mla/flashinfer_mla_sparse.py"
# fp8_ds_mla: 512 fp8 NoPE values, 4 fp32 scales, 64 bf16 RoPE values per token
# (flashmla_sparse.py module docstring; 0.24.0: kv_cache_interface.py MLAAttentionSpec.real_page_size_bytes,
# 0.33.0: mla_attention.py MLAAttention.get_kv_cache_spec state_content_bytes).
FP8_DS_MLA_BYTES = 512 + 4 * 4 + 64 * 2
# nvfp4_ds_mla (0.33.0): 512 e2m1 NoPE values packed two per byte, 64 fp8 RoPE values, one fp8 scale
# per 16 NoPE values (flashmla_sparse.py module docstring, MLAAttention.get_kv_cache_spec).
NVFP4_DS_MLA_BYTES = 512 // 2 + 64 + 512 // 16

# Per vLLM release, from its source; a release without an entry is refused (release()).
KV_RELEASES: dict[str, KvRelease] = {
    "0.24.0": KvRelease(
        backends={
            "FLASHMLA_SPARSE": Backend("FLASHMLA_SPARSE", (9, 10), ("auto", "bfloat16", "fp8_ds_mla", "fp8"), (64,),
                                       "vllm/v1/attention/backends/mla/flashmla_sparse.py"),
            "FLASHINFER_MLA_SPARSE": Backend("FLASHINFER_MLA_SPARSE", (10,),
                                             ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3"), (32, 64),
                                             _FLASHINFER_MLA_SPARSE),
            "FLASHINFER_MLA_SPARSE_SM120": Backend("FLASHINFER_MLA_SPARSE_SM120", (12,),
                                                   ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla"), (64, 256),
                                                   _FLASHINFER_MLA_SPARSE),
        },
        packed_bytes={"fp8_ds_mla": FP8_DS_MLA_BYTES},
    ),
    # Kernel block sizes are multiples now. FLASHMLA_SPARSE declares exactly 64 for a quantized
    # cache on SM100 (get_supported_kernel_block_sizes(spec)), into which vLLM splits a block of a
    # multiple of 64 (worker/utils.py select_common_block_size). It also takes nvfp4_ds_mla, on
    # SM100 only (supports_combination): the plan sizes it (352 B/token); no recipe uses it.
    # FLASH_ATTN_MLA_SPARSE (sm_90 only, bf16/fp16 caches) is new and ranks first on sm_90
    # (vllm/platforms/cuda.py): the sm90 target's backend on this release.
    "0.33.0": KvRelease(
        backends={
            "FLASHMLA_SPARSE": Backend("FLASHMLA_SPARSE", (9, 10),
                                       ("auto", "bfloat16", "fp8_ds_mla", "fp8", "nvfp4_ds_mla"), (MultipleOf(64),),
                                       "vllm/v1/attention/backends/mla/flashmla_sparse.py",
                                       dtype_majors={"nvfp4_ds_mla": (10,)}),
            "FLASHINFER_MLA_SPARSE": Backend("FLASHINFER_MLA_SPARSE", (10,),
                                             ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3"), (MultipleOf(32),),
                                             _FLASHINFER_MLA_SPARSE),
            "FLASHINFER_MLA_SPARSE_SM120": Backend("FLASHINFER_MLA_SPARSE_SM120", (12,),
                                                   ("auto", "fp8", "fp8_e4m3", "fp8_ds_mla"), (MultipleOf(64),),
                                                   _FLASHINFER_MLA_SPARSE),
            "FLASH_ATTN_MLA_SPARSE": Backend("FLASH_ATTN_MLA_SPARSE", (9,), ("auto", "float16", "bfloat16"),
                                             (MultipleOf(64),), "vllm/v1/attention/backends/mla/flashattn_mla_sparse.py"),
        },
        packed_bytes={"fp8_ds_mla": FP8_DS_MLA_BYTES, "nvfp4_ds_mla": NVFP4_DS_MLA_BYTES},
    ),
}


def release(vllm: str) -> KvRelease:
    try:
        return KV_RELEASES[vllm]
    except KeyError:
        raise ValueError(
            f"vLLM {vllm}: no KV facts in memory_plan (known: {', '.join(KV_RELEASES)}); read its sparse-MLA "
            "backends (supported_kv_cache_dtypes, get_supported_kernel_block_sizes, supports_compute_capability) "
            "and the MLA layer's cache spec, add an entry to KV_RELEASES, and run "
            "tests/test_serving_recipes_vllm.py in its image") from None


def backends(vllm: str) -> dict[str, Backend]:
    return release(vllm).backends


# Indexer key cache: index_head_dim fp8 values + one fp32 scale per 128 (deepseek_v2.py Indexer,
# DeepseekV32IndexerCache head_dim = head_dim + head_dim // 128 * 4, uint8).
INDEXER_QUANT_BLOCK = 128
_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


def stored_kv_dtype(backend: str, kv_cache_dtype: str, vllm: str) -> str:
    """The KV layout vLLM actually stores (mla_attention.py _canonicalize_sparse_mla_kv_cache_dtype):
    a packed layout of this release asked for by name as is, the rest as the backend converts them."""
    if kv_cache_dtype in release(vllm).packed_bytes:
        return kv_cache_dtype
    if backend == "FLASHMLA_SPARSE" and kv_cache_dtype not in ("auto", "bfloat16", "float16"):
        return "fp8_ds_mla"
    if backend == "FLASHINFER_MLA_SPARSE_SM120" and kv_cache_dtype in ("auto", "fp8", "fp8_e4m3"):
        return "fp8_ds_mla"
    return kv_cache_dtype


def mla_bytes_per_token(cfg: Mapping[str, Any], backend: str, kv_cache_dtype: str, vllm: str) -> int:
    stored = stored_kv_dtype(backend, kv_cache_dtype, vllm)
    packed = release(vllm).packed_bytes
    if stored in packed:
        # every packed layout is DeepSeek V3.2's geometry
        if (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) != (512, 64):
            raise ValueError(f"{stored} needs kv_lora_rank 512 and qk_rope_head_dim 64")
        return packed[stored]
    return (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * _DTYPE_BYTES[stored]


def indexer_bytes_per_token(cfg: Mapping[str, Any]) -> int:
    head = cfg["index_head_dim"]
    return head + head // INDEXER_QUANT_BLOCK * 4


def index_topk_pattern(cfg: Mapping[str, Any]) -> str:
    """'F' (runs the indexer, has an indexer cache) or 'S' (reuses the previous full layer's
    top-k) per backbone layer, as vLLM 0.24.0 decides it (deepseek_v2.py)."""
    layers = cfg["num_hidden_layers"]
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        return "".join(pattern[i] if i < len(pattern) else "F" for i in range(layers))
    freq = cfg.get("index_topk_freq", 1)
    offset = cfg.get("index_skip_topk_offset", 2)
    return "".join("F" if max(i - offset + 1, 0) % freq == 0 else "S" for i in range(layers))


@dataclass(frozen=True)
class KvPerToken:
    mla_per_layer: int
    indexer_per_layer: int
    mla_layers: int
    indexer_layers: int
    stored_dtype: str

    @property
    def total(self) -> int:
        return self.mla_per_layer * self.mla_layers + self.indexer_per_layer * self.indexer_layers


def kv_per_token(cfg: Mapping[str, Any], backend: str, kv_cache_dtype: str, layers: range, mtp: bool,
                 last_stage: bool, vllm: str) -> KvPerToken:
    """KV bytes one token takes on one GPU holding `layers`. MLA has one latent KV head: every
    tensor-parallel rank stores all of it. MTP layers always run their own indexer."""
    pattern = index_topk_pattern(cfg)
    mtp_layers = cfg["num_nextn_predict_layers"] if (mtp and last_stage) else 0
    return KvPerToken(
        mla_per_layer=mla_bytes_per_token(cfg, backend, kv_cache_dtype, vllm),
        indexer_per_layer=indexer_bytes_per_token(cfg),
        mla_layers=len(layers) + mtp_layers,
        indexer_layers=sum(1 for i in layers if pattern[i] == "F") + mtp_layers,
        stored_dtype=stored_kv_dtype(backend, kv_cache_dtype, vllm),
    )


# -- the plan ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    gpu: Gpu
    scheme: Scheme
    tp: int
    pp: int
    gpu_memory_utilization: float
    max_model_len: int
    block_size: int
    weights_per_gpu: float  # on one GPU of the stage with the least room for KV
    weights_stage: int
    kv: KvPerToken  # of that stage
    budget: float  # gpu_memory_utilization x memory
    kv_budget: float  # budget - weights
    kv_tokens: int  # whole blocks, as vLLM allocates them
    checkpoint_bytes: float

    @property
    def fits(self) -> bool:
        return self.kv_tokens >= self.max_model_len

    @property
    def full_length_sequences(self) -> int:
        return self.kv_tokens // self.max_model_len if self.max_model_len else 0

    def problem(self) -> str | None:
        if self.fits:
            return None
        if self.kv_budget <= 0:
            return (f"does not fit: {gb(self.weights_per_gpu)} of weights per GPU (stage {self.weights_stage}) "
                    f"exceed the {gb(self.budget)} that gpu_memory_utilization {self.gpu_memory_utilization} "
                    f"allows of the {self.gpu.name}'s {gb(self.gpu.memory_bytes)}")
        return (f"does not fit: after {gb(self.weights_per_gpu)} of weights per GPU, {gb(self.kv_budget)} hold "
                f"{self.kv_tokens} tokens of KV ({self.kv.total} B/token), fewer than max_model_len "
                f"{self.max_model_len} (one full-length request)")

    def lines(self) -> list[str]:
        return [
            f"GPU: {self.gpu.name}, {gb(self.gpu.memory_bytes)} ({self.gpu.memory}; {self.gpu.source})",
            f"weights: {gb(self.checkpoint_bytes)} in all ({self.scheme.id}: {self.scheme.description})",
            f"weights per GPU: {gb(self.weights_per_gpu)} (TP {self.tp}, PP {self.pp}, stage {self.weights_stage})",
            f"budget: gpu_memory_utilization {self.gpu_memory_utilization} x {gb(self.gpu.memory_bytes)} = "
            f"{gb(self.budget)}; left for KV: {gb(self.kv_budget)}",
            f"KV per token per GPU: {self.kv.total} B = {self.kv.mla_layers} layers x {self.kv.mla_per_layer} B "
            f"({self.kv.stored_dtype}) + {self.kv.indexer_layers} indexer caches x {self.kv.indexer_per_layer} B",
            f"KV tokens that fit: {self.kv_tokens} ({self.full_length_sequences} x max_model_len "
            f"{self.max_model_len}); an upper bound: activations, CUDA graphs and NCCL buffers come off it",
        ]


def gb(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def plan(cfg: Mapping[str, Any], scheme: Scheme, gpu: Gpu, *, tp: int, pp: int, mtp: bool, backend: str,
         kv_cache_dtype: str, gpu_memory_utilization: float, max_model_len: int, block_size: int,
         vllm: str) -> Plan:
    """The plan of the stage with the least room for KV: every stage holds the same tokens, so
    that one bounds the cache. `vllm`: the release whose KV layouts apply (KV_RELEASES)."""
    budget = gpu_memory_utilization * gpu.memory_bytes
    candidates = []
    for s in stage_weights(cfg, scheme, tp, pp, mtp):
        kv = kv_per_token(cfg, backend, kv_cache_dtype, s.layers, mtp, last_stage=s.stage == pp - 1, vllm=vllm)
        left = budget - s.bytes_per_gpu
        # vLLM allocates whole blocks of block_size tokens (0.24.0 kv_cache_utils.get_num_blocks,
        # 0.33.0 kv_cache_planning.get_kv_cache_config_from_groups).
        blocks = int(left // (kv.total * block_size)) if left > 0 else 0
        candidates.append((blocks * block_size, -s.bytes_per_gpu, s, kv, left))
    tokens, _, stage, kv, left = min(candidates, key=lambda c: (c[0], c[1]))
    return Plan(gpu=gpu, scheme=scheme, tp=tp, pp=pp, gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len, block_size=block_size, weights_per_gpu=stage.bytes_per_gpu,
                weights_stage=stage.stage, kv=kv, budget=budget, kv_budget=left, kv_tokens=tokens,
                checkpoint_bytes=checkpoint_bytes(cfg, scheme, with_mtp=mtp))
