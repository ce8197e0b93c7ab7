"""The input socket's send queue: ADD, ABORT and UTILITY go out in program order, in one
burst per event-loop pass.

Callers :meth:`Outbox.put` a message and return at once; a sender task wakes after the
pass in which they did (so it sees every message queued in that pass) and sends them all
with ``NOBLOCK`` sends, which never wait (the socket's high-water mark is unbounded). A
burst longer than ``FLUSH_AT`` goes out in chunks of that size as it is made, so the engine
starts on its first requests while the client is still making the rest.
Sending each message from its caller instead woke the ZeroMQ I/O thread once per message:
with 64 short requests in flight, 9 of the 52 us of CPU each request cost were that thread's
(docs/performance.md). The queue preserves program order, so an ABORT queued before an ADD
reusing its id still reaches the engine first.
"""

from __future__ import annotations

from typing import Final

import anyio

from ..errors import TransportError
from ..transport import Frames, ZmqSocket
from .parking import parking_factory

__all__ = ["FLUSH_AT", "Outbox"]

#: Queued messages that are sent at once rather than at the end of the pass.
FLUSH_AT: Final = 8


class Outbox:
    """Messages for one socket, sent in order by :meth:`run` (one task) or :meth:`flush`."""

    __slots__ = ("_parking", "_pending", "_socket")

    def __init__(self, socket: ZmqSocket) -> None:
        self._socket = socket
        self._pending: list[Frames] = []
        self._parking = parking_factory()()

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, frames: Frames) -> None:
        """Queue ``frames``; raises :class:`anyio.ClosedResourceError` once the socket is.

        Every ``FLUSH_AT`` messages the queue is sent at once, by the caller (raising
        :class:`~anyio_genout.errors.TransportError` like :meth:`flush`): a long burst then
        reaches the engine as it is made, and the engine's work on its first messages
        overlaps the making of the rest."""
        if self._socket.closed:
            raise anyio.ClosedResourceError
        pending = self._pending
        pending.append(frames)
        if len(pending) >= FLUSH_AT:
            self.flush()
        elif self._parking.waiter is not None:
            self._parking.wake()

    def flush(self) -> None:
        """Send everything queued, now. Raises :class:`~anyio_genout.errors.TransportError`
        (or :class:`anyio.ClosedResourceError`); what was not sent then is dropped."""
        pending, self._pending = self._pending, []
        send = self._socket.send_nowait
        for frames in pending:
            if not send(frames):  # pragma: no cover - ROUTER with SNDHWM=0 never blocks
                raise TransportError("input socket would block")

    async def run(self) -> None:
        """Send queued messages as they come, until cancelled or a send fails."""
        while True:
            while not self._pending:
                await self._parking.wait()
            self.flush()
