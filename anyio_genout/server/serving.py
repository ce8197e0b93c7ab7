"""OpenAI serving as plain functions: a request body in; a response body, or its SSE chunks, out.

The HTTP routes (:mod:`.app`, through the transport :class:`~.response.TextResponse`) and
``anyio-genout run``'s OpenAI batch lines (:mod:`anyio_genout.cli.run_batch`) both call
these, as vLLM's routes and ``run_batch`` both call its ``OpenAIServingCompletion`` and
``OpenAIServingChat``, so a body means the same, answers the same and fails with the same
error (status, message, ``param``) to both:

* :func:`parse_body` validates a body with the server's request model (the routes get this
  from FastAPI; both map a failure with :func:`~.errors.validation_error`);
* :class:`Serving` turns a body into a :class:`Plan` (its child requests and the response's
  :class:`~.formats.Format`), raising :class:`~.errors.ApiError` naming the field;
* :class:`Generation` enters every child request (checked and sent: a bad one is an
  ``ApiError`` before anything is answered), and :meth:`Generation.close` is what a
  disconnect calls;
* :func:`serve_whole` runs one to its JSON body (:func:`serve_whole_json`: its bytes), a
  large one rendered in a worker thread; :func:`serve_stream` runs an entered one,
  handing each rendered SSE chunk to a ``send_chunk`` callback, and returns the last bytes.

Every :class:`~anyio_genout.errors.GenoutError` is mapped here, once, with the route's
``param`` names (:meth:`.Format.api_error`). Nothing here knows ASGI: the transport starts
the response, writes the bytes and watches the connection. The generation's scopes are an
:class:`~contextlib.AsyncExitStack` inside :class:`Generation` and task groups inside the
functions: no async generator straddles them.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, Final, Self

import anyio
import attrs
import pydantic

from ..errors import GenoutError, InvalidRequestError
from ..text.client import TextClient
from ..text.output import CollectedTextOutput, TextOutput, collect_text, merge_outputs
from ..text.request import TextRequest, check_text_request
from ..text.stream import TextStream
from . import requests
from .errors import ApiError, error_body, validation_error
from .formats import Format, usage
from .generation_defaults import with_defaults
from .json_encoding import dumps, dumps_in_slices, sse_event
from .models import ChatCompletionRequest, CompletionRequest
from .tools import ToolServing

__all__ = ["CHAT_URL", "COMPLETIONS_URL", "DONE", "Body", "Generation", "Plan", "Serving",
           "INLINE_RENDER_VALUES", "check_choices", "choices", "parse_body", "render_size",
           "serve_stream", "serve_whole", "serve_whole_json"]

COMPLETIONS_URL: Final = "/v1/completions"
CHAT_URL: Final = "/v1/chat/completions"
#: The SSE stream's last event.
DONE: Final = b"data: [DONE]\n\n"

Body = CompletionRequest | ChatCompletionRequest


def parse_body(url: str, body: Any) -> Body:
    """``body`` (decoded JSON) validated with the request model of ``url``
    (:data:`COMPLETIONS_URL` or :data:`CHAT_URL`), as the route validates it.

    Raises:
        ApiError: 400 naming the field as the server names it (:func:`validation_error`).
    """
    model = CompletionRequest if url == COMPLETIONS_URL else ChatCompletionRequest
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as exc:
        raise validation_error(exc.errors(), body) from None


def choices(body: Body, *, max_n: int, max_model_len: int | None,
            vocab_size: int | None = None, trust_request_chat_template: bool = False,
            tool_serving: ToolServing | None = None) -> requests.Choices:
    """The child requests of a completions or chat completions ``body``
    (:func:`~.requests.completion_choices` or :func:`~.requests.chat_choices`; None
    limits are not checked here). Raises ApiError (400) naming the field."""
    if isinstance(body, CompletionRequest):
        return requests.completion_choices(body, max_n=max_n, max_model_len=max_model_len,
                                           vocab_size=vocab_size)
    return requests.chat_choices(body, max_n=max_n, max_model_len=max_model_len,
                                 trust_request_chat_template=trust_request_chat_template,
                                 tool_serving=tool_serving)


def check_choices(found: requests.Choices) -> None:
    """The checks of entering that need no engine (:func:`check_text_request` of each
    request), for a body read before it runs (``run``'s batch lines).

    Raises:
        ApiError: 400 naming the field as the route names it (:meth:`.Format.api_error`).
    """
    for request in found.requests:
        try:
            check_text_request(request)
        except InvalidRequestError as exc:
            raise found.format("", _no_decode).api_error(exc) from None


def _no_decode(ids: Sequence[int]) -> str:
    return ""


@attrs.frozen
class Plan:
    """One body to serve: its child requests (one per choice, by ``index``), the format of
    its response, and how it is answered (``stream``; ``include_usage``: a streamed usage
    chunk before ``[DONE]``; ``continuous_usage``: every streamed chunk carries its choice's
    usage so far too, vLLM's ``continuous_usage_stats``)."""

    requests: Sequence[TextRequest]
    format: Format
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    #: Tokens a streamed chunk holds at least (vLLM's stream interval; see serve_stream).
    stream_interval: int = 1


@attrs.frozen(kw_only=True)
class Serving:
    """The completions and chat completions of ``text_client``, as ``model_name``: at most
    ``max_n`` choices, a request's own chat template only if
    ``trust_request_chat_template``, chat outputs read with ``tool_serving``'s parsers,
    responses carrying the ``system_fingerprint`` that ``fingerprint`` gives (called for
    every body: a cached constant; :meth:`.Format.stamp`; None: none)."""

    text_client: TextClient
    model_name: str
    max_n: int
    trust_request_chat_template: bool = False
    tool_serving: ToolServing = attrs.field(factory=ToolServing)
    fingerprint: Callable[[], str | None] = attrs.field(default=lambda: None)
    #: vLLM's ``--stream-interval``: the least a request's ``stream_interval`` is taken as.
    stream_interval: int = 1
    #: The model's sampling defaults (:func:`.generation_defaults.generation_defaults`).
    sampling_defaults: Mapping[str, Any] = attrs.field(factory=dict)

    def check_model(self, model: str | None) -> None:
        """Raises ApiError (404) if ``model`` is given and is not the one served (an empty
        name is the served model, as vLLM's ``_is_model_supported`` has it)."""
        if model and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")

    def plan(self, body: Body, *, model: str | None = None) -> Plan:
        """``body``'s :class:`Plan`, its responses naming ``model`` (None: the served name).

        Raises ApiError (400) naming the field: the checks of
        :func:`~.requests.completion_choices` and :func:`~.requests.chat_choices`, with the
        engines' ``max_model_len`` and the tokenizer's vocabulary."""
        text = self.text_client
        tokenizer = text.tokenizer
        max_model_len = text.client.engine.max_model_len
        body = with_defaults(body, self.sampling_defaults, max_model_len)
        found = choices(body, max_n=self.max_n, max_model_len=max_model_len,
                        vocab_size=tokenizer.vocab_size,
                        trust_request_chat_template=self.trust_request_chat_template,
                        tool_serving=self.tool_serving)

        def decode(ids: Sequence[int]) -> str:  # the echoed text of token-id prompts
            return tokenizer.decode(list(ids), skip_special_tokens=False)

        stream_options = body.stream_options
        include_usage = stream_options is not None and stream_options.include_usage
        continuous = include_usage and stream_options is not None \
            and stream_options.continuous_usage_stats
        fmt = found.format(model or self.model_name, decode, tokenizer.token_id)
        fmt.stamp(self.fingerprint(), include_usage=include_usage)
        return Plan(found.requests, fmt, stream=body.stream, include_usage=include_usage,
                    continuous_usage=continuous,
                    stream_interval=max(body.stream_interval or 1, self.stream_interval))


class Generation:
    """The running child requests of a :class:`Plan` on ``text_client``.

    ``async with`` enters (checks, encodes and sends) every request before anything is
    answered, so a bad field is an :class:`ApiError` (its ``param`` named as the route
    names it) and the response has not started; leaving closes every request (each still
    running aborted once). :meth:`close` closes them at once, and any entered later.
    """

    def __init__(self, text_client: TextClient, plan: Plan) -> None:
        self.plan = plan
        #: The text client the requests run on.
        self.text_client = text_client
        self._scopes = AsyncExitStack()
        #: The requests' streams, by choice index (those entered so far).
        self.streams: list[TextStream] = []
        self._closed = False

    async def __aenter__(self) -> Self:
        """Raises ApiError: a request failed its checks or could not be sent."""
        try:
            for request in self.plan.requests:
                self.streams.append(await self._scopes.enter_async_context(
                    self.text_client.generate(request)))
                if self._closed:
                    self.streams[-1].close()
        except GenoutError as exc:
            await self._scopes.aclose()
            raise self.plan.format.api_error(exc) from None
        except BaseException:
            await self._scopes.aclose()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Leave every request's scope (idempotent): each still running is aborted once,
        and each records its end in the metrics."""
        await self._scopes.aclose()

    def close(self) -> None:
        """Close every request now, synchronously (a disconnect): each still running is
        aborted once, and one entered after this is closed as it is entered."""
        self._closed = True
        for stream in self.streams:
            stream.close()


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


#: A response (or a streamed event) of at most this many values to render (tokens, echoed
#: prompt tokens, logprob entries: see :func:`render_size`) is rendered on the event loop
#: (1-2 µs a value with its JSON encoding: a few ms); a larger one in the text client's
#: worker thread, its JSON a slice at a time (:func:`.json_encoding.dumps_in_slices`): 16
#: choices of 4,000 echoed tokens with 20 logprobs each held the event loop 1.7 s.
INLINE_RENDER_VALUES: Final = 4096


def render_size(outs: Sequence[CollectedTextOutput | TextOutput]) -> int:
    """About how many values the response of ``outs`` renders: each token of the output
    and of the prompt, and each logprob entry (rows times the last row's width)."""
    size = 0
    for out in outs:
        size += len(out.token_ids) + len(out.prompt_token_ids or ())
        for rows in (out.logprobs, out.prompt_logprobs):
            if rows:
                size += len(rows) * len(rows[-1])
    return size


async def _whole(generation: Generation, *, json: bool) -> Any:
    """:func:`serve_whole`'s body; ``json``: encoded."""
    fmt = generation.plan.format
    async with generation:
        streams = generation.streams
        wholes: list[CollectedTextOutput | None] = [None] * len(streams)

        async def collect(i: int, stream: TextStream) -> None:
            wholes[i] = await collect_text(stream)

        try:
            await _each(streams, collect)
        except GenoutError as exc:
            raise fmt.api_error(exc) from None
    outs = [whole for whole in wholes if whole is not None]
    try:
        if render_size(outs) <= INLINE_RENDER_VALUES:
            body = fmt.whole(outs)
            return dumps(body) if json else body

        def render() -> Any:
            body = fmt.whole(outs)
            return dumps_in_slices(body) if json else body

        return await generation.text_client.run_in_worker(render)
    except GenoutError as exc:
        raise fmt.api_error(exc) from None


async def serve_whole(generation: Generation) -> dict[str, Any]:
    """Enter ``generation`` (not entered yet), read every choice to its end and leave it:
    the response's JSON body, rendered in a worker thread if it is large
    (:data:`INLINE_RENDER_VALUES`). The requests are closed when it returns (a client
    given the body finds the request in ``/metrics``: the streams record their end on
    close).

    Raises:
        ApiError: a request failed (on entering: 400 naming the field, 503 while the
            client is unhealthy; later: 500, or 503), as the route answers it.
    """
    body: dict[str, Any] = await _whole(generation, json=False)
    return body


async def serve_whole_json(generation: Generation) -> bytes:
    """:func:`serve_whole`'s body as JSON bytes (encoded where it is rendered).

    Raises:
        ApiError: as :func:`serve_whole`.
    """
    body: bytes = await _whole(generation, json=True)
    return body


async def serve_stream(generation: Generation,
                       send_chunk: Callable[[bytes], Awaitable[None]]) -> bytes:
    """Run an entered ``generation`` as an SSE stream: each rendered chunk goes to
    ``send_chunk`` (never two at once; the choices' chunks interleave by ``index`` as their
    tokens arrive); returns the stream's last bytes (a single choice's finish event, the
    usage chunk if asked for, and ``data: [DONE]``), for the caller to send after every
    request is closed (closed here first, so a client that has ``[DONE]`` finds the request
    in ``/metrics``).

    An error of a request (an engine death, a finish reason ``error``) ends it: the other
    choices are closed and the last bytes are an error event and ``data: [DONE]``, so a
    client never hangs.
    """
    plan = generation.plan
    fmt = plan.format
    text_client = generation.text_client
    streams = generation.streams
    send = send_chunk
    if len(streams) > 1:
        lock = anyio.Lock()

        async def send_locked(chunk: bytes) -> None:  # choices send from their own tasks
            async with lock:
                await send_chunk(chunk)

        send = send_locked
    completion = 0
    # With continuous usage every chunk carries its choice's usage so far (vLLM's: the
    # prompt of that choice, the tokens of that choice up to and with this chunk's).
    counted: list[int] | None = [0] * len(streams) if plan.continuous_usage else None
    prompts = [len(s.prompt_token_ids) for s in streams]
    # Each choice's reasoning tokens, if the usage shows them (a reasoning parser served).
    counters = fmt.reasoning_counters(len(streams))
    first_chunks = fmt.first_chunks(len(streams))
    if counted is not None:
        for chunk in first_chunks:
            chunk["usage"] = usage(prompts[chunk["choices"][0]["index"]], 0,
                                   None if counters is None else 0)
    # The role chunks (and chat echo) go out with the first output, as vLLM sends them (its
    # first iteration): an engine that fails before any output gets the error event first,
    # and the first chunk measures the time to the first token.
    # One write for all of them, so no choice's text can come between.
    first = b"".join(sse_event(chunk) for chunk in first_chunks)

    interval = plan.stream_interval
    # A single choice's finish event goes out with the last bytes, in one write: the HTTP
    # server writes each body message with its own send (Hypercorn: a Data event, its lock
    # and a send_all), and a short request has only three or four of them.
    single = len(streams) == 1
    tail = b""

    async def relay(i: int, stream: TextStream) -> None:
        nonlocal completion, first
        held: list[TextOutput] = []  # outputs a stream interval holds back
        sent = 0  # tokens sent
        async for out in stream:
            if first:
                chunks, first = first, b""
                await send(chunks)
            out, failure = _with_buffered(stream, out)
            if interval > 1:
                # vLLM's rule (its OutputProcessor): the first tokens at once, then a chunk
                # once `interval` tokens are held, and the end (or an error) at once.
                held.append(out)
                count = sum(len(o.token_ids) for o in held)
                if sent and count < interval and out.finish_reason is None \
                        and failure is None:
                    continue
                out, held = merge_outputs(held), []
                sent += count
            await deliver(i, out)
            if failure is not None:
                raise failure
        if held:  # the stream ended without a finish (closed meanwhile)
            await deliver(i, merge_outputs(held))

    async def deliver(i: int, out: TextOutput) -> None:
        """Send choice ``i``'s ``out`` as its event (with its usage so far, if asked); a
        single choice's finish event is kept for the last bytes."""
        nonlocal completion, tail
        completion += len(out.token_ids)
        thought = None if counters is None else counters[i].feed(out.token_ids)
        now = None
        if counted is not None:
            counted[i] += len(out.token_ids)
            now = usage(prompts[i], counted[i], thought)
        if (out.logprobs is None and out.prompt_logprobs is None) \
                or render_size((out,)) <= INLINE_RENDER_VALUES:
            event = fmt.event(out, i, usage=now)
        else:  # a large one (a long prompt's logprobs), off the event loop
            event = await text_client.run_in_worker(
                functools.partial(fmt.event, out, i, usage=now, sliced=True))
        if event is not None:
            if single and out.finish_reason is not None:
                tail = event
            else:
                await send(event)

    try:
        await _each(streams, relay)
    except GenoutError as exc:
        await generation.aclose()
        error = fmt.api_error(exc)  # vLLM's param names
        return tail + sse_event(error_body(error.status, error.message, error.param)) + DONE
    await generation.aclose()
    if not plan.include_usage:
        return tail + DONE
    thought = None if counters is None else sum(counter.count for counter in counters)
    return tail + sse_event(fmt.usage_chunk(fmt.prompt_tokens(prompts), completion, thought)
                            ) + DONE
