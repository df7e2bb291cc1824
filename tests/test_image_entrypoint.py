"""dsa_image.entrypoint: what the container runs for each kind of `docker run` arguments.

Expected values come from the recipe (load_recipe), never typed here."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from dsa_image import entrypoint
from dsa_image.entrypoint import EntrypointError
from dsa_image.recipe import REPO_ROOT, load_recipe

RECIPE = load_recipe()
SM120 = RECIPE.target("sm120")
ENVIRON = {"DSA_IMAGE_TOOL": str(REPO_ROOT), "DSA_IMAGE_RECIPE": RECIPE.id, "DSA_IMAGE_TARGET": "sm120",
           "DSA_IMAGE_SITE_PACKAGES": "/nonexistent"}


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_no_arguments_serves_the_tiny_model_with_dummy_weights_and_says_so():
    plan = entrypoint.plan([], ENVIRON)
    serving = RECIPE.serving
    assert plan.argv[:3] == ["vllm", "serve", serving["default_model"]]
    assert _value(plan.argv, "--load-format") == serving["default_load_format"]
    assert _value(plan.argv, "--served-model-name") == serving["served_model_name"]
    assert _value(plan.argv, "--max-model-len") == str(serving["max_model_len"])
    assert _value(plan.argv, "--kv-cache-dtype") == SM120.kv_cache_dtype
    assert _value(plan.argv, "--port") == str(serving["port"])
    assert "tiny GLM-5" in plan.log and "random weights" in plan.log and serving["default_model"] in plan.log


@pytest.mark.parametrize("target_id", list(RECIPE.targets))
def test_each_target_gets_its_own_kv_cache_dtype_and_environment(target_id):
    plan = entrypoint.plan([], {**ENVIRON, "DSA_IMAGE_TARGET": target_id})
    target = RECIPE.target(target_id)
    assert _value(plan.argv, "--kv-cache-dtype") == target.kv_cache_dtype
    assert plan.env == target.env


def test_the_containers_own_environment_wins_over_the_targets():
    name = next(iter(SM120.env))
    plan = entrypoint.plan([], {**ENVIRON, name: "0"})
    assert name not in plan.env


def test_arguments_go_to_vllm_serve_with_defaults_only_for_flags_not_given():
    plan = entrypoint.plan(["some/model", "--max_model_len=4096", "--kv-cache-dtype", "auto", "-tp", "8"], ENVIRON)
    assert plan.argv[:3] == ["vllm", "serve", "some/model"]
    assert plan.argv.count("--kv-cache-dtype") == 1 and _value(plan.argv, "--kv-cache-dtype") == "auto"
    assert "--max-model-len" not in plan.argv and "--max_model_len=4096" in plan.argv
    assert "--load-format" not in plan.argv  # dummy weights only for the built-in model
    assert _value(plan.argv, "--served-model-name") == RECIPE.serving["served_model_name"]


def test_missing_image_environment_is_an_error_naming_the_variable():
    with pytest.raises(EntrypointError, match="DSA_IMAGE_TARGET"):
        entrypoint.plan([], {k: v for k, v in ENVIRON.items() if k != "DSA_IMAGE_TARGET"})


def test_unknown_target_is_an_error_listing_the_valid_ones():
    with pytest.raises(EntrypointError, match="valid targets"):
        entrypoint.plan([], {**ENVIRON, "DSA_IMAGE_TARGET": "sm75"})


def _receipts(tmp_path: Path, data: bytes = b'{"files": []}\n') -> tuple[Path, Path, Path]:
    site = tmp_path / "site-packages"
    site.mkdir()
    (site / entrypoint.SITE_RECEIPT_NAME).write_bytes(data)
    receipt, recorded = tmp_path / "receipt.json", tmp_path / "receipt.json.sha256"
    receipt.write_bytes(data)
    recorded.write_text(f"{hashlib.sha256(data).hexdigest()}  receipt.json\n")
    return site, receipt, recorded


def test_check_receipt_returns_the_recorded_sha256(tmp_path):
    site, receipt, recorded = _receipts(tmp_path)
    assert entrypoint.check_receipt(site, receipt, recorded) == hashlib.sha256(receipt.read_bytes()).hexdigest()


def test_check_receipt_fails_on_an_edited_receipt(tmp_path):
    site, receipt, recorded = _receipts(tmp_path)
    receipt.write_bytes(b'{"files": ["x"]}\n')
    with pytest.raises(EntrypointError, match="the build recorded"):
        entrypoint.check_receipt(site, receipt, recorded)


def test_check_receipt_fails_when_site_packages_holds_another_receipt(tmp_path):
    site, receipt, recorded = _receipts(tmp_path)
    (site / entrypoint.SITE_RECEIPT_NAME).write_bytes(b"{}\n")
    with pytest.raises(EntrypointError, match="differs from"):
        entrypoint.check_receipt(site, receipt, recorded)


def test_check_receipt_fails_when_missing(tmp_path):
    site, receipt, recorded = _receipts(tmp_path)
    recorded.unlink()
    with pytest.raises(EntrypointError, match="missing"):
        entrypoint.check_receipt(site, receipt, recorded)


def test_verify_runs_the_overlay_tools_verify(tmp_path, monkeypatch):
    site, receipt, recorded = _receipts(tmp_path)
    monkeypatch.setattr(entrypoint, "RECEIPT", receipt)
    monkeypatch.setattr(entrypoint, "RECEIPT_SHA256", recorded)
    plan = entrypoint.plan(["verify"], {**ENVIRON, "DSA_IMAGE_SITE_PACKAGES": str(site)})
    assert plan.argv[1:] == [str(REPO_ROOT / "scripts" / "overlay.py"), "verify", "--site-packages", str(site)]
