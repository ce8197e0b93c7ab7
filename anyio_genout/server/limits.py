"""``Limits``: the ASGI middleware that bounds request bodies (413) and the number of
generations served at once (429), answering in OpenAI's error shape."""

from __future__ import annotations

import anyio
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import error_response

__all__ = ["Limits"]


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
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = -1
                if length > limit:
                    await self._too_large()(scope, receive, send)
                    return
        received = 0
        body_done = False
        deadline = (None if self._body_timeout is None
                    else anyio.current_time() + self._body_timeout)

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
                body_done = message["type"] != "http.request" or not message.get(
                    "more_body", False)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, self._message())
            return message

        if self._max_running is None or scope["path"] not in self._paths:
            await self._app(scope, bounded_receive, send)
            return
        if self._running >= self._max_running:
            await error_response(
                429, f"too many concurrent requests (at most {self._max_running}); retry "
                "later")(scope, receive, send)
            return
        self._running += 1
        try:
            await self._app(scope, bounded_receive, send)
        finally:
            self._running -= 1

    def _message(self) -> str:
        return f"the request body is larger than the limit of {self._max_body} bytes"

    def _too_large(self) -> ASGIApp:
        return error_response(413, self._message())
