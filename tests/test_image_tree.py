"""The house's shape: the runtime image carries exactly the code it runs, each package imports
only the packages of the layers before it (LAYERS; docs/design.md), so none in a cycle, and no
module grows past what one reader holds (MAX_MODULE_LINES).

The image's `overlay` and `runtime-code` stages (Dockerfile) copy dsa_image/ file by file or
package by package; the code they run is the overlay tool's script (`overlay`) and
dsa_image/runtime/ (entrypoint, healthcheck, warm-up, self-test). What those import, at module
level or inside a function, directly or not, is the closure; the stages must copy that and
nothing else, `overlay` only its script's part."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "dsa_image"
MAX_MODULE_LINES = 700


def module_file(name: str) -> Path | None:
    path = REPO.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def imported_names(path: Path) -> set[str]:
    """Every dsa_image module name `path` imports anywhere in its body (relative ones resolved)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return {n for n in names if n == "dsa_image" or n.startswith("dsa_image.")}


def imported_files(path: Path) -> set[Path]:
    """The files of the modules `path` imports, with each package's __init__.py on the way."""
    files = set()
    for name in imported_names(path):
        parts = name.split(".")
        files.update(f for i in range(1, len(parts) + 1) if (f := module_file(".".join(parts[:i]))))
    return files


def closure(roots: set[Path]) -> set[Path]:
    seen, todo = set(), list(roots)
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo.extend(imported_files(path) - seen)
    return seen


def stage(name: str) -> str:
    """The Dockerfile's stage NAME, from its FROM line to the next stage's (or the file's end)."""
    text = (REPO / "Dockerfile").read_text()
    found = re.search(rf"^FROM \S+ AS {re.escape(name)}$", text, re.M)
    assert found, f"the Dockerfile has no stage {name!r}"
    return text[found.start():].split("\nFROM ", 1)[0]


def joined_lines(dockerfile: str) -> list[str]:
    """The Dockerfile text's instructions one per line: a `\\` continuation joins the next line,
    so a COPY or RUN's sources spread over several lines are read as the one instruction."""
    return re.sub(r"\\\n\s*", " ", dockerfile).splitlines()


def copied(stage: str) -> tuple[set[Path], set[Path]]:
    """The dsa_image files and the scripts the stage's COPY instructions take from the context."""
    files, scripts = set(), set()
    for line in joined_lines(stage):
        words = line.split()
        if not words or words[0] != "COPY" or any(w.startswith("--from") for w in words):
            continue
        for source in words[1:-1]:
            path = REPO / source.rstrip("/")
            if source.startswith("dsa_image"):
                files.update(path.rglob("*.py") if path.is_dir() else {path})
            elif source.startswith("scripts/"):
                scripts.add(path)
    return {f for f in files if "__pycache__" not in f.parts}, scripts


def test_the_runtime_image_copies_exactly_what_its_code_imports():
    (apply_files, scripts), (runtime_files, more_scripts) = copied(stage("overlay")), copied(stage("runtime-code"))
    assert scripts == {REPO / "scripts" / "overlay.py"} and not more_scripts
    files = apply_files | runtime_files
    roots = set((PACKAGE / "runtime").glob("*.py")) | scripts
    needed = closure(roots) - scripts
    missing = sorted(str(p.relative_to(REPO)) for p in needed - files)
    extra = sorted(str(p.relative_to(REPO)) for p in files - needed)
    assert not missing, f"the overlay stage misses modules the runtime imports: {missing}"
    assert not extra, f"the overlay stage copies modules the runtime never imports: {extra}"
    for concern in ("bench", "smoke", "validation", "upstream", "records"):
        assert not any((PACKAGE / concern) in f.parents for f in files), concern


def test_the_overlay_stage_copies_only_what_apply_imports_so_runtime_edits_leave_the_gate_cached():
    """The gate's overlay side (upstream-overlay) runs FROM `overlay`: what that stage copies is
    its cache key, so it holds the overlay tool alone (scripts/overlay.py's closure) and the
    runtime's own code comes after it, in `runtime-code`, which the gate does not build on."""
    files, scripts = copied(stage("overlay"))
    needed = closure(scripts) - scripts
    assert files == needed, (f"copies {sorted(str(f.relative_to(REPO)) for f in files - needed)} apply does not "
                             f"import, misses {sorted(str(f.relative_to(REPO)) for f in needed - files)}")
    assert stage("upstream-overlay").startswith("FROM overlay AS upstream-overlay\n")
    assert not any((PACKAGE / "runtime") in f.parents for f in files)


def test_the_closure_follows_imports_inside_functions_too(tmp_path):
    # the runtime's lazy imports (the entrypoint's recipe mode) are part of what it runs
    entrypoint = PACKAGE / "runtime" / "entrypoint.py"
    assert PACKAGE / "serving" / "cli.py" in imported_files(entrypoint)


# The packages in the order they may import each other: each only those before it.
LAYERS = ("core", "serving", "runtime", "overlay", "rebase", "build", "harness", "smoke", "bench", "upstream",
          "validation", "records")


def package_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else "dsa_image"


def package_imports() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for target in imported_files(path):
            a, b = package_of(path), package_of(target)
            if a != b and b != "dsa_image":
                edges.setdefault(a, set()).add(b)
    return edges


def test_every_package_has_its_layer():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(LAYERS)


def test_a_package_imports_only_the_packages_before_it():
    wrong = sorted(f"{a} imports {b}" for a, targets in package_imports().items() for b in targets
                   if LAYERS.index(b) >= LAYERS.index(a))
    assert not wrong, f"imports against the layers {LAYERS}: {wrong} (a cycle, or a layer to move)"


def test_no_module_is_longer_than_one_reader_holds():
    long = {str(p.relative_to(REPO)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them at a seam): {long}"


def tool_mounts() -> list[tuple[set[Path], set[Path]]]:
    """Each Dockerfile RUN that bind-mounts our code from the build context: (the dsa_image files
    it mounts, the scripts it mounts). A mounted folder counts as all of its modules."""
    steps = []
    for line in joined_lines((REPO / "Dockerfile").read_text()):
        sources = re.findall(r"--mount=type=bind,source=((?:dsa_image|scripts)[^,\s]*)", line)
        if line.startswith("RUN") and sources:
            paths = [REPO / source for source in sources]
            files = {f for p in paths if "dsa_image" in p.parts
                     for f in (p.rglob("*.py") if p.is_dir() else {p}) if "__pycache__" not in f.parts}
            steps.append((files, {p for p in paths if p.suffix == ".py" and "scripts" in p.parts}))
    return steps


def test_a_build_step_mounts_exactly_the_code_its_script_imports():
    """A bind mount is part of its step's cache key: a step that mounted all of dsa_image/core
    re-ran its pip install (and, under QEMU, the arm64 image's) for any new module there."""
    steps = [(files, scripts) for files, scripts in tool_mounts() if scripts]
    assert len(steps) >= 2, "expected the extras step's pip_check and the arch check"
    for files, scripts in steps:
        needed = closure(scripts) - scripts
        assert files == needed, (f"{sorted(s.name for s in scripts)}: mounts {sorted(str(f.relative_to(REPO)) for f in files - needed)} "
                                 f"it does not import, misses {sorted(str(f.relative_to(REPO)) for f in needed - files)}")
