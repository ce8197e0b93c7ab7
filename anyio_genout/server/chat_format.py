"""The response shapes of ``/v1/chat/completions``, whole or streamed (vLLM 0.32's
``OpenAIServingChat``): the role chunk, echo, logprobs as chat shows them, the parsed
reasoning and tool calls, and the usage's reasoning tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..parsers import ReasoningTokenCounter
from ..text.output import CollectedTextOutput, LogprobRows, Rows, TextOutput, TokenLogprob
from .formats import Format, prompt_logprobs_json
from .tools import ChatParsing, ChatStream, tool_call_json, tool_delta_json

__all__ = ["ChatFormat"]


class ChatFormat(Format):
    """``/v1/chat/completions`` responses; with ``echo_text`` (chat ``echo``) each answer
    begins with it (a chunk of its own after the role's, when streamed, as vLLM sends it).
    With ``parsing`` the output is read for reasoning and tool calls (``message.reasoning``
    and ``message.tool_calls``; streamed, ``delta.reasoning`` and ``delta.tool_calls``
    pieces), each streamed choice through its own parser state. ``role`` is the answer's
    (``message.role``, the first chunk's ``delta.role``): vLLM's ``get_chat_request_role``.
    ``token_id`` (a token's id in the vocabulary) lets the usage count reasoning tokens.
    """

    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, response_id: str, model: str, top: int | None, *,
                 constraint: str | None = None, prompt_logprobs: bool = False,
                 token_ids: bool = False, echo_text: str | None = None,
                 parsing: ChatParsing | None = None, role: str = "assistant",
                 token_id: Callable[[str], int | None] | None = None) -> None:
        super().__init__(response_id, model, top, constraint=constraint,
                         prompt_logprobs=prompt_logprobs, token_ids=token_ids)
        self.role = role
        self._echo_text = echo_text or ""
        self._parsing = parsing
        self._parse_streams: dict[int, ChatStream] = {}  # by choice index
        if parsing is not None and parsing.hide_logprobs:
            self.top = None  # hidden reasoning hides the logprobs too, as vLLM's do
        self._token_id = token_id

    def reasoning_counters(self, n: int) -> list[ReasoningTokenCounter] | None:
        """See :meth:`Format.reasoning_counters`: vLLM's usage has the reasoning tokens when
        it serves a reasoning parser; counted by the request's, over the vocabulary
        ``token_id`` looks its markers up in (none if they are not single tokens)."""
        parsing, token_id = self._parsing, self._token_id
        reasoning = None if parsing is None else parsing.parser.reasoning
        if reasoning is None or token_id is None:
            return None
        counters = [reasoning.token_counter(token_id) for _ in range(n)]
        return [c for c in counters if c is not None] if all(counters) else None

    def _plain(self, index: int) -> bool:
        return self._parsing is None

    def _entry(self, entry: TokenLogprob) -> dict[str, Any]:
        token = self.token(entry)
        return {"token": token, "logprob": entry.logprob, "bytes": list(token.encode("utf-8"))}

    def _logprobs(self, rows: Rows | None) -> dict[str, Any] | None:
        if self.top is None or rows is None:
            return None
        if type(rows) is LogprobRows:  # from its flat lists: no entry objects made
            width, cols = rows.width, min(self.top + 1, rows.width)
            shown = [f"token_id:{i}" for i in rows.token_ids] if self.token_ids \
                else rows.tokens
            content = []
            for base in range(0, len(shown), width or 1):
                entries = [{"token": token, "logprob": value,
                            "bytes": list(token.encode("utf-8"))}
                           for token, value in zip(shown[base:base + cols],
                                                   rows.logprobs[base:base + cols],
                                                   strict=True)]
                content.append({**entries[0], "top_logprobs": entries[1:]})
            return {"content": content}
        return {"content": [{**self._entry(row[0]),
                             "top_logprobs": [self._entry(e) for e in row[1: self.top + 1]]}
                            for row in rows]}

    def first_chunks(self, n: int) -> list[dict[str, Any]]:
        first = [self.envelope(self.object_chunk, [
            {"index": i, "delta": {"role": self.role, "content": ""}, "logprobs": None,
             "finish_reason": None}]) for i in range(n)]
        if self._echo_text:
            first += [self.envelope(self.object_chunk, [
                {"index": i, "delta": {"content": self._echo_text}, "logprobs": None,
                 "finish_reason": None}]) for i in range(n)]
        return first

    def whole(self, outs: list[CollectedTextOutput]) -> dict[str, Any]:
        """See :meth:`Format.whole`; with ``prompt_logprobs``, vLLM's top-level
        ``prompt_logprobs`` (the first choice's prompt)."""
        body = super().whole(outs)
        if self.prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs_json(outs[0].prompt_logprobs) if outs \
                else None
        return body

    def chunk(self, out: TextOutput, index: int) -> dict[str, Any] | None:
        if self._parsing is not None:
            return self._parsed_chunk(out, index, self._parsing)
        if not out.text and not out.finished and not (out.logprobs and self.top is not None):
            return None
        finish, stop = self._finish(out.finish_reason)
        choice = {"index": index, "delta": {"content": out.text} if out.text else {},
                  "logprobs": self._logprobs(out.logprobs), "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop
        return self.envelope(self.object_chunk, [choice])

    def _parsed_chunk(self, out: TextOutput, index: int, parsing: ChatParsing
                      ) -> dict[str, Any] | None:
        """A streamed chunk through the choice's parser state: only what it lets out (a
        marker is held back until it is whole); ``finish_reason`` ``tool_calls`` once a
        call was sent (vLLM's rule: auto and required; a named function keeps stop)."""
        stream = self._parse_streams.get(index)
        if stream is None:
            stream = self._parse_streams[index] = parsing.stream()
        finish, stop = self._finish(out.finish_reason)
        found = stream.delta(out.text, out.token_ids, out.prompt, last=finish is not None)
        logprobs = self._logprobs(out.logprobs)
        if found is None and finish is None and logprobs is None:
            return None
        delta: dict[str, Any] = {}
        if found is not None:
            if found.reasoning:
                delta["reasoning"] = found.reasoning
            if found.content:
                delta["content"] = found.content
            if found.tool_calls:
                delta["tool_calls"] = tool_delta_json(found.tool_calls)
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish}
        if finish is not None:
            choice["finish_reason"] = parsing.finish_reason(finish, called=stream.called)
            choice["stop_reason"] = stop
        return self.envelope(self.object_chunk, [choice])

    def whole_choice(self, out: CollectedTextOutput, index: int) -> dict[str, Any]:
        finish, stop = self._finish(out.finish_reason)
        parsing = self._parsing
        if parsing is None:
            return {"index": index, "message": {"role": self.role,
                                                "content": self._echo_text + out.text},
                    "logprobs": self._logprobs(out.logprobs), "finish_reason": finish,
                    "stop_reason": stop}
        parsed = parsing.whole(out.text, out.prompt)
        content = parsed.content
        if self._echo_text:
            content = self._echo_text + (content or "")
        message: dict[str, Any] = {"role": self.role, "content": content}
        if parsing.shows_reasoning_field:
            message["reasoning"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [tool_call_json(call) for call in parsed.tool_calls]
        return {"index": index, "message": message, "logprobs": self._logprobs(out.logprobs),
                "finish_reason": parsing.finish_reason(  # required: whatever it holds
                    finish, called=bool(parsed.tool_calls) or parsing.mode == "required"),
                "stop_reason": stop}
