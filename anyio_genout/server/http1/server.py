"""``Http1Server``: the accept loop, TLS, and the graceful stop over the connections."""

from __future__ import annotations

import errno
import logging
import socket
import ssl
from typing import Final

import anyio
import anyio.abc
from anyio.streams.tls import TLSStream

from .connection import Connection, ConnectionSettings
from .cycle import App

__all__ = ["Http1Server"]

#: Seconds the accept loop waits after another error (out of descriptors, of memory).
_ACCEPT_BACKOFF: Final = 0.1
#: accept(2)'s errors that only mean one client gave up before it was accepted.
_CLIENT_GAVE_UP: Final = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EINTR,
                                    errno.EAGAIN})


class Http1Server:
    """Serve an ASGI app over HTTP/1.1 on a listening socket (TCP or Unix), on asyncio or
    trio, until told to stop (:meth:`serve`).

    ``keep_alive_timeout``: seconds a request head has to arrive whole (from the
    connection's start, or the previous response's end), and a TLS handshake to finish.
    ``read_timeout``: seconds of silence after which a connection is closed, even while its
    response streams (None: never). ``max_head_bytes``: the largest request head (431
    above). ``root_path``: the scope's ``root_path``. ``ssl_context``: serve HTTPS.
    """

    def __init__(self, sock: socket.socket, *, keep_alive_timeout: float,
                 read_timeout: float | None, max_head_bytes: int, root_path: str = "",
                 ssl_context: ssl.SSLContext | None = None,
                 log: logging.Logger | None = None) -> None:
        self._socket = sock
        self._keep_alive_timeout = keep_alive_timeout
        self._read_timeout = read_timeout
        self._max_head_bytes = max_head_bytes
        self._root_path = root_path
        self._ssl_context = ssl_context
        self._log = log or logging.getLogger(__name__)
        #: Seconds the open connections get to finish once stopped (read when it stops).
        self.graceful_timeout = 0.0
        self._connections: set[Connection] = set()
        self._stopping = False

    async def serve(self, app: App, stop: anyio.Event) -> None:
        """Serve ``app`` until ``stop`` is set; then close the listening socket at once, end
        each connection after its response in progress (an idle one at once), and cancel
        those still open after :attr:`graceful_timeout` seconds. Raises nothing of its own:
        a connection's failure is logged, and running out of descriptors pauses accepting."""
        settings = ConnectionSettings(
            app, keep_alive_timeout=self._keep_alive_timeout, read_timeout=self._read_timeout,
            max_head_bytes=self._max_head_bytes, root_path=self._root_path,
            scheme="https" if self._ssl_context is not None else "http", log=self._log)
        listener = await anyio.abc.SocketListener.from_socket(self._socket)
        all_closed = anyio.Event()
        async with anyio.create_task_group() as connections:
            async with anyio.create_task_group() as accepting:
                accepting.start_soon(self._accept, listener, connections, settings,
                                     all_closed)
                await stop.wait()
                accepting.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            self._stopping = True
            for conn in self._connections:
                conn.stop()
            if not self._connections:
                all_closed.set()
            with anyio.move_on_after(self.graceful_timeout):
                await all_closed.wait()
            connections.cancel_scope.cancel()

    async def _accept(self, listener: anyio.abc.SocketListener,
                      connections: anyio.abc.TaskGroup, settings: ConnectionSettings,
                      all_closed: anyio.Event) -> None:
        local = self._socket.getsockname()
        server = (local, None) if isinstance(local, str) else (local[0], local[1])
        failing = False
        while True:
            try:
                stream = await listener.accept()
            except anyio.ClosedResourceError:
                return
            except (OSError, anyio.BrokenResourceError) as exc:
                # trio's listener raises BrokenResourceError from the OSError
                cause = exc if isinstance(exc, OSError) else exc.__cause__
                if getattr(cause, "errno", None) not in _CLIENT_GAVE_UP:
                    # Out of descriptors or memory (or worse): say so once, and try again
                    # shortly rather than spin; what is open goes on being served.
                    (self._log.debug if failing else self._log.warning)(
                        "cannot accept a connection: %s", cause or exc)
                    failing = True
                    await anyio.sleep(_ACCEPT_BACKOFF)
                continue
            if failing:
                self._log.warning("accepting connections again")
                failing = False
            connections.start_soon(self._connection, stream, settings, server, all_closed)

    async def _connection(self, raw: anyio.abc.SocketStream, settings: ConnectionSettings,
                          server: tuple[str, int | None], all_closed: anyio.Event) -> None:
        # A client that reset at once has no address any more: None, as for a Unix socket.
        remote = raw.extra(anyio.abc.SocketAttribute.remote_address, None)
        client = (remote[0], remote[1]) if isinstance(remote, tuple) else None
        stream: anyio.abc.ByteStream = raw
        if self._ssl_context is not None:
            try:
                with anyio.move_on_after(self._keep_alive_timeout):
                    stream = await TLSStream.wrap(raw, server_side=True,
                                                  ssl_context=self._ssl_context,
                                                  standard_compatible=False)
            except (OSError, anyio.BrokenResourceError, anyio.EndOfStream) as exc:
                self._log.debug("TLS handshake failed: %r", exc)
            finally:
                if stream is raw:  # failed, too slow, or the server's cancel
                    with anyio.CancelScope(shield=True):
                        await raw.aclose()
            if stream is raw:
                return
        conn = Connection(stream, settings, server=server, client=client)
        self._connections.add(conn)
        if self._stopping:
            conn.stop()
        try:
            await conn.run()
        finally:
            self._connections.discard(conn)
            if self._stopping and not self._connections:
                all_closed.set()
