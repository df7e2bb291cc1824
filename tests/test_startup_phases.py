"""The start-up phase table, read from real H200 server logs (tests/data/h200-run*-server-*.log,
excerpts of docs/validation's run 4 and run 5) and the warm-start harness's records of them."""

import json
from pathlib import Path

import pytest

from dsa_image.validation import startup_phases
from record_files import VALIDATION, unpacked

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[1]
COLD_LOG = DATA / "h200-run5-server-cold-warmup-overlay.log"
COLD_RECORD = unpacked(VALIDATION / "h200-2026-12-01-vllm0_33_0-run5") / "warmstart/warmstart-cold-warmup.json"
WARM_LOG = DATA / "h200-run4-server-warm-warmup-overlay.log"
WARM_RECORD = unpacked(VALIDATION / "h200-2026-12-01-vllm0_33_0-run4") / "warmstart/warmstart-warm-warmup.json"


def _table(log, record, step):
    return startup_phases.phases(log.read_text(), startup_phases.record_from_warmstart(record, step, "overlay"))


def _row(table, prefix):
    return next(r for r in table["phases"] if r["phase"].startswith(prefix))


@pytest.fixture(scope="module")
def cold():
    return _table(COLD_LOG, COLD_RECORD, "cold-warmup")


@pytest.fixture(scope="module")
def warm():
    return _table(WARM_LOG, WARM_RECORD, "warm-warmup")


def test_the_phases_add_up_to_the_recorded_healthy_and_ready(cold, warm):
    for table, healthy, ready in ((cold, 236.2, 243.9), (warm, 69.1, 74.3)):
        assert table["process_start_derived"]
        assert table["healthy_s"] == healthy and table["ready_s"] == ready
        engine = [r for r in table["phases"] if not r["phase"].startswith("image warm-up")]
        assert sum(r["seconds"] for r in engine) == pytest.approx(healthy, abs=0.11)
        assert all(r["seconds"] >= 0 for r in table["phases"])


def test_a_cold_start_spends_its_time_on_flashinfer_sampling_and_deepgemm(cold):
    profile = _row(cold, "profile run")
    assert profile["jit"] == {"FlashInfer:sampling": 1} and profile["seconds"] == 111.0
    assert profile["note"] == "FlashInfer sampling built in <= 104 s"
    deepgemm = {r["phase"]: r["jit"].get("DeepGEMM nvcc", 0) for r in cold["phases"]}
    # The 19 compiler runs the harness counted before healthy, most of them during capture.
    assert sum(deepgemm.values()) == 19 and deepgemm["CUDA graph capture"] == 15
    assert _row(cold, "CUDA graph capture")["seconds"] == 35.0


def test_a_restart_compiles_nothing_before_healthy_and_spends_it_on_imports(warm):
    assert all(not r["jit"] for r in warm["phases"])
    imports = sum(r["seconds"] for r in warm["phases"] if r["phase"].startswith("import:"))
    assert imports == pytest.approx(45.1)
    assert _row(warm, "CuTe DSL router GEMM")["seconds"] == 5.0


def test_the_warm_up_steps_come_from_the_record_and_what_compiled_in_them_from_the_log(warm):
    steps = [r for r in warm["phases"] if r["phase"].startswith("image warm-up: ")]
    recorded = json.loads(WARM_RECORD.read_text())["steps"]["warm-warmup"]["sides"]["overlay"]["warmup"]["steps"]
    assert [r["phase"].removeprefix("image warm-up: ") for r in steps] == list(recorded)
    assert "monitor:fused_moe_kernel x6" in steps[-1]["note"]


def test_the_harness_start_line_fixes_process_start(tmp_path):
    text = "dsa-image: server process started at 2026-12-01 02:27:30.500000\n" + WARM_LOG.read_text()
    table = startup_phases.phases(text, startup_phases.Record())
    assert not table["process_start_derived"]
    assert table["healthy_s"] == 73.5  # "Starting vLLM server on" at 02:28:44
    assert table["phases"][0]["seconds"] == 29.5  # to the first vLLM line, the banner at 02:28:00


def test_the_supervisor_lines_are_the_record_when_the_warm_up_ran_in_the_log():
    text = WARM_LOG.read_text() + ("dsa-image warmup: prefill-2049: 1 request(s) in 0.71 s\n"
                                   "dsa-image warmup: decode-c8: 8 request(s) in 2.69 s\n")
    record = startup_phases.record_from_log(startup_phases.read_lines(text, 2026))
    assert record.warmup_steps == {"prefill-2049": 0.71, "decode-c8": 2.69}


def test_a_log_without_a_listening_server_or_a_start_is_refused():
    with pytest.raises(ValueError, match="Starting vLLM server on"):
        startup_phases.phases(WARM_LOG.read_text().split("Starting vLLM server on")[0], startup_phases.Record(69.1))
    with pytest.raises(ValueError, match="process start is unknown"):
        startup_phases.phases(WARM_LOG.read_text(), startup_phases.Record())


def test_a_record_without_the_step_says_what_it_has():
    with pytest.raises(ValueError, match="no step 'cold' side 'overlay'.*warm-warmup"):
        startup_phases.record_from_warmstart(WARM_RECORD, "cold", "overlay")


def test_the_command_prints_each_start_and_the_comparison(tmp_path, capsys):
    out = tmp_path / "phases.json"
    assert startup_phases.main(["--start", "cold", str(COLD_LOG), f"{COLD_RECORD}:cold-warmup:overlay",
                                "--start", "restart", str(WARM_LOG), f"{WARM_RECORD}:warm-warmup:overlay",
                                "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| **healthy** | **236.2** | **69.1** |" in printed
    assert json.loads(out.read_text())["restart"]["ready_s"] == 74.3
