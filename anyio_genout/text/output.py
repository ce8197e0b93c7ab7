"""What a text generation yields: per-step :class:`TextOutput` deltas and the collected whole."""

from __future__ import annotations

from collections.abc import AsyncIterable, Sequence

import attrs

from ..errors import IncompleteStreamError
from ..generate import FinishReason, TokenUsage

__all__ = ["CollectedTextOutput", "TextOutput", "TokenLogprob", "collect_text", "merge_outputs"]


@attrs.frozen
class TokenLogprob:
    """One candidate token at one position: its id, logprob, rank (1 = most likely) and its
    text as vLLM's logprobs show it (the token's own string, e.g. ``"Ġtime"`` decoded to
    ``" time"``; ``""`` with ``detokenize=False``)."""

    token_id: int
    logprob: float
    rank: int
    token: str


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
    logprobs: list[list[TokenLogprob]] | None = None
    finish_reason: FinishReason | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    cached_token_count: int = 0
    prompt_logprobs: list[list[TokenLogprob]] | None = None

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
    logprobs: list[list[TokenLogprob]] | None = None
    prompt_logprobs: list[list[TokenLogprob]] | None = None


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
        logprobs = [row for out in outputs for row in (out.logprobs or ())]
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
    logprobs: list[list[TokenLogprob]] | None = None
    prompt_logprobs: list[list[TokenLogprob]] | None = None
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
            logprobs.extend(out.logprobs)
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
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    raise IncompleteStreamError(
        f"request {request_id or '?'}: the stream ended before its terminal output")
