"""The one exit-code table and the one exception root (dsa_image/core/status.py).

* The table: codes 0..9, each once, its names the module's constants; docs/design.md shows
  exactly `status.markdown()`; `epilog` renders a tool's subset with the table's names.
* The root: every exception class dsa_image defines derives from DsaImageError, read from the
  source (an import would need torch and vLLM for some modules); only the two interrupts stay
  BaseExceptions, on purpose.
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

from dsa_image.core import status

REPO = Path(__file__).resolve().parent.parent
BUILTIN_EXCEPTIONS = {name for name, value in vars(builtins).items()
                      if isinstance(value, type) and issubclass(value, BaseException)}
# Outside the root on purpose: like KeyboardInterrupt, no `except Exception` may swallow them.
INTERRUPTS = {("dsa_image/overlay/core.py", "Interrupted"), ("dsa_image/smoke/run.py", "Interrupted")}


def test_the_table_numbers_each_code_once_by_its_constant():
    assert [s.code for s in status.TABLE] == list(range(10))
    for row in status.TABLE:
        assert getattr(status, row.name) == row.code, row
        assert row.meaning and "\n" not in row.meaning
    assert (status.TIMED_OUT, status.NOT_RUN, status.killed_by(15)) == (124, 127, 143)


def test_design_doc_shows_the_table_as_the_code_renders_it():
    assert status.markdown() in (REPO / "docs" / "design.md").read_text()


def test_epilog_lists_a_tools_codes_with_their_names_in_its_order():
    text = status.epilog(status.NO_GPU, (status.SUCCESS, "all fine here"), notes=("124: timed out",))
    lines = text.splitlines()
    assert lines[0] == "exit codes:"
    assert lines[1].split()[:2] == ["7", "NO_GPU"] and "no usable GPU" in lines[1]
    assert lines[2].split() == ["0", "SUCCESS", "all", "fine", "here"]
    assert lines[-1].strip() == "124: timed out"


def exception_classes() -> dict[str, list[tuple[str, list[str]]]]:
    """Every class dsa_image defines: name -> [(file, its bases' last names)]."""
    classes: dict[str, list[tuple[str, list[str]]]] = {}
    for path in sorted((REPO / "dsa_image").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
                classes.setdefault(node.name, []).append((str(path.relative_to(REPO)), bases))
    return classes


def _derives(name: str, classes, roots: set[str], seen: frozenset = frozenset()) -> bool:
    if name in roots:
        return True
    if name in seen or name not in classes:
        return False
    return any(_derives(b, classes, roots, seen | {name}) for _, bases in classes[name] for b in bases)


def unrooted(classes) -> list[str]:
    exceptions = BUILTIN_EXCEPTIONS | {"HTTPException"}
    found = []
    for name, defs in classes.items():
        for path, bases in defs:
            is_exception = any(_derives(b, classes, exceptions) for b in bases)
            rooted = name == "DsaImageError" or any(_derives(b, classes, {"DsaImageError"}) for b in bases)
            if is_exception and not rooted and (path, name) not in INTERRUPTS:
                found.append(f"{path}: {name}({', '.join(bases)})")
    return found


def test_every_exception_class_derives_from_the_root():
    classes = exception_classes()
    assert sum(len(d) for d in classes.values()) > 50  # the scan read the package
    assert unrooted(classes) == []


def test_the_root_check_finds_a_class_outside_the_root():
    classes = {"Good": [("a.py", ["DsaImageError"])], "Bad": [("b.py", ["ValueError"])],
               "Worse": [("c.py", ["Bad"])], "Plain": [("d.py", ["object"])]}
    assert unrooted(classes) == ["b.py: Bad(ValueError)", "c.py: Worse(Bad)"]
