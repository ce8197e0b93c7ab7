"""Multi-token stop sequences, matched on the client across engine steps.

The engine only stops on single tokens. A stop sequence can straddle step boundaries, so
the matcher keeps the last ``longest - 1`` tokens of the previous steps.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopSequenceMatcher"]


class StopSequenceMatcher:
    """Finds the first stop sequence that ends at or after output token ``min_tokens``."""

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
            if self._count < self._min_tokens:
                continue  # like vLLM's stop strings, no stop before min_tokens
            for seq in self._sequences:
                n = len(seq)
                if len(window) >= n and window[-1] == seq[-1] and tuple(window[-n:]) == seq:
                    return i + 1, seq
        keep = self._longest - 1
        if len(window) > keep:
            del window[:len(window) - keep]
        return None
