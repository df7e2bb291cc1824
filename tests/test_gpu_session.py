"""The GPU validation session runner (scripts/gpu_validation.py, dsa_image/validation/session.py):
one set of paths per base, the phase table, receiving the staged parts, the bench phase's builds,
refusals before anything runs, several phases in one call within a deadline. No GPU: the runner
itself runs, on a copy of the repository as a device call carries it."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsa_image.bench import paired as bench
from dsa_image.core import status
from dsa_image.core.recipe import load_recipe
from dsa_image.validation import phases, runner, session, stage
from test_h200_stage import wheel

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_validation.py"


def run_script(*args: str, script: Path = SCRIPT, env: dict | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return subprocess.run([sys.executable, str(script), *args], env={**os.environ, "PATH": path, **(env or {})},
                          capture_output=True, text=True, timeout=120, check=False)


def roots(tmp_path: Path) -> list[str]:
    return ["--work-root", str(tmp_path / "root"), "--out", str(tmp_path / "out"),
            "--results-dir", str(tmp_path / "results")]


# -- one set of paths per base ----------------------------------------------------------------------


@pytest.mark.parametrize("base", [None, "0.24.0", "0.33.0"])
def test_every_path_of_the_runner_is_the_bases_own(base):
    done = run_script(*(["--vllm", base] if base else []), "paths")
    assert done.returncode == 0, done.stderr
    paths = dict(line.split("=", 1) for line in done.stdout.splitlines())
    version = base or load_recipe().vllm_version
    assert paths == {"vllm": version, "stage": f"/tmp/stage-{version}", "wheels": f"/tmp/wheels-{version}",
                     "site_stock": f"/tmp/site-stock-{version}", "site_overlay": f"/tmp/site-overlay-{version}",
                     "model": "/tmp/tiny-glm5", "realwidth": "/tmp/glm5-realwidth",
                     "manifest": f"{REPO}/overlay/vllm-{version}/manifest.json", "results": f"/tmp/results-{version}"}


def test_the_runner_refuses_a_base_the_recipe_does_not_pin():
    done = run_script("--vllm", "0.9.9", "paths")
    assert done.returncode == 2 and "--vllm 0.9.9: expected one of the recipe's bases: 0.24.0 0.33.0" in done.stderr


def test_an_unknown_phase_is_a_usage_error_before_anything_runs(tmp_path):
    done = run_script(*roots(tmp_path), "receive", "instal")
    assert done.returncode == 2 and "unknown phases ['instal']" in done.stderr
    assert not (tmp_path / "out").exists()


def code_strings(path: Path) -> list[str]:
    """The string constants of a module that are not docstrings: what its code uses."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]


def test_the_runner_names_no_base_and_no_shared_path():
    strings = [s for name in ("session.py", "phases.py", "runner.py")
               for s in code_strings(REPO / "dsa_image" / "validation" / name)]
    assert not [s for s in strings if re.search(r"\b0\.\d+\.\d+\b", s)]
    assert not [s for s in strings if re.search(r"/tmp/(?:site-|stage\b|wheels\b|results\b|tiny-glm5|glm5-)", s)]


def test_the_paths_of_the_old_script_are_kept():
    """The records' calls (docs/validation) used the same places: /tmp/stage-X.Y.Z ... per base."""
    p = runner.Paths.of("9.9.9", Path("/tmp"), Path("/out"))
    assert {p.cuda_pip.name, p.toolchain_home.name, p.bench_work.name, p.warmstart_homes.name,
            p.model_info.name, p.mtp_model.name} == {
        "cuda-pip-9.9.9", "home-toolchain-9.9.9", "bench-work-9.9.9", "warmstart-homes-9.9.9",
        "model-info-9.9.9", "tiny-glm5-mtp"}


# -- the phase table ---------------------------------------------------------------------------------


def test_every_knob_of_the_table_is_an_option_and_every_phase_option_a_knob():
    options = vars(session.parse_args(["paths"]))
    knobs = {k for p in session.PHASES.values() for k in p.knobs}
    assert knobs <= set(options)
    general = {"phases", "vllm", "work_root", "out", "results_dir", "deadline_s"}
    assert set(options) - general == knobs


def test_the_old_scripts_phases_are_all_here_with_the_real_width_ones():
    old = ("paths receive inventory prepare sites install serve hosttime toolchain smoke mtp longctx deploy "
           "warmstart bench b12x selftest b12xserve cluster").split()
    assert set(old) <= set(session.PHASES)
    assert {"realwidth-model", "realwidth-equiv", "realwidth-startup", "realwidth-bench"} <= set(session.PHASES)
    assert all(p.does and p.seconds(session.DEFAULTS) >= 0 for p in session.PHASES.values())


def test_each_real_width_phase_fits_one_ten_minute_call_with_room_to_spare():
    for name in ("realwidth-model", "realwidth-equiv", "realwidth-startup", "realwidth-bench"):
        assert session.PHASES[name].seconds(session.DEFAULTS) <= session.DEFAULT_DEADLINE_S < 600


def test_the_help_shows_the_table():
    done = run_script("--help")
    assert done.returncode == 0
    assert "realwidth-equiv      needs: sites; options: --realwidth-modes, --modes-timeout-s" in done.stdout
    # The exit codes come from the one table (dsa_image.core.status), rendered into the epilog.
    assert "  0  SUCCESS      every phase ran and passed" in done.stdout
    assert "  8  INCOMPLETE   a phase was not reached before the deadline" in done.stdout


def test_the_real_width_modes_exist_and_serve_past_32k_with_mtp_one_a_call(tmp_path):
    from dsa_image.validation.serving_modes import MODES, FP8_KV

    long_fp8_mtp3, long_mtp1 = (MODES[m] for m in session.REALWIDTH_MODES)
    assert (long_fp8_mtp3.spec_tokens, long_fp8_mtp3.kv_cache_dtype) == (3, FP8_KV)
    assert (long_mtp1.spec_tokens, long_mtp1.kv_cache_dtype) == (1, "auto")
    assert all(max(m.prompt_lengths) > 32_000 and m.model == "mtp" for m in (long_fp8_mtp3, long_mtp1))
    done = run_script(*roots(tmp_path), "--realwidth-modes", "long-fp8-mtp3,long-mtp1", "realwidth-equiv")
    assert done.returncode == 2 and "one mode a call" in done.stderr


# -- receiving the parts ------------------------------------------------------------------------------


def device_copy(tmp_path: Path) -> Path:
    """What the runner needs of the repository, as the device's copy has it."""
    repo = tmp_path / "repo"
    shutil.copytree(REPO / "dsa_image", repo / "dsa_image", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "recipes", repo / "recipes")
    (repo / "scripts").mkdir()
    for name in ("gpu_validation.py", "recipe.py"):
        shutil.copy2(REPO / "scripts" / name, repo / "scripts" / name)
    return repo


class Transfer:
    """A staged bundle of two wheels here, and the device's copy of the repository the parts
    are carried into; `carry` copies parts into it and runs `receive` (and what else is asked)."""

    def __init__(self, tmp_path: Path):
        self.tmp, self.here, self.work = tmp_path, tmp_path / "here", tmp_path / "work"
        repo = device_copy(tmp_path)
        self.carried = repo / ".stage" / "vllm-0.33.0"
        self.script = repo / "scripts" / "gpu_validation.py"
        self.files = {n: wheel(tmp_path, n, "1.0", os.urandom(5000)) for n in ("foo", "bar")}
        self.staged = [stage.Staged(n, "1.0", frozenset(), "") for n in sorted(self.files)]
        self.parts = self.restage()

    def restage(self):
        shutil.rmtree(self.here, ignore_errors=True)
        return stage.write_stage(self.staged, self.files, self.here, part_bytes=4096)

    def receive(self, *more: str) -> subprocess.CompletedProcess:
        return run_script("--vllm", "0.33.0", "--work-root", str(self.work), "--out", str(self.tmp / "out"),
                          "receive", *more, script=self.script)

    def carry(self, *names: str, then: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        self.carried.mkdir(parents=True, exist_ok=True)
        for name in names:
            shutil.copy2(self.here / name, self.carried / name)
        return self.receive(*then)


def test_receive_moves_each_carried_part_checks_it_and_counts(tmp_path):
    t = Transfer(tmp_path)
    total = len(t.parts.paths)
    done = t.receive()
    assert done.returncode == 1 and "expected" in done.stderr and "SHA256SUMS" in done.stderr
    done = t.carry(t.parts.paths[0].name, "SHA256SUMS", "selection.txt")
    assert done.returncode == 0, done.stderr
    assert f"received: 1 of {total} parts" in done.stdout and not list(t.carried.iterdir())
    t.parts.paths[1].write_bytes(b"damaged in transfer")
    done = t.carry(t.parts.paths[1].name)
    assert done.returncode == 1 and "a part differs from SHA256SUMS" in done.stderr
    assert f"{t.parts.paths[1].name}: FAILED" in done.stdout
    t.restage()
    done = t.carry(*(p.name for p in t.parts.paths[1:]))
    assert done.returncode == 0 and f"received: {total} of {total} parts" in done.stdout


def test_receive_hashes_only_what_this_call_carried(tmp_path):
    """Each call hashes its own part: hashing every part so far made 71 calls quadratic (3 s a
    call by part 45 on the H200). A part damaged after its arrival is left to the install
    phase's check of the whole bundle."""
    t = Transfer(tmp_path)
    assert t.carry(t.parts.paths[0].name, "SHA256SUMS", "selection.txt").returncode == 0
    (t.work / "stage-0.33.0" / t.parts.paths[0].name).write_bytes(b"damaged after arrival")
    done = t.carry(t.parts.paths[1].name)
    assert done.returncode == 0, done.stderr
    assert f"received: 2 of {len(t.parts.paths)} parts" in done.stdout


def test_install_after_a_receive_that_left_parts_to_come_is_refused_saying_how_many(tmp_path):
    t = Transfer(tmp_path)
    done = t.carry(t.parts.paths[0].name, "SHA256SUMS", "selection.txt", then=("install", "serve"))
    total = len(t.parts.paths)
    assert done.returncode == status.REFUSED, done.stdout + done.stderr
    assert f"1 of {total} parts here" in done.stderr and "carry the missing ones (the receive phase)" in done.stderr
    lines = (tmp_path / "out" / "session.jsonl").read_text().splitlines()
    record = {r["phase"]: r for r in json.loads(lines[-1])["phases"]}
    assert [record[p]["status"] for p in ("receive", "install", "serve")] == ["passed", "refused", "not reached"]
    assert record["serve"]["detail"] == "after install refused"


def test_the_last_part_and_the_install_go_in_one_call_the_bundle_checked_whole(tmp_path):
    """receive then install, back to back: /tmp lasts only while the machine stays warm. The
    reassembled bundle is checked against SHA256SUMS before anything is installed."""
    t = Transfer(tmp_path)
    assert t.carry(*(p.name for p in t.parts.paths), "SHA256SUMS", "selection.txt").returncode == 0
    staged = t.work / "stage-0.33.0"
    (staged / t.parts.paths[0].name).write_bytes(b"damaged after arrival")
    done = t.receive("install", "serve")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "bundle.tar: FAILED" in done.stdout and "carry the missing ones" in done.stderr
    assert not (t.work / "site-stock-0.33.0").exists()
    assert "install              failed" in done.stdout and "serve                not reached" in done.stdout


# -- the deadline ---------------------------------------------------------------------------------------


def test_a_phase_that_needs_more_than_is_left_is_not_reached_and_said_so(tmp_path):
    t = Transfer(tmp_path)
    t.carry(*(p.name for p in t.parts.paths), "SHA256SUMS", "selection.txt")
    done = run_script("--vllm", "0.33.0", "--work-root", str(t.work), "--out", str(tmp_path / "out"),
                      "--deadline-s", "100", "receive", "install", "realwidth-equiv", script=t.script)
    assert done.returncode == status.INCOMPLETE, done.stdout + done.stderr
    assert re.search(r"install +not reached: needs 270 s, \d+ s were left before the deadline", done.stdout)
    assert re.search(r"realwidth-equiv +not reached: after install, not reached", done.stdout)
    assert not (t.work / "wheels-0.33.0").exists()  # nothing of install started


@pytest.mark.parametrize("interrupt", ["default", "ignored"])
def test_a_harness_running_at_the_deadline_is_interrupted_and_stops_what_it_started(tmp_path, interrupt):
    """`ignored`: the runner itself started in the background (`&` in a script, nohup), which
    leaves SIGINT ignored in it; its harnesses must still answer the deadline's SIGINT."""
    marker = tmp_path / "stopped"
    child = ("import time, pathlib\ntry:\n    time.sleep(60)\nfinally:\n"
             f"    pathlib.Path({str(marker)!r}).write_text('servers stopped')\n")
    session = ("import argparse, signal, sys\n"
               f"signal.signal(signal.SIGINT, signal.{'SIG_IGN' if interrupt == 'ignored' else 'SIG_DFL'})\n"
               "from dsa_image.validation import runner\nfrom pathlib import Path\n"
               "opts = argparse.Namespace(deadline_s=runner.MARGIN_S + 2)\n"
               "s = runner.Session(opts, runner.Paths.of('9.9.9', Path(sys.argv[1]), Path(sys.argv[1]) / 'out'))\n"
               "sys.exit(s.run([sys.executable, '-c', sys.argv[2]], Path(sys.argv[1]) / 'child.log'))\n")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", session, str(tmp_path), child], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == status.TIMED_OUT, done.stdout + done.stderr
    assert time.monotonic() - t0 < 30  # stopped by SIGINT, not by the SIGKILL 60 s after it
    assert marker.read_text() == "servers stopped"  # SIGINT: its finally blocks ran


# -- the bench phase's builds: this base's stock and overlay, or any two installed here ------------------


def _bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    work_root = tmp_path / "root"
    for site in ("site-stock-0.33.0", "site-overlay-0.33.0"):  # the base's own, installed
        (work_root / site / "vllm").mkdir(parents=True, exist_ok=True)
        (work_root / site / "vllm" / "__init__.py").write_text("")
    (work_root / "site-overlay-0.33.0" / "vllm_overlay_receipt.json").write_text("{}")
    (work_root / "tiny-glm5").mkdir(exist_ok=True)
    (work_root / "tiny-glm5" / "config.json").write_text("{}")
    (work_root / "tiny-glm5-mtp").mkdir(exist_ok=True)  # no model to write: not what is tested
    repo = tmp_path / "repo" if (tmp_path / "repo").is_dir() else device_copy(tmp_path)
    script = repo / "scripts" / "gpu_validation.py"
    return run_script("--vllm", "0.33.0", *roots(tmp_path), *args, "bench", script=script)


@pytest.mark.parametrize("args, named", [
    (("--bench-a", "overlay-0.24.0"), "--bench-a overlay-0.24.0"),  # not installed here
    (("--bench-a", "0.33.0"), "--bench-a 0.33.0"),  # no side
    (("--bench-a", "stock-0.33.0;rm", "--bench-b", "overlay-0.33.0"), "--bench-a stock-0.33.0;rm"),
])
def test_the_bench_phase_refuses_a_build_not_installed_here_before_anything_runs(tmp_path, args, named):
    done = _bench(tmp_path, *args)
    assert done.returncode == status.REFUSED, done.stdout + done.stderr
    assert f"bench: {named}: expected stock-X.Y.Z or overlay-X.Y.Z of a base installed here" in done.stderr
    assert "gpu_validation.py --vllm X.Y.Z sites` (or prepare) first" in done.stderr
    assert not (tmp_path / "results" / "environment.txt").exists()


def test_the_bench_phase_serves_the_two_builds_it_is_given_under_their_names(tmp_path):
    work_root = tmp_path / "root"
    for build in ("overlay-0.24.0", "overlay-0.33.0"):
        (work_root / f"site-{build}" / "vllm").mkdir(parents=True)
        (work_root / f"site-{build}" / "vllm" / "__init__.py").write_text("")
    done = _bench(tmp_path, "--bench-a", "overlay-0.24.0", "--bench-b", "overlay-0.33.0",
                  "--bench-args=--workloads base")
    assert (f"benchmark bench: --a-site {work_root}/site-overlay-0.24.0 --a-name overlay-0.24.0 "
            f"--b-site {work_root}/site-overlay-0.33.0 --b-name overlay-0.33.0; --workloads base") in done.stdout
    control = _bench(tmp_path, "--bench-a", "overlay-0.33.0", "--bench-b", "overlay-0.33.0")
    assert (f"--a-site {work_root}/site-overlay-0.33.0 --a-name overlay-0.33.0 "
            f"--b-site {work_root}/site-overlay-0.33.0 --b-name overlay-0.33.0-control;") in control.stdout
    default, default_root = _bench(tmp_path / "default"), tmp_path / "default" / "root"
    assert (f"benchmark bench: --a-site {default_root}/site-stock-0.33.0 "
            f"--b-site {default_root}/site-overlay-0.33.0 --a-name stock --b-name overlay") in default.stdout


def _session(tmp_path: Path, *argv: str) -> runner.Session:
    opts = session.parse_args([*roots(tmp_path), *argv])
    return runner.Session(opts, session.base_paths(opts))


def test_bench_args_come_last_so_they_can_rename_b_and_give_it_a_setting(tmp_path):
    # --bench-a X --bench-b X --bench-args "--b-name X-setting --b-env K=V" measures a setting: that
    # needs the bench args after the builds' names on bench.py's command line (argparse: last wins).
    s = _session(tmp_path, "--bench-args=--b-name overlay-0.33.0-compiled --b-env VLLM_USE_BREAKABLE_CUDAGRAPH=0",
                 "bench")
    builds = ["--a-site", "s", "--b-site", "s", "--a-name", "overlay-0.33.0", "--b-name", "overlay-0.33.0-control"]
    command = [str(c) for c in phases.bench_command(s, builds, "bench", Path("m"), Path("m"), Path("w"))]
    assert command[-4:] == ["--b-name", "overlay-0.33.0-compiled", "--b-env", "VLLM_USE_BREAKABLE_CUDAGRAPH=0"]
    assert command.index("--a-site") < command.index("--deadline-s") < len(command) - 4
    args = bench.parse_args(command[1:])
    assert (args.b_name, args.b_env) == ("overlay-0.33.0-compiled", [("VLLM_USE_BREAKABLE_CUDAGRAPH", "0")])


def test_bench_args_can_give_b_a_serve_flag_of_its_own(tmp_path):
    # The c=32 attribution at real width: the same build with another attention backend as B.
    s = _session(tmp_path, "--bench-args=--b-name overlay-0.33.0-flashmla --b-server-args '--attention-backend FLASHMLA_SPARSE'",
                 "realwidth-bench")
    builds = ["--a-site", "s", "--b-site", "s", "--a-name", "overlay-0.33.0", "--b-name", "overlay-0.33.0-control"]
    command = [str(c) for c in phases.bench_command(s, builds, "realwidth-bench", Path("m"), Path("m"), Path("w"))]
    args = bench.parse_args(command[1:])
    assert (args.b_name, args.b_server_args, args.a_server_args) == (
        "overlay-0.33.0-flashmla", "--attention-backend FLASHMLA_SPARSE", "")


def test_the_benchmarks_deadline_leaves_it_time_to_stop_its_servers(tmp_path):
    s = _session(tmp_path, "--deadline-s", "400", "bench")
    command = [str(c) for c in phases.bench_command(s, [], "bench", Path("m"), Path("m"), Path("w"))]
    deadline = float(command[command.index("--deadline-s") + 1])
    assert 400 - 60 < deadline <= 400 - phases.BENCH_STOP_S - phases.BENCH_KEEP_S


def test_the_real_width_bench_serves_glm5_at_real_width_with_its_memory_and_the_base_workloads(tmp_path):
    s = _session(tmp_path, "realwidth-bench")
    assert s.opts.bench_args == "--workloads base"
    builds = ["--a-site", "s", "--b-site", "o"]
    command = [str(c) for c in phases.bench_command(s, builds, "realwidth-bench", s.paths.realwidth, s.paths.realwidth,
                                                    s.paths.realwidth_bench_work, *phases.REALWIDTH_SERVERS)]
    args = bench.parse_args(command[1:])
    assert (args.model, args.mtp_model) == (str(s.paths.realwidth),) * 2
    assert (args.kv_cache_memory_bytes, args.gpu_memory_utilization, args.workloads) == (4 << 30, 0.4, ["base"])


def test_the_real_width_harnesses_take_the_arguments_the_runner_gives_them(tmp_path):
    from dsa_image.validation import serving_modes, startup

    s = _session(tmp_path, "realwidth-equiv")
    model = s.paths.realwidth
    args = serving_modes.parse_args([str(a) for a in phases.modes_args(
        s, "realwidth-equiv-long-fp8-mtp3", s.opts.realwidth_modes, model, model, *phases.REALWIDTH_SERVERS)])
    assert (args.modes, args.model, args.mtp_model) == ("long-fp8-mtp3", str(model), str(model))
    assert (args.kv_cache_memory_bytes, args.gpu_memory_utilization, args.vllm) == (4 << 30, 0.4, s.paths.vllm)
    assert args.timeout <= s.opts.modes_timeout_s
    args = startup.parse_args([str(a) for a in phases.startup_args(s, "realwidth-startup", model,
                                                                   *phases.REALWIDTH_STARTUP)])
    assert (args.model, args.site, args.vllm) == (str(model), str(s.paths.site_overlay), s.paths.vllm)
    assert (args.starts, args.goal_factor, args.require_warm) == (["after-cold", "after-restart"], 1.2, True)
    assert args.budget_s == pytest.approx(s.left() - 60, abs=1)  # a minute kept for the memory check


# -- upstream's tests: what is left goes to the next call ------------------------------------------------


def fake_sites(root: Path, base: str = "0.33.0") -> None:
    for site in (f"site-stock-{base}", f"site-overlay-{base}"):
        (root / site / "vllm").mkdir(parents=True, exist_ok=True)
        (root / site / "vllm" / "__init__.py").write_text("")
    (root / f"site-overlay-{base}" / "vllm_overlay_receipt.json").write_text("{}")


# Stands in for scripts/upstream_tests.py in the device's copy: says what it was given, and that
# files are left (its exit INCOMPLETE, 8).
FAKE_GATE = """import json, sys
from pathlib import Path
args = sys.argv[1:]
out = Path(args[args.index("--out") + 1])
(out / "args.json").write_text(json.dumps(args))
print("2 of 21 files ran on both sides; 19 left")
print("resume in the next call", file=sys.stderr)
sys.exit(8)
"""


def test_the_upstream_phase_leaves_what_is_left_to_the_next_call_and_says_so(tmp_path):
    repo = device_copy(tmp_path)
    (repo / "scripts" / "upstream_tests.py").write_text(FAKE_GATE)
    fake_sites(tmp_path / "root")
    script = repo / "scripts" / "gpu_validation.py"
    done = run_script("--vllm", "0.33.0", *roots(tmp_path), "upstream", script=script)
    assert done.returncode == status.REFUSED and "upstream: expected the bundle" in done.stderr  # not made, not carried
    (repo / "build" / "upstream-tests-0.33.0").mkdir(parents=True)
    done = run_script("--vllm", "0.33.0", *roots(tmp_path), "--deadline-s", "300", "upstream", script=script)
    assert done.returncode == status.INCOMPLETE, done.stdout + done.stderr
    assert f"upstream exit: {status.INCOMPLETE}" in done.stdout and "19 left" in done.stdout and "upstream             incomplete" in done.stdout
    args = json.loads((tmp_path / "results" / "upstream-tests" / "args.json").read_text())
    deadline, timeout = (float(args[args.index(k) + 1]) for k in ("--deadline-s", "--timeout"))
    assert deadline + timeout <= 300 - runner.MARGIN_S and deadline / timeout == pytest.approx(120 / 420, rel=0.05)
    assert (tmp_path / "out" / "compare.txt").read_text().startswith("2 of 21 files")
    assert "resume in the next call" in (tmp_path / "results" / "upstream-tests.log").read_text()


# -- refusals before anything runs ------------------------------------------------------------------------


def test_the_cluster_phase_refuses_to_run_without_its_inputs(tmp_path):
    done = run_script(*roots(tmp_path), "--cluster-layouts", "mp-tp2", "cluster")
    assert done.returncode == status.REFUSED
    assert "cluster: expected" in done.stderr and "run the prepare phase first" in done.stderr
    done = run_script(*roots(tmp_path), "cluster")
    assert done.returncode == 2 and "cluster: expected --cluster-layouts" in done.stderr


@pytest.mark.parametrize("phase", ["serve", "mtp", "realwidth-equiv", "realwidth-startup", "selftest"])
def test_a_phase_without_the_sites_is_refused_naming_the_phase_that_makes_them(tmp_path, phase):
    done = run_script(*roots(tmp_path), phase)
    assert done.returncode == status.REFUSED, done.stdout + done.stderr
    assert "run the install, prepare or sites phase first" in done.stderr
    assert not (tmp_path / "results" / "environment.txt").exists()


def test_the_environment_record_names_the_settings_the_session_ran_with():
    from dsa_image.harness import server as serving

    env = {"CUDA_MODULE_LOADING": "EAGER", "VLLM_USE_BREAKABLE_CUDAGRAPH": "0", "HOME": "/root", "PATH": "/bin",
           "XCUDA_Y": "1"}
    assert serving.settings_set(env) == ["CUDA_MODULE_LOADING=EAGER", "VLLM_USE_BREAKABLE_CUDAGRAPH=0"]
    assert serving.settings_set({"HOME": "/root"}) == []
