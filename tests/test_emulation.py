"""The b12x emulation (emulation/, validation only): never in an image, the API each base's
overlay calls (b12x 0.30.2's for vLLM 0.24.0, 1.5.1's for 0.33.0), b12x's semantics (against
each pinned wheel's own references and constants), the release it stands in for, and the
production capability check still refusing GPUs b12x has no kernels for.

The emulation's numerics need torch (any torch install; they run on CPU tensors); the
image-context, release and API checks need neither torch nor vLLM."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dsa_image.build import b12x_api
from dsa_image.overlay import cli as overlay
from dsa_image.core.recipe import load_every_base
from dsa_image.validation import b12x_release

REPO = Path(__file__).resolve().parents[1]
EMULATION = REPO / "emulation"

if not EMULATION.is_dir():  # the image's test stage: emulation/ stays out of every image
    pytest.skip("emulation/ is not in this tree (never in an image)", allow_module_level=True)

R = b12x_release.load_release_module(str(EMULATION))
# Per vLLM base, the b12x release its recipe pins: the one the emulation stands in for there.
BASE_RELEASES = {recipe.vllm_version: b12x_release.pinned_b12x(recipe.vllm_version) for recipe in load_every_base()}


def overlay_source(vllm: str) -> str:
    return (overlay.overlay_dir(vllm) / b12x_api.OVERLAY_MODULE).read_text()


def pinned_wheel(vllm: str) -> Path:
    from dsa_image.core import wheels
    from tests.test_b12x_api import BASES, pinned_b12x

    return wheels.ensure_wheel(*pinned_b12x(BASES[vllm]))


# -- never in an image ------------------------------------------------------------------------


def dockerignore_rules() -> list[tuple[bool, str]]:
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negate = line.startswith("!")
            rules.append((negate, line.lstrip("!").strip("/")))
    return rules


def _match(pattern: list[str], path: list[str]) -> bool:
    import fnmatch

    if not pattern:
        return not path
    if pattern[0] == "**":
        return any(_match(pattern[1:], path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatch.fnmatchcase(path[0], pattern[0]) and _match(pattern[1:], path[1:])


def in_build_context(path: str, rules) -> bool:
    """Docker's .dockerignore: the last pattern matching the path or one of its parent
    directories decides; a `!` pattern keeps it."""
    parts = path.split("/")
    candidates = [parts[:i] for i in range(1, len(parts) + 1)]
    kept = True
    for negate, pattern in rules:
        if any(_match(pattern.split("/"), c) for c in candidates):
            kept = negate
    return kept


@pytest.mark.parametrize("path, kept", [
    ("emulation/b12x/attention/indexer.py", False),
    ("emulation/sitecustomize.py", False),
    ("emulation/b12x_emulation.py", False),
    ("dsa_image/runtime/indexer_reference.py", True),
    ("dsa_image/runtime/selftest.py", True),
    ("dsa_image/__pycache__/selftest.cpython-311.pyc", False),
    ("tests/test_emulation.py", True),
    ("Dockerfile", True),
    ("docs/decisions.md", False),
])
def test_the_build_context_rule(path, kept):
    assert in_build_context(path, dockerignore_rules()) is kept


def test_no_emulation_file_is_in_the_image_build_context():
    files = [str(p.relative_to(REPO)) for p in EMULATION.rglob("*") if p.is_file()]
    assert {"emulation/b12x/attention/indexer.py", "emulation/b12x/attention/dsa_indexer/_impl.py",
            "emulation/b12x/_emulated_indexer.py", "emulation/sitecustomize.py"} <= set(files)
    rules = dockerignore_rules()
    assert [f for f in files if in_build_context(f, rules)] == []
    assert "emulation" not in (REPO / ".dockerignore").read_text()
    assert "emulation" not in (REPO / "Dockerfile").read_text()


def test_the_overlay_has_no_switch_for_the_emulation():
    # No name of the emulation's, no env switch it reads: it stands in for b12x only where a
    # harness puts it on the path and bypasses the capability check in its own process.
    names = ("b12x_emulation", "indexer_tap", "DSA_INDEXER_TAP", "DSA_B12X_EMULATION", "sitecustomize",
             R.RELEASE_VARIABLE, "_emulated_indexer")
    for path in (REPO / "overlay").rglob("*.py"):
        text = path.read_text()
        assert not [n for n in names if n in text], path


# -- the release it stands in for -------------------------------------------------------------


def test_every_base_pins_an_emulated_release():
    assert BASE_RELEASES == {"0.24.0": "0.30.2", "0.33.0": "1.5.1"}
    assert set(BASE_RELEASES.values()) == set(R.RELEASES)


@pytest.mark.parametrize("switch, installed, version", [
    ("1.5.1", None, "1.5.1"), (None, "0.30.2", "0.30.2"), ("0.30.2", "0.30.2", "0.30.2"),
    ("", "1.5.1", "1.5.1"),
])
def test_the_release_is_the_sites_or_the_switchs(switch, installed, version):
    assert R.resolve(switch, installed) is R.RELEASES[version]


@pytest.mark.parametrize("switch, installed, words", [
    ("1.5.1", "0.30.2", "DSA_B12X_EMULATED_RELEASE=1.5.1, but this site has b12x 0.30.2"),
    (None, None, "no b12x release to emulate: install the b12x wheel"),
    (None, "1.5.2", "b12x 1.5.2 is not emulated (emulated: 0.30.2, 1.5.1)"),
    ("0.30.1", None, "b12x 0.30.1 is not emulated"),
])
def test_no_release_or_another_is_refused_at_import(switch, installed, words):
    with pytest.raises(ImportError, match=re.escape(words)):
        R.resolve(switch, installed)


def test_each_releases_variables_and_modules():
    old, new = R.RELEASES["0.30.2"], R.RELEASES["1.5.1"]
    assert old.supertile_variable == "B12X_NSA_TOPK_SUPERTILE_K"
    assert new.supertile_variable == "B12X_DSA_TOPK_SUPERTILE_K"
    assert new.prefill_block_k_variable == "B12X_DSA_CONTIGUOUS_PREFILL_BLOCK_K"
    assert old.modules == ("b12x.attention.indexer",)
    assert new.modules == ("b12x.attention.dsa_indexer", "b12x.attention.dsa_indexer._impl")


def import_emulated(module: str, release: str) -> subprocess.CompletedProcess:
    """``import module`` in a fresh interpreter with only the emulation on its path (no torch
    needed: a module of another release is refused before the numerics load)."""
    env = {**os.environ, "PYTHONPATH": str(EMULATION), R.RELEASE_VARIABLE: release}
    return subprocess.run([sys.executable, "-S", "-c", f"import {module}"], capture_output=True, text=True,
                          env=env, cwd=str(EMULATION))


@pytest.mark.parametrize("release, module, missing", [
    ("1.5.1", "b12x.attention.indexer", "b12x.attention.indexer"),
    ("0.30.2", "b12x.attention.dsa_indexer._impl", "b12x.attention.dsa_indexer"),  # as Python says
])
def test_a_module_of_the_other_release_is_not_there(release, module, missing):
    done = import_emulated(module, release)
    assert done.returncode != 0
    assert f"ModuleNotFoundError: No module named '{missing}' in the emulated b12x {release}" in done.stderr


def test_without_a_release_b12x_does_not_import():
    done = import_emulated("b12x", "")
    assert done.returncode != 0 and "ImportError: no b12x release to emulate" in done.stderr


# -- the API the overlays call ----------------------------------------------------------------


def emulation_as_wheel(tmp_path: Path) -> Path:
    wheel = tmp_path / "b12x-0.0.0+emulation-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path in (EMULATION / "b12x").rglob("*.py"):
            archive.write(path, str(path.relative_to(EMULATION)))
    return wheel


@pytest.mark.parametrize("vllm", sorted(BASE_RELEASES))
def test_the_emulation_has_every_name_and_parameter_the_overlay_calls(tmp_path, vllm):
    assert b12x_api.problems(emulation_as_wheel(tmp_path), overlay_source(vllm)) == []


@pytest.mark.wheel
@pytest.mark.parametrize("vllm", sorted(BASE_RELEASES))
def test_the_emulations_signatures_are_the_pinned_wheels(tmp_path, vllm):
    """Every function and dataclass the overlay imports takes the same parameters (names,
    order, keyword-only, required) in the emulation as in the release its base pins."""
    ours = b12x_api.WheelSources(emulation_as_wheel(tmp_path))
    theirs = b12x_api.WheelSources(pinned_wheel(vllm))
    usages = b12x_api.overlay_usage(overlay_source(vllm))
    compared = 0
    for module, usage in usages.items():
        for name in usage.names:
            want = b12x_api.api_signature(theirs, module, name)
            assert want is not None and b12x_api.api_signature(ours, module, name) == want, f"{module}.{name}"
            compared += 1
    assert compared == 6


@pytest.mark.wheel
@pytest.mark.parametrize("vllm", sorted(BASE_RELEASES))
def test_the_emulation_mirrors_the_pinned_wheels_constants(vllm):
    release = R.RELEASES[BASE_RELEASES[vllm]]
    files = b12x_api.WheelSources(pinned_wheel(vllm)).files
    expected = release.wheel_constants()
    assert len(expected) >= 20
    assert b12x_api.constant_mismatches(files, expected) == []
    # A literal in a function, not a constant: the rows from which the prefill scorer runs.
    scorer = f"_use_{'sparse_nsa' if release.tag == 'NSA' else 'dsa'}_contiguous_prefill"
    body = files[f"{release.package}.contiguous_kernel"].split(f"def {scorer}(")[1].split("\ndef ")[0]
    assert f"return valid_q_rows >= {R.PREFILL_SCORER_MIN_ROWS}" in body


def test_a_changed_constant_is_reported():
    files = {"b12x.attention.indexer.kernel": "_SCHEDULE_MIN_PAGES = 2048\n"}
    assert b12x_api.constant_mismatches(files, {("b12x.attention.indexer.kernel", "_SCHEDULE_MIN_PAGES"): 1024}) == [
        "b12x.attention.indexer.kernel._SCHEDULE_MIN_PAGES: b12x has 2048, expected 1024"]


def test_an_aliased_constant_is_read_through_its_alias():
    source = "_PREFILL_BLOCK_Q = 32\n_PREFILL512_BLOCK_Q = _PREFILL_BLOCK_Q\n_OTHER = _UNKNOWN\n"
    assert b12x_api.module_constants(source) == {"_PREFILL_BLOCK_Q": 32, "_PREFILL512_BLOCK_Q": 32}


# -- semantics, on CPU tensors ----------------------------------------------------------------


@pytest.fixture
def fresh_b12x(monkeypatch):
    """Imports the emulated b12x afresh (it decides its release at import) and forgets it after."""
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "b12x"}
    for name in saved:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(EMULATION))
    yield
    for name in [n for n in sys.modules if n.split(".")[0] == "b12x"]:
        del sys.modules[name]


@pytest.fixture(params=sorted(R.RELEASES))
def emulated(request, monkeypatch, fresh_b12x):
    """The API module of each emulated release (its numerics on CPU tensors)."""
    pytest.importorskip("torch")
    installed = R.installed_version()
    if installed not in (None, request.param):
        pytest.skip(f"b12x {installed} is installed here: the emulation stands in for that release only")
    monkeypatch.setenv(R.RELEASE_VARIABLE, request.param)
    for release in R.RELEASES.values():
        for variable in (release.supertile_variable, release.prefill_threshold_variable,
                         release.prefill_block_k_variable):
            monkeypatch.delenv(variable, raising=False)
    module = importlib.import_module(R.RELEASES[request.param].api_module)
    monkeypatch.setattr(core(), "REQUIRE_CUDA", False)
    return module


def core():
    """The module behind both releases' API modules (its switches and records)."""
    return sys.modules["b12x._emulated_indexer"]


def prefill(rows=40, keys=1500, heads=4, seed=0):
    import torch

    from dsa_image.runtime import indexer_reference as ref

    g = torch.Generator().manual_seed(seed)
    ks = torch.randint(0, min(300, keys - 1), (rows,), generator=g, dtype=torch.int32)
    ke = (ks + torch.randint(1, keys, (rows,), generator=g, dtype=torch.int32)).clamp(max=keys)
    return dict(q_fp8=ref.random_fp8((rows, heads, 128), g), weights=ref.random_weights(rows, heads, g),
                kv_fp8=(ref.random_fp8((keys, 128), g), ref.random_scales(keys, g)), ks=ks, ke=ke)


def reference_topk(inputs, topk):
    from dsa_image.runtime import indexer_reference as ref

    logits = ref.relu_weighted_logits(inputs["q_fp8"], inputs["weights"], *inputs["kv_fp8"])
    return ref.topk_positions(ref.masked_logits(logits, inputs["ks"], inputs["ke"]), topk)


def call_tiled(emulated, inputs, topk=512, **kwargs):
    metadata = emulated.IndexerContiguousMetadata(k_start=inputs["ks"], k_end=inputs["ke"])
    return emulated.contiguous_tiled_topk(q_fp8=inputs["q_fp8"], weights=inputs["weights"],
                                          kv_fp8=inputs["kv_fp8"], metadata=metadata, topk=topk, **kwargs)


@pytest.mark.parametrize("supertile", [1, 256, 512, 700, 2048, None])
def test_tiled_topk_is_the_reference_topk_whatever_the_supertile(emulated, supertile):
    import torch

    inputs = prefill()
    got = call_tiled(emulated, inputs, supertile_k=supertile)
    assert torch.equal(got.sort(1).values, reference_topk(inputs, 512).sort(1).values)
    # absolute key rows: every chosen position lies in its row's [ks, ke)
    valid = got >= 0
    assert bool(((got >= inputs["ks"][:, None]) & (got < inputs["ke"][:, None]) | ~valid).all())
    resolved = emulated.LAST_PREFILL["supertile_k"]
    assert resolved % 256 == 0 and emulated.LAST_PREFILL["supertiles"] == -(-1500 // resolved)


def test_tiled_topk_reads_its_releases_variable_only_without_an_argument(emulated, monkeypatch):
    ours = core().RELEASE
    other = next(r for version, r in R.RELEASES.items() if version != ours.version)
    monkeypatch.setenv(other.supertile_variable, "1500")  # the other release's name: not read
    call_tiled(emulated, prefill())
    assert emulated.LAST_PREFILL["supertile_k"] == R.SUPERTILE_K_DEFAULT
    monkeypatch.setenv(ours.supertile_variable, "700")
    call_tiled(emulated, prefill())
    assert emulated.LAST_PREFILL["supertile_k"] == 768
    call_tiled(emulated, prefill(), supertile_k=1024)
    assert emulated.LAST_PREFILL["supertile_k"] == 1024


def test_the_prefill_tile_follows_its_releases_variables(emulated, monkeypatch):
    ours = core().RELEASE
    other = next(r for version, r in R.RELEASES.items() if version != ours.version)
    inputs = prefill(rows=4, keys=600)
    monkeypatch.setenv(other.prefill_block_k_variable, "bogus")  # not read
    call_tiled(emulated, inputs)
    assert emulated.LAST_PREFILL["block_k"] == 256
    monkeypatch.setenv(ours.prefill_threshold_variable, "1")  # the prefill scorer for 4 rows too
    monkeypatch.setenv(ours.prefill_block_k_variable, "bogus")
    with pytest.raises(ValueError, match=f"{ours.prefill_block_k_variable} must be auto, 256, or 512"):
        call_tiled(emulated, inputs)
    monkeypatch.setenv(ours.prefill_block_k_variable, "512")
    with pytest.raises(ValueError, match="=512 is unsupported for this shape"):
        call_tiled(emulated, inputs)


def test_tiled_topk_refuses_zero_keys_as_b12x_does(emulated):
    import torch

    inputs = prefill(rows=2, keys=10)
    inputs["kv_fp8"] = (inputs["kv_fp8"][0][:0], inputs["kv_fp8"][1][:0])
    inputs["ks"], inputs["ke"] = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="Cannot determine num_k_tiles"):
        call_tiled(emulated, inputs)


def test_tiled_topk_writes_into_a_given_output_and_pads_short_rows(emulated):
    import torch

    inputs = prefill(rows=3, keys=100)
    out = torch.full((3, 512), 99, dtype=torch.int32)
    assert call_tiled(emulated, inputs, output_indices=out) is out
    lengths = (inputs["ke"] - inputs["ks"]).tolist()
    for row, length in enumerate(lengths):
        assert sorted(out[row, :length].tolist()) == list(range(inputs["ks"][row], inputs["ke"][row]))
        assert set(out[row, length:].tolist()) <= {-1}


def test_tiled_topk_allocates_what_b12x_allocates(emulated):
    inputs = prefill(rows=40, keys=1500)
    call_tiled(emulated, inputs, supertile_k=512)
    rows_padded, topk = 64, 512
    tile, carry, values, lengths = rows_padded * 512 * 4, 2 * 40 * topk * 8, 40 * topk * 4, 40 * 4
    assert emulated.LAST_PREFILL["b12x_buffer_bytes"] == tile + carry + values + lengths
    call_tiled(emulated, inputs, supertile_k=2048)  # one supertile: no carry
    assert emulated.LAST_PREFILL["b12x_buffer_bytes"] == rows_padded * 1536 * 4 + values + lengths


@pytest.mark.parametrize("change, error, words", [
    (dict(weights="int"), RuntimeError, "weights must be (rows, heads) floats"),
    (dict(topk=300), ValueError, "supports topk values"),
    (dict(output="strided"), ValueError, "output_indices must be a contiguous"),
    (dict(binding=object()), NotImplementedError, "binding"),
    (dict(cuda=True), RuntimeError, "one CUDA device"),
])
def test_tiled_topk_refuses_what_b12x_would_not_run_in_its_kernels(emulated, monkeypatch, change, error, words):
    import torch

    inputs = prefill(rows=4, keys=600)
    kwargs = {"topk": change.get("topk", 512)}
    if change.get("weights"):
        inputs["weights"] = inputs["weights"].to(torch.int32)
    if change.get("output"):
        kwargs["output_indices"] = torch.empty((4, 1024), dtype=torch.int32)[:, :512]
    if change.get("binding"):
        kwargs["binding"] = change["binding"]
    if change.get("cuda"):
        monkeypatch.setattr(core(), "REQUIRE_CUDA", True)
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        call_tiled(emulated, inputs, **kwargs)


def paged(rows=3, columns=6, heads=4, seed=0):
    import torch

    from dsa_image.runtime import indexer_reference as ref

    g = torch.Generator().manual_seed(seed)
    cache = ref.random_cache(rows * columns, 64, g)
    table = torch.randperm(rows * columns, generator=g).view(rows, columns).to(torch.int32)
    return dict(q_fp8=ref.random_fp8((rows + 2, heads, 128), g), weights=ref.random_weights(rows + 2, heads, g),
                index_k_cache=ref.cache_pages(cache), table=table,
                lens=torch.tensor([1, 200, columns * 64][:rows], dtype=torch.int32))


def call_paged(emulated, inputs, **kwargs):
    metadata = emulated.IndexerPagedDecodeMetadata(inputs["table"], inputs["lens"], kwargs.pop("schedule", None))
    return emulated.paged_decode_logits(q_fp8=inputs["q_fp8"], weights=inputs["weights"],
                                        index_k_cache=inputs["index_k_cache"], metadata=metadata, **kwargs)


def test_paged_logits_are_the_reference_through_each_rows_table(emulated):
    import torch

    from dsa_image.runtime import indexer_reference as ref

    inputs = paged()
    got = call_paged(emulated, inputs)
    want = ref.paged_logits(inputs["q_fp8"][:3], inputs["weights"][:3], inputs["index_k_cache"], 64,
                            inputs["table"], inputs["lens"])
    assert got.shape == (5, 384) and torch.equal(got[:3], want)
    assert bool(torch.isinf(got[3:]).all())


def test_paged_logits_stop_at_the_active_width(emulated):
    import torch

    inputs = paged()
    got = call_paged(emulated, inputs, active_width_override=torch.tensor([150], dtype=torch.int32))
    assert bool(torch.isinf(got[:, 150:]).all()) and bool(torch.isfinite(got[1, :150]).all())


def test_without_an_override_the_width_is_the_longest_length_as_b12x_computes_it(emulated):
    import torch

    inputs = paged()  # lengths 1, 200, 384 of a 384-wide table
    call_paged(emulated, inputs)
    assert emulated.LAST_DECODE == {"rows": 3, "width": 384, "active_width": 384, "width_overridden": False}
    inputs["lens"] = torch.tensor([1, 200, 150], dtype=torch.int32)
    got = call_paged(emulated, inputs)
    assert emulated.LAST_DECODE["active_width"] == 200 and bool(torch.isinf(got[:, 200:]).all())
    call_paged(emulated, inputs, active_width_override=torch.tensor([300], dtype=torch.int32))
    assert emulated.LAST_DECODE["active_width"] == 300 and emulated.LAST_DECODE["width_overridden"]


def test_paged_logits_of_no_rows_are_minus_infinity(emulated):
    import torch

    inputs = paged()
    inputs["table"], inputs["lens"] = inputs["table"][:0], inputs["lens"][:0]
    got = call_paged(emulated, inputs)
    assert got.shape == (5, 384) and bool(torch.isinf(got).all())


def test_paged_logits_refuse_another_page_size(emulated):
    with pytest.raises(NotImplementedError, match="page_size"):
        call_paged(emulated, paged(), page_size=32)


def naive_schedule(lens, block_kv, num_sms):
    """b12x's schedule by definition: splits of block_kv * 4 keys per row, dealt to SMs in equal
    shares (the first `total % num_sms` SMs one more); each SM's first (row, split)."""
    splits = [-(-max(0, n) // (block_kv * 4)) for n in lens]
    total = sum(splits)
    out = []
    for sm in range(num_sms + 1):
        start = sm * (total // num_sms) + min(sm, total % num_sms)
        row, before = 0, 0
        while row < len(splits) and before + splits[row] <= start:
            before += splits[row]
            row += 1
        out.append([row, start - before])
    return out


@pytest.mark.parametrize("lens", [[1], [0, 0], [65536, 3, 20000, 256, 257], list(range(0, 70000, 997))])
def test_the_schedule_is_b12xs_by_definition(emulated, lens):
    import torch

    got = emulated.build_paged_mqa_schedule_metadata(torch.tensor(lens, dtype=torch.int32), 64, 7)
    assert got.tolist() == naive_schedule(lens, 64, 7)


def test_which_decodes_b12x_schedules(emulated):
    uses = emulated.uses_paged_mqa_schedule
    assert uses(q_rows=1, max_pages=1024) and uses(q_rows=8, max_pages=4096)
    assert not uses(q_rows=9, max_pages=1024) and not uses(q_rows=1, max_pages=1023)
    assert not uses(q_rows=0, max_pages=2048)


def test_a_stale_schedule_is_refused(emulated):
    import torch

    inputs = paged(rows=2, columns=1024)
    inputs["lens"] = torch.tensor([1000, 65536], dtype=torch.int32)
    fresh = emulated.build_paged_mqa_schedule_metadata(inputs["lens"], 64, 7)
    before = emulated.STATS["schedules_verified"]
    call_paged(emulated, inputs, schedule=fresh)
    assert emulated.STATS["schedules_verified"] == before + 1
    stale = emulated.build_paged_mqa_schedule_metadata(torch.tensor([1000, 30000], dtype=torch.int32), 64, 7)
    with pytest.raises(RuntimeError, match="does not describe"):
        call_paged(emulated, inputs, schedule=stale)


@pytest.mark.wheel
def test_the_emulation_agrees_with_b12xs_own_references(emulated):
    import torch

    from dsa_image.runtime import indexer_reference as ref

    release = core().RELEASE
    vllm = next(v for v, version in BASE_RELEASES.items() if version == release.version)
    member = "/".join(release.package.split(".")) + "/reference.py"
    reference = _wheel_module(pinned_wheel(vllm), member)
    inputs = paged(rows=3, columns=8, heads=8, seed=4)
    theirs = reference.paged_decode_logits_reference(
        q_fp8=inputs["q_fp8"], weights=inputs["weights"], index_k_cache=inputs["index_k_cache"].contiguous(),
        real_page_table=inputs["table"], query_row_to_batch=torch.arange(3, dtype=torch.int32),
        seqlens_per_query=inputs["lens"])
    ours = call_paged(emulated, inputs)
    assert torch.equal(torch.isinf(theirs), torch.isinf(ours))
    finite = torch.isfinite(ours)
    assert torch.allclose(theirs[finite], ours[finite], rtol=1e-5, atol=1e-5 * float(ours[finite].abs().max()))
    inputs = prefill(rows=6, keys=700, heads=8, seed=5)
    theirs = reference.contiguous_logits_reference(q_fp8=inputs["q_fp8"], weights=inputs["weights"],
                                                   kv_fp8=inputs["kv_fp8"], k_start=inputs["ks"], k_end=inputs["ke"])
    chosen = call_tiled(emulated, inputs, topk=512)
    for row in range(6):
        scale = float(theirs[row][torch.isfinite(theirs[row])].abs().max())
        assert ref.selection_problems(chosen[row], theirs[row], 512, 1e-5 * scale) == []


CROSSCHECK = """
import json
import b12x._emulated_indexer as emulated
from dsa_image.validation import b12x_crosscheck
emulated.REQUIRE_CUDA = False
b12x_crosscheck.DEVICE = "cpu"
print(json.dumps(b12x_crosscheck.run(EMULATION), default=str))
"""


@pytest.mark.wheel
@pytest.mark.parametrize("vllm", sorted(BASE_RELEASES))
def test_the_glue_harness_crosscheck_passes_against_each_pinned_wheel(tmp_path, vllm):
    """b12x_crosscheck as the glue harness runs it on the GPU, here on CPU tensors, with the
    base's pinned wheel installed beside the emulation (which then stands in for it; b12x's
    Triton schedule builder falls back to its torch one off CUDA)."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    with zipfile.ZipFile(pinned_wheel(vllm)) as wheel:
        wheel.extractall(tmp_path / "site")
    env = {k: v for k, v in os.environ.items() if k != R.RELEASE_VARIABLE}
    env["PYTHONPATH"] = os.pathsep.join([str(EMULATION), str(tmp_path / "site"), str(REPO)])
    done = subprocess.run([sys.executable, "-c", CROSSCHECK.replace("EMULATION", repr(str(EMULATION)))],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["release"] == {"emulated": BASE_RELEASES[vllm], "installed": BASE_RELEASES[vllm],
                                 "api_module": R.RELEASES[BASE_RELEASES[vllm]].api_module,
                                 "api_module_in_wheel": True, "ok": True}
    assert report["ok"], json.dumps(report, indent=1)[:3000]
    assert report["constants"]["checked"] >= 20 and report["schedules"]["compared"] == 16


def _wheel_module(wheel: Path, member: str):
    source = zipfile.ZipFile(wheel).read(member).decode()
    module = type(sys)("b12x_wheel_" + Path(member).stem)
    exec(compile(source, member, "exec"), module.__dict__)
    return module


# -- the production check, with the emulation importable as b12x ----------------------------


def run_with_emulation(code: str, startup_hook: bool) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with the emulation first on its path, standing in for the
    b12x the installed vLLM's base pins (where no b12x is installed); the start-up hook
    (sitecustomize) acts only with DSA_B12X_EMULATION=1."""
    import importlib.metadata

    path = os.pathsep.join([str(EMULATION), *[p for p in sys.path if p], str(REPO)])
    env = {k: v for k, v in os.environ.items() if k != "DSA_B12X_EMULATION"}
    env.update(PYTHONPATH=path, **({"DSA_B12X_EMULATION": "1"} if startup_hook else {}))
    if R.installed_version() is None:
        env[R.RELEASE_VARIABLE] = BASE_RELEASES[importlib.metadata.version("vllm")]
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=env, cwd=REPO)


ON_SM90 = """
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
current_platform.is_cuda = lambda: True
current_platform.get_device_capability = lambda device_id=0: DeviceCapability(9, 0)
current_platform.is_device_capability_family = lambda family, device_id=0: family == 90
import b12x
import b12x_emulation
from vllm.v1.attention.backends.mla import b12x_indexer
assert b12x.EMULATION
try:
    b12x_indexer.require_supported(TOPK, False, *REQUIRE_ARGS)
except RuntimeError as e:
    print("REFUSED", e)
print("REFUSALS", b12x_emulation.REFUSALS)
"""


def on_sm90(topk: int) -> str:
    """ON_SM90 for this top-k and the installed vLLM's require_supported."""
    import importlib.metadata

    from dsa_image.validation.b12x_glue import BASES

    extra = BASES[importlib.metadata.version("vllm")].require_args
    return ON_SM90.replace("TOPK", str(topk)).replace("REQUIRE_ARGS", repr(tuple(extra)))


def test_the_production_check_still_refuses_sm90_with_the_emulation_importable():
    pytest.importorskip("vllm")
    done = run_with_emulation(on_sm90(2048), startup_hook=False)
    assert "REFUSED VLLM_USE_B12X_SPARSE_INDEXER=1 needs compute capability 12.0/12.1" in done.stdout, done.stderr
    assert "this GPU is compute capability 9.0" in done.stdout
    assert "REFUSALS []" in done.stdout


def test_the_harness_bypass_skips_the_capability_check_only():
    pytest.importorskip("vllm")
    # sitecustomize installed the hook at start-up: the capability check runs and is recorded,
    # and the next check (the top-k size) still refuses.
    done = run_with_emulation(on_sm90(100), startup_hook=True)
    assert "compute-capability check bypassed" in done.stderr, done.stderr
    assert "REFUSED VLLM_USE_B12X_SPARSE_INDEXER=1: b12x selects a top-k of 512, 1024, 2048" in done.stdout
    assert "REFUSALS ['VLLM_USE_B12X_SPARSE_INDEXER=1 needs compute capability 12.0/12.1" in done.stdout


def test_the_emulation_refuses_to_stand_in_when_another_b12x_comes_first(tmp_path):
    shadow = tmp_path / "b12x"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import b12x_emulation; b12x_emulation.check_shadowing()"
    done = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(EMULATION)})
    assert done.returncode != 0 and "not the emulation" in done.stderr


# -- the serving comparison's recorder and its explanation ------------------------------------


def tap_record(kind, chosen, inputs, topk=512):
    import torch

    return {"kind": kind, "topk": topk, "q": inputs["q_fp8"].view(torch.uint8), "weights": inputs["weights"],
            "k_quant": inputs["kv_fp8"][0].view(torch.uint8), "k_scale": inputs["kv_fp8"][1],
            "ks": inputs["ks"], "ke": inputs["ke"], "chosen": chosen}


def causal_prefill(rows=8, keys=900):
    import torch

    inputs = prefill(rows=rows, keys=keys, seed=3)
    inputs["ks"] = torch.zeros(rows, dtype=torch.int32)
    inputs["ke"] = torch.arange(keys - rows + 1, keys + 1, dtype=torch.int32)
    return inputs


def test_a_near_tie_swap_is_explained_and_a_wrong_choice_is_not():
    torch = pytest.importorskip("torch")

    from dsa_image.runtime import indexer_reference as ref
    from dsa_image.validation import b12x_serving

    inputs = causal_prefill()
    logits = ref.masked_logits(ref.relu_weighted_logits(inputs["q_fp8"], inputs["weights"], *inputs["kv_fp8"]),
                               inputs["ks"], inputs["ke"])
    order = torch.argsort(logits, dim=1, descending=True, stable=True)
    exact = order[:, :512].to(torch.int32)
    near = exact.clone()
    near[2, -1] = order[2, 512]  # the k-th and the (k+1)-th swapped: a near-tie
    far = exact.clone()
    far[3, 0] = order[3, int(inputs["ke"][3]) - 1]  # the best key traded for the worst
    emulated = tap_record("b12x", exact, inputs)
    good = b12x_serving.explain_call(tap_record("deepgemm", near, inputs), emulated)
    assert good["same_inputs"] and good["rows_identical"] == 7
    assert good["b12x_equals_reference"] and good["deepgemm_only_near_ties"]
    assert 0 < good["max_swap_margin_relative"] < b12x_serving.NEAR_TIE
    bad = b12x_serving.explain_call(tap_record("deepgemm", far, inputs), emulated)
    assert not bad["deepgemm_only_near_ties"]
    assert [p.split(", e.g.")[0] for p in bad["deepgemm_problems"]] == [
        "row 3: 1 positions above the k-th logit not chosen", "row 3: 1 chosen positions below the k-th logit"]
    other = dict(inputs, weights=inputs["weights"] * 2)
    assert b12x_serving.explain_call(tap_record("deepgemm", near, other), emulated)["same_inputs"] is False


def import_indexer_tap():
    """emulation/indexer_tap.py, a top-level module of that folder (as the validation runs it)."""
    sys.path.insert(0, str(EMULATION))
    try:
        import indexer_tap
    finally:
        sys.path.remove(str(EMULATION))
    return indexer_tap


def test_the_recorder_keeps_long_prefill_calls_and_skips_short_ones(tmp_path, monkeypatch):
    import types

    torch = pytest.importorskip("torch")

    indexer_tap = import_indexer_tap()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    module = types.SimpleNamespace(prefill_topk=lambda q, w, kq, s, ks, ke, k, out: out.fill_(3))
    patches = indexer_tap.with_taps({}, str(tmp_path))
    patches[indexer_tap.B12X_INDEXER](module)
    inputs = causal_prefill(rows=4, keys=600)
    args = (inputs["q_fp8"], inputs["weights"], *inputs["kv_fp8"])
    short = torch.zeros((4, 512), dtype=torch.int32)
    module.prefill_topk(*args, inputs["ks"], torch.full((4,), 300, dtype=torch.int32), 512, short)
    assert list(tmp_path.iterdir()) == []  # every row sees <= topk keys: nothing to select
    out = torch.zeros((4, 512), dtype=torch.int32)
    module.prefill_topk(*args, inputs["ks"], inputs["ke"], 512, out)
    saved = list(tmp_path.glob("b12x-*-00.pt"))
    assert len(saved) == 1 and bool((out == 3).all())
    doc = torch.load(saved[0])
    assert doc["kind"] == "b12x" and doc["topk"] == 512 and torch.equal(doc["chosen"], out)
    assert torch.equal(doc["q"], inputs["q_fp8"].view(torch.uint8))


# How each base calls DeepGEMM's prefill logits after ke: 0.24.0 by keyword, 0.33.0 positionally.
LOGITS_TAILS = {"0.24.0": ((), {"clean_logits": False}), "0.33.0": ((600,), {})}


@pytest.mark.parametrize("vllm", sorted(LOGITS_TAILS))
def test_the_recorder_pairs_deepgemms_logits_inputs_with_its_topk_output(tmp_path, monkeypatch, vllm):
    import types

    torch = pytest.importorskip("torch")
    indexer_tap = import_indexer_tap()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ops = types.SimpleNamespace(top_k_per_row_prefill=lambda logits, ks, ke, out, n, s0, s1, k: out.fill_(5))
    rest, options = LOGITS_TAILS[vllm]
    seen = []

    def deepgemm_logits(q, kv, w, ks, ke, *args, **kwargs):
        seen.append((args, kwargs))
        return torch.zeros(4, 600)

    module = types.SimpleNamespace(fp8_fp4_mqa_logits=deepgemm_logits, ops=ops)
    indexer_tap.with_taps({}, str(tmp_path))[indexer_tap.SPARSE_ATTN_INDEXER](module)
    inputs = causal_prefill(rows=4, keys=600)
    logits = module.fp8_fp4_mqa_logits((inputs["q_fp8"], None), inputs["kv_fp8"], inputs["weights"],
                                       inputs["ks"], inputs["ke"], *rest, **options)
    assert seen == [(rest, options)]
    out = torch.zeros((4, 512), dtype=torch.int32)
    module.ops.top_k_per_row_prefill(logits, inputs["ks"], inputs["ke"], out, 4, 600, 1, 512)
    doc = torch.load(next(tmp_path.glob("deepgemm-*.pt")))
    assert torch.equal(doc["chosen"], out) and bool((out == 5).all())
    assert torch.equal(doc["k_scale"], inputs["kv_fp8"][1]) and torch.equal(doc["ke"], inputs["ke"])
