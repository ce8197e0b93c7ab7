"""``Limits``: the ASGI middleware that bounds request bodies (413) and the number of
generations served at once (429), answering in OpenAI's error shape."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import anyio
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response

__all__ = ["Limits", "drain", "draining_send", "tolerant_send"]


def tolerant_send(send: Send) -> Send:
    """``send``, except that on trio a message that collides with Hypercorn closing the
    connection is dropped, and so is every later one (the client is gone).

    Hypercorn 0.18's trio worker shuts a connection's sending side down (``send_eof``)
    without its send lock when the client hangs up in the middle of a request body, and a
    response being sent meanwhile then fails with ``trio.BusyResourceError`` ("another
    task is currently sending data on this SocketStream"), which it logs with a traceback
    as "Error in ASGI Framework". Any response sent before the whole body arrived (401,
    413, 408, 429, ...) to a client that hangs up then can hit it. On asyncio (no such
    race) ``send`` itself is returned. Raises what ``send`` raises, but that error.
    """
    trio = sys.modules.get("trio")
    if trio is None:
        return send
    try:
        trio.lowlevel.current_task()
    except RuntimeError:  # not running on trio
        return send
    busy: type[Exception] = trio.BusyResourceError
    gone = False

    async def guarded(message: Message) -> None:
        nonlocal gone
        if gone:
            return
        try:
            await send(message)
        except busy:
            gone = True

    return guarded


async def drain(receive: Receive, deadline: float | None) -> None:
    """Read and drop what is left of a request's body: until its end, the client's
    disconnect, or ``deadline`` (anyio's clock; None: no deadline). Raises nothing."""
    with anyio.CancelScope(deadline=math.inf if deadline is None else deadline):
        while True:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return


def draining_send(send: Send, receive: Receive, deadline: float | None,
                  body_done: Callable[[], bool]) -> Send:
    """``send``, except that the last message of a response sent while ``body_done()`` is
    false (an answer before the whole body was read: 401, 413, 429, 404, ...) is sent
    while another task drains the body (:func:`drain`, until ``deadline``).

    Hypercorn's reader stops while its queue of 10 body messages is full, and the last
    message of a response queues ``http.disconnect`` there before the connection can be
    closed: a client with more than 10 chunks on their way would otherwise hold the
    connection, and the request's task inside that ``send``, for ever. Raises what
    ``send`` raises.
    """
    async def wrapped(message: Message) -> None:
        if (message["type"] != "http.response.body" or message.get("more_body", False)
                or body_done()):
            await send(message)
            return
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(drain, receive, deadline)
                await send(message)
        except BaseExceptionGroup as group:  # only send's own error: no group leaks
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise

    return wrapped


class Limits:
    """Bound every HTTP request's body to ``max_body_size`` bytes, and with
    ``max_concurrent_requests`` the requests to ``limited_paths`` running at once.

    A ``content-length`` beyond the limit is answered 413 before the body is read; a
    chunked body that grows beyond it fails the read with a 413 (FastAPI passes an
    ``HTTPException`` raised while reading the body on as it is). A limited request beyond
    ``max_concurrent_requests`` is answered 429 at once (vLLM's Python server has such
    admission control); it counts until its response (a whole stream) has ended. With
    ``body_timeout``, a body not received whole within that many seconds of the request's
    start fails the read with a 408 (a slowly trickled body; Hypercorn bounds the head).
    An answer sent before the whole body was read drains the rest of it (until the same
    deadline; :func:`draining_send`), and every send is a :func:`tolerant_send`.
    """

    def __init__(self, app: ASGIApp, *, max_body_size: int,
                 max_concurrent_requests: int | None,
                 limited_paths: frozenset[str], body_timeout: float | None = None) -> None:
        self._app = app
        self._body_timeout = body_timeout
        self._max_body = max_body_size
        self._max_running = max_concurrent_requests
        self._paths = limited_paths
        self._running = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        limit = self._max_body
        deadline = (None if self._body_timeout is None
                    else anyio.current_time() + self._body_timeout)
        received = 0
        body_done = False
        send = draining_send(tolerant_send(send), receive, deadline, lambda: body_done)
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = -1
                if length > limit:
                    await self._too_large()(scope, receive, send)
                    return

        async def bounded_receive() -> Message:
            nonlocal received, body_done
            if body_done or deadline is None:
                message = await receive()
            else:
                got: Message | None = None
                with anyio.move_on_after(deadline - anyio.current_time()):
                    got = await receive()
                if got is None:
                    raise HTTPException(408, f"the request body did not arrive within "
                                        f"{self._body_timeout} s")
                message = got
            if not body_done:
                body_done = message["type"] != "http.request" or not message.get(
                    "more_body", False)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, self._message())
            return message

        if self._max_running is not None and scope["path"] in self._paths:
            if self._running >= self._max_running:
                await error_response(
                    429, f"too many concurrent requests (at most {self._max_running}); "
                    "retry later")(scope, receive, send)
                return
            self._running += 1
            try:
                await self._app(scope, bounded_receive, send)
            finally:
                self._running -= 1
        else:
            await self._app(scope, bounded_receive, send)

    def _message(self) -> str:
        return f"the request body is larger than the limit of {self._max_body} bytes"

    def _too_large(self) -> ASGIApp:
        return error_response(413, self._message())
