"""docker-bake.json: the recipe's pins as bake variables (`scripts/recipe.py render`).

docker-bake.hcl (targets, contexts, secrets) reads these variables; bake merges both files.
Every base of the recipe is in here: `VLLM` maps each vLLM version to its pins, `TARGETS`
and `VLLM_VERSIONS` drive the HCL's target matrix, `DEFAULT_VLLM` picks the base of the plain
target names. Scalar values are strings (bake passes them on as build args): lists are joined
the way their consumer takes them (platforms with ",", TORCH_CUDA_ARCH_LIST with ";").
"""

from __future__ import annotations

import json
from pathlib import Path

from dsa_image.overlay.core import predicted_receipt_sha256
from dsa_image.core.recipe import ARCH_OF_PLATFORM, RECIPES_DIR, Recipe, Target, load_every_base

BAKE_JSON = Path("docker-bake.json")


def _target_args(target: Target) -> dict[str, str]:
    return {
        "PLATFORMS": ",".join(target.platforms),
        "CUDA_ARCH_LIST": ";".join(target.cuda_arch),
        # Name of the extras lock (recipes/locks/vllm-<version>/<name>-<arch>.txt); "" = common lock only.
        "EXTRAS_LOCK": target.id if target.extras else "",
    }


def _base_args(recipe: Recipe) -> dict[str, str]:
    """What differs between bases: the vLLM version, its wheels and the receipt its overlay
    makes apply write (the image's label, checked against the real receipt during the build;
    `overlay.py record` re-renders)."""
    args = {"VLLM_VERSION": recipe.vllm_version, "RECEIPT_SHA256": predicted_receipt_sha256(recipe)}
    for platform, wheel in recipe.wheels.items():
        args[f"VLLM_WHEEL_SHA256_{ARCH_OF_PLATFORM[platform].upper()}"] = wheel.sha256
    return args


def bake_variables(bases: list[Recipe]) -> dict[str, object]:
    """The variables docker-bake.hcl reads, from the recipe once per base (default first)."""
    default = bases[0]
    return {
        "RECIPE": default.id,
        "BASE_IMAGE": default.base_ref,
        "PYTHON_VERSION": default.python,
        "DEFAULT_MODEL": str(default.serving["default_model"]),
        "PORT": str(default.serving["port"]),
        "DEFAULT_VLLM": default.vllm_version,
        "VLLM_VERSIONS": [recipe.vllm_version for recipe in bases],
        "TARGETS": list(default.targets),
        "TARGET_ARGS": {target.id: _target_args(target) for target in default.targets.values()},
        "VLLM": {recipe.vllm_version: _base_args(recipe) for recipe in bases},
    }


def render_bake_json(recipe_id: str, recipes_dir: Path = RECIPES_DIR) -> str:
    document = {
        "//": f"Generated from recipes/{recipe_id}.toml by `python3 scripts/recipe.py render`. Do not edit.",
        "variable": {name: {"default": value}
                     for name, value in sorted(bake_variables(load_every_base(recipe_id, recipes_dir)).items())},
    }
    return json.dumps(document, indent=2, sort_keys=True) + "\n"
