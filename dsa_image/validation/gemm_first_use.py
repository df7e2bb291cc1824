"""What a prefill of a new token count pays the first time: cuBLAS's first use of a GEMM kernel.

A prefill past the CUDA graphs' sizes runs eagerly, and cuBLAS (its nvjet kernels on sm_90)
picks a GEMM kernel for the exact token count M: over 512-8,192 at a step of 8, GLM-5's router
alone ran 112 different kernels on the H200. Some first uses of a kernel cost about 2 ms more
than its next call, whatever ran before, and CUDA's module loading does not decide it:
CUDA_MODULE_LOADING=EAGER (every runtime module loaded at start) leaves the excess as it is.
This measures it on GLM-5's own GEMM shapes (recipes/models/glm-5.toml, one GPU: tensor parallel
1), outside vLLM (docs/validation/h200-2026-12-06-gemm-first-use):

  1. warm: every shape at the token counts a server has run before its first request (the CUDA
     graphs' sizes 1-512, the profile run's 8,192, the image warm-up's prefills); --warm-step adds
     every multiple of the step from 512 (a warm-up that prefilled those lengths too);
  2. per probe length (3,000: the warm-start's first request; 3,500: its new-length probe; more):
     each shape once (first), then twice more (warm); the excess is first - warm, summed, and
     `loaded` names the shapes whose first call was more than EXCESS_MS slower;
  3. the kernel each shape ran at each of those token counts (torch.profiler, after the timings:
     cuBLAS picks by shape), so that each probe's slow first calls can be set beside the shapes
     whose kernel at that length no earlier length ran; --sweep-step adds the kernels run at every
     multiple of the step from 512 to 8,192 (how many a shape has), then probes the lengths 3
     past each probe again ("after the sweep").

Each --variant runs in a process of its own with its environment (default: as the machine has
it, and CUDA_MODULE_LOADING=EAGER), which also records the seconds to import torch and create
the context, and the first cuBLAS call.

    python -m dsa_image.validation.gemm_first_use --out DIR [--variant ENV=VALUE ...] \\
        [--sweep-step 8] [--warm-step 256]

The parent is stdlib only; each variant's process needs torch and a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dsa_image.core import status

PROBE_LENGTHS = (3000, 3500, 3001, 2500, 5000, 7000)
# Token counts a server has run GEMMs at before its first request: vLLM's CUDA graph sizes (its
# default list up to 512), the profile run at max_num_batched_tokens (8,192 in the image), and
# the image warm-up's prefills (dsa_image.runtime.warmup.DEFAULT_PREFILL).
GRAPH_SIZES = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))
PROFILE_TOKENS = 8192
DEFAULT_VARIANTS = ("", "CUDA_MODULE_LOADING=EAGER")
EXCESS_MS = 0.5  # a first GEMM this much slower than its warm ones is a slow first use ("loaded")
# After a sweep, each probe length plus this is probed again: a length no call ran, beside one that did.
AFTER_SWEEP_OFFSET = 3
EXIT_CODES = status.epilog((status.SUCCESS, "measured"), (status.FAILED, "a variant's process failed"),
                           status.USAGE)


def gemm_shapes(cfg: dict, tp: int = 1) -> dict[str, tuple[int, int]]:
    """GLM-5's dense GEMMs, name: (K, N) per GPU at tensor parallel `tp`, as vLLM's layers split
    them (the latent projections, the indexer and the router replicated)."""
    heads, h = cfg["num_attention_heads"] // tp, cfg["hidden_size"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    shared = cfg["moe_intermediate_size"] * cfg["n_shared_experts"] // tp
    return {
        "fused_qkv_a_proj": (h, cfg["q_lora_rank"] + cfg["kv_lora_rank"] + rope),
        "q_b_proj": (cfg["q_lora_rank"], heads * (nope + rope)),
        "kv_b_proj": (cfg["kv_lora_rank"], heads * (nope + v)),
        "o_proj": (heads * v, h),
        "indexer.wq_b": (cfg["q_lora_rank"], cfg["index_n_heads"] * cfg["index_head_dim"]),
        "indexer.wk": (h, cfg["index_head_dim"]),
        "indexer.weights_proj": (h, cfg["index_n_heads"]),
        "dense.gate_up_proj": (h, 2 * cfg["intermediate_size"] // tp),
        "dense.down_proj": (cfg["intermediate_size"] // tp, h),
        "shared_experts.gate_up_proj": (h, 2 * shared),
        "shared_experts.down_proj": (shared, h),
        "router": (h, cfg["n_routed_experts"]),
    }


def absorbed_shapes(cfg: dict, tp: int = 1) -> dict[str, tuple[int, int, int]]:
    """MLA's absorbed products, batched over heads: name: (heads, K, N)."""
    heads = cfg["num_attention_heads"] // tp
    return {"absorb.q_nope@W_UK": (heads, cfg["qk_nope_head_dim"], cfg["kv_lora_rank"]),
            "absorb.o@W_UV": (heads, cfg["kv_lora_rank"], cfg["v_head_dim"])}


def warm_lengths(step: int = 0) -> list[int]:
    """A server's token counts before its first request; with `step`, also every multiple of it
    from 512 to 8,192 (a warm-up that prefilled those lengths)."""
    from dsa_image.runtime.warmup import DEFAULT_PREFILL
    return sorted({*GRAPH_SIZES, PROFILE_TOKENS, *DEFAULT_PREFILL, *(range(512, PROFILE_TOKENS, step) if step else ())})


# -- the variant's process (torch) ----------------------------------------------------------------


def measure(cfg: dict, probes: tuple[int, ...], sweep_step: int, warm_step: int = 0) -> dict:
    started = time.perf_counter()
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    context_s = time.perf_counter() - started
    gemm = _gemms(torch, cfg, max(PROFILE_TOKENS, *probes))
    first_call = time.perf_counter()
    gemm[next(iter(gemm))](1)
    torch.cuda.synchronize()
    doc = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(),
           "import_and_context_s": round(context_s, 2),
           "first_cublas_call_s": round(time.perf_counter() - first_call, 3)}
    warm = warm_lengths(warm_step)
    doc["warm_lengths"] = warm
    for m in warm:
        for run in gemm.values():
            run(m)
    torch.cuda.synchronize()
    doc["probes"] = {str(m): _probe(torch, gemm, m) for m in probes}
    sweep = range(512, PROFILE_TOKENS + 1, sweep_step) if sweep_step else ()
    doc["kernels"] = _kernels(torch, gemm, list(dict.fromkeys([*warm, *probes, *sweep])))
    if sweep_step:  # after the sweep: do new lengths still pay?
        doc["after_sweep"] = {str(m + AFTER_SWEEP_OFFSET): _probe(torch, gemm, m + AFTER_SWEEP_OFFSET) for m in probes}
    return doc


def _gemms(torch, cfg: dict, rows: int) -> dict:
    """name: run(M), each a GEMM of the shape on M rows of bf16 inputs made once."""
    bf16, gen = torch.bfloat16, torch.Generator(device="cuda").manual_seed(0)
    runs = {}
    for name, (k, n) in gemm_shapes(cfg).items():
        x = torch.randn(rows, k, device="cuda", dtype=bf16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=bf16, generator=gen) / k ** 0.5
        runs[name] = lambda m, x=x, w=w: torch.nn.functional.linear(x[:m], w)
    for name, (heads, k, n) in absorbed_shapes(cfg).items():
        x = torch.randn(heads, rows, k, device="cuda", dtype=bf16, generator=gen)
        w = torch.randn(heads, k, n, device="cuda", dtype=bf16, generator=gen) / k ** 0.5
        runs[name] = lambda m, x=x, w=w: torch.bmm(x[:, :m], w)
    return runs


def _probe(torch, gemm: dict, m: int) -> dict:
    def timed(run) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        run(m)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    shapes = {}
    for name, run in gemm.items():
        first, warm = timed(run), statistics.median([timed(run), timed(run)])
        shapes[name] = {"first_ms": round(first, 3), "warm_ms": round(warm, 3)}
    excess = {n: s["first_ms"] - s["warm_ms"] for n, s in shapes.items()}
    return {"first_ms": round(sum(s["first_ms"] for s in shapes.values()), 2),
            "warm_ms": round(sum(s["warm_ms"] for s in shapes.values()), 2),
            "excess_ms": round(sum(excess.values()), 2),
            "loaded": sorted(n for n, e in excess.items() if e > EXCESS_MS), "shapes": shapes}


def _kernels(torch, gemm: dict, lengths: list[int]) -> dict:
    """name: {M: the kernels it ran}, from one profile with a spin kernel between GEMMs."""
    from torch.profiler import ProfilerActivity, profile

    order = [(name, m) for name in gemm for m in lengths]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for name, m in order:
            torch.cuda._sleep(100)
            gemm[name](m)
        torch.cuda._sleep(100)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    groups: list[list[str]] = []
    for event in events:
        if "spin" in event.name:
            groups.append([])
        elif groups and "Memset" not in event.name:
            groups[-1].append(event.name)
    if len(groups) != len(order) + 1:
        raise RuntimeError(f"profile: {len(groups) - 1} GEMM groups for {len(order)} GEMMs")
    table: dict[str, dict[str, list[str]]] = {}
    for (name, m), kernels in zip(order, groups, strict=False):
        table.setdefault(name, {})[str(m)] = kernels
    return table


# -- the parent --------------------------------------------------------------------------------------


def new_kernels(kernels: dict, probes: tuple[int, ...], warm: list[int] | None = None) -> dict[str, list[str]]:
    """Per probe length, in the order they ran, the shapes whose kernel there no warm length and
    no earlier probe ran."""
    found = {}
    for index, m in enumerate(probes):
        before = [*map(str, warm_lengths() if warm is None else warm), *map(str, probes[:index])]
        found[str(m)] = sorted(name for name, by_m in kernels.items()
                               if set(by_m[str(m)]) - {k for b in before for k in by_m[b]})
    return found


def slow_against_new(doc: dict, probes: tuple[int, ...]) -> dict[str, int]:
    """Every (probe, shape) counted by two questions: was its first call slow (EXCESS_MS), did it
    run a kernel new to the process?"""
    new = new_kernels(doc["kernels"], probes, doc.get("warm_lengths"))
    counts = {"slow_new": 0, "slow_not_new": 0, "fast_new": 0, "fast_not_new": 0}
    for m in map(str, probes):
        for name in doc["probes"][m]["shapes"]:
            slow = "slow" if name in doc["probes"][m]["loaded"] else "fast"
            counts[f"{slow}_{'new' if name in new[m] else 'not_new'}"] += 1
    return counts


def _probe_line(label: str, m: str, p: dict) -> str:
    return (f"  {label}M={m:>5}: first {p['first_ms']:7.2f} ms  warm {p['warm_ms']:7.2f} ms  "
            f"excess {p['excess_ms']:6.2f} ms  loaded: {', '.join(p['loaded']) or '-'}")


def summary(results: dict) -> list[str]:
    lines = []
    for variant, doc in results["variants"].items():
        doc = {"warm_lengths": results["warm_lengths"], **doc}  # the variant's own, where it has one
        if "error" in doc:
            lines.append(f"{variant or 'default'}: {doc['error']}")
            continue
        lines.append(f"{variant or 'default'}: torch {doc['torch']}, {doc['gpu']}; import and context "
                     f"{doc['import_and_context_s']} s, first cuBLAS call {doc['first_cublas_call_s']} s")
        lines += [_probe_line("", m, p) for m, p in doc["probes"].items()]
        lines += [_probe_line("after the sweep, ", m, p) for m, p in doc.get("after_sweep", {}).items()]
        probes = tuple(results["probes"])
        for m, names in new_kernels(doc["kernels"], probes, doc.get("warm_lengths")).items():
            lines.append(f"  M={m:>5}: a kernel new to the process for: {', '.join(names) or '-'}")
        lines.append(f"  first calls, slow or not against new kernel or not: {slow_against_new(doc, probes)}")
        distinct = {n: len({k for ks in by_m.values() for k in ks}) for n, by_m in doc["kernels"].items()}
        lines.append(f"  distinct kernels per shape over every length profiled: {distinct}")
    return lines


def run_variant(index: int, variant: str, args) -> dict:
    env = dict(os.environ)
    if variant:
        key, _, value = variant.partition("=")
        env[key] = value
    out = Path(args.out) / f"variant-{index}.json"
    cmd = [sys.executable, "-m", "dsa_image.validation.gemm_first_use", "--out", args.out, "--child", str(out),
           "--sweep-step", str(args.sweep_step), "--warm-step", str(args.warm_step), "--probes", ",".join(map(str, args.probes))]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout:g} s"}
    if proc.returncode != 0 or not out.is_file():
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
    return json.loads(out.read_text())


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", action="append",
                        help="ENV=VALUE for one process ('' for the environment as it is); repeatable "
                             f"(default: {', '.join(repr(v) for v in DEFAULT_VARIANTS)})")
    parser.add_argument("--probes", type=lambda s: tuple(int(x) for x in s.split(",")), default=PROBE_LENGTHS)
    parser.add_argument("--sweep-step", type=int, default=0, help="token-count step of the kernel sweep (0: none)")
    parser.add_argument("--warm-step", type=int, default=0,
                        help="also warm every multiple of this from 512 to 8,192 before the probes (0: none)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for each variant's process")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for variant in args.variant or ():
        if variant and "=" not in variant:
            parser.error(f"--variant {variant!r}: expected ENV=VALUE, or '' for the environment as it is")
    return args


def main(argv=None) -> int:
    from dsa_image.build.realwidth_model import facts

    args, cfg = parse_args(argv), facts()
    if args.child:
        Path(args.child).write_text(json.dumps(measure(cfg, args.probes, args.sweep_step, args.warm_step)) + "\n")
        return status.SUCCESS
    Path(args.out).mkdir(parents=True, exist_ok=True)
    variants = args.variant if args.variant is not None else list(DEFAULT_VARIANTS)
    measured = {v: run_variant(i, v, args) for i, v in enumerate(variants)}
    results = {"probes": list(args.probes), "warm_lengths": warm_lengths(args.warm_step),
               "gemm_shapes": gemm_shapes(cfg), "absorbed_shapes": absorbed_shapes(cfg),
               "variants": measured}
    (Path(args.out) / "gemm-first-use.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(summary(results)))
    return status.FAILED if any("error" in d for d in measured.values()) else status.SUCCESS


if __name__ == "__main__":
    sys.exit(main())
