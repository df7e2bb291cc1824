"""The one wait for vLLM servers to become healthy: the image's warm-up (runtime/warmup.py) and
the harnesses' (the shared lifecycle, recipes, the cluster waves, smoke). Each server is watched
through callables, so one loop serves the image's own server, a process this host started, a
container, or a fake in a test. Stdlib only: the runtime image carries it.

All servers are polled in each round: waiting for one at a time would record the later ones as
healthy when the first was, not when they were."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable


def _always_ready() -> str | None:
    return None


def _never_settled() -> str | None:
    return None


@dataclass
class Watch:
    """One server to wait for. Its seconds count from `started`, a reading of the wait's clock."""

    name: str
    answers: Callable[[], bool]  # GET /health answers 200 (and the answer is this server's)
    exit_code: Callable[[], int | None]  # None while its process runs
    started: float
    # After /health: None once it takes traffic, else why not (smoke: the image's warm-up marker).
    ready: Callable[[], str | None] = _always_ready
    # A reason it will never be healthy, ending its wait early (the cluster's controls).
    settled: Callable[[], str | None] = _never_settled


@dataclass
class Outcome:
    """How the wait for one server ended: healthy, exited, settled, or none of these (late)."""

    answered_s: float | None = None  # /health first answered
    healthy_s: float | None = None  # /health answered and the server was ready
    exit_code: int | None = None  # it exited before it was healthy
    settled: str | None = None  # Watch.settled's reason
    not_ready: str | None = None  # Watch.ready's last answer, while it was not ready
    ended_s: float | None = None  # when the wait for it ended

    @property
    def done(self) -> bool:
        return self.healthy_s is not None or self.exit_code is not None or self.settled is not None

    @property
    def failed(self) -> bool:
        return self.exit_code is not None or self.settled is not None


def _poll(watch: Watch, outcome: Outcome, now: Callable[[], float]) -> None:
    """One look at one server. Its process first: an answer counts only while it runs (another
    server on the port would answer for one that died)."""
    code = watch.exit_code()
    if code is not None:
        outcome.exit_code, outcome.ended_s = code, now() - watch.started
        return
    answered_now = outcome.answered_s is None and watch.answers()
    if answered_now:
        outcome.answered_s = now() - watch.started
    if outcome.answered_s is not None:
        outcome.not_ready = watch.ready()
        if outcome.not_ready is None:
            # One clock reading when it is ready at its first answer: the same moment.
            outcome.healthy_s = outcome.answered_s if answered_now else now() - watch.started
            outcome.ended_s = outcome.healthy_s
            return
    outcome.settled = watch.settled()


def wait(watches: list[Watch], deadline: float, poll_s: float = 1.0, *, first_failure_ends: bool = False,
         clock: Callable[[], float] | None = None,
         sleep: Callable[[float], None] | None = None) -> dict[str, Outcome]:
    """Poll every server not yet done, each `poll_s`, until all are healthy or failed, or `clock`
    passes `deadline` (after at least one round). `first_failure_ends`: stop at the first server
    that exits or is settled (a harness that needs them all). Clock and sleep are looked up at
    call time, so that a test's patched time module is the one used."""
    now = clock or time.monotonic
    outcomes = {w.name: Outcome() for w in watches}
    while True:
        for watch in (w for w in watches if not outcomes[w.name].done):
            _poll(watch, outcomes[watch.name], now)
            if first_failure_ends and outcomes[watch.name].failed:
                return outcomes
        if all(o.done for o in outcomes.values()) or now() > deadline:
            break
        (sleep or time.sleep)(poll_s)
    for watch in watches:
        if not outcomes[watch.name].done:
            outcomes[watch.name].ended_s = now() - watch.started
    return outcomes
