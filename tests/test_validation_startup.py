"""dsa_image.validation.startup on the CPU: which flags its before and after starts give vLLM
(the image's no-argument `docker run`, read from the entrypoint and the recipe)."""

from dsa_image.runtime import entrypoint
from dsa_image.core.recipe import load_recipe
from dsa_image.validation import startup


def test_before_is_the_image_without_the_start_up_flags_and_after_is_the_image_now():
    recipe = load_recipe()
    target = recipe.target("sm90")
    flags = startup.image_flags("sm90", None)
    added = [str(a) for a in recipe.serving["default_model_args"]]
    assert flags["before"] == ["--kv-cache-dtype", target.kv_cache_dtype]
    assert flags["after"] == [*added, "--kv-cache-dtype", target.kv_cache_dtype]
    served = entrypoint.plan_serve([], recipe, target, {}).argv
    assert all(flag in served for flag in flags["after"][::2])



def test_the_four_starts_run_in_order_and_an_after_start_without_its_build_is_refused(tmp_path):
    """Against a fake vLLM (tests/test_bench.py) that has no FlashInfer: the precompile build
    fails, so the after-cold start is not made; the other three are, each server's log opening
    with its process start, the before ones given the image's old flags."""
    import json

    import test_bench as fakes
    from dsa_image.build.tiny_model import write_model

    write_model(tmp_path / "model")
    site = fakes.fake_vllm_site(tmp_path / "site", fake={"ttft_s": 0.002})
    out = tmp_path / "out"
    code = startup.main(["--model", str(tmp_path / "model"), "--site", str(site), "--out", str(out),
                         "--port-base", str(fakes.free_ports(1)), "--health-timeout", "60"])
    doc = json.loads((out / "startup.json").read_text())
    assert code == 1 and list(doc["starts"]) == ["before-cold", "after-cold", "before-restart", "after-restart"]
    assert doc["precompile_build"]["exit"] != 0 and "precompile build failed" in doc["starts"]["after-cold"]["error"]
    assert "FlashInfer" in (out / "precompile-build.log").read_text()
    before = doc["starts"]["before-cold"]["sides"]["overlay"]
    assert before["healthy_after_s"] > 0 and "warmup" in before and "Starting vLLM" in doc["starts"]["before-cold"]["phases_error"]
    log = (out / "before" / before["server_log"]).read_text().splitlines()
    assert log[0].startswith("dsa-image: server process started at ")
    assert str(doc["flags"]["before"])[1:-1] in log[1] and "--max-num-seqs" not in log[1]
    assert "--max-num-seqs" in (out / "after" / doc["starts"]["after-restart"]["sides"]["overlay"]["server_log"]).read_text()


def test_the_summary_reads_a_real_start(tmp_path):
    """Run 5's cold start of the overlay, as a start of this phase records it."""
    import json

    from dsa_image.validation import startup_phases

    from record_files import VALIDATION, unpacked

    root = unpacked(VALIDATION / "h200-2026-12-01-vllm0_33_0-run5") / "warmstart"
    side = json.loads((root / "warmstart-cold-warmup.json").read_text())["steps"]["cold-warmup"]["sides"]["overlay"]
    record = startup_phases.Record(side["healthy_after_s"], side["warmup"]["steps"])
    start = {"sides": {"overlay": side}, "precompile_check": {"exit": 0},
             "phases": startup_phases.phases((root / side["server_log"]).read_text(), record)}
    line, = startup.summary({"starts": {"after-cold": start}})
    assert "healthy  236.2 s  ready  243.9 s" in line and "FlashInfer built: ['sampling']" in line
    assert "compiled after ready: -" in line and line.endswith("check: 0")


def test_starts_run_as_named_and_a_restart_needs_its_cold_start_first(capsys):
    import pytest

    args = startup.parse_args(["--model", "m", "--site", "s", "--out", "o", "--starts", "after-cold,after-restart"])
    assert args.starts == ["after-cold", "after-restart"]
    with pytest.raises(SystemExit):
        startup.parse_args(["--model", "m", "--site", "s", "--out", "o", "--starts", "after-restart"])
    assert "after-restart needs after-cold before it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        startup.parse_args(["--model", "m", "--site", "s", "--out", "o", "--starts", "after-warm"])
    assert "unknown ['after-warm']" in capsys.readouterr().err


def test_require_warm_fails_each_start_whose_first_request_missed_the_goal(tmp_path):
    """The named starts only (no precompile build without after-cold), against the fake vLLM:
    a first request over the goal fails --require-warm, one problem a start."""
    import json

    import test_bench as fakes
    from dsa_image.build.tiny_model import write_model

    write_model(tmp_path / "model")
    site = fakes.fake_vllm_site(tmp_path / "site", fake={"ttft_s": 0.002})
    out = tmp_path / "out"
    code = startup.main(["--model", str(tmp_path / "model"), "--site", str(site), "--out", str(out),
                         "--port-base", str(fakes.free_ports(1)), "--health-timeout", "60",
                         "--starts", "before-cold,before-restart", "--require-warm", "--goal-factor", "0.01"])
    doc = json.loads((out / "startup.json").read_text())
    assert list(doc["starts"]) == ["before-cold", "before-restart"] and "precompile_build" not in doc
    assert not (out / "precompile-build.log").exists()
    assert code == 1 and len(doc["warm_problems"]) == 2, doc["warm_problems"]
    assert all("first request" in p and p.endswith("goal 0.01x") for p in doc["warm_problems"])
