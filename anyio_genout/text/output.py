"""What a text generation yields: per-step :class:`TextOutput` deltas and the collected whole."""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterator, Sequence
from typing import overload

import attrs

from ..errors import IncompleteStreamError
from ..generate import FinishReason, TokenUsage

__all__ = ["CollectedTextOutput", "LogprobRows", "Rows", "TextOutput", "TokenLogprob",
           "collect_text", "merge_outputs"]


@attrs.frozen
class TokenLogprob:
    """One candidate token at one position: its id, logprob, rank (1 = most likely) and its
    text as vLLM's logprobs show it (the token's own string, e.g. ``"Ġtime"`` decoded to
    ``" time"``; ``""`` with ``detokenize=False``)."""

    token_id: int
    logprob: float
    rank: int
    token: str


#: Logprob rows as outputs give them: one list per position, its token first, then the top
#: ones (a :class:`LogprobRows` from the text layer; any sequence of such lists is taken).
Rows = Sequence[list[TokenLogprob]]


class LogprobRows(Sequence[list[TokenLogprob]]):
    """Logprob rows held flat: ``width`` entries per row (the row's token first, then the
    top ones), as four flat lists of plain values rather than an object per entry. A row is
    made (a list of :class:`TokenLogprob`) as it is read.

    A whole response of 16 choices of 4,000 tokens with 20 logprobs each holds 1.3 million
    entries: as objects, each of the collector's full passes walked them all while the
    event loop waited. Plain ints, floats and strings in a list are not tracked by it.

    ``token_ids``, ``logprobs`` and ``tokens`` are row after row (``width`` items each);
    ``ranks`` the rank of each row's token (the top ones' rank is their place, 1 first).
    Equal to any sequence of the same rows. Read-only by convention, as outputs are.
    """

    __slots__ = ("logprobs", "ranks", "token_ids", "tokens", "width")

    def __init__(self, width: int, token_ids: list[int], logprobs: list[float],
                 ranks: list[int], tokens: list[str]) -> None:
        self.width = width
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.ranks = ranks
        self.tokens = tokens

    @classmethod
    def join(cls, parts: Sequence[Rows]) -> Rows:
        """The rows of ``parts`` one after another: a :class:`LogprobRows` when every part
        that has rows is one, all of the same width; else a list of the rows."""
        kept = [part for part in parts if part]
        flat = [part for part in kept if type(part) is LogprobRows]
        if not kept:
            return parts[0] if parts else []
        if len(flat) != len(kept) or any(part.width != flat[0].width for part in flat):
            return [row for part in kept for row in part]
        if len(flat) == 1:
            return flat[0]
        joined = LogprobRows(flat[0].width, [], [], [], [])
        for part in flat:
            joined.token_ids += part.token_ids
            joined.logprobs += part.logprobs
            joined.ranks += part.ranks
            joined.tokens += part.tokens
        return joined

    def __len__(self) -> int:
        return len(self.ranks)

    def __add__(self, other: Rows) -> Rows:  # the rows were lists: + joins them as before
        return LogprobRows.join([self, other])

    def __radd__(self, other: Rows) -> Rows:
        return LogprobRows.join([other, self])

    @overload
    def __getitem__(self, index: int) -> list[TokenLogprob]: ...
    @overload
    def __getitem__(self, index: slice) -> LogprobRows: ...

    def __getitem__(self, index: int | slice) -> list[TokenLogprob] | LogprobRows:
        rows = range(len(self.ranks))[index]  # IndexError as a list's, negative indices
        if isinstance(rows, range):
            return self._rows(rows)
        return self._row(rows)

    def __iter__(self) -> Iterator[list[TokenLogprob]]:
        for row in range(len(self.ranks)):
            yield self._row(row)

    def _row(self, row: int) -> list[TokenLogprob]:
        width = self.width
        base = row * width
        ids, values, tokens = self.token_ids, self.logprobs, self.tokens
        return [TokenLogprob(ids[base + col], values[base + col],
                             self.ranks[row] if col == 0 else col, tokens[base + col])
                for col in range(width)]

    def _rows(self, rows: range) -> LogprobRows:
        width = self.width
        if rows.step == 1:
            start, stop = rows.start * width, max(rows.stop, rows.start) * width
            return LogprobRows(width, self.token_ids[start:stop], self.logprobs[start:stop],
                               self.ranks[rows.start:max(rows.stop, rows.start)],
                               self.tokens[start:stop])
        picked = [col + row * width for row in rows for col in range(width)]
        return LogprobRows(width, [self.token_ids[i] for i in picked],
                           [self.logprobs[i] for i in picked], [self.ranks[r] for r in rows],
                           [self.tokens[i] for i in picked])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LogprobRows):
            return (len(self) == len(other) and (not self.ranks or self.width == other.width)
                    and self.ranks == other.ranks and self.token_ids == other.token_ids
                    and self.logprobs == other.logprobs and self.tokens == other.tokens)
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"LogprobRows({list(self)!r})"


@attrs.define(eq=False, slots=True)
class TextOutput:
    """One step of a text generation, or several merged (coalescing, docs/lifecycle.md):
    what is new since the previous output (a delta).

    ``text`` is the new text (stop-string hold-back applied: characters that might begin a
    stop string come later, or never); ``token_ids`` the new tokens (cut after the token that
    completed a stop string); ``logprobs``, when asked for, one list per new token: the
    sampled token first, then the top ones. ``finish_reason`` is set on the terminal output
    only: on a stop-string match it is STOP with the matched string as ``stop_reason``.
    ``prompt`` (the prompt text, or the rendered chat template; None for a token-id prompt)
    and ``prompt_token_ids`` come with the first output only, and so do ``prompt_logprobs``
    when the request's ``sampling_params.prompt_logprobs`` asked for them: one list per
    prompt position but the first (which has none), the prompt's token first, then the top
    ones. ``request_id`` is the id the engine knows the request by (as in
    :class:`~anyio_genout.GenerateOutput`).
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: Rows | None = None
    finish_reason: FinishReason | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    cached_token_count: int = 0
    prompt_logprobs: Rows | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@attrs.frozen(eq=False)
class CollectedTextOutput:
    """A whole text generation, gathered by :func:`collect_text`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: TokenUsage
    logprobs: Rows | None = None
    prompt_logprobs: Rows | None = None


def merge_outputs(outputs: Sequence[TextOutput]) -> TextOutput:
    """Consecutive outputs of one stream as one delta: texts, tokens and logprobs joined, the
    prompt fields of the first, the finish of the last (what a consumer that fell behind
    delivers at once, as vLLM's output collector merges what its consumer has not taken).

    Raises:
        ValueError: ``outputs`` is empty.
    """
    if len(outputs) == 1:
        return outputs[0]
    if not outputs:
        raise ValueError("no outputs to merge")
    first, last = outputs[0], outputs[-1]
    tokens = [t for out in outputs for t in out.token_ids]
    logprobs = None
    if any(out.logprobs is not None for out in outputs):
        logprobs = LogprobRows.join([out.logprobs for out in outputs
                                     if out.logprobs is not None])
    return TextOutput(first.request_id, "".join(out.text for out in outputs), tokens,
                      logprobs, last.finish_reason, first.prompt_token_ids, first.prompt,
                      first.cached_token_count, first.prompt_logprobs)


async def collect_text(outputs: AsyncIterable[TextOutput]) -> CollectedTextOutput:
    """Gather every output of one text generation; the first error is raised as it arrives.

    Raises:
        IncompleteStreamError: the outputs ended without a terminal output (e.g. the stream
            was closed or cancelled first).
        OperationalError: what the stream raises (see :class:`TextStream`).
    """
    request_id: str | None = None
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    texts: list[str] = []
    tokens: list[int] = []
    logprobs: list[Rows] | None = None  # joined at the end
    prompt_logprobs: Rows | None = None
    cached = 0
    async for out in outputs:
        if request_id is None:
            request_id = out.request_id
        if prompt_ids is None and out.prompt_token_ids is not None:
            prompt_ids = out.prompt_token_ids
            prompt = out.prompt
            prompt_logprobs = out.prompt_logprobs
        texts.append(out.text)
        tokens.extend(out.token_ids)
        if out.logprobs is not None:
            if logprobs is None:
                logprobs = []
            logprobs.append(out.logprobs)
        cached = max(cached, out.cached_token_count)
        if out.finish_reason is None:
            continue
        prompt_ids = prompt_ids or ()
        return CollectedTextOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_ids,
            text="".join(texts),
            token_ids=tokens,
            finish_reason=out.finish_reason,
            usage=TokenUsage(len(prompt_ids), len(tokens), cached),
            logprobs=None if logprobs is None else LogprobRows.join(logprobs),
            prompt_logprobs=prompt_logprobs,
        )
    raise IncompleteStreamError(
        f"request {request_id or '?'}: the stream ended before its terminal output")
