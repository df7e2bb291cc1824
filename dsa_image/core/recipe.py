"""Load and validate a recipe (recipes/<id>.toml), the single source of the image's pins.

A recipe pins one or more vLLM releases, the *bases* (`[vllm."X"]`: the wheels, the CUDA
toolkit that release's torch was built with, the extras' versions); everything else (base
image, serving defaults, targets) is shared. `load_recipe(..., vllm=X)` returns the recipe as
seen from base X (default: `[vllm] default`), so every consumer reads one base's pins the same
way (`recipe.get("cuda.toolkit")`, `recipe.vllm_version`).

Stdlib only (tomllib). Writing pins back is a targeted text edit (`set_wheel_sha256`,
`set_sdist_sha256`, `set_base_digest`): the stdlib has no TOML writer, and an edit keeps the
file's comments.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsa_image.core import status

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = REPO_ROOT / "recipes"
DEFAULT_RECIPE = "glm5-dsa"

# Docker platform <-> short arch name used in file names (locks) and bake variables.
PLATFORM_OF_ARCH = {"amd64": "linux/amd64", "arm64": "linux/arm64"}
ARCH_OF_PLATFORM = {platform: arch for arch, platform in PLATFORM_OF_ARCH.items()}

_SHA256 = re.compile(r"[0-9a-f]{64}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+-]*)")
_TARGET_ID = re.compile(r"[a-z0-9_]+")
_RECIPE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
_RELEASE = re.compile(r"[0-9]+\.[0-9]+\.[0-9]+([.+a-z0-9]*)")
SCHEMA = 2
# What a base ([vllm."X"]) pins besides the extras' sections its targets name. The sdist is
# not installed: it carries vLLM's own tests (dsa_image/upstream/gate.py).
_BASE_KEYS = ("wheels", "cuda", "sdist")
# ...and the target keys it changes ([vllm."X".targets.ID]), e.g. the backend a release picks.
_TARGET_ADJUSTMENTS = "targets"


def vllm_dir(version: str) -> str:
    """The directory name of one base's files (overlay/, recipes/locks/, recipes/requirements/)."""
    return f"vllm-{version}"


class RecipeError(status.DsaImageError):
    """The recipe is missing, malformed or asked for something it does not define."""

    exit_code = status.USAGE


@dataclass(frozen=True)
class Wheel:
    platform: str
    filename: str
    sha256: str  # "" until `scripts/recipe.py lock` filled it


@dataclass(frozen=True)
class Sdist:
    """A base's source distribution (PyPI's vllm-X.Y.Z.tar.gz): vLLM's tests, never installed."""

    filename: str
    sha256: str  # "" until `scripts/recipe.py lock` filled it


@dataclass(frozen=True)
class Extra:
    """A per-target addition: `<name>==<version>` plus optional resolver overrides."""

    name: str
    version: str
    overrides: tuple[str, ...]

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class Target:
    id: str
    description: str
    cuda_arch: tuple[str, ...]
    platforms: tuple[str, ...]
    extras: tuple[Extra, ...]
    kv_cache_dtype: str
    attention_backend: str
    indexer_backend: str
    env: dict[str, str]

    @property
    def arches(self) -> tuple[str, ...]:
        return tuple(ARCH_OF_PLATFORM[p] for p in self.platforms)

    @property
    def overrides(self) -> tuple[str, ...]:
        return tuple(o for extra in self.extras for o in extra.overrides)


@dataclass(frozen=True)
class Recipe:
    """The recipe as seen from one base: `vllm_version` and the pins below are that base's;
    `raw` is the file with that base's sections in place of [vllm] (what `get` reads)."""

    id: str
    path: Path
    raw: dict[str, Any]
    vllm_version: str
    default_vllm: str  # [vllm] default: the base used when none is named
    vllm_versions: tuple[str, ...]  # every base the recipe pins, in file order
    wheels: dict[str, Wheel]  # by docker platform
    sdist: Sdist
    base_image: str
    base_digest: str  # "" when not locked
    python: str
    cuda_toolkit: tuple[str, ...]
    cluster_packages: tuple[str, ...]  # in every image's common lock: serving across nodes
    upstream_test_packages: tuple[str, ...]  # what vLLM's own tests import beyond vLLM and the dev lock
    serving: dict[str, Any]
    targets: dict[str, Target]

    @property
    def base_ref(self) -> str:
        """The base image as bake/docker take it: image@digest once locked, else the tag."""
        return f"{self.base_image}@{self.base_digest}" if self.base_digest else self.base_image

    @property
    def platforms(self) -> tuple[str, ...]:
        """Every platform some target builds for, in the order of `[vllm.wheels]`."""
        wanted = {p for t in self.targets.values() for p in t.platforms}
        return tuple(p for p in self.wheels if p in wanted)

    def bake_target(self, target_id: str) -> str:
        """This base's own bake name for a target (docker-bake.hcl's `base_name`): sm120-vllm0_33_0."""
        return f"{target_id}-vllm{self.vllm_version.replace('.', '_')}"

    def target(self, target_id: str) -> Target:
        try:
            return self.targets[target_id]
        except KeyError:
            raise RecipeError(
                f"unknown target {target_id!r} in recipe {self.id}; valid targets: "
                f"{', '.join(self.targets)}"
            ) from None

    def wheel(self, platform: str) -> Wheel:
        platform = PLATFORM_OF_ARCH.get(platform, platform)
        try:
            return self.wheels[platform]
        except KeyError:
            raise RecipeError(
                f"recipe {self.id} has no vLLM wheel for {platform!r}; it has: "
                f"{', '.join(self.wheels)}"
            ) from None

    def get(self, dotted_key: str) -> Any:
        """The raw value at `a.b.c` (e.g. `targets.sm120.kv_cache_dtype`)."""
        node: Any = self.raw
        for part in dotted_key.split("."):
            if not isinstance(node, dict) or part not in node:
                keys = ", ".join(node) if isinstance(node, dict) else "(a value, not a table)"
                raise RecipeError(f"{self.id}: no key {dotted_key!r} (at {part!r}; there: {keys})")
            node = node[part]
        return node


def recipe_ids(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    return sorted(p.stem for p in recipes_dir.glob("*.toml"))


def recipe_path(recipe_id: str, recipes_dir: Path = RECIPES_DIR) -> Path:
    """recipes/<id>.toml; an id is a plain name, so it can never reach outside recipes/."""
    path = recipes_dir / f"{recipe_id}.toml"
    if not _RECIPE_ID.fullmatch(recipe_id) or not path.is_file():
        valid = ", ".join(recipe_ids(recipes_dir)) or "(none)"
        raise RecipeError(f"unknown recipe {recipe_id!r}; valid recipes: {valid}")
    return path


def load_recipe(recipe_id: str = DEFAULT_RECIPE, recipes_dir: Path = RECIPES_DIR, vllm: str | None = None) -> Recipe:
    """The recipe for base `vllm` (a vLLM version it pins; None: its default base)."""
    path = recipe_path(recipe_id, recipes_dir)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: not valid TOML: {exc}") from exc
    return parse_recipe(recipe_id, path, raw, vllm)


def load_every_base(recipe_id: str = DEFAULT_RECIPE, recipes_dir: Path = RECIPES_DIR) -> list[Recipe]:
    """The recipe once per base, the default first."""
    default = load_recipe(recipe_id, recipes_dir)
    others = [load_recipe(recipe_id, recipes_dir, v) for v in default.vllm_versions if v != default.vllm_version]
    return [default, *others]


def _need(table: dict, key: str, kind: type, where: str) -> Any:
    if key not in table:
        raise RecipeError(f"{where}: missing key {key!r}")
    value = table[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise RecipeError(f"{where}.{key}: expected {kind.__name__}, found {value!r}")
    return value


def _str_list(table: dict, key: str, where: str) -> tuple[str, ...]:
    values = _need(table, key, list, where)
    if not all(isinstance(v, str) for v in values):
        raise RecipeError(f"{where}.{key}: expected a list of strings, found {values!r}")
    return tuple(values)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RecipeError(message)


def _bases(raw: dict[str, Any], where: str) -> tuple[str, dict[str, dict]]:
    """([vllm] default, {version: its section}) of a recipe file, every base checked."""
    vllm = _need(raw, "vllm", dict, where)
    default = _need(vllm, "default", str, f"{where}: vllm")
    bases = {k: v for k, v in vllm.items() if k != "default"}
    _check(bool(bases), f'{where}: no [vllm."X"] section: a recipe pins at least one vLLM release')
    extras = {e for t in raw.get("targets", {}).values() if isinstance(t, dict) for e in t.get("extras", [])}
    for version, section in bases.items():
        _check(bool(_RELEASE.fullmatch(version)) and isinstance(section, dict),
               f'{where}: vllm.{version!r}: expected a [vllm."X.Y.Z"] table named after a vLLM release')
        unknown = sorted(set(section) - set(_BASE_KEYS) - {_TARGET_ADJUSTMENTS} - extras)
        _check(not unknown, f'{where}: [vllm."{version}"] has {", ".join(unknown)}: a base pins only '
                            f'{", ".join(_BASE_KEYS)} and the extras its targets name ({", ".join(sorted(extras)) or "none"}), '
                            f'and adjusts [{_TARGET_ADJUSTMENTS}.*] keys')
        shared = sorted(set(section) & set(raw) - {_TARGET_ADJUSTMENTS})
        _check(not shared, f'{where}: {", ".join(shared)} is both shared and in [vllm."{version}"]; keep one')
        _adjusted_targets(raw.get("targets", {}), section.get(_TARGET_ADJUSTMENTS, {}), f'{where}: vllm."{version}"')
    _check(default in bases, f"{where}: vllm.default {default!r} is not one of the pinned releases: {', '.join(bases)}")
    return default, bases


def _base_view(raw: dict[str, Any], version: str | None, where: str) -> dict[str, Any]:
    """The file as seen from base `version` (None: the default): its sections take the place
    of [vllm], which keeps the version, the default and the list of bases."""
    default, bases = _bases(raw, where)
    version = version or default
    if version not in bases:
        raise RecipeError(f"{where}: no vLLM {version!r}; this recipe pins: {', '.join(bases)} "
                          f"(--vllm takes one of them; default {default})")
    base = bases[version]
    vllm = {"version": version, "default": default, "versions": list(bases), "wheels": base.get("wheels"),
            "sdist": base.get("sdist")}
    view = {**{k: v for k, v in raw.items() if k != "vllm"},
            **{k: v for k, v in base.items() if k not in ("wheels", "sdist")}, "vllm": vllm}
    if _TARGET_ADJUSTMENTS in base:
        view["targets"] = _adjusted_targets(raw.get("targets", {}), base[_TARGET_ADJUSTMENTS],
                                            f'{where}: vllm."{version}"')
    return view


def _adjusted_targets(shared: dict, adjusted: dict, where: str) -> dict:
    """The shared [targets.*] with a base's [vllm."X".targets.ID] keys in place of theirs: a
    release that picks another backend for a GPU adjusts that key, not a copy of the target."""
    for tid, keys in adjusted.items():
        _check(tid in shared and isinstance(keys, dict),
               f"{where}.targets.{tid}: adjusts no shared target; targets: {', '.join(shared)}")
        unknown = sorted(set(keys) - set(shared[tid]))
        _check(not unknown, f"{where}.targets.{tid}: {', '.join(unknown)} not keys of [targets.{tid}]; "
                            f"a base adjusts a target's keys, it adds none")
    return {tid: {**t, **adjusted.get(tid, {})} for tid, t in shared.items()}


def parse_recipe(recipe_id: str, path: Path, file: dict[str, Any], vllm_version: str | None = None) -> Recipe:
    where = str(path)
    _check(file.get("schema") == SCHEMA, f"{where}: schema must be {SCHEMA}, found {file.get('schema')!r}")
    raw = _base_view(file, vllm_version, where)
    vllm = raw["vllm"]
    vllm_version = vllm["version"]
    wheels = _parse_wheels(_need(vllm, "wheels", dict, f'{where}: vllm."{vllm_version}"'), vllm_version, where)
    sdist = _parse_sdist(_need(vllm, "sdist", dict, f'{where}: vllm."{vllm_version}"'), vllm_version, where)

    base = _need(raw, "base", dict, where)
    digest = _need(base, "digest", str, f"{where}: base")
    _check(digest == "" or bool(_DIGEST.fullmatch(digest)),
           f"{where}: base.digest must be empty or sha256:<64 hex>, found {digest!r}")

    toolkit = _str_list(_need(raw, "cuda", dict, where), "toolkit", f"{where}: cuda")
    for pin in toolkit:
        _check(bool(_PIN.fullmatch(pin)), f"{where}: cuda.toolkit entry {pin!r} is not name==version")

    cluster = _str_list(_need(raw, "cluster", dict, where), "packages", f"{where}: cluster")
    for pin in cluster:
        _check(bool(_PIN.fullmatch(pin)), f"{where}: cluster.packages entry {pin!r} is not name==version")

    upstream = _str_list(_need(raw, "upstream_tests", dict, where), "packages", f"{where}: upstream_tests")
    for name in upstream:
        _check(bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name)),
               f"{where}: upstream_tests.packages entry {name!r} is not a package name (the lock pins its version)")

    targets_raw = _need(raw, "targets", dict, where)
    _check(bool(targets_raw), f"{where}: no [targets.*] section")
    targets = {tid: _parse_target(tid, t, raw, wheels, where) for tid, t in targets_raw.items()}
    return Recipe(
        id=recipe_id,
        path=path,
        raw=raw,
        vllm_version=vllm_version,
        default_vllm=vllm["default"],
        vllm_versions=tuple(vllm["versions"]),
        wheels=wheels,
        sdist=sdist,
        base_image=_need(base, "image", str, f"{where}: base"),
        base_digest=digest,
        python=_need(base, "python", str, f"{where}: base"),
        cuda_toolkit=toolkit,
        cluster_packages=cluster,
        upstream_test_packages=upstream,
        serving=_need(raw, "serving", dict, where),
        targets=targets,
    )


def _parse_wheels(table: dict, version: str, where: str) -> dict[str, Wheel]:
    wheels = {}
    for platform, entry in table.items():
        at = f'{where}: vllm."{version}".wheels.{platform!r}'
        _check(platform in ARCH_OF_PLATFORM, f"{at}: unknown platform; valid: {', '.join(ARCH_OF_PLATFORM)}")
        filename = _need(entry, "filename", str, at)
        sha = _need(entry, "sha256", str, at)
        _check(filename.startswith(f"vllm-{version}-") and filename.endswith(".whl"),
               f"{at}: filename {filename!r} is not a vllm {version} wheel")
        _check(sha == "" or bool(_SHA256.fullmatch(sha)), f"{at}: sha256 must be empty or 64 hex, found {sha!r}")
        wheels[platform] = Wheel(platform, filename, sha)
    return wheels


def _parse_sdist(entry: dict, version: str, where: str) -> Sdist:
    at = f'{where}: vllm."{version}".sdist'
    filename = _need(entry, "filename", str, at)
    sha = _need(entry, "sha256", str, at)
    _check(filename == f"vllm-{version}.tar.gz", f"{at}: filename {filename!r}, expected vllm-{version}.tar.gz "
                                                 "(PyPI's sdist of that release)")
    _check(sha == "" or bool(_SHA256.fullmatch(sha)), f"{at}: sha256 must be empty or 64 hex, found {sha!r}")
    return Sdist(filename, sha)


def _parse_extra(name: str, raw: dict, where: str) -> Extra:
    section = raw.get(name)
    if not (isinstance(section, dict) and isinstance(section.get("version"), str)):
        raise RecipeError(f'{where}: extra {name!r} needs a [{name}] section with a version (shared, or in this '
                          f'base\'s [vllm."X".{name}])')
    override = section.get("torch_override")
    overrides = (override,) if override else ()
    for pin in overrides:
        _check(bool(_PIN.fullmatch(pin)), f"{where}: {name}.torch_override {pin!r} is not name==version")
    return Extra(name, section["version"], overrides)


def _parse_target(tid: str, t: dict, raw: dict, wheels: dict[str, Wheel], where: str) -> Target:
    at = f"{where}: targets.{tid}"
    _check(bool(_TARGET_ID.fullmatch(tid)), f"{at}: target ids are lower-case letters, digits, _")
    platforms = _str_list(t, "platforms", at)
    for p in platforms:
        _check(p in wheels, f"{at}: platform {p!r} has no vLLM wheel in this base; known: {', '.join(wheels)}")
    env = _need(t, "env", dict, at)
    _check(all(isinstance(v, str) for v in env.values()), f"{at}.env: values must be strings")
    return Target(
        id=tid,
        description=_need(t, "description", str, at),
        cuda_arch=_str_list(t, "cuda_arch", at),
        platforms=platforms,
        extras=tuple(_parse_extra(e, raw, at) for e in _str_list(t, "extras", at)),
        kv_cache_dtype=_need(t, "kv_cache_dtype", str, at),
        attention_backend=_need(t, "attention_backend", str, at),
        indexer_backend=_need(t, "indexer_backend", str, at),
        env=dict(env),
    )


def format_value(value: Any) -> str:
    """How `scripts/recipe.py get` prints a value for shell scripts: scalars as they are,
    lists one item per line, tables as sorted JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "\n".join(format_value(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


# --- targeted edits: the only way pins get into the recipe -------------------------------


def _set_in_section(text: str, header: str, key: str, value: str) -> str:
    """Replace `key = "..."` inside the table whose header line is exactly `header`."""
    lines = text.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == header)
    except StopIteration:
        raise RecipeError(f"recipe has no {header} section") from None
    pattern = re.compile(rf'^(\s*{re.escape(key)}\s*=\s*)"[^"]*"(.*)$', re.DOTALL)
    for i in range(start + 1, len(lines)):
        if lines[i].lstrip().startswith("["):
            break
        match = pattern.match(lines[i])
        if match:
            lines[i] = f'{match.group(1)}"{value}"{match.group(2)}'
            return "".join(lines)
    raise RecipeError(f'recipe section {header} has no line `{key} = "..."`')


def set_wheel_sha256(text: str, version: str, platform: str, sha256: str) -> str:
    _check(bool(_SHA256.fullmatch(sha256)), f"not a sha256: {sha256!r}")
    return _set_in_section(text, f'[vllm."{version}".wheels."{platform}"]', "sha256", sha256)


def set_sdist_sha256(text: str, version: str, sha256: str) -> str:
    _check(bool(_SHA256.fullmatch(sha256)), f"not a sha256: {sha256!r}")
    return _set_in_section(text, f'[vllm."{version}".sdist]', "sha256", sha256)


def set_base_digest(text: str, digest: str) -> str:
    _check(digest == "" or bool(_DIGEST.fullmatch(digest)), f"not an image digest: {digest!r}")
    return _set_in_section(text, "[base]", "digest", digest)
