"""``async with EngineCoreClient.connect(config)``: the client's lifetime.

Entering makes the ZeroMQ context, binds the sockets, runs the handshake (whose socket stays
open for engines that come back, :mod:`.rejoin`), makes the client,
dispatches the outputs that arrived before READY, and starts the client's tasks in a task
group of their own. Leaving closes the client (its final ABORTs, the sticky
:class:`~anyio_genout.ClientClosedError`, the sockets), cancels the tasks, and terminates the
context in a worker thread. A factory makes the client: its parts (run and closed through
the three methods of :class:`ConnectedClient`) and the object entering returns, so this
module imports no client.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

import anyio
import anyio.abc
import anyio.to_thread

from ..errors import keyboard_interrupt_in
from ..protocol import EngineCoreReadyResponse
from ..transport import new_context
from .config import EngineCoreClientConfig
from .handshake import BoundSockets, bind_sockets, run_handshake

__all__ = ["ConnectedClient", "Connection"]


class ConnectedClient(Protocol):
    """What a :class:`Connection` needs of the client it runs (package-internal: the
    client's :class:`~.core.ClientCore`)."""

    def deliver_output(self, frames: list[Any]) -> None:
        """Handle one output message as the reader does."""

    async def run_tasks(self, task_group: anyio.abc.TaskGroup) -> None:
        """Start the client's background tasks in ``task_group``."""

    def close_now(self) -> None:
        """Close synchronously: final ABORTs, the closed error, the sockets."""


C = TypeVar("C")
#: Makes a connected client from the bound sockets and the engines' ready responses: the
#: parts the connection runs, and what entering returns.
ClientFactory = Callable[[EngineCoreClientConfig, BoundSockets,
                          dict[int, EngineCoreReadyResponse]], tuple[ConnectedClient, C]]


class Connection(Generic[C]):
    """``async with EngineCoreClient.connect(config) as engine``: see
    :meth:`EngineCoreClient.connect <.client.EngineCoreClient.connect>` for what entering
    raises."""

    def __init__(self, config: EngineCoreClientConfig, make_client: ClientFactory[C]) -> None:
        self._config = config
        self._make_client = make_client
        self._parts: ConnectedClient | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._context: Any = None

    async def __aenter__(self) -> C:
        self._context = new_context()
        sockets: BoundSockets | None = None
        try:
            sockets = bind_sockets(self._context, self._config)
            ready = await run_handshake(sockets, self._config)
            # The handshake socket stays open: the client answers engines that come back.
            parts, client = self._make_client(self._config, sockets, ready)
            early, sockets.early_outputs = sockets.early_outputs, []
            for frames in early:  # arrived before READY: dispatched before anything newer
                parts.deliver_output(frames)
            tg = anyio.create_task_group()
            await tg.__aenter__()
            try:
                await parts.run_tasks(tg)
            except BaseException:
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)
                raise
        except BaseException:
            if sockets is not None:
                sockets.close()
            self._context.term()
            raise
        self._parts = parts
        self._tg = tg
        return client

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        parts, tg = self._parts, self._tg
        assert parts is not None and tg is not None
        # Every request the engines still run gets its ABORT before the sockets close: those
        # whose scopes were left just now (e.g. on Ctrl-C) and those still open elsewhere.
        parts.close_now()
        tg.cancel_scope.cancel()
        # The body's exception (if any) propagates unchanged: it never enters the task group.
        try:
            await tg.__aexit__(None, None, None)
        except BaseExceptionGroup as group:
            # On trio a Ctrl-C lands in whichever task runs, often the reader: it is the
            # user's KeyboardInterrupt all the same, not a failure of ours.
            interrupt = keyboard_interrupt_in(group)
            if interrupt is not None:
                raise interrupt from None
            raise RuntimeError("anyio-genout background task failed") from group  # a bug
        finally:
            # term() waits (at most CLOSE_LINGER) for the last ABORTs to leave; in a worker
            # thread, shielded, so the event loop never blocks on it and it always completes.
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._context.term)
