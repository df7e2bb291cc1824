"""The first-use GEMM measurement (dsa_image/validation/gemm_first_use.py): its shapes from GLM-5's
model facts, the token counts it warms, what it calls a kernel only a probe length ran, and a
variant's failure reported. The measurement itself needs a GPU (the H200 records)."""

from __future__ import annotations

import json

import pytest
from conftest import _has_nvidia_gpu

from dsa_image.build.realwidth_model import facts
from dsa_image.core import status
from dsa_image.runtime.warmup import DEFAULT_PREFILL
from dsa_image.validation import gemm_first_use as g

GLM5 = facts()


def test_the_shapes_are_glm5s_layers_split_as_tensor_parallel_splits_them():
    one, eight = g.gemm_shapes(GLM5), g.gemm_shapes(GLM5, tp=8)
    heads = GLM5["num_attention_heads"]
    assert one["q_b_proj"] == (GLM5["q_lora_rank"], heads * (GLM5["qk_nope_head_dim"] + GLM5["qk_rope_head_dim"]))
    assert one["o_proj"] == (heads * GLM5["v_head_dim"], GLM5["hidden_size"])
    assert one["dense.gate_up_proj"] == (GLM5["hidden_size"], 2 * GLM5["intermediate_size"])
    split = {"q_b_proj", "kv_b_proj", "o_proj", "dense.gate_up_proj", "dense.down_proj",
             "shared_experts.gate_up_proj", "shared_experts.down_proj"}
    for name, (k, n) in one.items():
        if name in split:
            assert eight[name] in ((k // 8, n), (k, n // 8)), name
        else:
            assert eight[name] == (k, n), name  # replicated: the latent projections, the indexer, the router
    assert g.absorbed_shapes(GLM5, tp=8)["absorb.q_nope@W_UK"][0] == heads // 8


def test_the_warm_lengths_are_what_a_server_ran_before_its_first_request():
    lengths = g.warm_lengths()
    assert set(DEFAULT_PREFILL) <= set(lengths) and {1, 512, g.PROFILE_TOKENS} <= set(lengths)
    assert not set(g.PROBE_LENGTHS) & set(lengths)  # a probe length is new by construction


def test_a_kernel_is_new_to_the_process_when_no_warm_length_and_no_earlier_probe_ran_it():
    warm = {str(m): ["k64"] for m in g.warm_lengths()}
    kernels = {"router": {**warm, "3000": ["k104"], "3500": ["k104"], "3001": ["k64"]},
               "o_proj": {**warm, "3000": ["k64", "reduce"], "3500": ["k64"], "3001": ["k64"]}}
    assert g.new_kernels(kernels, (3000, 3500, 3001)) == {"3000": ["o_proj", "router"], "3500": [], "3001": []}
    probe = {"shapes": {"router": {}, "o_proj": {}}}
    doc = {"kernels": kernels, "probes": {"3000": {**probe, "loaded": ["router"]},
                                          "3500": {**probe, "loaded": ["router"]}, "3001": {**probe, "loaded": []}}}
    assert g.slow_against_new(doc, (3000, 3500, 3001)) == \
        {"slow_new": 1, "slow_not_new": 1, "fast_new": 1, "fast_not_new": 3}


def test_a_variant_is_env_equals_value_or_empty():
    assert g.parse_args(["--out", "o", "--variant", "", "--variant", "A=B"]).variant == ["", "A=B"]
    with pytest.raises(SystemExit):
        g.parse_args(["--out", "o", "--variant", "EAGER"])


@pytest.mark.skipif(_has_nvidia_gpu(), reason="a GPU is here: the variant would measure, not fail")
def test_a_variant_that_cannot_measure_is_recorded_and_fails_the_run(tmp_path, capsys):
    assert g.main(["--out", str(tmp_path), "--variant", "CUDA_MODULE_DATA_LOADING=EAGER", "--timeout", "120"]) \
        == status.FAILED
    doc = json.loads((tmp_path / "gemm-first-use.json").read_text())
    assert doc["variants"]["CUDA_MODULE_DATA_LOADING=EAGER"]["error"].startswith("exit ")
    assert "CUDA_MODULE_DATA_LOADING=EAGER: exit" in capsys.readouterr().out


def test_a_variant_that_outlives_its_timeout_is_recorded_and_fails_the_run(tmp_path):
    assert g.main(["--out", str(tmp_path), "--variant", "", "--timeout", "0.01"]) == status.FAILED
    doc = json.loads((tmp_path / "gemm-first-use.json").read_text())
    assert doc["variants"][""] == {"error": "timed out after 0.01 s"}
