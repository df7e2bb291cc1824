"""Host time of build(): stock and overlay builders in one process, calls interleaved.

Both builders also build each batch once more for a tensor-for-tensor comparison
(the same check as compare.py, here within one process).

Separate processes measured minutes apart differ by tens of percent on the same
code (seen on the H200), so this loads stock vLLM's indexer.py from a stock
install under another module name next to the overlay's (the overlay's vLLM is
on sys.path; stock indexer.py imports nothing the overlay changed) and times the
builders call by call on the same batches. A second stock builder runs beside
them as the control: its ratio to the first is what "equal code" measures in the
same run, so an overlay ratio is read against it. The calling order rotates each
round, so no builder always runs first (or right after another one).

Usage: python -m dsa_image.validation.host_time --model DIR \
           --stock-indexer SITE/vllm/v1/attention/backends/mla/indexer.py --json OUT
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from dsa_image.validation import batches as B
from dsa_image.validation import compare
from dsa_image.validation import indexer_probe as probe

CALLS = 600  # per builder; a multiple of the 3 builders, so each holds each place equally
BUILDERS = ("stock", "overlay", "stock_control")


def load_stock_indexer(path: str):
    spec = importlib.util.spec_from_file_location("dsa_stock_indexer", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"{path}: not loadable as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def rotated(names: list, round_index: int) -> list:
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def interleaved_host_us(builds: dict, calls: int = CALLS) -> dict:
    """Median host time per build() for each builder, the order rotating each round.

    The GPU is idle when each call starts and its launches stay asynchronous, so
    this is the time the host spends in build(), not time waiting on a full queue.
    """
    import torch

    names = list(builds)
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc.disable()
    try:
        for round_index in range(calls):
            for name in rotated(names, round_index):
                torch.cuda.synchronize()
                start = time.perf_counter()
                builds[name]()
                samples[name].append(time.perf_counter() - start)
    finally:
        gc.enable()
    torch.cuda.synchronize()
    return {name: statistics.median(s) * 1e6 for name, s in samples.items()}


def summarise(rows: list) -> dict:
    """The verdict: the overlay's worst ratio beside the control's spread."""
    ratios = [r["ratio"] for r in rows]
    controls = [r["control_ratio"] for r in rows]
    return {
        "overlay_ratio_max": max(ratios),
        "overlay_ratio_min": min(ratios),
        "control_ratio_min": min(controls),
        "control_ratio_max": max(controls),
        "overlay_not_slower": max(ratios) <= 1.0,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--stock-indexer", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--overlay-checks", action="store_true",
                        help="then the probe's overlay-only checks (width, b12x)")
    args = parser.parse_args(argv)
    import torch
    from vllm.v1.attention.backends.mla import indexer as overlay_indexer

    stock_indexer = load_stock_indexer(args.stock_indexer)
    rng = np.random.default_rng(probe.SEED)
    rows = []
    for next_n, specs in B.standard_batches(probe.SEED, probe.MAX_MODEL_LEN).items():
        config = probe.make_vllm_config(args.model, next_n - 1)
        classes = {"stock": stock_indexer.DeepseekV32IndexerMetadataBuilder,
                   "overlay": overlay_indexer.DeepseekV32IndexerMetadataBuilder,
                   "stock_control": stock_indexer.DeepseekV32IndexerMetadataBuilder}
        builders = {name: probe.make_builder(config, classes[name]) for name in BUILDERS}
        width = -(-probe.MAX_MODEL_LEN // B.BLOCK_SIZE)
        for spec in specs:
            table = B.random_block_table(rng, spec.num_reqs, width, probe.NUM_BLOCKS)
            cm = probe.make_common_metadata(spec, table)
            builds = {name: (lambda b=b, cm=cm: b.build(0, cm)) for name, b in builders.items()}
            built: dict[str, dict[str, Any]] = {}
            for name, build in builds.items():  # also the warm-up call of each
                md = build()
                torch.cuda.synchronize()
                built[name] = {"tensors": probe.flatten_metadata(md),
                               "runner_block_table_width": width,
                               "true_decode_max_seq_len": probe.true_decode_max(spec, md)}
            differences = compare.compare_scenario(built["stock"], built["overlay"])
            us = interleaved_host_us(builds)
            rows.append({"scenario": spec.name, "next_n": next_n,
                         "tensors_compared": len(built["stock"]["tensors"]),
                         "equal": not differences, "differences": differences,
                         "host_us_stock": round(us["stock"], 1),
                         "host_us_overlay": round(us["overlay"], 1),
                         "host_us_stock_control": round(us["stock_control"], 1),
                         "ratio": round(us["overlay"] / us["stock"], 3),
                         "control_ratio": round(us["stock_control"] / us["stock"], 3)})
            print(f"{spec.name:28s} equal {not differences!s:5s} stock {us['stock']:7.1f} us"
                  f"  overlay {us['overlay']:7.1f} us  ratio {rows[-1]['ratio']:.3f}"
                  f"  (control {rows[-1]['control_ratio']:.3f})", flush=True)
    report = {"calls_per_builder": CALLS, "order": "rotating: " + ", ".join(BUILDERS),
              "scenarios": rows,
              "all_equal": all(r["equal"] for r in rows),
              **summarise(rows),
              "stock_indexer": args.stock_indexer,
              "overlay_indexer": overlay_indexer.__file__}
    if args.overlay_checks:
        report["block_table_growth"] = probe.guarded(probe.check_block_table_growth, args.model)
        report["b12x"] = probe.guarded(probe.check_b12x_path, args.model)
        report["overlay_checks_pass"] = compare.overlay_checks_pass(report)
        print(json.dumps({"block_table_growth": report["block_table_growth"]}, default=str))
        print("OVERLAY CHECKS:", report["overlay_checks_pass"],
              {k: v.get("syncs") for k, v in report["b12x"].get("scenarios", {}).items()})
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print("TENSORS EQUAL on every scenario:", report["all_equal"])
    print("HOST TIME overlay <= stock on every scenario:", report["overlay_not_slower"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
