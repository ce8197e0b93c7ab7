"""One labelled histogram as plain Python numbers, and folding a batch of values into it.

:class:`Histogram` keeps a count per bucket (found with :func:`bisect.bisect_left` on the
bucket bounds) and a running sum: no prometheus-client object and no lock per observation.
:meth:`Histogram.observe_many` folds a numpy batch in with the same counts and the very same
sum as observing each value in turn.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

import numpy as np

__all__ = ["Histogram"]


class Histogram:
    """One labelled histogram: a count per bucket (the last one is ``+Inf``) and the sum.

    Same semantics as ``prometheus_client.Histogram.observe``: a value goes to the first
    bucket whose bound is ``>=`` it; NaN goes to no bucket (so not into ``_count``) but is
    added to ``_sum``.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        #: The finite upper bounds, ascending.
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect_left(self.bounds, value)
        if i or value == value:  # NaN compares false to every bound: bisect gives 0
            self.counts[i] += 1
        self.sum += value

    def observe_many(self, values: np.ndarray[Any, np.dtype[np.float64]]) -> None:
        """:meth:`observe` each of ``values`` in order: the same counts, and the same sum to
        the last bit (a running sum, as one observation after another would make).

        Like Python's float addition, the sum overflows to an infinity and ``inf + -inf``
        gives NaN silently: numpy's warnings for those are off here, since a scrape (which
        folds) must not warn where one observation at a time would not.
        """
        bins = np.bincount(
            np.searchsorted(np.asarray(self.bounds), values[~np.isnan(values)], side="left"),
            minlength=len(self.counts))
        counts = self.counts
        for i in np.flatnonzero(bins).tolist():
            counts[i] += int(bins[i])
        with np.errstate(over="ignore", invalid="ignore"):
            self.sum = float(np.cumsum(np.concatenate(([self.sum], values)))[-1])
