"""Serving equivalence: stock vLLM twice and the overlay once, same seed, same requests.

Starts the three servers side by side on one GPU, with vLLM's default flags (CUDA graphs on;
--enforce-eager only when asked for), each with its own HOME (no
compile cache shared) and a fixed KV-cache size (vLLM's memory profiling would
count the other servers' allocations as its own), sends each the same greedy
requests (short prompts and prompts over 2048 tokens, one by one and then
several at once) and compares the generated token ids, texts and logprobs. Stock against stock
first: only if that repeats exactly does a stock/overlay difference mean something. Also
reports, per server, the kernels vLLM's JIT monitor saw compiled during inference (Triton's by
name, another runtime's as "Runtime:name"), and per comparison how often the top-5 token sets
agree (information: random weights can make greedy output degenerate, one token repeated, and
the top-5 still compare the logits).

Stdlib only (runs under any Python that can start vLLM). Usage:
    python -m dsa_image.validation.serving --model DIR --stock-site S \
        --overlay-site O --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from dsa_image.harness.server import (MAX_TOKENS, PREFILL_CHUNK_KERNELS, PROMPT_LENGTHS, compare,
                                      jit_kernels_during_inference, output_findings, prompts, run_requests,
                                      same_outputs, start_server, stop, wait_all_healthy)
from dsa_image.core import status


def verdict(report: dict) -> bool:
    """Stock repeats itself and the overlay matches it (tokens and texts), every server generated
    tokens (empty text alone is recorded, not failed: see answered()), and the overlay did not
    JIT-compile the prefill chunk metadata kernel during inference."""
    return bool(
        "error" not in report
        and same_outputs(report.get("stock_vs_stock", {}))
        and same_outputs(report.get("stock_vs_overlay", {}))
        and not report.get("unanswered")
        and not set(PREFILL_CHUNK_KERNELS).intersection(
            report.get("jit_during_inference", {}).get("overlay", ()))
    )


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
        report.update(output_findings(results))
    except Exception as e:  # noqa: BLE001 - reported, then servers are stopped
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        for s in servers:
            stop(s)
    report["jit_during_inference"] = {s["name"]: jit_kernels_during_inference(s["log"])
                                      for s in servers}
    report["ok"] = verdict(report)
    with open(os.path.join(args.out, "serving-equivalence.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "sample_tokens"}, indent=1))
    print("SERVING EQUIVALENCE:", "PASS" if report["ok"] else "FAIL")
    return status.SUCCESS if report["ok"] else status.FAILED


if __name__ == "__main__":
    sys.exit(main())
