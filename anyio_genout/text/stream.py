"""``TextStream``: one text request's scope and its :class:`TextOutput` deltas.

``async with text_client.generate(request) as stream:`` checks and encodes the request (the
chat template and a long prompt's encoding in worker threads, :mod:`.offload`), then
opens a :class:`~anyio_genout.GenerateStream` for its token ids; ``async for out in stream``
feeds each output's tokens to a :class:`TextDecoder` (incremental detokenization, stop
strings, ``min_tokens``) and yields the text. On a stop-string match the stream yields the
truncated terminal output and closes the token stream under
:attr:`AbortCause.STOP_STRING_MATCHED` (one ABORT to the engine, counted as
``finished_reason="stop"``); a match in an output the engine already ended sends nothing.

Like the token stream underneath, the scope opens no cancel scope and no task group and
leaving it never awaits anything that blocks: an async generator may wrap it
(docs/concepts.md, "Wrapping a stream"), and leaving it early aborts the request once.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Final, final

import anyio
import attrs

from ..generate import (
    AbortCause,
    Client,
    GenerateOutput,
    GenerateRequest,
    GenerateStream,
)
from ..generate.stop_sequences import cut_at_stop
from ..protocol import SamplingParams, StructuredOutputsParams
from ..protocol.sampling import fill_eos
from .bad_words import bad_words_token_ids
from .decoding import TextDecoder, TextStep
from .logprobs import LogprobsDecoder, prompt_logprob_rows
from .offload import Offload, encode_request
from .output import CollectedTextOutput, Rows, TextOutput, collect_text
from .request import TextRequest, check_text_request
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from typing import Self

__all__ = ["INLINE_PROMPT_LOGPROBS", "ModelEos", "TextStream", "new_text_stream"]

#: Passed by :func:`new_text_stream` only: the class has no public constructor.
_MADE_HERE: Final = object()
#: Prompt logprobs of at most this many entries (rows times their width) are decoded on
#: the event loop (about 1.3 µs an entry: 5 ms); more in the worker thread (100,000 prompt
#: tokens with 20 logprobs each held the event loop 2.8 s).
INLINE_PROMPT_LOGPROBS: Final = 4096


class ModelEos:
    """The model's end-of-sequence tokens, for the one EOS fill
    (:func:`~anyio_genout.protocol.sampling.fill_eos`, where its precedence is): the primary
    EOS is the tokenizer's (else ``fallback``, the client's ``ClientConfig.eos_token_id``),
    the others are the folder's other EOS ids. The generate layer's own fill then finds
    nothing left to do, so the order of the two calls does not matter."""

    __slots__ = ("eos_token_id", "other_eos_ids")

    def __init__(self, tokenizer: Tokenizer, fallback: int | None = None) -> None:
        primary = tokenizer.eos_token_id
        self.eos_token_id = fallback if primary is None else primary
        self.other_eos_ids = tuple(t for t in dict.fromkeys(tokenizer.eos_token_ids)
                                   if t != self.eos_token_id)

    def fill(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the model's EOS ids (:func:`fill_eos`)."""
        return fill_eos(params, self.eos_token_id, self.other_eos_ids)


@final
class TextStream:
    """A text request in flight: an async context manager and an async iterator of
    :class:`TextOutput`.

    Entering checks and encodes the request (a text that cannot fit the context is refused
    before it is encoded; templates and long texts are rendered and encoded in worker
    threads) and sends it; it raises, with nothing sent,
    :class:`~anyio_genout.InvalidRequestError` (a bad field, named; a prompt too long for
    the context, in vLLM's words),
    :class:`~anyio_genout.ChatTemplateError` (``messages`` without a usable chat
    template), and whatever entering a :class:`~anyio_genout.GenerateStream` raises
    (:class:`~anyio_genout.DuplicateRequestIdError`, the client's sticky health error).
    Iterate it from one task: a second task that waits for an output while another one
    does gets :class:`anyio.BusyResourceError` at once.
    """

    __slots__ = ("_client", "_decoder", "_done", "_entered", "_eos", "_first", "_inner",
                 "_logprobs", "_offload", "_per_step", "_prompt", "_prompt_ids",
                 "_prompt_pending", "_prompt_rows", "_push", "_request", "_rid", "_tokenizer")

    def __init__(self, client: Client, tokenizer: Tokenizer, eos: ModelEos,
                 request: TextRequest, offload: Offload | None = None, *,
                 per_step: bool = False, _made_by: object = None) -> None:
        """Made by :meth:`TextClient.generate` (there is no public constructor).
        ``per_step``: one output per engine step (the token stream's, no coalescing)."""
        if _made_by is not _MADE_HERE:
            raise TypeError("TextStream has no public constructor: use "
                            "`async with text_client.generate(request) as stream`")
        self._client = client
        self._tokenizer = tokenizer
        self._eos = eos
        self._request = request
        self._per_step = per_step
        self._offload = Offload(tokenizer) if offload is None else offload
        self._inner: GenerateStream | None = None
        self._decoder: TextDecoder | None = None
        # The decoder's one-token step (None without decoding); the engine's id of the request.
        self._push: Callable[[int], TextStep] | None = None
        self._rid = ""
        self._logprobs: LogprobsDecoder | None = None
        self._prompt: str | None = None
        self._prompt_ids: tuple[int, ...] = ()
        self._entered = False
        self._prompt_pending = True
        # The first output, taken while its long prompt logprobs were decoded in a worker
        # thread and the wait was cancelled (returned next), and those rows once decoded.
        self._first: GenerateOutput | None = None
        self._prompt_rows: Rows | None = None
        self._done = False

    # ------------------------------------------------------------------ scope

    async def __aenter__(self) -> Self:
        """Check, encode and send the request (see the class docstring for what it raises).

        Raises:
            InvalidRequestError, ChatTemplateError, DuplicateRequestIdError: nothing was sent.
            ClientUnhealthyError: the client's sticky health error.
            RuntimeError: the stream was entered before.
        """
        if self._entered:
            raise RuntimeError("a TextStream can be entered only once")
        self._entered = True
        arrival = time.time()  # as vLLM: the wait includes encoding the prompt
        request = self._request
        check_text_request(request)
        tokenizer = self._tokenizer
        self._prompt, ids = await encode_request(self._offload, tokenizer, request,
                                                 max_model_len=self._client.engine.max_model_len)
        params = self._eos.fill(request.sampling_params)
        constraint = getattr(params, "structured_outputs", None)  # not SamplingParams: the
        # generate layer refuses it below
        if isinstance(constraint, StructuredOutputsParams) and constraint.json is not None:
            # A JSON schema's check can take seconds (jsonschema): done in a worker thread
            # first, it is remembered, and entering below only looks it up.
            await self._offload.run(constraint.validate)
        if request.bad_words:
            params = attrs.evolve(params, bad_words_token_ids=await self._offload.run(
                functools.partial(bad_words_token_ids, tokenizer, request.bad_words)))
        generate_request = GenerateRequest(
            request_id=request.request_id, prompt_token_ids=ids,
            sampling_params=params,
            arrival_time=arrival if request.arrival_time is None else request.arrival_time,
            cache_salt=request.cache_salt, trace_headers=request.trace_headers,
            priority=request.priority, data_parallel_rank=request.data_parallel_rank,
            lora_request=request.lora_request)
        self._prompt_ids = tuple(generate_request.prompt_token_ids)
        inner = self._client.generate(generate_request, per_step=self._per_step)
        await inner.__aenter__()  # the token-level checks; then the request is sent
        try:
            if request.detokenize:
                self._decoder = TextDecoder(
                    tokenizer, generate_request.prompt_token_ids, stop=request.stop,
                    include_stop_str_in_output=request.include_stop_str_in_output,
                    min_tokens=generate_request.sampling_params.min_tokens,
                    skip_special_tokens=request.skip_special_tokens,
                    spaces_between_special_tokens=request.spaces_between_special_tokens)
        except BaseException:
            inner.close()
            raise
        if self._decoder is not None:
            self._push = self._decoder.push
        self._rid = inner.request_id
        self._inner = inner
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self._done = True
        if self._inner is not None:
            await self._inner.__aexit__(exc_type, exc, tb)

    def close(self, cause: AbortCause | None = None) -> None:
        """Finish with this request now: abort it in the engine if it is still running.

        As :meth:`GenerateStream.close`: ``cause`` overrides :meth:`AbortCause.current` for
        the metrics; synchronous and idempotent; the iteration ends (a task waiting for an
        output wakes up and stops); leaving the ``async with`` block afterwards does nothing
        more.
        """
        self._done = True
        if self._inner is not None:
            self._inner.close(cause)

    def cancel(self) -> None:
        """The same as :meth:`close` (see :meth:`GenerateStream.cancel`)."""
        self.close()

    # ------------------------------------------------------------------ accessors

    @property
    def request_id(self) -> str:
        """The internal id the engine knows this request by.

        Raises:
            RuntimeError: the stream has not been entered.
        """
        return self._entered_inner().request_id

    @property
    def external_request_id(self) -> str:
        return self._request.request_id

    @property
    def engine_index(self) -> int:
        """The data-parallel rank of the engine running the request.

        Raises:
            RuntimeError: the stream has not been entered.
        """
        return self._entered_inner().engine_index

    @property
    def prompt(self) -> str | None:
        """The prompt text (the rendered chat template for ``messages``; None for token ids
        and before entering)."""
        return self._prompt

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The prompt's token ids as sent (empty before entering)."""
        return self._prompt_ids

    def _entered_inner(self) -> GenerateStream:
        if self._inner is None:
            raise RuntimeError("the stream has not been entered")
        return self._inner

    # ------------------------------------------------------------------ iteration

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> TextOutput:
        """The next output; after the terminal one (or after an error), StopAsyncIteration.

        Raises:
            ClientUnhealthyError: once, when the client became unhealthy mid-stream.
            RequestFailedError: once, when only this request failed.
            anyio.BusyResourceError: another task is waiting on this stream.
            RuntimeError: the stream has not been entered.
        """
        inner = self._inner
        if inner is None:
            raise RuntimeError("use `async with text_client.generate(...) as stream` first")
        if self._done:
            await anyio.lowlevel.checkpoint()
            raise StopAsyncIteration
        if self._prompt_pending:
            return await self._first_output(inner)
        # Without a coroutine when an output is buffered (once per token at most
        # concurrencies); a plain step comes as its token ids, no GenerateOutput built.
        got = inner.receive_buffered()
        if got is None:
            got = await inner.receive()
        return self._convert(inner, got)

    async def _first_output(self, inner: GenerateStream) -> TextOutput:
        """The first output: its prompt logprobs, if more than
        :data:`INLINE_PROMPT_LOGPROBS` entries, decoded in the worker thread (a cancelled
        wait keeps the output for the next call)."""
        got: list[int] | GenerateOutput | None = self._first
        if got is None:
            got = inner.receive_buffered()
            if got is None:
                got = await inner.receive()
        if isinstance(got, GenerateOutput) and got.prompt_logprobs is not None \
                and got.prompt_logprobs.token_ids.size > INLINE_PROMPT_LOGPROBS:
            self._first = got
            self._prompt_rows = await self._offload.run_python(functools.partial(
                prompt_logprob_rows, self._tokenizer, got.prompt_logprobs,
                detokenize=self._request.detokenize))
            self._first = None
        return self._convert(inner, got)

    def receive_nowait(self) -> TextOutput:
        """The next output if it is already buffered (no waiting, no checkpoint): a consumer
        that fell behind takes what has arrived at once (the server sends it as one event).

        Raises:
            anyio.WouldBlock: nothing is buffered now (iterate the stream to wait for it).
            anyio.EndOfStream: the terminal output was already returned.
            ClientUnhealthyError, RequestFailedError: what :meth:`__anext__` raises.
            RuntimeError: the stream has not been entered.
        """
        inner = self._inner
        if inner is None:
            raise RuntimeError("use `async with text_client.generate(...) as stream` first")
        if self._done:
            raise anyio.EndOfStream
        got: list[int] | GenerateOutput | None = self._first
        if got is None:
            got = inner.receive_buffered(nowait=True)
        self._first = None
        if got is None:
            raise anyio.WouldBlock
        return self._convert(inner, got)

    def _convert(self, inner: GenerateStream, got: list[int] | GenerateOutput) -> TextOutput:
        if got.__class__ is not list:
            return self._text_output(inner, got)  # type: ignore[arg-type]
        tokens: list[int] = got
        push = self._push
        if push is None:
            return TextOutput(self._rid, "", tokens)
        if len(tokens) == 1:
            step = push(tokens[0])
            if step.stop_string is None:
                return TextOutput(self._rid, step.text, tokens)
            return self._plain(inner, tokens, step)
        return self._plain(inner, tokens, None)

    def _plain(self, inner: GenerateStream, tokens: list[int], step: TextStep | None
               ) -> TextOutput:
        """The output of a plain step's ``tokens`` (several ids, or ``step``: the match the
        decoder found in one)."""
        if step is None:
            assert self._decoder is not None
            step = self._decoder.update(tokens)
        if step.stop_string is None:
            return TextOutput(self._rid, step.text, tokens)
        tokens = cut_at_stop(inner, step.keep, step.stop_string, tokens)[0]
        self._done = True
        return TextOutput(self._rid, step.text, tokens, None, step.finish_reason)

    def _text_output(self, inner: GenerateStream, out: GenerateOutput) -> TextOutput:
        """The output for ``out`` (the general path: a finish, logprobs, the first one)."""
        tokens = out.token_ids
        finish = out.finish_reason
        decoder = self._decoder
        text = ""
        if decoder is not None:
            # The decoder says how the text ends: the engine's finish, or "stop" on a match.
            step = decoder.update(tokens, finish)
            text = step.text
            finish = step.finish_reason
            if step.stop_string is not None:
                # A live request is freed (one ABORT); either way the metrics count "stop".
                tokens = cut_at_stop(inner, step.keep, step.stop_string, tokens)[0]
        if finish is not None:
            self._done = True
        logprobs = None
        if out.logprobs is not None:
            if self._logprobs is None:
                self._logprobs = LogprobsDecoder(self._tokenizer,
                                                 detokenize=self._request.detokenize)
            logprobs = self._logprobs.decode(out.logprobs, len(tokens))
        prompt = prompt_ids = prompt_logprobs = None
        if self._prompt_pending:
            self._prompt_pending = False
            prompt, prompt_ids = self._prompt, out.prompt_token_ids
            prompt_logprobs, self._prompt_rows = self._prompt_rows, None
            if prompt_logprobs is None and out.prompt_logprobs is not None:
                prompt_logprobs = prompt_logprob_rows(self._tokenizer, out.prompt_logprobs,
                                                      detokenize=self._request.detokenize)
        return TextOutput(out.request_id, text, tokens, logprobs, finish, prompt_ids, prompt,
                          out.cached_token_count, prompt_logprobs)

    async def collect_text(self) -> CollectedTextOutput:
        """Gather the rest of this stream (see :func:`collect_text`).

        Raises:
            IncompleteStreamError: the outputs ended without a terminal one.
            OperationalError: what :meth:`__anext__` raises.
        """
        return await collect_text(self)


def new_text_stream(client: Client, tokenizer: Tokenizer, eos: ModelEos,
                    request: TextRequest, offload: Offload, *,
                    per_step: bool = False) -> TextStream:
    """:meth:`TextClient.generate`'s way to make a stream (package-internal)."""
    return TextStream(client, tokenizer, eos, request, offload, per_step=per_step,
                      _made_by=_MADE_HERE)
