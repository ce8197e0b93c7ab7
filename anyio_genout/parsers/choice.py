"""The outputs of ``tool_choice="required"`` and of a named function: the engine was
constrained to JSON (:mod:`.schema`), so these read JSON, whatever the model's own format.

As vLLM 0.32 does when the tool parser supports it (every parser here does): a named
function's output is its arguments; a required one's is a JSON array of
``{"name": ..., "parameters": {...}}``.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from .base import PartialCall, Snapshot, ToolParser
from .jsonscan import scan_call_object
from .types import ToolCall, ToolCallsResult

__all__ = ["NamedToolParser", "RequiredToolParser"]

_OPTIONAL = {"description": str, "strict": bool, "defer_loading": bool}


def _definition(item: Any) -> ToolCall | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    for key, kind in _OPTIONAL.items():
        if item.get(key) is not None and not isinstance(item[key], kind):
            return None
    parameters = item.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        return None
    return ToolCall(item["name"], json.dumps(parameters, ensure_ascii=False))


class RequiredToolParser(ToolParser):
    """``tool_choice="required"``: an array of calls; anything else is no call, and never
    content (vLLM's ``content: null``)."""

    name: ClassVar[str] = "required"

    def extract(self, text: str) -> ToolCallsResult:
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):
            return ToolCallsResult(None)
        if not isinstance(items, list):
            return ToolCallsResult(None)
        calls = [_definition(item) for item in items]
        if any(call is None for call in calls):
            return ToolCallsResult(None)
        return ToolCallsResult(None, tuple(c for c in calls if c is not None))

    def scan(self, text: str, *, final: bool) -> Snapshot:
        pos = text.find("[")
        if pos == -1 or text[:pos].strip():
            return Snapshot(0)
        calls = []
        pos += 1
        while True:
            while pos < len(text) and text[pos] in " \t\n\r,":
                pos += 1
            if pos >= len(text) or text[pos] != "{":
                break
            found = scan_call_object(text, pos, ("parameters",))
            if found.name is None or found.args_start is None:
                break
            calls.append(PartialCall(found.name, text[found.args_start:found.args_end]))
            if found.end is None:
                break
            pos = found.end
        return Snapshot(0, tuple(calls))


class NamedToolParser(ToolParser):
    """``tool_choice={"type": "function", "function": {"name": NAME}}``: the whole output is
    the arguments of one call to NAME (none if it is blank)."""

    name: ClassVar[str] = "named"

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def extract(self, text: str) -> ToolCallsResult:
        if not text.strip():
            return ToolCallsResult(None)
        return ToolCallsResult(None, (ToolCall(self.function_name, text),))

    def scan(self, text: str, *, final: bool) -> Snapshot:
        return Snapshot(0, (PartialCall(self.function_name, text),) if text else ())
