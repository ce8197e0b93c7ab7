"""``TextResponse``: the ASGI response that runs one text generation for one HTTP request.

The generation's scope lives inside the response's ``__call__`` (no async generator wraps
it), in a task group with one more task that waits for the client's ``http.disconnect``:
a disconnect closes every text stream at once (aborting each engine request still running
exactly once), stops all writing, and cancels the group. Errors on entering (a bad field,
an unhealthy client) are answered with OpenAI's error body; an error after the SSE stream
started ends it with an error event and ``data: [DONE]``, so a client never hangs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack

import anyio
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from ..errors import GenoutError
from ..text.client import TextClient
from ..text.output import CollectedTextOutput, TextOutput, collect_text, merge_outputs
from ..text.request import TextRequest
from ..text.stream import TextStream
from .errors import error_body
from .formats import Format, dumps, sse_event

__all__ = ["TextResponse"]

_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"),
                (b"cache-control", b"no-cache")]
_JSON_HEADERS = [(b"content-type", b"application/json")]
_DONE = b"data: [DONE]\n\n"




def _with_buffered(stream: TextStream, out: TextOutput) -> tuple[TextOutput, GenoutError | None]:
    """``out`` with whatever else of ``stream`` is already buffered merged in: under load
    a client gets what arrived together as one event (one write, one JSON document) instead
    of an event per token. An error met there comes second, after what came before it."""
    if out.finish_reason is not None:
        return out, None
    more = [out]
    failure = None
    try:
        while more[-1].finish_reason is None:
            more.append(stream.receive_nowait())
    except (anyio.WouldBlock, anyio.EndOfStream):
        pass
    except GenoutError as exc:
        failure = exc
    return merge_outputs(more), failure


class TextResponse(Response):
    """Run ``requests`` (one per choice, ``n`` of them) on ``text_client`` and answer in
    ``fmt``'s shape (SSE if ``stream``).

    Every request is entered (checked and sent) before the response starts, so a bad field
    is a 400; then each is read by its own task in one task group, and streamed chunks
    interleave by choice ``index``. Leaving early (a disconnect, an error of one choice)
    leaves every request's scope, aborting each still running exactly once.
    """

    def __init__(self, text_client: TextClient, requests: Sequence[TextRequest], fmt: Format,
                 *, stream: bool, include_usage: bool) -> None:
        super().__init__()
        self._text = text_client
        self._requests = requests
        self._fmt = fmt
        self._stream = stream
        self._include_usage = include_usage
        self._started = False
        self._lock = anyio.Lock() if len(requests) > 1 else None
        self._streams: list[TextStream] = []  # entered so far (the disconnect closes them)
        self._disconnected = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_while_connected(message: Message) -> None:
            if not self._disconnected:  # nothing more is written to a dead connection
                await send(message)

        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_disconnect, receive, tg.cancel_scope)
            try:
                await self._run(send_while_connected)
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
                self._disconnected = True
                for stream in self._streams:
                    stream.close()
                scope.cancel()
                return

    async def _start(self, send: Send, status: int, headers: list[tuple[bytes, bytes]]
                     ) -> None:
        self._started = True
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _body(self, send: Send, body: bytes, *, more: bool) -> None:
        await send({"type": "http.response.body", "body": body, "more_body": more})

    async def _send_event(self, send: Send, event: bytes) -> None:
        if self._lock is None:
            await self._body(send, event, more=True)
            return
        async with self._lock:  # choices send from their own tasks
            await self._body(send, event, more=True)

    @staticmethod
    async def _each(streams: list[TextStream],
                    work: Callable[[int, TextStream], Awaitable[None]]) -> None:
        """``work(i, stream)`` for each stream, concurrently when several; the first error
        of the library cancels the others and is raised as it is (no ExceptionGroup)."""
        if len(streams) == 1:
            await work(0, streams[0])
            return
        failures: list[GenoutError] = []

        async def one(i: int, stream: TextStream, scope: anyio.CancelScope) -> None:
            try:
                await work(i, stream)
            except GenoutError as exc:
                failures.append(exc)
                scope.cancel()

        async with anyio.create_task_group() as tg:
            for i, stream in enumerate(streams):
                tg.start_soon(one, i, stream, tg.cancel_scope)
        if failures:
            raise failures[0]

    async def _run(self, send: Send) -> None:
        try:
            async with AsyncExitStack() as scopes:
                streams = self._streams
                for request in self._requests:
                    streams.append(await scopes.enter_async_context(
                        self._text.generate(request)))
                    if self._disconnected:
                        streams[-1].close()
                if not self._stream:
                    wholes: list[CollectedTextOutput | None] = [None] * len(streams)

                    async def collect(i: int, stream: TextStream) -> None:
                        wholes[i] = await collect_text(stream)

                    await self._each(streams, collect)
                    done = [whole for whole in wholes if whole is not None]
                    rendered = dumps(self._fmt.whole(done))  # may fail: an error answer
                    # Closed before the answer goes out, so a client that has it finds
                    # the request in /metrics (the streams record their end on close).
                    await scopes.aclose()
                    await self._start(send, 200, _JSON_HEADERS)
                    await self._body(send, rendered, more=False)
                    return
                await self._start(send, 200, _SSE_HEADERS)
                fmt = self._fmt
                for first in fmt.first_chunks(len(streams)):
                    await self._body(send, sse_event(first), more=True)
                completion = 0

                async def relay(i: int, stream: TextStream) -> None:
                    nonlocal completion
                    async for out in stream:
                        out, failure = _with_buffered(stream, out)
                        completion += len(out.token_ids)
                        event = fmt.event(out, i)
                        if event is not None:
                            await self._send_event(send, event)
                        if failure is not None:
                            raise failure

                await self._each(streams, relay)
                await scopes.aclose()  # recorded before [DONE], as above
                if self._include_usage:
                    usage = fmt.usage_chunk(
                        fmt.prompt_tokens([len(s.prompt_token_ids) for s in streams]),
                        completion)
                    await self._body(send, sse_event(usage), more=True)
                await self._body(send, _DONE, more=False)
        except GenoutError as exc:
            error = self._fmt.api_error(exc)  # vLLM's param names
            body = error_body(error.status, error.message, error.param)
            if not self._started:
                await self._start(send, error.status, _JSON_HEADERS)
                await self._body(send, dumps(body), more=False)
            elif self._stream:
                await self._body(send, sse_event(body) + _DONE, more=False)
            else:
                raise
