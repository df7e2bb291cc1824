"""The one exit-code table of every tool and mode, and the one exception root (after pip's
status_codes.py).

Every command line here (scripts/*.py, the image's entrypoint and its modes, the self-test, the
harnesses of dsa_image.validation, the overlay tool) exits with a code of TABLE, by its name, and
lists in its --help the subset it can return, rendered by `epilog` with what each code means for
that tool: the text cannot drift from the numbers. docs/design.md shows the whole table
(`markdown`; a test holds the two together).

Not ours to number, and so outside the table:
- the image's HEALTHCHECK exits as Docker defines it, 0 healthy and 1 unhealthy (SUCCESS and
  FAILED are those numbers);
- the shell's: 124 (`timeout` cut the command off), 127 (the command could not be run) and 128+N
  (killed by signal N), whether a tool passes on a child's or exits so itself (TIMED_OUT,
  NOT_RUN, killed_by);
- once a mode hands over to another program (`vllm serve`, pytest, the overlay tool inside the
  image), that program's codes; the tool's --help says where.

The exception root: every exception class dsa_image defines derives from DsaImageError, whose
`exit_code` (a class attribute each subclass sets, or an instance's own) is what a tool's main
exits with when it stops on one. The two interrupts (dsa_image.overlay.core.Interrupted,
dsa_image.smoke.run.Interrupted) stay BaseExceptions beside it, like KeyboardInterrupt, so that no
`except Exception` swallows them; they end a tool by its signal (128+N).

Stdlib only, Python 3.11: scripts/test.py imports it before any virtual environment exists, and
the runtime image copies it (the Dockerfile's overlay stage).
"""

from __future__ import annotations

import textwrap
from typing import NamedTuple


class Status(NamedTuple):
    code: int
    name: str
    meaning: str  # one line, for --help and docs/design.md


SUCCESS = 0
FAILED = 1
USAGE = 2
DRIFT = 3
ENVIRONMENT = 4
CONFLICT = 5
REFUSED = 6
NO_GPU = 7
INCOMPLETE = 8
CRASHED = 9

TABLE: tuple[Status, ...] = (
    Status(SUCCESS, "SUCCESS", "done as asked; every check passed"),
    Status(FAILED, "FAILED", "a check ran and found a defect (each one printed)"),
    Status(USAGE, "USAGE", "bad arguments or input: usage, an unknown name, a malformed file"),
    Status(DRIFT, "DRIFT", "what is installed or pinned is not what was expected"),
    Status(ENVIRONMENT, "ENVIRONMENT", "the machine or image lacks something needed: a broken image, a missing "
                                       "tool, a write or a fetch that failed"),
    Status(CONFLICT, "CONFLICT", "a merge left conflicts"),
    Status(REFUSED, "REFUSED", "refused to proceed: an unsafe or unsupported request, or a prerequisite (an "
                               "earlier phase's output) missing"),
    Status(NO_GPU, "NO_GPU", "no usable GPU is visible"),
    Status(INCOMPLETE, "INCOMPLETE", "not every part ran (out of time, or left for a later call); none failed"),
    Status(CRASHED, "CRASHED", "an unexpected exception (a bug, or something broken underneath)"),
)
BY_CODE = {s.code: s for s in TABLE}
NAME_WIDTH = max(len(s.name) for s in TABLE) + 2  # the name column of epilog

# The shell's, outside the table (the module's docstring).
TIMED_OUT = 124
NOT_RUN = 127


def killed_by(signum: int) -> int:
    """The status a shell reports of a process killed by signal `signum`."""
    return 128 + signum


class DsaImageError(Exception):
    """The root of every exception dsa_image defines. `exit_code`: what a tool's main exits with
    when it stops on this error (a subclass sets its own; an instance may set one too)."""

    exit_code: int = FAILED


def name(code: int) -> str:
    return BY_CODE[code].name


def epilog(*codes: int | tuple[int, str], heading: str = "exit codes:", notes: tuple[str, ...] = (),
           width: int = 96) -> str:
    """A tool's exit codes for its --help: each of `codes` (in the order given) with the table's
    meaning, or (code, what it means for this tool); then `notes`, one paragraph each (the
    shell's codes, another program's). Use with argparse.RawDescriptionHelpFormatter."""
    lines = [heading]
    for item in codes:
        code, meaning = item if isinstance(item, tuple) else (item, BY_CODE[item].meaning)
        head = f"  {code:<3}{name(code):<{NAME_WIDTH}}"
        lines += textwrap.wrap(meaning, width=width, initial_indent=head, subsequent_indent=" " * len(head))
    for note in notes:
        lines += textwrap.wrap(note, width=width, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines) + "\n"


def markdown() -> str:
    """The whole table as docs/design.md shows it."""
    rows = ["| code | name | meaning |", "|---|---|---|"]
    rows += [f"| {s.code} | `{s.name}` | {s.meaning} |" for s in TABLE]
    return "\n".join(rows) + "\n"
