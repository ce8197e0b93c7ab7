"""The tool parser interface, and the one streaming algorithm every parser here shares.

A parser says two things about an output text:

* :meth:`ToolParser.extract`: the whole output split into content and calls (vLLM's
  ``extract_tool_calls``);
* :meth:`ToolParser.scan`: what a PREFIX of the output already tells: how much of it is
  content to show, and for each call begun so far its name (once whole) and its argument
  text so far. Scans are prefix-stable: a longer text never takes back a name or argument
  text a shorter one gave, so a stream only ever appends.

:class:`ToolCallStream` turns successive scans of the growing text into deltas (vLLM's
``extract_tool_calls_streaming``): each call's first piece carries id, type and name, the
next ones argument text. ``finish`` makes the stream agree with ``extract`` where it can:
an output that turned out to hold no call is flushed as content, calls only ``extract``
found are sent whole.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import ClassVar

import attrs

from .types import DeltaMessage, ToolCallDelta, ToolCallsResult, make_tool_call_id

__all__ = ["PartialCall", "Snapshot", "ToolCallStream", "ToolParser", "partial_overlap"]


def partial_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ends ``text`` (0 if none):
    those characters may be the start of ``tag`` and are held back."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@attrs.frozen
class PartialCall:
    """A call as far as a prefix of the output shows it."""

    name: str | None  # None until the name is complete
    arguments: str = ""  # argument text so far, never shrinking as the text grows


@attrs.frozen
class Snapshot:
    """What a prefix tells: ``text[:content_end]`` is content; the calls begun so far."""

    content_end: int
    calls: tuple[PartialCall, ...] = ()


class ToolParser(abc.ABC):
    """A tool-call format (``--tool-call-parser NAME``). Stateless: one instance serves
    every request; :meth:`stream` gives each streamed request its own state."""

    #: The name ``--tool-call-parser`` takes (vLLM 0.32's).
    name: ClassVar[str]

    @abc.abstractmethod
    def extract(self, text: str) -> ToolCallsResult:
        """Split a whole output into content and tool calls. Raises nothing: an output
        that is not a well-formed call is content."""

    @abc.abstractmethod
    def scan(self, text: str, *, final: bool) -> Snapshot:
        """What the output prefix ``text`` shows so far (``final``: the output ended, hold
        nothing back). Raises nothing."""

    def stream(self) -> ToolCallStream:
        """A fresh per-request streaming state."""
        return ToolCallStream(self)


class ToolCallStream:
    """One streamed request through a :class:`ToolParser`.

    Call :meth:`push` with each piece of output text as it comes, then :meth:`finish` once
    after the last one. Each returns the delta to send, or ``None`` when there is nothing
    new. Raises nothing.
    """

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._text = ""
        self._content_sent = 0
        self._args_sent: list[str] = []  # one per announced call
        self._finished = False

    @property
    def text(self) -> str:
        """The output text pushed so far."""
        return self._text

    def push(self, delta_text: str, delta_token_ids: Sequence[int] = ()) -> DeltaMessage | None:
        """Add ``delta_text`` (token ids are accepted for the interface's sake; the
        parsers here read text only, so a marker split over tokens is still found)."""
        if self._finished:
            return None
        self._text += delta_text
        return self._delta(self._parser.scan(self._text, final=False))

    def finish(self) -> DeltaMessage | None:
        """The output ended: send what was held back, and what only the whole reading
        finds. Later calls return ``None``."""
        if self._finished:
            return None
        self._finished = True
        if self._args_sent:
            return self._delta(self._parser.scan(self._text, final=True))
        whole = self._parser.extract(self._text)
        if whole.calls:  # found only in the whole text (e.g. a call after some text)
            calls = tuple(PartialCall(call.name, call.arguments) for call in whole.calls)
            return self._delta(Snapshot(self._content_sent, calls), ids=[c.id for c in whole.calls])
        content = whole.content or ""
        if content.startswith(self._text[:self._content_sent]):
            return self._delta(Snapshot(len(content)), text=content)
        return None

    def _delta(self, snap: Snapshot, *, text: str | None = None,
               ids: Sequence[str] = ()) -> DeltaMessage | None:
        source = self._text if text is None else text
        content = None
        if snap.content_end > self._content_sent:
            content = source[self._content_sent:snap.content_end]
            self._content_sent = snap.content_end
        pieces: list[ToolCallDelta] = []
        for index, call in enumerate(snap.calls):
            if call.name is None:
                break  # calls come in order: a later one waits for this one's name
            if index == len(self._args_sent):
                call_id = ids[index] if index < len(ids) else make_tool_call_id()
                pieces.append(ToolCallDelta(index, id=call_id, type="function", name=call.name))
                self._args_sent.append("")
            sent = self._args_sent[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                pieces.append(ToolCallDelta(index, arguments=call.arguments[len(sent):]))
                self._args_sent[index] = call.arguments
        if content is None and not pieces:
            return None
        return DeltaMessage(content=content, tool_calls=tuple(pieces))
