"""The emulated-b12x harnesses per vLLM base (dsa_image.validation.b12x_glue, b12x_serving,
b12x_release), without a GPU: which base and b12x release a run is for, the glue's cases on each
base, and the overlay calls the glue makes, checked against each overlay's source.

The cases themselves run on an H200 (scripts/gpu_validation.py b12x); these need numpy only."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsa_image.overlay import cli as overlay
from dsa_image.validation import b12x_release

pytest.importorskip("numpy")

from dsa_image.validation import b12x_glue, b12x_serving  # noqa: E402
from test_validation_vllm_base import fake_site  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EMULATION = REPO / "emulation"
if not EMULATION.is_dir():  # the image's test stage: emulation/ stays out of every image
    pytest.skip("emulation/ is not in this tree (never in an image)", allow_module_level=True)


def release_of(vllm: str):
    return b12x_release.emulated_release(str(EMULATION), b12x_release.pinned_b12x(vllm))


def cases(vllm: str) -> dict[str, b12x_glue.GlueCase]:
    return {c.name: c for c in b12x_glue.glue_cases(b12x_glue.BASES[vllm], release_of(vllm))}


def test_the_glue_has_a_base_for_every_recipe_base():
    from dsa_image.core.recipe import load_every_base

    assert set(b12x_glue.BASES) == {r.vllm_version for r in load_every_base()}


def test_the_cases_are_the_same_on_both_bases_but_the_table_ones():
    old, new = cases("0.24.0"), cases("0.33.0")
    assert set(old) - set(new) == {"grown_table_mtp4", "grown_table_decode"}
    assert set(new) - set(old) == {"full_width_table_mtp4", "full_width_table_decode"}
    assert len(old) == len(new) == 21
    for name in set(old) & set(new):
        a, b = old[name], new[name]
        assert (a.spec, a.next_n, a.max_model_len, a.extra_columns) == (b.spec, b.next_n, b.max_model_len,
                                                                         b.extra_columns), name


@pytest.mark.parametrize("vllm, variable", [("0.24.0", "B12X_NSA_TOPK_SUPERTILE_K"),
                                            ("0.33.0", "B12X_DSA_TOPK_SUPERTILE_K")])
def test_the_small_supertile_is_set_through_the_bases_b12x_variable(vllm, variable):
    with_env = [c for c in cases(vllm).values() if c.env]
    assert {c.name for c in with_env} == {"prefill_7_supertiles_9_row_chunks", "mtp4_mixed_prefill_supertiles"}
    for case in with_env:
        assert dict(case.env) == {variable: "1024", "VLLM_SPARSE_INDEXER_MAX_LOGITS_MB": "16"}


@pytest.mark.parametrize("vllm, prefix, tokens, extra", [
    ("0.24.0", "grown_table", b12x_glue.GROWN_TABLE_TOKENS, 3),
    # vLLM 0.33.0's runner: cdiv(8192, 64) = 128 columns, aligned to 128 tokens already.
    ("0.33.0", "full_width_table", 128 * 64, 0),
])
def test_the_table_cases_reach_the_runner_tables_last_column(vllm, prefix, tokens, extra):
    for suffix, next_n in (("mtp4", 4), ("decode", 1)):
        case = cases(vllm)[f"{prefix}_{suffix}"]
        assert case.reaches_last_column and case.extra_columns == extra and case.next_n == next_n
        assert max(case.spec.seq_lens) == tokens


def test_a_case_that_cannot_be_what_it_says_is_refused():
    base = b12x_glue.BASES["0.33.0"]
    builder = SimpleNamespace(expanded_block_table_buffer=SimpleNamespace(shape=(16384, 128)),
                              requires_block_table_width=True)
    grown = cases("0.24.0")["grown_table_decode"]
    with pytest.raises(RuntimeError, match="cannot grow past the builder's"):
        b12x_glue.runner_table_width(grown, base, None, builder)
    stock_like = SimpleNamespace(expanded_block_table_buffer=builder.expanded_block_table_buffer)
    with pytest.raises(RuntimeError, match="does not take the runner's block-table width"):
        b12x_glue.runner_table_width(cases("0.33.0")["decode_bs1"], base, None, stock_like)


def test_a_grown_case_is_sized_from_the_builders_buffer():
    builder = SimpleNamespace(expanded_block_table_buffer=SimpleNamespace(shape=(16384, 136)))
    case = cases("0.24.0")["grown_table_mtp4"]
    assert b12x_glue.runner_table_width(case, b12x_glue.BASES["0.24.0"], None, builder) == 139


def test_only_names_cases_of_the_base():
    all_cases = list(cases("0.33.0").values())
    assert [c.name for c in b12x_glue.select_cases(all_cases, "decode_bs1,long_decode_bs4")] == [
        "decode_bs1", "long_decode_bs4"]
    with pytest.raises(RuntimeError, match="grown_table_decode"):
        b12x_glue.select_cases(all_cases, "decode_bs1,grown_table_decode")


@pytest.mark.parametrize("facts, emulation, why", [
    ({"exact_decode_max": 900, "active_width": 900}, {"decode_calls": 1, "decode_active_width": 900}, []),
    ({"exact_decode_max": 900}, {"decode_calls": 1, "decode_active_width": 900}, []),  # 0.33.0: b12x's own
    ({"exact_decode_max": 900}, {"decode_calls": 1, "decode_active_width": 8192},
     ["b12x's active width 8192 != exact decode max 900"]),
    ({"exact_decode_max": 900, "active_width": 960}, {"decode_calls": 1, "decode_active_width": 960},
     ["builder's active width 960 != exact decode max 900", "b12x's active width 960 != exact decode max 900"]),
    ({"exact_decode_max": 900}, {"decode_calls": 1}, ["b12x's decode width was not recorded"]),
    ({}, {"prefill_calls": 1}, []),
])
def test_the_decode_width_verdict(facts, emulation, why):
    assert b12x_glue._width_verdict(facts, emulation) == why


# -- the overlay calls the glue makes, against each overlay's source -----------------------------


def overlay_function(vllm: str, path: str, name: str) -> ast.FunctionDef:
    tree = ast.parse((overlay.overlay_dir(vllm) / path).read_text())
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)


def parameters(node: ast.FunctionDef) -> tuple[list[str], set[str]]:
    """(positional names, required names)."""
    names = [a.arg for a in node.args.args]
    return names, set(names[: len(names) - len(node.args.defaults)])


# sparse_attn_indexer's positional arguments in the glue, up to topk_indices_buffer.
GLUE_POSITIONAL = 14


@pytest.mark.parametrize("vllm", sorted(b12x_glue.BASES))
def test_the_glue_calls_sparse_attn_indexer_as_the_overlay_declares_it(vllm):
    names, required = parameters(overlay_function(vllm, "vllm/model_executor/layers/sparse_attn_indexer.py",
                                                  "sparse_attn_indexer"))
    assert names[GLUE_POSITIONAL - 1] == "topk_indices_buffer"
    given = set(names[:GLUE_POSITIONAL]) | {k for k, _ in b12x_glue.BASES[vllm].indexer_kwargs}
    assert {k for k, _ in b12x_glue.BASES[vllm].indexer_kwargs} <= set(names)
    assert required <= given
    assert dict(b12x_glue.BASES[vllm].indexer_kwargs)["use_fp4_cache"] is False


@pytest.mark.parametrize("vllm", sorted(b12x_glue.BASES))
def test_the_glue_calls_require_supported_as_the_overlay_declares_it(vllm):
    names, required = parameters(overlay_function(vllm, "vllm/v1/attention/backends/mla/b12x_indexer.py",
                                                  "require_supported"))
    assert len(names) == len(required) == 2 + len(b12x_glue.BASES[vllm].require_args)


# -- which base and release a run is for ----------------------------------------------------------


@pytest.mark.parametrize("vllm, variable", [("0.24.0", "B12X_NSA_TOPK_SUPERTILE_K"),
                                            ("0.33.0", "B12X_DSA_TOPK_SUPERTILE_K")])
def test_serving_sets_the_supertile_through_the_bases_variable(tmp_path, vllm, variable):
    args = SimpleNamespace(vllm=None, emulation=str(EMULATION), stock_site=fake_site(tmp_path / "s", vllm),
                           overlay_site=fake_site(tmp_path / "o", vllm))
    assert b12x_serving.resolve_base(args) == (vllm, variable)


def test_serving_refuses_sites_of_two_bases_or_none(tmp_path):
    args = SimpleNamespace(vllm=None, emulation=str(EMULATION), stock_site=fake_site(tmp_path / "s", "0.24.0"),
                           overlay_site=fake_site(tmp_path / "o", "0.33.0"))
    with pytest.raises(RuntimeError, match="one base per run"):
        b12x_serving.resolve_base(args)
    args.overlay_site = fake_site(tmp_path / "empty", None)
    with pytest.raises(RuntimeError, match="expected one vllm-\\*.dist-info/METADATA with a Version, found none"):
        b12x_serving.resolve_base(args)


def test_an_unemulated_release_is_refused():
    with pytest.raises(RuntimeError, match=r"b12x 1\.4\.0 is not emulated \(emulated: 0\.30\.2, 1\.5\.1\)"):
        b12x_release.emulated_release(str(EMULATION), "1.4.0")
