"""Scheduler state of one mock request, and vLLM's stop rules for its output tokens.

A :class:`Request` is built when an ADD arrives (``Scheduler._new_request``) and is read and
written in place by the step's hot loop, so it is a plain mutable record. ``prefix`` and
``mid`` are its pre-packed row bytes (see :mod:`.wire`); ``plain`` and ``fast_end`` say
whether, and up to which output, its rows may take that fast path (:func:`set_plain`).
"""

from __future__ import annotations

from typing import Final

import attrs

from ..protocol import EngineCoreFinishReason

__all__ = ["Request", "check_stop", "set_plain"]

_STOP: Final = int(EngineCoreFinishReason.STOP)
_LENGTH: Final = int(EngineCoreFinishReason.LENGTH)


@attrs.define(eq=False)
class Request:
    """Scheduler state of one request (mutable; the hot loop reads it directly)."""

    rid: str
    client: int
    prompt: list[int]
    key: int
    greedy: bool
    limit: int  # output length at which LENGTH fires (max_tokens / max_model_len)
    eos: int | None
    stops: frozenset[int]  # stop_token_ids (STOP with stop_reason)
    checks: frozenset[int]  # stops plus EOS: any of these ends the fast path
    all_stop: frozenset[int]  # held back by min_tokens
    min_tokens: int
    logprobs: int | None
    prompt_logprobs: int | None
    allowed: list[int] | None
    trace: dict[str, str] | None
    cache_salt: str | None
    oov: bool
    prefix: bytes  # packed row header and request id
    mid: bytes  # packed fields after new_token_ids of a plain row
    alive: bool = True
    num_out: int = 0
    buf: list[int] = attrs.Factory(list)
    buf_start: int = 0
    buf_end: int = 0
    events: list[tuple[int, float]] | None = None
    prefill: dict[str, int] | None = None
    want_prompt_logprobs: bool = False
    scheduled_once: bool = False
    plain: bool = False  # the next row may take the fast path (no logprobs or events)
    fast_end: int = 0  # fast path while num_out < fast_end (plain, buffered, not last)
    num_preemptions: int = 0
    late: int = 0  # outputs still owed after an ABORT (fault injection)
    offset: int = 0  # stream position of output 0 (a greedy continuation: greedy_continuations)
    bad_words: tuple[tuple[int, ...], ...] = ()  # bad_words_token_ids (banned as vLLM does)
    bad_tail: list[int] = attrs.Factory(list)  # with bad_words: the last outputs before buf


def set_plain(r: Request, plain: bool) -> None:
    r.plain = plain
    r.fast_end = min(r.buf_end, r.limit - 1) if plain else 0


def check_stop(r: Request, tok: int, n: int) -> tuple[int | None, int | None]:
    """vLLM's ``check_stop`` for the ``n``-th output token ``tok``."""
    if tok == r.eos:
        return _STOP, None
    if tok in r.stops:
        return _STOP, tok
    if n >= r.limit:
        return _LENGTH, None
    return None, None
