"""vLLM's and OpenAI's response shapes, whole or streamed: what every route's has
(:class:`Format`), and completions'; chat completions' are in :mod:`.chat_format`."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from json.encoder import encode_basestring
from typing import Any, Final

from ..errors import GenoutError, RequestFailedError
from ..generate import FinishReason, FinishReasonKind
from ..parsers import ReasoningTokenCounter
from ..text.output import CollectedTextOutput, LogprobRows, Rows, TextOutput, TokenLogprob
from .errors import ApiError, error_for
from .json_encoding import dumps, dumps_text, sse_event

__all__ = ["CompletionFormat", "Format", "dumps", "engine_error", "prompt_logprobs_json",
           "sse_event", "usage"]

#: A string no output's text contains (a lone surrogate, which the text layer never makes),
#: for cutting a rendered chunk around its text.
_SPLIT: Final = "\udfff"


def usage(prompt_tokens: int, completion_tokens: int,
          reasoning_tokens: int | None = None) -> dict[str, Any]:
    """A ``usage`` object; ``reasoning_tokens`` (a chat served with a reasoning parser, as
    vLLM's): its ``completion_tokens_details``."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens, "prompt_tokens_details": None}
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return body


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
              usage: dict[str, Any] | None = None, sliced: bool = False) -> bytes | None:
        """The SSE event of a streamed output (None: nothing to send), ``chunk`` rendered,
        with ``usage`` (continuous usage stats) if given; ``sliced``: encoded a slice of
        each long list at a time (:func:`.json_encoding.dumps_in_slices`, for a large one
        rendered in a worker thread).

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
        return sse_event(chunk, sliced=sliced)

    def token(self, entry: TokenLogprob) -> str:
        """A logprob entry's token as shown."""
        return f"token_id:{entry.token_id}" if self.token_ids else entry.token

    def _plain(self, index: int) -> bool:
        """Whether choice ``index``'s next chunk of new text alone is the template's."""
        return True

    def _template(self, index: int) -> tuple[bytes, bytes]:
        chunk = self.chunk(TextOutput("", _SPLIT, []), index)
        assert chunk is not None
        rendered = dumps_text(chunk)  # a str: the marker is a lone surrogate
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
        counters = self.reasoning_counters(len(outs))
        reasoning = None if counters is None else sum(
            counter.feed(out.token_ids) for counter, out in zip(counters, outs, strict=True))
        body["usage"] = usage(self.prompt_tokens([out.usage.prompt_token_count
                                                  for out in outs]),
                              sum(out.usage.output_token_count for out in outs), reasoning)
        return body

    def reasoning_counters(self, n: int) -> list[ReasoningTokenCounter] | None:
        """A fresh counter of the reasoning tokens of each of ``n`` choices, if this
        response's usage has ``completion_tokens_details`` (a chat served with a reasoning
        parser); else None."""
        return None

    def whole_choice(self, out: CollectedTextOutput, index: int) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int,
                    reasoning_tokens: int | None = None) -> dict[str, Any]:
        body = self.envelope(self.object_chunk, [])
        body["usage"] = usage(prompt_tokens, completion_tokens, reasoning_tokens)
        if self.fingerprint is not None:
            body["system_fingerprint"] = self.fingerprint
        return body


class CompletionFormat(Format):
    """``/v1/completions`` responses. With ``echo`` each choice's text (its first chunk when
    streamed, as vLLM sends it) begins with its prompt (``decode`` gives the text of a
    token-id prompt); with ``echo`` and ``top`` its logprobs begin with the prompt's (the
    first prompt token has none), which the requests must have asked the engine for
    (``prompt_logprobs``). ``prompt_only`` (echo with ``max_tokens`` 0, vLLM's echo without
    generation): the text and logprobs are the prompt's alone, the generated token hidden
    (its finish and its count in the usage stay, as in vLLM)."""

    object_whole = object_chunk = "text_completion"

    def __init__(self, response_id: str, model: str, top: int | None, *, echo: bool = False,
                 prompt_only: bool = False,
                 n: int = 1, decode: Callable[[Sequence[int]], str] | None = None,
                 constraint: str | None = None, prompt_logprobs: bool = False,
                 token_ids: bool = False) -> None:
        super().__init__(response_id, model, top, n=n, constraint=constraint,
                         prompt_logprobs=prompt_logprobs, token_ids=token_ids)
        self._offsets: dict[int, int] = {}  # by choice index
        self._echo = echo
        self._prompt_only = prompt_only
        self._echoed: set[int] = set()  # the streamed choices whose prompt was sent
        self._decode = decode

    def _logprobs(self, parts: Sequence[Rows | str] | None,
                  index: int) -> dict[str, Any] | None:
        """``parts``: runs of logprob rows, and the text of the prompt's first token (which
        has no logprob) where it is echoed (see _echo_rows)."""
        if self.top is None or parts is None:
            return None
        offsets: list[int] = []
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offset = self._offsets.get(index, 0)
        for part in parts:
            if isinstance(part, str):
                offsets.append(offset)
                offset += len(part)
                tokens.append(part)
                values.append(None)
                tops.append(None)
                continue
            if type(part) is LogprobRows:  # from its flat lists: no entry objects made
                texts = part.tokens
                shown = [f"token_id:{i}" for i in part.token_ids] if self.token_ids else texts
                clamped = [_clamp(value) for value in part.logprobs]
                width = part.width
                # logprobs=0 shows the sampled token's entry alone, as vLLM's does.
                cols = min(self.top + 1, width)
                for base in range(0, len(texts), width or 1):
                    offsets.append(offset)
                    offset += len(texts[base])
                    tokens.append(shown[base])
                    values.append(clamped[base])
                    tops.append(dict(zip(shown[base:base + cols], clamped[base:base + cols],
                                         strict=True)))
                continue
            for row in part:
                sampled = row[0]
                offsets.append(offset)
                offset += len(sampled.token)
                tokens.append(self.token(sampled))
                values.append(_clamp(sampled.logprob))
                tops.append({self.token(e): _clamp(e.logprob) for e in row[: self.top + 1]})
        self._offsets[index] = offset
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
                "top_logprobs": tops}

    def _echo_rows(self, prompt_ids: Sequence[int] | None,
                   rows: Rows | None) -> list[Rows | str]:
        """The prompt's logprob rows, its first token's text first."""
        ids = prompt_ids or ()
        found = len(rows or ())
        if found != max(len(ids) - 1, 0):
            raise RequestFailedError(
                f"the engine sent prompt logprobs for {found} of the prompt's {len(ids)} "
                "tokens (echo with logprobs needs all but the first)")
        if not ids:
            return []
        return [self._text_of(ids[:1]), rows or ()]

    def _text_of(self, ids: Sequence[int]) -> str:
        if self._decode is None:
            raise RequestFailedError("echo of a token-id prompt needs a tokenizer")
        return self._decode(ids)

    def _prompt_text(self, prompt: str | None, ids: Sequence[int] | None) -> str:
        return prompt if prompt is not None else self._text_of(ids or ())

    def _choice(self, text: str, rows: Sequence[Rows | str] | None,
                reason: FinishReason | None, index: int) -> dict[str, Any]:
        finish, stop = self._finish(reason)
        return {"index": index, "text": text, "logprobs": self._logprobs(rows, index),
                "finish_reason": finish, "stop_reason": stop}

    def _with_prompt(self, text: str, rows: Rows | None, prompt: str | None,
                     prompt_ids: Sequence[int] | None,
                     prompt_rows: Rows | None) -> tuple[str, list[Rows | str] | None]:
        """A choice's text and logprob rows with its prompt in front (echo); the prompt's
        alone with ``prompt_only``."""
        if self._prompt_only:
            text, rows = "", None
        text = self._prompt_text(prompt, prompt_ids) + text
        if self.top is None:
            return text, None
        return text, [*self._echo_rows(prompt_ids, prompt_rows), rows or ()]

    def _plain(self, index: int) -> bool:
        return not self._echo or (index in self._echoed and not self._prompt_only)

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
        if self._prompt_only:  # nothing generated is shown (one token, with the echo)
            if not out.finished:
                return None
            out = TextOutput(out.request_id, "", [], None, out.finish_reason)
        if not out.text and not out.finished and not (out.logprobs and self.top is not None):
            return None
        return self.envelope(self.object_chunk, [self._choice(
            out.text, _parts(out.logprobs), out.finish_reason, index)])

    def whole_choice(self, out: CollectedTextOutput, index: int) -> dict[str, Any]:
        text: str = out.text
        rows = _parts(out.logprobs)
        prompt_logprobs = None
        if self._echo:
            text, rows = self._with_prompt(out.text, out.logprobs, out.prompt,
                                           out.prompt_token_ids, out.prompt_logprobs)
        if self.prompt_logprobs or (self._echo and self.top is not None):
            prompt_logprobs = prompt_logprobs_json(out.prompt_logprobs)
        choice = self._choice(text, rows, out.finish_reason, index)
        choice["prompt_logprobs"] = prompt_logprobs
        return choice


def prompt_logprobs_json(rows: Rows | None) -> list[Any]:
    """vLLM's ``prompt_logprobs`` of a choice: None for the first prompt token, then per
    token id its logprob, rank and text."""
    if type(rows) is LogprobRows:  # from its flat lists: no entry objects made
        ids, values, texts, width = rows.token_ids, rows.logprobs, rows.tokens, rows.width
        return [None, *({str(ids[base + col]): {
            "logprob": _clamp(values[base + col]), "rank": rank if col == 0 else col,
            "decoded_token": texts[base + col]} for col in range(width)}
            for base, rank in zip(range(0, len(ids), width or 1), rows.ranks, strict=True))]
    return [None, *({str(e.token_id): {"logprob": _clamp(e.logprob), "rank": e.rank,
                                       "decoded_token": e.token} for e in row}
                    for row in rows or ())]


def _clamp(logprob: float) -> float:
    """A logprob as vLLM shows it: -inf (and below -9999) as -9999.0."""
    return max(logprob, -9999.0)


def _parts(rows: Rows | None) -> list[Rows | str] | None:
    return None if rows is None else [rows]
