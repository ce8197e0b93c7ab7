"""The connections of one socket as its ZeroMQ monitor reports them, and a drop of one
waiting for the prober's verdict (:mod:`.watchers`)."""

from __future__ import annotations

from typing import Final, NamedTuple

import attrs
import zmq

from ..transport import MonitorEvent

__all__ = ["Connections", "Counts", "Drop"]

_HANDSHAKE_FAILED: Final = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                            | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class Counts(NamedTuple):
    """One socket's :class:`Connections` counters at a moment."""

    events: int  # events applied: the clock ``accepted`` and ``connected_at`` are on
    made: int  # connections whose handshake completed
    drops: int  # of those, the ones that closed


class Connections:
    """One socket's connections, from its monitor's events.

    Monitor events carry no peer address: an ACCEPTED event gives the connection's
    descriptor, the handshake events that follow give none, so they are matched in order.
    """

    __slots__ = ("accepted", "connected_at", "drops", "events", "failed", "live", "made",
                 "pending")

    def __init__(self) -> None:
        self.pending: list[int] = []  # accepted, ZeroMQ handshake not yet done (oldest first)
        self.failed: set[int] = set()  # the handshake failed (a port scan): not reported
        self.live = 0  # connections with a completed handshake, still open
        self.drops = 0  # connections with a completed handshake that closed
        self.made = 0  # connections whose handshake completed
        self.events = 0  # events applied so far: a clock for ``accepted``
        self.accepted: dict[int, int] = {}  # open connection's descriptor -> ``events`` then
        self.connected_at = 0  # ``events`` at the latest completed handshake

    def counts(self) -> Counts:
        """The counters so far."""
        return Counts(self.events, self.made, self.drops)

    def update(self, event: MonitorEvent) -> int:
        """Apply ``event``; returns ``zmq.EVENT_HANDSHAKE_SUCCEEDED`` for a new connection,
        ``zmq.EVENT_DISCONNECTED`` when one that had completed its handshake closed, else
        0."""
        kind = event.event
        self.events += 1
        if kind == zmq.EVENT_ACCEPTED:
            self.pending.append(event.value)
            self.accepted[event.value] = self.events
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if self.pending:
                self.pending.pop(0)
            self.connected_at = self.events
            self.live += 1
            self.made += 1
            return kind
        elif kind & _HANDSHAKE_FAILED:
            if self.pending:
                self.failed.add(self.pending.pop(0))
        elif kind == zmq.EVENT_DISCONNECTED:
            fd = event.value
            self.accepted.pop(fd, None)
            if fd in self.failed:
                self.failed.discard(fd)
            elif fd in self.pending:
                self.pending.remove(fd)
            else:
                self.live = max(0, self.live - 1)
                self.drops += 1
                return kind
        return 0


@attrs.define
class Drop:
    """Connections that closed and wait for the prober's verdict."""

    at: float  # when the first closed
    counts: dict[str, Counts]  # each socket's counters then (this drop's close included)
    work: int  # requests and callers' utility calls in flight then
    sockets: set[str]  # which sockets' connections closed ("input", "output")
