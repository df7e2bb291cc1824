"""Fetch wheels (and the vLLM sdists, for upstream's tests) from PyPI into a local cache,
verified by sha256 on every use.

Stdlib only. PyPI's JSON API (/pypi/<name>/json) is not used: the PEP 691 simple index is
the interface pip and uv use, and the one every mirror serves.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dsa_image.core import status

PYPI_SIMPLE = "https://pypi.org/simple"
_SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
_CHUNK = 1 << 20


class WheelError(status.DsaImageError):
    """A wheel could not be found, fetched or verified. The message says what to do."""

    exit_code = status.ENVIRONMENT


@dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    sha256: str


def cache_dir() -> Path:
    """Where downloaded artefacts live: $DSA_IMAGE_CACHE, default ~/.cache/dsa-image."""
    return Path(os.environ.get("DSA_IMAGE_CACHE") or Path.home() / ".cache" / "dsa-image")


def wheel_cache_path(filename: str) -> Path:
    """Where a downloaded wheel (cache/wheels/) or sdist (cache/sdists/) is kept."""
    return cache_dir() / ("wheels" if filename.endswith(".whl") else "sdists") / filename


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def project_of(filename: str) -> str:
    """The normalized project name of a wheel (PEP 427) or sdist (PEP 625: name-version.tar.gz)
    filename (PEP 503)."""
    if filename.endswith(".tar.gz") and filename.count("-") == 1:
        name = filename.split("-", 1)[0]
    elif filename.endswith(".whl") and filename.count("-") >= 4:
        name = filename.split("-", 1)[0]
    else:
        raise WheelError(f"{filename}: not a wheel (name-version-python-abi-platform.whl) or sdist "
                         "(name-version.tar.gz) filename")
    return name.lower().replace("_", "-").replace(".", "-")


# Pauses before the second and third attempt at an index page: a resolver or connection hiccup
# (CI met "Temporary failure in name resolution" once in ~100 pages) is not a verdict on a lock.
INDEX_RETRY_PAUSES_S = (2.0, 5.0)


def _transient(exc: Exception) -> bool:
    """Worth another attempt: no answer at all, or the index's own 429/5xx; not a 404 or bad JSON."""
    if isinstance(exc, urllib.error.HTTPError):
        return exc.code == 429 or exc.code >= 500
    return isinstance(exc, (urllib.error.URLError, OSError))


def index_files(project: str, index_url: str = PYPI_SIMPLE, timeout: float = 60,
                pauses_s: tuple[float, ...] = INDEX_RETRY_PAUSES_S) -> list[IndexFile]:
    """The files the PEP 691 simple index lists for `project`, with their sha256."""
    url = f"{index_url.rstrip('/')}/{project}/"
    request = urllib.request.Request(url, headers={"Accept": _SIMPLE_JSON})
    for attempt, pause in enumerate((*pauses_s, None), start=1):
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                page = json.load(response)
            break
        except (urllib.error.URLError, OSError, ValueError) as exc:
            if pause is None or not _transient(exc):
                tries = f" (after {attempt} attempts)" if attempt > 1 else ""
                raise WheelError(f"cannot read the package index {url}{tries}: {exc}") from exc
            time.sleep(pause)
    files = []
    for entry in page.get("files", []):
        sha = entry.get("hashes", {}).get("sha256")
        if sha:
            files.append(IndexFile(entry["filename"], urllib.parse.urljoin(url, entry["url"]), sha))
    return files


def index_file(filename: str, index_url: str = PYPI_SIMPLE) -> IndexFile:
    for entry in index_files(project_of(filename), index_url):
        if entry.filename == filename:
            return entry
    raise WheelError(f"{filename}: not listed by {index_url}/{project_of(filename)}/")


def _download(entry: IndexFile, dest: Path, timeout: float = 120) -> str:
    """Stream `entry` into `dest` (atomically: temp file, then rename); returns its sha256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(entry.url, timeout=timeout) as response:
            while chunk := response.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != entry.sha256:
            raise WheelError(
                f"{entry.filename}: downloaded file has sha256 {digest.hexdigest()}, the index says "
                f"{entry.sha256}. Nothing was cached; retry, or check the network path."
            )
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; the cache is shared like pip's
        os.replace(tmp, dest)
    except (urllib.error.URLError, OSError) as exc:
        raise WheelError(f"{entry.filename}: download from {entry.url} failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return digest.hexdigest()


def ensure_wheel(filename: str, sha256: str, index_url: str = PYPI_SIMPLE) -> Path:
    """Path of the cached wheel (or sdist) `filename`, downloading it when absent; its sha256
    must equal `sha256` (the recipe's pin), checked on every call."""
    if not sha256:
        raise WheelError(
            f"{filename}: the recipe has no sha256 for it yet; run `python3 scripts/recipe.py lock --vllm VERSION` "
            "for its vLLM release"
        )
    path = wheel_cache_path(filename)
    if not path.exists():
        entry = index_file(filename, index_url)
        if entry.sha256 != sha256:
            raise WheelError(
                f"{filename}: the recipe pins sha256 {sha256}, the index lists {entry.sha256}. "
                "Nothing was downloaded; re-run `python3 scripts/recipe.py lock --vllm VERSION` if the pin is stale."
            )
        _download(entry, path)
    found = sha256_file(path)
    if found != sha256:
        raise WheelError(
            f"{path}: cached file has sha256 {found}, the recipe pins {sha256}. "
            "Delete the cached file to download it again."
        )
    return path


def lock_wheel(filename: str, index_url: str = PYPI_SIMPLE) -> tuple[Path, str]:
    """Fetch (or reuse the cached) `filename` and return its path and sha256, computed from the
    file and required to equal the index's sha256. The only source of wheel pins."""
    entry = index_file(filename, index_url)
    path = wheel_cache_path(filename)
    if path.exists():
        found = sha256_file(path)
        if found != entry.sha256:
            raise WheelError(
                f"{path}: cached file has sha256 {found}, the index lists {entry.sha256}. "
                "Delete the cached file to download it again."
            )
        return path, found
    return path, _download(entry, path)


def read_member(wheel: Path, member: str) -> bytes | None:
    """Bytes of `member` (a path like vllm/envs.py) inside the wheel, or None when absent."""
    with zipfile.ZipFile(wheel) as archive:
        try:
            return archive.read(member)
        except KeyError:
            return None


# --- which release a distribution file belongs to: what `check --online` compares locks with ---

_SDIST_SUFFIXES = (".tar.gz", ".zip", ".tar.bz2", ".tar.xz", ".tgz", ".tar")
_RELEASE = re.compile(r"v?([0-9]+(?:\.[0-9]+)*)(.*)")


def distribution_version(filename: str) -> str | None:
    """The version in a wheel (name-version[-build]-python-abi-platform.whl) or sdist
    (name-version.tar.gz, .zip) filename; None for other kinds (eggs, installers)."""
    if filename.endswith(".whl"):
        parts = filename[:-4].split("-")
        return parts[1] if len(parts) in (5, 6) else None
    for suffix in _SDIST_SUFFIXES:
        if filename.endswith(suffix):
            _, dash, version = filename[: -len(suffix)].rpartition("-")
            return version if dash and version else None
    return None


def canonical_version(version: str) -> str:
    """Enough of PEP 440 normalization to compare a lock's version with a filename's:
    case, a leading v, leading zeros and trailing .0 of the release (1.0 == 1.0.0 == 1)."""
    match = _RELEASE.fullmatch(version.strip().lower())
    if not match:
        return version.strip().lower()
    release = [int(part) for part in match.group(1).split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    return ".".join(map(str, release)) + match.group(2)


def release_files(files: list[IndexFile], version: str) -> list[IndexFile]:
    """The files of `files` (one project's index listing) that belong to release `version`."""
    wanted = canonical_version(version)
    return [f for f in files
            if (found := distribution_version(f.filename)) is not None and canonical_version(found) == wanted]
