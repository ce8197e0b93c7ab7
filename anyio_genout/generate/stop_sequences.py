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

__all__ = ["StopSequenceMatcher"]


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
