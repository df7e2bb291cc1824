"""The image's entrypoint: `vllm serve` with the recipe's defaults for the image's target.

    docker run IMAGE                 serve the built-in tiny dummy-weight GLM-5 (no download)
    docker run IMAGE verify          verify the overlay and the receipt, then exit
    docker run IMAGE ARGS...         vllm serve ARGS... (e.g. a model id and vLLM flags)

Every serve gets the recipe's serving defaults (served model name, max model len, port, the
target's KV-cache dtype) unless ARGS give that flag, and the target's environment (e.g.
VLLM_USE_B12X_SPARSE_INDEXER=1 on sm120) unless the container sets it. The image sets
DSA_IMAGE_RECIPE and DSA_IMAGE_TARGET; the tool (dsa_image, scripts, recipe) lives in
DSA_IMAGE_TOOL. Stdlib only.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from .recipe import Recipe, RecipeError, Target, load_recipe

RECEIPT = Path("/opt/dsa-image/receipt.json")
RECEIPT_SHA256 = Path("/opt/dsa-image/receipt.json.sha256")
SITE_RECEIPT_NAME = "vllm_overlay_receipt.json"


class EntrypointError(Exception):
    """The container cannot start as asked; the message says what to do."""


@dataclass(frozen=True)
class Plan:
    """What to run: `argv` replaces this process, with `env` added; `log` says why."""

    argv: list[str]
    env: dict[str, str]
    log: str


def _flag_name(arg: str) -> str:
    # vLLM accepts --max_model_len and --max-model-len, with "=value" or a separate value.
    return arg.split("=", 1)[0].replace("_", "-")


def serving_defaults(recipe: Recipe, target: Target) -> list[tuple[str, str]]:
    serving = recipe.serving
    return [
        ("--served-model-name", str(serving["served_model_name"])),
        ("--max-model-len", str(serving["max_model_len"])),
        ("--kv-cache-dtype", target.kv_cache_dtype),
        ("--port", str(serving["port"])),
    ]


def with_defaults(args: list[str], defaults: list[tuple[str, str]]) -> list[str]:
    """`args` plus each default flag the arguments do not already give."""
    given = {_flag_name(a) for a in args if a.startswith("--")}
    added = [part for flag, value in defaults if flag not in given for part in (flag, value)]
    return [*args, *added]


def target_env(target: Target, environ: dict[str, str]) -> dict[str, str]:
    """The target's variables the container does not set itself."""
    return {k: v for k, v in target.env.items() if k not in environ}


def plan_serve(args: list[str], recipe: Recipe, target: Target, environ: dict[str, str]) -> Plan:
    defaults = serving_defaults(recipe, target)
    env = target_env(target, environ)
    if args:
        argv = ["vllm", "serve", *with_defaults(args, defaults)]
        return Plan(argv, env, f"dsa-image {target.id}: vllm serve with the recipe's defaults: {' '.join(argv)}")
    model = str(recipe.serving["default_model"])
    load_format = str(recipe.serving["default_load_format"])
    argv = ["vllm", "serve", *with_defaults([model, "--load-format", load_format], defaults)]
    log = (f"dsa-image {target.id}: no arguments given, so serving the built-in tiny GLM-5 at {model} "
           f"with random weights (--load-format {load_format}; nothing is downloaded). To serve a real "
           f"model: docker run --gpus all -p 8000:8000 IMAGE <model> [vllm serve flags]. "
           f"Running: {' '.join(argv)}")
    return Plan(argv, env, log)


def check_receipt(site_packages: Path, receipt: Path = RECEIPT, recorded: Path = RECEIPT_SHA256) -> str:
    """The image's receipt is the one `apply` wrote into site-packages and has the sha256
    recorded at build time. Returns that sha256."""
    for path in (receipt, recorded, site_packages / SITE_RECEIPT_NAME):
        if not path.is_file():
            raise EntrypointError(f"{path}: missing; the image was not built by this Dockerfile's overlay stage")
    data = receipt.read_bytes()
    actual = hashlib.sha256(data).hexdigest()
    expected = recorded.read_text().split()[0]
    if actual != expected:
        raise EntrypointError(f"{receipt}: sha256 {actual}, but the build recorded {expected} in {recorded}")
    if (site_packages / SITE_RECEIPT_NAME).read_bytes() != data:
        raise EntrypointError(f"{receipt} differs from {site_packages / SITE_RECEIPT_NAME}, the receipt apply wrote")
    return actual


def plan_verify(tool: Path, site_packages: Path) -> Plan:
    sha = check_receipt(site_packages, RECEIPT, RECEIPT_SHA256)
    argv = [sys.executable, str(tool / "scripts" / "overlay.py"), "verify", "--site-packages", str(site_packages)]
    return Plan(argv, {}, f"dsa-image: receipt {RECEIPT} sha256 {sha} matches the build; running {' '.join(argv)}")


def _required_env(environ: dict[str, str], name: str) -> str:
    value = environ.get(name, "")
    if not value:
        raise EntrypointError(f"environment variable {name} is not set; the image's Dockerfile sets it")
    return value


def plan(args: list[str], environ: dict[str, str]) -> Plan:
    tool = Path(_required_env(environ, "DSA_IMAGE_TOOL"))
    if args == ["verify"]:
        return plan_verify(tool, Path(_required_env(environ, "DSA_IMAGE_SITE_PACKAGES")))
    try:
        recipe = load_recipe(_required_env(environ, "DSA_IMAGE_RECIPE"), tool / "recipes")
        target = recipe.target(_required_env(environ, "DSA_IMAGE_TARGET"))
    except RecipeError as exc:
        raise EntrypointError(str(exc)) from exc
    return plan_serve(args, recipe, target, environ)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        chosen = plan(args, dict(os.environ))
    except EntrypointError as exc:
        print(f"dsa-image: {exc}", file=sys.stderr)
        return 1
    print(chosen.log, file=sys.stderr, flush=True)
    env = {**os.environ, **chosen.env}
    env.pop("PYTHONPATH", None)  # set only so this module could be found; vLLM needs none
    os.execvpe(chosen.argv[0], chosen.argv, env)
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
