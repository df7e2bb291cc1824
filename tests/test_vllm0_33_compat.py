"""The benchmark, the image's warm-up and the serving-recipe validation against vLLM 0.33.0's facts,
on the CPU: excerpts of the real H200 logs of vLLM 0.33.0 (tests/data/, from docs/validation/), and
the source of the vLLM wheels in the wheel cache (`scripts/recipe.py lock` puts them there; tests
that read a wheel skip where it is absent). Every check of a wheel runs for 0.24.0 too: both bases
are served by the same harnesses.

Only a GPU run settles how long a cold start with MTP really takes, and whether the draft path
runs; these tests fix what the harnesses expect of vLLM: names, routes, options and values.
"""

from __future__ import annotations

import ast
import datetime as dt
import json
import re
import subprocess
import sys
import zipfile
from functools import lru_cache
from pathlib import Path

import pytest

from dsa_image.serving import launch as sl, recipes as sr
from dsa_image.runtime import spec_decode_metrics, warmup
from dsa_image.core.recipe import load_recipe
from dsa_image.validation import recipes as scaled
from dsa_image.harness import server as serving
from dsa_image.core.wheels import cache_dir

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"


def run2(name: str) -> Path:
    """The excerpt of a log of the second 0.33.0 H200 run (docs/validation/h200-2026-11-30-vllm0_33_0-run2)."""
    return DATA / f"h200-vllm0_33_0-run2-{name}"


RECIPE_LOG = run2("recipe-glm-5-fp8-8xb200.log")
BASES = ("0.24.0", "0.33.0")
# The GPU machine's limit on one command of a validation session: at most 10 minutes (docs/validation/README.md).
DEVICE_CALL_S = 600
# The recipe run of the second 0.33.0 session (its README's call 77): `--timeout 270`.
RUN2_RECIPE_TIMEOUT_S = 270


# -- the logs -----------------------------------------------------------------------------------

_STAMP = re.compile(r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)|2026-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)")


def stamp(line: str) -> dt.datetime:
    """The time of a vLLM log line ("INFO 11-30 21:15:02 [...]") or of FlashInfer's logger
    ("2026-11-30 21:15:55,840 - INFO - ...")."""
    m = _STAMP.search(line)
    month, day, h, mi, s = (int(x) for x in (m.groups()[:5] if m.group(1) else m.groups()[5:]))
    return dt.datetime(2026, month, day, h, mi, s)


def first_line(path: Path, needle: str) -> str:
    return next(line for line in path.read_text(errors="replace").splitlines() if needle in line)


SAMPLER_JIT = "flashinfer.jit: Building JIT module sampling"


def test_the_recipe_timeout_outlasts_a_cold_0_33_mtp_start_and_fits_in_a_device_call():
    """The recipe run of 0.33.0's second session timed out at 270 s. From its log: the server
    reached FlashInfer's sampler JIT 179 s after its start (started = the stop's SIGTERM minus
    the 270 s waited). From the smoke's server: 169 s from that JIT's start to healthy. The
    default must exceed their sum, and with the stop's 30-s wait (serving.stop) stay inside one
    device call."""
    stopped = stamp(first_line(RECIPE_LOG, "[shutdown] EngineCore: trigger received signal=SIGTERM"))
    started = stopped - dt.timedelta(seconds=RUN2_RECIPE_TIMEOUT_S)
    to_jit = (stamp(first_line(RECIPE_LOG, SAMPLER_JIT)) - started).total_seconds()
    smoke = run2("smoke-server.log")
    jit_to_healthy = (stamp(first_line(smoke, "Starting vLLM server on"))
                      - stamp(first_line(smoke, SAMPLER_JIT))).total_seconds()
    assert (to_jit, jit_to_healthy) == (179, 169)
    assert to_jit + jit_to_healthy < scaled.DEFAULT_TIMEOUT_S
    assert RUN2_RECIPE_TIMEOUT_S < to_jit + jit_to_healthy  # why the run timed out
    assert scaled.DEFAULT_TIMEOUT_S + 30 + 60 <= DEVICE_CALL_S  # the stop, the requests and writing


def test_the_recipe_validation_defaults_to_that_timeout(tmp_path, monkeypatch):
    seen = {}

    def serve_one(run, model, out, work, python, site, port, timeout):
        seen[run.name] = timeout
        return {"run": run.name, "recipes": list(run.recipes), "ok": True}

    monkeypatch.setattr(scaled, "serve_one", serve_one)
    monkeypatch.setattr(scaled, "prepare_models", lambda directory: {False: tmp_path, True: tmp_path})
    assert scaled.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path), "--only", "tiny-glm5"]) == 0
    assert seen == {"tiny-glm5": scaled.DEFAULT_TIMEOUT_S}


def test_a_server_out_of_time_is_reported_with_what_it_was_still_doing(tmp_path):
    """Run2's recipe log up to the stop: the server was compiling FlashInfer's sampler. Its end
    after the stop is the ninja "interrupted by user" traceback the stop caused, which reads like
    a failed build: the error must name the line from before."""
    text = RECIPE_LOG.read_text(errors="replace")
    log = tmp_path / "server.log"
    log.write_text(text[:text.index("(EngineCore pid=8352) INFO 11-30 21:17:26 [core.py:1525] [shutdown]")])
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(TimeoutError) as caught:
            scaled.wait_healthy(alive, _free_port(), log, timeout=0, poll_s=0)
    finally:
        alive.kill()
        alive.wait()
    assert str(caught.value).startswith("not healthy after 0 s; still running, its last log line: ")
    assert str(caught.value).endswith("flashinfer.jit: Building JIT module sampling; this can take several minutes "
                                      "on first use.")


def test_the_last_log_line_is_the_last_redraw_of_a_progress_bar(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO start\nCapturing CUDA graphs:   2%|\rCapturing CUDA graphs:  10%|\n\n")
    assert scaled.last_log_line(log) == "Capturing CUDA graphs:  10%|"
    assert scaled.last_log_line(tmp_path / "none.log") is None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_8xb200_recipe_scaled_down_is_what_0_33_accepted():
    """The server of run2's recipe log got past vLLM 0.33.0's argument parser and engine
    configuration with these settings (its "non-default args" line, then the engine's config
    with the MTP drafter): the scaled-down recipe must still render them."""
    build = load_recipe(vllm="0.33.0")
    run = scaled.scale_down(sr.load_serve_recipe("glm-5-fp8-8xb200", build=build), build)
    line = first_line(RECIPE_LOG, "non-default args: ")
    logged = ast.literal_eval(line.split("non-default args: ", 1)[1])
    args = run.args
    value = {flag: args[args.index(flag) + 1] for flag in args if flag.startswith("--") and
             args.index(flag) + 1 < len(args) and not args[args.index(flag) + 1].startswith("--")}
    assert logged["attention_backend"] == value["--attention-backend"] == "FLASHMLA_SPARSE"
    assert logged["kv_cache_dtype"] == value["--kv-cache-dtype"] == "fp8"
    assert logged["block_size"] == int(value["--block-size"])
    assert logged["speculative_config"] == json.loads(value["--speculative-config"]) == {
        "method": "mtp", "num_speculative_tokens": 3}
    assert logged["enable_prefix_caching"] is True and "--enable-prefix-caching" in args
    assert logged["tool_call_parser"] == value["--tool-call-parser"]
    assert logged["reasoning_parser"] == value["--reasoning-parser"]
    assert logged["chat_template_content_format"] == value["--chat-template-content-format"]
    assert "Using fp8_ds_mla KV cache format for FLASHMLA_SPARSE backend." in RECIPE_LOG.read_text()
    assert "speculative_config=SpeculativeConfig(method='mtp'" in RECIPE_LOG.read_text()


def test_the_routes_the_harnesses_use_are_0_33s():
    """bench (/v1/completions streamed, /metrics), the warm-up (/health, /v1/models,
    /v1/completions, /metrics) and the recipe validation (/v1/chat/completions too)."""
    routes = set(re.findall(r"Route: (\S+), Methods", run2("smoke-server.log").read_text()))
    assert {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions"} <= routes


def test_the_jit_monitor_lines_of_0_33_are_read():
    """vLLM 0.33.0 names a class's kernel "BuildPrefillChunkMetadataKernel.kernel"; the bench
    records the kernels compiled during inference by name."""
    assert serving.jit_kernels_during_inference(str(run2("server-stock_a.log"))) == [
        "BuildPrefillChunkMetadataKernel", "fused_moe_kernel"]
    assert serving.jit_kernels_during_inference(str(run2("server-overlay.log"))) == ["fused_moe_kernel"]


def test_the_warmups_health_wait_outlasts_the_cold_0_33_starts_logged():
    """From vLLM's first log line (its banner, after the imports) to "Starting vLLM
    server" (its /health answers then): 0.33.0's cold starts of run2, 209-252 s (the harnesses,
    timing from the process start, measured 239-281 s). The supervisor waits hours for /health,
    not minutes, and the warm-up's own budget starts only after it."""
    import inspect

    longest = 0.0
    for name in ("server-stock_a.log", "server-stock_b.log", "server-overlay.log", "smoke-server.log"):
        lines = run2(name).read_text(errors="replace").splitlines()
        first = next(line for line in lines if _STAMP.search(line))
        longest = max(longest, (stamp(first_line(run2(name), "Starting vLLM server on")) - stamp(first)).total_seconds())
    assert 200 < longest < 300
    health_timeout = inspect.signature(warmup.supervise).parameters["health_timeout_s"].default
    assert health_timeout >= 10 * longest and warmup.Settings().timeout_s >= 1800


# -- the wheels ---------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def _wheel(version: str) -> zipfile.ZipFile | None:
    found = sorted((cache_dir() / "wheels").glob(f"vllm-{version}-*.whl"))
    return zipfile.ZipFile(found[0]) if found else None


def source(version: str, path: str) -> str:
    wheel = _wheel(version)
    if wheel is None:
        pytest.skip(f"no vLLM {version} wheel in {cache_dir() / 'wheels'} (scripts/recipe.py lock downloads it)")
    return wheel.read(path).decode()


def literal(text: str, name: str) -> set[str]:
    """The strings of `NAME = Literal[...]` in a module's text."""
    body = re.search(rf"^{name} = Literal\[(.*?)\]", text, re.S | re.M).group(1)
    return set(re.findall(r'"([^"]+)"', body))


@pytest.mark.parametrize("version", BASES)
def test_the_spec_decode_counters_read_are_vllms(version):
    """Bench and warm-up tell an MTP server and its drafts by these counters: prometheus
    Counters (exposed with `_total`), registered only with speculative decoding configured."""
    text = source(version, "vllm/v1/spec_decode/metrics.py")
    assert "    _counter_cls = prometheus_client.Counter" in text
    assert "self.spec_decoding_enabled = speculative_config is not None" in text
    assert "if not self.spec_decoding_enabled:\n            return" in text
    registered = set(re.findall(r'name="(vllm:spec_decode_[a-z_]+)"|\("(vllm:spec_decode_[a-z_]+)",', text))
    registered = {a or b for a, b in registered}
    assert {f"{name}_total" for name in registered} == {*spec_decode_metrics.SPEC_COUNTERS.values(),
                                                       spec_decode_metrics.SPEC_PER_POSITION}
    assert 'pos_labelnames = labelnames + ["position"]' in text


@pytest.mark.parametrize("version", BASES)
def test_the_answers_the_warmup_and_bench_read_are_vllms(version):
    protocol = source(version, {"0.24.0": "vllm/entrypoints/openai/engine/protocol.py",
                                "0.33.0": "vllm/entrypoints/serve/engine/protocol.py"}[version])
    card = protocol[protocol.index("class ModelCard("):protocol.index("class ModelList(")]
    assert "    max_model_len: int | None = None" in card  # warmup.served_model
    usage = protocol[protocol.index("class UsageInfo("):]
    assert "    completion_tokens: int | None = 0" in usage  # warm-up, bench and recipes count these
    completion = source(version, "vllm/entrypoints/openai/completion/serving.py")
    # bench: with continuous_usage_stats every streamed chunk carries the tokens so far
    assert "completion_tokens = previous_num_tokens[i]" in completion
    assert 'yield "data: [DONE]\\n\\n"' in completion
    utils = source(version, "vllm/entrypoints/serve/utils/api_utils.py")
    assert "include_continuous_usage = include_usage and bool(\n            stream_options.continuous_usage_stats" in utils
    health = source(version, "vllm/entrypoints/serve/instrumentator/health.py")
    assert "await client.check_health()\n        return Response(status_code=200)" in health


def test_0_33_answers_busy_with_503_where_0_24_has_no_such_answer():
    """Why the warm-up sends a request refused with 503 again (warmup.RETRY_STATUS)."""
    new = source("0.33.0", "vllm/exceptions.py")
    for name in ("QueueOverflowError", "MaxQueuedTokensError"):
        block = new[new.index(f"class {name}(GracefulHTTPError)"):]
        assert "HTTPStatus.SERVICE_UNAVAILABLE" in block[:block.index("\nclass ")]
    assert "self.status_code = HTTPStatus.SERVICE_UNAVAILABLE" in new  # RetryableRequestError
    assert warmup.RETRY_STATUS == 503
    old = source("0.24.0", "vllm/exceptions.py")
    assert "QueueOverflowError" not in old and "RetryableRequestError" not in old


# -- every recipe's flags against the release's `vllm serve` --------------------------------------


def serve_options(version: str) -> set[str]:
    """What `vllm serve` of this release takes, read from its source: the engine arguments and
    the frontend's (dataclass fields, --field-name) and the options added by name."""
    serve = source(version, "vllm/entrypoints/cli/serve.py")
    frontend = re.search(r"from (vllm\.entrypoints\.[\w.]*cli_args) import", serve).group(1).replace(".", "/") + ".py"
    engine = source(version, "vllm/engine/arg_utils.py")
    engine = engine[engine.index("class EngineArgs"):]
    texts = (engine, source(version, frontend), serve)
    fields = {m for text in texts for m in re.findall(r"^    (\w+): ", text, re.M)}
    named = {m for text in texts for m in re.findall(r'"(--[\w-]+)"', text)}
    return {"--" + f.replace("_", "-") for f in fields} | named


def recipe_forms(build) -> list[tuple[str, str, list[str], dict[str, str]]]:
    """(name, form, `vllm serve` arguments, environment): every node role of every recipe and
    image target, as the runner launches them, and every scaled-down run of the validation."""
    forms = []
    for name in sr.serve_recipe_names():
        recipe = sr.load_serve_recipe(name, build=build)
        for target in recipe.targets:
            env = sl.environment(recipe, target, build)
            if recipe.nodes == 1:
                forms.append((name, f"{target} solo", sl.vllm_args(recipe, target, build), env))
                continue
            for backend in sr.CLUSTER_BACKENDS:
                args = sl.vllm_args(sr.apply_overrides(recipe, [f"cluster_backend={backend}"], build), target, build)
                if backend == "ray":
                    forms.append((name, f"{target} ray", [*args, "--distributed-executor-backend", "ray"], env))
                else:
                    forms.append((name, f"{target} mp", [*args, "--nnodes", str(recipe.nodes), "--node-rank", "1",
                                                         "--master-addr", "10.0.0.1", "--master-port",
                                                         str(sl.MP_MASTER_PORT), "--headless"], env))
    for run in scaled.scaled_runs(sr.serve_recipe_names(), build, gpus=1):
        forms.append((run.name, "scaled down", ["MODEL", *run.args], run.env))
    return forms


@pytest.mark.parametrize("version", BASES)
def test_every_recipe_flag_and_value_is_one_vllm_serve_of_that_release_takes(version):
    """An option renamed or removed between releases (0.33.0 dropped e.g. --calculate-kv-scales and
    --max-num-partial-prefills), a backend, KV dtype, parser or speculative setting the release
    does not have, or a VLLM_ variable it does not read: each would stop a recipe's server."""
    build = load_recipe(vllm=version)
    options = serve_options(version)
    kv_dtypes = literal(source(version, "vllm/config/cache.py"), "CacheDType")
    registry = source(version, "vllm/v1/attention/backends/registry.py")
    registry = registry[registry.index("class AttentionBackendEnum"):]
    backends = set(re.findall(r"^    ([A-Z0-9_]+) = ", registry, re.M))
    tool_parsers = set(re.findall(r'^    "([\w-]+)": \(', source(version, "vllm/tool_parsers/__init__.py"), re.M))
    reasoning = set(re.findall(r'^    "([\w-]+)": \(', source(version, "vllm/reasoning/__init__.py"), re.M))
    speculative = source(version, "vllm/config/speculative.py")
    spec_fields = set(re.findall(r"^    (\w+): ", speculative, re.M))
    executors = literal(source(version, "vllm/config/parallel.py"), "DistributedExecutorBackend")
    envs = set(re.findall(r'^    "(VLLM_\w+)": ', source(version, "vllm/envs.py"), re.M))
    overlay = "".join(p.read_text() for p in (REPO / "overlay" / f"vllm-{version}").rglob("*.py"))
    values = {"--kv-cache-dtype": kv_dtypes, "--attention-backend": backends, "--tool-call-parser": tool_parsers,
              "--reasoning-parser": reasoning, "--distributed-executor-backend": executors}
    problems = []
    for name, form, args, env in recipe_forms(build):
        where = f"{name} ({form})"
        for i, arg in enumerate(args):
            if not arg.startswith("--"):
                continue
            option = "--" + arg[len("--no-"):] if arg.startswith("--no-") else arg
            if option not in options:
                problems.append(f"{where}: {arg} is not an option of vllm serve {version}")
            if arg in values and args[i + 1] not in values[arg]:
                problems.append(f"{where}: {arg} {args[i + 1]} is not one vLLM {version} has")
            if arg == "--speculative-config":
                spec = json.loads(args[i + 1])
                problems += [f"{where}: speculative config key {k}" for k in spec if k not in spec_fields]
                if f'"{spec["method"]}"' not in speculative:
                    problems.append(f"{where}: speculative method {spec['method']}")
        problems += [f"{where}: {var} is read neither by vLLM {version} nor by its overlay"
                     for var in env if var.startswith("VLLM_") and var not in envs and f'"{var}"' not in overlay]
    assert not problems, "\n".join(problems)
    assert len({f for _, f, _, _ in recipe_forms(build)}) > 3  # the forms were there to check


@pytest.mark.parametrize("version", BASES)
def test_the_flags_the_bench_passes_and_the_warmup_reads_are_that_releases(version):
    """The bench starts each server with serving.start_server's flags and its group's; the
    warm-up finds the server from --host, --port, --uds, --ssl-certfile, --api-key and --config."""
    from dsa_image.bench import paired as bench, schedule

    options = serve_options(version)
    args = bench.parse_args(["run", "--a-site", "a", "--b-site", "b", "--model", "m", "--out", "o"])
    passed = {a for group in schedule.GROUPS.values() for a in bench._server_args(args, group) if a.startswith("--")}
    passed |= {"--port", "--served-model-name", "--load-format", "--seed", "--max-model-len"}  # start_server
    read = {"--host", "--port", "--uds", "--ssl-certfile", "--api-key", "--config"}  # serve_command.endpoint_of
    assert not (passed | read) - options
    spec_fields = set(re.findall(r"^    (\w+): ", source(version, "vllm/config/speculative.py"), re.M))
    for group in schedule.GROUPS.values():
        if schedule.speculative(group.server_args):
            config = json.loads(group.server_args[group.server_args.index("--speculative-config") + 1])
            assert set(config) <= spec_fields and config["method"] == "mtp"
