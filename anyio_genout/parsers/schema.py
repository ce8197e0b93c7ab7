"""The JSON schema the engine's structured outputs must hold a ``tool_choice="required"``
or named-function output to: vLLM 0.32's ``get_json_schema_from_tools``, as a pure function.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InvalidRequestError

__all__ = ["tool_choice_json_schema"]


def _function(tool: Mapping[str, Any], index: int) -> tuple[str, dict[str, Any] | None]:
    function = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(function, Mapping) \
            or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"tools.{index}", "must be a function tool with a name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise InvalidRequestError(f"tools.{index}.function.parameters", "must be an object")
    return function["name"], None if parameters is None else copy.deepcopy(dict(parameters))


def _object_or_empty(parameters: dict[str, Any] | None) -> dict[str, Any]:
    return parameters if parameters else {"type": "object", "properties": {}}


def tool_choice_json_schema(tool_choice: str | Mapping[str, Any] | None,
                            tools: Sequence[Mapping[str, Any]] | None,
                            parallel_tool_calls: bool | None = None) -> dict[str, Any] | None:
    """The schema for ``tool_choice`` over ``tools`` (chat completion shapes: ``{"type":
    "function", "function": {"name", "parameters"}}``), or ``None`` when the output is not
    constrained (``"auto"``, ``"none"``, no tools).

    A named function gets its parameters schema (an empty object schema if it has none);
    ``"required"`` gets an array (at least one item; at most one if
    ``parallel_tool_calls`` is ``False``) of ``{"name": NAME, "parameters": ...}`` objects,
    any of the tools, with every tool's ``$defs`` gathered at the top.

    Raises:
        InvalidRequestError: a tool that is not a named function, a named function that is
            not among ``tools``, two tools defining one ``$defs`` name differently.
    """
    if tool_choice in (None, "none", "auto") or tools is None:
        return None
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    if isinstance(tool_choice, Mapping):
        wanted = tool_choice.get("function", {}).get("name")
        for name, parameters in functions:
            if name == wanted:
                return _object_or_empty(parameters)
        raise InvalidRequestError("tool_choice", f"tool {wanted!r} is not among the tools")
    if tool_choice != "required":
        raise InvalidRequestError("tool_choice", f"unknown tool_choice {tool_choice!r}")
    defs: dict[str, Any] = {}
    for name, parameters in functions:
        if parameters is None:
            continue
        own = parameters.pop("$defs", {})
        if not isinstance(own, Mapping):
            raise InvalidRequestError("tools", f"$defs of tool {name!r} must be an object")
        for key, value in own.items():
            if key in defs and defs[key] != value:
                raise InvalidRequestError("tools", f"$defs {key!r} has several schemas")
            defs[key] = value
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [name]},
                            "parameters": _object_or_empty(parameters)},
             "required": ["name", "parameters"]} for name, parameters in functions]},
    }
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
