"""vLLM's and OpenAI's response shapes: completions and chat completions, whole or streamed."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from json.encoder import encode_basestring
from typing import Any, Final

from ..errors import GenoutError, RequestFailedError
from ..generate import FinishReason, FinishReasonKind
from ..text.output import CollectedTextOutput, TextOutput, TokenLogprob
from .errors import ApiError, error_for
from .tools import ChatParsing, ChatStream, tool_call_json, tool_delta_json

__all__ = ["ChatFormat", "CompletionFormat", "Format", "dumps", "engine_error", "sse_event",
           "usage"]

#: A string no output's text contains (a lone surrogate, which the text layer never makes),
#: for cutting a rendered chunk around its text.
_SPLIT: Final = "\udfff"


def dumps(value: Any) -> bytes:
    """``value`` as compact JSON, non-ASCII characters as they are (as vLLM sends them)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def sse_event(value: Any) -> bytes:
    """One server-sent event carrying ``value`` as JSON."""
    return b"data: " + dumps(value) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


def engine_error(constraint: str | None) -> RequestFailedError:
    """What a request the engine ended with finish reason ``error`` fails with (vLLM's server
    answers 500 too): for one with a structured-output constraint (``constraint`` names
    its field), that the engine could not apply it."""
    if constraint is None:
        return RequestFailedError("the engine ended the request with an error (finish "
                                  "reason error)")
    return RequestFailedError(
        f"the engine ended the request with an error: it could not apply the structured "
        f"outputs constraint of {constraint} (an engine without structured outputs support, "
        f"such as the mock engine or vLLM started with --skip-tokenizer-init, refuses every "
        f"one; vLLM also refuses a regex or grammar it cannot compile)")


class Format:
    """What one route's responses look like; ``top`` is how many alternatives to show.

    ``n`` is the number of choices per prompt when a request has several prompts (choice
    ``index`` = prompt index * n + i); None: every choice has the one prompt.
    """

    object_whole = ""
    object_chunk = ""
    #: vLLM's ``param`` for a library field named by an error of this route's requests.
    params: Mapping[str, str] = {"prompt_token_ids": "input_tokens"}

    def __init__(self, response_id: str, model: str, top: int | None, *,
                 n: int | None = None, constraint: str | None = None,
                 prompt_logprobs: bool = False, token_ids: bool = False) -> None:
        self.id = response_id
        #: Whether the whole response shows the prompt's logprobs.
        self.prompt_logprobs = prompt_logprobs
        #: Logprob tokens as ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``).
        self.token_ids = token_ids
        self.model = model
        self.top = top
        self.n = n
        #: The field of the request's structured-output constraint, if it has one.
        self.constraint = constraint
        self.created = int(time.time())
        self._templates: dict[int, tuple[bytes, bytes]] = {}
        #: The server's ``system_fingerprint`` (None: none is sent); see :meth:`stamp`.
        self.fingerprint: str | None = None
        #: The fingerprint streamed chunks with a finish reason carry (None: none do).
        self._terminal_fingerprint: str | None = None

    def stamp(self, fingerprint: str | None, *, include_usage: bool) -> None:
        """Send ``fingerprint`` (the server's, a constant) as vLLM 0.32 does: on the whole
        response; streamed, on each chunk with a finish reason, or with ``include_usage``
        on the usage chunk alone. No other chunk carries it: the chunks of new text alone
        (:meth:`event`'s templates) never have a finish reason."""
        self.fingerprint = fingerprint
        self._terminal_fingerprint = None if include_usage else fingerprint

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def first_chunks(self, n: int) -> list[dict[str, Any]]:
        return []

    def api_error(self, exc: GenoutError) -> ApiError:
        """The HTTP answer to ``exc`` (:func:`~.errors.error_for`), its ``param`` named as
        vLLM names it on this route (a prompt too long for the context: ``input_tokens``;
        a logprobs count above the engines' limit: ``logprobs`` on both routes, chat's
        ``top_logprobs`` too, as vLLM's SamplingParams names it)."""
        error = error_for(exc)
        if error.param is not None and error.param in self.params:
            error.param = self.params[error.param]
        return error

    def _finish(self, reason: FinishReason | None) -> tuple[str | None, int | str | None]:
        """``finish_reason`` and ``stop_reason`` of a choice; raises RequestFailedError
        (:func:`engine_error`) for finish reason ``error``: such a response is never 200."""
        if reason is None:
            return None, None
        if reason.kind is FinishReasonKind.ERROR:
            raise engine_error(self.constraint)
        stop = reason.stop_reason
        return reason.kind.value, stop if isinstance(stop, int | str) else None

    def chunk(self, out: TextOutput, index: int) -> dict[str, Any] | None:
        raise NotImplementedError

    def event(self, out: TextOutput, index: int, *,
              usage: dict[str, Any] | None = None) -> bytes | None:
        """The SSE event of a streamed output (None: nothing to send), ``chunk`` rendered,
        with ``usage`` (continuous usage stats) if given.

        Most events carry new text alone (no finish, no logprobs, no echo due): those are
        the choice's chunk rendered once with a marker for its text, the text's JSON
        spliced in, the same bytes as rendering the chunk, at a fraction of the cost.

        Raises what :meth:`chunk` raises.
        """
        if (usage is None and out.text and out.finish_reason is None and out.logprobs is None
                and self._plain(index)):
            template = self._templates.get(index)
            if template is None:
                template = self._templates[index] = self._template(index)
            return template[0] + encode_basestring(out.text).encode() + template[1]
        chunk = self.chunk(out, index)
        if chunk is None:
            return None
        if out.finish_reason is not None and self._terminal_fingerprint is not None:
            chunk["system_fingerprint"] = self._terminal_fingerprint
        if usage is not None:
            chunk["usage"] = usage
        return sse_event(chunk)

    def token(self, entry: TokenLogprob) -> str:
        """A logprob entry's token as shown."""
        return f"token_id:{entry.token_id}" if self.token_ids else entry.token

    def _plain(self, index: int) -> bool:
        """Whether choice ``index``'s next chunk of new text alone is the template's."""
        return True

    def _template(self, index: int) -> tuple[bytes, bytes]:
        chunk = self.chunk(TextOutput("", _SPLIT, []), index)
        assert chunk is not None
        rendered = json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
        # The text is the chunk's last string: what precedes it (a model name) cannot fool
        # the cut.
        before, marker, after = rendered.rpartition(encode_basestring(_SPLIT))
        assert marker, "the text marker was not rendered"
        return b"data: " + before.encode(), after.encode() + b"\n\n"

    def prompt_tokens(self, counts: Sequence[int]) -> int:
        """The usage's prompt tokens, given each choice's prompt length (by index): each
        prompt counts once, however many choices it has."""
        if not counts:
            return 0
        return counts[0] if self.n is None else sum(counts[::self.n])

    def whole(self, outs: list[CollectedTextOutput]) -> dict[str, Any]:
        """The whole response of ``outs``, one choice each (by index); the usage counts each
        prompt once and the completions of all.

        Raises RequestFailedError if the engine's output cannot be shown (see the route's
        format)."""
        body = self.envelope(self.object_whole, [self.whole_choice(out, i)
                                                 for i, out in enumerate(outs)])
        if self.fingerprint is not None:  # before usage, as vLLM's field order
            body["system_fingerprint"] = self.fingerprint
        body["usage"] = usage(self.prompt_tokens([out.usage.prompt_token_count
                                                  for out in outs]),
                              sum(out.usage.output_token_count for out in outs))
        return body

    def whole_choice(self, out: CollectedTextOutput, index: int) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        body = self.envelope(self.object_chunk, [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        if self.fingerprint is not None:
            body["system_fingerprint"] = self.fingerprint
        return body


#: A logprob row of a completion; a string for the prompt's first token (echo with
#: logprobs): its text, which has no logprob.
_Row = list[TokenLogprob] | str


class CompletionFormat(Format):
    """``/v1/completions`` responses. With ``echo`` each choice's text (its first chunk when
    streamed, as vLLM sends it) begins with its prompt (``decode`` gives the text of a
    token-id prompt); with ``echo`` and ``top`` its logprobs begin with the prompt's (the
    first prompt token has none), which the requests must have asked the engine for
    (``prompt_logprobs``)."""

    object_whole = object_chunk = "text_completion"

    def __init__(self, response_id: str, model: str, top: int | None, *, echo: bool = False,
                 n: int = 1, decode: Callable[[Sequence[int]], str] | None = None,
                 constraint: str | None = None, prompt_logprobs: bool = False,
                 token_ids: bool = False) -> None:
        super().__init__(response_id, model, top, n=n, constraint=constraint,
                         prompt_logprobs=prompt_logprobs, token_ids=token_ids)
        self._offsets: dict[int, int] = {}  # by choice index
        self._echo = echo
        self._echoed: set[int] = set()  # the streamed choices whose prompt was sent
        self._decode = decode

    def _logprobs(self, rows: Sequence[_Row] | None, index: int) -> dict[str, Any] | None:
        if self.top is None or rows is None:
            return None
        offsets: list[int] = []
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offset = self._offsets.get(index, 0)
        for row in rows:
            if isinstance(row, str):  # the prompt's first token (see _echo_rows)
                offsets.append(offset)
                offset += len(row)
                tokens.append(row)
                values.append(None)
                tops.append(None)
                continue
            sampled = row[0]
            offsets.append(offset)
            offset += len(sampled.token)
            tokens.append(self.token(sampled))
            values.append(max(sampled.logprob, -9999.0))  # -inf as vLLM shows it
            # logprobs=0 shows the sampled token's entry alone, as vLLM's does.
            tops.append({self.token(e): max(e.logprob, -9999.0) for e in row[: self.top + 1]})
        self._offsets[index] = offset
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
                "top_logprobs": tops}

    def _echo_rows(self, prompt_ids: Sequence[int] | None,
                   rows: list[list[TokenLogprob]] | None) -> list[_Row]:
        """The prompt's logprob rows, its first token's text first."""
        ids = prompt_ids or ()
        found = len(rows or ())
        if found != max(len(ids) - 1, 0):
            raise RequestFailedError(
                f"the engine sent prompt logprobs for {found} of the prompt's {len(ids)} "
                "tokens (echo with logprobs needs all but the first)")
        if not ids:
            return []
        return [self._text_of(ids[:1]), *(rows or ())]

    def _text_of(self, ids: Sequence[int]) -> str:
        if self._decode is None:
            raise RequestFailedError("echo of a token-id prompt needs a tokenizer")
        return self._decode(ids)

    def _prompt_text(self, prompt: str | None, ids: Sequence[int] | None) -> str:
        return prompt if prompt is not None else self._text_of(ids or ())

    def _choice(self, text: str, rows: Sequence[_Row] | None,
                reason: FinishReason | None, index: int) -> dict[str, Any]:
        finish, stop = self._finish(reason)
        return {"index": index, "text": text, "logprobs": self._logprobs(rows, index),
                "finish_reason": finish, "stop_reason": stop}

    def _with_prompt(self, text: str, rows: list[list[TokenLogprob]] | None,
                     prompt: str | None, prompt_ids: Sequence[int] | None,
                     prompt_rows: list[list[TokenLogprob]] | None) -> tuple[str, list[_Row] | None]:
        """A choice's text and logprob rows with its prompt in front (echo)."""
        text = self._prompt_text(prompt, prompt_ids) + text
        if self.top is None:
            return text, None
        return text, [*self._echo_rows(prompt_ids, prompt_rows), *(rows or ())]

    def _plain(self, index: int) -> bool:
        return not self._echo or index in self._echoed

    def chunk(self, out: TextOutput, index: int) -> dict[str, Any] | None:
        """Raises RequestFailedError (echo with logprobs) if the engine's prompt logprobs
        do not cover the prompt."""
        if self._echo and index not in self._echoed:
            self._echoed.add(index)
            text, rows = self._with_prompt(out.text, out.logprobs, out.prompt,
                                           out.prompt_token_ids, out.prompt_logprobs)
            choice = self._choice(text, rows, out.finish_reason, index)
            # vLLM's echo chunk carries the prompt's ids (its first chunk of each choice).
            choice["prompt_token_ids"] = list(out.prompt_token_ids or ())
            return self.envelope(self.object_chunk, [choice])
        if not out.text and not out.finished and not (out.logprobs and self.top is not None):
            return None
        return self.envelope(self.object_chunk,
                             [self._choice(out.text, out.logprobs, out.finish_reason, index)])

    def whole_choice(self, out: CollectedTextOutput, index: int) -> dict[str, Any]:
        text: str = out.text
        rows: Sequence[_Row] | None = out.logprobs
        prompt_logprobs = None
        if self._echo:
            text, rows = self._with_prompt(out.text, out.logprobs, out.prompt,
                                           out.prompt_token_ids, out.prompt_logprobs)
        if self.prompt_logprobs or (self._echo and self.top is not None):
            prompt_logprobs = _prompt_logprobs(out.prompt_logprobs)
        choice = self._choice(text, rows, out.finish_reason, index)
        choice["prompt_logprobs"] = prompt_logprobs
        return choice


def _prompt_logprobs(rows: list[list[TokenLogprob]] | None) -> list[Any]:
    """vLLM's ``prompt_logprobs`` of a choice: None for the first prompt token, then per
    token id its logprob, rank and text."""
    return [None, *({str(e.token_id): {"logprob": max(e.logprob, -9999.0), "rank": e.rank,
                                       "decoded_token": e.token} for e in row}
                    for row in rows or ())]


class ChatFormat(Format):
    """``/v1/chat/completions`` responses; with ``echo_text`` (chat ``echo``) each answer
    begins with it (a chunk of its own after the role's, when streamed, as vLLM sends it).
    With ``parsing`` the output is read for reasoning and tool calls (``message.reasoning``
    and ``message.tool_calls``; streamed, ``delta.reasoning`` and ``delta.tool_calls``
    pieces), each streamed choice through its own parser state. ``role`` is the answer's
    (``message.role``, the first chunk's ``delta.role``): vLLM's ``get_chat_request_role``.
    """

    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(self, response_id: str, model: str, top: int | None, *,
                 constraint: str | None = None, prompt_logprobs: bool = False,
                 token_ids: bool = False, echo_text: str | None = None,
                 parsing: ChatParsing | None = None, role: str = "assistant") -> None:
        super().__init__(response_id, model, top, constraint=constraint,
                         prompt_logprobs=prompt_logprobs, token_ids=token_ids)
        self.role = role
        self._echo_text = echo_text or ""
        self._parsing = parsing
        self._parse_streams: dict[int, ChatStream] = {}  # by choice index
        if parsing is not None and parsing.hide_logprobs:
            self.top = None  # hidden reasoning hides the logprobs too, as vLLM's do

    def _plain(self, index: int) -> bool:
        return self._parsing is None

    def _entry(self, entry: TokenLogprob) -> dict[str, Any]:
        token = self.token(entry)
        return {"token": token, "logprob": entry.logprob, "bytes": list(token.encode("utf-8"))}

    def _logprobs(self, rows: list[list[TokenLogprob]] | None) -> dict[str, Any] | None:
        if self.top is None or rows is None:
            return None
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
            body["prompt_logprobs"] = _prompt_logprobs(outs[0].prompt_logprobs) if outs \
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
