"""The first-use GEMM record (docs/validation/h200-2026-12-06-gemm-first-use) re-derived from its
raw JSON with the tool's own readers: the README's table, the slow-against-new counts, the
kernel counts and the range of a slow first call. Nothing is compared with today's tree. No GPU."""

from __future__ import annotations

import json
import re
import statistics

import pytest

from dsa_image.validation import gemm_first_use as g
from record_files import VALIDATION, unpacked

RECORD = VALIDATION / "h200-2026-12-06-gemm-first-use"
COLUMNS = ("3000", "3500", "3001", "2500", "5000", "7000")
ROW = re.compile(r"^\| (?P<what>[^|]+) \| (?P<card>H100|H200) \| (?P<call>[\d.]+) s \| (?P<cells>.+) \|$", re.M)


def _doc(name: str) -> dict:
    return json.loads((unpacked(RECORD) / name).read_text())


def _rows() -> list[re.Match]:
    return list(ROW.finditer((RECORD / "README.md").read_text()))


def _variant(what: str) -> str:
    """The variant a row names: its environment setting, or the machine's environment ("")."""
    setting = re.search(r"`(CUDA_\w+=\w+)`", what)
    return setting.group(1) if setting else ""


def test_the_table_has_a_row_per_run_and_variant():
    assert len(_rows()) == 9


@pytest.mark.parametrize("row", _rows(), ids=lambda m: m.group("what")[:60])
def test_each_row_is_its_files_probes(row):
    name = re.search(r"`([\w.-]+\.json)`", row.group("what")).group(1)
    doc = _doc(name)["variants"][_variant(row.group("what"))]
    assert row.group("card") in doc["gpu"]
    assert float(row.group("call")) == pytest.approx(doc["first_cublas_call_s"], abs=5e-4)
    cells = [c.strip() for c in row.group("cells").split("|")]
    derived = [f"{doc['probes'][m]['excess_ms']:.1f} ({len(doc['probes'][m]['loaded'])})" for m in COLUMNS]
    assert cells == derived


def test_every_slow_first_call_ran_a_kernel_new_to_the_process():
    doc = _doc("sweep-8.json")
    variant = {**doc["variants"][""], "warm_lengths": doc["warm_lengths"]}  # the run's, not today's
    counts = g.slow_against_new(variant, tuple(doc["probes"]))
    assert counts == {"slow_new": 12, "slow_not_new": 0, "fast_new": 37, "fast_not_new": 35}


def test_the_shapes_ran_14_to_112_kernels_over_the_sweep():
    kernels = _doc("sweep-8.json")["variants"][""]["kernels"]
    distinct = {n: len({k for ks in by_m.values() for k in ks}) for n, by_m in kernels.items()}
    assert (min(distinct.values()), max(distinct.values())) == (14, 112)
    assert distinct["router"] == 112 and distinct["fused_qkv_a_proj"] == 94


def test_a_slow_first_call_was_1_84_to_4_26_ms_over_its_warm_ones():
    excess = [p["shapes"][n]["first_ms"] - p["shapes"][n]["warm_ms"]
              for path in sorted(unpacked(RECORD).glob("*.json"))
              for doc in json.loads(path.read_text())["variants"].values()
              for p in doc["probes"].values() for n in p["loaded"]]
    assert len(excess) == 132
    assert (round(min(excess), 2), round(max(excess), 2), round(statistics.median(excess), 2)) == (1.84, 4.26, 2.40)


def test_past_the_sweep_no_length_near_an_earlier_probe_was_slow():
    for name in ("after-sweep-8.json", "after-sweep-64.json", "after-sweep-256.json"):
        after = _doc(name)["variants"][""]["after_sweep"]
        assert sorted(after) == ["2503", "3003", "3004", "3503", "5003", "7003"]
        assert all(p["loaded"] == [] for p in after.values()), name


def test_at_3000_tokens_the_excess_was_9_4_to_14_6_ms_after_the_images_lengths_and_6_1_to_10_3_after_more():
    def excess(names):
        return [doc["probes"]["3000"]["excess_ms"] for name in names for doc in _doc(name)["variants"].values()]

    images = excess(["h100-variants.json", "sweep-8.json", "eager.json", "after-sweep-8.json",
                     "after-sweep-64.json", "after-sweep-256.json"])
    more = excess([f"warm-step-{w}.json" for w in (2048, 1024, 512, 256)])
    assert (min(images), max(images)) == (9.38, 14.63)
    assert (min(more), max(more)) == (6.11, 10.3)
