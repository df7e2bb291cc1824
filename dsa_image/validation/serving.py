"""Serving equivalence: stock vLLM twice and the overlay once, same seed, same requests.

Starts the three servers side by side on one GPU, with vLLM's default flags (CUDA graphs on;
--enforce-eager only when asked for), each with its own HOME (no
compile cache shared) and a fixed KV-cache size (vLLM's memory profiling would
count the other servers' allocations as its own), sends each the same greedy
requests (short prompts and prompts over 2048 tokens, one by one and then
several at once) and compares the generated token ids and logprobs. Stock against stock first: only
if that repeats exactly does a stock/overlay difference mean something. Also
reports, per server, the Triton kernels the JIT monitor saw compiled during
inference.

Stdlib only (runs under any Python that can start vLLM). Usage:
    python -m dsa_image.validation.serving --model DIR --stock-site S \
        --overlay-site O --out DIR
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from dsa_image.compile_caches import cache_env

SERVED_NAME = "glm-5"
PROMPT_LENGTHS = (20, 300, 2049, 3000, 5000, 7000)
MAX_TOKENS = 24
JIT_LINE = re.compile(r"JIT compilation during inference: (\w+)")


def prompts(vocab_size: int = 1024, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids 3.. skip the special tokens (bos/eos/pad are 0/1/2).
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def server_env(site: str, home: str, env_extra: dict | None = None) -> dict:
    """The environment a vLLM process of one build runs in: that build's site on PYTHONPATH and
    its own HOME and compile caches (the cluster harness starts Ray nodes with it too: Ray
    workers inherit the environment of `ray start`). Creates HOME."""
    os.makedirs(home, exist_ok=True)
    return {**os.environ, "PYTHONPATH": site, "HOME": home, **cache_env(home), **(env_extra or {})}


def start_server(name, site, model, port, out_dir, extra_args, *, home=None,
                 max_model_len=8192, python=None, env_extra=None):
    # A HOME (its compile caches laid out as the image's: dsa_image/compile_caches.py) each; the
    # benchmark and the warm-start measurement pass their own HOME to keep (or empty) one
    # server's caches across starts.
    home = home or f"/tmp/home-{name}"
    env = server_env(site, home, env_extra)
    cmd = [python or sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model,
           "--port", str(port), "--served-model-name", SERVED_NAME,
           "--load-format", "dummy", "--seed", "0", "--max-model-len", str(max_model_len),
           *extra_args]
    log = open(os.path.join(out_dir, f"server-{name}.log"), "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            cwd=home, start_new_session=True)
    return {"name": name, "port": port, "proc": proc, "log": log.name, "cmd": cmd,
            "started": time.monotonic()}


def is_healthy(server) -> bool:
    if server["proc"].poll() is not None:
        raise RuntimeError(f"{server['name']} exited with {server['proc'].returncode}"
                           f" before becoming healthy; see {server['log']}")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def wait_all_healthy(servers, deadline) -> dict:
    """Seconds from each server's start until its /health first answers.

    All are polled in each round: waiting for one server at a time would record the
    later ones as healthy when the first was, not when they were.
    """
    healthy_after = {}
    while time.monotonic() < deadline:
        for server in servers:
            if server["name"] not in healthy_after and is_healthy(server):
                healthy_after[server["name"]] = round(time.monotonic() - server["started"], 1)
        if len(healthy_after) == len(servers):
            return healthy_after
        time.sleep(1)
    late = [s["name"] for s in servers if s["name"] not in healthy_after]
    raise TimeoutError(f"{', '.join(late)} not healthy in time; see their server-*.log")


def complete(port: int, prompt: list[int]) -> dict:
    body = json.dumps({
        "model": SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
        "temperature": 0.0, "logprobs": 1, "return_token_ids": True,
        "ignore_eos": True,
    }).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        choice = json.load(r)["choices"][0]
    return {"token_ids": choice.get("token_ids"),
            "logprobs": choice["logprobs"]["token_logprobs"],
            "text": choice["text"]}


def run_requests(port: int, batch: list[list[int]]) -> dict:
    sequential = [complete(port, p) for p in batch]
    with concurrent.futures.ThreadPoolExecutor(len(batch)) as pool:
        concurrent_ = list(pool.map(lambda p: complete(port, p), batch))
    return {"sequential": sequential, "concurrent": concurrent_}


def compare(a: dict, b: dict, lengths=PROMPT_LENGTHS) -> dict:
    """Token-for-token and logprob comparison of two servers' results."""
    token_mismatches, max_logprob_diff = [], 0.0
    for mode in ("sequential", "concurrent"):
        for i, (x, y) in enumerate(zip(a[mode], b[mode])):
            if x["token_ids"] != y["token_ids"]:
                token_mismatches.append(f"{mode}[{i}] ({lengths[i]} tokens)")
            diffs = [abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"])
                     if p is not None and q is not None]
            max_logprob_diff = max([max_logprob_diff, *diffs])
    return {"identical_tokens": not token_mismatches, "mismatches": token_mismatches,
            "max_abs_logprob_diff": max_logprob_diff}


def jit_kernels_during_inference(log_path: str) -> list[str]:
    with open(log_path, errors="replace") as f:
        return sorted({m.group(1) for m in JIT_LINE.finditer(f.read())})


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--stock-site", required=True)
    parser.add_argument("--overlay-site", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--server-args",
                        default="--kv-cache-memory-bytes 4294967296",
                        help="extra vllm serve arguments, one string (default: CUDA graphs on, as vLLM serves)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    plan = [("stock_a", args.stock_site, 8101), ("stock_b", args.stock_site, 8102),
            ("overlay", args.overlay_site, 8103)]
    servers = [start_server(n, s, args.model, p, args.out, shlex.split(args.server_args))
               for n, s, p in plan]
    report = {"prompt_lengths": PROMPT_LENGTHS, "max_tokens": MAX_TOKENS,
              "server_cmd": servers[0]["cmd"][1:], "healthy_after_s": {},
              "request_time_s": {}}
    batch = prompts()
    results = {}
    try:
        deadline = time.monotonic() + args.timeout
        report["healthy_after_s"] = wait_all_healthy(servers, deadline)
        for s in servers:
            t0 = time.monotonic()
            results[s["name"]] = run_requests(s["port"], batch)
            report["request_time_s"][s["name"]] = round(time.monotonic() - t0, 2)
        report["stock_vs_stock"] = compare(results["stock_a"], results["stock_b"])
        report["stock_vs_overlay"] = compare(results["stock_a"], results["overlay"])
        report["sample_tokens"] = {n: r["sequential"][3]["token_ids"] for n, r in results.items()}
        report["empty_text"] = [n for n, r in results.items()
                                if any(not c["text"] for m in r.values() for c in m)]
    except Exception as e:  # noqa: BLE001 - reported, then servers are stopped
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        for s in servers:
            stop(s)
    report["jit_during_inference"] = {s["name"]: jit_kernels_during_inference(s["log"])
                                      for s in servers}
    report["ok"] = bool(
        "error" not in report
        and report.get("stock_vs_stock", {}).get("identical_tokens")
        and report.get("stock_vs_overlay", {}).get("identical_tokens")
        and not report.get("empty_text")
        and "_build_prefill_chunk_metadata_kernel"
        not in report["jit_during_inference"].get("overlay", ["missing"])
    )
    with open(os.path.join(args.out, "serving-equivalence.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "sample_tokens"}, indent=1))
    print("SERVING EQUIVALENCE:", "PASS" if report["ok"] else "FAIL")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
