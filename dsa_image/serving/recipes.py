"""Serving recipes: their schema, loading and checks, --set overrides, and the bugs they name.

    recipes/serve/<name>.toml    a recipe: model, image targets and GPUs, layout, vLLM settings,
                                 environment workarounds (each with a reason and a link)
    recipes/models/<model>.toml  model facts (transformers' GlmMoeDsaConfig defaults + published values)

Every recipe is checked when loaded, its values by their schema entries (Setting); a layout
that cannot work is refused with the reason. The errors carry the runner's exit codes (cli;
dsa_image.core.status): USAGE, a bad recipe / override (RecipeFileError); REFUSED, a layout that
cannot work (LayoutError: TP does not divide the heads, PP does not divide the layers,
cluster-only on one node, a node count that does not match, memory) or an image target that does
not match the GPU (TargetError).

Workarounds expire with their bugs: each `[env.NAME]` / `[workarounds.SETTING]` entry names the
bugs it works around (recipes/bugs/, dsa_image/serving/workarounds.py) and is applied on a vLLM base only
where the recorded evidence says one of them is present (applies); a recipe's `blockers` refuse it
on a base that has one (blocking); bug_usage_problems finds the entries whose bugs are gone.

Stdlib only: the image's entrypoint imports this (through dsa_image.serving.cli).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from dsa_image.core import status
from dsa_image.serving import memory_plan
from dsa_image.serving.memory_plan import GPUS, SCHEMES
from dsa_image.core.recipe import DEFAULT_RECIPE, RECIPES_DIR, Recipe, RecipeError, load_recipe
from dsa_image.serving.workarounds import Bug, BugError, load_bugs

SERVE_DIR_NAME = "serve"
MODELS_DIR_NAME = "models"
DEFAULT_SERVE_RECIPE = "tiny-glm5"

OK, USAGE, REFUSED = status.SUCCESS, status.USAGE, status.REFUSED


class ServeError(status.DsaImageError):
    exit_code = USAGE


class RecipeFileError(ServeError):
    """A recipe or model file (or an override) is malformed."""


class LayoutError(ServeError):
    """The layout cannot work: memory, divisibility, node count."""

    exit_code = REFUSED


class TargetError(ServeError):
    """The image target does not match the GPU."""

    exit_code = REFUSED


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


def build_recipe(recipes_dir: Path, build: Recipe | None, vllm: str | None = None) -> Recipe:
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
    _check_top_level(raw, where)
    build = build_recipe(recipes_dir, build)
    model = load_model(raw["model"], recipes_dir)
    hardware = {target: _typed(gpu, str, f"{where}: hardware.{target}") for target, gpu in raw["hardware"].items()}
    layout = settings_table("layout", raw["layout"], LAYOUT_SETTINGS, where)
    layout.setdefault("cluster_backend", "mp")
    vllm = settings_table("vllm", raw["vllm"], VLLM_SETTINGS, where)
    for table, values, required in (("layout", layout, REQUIRED_LAYOUT), ("vllm", vllm, REQUIRED_VLLM)):
        missing = [key for key in required if key not in values]
        if missing:
            raise RecipeFileError(f"{where}: {table}.{missing[0]} missing")
    bugs = _load_bugs(recipes_dir)
    env = _env_vars(raw.get("env", {}), bugs, where)
    workarounds = _workarounds(raw.get("workarounds", {}), vllm, bugs, where)
    limitations = _bug_ids(raw.get("limitations", []), bugs, f"{where}: limitations", empty_ok=True)
    blockers = _bug_ids(raw.get("blockers", []), bugs, f"{where}: blockers", empty_ok=True)
    recipe = ServeRecipe(name, path, raw["description"], model, raw["hf_id"], raw["quantization"],
                         raw["cluster_only"], hardware, layout, vllm, tuple(env), tuple(workarounds),
                         limitations, blockers, bugs)
    check_recipe(recipe, build)
    return recipe


def _check_top_level(raw: dict[str, Any], where: str) -> None:
    """Known keys, the required ones, their types, the schema and the quantisation scheme."""
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
    if raw["quantization"] not in SCHEMES:
        raise RecipeFileError(f"{where}: quantization {raw['quantization']!r} unknown; known: {', '.join(SCHEMES)}")


def _env_vars(table: Mapping[str, Any], bugs, where: str) -> list[EnvVar]:
    env = []
    for var, entry in table.items():
        at = f"{where}: env.{var}"
        if not isinstance(entry, dict) or set(entry) != {"value", "reason", "link", "bugs"}:
            raise RecipeFileError(f"{at}: needs exactly value, reason, link and bugs (the recipes/bugs/ it works "
                                  "around)")
        for key in ("value", "reason", "link"):
            _typed(entry[key], str, f"{at}.{key}")
        _check_link(entry["link"], at)
        env.append(EnvVar(var, entry["value"], entry["reason"], entry["link"], _bug_ids(entry["bugs"], bugs, at)))
    return env


def _workarounds(table: Mapping[str, Any], vllm: Mapping[str, Any], bugs, where: str) -> list[Workaround]:
    workarounds = []
    for setting, entry in table.items():
        at = f"{where}: workarounds.{setting}"
        if setting not in vllm:
            raise RecipeFileError(f"{at}: the recipe sets no vllm.{setting}")
        if not isinstance(entry, dict) or set(entry) != {"reason", "link", "bugs"}:
            raise RecipeFileError(f"{at}: needs exactly reason, link and bugs (the recipes/bugs/ it works around)")
        _check_link(_typed(entry["link"], str, f"{at}.link"), at)
        workarounds.append(Workaround(setting, _typed(entry["reason"], str, f"{at}.reason"), entry["link"],
                                      _bug_ids(entry["bugs"], bugs, at)))
    return workarounds


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
    where, vllm = str(recipe.path), recipe.vllm
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
    _check_speculative(recipe, where)
    _check_model_limits(recipe, where)
    for target in recipe.targets:
        check_backend(recipe, target, build)
    check_layout(recipe)


def _check_speculative(recipe: ServeRecipe, where: str) -> None:
    vllm, cfg = recipe.vllm, recipe.model.config
    method = vllm.get("speculative_method")
    if (method is None) != ("num_speculative_tokens" not in vllm):
        raise RecipeFileError(f"{where}: speculative_method and num_speculative_tokens go together")
    if method is not None and method not in SPECULATIVE_METHODS:
        raise RecipeFileError(f"{where}: speculative_method {method!r}; supported: {', '.join(SPECULATIVE_METHODS)}")
    if method == "mtp" and cfg["num_nextn_predict_layers"] < 1:
        raise RecipeFileError(f"{where}: MTP needs a model with an MTP layer; {recipe.model.id} has "
                              f"num_nextn_predict_layers {cfg['num_nextn_predict_layers']}")


def _check_model_limits(recipe: ServeRecipe, where: str) -> None:
    """The tool parser, the context length and the indexer's top-k pattern against the model."""
    vllm, cfg = recipe.vllm, recipe.model.config
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


# -- expiry --------------------------------------------------------------------------------


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
