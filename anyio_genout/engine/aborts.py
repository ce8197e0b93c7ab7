"""Aborting requests in the engines: the abort queue, its worker, and the close-time abort-all.

A request scope left before its terminal output queues its id here synchronously
(:meth:`AbortQueue.queue`: nothing awaits in a cancelled scope); the **abort worker**
(:meth:`AbortQueue.run`) batches the queued ids into one ABORT frame per engine, up to
``MAX_ABORT_BATCH`` ids a frame. An id stays *pending* until its frame is queued for the
engine's input, so :meth:`EngineCoreClient.open_stream <.client.EngineCoreClient.open_stream>`
reusing it and :meth:`EngineCoreClient.abort <.client.EngineCoreClient.abort>` can send its
ABORT first, exactly once. No I/O here: frames go to the ``send`` callable (the client's
outbox).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import anyio

from ..errors import GenoutError
from ..protocol import encode_abort
from .reports import HealthReports

__all__ = ["MAX_ABORT_BATCH", "AbortQueue"]

logger = logging.getLogger("anyio_genout.engine")

#: At most this many ids in one ABORT frame.
MAX_ABORT_BATCH: Final = 1024


class AbortQueue:
    """The ids of requests to abort, by engine, and the worker that sends their frames."""

    __slots__ = ("_pending", "_receive", "_reports", "_send", "_send_input", "_sent")

    def __init__(self, send_input: Callable[[int, list[bytes]], None],
                 reports: HealthReports) -> None:
        """``send_input(engine, frames)`` queues a message for an engine (raising a
        :class:`~anyio_genout.GenoutError` if it cannot); ``reports.healthy`` tells whether
        the client still tracks requests (an unhealthy one sends no aborts)."""
        self._send_input = send_input
        self._reports = reports
        self._send, self._receive = anyio.create_memory_object_stream[tuple[str, int]](math.inf)
        self._pending: dict[str, int] = {}  # id -> engine, until its ABORT is queued
        self._sent = 0

    @property
    def sent(self) -> int:
        """Request ids sent in ABORT frames so far."""
        return self._sent

    def is_pending(self, request_id: str) -> bool:
        """Whether ``request_id``'s ABORT waits for the worker (not yet queued for input)."""
        return request_id in self._pending

    def queue(self, request_id: str, engine: int) -> None:
        """Abort ``request_id`` on ``engine`` soon (from the worker); synchronous."""
        self._pending[request_id] = engine
        self._send.send_nowait((request_id, engine))

    def take(self, request_id: str) -> int | None:
        """Forget ``request_id``'s pending ABORT; the engine it was for, or None."""
        return self._pending.pop(request_id, None)

    def send_pending_now(self, request_id: str) -> None:
        """Queue ``request_id``'s pending ABORT for input now (before an ADD reusing the id:
        the engine would otherwise see a duplicate id and die). Raises what ``send_input``
        raises."""
        engine = self._pending.pop(request_id, None)
        if engine is not None:
            self.send_now(engine, [request_id])

    def send_now(self, engine: int, ids: Sequence[str]) -> None:
        """Queue ABORT frames for ``ids`` on ``engine`` (more than one past
        ``MAX_ABORT_BATCH`` ids). Raises what ``send_input`` raises."""
        for start in range(0, len(ids), MAX_ABORT_BATCH):
            chunk = list(ids[start:start + MAX_ABORT_BATCH])
            self._send_input(engine, encode_abort(chunk))
            self._sent += len(chunk)

    def clear(self) -> None:
        """Forget every pending ABORT (the client became unhealthy)."""
        self._pending.clear()

    def forget_engine(self, engine: int) -> None:
        """Forget the pending ABORTs for ``engine``: it died, and a dead engine is sent
        nothing (its requests died with it)."""
        for rid in [rid for rid, e in self._pending.items() if e == engine]:
            del self._pending[rid]

    def close(self) -> None:
        """No more aborts: the worker ends (both ends of its queue close)."""
        self._send.close()
        self._receive.close()

    async def run(self) -> None:
        """The abort worker: batch queued ids into frames until :meth:`close`."""
        receive = self._receive
        try:
            async for first in receive:
                batch = [first]
                while len(batch) < MAX_ABORT_BATCH:
                    try:
                        batch.append(receive.receive_nowait())
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                self._flush(batch)
        except anyio.ClosedResourceError:
            return

    def _flush(self, batch: Sequence[tuple[str, int]]) -> None:
        """Send the pending aborts among ``batch``: one ABORT frame per engine."""
        if not self._reports.healthy:
            self._pending.clear()
            return
        by_engine: dict[int, list[str]] = {}
        for rid, engine in batch:
            # Skip ids already sent (a new request with the same id flushed it).
            if self._pending.get(rid) == engine:
                del self._pending[rid]
                by_engine.setdefault(engine, []).append(rid)
        self._send_logged(by_engine)

    def abort_all(self, registered: Iterable[tuple[str, int]]) -> None:
        """Closing: ABORT, one frame per engine, every pending id and every ``(id, engine)``
        of ``registered`` (the requests still open); a failure is logged. An unhealthy
        client sends none: it no longer tracks any request."""
        if not self._reports.healthy:
            return
        by_engine: dict[int, list[str]] = {}
        for rid, engine in self._pending.items():
            by_engine.setdefault(engine, []).append(rid)
        self._pending.clear()
        for rid, engine in registered:
            by_engine.setdefault(engine, []).append(rid)
        if by_engine:
            logger.info("closing: aborting %d request(s) still in flight",
                        sum(map(len, by_engine.values())))
        self._send_logged(by_engine)

    def _send_logged(self, by_engine: dict[int, list[str]]) -> None:
        """One ABORT frame per engine (more past 1024 ids); a failure is logged."""
        for engine, ids in by_engine.items():
            logger.debug("aborting %d request(s) on engine %d", len(ids), engine)
            try:
                self.send_now(engine, ids)
            except GenoutError as exc:
                logger.warning("could not send ABORT to engine %d: %s", engine, exc)
