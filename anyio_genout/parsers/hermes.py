"""``hermes``: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Hermes 2 Pro,
Qwen 2.5, Qwen3's JSON tool calls; vLLM 0.32 also answers to ``qwen3_json`` with it).

As vLLM 0.32's ``Hermes2ProToolParser``: content is the text before the first
``<tool_call>``; text after or between calls is dropped; a last call may lack its closing
tag; one call that is not a JSON object with a string ``name`` and an ``arguments`` key
makes the whole output content. Arguments are re-serialized (``json.dumps``, non-ASCII
kept) whole, sent as the model wrote them when streamed.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from .base import PartialCall, Snapshot, ToolParser, partial_overlap
from .jsonscan import scan_call_object
from .types import ToolCall, ToolCallsResult

__all__ = ["HermesToolParser", "load_call_object"]


def load_call_object(raw: str, arg_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """The call a JSON text holds, or None if it is not one (not JSON, not an object, no
    string name, no arguments)."""
    try:
        obj: Any = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in arg_keys if k in obj), None)
    if key is None:
        return None
    return ToolCall(obj["name"], json.dumps(obj[key], ensure_ascii=False))


class HermesToolParser(ToolParser):
    name: ClassVar[str] = "hermes"
    start: ClassVar[str] = "<tool_call>"
    end: ClassVar[str] = "</tool_call>"

    def _regions(self, text: str, *, final: bool) -> list[tuple[int, int, bool]]:
        """``(start, end, closed)`` of the text inside each ``<tool_call>`` region."""
        regions = []
        pos = text.find(self.start)
        while pos != -1:
            body = pos + len(self.start)
            close = text.find(self.end, body)
            if close == -1:
                cut = len(text) if final else len(text) - partial_overlap(text[body:], self.end)
                regions.append((body, cut, False))
                break
            regions.append((body, close, True))
            pos = text.find(self.start, close + len(self.end))
        return regions

    def extract(self, text: str) -> ToolCallsResult:
        if self.start not in text:
            return ToolCallsResult(text)
        calls = []
        for body, end, _ in self._regions(text, final=True):
            call = load_call_object(text[body:end])
            if call is None:
                return ToolCallsResult(text)
            calls.append(call)
        return ToolCallsResult(text[:text.find(self.start)] or None, tuple(calls))

    def scan(self, text: str, *, final: bool) -> Snapshot:
        first = text.find(self.start)
        if first == -1:
            return Snapshot(len(text) if final else len(text) - partial_overlap(text, self.start))
        calls = []
        for body, end, _ in self._regions(text, final=final):
            region = text[:end]
            obj = body
            while obj < end and region[obj] in " \t\n\r":
                obj += 1
            if obj >= end or region[obj] != "{":
                break
            found = scan_call_object(region, obj, ("arguments",))
            if found.name is None:
                break
            args = "" if found.args_start is None else region[found.args_start:found.args_end]
            calls.append(PartialCall(found.name, args))
        return Snapshot(first, tuple(calls))
