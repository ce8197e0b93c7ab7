"""A prefix-stable reading of a (possibly unfinished) JSON tool-call object.

``{"name": "f", "arguments": {...}}`` written token by token: :func:`scan_call_object`
tells, for any prefix, the name once its string is closed (JSON-decoded, escapes and all)
and where the value of the arguments key starts and, once it is closed, ends. One pass,
string- and nesting-aware, reading only the object's own level, so braces and quotes inside
strings and nested values cannot confuse it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection

import attrs

__all__ = ["ObjectScan", "scan_call_object"]

_WS = " \t\n\r"


@attrs.define
class ObjectScan:
    """Offsets into the text; ``None`` while not reached yet."""

    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None
    end: int | None = None  # just past the object's closing brace


#: The rest of a JSON string after its opening quote, through its closing one (escapes
#: skipped); possessive, so a string not closed yet fails in one linear pass.
_STRING_REST = re.compile(r'(?:[^"\\]++|\\.)*+"', re.DOTALL)
#: What changes a container's nesting, or starts a string in it.
_STRUCTURAL = re.compile(r'["\[\]{}]')
#: What ends a scalar (a number, true, false, null).
_SCALAR_END = re.compile(r"[ \t\n\r,}\]]")


def _string_end(text: str, start: int) -> int | None:
    """Index just past the JSON string starting at ``text[start] == '"'``, or None."""
    quote = text.find('"', start + 1)
    if quote == -1:
        return None
    if text.find("\\", start + 1, quote) == -1:  # no escape before it (memchr speed)
        return quote + 1
    found = _STRING_REST.match(text, start + 1)
    return None if found is None else found.end()


def _value_end(text: str, start: int) -> int | None:
    """Index just past the JSON value starting at ``start`` (a string, an array or object,
    or a scalar ended by a delimiter), or None while it is unfinished.

    The scans run in the regex engine (C): a streamed call's growing arguments are read
    again on every piece, so a Python loop per character would cost milliseconds per
    piece for long arguments."""
    ch = text[start]
    if ch == '"':
        return _string_end(text, start)
    if ch in "[{":
        depth, i = 0, start
        while True:
            found = _STRUCTURAL.search(text, i)
            if found is None:
                return None
            i = found.start()
            ch = text[i]
            if ch == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if ch in "[{":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
    found = _SCALAR_END.search(text, start)
    return None if found is None else found.start()


def scan_call_object(text: str, start: int, arg_keys: Collection[str]) -> ObjectScan:
    """Read the object at ``text[start] == '{'``: the first ``"name"`` string value and the
    span of the first value under one of ``arg_keys``. Stops at anything that is not JSON
    (what was read so far stays)."""
    scan = ObjectScan()
    i = start + 1
    while True:
        while i < len(text) and text[i] in _WS + ",":
            i += 1
        if i >= len(text):
            return scan
        if text[i] == "}":
            scan.end = i + 1
            return scan
        if text[i] != '"':
            return scan
        key_end = _string_end(text, i)
        if key_end is None:
            return scan
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            return scan
        i = key_end
        while i < len(text) and text[i] in _WS:
            i += 1
        if i >= len(text) or text[i] != ":":
            return scan
        i += 1
        while i < len(text) and text[i] in _WS:
            i += 1
        if i >= len(text):
            return scan
        is_args = key in arg_keys and scan.args_start is None
        if is_args:
            scan.args_start = i
        end = _value_end(text, i)
        if end is None:
            return scan
        if is_args:
            scan.args_end = end
        elif key == "name" and scan.name is None and text[i] == '"':
            try:
                scan.name = json.loads(text[i:end])
            except ValueError:
                return scan
        i = end
