"""``Cycle``: one request's ASGI exchange on a connection (its ``receive`` and ``send``).

The connection's reader fills the cycle's body as the parser reads it; the app, run by the
connection's handler, takes it with ``receive`` and answers with ``send``, which frames the
response (``content-length``, chunked, or close-delimited for HTTP/1.0) and writes each
body message in one write. What the app may send follows ASGI's HTTP spec; a message out
of order raises :class:`RuntimeError` naming it.
"""

from __future__ import annotations

import http
import logging
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from typing import Any, Final, Protocol

import anyio

__all__ = ["App", "Cycle", "Link", "plain_response"]

Message = dict[str, Any]
App = Callable[[dict[str, Any], Callable[[], Awaitable[Message]],
                Callable[[Message], Awaitable[None]]], Awaitable[None]]

_DISCONNECT: Final = {"type": "http.disconnect"}
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
#: Statuses whose response has no body (RFC 9112 6.3).
_NO_BODY: Final = frozenset({204, 304})
_STATUS_LINES: dict[int, bytes] = {}
_date: list[Any] = [0, b""]


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = http.HTTPStatus(status).phrase.encode()
        except ValueError:
            phrase = b""
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, phrase)
    return line


def _date_header() -> bytes:
    """``date: ...\\r\\n``, formatted once a second."""
    now = int(time.time())
    if now != _date[0]:
        _date[0], _date[1] = now, b"date: %s\r\n" % formatdate(now, usegmt=True).encode()
    value: bytes = _date[1]
    return value


def plain_response(status: int, text: str, *, close: bool = True, head: bool = False
                   ) -> bytes:
    """A whole ``text/plain`` response: what the server answers by itself; to a ``HEAD``
    request (``head``) its head alone, which says the length the body would have."""
    body = text.encode()
    return b"".join((_status_line(status), _date_header(),
                     b"content-type: text/plain; charset=utf-8\r\n",
                     b"content-length: %d\r\n" % len(body),
                     b"connection: close\r\n" if close else b"", b"\r\n",
                     b"" if head else body))


class Link(Protocol):
    """What a cycle needs of its connection (:class:`~.connection.Connection`)."""

    #: The client is gone: nothing more is written, ``receive`` says ``http.disconnect``.
    closed: bool
    #: Nothing more is read (end of stream, a malformed request, an upgrade).
    ended: bool
    #: The server is stopping: this is the connection's last request.
    stopping: bool
    #: The answer to a malformed request, if one came.
    error: bytes | None
    log: logging.Logger

    async def write(self, data: bytes) -> None:
        """Write ``data`` whole, in order; dropped once the client is gone."""

    def resume_reading(self) -> None:
        """The body was taken or the response ended: the reader may go on."""


class Cycle:
    """One request: its ASGI ``scope``, the body read for it so far, and its response."""

    __slots__ = ("_chunked", "_conn", "_delivered", "_expect_continue", "_head",
                 "_head_request", "_remaining", "_wakeup", "body", "body_done", "buffered",
                 "keep_alive", "response_done", "response_started", "scope")

    def __init__(self, conn: Link, scope: dict[str, Any], *, keep_alive: bool,
                 expect_continue: bool) -> None:
        self._conn = conn
        self.scope = scope
        #: Whether the connection may carry another request after this one.
        self.keep_alive = keep_alive
        self._expect_continue = expect_continue
        self._head_request = scope["method"] == "HEAD"
        #: Body chunks read and not yet received by the app, and their size.
        self.body: list[bytes] = []
        self.buffered = 0
        #: Whether the parser has read the whole body; whether the app has received it.
        self.body_done = False
        self._delivered = False
        self.response_started = False
        self.response_done = False
        #: A response head not written yet (a ``content-length`` response's goes out with
        #: its body, in one write).
        self._head = b""
        self._chunked = False
        #: Body bytes a ``content-length`` response still owes (None: not that framing).
        self._remaining: int | None = None
        self._wakeup: anyio.Event | None = None

    def wake(self) -> None:
        """Wake a ``receive`` waiting for more body or for the end of the exchange."""
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    async def run(self, app: App) -> None:
        """Run ``app`` on this request; answer 500 (and close) for an app that fails or
        returns before starting its response, close for one that started and did not end
        it. Raises nothing but cancellation."""
        try:
            await app(self.scope, self.receive, self.send)
        except Exception:
            self._conn.log.exception("the app failed on %s %s", self.scope["method"],
                                     self.scope["path"])
            failed = True
        else:
            failed = False
        if self.response_done:
            return
        self.keep_alive = False
        conn = self._conn
        if self._head and not conn.closed:  # started, but nothing written: a 500 still can
            self._head = b""
            self.response_started = False
        if not self.response_started and not conn.closed:
            if conn.error is not None and not self.body_done:  # its body was malformed
                await conn.write(conn.error)
            else:
                if not failed:
                    conn.log.error("the app returned without a response to %s %s",
                                   self.scope["method"], self.scope["path"])
                await conn.write(plain_response(500, "Internal Server Error",
                                                head=self._head_request))
        self.response_done = True
        self.wake()

    async def receive(self) -> Message:
        """ASGI ``receive``: the body as read (``more_body`` until its end), then, once the
        response is done or the client is gone, ``http.disconnect``."""
        conn = self._conn
        while True:
            if self.body:
                body = self.body[0] if len(self.body) == 1 else b"".join(self.body)
                self.body.clear()
                self.buffered = 0
                conn.resume_reading()
                more = not self.body_done
                self._delivered = not more
                return {"type": "http.request", "body": body, "more_body": more}
            if self.body_done and not self._delivered:
                self._delivered = True
                return {"type": "http.request", "body": b"", "more_body": False}
            if conn.closed or self.response_done or (conn.ended and not self.body_done):
                return _DISCONNECT
            if self._expect_continue and not self.response_started:
                self._expect_continue = False
                await conn.write(_CONTINUE)
                continue
            event = self._wakeup = anyio.Event()
            await event.wait()

    async def send(self, message: Message) -> None:
        """ASGI ``send``. Raises :class:`RuntimeError` for a message out of order; once the
        client is gone, drops it."""
        kind = message["type"]
        if kind == "http.response.body":
            if not self.response_started or self.response_done:
                raise RuntimeError("http.response.body sent "
                                   + ("after the response ended" if self.response_started
                                      else "before http.response.start"))
            await self._send_body(message.get("body", b""), message.get("more_body", False))
        elif kind == "http.response.start":
            if self.response_started:
                raise RuntimeError("http.response.start sent twice")
            self._start(message["status"], message.get("headers", ()))
            if not self._head_request and self._remaining is None \
                    and self._head and not self._conn.closed:
                # A streamed response's head goes at once, as other servers send it.
                head, self._head = self._head, b""
                await self._conn.write(head)
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def _start(self, status: int, headers: Any) -> None:
        self.response_started = True
        conn = self._conn
        if conn.stopping or not self.body_done:
            # An answer before the whole body: the rest is dropped, then the connection
            # closed (it cannot be told from the next request).
            self.keep_alive = False
        parts = [_status_line(status)]
        length: int | None = None
        dated = False
        for name, value in headers:
            lower = name.lower()
            if lower == b"content-length":
                length = int(value)
            elif lower == b"connection" and b"close" in value.lower():
                self.keep_alive = False
            elif lower == b"date":
                dated = True
            parts.append(b"%s: %s\r\n" % (name, value))
        if not dated:
            parts.append(_date_header())
        if self._head_request or status in _NO_BODY or status < 200:
            self._remaining = 0 if length is None else length
            self._head_request = True  # no body goes out
        elif length is not None:
            self._remaining = length
        elif self.scope["http_version"] == "1.1":
            self._chunked = True
            parts.append(b"transfer-encoding: chunked\r\n")
        else:  # HTTP/1.0: the body ends where the connection does
            self.keep_alive = False
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        self._head = b"".join(parts)

    async def _send_body(self, body: bytes, more: bool) -> None:
        conn = self._conn
        if self._head_request:
            data = b""
        elif self._chunked:
            if body:
                data = b"%x\r\n%s\r\n" % (len(body), body)
                if not more:
                    data += b"0\r\n\r\n"
            else:
                data = b"" if more else b"0\r\n\r\n"
        else:
            data = body
            if self._remaining is not None:
                self._remaining -= len(body)
                if self._remaining < 0:
                    raise RuntimeError("the response body is longer than its content-length")
                if not more and self._remaining:
                    self.keep_alive = False  # a short body: the client cannot reuse this
        if self._head:
            data, self._head = self._head + data, b""
        if not more:
            self.response_done = True
            self.body.clear()  # an unread rest of the request's body is dropped from here
            self.buffered = 0
            self.wake()
            conn.resume_reading()
        if data and not conn.closed:
            await conn.write(data)
