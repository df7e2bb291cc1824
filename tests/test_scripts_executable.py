"""Every file of the repository that starts with a shebang can be run as `./path`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Not the repository's own files: environments, caches, build outputs, git's data.
SKIP_DIRS = {".git", ".venv", "build", "__pycache__", ".pytest_cache", ".hypothesis", ".cache", ".whl", ".stage"}


def repository_files() -> list[Path]:
    """Tracked and new (not ignored) files; a walk without the skipped directories where git
    cannot answer (a copy of the tree without .git)."""
    done = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          cwd=REPO_ROOT, capture_output=True)
    if done.returncode == 0:
        return [REPO_ROOT / name for name in done.stdout.decode().split("\0") if name]
    found = []
    for directory, subdirs, names in os.walk(REPO_ROOT):
        subdirs[:] = [d for d in subdirs if d not in SKIP_DIRS]
        found += [Path(directory) / name for name in names]
    return found


def has_shebang(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            return handle.read(2) == b"#!"
    except (IsADirectoryError, FileNotFoundError):  # a submodule, or deleted but still tracked
        return False


def test_the_repository_has_scripts_with_a_shebang():
    assert any(has_shebang(p) for p in repository_files()), "no file with a shebang found: the walk is broken"


def test_every_file_with_a_shebang_is_executable():
    not_executable = sorted(str(p.relative_to(REPO_ROOT)) for p in repository_files()
                            if has_shebang(p) and not os.access(p, os.X_OK))
    assert not_executable == [], f"chmod +x {' '.join(not_executable)}"
