"""The smoke checks against a fake OpenAI-compatible server, good and broken: each fault a
real server can show must fail exactly the check meant to catch it, with a reason."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_vllm import FakeServer, FakeVllm  # noqa: E402
from test_smoke_fakes import startup_log  # noqa: E402

from dsa_image.core.recipe import RecipeError, load_recipe  # noqa: E402
from dsa_image.smoke import checks as C  # noqa: E402
from dsa_image.smoke import expect, gpu  # noqa: E402
from dsa_image.harness.client import Client  # noqa: E402
from dsa_image.build.tiny_model import CONFIG  # noqa: E402

# The fakes play vLLM 0.24.0 (its dist-info, image label and log: FLASHMLA_SPARSE on sm_90); the
# base the smoke checks follows the served vLLM, so the expectations here are 0.24.0's.
RECIPE = load_recipe(vllm="0.24.0")


def run_all(faults=frozenset(), served="glm-5") -> dict[str, C.Check]:
    with FakeServer(FakeVllm(served, set(faults))) as server:
        results = C.run_http_checks(Client(server.base_url, timeout_s=10), "glm-5")
    assert [c.name for c in results] == list(C.HTTP_CHECKS)
    return {c.name: c for c in results}


def failed(results: dict[str, C.Check]) -> set[str]:
    return {name for name, c in results.items() if not c.passed}


def test_a_good_server_passes_every_http_check():
    results = run_all()
    assert failed(results) == set(), {n: c.reason for n, c in results.items()}
    assert results["completion_long"].details["prompt_tokens"] == C.LONG_PROMPT_TOKENS
    assert results["stream"].details["token_ids"] == results["completion_short"].details["token_ids"]


def test_a_usage_only_stream_chunk_is_no_failure():
    assert failed(run_all({"usage_chunk"})) == set()


def test_the_long_prompt_is_over_index_topk_and_sent_as_token_ids():
    state = FakeVllm()
    with FakeServer(state) as server:
        C.Completions(Client(server.base_url, timeout_s=10), "glm-5").check_long()
    prompts = [body["prompt"] for path, body in state.requests if path == "/v1/completions"]
    assert len(prompts) == 1 and all(isinstance(t, int) for t in prompts[0])
    assert len(prompts[0]) == C.LONG_PROMPT_TOKENS > CONFIG["index_topk"]


def test_requests_are_greedy_and_ask_for_token_ids():
    state = FakeVllm()
    with FakeServer(state) as server:
        C.run_http_checks(Client(server.base_url, timeout_s=10), "glm-5")
    completions = [body for path, body in state.requests if path == "/v1/completions"]
    assert completions and all(b["temperature"] == 0.0 and b["return_token_ids"] and b["ignore_eos"]
                               for b in completions)


@pytest.mark.parametrize(
    "fault, expected_failures, words",
    [
        ("empty_text", {"completion_short", "completion_long", "deterministic", "stream"}, "empty text"),
        ("nan_logprob", {"completion_short", "completion_long", "deterministic", "chat"}, "not finite"),
        ("null_logprob", {"completion_short", "completion_long", "deterministic", "chat"}, "not finite"),
        ("nondeterministic", {"deterministic", "stream"}, "differ"),
        ("short", {"completion_short", "completion_long", "deterministic", "stream", "chat"}, "expected 16"),
        ("no_done", {"stream"}, "[DONE]"),
        ("stream_other_tokens", {"stream"}, "differ from the non-streamed"),
        ("chat_empty", {"chat"}, "no content"),
        ("wrong_model", {"models"}, "expected 'glm-5'"),
        ("no_tokenize", {"completion_long"}, "/tokenize"),
        ("http_500", {"completion_short", "completion_long", "deterministic", "stream"}, "HTTP 500"),
    ],
)
def test_each_fault_fails_its_checks_with_a_reason(fault, expected_failures, words):
    results = run_all({fault})
    assert failed(results) == expected_failures, {n: c.reason for n, c in results.items()}
    first = results[sorted(expected_failures)[0]]
    assert words in first.reason or any(words in results[n].reason for n in expected_failures), \
        {n: results[n].reason for n in expected_failures}


def test_nothing_listening_fails_every_check_without_crashing():
    results = {c.name: c for c in C.run_http_checks(Client("http://127.0.0.1:9", timeout_s=2), "glm-5")}
    assert failed(results) == set(C.HTTP_CHECKS)
    assert "Connection refused" in results["models"].reason or "refused" in results["models"].reason


def test_a_too_short_max_model_len_is_named():
    with FakeServer(FakeVllm(max_model_len=2048)) as server:
        check = C.Completions(Client(server.base_url, timeout_s=10), "glm-5").check_long()
    assert not check.passed and "max_model_len 2048" in check.reason


# --- verify ---------------------------------------------------------------------------------


def test_verify_passes_on_exit_zero_and_fails_with_the_tool_output():
    ok = C.check_verify(lambda: (0, "3 files match the receipt"), "overlay.py verify")
    bad = C.check_verify(lambda: (1, "vllm/envs.py: installed file has sha256 abc, the receipt says def"),
                         "overlay.py verify")
    assert ok.passed and "3 files match" in ok.details["output"]
    assert not bad.passed and "exited 1" in bad.reason and "vllm/envs.py" in bad.reason


# --- expected backends ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "target, capability, attention, kernels",
    [
        ("sm120", (12, 0), "FLASHINFER_MLA_SPARSE_SM120", "b12x"),
        ("sm120", (12, 1), "FLASHINFER_MLA_SPARSE_SM120", "b12x"),
        ("sm100", (10, 0), "FLASHINFER_MLA_SPARSE", "deepgemm"),
        ("sm90", (9, 0), "FLASHMLA_SPARSE", "deepgemm"),
    ],
)
def test_expected_backends_come_from_the_recipe_target(target, capability, attention, kernels):
    t = RECIPE.target(target)
    assert expect.target_for_capability(RECIPE, capability).id == target
    expected = expect.expected_for(t, capability)
    assert (expected.attention_backend, expected.indexer_kernels) == (attention, kernels)
    assert expected.indexer_backend == t.indexer_backend == "DEEPSEEK_V32_INDEXER"
    assert expect.capability_problem(t, capability) is None
    log = "\n".join(startup_log(attention, kernels))
    assert expect.backend_problems(log, expected) == []


# Excerpts of the second 0.33.0 H200 run's server logs (tests/data/excerpts.toml).
H200_RUN2 = Path(__file__).resolve().parent / "data" / "h200-vllm0_33_0-run2-"


@pytest.mark.parametrize("log_name", ["smoke-server.log", "server-overlay.log"])
def test_a_recorded_h200_log_of_vllm_0_33_meets_that_bases_expectations(log_name):
    """The server logs of the H200 run: 0.33.0's sm90 target expects what it logged; 0.24.0's
    (the run's smoke failure, before the base followed the environment) names the difference."""
    log = Path(f"{H200_RUN2}{log_name}").read_text()
    on_033 = expect.expected_for(load_recipe(vllm="0.33.0").target("sm90"), (9, 0))
    assert expect.backend_problems(log, on_033) == []
    on_024 = expect.expected_for(load_recipe(vllm="0.24.0").target("sm90"), (9, 0))
    assert expect.backend_problems(log, on_024) == [
        "attention backend: expected FLASHMLA_SPARSE, log names FLASH_ATTN_MLA_SPARSE"]


def test_b12x_follows_the_target_env(monkeypatch):
    t = RECIPE.target("sm120")
    assert t.env.get(expect.B12X_ENV) == "1"
    without = type(t)(**{**t.__dict__, "env": {}})
    assert expect.expected_for(without, (12, 0)).indexer_kernels == "deepgemm"


def test_wrong_backends_in_the_log_are_named():
    expected = expect.expected_for(RECIPE.target("sm120"), (12, 0))
    problems = expect.backend_problems("\n".join(startup_log("FLASHMLA_SPARSE", "deepgemm")), expected)
    assert len(problems) == 2
    assert "expected FLASHINFER_MLA_SPARSE_SM120, log names FLASHMLA_SPARSE" in problems[0]
    assert "'DSA sparse indexer kernels: b12x', log says deepgemm" in problems[1]


def test_a_log_without_the_overlay_line_says_so():
    expected = expect.expected_for(RECIPE.target("sm90"), (9, 0))
    log = "Using FLASHMLA_SPARSE attention backend out of potential backends: ['FLASHMLA_SPARSE']."
    problems = expect.backend_problems(log, expected)
    assert any("is the overlay installed?" in p for p in problems)
    assert any("DEEPSEEK_V32_INDEXER, not named" in p for p in problems)


def test_an_explicitly_selected_backend_counts():
    log = "Using AttentionBackendEnum.FLASHMLA_SPARSE backend.\n" + "\n".join(startup_log("FLASHMLA_SPARSE", "deepgemm")[1:])
    assert expect.backend_problems(log, expect.expected_for(RECIPE.target("sm90"), (9, 0))) == []


def test_other_backends_in_the_log_are_not_taken_for_attention():
    log = "\n".join(startup_log("FLASHMLA_SPARSE", "deepgemm") + [
        "Using FLASHINFER MLA prefill backend.",
        "Using TRITON Unquantized MoE backend out of potential backends: ['TRITON'].",
        "Using HND KV cache layout for FLASHMLA_SPARSE backend.",
    ])
    assert expect.backend_problems(log, expect.expected_for(RECIPE.target("sm90"), (9, 0))) == []


def test_the_wrong_image_for_the_gpu_fails_the_backend_check():
    t = RECIPE.target("sm120")
    problem = expect.capability_problem(t, (9, 0))
    assert "9.0 is not one target sm120 is built for (12.0, 12.1)" in problem
    check = C.check_backends("\n".join(startup_log("FLASHINFER_MLA_SPARSE_SM120", "b12x")),
                             expect.expected_for(t, (9, 0)), problem)
    assert not check.passed and "sm120" in check.reason


def test_an_unknown_capability_has_no_target():
    with pytest.raises(RecipeError, match="7.5 must match exactly one target"):
        expect.target_for_capability(RECIPE, (7, 5))


# --- nvidia-smi -----------------------------------------------------------------------------


def test_nvidia_smi_query_is_parsed():
    info = gpu.query_gpus(lambda argv: (0, "NVIDIA H200, 9.0, 580.95.05\nNVIDIA H200, 9.0, 580.95.05\n"))
    assert info["gpus"][0] == {"name": "NVIDIA H200", "compute_capability": "9.0", "driver_version": "580.95.05"}
    assert gpu.capability_of(info) == (9, 0)


def test_nvidia_smi_failures_are_reported_not_raised():
    assert "not found" in gpu.query_gpus(lambda argv: (127, "nvidia-smi: not found on this host"))["error"]
    assert "unexpected nvidia-smi line" in gpu.query_gpus(lambda argv: (0, "garbage\n"))["error"]
    mixed = gpu.query_gpus(lambda argv: (0, "A, 9.0, 1\nB, 12.0, 1\n"))
    assert gpu.capability_of(mixed) is None
