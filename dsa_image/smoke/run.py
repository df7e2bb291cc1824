"""One smoke run, whatever the runtime: start the server, wait for /health while following
its log, run the checks, stop the server (always: success, failure, timeout, Ctrl-C, SIGTERM),
write the report and the log."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO, Callable, Iterable, Protocol

from dsa_image.core.recipe import Recipe, RecipeError, Target
from dsa_image.smoke import checks as C
from dsa_image.smoke.expect import capability_problem, expected_for, target_for_capability
from dsa_image.smoke.gpu import capability_of
from dsa_image.core import health
from dsa_image.harness.client import Client
from dsa_image.smoke.layout import SINGLE_GPU, Layout, logged_layout, summary
from dsa_image.smoke.report import LOG_NAME, Report, log_tail, summarize_receipt, write_report
from dsa_image.core import status

DEFAULT_HEALTH_TIMEOUT_S = 600.0
POLL_S = 1.0
# A failed check's reason past its first line (the server log's tail, a tool's output), on the
# console: enough to see why, bounded so it does not bury the summary; the report has the rest.
SUMMARY_REASON_LINES = 40


class StartError(status.DsaImageError):
    """The server could not be started at all (e.g. Docker refused the GPU request)."""

    exit_code = status.USAGE


class Server(Protocol):
    """What a runtime provides. `stop` must be safe to call at any point, more than once."""

    base_url: str
    verify_command: str

    def start(self) -> None: ...
    def exit_code(self) -> int | None: ...  # None while running
    def log_text(self) -> str: ...
    def run_verify(self) -> tuple[int, str]: ...
    def run_selftest(self) -> tuple[int, str]: ...
    def receipt(self) -> dict | None: ...
    def gpu_info(self) -> dict: ...
    def layout_facts(self) -> dict: ...  # {"gpus_used": GPUs its processes hold, "shm": /dev/shm}
    def warm_problem(self) -> str | None: ...  # after /health: None once it takes traffic (warm-up done)
    def describe(self, report: Report) -> None: ...  # fills image / python / versions
    def stop(self) -> None: ...


class Interrupted(BaseException):
    """SIGINT / SIGTERM / SIGHUP, so `finally` blocks clean up.

    SIGINT gets the handler too: Python raises KeyboardInterrupt only when SIGINT was
    not ignored at start-up, and a job started with `&` by a non-interactive shell
    (a CI step, nohup) inherits it ignored, so Ctrl-C or `kill -INT` would be lost."""


def _raise_interrupted(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


class LogFollower:
    """Copies a server's output into its log file as it comes, echoing lines to `echo`."""

    def __init__(self, chunks: Iterable[bytes], path: Path, echo: IO[str] | None, prefix: str = "server| "):
        self.path = path
        self._chunks = chunks
        self._echo = echo
        self._prefix = prefix
        self._thread = threading.Thread(target=self._run, name="smoke-log", daemon=True)

    def start(self) -> "LogFollower":
        self._thread.start()
        return self

    def _run(self) -> None:
        pending = b""
        try:
            with open(self.path, "ab") as f:
                for chunk in self._chunks:
                    f.write(chunk)
                    f.flush()
                    if self._echo is not None:
                        pending += chunk
                        *lines, pending = pending.split(b"\n")
                        self._show(lines)
        except Exception as e:  # the stream ends with the server; that is no error of the run
            if self._echo is not None:
                self._echo.write(f"smoke: log stream ended: {e}\n")

    def _show(self, lines: list[bytes]) -> None:
        echo = self._echo
        if echo is None:  # no terminal asked for, or it closed under an earlier chunk
            return
        try:
            for line in lines:
                echo.write(self._prefix + line.decode(errors="replace") + "\n")
            echo.flush()
        except (OSError, ValueError):
            self._echo = None  # a closed terminal must not stop the log file

    def join(self, timeout_s: float = 10.0) -> None:
        self._thread.join(timeout_s)


def wait_healthy(server: Server, client: Client, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> C.Check:
    """Poll /health until 200 and then the server's readiness (the image's healthcheck: its
    warm-up done) until ready, the server exits, or `timeout_s` passes.

    The image's /health answers before its warm-up requests have run; checks sent then would
    be batched with the warm-up's traffic and time the compiles the warm-up exists to take."""
    start = clock()
    watched = health.Watch("server", lambda: client.status("/health") == 200, server.exit_code, start,
                           ready=server.warm_problem)
    outcome = health.wait([watched], start + timeout_s, POLL_S, clock=clock, sleep=sleep)["server"]
    answered_s, seconds = outcome.answered_s, outcome.ended_s or 0.0
    if outcome.healthy_s is not None:
        return C.Check("server_healthy", True,
                       f"/health answered 200 after {answered_s:.1f} s, ready after {outcome.healthy_s:.1f} s",
                       outcome.healthy_s, {"time_to_healthy_s": round(outcome.healthy_s, 1),
                                           "health_answered_s": round(answered_s or 0.0, 1)})
    if outcome.exit_code is not None:
        when = "before /health answered" if answered_s is None else "after /health answered, before it was ready"
        return C.Check("server_healthy", False,
                       f"the server exited with code {outcome.exit_code} after {seconds:.1f} s, {when}; "
                       f"log tail:\n{_startup_tail(server)}", seconds, {"exit_code": outcome.exit_code})
    waited_for = ("/health did not answer 200" if answered_s is None else
                  f"/health answered after {answered_s:.1f} s but the server was not ready ({outcome.not_ready})")
    return C.Check("server_healthy", False,
                   f"{waited_for} within {timeout_s:.0f} s (raise --health-timeout for big "
                   f"models); log tail:\n{_startup_tail(server)}", seconds)


def _startup_tail(server: Server) -> str:
    # An empty tail would read as if it had been lost: say that the server wrote nothing.
    return log_tail(server.log_text(), 3000).strip("\n") or "(the server wrote nothing to its log)"


def resolve_target(recipe: Recipe, target_id: str | None, gpu: dict) -> Target:
    """--target when given, else the recipe target built for the GPU's compute capability."""
    if target_id:
        return recipe.target(target_id)
    capability = capability_of(gpu)
    if capability is None:
        raise RecipeError(f"no --target given and the GPU's compute capability is unknown "
                          f"({gpu.get('error') or 'GPUs of different capabilities'}); pass --target")
    return target_for_capability(recipe, capability)


def run_smoke(server: Server, report: Report, recipe: Recipe, target_id: str | None, out_dir: Path,
              health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S, request_timeout_s: float = 300.0,
              layout: Layout = SINGLE_GPU) -> Report:
    """Run every check against `server` (serving `layout`), always stop it, and write the
    report into `out_dir`."""
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    run_start = time.monotonic()
    report.parallel = report.parallel or layout.as_dict()
    try:
        _run_checks(server, report, recipe, target_id, health_timeout_s, request_timeout_s, layout)
    except (KeyboardInterrupt, Interrupted) as e:
        report.interrupted = True
        report.errors.append(f"interrupted ({type(e).__name__} {e}); the server was stopped")
    finally:
        log = _stop(server, report)
        report.parallel.update(logged_layout(log, layout))
        for s, handler in previous.items():
            signal.signal(s, handler)
        report.timings["total_s"] = round(time.monotonic() - run_start, 1)
        _fill_not_run(report)
        write_report(out_dir, report, log)
    return report


def _stop(server: Server, report: Report) -> str:
    """Note how the server ended, stop it (a second Ctrl-C cannot skip that), then read its
    whole log, shutdown messages included."""
    try:
        code = server.exit_code()
        if code is not None:
            report.server_exit = {"exit_code": code, "while": "during the run"}
    except Exception as e:
        report.errors.append(f"reading the server's state failed: {e}")
    for _attempt in range(3):
        try:
            server.stop()
            break
        except (KeyboardInterrupt, Interrupted):
            continue
        except Exception as e:
            report.errors.append(f"stopping the server failed: {e}")
            break
    try:
        return server.log_text()
    except Exception as e:
        report.errors.append(f"reading the server's log failed: {e}")
        return ""


def _run_checks(server: Server, report: Report, recipe: Recipe, target_id: str | None,
                health_timeout_s: float, request_timeout_s: float, layout: Layout) -> None:
    report.gpu = server.gpu_info()
    try:
        target = resolve_target(recipe, target_id, report.gpu)
    except RecipeError as e:
        report.errors.append(str(e))
        return
    report.target = target.id
    if report.served_model_name is None:  # the CLI sets it from the recipe before the run
        report.errors.append("no served model name to ask the server for; the server was not started")
        return
    try:
        server.start()
    except StartError as e:
        report.checks.append(C.Check("server_healthy", False, f"the server did not start: {e}"))
        _describe(server, report)
        return
    client = Client(server.base_url, timeout_s=request_timeout_s)
    healthy = wait_healthy(server, client, health_timeout_s)
    report.checks.append(healthy)
    report.timings["time_to_healthy_s"] = healthy.details.get("time_to_healthy_s")
    if not report.gpu.get("gpus"):
        report.gpu = server.gpu_info()  # inside the container, now that it runs
    _describe(server, report)
    if not healthy.passed:
        return
    # Now, while it serves: the GPUs its processes hold are the ones it uses. run_smoke has
    # recorded the layout asked in report.parallel; these facts join it.
    report.parallel = {**(report.parallel or {}), **_layout_facts(server)}
    report.checks += C.run_http_checks(client, report.served_model_name)
    report.timings["requests_s"] = {c.name: c.details.get("latency_s") for c in report.checks
                                    if c.details.get("latency_s") is not None}
    report.checks.append(C.check_verify(server.run_verify, server.verify_command))
    report.checks.append(C.check_selftest(server.run_selftest))
    capability = capability_of(report.gpu)
    expected = expected_for(target, capability)
    report.expected = expected.as_dict()
    log = server.log_text()
    report.checks.append(C.check_backends(log, expected, capability_problem(target, capability)))
    report.checks.append(C.check_parallel_layout(log, layout, report.parallel.get("gpus_used")))


def _layout_facts(server: Server) -> dict:
    # What the report says of the GPUs held: failing to read it leaves that unknown (the
    # parallel_layout check then rests on the log), it does not stop the run.
    try:
        return server.layout_facts()
    except Exception as e:
        return {"gpus_used": {"error": f"reading them failed: {type(e).__name__}: {e}"}}


def _describe(server: Server, report: Report) -> None:
    """What ran: image or python, and the versions the overlay receipt proves."""
    server.describe(report)
    report.receipt = server.receipt()
    report.versions.update({f"receipt_{k}": v for k, v in summarize_receipt(report.receipt).items()})


def _fill_not_run(report: Report) -> None:
    done = {c.name for c in report.checks}
    why = "the server never became healthy" if report.checks else (
        "; ".join(report.errors) or "the run stopped before the server started")
    if report.interrupted:
        why = "interrupted"
    report.checks += [C.not_run(name, why) for name in C.ALL_CHECKS if name not in done]


def print_summary(report: Report, report_path: Path, stream: IO[str] = sys.stderr) -> None:
    if report.parallel:
        stream.write(f"LAYOUT {summary(report.parallel)}\n")
    for check in report.checks:
        mark = "PASS" if check.passed else "FAIL"
        first_line, *rest = check.reason.splitlines() or [""]
        stream.write(f"{mark} {check.name}: {first_line}\n")
        if check.passed or not rest:
            continue
        if len(rest) > SUMMARY_REASON_LINES:
            stream.write(f"  | ... {len(rest) - SUMMARY_REASON_LINES} earlier lines in {report_path}, "
                         f"the whole log in {report_path.parent / LOG_NAME}\n")
            rest = rest[-SUMMARY_REASON_LINES:]
        stream.writelines(f"  | {line}\n" for line in rest)
    for error in report.errors:
        stream.write(f"ERROR {error}\n")
    stream.write(f"{'PASSED' if report.passed else 'FAILED'}: report {report_path}\n")
