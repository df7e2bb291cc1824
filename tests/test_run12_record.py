"""Run 12's record (docs/validation/h100-2026-12-06-vllm0_33_0-run12) re-derived from its raw
files: the upstream gate's verdict recomputed from both sides' results with the gate's own
compare, each file's row, the totals and every failure's cause; the two bases' benchmark tables
as the benchmark's report makes them, the memory plan and the first attempt's out-of-memory.
(The benchmark's rounds, ratios and intervals: tests/test_benchmark_record.py.) Nothing is
compared with today's tree. No GPU."""

from __future__ import annotations

import collections
import functools
import json
import re

from dsa_image.bench import report
from dsa_image.upstream import compare as upstream_compare
from dsa_image.upstream import run as upstream_run
from record_files import NO_MODEL_CONFIG, VALIDATION, missing_model_configs, readme_flat, readme_lines, unpacked

RECORD = VALIDATION / "h100-2026-12-06-vllm0_33_0-run12"
SPARSE = "tests/v1/attention/test_sparse_mla_backends.py"
DECODE = f"{SPARSE}::test_sparse_backend_decode_correctness["
SIDES = ("stock", "overlay")


def _flat() -> str:
    return readme_flat(RECORD)


def _rows() -> list[str]:
    return readme_lines(RECORD)


# -- upstream's tests ---------------------------------------------------------------------------


def _results():
    return unpacked(RECORD) / "upstream-tests"


def _run(side: str) -> dict:
    return upstream_run.load_run(_results(), side)


@functools.cache
def _comparisons() -> dict[str, upstream_compare.FileComparison]:
    stock, overlay = (_run(side)["files"] for side in SIDES)
    assert set(stock) == set(overlay)
    return {path: upstream_compare.compare_file(path, stock[path], overlay[path], _results()) for path in sorted(stock)}


def _fails(counts: dict) -> int:
    return counts["failed"] + counts["error"]


def test_every_file_compared_without_a_regression_recomputed_from_both_sides():
    found = _comparisons()
    assert len(found) == 21 and all(c.complete for c in found.values())
    assert [c.regressions for c in found.values()] == [[]] * 21
    recorded = json.loads((_results() / "compare.json").read_text())
    assert (recorded["verdict"], recorded["regressions"], recorded["complete"]) == ("ok", 0, True)
    assert "every one of the 21 selected files compared, 0 regressions" in _flat()


def test_each_files_row_is_its_counts_on_both_sides():
    rows = [r for r in _rows() if r.startswith("| tests/")]
    expected = []
    for path, c in _comparisons().items():
        assert c.counts["stock"] == c.counts["overlay"], path
        cells = [f"{c.counts[s]['passed']} / {_fails(c.counts[s])} / {c.counts[s]['skipped']}" for s in SIDES]
        expected.append(f"| {path} | {cells[0]} | {cells[1]} |")
    assert rows == expected


def test_the_totals_and_the_sparse_files_seconds():
    totals = collections.Counter()
    for c in _comparisons().values():
        assert c.other == [] and (c.counts["stock"]["crashed"], c.counts["stock"]["timeout"]) == (0, 0)
        totals.update(c.counts["stock"])
    seconds = [f"{_run(s)['files'][SPARSE]['seconds']:.1f}" for s in SIDES]
    parts = {_run(s)["files"][SPARSE]["parts"] for s in SIDES}
    flat = _flat()
    assert (f"{totals['passed']} passed, {_fails(totals):,} failed and {totals['skipped']:,} skipped on each "
            "side, every test with one outcome on both") in flat
    assert parts == {2} and f"took {seconds[0]} s on stock and {seconds[1]} s on the overlay over its two parts" in flat


def test_every_failure_on_both_sides_is_a_missing_model_config_or_the_decode_checks_unlogged_half():
    by_model, unlogged, total = collections.Counter(), 0, 0
    for path, c in _comparisons().items():
        models = {side: missing_model_configs(_results(), side, path) for side in SIDES}
        assert collections.Counter(models["stock"]) == collections.Counter(models["overlay"]), path
        fails = _fails(c.counts["stock"])
        assert len(c.fail_on_both) == fails
        # A test whose reason the gate kept says it; the rest are run 11's killed part, no log.
        kept = [f for f in c.fail_on_both if f.reason]
        assert all(NO_MODEL_CONFIG.search(f.reason) for f in kept), path
        missing = [f for f in c.fail_on_both if not f.reason and len(models["stock"]) < fails]
        assert len(models["stock"]) + len(missing) == fails, path
        assert all(f.test.startswith(DECODE) for f in missing), path
        by_model.update(models["stock"])
        unlogged += len(missing)
        total += fails
    flat = _flat()
    assert f"**The {total} failures are the same on both sides" in flat
    assert f"{sum(by_model.values())} of them each log vLLM's `ModelConfig` finding no `config.json`" in flat
    assert ", ".join(f"`{m}` {n}" for m, n in by_model.most_common()) in flat
    assert f"The other {unlogged} are `test_sparse_backend_decode_correctness` cases from run 11's part" in flat


def test_the_decode_check_compared_nothing():
    outcomes = {side: upstream_compare.side_results(_results(), side, SPARSE, _run(side)["files"][SPARSE])[0]
                for side in SIDES}
    decode = {side: collections.Counter(o for t, o in outcomes[side].items() if t.startswith(DECODE)) for side in SIDES}
    assert decode["stock"] == decode["overlay"]
    d = decode["stock"]
    assert set(d) == {"skipped", "failed"}
    assert f"of its {sum(d.values()):,} cases {d['skipped']:,} skipped and {d['failed']} failed on each side, none passed" \
        in _flat()
    split = {side: [o for t, o in outcomes[side].items() if t.startswith(f"{SPARSE}::test_split_indexer_prefill_chunks")]
             for side in SIDES}
    assert split["stock"] == split["overlay"] == ["passed"] * len(split["stock"])
    assert f"its {len(split['stock'])} tests (`test_split_indexer_prefill_chunks*`) passed on both sides" in _flat()


# -- the two bases at real width -------------------------------------------------------------------


def _bench(label: str = "realwidth-bench-bases") -> dict:
    return report.load_results(unpacked(RECORD) / label / "results.json")


def test_the_bases_tables_are_the_reports():
    doc = _bench()
    a, b = (doc["environment"]["builds"][side]["versions"] for side in ("A", "B"))
    assert (a["vllm"], b["vllm"]) == ("0.24.0", "0.33.0") and a["overlay_receipt_sha256"] and b["overlay_receipt_sha256"]
    assert (a["torch"], a["triton"], b["torch"], b["triton"]) == ("2.11.0", "3.6.0", "2.14.0", "3.8.0")
    rows = set(_rows())
    for line in (*report.table([doc]).splitlines(), *report.levels_table([doc]).splitlines()):
        assert line in rows


def test_the_bases_served_with_4_gib_of_kv_and_the_memory_plan_held():
    raw = unpacked(RECORD) / "realwidth-bench-bases"
    doc = _bench()
    assert doc["groups"]["base"]["server_args"][:2] == ["--kv-cache-memory-bytes", str(4 << 30)]
    assert "MEMORY PLAN: PASS" in (raw / "memory-plan.txt").read_text()
    plans = json.loads((raw / "memory-plan.json").read_text())
    assert len(plans) == 2 and all(p["ok"] for p in plans.values())
    (kv,) = {(p["kv"]["vllm_tokens"], p["kv"]["plan_tokens"], p["kv"]["plan_bytes_per_token"]) for p in plans.values()}
    assert f"{kv[0]:,} tokens in 4 GiB each, the plan's {kv[1]:,} ({kv[2]:,} bytes a token)" in _flat()
    healthy = doc["healthy_after_s"]
    assert f"Healthy after {healthy['bench-base-A']:.1f} s (A) and {healthy['bench-base-B']:.1f} s (B)" in _flat()


def test_the_first_attempt_ran_out_of_memory_with_8_gib_each():
    doc = _bench("realwidth-bench-bases-8gib")
    assert doc["groups"]["base"]["server_args"][:2] == ["--kv-cache-memory-bytes", str(8 << 30)]
    assert set(doc["group_errors"]["base"]) == {"bench-base-A"} and not doc["workloads"]
    log = (unpacked(RECORD) / "realwidth-bench-bases-8gib" / "server-bench-base-A.log").read_text()
    (oom,) = set(re.findall(r"torch\.OutOfMemoryError: CUDA out of memory\. Tried to allocate ([\d.]+) GiB\..*?"
                            r"this process has ([\d.]+) GiB memory in use\. Process \d+ has ([\d.]+) GiB", log))
    assert (f"{oom[0]} GiB asked in `mla_attention.forward_impl` with {oom[1]} GiB in use by it and {oom[2]} GiB "
            "by 0.33.0's server") in _flat()
    assert "_capture_cudagraphs" in log
    assert f"0.33.0's was healthy after {doc['healthy_after_s']['bench-base-B']:.1f} s" in _flat()
