"""``deepseek_v3``: DeepSeek V3 / R1 tool calls.

::

    <TOOL_CALLS_BEGIN><TOOL_CALL_BEGIN>function<TOOL_SEP>NAME
    ```json
    ARGUMENTS
    ```<TOOL_CALL_END><TOOL_CALLS_END>

where ``<TOOL_CALLS_BEGIN>`` is the special token ``<\uff5ctool\u2581calls\u2581begin\uff5c>``
and so on (full-width bars, ``\u2581`` for spaces).

As vLLM 0.32's ``DeepSeekV3ToolParser`` for the whole output: content is the text before
``<TOOL_CALLS_BEGIN>`` (``None`` if empty), the arguments text is passed on as written,
text after the calls is dropped, a call of a type other than ``function`` makes the whole
output content. Unlike vLLM, arguments may span lines (vLLM's pattern stops at a line end
and loses such a call), and the stream is read from the text, not from token ids.
"""

from __future__ import annotations

from typing import ClassVar

from .base import PartialCall, Snapshot, ToolParser, partial_overlap
from .types import ToolCall, ToolCallsResult

__all__ = ["DeepSeekV3ToolParser"]

# Full-width bars and U+2581 spaces, as DeepSeek's tokenizer spells them.
CALLS_BEGIN = "<\uff5ctool\u2581calls\u2581begin\uff5c>"
CALL_BEGIN = "<\uff5ctool\u2581call\u2581begin\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
ARGS_OPEN = "\n```json\n"
ARGS_CLOSE = "\n```<\uff5ctool\u2581call\u2581end\uff5c>"


class DeepSeekV3ToolParser(ToolParser):
    name: ClassVar[str] = "deepseek_v3"

    def _calls(self, text: str, *, final: bool) -> tuple[list[PartialCall], list[str], bool]:
        """The calls after the first CALLS_BEGIN, their types, and whether the last one is
        complete."""
        calls: list[PartialCall] = []
        types: list[str] = []
        pos = text.find(CALL_BEGIN, text.find(CALLS_BEGIN))
        while pos != -1:
            sep = text.find(SEP, pos)
            if sep == -1:
                break
            name_start = sep + len(SEP)
            newline = text.find("\n", name_start)
            if newline == -1:
                break
            type_ = text[pos + len(CALL_BEGIN):sep]
            name = text[name_start:newline]
            if "\n" in type_ or SEP in name:
                break
            if not text.startswith(ARGS_OPEN, newline):
                if not ARGS_OPEN.startswith(text[newline:]):
                    break  # not this format: no call
                calls.append(PartialCall(name))
                types.append(type_)
                return calls, types, False
            args_start = newline + len(ARGS_OPEN)
            close = text.find(ARGS_CLOSE, args_start)
            if close == -1:
                end = len(text) if final else len(text) - partial_overlap(text[args_start:],
                                                                          ARGS_CLOSE)
                calls.append(PartialCall(name, text[args_start:end]))
                types.append(type_)
                return calls, types, False
            calls.append(PartialCall(name, text[args_start:close]))
            types.append(type_)
            pos = text.find(CALL_BEGIN, close + len(ARGS_CLOSE))
        return calls, types, True

    def extract(self, text: str) -> ToolCallsResult:
        begin = text.find(CALLS_BEGIN)
        if begin == -1:
            return ToolCallsResult(text)
        calls, types, complete = self._calls(text, final=True)
        if not complete:
            calls, types = calls[:-1], types[:-1]
        if any(t != "function" for t in types):
            return ToolCallsResult(text)
        return ToolCallsResult(text[:begin] or None,
                               tuple(ToolCall(c.name or "", c.arguments) for c in calls))

    def scan(self, text: str, *, final: bool) -> Snapshot:
        begin = text.find(CALLS_BEGIN)
        if begin == -1:
            return Snapshot(len(text) if final else len(text) - partial_overlap(text, CALLS_BEGIN))
        calls, _, _ = self._calls(text, final=final)
        return Snapshot(begin, tuple(calls))
