"""Serving recipes: one file per GLM-5.x model and hardware layout, their memory plans, and a runner.

    recipes/serve/<name>.toml    a recipe: model, image targets and GPUs, layout, vLLM settings,
                                 environment workarounds (each with a reason and a link)
    recipes/models/<model>.toml  model facts (transformers' GlmMoeDsaConfig defaults + published values)

The runner (`python3 scripts/serve.py`, and `docker run IMAGE recipe ...` inside the image) lists
recipes, prints a dry run (per node: the exact `docker run` and `vllm serve` commands, every
word shell-quoted) and launches solo or across nodes, all or nothing (execute). Every recipe is
checked when loaded, its values by their schema entries (Setting); a layout that cannot work
is refused with the reason and, for memory, the numbers.

Workarounds expire with their bugs: each `[env.NAME]` / `[workarounds.SETTING]` entry names the
bugs it works around (recipes/bugs/, dsa_image/serving/workarounds.py) and is applied on a vLLM base only
where the recorded evidence says one of them is present; a recipe's `blockers` refuse it on a
base that has one.

Exit codes: 0 ok; 2 usage or a bad recipe / override; 4 layout refused (does not fit, TP does
not divide the heads, PP does not divide the layers, cluster-only on one node, a node count
that does not match); 5 the image target does not match the GPU (or a GPU host is needed and
absent). Once docker or vllm runs, theirs. Stdlib only: the image's entrypoint imports this.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from dsa_image.serving import memory_plan
from dsa_image.serving.memory_plan import GPUS, SCHEMES
from dsa_image.core.recipe import DEFAULT_RECIPE, RECIPES_DIR, Recipe, RecipeError, load_recipe
from dsa_image.serving.workarounds import Bug, BugError, load_bugs

SERVE_DIR_NAME = "serve"
MODELS_DIR_NAME = "models"
DEFAULT_SERVE_RECIPE = "tiny-glm5"
IMAGE_REPOSITORY = "dsa-image"
# The image runs as user vllm with HOME=/home/vllm (Dockerfile runtime stage): Hugging Face's
# cache is there.
CONTAINER_HF_CACHE = "/home/vllm/.cache/huggingface"
DEFAULT_HF_CACHE = "~/.cache/huggingface"
RAY_PORT = 6379
MP_MASTER_PORT = 29501

OK, USAGE, LAYOUT, TARGET = 0, 2, 4, 5


class ServeError(Exception):
    exit_code = USAGE


class RecipeFileError(ServeError):
    """A recipe or model file (or an override) is malformed."""


class LayoutError(ServeError):
    """The layout cannot work: memory, divisibility, node count."""

    exit_code = LAYOUT


class TargetError(ServeError):
    """The image target does not match the GPU."""

    exit_code = TARGET


# -- schema --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    kind: type
    flag: str | None  # None: rendered specially (speculative config, hf overrides, the layout)
    help: str
    low: float | None = None  # the least value (excluded when low_open)
    high: float | None = None  # the greatest
    low_open: bool = False

    def range_problem(self, value: Any) -> str | None:
        """Why a value of the right kind is out of range, or None."""
        # Written as "not within" so that a NaN (float("nan") from --set) is out of range too.
        within_low = self.low is None or (value > self.low if self.low_open else value >= self.low)
        if within_low and (self.high is None or value <= self.high):
            return None
        low = f"{'above' if self.low_open else 'at least'} {self.low:g}" if self.low is not None else ""
        high = f"at most {self.high:g}" if self.high is not None else ""
        return "must be " + " and ".join(part for part in (low, high) if part)


# [vllm] settings; each becomes a `vllm serve` flag.
VLLM_SETTINGS: dict[str, Setting] = {
    "served_model_name": Setting(str, "--served-model-name", "name the API serves the model under"),
    "max_model_len": Setting(int, "--max-model-len", "longest request (prompt + output), tokens", low=1),
    "kv_cache_dtype": Setting(str, "--kv-cache-dtype", "KV cache dtype (absent: the image target's)"),
    "attention_backend": Setting(str, "--attention-backend", "sparse-MLA backend (absent: the target's)"),
    "block_size": Setting(int, "--block-size", "KV cache block size, tokens", low=1),
    "gpu_memory_utilization": Setting(float, "--gpu-memory-utilization", "fraction of GPU memory vLLM may use",
                                      low=0, high=1, low_open=True),
    "max_num_batched_tokens": Setting(int, "--max-num-batched-tokens", "tokens per scheduler step", low=1),
    "max_num_seqs": Setting(int, "--max-num-seqs", "concurrent sequences", low=1),
    "enable_prefix_caching": Setting(bool, "--enable-prefix-caching", "prefix caching"),
    "speculative_method": Setting(str, None, "speculative decoding method (mtp)"),
    "num_speculative_tokens": Setting(int, None, "speculative tokens per step", low=1),
    "tool_call_parser": Setting(str, "--tool-call-parser", "tool-call parser"),
    "reasoning_parser": Setting(str, "--reasoning-parser", "reasoning parser"),
    "enable_auto_tool_choice": Setting(bool, "--enable-auto-tool-choice", "let the model choose tools"),
    "chat_template_content_format": Setting(str, "--chat-template-content-format", "string or openai"),
    "load_format": Setting(str, "--load-format", "weights format (dummy: random weights)"),
    "enforce_eager": Setting(bool, "--enforce-eager", "no CUDA graphs"),
    "port": Setting(int, "--port", "HTTP port", low=1, high=65535),
    "hf_overrides": Setting(dict, None, "config.json values to override (JSON)"),
}
LAYOUT_SETTINGS: dict[str, Setting] = {
    "nodes": Setting(int, None, "nodes", low=1),
    "gpus_per_node": Setting(int, None, "GPUs per node", low=1),
    "tensor_parallel_size": Setting(int, None, "tensor-parallel ranks", low=1),
    "pipeline_parallel_size": Setting(int, None, "pipeline stages", low=1),
    "cluster_backend": Setting(str, None, "mp or ray"),
}
REQUIRED_LAYOUT = ("nodes", "gpus_per_node", "tensor_parallel_size", "pipeline_parallel_size")
REQUIRED_VLLM = ("served_model_name", "max_model_len", "port")
TOP_LEVEL = {"schema": int, "description": str, "model": str, "hf_id": str, "quantization": str,
             "cluster_only": bool, "hardware": dict, "layout": dict, "vllm": dict, "env": dict,
             "workarounds": dict, "limitations": list, "blockers": list}
REQUIRED_TOP = ("schema", "description", "model", "hf_id", "quantization", "cluster_only", "hardware",
                "layout", "vllm")
CLUSTER_BACKENDS = ("mp", "ray")
SPECULATIVE_METHODS = ("mtp",)
# A recipe's or a model's name is its file's name (recipes/serve/NAME.toml, recipes/models/NAME.toml)
# and part of a container's (dsa-NAME): a plain file name.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str
    reason: str
    link: str  # "" only for a variable set with --set
    bugs: tuple[str, ...] = ()  # () only for a variable set with --set: applied on every base


@dataclass(frozen=True)
class Workaround:
    setting: str
    reason: str
    link: str
    bugs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Model:
    id: str
    name: str
    path: Path
    config: dict[str, Any]  # [config] with [published] applied
    raw: dict[str, Any]


@dataclass(frozen=True)
class ServeRecipe:
    name: str
    path: Path
    description: str
    model: Model
    hf_id: str
    quantization: str
    cluster_only: bool
    hardware: dict[str, str]  # target -> GPU id, first = default target
    layout: dict[str, Any]
    vllm: dict[str, Any]
    env: tuple[EnvVar, ...]
    workarounds: tuple[Workaround, ...]
    limitations: tuple[str, ...] = ()  # bugs that shaped the recipe (recipes/bugs/)
    blockers: tuple[str, ...] = ()  # bugs that keep it off a base that has one
    bugs: Mapping[str, Bug] = field(default_factory=dict)  # recipes/bugs/, by id

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self.hardware)

    @property
    def tp(self) -> int:
        return self.layout["tensor_parallel_size"]

    @property
    def pp(self) -> int:
        return self.layout["pipeline_parallel_size"]

    @property
    def nodes(self) -> int:
        return self.layout["nodes"]

    @property
    def uses_mtp(self) -> bool:
        return self.vllm.get("speculative_method") == "mtp"


# -- loading -------------------------------------------------------------------------------


def serve_dir(recipes_dir: Path = RECIPES_DIR) -> Path:
    return recipes_dir / SERVE_DIR_NAME


def serve_recipe_names(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    return sorted(p.stem for p in serve_dir(recipes_dir).glob("*.toml"))


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise RecipeFileError(f"{path}: cannot read it: {exc}") from None
    except UnicodeDecodeError as exc:
        raise RecipeFileError(f"{path}: not UTF-8 (byte {exc.start}); a TOML file is UTF-8 text") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeFileError(f"{path}: not valid TOML: {exc}") from exc


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise RecipeFileError(f"{what} {name!r}: not a plain file name (letters, digits, '.', '_', '-'; no '/')")
    return name


def _typed(value: Any, kind: type, where: str) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise RecipeFileError(f"{where}: expected {kind.__name__}, found {value!r}")
    return value


def load_model(model_id: str, recipes_dir: Path = RECIPES_DIR) -> Model:
    _check_name(model_id, "model")
    path = recipes_dir / MODELS_DIR_NAME / f"{model_id}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.toml"))) or "(none)"
        raise RecipeFileError(f"unknown model {model_id!r} (no {path}); known models: {known}")
    raw = _read_toml(path)
    where = str(path)
    if raw.get("schema") != 1:
        raise RecipeFileError(f"{where}: schema must be 1, found {raw.get('schema')!r}")
    if raw.get("id") != model_id:
        raise RecipeFileError(f"{where}: id {raw.get('id')!r} must equal the file name {model_id!r}")
    for table in ("config", "config_source", "published", "published_sources"):
        if not isinstance(raw.get(table), dict):
            raise RecipeFileError(f"{where}: needs a [{table}] table")
    missing_sources = sorted(set(raw["published"]) - set(raw["published_sources"]))
    if missing_sources:
        raise RecipeFileError(f"{where}: [published] values without a source in [published_sources]: "
                              f"{', '.join(missing_sources)}")
    config = {**raw["config"], **raw["published"]}
    missing = [k for k in memory_plan.REQUIRED_CONFIG if k not in config]
    if missing:
        raise RecipeFileError(f"{where}: config lacks {', '.join(missing)}")
    for key in memory_plan.REQUIRED_CONFIG:  # the plan's arithmetic takes whole numbers, some as divisors
        least = 0 if key in memory_plan.CONFIG_MAY_BE_ZERO else 1
        if _typed(config[key], int, f"{where}: {key}") < least:
            raise RecipeFileError(f"{where}: {key} must be at least {least}, found {config[key]}")
    return Model(model_id, str(raw.get("name", model_id)), path, config, raw)


def load_serve_recipe(name: str, recipes_dir: Path = RECIPES_DIR, build: Recipe | None = None) -> ServeRecipe:
    _check_name(name, "recipe")
    path = serve_dir(recipes_dir) / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(serve_recipe_names(recipes_dir)) or "(none)"
        raise RecipeFileError(f"unknown recipe {name!r}; recipes: {known}")
    return parse_serve_recipe(name, path, _read_toml(path), recipes_dir, build)


def _build_recipe(recipes_dir: Path, build: Recipe | None, vllm: str | None = None) -> Recipe:
    """The image recipe as seen from base `vllm` (None: its default base)."""
    if build is not None:
        return build
    try:
        return load_recipe(DEFAULT_RECIPE, recipes_dir, vllm)
    except RecipeError as exc:
        raise RecipeFileError(str(exc)) from exc


def parse_serve_recipe(name: str, path: Path, raw: dict[str, Any], recipes_dir: Path = RECIPES_DIR,
                       build: Recipe | None = None) -> ServeRecipe:
    """Check everything that does not depend on the target chosen or the hosts given."""
    where = str(path)
    unknown = sorted(set(raw) - set(TOP_LEVEL))
    if unknown:
        raise RecipeFileError(f"{where}: unknown keys {', '.join(unknown)}; known: {', '.join(TOP_LEVEL)}")
    for key in REQUIRED_TOP:
        if key not in raw:
            raise RecipeFileError(f"{where}: missing key {key!r}")
    for key, kind in TOP_LEVEL.items():
        if key in raw:
            _typed(raw[key], kind, f"{where}: {key}")
    if raw["schema"] != 1:
        raise RecipeFileError(f"{where}: schema must be 1, found {raw['schema']!r}")
    build = _build_recipe(recipes_dir, build)
    model = load_model(raw["model"], recipes_dir)
    if raw["quantization"] not in SCHEMES:
        raise RecipeFileError(f"{where}: quantization {raw['quantization']!r} unknown; known: {', '.join(SCHEMES)}")

    hardware = {target: _typed(gpu, str, f"{where}: hardware.{target}") for target, gpu in raw["hardware"].items()}
    layout = settings_table("layout", raw["layout"], LAYOUT_SETTINGS, where)
    layout.setdefault("cluster_backend", "mp")
    vllm = settings_table("vllm", raw["vllm"], VLLM_SETTINGS, where)
    for table, values, required in (("layout", layout, REQUIRED_LAYOUT), ("vllm", vllm, REQUIRED_VLLM)):
        missing = [key for key in required if key not in values]
        if missing:
            raise RecipeFileError(f"{where}: {table}.{missing[0]} missing")

    bugs = _load_bugs(recipes_dir)
    env = []
    for var, entry in raw.get("env", {}).items():
        at = f"{where}: env.{var}"
        if not isinstance(entry, dict) or set(entry) != {"value", "reason", "link", "bugs"}:
            raise RecipeFileError(f"{at}: needs exactly value, reason, link and bugs (the recipes/bugs/ it works "
                                  "around)")
        for key in ("value", "reason", "link"):
            _typed(entry[key], str, f"{at}.{key}")
        _check_link(entry["link"], at)
        env.append(EnvVar(var, entry["value"], entry["reason"], entry["link"], _bug_ids(entry["bugs"], bugs, at)))
    workarounds = []
    for setting, entry in raw.get("workarounds", {}).items():
        at = f"{where}: workarounds.{setting}"
        if setting not in vllm:
            raise RecipeFileError(f"{at}: the recipe sets no vllm.{setting}")
        if not isinstance(entry, dict) or set(entry) != {"reason", "link", "bugs"}:
            raise RecipeFileError(f"{at}: needs exactly reason, link and bugs (the recipes/bugs/ it works around)")
        _check_link(_typed(entry["link"], str, f"{at}.link"), at)
        workarounds.append(Workaround(setting, _typed(entry["reason"], str, f"{at}.reason"), entry["link"],
                                      _bug_ids(entry["bugs"], bugs, at)))
    limitations = _bug_ids(raw.get("limitations", []), bugs, f"{where}: limitations", empty_ok=True)
    blockers = _bug_ids(raw.get("blockers", []), bugs, f"{where}: blockers", empty_ok=True)

    recipe = ServeRecipe(name, path, raw["description"], model, raw["hf_id"], raw["quantization"],
                         raw["cluster_only"], hardware, layout, vllm, tuple(env), tuple(workarounds),
                         limitations, blockers, bugs)
    check_recipe(recipe, build)
    return recipe


def settings_table(table: str, values: Mapping[str, Any], schema: Mapping[str, Setting], where: str) -> dict:
    """A [layout] or [vllm] table checked against the schema: known keys, their types and ranges.
    The one check of these values, for a recipe file's and for --set's."""
    checked = {}
    for key, value in values.items():
        if key not in schema:
            raise RecipeFileError(f"{where}: {table}.{key} unknown; known: {', '.join(schema)}")
        checked[key] = _typed(value, schema[key].kind, f"{where}: {table}.{key}")
        problem = schema[key].range_problem(checked[key]) if schema[key].kind in (int, float) else None
        if problem:
            raise RecipeFileError(f"{where}: {table}.{key} = {checked[key]!r}: {problem}")
    return checked


def _check_link(link: str, where: str) -> None:
    if not link.startswith("https://"):
        raise RecipeFileError(f"{where}: link must be an https:// URL, found {link!r}")


def _load_bugs(recipes_dir: Path) -> dict[str, Bug]:
    try:
        return load_bugs(recipes_dir)
    except BugError as exc:
        raise RecipeFileError(str(exc)) from exc


def _bug_ids(value: Any, bugs: Mapping[str, Bug], where: str, empty_ok: bool = False) -> tuple[str, ...]:
    """A list of bug ids, each a file of recipes/bugs/."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or not (value or empty_ok):
        raise RecipeFileError(f"{where}: expected a list of bug ids (files of recipes/bugs/), found {value!r}")
    unknown = [v for v in value if v not in bugs]
    if unknown:
        raise RecipeFileError(f"{where}: unknown bugs {', '.join(unknown)}; recipes/bugs/ has "
                              f"{', '.join(bugs) or '(none)'}")
    return tuple(value)


def applies(recipe: ServeRecipe, bug_ids: tuple[str, ...], base: str, target: str) -> bool:
    """Whether a workaround of `bug_ids` is applied on vLLM `base`'s `target` image: one of them
    is present there (an entry without bugs, set with --set, always is)."""
    return not bug_ids or any(recipe.bugs[b].present(base, target) for b in bug_ids)


def blocking(recipe: ServeRecipe, target: str, build: Recipe) -> list[Bug]:
    """The recipe's blockers present on `build`'s base for `target`."""
    return [recipe.bugs[b] for b in recipe.blockers if recipe.bugs[b].present(build.vllm_version, target)]


def check_recipe(recipe: ServeRecipe, build: Recipe) -> None:
    """The checks an override can also break: RecipeFileError for values, LayoutError for layouts."""
    where = str(recipe.path)
    vllm, cfg = recipe.vllm, recipe.model.config
    check_hardware(recipe, build)
    for var in recipe.env:
        if not ENV_NAME.fullmatch(var.name):
            raise RecipeFileError(f"{where}: env.{var.name}: {var.name!r} is not an environment variable name "
                                  "(letters, digits, '_'; not a digit first)")
    if not recipe.hf_id or recipe.hf_id.startswith("-"):
        raise RecipeFileError(f"{where}: hf_id {recipe.hf_id!r}: expected a model id or path for vllm serve")
    if any(not key for key in vllm.get("hf_overrides", {})):
        raise RecipeFileError(f"{where}: hf_overrides has an empty key")
    if recipe.layout["cluster_backend"] not in CLUSTER_BACKENDS:
        raise RecipeFileError(f"{where}: cluster_backend {recipe.layout['cluster_backend']!r}; "
                              f"one of {', '.join(CLUSTER_BACKENDS)}")
    method = vllm.get("speculative_method")
    if (method is None) != ("num_speculative_tokens" not in vllm):
        raise RecipeFileError(f"{where}: speculative_method and num_speculative_tokens go together")
    if method is not None and method not in SPECULATIVE_METHODS:
        raise RecipeFileError(f"{where}: speculative_method {method!r}; supported: {', '.join(SPECULATIVE_METHODS)}")
    if method == "mtp" and cfg["num_nextn_predict_layers"] < 1:
        raise RecipeFileError(f"{where}: MTP needs a model with an MTP layer; {recipe.model.id} has "
                              f"num_nextn_predict_layers {cfg['num_nextn_predict_layers']}")
    if vllm.get("enable_auto_tool_choice") and "tool_call_parser" not in vllm:
        raise RecipeFileError(f"{where}: enable_auto_tool_choice needs a tool_call_parser")
    if vllm["max_model_len"] > cfg["max_position_embeddings"]:
        raise RecipeFileError(f"{where}: max_model_len {vllm['max_model_len']} exceeds the model's "
                              f"max_position_embeddings {cfg['max_position_embeddings']}")
    overrides = vllm.get("hf_overrides", {})
    pattern = overrides.get("index_topk_pattern")
    if pattern is not None:
        derived = memory_plan.index_topk_pattern(cfg)
        if pattern != derived:
            raise RecipeFileError(f"{where}: hf_overrides.index_topk_pattern {pattern!r} differs from the one "
                                  f"{recipe.model.id}'s config gives vLLM ({derived!r})")
    for target in recipe.targets:
        check_backend(recipe, target, build)
    check_layout(recipe)


def check_hardware(recipe: ServeRecipe, build: Recipe) -> None:
    where = str(recipe.path)
    if not recipe.hardware:
        raise RecipeFileError(f"{where}: [hardware] names no image target")
    for target, gpu_id in recipe.hardware.items():
        if target not in build.targets:
            raise RecipeFileError(f"{where}: hardware target {target!r} is not a target of {build.id}: "
                                  f"{', '.join(build.targets)}")
        if gpu_id not in GPUS:
            raise RecipeFileError(f"{where}: hardware.{target}: unknown GPU {gpu_id!r}; known: {', '.join(GPUS)}")
        if GPUS[gpu_id].target != target:
            raise RecipeFileError(f"{where}: hardware.{target} = {gpu_id!r}, but the {GPUS[gpu_id].name} needs the "
                                  f"{GPUS[gpu_id].target} image")


def check_backend(recipe: ServeRecipe, target: str, build: Recipe) -> None:
    backend, kv_dtype = attention_backend(recipe, target, build), kv_cache_dtype(recipe, target, build)
    where = f"{recipe.path} (target {target})"
    try:
        backends = memory_plan.backends(build.vllm_version)
    except ValueError as exc:
        raise RecipeFileError(str(exc)) from None
    if backend not in backends:
        raise RecipeFileError(f"{where}: attention_backend {backend!r}: not a sparse-MLA backend of vLLM "
                              f"{build.vllm_version} ({', '.join(backends)})")
    spec, gpu = backends[backend], GPUS[recipe.hardware[target]]
    if gpu.capability[0] not in spec.capability_majors:
        raise TargetError(f"{where}: {backend} runs on compute capability {'/'.join(map(str, spec.capability_majors))}"
                          f".x, the {gpu.name} is {gpu.capability[0]}.{gpu.capability[1]}")
    takes = spec.kv_cache_dtypes_on(gpu.capability[0])
    if kv_dtype not in takes:
        raise RecipeFileError(f"{where}: {backend} does not take kv_cache_dtype {kv_dtype!r} on the {gpu.name}; "
                              f"it takes {', '.join(takes)}")
    block = recipe.vllm.get("block_size")
    if block is not None and not spec.takes_block_size(block):
        raise RecipeFileError(f"{where}: {backend} takes block sizes {', '.join(map(str, spec.block_sizes))}, "
                              f"not {block}")


def check_layout(recipe: ServeRecipe) -> None:
    cfg, layout = recipe.model.config, recipe.layout
    where = str(recipe.path)
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    if heads % recipe.tp:
        raise LayoutError(f"{where}: tensor_parallel_size {recipe.tp} does not divide the {heads} attention heads "
                          f"of {recipe.model.id}")
    if layers % recipe.pp:
        raise LayoutError(f"{where}: pipeline_parallel_size {recipe.pp} does not divide the {layers} layers of "
                          f"{recipe.model.id} (the memory plan assumes equal stages)")
    gpus = layout["nodes"] * layout["gpus_per_node"]
    if gpus != recipe.tp * recipe.pp:
        raise LayoutError(f"{where}: {layout['nodes']} node(s) x {layout['gpus_per_node']} GPU(s) = {gpus} GPUs, "
                          f"but TP {recipe.tp} x PP {recipe.pp} = {recipe.tp * recipe.pp}")
    if recipe.cluster_only and layout["nodes"] < 2:
        raise LayoutError(f"{where}: cluster_only, yet the layout has one node")


def kv_cache_dtype(recipe: ServeRecipe, target: str, build: Recipe) -> str:
    return recipe.vllm.get("kv_cache_dtype", build.target(target).kv_cache_dtype)


def attention_backend(recipe: ServeRecipe, target: str, build: Recipe) -> str:
    return recipe.vllm.get("attention_backend", build.target(target).attention_backend)


# -- overrides -----------------------------------------------------------------------------


def parse_value(text: str, kind: type, where: str) -> Any:
    if kind is bool:
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
        raise RecipeFileError(f"{where}: {text!r} is not a boolean (true/false)")
    try:
        return kind(text)
    except ValueError:
        raise RecipeFileError(f"{where}: {text!r} is not {kind.__name__}") from None


def apply_overrides(recipe: ServeRecipe, assignments: list[str], build: Recipe) -> ServeRecipe:
    """`--set KEY=VALUE`, typed against the schema: a [vllm] or [layout] setting, hf_id,
    hf_overrides.NAME, env.NAME, or hardware.TARGET (a GPU id). `KEY=` unsets a [vllm] setting."""
    vllm, layout, hardware = dict(recipe.vllm), dict(recipe.layout), dict(recipe.hardware)
    env = {e.name: e for e in recipe.env}
    fixes = {w.setting: w for w in recipe.workarounds}
    hf_id = recipe.hf_id
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        where = f"--set {assignment}"
        if not sep:
            raise RecipeFileError(f"{where}: expected KEY=VALUE")
        if key in VLLM_SETTINGS and VLLM_SETTINGS[key].kind is not dict:
            if text == "":
                vllm.pop(key, None)
            else:
                vllm.update(settings_table("vllm", {key: parse_value(text, VLLM_SETTINGS[key].kind, where)},
                                           VLLM_SETTINGS, where))
            fixes.pop(key, None)  # the user's value now, on every base
        elif key in LAYOUT_SETTINGS:
            layout.update(settings_table("layout", {key: parse_value(text, LAYOUT_SETTINGS[key].kind, where)},
                                         LAYOUT_SETTINGS, where))
        elif key == "hf_id":
            hf_id = text
        elif key.startswith("hf_overrides."):
            vllm["hf_overrides"] = {**vllm.get("hf_overrides", {}), key.split(".", 1)[1]: text}
        elif key.startswith("env."):
            name = key.split(".", 1)[1]
            env[name] = EnvVar(name, text, "set with --set", "")
        elif key.startswith("hardware."):
            hardware[key.split(".", 1)[1]] = text
        else:
            known = [*(k for k, s in VLLM_SETTINGS.items() if s.kind is not dict), *LAYOUT_SETTINGS, "hf_id",
                     "hf_overrides.NAME", "env.NAME", "hardware.TARGET"]
            raise RecipeFileError(f"{where}: unknown key {key!r}; known: {', '.join(known)}")
    changed = replace(recipe, vllm=vllm, layout=layout, hardware=hardware, env=tuple(env.values()), hf_id=hf_id,
                      workarounds=tuple(fixes.values()))
    check_recipe(changed, build)
    return changed


# -- the plan of one run -------------------------------------------------------------------


def memory_plan_of(recipe: ServeRecipe, target: str, build: Recipe) -> memory_plan.Plan:
    return memory_plan.plan(
        recipe.model.config, SCHEMES[recipe.quantization], GPUS[recipe.hardware[target]],
        tp=recipe.tp, pp=recipe.pp, mtp=recipe.uses_mtp, backend=attention_backend(recipe, target, build),
        kv_cache_dtype=kv_cache_dtype(recipe, target, build),
        gpu_memory_utilization=recipe.vllm.get("gpu_memory_utilization", 0.92),
        max_model_len=recipe.vllm["max_model_len"], block_size=recipe.vllm.get("block_size", 16),
        vllm=build.vllm_version)


def vllm_args(recipe: ServeRecipe, target: str, build: Recipe, extra: list[str] = ()) -> list[str]:
    """`vllm serve` arguments (without `vllm serve`) common to every node."""
    vllm = recipe.vllm
    args = [recipe.hf_id]
    settings = {k: v for k, v in vllm.items() if k not in unapplied_settings(recipe, target, build)}
    settings.setdefault("kv_cache_dtype", kv_cache_dtype(recipe, target, build))
    settings.setdefault("attention_backend", attention_backend(recipe, target, build))
    if recipe.tp > 1:
        args += ["--tensor-parallel-size", str(recipe.tp)]
    if recipe.pp > 1:
        args += ["--pipeline-parallel-size", str(recipe.pp)]
    for key, setting in VLLM_SETTINGS.items():
        if key not in settings or setting.flag is None:
            continue
        value = settings[key]
        if setting.kind is bool:
            if key == "enable_prefix_caching":
                args.append(setting.flag if value else "--no-enable-prefix-caching")
            elif value:
                args.append(setting.flag)
        else:
            args += [setting.flag, str(value)]
    if "speculative_method" in settings:
        args += ["--speculative-config", json.dumps({"method": settings["speculative_method"],
                                                     "num_speculative_tokens": settings["num_speculative_tokens"]},
                                                    separators=(",", ":"))]
    if settings.get("hf_overrides"):
        args += ["--hf-overrides", json.dumps(settings["hf_overrides"], separators=(",", ":"))]
    return [*args, *extra]


def unapplied_settings(recipe: ServeRecipe, target: str, build: Recipe) -> set[str]:
    """The [vllm] settings of workarounds whose bugs `build`'s base does not have: left to vLLM."""
    return {w.setting for w in recipe.workarounds if not applies(recipe, w.bugs, build.vllm_version, target)}


def environment(recipe: ServeRecipe, target: str, build: Recipe) -> dict[str, str]:
    """The recipe's variables on top of the image target's (recipes/glm5-dsa.toml [targets.*].env),
    less those working around bugs `build`'s base does not have."""
    return {**build.target(target).env,
            **{e.name: e.value for e in recipe.env if applies(recipe, e.bugs, build.vllm_version, target)}}


@dataclass(frozen=True)
class Node:
    rank: int
    address: str
    role: str  # "solo", "head", "worker"
    docker: list[str]  # the docker command: its argv here (HomePath words: see there)
    container: str  # the name it runs under (--name)
    then: list[str] = field(default_factory=list)  # a command run after all containers are up (Ray)
    detached: bool = False


@dataclass(frozen=True)
class Launch:
    recipe: ServeRecipe
    target: str
    image: str
    vllm: list[str]  # `vllm serve ...` on the serving node
    env: dict[str, str]
    nodes: tuple[Node, ...]
    plan: memory_plan.Plan
    notes: tuple[str, ...]
    build: Recipe  # the base it is planned on


class HomePath(str):
    """A word naming a path under the home directory of whichever host runs the command. As a
    str it is this host's path: what `docker run` gets here, run without a shell. In a shell
    command (shell_join: the printed commands, and the one ssh hands a worker's shell) it is
    "$HOME"'/REST', so each node's shell puts in its own home and the rest stays quoted.
    `tail`: what follows the home directory (`/.cache/huggingface:/home/vllm/...`)."""

    shell: str

    def __new__(cls, tail: str) -> "HomePath":
        word = super().__new__(cls, os.path.expanduser("~") + tail)
        word.shell = '"$HOME"' + (shlex.quote(tail) if tail else "")
        return word


def shell_join(words: list[str]) -> str:
    """`words` as one POSIX shell command: every word quoted (a HomePath as its shell form)."""
    return " ".join(w.shell if isinstance(w, HomePath) else shlex.quote(w) for w in words)


def image_ref(build: Recipe, target: str, repository: str = IMAGE_REPOSITORY) -> str:
    return f"{repository}:{build.vllm_version}-{target}"


# Docker's own rule for a named volume (a -v source that is no absolute path).
VOLUME_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]+")
# What --nodes may name: a host name or an IPv4/IPv6 address (never a word ssh would take as an option).
HOST = re.compile(r"[A-Za-z0-9:\[][A-Za-z0-9_.:%\[\]-]*")
REPOSITORY = re.compile(r"[a-z0-9][a-z0-9._/:-]*")


def hf_volume(hf_cache: str) -> str:
    """`-v`'s value for --hf-cache: ~ and ~/PATH under each node's own home (HomePath), an
    absolute path or a Docker volume name as they are. A `:` would split docker's -v value."""
    home = hf_cache == "~" or hf_cache.startswith("~/")
    if ":" not in hf_cache and (home or os.path.isabs(hf_cache) or VOLUME_NAME.fullmatch(hf_cache)):
        suffix = f":{CONTAINER_HF_CACHE}"
        return HomePath(hf_cache[1:] + suffix) if home else f"{hf_cache}{suffix}"
    raise RecipeFileError(f"--hf-cache {hf_cache!r}: expected ~/PATH, an absolute path or a Docker volume name, "
                          "without ':'")


def check_hosts(hosts: list[str]) -> None:
    for host in hosts:
        if not HOST.fullmatch(host):
            raise RecipeFileError(f"--nodes: {host!r} is not a host name or address")


def plan_launch(recipe: ServeRecipe, target: str, build: Recipe, *, hosts: list[str] | None, solo: bool,
                extra: list[str] = (), repository: str = IMAGE_REPOSITORY, hf_cache: str = DEFAULT_HF_CACHE,
                ifname: str | None = None) -> Launch:
    if not REPOSITORY.fullmatch(repository):
        raise RecipeFileError(f"--image {repository!r}: not an image repository (lower case, e.g. dsa-image or "
                              "registry.example:5000/dsa-image)")
    check_hosts(hosts or [])
    volume = hf_volume(hf_cache)
    if target not in recipe.hardware:
        raise TargetError(f"recipe {recipe.name} runs on the {', '.join(recipe.targets)} image(s), not {target} "
                          f"(its GPUs: {', '.join(GPUS[g].name for g in recipe.hardware.values())})")
    check_backend(recipe, target, build)
    blocked = blocking(recipe, target, build)
    if blocked:
        others = [v for v in build.vllm_versions if not any(b.present(v, target) for b in blocked)]
        raise TargetError(f"recipe {recipe.name} cannot run on the vLLM {build.vllm_version} {target} image: "
                          + "; ".join(f"{b.id}: {b.title} ({b.why(build.vllm_version)}; {_rel(b.path)})"
                                      for b in blocked)
                          + (f". Use --vllm {others[0]}" if others else ""))
    nodes_wanted = recipe.nodes
    if solo and recipe.cluster_only:
        raise LayoutError(f"recipe {recipe.name} is cluster-only: it needs {nodes_wanted} nodes "
                          f"(--nodes HEAD,WORKER,...), not --solo")
    if solo and nodes_wanted > 1:
        raise LayoutError(f"recipe {recipe.name} spans {nodes_wanted} nodes; --solo runs one")
    if hosts is not None and len(hosts) != nodes_wanted:
        raise LayoutError(f"recipe {recipe.name} needs {nodes_wanted} node(s), --nodes gave {len(hosts)}: "
                          f"{', '.join(hosts)}")
    plan = memory_plan_of(recipe, target, build)
    problem = plan.problem()
    if problem:
        raise LayoutError(f"recipe {recipe.name}: {problem}\n  " + "\n  ".join(plan.lines()))
    image = image_ref(build, target, repository)
    env = environment(recipe, target, build)
    args = vllm_args(recipe, target, build, list(extra))
    notes = []
    port = str(recipe.vllm["port"])
    common = ["--gpus", "all", "--ipc=host", "-v", volume, "-e", "HF_TOKEN"]
    if ifname:
        env = {**env, "NCCL_SOCKET_IFNAME": ifname, "GLOO_SOCKET_IFNAME": ifname}

    def env_flags(extra_env: Mapping[str, str] = {}) -> list[str]:
        return [w for k, v in {**env, **extra_env}.items() for w in ("-e", f"{k}={v}")]

    name = f"dsa-{recipe.name}"
    if nodes_wanted == 1:
        docker = ["docker", "run", "--rm", "--name", name, *common, "-p", f"{port}:{port}", *env_flags(),
                  image, "serve", *args]
        return Launch(recipe, target, image, ["vllm", "serve", *args], env,
                      (Node(0, (hosts or ["localhost"])[0], "solo", docker, name),), plan, tuple(notes), build)

    addresses = hosts or ["HEAD_ADDR", *(f"NODE{i}_ADDR" for i in range(1, nodes_wanted))]
    if hosts is None:
        notes.append("no --nodes given: HEAD_ADDR and NODEi_ADDR stand for the nodes' addresses")
    head = addresses[0]
    nodes = []
    if recipe.layout["cluster_backend"] == "ray":
        serve = ["vllm", "serve", *args, "--distributed-executor-backend", "ray"]
        for rank, address in enumerate(addresses):
            role = "head" if rank == 0 else "worker"
            container = f"{name}-{role}" if rank == 0 else f"{name}-worker{rank}"
            # The image's modes (dsa_image/runtime/entrypoint.py): the head's port through RAY_PORT, a
            # worker names the head first.
            node_env = {"VLLM_HOST_IP": address, **({"RAY_PORT": str(RAY_PORT)} if rank == 0 else {})}
            mode = ["ray-head"] if rank == 0 else ["ray-worker", f"{head}:{RAY_PORT}"]
            docker = ["docker", "run", "-d", "--rm", "--name", container, *common, "--network", "host",
                      *env_flags(node_env), image, *mode]
            then = ["docker", "exec", f"{name}-head", *serve] if rank == 0 else []
            nodes.append(Node(rank, address, role, docker, container, then, detached=True))
        return Launch(recipe, target, image, serve, env, tuple(nodes), plan, tuple(notes), build)

    for rank, address in enumerate(addresses):
        role = "head" if rank == 0 else "worker"
        node_args = [*args, "--nnodes", str(nodes_wanted), "--node-rank", str(rank), "--master-addr", head,
                     "--master-port", str(MP_MASTER_PORT)]
        if rank > 0:
            node_args.append("--headless")
        container = f"{name}-node{rank}"
        docker = ["docker", "run", *(["-d"] if rank else []), "--rm", "--name", container, *common,
                  "--network", "host", *env_flags(), image, "serve", *node_args]
        nodes.append(Node(rank, address, role, docker, container, detached=rank > 0))
    head_args = nodes[0].docker[nodes[0].docker.index("serve") + 1:]
    return Launch(recipe, target, image, ["vllm", "serve", *head_args], env, tuple(nodes), plan, tuple(notes), build)


# -- output --------------------------------------------------------------------------------


def describe(launch: Launch) -> str:
    recipe = launch.recipe
    lines = [f"recipe {recipe.name}: {recipe.description}",
             f"model: {recipe.hf_id} ({recipe.model.name}; facts: {_rel(recipe.model.path)})",
             f"image: {launch.image} (target {launch.target})",
             f"layout: {recipe.nodes} node(s) x {recipe.layout['gpus_per_node']} GPU(s), TP {recipe.tp}, PP {recipe.pp}"
             + (f", cluster backend {recipe.layout['cluster_backend']}" if recipe.nodes > 1 else ""),
             "", "memory plan (an estimate):"]
    lines += [f"  {line}" for line in launch.plan.lines()]
    if recipe.env or launch.env:
        lines += ["", "environment:"]
        reasons = {e.name: e for e in recipe.env}
        for name, value in launch.env.items():
            if name in reasons:
                var = reasons[name]
                lines.append(f"  {name}={value}: {var.reason}" + (f" ({var.link})" if var.link else ""))
            else:
                lines.append(f"  {name}={value}: image target {launch.target} default (recipes/glm5-dsa.toml)")
    lines += bug_lines(recipe, launch.target, launch.build)
    for note in launch.notes:
        lines += ["", f"note: {note}"]
    lines += ["", "vllm serve (on the serving node):", f"  {shell_join(launch.vllm)}", ""]
    for node in launch.nodes:
        label = {"solo": "this host", "head": f"node 0 (head, runs this script) {node.address}",
                 "worker": f"node {node.rank} (worker) {node.address}"}[node.role]
        lines.append(f"# {label}")
        lines.append(shell_join(node.docker))
    for node in launch.nodes:
        if node.then:
            lines.append("# then, once every node's container is up, on node 0:")
            lines.append(shell_join(node.then))
    return "\n".join(lines) + "\n"


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(RECIPES_DIR.parent))
    except ValueError:
        return str(path)


def _bases(build: Recipe) -> list[str]:
    """Every vLLM base of the build recipe, the plan's first."""
    return [build.vllm_version, *(v for v in build.vllm_versions if v != build.vllm_version)]


def _bug_state(bug: Bug, base: str, target: str) -> str:
    other_target = bug.targets and target not in bug.targets
    return f"{bug.id} {bug.why(base)}" + (f" (concerns {'/'.join(bug.targets)} only)" if other_target else "")


def bug_lines(recipe: ServeRecipe, target: str, build: Recipe) -> list[str]:
    """Per vLLM base: which workarounds apply and why, and the recipe's limitations and blockers."""
    this = build.vllm_version
    label = {base: f"vLLM {base}" + (" (this plan)" if base == this else "") for base in _bases(build)}
    entries = [(f"env {e.name}={e.value}", e.reason, e.bugs) for e in recipe.env if e.bugs]
    entries += [(f"{w.setting}={recipe.vllm[w.setting]}", w.reason, w.bugs) for w in recipe.workarounds]
    lines = []
    if entries:
        lines += ["", "workarounds, per vLLM base (each applied where a bug it names is present; the evidence: "
                      "recipes/bugs/, held to the pinned artefacts by scripts/recipe.py check):"]
        for what, reason, bug_ids in entries:
            lines.append(f"  {what}: {reason}")
            for base in _bases(build):
                state = "applied" if applies(recipe, bug_ids, base, target) else "not applied"
                found = "; ".join(_bug_state(recipe.bugs[b], base, target) for b in bug_ids)
                lines.append(f"    {label[base]}: {state}: {found}")
            lines += [f"    {b}: {recipe.bugs[b].title} ({recipe.bugs[b].link})" for b in bug_ids]
    for kind, bug_ids in (("limitations (what shaped this recipe)", recipe.limitations),
                          ("blockers (the plan refuses a base where one is present)", recipe.blockers)):
        if bug_ids:
            lines += ["", f"{kind}:"]
            for b in bug_ids:
                lines.append(f"  {b}: {recipe.bugs[b].title} ({recipe.bugs[b].link})")
                lines += [f"    {label[base]}: {_bug_state(recipe.bugs[b], base, target)}" for base in _bases(build)]
    return lines


def bug_usage_problems(recipes_dir: Path, build: Recipe) -> list[str]:
    """Workarounds and limitations of the serving recipes that hold on no vLLM base: expired."""
    problems = []
    for name in serve_recipe_names(recipes_dir):
        try:
            recipe = load_serve_recipe(name, recipes_dir, build)
        except ServeError as exc:
            problems.append(str(exc))
            continue
        entries = [(f"env.{e.name}", e.bugs) for e in recipe.env]
        entries += [(f"workarounds.{w.setting}", w.bugs) for w in recipe.workarounds]
        entries += [("limitations", (b,)) for b in recipe.limitations]
        for what, bug_ids in entries:
            if not any(recipe.bugs[b].present(v, t) for b in bug_ids for v in build.vllm_versions
                       for t in recipe.targets):
                problems.append(f"{recipe.path}: {what}: {', '.join(bug_ids)} present on no vLLM base it could "
                                f"apply to ({', '.join(build.vllm_versions)}): the bug is gone; remove it from the "
                                "recipe and say why in its comment and in docs/recipes.md")
    return problems


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

exit codes: 0 ok; 2 usage or a bad recipe/override; 4 layout refused (memory plan, TP/PP
divisibility, cluster-only on one node, node count); 5 image target and GPU do not match.
"""


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, usage=USAGE_TEXT, epilog=EPILOG,
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
    recipe: ServeRecipe | None
    target: str | None
    args: argparse.Namespace
    extra: list[str]
    build: Recipe
    recipes_dir: Path


def parse_request(argv: list[str], prog: str, recipes_dir: Path, default_target: str | None,
                  out: Callable[[str], None], default_vllm: str | None = None) -> Request | int:
    own, extra = split_extra(argv)
    parser = build_parser(prog)
    try:
        args = parser.parse_args(own)
    except SystemExit as exc:  # argparse printed usage or --help
        return int(exc.code or 0)
    build = _build_recipe(recipes_dir, None, args.vllm or default_vllm)
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


def host_gpu_problem(target: str, build: Recipe, run: Callable = subprocess.run) -> str | None:
    """Why this host's GPUs cannot run the target's image, or None."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found: this host has no NVIDIA driver (a dry run needs none: --dry-run)"
    done = run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"], capture_output=True,
               text=True, check=False)
    if done.returncode != 0:
        return f"nvidia-smi failed ({done.returncode}): {done.stderr.strip()}"
    wanted = set(build.target(target).cuda_arch)
    found = [line.rsplit(",", 1) for line in done.stdout.strip().splitlines() if line.strip()]
    wrong = [f"{name.strip()} ({cap.strip()})" for name, cap in found if cap.strip() not in wanted]
    if not found:
        return "nvidia-smi lists no GPU"
    if wrong:
        return (f"the {target} image is built for compute capability {', '.join(sorted(wanted))}; this host has "
                f"{', '.join(wrong)}")
    return None


def execute(launch: Launch, request: Request, run: Callable = subprocess.run) -> int:
    """Start the containers: the detached ones first (workers over ssh; Ray's head here), then
    the foreground command here. All or nothing: when a start fails, and when the foreground
    command ends (its status, a Ctrl-C), the detached containers this launch started are stopped
    (`docker stop`; they run with --rm, so that removes them too)."""
    problem = host_gpu_problem(launch.target, request.build, run)
    if problem:
        raise TargetError(problem)
    ssh = shlex.split(request.args.ssh)
    head, workers = launch.nodes[0], launch.nodes[1:]
    # (node, command, whether it starts a detached container)
    if head.then:  # Ray: the head's Ray first, then the workers join, then vllm serve on the head
        order = [(head, head.docker, True), *((w, w.docker, True) for w in workers), (head, head.then, False)]
    else:
        order = [*((w, w.docker, True) for w in workers), (head, head.docker, False)]
    started: list[Node] = []
    try:
        for node, command, detached in order:
            done = run(_on_node(node, command, ssh), check=False)
            if done.returncode != 0:
                print(f"serve: node {node.rank} ({node.address}) failed, exit {done.returncode}", file=sys.stderr)
                return done.returncode
            if detached:
                started.append(node)
        return OK
    finally:
        _stop(started, ssh, run)


def _on_node(node: Node, command: list[str], ssh: list[str]) -> list[str]:
    """The argv that runs `command` on the node: here as it is, on another node as one shell command."""
    argv = [*ssh, node.address, shell_join(command)] if node.rank > 0 else list(command)
    print(f"serve: {shell_join(argv)}", file=sys.stderr, flush=True)
    return argv


def _stop(started: list[Node], ssh: list[str], run: Callable) -> None:
    if started:
        print(f"serve: stopping the {len(started)} container(s) this launch started", file=sys.stderr, flush=True)
    for node in reversed(started):
        stop = ["docker", "stop", node.container]
        done = run(_on_node(node, stop, ssh), check=False)
        if done.returncode != 0:
            print(f"serve: could not stop {node.container} on node {node.rank} ({node.address}), exit "
                  f"{done.returncode}; stop it there: {shell_join(stop)}", file=sys.stderr)


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
        return ImagePlan(error="DSA_IMAGE_TOOL is not set; the image's Dockerfile sets it", exit_code=1)
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
