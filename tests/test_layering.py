"""The protocol core stays sans-IO: no anyio, no zmq, no trio, no asyncio."""

from __future__ import annotations

import ast
from pathlib import Path

import anyio_genout.protocol

FORBIDDEN = {"anyio", "zmq", "trio", "asyncio", "socket"}


def test_protocol_core_imports_no_io_library() -> None:
    package = Path(anyio_genout.protocol.__file__).parent
    offenders = []
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []


# Top-level imports a plain ``pip install .`` provides (pyproject's dependencies), and the
# optional ones each part of the package may use; imports made inside a function (after
# the optional library is known to be there) are not checked.
_REQUIRED = {"anyio", "zmq", "msgpack", "numpy", "attrs", "prometheus_client"}
_OPTIONAL_BY_PART = {"bench": {"psutil", "matplotlib", "pyinstrument"}}


def _module_level_imports(tree: ast.Module) -> list[str]:
    names: list[str] = []
    for node in tree.body:  # module level only, including under `if TYPE_CHECKING:`
        stack: list[ast.stmt] = [node]
        while stack:
            stmt = stack.pop()
            if isinstance(stmt, ast.Import):
                names += [alias.name.split(".")[0] for alias in stmt.names]
            elif isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module:
                names.append(stmt.module.split(".")[0])
            elif isinstance(stmt, ast.If | ast.Try):
                if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
                    continue  # not imported at run time
                stack += [*stmt.body, *stmt.orelse]
                if isinstance(stmt, ast.Try):
                    stack += [s for handler in stmt.handlers for s in handler.body]
    return names


def test_the_package_imports_only_what_its_install_provides() -> None:
    """A module-level import of a package that ``pip install .`` does not bring (sniffio,
    which anyio 4 no longer depends on, once broke the README's first command) fails
    here rather than on a user's machine."""
    import sys

    package = Path(anyio_genout.protocol.__file__).parents[1]
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    offenders = []
    for path in sorted(package.rglob("*.py")):
        part = path.relative_to(package).parts[0]
        allowed = _REQUIRED | _OPTIONAL_BY_PART.get(part, set()) | {"anyio_genout"}
        tree = ast.parse(path.read_text(), filename=str(path))
        offenders += [f"{path.relative_to(package)}: {name}"
                      for name in _module_level_imports(tree)
                      if name not in stdlib and name not in allowed]
    assert offenders == []
