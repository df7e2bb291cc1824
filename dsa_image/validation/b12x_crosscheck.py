"""The b12x emulation against the parts of the installed b12x wheel that run without sm_120.

b12x's package needs a compute capability 12.x GPU to do anything, but three of its pieces
run anywhere and fix the semantics the emulation copies:

- reference.py: b12x's torch references of its paged and contiguous logits (and, with a
  stable descending sort, of its top-k index convention);
- schedule_metadata.py: b12x's schedule builder, Triton on CUDA and torch;
- the constants the emulation mirrors (schedule thresholds, supported top-k sizes, the
  contiguous path's supertile variable and default, prefill tile widths).

They live in the indexer package of the installed release (``b12x/attention/indexer/`` in
0.30.2, ``b12x/attention/dsa_indexer/`` in 1.5.1), which is the release the emulation stands in
for (``b12x/_release.py``), and are loaded by file (``b12x`` itself resolves to the emulation
in this process). The logits are compared with a tolerance (b12x's references compute in fp32,
the emulation exactly), the selections up to near-ties, the schedules exactly.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

SEED = 7
TOLERANCE = 1e-5
DEVICE = "cuda"


def real_b12x_dir(emulation_dir: str) -> Path:
    """The installed b12x package, looked up on sys.path without the emulation."""
    paths = [p for p in sys.path if os.path.abspath(p or ".") != os.path.abspath(emulation_dir)]
    spec = importlib.machinery.PathFinder.find_spec("b12x", paths)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no installed b12x package beside the emulation")
    return Path(list(spec.submodule_search_locations)[0])


def load_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"{path}: not loadable as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(emulation_dir: str) -> dict:
    import torch

    import b12x

    release = b12x.RELEASE
    emulated = importlib.import_module(release.api_module)
    root = real_b12x_dir(emulation_dir)
    indexer_dir = module_path(root, release.package)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # b12x's references in full fp32, not TF32
    try:
        reference = load_file(indexer_dir / "reference.py", "b12x_wheel_reference")
        report: dict[str, Any] = {"b12x": str(root), "release": check_release(release, root),
                  "paged_logits": check_paged(emulated, reference),
                  "contiguous": check_contiguous(emulated, reference),
                  "schedules": check_schedules(emulated, load_file(indexer_dir / "schedule_metadata.py",
                                                                   "b12x_wheel_schedule_metadata")),
                  "constants": check_constants(release, indexer_dir)}
    finally:
        torch.set_float32_matmul_precision(previous)
    report["ok"] = all(part["ok"] for part in report.values() if isinstance(part, dict))
    return report


def module_path(root: Path, module: str) -> Path:
    """Where ``module`` (b12x.x.y) lies under the installed package ``root``, without suffix."""
    return root.parent.joinpath(*module.split("."))


def check_release(release, root: Path) -> dict:
    """The installed wheel is the release emulated, with the module the overlay imports."""
    installed = importlib.metadata.version("b12x")
    api = module_path(root, release.api_module)
    has_api = api.with_suffix(".py").is_file() or (api / "__init__.py").is_file()
    return {"emulated": release.version, "installed": installed, "api_module": release.api_module,
            "api_module_in_wheel": has_api, "ok": installed == release.version and has_api}


def check_paged(emulated, reference) -> dict:
    import torch

    from dsa_image.runtime import indexer_reference as ref

    gen = torch.Generator().manual_seed(SEED)
    rows, heads, columns = 6, 32, 40
    pages = ref.cache_pages(ref.random_cache(rows * columns, 64, gen, DEVICE)).contiguous()
    table = torch.randperm(rows * columns, generator=gen).view(rows, columns).to(torch.int32).to(DEVICE)
    lens = torch.tensor([1, 100, 2047, 2048, 2049, columns * 64], dtype=torch.int32, device=DEVICE)
    q = ref.random_fp8((rows, heads, ref.HEAD_DIM), gen, DEVICE)
    w = ref.random_weights(rows, heads, gen, DEVICE)
    theirs = reference.paged_decode_logits_reference(
        q_fp8=q, weights=w, index_k_cache=pages, real_page_table=table,
        query_row_to_batch=torch.arange(rows, dtype=torch.int32, device=DEVICE),
        seqlens_per_query=lens, page_size=64)
    ours = emulated.paged_decode_logits(q_fp8=q, weights=w, index_k_cache=pages, page_size=64,
                                        metadata=emulated.IndexerPagedDecodeMetadata(table, lens))
    magnitude = ref.paged_logits(q, w.abs(), pages, 64, table, lens)
    return _agree(theirs, ours, magnitude, topk=512)


def check_contiguous(emulated, reference) -> dict:
    import torch

    from dsa_image.runtime import indexer_reference as ref

    gen = torch.Generator().manual_seed(SEED + 1)
    rows, heads, keys, topk = 300, 32, 3000, 512
    q = ref.random_fp8((rows, heads, ref.HEAD_DIM), gen, DEVICE)
    w = ref.random_weights(rows, heads, gen, DEVICE)
    k, scale = ref.random_fp8((keys, ref.HEAD_DIM), gen, DEVICE), ref.random_scales(keys, gen, DEVICE)
    ks = torch.randint(0, 1000, (rows,), generator=gen, dtype=torch.int32).to(DEVICE)
    ke = (ks + torch.randint(1, 2000, (rows,), generator=gen, dtype=torch.int32).to(DEVICE)).clamp(max=keys)
    theirs = reference.contiguous_logits_reference(q_fp8=q, weights=w, kv_fp8=(k, scale), k_start=ks, k_end=ke)
    ours = ref.masked_logits(ref.relu_weighted_logits(q, w, k, scale), ks, ke)
    magnitude = ref.masked_logits(ref.relu_weighted_logits(q, w.abs(), k, scale), ks, ke)
    found = _agree(theirs, ours, magnitude, topk)
    chosen = emulated.contiguous_tiled_topk(
        q_fp8=q, weights=w, kv_fp8=(k, scale), topk=topk, supertile_k=512,
        metadata=emulated.IndexerContiguousMetadata(k_start=ks, k_end=ke))
    found["tiled_topk_problems"] = _selection_problems(theirs, chosen, magnitude, topk)[:5]
    found["ok"] = found["ok"] and not found["tiled_topk_problems"]
    return found


def _agree(theirs, ours, magnitude, topk: int) -> dict:
    """Same -inf positions, logits within TOLERANCE of the row magnitude, and b12x's reference
    top-k (stable descending sort: its _reference_topk_indices_from_logits) a top-k of ours."""
    import torch

    same_mask = bool(torch.equal(torch.isinf(theirs), torch.isinf(ours)))
    finite = torch.isfinite(ours)
    scale = magnitude.where(finite, magnitude.new_zeros(())).amax(1, keepdim=True).clamp_min(1e-30)
    error = float(((theirs - ours).abs() / scale).where(finite, ours.new_zeros(())).max())
    order = torch.argsort(theirs, dim=1, descending=True, stable=True)[:, :topk]
    picked = torch.where(torch.isfinite(theirs.gather(1, order)), order, torch.full_like(order, -1))
    problems = _selection_problems(ours, picked, magnitude, topk)
    return {"same_inf_positions": same_mask, "max_relative_error": error, "topk_problems": problems[:5],
            "ok": same_mask and error <= TOLERANCE and not problems}


def _selection_problems(logits, chosen, magnitude, topk: int) -> list[str]:
    from dsa_image.runtime import indexer_reference as ref

    found = []
    finite = magnitude.isfinite()
    scale = magnitude.where(finite, magnitude.new_zeros(())).amax(1)
    for row in range(logits.shape[0]):
        problems = ref.selection_problems(chosen[row].cpu(), logits[row], topk, float(TOLERANCE * scale[row]))
        found += [f"row {row}: {p}" for p in problems]
    return found


def check_schedules(emulated, module) -> dict:
    import torch

    gen = torch.Generator().manual_seed(SEED + 2)
    mismatches, compared = [], 0
    for rows, columns in ((1, 1), (3, 1), (8, 1), (64, 1), (256, 1), (300, 1), (8, 2), (0, 1)):
        lens = torch.randint(0, 70000, (rows, columns), generator=gen, dtype=torch.int32).to(DEVICE)
        lens = lens[:, 0].contiguous() if columns == 1 else lens
        want = emulated.build_paged_mqa_schedule_metadata(lens, 64, 132)
        for builder in ("build_paged_mqa_schedule_metadata_triton", "build_paged_mqa_schedule_metadata_torch"):
            out = torch.empty((133, 2), dtype=torch.int32, device=DEVICE)
            got = getattr(module, builder)(lens, block_kv=64, num_sms=132, pages_per_split=4, out=out)
            compared += 1
            if not torch.equal(got, want):
                mismatches.append(f"{builder}, lens {tuple(lens.shape)}")
    return {"compared": compared, "mismatches": mismatches, "ok": not mismatches}


def check_constants(release, indexer_dir: Path) -> dict:
    from dsa_image.build import b12x_api

    files = {f"{release.package}.{p.stem}": p.read_text() for p in indexer_dir.glob("*.py")}
    expected = release.wheel_constants()
    mismatches = b12x_api.constant_mismatches(files, expected)
    return {"checked": len(expected), "mismatches": mismatches, "ok": not mismatches}
