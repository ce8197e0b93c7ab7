"""``qwen3_xml`` (and ``qwen3_coder``): Qwen3-Coder's XML tool calls.

::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

As vLLM 0.32's engine-based Qwen3 parser: content is the text before the first
``<tool_call>`` (or a bare ``<function=``), white space around it cut in a whole
response; each ``<parameter=NAME>`` value is a string (one newline trimmed at each end),
the arguments the JSON object of them; a call cut short keeps its complete parameters; text
after the calls is dropped. Streamed, the arguments object is sent as it grows, each value
as its characters come.
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from .base import PartialCall, Snapshot, ToolParser, partial_overlap
from .types import ToolCall, ToolCallsResult

__all__ = ["Qwen3XmlToolParser"]

TOOL_START = "<tool_call>"
FUNC = "<function="
FUNC_END = "</function>"
PARAM = "<parameter="
PARAM_END = "</parameter>"
_PARAM = re.compile(r"<\s*parameter\s*=\s*([^>]*)>(.*?)"
                    r"(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=))", re.DOTALL)


def _trim(value: str) -> str:
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


class Qwen3XmlToolParser(ToolParser):
    name: ClassVar[str] = "qwen3_xml"

    @staticmethod
    def _start(text: str) -> int:
        hits = [i for i in (text.find(TOOL_START), text.find(FUNC)) if i != -1]
        return min(hits) if hits else -1

    @staticmethod
    def _functions(text: str, start: int,
                   final: bool) -> list[tuple[str | None, int, int, bool]]:
        """``(name, body start, body end, closed)`` of each ``<function=...>`` from start."""
        found: list[tuple[str | None, int, int, bool]] = []
        pos = text.find(FUNC, start)
        while pos != -1:
            close = text.find(">", pos)
            if close == -1:  # a name cut short: a call by it only in the whole reading
                found.append(((text[pos + len(FUNC):] or None) if final else None, len(text),
                              len(text), False))
                break
            end = text.find(FUNC_END, close)
            name = text[pos + len(FUNC):close]
            if end == -1:
                found.append((name, close + 1, len(text), False))
                break
            found.append((name, close + 1, end, True))
            pos = text.find(FUNC, end)
        return found

    def extract(self, text: str) -> ToolCallsResult:
        start = self._start(text)
        if start == -1:
            return ToolCallsResult(text or None)
        calls = []
        for name, body, end, _ in self._functions(text, start, True):
            if name is None:
                break
            params = {m.group(1): _trim(m.group(2)) for m in _PARAM.finditer(text, body, end)}
            calls.append(ToolCall(name, json.dumps(params, ensure_ascii=False)))
        return ToolCallsResult(text[:start].strip() or None, tuple(calls))

    def scan(self, text: str, *, final: bool) -> Snapshot:
        start = self._start(text)
        if start == -1:
            held = 0 if final else max(partial_overlap(text, TOOL_START),
                                       partial_overlap(text, FUNC))
            return Snapshot(len(text) - held)
        calls = []
        for name, body, end, closed in self._functions(text, start, False):
            if name is None:
                break
            calls.append(PartialCall(name, self._arguments(text[body:end], closed or final)))
        return Snapshot(start, tuple(calls))

    @staticmethod
    def _arguments(body: str, closed: bool) -> str:
        """The arguments object as far as ``body`` shows it, prefix-stable: an open value
        is sent without its closing quote, less what may be ``</parameter>`` or its
        trimmed newline."""
        parts: list[tuple[str, str]] = []
        pos, open_value = 0, None
        while True:
            at = body.find(PARAM, pos)
            if at == -1:
                break
            gt = body.find(">", at)
            if gt == -1:
                break
            key = body[at + len(PARAM):gt]
            end = body.find(PARAM_END, gt)
            nxt = body.find(PARAM, gt)
            if end != -1 and (nxt == -1 or end < nxt):
                parts.append((key, _trim(body[gt + 1:end])))
                pos = end + len(PARAM_END)
            elif nxt != -1:
                parts.append((key, _trim(body[gt + 1:nxt])))
                pos = nxt
            else:
                open_value = (key, body[gt + 1:])
                break
        text = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: "
                               f"{json.dumps(v, ensure_ascii=False)}" for k, v in parts)
        if open_value is not None and not closed:
            key, value = open_value
            value = value[:len(value) - partial_overlap(value, PARAM_END)].removeprefix("\n")
            value = value.removesuffix("\n")
            text += (", " if parts else "") + json.dumps(key, ensure_ascii=False) + ": " \
                + json.dumps(value, ensure_ascii=False)[:-1]
            return text
        return text + "}" if closed else text
