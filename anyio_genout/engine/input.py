"""The engines' input socket, as the client uses it: queueing messages, sending, draining.

Every message for an engine (ADD, ABORT, UTILITY) goes through :meth:`EngineInput.send`
into one :class:`~.outbox.Outbox`, sent in program order by the **sender** task
(:meth:`EngineInput.run_sender`). The **input drain** (:meth:`EngineInput.drain`) reads and
discards whatever a peer sends *to* the socket after the handshake. A send failure makes the
client unhealthy: it is reported to the client's :class:`~.reports.HealthReports`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

import anyio
import anyio.lowlevel

from ..errors import ClientClosedError, TransportError
from ..transport import ZmqSocket
from .outbox import Outbox
from .reports import HealthReports

__all__ = ["EngineInput"]

logger = logging.getLogger("anyio_genout.engine")

#: Unexpected input-socket messages logged one by one; later ones are only counted.
MAX_INPUT_JUNK_LOGGED: Final = 10
#: Seconds the input drain waits for the descriptor before it checks the socket again.
DRAIN_RECHECK: Final = 0.05
#: Discarded messages between two checkpoints of the input drain.
_DRAIN_BATCH: Final = 16


class EngineInput:
    """The input ROUTER, its send queue, and the count of messages discarded from it."""

    __slots__ = ("_identities", "_outbox", "_reports", "_socket", "_take", "junk")

    def __init__(self, socket: ZmqSocket, identities: dict[int, bytes],
                 reports: HealthReports,
                 take: Callable[[list[Any]], bool] | None = None) -> None:
        """``reports``: where a send failure is reported; ``take(frames)``: whether a
        message the drain received is wanted after all (a restarted engine's registration,
        :meth:`.rejoin.Rejoins.on_input`), not junk."""
        self._socket = socket
        self._take = take
        self._outbox = Outbox(socket)
        self._identities = identities
        self._reports = reports
        #: Messages sent to the input socket after the handshake, and discarded.
        self.junk = 0

    @property
    def queued(self) -> int:
        """Messages queued and not yet handed to ZeroMQ."""
        return len(self._outbox)

    def capture(self, sink: Callable[[list[Any]], None]) -> None:
        """Hand every message to ``sink`` instead of sending it (in-process engines)."""
        self._outbox = _Capture(sink)  # type: ignore[assignment]

    def send(self, engine: int, frames: list[bytes]) -> None:
        """Queue a message for ``engine`` (sent by the sender task, in order).

        Raises :class:`~anyio_genout.ClientClosedError` once the socket is closed, and
        :class:`~anyio_genout.TransportError` if a full queue was being sent and a send
        failed (which makes the client unhealthy)."""
        try:
            self._outbox.put([self._identities[engine], *frames])
        except anyio.ClosedResourceError:
            raise ClientClosedError("engine-core client is closed") from None
        except TransportError as exc:
            self._reports.fail(exc)
            raise

    def hand_over(self) -> None:
        """Hand every queued message to ZeroMQ now, in order (not at the end of the
        event-loop pass, as the sender would). Raises what :meth:`send` raises."""
        try:
            self._outbox.flush()
        except anyio.ClosedResourceError:
            raise ClientClosedError("engine-core client is closed") from None
        except TransportError as exc:
            self._reports.fail(exc)
            raise

    def hand_over_logged(self) -> None:
        """:meth:`hand_over` when closing: a failure is only logged."""
        try:
            self._outbox.flush()
        except (anyio.ClosedResourceError, TransportError) as exc:
            logger.warning("could not send the last queued messages: %s", exc)

    async def run_sender(self) -> None:
        """The sender task: send queued messages as they come, until the socket closes."""
        try:
            await self._outbox.run()
        except anyio.ClosedResourceError:
            return
        except TransportError as exc:
            self._reports.fail(exc)

    async def drain(self) -> None:
        """The input drain: discard messages sent to the socket after the handshake (none
        expected but a restarted engine's registration, handed to ``take``), until it
        closes."""
        sock = self._socket
        take = self._take
        try:
            while True:
                frames = sock.receive_nowait()
                if frames is None:
                    # The sender task sends on this socket too, and a send processes the
                    # socket's pending commands, which can take the descriptor's signal of
                    # a message that arrived meanwhile (a restarted engine's registration):
                    # the descriptor would not signal it again. Never wait unboundedly.
                    with anyio.move_on_after(DRAIN_RECHECK):
                        await sock.wait_readable()
                    continue
                if take is not None and take(frames):
                    continue
                self.junk += 1
                if self.junk <= MAX_INPUT_JUNK_LOGGED:
                    logger.warning("discarding an unexpected %d-frame message sent to the "
                                   "input socket by %r", len(frames),
                                   bytes(frames[0].buffer)[:16])
                if self.junk % _DRAIN_BATCH == 0:
                    await anyio.lowlevel.checkpoint()
        except anyio.ClosedResourceError:
            return
        except TransportError as exc:
            self._reports.fail(exc)


class _Capture:
    """An outbox that hands each message to a function (:meth:`EngineInput.capture`)."""

    def __init__(self, sink: Callable[[list[Any]], None]) -> None:
        self.put = sink

    def __len__(self) -> int:
        return 0

    def flush(self) -> None:
        pass

    async def run(self) -> None:
        await anyio.sleep_forever()
