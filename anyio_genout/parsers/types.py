"""What the parsers return: tool calls, whole and in pieces, and the split of reasoning.

Plain attrs classes, shaped as vLLM 0.32's OpenAI objects are (``tool_calls[i]`` of a
message or of a streamed ``delta``), so a server turns them into JSON field by field.
"""

from __future__ import annotations

import uuid

import attrs

__all__ = ["DeltaMessage", "ParsedOutput", "ToolCall", "ToolCallDelta", "ToolCallsResult",
           "make_tool_call_id"]


def make_tool_call_id() -> str:
    """A fresh tool call id in vLLM's form, ``chatcmpl-tool-`` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@attrs.frozen
class ToolCall:
    """One complete call: ``arguments`` is a JSON text (an object, as the model wrote it)."""

    name: str
    arguments: str
    id: str = attrs.field(factory=make_tool_call_id)
    type: str = "function"


@attrs.frozen
class ToolCallsResult:
    """A whole output split by a tool parser: the text left to show, and the calls.

    ``content`` is ``None`` when nothing is left (vLLM's ``content: null``).
    """

    content: str | None
    calls: tuple[ToolCall, ...] = ()

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)


@attrs.frozen
class ToolCallDelta:
    """One ``tool_calls[i]`` piece of a streamed delta.

    The first piece of call ``index`` carries its ``id``, ``type`` and ``name``; the pieces
    after it carry only ``arguments`` text, to be appended.
    """

    index: int
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: str | None = None


@attrs.frozen
class DeltaMessage:
    """What one step of a stream adds: text to show, reasoning text, tool call pieces."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


@attrs.frozen
class ParsedOutput:
    """A whole output split three ways (reasoning first, then tool calls, as vLLM does)."""

    reasoning: str | None
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
