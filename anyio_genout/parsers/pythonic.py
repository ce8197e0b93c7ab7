"""``pythonic``: a Python list of calls, ``[get_weather(city='Paris'), now()]`` (Llama 3.2,
Llama 4, ToolACE).

As vLLM 0.32's ``PythonicToolParser`` for the whole output: it is a tool call message only
if all of it is one list of calls by simple names (letters first) with keyword arguments
of literal values (``true``/``false``/``null`` read as JSON's, tuples and sets as lists);
anything else is content. Arguments are the keyword values as a JSON object. The stream
sends each call whole once its closing parenthesis arrives (vLLM's sends the arguments
in pieces, re-parsing the unfinished Python at every token).
"""

from __future__ import annotations

import ast
import functools
import json
import re
import warnings
from typing import Any, ClassVar

from .base import PartialCall, Snapshot, ToolParser
from .types import ToolCall, ToolCallsResult

__all__ = ["PythonicToolParser"]

_NAME = re.compile(r"[a-zA-Z]\w*\Z")
_JSON_NAMES = {"null": None, "true": True, "false": False}


class _NotACall(Exception):
    pass


def _value(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(
            node.value, str | int | float)):
        return node.value
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        return {k.value: _value(v) for k, v in zip(node.keys, node.values, strict=True)}  # type: ignore[union-attr]
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [_value(v) for v in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(p, ast.Constant) for p in node.values):
        return "".join(str(p.value) for p in node.values)  # type: ignore[attr-defined]
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _value(node.operand)
        if isinstance(operand, int | float) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    raise _NotACall


def _call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) \
            or not _NAME.match(node.func.id):
        raise _NotACall
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None or not _NAME.match(keyword.arg):
            raise _NotACall
        arguments[keyword.arg] = _value(keyword.value)
    try:
        return ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False))
    except (TypeError, ValueError) as exc:
        raise _NotACall from exc


def _parse(source: str) -> ast.expr | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in the model's text
            return ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


#: What a scan of the list stops at: a quote (a string starts) or a bracket.
_STRUCTURAL = re.compile(r"""['"()\[\]{}]""")


def _string_end(text: str, start: int, quote: str) -> int | None:
    """Index just past the Python string whose body starts at ``start`` and which
    ``quote`` closes (a backslash escapes the next character), or None while it is open."""
    i = start
    while True:
        close = text.find(quote, i)
        if close == -1:
            return None
        escape = text.find("\\", i, close)
        if escape == -1:
            return close + len(quote)
        i = escape + 2


def _call_ends(text: str) -> list[int]:
    """End offsets of the complete calls at the top level of the list ``text`` opens.

    Jumps from bracket to quote with the regex engine and ``str.find`` (C): the stream
    rescans the growing text on every piece."""
    ends: list[int] = []
    depth, i = 0, 0
    while True:
        found = _STRUCTURAL.search(text, i)
        if found is None:
            return ends
        i = found.start()
        ch = text[i]
        if ch in "'\"":
            quote = ch * 3 if text.startswith(ch * 3, i) else ch
            end = _string_end(text, i + len(quote), quote)
            if end is None:
                return ends
            i = end
            continue
        if ch in "([{":
            depth += 1
        else:
            depth -= 1
            if depth == 1 and ch == ")":
                ends.append(i + 1)
            if depth <= 0:
                return ends
        i += 1


@functools.lru_cache(maxsize=64)
def _read_call(source: str) -> tuple[str, str] | None:
    """``(name, arguments)`` of one call's source, or None (cached: a stream reads each
    complete call again on every later piece)."""
    node = _parse(source)
    try:
        call = _call(node) if node is not None else None
    except _NotACall:
        return None
    return None if call is None else (call.name, call.arguments)


class PythonicToolParser(ToolParser):
    name: ClassVar[str] = "pythonic"

    def extract(self, text: str) -> ToolCallsResult:
        if not text.startswith("["):
            return ToolCallsResult(text)
        tree = _parse(text)
        if not isinstance(tree, ast.List) or not tree.elts:
            return ToolCallsResult(text)
        try:
            return ToolCallsResult(None, tuple(_call(e) for e in tree.elts))
        except _NotACall:
            return ToolCallsResult(text)

    def scan(self, text: str, *, final: bool) -> Snapshot:
        if not text.startswith("["):
            return Snapshot(len(text))
        calls, start = [], 1
        for end in _call_ends(text):
            call = _read_call(text[start:end].strip().lstrip(",").strip())
            if call is None:
                break
            calls.append(PartialCall(*call))
            start = end
        return Snapshot(0, tuple(calls))
