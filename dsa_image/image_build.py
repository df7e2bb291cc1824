"""Run `docker buildx bake` for this repository and read what it did.

Used by the tests (conftest's image fixtures) and CI. Stdlib only: subprocess + the docker CLI.

* `BakeOptions.for_this_machine`: host networking (works on any engine, and is the only network
  on engines started without a bridge, like CI's) and the host's CA bundle as the `pip-ca`
  build secret when one exists (needed behind a TLS-intercepting proxy, harmless elsewhere).
* `bake`: build targets with `--progress plain`, keep the log, parse which steps ran and which
  came from the cache (`parse_steps`).
* `bake_print`: the resolved definition (`docker buildx bake --print`) as a dict.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
MIN_BUILDX = (0, 15)  # bake's `network` attribute


class BuildError(Exception):
    """A bake failed or its output could not be read."""


def buildx_problem() -> str | None:
    """Why buildx cannot run our bake file here, or None when it can."""
    try:
        done = subprocess.run(["docker", "buildx", "version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"docker CLI not usable ({exc})"
    if done.returncode != 0:
        return f"docker buildx is not installed ({done.stderr.strip() or done.stdout.strip()}); see /work/shared/env/docker.md or .ci/run"
    match = re.search(r"\bv?(\d+)\.(\d+)", done.stdout)
    if not match:
        return f"cannot read the buildx version from {done.stdout.strip()!r}"
    version = (int(match.group(1)), int(match.group(2)))
    if version < MIN_BUILDX:
        return f"buildx {version[0]}.{version[1]} is too old; bake's `network` needs >= {MIN_BUILDX[0]}.{MIN_BUILDX[1]}"
    return None


@dataclass(frozen=True)
class BakeOptions:
    base_image: str | None = None  # None: the recipe's (docker-bake.json)
    network: str = "host"
    pip_ca: Path | None = None
    log_dir: Path | None = None
    variables: dict[str, str] = field(default_factory=dict)  # more bake variables (TAG, IMAGE ...)

    @classmethod
    def for_this_machine(cls, base_image: str | None, log_dir: Path | None) -> "BakeOptions":
        configured = os.environ.get("DSA_IMAGE_PIP_CA")
        if configured is not None:
            pip_ca = Path(configured) if configured else None
        else:
            pip_ca = HOST_CA_BUNDLE if HOST_CA_BUNDLE.is_file() else None
        return cls(base_image=base_image, network="host", pip_ca=pip_ca, log_dir=log_dir)

    def with_variables(self, **variables: str) -> "BakeOptions":
        return BakeOptions(self.base_image, self.network, self.pip_ca, self.log_dir, {**self.variables, **variables})

    def environment(self) -> dict[str, str]:
        """Bake variables are read from the environment."""
        env = {"BUILD_NETWORK": self.network, "PIP_CA": str(self.pip_ca) if self.pip_ca else ""}
        if self.base_image:
            env["BASE_IMAGE"] = self.base_image
        return {**env, **self.variables}

    def allow_flags(self) -> list[str]:
        """Entitlements buildx asks for: host networking, reading the CA bundle outside the context."""
        flags = ["--allow", "network.host"] if self.network == "host" else []
        if self.pip_ca:
            flags += ["--allow", f"fs.read={self.pip_ca.resolve().parent}"]
        return flags


@dataclass(frozen=True)
class Step:
    """One build vertex of `--progress plain` output."""

    vertex: int
    name: str
    stage: str | None  # "deps" for "[deps 1/2] RUN ...", None for internal vertices
    cached: bool
    seconds: float | None


@dataclass(frozen=True)
class BuildResult:
    targets: tuple[str, ...]
    tags: tuple[str, ...]
    seconds: float
    log: str
    log_path: Path | None
    steps: tuple[Step, ...]

    def rebuilt(self) -> list[Step]:
        """Dockerfile steps (not internal ones) that ran instead of coming from the cache.
        FROM is left out: BuildKit reports resolving a base image as DONE, never CACHED."""
        return [s for s in self.steps if s.stage is not None and not s.cached and "] FROM " not in s.name]


_VERTEX_NAME = re.compile(r"^#(\d+) (\[.*)$")
_VERTEX_STATE = re.compile(r"^#(\d+) (CACHED|DONE ([0-9.]+)s|ERROR.*|CANCELED)\s*$")
# "[deps 1/2] RUN ..." or, in multi-platform builds, "[linux/amd64 deps 1/2] RUN ..."
_STAGE = re.compile(r"^\[(?:\S+/\S+ )?([A-Za-z0-9_.-]+) \d+/\d+\]")


def parse_steps(log: str) -> list[Step]:
    names: dict[int, str] = {}
    states: dict[int, tuple[bool, float | None]] = {}
    for line in log.splitlines():
        state = _VERTEX_STATE.match(line)
        if state:
            vertex, what = int(state.group(1)), state.group(2)
            if what == "CACHED":
                states[vertex] = (True, None)
            elif what.startswith("DONE"):
                states[vertex] = (False, float(state.group(3)))
            continue
        named = _VERTEX_NAME.match(line)
        if named:
            names.setdefault(int(named.group(1)), named.group(2))
    steps = []
    for vertex, name in sorted(names.items()):
        if vertex not in states:
            continue
        stage = _STAGE.match(name)
        cached, seconds = states[vertex]
        steps.append(Step(vertex, name, stage.group(1) if stage else None, cached, seconds))
    return steps


def bake_command(targets: list[str], options: BakeOptions, sets: list[str] = ()) -> list[str]:
    command = ["docker", "buildx", "bake", *targets, "--progress", "plain", *options.allow_flags()]
    for item in sets:
        command += ["--set", item]
    return command


def bake_print(repo: Path, targets: list[str], options: BakeOptions, extra_env: dict[str, str] | None = None) -> dict:
    env = {**os.environ, **options.environment(), **(extra_env or {})}
    done = subprocess.run(["docker", "buildx", "bake", "--print", *targets], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise BuildError(f"docker buildx bake --print {' '.join(targets)} failed ({done.returncode}):\n{done.stderr}")
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError as exc:
        raise BuildError(f"bake --print did not print JSON ({exc}):\n{done.stdout[:2000]}") from exc


def bake(repo: Path, target: str, options: BakeOptions, sets: list[str] = (), timeout: float = 3600,
         log_name: str | None = None) -> BuildResult:
    """Build one bake target; the log goes to options.log_dir/<log_name or bake-TARGET>.log."""
    definition = bake_print(repo, [target], options)
    tags = tuple(definition["target"][target].get("tags", []))
    command = bake_command([target], options, sets)
    env = {**os.environ, **options.environment()}
    log_path = None
    if options.log_dir:
        options.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = options.log_dir / f"{log_name or f'bake-{target}'}.log"
    started = time.monotonic()
    done = subprocess.run(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=timeout)
    seconds = time.monotonic() - started
    if log_path:
        log_path.write_text(f"$ {' '.join(command)}\n{done.stdout}\n# exit {done.returncode} after {seconds:.0f} s\n")
    if done.returncode != 0:
        raise BuildError(f"{' '.join(command)} failed ({done.returncode}) after {seconds:.0f} s"
                         f"{f'; full log: {log_path}' if log_path else ''}\n--- last lines ---\n"
                         + "\n".join(done.stdout.splitlines()[-60:]))
    return BuildResult((target,), tags, seconds, done.stdout, log_path, tuple(parse_steps(done.stdout)))

