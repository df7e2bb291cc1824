"""The Version of a distribution installed in a site-packages directory, read from its
dist-info METADATA; nothing is imported. Stdlib only: the image's bare build stages use it."""

from __future__ import annotations

import email.parser
from pathlib import Path

from dsa_image.core import status


class DistInfoError(status.DsaImageError, RuntimeError):  # a RuntimeError: the validation harnesses refuse a base with one
    """A site-packages directory without exactly one install (with a Version) of a distribution."""

    exit_code = status.USAGE


def installed_versions(site: Path, name: str) -> list[str]:
    """The Version of every dist-info of `name` in `site` (one where a single install is there;
    "" for a METADATA without a Version)."""
    found = []
    for info in sorted(site.glob("*.dist-info")):
        metadata = info / "METADATA"
        if info.name.lower().startswith(f"{name}-") and metadata.is_file():
            headers = email.parser.HeaderParser().parsestr(metadata.read_text(errors="replace"))
            if (headers.get("Name") or "").lower() == name:
                found.append(headers.get("Version") or "")
    return found


def installed_vllm_version(site: Path) -> str:
    """The Version of the one vLLM install in `site`; raises DistInfoError unless there is
    exactly one with a Version."""
    found = installed_versions(site, "vllm")
    if len(found) == 1 and found[0]:
        return found[0]
    what = f"{len(found)} ({', '.join(v or 'no Version' for v in found)})" if found else "none"
    raise DistInfoError(f"{site}: expected one vllm-*.dist-info/METADATA with a Version, found {what}; "
                        "point at the site-packages of one vLLM install, or reinstall vLLM there with pip")
