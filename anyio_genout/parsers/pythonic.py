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


def _call_ends(text: str) -> list[int]:
    """End offsets of the complete calls at the top level of the list ``text`` opens."""
    ends, depth, quote, i = [], 0, "", 0
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif text.startswith(quote, i):
                i += len(quote) - 1
                quote = ""
        elif ch in "'\"":
            quote = ch * 3 if text.startswith(ch * 3, i) else ch
            i += len(quote) - 1
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 1 and ch == ")":
                ends.append(i + 1)
            if depth <= 0:
                break
        i += 1
    return ends


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
            node = _parse(text[start:end].strip().lstrip(",").strip())
            try:
                call = _call(node) if node is not None else None
            except _NotACall:
                call = None
            if call is None:
                break
            calls.append(PartialCall(call.name, call.arguments))
            start = end
        return Snapshot(0, tuple(calls))
