"""docker-bake.json: the recipe's pins as bake variables (`scripts/recipe.py render`).

docker-bake.hcl (targets, contexts, secrets) reads these variables; bake merges both files.
Values are strings (bake passes them on as build args): lists are joined the way their
consumer takes them (platforms with ",", TORCH_CUDA_ARCH_LIST with ";", env as K=V with " ").
"""

from __future__ import annotations

import json
from pathlib import Path

from .overlay import predicted_receipt_sha256
from .recipe import ARCH_OF_PLATFORM, Recipe, Target

BAKE_JSON = Path("docker-bake.json")


def _target_variables(target: Target) -> dict[str, str]:
    prefix = target.id.upper()
    return {
        f"{prefix}_PLATFORMS": ",".join(target.platforms),
        f"{prefix}_CUDA_ARCH_LIST": ";".join(target.cuda_arch),
        f"{prefix}_KV_CACHE_DTYPE": target.kv_cache_dtype,
        f"{prefix}_ATTENTION_BACKEND": target.attention_backend,
        f"{prefix}_INDEXER_BACKEND": target.indexer_backend,
        # Name of the extras lock (recipes/locks/<name>-<arch>.txt); "" = common lock only.
        f"{prefix}_EXTRAS_LOCK": target.id if target.extras else "",
        f"{prefix}_ENV": " ".join(f"{k}={v}" for k, v in sorted(target.env.items())),
    }


def bake_variables(recipe: Recipe) -> dict[str, str]:
    serving = recipe.serving
    variables = {
        "RECIPE": recipe.id,
        "VLLM_VERSION": recipe.vllm_version,
        "BASE_IMAGE": recipe.base_ref,
        "PYTHON_VERSION": recipe.python,
        "TARGETS": ",".join(recipe.targets),
        "SERVED_MODEL_NAME": str(serving["served_model_name"]),
        "MAX_MODEL_LEN": str(serving["max_model_len"]),
        "DEFAULT_MODEL": str(serving["default_model"]),
        "DEFAULT_LOAD_FORMAT": str(serving["default_load_format"]),
        "PORT": str(serving["port"]),
        # The receipt `apply` must write for overlay/manifest.json: the image's label, and
        # checked against the real receipt during the build. `overlay.py record` re-renders.
        "RECEIPT_SHA256": predicted_receipt_sha256(recipe.id),
    }
    for platform, wheel in recipe.wheels.items():
        arch = ARCH_OF_PLATFORM[platform].upper()
        variables[f"VLLM_WHEEL_{arch}"] = wheel.filename
        variables[f"VLLM_WHEEL_SHA256_{arch}"] = wheel.sha256
    for target in recipe.targets.values():
        variables.update(_target_variables(target))
    return variables


def render_bake_json(recipe: Recipe) -> str:
    document = {
        "//": f"Generated from recipes/{recipe.id}.toml by `python3 scripts/recipe.py render`. Do not edit.",
        "variable": {name: {"default": value} for name, value in sorted(bake_variables(recipe).items())},
    }
    return json.dumps(document, indent=2, sort_keys=True) + "\n"
