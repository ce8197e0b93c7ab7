"""``TextResponse``: the ASGI response that runs one text generation for one HTTP request.

The generation's scope lives inside the response's ``__call__`` (no async generator wraps
it), in a task group with one more task that waits for the client's ``http.disconnect``:
a disconnect cancels the group, and leaving the text stream's scope by cancellation aborts
the engine request exactly once. Errors on entering (a bad field, an unhealthy client) are
answered with OpenAI's error body; an error after the SSE stream started ends it with an
error event and ``data: [DONE]``, so a client never hangs.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..errors import GenoutError
from ..text.client import TextClient
from ..text.output import collect_text
from ..text.request import TextRequest
from .errors import error_body, error_for
from .formats import Format

__all__ = ["TextResponse"]

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache")]
_JSON_HEADERS = [(b"content-type", b"application/json")]
_DONE = b"data: [DONE]\n\n"


def _dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _event(value: Any) -> bytes:
    return b"data: " + _dumps(value) + b"\n\n"


class TextResponse(Response):
    """Run ``request`` on ``text_client`` and answer in ``fmt``'s shape (SSE if ``stream``)."""

    def __init__(self, text_client: TextClient, request: TextRequest, fmt: Format, *,
                 stream: bool, include_usage: bool) -> None:
        super().__init__()
        self._text = text_client
        self._request = request
        self._fmt = fmt
        self._stream = stream
        self._include_usage = include_usage
        self._started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_disconnect, receive, tg.cancel_scope)
            try:
                await self._run(send)
            finally:
                tg.cancel_scope.cancel()

    @staticmethod
    async def _watch_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                scope.cancel()
                return

    async def _start(self, send: Send, status: int, headers: list[tuple[bytes, bytes]]
                     ) -> None:
        self._started = True
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _body(self, send: Send, body: bytes, *, more: bool) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": more})

    async def _run(self, send: Send) -> None:
        try:
            async with self._text.generate(self._request) as stream:
                if not self._stream:
                    whole = await collect_text(stream)
                    await self._start(send, 200, _JSON_HEADERS)
                    await self._body(send, _dumps(self._fmt.whole(whole)), more=False)
                    return
                await self._start(send, 200, _SSE_HEADERS)
                fmt = self._fmt
                for first in fmt.first_chunks():
                    await self._body(send, _event(first), more=True)
                completion = 0
                async for out in stream:
                    completion += len(out.token_ids)
                    chunk = fmt.chunk(out)
                    if chunk is not None:
                        await self._body(send, _event(chunk), more=True)
                if self._include_usage:
                    usage = fmt.usage_chunk(len(stream.prompt_token_ids), completion)
                    await self._body(send, _event(usage), more=True)
                await self._body(send, _DONE, more=False)
        except GenoutError as exc:
            error = error_for(exc)
            body = error_body(error.status, error.message, error.param)
            if not self._started:
                await self._start(send, error.status, _JSON_HEADERS)
                await self._body(send, _dumps(body), more=False)
            elif self._stream:
                await self._body(send, _event(body) + _DONE, more=False)
            else:
                raise
