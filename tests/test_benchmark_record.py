"""The recorded benchmark and warm-start runs, re-read: every figure the docs cite comes out of
the committed results and logs again (docs/benchmarks/h200-2026-12-01-vllm0_33_0 and
docs/validation/h200-2026-12-01-vllm0_33_0-run5). No GPU: these read files."""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path

import pytest

from dsa_image import bench
from dsa_image.validation import warmstart

REPO = Path(__file__).resolve().parent.parent
BENCH_RUN = REPO / "docs" / "benchmarks" / "h200-2026-12-01-vllm0_33_0"
RESULTS = [BENCH_RUN / "base" / "results.json", BENCH_RUN / "mtp-long" / "results.json"]
RUN5 = REPO / "docs" / "validation" / "h200-2026-12-01-vllm0_33_0-run5"


def _docs() -> list[dict]:
    return [bench.load_results(path) for path in RESULTS]


def _workloads() -> list[dict]:
    return [w for doc in _docs() for w in doc["workloads"]]


def _lines(path: Path) -> set[str]:
    return set(path.read_text().splitlines())


# -- the results themselves ------------------------------------------------------------------------


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.parent.name)
def test_each_recorded_run_follows_the_schema_and_ran_every_planned_round(path):
    doc = bench.load_results(path)
    assert bench.schema_problems(doc) == [] and "error" not in doc and not doc.get("group_errors")
    for w in doc["workloads"]:
        assert w["rounds_done"] == w["rounds_planned"] and not w["truncated"] and not w["failed"]
        assert w["warmup_errors"] == {"A": 0, "B": 0}
        assert [r["order"][0] for r in w["rounds"]] == ["A", "B"] * (w["rounds_done"] // 2)


@pytest.mark.parametrize("name", [w["name"] for w in _workloads()])
def test_each_ratio_and_interval_follows_from_the_rounds(name):
    (w,) = [w for w in _workloads() if w["name"] == name]
    settings = _docs()[0]["settings"]
    for r in w["rounds"]:
        assert r["ratios"] == pytest.approx(bench.round_ratios(r["sides"]["A"]["stats"], r["sides"]["B"]["stats"]))
        for side in bench.SIDES:
            samples = r["sides"][side]["samples"]
            assert len(samples) == w["requests"] and all(s["tokens"] == w["output_len"] for s in samples)
    again = bench.summarize(w["rounds"], settings["resamples"], settings["confidence"], settings["seed"])
    for metric, summary in w["summary"].items():
        assert again[metric]["verdict"] == summary["verdict"] == "within interval"
        for key in ("median_ratio", "ci_low", "ci_high"):
            assert again[metric][key] == pytest.approx(summary[key], rel=1e-12)


def test_both_builds_are_the_default_base_and_b_carries_the_bakes_overlay():
    bake = json.loads((REPO / "docker-bake.json").read_text())
    for doc in _docs():
        a, b = (doc["environment"]["builds"][side] for side in bench.SIDES)
        assert (a["name"], b["name"]) == ("stock", "overlay")
        assert a["versions"]["vllm"] == b["versions"]["vllm"] == "0.33.0"
        assert "overlay_receipt_sha256" not in a["versions"]
        assert b["versions"]["overlay_receipt_sha256"] == bake["variable"]["VLLM"]["default"]["0.33.0"]["RECEIPT_SHA256"]
        assert doc["caches_warm_at_start"] is False


# -- what the docs print from them -----------------------------------------------------------------


def test_the_record_and_the_readme_show_the_tables_the_results_give():
    record = _lines(BENCH_RUN / "README.md")
    ratios = bench.table(_docs()).splitlines()
    assert set(ratios) <= record
    assert set(ratios) <= _lines(REPO / "README.md")
    assert set(bench.levels_table(_docs()).splitlines()) <= record


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


def test_the_start_up_times_in_the_record_are_the_results():
    healthy = {name: seconds for doc in _docs() for name, seconds in doc["healthy_after_s"].items()}
    text = " ".join((BENCH_RUN / "README.md").read_text().split())
    assert (f"base {healthy['bench-base-A']:.0f} s (A) / {healthy['bench-base-B']:.0f} s (B); "
            + "; ".join(f"{g} {healthy[f'bench-{g}-A']:.0f} / {healthy[f'bench-{g}-B']:.0f} s"
                        for g in ("long", "mtp1", "mtp3"))) in text


def _started_before_each_jit(log: Path) -> list[int]:
    started, counts = 0, []
    for line in log.read_text(errors="replace").splitlines():
        if "POST /v1/completions" in line:
            started += 1
        elif "JIT compilation during inference" in line:
            counts.append(started)
    return counts


@pytest.mark.parametrize("log", sorted(BENCH_RUN.glob("*/server-*.log")), ids=lambda p: p.name)
def test_no_compilation_fell_in_a_measured_round(log):
    # The first c=8 workload's unrecorded warm-up round is each server's requests 85-100 (84
    # before it: the c=1 workload's 4 warm-up and 80 measured requests); the long group's is 1-2.
    counts = _started_before_each_jit(log)
    window = range(1, 3) if "-long-" in log.name else range(85, 101)
    assert all(count in window for count in counts), counts
    jit = [k for doc in _docs() for k in doc["jit_during_inference"].get(log.stem.removeprefix("server-"), [])]
    assert len(counts) == len(jit)


# -- the warm start of the fifth run ----------------------------------------------------------------


def _cold_warmup() -> dict:
    return json.loads((RUN5 / "warmstart" / "warmstart-cold-warmup.json").read_text())["steps"]["cold-warmup"]


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


def test_the_fifth_runs_receipt_is_the_bakes():
    bake = json.loads((REPO / "docker-bake.json").read_text())
    assert hashlib.sha256((RUN5 / "receipt.json").read_bytes()).hexdigest() == \
        bake["variable"]["VLLM"]["default"]["0.33.0"]["RECEIPT_SHA256"]
