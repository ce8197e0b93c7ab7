"""The package's layers: no import runs up, no import circle, the protocol core sans-IO.

The layers, bottom up: ``errors``; ``protocol`` (sans I/O); ``transport`` and ``readiness``;
``engine``; ``testing`` (test hooks over the engine client); ``generate`` and ``metrics``
(generate may use metrics, not the reverse); ``text``; the package's facade
(``anyio_genout/__init__.py``); ``server``; ``vllm`` and ``bench``; ``cli`` (and
``__main__``) on top. ``mock`` stands beside them: it uses only ``errors``, ``protocol`` and
``transport``/``readiness``, and only ``vllm``, ``bench`` and ``cli`` may use it. Folders are
layers, with no exception: a module's layer is its folder (its first name below
``anyio_genout``), so every command line, the mock engine's and the benchmark's too, lives
under ``cli/``. docs/architecture.md lists the
layers in the same order (checked here too).

Every import counts: absolute or relative, at module level, in a function, or under ``if
TYPE_CHECKING:`` (a type-only import is still a dependency, and the first step to a circle).
"""

from __future__ import annotations

import ast
import functools
import re
import shutil
from pathlib import Path

import pytest

import anyio_genout
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
_REQUIRED = {"anyio", "zmq", "msgpack", "numpy", "attrs", "prometheus_client", "tokenizers",
             "jinja2", "jsonschema"}
_OPTIONAL_BY_PART = {"bench": {"psutil", "matplotlib", "pyinstrument"},
                     "server": {"fastapi", "starlette", "pydantic", "hypercorn",
                                "httptools"}}


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


# ------------------------------------------------------------------ layers and circles

PACKAGE = Path(anyio_genout.__file__).parent

#: Rank of each part of the package (its first name below ``anyio_genout``); a module may
#: import its own part, a part of lower rank, or a part listed in _SIDEWAYS.
_RANKS: dict[str, int] = {
    "errors": 0,
    "protocol": 10,
    "transport": 20, "readiness": 20,
    "engine": 30,
    "testing": 35,  # test hooks over the engine client; nothing in the package imports it
    "generate": 40, "metrics": 40,
    "text": 50,
    "parsers": 52,  # tool-call and reasoning parsers: sans I/O, errors only
    "": 55,  # anyio_genout/__init__.py, the facade
    "server": 58,  # above the facade's layers, below cli (needs the server extra)
    "vllm": 60, "bench": 60,
    "cli": 70, "__main__": 70,
}
_SIDEWAYS = {("transport", "readiness"), ("generate", "metrics"), ("__main__", "cli")}
#: mock stands beside the stack: what it may import, and the lowest rank that may import it.
_MOCK_USES = {"mock", "errors", "protocol", "transport", "readiness"}
_MOCK_USED_FROM = 60


def _modules(package: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of ``package`` (a package is its __init__.py)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = [package.name, *path.relative_to(package).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


@functools.cache
def _import_statements(source: str) -> tuple[tuple[int, int, str, tuple[str, ...]], ...]:
    """``(line, level, module, names)`` of every import statement in ``source``, at any
    depth (in a function, under ``if TYPE_CHECKING:``); ``import a.b`` has level -1."""
    found: list[tuple[int, int, str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, -1, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.level, node.module or "",
                          tuple(alias.name for alias in node.names)))
    return tuple(found)


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of a module of the package in ``name``'s source.

    All of them: relative or absolute, at any depth. ``from X import y`` imports module
    ``X.y`` if there is one, else ``X``; a name resolves to the module or package that
    holds it.
    """
    top = name.split(".")[0]
    is_package = path.name == "__init__.py"
    package = name.split(".") if is_package else name.split(".")[:-1]
    found = []
    for line, level, module, names in _import_statements(path.read_text()):
        if level < 0:
            targets = [module]
        else:
            if level:
                module = ".".join([*package[:len(package) - level + 1],
                                   *([module] if module else [])])
            submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules]
            targets = submodules if len(submodules) == len(names) else [module, *submodules]
        for target in targets:
            if target.split(".")[0] != top:
                continue
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            found.append((line, target))
    return found


def _part(name: str) -> str:
    """``anyio_genout.engine.client`` -> ``engine``; the facade -> ``""``."""
    return name.split(".")[1] if "." in name else ""


def layer_violations(package: Path) -> list[str]:
    """Every import in ``package`` that runs up the layers or into or out of mock."""
    modules = _modules(package)
    problems = []
    for name, path in modules.items():
        source = _part(name)
        if source not in _RANKS and source != "mock":
            problems.append(f"{name}: not in any layer (add {source!r} to _RANKS)")
            continue
        for line, target in _imports(name, path, modules):
            dest = _part(target)
            where = f"{path.relative_to(package.parent)}:{line}: {name} imports {target}"
            if source == dest:
                continue
            if source == "mock":
                if dest not in _MOCK_USES:
                    problems.append(f"{where} (mock uses only {sorted(_MOCK_USES - {'mock'})})")
            elif dest == "mock":
                if _RANKS[source] < _MOCK_USED_FROM:
                    problems.append(f"{where} (only vllm, bench and cli may use mock)")
            elif dest not in _RANKS:
                problems.append(f"{where} (not in any layer)")
            elif _RANKS[dest] >= _RANKS[source] and (source, dest) not in _SIDEWAYS:
                problems.append(f"{where} (runs up: {source or 'the facade'} is below or "
                                f"beside {dest or 'the facade'})")
    return problems


def import_cycles(package: Path) -> list[list[str]]:
    """The import circles between modules of ``package`` (each as a list of modules, first
    one repeated at the end), counting every import as :func:`_imports` does."""
    modules = _modules(package)
    graph = {name: sorted({t for _, t in _imports(name, path, modules) if t != name})
             for name, path in modules.items()}
    # Tarjan's strongly connected components; any with two or more modules is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    cycles = []
    for component in components:  # one concrete circle through the component's first module
        members = set(component)
        path, seen = [component[0]], {component[0]}
        while True:
            succ = next(s for s in graph[path[-1]] if s in members and (
                (s == component[0] and len(path) > 1) or s not in seen))
            path.append(succ)
            if succ == component[0]:
                break
            seen.add(succ)
        cycles.append(path)
    return cycles


def test_no_import_runs_up_the_layers() -> None:
    assert layer_violations(PACKAGE) == []


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
_DIAGRAM_MARK = "<!-- layers:"
#: A layer line of the diagram: one space, then its folders (``engine/``) or files
#: (``errors.py``, ``__init__.py`` for the facade), comma-separated, then what they hold.
_LAYER_LINE = re.compile(
    r"^ (?P<names>\w+(?:/|\.py)(?:, \w+(?:/|\.py))*)(?: {2,}(?P<text>.*))?$")


def _layer_name(name: str) -> str:
    """``engine/`` -> ``engine``, ``errors.py`` -> ``errors``, ``__init__.py`` -> ``""``."""
    name = name.removesuffix("/").removesuffix(".py")
    return "" if name == "__init__" else name


def architecture_diagram(text: str) -> list[tuple[list[str], str]]:
    """The layers docs/architecture.md's diagram lists, top down: ``(names, text)`` per line
    (text with its continuation lines), from the fenced block after the layers mark."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(_DIAGRAM_MARK))
    assert lines[start + 1].startswith("```"), "the layers mark is not above a fenced block"
    entries: list[tuple[list[str], str]] = []
    for line in lines[start + 2:]:
        if line.startswith("```"):
            break
        match = _LAYER_LINE.match(line)
        if match is not None:
            entries.append(([_layer_name(n) for n in match["names"].split(", ")],
                            match["text"] or ""))
        elif entries and line.strip(" │"):
            names, described = entries[-1]
            entries[-1] = (names, f"{described} {line.strip(' │')}")
    return entries


def test_the_architecture_diagram_lists_the_layers_in_rank_order() -> None:
    """docs/architecture.md's diagram cannot fall behind :data:`_RANKS`: the same layers,
    top down, one line per rank (the pairs of :data:`_SIDEWAYS` on one line, in order),
    then ``mock`` beside them, naming what it uses and who uses it; every name a folder or
    a file of the package."""
    entries = architecture_diagram(ARCHITECTURE.read_text())
    stack = [names for names, _ in entries if names != ["mock"]]
    by_rank: dict[int, set[str]] = {}
    for part, rank in _RANKS.items():
        by_rank.setdefault(rank, set()).add(part)
    assert [set(names) for names in stack] == [by_rank[r] for r in sorted(by_rank, reverse=True)]
    for first, second in _SIDEWAYS:
        line = next(names for names in stack if first in names)
        assert second in line and line.index(first) < line.index(second), (first, second)
    assert [names for names, _ in entries][-1] == ["mock"], "mock's line comes last"
    mock_text = entries[-1][1]
    used_by = {part for part, rank in _RANKS.items() if rank >= _MOCK_USED_FROM} - {"__main__"}
    for part in (_MOCK_USES - {"mock"}) | used_by:
        assert re.search(rf"\b{part}\b", mock_text), f"mock's line does not name {part}"
    for names, _ in entries:
        for name in names:
            assert name == "" or (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file()


def test_the_diagram_reader_reads_the_lines_it_should() -> None:
    text = "\n".join(["intro", "<!-- layers: -->", "```", " a/, b.py    holds x", "      │ and y",
                      "        │", " __init__.py", "", " mock/   uses a", "```", " c/   after"])
    assert architecture_diagram(text) == [(["a", "b"], "holds x and y"), ([""], ""),
                                          (["mock"], "uses a")]


#: Import circles tolerated (issue 13 removed the last two, generate.client <-> .stream and
#: mock.engine <-> .utility). Keep it empty: break a new circle rather than list it.
_KNOWN_CIRCLES: set[frozenset[str]] = set()


def test_there_is_no_import_circle() -> None:
    assert {frozenset(cycle) for cycle in import_cycles(PACKAGE)} == _KNOWN_CIRCLES


#: (file, line added, what the checks must say): each breaks the layering in another way.
_BAD_IMPORTS = [
    ("protocol/packing.py", "from ..transport import ZmqSocket",
     "anyio_genout.protocol.packing imports anyio_genout.transport"),
    ("protocol/outputs.py",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from anyio_genout.engine import X",
     "anyio_genout.protocol.outputs imports anyio_genout.engine"),
    ("engine/registry.py", "def _late() -> None:\n    from ..generate import client",
     "anyio_genout.engine.registry imports anyio_genout.generate.client"),
    ("metrics/series.py", "from .. import Client",
     "anyio_genout.metrics.series imports anyio_genout (runs up"),
    ("metrics/histogram.py", "from ..generate.output import FinishReason",
     "anyio_genout.metrics.histogram imports anyio_genout.generate.output"),
    ("mock/wire.py", "import anyio_genout.engine.client",
     "anyio_genout.mock.wire imports anyio_genout.engine.client (mock uses only"),
    ("mock/engine.py", "from ..cli.mock_cmd import main",
     "anyio_genout.mock.engine imports anyio_genout.cli.mock_cmd (mock uses only"),
    ("bench/spec.py", "from ..cli.bench.options import DEFAULT_DIR",
     "anyio_genout.bench.spec imports anyio_genout.cli.bench.options (runs up"),
    ("bench/measure.py", "from ..cli.main import main",
     "anyio_genout.bench.measure imports anyio_genout.cli.main"),
    ("generate/stream.py", "from ..mock import MockEngine",
     "anyio_genout.generate.stream imports anyio_genout.mock (only"),
    ("transport.py", "from .cli import main", "anyio_genout.transport imports anyio_genout.cli"),
]

#: (file, line added, a module the circle must go through).
_CIRCLES = [
    ("metrics/series.py",
     "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .tracker import RequestTracker",
     "anyio_genout.metrics.tracker"),
    ("protocol/arrays.py", "def _late() -> None:\n    from . import packing",
     "anyio_genout.protocol.packing"),
    ("engine/registry.py", "from . import EngineCoreClient", "anyio_genout.engine"),
]


def _scratch_copy(tmp_path: Path) -> Path:
    copy = tmp_path / PACKAGE.name
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


@pytest.mark.parametrize(("file", "line", "expected"), _BAD_IMPORTS,
                         ids=[f for f, _, _ in _BAD_IMPORTS])
def test_the_layer_check_catches_an_upward_import(tmp_path: Path, file: str, line: str,
                                                  expected: str) -> None:
    """The check above is not vacuous: in a scratch copy of the package, one bad import."""
    copy = _scratch_copy(tmp_path)
    before = layer_violations(copy)
    target = copy / file
    target.write_text(target.read_text() + "\n" + line + "\n")
    problems = [p for p in layer_violations(copy) if p not in before]
    assert len(problems) == 1 and expected in problems[0], problems


@pytest.mark.parametrize(("file", "line", "member"), _CIRCLES, ids=[f for f, _, _ in _CIRCLES])
def test_the_circle_check_catches_a_circle(tmp_path: Path, file: str, line: str,
                                           member: str) -> None:
    copy = _scratch_copy(tmp_path)
    before = [set(cycle) for cycle in import_cycles(copy)]
    target = copy / file
    target.write_text(target.read_text() + "\n" + line + "\n")
    cycles = [c for c in import_cycles(copy) if set(c) not in before]
    assert len(cycles) == 1 and member in cycles[0], cycles
    assert cycles[0][0] == cycles[0][-1]
