"""Run the DSA indexer kernels this image serves with on this GPU, against the torch reference.

    docker run --rm --gpus all IMAGE selftest [--kernels auto|b12x|deepgemm] [--json FILE|-]
    python -m dsa_image.runtime.selftest ...

The kernels are those the image uses on the GPU: b12x on compute capability 12.0/12.1 (through
the overlay's b12x_indexer, as vLLM calls it), DeepGEMM on 9.0 and 10.x (vLLM's bundled
fp8_mqa_logits / fp8_paged_mqa_logits, called as the installed vLLM release calls them), each
followed by the top-k vLLM runs after it: on decode, the kernel the installed release chooses on
this GPU (0.33.0: vLLM's own get_indexer_topk("auto"); 0.24.0: its inline rule), named in the
table's top-k kernel column. They run on seeded inputs (decode batches up to a
65,536-token context, a prefill shorter than the top-k, and a long prefill over more keys than
one b12x supertile) and are compared with dsa_image.runtime.indexer_reference on up to 256 rows per case:

- max error: the largest |kernel - reference| logit, relative to the row's magnitude
  (sum over heads of |weight| * relu(q.k), times the key's scale), for kernels that return
  logits; at most 2^-7 (a bf16 rounding of the weights is 2^-9);
- top-k agreement: the share of the reference's top-k positions the kernel chose too. Every
  position chosen differently must be a near-tie: within 2^-7 of the row's magnitude of the
  k-th logit. Anything else is a mismatch.

Exit codes: --help lists them (EXIT_CODES).

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

from dsa_image.core import status

OK, MISMATCH, USAGE, REFUSED, NO_GPU, ERROR = (status.SUCCESS, status.FAILED, status.USAGE, status.REFUSED,
                                              status.NO_GPU, status.CRASHED)
BROKEN_ENV = status.ENVIRONMENT  # torch or vLLM missing or unreadable: not a kernel's fault
EXIT_CODES = status.epilog(
    (OK, "every kernel agrees with the reference"),
    (MISMATCH, "mismatch: a kernel disagrees with the reference"),
    USAGE,
    (REFUSED, "refused: the kernels asked for have no code for this GPU, or the self-test does not cover them here "
              "(DeepGEMM under vLLM 0.33.0 on the sm_100 family: MX-scaled inputs)"),
    (NO_GPU, "no NVIDIA GPU visible (torch.cuda sees none)"),
    (BROKEN_ENV, "the environment that serves (torch, vLLM) is missing or broken"),
    (ERROR, "a kernel raised (the table says which)"))
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
    topk_kernel: str | None = None  # the top-k the kernels ran (decode: as vLLM chose it)
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

    from dsa_image.runtime import indexer_reference as ref

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

    from dsa_image.runtime import indexer_reference as ref

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
    from dsa_image.runtime import indexer_reference as ref

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
    from dsa_image.runtime import indexer_reference as ref

    scale = magnitude.where(magnitude.isfinite(), magnitude.new_zeros(())).amax(1).clamp_min(1e-30)
    valid = ref_logits.isfinite()
    max_error: float | None = None
    problems: list[str] = []
    if logits is not None:
        got = logits[rows, : ref_logits.shape[1]].float()
        err = ((got - ref_logits).abs() / scale[:, None]).where(valid, got.new_zeros(()))
        max_error = float(err.max())
        if max_error > TOLERANCE:
            problems.append(f"logit error {max_error:.2e} > {TOLERANCE:.2e}")
    wanted = ref.topk_positions(ref_logits, case.topk).cpu()
    shares = []
    for i, row in enumerate(rows):
        chosen = positions[row].cpu()
        shares.append(ref.agreement(chosen, wanted[i]))
        for problem in ref.selection_problems(chosen, ref_logits[i], case.topk, float(TOLERANCE * scale[i])):
            problems.append(f"row {row}: {problem}")
    return {"max_error": max_error, "problems": problems, "agreement": statistics.fmean(shares),
            "min_agreement": min(shares)}


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
    result.topk_kernel = getattr(kernels, "last_topk", None)
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
    lines = ["| case | kernel | top-k kernel | shapes | max error | top-k agreement (min row) | time "
             "| result |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        error = "n/a" if r.max_error is None else f"{r.max_error:.1e}"
        verdict = "ok" if r.passed else ("ERROR: " + r.error if r.error else "MISMATCH: " + r.problems[0])
        lines.append(f"| {r.case} | {r.kernel} | {r.topk_kernel or 'n/a'} | {r.shapes} | {error} | "
                     f"{r.agreement:.4%} ({r.min_agreement:.2%}) | {r.seconds * 1e3:.2f} ms | {verdict} |")
    return "\n".join(lines)


# -- the kernels ------------------------------------------------------------------------------


# The decode top-k. Both releases rank the decode logits with vLLM's top-k kernels, whichever
# kernels computed them (b12x or DeepGEMM), but choose the kernel differently: the self-test
# chooses as the installed release does on this GPU and records the choice in the report.

# vLLM 0.24.0's inline choice (overlay/vllm-0.24.0/.../sparse_attn_indexer.py:374-422): no
# module to call, so mirrored here and pinned to that source text by the tests.
TOPK_0_24_0_SIZES = (512, 1024, 2048)
TOPK_0_24_0_COOPERATIVE_ROWS = 32


def topk_backend_0_24_0(rows: int, topk: int, row_stride: int, capability: tuple[int, int]) -> str:
    """The decode top-k vLLM 0.24.0 runs (on CUDA, as the self-test always is): cooperative_topk
    for up to 32 rows with TMA-aligned rows on 9.0+ (sm_12x included: 0.24.0 does not exclude
    it), persistent_topk past that, top_k_per_row_decode for other top-k sizes."""
    if topk not in TOPK_0_24_0_SIZES:
        return "per_row"
    if rows <= TOPK_0_24_0_COOPERATIVE_ROWS and row_stride % 4 == 0 and tuple(capability) >= (9, 0):
        return "cooperative"
    return "persistent"


def _topk_0_24_0(logits, seq_lens, out, topk: int, max_seq_len: int) -> str:
    import torch

    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.sparse_attn_indexer import RADIX_TOPK_WORKSPACE_SIZE

    rows = logits.shape[0]
    capability = torch.cuda.get_device_capability(logits.device)
    backend = topk_backend_0_24_0(rows, topk, logits.stride(0), capability)
    if backend == "per_row":
        ops.top_k_per_row_decode(logits, 1, seq_lens, out, rows, logits.stride(0), logits.stride(1), topk)
        return backend
    workspace = torch.empty(RADIX_TOPK_WORKSPACE_SIZE, dtype=torch.uint8, device=logits.device)
    getattr(torch.ops._C, f"{backend}_topk")(logits, seq_lens, out, workspace, topk, max_seq_len)
    return backend


# vLLM 0.33.0 chooses in vllm/model_executor/layers/indexer_topk.py (get_indexer_topk :137,
# SparseIndexerTopk._resolve_auto :236, _cooperative_constraints :255: cooperative_topk only on
# 9.0+ outside the sm_12x family, up to AUTO_COOPERATIVE_MAX_ROWS = 64 rows; deep_select is
# opt-in, never "auto"). The overlay's sparse_attn_indexer.py:959-966 calls
# get_indexer_topk(topk_backend)(logits, seq_lens, next_n, topk_indices, topk_tokens, max_seq_len)
# with kernel_config.sparse_indexer_topk_backend, "auto" unless the user sets it: the self-test
# calls that same object, so the choice is vLLM's own on every GPU and follows the release.
TOPK_0_33_0_BACKEND = "auto"


def indexer_topk_decode(indexer_topk, workspace, logits, seq_lens, out, topk: int, max_seq_len: int) -> str:
    """Run vLLM's decode top-k as sparse_attn_indexer does (next_n 1: one query row per request);
    returns the backend it resolved. indexer_topk, workspace: vLLM's modules."""
    if not workspace.is_workspace_manager_initialized():
        # The engine's GPUModelRunner makes it (workspace.py:307); cooperative and persistent
        # top-k take their scratch from it, and outside the engine nothing else does.
        workspace.init_workspace_manager(logits.device)
    selector = indexer_topk.get_indexer_topk(TOPK_0_33_0_BACKEND)
    backend = selector.resolve_backend(logits, topk, logits.shape[0])
    selector(logits, seq_lens, 1, out, topk, max_seq_len)
    return backend


def _topk_0_33_0(logits, seq_lens, out, topk: int, max_seq_len: int) -> str:
    from vllm.model_executor.layers import indexer_topk
    from vllm.v1.worker import workspace

    return indexer_topk_decode(indexer_topk, workspace, logits, seq_lens, out, topk, max_seq_len)


DECODE_TOPK = {"0.24.0": _topk_0_24_0, "0.33.0": _topk_0_33_0}


def vllm_decode_topk(version: str, logits, seq_lens, topk: int, max_seq_len: int) -> tuple:
    """(positions, backend): the decode top-k the installed vLLM release runs after the logits.
    The output starts at -1, as vLLM pre-fills topk_indices_buffer (rows shorter than topk)."""
    if version not in DECODE_TOPK:
        raise RuntimeError(f"vLLM {version}: the self-test knows how vLLM {', '.join(DECODE_TOPK)} "
                           "choose the decode top-k, not this release; add it to DECODE_TOPK")
    import torch

    out = torch.full((logits.shape[0], topk), -1, dtype=torch.int32, device=logits.device)
    return out, DECODE_TOPK[version](logits, seq_lens, out, topk, max_seq_len)


@dataclass(frozen=True)
class DeepGemmCalls:
    """How one vLLM release calls DeepGEMM's indexer logits.

    `clean_logits`: the wrappers take it (vLLM passes False); without it, fp8_fp4_mqa_logits
    takes max_seqlen_k and returns compressed rows. `mqa_params`, `paged_params`: the parameter
    names of fp8_fp4_mqa_logits and fp8_fp4_paged_mqa_logits (vllm/utils/deep_gemm.py), checked
    against the installed wrappers, so a vLLM that changed them fails naming them instead of
    with a TypeError. The decode top-k after them is DECODE_TOPK's."""

    clean_logits: bool
    mqa_params: tuple[str, ...]
    paged_params: tuple[str, ...]


_MQA = ("q", "kv", "weights", "cu_seqlen_ks", "cu_seqlen_ke")
_PAGED = ("q", "kv_cache", "weights", "context_lens", "block_tables", "schedule_metadata", "max_model_len")

DEEPGEMM_CALLS = {
    # utils/deep_gemm.py:499-506, :565-574 take clean_logits; sparse_attn_indexer.py:251-258,
    # :361-370 pass False (full-width logits, the columns out of each row's range left as they
    # are: the top-k reads [ks, ke) / [0, seq_len) only).
    "0.24.0": DeepGemmCalls(True, _MQA + ("clean_logits",), _PAGED + ("clean_logits",)),
    # utils/deep_gemm.py:638-645, :738-747: no clean_logits (the tail is never cleaned);
    # prefill takes max_seqlen_k and returns compressed rows, column j being key ks[i] + j,
    # ranked within [0, ke - ks) (sparse_attn_indexer.py:722-773); SM100's bf16 weights and
    # logits are adapted around both calls (no-ops elsewhere; the self-test refuses sm_100 on
    # 0.33.0, see mx_scales_refusal).
    "0.33.0": DeepGemmCalls(False, _MQA + ("max_seqlen_k",), _PAGED + ("indices",)),
}


def installed_vllm_version() -> str:
    """The importable vLLM's version, from the dist-info beside it."""
    import importlib.util
    from pathlib import Path

    from dsa_image.core.dist_info import installed_vllm_version as read

    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise ImportError("no vllm installed: the self-test runs in the image's environment")
    return read(Path(spec.origin).parent.parent)


def deepgemm_calls(version: str, mqa_wrapper, paged_wrapper) -> DeepGemmCalls:
    """DEEPGEMM_CALLS[version], once the installed wrappers are seen to take exactly its
    parameters; fails closed otherwise."""
    import inspect

    if version not in DEEPGEMM_CALLS:
        raise RuntimeError(f"vLLM {version}: the self-test knows how vLLM {', '.join(DEEPGEMM_CALLS)} "
                           "call DeepGEMM's indexer kernels, not this release; add it to DEEPGEMM_CALLS")
    calls = DEEPGEMM_CALLS[version]
    for wrapper, expected in ((mqa_wrapper, calls.mqa_params), (paged_wrapper, calls.paged_params)):
        found = tuple(inspect.signature(wrapper).parameters)
        if found != expected:
            raise RuntimeError(f"vLLM {version}: {wrapper.__name__}({', '.join(found)}), not the "
                               f"({', '.join(expected)}) vLLM {version} calls; DEEPGEMM_CALLS is out of date")
    return calls


def paged_logits(calls: DeepGemmCalls, dg, upcast, q, cache, weights, lens, table, schedule, width: int):
    """fp8_fp4_paged_mqa_logits as the release's vLLM calls it (dg: vllm.utils.deep_gemm,
    upcast: sparse_attn_indexer.as_fp32_logits); the columns past each row's length are left
    uncleaned on both releases, as vLLM leaves them."""
    if calls.clean_logits:
        return dg.fp8_fp4_paged_mqa_logits((q, None), cache, weights, lens, table, schedule,
                                           max_model_len=width, clean_logits=False)
    q_scale, weights = dg.mqa_logits_mx_inputs(q, None, weights)
    logits = dg.fp8_fp4_paged_mqa_logits((q, q_scale), cache, weights, lens, table, schedule,
                                         max_model_len=width)
    return upcast(logits, lens.view(-1))


def prefill_logits(calls: DeepGemmCalls, dg, upcast, q, k, k_scale, weights, ks, ke) -> tuple:
    """fp8_fp4_mqa_logits as the release's vLLM calls it: (logits, starts, ends), the range of
    each logits row that top_k_per_row_prefill then ranks."""
    if calls.clean_logits:
        return dg.fp8_fp4_mqa_logits((q, None), (k, k_scale), weights, ks, ke, clean_logits=False), ks, ke
    ends = ke - ks
    q_scale, weights = dg.mqa_logits_mx_inputs(q, None, weights)
    logits = dg.fp8_fp4_mqa_logits((q, q_scale), (k, k_scale), weights, ks, ke, int(ends.max()))
    return upcast(logits, ends), ends.new_zeros(ends.shape), ends


def mx_scales_refusal(version: str, dg) -> str | None:
    """Why the self-test does not check DeepGEMM here, or None when it does.

    Where vLLM's deep_gemm.mqa_logits_use_mx_scales() holds (0.33.0 on the sm_100 family,
    deep_gemm.py:596-607), vLLM writes the indexer K cache as MXFP8, each token's power-of-two
    scale stored as four UE8M0 bytes (the overlay's sparse_attn_indexer.py:575-581,
    indexer_k_quant_and_cache with "mxfp8"), and hands DeepGEMM int32 packed UE8M0 K scales
    (:724-726), bf16 weights and bf16 logits. The self-test's inputs and reference use fp32
    scales, and an MX variant has never run on an sm_100 GPU: it refuses rather than feed the
    kernels a format vLLM never gives them there, or ship a check whose verdict no one has seen.
    Asking vLLM, not the capability, keeps the refusal to the releases and GPUs that use MX."""
    uses_mx = getattr(dg, "mqa_logits_use_mx_scales", None)  # 0.24.0 has none: fp32 scales
    if uses_mx is None or not uses_mx():
        return None
    return (f"vLLM {version} runs DeepGEMM's indexer on this GPU with MX inputs (an MXFP8 K cache "
            "whose per-token scales are UE8M0 bytes, int32 packed K scales, bf16 weights and "
            "logits: vllm.utils.deep_gemm.mqa_logits_use_mx_scales() is True); the self-test "
            "builds fp32-scaled inputs and has not been validated on the sm_100 family, so it does "
            "not check these kernels here. Expected: compute capability 9.0 (or 10.x under vLLM "
            "0.24.0). Check serving on this GPU end to end instead (scripts/smoke.py).")


def _vllm_deep_gemm():
    from vllm.utils import deep_gemm

    return deep_gemm


class _InstalledReleaseKernels:
    """Kernels called as the installed vLLM release calls them: its version, read once."""

    last_topk: str | None = None  # the top-k kernel the last call ran, for the report

    def __init__(self, version: str | None = None):
        self.version = version  # None: read from the installed vLLM on first use

    def _version(self) -> str:
        if self.version is None:
            self.version = installed_vllm_version()
        return self.version


class DeepGemmKernels(_InstalledReleaseKernels):
    """vLLM's bundled DeepGEMM indexer kernels, called as the installed vLLM calls them."""

    family = "deepgemm"

    def __init__(self, calls: DeepGemmCalls | None = None, version: str | None = None):
        super().__init__(version)
        self.calls = calls  # None: read from the installed vLLM on first use

    def check_covered(self) -> None:
        """Refused when the self-test cannot give these kernels the inputs vLLM gives them here."""
        refusal = mx_scales_refusal(self._version(), _vllm_deep_gemm())
        if refusal:
            raise Refused(refusal)

    def kernel_name(self, kind: str) -> str:
        return {"decode": "fp8_paged_mqa_logits + vLLM top-k",
                "prefill": "fp8_mqa_logits + top_k_per_row_prefill"}[kind]

    def _calls(self, dg) -> DeepGemmCalls:
        if self.calls is None:
            self.calls = deepgemm_calls(self._version(), dg.fp8_fp4_mqa_logits, dg.fp8_fp4_paged_mqa_logits)
        return self.calls

    def decode(self, inputs: dict, case: Case):
        from vllm.model_executor.layers import sparse_attn_indexer
        from vllm.utils import deep_gemm as dg
        from vllm.utils.platform_utils import num_compute_units

        calls = self._calls(dg)
        lens = inputs["lens"].unsqueeze(-1)
        schedule = dg.get_paged_mqa_logits_metadata(lens, BLOCK_SIZE, num_compute_units(lens.device.index))
        width = inputs["table"].shape[1] * BLOCK_SIZE
        logits = paged_logits(calls, dg, _upcast(sparse_attn_indexer), inputs["q"].unsqueeze(1),
                              inputs["cache"].unsqueeze(-2), inputs["weights"], lens, inputs["table"],
                              schedule, width)
        positions, self.last_topk = vllm_decode_topk(self._version(), logits, lens, case.topk, case.context)
        return logits, positions

    def prefill(self, inputs: dict, case: Case):
        import torch

        from vllm import _custom_ops as ops
        from vllm.model_executor.layers import sparse_attn_indexer
        from vllm.utils import deep_gemm as dg

        # The prefill inputs start every row at key 0 (ks = 0), so 0.33.0's compressed logits
        # columns are key positions, as 0.24.0's are, and compare() reads both alike.
        logits, starts, ends = prefill_logits(self._calls(dg), dg, _upcast(sparse_attn_indexer), inputs["q"],
                                              inputs["k"], inputs["k_scale"], inputs["weights"],
                                              inputs["ks"], inputs["ke"])
        out = torch.empty((case.rows, case.topk), dtype=torch.int32, device=logits.device)
        ops.top_k_per_row_prefill(logits, starts, ends, out, case.rows,
                                  logits.stride(0), logits.stride(1), case.topk)
        self.last_topk = "top_k_per_row_prefill"
        return logits, out


def _upcast(sparse_attn_indexer):
    """0.33.0's as_fp32_logits (SM100's bf16 logits to fp32); 0.24.0 has none and needs none."""
    return getattr(sparse_attn_indexer, "as_fp32_logits", None)


class B12xKernels(_InstalledReleaseKernels):
    """b12x's indexer kernels through the overlay's b12x_indexer, as the sm120 image runs them."""

    family = "b12x"

    def check_covered(self) -> None:
        """b12x's inputs are the same under both releases: nothing to refuse."""

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
        # 0.24.0 gives small batches cooperative_topk on sm_12x too; 0.33.0 never does there
        # (indexer_topk.py:160-163): vllm_decode_topk chooses as the installed release does.
        positions, self.last_topk = vllm_decode_topk(self._version(), logits, lens, case.topk, case.context)
        return logits, positions

    def prefill(self, inputs: dict, case: Case):
        import torch

        from vllm.v1.attention.backends.mla import b12x_indexer

        out = torch.empty((case.rows, case.topk), dtype=torch.int32, device=inputs["q"].device)
        b12x_indexer.prefill_topk(inputs["q"], inputs["weights"], inputs["k"], inputs["k_scale"],
                                  inputs["ks"], inputs["ke"], case.topk, out)
        self.last_topk = "b12x prefill_topk"
        return None, out


# -- choosing, refusing -----------------------------------------------------------------------


class Refused(status.DsaImageError):
    """The kernels asked for have no code for this GPU."""

    exit_code = status.REFUSED


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
    parser = argparse.ArgumentParser(prog="selftest", description=__doc__.splitlines()[0], epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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
        return BROKEN_ENV
    if gpu is None:
        print("selftest: no NVIDIA GPU visible (torch.cuda.is_available() is False): run it with "
              "GPUs, docker run --gpus all IMAGE selftest", file=sys.stderr)
        return NO_GPU
    try:
        kernels = pick_kernels(args.kernels, gpu[1], gpu[0])
        kernels.check_covered()
    except Refused as exc:
        print(f"selftest: refused: {exc}", file=sys.stderr)
        return REFUSED
    except Exception as exc:  # noqa: BLE001 - the image's vLLM is broken or unreadable: one line
        print(f"selftest: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return BROKEN_ENV
    return report(kernels, gpu, args)


def report(kernels, gpu, args, device="cuda:0") -> int:
    try:
        cases = default_cases(_supertile() if kernels.family == "b12x" else 32768)
    except (ImportError, ValueError) as exc:  # the image's vLLM or a variable is broken
        print(f"selftest: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return BROKEN_ENV
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
