"""The HTTP server under the app (``serve --http-server``): our own (``builtin``) on trio,
uvicorn with httptools on asyncio and uvloop, Hypercorn when asked.

Each serves the same ASGI app on a listening socket bound by the caller, stops when told
(closing the listening socket at once and giving open connections ``graceful_timeout``
seconds before their tasks are cancelled), and bounds what a hostile client can hold:

* a request head must arrive whole within ``keep_alive_timeout`` seconds of the
  connection's start or of the previous response's end (slow-loris), and be at most
  :data:`MAX_HEAD_BYTES`; an idle keep-alive connection is closed after the same time;
* ``read_timeout`` (builtin and Hypercorn): a connection that sends nothing for that long
  is closed, even while its response streams.

Measured in front of the same mock engine (docs/performance.md, "Server"): on trio, the
builtin server (:mod:`anyio_genout.server.http1`, httptools under AnyIO streams) costs
about half the CPU per streamed token of Hypercorn, whose h11 parser and framing are pure
Python; on asyncio it costs what uvicorn costs, and uvicorn, the server vLLM itself runs,
stays the default there. uvicorn has no head timeout of its own (its keep-alive timer stops
at a connection's first byte, and an idle new connection has none), so
:class:`_GuardedHttpTools` adds Hypercorn's. Granian was measured too and cost the same CPU
per token as uvicorn (docs/performance.md, "Granian against uvicorn"), so it is not offered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import ssl
import sys
from collections.abc import Iterator
from typing import Any, Final, Protocol

import anyio

from ..errors import UsageError

__all__ = ["HTTP_SERVERS", "LISTEN_BACKLOG", "MAX_HEAD_BYTES", "HttpServer", "choose_http_server",
           "http_server"]

#: The values of ``--http-server``.
HTTP_SERVERS: Final = ("builtin", "uvicorn", "hypercorn")
#: Seconds of silence after which the rest of an answered request's body is taken as done
#: and the connection closed (its bytes sent by then have been read: no reset).
_LINGER: Final = 0.2
#: The listening socket's backlog (``serve_http.listen``'s).
LISTEN_BACKLOG: Final = 2048
#: The largest request head (request line and headers) accepted, in bytes: Hypercorn's
#: ``h11_max_incomplete_size``, for both servers.
MAX_HEAD_BYTES: Final = 16 * 1024


class HttpServer(Protocol):
    """One HTTP server over a listening socket."""

    #: Seconds the open connections get to finish once stopped (read when it stops).
    graceful_timeout: float

    async def serve(self, app: Any, stop: anyio.Event) -> None:
        """Serve ``app`` until ``stop`` is set, then stop as described above."""


def choose_http_server(args: argparse.Namespace) -> str:
    """``--http-server`` resolved for ``--backend`` (builtin on trio, else uvicorn); raises
    :class:`UsageError` for a combination that cannot run or an option the chosen server
    cannot honour."""
    chosen: str | None = args.http_server
    if chosen is None:
        chosen = "builtin" if args.backend == "trio" else "uvicorn"
    if chosen == "uvicorn":
        if args.backend == "trio":
            raise UsageError("--http-server uvicorn runs on asyncio only; with --backend "
                             "trio use --http-server builtin or hypercorn")
        if args.read_timeout is not None:
            raise UsageError("--read-timeout is not uvicorn's; add --http-server builtin "
                             "or hypercorn to use it")
    return chosen


def http_server(name: str, args: argparse.Namespace, http_fd: int) -> HttpServer:
    """The server ``name`` (from :func:`choose_http_server`) on the listening socket
    ``http_fd``, which it closes when it stops."""
    if name == "builtin":
        return _builtin(args, http_fd)
    if name == "uvicorn":
        return _Uvicorn(args, http_fd)
    return _Hypercorn(args, http_fd)


def _builtin(args: argparse.Namespace, http_fd: int) -> HttpServer:
    from ..server.http1 import Http1Server

    context = None
    if args.ssl_certfile is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    return Http1Server(socket.socket(fileno=http_fd),
                       keep_alive_timeout=args.keep_alive_timeout,
                       read_timeout=args.read_timeout, max_head_bytes=MAX_HEAD_BYTES,
                       root_path=args.root_path or "", ssl_context=context,
                       log=_server_logger("anyio_genout.http1", "http"))


def _server_logger(name: str, label: str) -> logging.Logger:
    """The HTTP server's error log, printed once: its own handler, not propagated to the
    command line's (Hypercorn's "Running on ..." line came out twice), and from WARNING
    (the command prints its own line saying where it serves); everything, once, through
    the command line's handler with ``--debug``."""
    log = logging.getLogger(name)
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        return log
    log.propagate = False
    log.setLevel(logging.WARNING)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"anyio-genout: {label}: %(levelname)s: "
                                               "%(message)s"))
        log.addHandler(handler)
    return log


class _Hypercorn:
    def __init__(self, args: argparse.Namespace, http_fd: int) -> None:
        from hypercorn.config import Config

        self._config = config = Config()
        config.bind = [f"fd://{http_fd}"]
        # Hypercorn listens again on the socket with its own backlog (100): under a burst
        # of connections on trio, hundreds were left unanswered.
        config.backlog = LISTEN_BACKLOG
        config.accesslog = None
        config.errorlog = _server_logger("hypercorn.error", "hypercorn")
        config.keep_alive_timeout = args.keep_alive_timeout
        config.read_timeout = args.read_timeout
        config.h11_max_incomplete_size = MAX_HEAD_BYTES
        config.certfile, config.keyfile = args.ssl_certfile, args.ssl_keyfile
        config.root_path = args.root_path or ""
        self._trio = args.backend == "trio"

    @property
    def graceful_timeout(self) -> float:
        return float(self._config.graceful_timeout)

    @graceful_timeout.setter
    def graceful_timeout(self, seconds: float) -> None:
        self._config.graceful_timeout = seconds

    async def serve(self, app: Any, stop: anyio.Event) -> None:
        if self._trio:
            from hypercorn.trio import serve as trio_serve

            await trio_serve(app, self._config, shutdown_trigger=stop.wait)
        else:
            from hypercorn.asyncio import serve as asyncio_serve

            await asyncio_serve(app, self._config, shutdown_trigger=stop.wait)


class _Uvicorn:
    def __init__(self, args: argparse.Namespace, http_fd: int) -> None:
        self._args = args
        self._socket = socket.socket(fileno=http_fd)
        self.graceful_timeout = 0.0
        _server_logger("uvicorn.error", "uvicorn")

    async def serve(self, app: Any, stop: anyio.Event) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield  # the signals are the caller's (serve's Lifecycle)

        args = self._args
        config = uvicorn.Config(
            app, http=_guarded_protocol(args.root_path or ""), loop="none", lifespan="off",
            backlog=LISTEN_BACKLOG,
            ws="none", interface="asgi3", access_log=False, log_config=None,
            proxy_headers=False, timeout_keep_alive=args.keep_alive_timeout,
            ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile)
        server = Server(config)

        async def stopper() -> None:
            await stop.wait()
            config.timeout_graceful_shutdown = self.graceful_timeout  # type: ignore[assignment]
            server.should_exit = True

        async with anyio.create_task_group() as tg:
            tg.start_soon(stopper)
            await server.serve(sockets=[self._socket])
            tg.cancel_scope.cancel()


def _guarded_protocol(root_path: str) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with the head timeout and size bound it lacks, and
    ``root_path`` given as Hypercorn gives it: in the scope, not prepended to the path
    (uvicorn's own prepends it, so a request sent with the prefix would not match)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class _GuardedHttpTools(HttpToolsProtocol):
        #: What closes the connection next: the head timeout while a head is awaited, the
        #: linger while an answered request's body is dropped (None: neither).
        _timer: asyncio.TimerHandle | None = None
        _head_bytes = 0
        #: While the rest of an answered request's body is dropped: when to close at the latest.
        _drop_until: float | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_head()

        def _await_head(self) -> None:
            self._head_bytes = 0
            self._timer = self.loop.call_later(self.timeout_keep_alive, self._close)

        def _cancel_timer(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _close(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                return
            if self._drop_until is not None:  # the rest of an answered request's body
                self._linger()
            elif self._timer is not None:  # a head awaited
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._cancel_timer()
                    self.send_400_response("Request head too large.")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope["root_path"] = root_path

        def on_headers_complete(self) -> None:
            self._cancel_timer()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if self.transport.is_closing():
                return
            if cycle is not None and cycle.more_body:
                # Answered before its body came whole (401, 413, 429, ...), as Hypercorn
                # does: read and drop the rest, then close; closing at once would reset a
                # connection whose unread bytes are still coming, losing the answer.
                self._unset_keepalive_if_required()
                self._drop_until = self.loop.time() + self.timeout_keep_alive
                self._linger()
                return
            # uvicorn armed its keep-alive timer: no pipelined request waits, so the next
            # head must come in time too.
            if self.timeout_keep_alive_task is not None:
                self._await_head()

        def _linger(self) -> None:
            """Close after :data:`_LINGER` s without more bytes, or at ``_drop_until``."""
            self._cancel_timer()
            assert self._drop_until is not None
            when = min(self.loop.time() + _LINGER, self._drop_until)
            self._timer = self.loop.call_at(when, self._close)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            if self._drop_until is not None:
                self._close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_timer()
            super().connection_lost(exc)

    return _GuardedHttpTools
