"""``Connection``: one client connection, read by one task and answered by another.

The reader feeds what arrives to httptools' parser, whose callbacks (the ``on_*`` methods)
make a :class:`~.cycle.Cycle` per request head and fill its body; it stops reading while a
body waits unread past :data:`BODY_HIGH_WATER` or :data:`MAX_PIPELINED` heads wait their
turn, and it is what sees the client go (end of stream, reset), which wakes the cycle's
``receive`` with ``http.disconnect``. The handler runs the app on each request in turn:

* a request head must arrive whole within ``keep_alive_timeout`` of the connection's start
  or of the previous response's end, and be at most ``max_head_bytes``, or the connection
  is closed (a head too large is answered 431 first);
* a malformed request is answered 400 and the connection closed;
* a response sent before its request's body came whole closes the connection (the rest
  of that body cannot be told from the next request);
* a connection closes gracefully (:meth:`Connection._close`): our side ends first, and
  what the client still sends is read and dropped until it closes or pauses for
  :data:`LINGER` seconds; closing at once would reset a connection whose unread bytes are
  still coming, losing the answer;
* once the server stops, the response in progress ends the connection, and an idle one
  is closed at once.

Only the handler's app and the 100 Continue of a ``receive`` write; :meth:`write` keeps
their writes whole and in order.
"""

from __future__ import annotations

import collections
import logging
from typing import Final
from urllib.parse import unquote

import anyio
import anyio.abc
import httptools

from .cycle import App, Cycle, plain_response

__all__ = ["BODY_HIGH_WATER", "LINGER", "MAX_PIPELINED", "Connection", "ConnectionSettings"]

#: Bytes of unread request body after which the reader waits for the app.
BODY_HIGH_WATER: Final = 256 * 1024
#: Request heads parsed ahead of the one being answered after which the reader waits.
MAX_PIPELINED: Final = 8
#: Seconds of silence after which a closing connection's client is taken as done sending.
LINGER: Final = 0.2
_READ_SIZE: Final = 65536
_STREAM_GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
                OSError)


class _HeadTooLarge(Exception):
    pass


class ConnectionSettings:
    """What every connection of one server shares."""

    __slots__ = ("app", "keep_alive_timeout", "log", "max_head_bytes", "read_timeout",
                 "root_path", "scheme")

    def __init__(self, app: App, *, keep_alive_timeout: float, read_timeout: float | None,
                 max_head_bytes: int, root_path: str, scheme: str,
                 log: logging.Logger) -> None:
        self.app = app
        self.keep_alive_timeout = keep_alive_timeout
        self.read_timeout = read_timeout
        self.max_head_bytes = max_head_bytes
        self.root_path = root_path
        self.scheme = scheme
        self.log = log


class Connection:
    """One client connection (:meth:`run` serves it to the end)."""

    def __init__(self, stream: anyio.abc.ByteStream, settings: ConnectionSettings, *,
                 server: tuple[str, int | None] | None,
                 client: tuple[str, int] | None) -> None:
        self._stream = stream
        self._settings = settings
        self.log = settings.log
        self._server = server
        self._client = client
        self._parser = httptools.HttpRequestParser(self)
        #: Heads parsed and not yet answered, oldest first; the one being read last.
        self._pending: collections.deque[Cycle] = collections.deque()
        self._reading: Cycle | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        #: Bytes of the head being read (counted as parsed, and as read while it is open).
        self._head_bytes = 0
        #: The same, counted as read (the reads after the one it began in).
        self._head_raw = 0
        #: Bytes read while parsing waits (:meth:`_must_wait`), parsed once it goes on.
        self._stash: list[bytes] = []
        self._stashed = 0
        #: The scope of the reader's receive while parsing waits; of the whole connection.
        self._paused: anyio.CancelScope | None = None
        self._scope: anyio.CancelScope | None = None
        #: Whether a head has begun and is not whole yet; whether it began in this read.
        self._in_head = False
        self._began_now = False
        #: The client is gone (or the connection is closing): nothing more is read or written.
        self.closed = False
        #: The reader has stopped: end of stream, a malformed request, or an upgrade.
        self.ended = False
        #: The client closed or reset the connection, or was silent past read_timeout.
        self._peer_gone = False
        #: The server is stopping: no request after the one in progress.
        self.stopping = False
        #: The answer to a malformed request, written once the ones before it are answered.
        self.error: bytes | None = None
        self._received = 0
        self._handler_wakeup: anyio.Event | None = None
        self._reader_wakeup: anyio.Event | None = None
        self._writing = False
        self._written: anyio.Event | None = None

    # -- the parser's callbacks -------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_bytes = self._head_raw = 0
        self._in_head = self._began_now = True

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))
        self._count_head(len(name) + len(value) + 4)

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self._settings.max_head_bytes:
            raise _HeadTooLarge

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self._parser
        version = parser.get_http_version()
        raw_path, query = self._target()
        settings = self._settings
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
                 "http_version": version, "method": parser.get_method().decode("ascii"),
                 "scheme": settings.scheme,
                 "path": unquote(raw_path.decode("ascii")) if b"%" in raw_path
                 else raw_path.decode("ascii"),
                 "raw_path": raw_path, "query_string": query,
                 "root_path": settings.root_path, "headers": self._headers,
                 "client": self._client, "server": self._server}
        expect = version == "1.1" and any(
            name == b"expect" and value.lower() == b"100-continue"
            for name, value in self._headers)
        if parser.should_upgrade() and any(
                name in (b"content-length", b"transfer-encoding") and value != b"0"
                for name, value in self._headers):
            # httptools reads no body after an upgrade head: the app would get none
            raise ValueError("an upgrade request with a body")
        self._headers = []  # a chunked body's trailers must not join the scope's headers
        cycle = Cycle(self, scope, keep_alive=parser.should_keep_alive() and not self.stopping,
                      expect_continue=expect)
        self._reading = cycle
        self._pending.append(cycle)
        self._wake_handler()

    def _target(self) -> tuple[bytes, bytes]:
        """The request target's path and query (raises ValueError, a 400, if unusable)."""
        url = httptools.parse_url(self._url)
        path: bytes = url.path or b"/"
        path.decode("ascii")  # a non-ASCII byte is not a URL: UnicodeDecodeError
        return path, url.query or b""

    def on_body(self, body: bytes) -> None:
        cycle = self._reading
        if cycle is not None and not cycle.response_done:
            cycle.body.append(body)
            cycle.buffered += len(body)
            cycle.wake()

    def on_message_complete(self) -> None:
        cycle = self._reading
        self._reading = None
        if cycle is not None:
            cycle.body_done = True
            cycle.wake()

    # -- the two tasks ----------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until it ends, then close it. Raises nothing but
        cancellation: a failure of this module is logged."""
        answered = False
        try:
            async with anyio.create_task_group() as tg:
                self._scope = tg.cancel_scope
                tg.start_soon(self._read)
                try:
                    answered = await self._handle()
                finally:
                    tg.cancel_scope.cancel()
        except Exception:
            self.log.exception("HTTP connection failed")
        finally:
            self.closed = True
            await self._close(linger=answered)

    async def _close(self, *, linger: bool) -> None:
        """Close the stream; with ``linger``, first end our side and read and drop what
        the client still sends until it closes too or pauses for :data:`LINGER` s
        (``keep_alive_timeout`` at most), so that closing neither resets the connection
        under an answer the client has not read (unread bytes make the kernel reset it)
        nor drops what is still buffered to it."""
        stream = self._stream
        try:
            if linger and not self._peer_gone:
                with anyio.move_on_after(self._settings.keep_alive_timeout):
                    await stream.send_eof()
                    while True:
                        with anyio.move_on_after(LINGER) as silent:
                            await stream.receive(_READ_SIZE)
                        if silent.cancelled_caught:
                            break
        except (NotImplementedError, *_STREAM_GONE):  # TLS cannot half-close
            pass
        finally:  # the server's cancel ends the linger, not the close
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                try:
                    await stream.aclose()
                except (*_STREAM_GONE, anyio.BusyResourceError):
                    pass

    def stop(self) -> None:
        """The server stops: no request after the one in progress, if any."""
        self.stopping = True
        for cycle in self._pending:
            cycle.keep_alive = False
        self._wake_handler()

    async def _handle(self) -> bool:
        """Answer each request in turn; returns whether the connection ends just after an
        answer (which the graceful close protects), not idle or with a head unfinished."""
        while (cycle := await self._next()) is not None:
            await cycle.run(self._settings.app)
            self._pending.popleft()
            self.resume_reading()
            if not (cycle.keep_alive and cycle.body_done) or self.closed:
                return True
        if self.error is not None and not self.closed:
            await self.write(self.error)
            return True
        return False

    async def _next(self) -> Cycle | None:
        """The next request to answer, once its head is whole; None to close."""
        if not self._pending and not self.ended and not self.stopping:
            with anyio.move_on_after(self._settings.keep_alive_timeout):
                while not self._pending and not self.ended and not self.stopping:
                    event = self._handler_wakeup = anyio.Event()
                    await event.wait()
        if self.closed or not self._pending:
            return None
        return self._pending[0]

    async def _read(self) -> None:
        try:
            while True:
                if self._must_wait():
                    # Parse nothing more until the app catches up, but go on reading (up
                    # to BODY_HIGH_WATER bytes set aside) so that a client that goes is
                    # still seen; resume_reading cuts the wait short.
                    if self._stashed >= BODY_HIGH_WATER:
                        event = self._reader_wakeup = anyio.Event()
                        await event.wait()
                        continue
                    with anyio.CancelScope() as self._paused:
                        data = await self._receive()
                        self._stash.append(data)
                        self._stashed += len(data)
                    self._paused = None
                    continue
                if self._stash:
                    data = b"".join(self._stash)
                    self._stash.clear()
                    self._stashed = 0
                else:
                    data = await self._receive()
                if not self._feed(data):
                    # Nothing more is parsed; read on (and drop) to see the client go.
                    self._end()
                    while True:
                        await self._receive()
        except _STREAM_GONE:
            self._gone()
        finally:
            self._end()

    async def _receive(self) -> bytes:
        """The next bytes from the client; silent past ``read_timeout``, the connection is
        cancelled (even a response blocked on a client that does not read)."""
        read_timeout = self._settings.read_timeout
        if read_timeout is None:
            data = await self._stream.receive(_READ_SIZE)
        else:
            with anyio.move_on_after(read_timeout) as silent:
                data = await self._stream.receive(_READ_SIZE)
            if silent.cancelled_caught:
                self._gone()
                if self._scope is not None:
                    self._scope.cancel()
                raise anyio.EndOfStream
        self._received += len(data)
        return data

    def _feed(self, data: bytes) -> bool:
        """Parse ``data``; False once nothing more is to be parsed (an upgrade, or a
        request refused)."""
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            return False  # the request is whole; nothing after it is read
        except httptools.HttpParserCallbackError as exc:
            self._refuse(exc.__context__)
            return False
        except httptools.HttpParserError as exc:
            self._refuse(exc)
            return False
        began, self._began_now = self._began_now, False
        if self._in_head:  # a head still coming: bound it as it is read
            if not began:
                self._head_raw += len(data)
            if max(self._head_raw, self._head_bytes) > self._settings.max_head_bytes:
                self._refuse(_HeadTooLarge())
                return False
        return True

    def _end(self) -> None:
        self.ended = True
        for cycle in self._pending:
            cycle.wake()
        self._wake_handler()

    def _refuse(self, exc: BaseException | None) -> None:
        """Answer a malformed request (after the ones before it) and stop reading."""
        if isinstance(exc, _HeadTooLarge):
            self.error = plain_response(431, "Request head too large.")
        else:
            self.error = plain_response(400, "Invalid HTTP request.")
        self.log.debug("refused a request: %r", exc)

    def _must_wait(self) -> bool:
        if self.closed or (self.stopping and not self._pending):
            return False
        cycle = self._reading
        return (len(self._pending) > MAX_PIPELINED
                or (cycle is not None and cycle.buffered > BODY_HIGH_WATER
                    and not cycle.response_done))

    # -- what both use ----------------------------------------------------------------

    def resume_reading(self) -> None:
        if self._paused is not None:
            self._paused.cancel()
        if self._reader_wakeup is not None:
            self._reader_wakeup.set()
            self._reader_wakeup = None

    def _wake_handler(self) -> None:
        if self._handler_wakeup is not None:
            self._handler_wakeup.set()
            self._handler_wakeup = None

    async def write(self, data: bytes) -> None:
        """Write ``data`` whole after any write in progress; once the client is gone, mark
        the connection closed (waking the cycle's ``receive``) and drop it."""
        while self._writing:  # only a receive's 100 Continue can overlap the app's send
            event = self._written = self._written or anyio.Event()
            await event.wait()
        if self.closed:
            return
        self._writing = True
        try:
            await self._stream.send(data)
        except _STREAM_GONE:
            self._gone()
        finally:
            self._writing = False
            if self._written is not None:
                self._written.set()
                self._written = None

    def _gone(self) -> None:
        self.closed = self._peer_gone = True
        for cycle in self._pending:
            cycle.wake()
        self._wake_handler()
        self.resume_reading()
