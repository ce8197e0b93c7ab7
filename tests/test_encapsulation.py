"""Each module keeps to its own private names, and stays small.

Two promises of the architecture (issue 13): no module reads or writes a private attribute
(``obj._name``) that it does not define itself — collaborators get non-underscore methods —
and no module of the package grows past :data:`MAX_LINES` lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "anyio_genout"

#: Private names of the standard library and of named tuples that modules may use.
FOREIGN_PRIVATE = frozenset({"_SubParsersAction", "_getframe", "_exit", "_asdict", "_replace",
                             "_fields", "_make", "_field_defaults"})

#: The size a module may reach (the design aims at about 450).
MAX_LINES = 460


def _defined_private(tree: ast.AST) -> set[str]:
    """Underscore names a module defines: its functions, classes, module and class names,
    ``self._x`` / ``cls._x`` attributes and ``__slots__``/string entries."""
    names: set[str] = set()
    named = {id(node) for node in _named_attributes(tree)}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in named:
            names.add(node.value)
    return {name for name in names if name.startswith("_")}


#: Builtins that take an attribute's name as a string.
_BY_NAME = frozenset({"getattr", "setattr", "delattr", "hasattr"})


def _named_attributes(tree: ast.AST) -> list[ast.Constant]:
    """The string constants naming an attribute in ``getattr(obj, "name", ...)`` and its
    kin: an access by name, which the check treats as ``obj.name``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in _BY_NAME and len(node.args) >= 2 \
                and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            found.append(node.args[1])
    return found


def foreign_private_uses(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every ``obj._name`` in ``source`` that the module does not define."""
    tree = ast.parse(source)
    own = _defined_private(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in FOREIGN_PRIVATE:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        if name not in own:
            found.append((node.lineno, name))
    for constant in _named_attributes(tree):
        name = constant.value
        if name.startswith("_") and not name.startswith("__") and name not in own \
                and name not in FOREIGN_PRIVATE:
            found.append((constant.lineno, name))
    return sorted(found)


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_no_module_touches_another_ones_private_names(path: Path) -> None:
    assert foreign_private_uses(path.read_text()) == []


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_no_module_is_larger_than_the_limit(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines: split it along its ideas"


@pytest.mark.parametrize(("source", "expected"), [
    ("def f(client):\n    return client._inflight\n", [(2, "_inflight")]),
    ("def f(engine, box):\n    engine._pause = box\n", [(2, "_pause")]),
    ("class A:\n    def __init__(self):\n        self._x = 1\n"
     "    def same(self, other):\n        return other._x\n", []),
    ("import sys\nsys._getframe(0)\n", []),
    ("def f(p):\n    return p.__class__\n", []),
    ("def f(engine):\n    return getattr(engine, '_dispatch', None)\n", [(2, "_dispatch")]),
    ("def f(engine, g):\n    setattr(engine, '_dispatch', g)\n", [(2, "_dispatch")]),
    ("def f(p):\n    return getattr(p, 'name')\n", []),
])
def test_the_check_finds_foreign_private_names(source: str,
                                               expected: list[tuple[int, str]]) -> None:
    assert foreign_private_uses(source) == expected
