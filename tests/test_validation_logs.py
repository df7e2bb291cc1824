"""The validation harnesses' reading of vLLM server logs and their server start-up, on the CPU.

Built from the real H200 run r18 (tests/data/r18-*, excerpts of its output):

- b12x serving reported FAIL although both servers produced identical tokens: its error scan
  counted vLLM's start-up ulimit advisory (a WARNING that names OSError) and the EngineDeadError
  that vLLM logs after the harness's own SIGTERM;
- the recipes harness reported a run "healthy after 0.0 s" with an empty log (a server left by an
  earlier, killed call answered on the same port), and a run whose HOME was kept from an earlier
  call reported "DeepGEMM backend is unavailable".
"""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dsa_image.build.tiny_model import write_model
from dsa_image.harness import server as serving
from dsa_image.validation import b12x_serving, recipes, serving_modes

# The free-port helper the smoke tests use (tests/ is on sys.path as pytest runs them).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bench import add_fake_model_registry  # noqa: E402
from fake_vllm import FakeServer, FakeVllm  # noqa: E402
from test_smoke_fakes import free_port  # noqa: E402

DATA = Path(__file__).parent / "data"
STOCK_LOG = DATA / "r18-server-b12x-stock.log"
EMULATED_LOG = DATA / "r18-server-b12x-emulated.log"
DEEPGEMM_UNAVAILABLE = DATA / "r18-recipe-glm-5-fp8-deepgemm-unavailable.log"
ULIMIT_ADVISORY = "Found ulimit of 20000 and failed to automatically increase"
TRIGGER = "[shutdown] EngineCore: trigger received signal=SIGTERM"


def _with_before_shutdown(log: str, inserted: str) -> str:
    """`log` with `inserted` placed just before the line where SIGTERM started the shutdown."""
    lines = log.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if TRIGGER in line)
    return "".join(lines[:at]) + inserted + "".join(lines[at:])


# -- bug 1: the error scan ------------------------------------------------------------------------


def test_the_recorded_logs_hold_what_the_scan_must_pass_over():
    stock = STOCK_LOG.read_text()
    assert ULIMIT_ADVISORY in stock.splitlines()[0] and "OSError: [Errno 24]" in stock.splitlines()[0]
    after = stock[stock.index(TRIGGER):]
    assert "EngineDeadError: EngineCore encountered an issue" in after
    assert ULIMIT_ADVISORY in EMULATED_LOG.read_text()


@pytest.mark.parametrize("log", [STOCK_LOG, EMULATED_LOG], ids=["stock", "emulated"])
def test_the_ulimit_advisory_and_the_noise_after_our_sigterm_are_not_errors(log):
    assert b12x_serving.log_facts(str(log))["errors"] == []
    assert serving_modes.log_facts(str(log))["errors"] == []
    assert serving.log_errors(log.read_text()) == []


def test_an_error_before_the_shutdown_still_counts():
    stock = STOCK_LOG.read_text()
    failed = _with_before_shutdown(stock, DEEPGEMM_UNAVAILABLE.read_text())
    assert serving.log_errors(failed) == [
        "EngineCore failed to start.",
        "RuntimeError: DeepGEMM backend is unavailable in the current vLLM environment, or the available "
        "DeepGEMM package does not provide the required APIs for these kernels."]
    # The very EngineDeadError block of the run, had it come while serving, is an error too.
    dead = [line for line in stock[stock.index(TRIGGER):].splitlines(keepends=True) if "ERROR" in line]
    assert serving.log_errors(_with_before_shutdown(stock, "".join(dead))) == [
        "AsyncLLM output_handler failed.",
        "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause."]


def test_serving_modes_reads_errors_with_the_same_scan(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(_with_before_shutdown(STOCK_LOG.read_text(), DEEPGEMM_UNAVAILABLE.read_text()))
    assert serving_modes.log_facts(str(log))["errors"] == serving.log_errors(log.read_text()) != []


def _recorded_run(directory: Path, stock_text: str | None = None) -> Path:
    directory.mkdir()
    shutil.copy(DATA / "r18-serving-b12x.json", directory / "serving-b12x.json")
    (directory / "server-b12x-stock.log").write_text(stock_text or STOCK_LOG.read_text())
    shutil.copy(EMULATED_LOG, directory / "server-b12x-emulated.log")
    return directory


def test_the_recorded_run_reevaluates_to_pass(tmp_path, capsys):
    run = _recorded_run(tmp_path / "run")
    assert json.loads((run / "serving-b12x.json").read_text())["ok"] is False  # as the H200 run said
    assert b12x_serving.main(["--reevaluate", str(run)]) == 0
    report = json.loads((run / "serving-b12x.reevaluated.json").read_text())
    assert report["ok"] is True and report["recorded_ok"] is False
    assert report["stock_vs_b12x"] == {"identical_tokens": True, "mismatches": [], "max_abs_logprob_diff": 0.0}
    assert report["logs"]["b12x-emulated"] == {"kernels": ["b12x"], "capability_bypassed": True, "errors": []}
    assert "B12X SERVING (re-evaluated): PASS" in capsys.readouterr().out


def test_a_recorded_run_with_an_error_before_shutdown_reevaluates_to_fail(tmp_path):
    stock = _with_before_shutdown(STOCK_LOG.read_text(), DEEPGEMM_UNAVAILABLE.read_text())
    run = _recorded_run(tmp_path / "run", stock)
    assert b12x_serving.main(["--reevaluate", str(run)]) == 1
    report = json.loads((run / "serving-b12x.reevaluated.json").read_text())
    assert report["ok"] is False and report["logs"]["b12x-stock"]["errors"]


# -- bug 2: the recipes harness's server start --------------------------------------------------

# Stands in for `python -m vllm.entrypoints.cli.main serve`: resolves `deep_gemm` as vLLM 0.24.0's
# vllm/utils/deep_gemm.py does (site-packages `deep_gemm` first, else the vendored copy) with the
# real import system, logs what the real servers logged in either case, and answers like vLLM.
FAKE_VLLM_MAIN = textwrap.dedent('''
    import importlib, os, pathlib, sys

    data = pathlib.Path(os.environ["FAKE_VLLM_DATA"])
    try:
        dg = importlib.import_module("deep_gemm")
    except ImportError:
        dg = None  # vLLM falls back to vllm.third_party.deep_gemm
    if dg is not None and getattr(dg, "get_paged_mqa_logits_metadata", None) is None:
        sys.stdout.write((data / "r18-recipe-glm-5-fp8-deepgemm-unavailable.log").read_text())
        sys.exit(1)
    sys.stdout.write((data / "r18-recipe-tiny-glm5-deepgemm-vendored.log").read_text())
    sys.stdout.flush()

    sys.path.insert(0, TESTS)
    import fake_vllm
    fake_vllm.main(sys.argv[1:])
''').replace("TESTS", repr(str(Path(__file__).resolve().parent)))


@pytest.fixture
def fake_vllm(tmp_path):
    site = tmp_path / "site"
    cli = site / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for package in (site / "vllm", site / "vllm" / "entrypoints", cli):
        (package / "__init__.py").write_text("")
    (cli / "main.py").write_text(FAKE_VLLM_MAIN)
    return add_fake_model_registry(site)


def _run() -> recipes.ScaledRun:
    return recipes.ScaledRun("fake", ("fake",), False, ["--port", "0", "--served-model-name", "glm-5"],
                             {"FAKE_VLLM_DATA": str(DATA)}, ())


def _serve(tmp_path, site, port, timeout=60):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    if not (tmp_path / "model").is_dir():  # its config.json names the classes the model info is for
        write_model(tmp_path / "model")
    return recipes.serve_one(_run(), tmp_path / "model", out, tmp_path / "work", sys.executable, str(site),
                             port, timeout)


def _old_server() -> FakeServer:
    """A server left running by an earlier call: answers /health and completions on its port."""
    return FakeServer(FakeVllm())


def test_a_run_serves_from_an_empty_home_even_after_a_killed_run(tmp_path, fake_vllm):
    # What a killed earlier call leaves in the run's HOME: a DeepGEMM JIT cache directory.
    stale = tmp_path / "work" / "home-fake"
    (stale / "deep_gemm" / "cache").mkdir(parents=True)
    (stale / "deep_gemm" / "cache" / "kernel.cu").write_text("// half-writ")
    (stale / "left-by-the-killed-run").write_text("")
    result = _serve(tmp_path, fake_vllm, free_port())
    assert result.get("error") is None and result["ok"], result
    assert "DeepGEMM PDL enabled on vllm.third_party.deep_gemm." in result["log_tail"]
    assert not (stale / "left-by-the-killed-run").exists()


def test_a_port_that_already_answers_is_refused_before_anything_starts(tmp_path, fake_vllm):
    with _old_server() as old:
        try:
            result, refusal = _serve(tmp_path, fake_vllm, old.port, timeout=30), None
        except Exception as exc:  # noqa: BLE001 - the refusal is checked below
            result, refusal = None, exc
    # Unfixed, the run is "healthy after 0.0 s" and its completions are the old server's answers.
    assert refusal is not None, f"served by the server already on the port: {result}"
    assert isinstance(refusal, recipes.PortBusy) and f"port {old.port} already accepts connections" in str(refusal)
    assert not (tmp_path / "out" / "fake.log").exists()


def test_health_counts_only_from_the_started_process_once_it_has_logged(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("")
    with _old_server() as old:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait(30)
        with pytest.raises(RuntimeError, match="exited with 0 before /health answered"):
            recipes.wait_healthy(dead, old.port, log, timeout=5, poll_s=0.1)
        alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            with pytest.raises(TimeoutError):  # alive, but it has written nothing: not its answer
                recipes.wait_healthy(alive, old.port, log, timeout=1, poll_s=0.1)
            log.write_text((DATA / "r18-recipe-tiny-glm5-deepgemm-vendored.log").read_text())
            assert recipes.wait_healthy(alive, old.port, log, timeout=5, poll_s=0.1) < 5
        finally:
            alive.kill()
            alive.wait(30)
