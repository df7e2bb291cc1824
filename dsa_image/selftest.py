"""Run the DSA indexer kernels this image serves with on this GPU, against the torch reference.

    docker run --rm --gpus all IMAGE selftest [--kernels auto|b12x|deepgemm] [--json FILE|-]
    python -m dsa_image.selftest ...

The kernels are those the image uses on the GPU: b12x on compute capability 12.0/12.1 (through
the overlay's b12x_indexer, as vLLM calls it), DeepGEMM on 9.0 and 10.x (vLLM's bundled
fp8_mqa_logits / fp8_paged_mqa_logits), each followed by the top-k vLLM runs after it. They
run on seeded inputs (decode batches up to a 65,536-token context, a prefill shorter than the
top-k, and a long prefill over more keys than one b12x supertile) and are compared with
dsa_image.indexer_reference on up to 256 rows per case:

- max error: the largest |kernel - reference| logit, relative to the row's magnitude
  (sum over heads of |weight| * relu(q.k), times the key's scale), for kernels that return
  logits; at most 2^-7 (a bf16 rounding of the weights is 2^-9);
- top-k agreement: the share of the reference's top-k positions the kernel chose too. Every
  position chosen differently must be a near-tie: within 2^-7 of the row's magnitude of the
  k-th logit. Anything else is a mismatch.

Exit codes:
  0  every kernel agrees with the reference
  1  mismatch: a kernel disagrees with the reference
  2  usage
  3  no NVIDIA GPU visible (torch.cuda sees none)
  4  refused: the kernels asked for have no code for this GPU
  5  a kernel raised (the table says which)

``--break CASE`` replaces one row of that case's kernel output with the first top-k positions:
the self-test's own proof that a wrong kernel fails it (exit 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

OK, MISMATCH, USAGE, NO_GPU, REFUSED, ERROR = 0, 1, 2, 3, 4, 5
TOLERANCE = 2.0 ** -7
BLOCK_SIZE = 64
TIMED_RUNS = 3
B12X_FAMILY = 12


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "decode" or "prefill"
    rows: int  # decode batch, or prefill query rows
    context: int  # decode: the longest context; prefill: keys before the first query row
    heads: int = 32
    topk: int = 2048
    checked_rows: int = 256
    seed: int = 0


@dataclass
class Result:
    case: str
    kernel: str
    shapes: str
    max_error: float | None = None
    agreement: float = 0.0
    min_agreement: float = 0.0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    first_call_seconds: float = 0.0
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and not self.problems


def default_cases(supertile: int = 32768) -> list[Case]:
    """What the image runs in service, small enough for a DGX Spark: the long prefill has more
    keys than one supertile, so b12x folds at least two."""
    return [
        Case("decode-bs32", "decode", 32, 8192),
        Case("decode-bs64-h64", "decode", 64, 16384, heads=64),
        Case("decode-65536", "decode", 4, 65536),
        Case("prefill-short", "prefill", 700, 0),
        Case("prefill-long", "prefill", 2048, supertile + 2048),
    ]


# -- inputs -----------------------------------------------------------------------------------


def decode_inputs(case: Case, device) -> dict:
    import torch

    from dsa_image import indexer_reference as ref

    gen = torch.Generator().manual_seed(case.seed)
    columns = -(-case.context // BLOCK_SIZE)
    lens = torch.randint(case.topk // 2, case.context + 1, (case.rows,), generator=gen, dtype=torch.int32)
    lens[0], lens[-1] = min(100, case.context), case.context
    blocks = case.rows * columns + 1
    table = torch.randperm(blocks, generator=gen)[: case.rows * columns].view(case.rows, columns)
    return dict(
        q=ref.random_fp8((case.rows, case.heads, ref.HEAD_DIM), gen, device),
        weights=ref.random_weights(case.rows, case.heads, gen, device),
        cache=ref.random_cache(blocks, BLOCK_SIZE, gen, device),
        table=table.to(torch.int32).to(device),
        lens=lens.to(device),
    )


def prefill_inputs(case: Case, device) -> dict:
    import torch

    from dsa_image import indexer_reference as ref

    gen = torch.Generator().manual_seed(case.seed)
    keys = case.context + case.rows
    return dict(
        q=ref.random_fp8((case.rows, case.heads, ref.HEAD_DIM), gen, device),
        weights=ref.random_weights(case.rows, case.heads, gen, device),
        k=ref.random_fp8((keys, ref.HEAD_DIM), gen, device),
        k_scale=ref.random_scales(keys, gen, device),
        ks=torch.zeros(case.rows, dtype=torch.int32, device=device),
        ke=torch.arange(case.context + 1, keys + 1, dtype=torch.int32, device=device),
    )


def checked_rows(case: Case) -> list[int]:
    """Up to checked_rows rows spread over the case, the first and last included."""
    n = min(case.rows, case.checked_rows)
    return sorted({round(i * (case.rows - 1) / max(1, n - 1)) for i in range(n)})


# -- the reference ----------------------------------------------------------------------------


def reference(case: Case, inputs: dict, rows: list[int]) -> tuple:
    """(logits, magnitudes) of ``rows``: the reference and the scale its errors are measured in."""
    from dsa_image import indexer_reference as ref

    q, w = inputs["q"][rows], inputs["weights"][rows]
    if case.kind == "decode":
        pages = ref.cache_pages(inputs["cache"])
        table, lens = inputs["table"][rows], inputs["lens"][rows]
        return (ref.paged_logits(q, w, pages, BLOCK_SIZE, table, lens),
                ref.paged_logits(q, w.abs(), pages, BLOCK_SIZE, table, lens))
    k, scale = inputs["k"], inputs["k_scale"]
    ks, ke = inputs["ks"][rows], inputs["ke"][rows]
    return (ref.masked_logits(ref.relu_weighted_logits(q, w, k, scale), ks, ke),
            ref.masked_logits(ref.relu_weighted_logits(q, w.abs(), k, scale), ks, ke))


def compare(case: Case, rows: list[int], logits, positions, ref_logits, magnitude) -> dict:
    """max error, agreement and problems of a kernel's output on ``rows``."""
    from dsa_image import indexer_reference as ref

    scale = magnitude.where(magnitude.isfinite(), magnitude.new_zeros(())).amax(1).clamp_min(1e-30)
    valid = ref_logits.isfinite()
    out = {"max_error": None, "problems": []}
    if logits is not None:
        got = logits[rows, : ref_logits.shape[1]].float()
        err = ((got - ref_logits).abs() / scale[:, None]).where(valid, got.new_zeros(()))
        out["max_error"] = float(err.max())
        if out["max_error"] > TOLERANCE:
            out["problems"].append(f"logit error {out['max_error']:.2e} > {TOLERANCE:.2e}")
    wanted = ref.topk_positions(ref_logits, case.topk).cpu()
    shares = []
    for i, row in enumerate(rows):
        chosen = positions[row].cpu()
        shares.append(ref.agreement(chosen, wanted[i]))
        for problem in ref.selection_problems(chosen, ref_logits[i], case.topk, float(TOLERANCE * scale[i])):
            out["problems"].append(f"row {row}: {problem}")
    out["agreement"], out["min_agreement"] = statistics.fmean(shares), min(shares)
    return out


# -- running ----------------------------------------------------------------------------------


def run_case(kernels, case: Case, device, broken: bool = False) -> Result:
    inputs = decode_inputs(case, device) if case.kind == "decode" else prefill_inputs(case, device)
    result = Result(case.name, kernels.kernel_name(case.kind), _shapes(case))
    try:
        (logits, positions), first, warm = _timed(getattr(kernels, case.kind), inputs, case, device)
    except Exception as exc:  # noqa: BLE001 - reported in the table, the other cases run
        result.error = f"{type(exc).__name__}: {exc}"[:500]
        return result
    result.first_call_seconds, result.seconds = first, warm
    rows = checked_rows(case)
    if broken:
        positions = _broken(positions, case, inputs, rows)
    ref_logits, magnitude = reference(case, inputs, rows)
    found = compare(case, rows, logits, positions, ref_logits, magnitude)
    result.max_error, result.problems = found["max_error"], found["problems"]
    result.agreement, result.min_agreement = found["agreement"], found["min_agreement"]
    return result


def _timed(call, inputs, case, device):
    import torch

    def once():
        start = time.perf_counter()
        output = call(inputs, case)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
        return output, time.perf_counter() - start

    output, first = once()
    warm = [once()[1] for _ in range(TIMED_RUNS)]
    return output, first, statistics.median(warm)


def _broken(positions, case: Case, inputs: dict, rows: list[int]):
    """One checked row that has more keys than topk gets the first topk positions instead."""
    import torch

    lengths = inputs["lens"] if case.kind == "decode" else inputs["ke"] - inputs["ks"]
    row = next((r for r in rows if int(lengths[r]) > case.topk), rows[-1])
    positions = positions.clone()
    positions[row] = torch.arange(case.topk, dtype=positions.dtype, device=positions.device)
    return positions


def _shapes(case: Case) -> str:
    if case.kind == "decode":
        return f"{case.rows} rows x {case.heads} heads, context <= {case.context}, top-{case.topk}"
    return f"{case.rows} rows x {case.heads} heads, {case.context + case.rows} keys, top-{case.topk}"


def run_suite(kernels, cases: list[Case], device, broken: str | None = None) -> tuple[list[Result], int]:
    results = [run_case(kernels, case, device, broken == case.name) for case in cases]
    if any(r.error for r in results):
        return results, ERROR
    return results, OK if all(r.passed for r in results) else MISMATCH


def format_table(results: list[Result]) -> str:
    lines = ["| case | kernel | shapes | max error | top-k agreement (min row) | time | result |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        error = "n/a" if r.max_error is None else f"{r.max_error:.1e}"
        verdict = "ok" if r.passed else ("ERROR: " + r.error if r.error else "MISMATCH: " + r.problems[0])
        lines.append(f"| {r.case} | {r.kernel} | {r.shapes} | {error} | {r.agreement:.4%} "
                     f"({r.min_agreement:.2%}) | {r.seconds * 1e3:.2f} ms | {verdict} |")
    return "\n".join(lines)


# -- the kernels ------------------------------------------------------------------------------


def vllm_decode_topk(logits, seq_lens, topk: int, max_seq_len: int):
    """The top-k vLLM 0.24.0 runs after the decode logits (sparse_attn_indexer.py)."""
    import torch

    from vllm.model_executor.layers.sparse_attn_indexer import RADIX_TOPK_WORKSPACE_SIZE

    out = torch.empty((logits.shape[0], topk), dtype=torch.int32, device=logits.device)
    workspace = torch.empty(RADIX_TOPK_WORKSPACE_SIZE, dtype=torch.uint8, device=logits.device)
    cooperative = logits.shape[0] <= 32 and logits.stride(0) % 4 == 0
    op = torch.ops._C.cooperative_topk if cooperative else torch.ops._C.persistent_topk
    op(logits, seq_lens, out, workspace, topk, max_seq_len)
    return out


class DeepGemmKernels:
    """vLLM's bundled DeepGEMM indexer kernels, called as vLLM 0.24.0 calls them."""

    family = "deepgemm"

    def kernel_name(self, kind: str) -> str:
        return {"decode": "fp8_paged_mqa_logits + vLLM top-k",
                "prefill": "fp8_mqa_logits + top_k_per_row_prefill"}[kind]

    def decode(self, inputs: dict, case: Case):
        from vllm.utils.deep_gemm import fp8_fp4_paged_mqa_logits, get_paged_mqa_logits_metadata
        from vllm.utils.platform_utils import num_compute_units

        lens = inputs["lens"].unsqueeze(-1)
        schedule = get_paged_mqa_logits_metadata(lens, BLOCK_SIZE, num_compute_units(lens.device.index))
        width = inputs["table"].shape[1] * BLOCK_SIZE
        logits = fp8_fp4_paged_mqa_logits(
            (inputs["q"].unsqueeze(1), None), inputs["cache"].unsqueeze(-2), inputs["weights"], lens,
            inputs["table"], schedule, max_model_len=width, clean_logits=False)
        return logits, vllm_decode_topk(logits, lens, case.topk, case.context)

    def prefill(self, inputs: dict, case: Case):
        import torch

        from vllm import _custom_ops as ops
        from vllm.utils.deep_gemm import fp8_fp4_mqa_logits

        logits = fp8_fp4_mqa_logits((inputs["q"], None), (inputs["k"], inputs["k_scale"]),
                                    inputs["weights"], inputs["ks"], inputs["ke"], clean_logits=False)
        out = torch.empty((case.rows, case.topk), dtype=torch.int32, device=logits.device)
        ops.top_k_per_row_prefill(logits, inputs["ks"], inputs["ke"], out, case.rows,
                                  logits.stride(0), logits.stride(1), case.topk)
        return logits, out


class B12xKernels:
    """b12x's indexer kernels through the overlay's b12x_indexer, as the sm120 image runs them."""

    family = "b12x"

    def kernel_name(self, kind: str) -> str:
        return {"decode": "b12x paged_decode_logits + vLLM top-k",
                "prefill": "b12x contiguous_tiled_topk"}[kind]

    def decode(self, inputs: dict, case: Case):
        import inspect

        import torch

        from vllm.utils.platform_utils import num_compute_units
        from vllm.v1.attention.backends.mla import b12x_indexer

        lens, table = inputs["lens"].unsqueeze(-1), inputs["table"]
        sms = num_compute_units(lens.device.index)
        out = torch.empty((sms + 1, 2), dtype=torch.int32, device=lens.device)
        schedule = b12x_indexer.build_schedule_metadata(lens, table, BLOCK_SIZE, sms, out)
        args = [inputs["q"], inputs["weights"], inputs["cache"], table, lens, schedule]
        if "active_width" in inspect.signature(b12x_indexer.decode_logits).parameters:
            # The vLLM 0.24.0 overlay passes the batch's width; 0.33.0's lets b12x compute it.
            args += [torch.full((1,), case.context, dtype=torch.int32, device=lens.device), BLOCK_SIZE]
        logits = b12x_indexer.decode_logits(*args)
        return logits, vllm_decode_topk(logits, lens, case.topk, case.context)

    def prefill(self, inputs: dict, case: Case):
        import torch

        from vllm.v1.attention.backends.mla import b12x_indexer

        out = torch.empty((case.rows, case.topk), dtype=torch.int32, device=inputs["q"].device)
        b12x_indexer.prefill_topk(inputs["q"], inputs["weights"], inputs["k"], inputs["k_scale"],
                                  inputs["ks"], inputs["ke"], case.topk, out)
        return None, out


# -- choosing, refusing -----------------------------------------------------------------------


class Refused(Exception):
    """The kernels asked for have no code for this GPU."""


def pick_kernels(choice: str, capability: tuple[int, int], gpu: str):
    found = f"this GPU ({gpu}) is compute capability {capability[0]}.{capability[1]}"
    if choice == "auto":
        choice = "b12x" if capability[0] == B12X_FAMILY else "deepgemm"
    if choice == "b12x" and capability[0] != B12X_FAMILY:
        raise Refused(f"the b12x kernels run on compute capability 12.0/12.1 (RTX PRO 6000, RTX 50, "
                      f"DGX Spark); {found}. Without --kernels the self-test runs the kernels this GPU uses.")
    if choice == "deepgemm" and not (tuple(capability) == (9, 0) or capability[0] == 10):
        raise Refused(f"DeepGEMM's indexer kernels run on compute capability 9.0 and 10.x; {found}.")
    return B12xKernels() if choice == "b12x" else DeepGemmKernels()


def gpu_or_none():
    """(name, capability) of GPU 0, or None when torch sees no CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0))


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="selftest", description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", choices=("auto", "b12x", "deepgemm"), default="auto",
                        help="auto (default): the kernels the image uses on this GPU")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON (- for stdout)")
    parser.add_argument("--break", dest="broken", metavar="CASE",
                        help="corrupt one row of CASE's kernel output (proves a mismatch fails)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return OK if exc.code in (0, None) else USAGE
    try:
        gpu = gpu_or_none()
    except ImportError as exc:  # run outside the image, in a Python without torch
        print(f"selftest: error: {exc}: the self-test needs the environment that serves (torch and vLLM); "
              "run it in the image: docker run --gpus all IMAGE selftest", file=sys.stderr)
        return ERROR
    if gpu is None:
        print("selftest: no NVIDIA GPU visible (torch.cuda.is_available() is False): run it with "
              "GPUs, docker run --gpus all IMAGE selftest", file=sys.stderr)
        return NO_GPU
    try:
        kernels = pick_kernels(args.kernels, gpu[1], gpu[0])
    except Refused as exc:
        print(f"selftest: refused: {exc}", file=sys.stderr)
        return REFUSED
    return report(kernels, gpu, args)


def report(kernels, gpu, args, device="cuda:0") -> int:
    try:
        cases = default_cases(_supertile() if kernels.family == "b12x" else 32768)
    except (ImportError, ValueError) as exc:  # the image's vLLM or a variable is broken
        print(f"selftest: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return ERROR
    if args.broken and args.broken not in {c.name for c in cases}:
        print(f"selftest: --break {args.broken}: no such case ({', '.join(c.name for c in cases)})",
              file=sys.stderr)
        return USAGE
    results, code = run_suite(kernels, cases, device, args.broken)
    print(f"DSA indexer self-test: {kernels.family} kernels on {gpu[0]} "
          f"(compute capability {gpu[1][0]}.{gpu[1][1]})")
    print(format_table(results))
    print("SELFTEST:", {OK: "PASS", MISMATCH: "MISMATCH", ERROR: "ERROR"}[code])
    if args.json:
        doc = {"gpu": gpu[0], "capability": list(gpu[1]), "kernels": kernels.family,
               "exit_code": code, "results": [{**asdict(r), "passed": r.passed} for r in results]}
        _write_json(doc, args.json)
    return code


def _supertile() -> int:
    from vllm.v1.attention.backends.mla import b12x_indexer

    return b12x_indexer.supertile_k()


def _write_json(doc: dict, target: str) -> None:
    text = json.dumps(doc)
    if target == "-":
        print(text)
    else:
        with open(target, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
