"""Resolve an image tag to its manifest digest through the OCI distribution API.

Stdlib only. Used by `scripts/recipe.py lock`; when the registry cannot be reached the caller
keeps the digest empty and says why: a digest is never invented.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request

from dsa_image.core import status

_ACCEPT = ", ".join([
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
])
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


class RegistryError(status.DsaImageError):
    """The digest could not be resolved (unreachable, unknown tag, odd answer)."""

    exit_code = status.ENVIRONMENT


def split_reference(image: str) -> tuple[str, str, str]:
    """docker.io/library/debian:bookworm-slim -> (registry host, repository, tag)."""
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "latest")
    host, _, repository = name.partition("/")
    if "." not in host and ":" not in host and host != "localhost":
        host, repository = "docker.io", name
    if host == "docker.io" and "/" not in repository:
        repository = f"library/{repository}"
    return host, repository, tag


def _api_host(host: str) -> str:
    return "registry-1.docker.io" if host == "docker.io" else host


def _bearer_token(challenge: str, repository: str, timeout: float) -> str:
    """Anonymous pull token for a `WWW-Authenticate: Bearer realm=...,service=...` challenge."""
    fields = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
    if "realm" not in fields:
        raise RegistryError(f"registry asks for authentication this tool does not speak: {challenge}")
    query = {"scope": f"repository:{repository}:pull"}
    if "service" in fields:
        query["service"] = fields["service"]
    url = f"{fields['realm']}?{urllib.parse.urlencode(query)}"
    with urllib.request.urlopen(url, timeout=timeout) as response:
        answer = json.load(response)
    return answer.get("token") or answer["access_token"]


def _head_manifest(url: str, token: str | None, timeout: float):
    headers = {"Accept": _ACCEPT}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers, method="HEAD"), timeout=timeout)


def resolve_digest(image: str, timeout: float = 15) -> str:
    """The registry's digest (sha256:...) of `image` (a tag reference), for every platform
    (the index digest when the tag is multi-platform)."""
    host, repository, tag = split_reference(image)
    url = f"https://{_api_host(host)}/v2/{repository}/manifests/{tag}"
    try:
        try:
            response = _head_manifest(url, None, timeout)
        except urllib.error.HTTPError as exc:
            if exc.code != 401:
                raise
            token = _bearer_token(exc.headers.get("WWW-Authenticate", ""), repository, timeout)
            response = _head_manifest(url, token, timeout)
        with response:
            digest = response.headers.get("Docker-Content-Digest", "")
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        raise RegistryError(f"cannot reach {url}: {exc}") from exc
    if not _DIGEST.fullmatch(digest):
        raise RegistryError(f"{url} answered without a sha256 Docker-Content-Digest (got {digest!r})")
    return digest
