"""Multi-token stop sequences, matched on the client across engine steps.

The engine only stops on single tokens. A stop sequence can straddle step boundaries, so
the matcher keeps the last ``longest - 1`` tokens of the previous steps.

``min_tokens`` applies as vLLM applies it to stop strings (``vllm/v1/engine/detokenizer.py``:
``check_stop_strings`` only searches the text after the first ``min_tokens`` tokens) and to
stop token ids (masked until ``min_tokens`` tokens exist): a sequence counts only if its last
token comes after the first ``min_tokens`` output tokens; it may begin within them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..protocol import Logprobs, SamplingMask
from .abort_cause import AbortCause
from .output import FinishReason, StopReason

__all__ = ["StopSequenceMatcher", "cut_at_stop"]


class _Closable(Protocol):
    def close(self, cause: AbortCause | None = None) -> None: ...


def cut_at_stop(stream: _Closable, keep: int, stop_reason: StopReason, tokens: list[int],
                logprobs: Logprobs | None = None, mask: SamplingMask | None = None
                ) -> tuple[list[int], Logprobs | None, SamplingMask | None, FinishReason]:
    """The one stop cut, for a stop token sequence (this layer) or a stop string (the text
    layer) matched in an output: keep its first ``keep`` tokens (and their logprobs and
    sampling-mask rows), close ``stream`` with :attr:`AbortCause.STOP_STRING_MATCHED` (one
    ABORT if the request is live; the metrics count the finish as "stop" either way), and
    finish with ``FinishReason.stop(stop_reason)``. Raises nothing.
    """
    if keep < len(tokens):
        tokens = tokens[:keep]
        if logprobs is not None:
            logprobs = Logprobs(logprobs.token_ids[:keep], logprobs.logprobs[:keep],
                                logprobs.ranks[:keep])
        if mask is not None and mask.offsets is not None:
            # Rows stay aligned with the kept tokens (a one-row mask is never cut: a match
            # keeps at least one token).
            mask = SamplingMask(mask.token_ids[:int(mask.offsets[keep])],
                                mask.offsets[:keep + 1])
    stream.close(AbortCause.STOP_STRING_MATCHED)
    return tokens, logprobs, mask, FinishReason.stop(stop_reason)


class StopSequenceMatcher:
    """Finds the first stop sequence whose last token is output token ``min_tokens + 1`` or
    later (counting from 1); the earliest end wins, then the order of ``sequences``."""

    __slots__ = ("_count", "_longest", "_min_tokens", "_sequences", "_tail")

    def __init__(self, sequences: Sequence[Sequence[int]], min_tokens: int = 0) -> None:
        self._sequences = [tuple(s) for s in sequences if s]
        self._longest = max((len(s) for s in self._sequences), default=0)
        self._tail: list[int] = []
        self._min_tokens = min_tokens
        self._count = 0

    def feed(self, tokens: Sequence[int]) -> tuple[int, tuple[int, ...]] | None:
        """Feed one step's tokens; on a match return (tokens of this step to keep, sequence).

        The kept count includes the matched sequence's last token; tokens after it in the
        same step are dropped.
        """
        window = self._tail
        for i, token in enumerate(tokens):
            window.append(token)
            self._count += 1
            if self._count <= self._min_tokens:
                continue  # like vLLM: no stop within the first min_tokens tokens
            for seq in self._sequences:
                n = len(seq)
                if len(window) >= n and window[-1] == seq[-1] and tuple(window[-n:]) == seq:
                    return i + 1, seq
        keep = self._longest - 1
        if len(window) > keep:
            del window[:len(window) - keep]
        return None
