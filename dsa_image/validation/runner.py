"""How a GPU validation session runs its commands: one base's paths under the work root, and
every command cut off at the session's deadline (dsa_image/validation/session.py has the phases).

Stdlib only: it runs under the device machine's Python with the repository on sys.path.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dsa_image.build import realwidth_model
from dsa_image.core.site_path import pythonpath
from dsa_image.core import status

REPO = Path(__file__).resolve().parents[2]
OK, FAILED, REFUSED = status.SUCCESS, status.FAILED, status.REFUSED
INCOMPLETE = status.INCOMPLETE  # a step that ran what it could and leaves the rest to a later call
MARGIN_S = 20.0  # what a phase keeps after its harness: collecting the results
INTERRUPT_GRACE_S = 60.0  # an interrupted harness's time to stop its servers (30 s each, at most)


class Refused(status.DsaImageError):
    """A phase's inputs are missing: the message says what and which phase makes them."""

    exit_code = status.REFUSED


# -- where a base keeps its things ------------------------------------------------------------------


@dataclass(frozen=True)
class Paths:
    vllm: str
    root: Path
    out: Path
    results: Path
    stage: Path
    wheels: Path
    site_stock: Path
    site_overlay: Path
    cuda_pip: Path
    toolchain_home: Path
    bench_work: Path
    warmstart_homes: Path
    model_info: Path
    realwidth_bench_work: Path
    model: Path
    mtp_model: Path
    realwidth: Path
    manifest: Path
    repo: Path = REPO

    @classmethod
    def of(cls, vllm: str, root: Path, out: Path, results: Path | None = None, repo: Path = REPO) -> "Paths":
        def base(name: str) -> Path:
            return root / f"{name}-{vllm}"

        return cls(vllm=vllm, root=root, out=out, results=results or base("results"), stage=base("stage"),
                   wheels=base("wheels"), site_stock=base("site-stock"), site_overlay=base("site-overlay"),
                   cuda_pip=base("cuda-pip"), toolchain_home=base("home-toolchain"), bench_work=base("bench-work"),
                   warmstart_homes=base("warmstart-homes"), model_info=base("model-info"),
                   realwidth_bench_work=base("bench-work-realwidth"),
                   model=root / "tiny-glm5", mtp_model=root / "tiny-glm5-mtp", realwidth=root / realwidth_model.NAME,
                   manifest=repo / "overlay" / f"vllm-{vllm}" / "manifest.json", repo=repo)

    def site(self, build: str) -> Path:
        """The site of a build, `stock-X.Y.Z` or `overlay-X.Y.Z`."""
        return self.root / f"site-{build}"

    def shown(self) -> dict[str, str]:
        """What the `paths` phase prints."""
        names = ("stage", "wheels", "site_stock", "site_overlay", "model", "realwidth", "manifest", "results")
        return {"vllm": self.vllm, **{n: str(getattr(self, n)) for n in names}}


# -- running commands -------------------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[{dt.datetime.now(dt.timezone.utc):%H:%M:%S}] {message}", flush=True)


def tail(path: Path, lines: int, keep: Callable[[str], bool] = lambda line: True) -> None:
    """The last `lines` kept lines of a file, printed (tail -N, after a grep)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        print(f"({path}: {exc})")
        return
    for line in [line for line in text if keep(line)][-lines:]:
        print(line)


def matching(pattern: str) -> Callable[[str], bool]:
    return lambda line: re.search(pattern, line) is not None


def copy_out(source: Path, target: Path) -> None:
    """cp SOURCE TARGET, where SOURCE may be missing (a harness that failed early)."""
    if source.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def _default_interrupt() -> None:
    """In the child, before exec: SIGINT back to its default. A runner started in the background
    (`gpu_validation.py ... &`, nohup) inherits SIGINT ignored and so would every harness it
    starts; Python then installs no KeyboardInterrupt handler, and the deadline's SIGINT, which
    a harness answers by stopping its servers, would do nothing for `grace` seconds."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Session:
    def __init__(self, opts: argparse.Namespace, paths: Paths):
        self.opts, self.paths = opts, paths
        self.deadline = time.monotonic() + opts.deadline_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def seconds(self, limit: float, keep: float = MARGIN_S) -> float:
        """`limit`, or less where less is left before the deadline, `keep` seconds kept after it
        (by default the margin for collecting the results)."""
        return max(1.0, min(limit, self.left() - keep))

    def run(self, cmd: list, log_path: Path | None = None, *, pythonpath: str | None = None, env: dict | None = None,
            unset: tuple[str, ...] = (), append: bool = False, echo: bool = False, cwd: str = "/tmp",
            errors: Path | None = None,
            limit: float | None = None, keep: float = MARGIN_S, stop_signal: int = signal.SIGINT,
            grace: float = INTERRUPT_GRACE_S) -> int:
        """Run `cmd`, in /tmp as the harnesses expect, its output to `log_path` (printed after
        with `echo`) or printed; its stderr with it, or to `errors`. Cut off at `limit` seconds or `keep` seconds before the deadline:
        `stop_signal` to its process group (SIGINT: a Python harness stops its servers in its
        finally blocks), SIGKILL after `grace` seconds. Returns its exit status, status.TIMED_OUT (124) when cut off
        (as timeout(1) does)."""
        environ = {k: v for k, v in os.environ.items() if k not in unset}
        environ.update(env or {})
        if pythonpath is not None:
            environ["PYTHONPATH"] = pythonpath
        timeout = self.seconds(limit if limit is not None else self.left(), keep)
        sink = open(log_path, "a" if append else "w") if log_path else subprocess.PIPE
        error_sink = open(errors, "w") if errors else subprocess.STDOUT
        printed = None
        try:
            proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=environ, stdout=sink,
                                    stderr=error_sink, text=True, start_new_session=True,
                                    preexec_fn=_default_interrupt)
            try:
                printed = proc.communicate(timeout=timeout)[0]
            except subprocess.TimeoutExpired:
                print(f"cut off after {timeout:.0f} s (the deadline): {shlex.join(map(str, cmd[:5]))} ...", flush=True)
                self._stop(proc, stop_signal, grace)
                return status.TIMED_OUT
        finally:
            for opened in (sink, error_sink):
                if hasattr(opened, "close"):
                    opened.close()
        if echo and log_path:
            tail(log_path, 100_000)
        elif printed:
            print(printed, end="", flush=True)
        return proc.returncode

    @staticmethod
    def _stop(proc: subprocess.Popen, stop_signal: int, grace: float) -> None:
        """`stop_signal`, then SIGKILL to what is left of the group the command leads."""
        for sig, wait in ((stop_signal, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(wait)
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue

    def python(self, *args, **kw) -> int:
        return self.run([sys.executable, *args], **kw)

    def repo_python(self, module: str, *args, **kw) -> int:
        """python -m MODULE with the repository on PYTHONPATH (after `site`, when given)."""
        site = kw.pop("site", None)
        path = f"{site}{os.pathsep}{self.paths.repo}" if site else str(self.paths.repo)
        return self.python("-m", module, *args, pythonpath=path, **kw)

    def site_path(self, site: Path) -> str:
        if not site.is_dir():
            raise Refused(f"expected the site {site}; run the install, prepare or sites phase first")
        return pythonpath(str(site))


