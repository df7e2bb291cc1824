"""The committed records' raw files, for the tests that re-derive a record's tables and claims
from its raw data: each record's raw.tar.xz unpacked once per test process (checked against the
sha256 its README cites) into a temporary directory. Parsers' fixtures are not read from here:
they are excerpts in tests/data/ (tests/data/excerpts.toml says which)."""

from __future__ import annotations

import atexit
import fnmatch
import functools
import re
import shutil
import tempfile
from pathlib import Path

from dsa_image.records import store as records
from dsa_image.upstream import run as upstream_run

REPO = Path(__file__).resolve().parent.parent
VALIDATION = REPO / "docs" / "validation"
BENCHMARKS = REPO / "docs" / "benchmarks"


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="dsa-image-records-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def unpacked(record: Path) -> Path:
    """A directory holding `record`'s raw files under their names in its archive."""
    dest = _root() / record.relative_to(REPO)
    records.extract(record, dest)
    return dest


def listed(record: Path, pattern: str = "*") -> list[str]:
    """The raw files `record`'s README lists whose names match `pattern` (no unpacking: for
    parametrising at collection)."""
    claim = records.cited((record / records.README).read_text(), str(record))
    return sorted(m.name for m in claim.members if fnmatch.fnmatchcase(m.name, pattern))


def readme_flat(record: Path) -> str:
    """A record's README with its line breaks and indents folded: prose wraps anywhere."""
    return re.sub(r"\s+", " ", (record / records.README).read_text())


def readme_lines(record: Path) -> list[str]:
    """A record's README lines, indent stripped: its tables may sit inside a numbered list."""
    return [line.strip() for line in (record / records.README).read_text().splitlines()]


# vLLM's ModelConfig on a machine that reaches no Hugging Face, once per test that names a model.
NO_MODEL_CONFIG = re.compile(r"Invalid repository ID or local directory specified: '([^']+)'")


def missing_model_configs(results: Path, side: str, test_file: str) -> list[str]:
    """The Hugging Face models an upstream-gate file's logs on one side found no config for, one
    per failure (results: the gate's upstream-tests directory)."""
    stem = upstream_run.junit_name(test_file).removesuffix(".xml")
    logs = sorted((results / side / "logs").glob(f"{stem}*.log"))
    return [m for log in logs for m in NO_MODEL_CONFIG.findall(log.read_text(errors="replace"))]
