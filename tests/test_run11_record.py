"""Run 11's record (docs/validation/h100-2026-12-06-vllm0_33_0-run11) re-derived from its raw
files: the start table and the first-use excesses from startup.json, the upstream files' rows,
totals and failure causes from the gate's results, and the half-run file's progress from its
shards' records, read with the gate's own reader. Nothing is compared with today's tree. No GPU."""

from __future__ import annotations

import collections
import json

import pytest

from dsa_image.upstream import compare as upstream_compare
from dsa_image.upstream import run as upstream_run
from record_files import VALIDATION, missing_model_configs, readme_flat, readme_lines, unpacked

RECORD = VALIDATION / "h100-2026-12-06-vllm0_33_0-run11"
STARTS = {"after-cold": "cold", "after-restart": "restart"}
NIXL = "tests/v1/kv_connector/unit/test_nixl_desc_geometry.py"
SPARSE = "tests/v1/attention/test_sparse_mla_backends.py"
SIDES = ("stock", "overlay")


def _flat() -> str:
    return readme_flat(RECORD)


def _rows() -> set[str]:
    return set(readme_lines(RECORD))


def _startup() -> dict:
    return json.loads((unpacked(RECORD) / "realwidth-startup" / "startup.json").read_text())


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _excess_ms(side: dict) -> float:
    return round((side["first"]["latency_s"] - side["warm_latency_s"]) * 1000, 1)


@pytest.mark.parametrize("start", STARTS)
def test_each_start_row_is_its_startup_json(start):
    doc = _startup()["starts"][start]
    side, probe = doc["sides"]["overlay"], doc["sides"]["overlay"]["new_length"]
    assert doc["empty_caches_at_start"] is (start == "after-cold") and doc["warmup"] is True
    assert side["goal_met"] is True and side["first_over_warm"] <= 1.2 and probe["tokens"] == 3500
    nothing = {"triton_jit": {}, "deepgemm_nvcc_runs": 0, "flashinfer_jit_builds": [], "other_jit": {}}
    assert side["compiled"]["during_first_request"] == side["compiled"]["during_warm_requests"] == nothing
    assert not probe["compiled"]
    row = (f"| {STARTS[start]} | {doc['phases']['healthy_s']:.1f} s | {doc['phases']['ready_s']:.1f} s "
           f"| {side['first_over_warm']:.2f}x ({_ms(side['first']['latency_s'])} / {_ms(side['warm_latency_s'])}) "
           f"| {probe['first_over_warm']:.2f}x ({_ms(probe['first']['latency_s'])} / {_ms(probe['warm_latency_s'])}) "
           "| nothing |")
    assert row in _rows()


def test_the_excesses_the_prose_states_are_the_starts():
    starts = _startup()["starts"]
    cold, restart = (starts[s]["sides"]["overlay"] for s in STARTS)
    probes = {_excess_ms(s["new_length"]) for s in (cold, restart)}
    assert probes == {9.7}
    assert f"its first request cost {probes.pop()} ms over its warm ones on both starts, against " \
           f"{_excess_ms(cold)} ms (cold) and {_excess_ms(restart)} ms (restart)" in _flat()


def test_the_phase_passed_its_goal_and_the_memory_plan():
    raw = unpacked(RECORD)
    assert "WARM START: PASS" in (raw / "realwidth-startup.log").read_text()
    assert "MEMORY PLAN: PASS" in (raw / "realwidth-startup" / "after" / "memory-plan.txt").read_text()
    plans = json.loads((raw / "realwidth-startup" / "after" / "memory-plan.json").read_text())
    assert len(plans) == 2 and all(p["ok"] for p in plans.values())
    (kv,) = {(p["kv"]["vllm_tokens"], p["kv"]["plan_tokens"], p["kv"]["plan_bytes_per_token"]) for p in plans.values()}
    (weights,) = {(p["weights"]["vllm_weights_gib"], p["weights"]["plan_gib"]) for p in plans.values()}
    assert (f"KV cache {kv[0]:,} tokens in 4 GiB, the plan's {kv[1]:,} ({kv[2]:,} bytes a token); "
            f"weights {weights[0]:.2f} GiB loaded, the plan's {weights[1]:.2f} GiB") in _flat()


# -- upstream's tests ---------------------------------------------------------------------------


def _results():
    return unpacked(RECORD) / "upstream-tests"


def _compare() -> dict:
    return json.loads((_results() / "compare.json").read_text())


def _run(side: str) -> dict:
    return json.loads((_results() / side / "run.json").read_text())


def test_every_file_but_one_compared_without_a_regression():
    doc = _compare()
    assert (doc["verdict"], doc["regressions"], doc["complete"]) == ("incomplete", 0, False)
    left = [f for f in doc["files"] if any(_run(s)["files"][f]["status"] != "ran" for s in SIDES)]
    assert (len(doc["files"]), left) == (21, [SPARSE])
    assert "20 of the 21 selected files compared, 0 regressions" in _flat()


def test_the_two_files_rows_are_the_gates_counts():
    doc = _compare()
    counts = {side: doc["files"][NIXL][side]["counts"] for side in SIDES}
    cells = [f"{c['passed']} / {c['failed'] + c['error']} / {c['skipped']}" for c in counts.values()]
    seconds = {f: " / ".join(f"{_run(s)['files'][f]['seconds']:.1f}" for s in SIDES) for f in (NIXL, SPARSE)}
    assert f"| {NIXL} | {cells[0]} | {cells[1]} | {seconds[NIXL]} |" in _rows()
    assert f"| {SPARSE} | partial | partial | {seconds[SPARSE]} |" in _rows()


def test_the_totals_are_the_files_counts():
    totals = {side: collections.Counter() for side in SIDES}
    for result in _compare()["files"].values():
        for side in SIDES:
            totals[side].update(result[side]["counts"])
    assert totals["stock"] == totals["overlay"]
    t = totals["stock"]
    assert (t["crashed"], t["timeout"]) == (0, 0)
    assert (f"{t['passed']} passed, {t['failed'] + t['error']} failed ({t['failed']} failures, {t['error']} errors) "
            f"and {t['skipped']} skipped on each side") in _flat()


def test_every_test_failing_on_both_sides_failed_for_a_missing_model_config():
    doc = _compare()
    by_model = collections.Counter()
    for path, result in doc["files"].items():
        fails = {side: result[side]["counts"]["failed"] + result[side]["counts"]["error"] for side in SIDES}
        assert len(result["fail_on_both"]) == fails["stock"] == fails["overlay"]
        models = {side: missing_model_configs(_results(), side, path) for side in SIDES}
        assert len(models["stock"]) == len(models["overlay"]) == fails["stock"], path
        assert collections.Counter(models["stock"]) == collections.Counter(models["overlay"])
        by_model.update(models["stock"])
    assert dict(by_model) == {"facebook/opt-125m": 263, "Qwen/Qwen3-0.6B": 3, "Qwen/Qwen3.5-0.8B": 3,
                              "ibm-granite/granite-4.0-tiny-preview": 2}
    flat = _flat()
    for model, count in by_model.items():
        assert f"`{model}` ({count}" in flat


def _sparse_outcomes(side: str) -> tuple[int, dict[str, str]]:
    shards = len(_run(side)["files"][SPARSE]["shards"])
    collected = set()
    for shard in upstream_run.shards_of(shards):
        collected |= set(upstream_run.read_record(upstream_run.record_path(_results() / side, SPARSE, shard), SPARSE).collected)
    return len(collected), upstream_run.file_record_results(_results() / side, SPARSE, shards)[0]


def test_the_half_run_files_progress_is_its_shards_records():
    found = {side: _sparse_outcomes(side) for side in SIDES}
    (collected,) = {n for n, _ in found.values()}
    words = []
    for side in SIDES:
        c = collections.Counter(found[side][1].values())
        assert set(c) <= {"passed", "failed", "skipped"}
        words.append((len(found[side][1]), c["skipped"], c["failed"], c["passed"]))
    both = set(found["stock"][1]) & set(found["overlay"][1])
    assert both and all(found["stock"][1][t] == found["overlay"][1][t] for t in both)
    # The gate's compare reads the same: the tests both sides finished, none a regression.
    files = _compare()["files"][SPARSE]
    so_far = upstream_compare.compare_file(SPARSE, _run("stock")["files"][SPARSE], _run("overlay")["files"][SPARSE],
                                           _results())
    assert (so_far.so_far, so_far.regressions, so_far.complete) == (len(both), [], False)
    assert files["regressions"] == []
    (s, o) = words
    assert (f"of its {collected:,} tests, {s[0]} finished on stock ({s[1]} skipped, {s[2]} failed, {s[3]} passed) "
            f"and {o[0]} on the overlay ({o[1]}, {o[2]}, {o[3]})") in _flat()
