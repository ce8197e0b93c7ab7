"""``llama3_json`` (and ``llama4_json``): JSON calls ``{"name": ..., "parameters": ...}``,
optionally after ``<|python_tag|>``, several separated by ``;`` (Llama 3.1-3.3, Llama 4).

As vLLM 0.32's ``Llama3JsonToolParser``: the whole output is searched for JSON objects (each
``{`` outside an object already read); every one must be a call (a ``name`` and
``arguments`` or ``parameters``) or the whole output is content; content is ``None`` when
there are calls (text around them is dropped). Streaming reads a call only when the output
begins with ``{`` or ``<|python_tag|>``, as vLLM's does; anything else streams as content.
"""

from __future__ import annotations

import json
from typing import ClassVar

from .base import PartialCall, Snapshot, ToolParser
from .hermes import load_call_object
from .jsonscan import scan_call_object
from .types import ToolCall, ToolCallsResult

__all__ = ["Llama3JsonToolParser"]

_ARG_KEYS = ("arguments", "parameters")


class Llama3JsonToolParser(ToolParser):
    name: ClassVar[str] = "llama3_json"
    bot: ClassVar[str] = "<|python_tag|>"

    def extract(self, text: str) -> ToolCallsResult:
        decoder = json.JSONDecoder()
        calls: list[ToolCall] = []
        pos = text.find("{")
        while pos != -1:
            try:
                _, length = decoder.raw_decode(text[pos:])
            except (ValueError, RecursionError):
                return ToolCallsResult(text)
            call = load_call_object(text[pos:pos + length], _ARG_KEYS)
            if call is None:
                return ToolCallsResult(text)
            calls.append(call)
            pos = text.find("{", pos + length)
        return ToolCallsResult(None, tuple(calls)) if calls else ToolCallsResult(text)

    def scan(self, text: str, *, final: bool) -> Snapshot:
        pos = len(self.bot) if text.startswith(self.bot) else 0
        if not text.startswith("{", pos):
            if not final and self.bot.startswith(text):
                return Snapshot(0)  # may still become <|python_tag|>
            return Snapshot(len(text))
        calls = []
        while pos < len(text) and text[pos] == "{":
            found = scan_call_object(text, pos, _ARG_KEYS)
            if found.name is None:
                break
            args = "" if found.args_start is None else text[found.args_start:found.args_end]
            calls.append(PartialCall(found.name, args))
            if found.end is None:
                break
            pos = found.end
            while pos < len(text) and text[pos] in " \t\n\r;":
                pos += 1
        return Snapshot(0, tuple(calls))
