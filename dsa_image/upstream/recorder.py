"""What each test did, written the moment it finishes: a pytest plugin the runner loads into every
test file's pytest process, so a run killed at its timeout (or by a crash) still says which tests
finished, how, and which one was running. The next run of the file deselects the finished ones:
one file can take as many runs (parts) as its tests need, across calls.

The record is JSON lines appended to one file per test file and side:

  {"collected": [node id, ...]}        each run's whole collection (its shard's), before the
                                       finished tests are deselected
  {"start": node id}                   a test began (its setup)
  {"done": node id, "outcome": "...",  it ended (after its teardown): passed, failed, error, skipped;
   "reason": "..."}                    a failure or error keeps what it raised (`failure_reason`):
                                       pytest prints that only at a run's end, which a killed
                                       part never reaches

Outcomes are junit's, as `compare.junit_outcomes` reads them: a failed setup or teardown is an
error, a failed call is failed (also with a failed teardown), an xfail is skipped.

A file run in shards runs one process a shard; each takes the tests whose node id hashes to it
(`in_shard`: by name, so a test's shard does not depend on the collection's order) and keeps a
record of its own.

This file's text runs as the process's `-c` program (`program()`), so it imports nothing of ours,
and pytest only inside `main`: the tool that reads it runs where no pytest is installed.
"""

from __future__ import annotations

import json
import sys
import zlib

PASSED, FAILED, ERROR, SKIPPED = "passed", "failed", "error", "skipped"
OUTCOMES = (PASSED, FAILED, ERROR, SKIPPED)
REASON_LIMIT = 500  # characters of a failure's reason kept in the record


def outcome_after(current: str | None, when: str, report_outcome: str) -> str | None:
    """A test's outcome so far, after one of its reports (setup, call, teardown)."""
    if report_outcome == "failed":
        if when == "call":
            return FAILED
        return current if current == FAILED else ERROR
    if report_outcome == "skipped" and current is None:
        return SKIPPED
    if report_outcome == "passed" and when == "call" and current is None:
        return PASSED
    return current


def failure_reason(report) -> str:
    """What a failed setup, call or teardown raised: pytest's crash message (the exception and
    its text), else its whole report, as `one_line`."""
    crash = getattr(report.longrepr, "reprcrash", None)
    return one_line(getattr(crash, "message", None) or str(report.longrepr or ""))


def one_line(text: str) -> str:
    """`text` as a reason: one line, printable (a terminal that shows it runs no escape), at most
    REASON_LIMIT characters. A reason read back must be its own one_line, so a cut that ends on
    a space drops it: vLLM 0.24.0's gate wrote such a reason, and its reader refused the record."""
    return "".join(c if c.isprintable() else "?" for c in " ".join(text.split()))[:REASON_LIMIT].rstrip()


def in_shard(nodeid: str, index: int, count: int) -> bool:
    """Whether the test `nodeid` is shard `index`'s (from 0) of `count`."""
    return zlib.crc32(nodeid.encode()) % count == index


class Recorder:
    def __init__(self, record, done: set[str], shard: tuple[int, int] = (0, 1)):
        self.record, self.done, self.shard = record, done, shard
        self.outcomes: dict[str, str | None] = {}
        self.reasons: dict[str, str] = {}  # the first failed report's, per test

    def write(self, doc: dict) -> None:
        self.record.write(json.dumps(doc) + "\n")
        self.record.flush()  # the next line may never come: a kill, a crash

    def pytest_collection_modifyitems(self, config, items):
        mine = [item for item in items if in_shard(item.nodeid, *self.shard)]
        self.write({"collected": [item.nodeid for item in mine]})
        kept = [item for item in mine if item.nodeid not in self.done]
        if len(kept) < len(items):
            ids = {id(item) for item in kept}
            config.hook.pytest_deselected(items=[item for item in items if id(item) not in ids])
            items[:] = kept

    def pytest_runtest_logstart(self, nodeid, location):
        self.write({"start": nodeid})

    def pytest_runtest_logreport(self, report):
        self.outcomes[report.nodeid] = outcome_after(self.outcomes.get(report.nodeid), report.when, report.outcome)
        if report.outcome == "failed" and report.nodeid not in self.reasons:
            self.reasons[report.nodeid] = failure_reason(report)

    def pytest_runtest_logfinish(self, nodeid, location):
        outcome, reason = self.outcomes.pop(nodeid, None) or PASSED, self.reasons.pop(nodeid, "")
        self.write({"done": nodeid, "outcome": outcome, **({"reason": reason} if outcome in (FAILED, ERROR) else {})})


def main(argv: list[str]) -> int:
    """argv: the libs to append to sys.path (JSON), the record to append to, the node ids finished
    in earlier parts (JSON file), the shard ("index/count", "0/1": the whole file), then pytest's
    own arguments."""
    libs, record_path, done_path, shard, *args = argv
    index, count = (int(n) for n in shard.split("/"))
    sys.path.extend(json.loads(libs))
    import pytest

    with open(done_path, encoding="utf-8") as f:
        done = set(json.load(f))
    with open(record_path, "a", encoding="utf-8") as record:
        # Last among the collection hooks: upstream's conftests deselect and reorder first.
        pytest.hookimpl(trylast=True)(Recorder.pytest_collection_modifyitems)
        return int(pytest.main(args, plugins=[Recorder(record, done, (index, count))]))


def program() -> str:
    """This module's text with the call to `main`: the `-c` program of a test file's process."""
    with open(__file__, encoding="utf-8") as f:
        return f.read() + "\nsys.exit(main(sys.argv[1:]))\n"
