"""The memory plan against what vLLM reported for a model it served: KV bytes per token, weights.

For each server log: the plan (dsa_image/serving/memory_plan.py) of the model's config.json (--model),
served as the log says it was (the vLLM release, --kv-cache-dtype, the attention backend, MTP,
--kv-cache-memory-bytes and the KV block size; one GPU), set against vLLM's own lines:

  KV cache  "KV cache size: N tokens": the whole blocks that --kv-cache-memory-bytes holds. The
            plan's bytes per token give the same blocks, to within one.
  weights   "Model loading took X GiB": the memory that loading the model (and its MTP drafter)
            took, weights and the buffers the model reserved meanwhile. The sparse-MLA backends'
            workspaces among them (GiBs with an fp8 KV cache: flashmla_sparse.py reserves its
            prefill workspaces at start) are logged when the server runs with
            VLLM_DEBUG_WORKSPACE=1 ("[WORKSPACE DEBUG] Resized workspace ...") and taken off. What
            is left must hold the plan's bf16 weights (X is rounded to 0.01 GiB) and at most
            WEIGHTS_SLACK_GIB more: the buffers no line names (the indexer's top-k indices,
            rotary caches). A missed part of a layer is more: a real-width GLM-5 layer's
            attention is 0.33 GiB, its dense MLP 0.42 GiB.

Measured on the tiny GLM-5 (tests/data/): KV tokens exact on vLLM 0.24.0 and 0.33.0, with and
without MTP and fp8_ds_mla; weights 0.09-0.37 GiB over the plan without an fp8 cache, which
reserves 1.7 GiB more that only the workspace lines explain.

Stdlib only (and the repository). Usage:
    python -m dsa_image.validation.memory_check --model DIR LOG... [--json FILE]

Exit codes: --help (EXIT_CODES, rendered by dsa_image/core/status.py).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from dsa_image.serving import memory_plan
from dsa_image.validation.serving_modes import LOG_FACTS
from dsa_image.core import status

WEIGHTS_SLACK_GIB = 0.5
ROUNDING_GIB = 0.01  # vLLM's format_gib rounds to two decimals
EXIT_CODES = status.epilog(
    (status.SUCCESS, "every log agrees with the plan"),
    (status.FAILED, "a log disagrees"),
    (status.USAGE, "a log lacks a line the check needs, or bad input (usage, an unreadable config.json)"),
    notes=(f"Of several logs, {status.USAGE} before {status.FAILED}.",))
BF16 = memory_plan.SCHEMES["bf16"]  # dummy weights in the model's dtype (the generators write bfloat16)

VERSION = re.compile(r"Initializing a V1 LLM engine \(v(\d+\.\d+\.\d+)")
NON_DEFAULT = re.compile(r"non-default args: (\{.*\})")
ARG = {key: re.compile(rf"'{key}': '?([\w.]+)'?") for key in
       ("max_model_len", "kv_cache_memory_bytes", "kv_cache_dtype", "num_speculative_tokens",
        "tensor_parallel_size", "pipeline_parallel_size")}
BLOCK_SIZE = re.compile(r"Setting kv cache block size to (\d+)")
# 0.24.0 and 0.33.0's V1 runner: "... GiB memory and ..."; 0.24.0's gpu/ runner: "... GiB and ...".
MODEL_LOADING = re.compile(r"Model loading took ([0-9.]+) GiB")
# 0.24.0: "GPU KV cache size: N tokens"; 0.33.0: "GPU KV cache size: N tokens, Maximum concurrency ...".
KV_TOKENS = re.compile(r"KV cache size: ([0-9,]+) tokens")
WORKSPACE = re.compile(r"\[WORKSPACE DEBUG\] Resized workspace from '[^']*': [0-9.]+ MB -> ([0-9.]+) MB "
                       r"\(ubatch (\d+)(?:, lane (\d+))?\)")
MB = 2**20  # vLLM's workspace.py _MB


class MemoryCheckError(status.DsaImageError):
    """A log lacks what the check needs, or the model or serving is not what it covers."""

    exit_code = status.USAGE


@dataclass(frozen=True)
class Served:
    """How the server was started and what it reported, from its log."""

    vllm: str
    max_model_len: int
    kv_cache_memory_bytes: int
    kv_cache_dtype: str
    spec_tokens: int
    backend: str
    block_size: int
    kv_tokens: int
    model_loading_gib: float
    workspace_bytes: int  # the workspaces reserved while loading (0 without VLLM_DEBUG_WORKSPACE)
    workspace_logged: bool


def _one(pattern: re.Pattern, text: str, what: str) -> re.Match:
    match = pattern.search(text)
    if not match:
        raise MemoryCheckError(f"no {what} line (expected /{pattern.pattern}/)")
    return match


def _arg(args: str, key: str, default: str | None = None) -> str:
    match = ARG[key].search(args)
    if match:
        return match.group(1)
    if default is None:
        raise MemoryCheckError(f"the non-default args name no {key}: this check needs the server started with it")
    return default


def workspace_bytes(text: str) -> tuple[int, bool]:
    """The workspaces' sizes when loading ended: each (ubatch, lane)'s last resize before it."""
    last: dict[tuple[str, str | None], float] = {}
    for match in WORKSPACE.finditer(text):
        last[(match.group(2), match.group(3))] = float(match.group(1))
    return round(sum(last.values()) * MB), bool(last)


def served(text: str) -> Served:
    args = _one(NON_DEFAULT, text, "non-default args").group(1)
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if int(_arg(args, key, "1")) != 1:
            raise MemoryCheckError(f"{key} {_arg(args, key)}: this check plans one GPU holding every layer")
    backends = sorted(set(LOG_FACTS["attention_backend"].findall(text)))
    if len(backends) != 1:
        raise MemoryCheckError(f"expected one attention backend in the log, found {backends or 'none'}")
    loading = _one(MODEL_LOADING, text, "model loading")
    workspace, logged = workspace_bytes(text[:loading.start()])
    return Served(
        vllm=_one(VERSION, text, "engine version").group(1),
        max_model_len=int(_arg(args, "max_model_len")),
        kv_cache_memory_bytes=int(_arg(args, "kv_cache_memory_bytes")),
        kv_cache_dtype=_arg(args, "kv_cache_dtype", "auto"),
        spec_tokens=int(_arg(args, "num_speculative_tokens", "0")),
        backend=backends[0],
        block_size=int(_one(BLOCK_SIZE, text, "KV block size").group(1)),
        kv_tokens=int(_one(KV_TOKENS, text, "KV cache size").group(1).replace(",", "")),
        model_loading_gib=float(loading.group(1)),
        workspace_bytes=workspace,
        workspace_logged=logged,
    )


def kv_check(cfg: dict, s: Served) -> dict:
    kv = memory_plan.kv_per_token(cfg, s.backend, s.kv_cache_dtype, range(cfg["num_hidden_layers"]),
                                  s.spec_tokens > 0, last_stage=True, vllm=s.vllm)
    block_bytes = kv.total * s.block_size
    tokens = s.kv_cache_memory_bytes // block_bytes * s.block_size
    return {"plan_bytes_per_token": kv.total, "plan_layout": asdict(kv), "plan_tokens": tokens,
            "vllm_tokens": s.kv_tokens, "vllm_bytes_per_token": round(s.kv_cache_memory_bytes / s.kv_tokens, 1),
            "ok": abs(tokens - s.kv_tokens) < s.block_size}


def weights_check(cfg: dict, s: Served) -> dict:
    plan = memory_plan.checkpoint_bytes(cfg, BF16, with_mtp=s.spec_tokens > 0) / memory_plan.GIB
    weights = s.model_loading_gib - s.workspace_bytes / memory_plan.GIB
    over = weights - plan
    return {"plan_gib": round(plan, 3), "vllm_loading_gib": s.model_loading_gib,
            "vllm_workspace_gib": round(s.workspace_bytes / memory_plan.GIB, 3),
            "workspace_logged": s.workspace_logged, "vllm_weights_gib": round(weights, 3),
            "over_plan_gib": round(over, 3), "ok": -ROUNDING_GIB <= over <= WEIGHTS_SLACK_GIB}


def check(cfg: dict, text: str) -> dict:
    """Plan against log: the KV and weights comparisons and their verdict. Raises MemoryCheckError."""
    s = served(text)
    report = {"served": asdict(s), "kv": kv_check(cfg, s), "weights": weights_check(cfg, s)}
    report["ok"] = report["kv"]["ok"] and report["weights"]["ok"]
    return report


def summary(name: str, report: dict) -> str:
    kv, w = report["kv"], report["weights"]
    line = (f"{name}: KV {kv['vllm_tokens']:,} tokens, plan {kv['plan_tokens']:,} "
            f"({kv['plan_bytes_per_token']} B/token) {'ok' if kv['ok'] else 'MISMATCH'}; weights "
            f"{w['vllm_weights_gib']:.2f} GiB (loading {w['vllm_loading_gib']} less workspaces "
            f"{w['vllm_workspace_gib']:.2f}), plan {w['plan_gib']:.2f} GiB {'ok' if w['ok'] else 'MISMATCH'}")
    if not w["ok"] and not w["workspace_logged"]:
        line += " (no workspace lines: start the server with VLLM_DEBUG_WORKSPACE=1)"
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path, help="the model directory the servers served")
    parser.add_argument("--json", type=Path, help="write every log's report here")
    parser.add_argument("logs", nargs="+", type=Path, help="vLLM server logs")
    args = parser.parse_args(argv)
    try:
        cfg = json.loads((args.model / "config.json").read_text())
    except (OSError, ValueError) as exc:
        print(f"memory check: {args.model}/config.json: {exc}", file=sys.stderr)
        return status.USAGE
    reports, code = {}, status.SUCCESS
    for log in args.logs:
        try:
            reports[log.name] = check(cfg, log.read_text(errors="replace"))
        except (OSError, MemoryCheckError, ValueError) as exc:
            print(f"memory check: {log}: {exc}", file=sys.stderr)
            reports[log.name], code = {"error": str(exc), "ok": False}, status.USAGE
            continue
        print(summary(log.name, reports[log.name]))
        code = code or (status.SUCCESS if reports[log.name]["ok"] else status.FAILED)
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1) + "\n")
    print("MEMORY PLAN:", "PASS" if code == status.SUCCESS else "FAIL")
    return code


if __name__ == "__main__":
    sys.exit(main())
