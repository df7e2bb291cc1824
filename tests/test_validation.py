"""The GPU validation's pure parts, on the CPU: host-time ordering and verdict, the comparison,
serving's health timing.

The comparison needs torch: it runs in the image's test stage, and skips elsewhere."""

import collections
import types

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


RUNNING = types.SimpleNamespace(poll=lambda: None)  # a server process that has not exited


def test_each_server_is_timed_to_its_own_first_healthy_answer(monkeypatch):
    from dsa_image.harness import server as serving

    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(serving.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(serving.time, "sleep", lambda seconds: None)
    polls = collections.Counter()

    def healthy_on_poll(server):  # "fast" answers at its first poll, "slow" at its third
        polls[server["name"]] += 1
        return polls[server["name"]] >= {"fast": 1, "slow": 3}[server["name"]]

    monkeypatch.setattr(serving, "is_healthy", healthy_on_poll)
    servers = [{"name": n, "started": 0, "proc": RUNNING} for n in ("slow", "fast")]
    after = serving.wait_all_healthy(servers, deadline=500)
    assert after["fast"] < after["slow"]
    assert polls == {"slow": 3, "fast": 1}  # a healthy server is not polled again


def test_a_server_that_never_answers_is_named(monkeypatch):
    from dsa_image.harness import server as serving

    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(serving.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(serving.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(serving, "is_healthy", lambda server: server["name"] == "fast")
    with pytest.raises(TimeoutError, match="slow not healthy in time"):
        serving.wait_all_healthy([{"name": n, "started": 0, "proc": RUNNING} for n in ("slow", "fast")], 100)


def test_the_growth_check_expects_one_row_per_query_token_only_when_flattened():
    """vLLM 0.33.0 takes next_n=4 natively on sm_90: its decode table is one row per request."""
    np = pytest.importorskip("numpy")
    from dsa_image.validation.indexer_probe import expected_decode_table

    table = np.array([[1, 2, 3], [4, 5, 6]])
    assert expected_decode_table(table, [2, 1], flattened=True, uniform_only=False).tolist() == [
        [1, 2, 3], [1, 2, 3], [4, 5, 6]]
    assert expected_decode_table(table, [2, 2], flattened=False, uniform_only=True).tolist() == table.tolist()


def test_a_variable_batch_without_flattening_decodes_only_its_leading_uniform_run():
    """0.33.0 on sm_90 (no flattening, no variable-length kernel) needs uniform decodes: the
    first request whose length differs and every one after it go the prefill path. The
    2026-11-30 H200 run's probe expected all 8 rows of such a batch, for stock and overlay."""
    np = pytest.importorskip("numpy")
    from dsa_image.validation.indexer_probe import expected_decode_table, leading_decodes

    assert leading_decodes([4, 4, 2, 4], uniform_only=True) == 2
    assert leading_decodes([4, 0, 4], uniform_only=True) == 3  # 0: cudagraph padding
    assert leading_decodes([4, 4, 2, 4], uniform_only=False) == 4
    table = np.arange(12).reshape(4, 3)
    assert expected_decode_table(table, [4, 4, 2, 4], flattened=False, uniform_only=True).tolist() == [
        [0, 1, 2], [3, 4, 5]]
