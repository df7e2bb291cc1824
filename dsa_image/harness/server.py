"""vLLM servers for the harnesses (validation, benchmark, start-up): start one from a site with
its own HOME and log, wait until it is healthy, send it greedy completions, read its log (JIT
compiles during inference, errors), stop it and what it started.

Stdlib only (runs under any Python that can start vLLM)."""

from __future__ import annotations

import concurrent.futures
import datetime
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from dsa_image.build import model_info_cache
from dsa_image.core.compile_caches import cache_env
from dsa_image.core import health
from dsa_image.harness.client import Client
from dsa_image.core.site_path import pythonpath

SERVED_NAME = "glm-5"
PROMPT_LENGTHS = (20, 300, 2049, 3000, 5000, 7000)
MAX_TOKENS = 24
TOP_LOGPROBS = 5  # per generated position: compared as sets, for information (compare())
# vLLM's JIT monitor: "<runtime> [kernel |autotune/warmup candidate ]JIT compilation during
# inference: <name>". vLLM 0.24.0 watched Triton alone (triton_utils/jit_monitor.py); 0.33.0 also
# CuTeDSL and TileLang (utils/jit_monitor.py, _handle_jit_event) and names its JIT kernel classes'
# Triton functions "<Class>.kernel", whose class name is kept here.
JIT_LINE = re.compile(r"(\w+) (?:kernel |autotune/warmup candidate )?JIT compilation during inference: (\w+)")
# The prefill-chunk metadata kernel the overlay warms up: a Triton function in 0.24.0, a
# VllmTritonJitKernel class in 0.33.0 (v1/attention/backends/mla/indexer.py of each).
PREFILL_CHUNK_KERNELS = ("_build_prefill_chunk_metadata_kernel", "BuildPrefillChunkMetadataKernel")


def prompts(vocab_size: int = 1024, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids 3.. skip the special tokens (bos/eos/pad are 0/1/2).
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def server_env(site: str, home: str, env_extra: dict | None = None) -> dict:
    """The environment a vLLM process of one build runs in: that build's site on PYTHONPATH and
    its own HOME and compile caches (the cluster harness starts Ray nodes with it too: Ray
    workers inherit the environment of `ray start`). Creates HOME."""
    os.makedirs(home, exist_ok=True)
    return {**os.environ, "PYTHONPATH": pythonpath(site), "HOME": home, **cache_env(home),
            **(env_extra or {})}


def image_model_info(sides: dict[str, tuple[str, str]], model: Path, root: Path) -> dict[str, Path]:
    """Per side (name: (python, site)), the model-info entries the image ships
    (dsa_image/build/model_info_cache.py), made by that side's vLLM from `model`'s classes, all sides
    at once (a cold 0.33.0 process on the H200 took 42-44 s a class), and kept under `root`:
    made once per side and model. A HOME made from them with model_info_cache.image_home starts
    a server as the image's first `docker run` does. Raises model_info_cache.FILL_ERRORS."""
    def fill(side: str) -> Path:
        python, site = sides[side]
        cache_root = Path(root) / f"{side}-{Path(model).name}"
        return model_info_cache.fill_with(python, server_env(site, str(cache_root / "home")), Path(model), cache_root)

    with concurrent.futures.ThreadPoolExecutor(len(sides)) as pool:
        return dict(zip(sides, pool.map(fill, sides), strict=True))


def require_image_model_info(sides: dict[str, tuple[str, str]], model: Path, root: Path) -> dict[str, Path]:
    """image_model_info for a harness that starts no server without it: a failed fill exits,
    saying what failed."""
    try:
        return image_model_info(sides, model, root)
    except model_info_cache.FILL_ERRORS as exc:
        raise SystemExit(f"the model info the image ships, for {model}: {type(exc).__name__}: {exc}") from None


def add_model_info_root(parser) -> None:
    """--model-info-root, as every harness that starts servers from the image's HOME takes it."""
    parser.add_argument("--model-info-root", help="where each side's model info (what the image ships) is made "
                        "once and kept, to be shared by calls and harnesses (default: WORK_DIR/model-info)")


def model_info_root(args, work_dir) -> Path:
    """The root --model-info-root names, or WORK_DIR/model-info."""
    return Path(args.model_info_root or Path(work_dir) / "model-info")


# The first line of every server log: process start, on the clock of vLLM's own lines (local
# time), to the microsecond (dsa_image.validation.startup_phases reads it).
STARTED = "dsa-image: server process started at "


def start_server(name, site, model, port, out_dir, extra_args, *, home=None,
                 max_model_len=8192, python=None, env_extra=None):
    # A HOME (its compile caches laid out as the image's: dsa_image/core/compile_caches.py) each; the
    # benchmark and the warm-start measurement pass their own HOME to keep (or empty) one
    # server's caches across starts.
    home = home or f"/tmp/home-{name}"
    env = server_env(site, home, env_extra)
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
           "--port", str(port), "--served-model-name", SERVED_NAME,
           "--load-format", "dummy", "--seed", "0", "--max-model-len", str(max_model_len),
           *extra_args]
    log = open(os.path.join(out_dir, f"server-{name}.log"), "w")
    log.write(f"{STARTED}{datetime.datetime.now().isoformat(sep=' ', timespec='microseconds')}\n")
    log.flush()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            cwd=home, start_new_session=True)
    return {"name": name, "port": port, "proc": proc, "log": log.name, "cmd": cmd,
            "started": time.monotonic()}


def is_healthy(server) -> bool:
    """Whether the server's /health answers 200 (whoever answers on its port: see watch)."""
    return Client.local(server["port"]).status("/health") == 200


def watch(server: dict, settled: Callable[[dict], str | None] | None = None) -> health.Watch:
    """A server start_server started, as health.wait watches it. `settled(server)` may end the
    wait for one that will never be healthy, with its reason."""
    return health.Watch(server["name"], lambda: is_healthy(server), lambda: server["proc"].poll(), server["started"],
                        settled=(lambda: settled(server)) if settled else lambda: None)


def _exited(server: dict, outcome: health.Outcome) -> str:
    return f"{server['name']} exited with {outcome.exit_code} before becoming healthy; see {server['log']}"


def wait_all_healthy(servers: list[dict], deadline: float) -> dict[str, float]:
    """Seconds from each server's start until its /health first answers, for a harness that needs
    them all: the first that exits raises RuntimeError, and those late at `deadline` TimeoutError."""
    outcomes = health.wait([watch(s) for s in servers], deadline, first_failure_ends=True)
    for server in servers:
        if outcomes[server["name"]].exit_code is not None:
            raise RuntimeError(_exited(server, outcomes[server["name"]]))
    late = [s["name"] for s in servers if outcomes[s["name"]].healthy_s is None]
    if late:
        raise TimeoutError(f"{', '.join(late)} not healthy in time; see their server-*.log")
    return {name: round(o.healthy_s or 0.0, 1) for name, o in outcomes.items()}


def complete(port: int, prompt: list[int]) -> dict:
    payload = {
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
        "temperature": 0.0, "logprobs": TOP_LOGPROBS, "return_token_ids": True,
        # Top-logprob keys as "token_id:N": as token strings, lone byte tokens of the tiny
        # byte-level tokenizer may all decode to one replacement character, one key for several.
        "return_tokens_as_token_ids": True,
        "ignore_eos": True,
    }
    choice = Client.local(port, timeout_s=300).post("/v1/completions", payload).body["choices"][0]
    return parse_choice(choice, TOP_LOGPROBS)


def parse_choice(choice: dict, top: int = 0) -> dict:
    """What the harnesses keep of one completion choice (requested with return_token_ids and
    logprobs): token ids, the chosen tokens' logprobs, the text and, with `top`, each generated
    position's `top` most likely tokens (ids where the server gave "token_id:N" keys)."""
    parsed = {"token_ids": choice.get("token_ids"),
              "logprobs": choice["logprobs"]["token_logprobs"],
              "text": choice["text"]}
    if top:
        parsed["top_tokens"] = [None if position is None else
                                [_token_key(k) for k in sorted(position, key=position.get, reverse=True)[:top]]
                                for position in choice["logprobs"].get("top_logprobs") or []]
    return parsed


def _token_key(key: str) -> int | str:
    return int(key[len("token_id:"):]) if key.startswith("token_id:") else key


# -- did a server answer ------------------------------------------------------------------------


def answered(choice: dict, usage: dict | None = None) -> bool:
    """Whether a server generated tokens for one completion choice: the choice's token ids where
    it has them (return_token_ids), else the response's usage.completion_tokens (one prompt).

    Not whether its text is non-empty: greedy decoding of random weights may repeat a token that
    detokenizes to nothing (vLLM 0.33.0 on the tiny GLM-5: token 257, a lone byte of the
    byte-level tokenizer, an invalid UTF-8 sequence on its own, 24 times, "" as text), and
    that server did answer."""
    token_ids = choice.get("token_ids")
    if token_ids is not None:
        return len(token_ids) > 0
    if not usage:
        return False
    return int(usage.get("completion_tokens") or 0) > 0


def _labelled(results: dict[str, list[dict]]):
    """("sequential[3]", choice), ... for each output of one server's results."""
    for batch, choices in results.items():
        for i, choice in enumerate(choices):
            yield f"{batch}[{i}]", choice


def unanswered_outputs(results: dict[str, list[dict]]) -> list[str]:
    """The outputs of one server that generated no tokens: a failure."""
    return [label for label, choice in _labelled(results) if not answered(choice)]


def empty_text_outputs(results: dict[str, list[dict]]) -> list[str]:
    """The outputs of one server whose tokens decoded to empty text: recorded, not a failure
    (see answered); comparing builds, compare() requires the same tokens to give the same text."""
    return [label for label, choice in _labelled(results) if answered(choice) and not choice["text"]]


def output_findings(results_by_server: dict[str, dict]) -> dict:
    """Per server (only those with any): `unanswered` outputs and `empty_text` outputs."""
    findings: dict[str, dict[str, list[str]]] = {"unanswered": {}, "empty_text": {}}
    for name, results in results_by_server.items():
        for key, outputs in (("unanswered", unanswered_outputs(results)),
                             ("empty_text", empty_text_outputs(results))):
            if outputs:
                findings[key][name] = outputs
    return findings


def run_requests(port: int, batch: list[list[int]]) -> dict:
    sequential = [complete(port, p) for p in batch]
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        concurrent_ = list(pool.map(lambda p: complete(port, p), batch))
    return {"sequential": sequential, "concurrent": concurrent_}


def compare(a: dict, b: dict, lengths=PROMPT_LENGTHS) -> dict:
    """Two servers' results output by output: token ids (`mismatches`), texts where the token ids
    are the same (`text_mismatches`: the same tokens must detokenize the same), the chosen tokens'
    logprobs and, where both recorded top tokens (complete()), the share of generated positions
    whose top-k token sets agree. The last two are information, not a verdict: run-to-run noise
    (~5e-4 in a logprob) can swap near-ties at rank k."""
    token_mismatches, text_mismatches, max_logprob_diff = [], [], 0.0
    top_positions = top_agreeing = top_k = 0
    for mode in ("sequential", "concurrent"):
        for i, (x, y) in enumerate(zip(a[mode], b[mode], strict=True)):
            label = f"{mode}[{i}] ({lengths[i]} tokens)"
            if x["token_ids"] != y["token_ids"]:
                token_mismatches.append(label)
            elif x["text"] != y["text"]:
                text_mismatches.append(label)
            diffs = [abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"], strict=False)
                     if p is not None and q is not None]
            max_logprob_diff = max([max_logprob_diff, *diffs])
            if "top_tokens" in x and "top_tokens" in y:
                pairs = [(p, q) for p, q in zip(x["top_tokens"], y["top_tokens"], strict=False) if p is not None and q is not None]
                top_positions += len(pairs)
                top_agreeing += sum(set(p) == set(q) for p, q in pairs)
                top_k = max([top_k, *(len(p) for p, _ in pairs)])
    report = {"identical_tokens": not token_mismatches, "mismatches": token_mismatches,
              "text_mismatches": text_mismatches, "max_abs_logprob_diff": max_logprob_diff}
    if top_positions:
        report["top_tokens"] = {"k": top_k, "positions": top_positions,
                                "same_set_share": round(top_agreeing / top_positions, 6)}
    return report


def same_outputs(comparison: dict) -> bool:
    """compare()'s verdict where two builds must agree: the same tokens, detokenized the same."""
    return bool(comparison.get("identical_tokens")) and not comparison.get("text_mismatches")


def jit_kernel_name(match: re.Match) -> str:
    """A Triton kernel by its name (as the harnesses always recorded it); another runtime's
    prefixed with it ("CuTeDSL:name"), so that it is not taken for a Triton kernel."""
    runtime, name = match.groups()
    return name if runtime == "Triton" else f"{runtime}:{name}"


def jit_kernels_during_inference(log_path: str) -> list[str]:
    with open(log_path, errors="replace") as f:
        return sorted({jit_kernel_name(m) for m in JIT_LINE.finditer(f.read())})


# -- errors in a server's log ------------------------------------------------------------------
# One scan for every harness that reads a vLLM server's log (b12x_serving, serving_modes).
# Counted: vLLM's ERROR/CRITICAL log lines, Python tracebacks and the exception lines that end
# them. Not counted: a WARNING or INFO line that merely names an exception (vLLM's start-up
# "Found ulimit ... fd limit errors like `OSError: [Errno 24] Too many open files`" advisory),
# and anything after the shutdown that a signal started (the harness stops every server with
# SIGTERM; vLLM then logs e.g. EngineDeadError from the API server's output handler).

_PROCESS = r"(?:\([\w.-]+ pid=\d+\) )?"  # "(APIServer pid=4855) ", "(EngineCore pid=5099) "
_LEVELLED = re.compile(_PROCESS + r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? "
                       r"\[[^\]]*\] ?(.*)")
_UVICORN = re.compile(_PROCESS + r"(DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+(.*)")
_EXCEPTION = re.compile(r"(?:[A-Za-z_][\w]*\.)*(\w+(?:Error|Exception|Exit|Interrupt): .*|\w+(?:Error|Exception))$")
_TRACEBACK = "Traceback (most recent call last):"
# vLLM 0.24.0's signal handlers (v1/engine/core.py, entrypoints/launcher.py).
SHUTDOWN_TRIGGER = re.compile(r"\[shutdown\] (?:EngineCore: trigger received signal=|API server: shutdown triggered)")


def log_errors(text: str) -> list[str]:
    """The distinct errors a vLLM server logged before a signal started its shutdown, sorted."""
    errors, in_traceback = set(), False
    for line in text.splitlines():
        if SHUTDOWN_TRIGGER.search(line):
            break
        levelled = _LEVELLED.match(line) or _UVICORN.match(line)
        if levelled:
            level, body = levelled.groups()
            if level not in ("ERROR", "CRITICAL"):
                continue
        else:
            body = re.sub("^" + _PROCESS, "", line)
        if body.startswith(_TRACEBACK):
            in_traceback = True
            continue
        exception = _EXCEPTION.match(body)
        if exception:
            errors.add(exception.group(1))
            in_traceback = False
        elif levelled and body and not body[0].isspace():
            errors.add(body)  # an ERROR line of its own, e.g. "EngineCore failed to start."
    if in_traceback:
        errors.add(f"{_TRACEBACK} (no exception line followed)")
    return sorted(errors)


def stop(server) -> None:
    if server["proc"].poll() is None:
        os.killpg(server["proc"].pid, signal.SIGTERM)
        try:
            server["proc"].wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server["proc"].pid, signal.SIGKILL)


def wait_each_healthy(servers: list[dict], deadline: float, poll_s: float = 1.0,
                      settled: Callable[[dict], str | None] | None = None) -> dict[str, float | str]:
    """Seconds from start to healthy per server, or "error: ..." for one that exited, was settled
    or was late. Unlike wait_all_healthy, one server failing (a build that cannot start in a
    mode) does not stop the others from being waited for and used."""
    outcomes = health.wait([watch(s, settled) for s in servers], deadline, poll_s)
    return {s["name"]: _seconds_or_error(s, outcomes[s["name"]]) for s in servers}


def _seconds_or_error(server: dict, outcome: health.Outcome) -> float | str:
    if outcome.healthy_s is not None:
        return round(outcome.healthy_s, 1)
    if outcome.exit_code is not None:
        return f"error: {_exited(server, outcome)}"
    if outcome.settled is not None:
        return f"error: {outcome.settled}"
    return f"error: not healthy in time; see {Path(server['log']).name}"


# Variables a session hands its servers that change what they run (CUDA_MODULE_LOADING=EAGER
# stalled a real-width start: run 10), named in a session's environment.txt.
SETTING_PREFIXES = ("CUDA_", "NCCL_", "VLLM_", "TORCH_", "PYTORCH_", "TRITON_", "DG_", "FLASHINFER_")


def settings_set(env) -> list[str]:
    """NAME=VALUE for each behaviour-changing variable set, sorted; paths (CUDA_HOME) included."""
    return sorted(f"{k}={v}" for k, v in env.items() if k.startswith(SETTING_PREFIXES))
