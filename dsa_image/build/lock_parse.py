"""Reading a requirements lock back: what `uv pip compile --generate-hashes` wrote, as pins.

The readers here know nothing of recipes: `parse_lock` (name -> version and hashes),
`parse_via` and `requirements_of` (who requires whom, from uv's `# via` comments), the name
normalization every comparison of names goes through, and the lines uv writes (the strict
patterns that `dsa_image.build.lock` rewrites a lock with and `dsa_image.build.lock_check`
holds a committed lock to).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsa_image.core import status


class LockError(status.DsaImageError):
    """Writing or reading a lock failed: the resolver, a download, or a pin without a hash;
    the message carries what it said."""

    exit_code = status.ENVIRONMENT


_REQUIREMENT_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)(\s*;.*?)?\s*\\?$")
_HASH_LINE = re.compile(r"^\s+--hash=sha256:([0-9a-f]{64})")


@dataclass(frozen=True)
class Pin:
    version: str
    hashes: frozenset[str]


def parse_lock(text: str) -> dict[str, Pin]:
    """{normalized name: Pin} of a `uv pip compile --generate-hashes` output."""
    pins: dict[str, Pin] = {}
    name = version = None
    hashes: set[str] = set()

    def flush() -> None:
        if name is not None:
            if not hashes:
                raise LockError(f"{name}=={version}: no --hash in the lock")
            pins[name] = Pin(version, frozenset(hashes))

    for line in text.splitlines():
        requirement = _REQUIREMENT_LINE.match(line)
        digest = _HASH_LINE.match(line)
        if requirement:
            flush()
            name, version, hashes = normalize(requirement.group(1)), requirement.group(2), set()
        elif digest and name is not None:
            hashes.add(digest.group(1))
    flush()
    return pins


_VIA_ONE = re.compile(r"^\s+# via (\S.*)$")
_VIA_OPEN = re.compile(r"^\s+# via\s*$")
_VIA_MORE = re.compile(r"^\s+#   (\S.*)$")


def parse_via(text: str) -> dict[str, frozenset[str]]:
    """{normalized name: the normalized names that require it} from the `# via` comments uv
    writes under each pin (`# via a`, or `# via` then one `#   a` per line). Requirement files
    (`-r ...`, `-c ...`) are not packages and are left out."""
    via: dict[str, set[str]] = {}
    name = None
    listing = False
    for line in text.splitlines():
        requirement = _REQUIREMENT_LINE.match(line)
        if requirement:
            name, listing = normalize(requirement.group(1)), False
            via[name] = set()
            continue
        one, more = _VIA_ONE.match(line), _VIA_MORE.match(line)
        if name is None:
            continue
        if _VIA_OPEN.match(line):
            listing = True
        elif (found := one or (more if listing else None)) is not None:
            parent = found.group(1).strip()
            if not parent.startswith("-"):
                via[name].add(normalize(parent))
    return {n: frozenset(parents) for n, parents in via.items()}


def requirements_of(via: dict[str, frozenset[str]], root: str) -> set[str]:
    """Every pin that `root` requires, directly or through other pins (not `root` itself)."""
    found: set[str] = set()
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for name, parents in via.items():
            if parent in parents and name not in found and name != root:
                found.add(name)
                frontier.append(name)
    return found


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def split_pin(pin: str) -> tuple[str, str]:
    name, _, version = pin.partition("==")
    return normalize(name), version


# The only lines `uv pip compile --generate-hashes` writes; `lock_check.scan_lock` refuses any other, since
# pip would read it (an inline --hash, an index option, a sha512 hash) and no rule here would.
LOCK_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)(\s+;[^\\]*?)?(\s+\\)?$")
LOCK_HASH = re.compile(r"^\s+--hash=sha256:([0-9a-f]{64})(\s+\\)?$")
LOCK_COMMENT = re.compile(r"^\s*(#.*)?$")


def has_option(line: str) -> bool:
    """pip reads every whitespace-separated token from the first one starting with '-' as
    options of the requirement (--hash=..., --index-url ...)."""
    return any(token.startswith("-") for token in line.split()[1:])
