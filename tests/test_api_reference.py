"""docs/api.md documents the whole public API, and cannot fall behind the code.

The public API is every name in the ``__all__`` of ``anyio_genout`` and of its public
modules :mod:`anyio_genout.metrics`, :mod:`anyio_genout.mock`, :mod:`anyio_genout.testing`,
:mod:`anyio_genout.text` and :mod:`anyio_genout.vllm`. Each name needs an entry in
docs/api.md: a heading that names it in a code span (``### `GenerateRequest` ``; one heading
may name several). An entry runs to the next heading of its level or above, and must
mention in code spans, read from the code:

* an attrs class: every field (``attrs.fields``);
* any other class: its constructor's parameters (``inspect.signature``), unless users never
  construct it (:data:`NOT_CONSTRUCTED`), and the members of an enum or a named tuple;
* every public method, property and attribute a class defines (or inherits from another
  class of the package), and every parameter of those methods;
* a function: every parameter.

So a field, parameter or method added to the code fails here until the reference has it.
``EngineCoreClient``'s entry is checked both ways: it lists its public members, no fewer and
no more (:func:`surface_drift`).
"""

from __future__ import annotations

import enum
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

ROOT = Path(__file__).resolve().parent.parent
API_DOC = ROOT / "docs" / "api.md"
MODULES = ("anyio_genout", "anyio_genout.metrics", "anyio_genout.mock", "anyio_genout.testing",
           "anyio_genout.text", "anyio_genout.vllm")

#: Classes users get from the library and never construct: their constructors are internal.
NOT_CONSTRUCTED = {
    "EngineCoreClient": "made by EngineCoreClient.connect",
    "GenerateStream": "made by Client.generate",
    "TextStream": "made by TextClient.generate",
    "EngineCoreOutputStream": "made by EngineCoreClient.call",
    "RequestTracker": "made by Metrics.tracker",
}

_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)  # a code span may wrap lines
_IDENTIFIER = re.compile(r"[A-Za-z_][\w.]*")


def public_api() -> dict[str, Any]:
    """Name -> object, for every name the public modules export."""
    found: dict[str, Any] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            found[name] = getattr(module, name)
    return found


def entries(text: str) -> dict[str, str]:
    """Name -> the text of its entry: each heading's code spans name what it documents."""
    lines = text.splitlines()
    headings = []
    fenced = False
    for number, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        match = None if fenced else _HEADING.match(line)
        if match:
            headings.append((number, len(match[1]), match[2]))
    found: dict[str, str] = {}
    for i, (number, level, title) in enumerate(headings):
        end = next((n for n, lv, _ in headings[i + 1:] if lv <= level), len(lines))
        body = "\n".join(lines[number:end])
        for span in _CODE_SPAN.finditer(title):
            name = _IDENTIFIER.match(span[2].strip())
            if name is not None:
                found.setdefault(name[0], body)
    return found


def mentioned(entry: str) -> set[str]:
    """Every identifier in the entry's code spans, whole and split at dots."""
    names: set[str] = set()
    for span in _CODE_SPAN.finditer(entry):
        for identifier in _IDENTIFIER.findall(span[2]):
            names.add(identifier)
            names.update(identifier.split("."))
    return names


def _parameters(function: Callable[..., Any]) -> list[str]:
    skip = {"self", "cls"}
    return [p for p in inspect.signature(function).parameters if p not in skip]


def _members(klass: type) -> Iterator[tuple[str, Any]]:
    """The public names a class defines itself or inherits from a class of the package."""
    seen: set[str] = set()
    for base in klass.__mro__:
        if base is not klass and not base.__module__.startswith("anyio_genout"):
            continue
        for name, value in vars(base).items():
            if not name.startswith("_") and name not in seen:
                seen.add(name)
                yield name, value


def required(name: str, obj: Any) -> list[str]:
    """What the entry of ``obj`` must mention (dotted for the parameters of a method)."""
    if inspect.isfunction(obj):
        return _parameters(obj)
    if not inspect.isclass(obj):
        return []
    needed: list[str] = []
    if attrs.has(obj):
        needed += [f.name for f in attrs.fields(obj) if f.init and not f.name.startswith("_")]
    elif issubclass(obj, enum.Enum):
        needed += [member.name for member in obj]
    elif hasattr(obj, "_fields"):  # a named tuple
        needed += list(obj._fields)
    elif name not in NOT_CONSTRUCTED and "__init__" in vars(obj):
        needed += _parameters(obj.__init__)
    for member, value in _members(obj):
        needed.append(member)
        function = value.__func__ if isinstance(value, classmethod | staticmethod) else value
        if inspect.isfunction(function):
            needed += [f"{member}.{p}" for p in _parameters(function)]
    return list(dict.fromkeys(needed))


def problems(text: str, api: dict[str, Any]) -> list[str]:
    """What docs/api.md (``text``) lacks for the public API ``api``."""
    found = entries(text)
    missing: list[str] = []
    for name, obj in api.items():
        entry = found.get(name)
        if entry is None:
            missing.append(f"{name}: no entry (a heading naming `{name}`)")
            continue
        names = mentioned(entry)
        missing += [f"{name}.{item}: not in its entry" for item in required(name, obj)
                    if item.rsplit(".", 1)[-1] not in names]
    return missing


def test_every_public_name_is_documented_with_its_fields_and_parameters() -> None:
    assert problems(API_DOC.read_text(encoding="utf-8"), public_api()) == []


_LISTED_MEMBER = re.compile(r"\*\*`(?:async )?(\w+)[(`]|^\| `(\w+)` \|", re.MULTILINE)


def listed_members(entry: str) -> set[str]:
    """The members an entry lists: its bold ``**`name(...)`**`` items and its table rows."""
    return {first or second for first, second in _LISTED_MEMBER.findall(entry)}


def surface_drift(text: str) -> tuple[list[str], list[str]]:
    """EngineCoreClient's members its entry in ``text`` lists that it lacks, and those it
    has that the entry does not list."""
    from anyio_genout import EngineCoreClient

    listed = listed_members(entries(text)["EngineCoreClient"])
    public = {name for name, _ in _members(EngineCoreClient)}
    return sorted(listed - public), sorted(public - listed)


def test_the_engine_client_entry_lists_its_public_surface_exactly() -> None:
    """EngineCoreClient is a facade whose every public member is for users: its entry lists
    each one, and nothing it does not have (the hooks are anyio_genout.testing's)."""
    assert surface_drift(API_DOC.read_text(encoding="utf-8")) == ([], [])


def test_a_member_listed_but_gone_is_caught() -> None:
    text = API_DOC.read_text(encoding="utf-8")
    anchor = "* **`add_health_listener("
    assert text.count(anchor) == 1
    text = text.replace(anchor, "* **`close_now() -> None`**: closes.\n" + anchor)
    assert surface_drift(text) == (["close_now"], [])


def test_the_readme_and_the_architecture_page_link_to_it() -> None:
    for page in (ROOT / "README.md", ROOT / "docs" / "architecture.md"):
        assert re.search(r"\]\((docs/)?api\.md\)", page.read_text(encoding="utf-8")), page


# ------------------------------------------------------- the checks can fail (scratch copies)


def _without_entry(text: str, name: str) -> str:
    """``text`` with the entry whose heading names ``name`` cut out."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if _HEADING.match(line) and f"`{name}" in line)
    level = len(_HEADING.match(lines[start])[1])  # type: ignore[index]
    end = next((i for i in range(start + 1, len(lines))
                if (m := _HEADING.match(lines[i])) and len(m[1]) <= level), len(lines))
    return "\n".join(lines[:start] + lines[end:])


def test_a_missing_entry_is_caught() -> None:
    text = _without_entry(API_DOC.read_text(encoding="utf-8"), "GenerateRequest")
    assert problems(text, public_api()) == [
        "GenerateRequest: no entry (a heading naming `GenerateRequest`)"]


def test_a_field_left_out_of_its_entry_is_caught() -> None:
    text = API_DOC.read_text(encoding="utf-8")
    entry = entries(text)["SamplingParams"]
    rows = [line for line in entry.splitlines() if line.startswith("| `logit_bias`")]
    assert len(rows) == 1
    assert problems(text.replace(rows[0] + "\n", ""), public_api()) == [
        "SamplingParams.logit_bias: not in its entry"]


@pytest.mark.parametrize("drift", ["field", "parameter", "method"])
def test_code_that_grows_is_caught(drift: str) -> None:
    """A field, a method parameter or a method the reference does not know yet."""
    api = public_api()
    if drift == "field":
        base = api["GenerateRequest"]
        fields = {f.name: attrs.field(default=f.default, kw_only=True)
                  for f in attrs.fields(base)}
        api["GenerateRequest"] = attrs.make_class(
            "GenerateRequest", {**fields, "deadline_hint": attrs.field(default=None,
                                                                         kw_only=True)})
        expected = "GenerateRequest.deadline_hint: not in its entry"
    elif drift == "parameter":
        def generate(self: Any, request: Any, *, priority_boost: int = 0) -> Any:
            raise NotImplementedError

        api["Client"] = type("Client", (api["Client"],), {"generate": generate,
                                                          "__module__": "anyio_genout.x"})
        expected = "Client.generate.priority_boost: not in its entry"
    else:
        def drain(self: Any) -> None:
            raise NotImplementedError

        api["Metrics"] = type("Metrics", (api["Metrics"],), {"drain": drain,
                                                             "__module__": "anyio_genout.x"})
        expected = "Metrics.drain: not in its entry"
    assert problems(API_DOC.read_text(encoding="utf-8"), api) == [expected]
