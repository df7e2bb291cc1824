"""The Version of a distribution installed in a site-packages directory, read from its
dist-info METADATA; nothing is imported. Stdlib only: the image's bare build stages use it."""

from __future__ import annotations

import email.parser
from pathlib import Path


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
