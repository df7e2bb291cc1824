"""The paired benchmark (dsa_image/bench/) and the serving modes' pure parts, on the CPU:
the bootstrap interval, the alternating schedule, the ratio direction, the results schema, the
streaming client and whole runs against a fake OpenAI-compatible vLLM.

The fake (tests/fake_vllm.py's, and fake_vllm_site for a real `python -m vllm.entrypoints.cli.main serve`
process) is also used by tests/test_warmup.py. Plot tests skip without matplotlib.
"""

from __future__ import annotations

import json
import math
import random
import signal
import socket
import sys
import textwrap
import time
import types
from dataclasses import asdict
from pathlib import Path

import pytest

from dsa_image.bench import client, paired as bench, plots, report, schedule, stats
from dsa_image.runtime import spec_decode_metrics
from dsa_image.validation import serving_modes

TESTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS_DIR))
from fake_vllm import FakeServer, FakeVllm, fake_tokens, make_handler  # noqa: E402,F401 (make_handler: for test_warmup)


# -- the fake server ----------------------------------------------------------------------------


FAKE_MAIN = textwrap.dedent('''\
    """A fake `vllm serve`: tests/fake_vllm.py in a real process; options from fake.json beside it."""
    import json, os, signal, sys
    from pathlib import Path
    sys.path.insert(0, {tests_dir!r})
    import fake_vllm

    options = json.loads((Path(__file__).parent / "fake.json").read_text())
    port = int(sys.argv[sys.argv.index("--port") + 1])
    state = fake_vllm.FakeVllm(**options.get("fake", {{}}))
    def on_term(signum, frame):
        if options.get("term_file"):
            Path(options["term_file"]).write_text(str(os.getpid()))
        os._exit(options.get("term_exit", 0))
    signal.signal(signal.SIGTERM, on_term)
    if options.get("crash_exit") is not None:
        sys.exit(options["crash_exit"])
    print("INFO fake vllm serve", sys.argv[1:], "probe:", os.environ.get("DSA_BENCH_PROBE"), flush=True)
    fake_vllm.FakeServer(state, port).httpd.serve_forever()
''')


# vLLM's model registry as far as its model-info cache goes (vllm/model_executor/models/registry.py):
# an entry per class under VLLM_CACHE_ROOT/modelinfos keyed by the hash of the model's module,
# else an inspection in a subprocess that writes one. The module here is this file.
FAKE_REGISTRY = textwrap.dedent('''\
    import hashlib, json, os
    from pathlib import Path

    def _run_in_subprocess(fn):
        return fn()

    class _LazyRegisteredModel:
        def __init__(self, name):
            self.name = name

        @staticmethod
        def _get_cache_dir():
            return Path(os.environ["VLLM_CACHE_ROOT"]) / "modelinfos"

        def _get_cache_filename(self):
            return f"vllm-models-fake-{self.name}.json"

        def inspect(self):
            source = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
            path = self._get_cache_dir() / self._get_cache_filename()
            if path.is_file() and json.loads(path.read_text())["hash"] == source:
                return json.loads(path.read_text())["modelinfo"]
            info = _run_in_subprocess(lambda: {"architecture": self.name})
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"hash": source, "modelinfo": info}))
            return info

    class ModelRegistry:
        models = {name: _LazyRegisteredModel(name) for name in ("GlmMoeDsaForCausalLM", "DeepseekV32MTPModel")}

        @staticmethod
        def _try_inspect_model_cls(arch):
            try:
                return ModelRegistry.models[arch].inspect()
            except Exception:
                return None
''')

FAKE_SPECULATIVE = textwrap.dedent('''\
    class SpeculativeConfig:
        @staticmethod
        def hf_config_override(hf_config):
            hf_config.architectures = ["DeepseekV32MTPModel"]
            return hf_config
''')


def add_fake_model_registry(site: Path) -> Path:
    """vLLM's model registry and speculative config, as far as the model-info cache the image
    ships goes, into a fake vLLM site."""
    models = site / "vllm" / "model_executor" / "models"
    for package in (models, site / "vllm" / "config"):
        package.mkdir(parents=True, exist_ok=True)
    for package in (site / "vllm", site / "vllm" / "model_executor", models, site / "vllm" / "config"):
        (package / "__init__.py").touch()
    (models / "registry.py").write_text(FAKE_REGISTRY)
    (site / "vllm" / "config" / "speculative.py").write_text(FAKE_SPECULATIVE)
    return site


def fake_vllm_site(site: Path, **options) -> Path:
    """A site dir whose `vllm.entrypoints.cli.main` runs the fake server (tests/fake_vllm.py), with vLLM's model-info
    cache as its registry keeps it (and a dist-info)."""
    cli = site / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for package in (site / "vllm", site / "vllm" / "entrypoints", cli):
        (package / "__init__.py").write_text("")
    add_fake_model_registry(site)
    (cli / "main.py").write_text(FAKE_MAIN.format(tests_dir=str(TESTS_DIR)))
    (cli / "fake.json").write_text(json.dumps(options))
    dist = site / "vllm-0.24.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.24.0\n")
    return site


def free_ports(count: int) -> int:
    """A base port with `count` free ports from it (probed, then released)."""
    for _ in range(50):
        base = random.randrange(20000, 60000)
        sockets = []
        try:
            for i in range(count):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                sockets.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no free ports")


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    from dsa_image.build.tiny_model import write_model

    write_model(tmp_path / "tiny-glm5")
    return tmp_path / "tiny-glm5"


# -- statistics ---------------------------------------------------------------------------------


def test_quantile_matches_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(3)
    for n in (1, 2, 5, 20):
        values = sorted(rng.uniform(0, 10) for _ in range(n))
        for q in (0.0, 0.025, 0.5, 0.99, 1.0):
            assert stats.quantile(values, q) == pytest.approx(float(np.quantile(values, q)))


def test_bootstrap_is_seeded_and_exact_on_a_small_case():
    # The median of 3 draws from {1, 2, 3} is 1 with probability 7/27 (> 2.5%): the 95%
    # interval is exactly [1, 3], and the point estimate is the sample median.
    assert stats.bootstrap_median_ci([1.0, 2.0, 3.0], resamples=4000, seed=1) == (2.0, 1.0, 3.0)
    values = [random.Random(5).gauss(1, 0.1) for _ in range(15)]
    assert stats.bootstrap_median_ci(values, seed=7) == stats.bootstrap_median_ci(values, seed=7)
    assert stats.bootstrap_median_ci([1.25] * 9) == (1.25, 1.25, 1.25)
    with pytest.raises(ValueError):
        stats.bootstrap_median_ci([])


def test_bootstrap_interval_covers_a_known_median_about_95_percent_of_the_time():
    # Ratios from a log-normal with median exactly 1.05: the interval from 20 rounds must
    # contain 1.05 in roughly 95% of 300 seeded experiments (percentile bootstrap of a median
    # at n=20 runs a little wide or narrow, never 70% or 100%).
    rng = random.Random(11)
    covered = 0
    for trial in range(300):
        ratios = [1.05 * math.exp(rng.gauss(0, 0.08)) for _ in range(20)]
        _, low, high = stats.bootstrap_median_ci(ratios, resamples=1000, seed=trial)
        covered += low <= 1.05 <= high
    assert 0.88 <= covered / 300 <= 0.99


def test_bootstrap_interval_narrows_with_more_rounds():
    rng = random.Random(2)
    few = [1.0 + rng.gauss(0, 0.1) for _ in range(10)]
    many = [1.0 + rng.gauss(0, 0.1) for _ in range(160)]
    _, lo_few, hi_few = stats.bootstrap_median_ci(few, resamples=2000)
    _, lo_many, hi_many = stats.bootstrap_median_ci(many, resamples=2000)
    assert (hi_many - lo_many) < 0.5 * (hi_few - lo_few)


def test_verdict_follows_each_metrics_direction():
    # output tokens/s: higher is better; times: lower is better.
    assert stats.verdict(1.02, 1.10, +1) == "B ahead"
    assert stats.verdict(0.90, 0.97, +1) == "B behind"
    assert stats.verdict(1.02, 1.10, -1) == "B behind"
    assert stats.verdict(0.90, 0.97, -1) == "B ahead"
    assert stats.verdict(0.97, 1.03, +1) == stats.verdict(0.97, 1.03, -1) == "within interval"


def test_ratios_are_b_over_a_and_a_round_with_an_error_does_not_count():
    a = {"errors": 0, "output_tok_s": 100.0, "ttft_p50_s": 0.2, "ttft_p99_s": 0.4, "tpot_s": 0.01}
    b = {"errors": 0, "output_tok_s": 110.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.4, "tpot_s": 0.02}
    ratios = stats.round_ratios(a, b)
    assert ratios == pytest.approx({"output_tok_s": 1.1, "ttft_p50_s": 0.5, "ttft_p99_s": 1.0, "tpot_s": 2.0})
    assert stats.round_ratios(a, {**b, "errors": 1}) is None


def test_summary_reports_median_interval_and_verdict_per_metric():
    rounds = [{"ratios": {"output_tok_s": 0.9 + 0.001 * i, "ttft_p50_s": 1.0, "ttft_p99_s": None, "tpot_s": 1.1}}
              for i in range(20)] + [{"ratios": None}]
    summary = stats.summarize(rounds, resamples=500, confidence=0.95, seed=0)
    assert summary["output_tok_s"]["n"] == 20
    assert summary["output_tok_s"]["median_ratio"] == pytest.approx(0.9095)
    assert summary["output_tok_s"]["verdict"] == "B behind"
    assert summary["tpot_s"]["verdict"] == "B behind"
    assert summary["ttft_p50_s"]["verdict"] == "within interval"
    assert summary["ttft_p99_s"] == {"label": "TTFT p99", "n": 0}


def test_side_stats_from_known_samples():
    samples = [client.Sample(start=0.0, end=1.0, tokens=11, first_token=0.1, last_token=0.6),
               client.Sample(start=0.5, end=2.0, tokens=11, first_token=0.8, last_token=1.8),
               client.Sample(start=0.5, end=9.0, error="HTTP 500")]
    side = client.side_stats(samples)
    assert side["errors"] == 1 and side["output_tokens"] == 22
    assert side["wall_s"] == 9.0 and side["output_tok_s"] == pytest.approx(22 / 9)
    assert side["ttft_p50_s"] == pytest.approx(0.2)  # ttfts 0.1 and 0.3
    assert side["ttft_p99_s"] == pytest.approx(0.1 + 0.2 * 0.99)
    assert side["tpot_s"] == pytest.approx((0.05 + 0.1) / 2)


# -- schedule, plan, prompts --------------------------------------------------------------------


def test_order_alternates_and_each_build_goes_first_equally_often():
    orders = [schedule.round_order(i) for i in range(10)]
    assert orders[0] == ("A", "B") and orders[1] == ("B", "A")
    assert all(orders[i] != orders[i + 1] for i in range(9))
    assert sum(o[0] == "A" for o in orders) == sum(o[0] == "B" for o in orders) == 5
    assert [schedule.even_up(x) for x in (0.2, 1, 2, 3, 4.1, 20)] == [2, 2, 2, 4, 6, 20]


def test_default_plan_meets_the_issues_minimums():
    plan = schedule.Plan.select(None)
    by_name = {w.name: w for w in plan.workloads}
    assert all(w.rounds >= 20 for w in plan.workloads if w.concurrency == 1)
    assert all(w.rounds >= 10 for w in plan.workloads if w.concurrency >= 32)
    assert {(512, 128, 1), (512, 128, 8), (512, 128, 32), (6000, 128, 8)} <= {
        (w.input_len, w.output_len, w.concurrency) for w in plan.workloads}
    assert by_name["32000x128-c1"].group == "long" and schedule.GROUPS["long"].max_model_len >= 65536
    assert {g.name for g in plan.groups} == set(schedule.GROUPS)
    assert all(w.input_len + w.output_len <= schedule.GROUPS[w.group].max_model_len for w in plan.workloads)


def test_plan_selects_and_scales():
    plan = schedule.Plan.select(["mtp3", "512x128-c32"], rounds_scale=0.25, requests_scale=0.1)
    assert [w.name for w in plan.workloads] == ["512x128-c32", "mtp3-512x128-c1", "mtp3-512x128-c8"]
    assert [g.name for g in plan.groups] == ["base", "mtp3"]
    assert all(w.rounds % 2 == 0 and w.rounds >= 2 for w in plan.workloads)
    assert all(w.requests >= w.concurrency for w in plan.workloads)
    with pytest.raises(SystemExit, match="unknown"):
        schedule.Plan.select(["512x128-c2"])


def test_estimate_grows_with_rounds_and_uses_warm_start_up():
    full, quick = schedule.Plan.select(None), schedule.Plan.select(None, rounds_scale=0.2)
    assert schedule.estimate(full, False)["total_s"] > schedule.estimate(quick, False)["total_s"]
    assert schedule.estimate(full, True)["startup_s"] < schedule.estimate(full, False)["startup_s"]
    assert "estimated total" in schedule.describe(full, schedule.estimate(full, False))


def test_round_prompts_are_shared_by_a_and_b_and_new_every_round():
    w = schedule.Workload("t", "base", 50, 4, 2, 3, 2)
    ids = list(range(8, 1024))
    first = schedule.round_prompts(w, 0, ids, seed=0)
    assert first == schedule.round_prompts(w, 0, ids, seed=0)
    assert [len(p) for p in first] == [50, 50, 50]
    assert len({tuple(p) for p in first}) == 3
    assert not {tuple(p) for p in first} & {tuple(p) for p in schedule.round_prompts(w, 1, ids, seed=0)}
    assert all(8 <= t < 1024 for p in first for t in p)


def test_prompt_ids_leave_out_the_special_tokens(tiny_model):
    ids = serving_modes.prompt_token_ids(tiny_model)
    assert ids[0] == 8 and ids[-1] == 1023 and len(ids) == 1016


# -- the streaming client -----------------------------------------------------------------------


def test_stream_completion_times_the_first_and_each_token():
    with FakeServer(FakeVllm(ttft_s=0.05, token_s=0.01)) as server:
        sample = client.stream_completion(server.port, "glm-5", [9, 10, 11], 12)
    assert sample.error is None and sample.tokens == 12
    assert 0.05 <= sample.ttft < 0.5
    assert 0.008 <= sample.tpot < 0.05
    sent = server.state.completions[0]
    assert sent["ignore_eos"] is True and sent["temperature"] == 0.0 and sent["max_tokens"] == 12
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_stream_completion_counts_tokens_that_decode_to_no_text():
    # Without usage in its chunks, each choice chunk is a token, its text "" or not (a lone byte).
    with FakeServer(FakeVllm(faults={"no_usage", "empty_text"})) as server:
        sample = client.stream_completion(server.port, "glm-5", [9, 10, 11], 12)
    assert sample.error is None and sample.tokens == 12 and sample.tpot is not None
    assert client._tokens_so_far({"choices": [{"index": 0, "text": "", "token_ids": [5, 6]}]}, 3) == 5


@pytest.mark.parametrize("fault, message", [("http_500", "HTTP 500"), ("short", "11 tokens, expected 12"),
                                            ("no_done", "without data: [DONE]")])
def test_stream_completion_reports_a_broken_answer(fault, message):
    with FakeServer(FakeVllm(faults={fault})) as server:
        sample = client.stream_completion(server.port, "glm-5", [9], 12)
    assert message in sample.error


def test_stream_completion_reports_no_server():
    sample = client.stream_completion(free_ports(1), "glm-5", [9], 4, timeout=5)
    assert "Connection refused" in sample.error


def test_a_round_keeps_concurrency_requests_in_flight():
    with FakeServer(FakeVllm(ttft_s=0.02, token_s=0.005)) as server:
        prompts = [[8 + i] * 5 for i in range(8)]
        samples = client.run_round(server.port, "glm-5", prompts, 6, concurrency=4)
    assert server.state.max_active == 4
    assert len(samples) == 8 and all(s.error is None and s.tokens == 6 for s in samples)
    assert sorted(r["prompt"][0] for r in server.state.completions) == list(range(8, 16))


# -- speculative-decoding counters --------------------------------------------------------------


def test_spec_counters_are_parsed_summed_and_turned_into_rates():
    text = FakeVllm(spec=True).metrics()
    assert spec_decode_metrics.parse_spec_counters(text) == {
        "drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "accepted_per_position": [0.0, 0.0]}
    two_engines = "\n".join([
        'vllm:spec_decode_num_drafts_total{engine="0"} 10.0', 'vllm:spec_decode_num_drafts_total{engine="1"} 30.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0"} 120.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 50.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="1"} 20.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 30.0'])
    counters = spec_decode_metrics.parse_spec_counters(two_engines)
    assert counters == {"drafts": 40.0, "draft_tokens": 120.0, "accepted_tokens": 50.0,
                        "accepted_per_position": [30.0, 20.0]}
    rates = spec_decode_metrics.acceptance(spec_decode_metrics.counter_delta(
        {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0, "accepted_per_position": []}, counters))
    assert rates["acceptance_rate"] == pytest.approx(50 / 120)
    assert rates["mean_acceptance_length"] == pytest.approx(1 + 50 / 40)
    assert rates["per_position_rate"] == pytest.approx([0.75, 0.5])
    assert spec_decode_metrics.parse_spec_counters(FakeVllm().metrics()) is None
    assert spec_decode_metrics.acceptance(None) is None


def test_spec_counters_are_scraped_as_deltas_over_requests():
    with FakeServer(FakeVllm(spec=True)) as server:
        before = spec_decode_metrics.scrape_spec_counters(server.port)
        client.stream_completion(server.port, "glm-5", [9], 16)
        delta = spec_decode_metrics.counter_delta(before, spec_decode_metrics.scrape_spec_counters(server.port))
    assert delta == {"drafts": 8.0, "draft_tokens": 16.0, "accepted_tokens": 4.0, "accepted_per_position": [2.0, 2.0]}


# -- whole runs against fake servers ------------------------------------------------------------


def _run_bench(tmp_path, tiny_model, *extra, fake=None) -> tuple[int, dict]:
    site = fake_vllm_site(tmp_path / "site", fake=fake or {"ttft_s": 0.002, "token_s": 0.0005, "spec": True})
    out = tmp_path / "out"
    code = bench.main(["run", "--a-site", str(site), "--b-site", str(site), "--model", str(tiny_model),
                       "--mtp-model", str(tiny_model), "--out", str(out), "--work-dir", str(tmp_path / "work"),
                       "--port-base", str(free_ports(8)), "--timeout", "60", "--resamples", "300", *extra])
    return code, json.loads((out / "results.json").read_text())


def test_a_run_writes_results_that_follow_the_schema(tmp_path, tiny_model):
    code, doc = _run_bench(tmp_path, tiny_model, "--workloads", "512x128-c8", "mtp1-512x128-c1",
                           "--rounds-scale", "0.2", "--requests-scale", "0.5")
    assert code == 0, doc.get("error")
    assert report.schema_problems(doc) == []
    assert doc["command"].startswith("scripts/bench.py run --a-site")
    assert doc["environment"]["builds"]["A"]["versions"]["vllm"] == "0.24.0"
    assert [w["name"] for w in doc["workloads"]] == ["512x128-c8", "mtp1-512x128-c1"]
    c8, mtp = doc["workloads"]
    assert c8["rounds_done"] == 2 and [r["order"] for r in c8["rounds"]] == [["A", "B"], ["B", "A"]]
    assert all(len(r["sides"][s]["samples"]) == 8 for r in c8["rounds"] for s in "AB")
    assert c8["summary"]["output_tok_s"]["n"] == 2 and c8["spec_decode"]["A"]["draft_tokens"] > 0
    assert c8["texts"] == {"compared": 16, "equal": 16} and c8["rounds"][1]["texts"] == {"compared": 8, "equal": 8}
    mtp_group = doc["groups"]["mtp1"]["server_args"]
    assert json.loads(mtp_group[mtp_group.index("--speculative-config") + 1]) == {
        "method": "mtp", "num_speculative_tokens": 1}
    assert mtp["spec_decode"]["B"]["acceptance_rate"] == pytest.approx(0.25)
    assert set(doc["healthy_after_s"]) == {"bench-base-A", "bench-base-B", "bench-mtp1-A", "bench-mtp1-B"}
    assert (tmp_path / "out" / "server-bench-base-A.log").is_file()


def test_a_build_that_answers_other_tokens_is_counted_prompt_by_prompt_not_failed(tmp_path, tiny_model, capsys):
    # Two bases may compute differently; the count says how far they agree, for the reader.
    fake = {"ttft_s": 0.002, "token_s": 0.0005}
    a = fake_vllm_site(tmp_path / "a", fake=fake)
    b = fake_vllm_site(tmp_path / "b", fake={**fake, "faults": ["salt"]})
    code = bench.main(["run", "--a-site", str(a), "--b-site", str(b), "--model", str(tiny_model),
                       "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), "--port-base",
                       str(free_ports(2)), "--timeout", "60", "--resamples", "300", "--workloads", "512x128-c1",
                       "--rounds-scale", "0.1", "--requests-scale", "0.5"])
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert code == 0 and doc["workloads"][0]["texts"] == {"compared": 4, "equal": 0}
    assert "512x128-c1: texts equal for 0 of 4 prompts" in capsys.readouterr().out
    assert report.levels_table([doc]).splitlines()[2].endswith("| 0 of 4 |")


def test_rounds_with_an_error_or_from_older_results_compare_no_texts():
    ok = {"error": None, "text_sha256": "x"}
    assert stats.texts_compared([ok, {**ok, "error": "HTTP 500"}], [ok, ok]) == {"compared": 1, "equal": 1}
    assert stats.texts_compared([{"error": None}], [ok]) == {"compared": 0, "equal": 0}
    assert bench.workload_texts([{"texts": {"compared": 2, "equal": 1}}, {}]) == {"compared": 2, "equal": 1}


@pytest.mark.parametrize("spec, problem", [(False, "A: no spec-decode counters on /metrics; B: no spec-decode "
                                                   "counters on /metrics"),
                                           ("idle", "A: no draft tokens counted; B: no draft tokens counted")])
def test_an_mtp_workload_whose_servers_made_no_drafts_fails(tmp_path, tiny_model, spec, problem):
    """Both sides must have drafted: an MTP group served without its draft path (no counters, or
    counters that never move) would otherwise pass for an MTP comparison."""
    code, doc = _run_bench(tmp_path, tiny_model, "--workloads", "mtp1-512x128-c1", "--rounds-scale", "0.1",
                           "--requests-scale", "0.5", fake={"ttft_s": 0.002, "spec": spec})
    w = doc["workloads"][0]
    assert code == 1 and w["failed"] is True and w["spec_decode_problem"] == problem
    assert w["summary"]["output_tok_s"]["n"] == w["rounds_done"] > 0  # the rounds themselves ran


def _shipped(home: Path) -> list[str]:
    return sorted(p.name for p in (home / ".cache" / "vllm" / "modelinfos").iterdir())


def test_servers_without_caches_start_from_the_images_home_and_keep_theirs_after(tmp_path, tiny_model):
    code, doc = _run_bench(tmp_path, tiny_model, "--workloads", "512x128-c1", "--rounds-scale", "0.1",
                           "--requests-scale", "0.5", fake={"ttft_s": 0.002})
    assert code == 0 and doc["caches_warm_at_start"] is False
    homes = [tmp_path / "work" / f"home-base-{name}" for name in ("stock", "overlay")]
    assert [_shipped(h) for h in homes] == [["vllm-models-fake-DeepseekV32MTPModel.json",
                                             "vllm-models-fake-GlmMoeDsaForCausalLM.json"]] * 2
    # The model info alone is not a compile cache: still cold.
    assert bench.caches_present(homes) is False
    for home in homes:
        (home / ".cache" / "triton").mkdir(parents=True)
        (home / ".cache" / "triton" / "kernel.bin").write_bytes(b"compiled")
    assert bench.caches_present(homes) is True
    # A second run keeps the HOMEs it finds with caches, model info included; nothing is made again.
    made = sorted((tmp_path / "work" / "model-info").rglob("*.json"))
    stamps = [p.stat().st_mtime_ns for p in made]
    code, doc = _run_bench(tmp_path / "again", tiny_model, "--workloads", "512x128-c1", "--rounds-scale", "0.1",
                           "--requests-scale", "0.5", "--work-dir", str(tmp_path / "work"), fake={"ttft_s": 0.002})
    assert code == 0 and doc["caches_warm_at_start"] is True
    assert all((h / ".cache" / "triton" / "kernel.bin").is_file() for h in homes)
    assert [p.stat().st_mtime_ns for p in made] == stamps


def test_other_builds_on_the_same_work_dir_get_their_own_homes(tmp_path, tiny_model):
    # A base-vs-base run after a stock-vs-overlay run must not start from the other builds' caches.
    args = ["--workloads", "512x128-c1", "--rounds-scale", "0.1", "--requests-scale", "0.5"]
    assert _run_bench(tmp_path, tiny_model, *args, fake={"ttft_s": 0.002})[0] == 0
    for name in ("stock", "overlay"):
        (tmp_path / "work" / f"home-base-{name}" / ".cache" / "triton").mkdir(parents=True)
        (tmp_path / "work" / f"home-base-{name}" / ".cache" / "triton" / "kernel.bin").write_bytes(b"compiled")
    code, doc = _run_bench(tmp_path / "again", tiny_model, *args, "--work-dir", str(tmp_path / "work"),
                           "--a-name", "overlay-0.24.0", "--b-name", "overlay-0.33.0", fake={"ttft_s": 0.002})
    assert code == 0 and doc["caches_warm_at_start"] is False
    assert sorted(p.name for p in (tmp_path / "work").glob("home-*")) == [
        "home-base-overlay", "home-base-overlay-0.24.0", "home-base-overlay-0.33.0", "home-base-stock"]


def test_the_benchmark_starts_from_model_info_another_harness_made(tmp_path, tiny_model):
    from dsa_image.validation import serving_modes

    stock, overlay = fake_vllm_site(tmp_path / "stock"), fake_vllm_site(tmp_path / "overlay")
    root = tmp_path / "model-info"
    assert serving_modes.main(["--model-info-only", "--model", str(tiny_model), "--stock-site", str(stock),
                               "--overlay-site", str(overlay), "--out", str(tmp_path / "modes"),
                               "--model-info-root", str(root)]) == 0
    for site in (stock, overlay):  # a new fill would fail: the benchmark must take what is there
        (site / "vllm" / "model_executor" / "models" / "registry.py").unlink()
    code = bench.main(["run", "--a-site", str(stock), "--b-site", str(overlay), "--model", str(tiny_model),
                       "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"),
                       "--model-info-root", str(root), "--workloads", "512x128-c1", "--rounds-scale", "0.1",
                       "--requests-scale", "0.5", "--port-base", str(free_ports(2)), "--timeout", "60",
                       "--resamples", "300"])
    assert code == 0
    assert _shipped(tmp_path / "work" / "home-base-stock") == _shipped(tmp_path / "work" / "home-base-overlay") == [
        "vllm-models-fake-DeepseekV32MTPModel.json", "vllm-models-fake-GlmMoeDsaForCausalLM.json"]


def test_the_two_builds_need_two_names(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args([*_RUN_ARGS, "--a-name", "x", "--b-name", "x"])
    assert "--a-name and --b-name must differ; both are 'x'" in capsys.readouterr().err


def test_each_build_serves_with_the_environment_it_is_given_and_the_results_say_so(tmp_path, tiny_model):
    # One build against itself with one setting changed: the servers of B alone get it.
    code, doc = _run_bench(tmp_path, tiny_model, "--workloads", "512x128-c1", "--rounds-scale", "0.1",
                           "--requests-scale", "0.5", "--b-name", "overlay-probed", "--b-env", "DSA_BENCH_PROBE=on",
                           "--b-env", "VLLM_EXAMPLE=a=b", fake={"ttft_s": 0.002})
    assert code == 0, doc.get("error")
    builds = doc["environment"]["builds"]
    assert builds["A"]["env"] == {} and builds["B"]["env"] == {"DSA_BENCH_PROBE": "on", "VLLM_EXAMPLE": "a=b"}
    assert "probe: None" in (tmp_path / "out" / "server-bench-base-A.log").read_text()
    assert "probe: on" in (tmp_path / "out" / "server-bench-base-B.log").read_text()


def test_each_build_serves_with_the_flags_it_is_given_after_every_other_and_the_results_say_so(tmp_path, tiny_model):
    # One build against itself with one vllm serve flag changed: B's servers alone get it, last.
    code, doc = _run_bench(tmp_path, tiny_model, "--workloads", "512x128-c1", "--rounds-scale", "0.1",
                           "--requests-scale", "0.5", "--b-name", "overlay-flashmla",
                           "--b-server-args", "--attention-backend FLASHMLA_SPARSE", fake={"ttft_s": 0.002})
    assert code == 0, doc.get("error")
    builds = doc["environment"]["builds"]
    assert builds["A"]["server_args"] == [] and builds["B"]["server_args"] == ["--attention-backend", "FLASHMLA_SPARSE"]
    a_log, b_log = ((tmp_path / "out" / f"server-bench-base-{side}.log").read_text() for side in ("A", "B"))
    assert "FLASHMLA_SPARSE" not in a_log
    assert "'--gpu-memory-utilization', '0.2', '--attention-backend', 'FLASHMLA_SPARSE'" in b_log


@pytest.mark.parametrize("value", ["NOEQUALS", "=x", "1BAD=x", "A-B=x"])
def test_an_environment_assignment_that_is_not_key_value_is_refused(value, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args([*_RUN_ARGS, "--a-env", value])
    assert f"expected KEY=VALUE with KEY an environment variable name, got {value!r}" in capsys.readouterr().err


def test_a_build_whose_vllm_cannot_make_the_model_info_starts_no_server(tmp_path, tiny_model):
    site = fake_vllm_site(tmp_path / "site")
    (site / "vllm" / "model_executor" / "models" / "registry.py").unlink()
    with pytest.raises(SystemExit, match="the model info the image ships, for .*model_info_cache fill exited with 1"):
        bench.main(["run", "--a-site", str(site), "--b-site", str(site), "--model", str(tiny_model),
                    "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), "--workloads", "512x128-c1",
                    "--port-base", str(free_ports(2)), "--timeout", "30"])
    assert not list((tmp_path / "out").glob("server-*.log"))


def test_a_base_workload_needs_no_drafts(tmp_path, tiny_model):
    code, doc = _run_bench(tmp_path, tiny_model, "--workloads", "512x128-c1", "--rounds-scale", "0.1",
                           "--requests-scale", "0.5", fake={"ttft_s": 0.002})
    assert code == 0 and doc["workloads"][0]["spec_decode"] is None
    assert "spec_decode_problem" not in doc["workloads"][0]


def test_speculative_reads_the_server_arguments():
    assert schedule.speculative(bench._server_args(bench.parse_args(_RUN_ARGS), schedule.GROUPS["mtp3"]))
    assert not schedule.speculative(bench._server_args(bench.parse_args(_RUN_ARGS), schedule.GROUPS["base"]))
    assert schedule.speculative(["--speculative-config={\"method\": \"mtp\"}"])


_RUN_ARGS = ["run", "--a-site", "a", "--b-site", "b", "--model", "m", "--out", "o"]


def test_a_run_of_a_failing_build_fails(tmp_path, tiny_model):
    code, doc = _run_bench(tmp_path, tiny_model, "--workloads", "512x128-c1", "--rounds-scale", "0.1",
                           "--requests-scale", "0.5", fake={"faults": ["http_500"]})
    assert code == 1
    assert doc["workloads"][0]["failed"] is True
    assert doc["workloads"][0]["summary"]["output_tok_s"] == {"label": "output tokens/s", "n": 0}


def test_a_run_stops_at_its_deadline_on_a_pair_boundary(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setattr(bench, "STOP_MARGIN_S", 0.0)
    # About 1 s per side and round: the warm-up round and at most a pair fit in 10 s.
    code, doc = _run_bench(tmp_path, tiny_model, "--workloads", "512x128-c1", "--deadline-s", "10",
                           fake={"token_s": 0.002})
    w = doc["workloads"][0]
    assert w["truncated"] is True and w["rounds_done"] % 2 == 0 and w["rounds_done"] < w["rounds_planned"]


def test_waiting_for_health_leaves_time_to_stop_before_the_deadline(tmp_path, tiny_model):
    code, doc = _run_bench(tmp_path, tiny_model, "--workloads", "512x128-c1", "--deadline-s", "30")
    assert code == 1 and doc["workloads"] == []
    assert set(doc["group_errors"]["base"]) == {"bench-base-A", "bench-base-B"}


def test_the_long_group_serves_a_model_that_allows_its_length(tmp_path, tiny_model):
    target = serving_modes.long_context_model(tiny_model, tmp_path / "long", 65536)
    assert json.loads((target / "config.json").read_text())["max_position_embeddings"] == 65536
    assert json.loads((target / "tokenizer_config.json").read_text())["model_max_length"] == 65536
    assert json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"] == 8192
    assert (target / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()


def _results_doc() -> dict:
    rounds = [{"index": i, "order": list(schedule.round_order(i)), "sides": {"A": {}, "B": {}},
               "ratios": {"output_tok_s": 1.0 + 0.01 * i, "ttft_p50_s": 0.98, "ttft_p99_s": 1.02, "tpot_s": 1.0}}
              for i in range(4)]
    workload = {**asdict(schedule.WORKLOADS[0]), "rounds_planned": 4, "rounds_done": 4, "rounds": rounds,
                "summary": stats.summarize(rounds, 200, 0.95, 0), "spec_decode": {"A": {"acceptance_rate": 0.5}, "B": None}}
    return {"schema": report.SCHEMA, "created": "2026-12-01T00:00:00+00:00", "command": "scripts/bench.py run",
            "environment": {"gpu": {"gpus": [{"name": "NVIDIA H200"}]}, "builds": {}}, "settings": {},
            "groups": {}, "workloads": [workload]}


@pytest.mark.parametrize("mutate, problem", [
    (lambda d: d.pop("command"), "command: missing"),
    (lambda d: d.update(schema="other/2"), "schema: 'other/2'"),
    (lambda d: d["workloads"][0].pop("summary"), "workloads[0].summary"),
    (lambda d: d["workloads"][0]["rounds"][1].update(order=["B", "B"]), "rounds[1].order"),
    (lambda d: d["workloads"][0]["rounds"][2]["ratios"].pop("tpot_s"), "rounds[2].ratios"),
    (lambda d: d["workloads"][0].update(rounds_done=5), "rounds_done 5 != 4"),
])
def test_schema_names_what_is_wrong(mutate, problem):
    doc = _results_doc()
    assert report.schema_problems(doc) == []
    mutate(doc)
    assert any(problem in p for p in report.schema_problems(doc))


def test_table_shows_each_workloads_ratios_and_intervals():
    text = report.table([_results_doc()])
    row = [line for line in text.splitlines() if line.startswith("| 512x128-c1")][0]
    assert "| 4 |" in row and row.count("[") == 4
    assert "1.015 [" in row  # median of 1.00, 1.01, 1.02, 1.03


def test_levels_show_each_builds_medians_and_the_ratio_by_who_went_first():
    doc = _results_doc()
    for r in doc["workloads"][0]["rounds"]:  # the second build of a round is 10% faster
        a, b = (100.0, 110.0) if r["order"][0] == "A" else (110.0, 100.0)
        r["sides"] = {"A": {"stats": {"output_tok_s": a, "ttft_p50_s": 0.010, "tpot_s": 0.002}},
                      "B": {"stats": {"output_tok_s": b, "ttft_p50_s": 0.012, "tpot_s": None}}}
        r["ratios"]["output_tok_s"] = b / a
    doc["workloads"][0]["rounds"][3]["ratios"] = None  # a round with an error counts nowhere
    (row,) = [line for line in report.levels_table([doc]).splitlines() if line.startswith("| 512x128-c1")]
    assert row == "| 512x128-c1 | 100 / 110 | 10.0 / 12.0 | 2.00 / n/a | 1.100 | 0.909 |"


def test_plots_are_made_from_the_json_alone(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not in this environment (requirements-dev.in adds it)")
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_results_doc()))
    written = plots.plot([str(path)], str(tmp_path / "png"))
    assert sorted(p.name for p in written) == ["acceptance.png", "ratios.png", "rounds-512x128-c1.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


def test_a_plot_title_names_both_bases_of_a_base_vs_base_run_and_one_otherwise():
    doc = _results_doc()
    doc["environment"]["builds"] = {side: {"name": f"overlay-{v}", "versions": {"vllm": v}}
                                    for side, v in (("A", "0.24.0"), ("B", "0.33.0"))}
    assert plots._title(doc) == ("NVIDIA H200, vLLM 0.24.0 vs 0.33.0, A=overlay-0.24.0 vs B=overlay-0.33.0, "
                                 "2026-12-01")
    doc["environment"]["builds"]["A"] = {"name": "stock", "versions": {"vllm": "0.33.0"}}
    assert plots._title(doc).startswith("NVIDIA H200, vLLM 0.33.0, A=stock vs B=overlay-0.33.0")


def test_plot_refuses_a_file_that_is_not_results(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"schema": report.SCHEMA}))
    with pytest.raises(ValueError, match="not a benchmark results file"):
        report.load_results(path)


# -- serving modes ------------------------------------------------------------------------------


def test_modes_ask_vllm_for_what_they_name():
    mtp1, mtp3 = serving_modes.MODES["mtp1"].server_args(), serving_modes.MODES["mtp3"].server_args()
    assert json.loads(mtp1[mtp1.index("--speculative-config") + 1])["num_speculative_tokens"] == 1
    assert json.loads(mtp3[mtp3.index("--speculative-config") + 1])["num_speculative_tokens"] == 3
    deploy = serving_modes.MODES["long-fp8-mtp3"]
    assert deploy.kv_cache_dtype == "fp8_ds_mla" and deploy.max_model_len >= 65536
    long_lengths = serving_modes.MODES["long-bf16"].prompt_lengths
    assert min(n for n in long_lengths if n > 8192) <= 20000 and max(long_lengths) >= 60000
    assert all(n + m.max_tokens <= m.max_model_len for m in serving_modes.MODES.values() for n in m.prompt_lengths)


def test_an_mtp_mode_passes_only_when_the_draft_counters_agree():
    mode = serving_modes.MODES["mtp1"]
    same = {"drafts": 4.0, "draft_tokens": 4.0, "accepted_tokens": 1.0, "accepted_per_position": [1.0]}
    report = {"stock_vs_overlay": {"identical_tokens": True}, "empty_text": []}
    assert serving_modes.mode_ok(mode, {**report, "spec_decode_agrees": serving_modes.spec_agrees(
        {"stock": same, "overlay": dict(same)})})
    other = {**same, "accepted_tokens": 2.0}
    assert not serving_modes.mode_ok(mode, {**report, "spec_decode_agrees": serving_modes.spec_agrees(
        {"stock": same, "overlay": other})})
    assert not serving_modes.mode_ok(mode, {**report, "spec_decode_agrees": None})  # no counters at all
    assert serving_modes.mode_ok(serving_modes.MODES["fp8"], {**report, "spec_decode_agrees": None})


def test_log_facts_find_the_decode_path_growth_and_kv_format(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO [indexer.py:391] DSA indexer decode path: use_flattening=True (next_n=4, use_fp4_indexer_cache=False)\n"
                   "INFO Using fp8_ds_mla KV cache format for FLASHMLA_SPARSE backend.\n"
                   "WARNING DSA indexer: growing the expanded block table from 1032 to 1040 columns to fit\n"
                   "RuntimeError: The expanded size of the tensor (128) must match\n")
    facts = serving_modes.log_facts(str(log))
    assert facts["decode_path"] == ["use_flattening=True (next_n=4, use_fp4_indexer_cache=False)"]
    assert facts["kv_cache_format"] == ["fp8_ds_mla"]
    assert facts["block_table_growth"] == ["from 1032 to 1040 columns to fit"]
    assert facts["errors"] == ["RuntimeError: The expanded size of the tensor (128) must match"]


def test_complete_batch_returns_choices_in_prompt_order():
    with FakeServer(FakeVllm()) as server:
        prompts = [[9, 10], [11], [12, 13, 14]]
        out = serving_modes.complete_batch(server.port, prompts, 5)
    assert [c["token_ids"] for c in out] == [fake_tokens(p, 5) for p in prompts]
    assert all(len(c["logprobs"]) == 5 and c["text"] for c in out)


def _run_modes(tmp_path, tiny_model, modes: str, overlay_fake: dict, stock_fake: dict | None = None) -> tuple[int, dict]:
    stock = fake_vllm_site(tmp_path / "stock", fake={"spec": True, **(stock_fake or {})})
    overlay = fake_vllm_site(tmp_path / "overlay", fake={"spec": True, **overlay_fake})
    code = serving_modes.main(["--modes", modes, "--model", str(tiny_model), "--mtp-model", str(tiny_model),
                               "--stock-site", str(stock), "--overlay-site", str(overlay),
                               "--out", str(tmp_path / "out"), "--port-base", str(free_ports(4)), "--timeout", "60"])
    return code, json.loads((tmp_path / "out" / "serving-modes.json").read_text())


def test_serving_modes_pass_when_both_builds_answer_alike(tmp_path, tiny_model):
    code, doc = _run_modes(tmp_path, tiny_model, "mtp3,long-fp8", {})
    assert code == 0 and doc["ok"], json.dumps(doc)[:2000]
    mtp3, long_fp8 = doc["modes"]["mtp3"], doc["modes"]["long-fp8"]
    assert mtp3["stock_vs_overlay"] == {"identical_tokens": True, "mismatches": [], "text_mismatches": [],
                                        "max_abs_logprob_diff": 0.0}
    assert mtp3["unanswered"] == mtp3["empty_text"] == {}
    assert mtp3["spec_decode_agrees"] is True and mtp3["spec_decode"]["stock"]["acceptance_rate"] == 0.25
    assert long_fp8["prompt_lengths"][-1] == 65400
    assert "--kv-cache-dtype" in long_fp8["server_args"] and "fp8_ds_mla" in long_fp8["server_args"]
    derived = Path(long_fp8["model"])
    assert json.loads((derived / "config.json").read_text())["max_position_embeddings"] == 65536


def test_serving_modes_fail_when_the_overlay_answers_otherwise(tmp_path, tiny_model):
    code, doc = _run_modes(tmp_path, tiny_model, "fp8", {"faults": ["salt"]})
    assert code == 1 and not doc["ok"]
    mismatches = doc["modes"]["fp8"]["stock_vs_overlay"]["mismatches"]
    assert "sequential[0] (20 tokens)" in mismatches and "concurrent[5] (7000 tokens)" in mismatches


def test_serving_modes_pass_when_the_same_tokens_decode_to_empty_text(tmp_path, tiny_model):
    # vLLM 0.33.0, random weights: both builds repeat a lone byte token, "" as text. They answered.
    code, doc = _run_modes(tmp_path, tiny_model, "fp8", {"faults": ["empty_text"]}, {"faults": ["empty_text"]})
    fp8 = doc["modes"]["fp8"]
    assert code == 0 and doc["ok"], json.dumps(fp8)[:2000]
    assert fp8["unanswered"] == {} and fp8["stock_vs_overlay"]["text_mismatches"] == []
    assert set(fp8["empty_text"]) == {"stock", "overlay"} and "concurrent[5]" in fp8["empty_text"]["overlay"]


def test_serving_modes_fail_when_no_tokens_are_generated(tmp_path, tiny_model):
    code, doc = _run_modes(tmp_path, tiny_model, "fp8", {"faults": ["no_tokens"]}, {"faults": ["no_tokens"]})
    fp8 = doc["modes"]["fp8"]
    assert code == 1 and not doc["ok"]
    assert fp8["stock_vs_overlay"]["identical_tokens"]  # nothing equals nothing: the failure is the answer
    assert set(fp8["unanswered"]) == {"stock", "overlay"} and "sequential[0]" in fp8["unanswered"]["stock"]


def test_serving_modes_fail_when_the_same_tokens_give_other_text(tmp_path, tiny_model):
    code, doc = _run_modes(tmp_path, tiny_model, "fp8", {"faults": ["other_text"]})
    comparison = doc["modes"]["fp8"]["stock_vs_overlay"]
    assert code == 1 and not doc["ok"]
    assert comparison["identical_tokens"] and "sequential[0] (20 tokens)" in comparison["text_mismatches"]


def test_fake_site_process_stops_on_sigterm(tmp_path):
    import subprocess

    site = fake_vllm_site(tmp_path / "site", term_file=str(tmp_path / "term"), term_exit=3)
    port = free_ports(1)
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "m", "--port", str(port)],
                            env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, cwd=str(tmp_path))
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 3
    finally:
        proc.kill()
    assert (tmp_path / "term").read_text() == str(proc.pid)


def test_the_benchmark_readme_lists_the_workloads_as_the_code_defines_them():
    readme = (TESTS_DIR.parent / "docs" / "benchmarks" / "README.md").read_text()
    rows = {}
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0].startswith("`") and " / " in cells[2]:
            prompt, output = cells[2].split(" / ")
            rows[cells[0].strip("`")] = (cells[1], int(prompt), int(output), int(cells[3]), int(cells[4]), int(cells[5]))
    assert rows == {w.name: (w.group, w.input_len, w.output_len, w.concurrency, w.requests, w.rounds)
                    for w in schedule.WORKLOADS}


def test_spec_counters_are_read_until_they_stop_moving(monkeypatch):
    # The API server records a step's statistics after sending its tokens: a late increment.
    reads = iter([{"drafts": 1.0}, {"drafts": 3.0}, {"drafts": 3.0}, {"drafts": 9.0}])
    monkeypatch.setattr(spec_decode_metrics, "scrape_spec_counters", lambda port: next(reads))
    assert spec_decode_metrics.settled_spec_counters(1, pause_s=0) == {"drafts": 3.0}
    monkeypatch.setattr(spec_decode_metrics, "scrape_spec_counters", lambda port: None)
    assert spec_decode_metrics.settled_spec_counters(1, pause_s=10) is None  # no counters: no waiting


def test_one_server_failing_does_not_stop_the_others(monkeypatch):
    clock = iter(range(1000))
    monkeypatch.setattr(serving_modes.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(serving_modes.time, "sleep", lambda seconds: None)

    monkeypatch.setattr(serving_modes.serving, "is_healthy", lambda server: server["name"] == "ok")
    servers = [{"name": n, "started": 0, "log": f"server-{n}.log",
                "proc": types.SimpleNamespace(poll=lambda n=n: 1 if n == "dead" else None)}
               for n in ("ok", "dead", "slow")]
    status = serving_modes.wait_each_healthy(servers, deadline=50)
    assert isinstance(status["ok"], (int, float))
    assert status["dead"] == "error: dead exited with 1 before becoming healthy; see server-dead.log"
    assert status["slow"].startswith("error: not healthy in time")


def test_a_mode_a_build_cannot_serve_is_reported_not_fatal(tmp_path, tiny_model):
    stock = fake_vllm_site(tmp_path / "stock", fake={})
    overlay = fake_vllm_site(tmp_path / "overlay", crash_exit=1)
    code = serving_modes.main(["--modes", "fp8", "--model", str(tiny_model), "--stock-site", str(stock),
                               "--overlay-site", str(overlay), "--out", str(tmp_path / "out"),
                               "--port-base", str(free_ports(2)), "--timeout", "30"])
    report = json.loads((tmp_path / "out" / "serving-modes.json").read_text())["modes"]["fp8"]
    assert code == 1 and report["ok"] is False
    assert isinstance(report["healthy_after_s"]["stock"], float)
    assert report["error"].startswith("not served: {'overlay': 'error: fp8-overlay exited with 1")
