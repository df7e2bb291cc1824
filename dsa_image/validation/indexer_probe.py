"""Run the DSA indexer metadata builder of the vLLM on sys.path over fixed batches.

Run once with stock vLLM 0.24.0 and once with our overlay applied (same seed);
``compare.py`` then checks them tensor for tensor. Per scenario it records every
tensor and scalar of the metadata, the number of synchronising CUDA calls during
``build()`` (``torch.cuda.set_sync_debug_mode``). Host time is measured by
``host_time.py``, with both builders in one process.
With ``--overlay-checks`` it also runs what only the overlay has: the b12x
metadata path and the block-table width case.

Needs a CUDA GPU, torch and vLLM. Usage:
    python -m dsa_image.validation.indexer_probe --model DIR --out FILE.pt [--overlay-checks]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import types
import warnings

import numpy as np

from dsa_image.validation import batches as B

MAX_MODEL_LEN = 8192
MAX_NUM_BATCHED_TOKENS = 16384
NUM_BLOCKS = 4096
SEED = 1234


def _torch():
    import torch

    return torch


def make_vllm_config(model_dir: str, num_speculative_tokens: int):
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(
        model=model_dir,
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=256,
        block_size=B.BLOCK_SIZE,
        load_format="dummy",
        enforce_eager=True,
    ).create_engine_config()
    if num_speculative_tokens:
        # The builder reads only num_speculative_tokens (and, from vLLM 0.33.0,
        # whether verification is adaptive); a real MTP config needs a model with
        # next-n layers, which the tiny model does not have.
        object.__setattr__(
            config,
            "speculative_config",
            types.SimpleNamespace(num_speculative_tokens=num_speculative_tokens,
                                  enable_adaptive_verification=False),
        )
    return config


def make_builder(vllm_config, builder_cls=None):
    """The indexer metadata builder of the vLLM on sys.path (or ``builder_cls``)."""
    torch = _torch()
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    if builder_cls is None:
        from vllm.v1.attention.backends.mla.indexer import (
            DeepseekV32IndexerMetadataBuilder as builder_cls,
        )

    spec = MLAAttentionSpec(
        block_size=B.BLOCK_SIZE, num_kv_heads=1, head_size=132, dtype=torch.uint8
    )
    kwargs = {}
    if getattr(builder_cls, "requires_block_table_width", False):
        # vLLM >= 0.33 hands such builders the runner's block-table width.
        kwargs["block_table_width"] = runner_block_table_width(vllm_config)
    with set_current_vllm_config(vllm_config):
        return builder_cls(
            spec, ["model.layers.0.self_attn.indexer.k_cache"], vllm_config,
            torch.device("cuda:0"), **kwargs,
        )


def runner_block_table_width(vllm_config) -> int:
    """Columns of the model runner's block table: one per block of max_model_len, which vLLM
    0.33.0's runner aligns to 128 tokens (v1/worker/utils.py); 0.24.0's does not align."""
    blocks = -(-vllm_config.model_config.max_model_len // B.BLOCK_SIZE)
    try:
        from vllm.v1.worker.block_table import get_block_table_width
    except ImportError:  # vLLM 0.24.0
        return blocks
    return get_block_table_width(blocks, B.BLOCK_SIZE)


def make_common_metadata(spec: B.BatchSpec, block_table: np.ndarray):
    """vLLM's CommonAttentionMetadata for ``spec``, as the runner would hand it."""
    torch = _torch()
    from vllm.v1.attention.backend import CommonAttentionMetadata

    dev = torch.device("cuda:0")
    qsl = np.concatenate([[0], np.cumsum(spec.query_lens)]).astype(np.int32)
    seq = np.asarray(spec.seq_lens, dtype=np.int32)
    slots = [
        int(block_table[r, p // B.BLOCK_SIZE]) * B.BLOCK_SIZE + p % B.BLOCK_SIZE
        for r, (q, s) in enumerate(zip(spec.query_lens, spec.seq_lens, strict=True))
        for p in range(s - q, s)
    ]
    seq_cpu = torch.from_numpy(seq)
    # vLLM 0.24.0 also takes the exact host lengths; 0.33.0 reads the upper bound only.
    exact = {"_seq_lens_cpu": seq_cpu} if "_seq_lens_cpu" in CommonAttentionMetadata.__dataclass_fields__ else {}
    return CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl).to(dev),
        query_start_loc_cpu=torch.from_numpy(qsl),
        seq_lens=seq_cpu.to(dev),
        num_reqs=spec.num_reqs,
        num_actual_tokens=spec.num_tokens,
        max_query_len=int(max(spec.query_lens)),
        max_seq_len=int(seq.max()),
        block_table_tensor=torch.from_numpy(block_table).to(dev),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        seq_lens_cpu_upper_bound=seq_cpu,
        **exact,
    )


def flatten_metadata(md) -> dict:
    """Every tensor and scalar of the metadata, by dotted name, on the CPU."""
    torch = _torch()
    out = {}

    def put(prefix, obj):
        for field, value in vars(obj).items():
            key = f"{prefix}{field}"
            if isinstance(value, torch.Tensor):
                out[key] = value.detach().cpu().clone()
            elif isinstance(value, (int, float, bool)) or value is None:
                out[key] = value

    put("", md)
    if md.decode is not None:
        put("decode.", md.decode)
    if md.prefill is not None:
        out["prefill.num_chunks"] = len(md.prefill.chunks)
        for i, chunk in enumerate(md.prefill.chunks):
            put(f"prefill.chunks.{i}.", chunk)
    return out


def count_syncs(fn) -> tuple[int, list[str]]:
    """Synchronising CUDA calls torch reports while ``fn`` runs, and where."""
    torch = _torch()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's own notice ("Synchronization debug mode is a prototype feature")
    # is not a sync; the per-operation warning is "called a synchronizing CUDA
    # operation".
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    return len(syncs), [f"{w.filename}:{w.lineno}: {w.message}"[:300] for w in syncs[:3]]


def run_scenarios(model_dir: str) -> dict:
    torch = _torch()
    rng = np.random.default_rng(SEED)
    results = {}
    for next_n, specs in B.standard_batches(SEED, MAX_MODEL_LEN).items():
        builder = make_builder(make_vllm_config(model_dir, next_n - 1))
        width = builder.expanded_block_table_buffer.shape[1]
        runner_width = -(-MAX_MODEL_LEN // B.BLOCK_SIZE)
        for spec in specs:
            table = B.random_block_table(rng, spec.num_reqs, runner_width, NUM_BLOCKS)
            cm = make_common_metadata(spec, table)
            build = lambda builder=builder, cm=cm: builder.build(0, cm)  # noqa: E731
            build()  # first build: JIT and allocator warm-up stay out of the counts
            md = build()
            torch.cuda.synchronize()
            syncs, sync_sites = count_syncs(build)
            results[spec.name] = {
                "next_n": next_n,
                "use_flattening": bool(builder.use_flattening),
                "runner_block_table_width": runner_width,
                "expanded_block_table_width": int(width),
                "true_decode_max_seq_len": true_decode_max(spec, md),
                "syncs": syncs,
                "sync_sites": sync_sites,
                "tensors": flatten_metadata(md),
            }
            print(f"  {spec.name}: syncs={results[spec.name]['syncs']}", flush=True)
    return results


def true_decode_max(spec: B.BatchSpec, md) -> int:
    return int(max(spec.seq_lens[: md.num_decodes], default=0))


# --- overlay-only checks ----------------------------------------------------


def leading_decodes(query_lens, uniform_only: bool) -> int:
    """How many requests of a batch of short queries the builder takes as decodes (vLLM's
    split_decodes_and_prefills): all of them, or, when the decode kernel needs uniform
    batches, the leading run as long as the first (the rest go the prefill path)."""
    if not uniform_only:
        return len(query_lens)
    first = query_lens[0]
    return next((i for i, q in enumerate(query_lens) if q not in (first, 0)), len(query_lens))


def expected_decode_table(table, query_lens, flattened: bool, uniform_only: bool):
    """The decode block table a builder must hand the kernel: each decode request's row once
    per query token when flattened, once per request otherwise."""
    n = leading_decodes(query_lens, uniform_only)
    rows = np.asarray(table)[:n]
    return np.repeat(rows, query_lens[:n], axis=0) if flattened else rows


def check_block_table_growth(model_dir: str) -> dict:
    """MTP (next_n=4) decode with the widest block table the runner hands.

    vLLM 0.24.0's runner can hand a table wider than the builder's buffer (here 3 columns
    wider): stock raises on the variable-length path and drops the last column on the
    uniform one; the overlay must give every flattened row its request's full row. From
    vLLM 0.28.0 the runner passes its width to the builder (`requires_block_table_width`),
    so the widest table is the runner's own width: every row must still arrive whole.
    The decode table has one row per query token when the builder flattens (0.24.0 on
    sm_90), one per request when it does not (0.33.0: DeepGEMM takes next_n=4 natively);
    without flattening or a variable-length kernel the builder needs uniform decode batches,
    so a variable batch's decodes are its leading run of equal query lengths.
    """
    rng = np.random.default_rng(SEED + 1)
    config = make_vllm_config(model_dir, 3)
    builder = make_builder(config)
    buffer_width = builder.expanded_block_table_buffer.shape[1]
    told = bool(getattr(type(builder), "requires_block_table_width", False))
    runner_width = runner_block_table_width(config) if told else buffer_width + 3
    flattened = bool(builder.use_flattening)
    uniform_only = not (flattened or getattr(builder, "supports_varlen", False))
    report: dict[str, object] = {"buffer_width": int(buffer_width), "runner_width": int(runner_width),
              "builder_told_runner_width": told, "flattened": flattened}
    for variable in (False, True):
        name = "variable" if variable else "uniform"
        spec = B.decode_batch(rng, f"wide_{name}", 8, 4, MAX_MODEL_LEN, variable)
        table = B.random_block_table(rng, spec.num_reqs, runner_width, NUM_BLOCKS)
        try:
            md = builder.build(0, make_common_metadata(spec, table))
        except Exception as e:  # noqa: BLE001 - stock's failure is the finding
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
            continue
        got = md.decode.block_table[:, :runner_width].cpu().numpy()
        want = expected_decode_table(table, spec.query_lens, flattened, uniform_only)
        decodes = leading_decodes(spec.query_lens, uniform_only)
        report[name] = {"ok": bool(md.num_decodes == decodes and np.array_equal(got, want)),
                        "decodes": int(md.num_decodes), "expected_decodes": decodes,
                        "rows": int(got.shape[0]), "expected_rows": int(want.shape[0])}
    return report


def check_b12x_path(model_dir: str) -> dict:
    """b12x on: the start-up refusal on this GPU, then (capability check
    bypassed, the kernels are never launched) the metadata path's syncs."""
    torch = _torch()
    from vllm.v1.attention.backends.mla import b12x_indexer

    import vllm.envs as envs

    envs.disable_envs_cache()  # the variable is flipped inside this process
    os.environ["VLLM_USE_B12X_SPARSE_INDEXER"] = "1"
    report = {}
    try:
        make_builder(make_vllm_config(model_dir, 0))
        report["startup_refusal"] = {"ok": False, "error": "no error raised"}
    except RuntimeError as e:
        report["startup_refusal"] = {"ok": "compute capability" in str(e),
                                     "message": str(e)}
    original = b12x_indexer.require_supported
    b12x_indexer.require_supported = lambda *a, **k: None
    try:
        rng = np.random.default_rng(SEED + 2)
        report["scenarios"] = {}
        for next_n in (1, 4):
            builder = make_builder(make_vllm_config(model_dir, next_n - 1))
            for spec in B.standard_batches(SEED, MAX_MODEL_LEN)[next_n]:
                table = B.random_block_table(rng, spec.num_reqs, 128, NUM_BLOCKS)
                cm = make_common_metadata(spec, table)
                build = lambda builder=builder, cm=cm: builder.build(0, cm)  # noqa: E731
                md = build()
                torch.cuda.synchronize()
                syncs, sync_sites = count_syncs(build)
                entry = {"syncs": syncs, "sync_sites": sync_sites,
                         "chunks": len(md.prefill.chunks) if md.prefill else 0}
                if md.decode is not None:
                    # The 0.24.0 overlay's decode metadata carries its exact max and the
                    # width in use; the 0.33.0 overlay's does not (upstream's fields only).
                    if hasattr(md.decode, "active_width"):
                        entry["active_width"] = int(md.decode.active_width.item())
                        entry["max_seq_len"] = md.decode.max_seq_len
                        entry["true_max"] = true_decode_max(spec, md)
                    entry["schedule"] = md.decode.schedule_metadata is not None
                report["scenarios"][spec.name] = entry
    finally:
        b12x_indexer.require_supported = original
        os.environ.pop("VLLM_USE_B12X_SPARSE_INDEXER")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="tiny GLM-5 model directory")
    parser.add_argument("--out", required=True, help="results file (.pt)")
    parser.add_argument("--overlay-checks", action="store_true",
                        help="also run the overlay-only checks (b12x, width)")
    args = parser.parse_args(argv)
    torch = _torch()
    import vllm

    results = {
        "vllm_file": vllm.__file__,
        "indexer_file": sys.modules["vllm"].__file__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
    }
    from vllm.v1.attention.backends.mla import indexer

    results["indexer_file"] = indexer.__file__
    print(f"indexer: {indexer.__file__}", flush=True)
    results["scenarios"] = run_scenarios(args.model)
    results["block_table_growth"] = guarded(check_block_table_growth, args.model)
    if args.overlay_checks:
        results["b12x"] = guarded(check_b12x_path, args.model)
    torch.save(results, args.out)
    summary = {k: v for k, v in results.items() if k not in ("scenarios",)}
    print(json.dumps(summary, indent=1, default=str), flush=True)
    return 0


def guarded(check, *args):
    """A failing check is recorded, not fatal: the other checks still run."""
    try:
        return check(*args)
    except Exception as e:  # noqa: BLE001
        import traceback

        return {"ok": False, "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:]}


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
