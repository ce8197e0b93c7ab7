"""``TextResponse``: the ASGI transport of one completions or chat completions answer.

What is served, and how each error is answered, is :mod:`.serving`'s (plain functions the
batch runner calls too); this only starts the response, writes what serving renders, and
watches the connection. It runs inside the response's ``__call__`` (no async generator
wraps it), in a task group with one more task that waits for the client's
``http.disconnect``: a disconnect closes every text stream at once (aborting each engine
request still running exactly once), stops all writing, and cancels the group. Errors on
entering (a bad field, an unhealthy client) are answered with OpenAI's error body; an error
after the SSE stream started ends it with serving's error event and ``data: [DONE]``, so a
client never hangs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from ..text.client import TextClient
from .errors import ApiError, error_body
from .formats import dumps
from .serving import Generation, Plan, serve_stream, serve_whole_json

__all__ = ["BODY_SEND", "TextResponse"]

#: The scope key of the HTTP server's own ``send``, put there by the app's outermost layer
#: (:class:`.app._App`) for the body messages of a response once it has started; without
#: it (another app around this response) the body goes through ``send`` as usual.
BODY_SEND = "anyio_genout.body_send"

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache")]
_JSON_HEADERS = [(b"content-type", b"application/json")]


class TextResponse(Response):
    """Serve ``plan`` on ``text_client`` over ASGI: JSON (:func:`.serving.serve_whole_json`), or
    SSE if ``plan.stream`` (:func:`.serving.serve_stream`, once every choice has been
    entered: a bad field is a 400, not a broken stream)."""

    def __init__(self, text_client: TextClient, plan: Plan) -> None:
        super().__init__()
        self._generation = Generation(text_client, plan)
        self._started = False
        self._disconnected = False
        #: Set as the last body message is handed to the server (the requests are closed
        #: by then): an ``http.disconnect`` from then on is the server ending the exchange.
        self._finishing = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_while_connected(message: Message) -> None:
            if not self._disconnected:  # nothing more is written to a dead connection
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    self._finishing = True
                await send(message)

        body_send: Send = scope.get(BODY_SEND, send)

        async def send_chunk(chunk: bytes) -> None:  # one per SSE event: the short way
            if not self._disconnected:
                await body_send({"type": "http.response.body", "body": chunk,
                                 "more_body": True})

        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_disconnect, receive, tg.cancel_scope)
            try:
                await self._run(send_while_connected, send_chunk)
            finally:
                tg.cancel_scope.cancel()

    async def _watch_disconnect(self, receive: Receive, scope: anyio.CancelScope) -> None:
        """On ``http.disconnect``: close every request now (each still running is aborted
        once, synchronously), send nothing more, and cancel the response.

        Closing here rather than leaving it to the cancellation: on asyncio, anyio delivers
        a cancellation only when the task is not about to resume, and a relay that the
        reader wakes before every delivery attempt (a backlog of outputs under load) ran on
        to the engine's own finish, writing every event to the dead socket, with no ABORT.
        """
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if self._finishing:
                    # Hypercorn puts one in as it closes the stream after the last body,
                    # from inside that send: cancelling then (trio) cut its keep-alive
                    # bookkeeping short, and the idle connection was never closed.
                    return
                self._disconnected = True
                self._generation.close()
                scope.cancel()
                return

    async def _start(self, send: Send, status: int, headers: list[tuple[bytes, bytes]]
                     ) -> None:
        self._started = True
        await send({"type": "http.response.start", "status": status, "headers": headers})

    @staticmethod
    async def _body(send: Send, body: bytes, *, more: bool) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": more})

    async def _run(self, send: Send, send_chunk: Callable[[bytes], Awaitable[None]]
                   ) -> None:
        generation = self._generation
        try:
            if not generation.plan.stream:
                # The requests are closed when serve_whole returns, before the body goes
                # out, so a client that has it finds the request in /metrics.
                body = await serve_whole_json(generation)
                await self._start(send, 200, _JSON_HEADERS)
                await self._body(send, body, more=False)
                return
            async with generation:
                await self._start(send, 200, _SSE_HEADERS)
                last = await serve_stream(generation, send_chunk)  # closed before [DONE]
            await self._body(send, last, more=False)
        except ApiError as error:
            if self._started:
                raise
            await self._start(send, error.status, _JSON_HEADERS)
            await self._body(send, dumps(error_body(error.status, error.message,
                                                    error.param)), more=False)
