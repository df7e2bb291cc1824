"""What the H200 validation records say their servers ran, re-judged from their raw logs (each
record's raw.tar.xz, unpacked by tests/record_files.py) with the harnesses' own readers: which
path each served mode took, how soon the model classes resolved. Nothing here compares a record
with today's receipts or prose (scripts/release_check.py does that). No GPU."""

from __future__ import annotations

import json
import posixpath
import re

import pytest

from dsa_image.harness import server as serving
from dsa_image.validation import serving_modes
from record_files import BENCHMARKS, VALIDATION, listed, unpacked

# The first served MTP, 64k and fp8 KV runs of 0.33.0, and its warm start.
RUN4 = VALIDATION / "h200-2026-12-01-vllm0_33_0-run4"
# The image's first start, and the benchmark of the same session.
RUN5 = VALIDATION / "h200-2026-12-01-vllm0_33_0-run5"
RUN3 = VALIDATION / "h200-2026-11-30-vllm0_33_0-run3"
# The serve phase's servers: bf16 KV cache, no MTP (no mode of serving_modes is exactly that).
PLAIN = serving_modes.Mode("plain", "base", 8192, serving.PROMPT_LENGTHS, 24)


def _logged(stock, overlay) -> dict:
    return {"stock": serving_modes.log_facts(str(stock)), "overlay": serving_modes.log_facts(str(overlay))}


# -- the paths each mode ran on the H200 ------------------------------------------------------------

RUN4_MODES = {"mtp2": "mtp", "mtp3": "mtp", "long-bf16": "longctx", "long-fp8": "longctx",
              "fp8": "deploy", "long-fp8-mtp3": "deploy"}


@pytest.mark.parametrize("mode", sorted(RUN4_MODES))
def test_each_mode_served_on_0_33_ran_the_paths_it_was_meant_to_cover(mode):
    # Re-judged from the recorded server logs alone, not from the run's own verdict.
    phase = unpacked(RUN4) / RUN4_MODES[mode]
    logged = _logged(phase / f"server-{mode}-stock.log", phase / f"server-{mode}-overlay.log")
    report = serving_modes.paths_report("0.33.0", serving_modes.MODES[mode], logged)
    assert report["as_expected"] is True, report["differences"]
    assert all(facts["errors"] == [] for facts in logged.values())
    recorded = json.loads((phase / "serving-modes.json").read_text())["modes"][mode]
    assert recorded["ok"] and serving.same_outputs(recorded["stock_vs_overlay"])


def test_the_mtp_phase_of_0_33_covered_the_flattened_and_the_native_decode_path():
    mtp = unpacked(RUN4) / "mtp"
    decode = {mode: _logged(mtp / f"server-{mode}-overlay.log", mtp / f"server-{mode}-stock.log")
              for mode in ("mtp2", "mtp3")}
    paths = {mode: serving_modes.logged_paths(logged["overlay"])["decode"] for mode, logged in decode.items()}
    assert paths == {"mtp2": [{"next_n": 3, "flattened": True}], "mtp3": [{"next_n": 4, "flattened": False}]}


@pytest.mark.parametrize("record, log", [
    (record, name) for record in sorted(VALIDATION.glob("h200-2026-11-30-overlay-*"))
    for name in listed(record, "serving-server-*.log")], ids=lambda x: getattr(x, "name", x))
def test_the_h200_logs_of_0_24_show_the_paths_expected_for_0_24_and_not_0_33s(record, log):
    logged = {"server": serving_modes.log_facts(str(unpacked(record) / log))}
    assert serving_modes.paths_report("0.24.0", PLAIN, logged)["as_expected"] is True
    assert serving_modes.paths_report("0.33.0", PLAIN, logged)["as_expected"] is False


# -- the model info the image ships -----------------------------------------------------------------


def _seconds(line: str) -> int:
    hours, minutes, seconds = re.search(r" (\d\d):(\d\d):(\d\d) ", line).groups()
    return 3600 * int(hours) + 60 * int(minutes) + int(seconds)


# Every server log of the fourth and fifth runs and of every benchmark (0.24.0's servers of the
# bases benchmark included).
FROM_THE_IMAGES_HOME = [(record, name) for record in (RUN4, RUN5, *sorted(BENCHMARKS.glob("h200-*")))
                        for name in listed(record) if posixpath.basename(name).startswith("server-")
                        and name.endswith(".log") and (record.parent == BENCHMARKS or "/" in name)]


@pytest.mark.parametrize("record, log", FROM_THE_IMAGES_HOME, ids=[f"{r.name}/{n}" for r, n in FROM_THE_IMAGES_HOME])
def test_servers_started_from_the_images_home_resolve_their_model_classes_at_once(record, log):
    # The model info the image ships was in each HOME: no 42-44 s inspection per class, as the
    # 8x B200 recipe's server with an empty cache spent (run3).
    lines = (unpacked(record) / log).read_text(errors="replace").splitlines()
    banner = next(line for line in lines if "non-default args:" in line)
    resolved = [line for line in lines if "Resolved architecture:" in line]
    assert resolved and all(_seconds(line) - _seconds(banner) <= 1 for line in resolved)


def test_the_recipe_server_with_an_empty_cache_took_tens_of_seconds_per_class():
    lines = (unpacked(RUN3) / "recipe-glm-5-fp8-8xb200.log").read_text(errors="replace").splitlines()
    banner = next(line for line in lines if "[startup.py:" in line)
    resolved = [_seconds(line) for line in lines if "Resolved architecture:" in line]
    assert [later - earlier for earlier, later in zip([_seconds(banner), *resolved], resolved, strict=False)] == [42, 44]
