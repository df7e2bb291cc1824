"""What the serving harnesses count as an answer and how they compare two builds, on the CPU.

Measured on an H200 with vLLM 0.33.0: the tiny GLM-5 with random weights, greedy, generated token
257 (a lone byte of the byte-level tokenizer, an invalid UTF-8 sequence on its own) 24 times on
every build, stock and overlay token for token alike, and the text was "". The harnesses failed
that run as "empty_text". A server answered when it generated tokens; empty text is recorded; two
builds must agree on the texts of the same tokens.
"""

import sys
from pathlib import Path

from dsa_image.harness import server as serving
from dsa_image.validation import b12x_serving, recipes
from dsa_image.validation import serving as serving_check

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bench import FakeVllm, FakeServer  # noqa: E402

LONE_BYTE = 257


def _choice(tokens, text, top=None):
    choice = {"token_ids": list(tokens), "logprobs": [-0.5] * len(tokens), "text": text}
    if top is not None:
        choice["top_tokens"] = top
    return choice


def _results(tokens=(LONE_BYTE,) * 3, text="", top=None):
    return {mode: [_choice(tokens, text, top) for _ in serving.PROMPT_LENGTHS] for mode in ("sequential", "concurrent")}


# -- answered ---------------------------------------------------------------------------------------


def test_a_server_answered_when_it_generated_tokens_whatever_their_text():
    assert serving.answered({"token_ids": [LONE_BYTE] * 24, "text": ""})
    assert not serving.answered({"token_ids": [], "text": ""})
    # Without token ids (not requested): the response's usage says.
    assert serving.answered({"text": ""}, {"completion_tokens": 16})
    assert not serving.answered({"text": "stale"}, {"completion_tokens": 0})
    assert not serving.answered({"text": "x"})


def test_empty_text_is_recorded_and_no_tokens_is_unanswered():
    findings = serving.output_findings({"stock_a": _results(), "overlay": _results(tokens=(), text=""),
                                        "stock_b": _results(tokens=(5,), text="a")})
    assert findings["empty_text"] == {"stock_a": [f"{m}[{i}]" for m in ("sequential", "concurrent")
                                                  for i in range(len(serving.PROMPT_LENGTHS))]}
    assert list(findings["unanswered"]) == ["overlay"]
    assert serving.unanswered_outputs(_results()) == []


# -- comparing two builds ---------------------------------------------------------------------------


def test_the_same_tokens_must_give_the_same_text():
    same = serving.compare(_results(), _results())
    assert same["identical_tokens"] and same["text_mismatches"] == [] and serving.same_outputs(same)
    other = serving.compare(_results(), _results(text="\ufffd"))
    assert other["identical_tokens"] and not serving.same_outputs(other)
    assert other["text_mismatches"][0] == "sequential[0] (20 tokens)" and len(other["text_mismatches"]) == 12
    # Texts of different tokens are the token mismatch's business, not a second finding.
    differ = serving.compare(_results(), _results(tokens=(5, 6, 7), text="abc"))
    assert len(differ["mismatches"]) == 12 and differ["text_mismatches"] == []


def test_top_token_sets_are_compared_for_information_only():
    top = [[LONE_BYTE, 3, 4, 5, 6]] * 3
    swapped = [[LONE_BYTE, 3, 4, 5, 6], [LONE_BYTE, 3, 4, 5, 9], [6, 5, 4, 3, LONE_BYTE]]  # rank 5 swapped once
    comparison = serving.compare(_results(top=top), _results(top=swapped))
    assert comparison["top_tokens"] == {"k": 5, "positions": 36, "same_set_share": round(24 / 36, 6)}
    assert serving.same_outputs(comparison)  # a near-tie at rank 5 is noise, not a verdict
    assert "top_tokens" not in serving.compare(_results(), _results())  # logprobs=1 harnesses


def _report(**changes):
    same = serving.compare(_results(), _results())
    report = {"stock_vs_stock": same, "stock_vs_overlay": same, "jit_during_inference": {"overlay": []},
              **serving.output_findings({"stock_a": _results(), "stock_b": _results(), "overlay": _results()})}
    return {**report, **changes}


def test_the_serving_verdict_passes_empty_text_and_fails_no_tokens_or_other_text():
    assert serving_check.verdict(_report()) and _report()["empty_text"]
    assert not serving_check.verdict(_report(unanswered={"overlay": ["sequential[0]"]}))
    other = serving.compare(_results(), _results(text="x"))
    assert not serving_check.verdict(_report(stock_vs_overlay=other))
    assert not serving_check.verdict(_report(jit_during_inference={"overlay": ["_build_prefill_chunk_metadata_kernel"]}))


DATA = Path(__file__).resolve().parent / "data"


def _jit_report(run: str) -> dict:
    """_report() with the kernels the H200's servers of `run` compiled during inference (excerpts
    of their logs: tests/data/excerpts.toml)."""
    return _report(jit_during_inference={name: serving.jit_kernels_during_inference(
        str(DATA / f"h200-vllm0_33_0-{run}-server-{name}.log")) for name in ("stock_a", "stock_b", "overlay")})


def test_the_verdict_knows_0_33s_prefill_chunk_kernel():
    # vLLM 0.33.0's kernel is the class BuildPrefillChunkMetadataKernel ("....kernel" in the JIT
    # monitor's line). The first 0.33.0 run's overlay, before its warm-up registered the kernel,
    # compiled it during inference; the second run's did not.
    first = _jit_report("run1")
    assert "BuildPrefillChunkMetadataKernel" in first["jit_during_inference"]["overlay"]
    assert not serving_check.verdict(first)
    second = _jit_report("run2")
    assert second["jit_during_inference"]["overlay"] == ["fused_moe_kernel"] and serving_check.verdict(second)


def test_complete_asks_for_the_top_5_as_token_ids():
    with FakeServer(FakeVllm(faults={"empty_text"})) as server:
        out = serving.complete(server.port, [9, 10, 11])
    sent = server.state.completions[0]
    assert sent["logprobs"] == serving.TOP_LOGPROBS == 5 and sent["return_tokens_as_token_ids"] is True
    assert out["text"] == "" and len(out["token_ids"]) == serving.MAX_TOKENS and serving.answered(out)
    assert all(top == [t + r for r in range(5)] for t, top in zip(out["token_ids"], out["top_tokens"], strict=True))


def test_parse_choice_keeps_token_strings_that_are_not_ids():
    choice = {"token_ids": [1], "text": "a", "logprobs": {"token_logprobs": [-0.1],
                                                        "top_logprobs": [{"a": -0.1, "b": -2.0}, None]}}
    assert serving.parse_choice(choice, 1)["top_tokens"] == [["a"], None]
    assert "top_tokens" not in serving.parse_choice(choice)


# -- the other harnesses --------------------------------------------------------------------------


def _b12x_report(**changes):
    logs = {"b12x-stock": {"kernels": [], "capability_bypassed": True, "errors": []},
            "b12x-emulated": {"kernels": ["b12x"], "capability_bypassed": True, "errors": []}}
    taps = [{"same_inputs": True, "b12x_equals_reference": True, "deepgemm_only_near_ties": True}]
    results = {"b12x-stock": _results(), "b12x-emulated": _results()}
    return {"stock_vs_b12x": serving.compare(*results.values()), "logs": logs, "taps": taps,
            **serving.output_findings(results), **changes}


def test_b12x_serving_passes_empty_text_and_fails_no_tokens_or_other_text():
    assert b12x_serving.verdict(_b12x_report()) and _b12x_report()["empty_text"]
    assert not b12x_serving.verdict(_b12x_report(unanswered={"b12x-emulated": ["sequential[0]"]}))
    assert not b12x_serving.verdict(_b12x_report(stock_vs_b12x=serving.compare(_results(), _results(text="y"))))
    # Its tokens may differ (DeepGEMM rounds otherwise): that alone is explained by the taps.
    assert b12x_serving.verdict(_b12x_report(stock_vs_b12x=serving.compare(_results(), _results(tokens=(5,), text="y"))))


def test_a_recipe_completion_answered_when_it_generated_tokens(monkeypatch):
    def answer(completion_tokens, text):
        monkeypatch.setattr(recipes, "_post", lambda *a, **k: {"status": 200, "body": {
            "choices": [{"text": text, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": completion_tokens}}})
        return recipes.completion(1, "glm-5", [9, 10, 11])
    assert answer(16, "")["ok"] and answer(16, "")["text"] == ""
    assert not answer(0, "")["ok"]
