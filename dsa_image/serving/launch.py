"""The plan of a launch: a serving recipe on an image target and vLLM base, as commands per node.

plan_launch checks what depends on the target and the hosts (the GPU, the backend, blockers, the
memory plan, the node count) and gives a Launch: the image, the `vllm serve` argv, the
environment, and per node the exact `docker run` argv: one node (solo), or a cluster of mp nodes
(vLLM's own multi-node: a head and headless workers) or Ray nodes (a Ray head and workers, then
`vllm serve` in the head's container). describe is the dry run: the plan, the workarounds per vLLM
base, and the commands, every word shell-quoted (shell_join). Running a Launch: execute.

Stdlib only: the image's entrypoint imports this (through dsa_image.serving.cli).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from dsa_image.serving import memory_plan
from dsa_image.serving.memory_plan import GPUS, SCHEMES
from dsa_image.core.recipe import RECIPES_DIR, Recipe
from dsa_image.serving.recipes import (VLLM_SETTINGS, LayoutError, RecipeFileError, ServeRecipe, TargetError,
                                       applies, attention_backend, blocking, check_backend, kv_cache_dtype)
from dsa_image.serving.workarounds import Bug

IMAGE_REPOSITORY = "dsa-image"
# The image runs as user vllm with HOME=/home/vllm (Dockerfile runtime stage): Hugging Face's
# cache is there.
CONTAINER_HF_CACHE = "/home/vllm/.cache/huggingface"
DEFAULT_HF_CACHE = "~/.cache/huggingface"
RAY_PORT = 6379
MP_MASTER_PORT = 29501


def memory_plan_of(recipe: ServeRecipe, target: str, build: Recipe) -> memory_plan.Plan:
    return memory_plan.plan(
        recipe.model.config, SCHEMES[recipe.quantization], GPUS[recipe.hardware[target]],
        tp=recipe.tp, pp=recipe.pp, mtp=recipe.uses_mtp, backend=attention_backend(recipe, target, build),
        kv_cache_dtype=kv_cache_dtype(recipe, target, build),
        gpu_memory_utilization=recipe.vllm.get("gpu_memory_utilization", 0.92),
        max_model_len=recipe.vllm["max_model_len"], block_size=recipe.vllm.get("block_size", 16),
        vllm=build.vllm_version)


def vllm_args(recipe: ServeRecipe, target: str, build: Recipe, extra: Sequence[str] = ()) -> list[str]:
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
                extra: Sequence[str] = (), repository: str = IMAGE_REPOSITORY, hf_cache: str = DEFAULT_HF_CACHE,
                ifname: str | None = None) -> Launch:
    if not REPOSITORY.fullmatch(repository):
        raise RecipeFileError(f"--image {repository!r}: not an image repository (lower case, e.g. dsa-image or "
                              "registry.example:5000/dsa-image)")
    check_hosts(hosts or [])
    volume = hf_volume(hf_cache)
    _check_target(recipe, target, build)
    _check_nodes(recipe, hosts, solo)
    plan = memory_plan_of(recipe, target, build)
    problem = plan.problem()
    if problem:
        raise LayoutError(f"recipe {recipe.name}: {problem}\n  " + "\n  ".join(plan.lines()))
    image = image_ref(build, target, repository)
    env = environment(recipe, target, build)
    args = vllm_args(recipe, target, build, list(extra))
    if ifname:
        env = {**env, "NCCL_SOCKET_IFNAME": ifname, "GLOO_SOCKET_IFNAME": ifname}
    run = _Containers(f"dsa-{recipe.name}", image, env,
                      ["--gpus", "all", "--ipc=host", "-v", volume, "-e", "HF_TOKEN"])
    if recipe.nodes == 1:
        port = str(recipe.vllm["port"])
        docker = ["docker", "run", "--rm", "--name", run.name, *run.common, "-p", f"{port}:{port}",
                  *run.env_flags(), image, "serve", *args]
        return Launch(recipe, target, image, ["vllm", "serve", *args], env,
                      (Node(0, (hosts or ["localhost"])[0], "solo", docker, run.name),), plan, (), build)
    notes = [] if hosts else ["no --nodes given: HEAD_ADDR and NODEi_ADDR stand for the nodes' addresses"]
    addresses = hosts or ["HEAD_ADDR", *(f"NODE{i}_ADDR" for i in range(1, recipe.nodes))]
    if recipe.layout["cluster_backend"] == "ray":
        serve = ["vllm", "serve", *args, "--distributed-executor-backend", "ray"]
        return Launch(recipe, target, image, serve, env, _ray_nodes(run, addresses, serve), plan, tuple(notes),
                      build)
    nodes = _mp_nodes(run, addresses, args)
    head_args = nodes[0].docker[nodes[0].docker.index("serve") + 1:]
    return Launch(recipe, target, image, ["vllm", "serve", *head_args], env, nodes, plan, tuple(notes), build)


def _check_target(recipe: ServeRecipe, target: str, build: Recipe) -> None:
    """The recipe runs on `target`'s image of this base: its hardware, backend and no blocker."""
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


def _check_nodes(recipe: ServeRecipe, hosts: list[str] | None, solo: bool) -> None:
    nodes_wanted = recipe.nodes
    if solo and recipe.cluster_only:
        raise LayoutError(f"recipe {recipe.name} is cluster-only: it needs {nodes_wanted} nodes "
                          f"(--nodes HEAD,WORKER,...), not --solo")
    if solo and nodes_wanted > 1:
        raise LayoutError(f"recipe {recipe.name} spans {nodes_wanted} nodes; --solo runs one")
    if hosts is not None and len(hosts) != nodes_wanted:
        raise LayoutError(f"recipe {recipe.name} needs {nodes_wanted} node(s), --nodes gave {len(hosts)}: "
                          f"{', '.join(hosts)}")


@dataclass(frozen=True)
class _Containers:
    """What every container of a launch shares: the name prefix, image, environment, docker flags."""
    name: str
    image: str
    env: Mapping[str, str]
    common: list[str]

    def env_flags(self, extra_env: Mapping[str, str] | None = None) -> list[str]:
        return [w for k, v in {**self.env, **(extra_env or {})}.items() for w in ("-e", f"{k}={v}")]


def _ray_nodes(run: _Containers, addresses: list[str], serve: list[str]) -> tuple[Node, ...]:
    nodes = []
    head = addresses[0]
    for rank, address in enumerate(addresses):
        role = "head" if rank == 0 else "worker"
        container = f"{run.name}-{role}" if rank == 0 else f"{run.name}-worker{rank}"
        # The image's modes (dsa_image/runtime/entrypoint.py): the head's port through RAY_PORT, a
        # worker names the head first.
        node_env = {"VLLM_HOST_IP": address, **({"RAY_PORT": str(RAY_PORT)} if rank == 0 else {})}
        mode = ["ray-head"] if rank == 0 else ["ray-worker", f"{head}:{RAY_PORT}"]
        docker = ["docker", "run", "-d", "--rm", "--name", container, *run.common, "--network", "host",
                  *run.env_flags(node_env), run.image, *mode]
        then = ["docker", "exec", f"{run.name}-head", *serve] if rank == 0 else []
        nodes.append(Node(rank, address, role, docker, container, then, detached=True))
    return tuple(nodes)


def _mp_nodes(run: _Containers, addresses: list[str], args: list[str]) -> tuple[Node, ...]:
    nodes = []
    for rank, address in enumerate(addresses):
        role = "head" if rank == 0 else "worker"
        node_args = [*args, "--nnodes", str(len(addresses)), "--node-rank", str(rank), "--master-addr", addresses[0],
                     "--master-port", str(MP_MASTER_PORT)]
        if rank > 0:
            node_args.append("--headless")
        container = f"{run.name}-node{rank}"
        docker = ["docker", "run", *(["-d"] if rank else []), "--rm", "--name", container, *run.common,
                  "--network", "host", *run.env_flags(), run.image, "serve", *node_args]
        nodes.append(Node(rank, address, role, docker, container, detached=rank > 0))
    return tuple(nodes)


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
