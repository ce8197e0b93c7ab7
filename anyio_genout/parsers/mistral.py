"""``mistral``: Mistral's ``[TOOL_CALLS]`` tool calls, in both of the forms vLLM 0.32 reads.

* the JSON form (tokenizers before v11, e.g. Mistral 7B Instruct v0.3):
  ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``, or one bare object;
* the named form (v11 and later, e.g. Mistral Small 3.2, Magistral, Devstral):
  ``[TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}`` (``f{...}`` without ``[ARGS]`` too).

vLLM 0.32's ``MistralToolParser`` picks the form by the tokenizer (the named one when its
vocabulary has ``[ARGS]``); a parser here reads text only, so it picks by what follows the
first ``[TOOL_CALLS]``: ``[`` or ``{`` is the JSON form, anything else the named form.

JSON form, as vLLM's legacy reading: the first JSON value after the marker (repeated markers
count as one; text after it is dropped); items that are not objects with a ``name`` or an
``arguments`` are skipped; a missing or non-string name is ``""``, missing or null arguments
``{}``, string arguments are taken as they are, others re-serialized (``json.dumps``,
non-ASCII kept); content is the text before the marker unless it is only white space.
Unlike vLLM, output with no call in it is all content (vLLM keeps only the text after the
marker).

Named form, as vLLM's engine: each ``[TOOL_CALLS]`` begins a call; the name (stripped) runs
to ``[ARGS]`` or ``{``; the arguments are the first JSON value after it, as written (text
after it dropped), or the stripped text if it is not JSON (a call cut short), ``{}`` if
there is none; content is the text before the first marker, stripped.

Tool call ids are 9 letters and digits, as vLLM's ``MistralToolCall`` (Mistral's chat
templates refuse other ids). Streaming sends the JSON form's arguments as written (string
arguments once whole) and the named form's JSON value as it grows.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Sequence
from typing import Any, ClassVar

from .base import PartialCall, Snapshot, ToolCallStream, ToolParser, partial_overlap
from .jsonscan import ObjectScan, scan_call_object
from .types import DeltaMessage, ToolCall, ToolCallsResult

__all__ = ["MistralToolParser", "mistral_tool_call_id"]

MARK = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_WS = " \t\n\r"
_ALPHANUMERIC = string.ascii_letters + string.digits
#: vLLM's fallback when the JSON after the marker does not decode as a whole.
_ARRAY = re.compile(r"\[\{.*\}\]", re.DOTALL)
_DECODER = json.JSONDecoder()


def _value_end(text: str, start: int) -> int | None:
    """Index just past the JSON value at ``start``, or None if none is whole there yet."""
    try:
        return _DECODER.raw_decode(text, start)[1]
    except (ValueError, RecursionError):
        return None


def mistral_tool_call_id() -> str:
    """A fresh id as Mistral wants them: 9 letters and digits."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _first_json(raw: str) -> str:
    """The named form's arguments: the first JSON value of ``raw``, the stripped text if
    it does not begin with one, ``{}`` if empty (vLLM's ``_extract_args_json``)."""
    stripped = raw.strip()
    if not stripped:
        return "{}"
    try:
        _, end = _DECODER.raw_decode(stripped)
    except (ValueError, RecursionError):
        return stripped
    return stripped[:end]


def _json_call(obj: Any) -> ToolCall | None:
    """A JSON-form item as a call, or None if it is not one."""
    if not isinstance(obj, dict) or not ("name" in obj or "arguments" in obj):
        return None
    name = obj.get("name")
    args = obj.get("arguments")
    if args is None:
        args = "{}"
    elif not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return ToolCall(name if isinstance(name, str) else "", args, id=mistral_tool_call_id())


class MistralToolParser(ToolParser):
    name: ClassVar[str] = "mistral"

    @staticmethod
    def _calls_start(text: str, first: int) -> int:
        """Where the calls begin: past the first marker, white space and repeated markers."""
        pos = _skip_ws(text, first + len(MARK))
        while text.startswith(MARK, pos):
            pos = _skip_ws(text, pos + len(MARK))
        return pos

    def extract(self, text: str) -> ToolCallsResult:
        first = text.find(MARK)
        if first == -1:
            return ToolCallsResult(text or None)
        pos = self._calls_start(text, first)
        if pos >= len(text):
            return ToolCallsResult(text or None)
        if text[pos] not in "[{":
            return self._extract_named(text, first)
        segment = text[pos:].split(MARK, 1)[0].strip()
        try:
            parsed: Any = _DECODER.raw_decode(segment)[0]
        except (ValueError, RecursionError):
            found = _ARRAY.search(segment)
            try:
                parsed = None if found is None else json.loads(found.group())
            except (ValueError, RecursionError):
                parsed = None
        items = [parsed] if isinstance(parsed, dict) else parsed
        calls = [c for c in map(_json_call, items if isinstance(items, list) else [])
                 if c is not None]
        if not calls:
            return ToolCallsResult(text or None)
        before = text[:first]
        return ToolCallsResult(before if before.strip() else None, tuple(calls))

    def _extract_named(self, text: str, first: int) -> ToolCallsResult:
        calls = [ToolCall(c.name or "", c.arguments, id=mistral_tool_call_id())
                 for c in self._named(text, first, final=True)]
        if not calls:
            return ToolCallsResult(text or None)
        return ToolCallsResult(text[:first].strip() or None, tuple(calls))

    def _named(self, text: str, first: int, *, final: bool) -> list[PartialCall]:
        """The named-form calls from the marker at ``first`` on."""
        calls: list[PartialCall] = []
        body = first + len(MARK)
        while True:
            nxt = text.find(MARK, body)
            closed = final or nxt != -1
            end = nxt if nxt != -1 else (
                len(text) if final else len(text) - partial_overlap(text[body:], MARK))
            args_mark = text.find(ARGS, body, end)
            brace = text.find("{", body, end)
            if args_mark != -1 and (brace == -1 or args_mark < brace):
                name_end, args_start = args_mark, args_mark + len(ARGS)
            elif brace != -1:
                name_end, args_start = brace, brace
            elif closed:
                if text[body:end].strip() or args_mark != -1:
                    calls.append(PartialCall(text[body:end].strip(), "{}"))
                name_end = -1
            else:
                break  # the name goes on (or [ARGS] is on its way)
            if name_end != -1:
                name = text[body:name_end].strip()
                if closed:
                    calls.append(PartialCall(name, _first_json(text[args_start:end])))
                else:
                    calls.append(PartialCall(name, self._growing_args(text, args_start, end)))
            if nxt == -1:
                break
            body = nxt + len(MARK)
        return calls

    @staticmethod
    def _growing_args(text: str, start: int, end: int) -> str:
        """A named-form call's arguments before its end is known: the JSON array or object
        so far (white space at either end held back), nothing for anything else yet."""
        start = _skip_ws(text, start)
        if start >= end or text[start] not in "[{":
            return ""
        stop = _value_end(text, start)
        if stop is not None and stop <= end:
            return text[start:stop]
        return text[start:end].rstrip(_WS)

    def scan(self, text: str, *, final: bool) -> Snapshot:
        first = text.find(MARK)
        if first == -1:
            return Snapshot(len(text) if final else len(text) - partial_overlap(text, MARK))
        pos = self._calls_start(text, first)
        if pos >= len(text) or (not final and MARK.startswith(text[pos:])):
            return Snapshot(first)
        if text[pos] not in "[{":
            return Snapshot(first, tuple(self._named(text, first, final=final)))
        return Snapshot(first, tuple(self._json_calls(text, pos)))

    def _json_calls(self, text: str, pos: int) -> list[PartialCall]:
        """The JSON-form calls of the array (or bare object) at ``pos``, as far as read."""
        calls: list[PartialCall] = []
        bare = text[pos] == "{"
        i = pos if bare else pos + 1
        while True:
            while i < len(text) and text[i] in _WS + ",":
                i += 1
            if i >= len(text) or text[i] == "]":
                return calls
            if text[i] != "{":  # not a call: skipped, as vLLM does
                stop = _value_end(text, i)
                if stop is None or stop == i:
                    return calls
                i = stop
                continue
            found = scan_call_object(text, i, ("arguments",))
            if found.end is None:
                if found.name is not None:
                    calls.append(PartialCall(found.name, self._json_args(text, found)))
                return calls
            try:
                obj = json.loads(text[i:found.end])
            except (ValueError, RecursionError):
                return calls
            call = _json_call(obj)
            if call is not None:
                calls.append(PartialCall(call.name, self._json_args(text, found)))
            if bare:
                return calls
            i = found.end

    @staticmethod
    def _json_args(text: str, found: ObjectScan) -> str:
        """A JSON-form call's arguments so far: an array or object as written, a string's
        value once whole, ``{}`` for null or none once the object ends."""
        if found.args_start is None:
            return "{}" if found.end is not None else ""
        if text[found.args_start] in "[{":
            return text[found.args_start:found.args_end or len(text)]
        if found.args_end is None:
            return ""
        raw = text[found.args_start:found.args_end]
        if raw.startswith('"'):
            try:
                value = json.loads(raw)
            except ValueError:
                return ""
            return value if isinstance(value, str) else ""
        return "{}" if raw == "null" else raw

    def stream(self) -> ToolCallStream:
        return MistralToolCallStream(self)


class MistralToolCallStream(ToolCallStream):
    """A :class:`ToolCallStream` whose calls get Mistral's 9-character ids."""

    def __init__(self, parser: ToolParser) -> None:
        super().__init__(parser)
        self._ids: list[str] = []

    def _delta(self, snap: Snapshot, *, text: str | None = None,
               ids: Sequence[str] = ()) -> DeltaMessage | None:
        if not ids:
            while len(self._ids) < len(snap.calls):
                self._ids.append(mistral_tool_call_id())
            ids = self._ids
        return super()._delta(snap, text=text, ids=ids)
