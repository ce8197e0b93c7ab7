"""Finding engines that vanish: the connection watchers, the prober and the liveness check.

* The **connection watchers** follow the output and input sockets' connections (their
  ZeroMQ monitors) and, when one closes, have the **prober** ask every engine a cheap
  utility call: an engine that neither comes back nor answers within ``disconnect_grace``
  is dead (killed, host gone, network cut: heartbeats close an input connection that went
  quiet); if all answer but a connection came back, messages on it may be lost (ZeroMQ
  drops a message over ``max_message_size`` together with its connection), which fails
  open work.
* The **liveness** task asks every engine that has been silent a utility call and finds
  an engine that is connected but hung or deaf (any message read from an engine proves it
  alive: the reader counts them in :attr:`EngineWatch.heard`).

Both end by reporting the engines found dead (:meth:`~.reports.HealthReports.fail_engines`:
only those engines fail, or the whole client, as ``engine_failure`` says), or by failing the
whole client (:meth:`~.reports.HealthReports.fail`) when messages were lost; see
docs/reliability.md. The watch also keeps
which output connection (descriptor) each engine's messages come on, to tell which engine
sent an ``ENGINE_CORE_DEAD`` (:meth:`EngineWatch.engine_of`).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import anyio
import zmq

from ..errors import (
    EngineDeadError,
    OperationalError,
    ProtocolError,
    UtilityCallError,
)
from ..transport import MonitorEvent, TransportError, ZmqSocket
from .config import EngineCoreClientConfig
from .links import Connections, Counts, Drop
from .liveness import Heard, run_liveness
from .registry import RequestRegistry
from .reports import HealthReports
from .utility_calls import PendingCalls

__all__ = ["EngineWatch"]

logger = logging.getLogger("anyio_genout.engine")


class EngineWatch:
    """The watchers, prober and liveness check of one engine client."""

    def __init__(self, config: EngineCoreClientConfig, registry: RequestRegistry,
                 monitors: dict[str, ZmqSocket], calls: PendingCalls,
                 reports: HealthReports) -> None:
        """``registry``: the client's requests and its set of engines up (kept current by
        it); ``monitors``: the ``"output"`` (and ``"input"``) sockets' monitors;
        ``reports``: where engines found dead and lost messages are reported, and whether
        the client is still healthy."""
        self._config = config
        self._registry = registry
        self._live = registry.live
        self._monitors = dict(monitors)
        self._calls = calls
        self._reports = reports
        self._output_disconnects = 0
        #: Messages read from each engine (rank -> count): the reader counts, the liveness
        #: check reads.
        self.heard: Heard = defaultdict(int)
        # The sockets' connections, as their monitors report them, and the latest unjudged
        # drop of one.
        self._links = {"output": Connections(), "input": Connections()}
        self._drop: Drop | None = None
        self._probing: Drop | None = None  # the drop being judged
        self._drop_seen = anyio.Event()  # set by the watchers, for the prober
        self._connected = anyio.Event()  # set (and replaced) on every new connection
        self._answered_on: dict[int, int] = {}  # engine -> descriptor its probe answer came on
        # Output connection descriptor -> the engine whose messages came on it; ``learning``
        # while an engine up has no known connection (the reader then calls learn()).
        self._fd_engine: dict[int, int] = {}
        # The same for connections that closed, until their descriptor is accepted again:
        # what an engine sent before its connection closed (an ENGINE_CORE_DEAD) may be read
        # after the watcher saw the close, and still names that engine.
        self._closed_fd_engine: dict[int, int] = {}
        self.learning = True
        # The input monitor's clock when an engine last rejoined (-1: none did).
        self._rejoin_clock = -1

    @property
    def output_disconnects(self) -> int:
        """Connections to the output socket that closed after a completed handshake."""
        return self._output_disconnects

    def note_answer(self, engine: int, frame: Any) -> None:
        """Which output connection ``engine``'s probe answer came on (its descriptor)."""
        try:
            self._answered_on[engine] = frame.get(zmq.SRCFD)
        except (AttributeError, zmq.ZMQError):  # not a zmq.Frame: unknown, so "came back"
            self._answered_on.pop(engine, None)

    def learn(self, engine: int, frame: Any) -> None:
        """``engine`` sent the message whose first frame is ``frame``: remember the output
        connection it came on (the reader calls this while :attr:`learning`)."""
        try:
            fd = frame.get(zmq.SRCFD)
        except (AttributeError, zmq.ZMQError):  # not a zmq.Frame (in-process): no sources
            self.learning = False
            return
        if self._closed_fd_engine.get(fd) == engine:
            return  # read after its connection closed: nothing to learn
        self._fd_engine[fd] = engine
        if all(rank in self._fd_engine.values() for rank in self._live):
            self.learning = False

    def engine_up(self) -> None:
        """An engine rejoined: learn which output connection its messages come on, and
        remember that its new input connection is no sign of a connection come back."""
        self.learning = True
        self._rejoin_clock = self._links["input"].events

    def engine_of(self, frame: Any) -> int | None:
        """The engine that sent the message whose first frame is ``frame`` (e.g. an
        ``ENGINE_CORE_DEAD``, which names none): the one seen on that connection before, or
        else the only engine up whose connection is not known; None if it cannot be told."""
        try:
            fd = frame.get(zmq.SRCFD)
        except (AttributeError, zmq.ZMQError):
            fd = None
        if fd is not None:
            rank = self._fd_engine.get(fd)
            if rank is None:
                rank = self._closed_fd_engine.get(fd)
            if rank is not None:
                return rank
        unknown = [r for r in self._live if r not in self._fd_engine.values()]
        if fd is not None and len(unknown) == 1:
            return unknown[0]
        if len(self._live) == 1:
            return next(iter(self._live))
        return None

    def _open_work(self) -> int:
        """Requests and callers' utility calls in flight (not the client's own probes)."""
        return len(self._registry.requests) + self._calls.callers

    async def watch_connections(self) -> None:
        """Follow the output and input sockets' connections; hand every drop to the prober.

        ZeroMQ reports a peer that disconnects after a completed ZeroMQ handshake, whatever
        the reason: an engine that exited or was killed, an input connection the heartbeat
        closed (host gone, network cut), or a message over ``max_message_size``, which
        ZeroMQ drops *together with the connection* and reports nothing else about. Port
        scanners (whose ZeroMQ handshake fails) are not reported.
        """
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._prober)
            if "input" in self._monitors:
                tg.start_soon(self._watch, "input")
            await self._watch("output")
            tg.cancel_scope.cancel()

    async def _watch(self, name: str) -> None:
        monitor = self._monitors[name]
        try:
            while True:
                self._read_monitors()
                await monitor.wait_readable()
        except anyio.ClosedResourceError:
            pass
        except TransportError as exc:  # pragma: no cover - an inproc PAIR does not fail
            logger.warning("%s-connection watcher stopped: %s", name, exc)

    def _read_monitors(self) -> None:
        """Apply every queued event of both monitors, then act on the drops among them.

        Never waits: the watchers call it when a monitor signals, and the prober to see the
        events queued before an engine's answer.
        """
        drops: list[tuple[str, str, Counts]] = []
        for name, monitor in self._monitors.items():
            links = self._links[name]
            while (frames := monitor.receive_nowait()) is not None:
                event = MonitorEvent.parse(frames)
                if event is None:
                    continue
                kind = links.update(event)
                if name == "output":
                    self._follow_output(event)
                if kind == zmq.EVENT_DISCONNECTED:
                    drops.append((name, event.endpoint, links.counts()))
                elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    # The prober asks again: a question sent while an engine's input
                    # connection was down was dropped, and an answer sent on an output
                    # connection that closed before it arrived (ZeroMQ drops what follows
                    # an oversized message on its connection) is lost.
                    self._connected.set()
                    self._connected = anyio.Event()
        for name, endpoint, counts in drops:
            self._on_disconnect(name, endpoint, counts)

    def _follow_output(self, event: MonitorEvent) -> None:
        """Keep the output connections' engines current: a closed connection's engine is
        remembered for the messages still queued from it, until its descriptor is accepted
        again (a new connection, to be learnt: so is one whose handshake completed)."""
        kind = event.event
        if kind == zmq.EVENT_DISCONNECTED:
            rank = self._fd_engine.pop(event.value, None)
            if rank is not None:
                self._closed_fd_engine[event.value] = rank
            self.learning = True
        elif kind == zmq.EVENT_ACCEPTED:
            self._closed_fd_engine.pop(event.value, None)
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.learning = True

    def _on_disconnect(self, name: str, endpoint: str, counts: Counts) -> None:
        """A connection to the ``name`` socket closed when that socket's counters were
        ``counts``."""
        if name == "output":
            self._output_disconnects += 1
        if not self._reports.healthy:
            return
        logger.warning(
            "a peer's connection to the %s socket %s closed (%d so far); checking that every "
            "engine is still there (it must answer or reconnect within %g s)",
            name, endpoint, self._links[name].drops, self._config.health.disconnect_grace)
        work = self._open_work()
        if self._drop is None:
            now = {other: links.counts() for other, links in self._links.items()}
            now[name] = counts
            self._drop = Drop(anyio.current_time(), now, work, {name})
        else:
            self._drop.work = max(self._drop.work, work)
            self._drop.sockets.add(name)
        if self._probing is not None:  # judged next too, but say it in this verdict
            self._probing.sockets.add(name)
        self._drop_seen.set()

    def _came_back(self, drop: Drop, ranks: Iterable[int]) -> bool:
        """Whether an engine's connection was made again since ``drop`` (every engine of
        ``ranks`` has answered the probe): its answer arrived on an output connection
        accepted after the drop, or an input connection was made since (those carry no
        answers; not if an engine rejoined since, which made one)."""
        since = drop.counts["input"].events
        if self._links["input"].connected_at > since and self._rejoin_clock < since:
            return True
        accepted = self._links["output"].accepted
        for rank in ranks:
            at = accepted.get(self._answered_on.get(rank, -1))
            if at is None or at > drop.counts["output"].events:
                return True
        return False

    async def _prober(self) -> None:
        """Judge every dropped connection (one drop, or a burst, at a time)."""
        while self._reports.healthy:
            await self._drop_seen.wait()
            self._drop_seen = anyio.Event()
            drop, self._drop = self._drop, None
            if drop is not None and self._reports.healthy:
                self._probing = drop
                try:
                    await self._probe(drop)
                finally:
                    self._probing = None

    async def _probe(self, drop: Drop) -> None:
        """Ask every engine ``is_sleeping`` after a connection closed at ``drop.at``.

        * An engine that has not answered when ``disconnect_grace`` is up, while fewer input
          or output connections are open than there are engines (one did not come back),
          is dead: :class:`EngineDeadError` naming it.
        * If every engine still has its connections, one that has not answered yet is slow
          (a long step), not gone: it gets up to ``liveness_timeout`` to answer. Every new
          input or output connection meanwhile gets the question again, so an answer lost
          with a connection that closed after the first (one more oversized message) is
          asked for again at once, and not waited for.
        * If every engine answered: had a connection come back (a new ZeroMQ handshake), it
          was an engine's, which lives, and whatever was sent over the dropped one is lost.
          Work in flight then fails with :class:`ProtocolError` (it could miss outputs, or
          never reach the engine, and never finish); with none in flight the drop is only
          logged. No new handshake: the peer was not an engine (an engine's reply would
          have needed one).
        """
        health = self._config.health
        live = self._live
        ranks = sorted(live)
        if not ranks:
            return  # no engine up (last_engine_death="wait"): nobody to ask, nothing to lose
        answered: set[int] = set()
        everyone = anyio.Event()
        self._answered_on.clear()

        def settled() -> None:  # every engine asked answered, or died meanwhile
            if all(rank in answered or rank not in live for rank in ranks):
                everyone.set()

        async def ask_once(rank: int, done: anyio.CancelScope) -> None:
            try:
                await self._calls.call([rank], "is_sleeping", (), internal=True)
            except UtilityCallError:
                pass  # an answer all the same
            except OperationalError:
                done.cancel()  # the client failed or closed, or this engine died, meanwhile
                settled()
                return
            answered.add(rank)
            settled()
            done.cancel()

        async def ask(rank: int) -> None:
            async with anyio.create_task_group() as calls:
                while True:
                    connected = self._connected
                    calls.start_soon(ask_once, rank, calls.cancel_scope)
                    await connected.wait()  # a new connection: ask (and answer) over it too

        def left() -> float:
            return health.disconnect_grace - (anyio.current_time() - drop.at)

        async with anyio.create_task_group() as tg:
            for rank in ranks:
                tg.start_soon(ask, rank)
            with anyio.move_on_after(left()):
                await everyone.wait()
            found_dead = False
            if not everyone.is_set() and self._reports.healthy:
                try:
                    self._read_monitors()  # judge the connections as they are now
                except (anyio.ClosedResourceError, TransportError):
                    return
                if self._flapping(drop):
                    # Alive: its answer was lost with a connection that closed again.
                    if drop.work:
                        self._fail_lost(drop.work)
                    return
                silent = [rank for rank in ranks if rank not in answered and rank in live]
                if any(links.live < len(live) for links in self._links.values()):
                    found_dead = True
                    self._reports.fail_engines(silent, EngineDeadError(
                        _gone_message(silent, drop.sockets, health.disconnect_grace),
                        ranks=silent))
                else:
                    with anyio.move_on_after(health.liveness_timeout - health.disconnect_grace
                                             + left()):
                        await everyone.wait()
                    silent = [rank for rank in ranks if rank not in answered and rank in live]
                    if silent and self._reports.healthy:
                        found_dead = True
                        self._reports.fail_engines(silent, EngineDeadError(
                            f"{_engines(silent)}: a connection to the client's "
                            f"{_sockets(drop.sockets)} closed and "
                            f"{'it' if len(silent) == 1 else 'they'} did not answer within "
                            f"{health.liveness_timeout:g} s", ranks=silent))
            tg.cancel_scope.cancel()
        if not self._reports.healthy or found_dead:
            return  # the dropped connections were the dead engines' own
        # Every engine answered. ZeroMQ reports a new connection before any message flows on
        # it: an engine whose connection dropped answered over a new one, reported by now.
        try:
            self._read_monitors()
        except (anyio.ClosedResourceError, TransportError):
            return
        if not self._came_back(drop, answered):
            logger.info("the peer that left was not an engine: every engine answered over "
                        "its own connections")
        elif drop.work:
            self._fail_lost(drop.work)
        else:
            logger.info("an engine's connection closed and came back with nothing in "
                        "flight; every engine answered")

    def _flapping(self, drop: Drop) -> bool:
        """Whether a connection to a socket was made again since ``drop`` and closed again
        too: the mark of an engine that lives while each connection it makes closes (one
        oversized message after another), which a dead engine (no new connection) and a
        restarted one (a new connection that stays) do not leave."""
        for name, then in drop.counts.items():
            links = self._links[name]
            if links.made > then.made and links.drops > then.drops:
                return True
        return False

    def _fail_lost(self, work: int) -> None:
        """Fail the client: an engine's connection closed and came back while ``work``
        requests or utility calls were in flight, so messages on it are lost."""
        limit = self._config.max_message_size
        self._reports.fail(ProtocolError(
            f"an engine's connection closed and came back while {work} request(s) "
            f"or utility call(s) were in flight, and messages on it are lost: ZeroMQ "
            f"drops a message larger than max_message_size "
            f"({'unlimited' if limit is None else f'{limit:,} bytes'}) together with its "
            f"connection, and a network fault closes it too"))

    async def liveness(self, interval: float, deadline: float) -> None:
        """The liveness task: an engine silent for ``interval`` s is asked a cheap utility
        call, and is dead if nothing at all comes from it within ``deadline`` s (any
        message read from an engine proves it alive; :mod:`.liveness`)."""
        await run_liveness(self._live, self.heard, self._calls, self._reports, interval,
                           deadline)


def _engines(ranks: Sequence[int]) -> str:
    return (f"engine {ranks[0]}" if len(ranks) == 1
            else f"engines {', '.join(map(str, ranks))}")


def _gone_message(ranks: Sequence[int], sockets: Iterable[str], grace: float) -> str:
    one = len(ranks) == 1
    return (f"{_engines(ranks)}: {'its' if one else 'a'} connection to the client's "
            f"{_sockets(sockets)} closed and {'it' if one else 'they'} did not answer or "
            f"reconnect within {grace:g} s (process killed, host gone or network cut)")


def _sockets(names: Iterable[str]) -> str:
    names = sorted(names)
    return f"{' and '.join(names)} socket{'s' if len(names) > 1 else ''}"
