"""The overlay's b12x path end to end on a GPU without b12x kernels, against a dense reference.

b12x's kernels run only on compute capability 12.x. Everything else of the overlay's b12x path
runs here for real (on an H200): vLLM's indexer metadata builder with b12x on, the dispatch in
``sparse_attn_indexer``, vLLM's key gather and decode top-k kernels, with ``emulation/b12x``
in b12x's place. For each case the top-k positions the overlay writes for every query token
are compared with a dense reference of the whole indexer computed from the batch's description
alone: a token at position p sees its request's positions [0, p], read from the paged cache
through the request's row of the runner's block table. The emulation and the reference share
dsa_image.runtime.indexer_reference's bit-reproducible math, so the sets must be equal, not close. The
one freedom admitted: vLLM's decode top-k may take any of several logits equal to the k-th.

Also checked: the production start-up check refuses this GPU with the emulation loaded (the
harness then bypasses that one check in its own process); the emulation against b12x's own
reference functions and schedule builder, loaded from the installed b12x wheel; vLLM's
workspace, reserved as its profiling run does and then locked, never asked to grow (the
"Workspace is locked" failure); the self-test's b12x branch on the emulation.

The vLLM base is the installed vLLM's (0.24.0 or 0.33.0; ``--vllm`` asserts it), and SITE must
hold the b12x release that base pins (0.30.2 or 1.5.1), for which the emulation then stands in.
The cases are the same on both bases but two: vLLM 0.33.0's runner hands the metadata builder
its own block-table width, so the runner's table cannot grow past the builder's buffer there;
the "grown_table_*" cases of 0.24.0 become "full_width_table_*" (the longest context in the
table's last column). The prefills' small supertile is set through the base's b12x variable.

    PYTHONPATH=emulation:SITE:REPO python -m dsa_image.validation.b12x_glue --model DIR --json OUT \
        [--vllm 0.33.0]

Exits SUCCESS when every check passes, else FAILED (--help: EXIT_CODES). Needs a CUDA GPU,
torch and vLLM with the overlay.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field

import numpy as np

from dsa_image.validation import batches as B
from dsa_image.core import status

EXIT_CODES = status.epilog((status.SUCCESS, "every check passes"), (status.FAILED, "a check failed"), status.USAGE)
SEED = 20261201
TOPK = 2048
HEAD_DIM = 128
PREFIX = "model.layers.0.self_attn.indexer.k_cache"
LONG_MAX_MODEL_LEN = 65536
# Where everything runs; a dry run of the harness's own code on the CPU sets "cpu".
DEVICE = "cuda"
# vLLM 0.24.0: the builder's expanded table holds cdiv(8192, 64) + 8 slack columns; the
# runner's is 3 wider and the longest context uses its last column.
GROWN_TABLE_TOKENS = (8192 // 64 + 8 + 3) * 64
# vLLM 0.33.0: the runner's table (and so the builder's) has cdiv(8192, 64) = 128 columns,
# already a whole number of its 128-token alignment; the longest context uses the last one.
FULL_TABLE_TOKENS = 8192


@dataclass(frozen=True)
class GlueBase:
    """What this harness does differently per vLLM base (the b12x variables follow from the
    release the base pins, which the emulation stands in for)."""

    vllm: str
    # Whether the runner's block table can be wider than the builder's buffer: 0.24.0's builder
    # sizes its buffer itself; 0.33.0's runner hands the builder its own width.
    table_grows: bool
    # b12x_indexer.require_supported's arguments after (index_topk, use_fp4_indexer_cache).
    require_args: tuple = ()
    # sparse_attn_indexer's arguments after topk_indices_buffer, by name.
    indexer_kwargs: tuple[tuple[str, object], ...] = ()


BASES = {base.vllm: base for base in (
    GlueBase("0.24.0", table_grows=True,
             indexer_kwargs=(("skip_k_cache_insert", True), ("use_fp4_cache", False))),
    # compress_ratio 1: one indexer key per token (GLM-5).
    GlueBase("0.33.0", table_grows=False, require_args=(1,),
             indexer_kwargs=(("skip_k_cache_insert", True), ("use_pcp", False),
                             ("pcp_shard_decode_requests", False), ("dense_mha_metadata_layer_name", ""),
                             ("use_fp4_cache", False))),
)}


@dataclass(frozen=True)
class GlueCase:
    name: str
    spec: B.BatchSpec
    next_n: int = 1
    max_model_len: int = 8192
    # Runner block-table columns beyond the builder's expanded buffer (growth).
    extra_columns: int = 0
    # The longest context must use the runner table's last column (checked when run).
    reaches_last_column: bool = False
    env: tuple[tuple[str, str], ...] = ()


def glue_cases(base: GlueBase, release, seed: int = SEED) -> list[GlueCase]:
    """The cases on ``base``, whose b12x ``release`` (``_release.Release``) names the variables."""
    rng = np.random.default_rng(seed)
    long = LONG_MAX_MODEL_LEN
    small_supertile = ((release.supertile_variable, "1024"), ("VLLM_SPARSE_INDEXER_MAX_LOGITS_MB", "16"))
    return [
        *(GlueCase(f"decode_bs{bs}", B.decode_batch(rng, f"decode_bs{bs}", bs, 1, 8192))
          for bs in (1, 8, 64, 256)),
        GlueCase("mtp2_uniform_bs4", B.decode_batch(rng, "m", 4, 2, 8192), next_n=2),
        GlueCase("mtp2_variable_bs16", B.decode_batch(rng, "m", 16, 2, 8192, True), next_n=2),
        GlueCase("mtp2_single_token_rows", B.decode_batch(rng, "m", 8, 1, 8192), next_n=2),
        GlueCase("mtp4_uniform_bs8", B.decode_batch(rng, "m", 8, 4, 8192), next_n=4),
        GlueCase("mtp4_variable_bs16", B.decode_batch(rng, "m", 16, 4, 8192, True), next_n=4),
        GlueCase("prefills_shorter_than_topk", B.mixed_batch(rng, "p", 0, (37, 700, 2000), 2048)),
        GlueCase("mixed_4dec_prefill_3000", B.mixed_batch(rng, "p", 4, (3000,), 8192)),
        GlueCase("prefill_7_supertiles_9_row_chunks",
                 B.BatchSpec("p", (3000,), (7000,)), env=small_supertile),
        GlueCase("mtp4_mixed_prefill_supertiles", B.mixed_batch(rng, "p", 6, (2500,), 8192, 4),
                 next_n=4, env=small_supertile),
        *_table_cases(base, rng),
        *(GlueCase(f"long_decode_bs{bs}", B.decode_batch(rng, "l", bs, 1, long), max_model_len=long)
          for bs in (1, 4, 8, 16)),
        GlueCase("long_mtp2_bs4", B.decode_batch(rng, "l", 4, 2, long), next_n=2, max_model_len=long),
        GlueCase("long_prefill_on_60000", B.BatchSpec("l", (1, 1, 2000), (40000, 65000, 62000)),
                 max_model_len=long),
    ]


def _table_cases(base: GlueBase, rng) -> list[GlueCase]:
    """Decodes whose longest context uses the runner table's last column: past the builder's
    buffer where the table grows (0.24.0), the builder's own last column where it cannot."""
    if base.table_grows:
        name, tokens, extra = "grown_table", GROWN_TABLE_TOKENS, 3
    else:
        name, tokens, extra = "full_width_table", FULL_TABLE_TOKENS, 0
    return [GlueCase(f"{name}_mtp4", _reaching_batch(rng, 8, 4, tokens), next_n=4, extra_columns=extra,
                     reaches_last_column=True),
            GlueCase(f"{name}_decode", _reaching_batch(rng, 8, 1, tokens), extra_columns=extra,
                     reaches_last_column=True)]


def _reaching_batch(rng, batch, next_n, longest) -> B.BatchSpec:
    """Decodes whose longest context uses the runner table's last column."""
    spec = B.decode_batch(rng, "g", batch, next_n, longest)
    seq = list(spec.seq_lens)
    seq[-1] = longest
    return B.BatchSpec("g", spec.query_lens, tuple(seq))


# -- running one case -------------------------------------------------------------------------


@dataclass
class CaseResult:
    name: str
    tokens: int = 0
    rows_equal: int = 0
    rows_tied: int = 0
    wrong_rows: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.wrong_rows and self.rows_equal + self.rows_tied == self.tokens


@contextlib.contextmanager
def case_environment(case: GlueCase):
    import vllm.envs as envs

    saved = {name: os.environ.get(name) for name, _ in case.env}
    os.environ.update(dict(case.env))
    envs.disable_envs_cache()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def make_config(model: str, case: GlueCase):
    from dsa_image.validation import indexer_probe

    config = indexer_probe.make_vllm_config(model, case.next_n - 1)
    # The builder and the prefill buffer size read only this; the tiny model's own limit
    # (8192 positions) does not matter to metadata and indexer kernels.
    object.__setattr__(config.model_config, "max_model_len", case.max_model_len)
    return config


def run_case(model: str, case: GlueCase, base: GlueBase) -> CaseResult:
    result = CaseResult(case.name, tokens=case.spec.num_tokens)
    try:
        with case_environment(case):
            run_checked(model, case, base, result)
    except Exception as exc:  # noqa: BLE001 - one case failing must not hide the others
        import traceback

        result.error = f"{type(exc).__name__}: {exc}"[:800]
        result.facts["traceback"] = traceback.format_exc()[-2000:]
    return result


def run_checked(model: str, case: GlueCase, base: GlueBase, result: CaseResult) -> None:
    from dsa_image.validation import indexer_probe

    config = make_config(model, case)
    builder = indexer_probe.make_builder(config)
    width = runner_table_width(case, base, config, builder)
    rng = np.random.default_rng(SEED + len(case.name))
    table = B.random_block_table(rng, case.spec.num_reqs, width, max(4096, 2 * width))
    metadata, facts = build_metadata(builder, case, table)
    result.facts.update(facts)
    inputs = make_inputs(case, table, config)
    emulated = emulated_indexer()
    emulated.STATS.update(max_supertiles=0, max_b12x_buffer_bytes=0, supertile_k_values=[])
    emulated.LAST_DECODE.clear()
    stats_before = dict(emulated.STATS)
    chosen = run_indexer(config, metadata, inputs, base)
    result.facts["emulation"] = _stats_delta(stats_before, emulated.STATS)
    result.facts["emulation"].update({f"decode_{k}": v for k, v in emulated.LAST_DECODE.items()})
    result.facts["b12x_buffer_budget_bytes"] = _logits_budget()
    result.facts["overlay_supertile_k"] = _supertile()
    compare_with_reference(case, inputs, chosen, result)


def runner_table_width(case: GlueCase, base: GlueBase, config, builder) -> int:
    """Columns of the runner's block table for this case, as vLLM's runner sizes it (plus the
    case's growth where the base lets it grow); fails when a case cannot be what it says."""
    from dsa_image.validation import indexer_probe

    buffer = builder.expanded_block_table_buffer.shape[1]
    hands_width = bool(getattr(builder, "requires_block_table_width", False))
    if hands_width == base.table_grows:
        raise RuntimeError(f"vLLM {base.vllm}'s builder {'takes' if hands_width else 'does not take'} "
                           "the runner's block-table width: this harness's base table is wrong")
    if case.extra_columns and not base.table_grows:
        raise RuntimeError(f"{case.name}: vLLM {base.vllm}'s runner table cannot grow past the builder's")
    width = buffer + case.extra_columns if case.extra_columns else indexer_probe.runner_block_table_width(config)
    if case.reaches_last_column and -(-max(case.spec.seq_lens) // B.BLOCK_SIZE) != width:
        raise RuntimeError(f"{case.name}: the longest context does not use the table's last column "
                           f"(width {width})")
    return width


def build_metadata(builder, case: GlueCase, table: np.ndarray):
    from dsa_image.validation import indexer_probe

    common = indexer_probe.make_common_metadata(case.spec, table)
    metadata = builder.build(0, common)
    syncs, sites = indexer_probe.count_syncs(lambda: builder.build(0, common))
    metadata = builder.build(0, common)
    facts = {"use_b12x": metadata.use_b12x, "use_flattening": bool(builder.use_flattening),
             "builder_syncs": syncs, "sync_sites": sites, "runner_table_width": int(table.shape[1]),
             "num_decodes": metadata.num_decodes, "num_prefills": metadata.num_prefills}
    if metadata.decode is not None:
        decode = metadata.decode
        facts.update(decode_rows=int(decode.seq_lens.numel()), decode_seq_lens_shape=list(decode.seq_lens.shape),
                     decode_table_width=int(decode.block_table.shape[1]),
                     scheduled=decode.schedule_metadata is not None,
                     exact_decode_max=int(max(case.spec.seq_lens[: metadata.num_decodes])))
        if getattr(decode, "active_width", None) is not None:  # 0.24.0's builder passes it to b12x
            facts["active_width"] = int(decode.active_width.item())
    if metadata.prefill is not None:
        chunks = metadata.prefill.chunks
        facts.update(prefill_chunks=len(chunks), gather_skipped=sum(c.skip_kv_gather for c in chunks),
                     rows_per_chunk_max=max(c.token_end - c.token_start for c in chunks))
    return metadata, facts


def make_inputs(case: GlueCase, table: np.ndarray, config) -> dict:
    import torch

    from dsa_image.runtime import indexer_reference as ref
    from vllm.v1.attention.backends.mla.indexer import get_max_prefill_buffer_size

    gen = torch.Generator().manual_seed(SEED + case.spec.num_tokens)
    heads = config.model_config.hf_text_config.index_n_heads
    tokens = case.spec.num_tokens
    return dict(
        q=ref.random_fp8((tokens, heads, HEAD_DIM), gen, DEVICE),
        weights=ref.random_weights(tokens, heads, gen, DEVICE),
        cache=ref.random_cache(int(table.max()) + 1, B.BLOCK_SIZE, gen, DEVICE),
        table=torch.from_numpy(table).to(DEVICE),
        total_seq_lens=get_max_prefill_buffer_size(config),
        max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
        max_model_len=case.max_model_len,
    )


def run_indexer(config, metadata, inputs: dict, base: GlueBase):
    """The overlay's sparse_attn_indexer on this batch; returns its top-k buffer rows."""
    import torch

    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.sparse_attn_indexer import sparse_attn_indexer

    tokens = inputs["q"].shape[0]
    buffer = torch.full((inputs["max_num_batched_tokens"], TOPK), -7, dtype=torch.int32, device=DEVICE)
    hidden = torch.empty((tokens, 1), device=DEVICE)
    with set_forward_context({PREFIX: metadata}, config):
        sparse_attn_indexer(hidden, PREFIX, inputs["cache"], inputs["q"], None, None, inputs["weights"],
                            128, "ue8m0", TOPK, HEAD_DIM, inputs["max_model_len"],
                            inputs["total_seq_lens"], buffer, **dict(base.indexer_kwargs))
    return buffer[:tokens]


def compare_with_reference(case: GlueCase, inputs: dict, chosen, result: CaseResult) -> None:
    """Per request: the reference logits of its rows over its context, then sets compared."""
    import torch

    from dsa_image.runtime import indexer_reference as ref

    pages = ref.cache_pages(inputs["cache"])
    start = 0
    for r, (q_len, seq_len) in enumerate(zip(case.spec.query_lens, case.spec.seq_lens, strict=True)):
        rows = slice(start, start + q_len)
        context = torch.arange(seq_len - q_len + 1, seq_len + 1, device=DEVICE)
        logits = ref.request_logits(inputs["q"][rows], inputs["weights"][rows], pages, B.BLOCK_SIZE,
                                    inputs["table"][r], context, seq_len)
        _compare_rows(logits, chosen[rows], start, result)
        start += q_len


def _compare_rows(logits, chosen, first_token: int, result: CaseResult) -> None:
    from dsa_image.runtime import indexer_reference as ref

    wanted = ref.topk_positions(logits, TOPK)
    equal = (wanted.sort(1).values == chosen.sort(1).values).all(1).cpu()
    result.rows_equal += int(equal.sum())
    for i in (~equal).nonzero().flatten().tolist():
        problems = ref.selection_problems(chosen[i].cpu(), logits[i], TOPK)
        if problems:
            result.wrong_rows.append(f"token {first_token + i}: {'; '.join(problems)}")
        else:
            result.rows_tied += 1


def _stats_delta(before: dict, after: dict) -> dict:
    counters = ("prefill_calls", "decode_calls", "scheduled_decode_calls", "schedules_verified")
    delta = {k: after[k] - before[k] for k in counters}
    delta.update({k: after[k] for k in ("max_supertiles", "max_b12x_buffer_bytes", "supertile_k_values")})
    return delta


def _logits_budget() -> int:
    import vllm.envs as envs

    return envs.VLLM_SPARSE_INDEXER_MAX_LOGITS_MB * 1024 * 1024


def emulated_indexer():
    """The emulation's counters and records (the same module for both releases)."""
    import b12x._emulated_indexer as emulated

    return emulated


# -- the checks around the cases --------------------------------------------------------------


def case_verdict(case: GlueCase, result: CaseResult) -> list[str]:
    """What a case's facts must show beyond equal sets."""
    facts, why = result.facts, []
    if facts.get("builder_syncs"):
        why.append(f"{facts['builder_syncs']} synchronising calls in build()")
    emulation = facts.get("emulation", {})
    why += _width_verdict(facts, emulation)
    if emulation.get("max_b12x_buffer_bytes", 0) > facts.get("b12x_buffer_budget_bytes", 0):
        why.append("b12x's prefill buffers exceed the logits budget")
    if emulation.get("prefill_calls") and emulation.get("supertile_k_values") != [facts["overlay_supertile_k"]]:
        why.append(f"b12x folded supertiles of {emulation.get('supertile_k_values')} keys, "
                   f"the overlay budgets {facts['overlay_supertile_k']}")
    if emulation.get("scheduled_decode_calls") != emulation.get("schedules_verified"):
        why.append("a scheduled decode was not verified against its batch")
    if case.next_n > 1 and not facts.get("use_flattening"):
        why.append("b12x MTP decode not flattened")
    return why


def _width_verdict(facts: dict, emulation: dict) -> list[str]:
    """b12x's decode scored exactly up to the longest decode context: the builder's width where
    it passes one (0.24.0), the one b12x computed on the device otherwise, as recorded."""
    exact = facts.get("exact_decode_max")
    why: list[str] = []
    if exact is None:
        return why
    if emulation.get("decode_calls") and "decode_active_width" not in emulation:
        why.append("b12x's decode width was not recorded")
    for source, width in (("builder's", facts.get("active_width")), ("b12x's", emulation.get("decode_active_width"))):
        if width is not None and width != exact:
            why.append(f"{source} active width {width} != exact decode max {exact}")
    return why


def check_startup_refusal(base: GlueBase) -> dict:
    """The production check, with the emulation importable as b12x, on this GPU."""
    from vllm.v1.attention.backends.mla import b12x_indexer

    try:
        b12x_indexer.require_supported(TOPK, False, *base.require_args)
    except RuntimeError as refusal:
        return {"ok": "needs compute capability 12.0/12.1" in str(refusal), "message": str(refusal)}
    return {"ok": False, "message": "no refusal"}


def reserve_and_lock_workspace(model: str, base: GlueBase) -> dict:
    """vLLM's profiling-run reservation for the largest case, then the lock vLLM applies."""
    import torch

    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.sparse_attn_indexer import sparse_attn_indexer
    from vllm.v1.attention.backends.mla.indexer import get_max_prefill_buffer_size
    from vllm.v1.worker import workspace

    config = make_config(model, GlueCase("profile", B.BatchSpec("p", (1,), (1,)), max_model_len=LONG_MAX_MODEL_LEN))
    workspace.init_workspace_manager(torch.device(DEVICE))
    buffer = torch.empty((1, TOPK), dtype=torch.int32, device=DEVICE)
    total = get_max_prefill_buffer_size(config)
    with set_forward_context(None, config):
        sparse_attn_indexer(torch.empty((1, 1), device=DEVICE), PREFIX, torch.empty(0, device=DEVICE),
                            torch.empty(0, device=DEVICE), None, None, torch.empty(0, device=DEVICE),
                            128, "ue8m0", TOPK, HEAD_DIM, LONG_MAX_MODEL_LEN, total, buffer,
                            **dict(base.indexer_kwargs))
    workspace.lock_workspace()
    manager = workspace.current_workspace_manager()
    return {"reserved_bytes": manager._workspace_size_bytes(manager._current_workspaces[0]),
            "locked": manager.is_locked()}


def run_selftest_b12x() -> dict:
    """The self-test's b12x branch (b12x_indexer and the compare logic) on the emulation."""
    from dsa_image.runtime import selftest

    cases = selftest.default_cases(_supertile())
    results, code = selftest.run_suite(selftest.B12xKernels(), cases, DEVICE)
    broken, broken_code = selftest.run_suite(selftest.B12xKernels(), cases[-1:], DEVICE, cases[-1].name)
    return {"exit_code": code, "table": selftest.format_table(results),
            "broken_exit_code": broken_code, "broken_table": selftest.format_table(broken),
            "ok": code == selftest.OK and broken_code == selftest.MISMATCH}


def _supertile() -> int:
    from vllm.v1.attention.backends.mla import b12x_indexer

    return b12x_indexer.supertile_k()


# -- main -------------------------------------------------------------------------------------


def format_cases(results: list[CaseResult], verdicts: dict) -> str:
    lines = ["| case | tokens | sets equal | equal up to ties | wrong | facts | result |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        facts = {k: r.facts[k] for k in ("use_flattening", "scheduled", "prefill_chunks", "decode_table_width")
                 if k in r.facts}
        facts["supertiles"] = r.facts.get("emulation", {}).get("max_supertiles")
        bad = r.error or "; ".join(r.wrong_rows[:2] + verdicts[r.name])
        lines.append(f"| {r.name} | {r.tokens} | {r.rows_equal} | {r.rows_tied} | {len(r.wrong_rows)} | "
                     f"{json.dumps(facts)} | {'ok' if not bad else 'FAIL: ' + bad[:200]} |")
    return "\n".join(lines)


def resolve_base(requested: str | None):
    """The installed vLLM's base and the b12x release the emulation stands in for, which must
    be the one that base's overlay calls."""
    import importlib.metadata

    from dsa_image.validation import b12x_release, vllm_base

    version = vllm_base.choose(requested, {importlib.metadata.version("vllm")})
    if version not in BASES:
        raise RuntimeError(f"vLLM {version} has no b12x glue cases (bases: {', '.join(BASES)})")
    try:
        import b12x
    except ImportError as exc:
        raise RuntimeError(f"the emulated b12x cannot be imported: {exc}") from exc
    pinned = b12x_release.pinned_b12x(version)
    if b12x.RELEASE.version != pinned:
        raise RuntimeError(f"the emulation stands in for b12x {b12x.RELEASE.version}, but the vLLM "
                           f"{version} overlay calls b12x {pinned}: install that b12x in the site")
    return BASES[version], b12x.RELEASE


def select_cases(cases: list[GlueCase], only: str | None) -> list[GlueCase]:
    if not only:
        return cases
    wanted = only.split(",")
    unknown = sorted(set(wanted) - {c.name for c in cases})
    if unknown:
        raise RuntimeError(f"--only names no case of this base: {', '.join(unknown)}")
    return [c for c in cases if c.name in wanted]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=EXIT_CODES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the tiny GLM-5 model directory")
    parser.add_argument("--json", required=True, help="results file")
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--vllm", choices=sorted(BASES),
                        help="the vLLM base this run is for: must be the installed vLLM (the default)")
    args = parser.parse_args(argv)
    if os.environ.get("DSA_B12X_EMULATION") == "1":
        parser.error("run without DSA_B12X_EMULATION: the harness first shows the production "
                     "check refusing this GPU, then bypasses that check itself")
    import b12x_emulation
    import torch

    from dsa_image.validation import b12x_crosscheck

    b12x_emulation.check_shadowing()
    try:
        base, release = resolve_base(args.vllm)
        cases = select_cases(glue_cases(base, release), args.only)
    except RuntimeError as exc:
        parser.error(str(exc))
    os.environ["VLLM_USE_B12X_SPARSE_INDEXER"] = "1"
    report = {"vllm": base.vllm, "b12x_emulated": release.version,
              "gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
              "startup_refusal": check_startup_refusal(base)}
    from vllm.v1.attention.backends.mla import b12x_indexer

    b12x_emulation.bypass_capability_check(b12x_indexer)
    report["b12x_wheel_crosscheck"] = b12x_crosscheck.run(b12x_emulation.emulation_dir())
    report["workspace"] = reserve_and_lock_workspace(args.model, base)
    results = [run_case(args.model, case, base) for case in cases]
    verdicts = {r.name: case_verdict(c, r) for c, r in zip(cases, results, strict=True)}
    report["cases"] = [{**asdict(r), "ok": r.ok and not verdicts[r.name], "verdict": verdicts[r.name]}
                       for r in results]
    report["selftest_b12x_emulated"] = run_selftest_b12x()
    report["ok"] = bool(report["startup_refusal"]["ok"] and report["b12x_wheel_crosscheck"]["ok"]
                        and report["workspace"]["locked"] and all(c["ok"] for c in report["cases"])
                        and report["selftest_b12x_emulated"]["ok"])
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"vLLM {base.vllm}, emulated b12x {release.version}")
    print(format_cases(results, verdicts))
    print(report["selftest_b12x_emulated"]["table"])
    print(json.dumps({k: report[k] for k in ("startup_refusal", "b12x_wheel_crosscheck", "workspace")},
                     indent=1, default=str)[:4000])
    print("B12X GLUE:", "PASS" if report["ok"] else "FAIL")
    return status.SUCCESS if report["ok"] else status.FAILED


if __name__ == "__main__":
    sys.exit(main())
