"""Reasoning parsers (``--reasoning-parser NAME``): the ``<think>`` part of an output apart
from the rest, whole and streamed.

``deepseek_r1`` (vLLM 0.32's ``DeepSeekR1ReasoningParser``): the output is reasoning up to
the first ``</think>``, content after it; the model may leave out ``<think>`` (R1's chat
template puts it in the prompt), and an output with no ``</think>`` is all reasoning.

``qwen3`` (vLLM 0.32's engine-based Qwen3 parser): the same, and also: a ``<tool_call>``
ends the reasoning (the call is content, for the tool parser), every ``<think>`` inside the
reasoning and every later ``</think>`` is dropped; with ``thinking=False`` (the request's
``chat_template_kwargs.enable_thinking``) the whole output is content.

A prompt that already closed its reasoning (``<think>...</think>`` at its end, see
:meth:`ReasoningParser.prompt_ends_reasoning`) makes the whole output content, streamed or
not (vLLM applies that to streams only). Markers are found in the text, so a marker split
over several tokens is still one marker; a piece that may be the start of a marker is held
back until the next piece tells.

The usage's ``completion_tokens_details.reasoning_tokens`` counts generated token ids, as
vLLM 0.32's ``count_reasoning_tokens`` does (:meth:`ReasoningParser.token_counter`, which
needs the markers to be single tokens of the vocabulary, as vLLM's think parsers do):
``deepseek_r1`` (vLLM's ``BaseThinkingReasoningParser``) counts the tokens inside
``<think>``...``</think>`` pairs with a depth counter (a stray ``</think>`` is skipped, an
unclosed ``<think>`` counts to the end); ``qwen3`` (its parser engine) counts every token
before the first ``</think>`` or ``<tool_call>`` but the ``<think>`` markers, none with
``thinking=False``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import ClassVar

from .base import partial_overlap

__all__ = ["DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "ReasoningParser",
           "ReasoningStream", "ReasoningTokenCounter"]


class ReasoningParser:
    """``<think>reasoning</think>content``. One instance per request setting (``thinking``);
    :meth:`stream` gives each streamed request its own state. Raises nothing."""

    name: ClassVar[str] = "deepseek_r1"
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    #: Markers that also end the reasoning, and stay in the content.
    implicit_ends: ClassVar[tuple[str, ...]] = ()
    #: Whether every ``<think>`` in the reasoning, and every ``</think>`` after it, goes.
    drop_all_markers: ClassVar[bool] = False

    def __init__(self, *, thinking: bool = True) -> None:
        self.thinking = thinking

    def prompt_ends_reasoning(self, prompt: str) -> bool:
        """Whether the rendered prompt ends with its reasoning closed (its last ``</think>``
        after its last ``<think>``), so the output has none (vLLM reads this from the
        prompt's token ids)."""
        return prompt.rfind(self.end) > prompt.rfind(self.start)

    def split(self, text: str, *, final: bool = True,
              reasoning_ended: bool = False) -> tuple[str, str]:
        """``(reasoning, content)`` of the output (prefix) ``text``; not ``final``: what may
        still be the start of a marker is in neither."""
        if reasoning_ended or not self.thinking:
            return "", text
        markers = (self.end, *self.implicit_ends)
        found = [(text.find(m), m) for m in markers]
        hits = [(i, m) for i, m in found if i != -1]
        if hits:
            stop, marker = min(hits)
            region = text[:stop]
            content = text[stop + (len(marker) if marker == self.end else 0):]
        else:
            region, content = text, ""
        first = region.find(self.start)
        held = 0
        if not hits and not final:
            held = max(partial_overlap(region, m) for m in markers)
            if first == -1 or self.drop_all_markers:
                held = max(held, partial_overlap(region, self.start))
            region = region[:len(region) - held]
        if self.drop_all_markers:
            region = region.replace(self.start, "")
        elif first != -1:
            region = region[:first] + region[first + len(self.start):]
        if self.drop_all_markers and content:
            cut = 0 if final else partial_overlap(content, self.end)
            content = content[:len(content) - cut].replace(self.end, "")
        return region, content

    def extract(self, text: str, *, reasoning_ended: bool = False) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output, ``None`` for an empty part."""
        reasoning, content = self.split(text, reasoning_ended=reasoning_ended)
        return reasoning or None, content or None

    def stream(self, *, reasoning_ended: bool = False) -> ReasoningStream:
        return ReasoningStream(self, reasoning_ended=reasoning_ended)

    def token_counter(self, token_id: Callable[[str], int | None]
                      ) -> ReasoningTokenCounter | None:
        """A counter of the reasoning tokens of one output (see the module docstring);
        ``token_id`` gives a marker's id in the vocabulary (None: not one token). None if
        ``start`` or ``end`` is not one token: vLLM's think parsers cannot be made then."""
        start, end = token_id(self.start), token_id(self.end)
        if start is None or end is None:
            return None
        if not self.implicit_ends and not self.drop_all_markers:
            return ReasoningTokenCounter(start, end)
        ends = {end, *(i for i in map(token_id, self.implicit_ends) if i is not None)}
        return ReasoningTokenCounter(start, end, until=frozenset(ends), off=not self.thinking)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name: ClassVar[str] = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name: ClassVar[str] = "qwen3"
    implicit_ends: ClassVar[tuple[str, ...]] = ("<tool_call>",)
    drop_all_markers: ClassVar[bool] = True


class ReasoningTokenCounter:
    """vLLM's ``count_reasoning_tokens`` of one output, fed its token ids as they come
    (:meth:`feed`); :attr:`count` so far. Without ``until``: the depth counter over
    ``start``/``end``; with it: every token but ``start`` until one of ``until`` (none at
    all if ``off``)."""

    __slots__ = ("_depth", "_end", "_start", "_until", "count")

    def __init__(self, start: int, end: int, *, until: frozenset[int] | None = None,
                 off: bool = False) -> None:
        self._start, self._end = start, end
        self._until = until
        self._depth = -1 if off else 0  # -1: past the reasoning (the ``until`` rule)
        self.count = 0

    def feed(self, token_ids: Sequence[int]) -> int:
        """Count ``token_ids`` (the next generated ones); returns :attr:`count`."""
        start, depth, count = self._start, self._depth, self.count
        if self._until is None:
            end = self._end
            for token in token_ids:
                if token == start:
                    depth += 1
                elif token == end:
                    depth = max(0, depth - 1)
                elif depth > 0:
                    count += 1
        elif depth == 0:
            until = self._until
            for token in token_ids:
                if token in until:
                    depth = -1
                    break
                if token != start:
                    count += 1
        self._depth, self.count = depth, count
        return count


class ReasoningStream:
    """One streamed request: :meth:`push` each piece, then :meth:`finish`; each returns
    ``(reasoning, content)`` pieces to append (empty strings when nothing is new)."""

    def __init__(self, parser: ReasoningParser, *, reasoning_ended: bool) -> None:
        self._parser = parser
        self._reasoning_ended = reasoning_ended
        self._text = ""
        self._sent = ("", "")

    def push(self, delta_text: str, delta_token_ids: Sequence[int] = ()) -> tuple[str, str]:
        self._text += delta_text
        return self._diff(final=False)

    def finish(self) -> tuple[str, str]:
        return self._diff(final=True)

    def _diff(self, *, final: bool) -> tuple[str, str]:
        reasoning, content = self._parser.split(self._text, final=final,
                                                reasoning_ended=self._reasoning_ended)
        sent_r, sent_c = self._sent
        new_r = reasoning[len(sent_r):] if reasoning.startswith(sent_r) else ""
        new_c = content[len(sent_c):] if content.startswith(sent_c) else ""
        self._sent = (sent_r + new_r, sent_c + new_c)
        return new_r, new_c
