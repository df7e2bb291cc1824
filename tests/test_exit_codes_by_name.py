"""Every command line exits with a code of dsa_image/core/status.py's table by its name: no
function of dsa_image/ or scripts/ whose result is an exit status (a `main`, what it hands its
result to, what goes to sys.exit) returns an integer literal other than 0, and nothing passes one
to sys.exit(), os._exit(), exit() or SystemExit(). Nothing is allowed: the image's HEALTHCHECK,
whose 1 is Docker's "unhealthy", says status.FAILED too (the status module's docstring says why
that is the same number). Functions that return other numbers (a count, a sentinel) are not exit
functions and are not looked at."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
EXIT_CALLS = {"exit", "_exit"}  # sys.exit, os._exit, the builtin exit


def _literals(node: ast.AST | None) -> list[int]:
    """The nonzero integer literals `node` can evaluate to as is: a literal itself, a negated one,
    either branch of a conditional expression, an operand of `and`/`or`."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return [node.value] if node.value != 0 else []
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        return [-v if isinstance(node.op, ast.USub) else v for v in _literals(node.operand)]
    if isinstance(node, ast.IfExp):
        return _literals(node.body) + _literals(node.orelse)
    if isinstance(node, ast.BoolOp):
        return [v for value in node.values for v in _literals(value)]
    return []


def _is_exit(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in EXIT_CALLS or func.id == "SystemExit"
    return isinstance(func, ast.Attribute) and func.attr in EXIT_CALLS


def _is_exit_call(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and _is_exit(node.func) and bool(node.args)


def exit_functions(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """The module's functions whose result is a command line's exit status: `main`, any the
    module passes to sys.exit() or SystemExit, and, transitively, any an exit function names in
    what it returns or exits with (`return run(args)`, `return {"plan": plan_call}[cmd](args)`)."""
    defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}

    def named(expr: ast.AST | None) -> set[str]:
        return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name) and n.id in defs} if expr else set()

    exits = {"main"} & defs.keys()
    exits |= {name for node in ast.walk(tree) if _is_exit_call(node) for name in named(node.args[0])}
    todo = list(exits)
    while todo:
        for node in ast.walk(defs[todo.pop()]):
            values = [node.value] if isinstance(node, ast.Return) else node.args[:1] if _is_exit_call(node) else []
            for name in {n for value in values for n in named(value)} - exits:
                exits.add(name)
                todo.append(name)
    return {name: defs[name] for name in exits}


def offences(source: str, filename: str) -> list[str]:
    """`filename`'s exits with a nonzero integer literal: a return of an exit function, and a
    sys.exit()/os._exit()/exit()/SystemExit() anywhere in the module."""
    found = []
    tree = ast.parse(source, filename=filename)
    for func in exit_functions(tree).values():
        for node in ast.walk(func):
            if isinstance(node, ast.Return):
                found += [(node.lineno, value) for value in _literals(node.value)]
    for node in ast.walk(tree):
        if _is_exit_call(node):
            found += [(node.lineno, value) for value in _literals(node.args[0])]  # type: ignore[attr-defined]
    return [f"{filename}:{line}: {value}" for line, value in sorted(set(found))]


def sources() -> list[Path]:
    return sorted([*(REPO_ROOT / "dsa_image").rglob("*.py"), *(REPO_ROOT / "scripts").glob("*.py")])


def test_no_integer_literal_exits() -> None:
    found = [hit for path in sources()
             for hit in offences(path.read_text(encoding="utf-8"), str(path.relative_to(REPO_ROOT)))]
    assert not found, ("exit with a code of dsa_image/core/status.py by its name, not a number:\n"
                       + "\n".join(found))


def test_the_check_sees_each_form() -> None:
    source = '''
import sys, os
def main(argv):
    if argv:
        return 2
    return {"a": a, "b": b}[argv[0]](argv) if argv else run(argv)
def a(argv):
    return 1 if argv else 0
def b(argv):
    return _check(argv)
def _check(argv):
    return -1
def run(argv):
    return status.FAILED
def count(things):
    return 2 if things else 1
def c():
    sys.exit(3)
def d():
    raise SystemExit(4)
def e():
    os._exit(5)
def f():
    exit(0)
if __name__ == "__main__":
    sys.exit(6)
'''
    assert [hit.split(": ", 1)[1] for hit in offences(source, "x.py")] == ["2", "1", "-1", "3", "4", "5", "6"]
