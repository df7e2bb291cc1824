"""Compare two indexer probe runs (stock vLLM vs the overlay), tensor for tensor.

Usage: python -m dsa_image.validation.compare STOCK.pt OVERLAY.pt --json OUT.json

Exits SUCCESS when every scenario's metadata is equal, the overlay makes no synchronising call
in build(), and the overlay-only checks pass (the codes: --help, EXIT_CODES).
"""

from __future__ import annotations

import argparse
import json
import sys

from dsa_image.core import status

EXIT_CODES = status.epilog(
    (status.SUCCESS, "every scenario's metadata equal, no synchronising call in build(), the overlay-only checks "
                     "pass"),
    (status.FAILED, "any of those not so (the table and the JSON say which)"),
    status.USAGE)
# Fields the overlay adds; stock has none of them, so they are checked on their
# own (exact decode max) rather than against stock.
OVERLAY_ONLY_FIELDS = {
    "decode.max_seq_len",
    "decode.active_width",
    "use_b12x",
}


def _equal(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    return a == b


def compare_scenario(stock: dict, ours: dict) -> list[str]:
    """Differences between the two runs' metadata for one scenario."""
    diffs = []
    st, ov = stock["tensors"], ours["tensors"]
    for key in sorted(set(st) | set(ov)):
        if key in OVERLAY_ONLY_FIELDS:
            continue
        if key not in st or key not in ov:
            diffs.append(f"{key}: only in {'stock' if key in st else 'overlay'}")
            continue
        a, b = st[key], ov[key]
        if key == "decode.block_table":
            # The overlay's flattened table has slack columns past the runner's
            # width; kernels read only pages below each row's length.
            width = stock["runner_block_table_width"]
            a, b = a[:, :width], b[:, :width]
        if not _equal(a, b):
            diffs.append(key)
    if "decode.max_seq_len" in ov and ov["decode.max_seq_len"] != ours["true_decode_max_seq_len"]:
        diffs.append(
            f"decode.max_seq_len {ov['decode.max_seq_len']} != exact "
            f"{ours['true_decode_max_seq_len']}"
        )
    return diffs


def compare_runs(stock: dict, ours: dict) -> dict:
    rows = []
    for name, st in stock["scenarios"].items():
        ov = ours["scenarios"][name]
        diffs = compare_scenario(st, ov)
        rows.append({
            "scenario": name,
            "next_n": st["next_n"],
            "flattened": st["use_flattening"],
            "tensors_compared": len(st["tensors"]),
            "equal": not diffs,
            "differences": diffs,
            "syncs_stock": st["syncs"],
            "syncs_overlay": ov["syncs"],
        })
    # The overlay run must really have run the overlay (its metadata carries
    # fields stock has not), or "equal" would compare stock with itself.
    overlay_ran = all("use_b12x" in ov["tensors"] for ov in ours["scenarios"].values())
    checks = {k: ours.get(k) for k in ("block_table_growth", "b12x")}
    checks["overlay_code_ran"] = overlay_ran
    checks["block_table_growth_stock"] = stock.get("block_table_growth")
    ok = (
        overlay_ran
        and all(r["equal"] and r["syncs_overlay"] == 0 for r in rows)
        and overlay_checks_pass(checks)
    )
    return {"ok": ok, "scenarios": rows, "checks": checks,
            "env": {k: ours.get(k) for k in ("gpu", "capability", "torch", "indexer_file")},
            "stock_indexer_file": stock.get("indexer_file")}


def overlay_checks_pass(checks: dict) -> bool:
    growth = checks.get("block_table_growth") or {}
    b12x = checks.get("b12x") or {}
    return (
        all(growth.get(k, {}).get("ok") for k in ("uniform", "variable"))
        and bool(b12x.get("startup_refusal", {}).get("ok"))
        and all(s["syncs"] == 0 for s in b12x.get("scenarios", {}).values())
        and bool(b12x.get("scenarios"))
    )


def format_table(report: dict) -> str:
    lines = [
        "| scenario | next_n | flattened | tensors equal | syncs stock | syncs overlay |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["scenarios"]:
        lines.append(
            f"| {r['scenario']} | {r['next_n']} | {r['flattened']} | "
            f"{'yes' if r['equal'] else 'NO: ' + ', '.join(r['differences'][:3])} | "
            f"{r['syncs_stock']} | {r['syncs_overlay']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stock")
    parser.add_argument("overlay")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    import torch

    stock = torch.load(args.stock, weights_only=False)
    ours = torch.load(args.overlay, weights_only=False)
    report = compare_runs(stock, ours)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(format_table(report))
    print(json.dumps(report["checks"], indent=1, default=str)[:6000])
    print("METADATA EQUIVALENCE:", "PASS" if report["ok"] else "FAIL")
    return status.SUCCESS if report["ok"] else status.FAILED


if __name__ == "__main__":
    sys.exit(main())
