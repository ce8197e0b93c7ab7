"""Reasoning, then tool calls, as vLLM 0.32's ``DelegatingParser`` orders them: the tool
parser reads only the content the reasoning parser leaves.

:class:`OutputParser` is what a chat completion request needs: built from the server's
``--tool-call-parser`` and ``--reasoning-parser`` and the request's ``tool_choice``; its
:meth:`~OutputParser.extract` reads a whole output, its :meth:`~OutputParser.stream` gives a
per-request :class:`OutputStream` to :meth:`~OutputStream.push` each detokenized piece into
and :meth:`~OutputStream.finish` once at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .base import ToolCallStream, ToolParser
from .choice import NamedToolParser, RequiredToolParser
from .reasoning import ReasoningParser, ReasoningStream
from .types import DeltaMessage, ParsedOutput

__all__ = ["OutputParser", "OutputStream"]


@attrs.frozen
class OutputParser:
    """``tool_choice``: ``"auto"`` (the tool parser reads the content; no tool parser, no
    calls), ``"none"`` (no calls), ``"required"`` or a function name (the engine was held
    to :func:`~anyio_genout.parsers.tool_choice_json_schema`'s JSON, read as such)."""

    tools: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    tool_choice: str = "auto"
    named_function: str | None = None

    def _tool_parser(self) -> ToolParser | None:
        if self.named_function is not None:
            return NamedToolParser(self.named_function)
        if self.tool_choice == "required":
            return RequiredToolParser()
        if self.tool_choice == "none":
            return None
        return self.tools

    def extract(self, text: str, *, reasoning_ended: bool = False) -> ParsedOutput:
        """Split a whole output. ``reasoning_ended``: the prompt closed its reasoning
        (:meth:`ReasoningParser.prompt_ends_reasoning`). Raises nothing."""
        reasoning: str | None = None
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(text, reasoning_ended=reasoning_ended)
        tools = self._tool_parser()
        if tools is None:
            return ParsedOutput(reasoning, content)
        found = tools.extract(content or "")
        if not found.calls:  # required/named: no call is never content (vLLM's null)
            if tools is not self.tools:
                return ParsedOutput(reasoning, None)
            kept = content if found.content == (content or "") else found.content
            return ParsedOutput(reasoning, kept)
        content = found.content if found.content and found.content.strip() else None
        return ParsedOutput(reasoning, content, found.calls)

    def stream(self, *, reasoning_ended: bool = False) -> OutputStream:
        """A fresh per-request streaming state."""
        tools = self._tool_parser()
        reasoning = self.reasoning
        return OutputStream(
            None if reasoning is None else reasoning.stream(reasoning_ended=reasoning_ended),
            None if tools is None else tools.stream())


class OutputStream:
    """One streamed output: :meth:`push` each piece of text as it is detokenized, then
    :meth:`finish` once. Each returns the delta to send (``None``: nothing new). Raises
    nothing."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self._done = False

    def push(self, delta_text: str, delta_token_ids: Sequence[int] = ()) -> DeltaMessage | None:
        if self._done:
            return None
        reasoning, content = ("", delta_text)
        if self._reasoning is not None:
            reasoning, content = self._reasoning.push(delta_text, delta_token_ids)
        tools = None
        if self._tools is not None and content:
            tools = self._tools.push(content, delta_token_ids)
            content = ""
        return _merge(reasoning, content, tools)

    def finish(self) -> DeltaMessage | None:
        if self._done:
            return None
        self._done = True
        reasoning, content = ("", "")
        if self._reasoning is not None:
            reasoning, content = self._reasoning.finish()
        tools = None
        if self._tools is not None:
            first = self._tools.push(content) if content else None
            last = self._tools.finish()
            tools = _join(first, last)
            content = ""
        return _merge(reasoning, content, tools)


def _join(a: DeltaMessage | None, b: DeltaMessage | None) -> DeltaMessage | None:
    if a is None or b is None:
        return a or b
    return DeltaMessage(content=((a.content or "") + (b.content or "")) or None,
                        tool_calls=a.tool_calls + b.tool_calls)


def _merge(reasoning: str, content: str, tools: DeltaMessage | None) -> DeltaMessage | None:
    delta = DeltaMessage(reasoning=reasoning or None,
                         content=((tools.content if tools else None) or "") + content or None,
                         tool_calls=tools.tool_calls if tools else ())
    return delta if delta else None
