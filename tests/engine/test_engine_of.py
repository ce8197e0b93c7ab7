"""Which engine sent an ``ENGINE_CORE_DEAD`` (the sentinel names none; the output connection
it came on does), whatever the order in which the client sees the connection close and reads
what came on it.

An engine that dies sends the sentinel and closes its connection. The reader and the
connection watcher are two tasks: on a loaded machine the watcher may apply the close first
(seen once in a full suite run: ``test_pinned_requests_are_not_migrated`` got
``EngineDeadError.ranks`` None, not the engine that died). The monitor events are fed here in
that order, from real monitor frames, so the case no longer depends on the scheduler.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
import zmq

from anyio_genout.engine.config import EngineCoreClientConfig
from anyio_genout.engine.registry import RequestRegistry
from anyio_genout.engine.reports import HealthReports
from anyio_genout.engine.utility_calls import PendingCalls
from anyio_genout.engine.watchers import EngineWatch

pytestmark = pytest.mark.anyio

_ENDPOINT = b"tcp://127.0.0.1:5555"


class _Frame:
    """A received frame's ``get(zmq.SRCFD)``: the descriptor of the connection it came on."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def get(self, option: int) -> int:
        assert option == zmq.SRCFD
        return self.fd


class _Monitor:
    """The output socket's monitor, with the events the test queues."""

    def __init__(self) -> None:
        self.queued: list[list[zmq.Frame]] = []

    def event(self, kind: int, fd: int) -> None:
        self.queued.append([zmq.Frame(struct.pack("=Hi", kind, fd)), zmq.Frame(_ENDPOINT)])

    def receive_nowait(self) -> list[zmq.Frame] | None:
        return self.queued.pop(0) if self.queued else None


def _watch(ranks: list[int]) -> tuple[EngineWatch, _Monitor]:
    registry = RequestRegistry(ranks)
    reports = HealthReports()
    calls = PendingCalls(0, lambda rank, frames: None, reports, registry)
    monitor = _Monitor()
    monitors: dict[str, Any] = {"output": monitor}
    return EngineWatch(EngineCoreClientConfig(engine_count=len(ranks)), registry, monitors,
                       calls, reports), monitor


def _connect(watch: EngineWatch, monitor: _Monitor, fd: int) -> None:
    monitor.event(zmq.EVENT_ACCEPTED, fd)
    monitor.event(zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
    watch._read_monitors()


async def test_a_sentinel_read_after_its_connection_closed_names_its_engine() -> None:
    # Three engines; only engine 2 has sent anything (the others had no requests), so the
    # descriptor is the only way to tell who sent the sentinel.
    watch, monitor = _watch([0, 1, 2])
    for fd in (10, 11, 12):
        _connect(watch, monitor, fd)
    watch.learn(2, _Frame(12))
    assert watch.engine_of(_Frame(12)) == 2
    monitor.event(zmq.EVENT_DISCONNECTED, 12)
    watch._read_monitors()  # the watcher applies the close first ...
    assert watch.engine_of(_Frame(12)) == 2  # ... and the sentinel read after it is engine 2's
    assert watch.engine_of(_Frame(10)) is None  # a silent engine's: any of 0 and 1


async def test_a_descriptor_accepted_again_belongs_to_its_new_connection() -> None:
    watch, monitor = _watch([0, 1])
    _connect(watch, monitor, 10)
    _connect(watch, monitor, 11)
    watch.learn(1, _Frame(11))
    watch.learn(0, _Frame(10))
    assert not watch.learning
    monitor.event(zmq.EVENT_DISCONNECTED, 11)
    watch._read_monitors()
    assert watch.learning  # a connection closed: the engine's next one is to be learnt
    watch.learn(1, _Frame(11))  # a late message of the closed connection teaches nothing
    assert watch.learning and watch.engine_of(_Frame(11)) == 1
    # Engine 1 comes back; the system gives its new connection the same descriptor.
    _connect(watch, monitor, 11)
    watch.learn(1, _Frame(11))
    assert not watch.learning and watch.engine_of(_Frame(11)) == 1
    # And a descriptor reused by another engine is that engine's once it has spoken on it.
    monitor.event(zmq.EVENT_DISCONNECTED, 10)
    monitor.event(zmq.EVENT_DISCONNECTED, 11)
    watch._read_monitors()
    _connect(watch, monitor, 10)
    watch.learn(1, _Frame(10))
    assert watch.engine_of(_Frame(10)) == 1 and watch.engine_of(_Frame(11)) == 1
