"""The reader's pace while consumers leave: one message a loop pass, not a batch.

The reader hands over ``READ_BATCH`` (32) messages or more before it yields, which keeps
the consumers' wake-ups few while outputs flow. But when scopes are being cancelled, every
step of a consumer's way out (its yield past the deadline, the cancellation's delivery,
its exit) waits for a loop pass, and each pass also runs the reader's batch: with 256
streams and an engine stepping back to back, 16 messages of 256 rows (the batch then) were
5-7 ms of every pass, and the exits of a timeout that fired for all 256 streams at once
waited behind two or three such batches (the lateness cell, a round with the consumers
busy: p99 21-47 ms on asyncio, 13-112 on trio; docs/performance.md, "(e) Lateness").

So a consumer that is leaving says so (:meth:`ReaderPace.leaving`): a stream whose consumer
resumed past its scopes' deadline, and a stream closed before its end. For ``HOLD``
seconds after the last such word the reader yields after every message; nothing changes
while no one leaves. The rows it would have read meanwhile are mostly the leaving
requests' own, which are dropped once their streams are closed.
"""

from __future__ import annotations

import time
from typing import Final

__all__ = ["HOLD", "ReaderPace"]

#: Seconds the reader keeps yielding after every message once a consumer said it leaves.
HOLD: Final = 0.01

_clock: Final = time.perf_counter


class ReaderPace:
    """Shared by one client's reader and its streams (package-internal)."""

    __slots__ = ("until",)

    def __init__(self) -> None:
        #: Until when (``time.perf_counter``) the reader yields after every message.
        self.until = 0.0

    def leaving(self) -> None:
        """A consumer is leaving its stream early: the reader yields after every message
        for ``HOLD`` seconds from now."""
        self.until = _clock() + HOLD
