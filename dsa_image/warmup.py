"""Healthy only when warm: vLLM as a child, warmed up, then a readiness marker for the HEALTHCHECK.

The supervisor runs `vllm serve` as a child, sends it the requests whose kernels would otherwise
compile during the first users' requests, then writes a readiness marker that the image's
HEALTHCHECK requires.

vLLM answers /health as soon as it listens, but on the H200 the first 3,000-token request after
that still took 3.8 s (overlay) / 4.9 s (stock) against 0.07 s warm: Triton compiled
`_compute_slot_mapping_kernel` and `fused_moe_kernel` for shapes the start-up never ran. The
warm-up runs those shapes: prefills above the indexer's top-k (2,048), one of them long where
max_model_len allows, decode batches at the concurrencies served, greedy and sampled, and a
mixed prefill+decode batch. With MTP configured every decode step is speculative, so the same
requests warm the draft path; the report records the drafts vLLM counted meanwhile (its
spec-decode counters on /metrics, present only when speculative decoding is configured), and
the log warns when there were none. A request answered HTTP 503 (vLLM 0.33.0: busy, try again)
is sent again within the budget.

    python -m dsa_image.warmup supervise [--marker PATH] -- vllm serve MODEL [FLAGS...]
    python -m dsa_image.warmup run --url http://127.0.0.1:8000      # warm a running server
    python -m dsa_image.warmup check --pid PID                      # the marker check alone

The marker names the server process (pid, start time, boot id), so a marker left by an earlier
server (a restarted container, a shared /dev/shm under --ipc=host) never counts. The server gets
its path in DSA_IMAGE_WARM_MARKER; a health check finds it there, in /proc/PID/environ, so a
server started without the supervisor is judged by /health alone.

A warm-up that fails (a wrong answer, out of time, /health never answering) leaves a marker
saying so: the health check then reports that reason, and the server keeps running, unhealthy,
for its log and a look inside (docker logs shows the step that failed).

Environment: DSA_IMAGE_WARMUP=0 skips the requests (the marker follows /health; the image's
entrypoint then runs vLLM without the supervisor); DSA_IMAGE_WARMUP_PREFILL (default
2049,2050,2052,2056,4096), DSA_IMAGE_WARMUP_CONCURRENCY (default 1,8,32),
DSA_IMAGE_WARMUP_TIMEOUT_S (default 1800, the requests' budget). A value these cannot read
stops the start, naming the variable. Stdlib only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .atomic import read_regular, write_atomic
from .healthcheck import UnixHTTPConnection
from .spec_decode_metrics import parse_spec_counters, settle

MARKER_ENV = "DSA_IMAGE_WARM_MARKER"
SWITCH_ENV = "DSA_IMAGE_WARMUP"
PROC = Path("/proc")
# Ids every tokenizer of a real model has as ordinary tokens (the tiny GLM-5's specials are
# 0..7); a token-id prompt needs no tokenizer round trip and has an exact length.
PROMPT_IDS = range(100, 1000)
# Prefills past the indexer's top-k (2,048), which it scores. Triton compiles a kernel once per
# pattern of its integer arguments being divisible by 16 (or equal to 1), and a token count
# reaches kernels multiplied by 1, 2, 4 or 8 (MoE top-k): its power of two decides. These five
# have 2^0 .. 2^3 and >= 2^4 in them, so any prompt length falls in a pattern already compiled.
DEFAULT_PREFILL = (2049, 2050, 2052, 2056, 4096)
DEFAULT_CONCURRENCY = (1, 8, 32)
LONG_PREFILL_FROM = 16384  # max_model_len from which one long prefill (several chunks) is sent
LONG_PREFILL_MAX = 32768
DECODE_TOKENS = 16
SAMPLED = {"temperature": 0.7, "top_p": 0.9, "top_k": 40}
# HTTP 503 is vLLM 0.33.0's "busy, send it again": its admission control (--max-num-queued-reqs,
# --max-num-queued-tokens: QueueOverflowError / MaxQueuedTokensError, vllm/exceptions.py and
# vllm/config/scheduler.py) and RetryableRequestError answer so; vLLM 0.24.0 has none of them. A
# decode step sends up to 32 requests at once, so under such a cap the warm-up waits and sends
# again, within its budget, instead of marking a working server unhealthy for good.
RETRY_STATUS = 503
RETRY_PAUSE_S = 1.0
# Reading vLLM's spec-decode counters again until two reads agree: the API server records a
# step's statistics after it has sent that step's tokens (spec_decode_metrics.settle).
SPEC_SETTLE_READS = 6
SPEC_SETTLE_PAUSE_S = 0.5


class WarmupError(Exception):
    """The server did not answer a warm-up request as it should."""


# -- where the server listens -------------------------------------------------------------------


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # http(s)://host:port; for --uds, http+unix://PATH (shown only)
    api_key: str | None = None
    uds: str | None = None  # vLLM's --uds: a Unix socket instead of host and port


def _flag(args: list[str], name: str) -> str | None:
    """The value of --name (the last one wins, as in argparse); vLLM takes _ for -."""
    value = None
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        if flag.startswith("--") and flag.replace("_", "-") == name:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def serve_endpoint(argv: list[str], environ: dict[str, str]) -> Endpoint:
    """Where `vllm serve ARGV` listens, from its flags (defaults: vLLM's own, port 8000)."""
    api_key = _flag(argv, "--api-key") or environ.get("VLLM_API_KEY")
    uds = _flag(argv, "--uds")
    if uds:
        return Endpoint(f"http+unix://{uds}", api_key, uds)
    host = _flag(argv, "--host") or "127.0.0.1"
    # A wildcard address listens on loopback too.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    host = f"[{host}]" if ":" in host else host
    scheme = "https" if _flag(argv, "--ssl-certfile") else "http"
    return Endpoint(f"{scheme}://{host}:{_flag(argv, '--port') or '8000'}", api_key)


# -- HTTP ---------------------------------------------------------------------------------------


def _connection(endpoint: Endpoint, timeout: float) -> http.client.HTTPConnection:
    if endpoint.uds:
        return UnixHTTPConnection(endpoint.uds, timeout)
    url = urllib.parse.urlsplit(endpoint.base_url)
    if url.scheme == "https":
        # Our own server on loopback: its certificate names a public host, not 127.0.0.1.
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        return http.client.HTTPSConnection(url.hostname, url.port, timeout=timeout, context=context)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)


def _request(endpoint: Endpoint, path: str, payload=None, timeout: float = 600.0) -> tuple[int, bytes]:
    """(status, body); raises OSError / HTTPException when nothing answers."""
    headers = {"Content-Type": "application/json"}
    if endpoint.api_key:
        headers["Authorization"] = f"Bearer {endpoint.api_key}"
    connection = _connection(endpoint, timeout)
    try:
        body = None if payload is None else json.dumps(payload).encode()
        connection.request("GET" if body is None else "POST", path, body, headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def is_healthy(endpoint: Endpoint) -> bool:
    try:
        return _request(endpoint, "/health", timeout=5)[0] == 200
    except (OSError, http.client.HTTPException):
        return False


def wait_healthy(endpoint: Endpoint, alive: Callable[[], bool], deadline: float, poll_s: float = 1.0) -> bool:
    """True once /health answers 200; False when the server died or the deadline passed."""
    while alive() and time.monotonic() < deadline:
        if is_healthy(endpoint):
            return True
        time.sleep(poll_s)
    return False


def served_model(endpoint: Endpoint) -> tuple[str, int | None]:
    """The first served model's name and max_model_len (vLLM's /v1/models carries both)."""
    try:
        status, body = _request(endpoint, "/v1/models", timeout=30)
    except (OSError, http.client.HTTPException) as exc:
        raise WarmupError(f"GET /v1/models: {exc}") from None
    if status != 200:
        raise WarmupError(f"GET /v1/models: HTTP {status}: {body[:300]!r}")
    model = json.loads(body)["data"][0]
    return model["id"], model.get("max_model_len")


# -- what to send -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    prompt_len: int
    max_tokens: int
    sampling: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    """Requests sent at once: the batch the server sees while they run."""

    name: str
    requests: tuple[Request, ...]


def decode_batch(concurrency: int, sampled: bool) -> tuple[Request, ...]:
    # One more token each: the requests end one step apart, so the batch passes through every
    # size from `concurrency` down to 1, as a server's running batch does.
    return tuple(Request(61 + i, DECODE_TOKENS + i, SAMPLED if sampled and i % 2 == 0 else {})
                 for i in range(concurrency))


def plan_steps(max_model_len: int | None, prefill: tuple[int, ...] = DEFAULT_PREFILL,
               concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY) -> list[Step]:
    """The warm-up requests for a server of this max_model_len (None: unknown, taken as 8192)."""
    limit = (max_model_len or 8192) - DECODE_TOKENS - max(concurrency, default=1)
    steps = [Step(f"prefill-{n}", (Request(n, 4),)) for n in prefill if n <= limit]
    if (max_model_len or 0) >= LONG_PREFILL_FROM:
        n = min(LONG_PREFILL_MAX, max_model_len // 2)
        steps.append(Step(f"long-prefill-{n}", (Request(n, 4),)))
    steps.append(Step("decode-c1-sampled", decode_batch(1, sampled=True)))
    steps += [Step(f"decode-c{c}", decode_batch(c, sampled=c > 1)) for c in concurrency]
    mixed_prefill = min((n for n in prefill if n <= limit), default=None)
    if mixed_prefill:
        steps.append(Step(f"mixed-prefill-{mixed_prefill}+decode-c7",
                          (Request(mixed_prefill, DECODE_TOKENS), *decode_batch(7, sampled=True))))
    return steps


def prompt_ids(length: int, key: str) -> list[int]:
    # A new prompt per request: a prefix-cache hit would skip the prefill it is meant to run.
    rng = random.Random(f"dsa-image-warmup:{key}")
    return [rng.choice(PROMPT_IDS) for _ in range(length)]


def send(endpoint: Endpoint, model: str, request: Request, key: str, timeout: float) -> int:
    """One completion; the number of tokens it produced (ignore_eos: max_tokens unless broken).
    An HTTP 503 (busy: see RETRY_STATUS) is sent again until `timeout` has passed."""
    retry_pause_s = RETRY_PAUSE_S
    payload = {"model": model, "prompt": prompt_ids(request.prompt_len, key), "max_tokens": request.max_tokens,
               "ignore_eos": True, "temperature": 0.0, **request.sampling}
    if request.sampling:
        payload["logprobs"] = 1  # the logprobs path, on the sampled requests
    deadline = time.monotonic() + timeout
    busy = 0
    while True:
        left = deadline - time.monotonic()
        try:
            status, body = _request(endpoint, "/v1/completions", payload, max(left, 0.001))
        except TimeoutError:  # the timeout is what was left of the warm-up's budget
            raise WarmupError(f"out of time ({timeout:.0f} s left)") from None
        except (OSError, http.client.HTTPException) as exc:
            raise WarmupError(f"no answer: {exc}") from None
        if status != RETRY_STATUS:
            break
        busy += 1
        if deadline - time.monotonic() <= retry_pause_s:
            raise WarmupError(f"HTTP {status} (busy) {busy} time(s) until out of time ({timeout:.0f} s): "
                              f"{body[:300]!r}")
        time.sleep(retry_pause_s)
    if status != 200:
        raise WarmupError(f"HTTP {status}: {body[:300]!r}")
    produced = json.loads(body).get("usage", {}).get("completion_tokens")
    if produced != request.max_tokens:
        raise WarmupError(f"{produced} tokens for max_tokens={request.max_tokens} (ignore_eos)")
    return produced


def run_step(endpoint: Endpoint, model: str, step: Step, timeout: float) -> float:
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(len(step.requests)) as pool:
        futures = [pool.submit(send, endpoint, model, r, f"{step.name}:{i}", timeout)
                   for i, r in enumerate(step.requests)]
        for future in futures:
            future.result()
    return time.monotonic() - start


# -- the warm-up --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    enabled: bool = True
    prefill: tuple[int, ...] = DEFAULT_PREFILL
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    timeout_s: float = 1800.0

    @classmethod
    def from_env(cls, environ: dict[str, str]) -> "Settings":
        """Raises ValueError naming the variable whose value it cannot read."""
        return cls(enabled=_switch(environ, SWITCH_ENV),
                   prefill=_numbers(environ, "DSA_IMAGE_WARMUP_PREFILL", DEFAULT_PREFILL),
                   concurrency=_numbers(environ, "DSA_IMAGE_WARMUP_CONCURRENCY", DEFAULT_CONCURRENCY),
                   timeout_s=_seconds(environ, "DSA_IMAGE_WARMUP_TIMEOUT_S", 1800.0))


# A typo must not quietly serve cold (or warm up forever): each reader refuses what it cannot read.
def _switch(environ: dict[str, str], name: str) -> bool:
    raw = environ.get(name, "").strip()
    if raw.lower() not in ("", "0", "1", "true", "false"):
        raise ValueError(f"{name}={raw!r}: expected 1 or true (warm up before healthy, the default), "
                         "0 or false (healthy on /health alone)")
    return raw.lower() not in ("0", "false")


def _numbers(environ: dict[str, str], name: str, default: tuple[int, ...]) -> tuple[int, ...]:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        values = tuple(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{name}={raw!r}: expected positive whole numbers separated by commas, "
                         f"e.g. {','.join(map(str, default))} (the default)")
    return values


def _seconds(environ: dict[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: expected a number of seconds above 0, e.g. {default:.0f} (the default)")
    return value


# -- speculative decoding (MTP): did the warm-up run the draft path? -----------------------------


def spec_counters(endpoint: Endpoint) -> dict | None:
    """vLLM's spec-decode counters from /metrics (summed over engines), or None where it has none.
    vLLM registers them only when speculative decoding is configured (SpecDecodingProm,
    vllm/v1/spec_decode/metrics.py, the same names in 0.24.0 and 0.33.0), so their presence is
    how the warm-up tells an MTP server without parsing vLLM's flags (a --config file, an
    entrypoint of its own). /metrics is outside --api-key's guarded /v1 paths."""
    try:  # a record only: nothing here may fail the warm-up
        status, body = _request(endpoint, "/metrics", timeout=30)
        return parse_spec_counters(body.decode(errors="replace")) if status == 200 else None
    except (OSError, http.client.HTTPException, ValueError):
        return None


def settled_spec_counters(endpoint: Endpoint, reads: int = SPEC_SETTLE_READS,
                          pause_s: float = SPEC_SETTLE_PAUSE_S) -> dict | None:
    return settle(lambda: spec_counters(endpoint), pause_s, reads)


def spec_decode_report(before: dict | None, after: dict | None) -> dict | None:
    """What the warm-up's requests drafted and accepted; None for a server without speculative
    decoding (no counters on /metrics, or /metrics not answering)."""
    if before is None or after is None:
        return None
    return {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted_tokens")}


def _log_spec_decode(spec: dict | None, log: Callable[[str], None]) -> None:
    if spec is None:
        return
    if spec["drafts"] > 0:
        log(f"dsa-image warmup: speculative decoding (MTP) ran in the warm-up: {spec['drafts']:.0f} drafts, "
            f"{spec['draft_tokens']:.0f} draft tokens, {spec['accepted_tokens']:.0f} accepted")
    else:  # recorded, not a failure: the server serves, its draft path just did not run here
        log("dsa-image warmup: WARNING: speculative decoding is configured (its counters are on /metrics) "
            "but the warm-up's requests made no drafts: the draft path was not warmed")


def warm(endpoint: Endpoint, settings: Settings = Settings(), log: Callable[[str], None] = print) -> dict:
    """Send every step's requests to a healthy server; raises WarmupError on a bad answer."""
    model, max_model_len = served_model(endpoint)
    steps = plan_steps(max_model_len, settings.prefill, settings.concurrency)
    deadline = time.monotonic() + settings.timeout_s
    report = {"model": model, "max_model_len": max_model_len, "steps": {}}
    spec_before = spec_counters(endpoint)
    start = time.monotonic()
    for step in steps:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WarmupError(f"out of time ({settings.timeout_s:.0f} s) before step {step.name}")
        try:
            seconds = run_step(endpoint, model, step, remaining)
        except WarmupError as exc:
            raise WarmupError(f"step {step.name}: {exc}") from None
        report["steps"][step.name] = round(seconds, 3)
        log(f"dsa-image warmup: {step.name}: {len(step.requests)} request(s) in {seconds:.2f} s")
    report["spec_decode"] = spec_decode_report(
        spec_before, settled_spec_counters(endpoint) if spec_before is not None else None)
    _log_spec_decode(report["spec_decode"], log)
    report["seconds"] = round(time.monotonic() - start, 3)
    return report


# -- the readiness marker -----------------------------------------------------------------------


def default_marker_path() -> Path:
    # /dev/shm is writable under --read-only and empty in a new container; the host name (the
    # container id) keeps containers apart when --ipc=host shares it.
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    return base / f"dsa-image-warm-{socket.gethostname()}.json"


def process_identity(pid: int, proc: Path = PROC) -> dict:
    """pid, start time (clock ticks since boot) and boot id: unique for a process on a host."""
    stat = (proc / str(pid) / "stat").read_text()
    # Field 22 is the start time; the command name (field 2) may hold spaces, hence after ")".
    starttime = int(stat.rsplit(")", 1)[1].split()[19])
    boot_id_file = proc / "sys" / "kernel" / "random" / "boot_id"
    boot_id = boot_id_file.read_text().strip() if boot_id_file.is_file() else ""
    return {"pid": pid, "starttime": starttime, "boot_id": boot_id}


def write_marker(path: Path, server_pid: int, report: dict, proc: Path = PROC, failed: str | None = None) -> None:
    """Mark server `server_pid` warm, or, with `failed`, record why its warm-up failed (the
    health check shows that reason instead of "warming up")."""
    doc = {**process_identity(server_pid, proc), "host": socket.gethostname(),
           "warmed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "warmup": report}
    if failed:
        doc["failed"] = failed
    write_atomic(path, (json.dumps(doc, indent=1) + "\n").encode())  # never half a marker


def clear_marker(path: Path) -> None:
    try:
        Path(path).unlink()
    except FileNotFoundError:
        pass


def marker_problem(path: Path, server_pid: int, proc: Path = PROC) -> str | None:
    """None when `path` marks the running server `server_pid` as warm, else why not."""
    try:
        # read_regular: a FIFO put there (a shared /dev/shm) cannot make the health check hang.
        doc = json.loads(read_regular(path))
    except FileNotFoundError:
        return (f"warming up: no readiness marker {path} yet (the container log shows the warm-up's steps; "
                f"{SWITCH_ENV}=0 serves without it)")
    except (OSError, ValueError) as exc:
        return f"readiness marker {path} unreadable: {exc}"
    try:
        current = process_identity(server_pid, proc)
    except (OSError, ValueError, IndexError) as exc:
        return f"server pid {server_pid}: {exc}"
    stale = [k for k in ("pid", "starttime", "boot_id") if doc.get(k) != current[k]]
    if stale:
        return f"readiness marker {path} is another server's ({', '.join(stale)} differ)"
    if doc.get("failed"):
        return (f"the warm-up FAILED: {doc['failed']}; the server stays unhealthy (docker logs shows the "
                f"failing step; fix it and restart, or set {SWITCH_ENV}=0 to serve without the warm-up)")
    return None


def required_marker(server_pid: int, proc: Path = PROC) -> Path | None:
    """The marker the supervisor told the server about, or None when it was not supervised."""
    raw = (proc / str(server_pid) / "environ").read_bytes()
    for entry in raw.split(b"\0"):
        name, _, value = entry.partition(b"=")
        if name.decode(errors="replace") == MARKER_ENV and value:
            return Path(value.decode())
    return None


def warm_problem(server_pid: int, proc: Path = PROC) -> str | None:
    """For a health check: None when the server needs no warm-up or is warm, else why not."""
    try:
        marker = required_marker(server_pid, proc)
    except OSError as exc:
        return f"cannot read the server's environment (pid {server_pid}): {exc}"
    return None if marker is None else marker_problem(marker, server_pid, proc)


# -- the supervisor -----------------------------------------------------------------------------

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _default_dispositions() -> None:
    """In the child before exec: the forwarded signals at their defaults. An ignored signal stays
    ignored across exec, and a supervisor started by a non-interactive shell in the background
    inherits SIGINT ignored: the server would then ignore the SIGINT forwarded to it."""
    for s in FORWARDED_SIGNALS:
        signal.signal(s, signal.SIG_DFL)


def forward_signals(child: subprocess.Popen, exited: threading.Event) -> Callable[[], None]:
    """Pass each signal on to the child (as if vLLM were PID 1); returns the undo."""

    def handler(signum, _frame):
        if not exited.is_set():
            try:
                os.kill(child.pid, signum)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, handler) for s in FORWARDED_SIGNALS}
    return lambda: [signal.signal(s, h) for s, h in previous.items()]


def wait_for(child: subprocess.Popen) -> int:
    """The child's exit status as a shell reports it (128 + N for signal N). As PID 1, also
    reaps the orphans re-parented here (vLLM's engine processes if the API server dies first)."""
    if os.getpid() != 1:
        child.wait()
    else:
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == child.pid:
                child.returncode = os.waitstatus_to_exitcode(status)
                break
    return 128 - child.returncode if child.returncode < 0 else child.returncode


def warm_and_mark(child: subprocess.Popen, exited: threading.Event, endpoint: Endpoint, marker: Path,
                  settings: Settings, health_timeout_s: float) -> bool:
    """Wait for /health, warm up, then write the marker; on failure a marker saying why (unhealthy)."""
    if not wait_healthy(endpoint, lambda: not exited.is_set(), time.monotonic() + health_timeout_s):
        if not exited.is_set():
            _fail(child, marker, f"{endpoint.base_url}/health did not answer in {health_timeout_s:.0f} s")
        return False
    _log(f"dsa-image warmup: {endpoint.base_url}/health answers; warming up before reporting healthy"
         if settings.enabled else f"dsa-image warmup: {SWITCH_ENV}=0, no warm-up requests")
    try:
        report = warm(endpoint, settings, _log) if settings.enabled else {"skipped": f"{SWITCH_ENV}=0"}
        write_marker(marker, child.pid, report)
    except (WarmupError, OSError, ValueError, KeyError) as exc:
        if not exited.is_set():
            _fail(child, marker, str(exc))
        return False
    _log(f"dsa-image warmup: done in {report.get('seconds', 0):.1f} s; healthy from now ({marker})")
    return True


def _fail(child: subprocess.Popen, marker: Path, why: str) -> None:
    _log(f"dsa-image warmup: FAILED: {why}; the container stays unhealthy and vLLM keeps running "
         f"(restart it once fixed, or set {SWITCH_ENV}=0 to serve without the warm-up)")
    try:
        write_marker(marker, child.pid, {}, failed=why)
    except (OSError, ValueError, IndexError) as exc:  # no marker is unhealthy too, only less telling
        _log(f"dsa-image warmup: could not record the failure in {marker}: {exc}")


def supervise(argv: list[str], environ: dict[str, str], marker: Path | None = None,
              health_timeout_s: float = 7200.0) -> int:
    """Run `argv` (vllm serve ...) as a child, warm it, mark it ready; exit with its status."""
    marker = Path(marker or default_marker_path())
    clear_marker(marker)
    settings = Settings.from_env(environ)
    try:
        # Its own process group: a terminal's Ctrl-C reaches it once, through the forwarding.
        child = subprocess.Popen(argv, env={**environ, MARKER_ENV: str(marker)}, process_group=0,
                                 preexec_fn=_default_dispositions)
    except OSError as exc:
        _log(f"dsa-image: cannot start {argv[0]}: {exc}")
        return 127
    exited = threading.Event()
    undo = forward_signals(child, exited)
    threading.Thread(target=warm_and_mark, daemon=True,
                     args=(child, exited, serve_endpoint(argv, environ), marker, settings, health_timeout_s)).start()
    try:
        return wait_for(child)
    finally:
        exited.set()
        undo()
        clear_marker(marker)


# -- command line -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsa_image.warmup", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sup = commands.add_parser("supervise", help="run SERVER_ARGV as a child, warm it, write the marker")
    sup.add_argument("--marker", type=Path, help="default: /dev/shm/dsa-image-warm-<hostname>.json")
    sup.add_argument("server_argv", nargs=argparse.REMAINDER, help="-- vllm serve MODEL [FLAGS...]")
    run = commands.add_parser("run", help="warm a server that is already running")
    run.add_argument("--url", default="http://127.0.0.1:8000")
    run.add_argument("--api-key")
    check = commands.add_parser("check", help="exit 0 when server PID is warm (or needs no warm-up)")
    check.add_argument("--pid", type=int, required=True)
    args = parser.parse_args(argv)
    if args.command != "check":
        try:
            settings = Settings.from_env(dict(os.environ))
        except ValueError as exc:
            parser.error(str(exc))
    if args.command == "supervise":
        server_argv = args.server_argv[1:] if args.server_argv[:1] == ["--"] else args.server_argv
        if not server_argv:
            parser.error("supervise needs the server's command after --")
        return supervise(server_argv, dict(os.environ), args.marker)
    if args.command == "run":
        report = warm(Endpoint(args.url.rstrip("/"), args.api_key), settings)
        print(json.dumps(report, indent=1))
        return 0
    problem = warm_problem(args.pid)
    print(f"not ready: {problem}" if problem else "ready")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
