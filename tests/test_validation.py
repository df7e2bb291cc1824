"""The GPU validation's pure parts, on the CPU: host-time ordering and verdict, the comparison.

The comparison needs torch: it runs in the image's test stage, and skips elsewhere."""

import collections

import pytest

from dsa_image.validation import compare, host_time


def test_each_builder_holds_each_place_equally_often():
    places = collections.Counter()
    for round_index in range(host_time.CALLS):
        for place, name in enumerate(host_time.rotated(list(host_time.BUILDERS), round_index)):
            places[name, place] += 1
    assert set(places.values()) == {host_time.CALLS // len(host_time.BUILDERS)}
    assert len(places) == len(host_time.BUILDERS) ** 2


def _row(ratio, control):
    return {"ratio": ratio, "control_ratio": control}


def test_the_verdict_is_the_worst_scenario():
    rows = [_row(0.91, 1.004), _row(0.98, 0.993)]
    assert host_time.summarise(rows) == {
        "overlay_ratio_max": 0.98, "overlay_ratio_min": 0.91,
        "control_ratio_min": 0.993, "control_ratio_max": 1.004,
        "overlay_not_slower": True}
    assert host_time.summarise([*rows, _row(1.01, 1.0)])["overlay_not_slower"] is False


def _scenario(**tensors):
    return {"tensors": tensors, "runner_block_table_width": 2, "true_decode_max_seq_len": 7}


def test_comparison_names_a_differing_field_and_skips_overlay_only_ones():
    torch = pytest.importorskip("torch")
    stock = _scenario(num_decodes=2, seq_lens=torch.tensor([3, 7]))
    same = _scenario(num_decodes=2, seq_lens=torch.tensor([3, 7]), use_b12x=False)
    assert compare.compare_scenario(stock, same) == []
    other_dtype = _scenario(num_decodes=2, seq_lens=torch.tensor([3, 7], dtype=torch.int32))
    assert compare.compare_scenario(stock, other_dtype) == ["seq_lens"]
    missing = _scenario(seq_lens=torch.tensor([3, 7]))
    assert compare.compare_scenario(stock, missing) == ["num_decodes: only in stock"]


def test_comparison_checks_the_overlays_exact_decode_max():
    pytest.importorskip("torch")
    stock = _scenario(num_decodes=2)
    wrong = _scenario(num_decodes=2, **{"decode.max_seq_len": 6})
    assert compare.compare_scenario(stock, wrong) == ["decode.max_seq_len 6 != exact 7"]
