"""The serving-modes and warm-start harnesses read against vLLM 0.33.0, on the CPU.

Both were written against vLLM 0.24.0 and first meet 0.33.0 on the H200 in the `mtp`,
`longctx`, `deploy` and `warmstart` phases. What differs, read from the H200's 0.33.0 logs
(docs/validation/h200-2026-11-30-vllm0_33_0-run2, excerpted in tests/data/) and the 0.33.0 sources:

- the attention backend of the bf16 modes is FLASH_ATTN_MLA_SPARSE, of the fp8_ds_mla modes
  still FLASHMLA_SPARSE (the only sm_90 backend that takes that dtype);
- next_n=4 (MTP 3) decodes natively on sm_90; next_n=3 (MTP 2) is flattened;
- a cold server builds FlashInfer's sampling module (~100 s), which nothing measured;
- 0.33.0's DeepGEMM prints its compiler runs as "Running command:", not "Running NVCC
  command:";
- vLLM's JIT monitor also reports CuTeDSL and TileLang compilations, with the Triton ones'
  wording.

The tests that read the 0.33.0 wheel skip where it is not in the wheel cache (dsa_image.core.wheels).
What the runs of 0.33.0 served, re-judged from their records, is tests/test_validation_records.py.
"""

from __future__ import annotations

import json
import re
import sys
import zipfile
from pathlib import Path

import pytest

from dsa_image.runtime import spec_decode_metrics
from dsa_image.core.recipe import load_recipe
from dsa_image.harness import server as serving
from dsa_image.validation import serving_modes, warmstart
from dsa_image.core.wheels import wheel_cache_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bench import fake_vllm_site, free_ports, tiny_model  # noqa: E402,F401 (tiny_model: a fixture)
from test_validation_vllm_base import fake_site  # noqa: E402

# Excerpts of H200 logs (tests/data/excerpts.toml): the second 0.33.0 run's, and two of 0.24.0.
DATA = Path(__file__).resolve().parent / "data"
RUN2 = DATA / "h200-vllm0_33_0-run2-"
RECIPE_0_24 = DATA / "h200-overlay-f1d4805b-recipe-glm-5-fp8-8xb200.log"
TOOLCHAIN_0_24 = DATA / "h200-overlay-c2b8469b-toolchain-server.log"
WHEEL_0_33 = wheel_cache_path("vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl")

# The serve phase's servers: bf16 KV cache, no MTP (no mode of serving_modes is exactly that).
PLAIN = serving_modes.Mode("plain", "base", 8192, serving.PROMPT_LENGTHS, 24)


def run2(name: str) -> Path:
    return Path(f"{RUN2}{name}")


def _logged(stock: Path, overlay: Path) -> dict:
    return {"stock": serving_modes.log_facts(str(stock)), "overlay": serving_modes.log_facts(str(overlay))}


# -- the paths each mode runs on the H200 ---------------------------------------------------------


def test_the_h200_logs_of_0_33_show_the_paths_expected_for_0_33_and_not_0_24s():
    logged = _logged(run2("server-stock_a.log"), run2("server-overlay.log"))
    on_0_33 = serving_modes.paths_report("0.33.0", PLAIN, logged)
    assert on_0_33["as_expected"] is True, on_0_33["differences"]
    assert on_0_33["logged"]["overlay"] == {"attention_backend": ["FLASH_ATTN_MLA_SPARSE"],
                                            "decode": [{"next_n": 1, "flattened": False}], "kv_cache_dtype": []}
    # The 0.24.0-era expectation, FLASHMLA_SPARSE, would misjudge the same servers.
    on_0_24 = serving_modes.paths_report("0.24.0", PLAIN, logged)
    assert on_0_24["as_expected"] is False
    assert on_0_24["differences"]["overlay"] == [
        "attention backend ['FLASH_ATTN_MLA_SPARSE'], expected FLASHMLA_SPARSE"]


def test_a_0_24_h200_log_of_mtp_3_with_fp8_is_as_expected_for_0_24_only():
    # vLLM 0.24.0, MTP 3, --kv-cache-dtype fp8, --attention-backend FLASHMLA_SPARSE.
    facts = serving_modes.log_facts(str(RECIPE_0_24))
    mode = serving_modes.Mode("recipe", "mtp", 8192, (1,), 1, spec_tokens=3, kv_cache_dtype="fp8")
    assert serving_modes.paths_report("0.24.0", mode, {"overlay": facts})["as_expected"] is True
    on_0_33 = serving_modes.paths_report("0.33.0", mode, {"overlay": facts})
    assert on_0_33["differences"]["overlay"] == [
        "decode path [{'next_n': 4, 'flattened': True}], expected [{'next_n': 4, 'flattened': False}]"]


def test_log_facts_read_0_33s_fp8_and_named_backend_lines():
    # vLLM 0.33.0, --kv-cache-dtype fp8 --attention-backend FLASHMLA_SPARSE: "Using
    # AttentionBackendEnum.FLASHMLA_SPARSE backend.", which "Using X attention backend" missed.
    facts = serving_modes.log_facts(str(run2("recipe-glm-5-fp8-8xb200.log")))
    assert facts["attention_backend"] == ["FLASHMLA_SPARSE"]
    assert facts["kv_cache_dtype"] == ["fp8"] and facts["kv_cache_format"] == ["fp8_ds_mla"]
    assert facts["errors"] == []  # its traceback came after the harness's SIGTERM


def test_an_fp8_ds_mla_server_logs_its_dtype_though_not_a_format():
    # --kv-cache-dtype fp8_ds_mla is no alias, so mla_attention.py logs no "KV cache format";
    # config/cache.py logs the dtype (the line of the 0.33.0 recipe run, with the modes' dtype).
    line = next(line for line in (run2("recipe-glm-5-fp8-8xb200.log")).read_text().splitlines()
                if "data type to store kv cache" in line).replace("Using fp8 data", "Using fp8_ds_mla data")
    facts = {name: pattern.findall(line) for name, pattern in serving_modes.LOG_FACTS.items()}
    assert facts["kv_cache_dtype"] == ["fp8_ds_mla"] and facts["kv_cache_format"] == []


def test_the_overlays_warmup_and_indexer_lines_are_facts():
    logged = _logged(run2("server-stock_a.log"), run2("server-overlay.log"))
    assert logged["stock"]["jit_warmup_keys"] == ["2"] and logged["overlay"]["jit_warmup_keys"] == ["65"]
    assert logged["stock"]["indexer_kernels"] == [] and logged["overlay"]["indexer_kernels"] == ["deepgemm"]
    assert logged["stock"]["block_table_growth"] == logged["overlay"]["block_table_growth"] == []


@pytest.mark.parametrize("base, mode, backend, next_n, flattened", [
    ("0.24.0", "mtp1", "FLASHMLA_SPARSE", 2, False),
    ("0.24.0", "mtp2", "FLASHMLA_SPARSE", 3, True),
    ("0.24.0", "mtp3", "FLASHMLA_SPARSE", 4, True),
    ("0.24.0", "long-fp8-mtp3", "FLASHMLA_SPARSE", 4, True),
    ("0.33.0", "mtp1", "FLASH_ATTN_MLA_SPARSE", 2, False),
    ("0.33.0", "mtp2", "FLASH_ATTN_MLA_SPARSE", 3, True),
    ("0.33.0", "mtp3", "FLASH_ATTN_MLA_SPARSE", 4, False),
    ("0.33.0", "long-bf16", "FLASH_ATTN_MLA_SPARSE", 1, False),
    ("0.33.0", "fp8", "FLASHMLA_SPARSE", 1, False),
    ("0.33.0", "long-fp8-mtp3", "FLASHMLA_SPARSE", 4, False),
])
def test_what_each_mode_runs_on_the_h200(base, mode, backend, next_n, flattened):
    expected = serving_modes.expected_on_h200(base, serving_modes.MODES[mode])
    assert (expected["attention_backend"], expected["next_n"], expected["flattened"]) == (backend, next_n, flattened)
    assert expected["kv_cache_dtype"] == (None if serving_modes.MODES[mode].kv_cache_dtype == "auto" else "fp8_ds_mla")


@pytest.mark.parametrize("base", sorted(serving_modes.H200_PATHS))
def test_the_bf16_backend_expected_is_the_recipes_sm90_one(base):
    assert serving_modes.H200_PATHS[base]["backend"]["auto"] == load_recipe(vllm=base).targets["sm90"].attention_backend


def test_the_flattened_decode_path_has_a_mode_on_every_base():
    for base in serving_modes.H200_PATHS:
        flattened = {m.name for m in serving_modes.MODES.values()
                     if serving_modes.expected_on_h200(base, m)["flattened"]}
        assert "mtp2" in flattened, base


def test_no_record_no_judgement():
    assert serving_modes.expected_on_h200("0.99.0", serving_modes.MODES["mtp3"]) is None
    logged = {"stock": serving_modes.log_facts(str(run2("server-stock_a.log")))}
    report = serving_modes.paths_report(None, PLAIN, logged)
    assert "as_expected" not in report and "not judged" in serving_modes.paths_summary(report)


# -- which base ----------------------------------------------------------------------------------




def test_the_base_is_the_sites_vllm_which_vllm_must_name(tmp_path):
    a, b = fake_site(tmp_path / "a", "0.33.0"), fake_site(tmp_path / "b", "0.33.0")
    assert serving_modes.resolve_base(None, [a, b]) == "0.33.0"
    assert serving_modes.resolve_base("0.33.0", [a, b]) == "0.33.0"
    with pytest.raises(SystemExit, match="--vllm 0.24.0, but vLLM 0.33.0 is installed"):
        serving_modes.resolve_base("0.24.0", [a, b])
    with pytest.raises(SystemExit, match="one base per run"):
        serving_modes.resolve_base(None, [a, fake_site(tmp_path / "c", "0.24.0")])
    bare = fake_site(tmp_path / "bare", None)
    assert serving_modes.resolve_base(None, [bare]) is None
    assert serving_modes.resolve_base("0.33.0", [bare]) == "0.33.0"


def test_a_whole_run_reports_its_paths_and_passes_on_tokens_alone(tmp_path, tiny_model, capsys):  # noqa: F811
    # The fake servers log no vLLM lines: the paths differ from the H200's, the verdict stands.
    stock = fake_vllm_site(tmp_path / "stock", fake={"spec": True})
    overlay = fake_vllm_site(tmp_path / "overlay", fake={"spec": True})
    code = serving_modes.main(["--modes", "mtp2", "--model", str(tiny_model), "--mtp-model", str(tiny_model),
                               "--stock-site", str(stock), "--overlay-site", str(overlay),
                               "--out", str(tmp_path / "out"), "--port-base", str(free_ports(2)), "--timeout", "60"])
    doc = json.loads((tmp_path / "out" / "serving-modes.json").read_text())
    assert code == 0 and doc["ok"] and doc["vllm"] == "0.24.0"
    paths = doc["modes"]["mtp2"]["paths"]
    assert paths["expected_on_h200"] == {"attention_backend": "FLASHMLA_SPARSE", "next_n": 3, "flattened": True,
                                         "kv_cache_dtype": None}
    assert paths["as_expected"] is False and paths["logged"]["overlay"]["decode"] == []
    assert json.loads(doc["modes"]["mtp2"]["server_args"][3])["num_speculative_tokens"] == 2
    assert "mtp2: PASS; paths NOT as on an H200 with vLLM 0.24.0 (FLASHMLA_SPARSE, next_n=3 flattened)" \
        in capsys.readouterr().out
    # Each server started from the image's HOME: the model info its side's vLLM made, nothing else.
    for side in ("stock", "overlay"):
        home = tmp_path / "out" / "work" / f"home-mtp2-{side}"
        made = tmp_path / "out" / "work" / "model-info" / f"{side}-{tiny_model.name}" / "modelinfos"
        assert sorted(p.name for p in (home / ".cache" / "vllm" / "modelinfos").iterdir()) \
            == sorted(p.name for p in made.iterdir()) \
            == ["vllm-models-fake-DeepseekV32MTPModel.json", "vllm-models-fake-GlmMoeDsaForCausalLM.json"]


def _modes_args(tmp_path, model: Path, stock: Path, overlay: Path, *more: str) -> list[str]:
    return ["--model", str(model), "--stock-site", str(stock), "--overlay-site", str(overlay),
            "--out", str(tmp_path / "out"), "--model-info-root", str(tmp_path / "model-info"), *more]


def test_model_info_is_made_once_per_side_from_the_mtp_model_and_kept(tmp_path, tiny_model, capsys):  # noqa: F811
    from dsa_image.build.tiny_model import MTP_CONFIG, write_model

    mtp = tmp_path / "tiny-mtp"
    write_model(mtp, MTP_CONFIG)
    stock, overlay = fake_vllm_site(tmp_path / "stock"), fake_vllm_site(tmp_path / "overlay")
    args = _modes_args(tmp_path, tiny_model, stock, overlay, "--mtp-model", str(mtp), "--model-info-only")
    assert serving_modes.main(args) == 0
    made = json.loads(capsys.readouterr().out)
    assert made == {side: str(tmp_path / "model-info" / f"{side}-tiny-mtp" / "modelinfos") for side in ("stock", "overlay")}
    # Made from the MTP model: its classes cover the base model's too.
    for entries in made.values():
        assert sorted(p.name for p in Path(entries).iterdir()) == [
            "vllm-models-fake-DeepseekV32MTPModel.json", "vllm-models-fake-GlmMoeDsaForCausalLM.json"]
    assert not list((tmp_path / "out").glob("server-*.log"))  # no server started
    # Kept: a second call (the serving phase after install) makes nothing again.
    stamp = {p: p.stat().st_mtime_ns for p in (tmp_path / "model-info").rglob("*.json")}
    (stock / "vllm" / "model_executor" / "models" / "registry.py").unlink()  # would fail a new fill
    assert serving_modes.main(args) == 0
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "model-info").rglob("*.json")} == stamp


def test_a_side_whose_vllm_cannot_make_the_model_info_starts_no_server(tmp_path, tiny_model):  # noqa: F811
    stock, overlay = fake_vllm_site(tmp_path / "stock"), fake_vllm_site(tmp_path / "overlay")
    (overlay / "vllm" / "model_executor" / "models" / "registry.py").unlink()
    with pytest.raises(SystemExit, match=r"the model info the image ships, for .*: RuntimeError: "
                                         r"model_info_cache fill exited with 1"):
        serving_modes.main(_modes_args(tmp_path, tiny_model, stock, overlay, "--modes", "fp8",
                                       "--port-base", str(free_ports(2))))
    assert not list((tmp_path / "out").glob("server-*.log"))


def test_modes_or_model_info_only_is_required(tmp_path, capsys):
    with pytest.raises(SystemExit):
        serving_modes.parse_args(["--model", "m", "--stock-site", "s", "--overlay-site", "o", "--out", str(tmp_path)])
    assert "expected --modes (or --model-info-only)" in capsys.readouterr().err


# -- the warm start: what compiled, and when ----------------------------------------------------


def test_a_cold_0_33_start_shows_flashinfers_sampling_build_before_healthy():
    log = run2("server-overlay.log")
    healthy = log.read_bytes().index(b'"GET /health HTTP/1.1" 200')
    before = warmstart.compiled_between({"log": str(log)}, 0, healthy)
    after = warmstart.compiled_between({"log": str(log)}, healthy)
    assert before["flashinfer_jit_builds"] == ["sampling"] and after["flashinfer_jit_builds"] == []
    assert after["triton_jit"] == {"fused_moe_kernel": 1} and after["other_jit"] == {}
    stock = warmstart.compiled_between({"log": str(run2("server-stock_a.log"))}, 0)
    assert stock["triton_jit"] == {"BuildPrefillChunkMetadataKernel": 1, "fused_moe_kernel": 1}


def _server_log(tmp_path, lines: list[str]) -> dict:
    log = tmp_path / "server.log"
    log.write_text("".join(line + "\n" for line in lines))
    return {"log": str(log)}


def test_deepgemm_compiler_runs_are_counted_in_both_bases_wordings(tmp_path):
    line_0_24 = next(line for line in TOOLCHAIN_0_24.read_text().splitlines()
                     if line.startswith("Running NVCC command: "))
    # 0.33.0's DeepGEMM (deep_jit) prints "Running command: %s" for the same compile command.
    line_0_33 = line_0_24.replace("Running NVCC command: ", "Running command: ")
    server = _server_log(tmp_path, [line_0_24, line_0_33, "Running command: which nvcc",
                                      "Running NVCC PTX command: nvcc x.cu -ptx",
                                      "(EngineCore pid=1) INFO 11-30 21:01:21 [deep_gemm.py:227] DeepGEMM PDL enabled."])
    assert warmstart.log_slice(server, 0)["deepgemm_nvcc_runs"] == 2
    assert warmstart.deepgemm_lines(server["log"]) == ["DeepGEMM PDL enabled."]


def test_other_runtimes_jit_lines_are_not_taken_for_triton_kernels(tmp_path):
    triton = next(line for line in (run2("server-stock_a.log")).read_text().splitlines()
                  if "BuildPrefillChunkMetadataKernel.kernel" in line)
    # vLLM 0.33.0's _handle_jit_event, backend="CuTeDSL", event="JIT compilation".
    cute = triton.replace("Triton kernel JIT compilation during inference: BuildPrefillChunkMetadataKernel.kernel",
                          "CuTeDSL JIT compilation during inference: sparse_mla_fwd")
    assert "CuTeDSL JIT compilation during inference: sparse_mla_fwd. This causes" in cute
    server = _server_log(tmp_path, [triton, cute])
    assert warmstart.log_slice(server, 0)["triton_jit"] == {"BuildPrefillChunkMetadataKernel": 1}
    assert warmstart.compiled_between(server, 0)["other_jit"] == {"CuTeDSL:sparse_mla_fwd": 1}
    assert serving.jit_kernels_during_inference(server["log"]) == ["BuildPrefillChunkMetadataKernel",
                                                                   "CuTeDSL:sparse_mla_fwd"]


def test_the_summary_says_what_a_start_built(tmp_path):
    compiled = {"triton_jit": {}, "deepgemm_nvcc_runs": 0, "flashinfer_jit_builds": [], "other_jit": {}}
    side = {"healthy_after_s": 270.3, "ready_after_s": 270.3, "first": {"latency_s": 0.5}, "warm_latency_s": 0.1,
            "first_over_warm": 5.0, "goal_met": False,
            "compiled": {"before_healthy": {**compiled, "flashinfer_jit_builds": ["sampling"]},
                         "during_first_request": {**compiled, "triton_jit": {"fused_moe_kernel": 1}}}}
    (line,) = warmstart.summary_lines({"steps": {"cold": {"sides": {"overlay": side}}}})
    assert "FlashInfer built at start: ['sampling']" in line and "compiled in first: ['fused_moe_kernel']" in line


# -- the 0.33.0 sources these rest on ------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel_0_33():
    if not WHEEL_0_33.is_file():
        pytest.skip(f"{WHEEL_0_33} is not here (`scripts/recipe.py lock` puts it there)")
    with zipfile.ZipFile(WHEEL_0_33) as wheel:
        yield wheel


def _source(wheel: zipfile.ZipFile, path: str) -> str:
    return wheel.read(path).decode()


def test_0_33s_jit_monitor_words_match_the_line_pattern(wheel_0_33):
    source = _source(wheel_0_33, "vllm/utils/jit_monitor.py")
    assert '"%s %s during inference: %s%s. "' in source
    events = re.findall(r'backend="(\w+)",\s*event="([\w ]+)"', source)
    assert set(events) == {("Triton", "kernel JIT compilation"), ("CuTeDSL", "JIT compilation"),
                           ("TileLang", "JIT compilation")}
    for backend, event in events:
        match = serving.JIT_LINE.search(f"{backend} {event} during inference: some_kernel. This causes")
        assert match and match.groups() == (backend, "some_kernel")
    assert '"--jit-monitor-verbose"' in _source(wheel_0_33, "vllm/engine/arg_utils.py")


def test_0_33_decodes_next_n_1_2_4_natively_on_sm90(wheel_0_33):
    source = _source(wheel_0_33, "vllm/utils/deep_gemm.py")
    body = source[source.index("def native_next_n_supported"):][:800]
    assert "is_device_capability_family(90)" in body and "return next_n in (1, 2, 4)" in body
    assert serving_modes.H200_PATHS["0.33.0"]["native_next_n"] == (1, 2, 4)


def test_0_33s_sm90_sparse_backends_and_the_fp8_ds_mla_cache(wheel_0_33):
    cuda = _source(wheel_0_33, "vllm/platforms/cuda.py")
    tail = cuda[cuda.index("sparse_tail = ["):][:200]
    assert tail.index("FLASH_ATTN_MLA_SPARSE") < tail.index("FLASHMLA_SPARSE")
    fa = _source(wheel_0_33, "vllm/v1/attention/backends/mla/flashattn_mla_sparse.py")
    dtypes = fa[fa.index("supported_kv_cache_dtypes"):][:200]
    assert "fp8" not in dtypes  # so an fp8 cache goes to FLASHMLA_SPARSE
    assert '"fp8_ds_mla",' in _source(wheel_0_33, "vllm/v1/attention/backends/mla/flashmla_sparse.py")


def test_0_33s_spec_decode_counters_are_the_ones_read(wheel_0_33):
    source = _source(wheel_0_33, "vllm/v1/spec_decode/metrics.py")
    for name in (*spec_decode_metrics.SPEC_COUNTERS.values(), spec_decode_metrics.SPEC_PER_POSITION):
        assert f'"{name.removesuffix("_total")}"' in source  # prometheus_client adds _total


def test_0_33s_deepgemm_prints_its_commands_as_running_command(wheel_0_33):
    binary = wheel_0_33.read("vllm/third_party/deep_gemm/_C_extension.abi3.so")
    assert b"Running command: %s" in binary and b"Running NVCC command" not in binary
    assert b"JIT_PRINT_COMPILER_COMMAND" in binary


def test_the_mtp_phase_covers_both_decode_paths_of_each_base():
    """`--modes mtp-paths` (the H200 script's mtp phase): one native and one flattened MTP mode."""
    assert serving_modes.decode_path_modes("0.24.0") == ["mtp1", "mtp3"]
    assert serving_modes.decode_path_modes("0.33.0") == ["mtp2", "mtp3"]
    for base in ("0.24.0", "0.33.0"):
        paths = {serving_modes.expected_on_h200(base, serving_modes.MODES[m])["flattened"]
                 for m in serving_modes.decode_path_modes(base)}
        assert paths == {True, False}
    with pytest.raises(SystemExit, match="no decode-path record for vLLM 0.30.0"):
        serving_modes.decode_path_modes("0.30.0")
