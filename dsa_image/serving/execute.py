"""Running a launch (launch.Launch): the containers on their nodes, all or nothing.

Workers are reached with ssh (--ssh), each command handed to the worker's shell as one quoted
line; the head's commands run here. When a start fails, and when the foreground command ends,
the detached containers this launch started are stopped again. Before anything starts, this
host's GPUs are checked against the image target (host_gpu_problem).

Stdlib only: the image's entrypoint imports this (through dsa_image.serving.cli).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from typing import TYPE_CHECKING, Callable

from dsa_image.core.recipe import Recipe
from dsa_image.serving.launch import Launch, Node, shell_join
from dsa_image.serving.recipes import OK, TargetError

if TYPE_CHECKING:  # the command line's Request; cli imports this module
    from dsa_image.serving.cli import Request


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

