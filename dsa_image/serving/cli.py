"""The serving-recipe runner's command line: `python3 scripts/serve.py` (main) and, inside the
image, `docker run IMAGE recipe ...` (image_mode, which the entrypoint's recipe mode calls).

It lists the recipes (--list: each with its memory plan), prints a dry run (per node: the exact
`docker run` and `vllm serve` commands, every word shell-quoted; launch.describe) and launches solo
or across nodes, all or nothing (execute). In the image the image's target and vLLM base are the
defaults, and a launch serves in the container itself (one node).

Exit codes: EXIT_CODES (--help). Stdlib only: the image's entrypoint imports this.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

from dsa_image.core import status
from dsa_image.serving import memory_plan
from dsa_image.serving.memory_plan import GPUS
from dsa_image.core.recipe import RECIPES_DIR, Recipe
from dsa_image.serving.execute import execute
from dsa_image.serving.launch import DEFAULT_HF_CACHE, IMAGE_REPOSITORY, Launch, describe, memory_plan_of, plan_launch
from dsa_image.serving.recipes import (OK, REFUSED, USAGE, LayoutError, RecipeFileError, ServeError, ServeRecipe,
                                       TargetError, apply_overrides, blocking, build_recipe, load_serve_recipe,
                                       serve_recipe_names)


# -- --list --------------------------------------------------------------------------------


def list_recipes(recipes_dir: Path, build: Recipe, target_filter: str | None = None) -> str:
    rows = []
    for name in serve_recipe_names(recipes_dir):
        try:
            recipe = load_serve_recipe(name, recipes_dir, build)
        except ServeError as exc:
            rows.append((name, "-", "-", "-", f"INVALID: {exc}"))
            continue
        for target in recipe.targets:
            if target_filter and target != target_filter:
                continue
            gpu = GPUS[recipe.hardware[target]]
            try:
                plan = memory_plan_of(recipe, target, build)
                status = (f"fits: {memory_plan.gb(plan.weights_per_gpu)}/GPU weights, {plan.kv_tokens} KV tokens"
                          if plan.fits else f"REFUSED: {plan.problem()}")
            except ServeError as exc:
                status = f"REFUSED: {exc}"
            blocked = blocking(recipe, target, build)
            if blocked:
                status = f"BLOCKED on vLLM {build.vllm_version}: {', '.join(b.id for b in blocked)}"
            layout = f"{recipe.nodes}x{recipe.layout['gpus_per_node']} {gpu.name}" + (
                " (cluster)" if recipe.cluster_only else "")
            rows.append((name, target, layout, recipe.hf_id, status))
    header = ("recipe", "target", "layout", "model", "memory plan")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    out = ["  ".join(str(cell).ljust(widths[i]) if i < 4 else str(cell) for i, cell in enumerate(row))
           for row in [header, *rows]]
    return "\n".join(out) + "\n"


# -- command line --------------------------------------------------------------------------

USAGE_TEXT = """\
%(prog)s --list [--target T] [--vllm VERSION]
%(prog)s NAME [--dry-run] [--target T] [--vllm VERSION] [--solo | --nodes HEAD,WORKER,...] [--set KEY=VALUE ...]
    [-- VLLM ARGS]"""

EPILOG = """\
--set keys: a [vllm] setting (max_model_len, gpu_memory_utilization, kv_cache_dtype, block_size,
max_num_batched_tokens, num_speculative_tokens, tool_call_parser, ...), a [layout] one
(tensor_parallel_size, pipeline_parallel_size, nodes, gpus_per_node, cluster_backend), hf_id,
hf_overrides.NAME, env.NAME, hardware.TARGET (a GPU). Values are typed by the schema;
`KEY=` drops a [vllm] setting. Arguments after `--` go to vllm serve verbatim.
"""
EXIT_CODES = status.epilog(
    (OK, "ok"), (USAGE, "usage or a bad recipe / override"),
    (REFUSED, "refused: the layout (does not fit in memory, TP does not divide the heads, PP does not divide the "
              "layers, cluster-only on one node, a node count that does not match), or the image target does not "
              "match the GPU (or a GPU host is needed and absent)"),
    notes=("Once docker or vllm runs, theirs.",))


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, usage=USAGE_TEXT, epilog=EPILOG + "\n" + EXIT_CODES,
                                     description="GLM-5.x serving recipes: list, dry-run, launch.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", help="recipe (recipes/serve/NAME.toml)")
    parser.add_argument("--list", "-l", action="store_true", help="list the recipes and their memory plans")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    parser.add_argument("--target", help="image target (default: the recipe's first; in the image: the image's)")
    parser.add_argument("--vllm", metavar="VERSION", help="the image's vLLM base (default: the recipe's default; "
                                                          "in the image: the image's)")
    parser.add_argument("--solo", action="store_true", help="one node, this host")
    parser.add_argument("--nodes", help="comma-separated node addresses, the head first (clusters)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--image", default=IMAGE_REPOSITORY, help="image repository (tag: <vllm>-<target>)")
    parser.add_argument("--hf-cache", default=DEFAULT_HF_CACHE, help="host Hugging Face cache to mount")
    parser.add_argument("--ifname", help="network interface for NCCL/Gloo across nodes")
    parser.add_argument("--ssh", default="ssh", help="how to reach worker nodes (default: ssh)")
    return parser


def split_extra(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


@dataclass(frozen=True)
class Request:
    recipe: ServeRecipe
    target: str
    args: argparse.Namespace
    extra: list[str]
    build: Recipe
    recipes_dir: Path


def parse_request(argv: list[str], prog: str, recipes_dir: Path, default_target: str | None,
                  out: Callable[[str], object], default_vllm: str | None = None) -> Request | int:
    own, extra = split_extra(argv)
    parser = build_parser(prog)
    try:
        args = parser.parse_args(own)
    except SystemExit as exc:  # argparse printed usage or --help
        return int(exc.code or 0)
    build = build_recipe(recipes_dir, None, args.vllm or default_vllm)
    if args.list:
        out(list_recipes(recipes_dir, build, args.target or default_target))
        return OK
    if not args.name:
        raise RecipeFileError(f"name a recipe (or --list); {recipe_choices(recipes_dir, build, default_target)}")
    if args.solo and args.nodes:
        raise RecipeFileError("--solo and --nodes exclude each other")
    recipe = load_serve_recipe(args.name, recipes_dir, build)
    recipe = apply_overrides(recipe, args.overrides, build)
    target = args.target or default_target or recipe.targets[0]
    return Request(recipe, target, args, extra, build, recipes_dir)


def recipe_choices(recipes_dir: Path, build: Recipe, target: str | None) -> str:
    """The recipes to choose from: with a target (the image's), those for it, then which are
    for other images."""
    names = serve_recipe_names(recipes_dir)
    if target is None:
        return f"recipes: {', '.join(names) or '(none)'}"
    ours, others, invalid = [], [], []
    for name in names:
        try:
            targets = load_serve_recipe(name, recipes_dir, build).targets
        except ServeError:
            invalid.append(name)
            continue
        if target in targets:
            ours.append(name)
        else:
            others.append(f"{name} ({', '.join(targets)})")
    text = f"recipes for this image ({target}): {', '.join(ours) or '(none)'}"
    text += f"; for other images: {', '.join(others)}" if others else ""
    return text + (f"; invalid (--list says why): {', '.join(invalid)}" if invalid else "")


def plan_request(request: Request) -> Launch:
    args = request.args
    hosts = [h for h in args.nodes.split(",") if h] if args.nodes else None
    return plan_launch(request.recipe, request.target, request.build, hosts=hosts, solo=args.solo,
                       extra=request.extra, repository=args.image, hf_cache=args.hf_cache, ifname=args.ifname)


def main(argv: list[str] | None = None, *, prog: str = "serve.py", recipes_dir: Path = RECIPES_DIR,
         default_target: str | None = None, run: Callable = subprocess.run) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        request = parse_request(argv, prog, recipes_dir, default_target, lambda s: sys.stdout.write(s))
        if isinstance(request, int):
            return request
        launch = plan_request(request)
        sys.stdout.write(describe(launch))
        if request.args.dry_run:
            return OK
        return execute(launch, request, run)
    except ServeError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return exc.exit_code


# -- the image's `recipe` mode -------------------------------------------------------------


@dataclass(frozen=True)
class ImagePlan:
    """What the entrypoint does for `docker run IMAGE recipe ...`: exec `argv` with `env` added
    (after `log`), or print `output` and exit `exit_code`; `error` goes to stderr instead."""

    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    log: str = ""
    output: str = ""
    error: str = ""
    exit_code: int = OK


def image_mode(args: list[str], environ: Mapping[str, str]) -> ImagePlan:
    """`recipe --list`, `recipe NAME --dry-run`, `recipe NAME [--set ...] [-- ...]` inside the
    image: the image's target is the default (and the only one a launch may use), the recipes are
    DSA_IMAGE_TOOL/recipes, and a launch serves in this container (one node)."""
    tool = environ.get("DSA_IMAGE_TOOL", "")
    if not tool:
        return ImagePlan(error="DSA_IMAGE_TOOL is not set; the image's Dockerfile sets it",
                         exit_code=status.ENVIRONMENT)
    recipes_dir = Path(tool) / "recipes"
    image_target = environ.get("DSA_IMAGE_TARGET") or None
    image_vllm = environ.get("DSA_IMAGE_VLLM") or None
    printed: list[str] = []
    try:
        request = parse_request(args, "docker run IMAGE recipe", recipes_dir, image_target, printed.append,
                                image_vllm)
        if isinstance(request, int):
            return ImagePlan(output="".join(printed), exit_code=request)
        launch = plan_request(request)
        text = describe(launch)
        if request.args.dry_run:
            return ImagePlan(output=text)
        if image_target and launch.target != image_target:
            raise TargetError(f"this is the {image_target} image; recipe {launch.recipe.name} asked for {launch.target}")
        if image_vllm and request.build.vllm_version != image_vllm:
            raise TargetError(f"this image runs vLLM {image_vllm}; --vllm asked for {request.build.vllm_version}")
        if len(launch.nodes) > 1:
            raise LayoutError(f"recipe {launch.recipe.name} spans {len(launch.nodes)} nodes: start it from a host "
                              f"with `python3 scripts/serve.py {launch.recipe.name} --nodes ...` (or print the "
                              f"per-node commands: docker run IMAGE recipe {launch.recipe.name} --dry-run)")
        env = {k: v for k, v in launch.env.items() if k not in environ}
        return ImagePlan(argv=launch.vllm, env=env, log=f"dsa-image: recipe {launch.recipe.name}\n{text}")
    except ServeError as exc:
        return ImagePlan(output="".join(printed), error=str(exc), exit_code=exc.exit_code)
