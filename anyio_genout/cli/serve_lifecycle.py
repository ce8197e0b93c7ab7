"""How one ``anyio-genout serve`` process stops: on a signal (SIGTERM drains the open
requests, SIGINT aborts them), and when every engine is gone (it waits for a rejoin, then
exits 1 so that a supervisor restarts it). docs/reliability.md has the rules and the
measurements ("When every engine dies", "Graceful drain")."""

from __future__ import annotations

import argparse
import logging
import signal
from typing import Final

import anyio

from ..engine.client import EngineCoreClient
from ..engine.registry import why_down
from ..errors import ClientUnhealthyError, EngineDeadError, GenoutError
from ..generate import Client
from .http_server import HttpServer

__all__ = ["DRAIN_SLACK", "Lifecycle", "rejoin_timeout", "watch_engines"]

logger = logging.getLogger("anyio_genout.serve")

#: Seconds the HTTP server has, after the drain ended (its requests finished or aborted), to send
#: the last bytes of the responses and close the connections before it cancels them.
DRAIN_SLACK: Final = 2.0
#: Seconds between two looks at the requests still open while draining.
_DRAIN_POLL: Final = 0.05


def rejoin_timeout(args: argparse.Namespace) -> float:
    """``--engine-rejoin-timeout``, or its default: ``--ready-timeout`` for engines that
    dial in (``--handshake-address``: something else restarts them, and a restarted engine
    loads its model before it is READY, as at start-up), 0 for the engines this process
    starts itself (embedded mock, ``--vllm-model``), which nothing restarts."""
    value: float | None = args.engine_rejoin_timeout
    if value is not None:
        return value
    if args.handshake_address is not None and not args.vllm_model:
        return float(args.ready_timeout)
    return 0.0


class _Changes:
    """Woken by the client's health listener: an engine went down or came back."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def __call__(self, rank: int, up: bool) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event = anyio.Event()


async def watch_engines(engine: EngineCoreClient, patience: float) -> ClientUnhealthyError:
    """Wait until the server must exit because of its engines, and say why: the client
    failed as a whole (its health error), or no engine was up for ``patience`` seconds (an
    :class:`EngineDeadError` naming each engine and why it is down). While no engine is up,
    requests fail at once (503) and a restarted engine rejoins (``last_engine_death=
    "wait"``). Returns, never raises (but cancellation)."""
    changes = _Changes()
    engine.add_health_listener(changes)
    while True:
        error = engine.health_error
        if error is not None:
            return error
        if engine.live_engines:
            await changes.wait()
            continue
        logger.warning("no engine is up: waiting up to %g s (--engine-rejoin-timeout) for "
                       "one to rejoin before exiting", patience)
        with anyio.move_on_after(patience):
            while not engine.live_engines and engine.health_error is None:
                await changes.wait()
        if not engine.live_engines and engine.health_error is None:
            down = engine.engine_health
            why = why_down(down)
            return EngineDeadError(
                f"no engine came back within {patience:g} s (--engine-rejoin-timeout), "
                f"exiting so that a supervisor restarts this server: {why}",
                ranks=sorted(down))


class Lifecycle:
    """The stop of one server process (``serve``, or a worker of ``serve --workers``).

    * SIGTERM (or :meth:`begin`): **drain**. ``draining`` turns true (``/health`` answers
      503), the HTTP server is told to stop (it closes its listening socket at once, so new
      connections are refused, and lets the open ones finish), the open requests get up to
      ``shutdown_timeout`` seconds to finish, and those still open then are aborted (each
      stream ends with finish reason ``abort``; the engine gets one ABORT each). Exit 0.
    * SIGINT, or a second signal while draining: the same with no wait (the requests still
      open are aborted at once). Exit 130 for SIGINT.
    * :meth:`fail` (the engines are gone): stop at once, the process exits 1.
    """

    def __init__(self, server: HttpServer, shutdown_timeout: float) -> None:
        self._server = server
        self._shutdown_timeout = shutdown_timeout
        #: The HTTP server's shutdown trigger.
        self.stop = anyio.Event()
        self._begun = anyio.Event()
        self._abort_now = anyio.Event()
        self._wait = 0.0
        self.draining = False
        #: The first signal received (None: none).
        self.signal: int | None = None
        #: Why the server stops on its own (its exit status is then 1).
        self.failure: GenoutError | None = None

    def begin(self, wait: float) -> None:
        """Stop accepting and drain, aborting what is still open after ``wait`` seconds
        (at once if called again)."""
        if self._begun.is_set():
            self._abort_now.set()
            return
        self.draining = True
        self._wait = wait
        self._server.graceful_timeout = wait + DRAIN_SLACK  # read when it stops
        self._begun.set()
        self.stop.set()

    def on_signal(self, signum: int) -> None:
        if self.signal is None or signum == signal.SIGINT:  # Ctrl-C after SIGTERM: 130
            self.signal = signum
        self.begin(self._shutdown_timeout if signum == signal.SIGTERM else 0.0)

    def fail(self, error: GenoutError) -> None:
        if self.failure is None:
            self.failure = error
        self.begin(0.0)

    async def drain(self, client: Client) -> None:
        """Once stopping: wait until no request is open, or ``wait`` seconds, then abort
        every request still open (one ABORT each, through the client)."""
        await self._begun.wait()
        engine = client.engine
        open_at_start = engine.in_flight
        if open_at_start and self._wait > 0:
            logger.warning("draining: %d request(s) open, waiting up to %g s "
                           "(--shutdown-timeout) for them to finish; refusing new "
                           "connections", open_at_start, self._wait)
        started = anyio.current_time()
        with anyio.move_on_after(self._wait):
            while engine.in_flight and not self._abort_now.is_set():
                with anyio.move_on_after(_DRAIN_POLL):
                    await self._abort_now.wait()
        left = engine.in_flight
        if left:
            logger.warning("aborting %d request(s) still open after %.1f s of draining",
                           left, anyio.current_time() - started)
            try:
                await client.abort()
            except GenoutError:  # the client failed meanwhile: its streams have ended
                pass
