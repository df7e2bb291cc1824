"""Stock vLLM against the overlay, served the way GLM-5 deployments run: MTP, long context, fp8 KV.

MTP speculative decoding, long context and the fp8 KV cache, with CUDA graphs on (default flags).

Each mode starts one stock and one overlay server (all modes' servers at once, side by side on
one GPU, each with the same fixed KV-cache size and its own HOME, as the image's at a first
`docker run`: the model info it ships, no compile cache), sends each server the same
greedy requests, one by one and then as one batch, and compares the token ids, texts and logprobs.
The modes:

    mtp1           MTP, 1 speculative token: next_n=2
    mtp2           MTP, 2 speculative tokens: next_n=3
    mtp3           MTP, 3 speculative tokens: next_n=4
    fp8            the fp8 KV cache (fp8_ds_mla)
    long-bf16      max_model_len 65536, prompts of 20k-65k tokens: wide block tables,
                   several prefill chunks
    long-fp8       the same with the fp8 KV cache
    long-fp8-mtp3  the deployment combination: 65536, fp8 KV cache, MTP with 3 tokens
    long-mtp1      65536 with MTP, 1 token, on the bf16 cache (with long-fp8-mtp3: MTP 1 and 3
                   past 32k on both caches, for a model too large for more than two servers)

Which decode path and attention backend a mode gets on the H200 (sm_90) depends on the base
(H200_PATHS): the indexer decodes next_n rows per request natively where DeepGEMM's paged MQA
logits kernel takes that next_n, else flattens them to one row per query token; 0.24.0 takes
next_n 1 and 2 there (mtp3 flattened), 0.33.0 also 4 (mtp3 native, mtp2 flattened). The bf16
modes run FLASHMLA_SPARSE on 0.24.0 and FLASH_ATTN_MLA_SPARSE on 0.33.0; the fp8 modes run
FLASHMLA_SPARSE on both, the one sm_90 backend that takes fp8_ds_mla.

Also reported per server: the decode path, attention backend, KV-cache dtype and format and
block-table growth vLLM logged (0.33.0 sizes the table up front: no growth to log) and whether
they are what the base gives on the H200 (information, not the verdict), the draft acceptance
counters of /metrics (which must agree: the draft layer runs the indexer too), and the kernels
JIT-compiled during inference.

Stdlib only (and the repository). Usage:
    python -m dsa_image.validation.serving_modes --modes mtp1,mtp3 --model DIR --mtp-model DIR \\
        --stock-site S --overlay-site O --out DIR [--vllm X.Y.Z] [--model-info-root DIR]
    python -m dsa_image.validation.serving_modes --model-info-only --model-info-root DIR ...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypedDict

from dsa_image.build import model_info_cache
from dsa_image.harness.client import Client, HttpError
from dsa_image.core.dist_info import installed_versions
from dsa_image.runtime.spec_decode_metrics import acceptance, counter_delta, settled_spec_counters
from dsa_image.harness import server as serving
from dsa_image.harness.prompts import long_context_model, model_prompt_ids, prompt_token_ids
from dsa_image.harness.server import wait_each_healthy
from dsa_image.validation import vllm_base
from dsa_image.core import status

SHORT_PROMPTS = serving.PROMPT_LENGTHS
# 65400 + 32 output tokens ends 104 tokens short of 65536: the widest block-table row a
# request can reach.
LONG_PROMPTS = (20, 3000, 20000, 33000, 47000, 60000, 65400)
LONG_MAX_MODEL_LEN = 65536
# What FLASHMLA_SPARSE stores for --kv-cache-dtype fp8 on sm_90 (mla_attention.py,
# flashmla_sparse.py), named exactly: "fp8" is an alias there, and on vLLM 0.33.0 also a dtype
# FLASHINFER_MLA_SPARSE_SM90 takes, while fp8_ds_mla only FLASHMLA_SPARSE does.
FP8_KV = "fp8_ds_mla"


@dataclass(frozen=True)
class Mode:
    name: str
    model: str  # "base": the tiny GLM-5; "mtp": the tiny GLM-5 with its MTP layer
    max_model_len: int
    prompt_lengths: tuple[int, ...]
    max_tokens: int
    spec_tokens: int = 0
    kv_cache_dtype: str = "auto"

    def server_args(self) -> list[str]:
        args = ["--kv-cache-dtype", self.kv_cache_dtype]
        if self.spec_tokens:
            args += ["--speculative-config",
                     json.dumps({"method": "mtp", "num_speculative_tokens": self.spec_tokens})]
        return args


# MTP modes decode 64 tokens: enough steps for the draft counters to mean something.
MODES = {m.name: m for m in (
    Mode("mtp1", "mtp", 8192, SHORT_PROMPTS, 64, spec_tokens=1),
    Mode("mtp2", "mtp", 8192, SHORT_PROMPTS, 64, spec_tokens=2),
    Mode("mtp3", "mtp", 8192, SHORT_PROMPTS, 64, spec_tokens=3),
    Mode("fp8", "base", 8192, SHORT_PROMPTS, 24, kv_cache_dtype=FP8_KV),
    Mode("long-bf16", "base", LONG_MAX_MODEL_LEN, LONG_PROMPTS, 32),
    Mode("long-fp8", "base", LONG_MAX_MODEL_LEN, LONG_PROMPTS, 32, kv_cache_dtype=FP8_KV),
    Mode("long-fp8-mtp3", "mtp", LONG_MAX_MODEL_LEN, LONG_PROMPTS, 32, spec_tokens=3, kv_cache_dtype=FP8_KV),
    Mode("long-mtp1", "mtp", LONG_MAX_MODEL_LEN, LONG_PROMPTS, 32, spec_tokens=1),
)}


# -- models and prompts -------------------------------------------------------------------------


def mode_prompts(mode: Mode, token_ids: list[int], batch: str) -> list[list[int]]:
    """The mode's prompts; the batch sent at once gets other ones than the requests sent one by
    one, so that its long prompts are prefilled again instead of found in the prefix cache."""
    return [model_prompt_ids(token_ids, n, f"serving-modes:{mode.name}:{batch}:{i}")
            for i, n in enumerate(mode.prompt_lengths)]


# -- requests -----------------------------------------------------------------------------------


def complete_batch(port: int, prompts: list[list[int]], max_tokens: int, timeout: float = 900) -> list[dict]:
    """One completion request for all `prompts` (they reach the engine together), greedy."""
    payload = {"model": serving.SERVED_NAME, "prompt": prompts, "max_tokens": max_tokens, "temperature": 0.0,
               "logprobs": 1, "return_token_ids": True, "ignore_eos": True}
    try:
        body = Client.local(port, timeout).post("/v1/completions", payload).body
    except HttpError as exc:
        raise RuntimeError(f"port {port}: {exc}") from None
    choices = sorted(body["choices"], key=lambda c: c["index"])
    return [serving.parse_choice(c) for c in choices]


def run_mode_requests(port: int, prompts: dict[str, list[list[int]]], max_tokens: int,
                      timeout: float = 900) -> dict:
    """`timeout`: seconds each request may take (the cluster harness bounds it by its call's deadline)."""
    sequential = [complete_batch(port, [p], max_tokens, timeout)[0] for p in prompts["sequential"]]
    return {"sequential": sequential, "concurrent": complete_batch(port, prompts["concurrent"], max_tokens, timeout)}


# -- what the server logged ---------------------------------------------------------------------

LOG_FACTS = {
    # "use_flattening=True (next_n=4, ...)" on 0.24.0, "use_flattening=False supports_varlen=False
    # (next_n=4, ...)" on 0.33.0.
    "decode_path": re.compile(r"DSA indexer decode path: (.*)"),
    # Logged only where vLLM maps an alias ("fp8") to the format it stores (mla_attention.py).
    "kv_cache_format": re.compile(r"Using (\S+) KV cache format"),
    # Logged for every quantized --kv-cache-dtype, fp8_ds_mla too (config/cache.py).
    "kv_cache_dtype": re.compile(r"Using (\S+) data type to store kv cache"),
    # The overlay of 0.24.0 only: 0.33.0's builder is given the runner's width up front.
    "block_table_growth": re.compile(r"DSA indexer: growing the expanded block table (.*)"),
    # Chosen by vLLM ("Using X attention backend out of potential backends") or named with
    # --attention-backend ("Using AttentionBackendEnum.X backend."): platforms/cuda.py.
    "attention_backend": re.compile(r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention backend out of|backend\.)"),
    # The overlay's own line: deepgemm, or b12x where its switch is on.
    "indexer_kernels": re.compile(r"DSA sparse indexer kernels: (\w+)"),
    # vLLM 0.33.0's JIT kernel warm-up: stock registers 2 compile keys, the overlay's
    # metadata-kernel-warmup 65 (docs/validation/h200-2026-11-30-vllm0_33_0-run2).
    "jit_warmup_keys": re.compile(r"JIT kernel warmup \((\d+) compile keys\)"),
}


def log_facts(log_path: str) -> dict:
    with open(log_path, errors="replace") as f:
        text = f.read()
    facts = {name: sorted(set(pattern.findall(text))) for name, pattern in LOG_FACTS.items()}
    facts["errors"] = serving.log_errors(text)[:10]
    return facts


# -- what each base gives on the H200 ------------------------------------------------------------

class H200Paths(TypedDict):
    """What one vLLM base does on an H200: the indexer's native decode next_n, and the attention
    backend per --kv-cache-dtype."""

    native_next_n: tuple[int, ...]
    backend: dict[str, str]


# Per base, on sm_90 with DeepGEMM: the next_n the indexer decodes natively (0.24.0:
# indexer.py, `next_n not in (1, 2)` flattens off SM100; 0.33.0: utils/deep_gemm.py,
# native_next_n_supported) and the attention backend per --kv-cache-dtype (the sm_90 sparse MLA
# priorities of platforms/cuda.py and each backend's kv-cache dtypes: FLASH_ATTN_MLA_SPARSE,
# first on 0.33.0, takes bf16 caches only; FLASHMLA_SPARSE, next, takes fp8 and fp8_ds_mla).
# The "auto" backends are the recipe's sm90 targets'.
H200_PATHS: dict[str, H200Paths] = {
    "0.24.0": {"native_next_n": (1, 2),
               "backend": {"auto": "FLASHMLA_SPARSE", "fp8": "FLASHMLA_SPARSE", FP8_KV: "FLASHMLA_SPARSE"}},
    "0.33.0": {"native_next_n": (1, 2, 4),
               "backend": {"auto": "FLASH_ATTN_MLA_SPARSE", "fp8": "FLASHMLA_SPARSE", FP8_KV: "FLASHMLA_SPARSE"}},
}
_USE_FLATTENING = re.compile(r"use_flattening=(True|False)\b.*\bnext_n=(\d+)")


def expected_on_h200(base: str | None, mode: Mode) -> dict | None:
    """The attention backend, decode path and quantized KV-cache dtype `mode` gets on an H200
    with vLLM `base`; None for a base or KV-cache dtype without a record."""
    paths = H200_PATHS.get(base or "")
    if paths is None or mode.kv_cache_dtype not in paths["backend"]:
        return None
    next_n = 1 + mode.spec_tokens
    return {"attention_backend": paths["backend"][mode.kv_cache_dtype], "next_n": next_n,
            "flattened": next_n not in paths["native_next_n"],
            "kv_cache_dtype": None if mode.kv_cache_dtype == "auto" else mode.kv_cache_dtype}


def logged_paths(facts: dict) -> dict:
    """What one server logged of the same: backends, each decode path's next_n and flattening,
    quantized KV-cache dtypes."""
    decode = [{"next_n": int(m.group(2)), "flattened": m.group(1) == "True"}
              for m in (_USE_FLATTENING.search(d) for d in facts.get("decode_path", [])) if m]
    return {"attention_backend": facts.get("attention_backend", []), "decode": decode,
            "kv_cache_dtype": facts.get("kv_cache_dtype", [])}


def path_differences(expected: dict, logged: dict) -> list[str]:
    """How one server's logged paths differ from `expected` (empty: as expected)."""
    differences = []
    if logged["attention_backend"] != [expected["attention_backend"]]:
        differences.append(f"attention backend {logged['attention_backend']}, expected {expected['attention_backend']}")
    want = {"next_n": expected["next_n"], "flattened": expected["flattened"]}
    if logged["decode"] != [want]:
        differences.append(f"decode path {logged['decode']}, expected {[want]}")
    kv = [expected["kv_cache_dtype"]] if expected["kv_cache_dtype"] else []
    if logged["kv_cache_dtype"] != kv:
        differences.append(f"quantized KV-cache dtype {logged['kv_cache_dtype']}, expected {kv}")
    return differences


def paths_report(base: str | None, mode: Mode, logged: dict[str, dict]) -> dict:
    """Per side, what was logged against what `base` gives on the H200 (information: stock and
    the overlay are compared on whatever path they ran)."""
    expected = expected_on_h200(base, mode)
    sides = {side: logged_paths(facts) for side, facts in logged.items()}
    report: dict[str, Any] = {"vllm": base, "expected_on_h200": expected, "logged": sides}
    if expected is not None:
        report["differences"] = {side: path_differences(expected, paths) for side, paths in sides.items()}
        report["as_expected"] = not any(report["differences"].values())
    return report


def paths_summary(paths: dict) -> str:
    expected = paths.get("expected_on_h200")
    if expected is None:
        return f"paths not judged (no H200 record for vLLM {paths.get('vllm')} and this mode)"
    what = (f"{expected['attention_backend']}, next_n={expected['next_n']} "
            f"{'flattened' if expected['flattened'] else 'native'}")
    if paths["as_expected"]:
        return f"paths as on an H200 with vLLM {paths['vllm']} ({what})"
    return f"paths NOT as on an H200 with vLLM {paths['vllm']} ({what}): {paths['differences']}"


MTP_PATHS = "mtp-paths"  # --modes: the base's MTP modes that cover both decode paths


def decode_path_modes(base: str | None) -> list[str]:
    """Per indexer decode path on an H200 (native, flattened), the 8k MTP mode with the most draft
    tokens: served side by side, they cover both paths of `base` (0.24.0: mtp1, mtp3; 0.33.0:
    mtp2, mtp3)."""
    if base not in H200_PATHS:
        raise SystemExit(f"--modes {MTP_PATHS}: no decode-path record for vLLM {base} (H200_PATHS); name the modes")
    mtp = sorted((m for m in MODES.values() if m.model == "mtp" and m.max_model_len == 8192
                  and m.kv_cache_dtype == "auto"), key=lambda m: m.spec_tokens)
    per_path = {}
    for m in mtp:
        expected = expected_on_h200(base, m)
        if expected is None:  # H200_PATHS lacks the mode's KV-cache dtype
            raise SystemExit(f"--modes {MTP_PATHS}: no H200 record of mode {m.name} on vLLM {base}; name the modes")
        per_path[expected["flattened"]] = m.name
    return sorted(per_path.values())


def resolve_base(requested: str | None, sites: list[str]) -> str | None:
    """The vLLM release both sites hold (their dist-info), which --vllm must name if given
    (vllm_base.choose, as every harness); sites without one: --vllm, or None (the paths are then
    not judged)."""
    installed = {v for site in sites for v in installed_versions(Path(site), "vllm") if v}
    if not installed:
        return requested
    try:
        return vllm_base.choose(requested, installed)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None


# -- running ------------------------------------------------------------------------------------


def model_for(mode: Mode, args, work_dir: Path) -> str:
    source = args.mtp_model if mode.model == "mtp" else args.model
    if not source:
        raise SystemExit(f"mode {mode.name} needs --mtp-model DIR (the tiny GLM-5 with its MTP layer)")
    limit = json.loads((Path(source) / "config.json").read_text()).get("max_position_embeddings", 0)
    if mode.max_model_len <= limit:
        return source
    return str(long_context_model(Path(source), work_dir / f"model-{mode.model}-{mode.max_model_len}",
                                  mode.max_model_len))


def model_info_entries(args, work_dir: Path) -> dict[str, Path]:
    """Per side, the model info the image ships (serving.image_model_info), kept in
    --model-info-root, where an earlier call (the H200 script's install phase) may have made it.
    Made from the MTP model where there is one: its classes include the base model's."""
    return serving.require_image_model_info({"stock": (sys.executable, args.stock_site),
                                             "overlay": (sys.executable, args.overlay_site)},
                                            Path(args.mtp_model or args.model), serving.model_info_root(args, work_dir))


def start_mode(mode: Mode, model: str, index: int, args, work_dir: Path, out_dir: Path,
               entries: dict[str, Path]) -> dict:
    common = [*mode.server_args(), "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
              "--gpu-memory-utilization", str(args.gpu_memory_utilization), *shlex.split(args.server_args)]
    servers = {}
    for offset, (side, site) in enumerate((("stock", args.stock_site), ("overlay", args.overlay_site))):
        name = f"{mode.name}-{side}"
        home = model_info_cache.image_home(work_dir / f"home-{name}", entries[side])
        servers[side] = serving.start_server(name, site, model, args.port_base + 2 * index + offset,
                                             str(out_dir), common, home=str(home),
                                             max_model_len=mode.max_model_len)
    return {"mode": mode, "model": model, "servers": servers}


def exercise(run: dict) -> dict:
    """Stock first, then the overlay, never both at once: each server has the GPU to itself."""
    mode = run["mode"]
    token_ids = prompt_token_ids(run["model"])
    prompts = {batch: mode_prompts(mode, token_ids, batch) for batch in ("sequential", "concurrent")}
    results, report = {}, {"prompt_lengths": list(mode.prompt_lengths), "max_tokens": mode.max_tokens,
                           "request_time_s": {}, "spec_decode": {}}
    for side, server in run["servers"].items():
        before = settled_spec_counters(server["port"])
        t0 = time.monotonic()
        results[side] = run_mode_requests(server["port"], prompts, mode.max_tokens)
        report["request_time_s"][side] = round(time.monotonic() - t0, 2)
        report["spec_decode"][side] = acceptance(counter_delta(before, settled_spec_counters(server["port"])))
    report["stock_vs_overlay"] = serving.compare(results["stock"], results["overlay"], mode.prompt_lengths)
    report.update(serving.output_findings(results))
    report["sample_tokens"] = {side: r["sequential"][-1]["token_ids"][:16] for side, r in results.items()}
    return report


def spec_agrees(spec: dict) -> bool | None:
    """Both sides' draft counters equal (None: no speculative decoding)."""
    stock, overlay = spec.get("stock"), spec.get("overlay")
    if stock is None and overlay is None:
        return None
    keys = ("drafts", "draft_tokens", "accepted_tokens", "accepted_per_position")
    if not (stock and overlay):
        return False
    return all(stock[k] == overlay[k] for k in keys)


def mode_ok(mode: Mode, report: dict) -> bool:
    # Empty text alone is recorded, not failed (serving.answered); a server without tokens fails.
    if "error" in report or report.get("unanswered"):
        return False
    if not serving.same_outputs(report.get("stock_vs_overlay", {})):
        return False
    # With MTP the draft layer runs the indexer too: its counters must match, and exist.
    return report.get("spec_decode_agrees") is True if mode.spec_tokens else True


def run_modes(runs: list[dict], args) -> dict:
    servers = [s for r in runs for s in r["servers"].values()]
    reports = {r["mode"].name: {"mode": asdict(r["mode"]), "model": r["model"],
                                "server_args": r["mode"].server_args()} for r in runs}
    healthy = wait_each_healthy(servers, time.monotonic() + args.timeout)
    for r in runs:
        report = reports[r["mode"].name]
        report["healthy_after_s"] = {side: healthy[s["name"]] for side, s in r["servers"].items()}
        failed = {side: h for side, h in report["healthy_after_s"].items() if isinstance(h, str)}
        if failed:
            report["error"] = f"not served: {failed}"
            continue
        try:
            report.update(exercise(r))
            report["spec_decode_agrees"] = spec_agrees(report["spec_decode"])
        except Exception as exc:  # noqa: BLE001 - one mode failing must not hide the others
            report["error"] = f"{type(exc).__name__}: {exc}"
    return reports


def stop_all(runs: list[dict]) -> None:
    for r in runs:
        for server in r["servers"].values():
            serving.stop(server)


def annotate(runs: list[dict], reports: dict, base: str | None = None) -> None:
    """What each server logged, read once it has stopped; then each mode's verdict."""
    for r in runs:
        report = reports[r["mode"].name]
        report["server_logs"] = {side: os.path.basename(s["log"]) for side, s in r["servers"].items()}
        report["logged"] = {side: log_facts(s["log"]) for side, s in r["servers"].items()}
        report["paths"] = paths_report(base, r["mode"], report["logged"])
        report["jit_during_inference"] = {side: serving.jit_kernels_during_inference(s["log"])
                                          for side, s in r["servers"].items()}
        report["ok"] = mode_ok(r["mode"], report)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", help=f"comma-separated, of: {', '.join(MODES)}; or {MTP_PATHS}: "
                        "the base's MTP modes, one per indexer decode path")
    parser.add_argument("--model", required=True, help="the tiny GLM-5 (scripts/make_tiny_model.py), or "
                        "GLM-5 at real width (scripts/make_realwidth_model.py)")
    parser.add_argument("--mtp-model", help="the same with its MTP layer (for the MTP modes; GLM-5 at real width "
                        "has it: the same directory)")
    parser.add_argument("--stock-site", required=True)
    parser.add_argument("--overlay-site", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--work-dir", help="servers' HOMEs and derived models (default: OUT/work)")
    serving.add_model_info_root(parser)
    parser.add_argument("--model-info-only", action="store_true",
                        help="make the model-info entries in --model-info-root and stop (no server starts)")
    parser.add_argument("--port-base", type=int, default=8300)
    parser.add_argument("--timeout", type=float, default=600, help="seconds for all servers to become healthy")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2,
                        help="only vLLM's start-up check of free memory reads it (the KV cache size is fixed)")
    parser.add_argument("--server-args", default="", help="more vllm serve arguments, one string")
    parser.add_argument("--vllm", help="the vLLM base the sites hold (default: read from them); "
                        "picks the decode paths and backends expected on the H200")
    args = parser.parse_args(argv)
    if not args.modes and not args.model_info_only:
        parser.error("expected --modes (or --model-info-only)")
    unknown = [m for m in (args.modes or "").split(",") if m and m not in MODES] if args.modes != MTP_PATHS else []
    if unknown:
        parser.error(f"unknown modes {unknown}; known: {', '.join(MODES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    base = resolve_base(args.vllm, [args.stock_site, args.overlay_site])
    out_dir = Path(args.out)
    work_dir = Path(args.work_dir or out_dir / "work")
    out_dir.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    if args.model_info_only:
        print(json.dumps({side: str(path) for side, path in model_info_entries(args, work_dir).items()}))
        return 0
    names = decode_path_modes(base) if args.modes == MTP_PATHS else args.modes.split(",")
    # Every model first: a missing one stops the run before any server starts.
    chosen = [(MODES[m], model_for(MODES[m], args, work_dir)) for m in names]
    entries = model_info_entries(args, work_dir)
    runs: list[dict] = []
    try:
        for i, (mode, model) in enumerate(chosen):
            runs.append(start_mode(mode, model, i, args, work_dir, out_dir, entries))
        reports = run_modes(runs, args)
    finally:
        stop_all(runs)
    annotate(runs, reports, base)
    doc = {"vllm": base, "modes": reports, "ok": all(r["ok"] for r in reports.values())}
    (out_dir / "serving-modes.json").write_text(json.dumps(doc, indent=1) + "\n")
    for name, report in reports.items():
        short = {k: v for k, v in report.items() if k not in ("sample_tokens", "logged", "mode")}
        print(name, json.dumps(short, indent=1))
        # One line per mode (the H200 script keeps the lines with PASS or FAIL): the verdict
        # and which paths it covered.
        print(f"{name}: {'PASS' if report['ok'] else 'FAIL'}; {paths_summary(report['paths'])}")
    print("SERVING MODES:", "PASS" if doc["ok"] else "FAIL")
    return status.SUCCESS if doc["ok"] else status.FAILED


if __name__ == "__main__":
    sys.exit(main())
