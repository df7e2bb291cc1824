"""Serve the tiny GLM-5 on the overlay's b12x path (emulated kernels) beside stock vLLM (DeepGEMM).

Two servers side by side on one GPU, CUDA graphs on (vLLM's defaults, no --enforce-eager):

- stock: the base's vLLM (0.24.0 or 0.33.0), DeepGEMM indexer;
- b12x: vLLM with the overlay, VLLM_USE_B12X_SPARSE_INDEXER=1, ``emulation/`` first on its
  PYTHONPATH and DSA_B12X_EMULATION=1 (its sitecustomize puts the emulated b12x in place and
  bypasses the compute-capability check in every server process), the supertile at 2048 keys
  so every prompt over 2048 tokens folds several supertiles: B12X_NSA_TOPK_SUPERTILE_K on
  0.24.0 (b12x 0.30.2), B12X_DSA_TOPK_SUPERTILE_K on 0.33.0 (b12x 1.5.1; its overlay refuses
  the NSA name).

The base is the vLLM both sites hold (``--vllm`` asserts it); the overlay site must hold the
b12x release that base pins, for which the emulation stands in.

Both get the same greedy requests (serving.PROMPT_LENGTHS: short and over 2,048 tokens, one by
one, then all at once). Reported: health, errors in the logs, the kernels each server logged,
token agreement, and text agreement where the tokens agree. The two compute logits differently
(DeepGEMM in fp32, the emulation exactly), so tokens may differ; each server records its first
long prefill top-k calls (``emulation/indexer_tap.py``), and a difference is explained down to
the selected positions: on the first call (layer 0, same inputs in both servers) the b12x side
must choose exactly the reference's top-k, and every position where DeepGEMM chose differently
must be a near-tie.

    python -m dsa_image.validation.b12x_serving --model DIR --stock-site S --overlay-site O \\
        --emulation REPO/emulation --repo REPO --out DIR [--vllm 0.33.0]

A recorded run can be judged again without a GPU (the logs re-scanned, the recorded token
comparison and tap explanations kept), written to DIR/serving-b12x.reevaluated.json:

    python -m dsa_image.validation.b12x_serving --reevaluate DIR
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from dsa_image.harness import server as serving
from dsa_image.core import status

SUPERTILE = "2048"
KERNEL_LINE = re.compile(r"DSA sparse indexer kernels: (\w+)")
BYPASS_LINE = "compute-capability check bypassed"
NEAR_TIE = 2.0 ** -7
EXPLAINED_ROWS = 64


def resolve_base(args) -> tuple[str, str]:
    """(base, the b12x variable its overlay's prefill supertile is set with)."""
    from dsa_image.validation import b12x_release, vllm_base

    base = vllm_base.sites_base(args.vllm, [args.stock_site, args.overlay_site])
    return base, b12x_release.emulated_release(args.emulation, b12x_release.pinned_b12x(base)).supertile_variable


def start_servers(args, out: Path, supertile: str) -> list[dict]:
    common = ["--kv-cache-memory-bytes", str(4 << 30), "--max-num-seqs", "16"]
    stock = serving.start_server(
        "b12x-stock", f"{args.emulation}:{args.stock_site}", args.model, 8111, str(out), common,
        env_extra={"DSA_B12X_EMULATION": "1", "DSA_INDEXER_TAP_DIR": str(out / "tap-stock")})
    emulated = serving.start_server(
        "b12x-emulated", f"{args.emulation}:{args.overlay_site}:{args.repo}", args.model, 8112, str(out),
        common, env_extra={"DSA_B12X_EMULATION": "1", "VLLM_USE_B12X_SPARSE_INDEXER": "1",
                           supertile: SUPERTILE,
                           "DSA_INDEXER_TAP_DIR": str(out / "tap-b12x")})
    return [stock, emulated]


def log_facts(path: str) -> dict:
    text = Path(path).read_text(errors="replace")
    return {"kernels": sorted(set(KERNEL_LINE.findall(text))),
            "capability_bypassed": BYPASS_LINE in text,
            "errors": serving.log_errors(text)[:10]}


# -- the recorded prefill top-k calls ---------------------------------------------------------


def explain_taps(stock_dir: Path, b12x_dir: Path) -> list[dict]:
    """Pair the servers' recorded calls in order and compare their chosen positions."""
    import torch

    stock = sorted(stock_dir.glob("deepgemm-*.pt"))
    emulated = sorted(b12x_dir.glob("b12x-*.pt"))
    return [explain_call(torch.load(a), torch.load(b)) for a, b in zip(stock, emulated, strict=True)]


def explain_call(stock: dict, emulated: dict) -> dict:
    import torch

    names = ("q", "weights", "k_quant", "k_scale", "ks", "ke")
    same_inputs = all(torch.equal(stock[n], emulated[n]) for n in names)
    rows = stock["chosen"].shape[0]
    differing = [r for r in range(rows) if _chosen(stock, r) != _chosen(emulated, r)]
    report = {"rows": rows, "same_inputs": same_inputs, "rows_identical": rows - len(differing)}
    if not same_inputs:
        report["note"] = "inputs differ: a selection in an earlier layer already differed"
        return report
    checked = sorted(set(differing[:EXPLAINED_ROWS] + [0, rows - 1]))
    report.update(explain_rows(stock, emulated, checked))
    return report


def explain_rows(stock: dict, emulated: dict, rows: list[int]) -> dict:
    """b12x must be the reference's top-k exactly; DeepGEMM may differ only at near-ties."""
    from dsa_image.runtime import indexer_reference as ref

    logits, magnitude = _reference(stock, rows)
    k = stock["topk"]
    b12x_problems, deepgemm_problems, margins = [], [], []
    for i, row in enumerate(rows):
        scale = float(magnitude[i].where(magnitude[i].isfinite(), magnitude.new_zeros(())).max())
        b12x_problems += [f"row {row}: {p}" for p in ref.selection_problems(emulated["chosen"][row], logits[i], k)]
        deepgemm_problems += [f"row {row}: {p}" for p in
                              ref.selection_problems(stock["chosen"][row], logits[i], k, NEAR_TIE * scale)]
        margins.append(_swap_margin(logits[i], _chosen(stock, row) ^ _chosen(emulated, row), k, scale))
    return {"explained_rows": len(rows), "b12x_equals_reference": not b12x_problems,
            "b12x_problems": b12x_problems[:5], "deepgemm_only_near_ties": not deepgemm_problems,
            "deepgemm_problems": deepgemm_problems[:5],
            "max_swap_margin_relative": max(margins, default=0.0)}


def _reference(record: dict, rows: list[int]):
    import torch

    from dsa_image.runtime import indexer_reference as ref

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = record["q"][rows].view(ref.FP8).to(device)
    w = record["weights"][rows].to(device)
    k, scale = record["k_quant"].view(ref.FP8).to(device), record["k_scale"].to(device)
    ks, ke = record["ks"][rows].to(device), record["ke"][rows].to(device)
    shift = record["ks"][rows].to(device)
    # Positions relative to each row's ks, as the top-k buffer holds them.
    logits = ref.masked_logits(ref.relu_weighted_logits(q, w, k, scale), ks, ke)
    magnitude = ref.masked_logits(ref.relu_weighted_logits(q, w.abs(), k, scale), ks, ke)
    return _shift_rows(logits, shift).cpu(), _shift_rows(magnitude, shift).cpu()


def _shift_rows(values, shift):
    import torch

    columns = torch.arange(values.shape[1], device=values.device)[None, :] + shift[:, None].long()
    inside = columns < values.shape[1]
    gathered = values.gather(1, columns.clamp(max=values.shape[1] - 1))
    return torch.where(inside, gathered, torch.full_like(gathered, float("-inf")))


def _chosen(record: dict, row: int) -> set[int]:
    return {int(i) for i in record["chosen"][row] if int(i) >= 0}


def _swap_margin(logits, swapped: set[int], k: int, scale: float) -> float:
    """Largest distance from the k-th logit, relative to the row magnitude, of a position only
    one server chose."""
    import torch

    finite = int(torch.isfinite(logits).sum())
    if not swapped or finite <= k:
        return 0.0
    kth = float(torch.topk(logits.double(), k).values[-1])
    return max(abs(float(logits[i]) - kth) for i in swapped) / max(scale, 1e-30)


# -- main -------------------------------------------------------------------------------------


def verdict(report: dict) -> bool:
    logs, taps = report.get("logs", {}), report.get("taps", [])
    first = taps[0] if taps else {}
    return bool(
        # A server without tokens fails; empty text alone is recorded (serving.answered). The
        # tokens may differ here (see above), but the same tokens must give the same text.
        "error" not in report and not report.get("unanswered")
        and not report.get("stock_vs_b12x", {}).get("text_mismatches")
        and all(not facts["errors"] for facts in logs.values())
        and logs.get("b12x-emulated", {}).get("kernels") == ["b12x"]
        and logs.get("b12x-emulated", {}).get("capability_bypassed")
        and logs.get("b12x-stock", {}).get("kernels") == []
        and first.get("same_inputs") and first.get("b12x_equals_reference")
        and first.get("deepgemm_only_near_ties"))


SERVER_NAMES = ("b12x-stock", "b12x-emulated")


def reevaluate(out: Path) -> dict:
    """The verdict of a recorded run (DIR/serving-b12x.json and DIR/server-*.log) under the
    current log scan and verdict; the recorded requests and tap explanations are kept as they were."""
    recorded = json.loads((out / "serving-b12x.json").read_text())
    report = {**recorded, "recorded_ok": recorded.get("ok"), "recorded_logs": recorded.get("logs"),
              "logs": {name: log_facts(str(out / f"server-{name}.log")) for name in SERVER_NAMES}}
    report["ok"] = verdict(report)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("--model", "--stock-site", "--overlay-site", "--emulation", "--repo", "--out"):
        parser.add_argument(name)
    parser.add_argument("--vllm", help="the vLLM base: must be the one both sites hold (the default)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--reevaluate", metavar="DIR", type=Path,
                        help="judge a recorded run in DIR again (no GPU); writes DIR/serving-b12x.reevaluated.json")
    args = parser.parse_args(argv)
    if args.reevaluate:
        report = reevaluate(args.reevaluate)
        (args.reevaluate / "serving-b12x.reevaluated.json").write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps({k: report[k] for k in ("recorded_ok", "ok", "logs", "stock_vs_b12x") if k in report},
                         indent=1))
        print("B12X SERVING (re-evaluated):", "PASS" if report["ok"] else "FAIL")
        return status.SUCCESS if report["ok"] else status.FAILED
    missing = [n for n in ("model", "stock_site", "overlay_site", "emulation", "repo", "out")
               if getattr(args, n) is None]
    if missing:
        parser.error("required unless --reevaluate: " + ", ".join("--" + n.replace("_", "-") for n in missing))
    try:
        base, variable = resolve_base(args)
    except RuntimeError as exc:
        parser.error(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    servers = start_servers(args, out, variable)
    report = {"vllm": base, "supertile": SUPERTILE, "supertile_variable": variable,
              "prompt_lengths": serving.PROMPT_LENGTHS}
    results = {}
    try:
        report["healthy_after_s"] = serving.wait_all_healthy(servers, time.monotonic() + args.timeout)
        for server in servers:
            results[server["name"]] = serving.run_requests(server["port"], serving.prompts())
        report["stock_vs_b12x"] = serving.compare(results["b12x-stock"], results["b12x-emulated"])
        report.update(serving.output_findings(results))
    except Exception as exc:  # noqa: BLE001 - reported, then the servers are stopped
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        for server in servers:
            serving.stop(server)
    report["logs"] = {s["name"]: log_facts(s["log"]) for s in servers}
    report["taps"] = explain_taps(out / "tap-stock", out / "tap-b12x")
    report["ok"] = verdict(report)
    (out / "serving-b12x.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps(report, indent=1, default=str)[:6000])
    print("B12X SERVING:", "PASS" if report["ok"] else "FAIL")
    return status.SUCCESS if report["ok"] else status.FAILED


if __name__ == "__main__":
    sys.exit(main())
