"""`pip check`, less exactly the conflicts the recipe overrides on purpose.

The sm120 image installs b12x, which declares torch>=2.12.0, over vLLM 0.24.0's torch==2.11.0:
the recipe records that as `[b12x] torch_override = "torch==2.11.0"` (docs/decisions.md). A
plain `pip check` must fail there; this one accepts that one line, for that package and that
installed version, and fails on anything else. Stdlib only (runs in a build stage).
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass

from dsa_image.core.recipe import Target

_CONFLICT = re.compile(r"^(?P<package>\S+) (?P<version>\S+) has requirement (?P<requirement>.+), "
                       r"but you have (?P<have_name>\S+) (?P<have_version>\S+)\.$")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Conflict:
    package: str
    requirement: str
    installed: str  # name==version

    def __str__(self) -> str:
        return f"{self.package} requires {self.requirement}, installed {self.installed}"


def parse_conflicts(output: str) -> tuple[list[Conflict], list[str]]:
    """pip check's "has requirement" lines, and every other line (missing packages ...)."""
    conflicts, other = [], []
    for line in output.splitlines():
        if not line.strip() or line.strip() == "No broken requirements found.":
            continue
        match = _CONFLICT.match(line.strip())
        if match:
            conflicts.append(Conflict(_normal(match["package"]), match["requirement"],
                                      f"{_normal(match['have_name'])}=={match['have_version']}"))
        else:
            other.append(line.strip())
    return conflicts, other


def allowed(conflict: Conflict, target: Target) -> bool:
    """The conflict is one the target's recipe overrides: its extra pinned the installed version."""
    return any(_normal(extra.name) == conflict.package and
               any(_normal(o.split("==")[0]) + "==" + o.split("==")[1] == conflict.installed for o in extra.overrides)
               for extra in target.extras)


def problems(output: str, target: Target) -> list[str]:
    conflicts, other = parse_conflicts(output)
    return other + [str(c) for c in conflicts if not allowed(c, target)]


def run_pip_check(python: str = sys.executable) -> str:
    done = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True)
    return done.stdout + done.stderr
