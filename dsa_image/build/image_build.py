"""Run `docker buildx bake` for this repository and read what it did.

Used by the tests (conftest's image fixtures), CI and `scripts/preflight.py`. Stdlib only:
subprocess + the docker CLI.

* `BakeOptions.for_this_machine`: the build network preflight picks (`build_network`: the
  default one when the engine has a docker0 bridge, else host networking, as on CI's engine;
  BUILD_NETWORK when set) and the host's CA bundle as the `pip-ca` build secret when one
  exists (needed behind a TLS-intercepting proxy, harmless elsewhere).
* `bake`: build targets with `--progress plain`, keep the log, parse which steps ran and which
  came from the cache (`parse_steps`); a target with a local output (bake target `test`) is
  exported into a directory emptied first, so what is there came from this build. The default
  network on an engine without a bridge is refused before anything runs; with `progress`, a
  line a minute says how long the bake has run and which step is running (`LiveSteps`).
* `read_test_results`: the in-image pytest run's counts and test files, from that export.
* `bake_print`: the resolved definition (`docker buildx bake --print`) as a dict.
* `HostFacts` / `choose_base` / `preflight_options` / `bake_invocation`: what this host lacks (a
  docker0 bridge, a reachable registry, direct TLS), the base image a build here uses (the
  tests' `base_image` fixture asks `choose_base` too) and the bake command that works here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from dsa_image.core import status

HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
MIN_BUILDX = (0, 15)  # bake's `network` attribute
# Where docs/image.md says how to get Docker and buildx, and what a host without a bridge, a
# registry or direct TLS needs: every hint points there.
DOCKER_DOCS = "docs/image.md#getting-docker-and-buildx"
HOST_DOCS = "docs/image.md#hosts-without-a-registry-a-bridge-or-direct-tls"
LOCAL_BASE_IMAGE = "dsa-image-base:bookworm"  # what scripts/bootstrap_base_image.sh makes
MAKE_LOCAL_BASE = f"sudo bash scripts/bootstrap_base_image.sh {LOCAL_BASE_IMAGE}"
BRIDGE_MISSING = "network bridge not found"
NO_BRIDGE = (f"this Docker engine has no docker0 bridge ('{BRIDGE_MISSING}' in every RUN step of a "
             f"default build): build with BUILD_NETWORK=host and --allow network.host")


class BuildError(status.DsaImageError):
    """A bake failed or its output could not be read."""


def buildx_problem() -> str | None:
    """Why buildx cannot run our bake file here, or None when it can."""
    try:
        done = subprocess.run(["docker", "buildx", "version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"docker CLI not usable ({exc})"
    if done.returncode != 0:
        return (f"docker buildx is not installed ({done.stderr.strip() or done.stdout.strip()}); "
                f"how to get it: {DOCKER_DOCS}")
    match = re.search(r"\bv?(\d+)\.(\d+)", done.stdout)
    if not match:
        return f"cannot read the buildx version from {done.stdout.strip()!r}"
    version = (int(match.group(1)), int(match.group(2)))
    if version < MIN_BUILDX:
        return (f"buildx {version[0]}.{version[1]} is too old; bake's `network` needs >= "
                f"{MIN_BUILDX[0]}.{MIN_BUILDX[1]} ({DOCKER_DOCS})")
    return None


def _docker(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)


def engine_has_bridge() -> bool:
    """Whether RUN steps can use the default network: the engine has the `bridge` network
    (dockerd --bridge=none, as scripts/install_docker.sh starts it, has none)."""
    try:
        return _docker("network", "inspect", "bridge").returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def build_network() -> str:
    """The bake's BUILD_NETWORK here: the user's when set, else what this engine can run."""
    return os.environ.get("BUILD_NETWORK") or ("default" if engine_has_bridge() else "host")


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
        return cls(base_image=base_image, network=build_network(), pip_ca=pip_ca, log_dir=log_dir)

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
    exported: Path | None = None  # the directory a local output was written to

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


def bake_command(targets: list[str], options: BakeOptions, sets: Sequence[str] = ()) -> list[str]:
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


def local_output(repo: Path, resolved_target: dict) -> Path | None:
    """The directory a target's `type=local` output writes to (relative to `repo`), if any."""
    for output in resolved_target.get("output", []):
        if isinstance(output, dict) and output.get("type") == "local" and output.get("dest"):
            return (repo / output["dest"]).resolve()
    return None


def _clear_export(repo: Path, directory: Path) -> None:
    # The local exporter adds to what is there: a file left by an earlier build would pass
    # for this one's. Only a directory under the repository's build/ is ever removed.
    if not directory.is_relative_to((repo / "build").resolve()):
        raise BuildError(f"{directory}: a local output outside {repo / 'build'}; not emptying it")
    shutil.rmtree(directory, ignore_errors=True)


def failure_hint(log: str) -> str:
    """What to do about a failure this repository's docs explain, or ""."""
    if BRIDGE_MISSING in log:
        return (f"\n'{BRIDGE_MISSING}': {NO_BRIDGE} ({HOST_DOCS}; `python3 scripts/preflight.py` "
                f"prints the command for this host)")
    if "CERTIFICATE_VERIFY_FAILED" in log:
        return (f"\npip does not trust this network's TLS (an intercepting proxy?): build with "
                f"PIP_CA=<the host's CA bundle> and --allow fs.read=<its directory> ({HOST_DOCS})")
    return ""


class LiveSteps:
    """The build steps `--progress plain` has started and finished, read as its lines come."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: dict[int, tuple[str, float]] = {}
        self._finished: set[int] = set()

    def feed(self, line: str, now: float) -> None:
        state, named = _VERTEX_STATE.match(line), _VERTEX_NAME.match(line)
        with self._lock:
            if state:
                self._finished.add(int(state.group(1)))
            elif named and int(named.group(1)) not in self._started:
                self._started[int(named.group(1))] = (named.group(2), now)

    def summary(self, started: float, now: float) -> str:
        """E.g. '7 min 12 s, 9 steps done; running for 5 min 3 s: [deps 1/2] RUN pip ...'."""
        with self._lock:
            running = sorted((since, name) for vertex, (name, since) in self._started.items()
                             if vertex not in self._finished)
            done = len(self._finished)
        line = f"{_minutes(now - started)}, {done} steps done"
        if running:
            since, name = running[0]
            more = f" (and {len(running) - 1} more)" if len(running) > 1 else ""
            line += f"; running for {_minutes(now - since)}: {name[:120]}{more}"
        else:
            line += "; no step running"
        return line


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def run_build(command: list[str], repo: Path, env: dict[str, str], timeout: float,
              progress: Callable[[str], None] | None = None,
              heartbeat_s: float = 60) -> subprocess.CompletedProcess:
    """Run a build command, its output (stdout and stderr) kept; with `progress`, every
    `heartbeat_s` a line with the time so far and the step running (a cold arm64 bake spends
    most of its ~19 minutes in one pip step). Past `timeout` the command is killed:
    TimeoutExpired, with the output so far."""
    started = time.monotonic()
    process = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, errors="replace")
    output = process.stdout
    if output is None:  # stdout=PIPE always opens one
        process.kill()
        raise BuildError(f"{command[0]}: started without a pipe for its output")
    lines: list[str] = []
    live = LiveSteps()

    def read() -> None:
        for line in output:
            lines.append(line)
            live.feed(line.rstrip("\n"), time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = started + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            process.wait(timeout=max(0.0, min(left, heartbeat_s) if progress else left))
            break
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                process.kill()
                process.wait()
                reader.join()
                raise subprocess.TimeoutExpired(command, timeout, "".join(lines)) from None
            if progress:
                progress(live.summary(started, time.monotonic()))
    reader.join()
    return subprocess.CompletedProcess(command, process.returncode, "".join(lines))


def bake(repo: Path, target: str, options: BakeOptions, sets: Sequence[str] = (), timeout: float = 3600,
         log_name: str | None = None, progress: Callable[[str], None] | None = None,
         heartbeat_s: float = 60) -> BuildResult:
    """Build one bake target; the log goes to options.log_dir/<log_name or bake-TARGET>.log.
    `progress` gets a line every `heartbeat_s` while it runs (`run_build`)."""
    if options.network == "default" and not engine_has_bridge():
        raise BuildError(f"not starting `docker buildx bake {target}`: {NO_BRIDGE} "
                         f"({HOST_DOCS}; `python3 scripts/preflight.py` prints the command for this host). "
                         f"Nothing was built.")
    definition = bake_print(repo, [target], options)
    tags = tuple(definition["target"][target].get("tags", []))
    exported = local_output(repo, definition["target"][target])
    if exported:
        _clear_export(repo, exported)
    command = bake_command([target], options, sets)
    env = {**os.environ, **options.environment()}
    log_path = None
    if options.log_dir:
        options.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = options.log_dir / f"{log_name or f'bake-{target}'}.log"
    started = time.monotonic()
    done = run_build(command, repo, env, timeout, progress, heartbeat_s)
    seconds = time.monotonic() - started
    if log_path:
        log_path.write_text(f"$ {' '.join(command)}\n{done.stdout}\n# exit {done.returncode} after {seconds:.0f} s\n")
    if done.returncode != 0:
        raise BuildError(f"{' '.join(command)} failed ({done.returncode}) after {seconds:.0f} s"
                         f"{f'; full log: {log_path}' if log_path else ''}\n--- last lines ---\n"
                         + "\n".join(done.stdout.splitlines()[-60:]) + failure_hint(done.stdout))
    return BuildResult((target,), tags, seconds, done.stdout, log_path, tuple(parse_steps(done.stdout)), exported)


# -- the in-image test run's results (bake target `test`) ------------------------------------

@dataclass(frozen=True)
class PytestResults:
    tests: int
    failures: int
    errors: int
    skipped: int
    files: tuple[str, ...]  # test modules with at least one test case, e.g. tests/test_overlay.py
    verify: str  # what `overlay.py verify` printed
    model_info: str  # what `model_info_cache check` printed

    @property
    def passed(self) -> int:
        return self.tests - self.failures - self.errors - self.skipped


def read_test_results(directory: Path) -> PytestResults:
    """The results the `test-results` stage exports: pytest's junit.xml, verify.txt and
    model-info.txt."""
    junit, verify, model_info = directory / "junit.xml", directory / "verify.txt", directory / "model-info.txt"
    for path in (junit, verify, model_info):
        if not path.is_file():
            raise BuildError(f"{path}: missing; the `test` stage exports it on every build "
                             f"(Dockerfile stage test-results)")
    try:
        root = ET.parse(junit).getroot()
    except ET.ParseError as exc:
        raise BuildError(f"{junit}: not XML ({exc})") from exc
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        raise BuildError(f"{junit}: no <testsuite>")
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    # pytest names a module's cases tests.test_x or tests.test_x.TestClass
    files = sorted({"/".join(case.get("classname", "").split(".")[:2]) + ".py"
                    for suite in suites for case in suite.iter("testcase") if case.get("classname")})
    return PytestResults(total["tests"], total["failures"], total["errors"], total["skipped"], tuple(files),
                         verify.read_text(errors="replace"), model_info.read_text(errors="replace"))


# -- preflight: what this host needs to build ------------------------------------------------

def public_ca_bundle(repo: Path | None = None) -> str | None:
    """The Mozilla CA bundle as certifi ships it: what pip in a fresh image trusts, unlike this
    host's store, which may hold a proxy's CA. First the repository's .venv's copy (installed
    from the hash-locked dev lock, so unmodified), then whatever certifi this Python has (a
    host may have added its proxy's CA to that one too)."""
    if repo is not None:
        for path in sorted((repo / ".venv" / "lib").glob("python3*/site-packages/certifi/cacert.pem")):
            return str(path)
    for module in ("certifi", "pip._vendor.certifi"):
        try:
            return __import__(module, fromlist=["where"]).where()
        except (ImportError, AttributeError):
            continue
    return None


def tls_intercepted(bundle: str | None, host: str = "pypi.org", timeout: float = 15) -> bool | None:
    """Whether HTTPS to `host` is intercepted (this host's CA store verifies it, the public
    `bundle` does not). None: cannot tell (no bundle, or `host` unreachable)."""
    if bundle is None:
        return None

    def verifies(context: ssl.SSLContext) -> bool:
        with socket.create_connection((host, 443), timeout=timeout) as sock:
            with context.wrap_socket(sock, server_hostname=host):
                return True

    try:
        return not verifies(ssl.create_default_context(cafile=bundle))
    except ssl.SSLCertVerificationError:
        try:
            return verifies(ssl.create_default_context())
        except (OSError, ssl.SSLError):
            return None
    except OSError:
        return None


@dataclass(frozen=True)
class HostFacts:
    """What preflight found. A problem string is None when that part is fine."""

    engine_problem: str | None
    buildx_problem: str | None
    bridge: bool  # `docker network inspect bridge` answers: RUN steps can use the default network
    base_image: str  # the base the bake would use (BASE_IMAGE or the recipe's)
    base_local: bool  # in this engine already
    base_pullable: bool | None  # a registry serves it; None when not asked (it is local)
    local_base: bool  # LOCAL_BASE_IMAGE exists in this engine
    tls_intercepted: bool | None
    ca_bundle: Path | None  # this host's CA bundle, when there is one
    public_bundle: str | None = None  # what tls_intercepted compared with


def host_facts(base_image: str, check_tls: bool = True, repo: Path | None = None) -> HostFacts:
    """Ask this host's Docker engine (and, with check_tls, PyPI) what a build here needs."""
    ca_bundle = HOST_CA_BUNDLE if HOST_CA_BUNDLE.is_file() else None
    public = public_ca_bundle(repo)
    intercepted = tls_intercepted(public) if check_tls else None
    try:
        info = _docker("info", "--format", "{{.ServerVersion}}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        problem = f"the docker CLI cannot run ({exc}); how to get it: {DOCKER_DOCS}"
        return HostFacts(problem, problem, False, base_image, False, None, False, intercepted, ca_bundle, public)
    if info.returncode != 0:
        problem = f"no Docker engine answers ({info.stderr.strip()}); start it, or see {DOCKER_DOCS}"
        return HostFacts(problem, buildx_problem(), False, base_image, False, None, False, intercepted, ca_bundle,
                         public)
    bridge = engine_has_bridge()
    base_local = _docker("image", "inspect", base_image).returncode == 0
    base_pullable = None
    if not base_local:
        try:  # asks the registry for the manifest only: nothing is pulled
            base_pullable = _docker("buildx", "imagetools", "inspect", base_image).returncode == 0
        except subprocess.TimeoutExpired:
            base_pullable = False
    local_base = _docker("image", "inspect", LOCAL_BASE_IMAGE).returncode == 0
    return HostFacts(None, buildx_problem(), bridge, base_image, base_local, base_pullable, local_base,
                     intercepted, ca_bundle, public)


@dataclass(frozen=True)
class BaseChoice:
    """The base image a build here uses. With `problem` set nothing can build yet: `image` is
    what to build on once the problem's fix is done."""

    image: str
    note: str | None  # why this one
    problem: str | None  # what must be done first, with the command that does it


def choose_base(facts: HostFacts, recipe_base: str, variable: str = "BASE_IMAGE") -> BaseChoice:
    """The one rule for preflight and the tests (their `base_image` fixture): the requested base
    when this engine has it or a registry serves it; for the recipe's base, else the local one
    scripts/bootstrap_base_image.sh makes, when it is here. A base the user named (`variable`)
    is never swapped for another."""
    wanted = facts.base_image
    if facts.base_local or facts.base_pullable:
        return BaseChoice(wanted, f"base image {wanted}: {'in this engine' if facts.base_local else 'a registry serves it'}",
                          None)
    missing = f"base image {wanted}: not in this engine and no registry serves it"
    if wanted != recipe_base:
        return BaseChoice(wanted, None, f"{missing} ({variable}={wanted}); make it (a local Debian bookworm base: "
                                        f"sudo bash scripts/bootstrap_base_image.sh {wanted}) or unset {variable}")
    if facts.local_base:
        return BaseChoice(LOCAL_BASE_IMAGE, f"{missing}; using the local {LOCAL_BASE_IMAGE} "
                                            f"(scripts/bootstrap_base_image.sh): {variable}={LOCAL_BASE_IMAGE}", None)
    return BaseChoice(LOCAL_BASE_IMAGE, None, f"{missing}; make a local one first: {MAKE_LOCAL_BASE} "
                                              f"(then {variable}={LOCAL_BASE_IMAGE})")


@dataclass(frozen=True)
class Preflight:
    options: BakeOptions
    notes: list[str]  # one line per finding, what it means for the build
    blockers: list[str]  # what must be done before any build can work


def preflight_options(facts: HostFacts, recipe_base: str) -> Preflight:
    """The bake options that work on a host with these facts, and why each was chosen."""
    notes: list[str] = []
    blockers: list[str] = []
    for problem in (facts.engine_problem, facts.buildx_problem):
        if problem and problem not in blockers:
            blockers.append(problem)
    if facts.engine_problem:  # nothing else could be asked
        return Preflight(BakeOptions(network="default"), notes, blockers)
    network = "default"
    if not facts.bridge:
        network = "host"
        notes.append(f"no docker0 bridge ('{BRIDGE_MISSING}' in a default build): BUILD_NETWORK=host, "
                     f"--allow network.host")
    choice = choose_base(facts, recipe_base)
    if choice.note:
        notes.append(choice.note)
    if choice.problem:
        blockers.append(choice.problem)
    base = None if choice.image == recipe_base else choice.image
    pip_ca = None
    if facts.tls_intercepted:
        if facts.ca_bundle:
            pip_ca = facts.ca_bundle
            notes.append(f"HTTPS to PyPI is intercepted (this host trusts it, the public CA bundle does not): "
                         f"PIP_CA={pip_ca}, --allow fs.read={pip_ca.resolve().parent}")
        else:
            blockers.append("HTTPS to PyPI is intercepted and this host has no CA bundle at "
                            f"{HOST_CA_BUNDLE}: set PIP_CA to the proxy's CA bundle ({HOST_DOCS})")
    else:
        finding = ("could not tell whether HTTPS to PyPI is intercepted" if facts.tls_intercepted is None else
                   f"HTTPS to PyPI verifies with the public CA bundle ({facts.public_bundle})")
        notes.append(f"{finding}; if pip in the build fails with CERTIFICATE_VERIFY_FAILED, add "
                     f"PIP_CA=<CA bundle> and --allow fs.read=<its directory>")
    return Preflight(BakeOptions(base_image=base, network=network, pip_ca=pip_ca), notes, blockers)


def bake_invocation(options: BakeOptions, target: str) -> str:
    """The shell command that runs `docker buildx bake TARGET` with `options`; variables left
    at the bake file's defaults are not written."""
    variables = []
    if options.network != "default":
        variables.append(f"BUILD_NETWORK={options.network}")
    if options.pip_ca:
        variables.append(f"PIP_CA={options.pip_ca}")
    if options.base_image:
        variables.append(f"BASE_IMAGE={options.base_image}")
    variables += [f"{k}={v}" for k, v in options.variables.items()]
    return " ".join([*variables, "docker", "buildx", "bake", target, *options.allow_flags()])

