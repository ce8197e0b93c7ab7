"""The server's JSON: compact, non-ASCII characters as they are (as vLLM sends them).

:func:`dumps` encodes in one call of the standard library's C encoder, which holds the GIL
until it is done: 0.5-1 µs a value, so 1-3 s for a response carrying millions of logprob
entries. :func:`dumps_in_slices` gives the same bytes a slice of a long list at a time, so
a worker thread encoding a large response holds the GIL a few milliseconds at a time and
the event loop gets its turns in between.
"""

from __future__ import annotations

import json
from typing import Any, Final

__all__ = ["SLICE_ITEMS", "dumps", "dumps_in_slices", "dumps_text", "sse_event"]

_ENCODE: Final = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
#: How many items of a long list :func:`dumps_in_slices` encodes in one call (256 rows of
#: 21 prompt logprob entries: about 5 ms).
SLICE_ITEMS: Final = 256
#: How deep :func:`dumps_in_slices` looks for long lists (a body's choices, a choice, its
#: logprobs object, their lists); anything deeper is encoded whole with its slice.
_DEPTH: Final = 4


def dumps_text(value: Any) -> str:
    """``value`` as compact JSON text, non-ASCII characters as they are (as vLLM sends
    them)."""
    return _ENCODE(value)


def dumps(value: Any) -> bytes:
    """:func:`dumps_text` as UTF-8 bytes."""
    return _ENCODE(value).encode()


def sse_event(value: Any, *, sliced: bool = False) -> bytes:
    """One server-sent event carrying ``value`` as JSON; ``sliced``: encoded with
    :func:`dumps_in_slices`."""
    return b"data: " + (dumps_in_slices(value) if sliced else dumps(value)) + b"\n\n"


def dumps_in_slices(value: Any, *, slice_items: int = SLICE_ITEMS) -> bytes:
    """:func:`dumps`'s bytes for ``value``, each list of more than ``slice_items`` items
    (down to the fourth level) encoded ``slice_items`` at a time."""
    pieces: list[str] = []
    _pieces(value, 0, slice_items, pieces)
    return "".join(pieces).encode()


def _pieces(value: Any, depth: int, slice_items: int, out: list[str]) -> None:
    if isinstance(value, list | tuple):
        if len(value) > slice_items:
            out.append("[")
            for start in range(0, len(value), slice_items):
                if start:
                    out.append(",")
                out.append(_ENCODE(value[start:start + slice_items])[1:-1])
            out.append("]")
            return
        if depth < _DEPTH and value:
            out.append("[")
            for i, item in enumerate(value):
                if i:
                    out.append(",")
                _pieces(item, depth + 1, slice_items, out)
            out.append("]")
            return
    elif isinstance(value, dict) and depth < _DEPTH and value \
            and all(key.__class__ is str for key in value):
        out.append("{")
        for i, (key, item) in enumerate(value.items()):
            if i:
                out.append(",")
            out.append(_ENCODE(key))
            out.append(":")
            _pieces(item, depth + 1, slice_items, out)
        out.append("}")
        return
    out.append(_ENCODE(value))
