"""The recorded benchmark and warm-start runs, re-read from their raw.tar.xz (the runs under
docs/benchmarks, docs/validation/h200-2026-12-01-vllm0_33_0-run5 and the real-width runs 10 and 12): each follows the schema,
every ratio, interval and verdict follows from its rounds, and the records' tables are what the
code makes of the results. Records are history: the receipts they ran against today's bake, and
the figures the prose and README.md state, are the release check's (scripts/release_check.py).
No GPU: these read files."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from dsa_image.bench import report, schedule, stats
from dsa_image.validation import warmstart
from record_files import BENCHMARKS, VALIDATION, unpacked

BENCH_RUN = BENCHMARKS / "h200-2026-12-01-vllm0_33_0"
RESULTS = [unpacked(BENCH_RUN) / "base" / "results.json", unpacked(BENCH_RUN) / "mtp-long" / "results.json"]
BASES = BENCHMARKS / "h200-2026-12-01-vllm0_24_0-vs-vllm0_33_0"
MTP2 = BENCHMARKS / "h200-2026-12-01-vllm0_33_0-mtp2"
REALWIDTH = VALIDATION / "h200-2026-12-04-vllm0_33_0-run10"  # GLM-5 at real width, 4 layers
REALWIDTH_RESULTS = unpacked(REALWIDTH) / "realwidth-bench" / "results.json"
# The two bases at real width (run 12, one H100).
REALWIDTH_BASES = unpacked(VALIDATION / "h100-2026-12-06-vllm0_33_0-run12") / "realwidth-bench-bases" / "results.json"
ALL_RESULTS = [*RESULTS, unpacked(BASES) / "results.json", unpacked(MTP2) / "results.json", REALWIDTH_RESULTS,
               REALWIDTH_BASES]
RUN5 = VALIDATION / "h200-2026-12-01-vllm0_33_0-run5"


def _docs() -> list[dict]:
    return [report.load_results(path) for path in RESULTS]


def _workloads() -> list[dict]:
    return [w for doc in _docs() for w in doc["workloads"]]


def _lines(path: Path) -> set[str]:
    return set(path.read_text().splitlines())


# -- the results themselves ------------------------------------------------------------------------


@pytest.mark.parametrize("path", ALL_RESULTS, ids=lambda p: p.parent.name)
def test_each_recorded_run_follows_the_schema_and_ran_every_planned_round(path):
    doc = report.load_results(path)
    assert report.schema_problems(doc) == [] and "error" not in doc and not doc.get("group_errors")
    for w in doc["workloads"]:
        assert w["rounds_done"] == w["rounds_planned"] and not w["truncated"] and not w["failed"]
        assert w["warmup_errors"] == {"A": 0, "B": 0}
        assert [r["order"][0] for r in w["rounds"]] == ["A", "B"] * (w["rounds_done"] // 2)


@pytest.mark.parametrize("path, name", [pytest.param(path, w["name"], id=f"{path.parent.name}/{w['name']}")
                                        for path in ALL_RESULTS for w in report.load_results(path)["workloads"]])
def test_each_ratio_interval_and_verdict_follows_from_the_rounds(path, name):
    doc = report.load_results(path)
    (w,) = [w for w in doc["workloads"] if w["name"] == name]
    settings = doc["settings"]
    for r in w["rounds"]:
        assert r["ratios"] == pytest.approx(stats.round_ratios(r["sides"]["A"]["stats"], r["sides"]["B"]["stats"]))
        for side in schedule.SIDES:
            samples = r["sides"][side]["samples"]
            assert len(samples) == w["requests"] and all(s["tokens"] == w["output_len"] for s in samples)
    again = stats.summarize(w["rounds"], settings["resamples"], settings["confidence"], settings["seed"])
    for metric, summary in w["summary"].items():
        assert again[metric]["verdict"] == summary["verdict"]
        for key in ("median_ratio", "ci_low", "ci_high"):
            assert again[metric][key] == pytest.approx(summary[key], rel=1e-12)


def test_every_verdict_of_the_first_run_is_within_interval():
    assert {s["verdict"] for w in _workloads() for s in w["summary"].values()} == {"within interval"}


def test_both_builds_are_the_default_base_and_only_b_carries_an_overlay():
    for doc in [*_docs(), report.load_results(REALWIDTH_RESULTS)]:
        a, b = (doc["environment"]["builds"][side] for side in schedule.SIDES)
        assert (a["name"], b["name"]) == ("stock", "overlay")
        assert a["versions"]["vllm"] == b["versions"]["vllm"] == "0.33.0"
        assert "overlay_receipt_sha256" not in a["versions"] and b["versions"]["overlay_receipt_sha256"]
        assert doc["caches_warm_at_start"] is False


# -- what the docs print from them -----------------------------------------------------------------


@pytest.mark.parametrize("record, paths", [pytest.param(record, paths, id=record.name) for record, paths in (
    (BENCH_RUN, RESULTS), (BASES, [unpacked(BASES) / "results.json"]), (MTP2, [unpacked(MTP2) / "results.json"]),
    (REALWIDTH, [REALWIDTH_RESULTS]))])
def test_each_record_shows_the_tables_the_results_give(record, paths):
    docs = [report.load_results(path) for path in paths]
    text = _lines(record / "README.md")
    assert set(report.table(docs).splitlines()) <= text
    assert set(report.levels_table(docs).splitlines()) <= text


def test_the_mtp_counters_in_the_record_are_the_results_and_equal_on_both_sides():
    record = _lines(BENCH_RUN / "README.md")
    for w in _workloads():
        if not w["name"].startswith("mtp"):
            assert w["spec_decode"] is None
            continue
        a, b = w["spec_decode"]["A"], w["spec_decode"]["B"]
        assert a == b
        rate = a["acceptance_rate"]
        row = (f"| {w['name']} | {a['drafts']:,.0f} | {a['draft_tokens']:,.0f} | {a['accepted_tokens']:,.0f} "
               f"| {f'{rate:.4f}' if rate else '0'} |")
        assert row in record


def _started_before_each_jit(log: Path) -> list[int]:
    started, counts = 0, []
    for line in log.read_text(errors="replace").splitlines():
        if "POST /v1/completions" in line:
            started += 1
        elif "JIT compilation during inference" in line:
            counts.append(started)
    return counts


def _unrecorded_requests(doc: dict, group: str) -> set[int]:
    """The request numbers, as one server of `group` counts them, of each workload's unrecorded
    warm-up round: each workload of the group sends one round of its requests first, then its
    measured rounds."""
    warmup, sent = set(), 0
    for w in doc["workloads"]:
        if w["group"] == group:
            warmup |= set(range(sent + 1, sent + w["requests"] + 1))
            sent += w["requests"] * (1 + w["rounds_done"])
    return warmup


@pytest.mark.parametrize("path, log", [
    pytest.param(path, log, id=str(log.relative_to(unpacked(BENCH_RUN).parents[1])))
    for path in ALL_RESULTS for log in sorted(path.parent.glob("server-*.log"))])
def test_no_compilation_fell_in_a_measured_round(path, log):
    # The first benchmark's JITs all came after request 92 (the first c=8 workload's warm-up round
    # is requests 85-100) or in the long group's first request; the bases' 0.24.0 server compiled
    # `_compute_slot_mapping_kernel` in its very first request.
    doc = report.load_results(path)
    group = log.stem.removeprefix("server-bench-").rsplit("-", 1)[0]
    counts = _started_before_each_jit(log)
    assert set(counts) <= _unrecorded_requests(doc, group), counts
    assert len(counts) == len(doc["jit_during_inference"][log.stem.removeprefix("server-")])


# -- the warm start of the fifth run ----------------------------------------------------------------


def _cold_warmup() -> dict:
    return json.loads((unpacked(RUN5) / "warmstart" / "warmstart-cold-warmup.json").read_text())["steps"]["cold-warmup"]


@pytest.mark.parametrize("side", ["stock", "overlay"])
def test_the_images_first_start_meets_the_goal_as_recorded(side):
    step = _cold_warmup()
    assert step["empty_caches_at_start"] is True and step["warmup"] is True
    s = step["sides"][side]
    warm = statistics.median(w["latency_s"] for w in s["warm"])
    assert s["warm_latency_s"] == warm and s["first_over_warm"] == round(s["first"]["latency_s"] / warm, 2)
    assert s["goal_met"] is (s["first"]["latency_s"] <= warmstart.GOAL_FACTOR * warm) is True
    empty = {"triton_jit": {}, "deepgemm_nvcc_runs": 0, "flashinfer_jit_builds": [], "other_jit": {}}
    assert s["compiled"]["during_first_request"] == s["compiled"]["during_warm_requests"] == empty
    assert s["ready_after_s"] == pytest.approx(s["healthy_after_s"] + s["warmup"]["seconds"], abs=0.1)
    row = (f"| `cold-warmup` | {side} | {s['healthy_after_s']:.1f} | {s['warmup']['seconds']:.1f} "
           f"| {s['ready_after_s']:.1f} | {s['first']['latency_s']:.3f} | {s['warm_latency_s']:.3f} "
           f"| {s['first_over_warm']:.2f} | met | – |")
    assert row in _lines(RUN5 / "README.md")


def test_only_stock_compiled_the_prefill_chunk_kernel_and_only_in_the_warmup():
    sides = _cold_warmup()["sides"]
    during = {side: sides[side]["compiled"]["during_warmup"]["triton_jit"] for side in sides}
    assert during["stock"].pop("BuildPrefillChunkMetadataKernel") == 2
    assert during["stock"] == during["overlay"] == {"_gumbel_sample_kernel": 1, "_topk_topp_kernel": 1,
                                                    "fused_moe_kernel": 4}


# -- the two bases against each other, and MTP 2 ------------------------------------------------------


def _verdicts(path: Path) -> dict[str, dict[str, str]]:
    return {w["name"]: {m: s["verdict"] for m, s in w["summary"].items()} for w in report.load_results(path)["workloads"]}


def test_the_bases_are_the_two_images_builds_each_with_its_overlay():
    doc = report.load_results(unpacked(BASES) / "results.json")
    builds = doc["environment"]["builds"]
    assert [(builds[s]["name"], builds[s]["versions"]["vllm"], builds[s]["versions"]["torch"]) for s in schedule.SIDES] == [
        ("overlay-0.24.0", "0.24.0", "2.11.0"), ("overlay-0.33.0", "0.33.0", "2.14.0")]
    assert all(builds[side]["versions"]["overlay_receipt_sha256"] for side in schedule.SIDES)
    assert doc["caches_warm_at_start"] is False


def test_vllm_0_33_is_behind_0_24_in_either_order():
    verdicts = _verdicts(unpacked(BASES) / "results.json")
    assert {name: v["output_tok_s"] for name, v in verdicts.items()} == dict.fromkeys(verdicts, "B behind")
    assert [name for name, v in verdicts.items() if v["tpot_s"] == "B behind"] == [
        "512x128-c1", "512x128-c8", "6000x128-c8"]
    assert [name for name, v in verdicts.items() if v["ttft_p50_s"] == "B behind"] == ["512x128-c32", "6000x128-c8"]
    assert [name for name, v in verdicts.items() if v["ttft_p99_s"] == "B behind"] == ["6000x128-c8"]
    assert not any("B ahead" in v.values() for v in verdicts.values())
    doc = report.load_results(unpacked(BASES) / "results.json")
    medians = [w["summary"]["output_tok_s"]["median_ratio"] for w in doc["workloads"]]
    assert (round(100 * (1 - max(medians))), round(100 * (1 - min(medians)))) == (10, 16)
    texts = [w["texts"] for w in doc["workloads"]]
    assert (sum(t["equal"] for t in texts), sum(t["compared"] for t in texts)) == (2, 1040)


def _line(log: Path, needle: str) -> str:
    return next(line for line in log.read_text(errors="replace").splitlines() if needle in line)


def test_what_the_bases_record_says_differs_at_start_is_in_their_logs():
    a, b = unpacked(BASES) / "server-bench-base-A.log", unpacked(BASES) / "server-bench-base-B.log"
    assert "(v0.24.0)" in _line(a, "Initializing a V1 LLM engine") and "(v0.33.0)" in _line(b, "Initializing a V1 LLM engine")
    assert "'mode': <CompilationMode.VLLM_COMPILE: 3>" in _line(a, "compilation_config=")
    config = _line(b, "compilation_config=")
    assert "'mode': <CompilationMode.NONE: 0>" in config and "'custom_ops': ['all']" in config
    assert "'splitting_ops': []" in config
    for log in (a, b):
        assert "'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE" in _line(log, "compilation_config=")
    assert "Auto-enabling VLLM_USE_BREAKABLE_CUDAGRAPH=1" in b.read_text() and "BREAKABLE" not in a.read_text()
    assert "Using V2 Model Runner" in b.read_text() and "V2 Model Runner" not in a.read_text()
    assert "Using FLASHMLA_SPARSE attention backend" in a.read_text()
    assert "Using FLASH_ATTN_MLA_SPARSE attention backend" in b.read_text()


def test_mtp2_is_the_flattened_path_the_same_texts_and_drafts_on_both_sides():
    doc = report.load_results(unpacked(MTP2) / "results.json")
    builds = doc["environment"]["builds"]
    assert builds["A"]["versions"]["vllm"] == builds["B"]["versions"]["vllm"] == "0.33.0"
    for side in schedule.SIDES:
        assert "use_flattening=True supports_varlen=False (next_n=3" in (unpacked(MTP2) / f"server-bench-mtp2-{side}.log").read_text()
    for w in doc["workloads"]:
        assert w["texts"]["equal"] == w["texts"]["compared"] == w["requests"] * w["rounds_done"]
        a, b = w["spec_decode"]["A"], w["spec_decode"]["B"]
        assert a == b and a["accepted_tokens"] == 0
    assert _verdicts(unpacked(MTP2) / "results.json") == {
        "mtp2-512x128-c1": {"output_tok_s": "within interval", "ttft_p50_s": "within interval",
                            "ttft_p99_s": "B ahead", "tpot_s": "within interval"},
        "mtp2-512x128-c8": dict.fromkeys(("output_tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_s"), "within interval")}


def test_the_lean_at_concurrency_8_is_the_rounds():
    (c8,) = [w for w in report.load_results(unpacked(MTP2) / "results.json")["workloads"] if w["name"] == "mtp2-512x128-c8"]
    low = [r for r in c8["rounds"] if r["ratios"]["output_tok_s"] < 0.9]
    high = [r for r in c8["rounds"] if r["ratios"]["output_tok_s"] >= 0.9]
    assert (len(low), len(high)) == (6, 4)
    assert 0.815 <= min(r["ratios"]["output_tok_s"] for r in low) and max(r["ratios"]["output_tok_s"] for r in low) < 0.865
    assert 0.955 <= min(r["ratios"]["output_tok_s"] for r in high) and max(r["ratios"]["output_tok_s"] for r in high) < 1.155
    assert 1.205 <= min(r["ratios"]["tpot_s"] for r in low) and max(r["ratios"]["tpot_s"] for r in low) < 1.265


def test_the_real_width_benchmark_found_no_difference_and_equal_texts():
    # Run 10: every interval holds 1, and every prompt gave both builds the same greedy text.
    doc = report.load_results(REALWIDTH_RESULTS)
    assert {s["verdict"] for w in doc["workloads"] for s in w["summary"].values()} == {"within interval"}
    assert all(w["texts"]["equal"] == w["texts"]["compared"] > 0 for w in doc["workloads"])
