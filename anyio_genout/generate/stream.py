"""``GenerateStream``: one request's scope and its outputs.

``async with client.generate(request) as stream:`` sends the request; ``async for out in
stream`` yields :class:`GenerateOutput` deltas. Leaving the block before the terminal output
(``break``, an exception, a timeout or cancellation around it) or :meth:`GenerateStream.close`
(alias :meth:`~GenerateStream.cancel`) aborts the request in the engine exactly once, and the
metrics record it with the finished reason of the current :class:`AbortCause`.

The scope opens no cancel scope and no task group, and leaving it never awaits: so the block
may contain the ``yield`` of an async generator that wraps the stream, and that generator may
be closed late, from another task (docs/concepts.md, "Wrapping a stream").
"""

from __future__ import annotations

import logging
import time
from types import TracebackType
from typing import TYPE_CHECKING, Final, final

import anyio

from ..engine import EngineCoreClient, EngineCoreOutputStream
from ..errors import EngineDeadError, SamplingMaskMismatchError
from ..metrics import Metrics, RequestTracker
from ..protocol import (
    EngineCoreFinishReason,
    EngineCoreOutput,
    EngineCoreRequest,
    Logprobs,
    SamplingMask,
)
from .abort_cause import AbortCause
from .inflight import AbortedIds, InflightGuard, InflightRequests
from .migration import MigratingStream, can_migrate
from .output import (
    CollectedGenerateOutput,
    FinishReason,
    GenerateOutput,
    GeneratePromptInfo,
    collect_output,
)
from .stop_sequences import StopSequenceMatcher

if TYPE_CHECKING:
    from typing import Self

__all__ = ["GenerateStream", "new_generate_stream"]

logger = logging.getLogger("anyio_genout.generate")


#: Passed by :func:`new_generate_stream` only: the class has no public constructor.
_MADE_HERE: Final = object()


@final
class GenerateStream(MigratingStream):
    """A request in flight: an async context manager and an async iterator of outputs.

    Entering sends the request; it raises, with nothing sent,
    :class:`~anyio_genout.InvalidRequestError` (a bad field),
    :class:`~anyio_genout.DuplicateRequestIdError` (a live request has the id, or, with
    ``randomize_request_ids=False``, an aborted one whose late outputs may still come) or
    the client's sticky health error. Iterate it from one task: a second task that waits for
    an output while another one does gets :class:`anyio.BusyResourceError` at once.

    With ``ClientConfig(migration_limit=N)``, when the engine running the request dies the
    stream resubmits it to a live engine as a continuation, up to N times, and goes on
    without a gap, a duplicate or an error (:mod:`.migration`, docs/reliability.md).
    """

    __slots__ = ("_delivered", "_done", "_engine", "_engine_request", "_entered",
                 "_external_id", "_finish_pending", "_inflight", "_matcher", "_max_tokens",
                 "_metrics", "_migration_limit", "_number", "_prompt_pending", "_tracker")

    def __init__(self, engine: EngineCoreClient, metrics: Metrics, inflight: InflightRequests,
                 engine_request: EngineCoreRequest, *, callers_ids: bool,
                 migration_limit: int = 0, _made_by: object = None) -> None:
        """Made by :meth:`Client.generate` (there is no public constructor). ``callers_ids``:
        the engine knows the request by the caller's own id (``randomize_request_ids=False``),
        so an aborted id is refused for a while (:class:`AbortedIds`). ``migration_limit``:
        how many times the request may move to another engine when its engine dies."""
        if _made_by is not _MADE_HERE:
            raise TypeError("GenerateStream has no public constructor: use "
                            "`async with client.generate(request) as stream`")
        self._engine = engine
        self._metrics = metrics
        self._inflight = inflight
        self._engine_request = engine_request
        self._external_id = engine_request.external_req_id or engine_request.request_id
        self._raw: EngineCoreOutputStream | None = None
        self._entered = False
        self._tracker: RequestTracker | None = None
        self._guard: InflightGuard | None = None
        # Ids the caller chose are refused for reuse while late outputs may come (see there).
        self._aborted: AbortedIds | None = inflight.aborted if callers_ids else None
        self._number = 0
        sequences = engine_request.sampling_params.stop_token_sequences
        self._matcher = (StopSequenceMatcher(
            sequences, engine_request.sampling_params.min_tokens) if sequences else None)
        self._prompt_pending = True
        # The first output of the current engine request is still to come (the fast path
        # waits for it: prompt info, the AbortedIds witness).
        self._first_pending = True
        self._migration_limit = migration_limit
        self._migrations = 0
        # The tokens delivered so far while the request may still migrate (else None), the
        # cap the first engine applied, and whether the current engine request continues one
        # whose prompt info was delivered (its prefill stats are not the prompt's then).
        self._delivered: list[int] | None = None
        self._max_tokens = 0
        self._continued = False
        self._done = False
        # The terminal output's (received_at, finish label), recorded in the metrics when the
        # caller next touches the stream: a layer above may still re-label it (close(cause)).
        self._finish_pending: tuple[float, str] | None = None

    # ------------------------------------------------------------------ scope

    async def __aenter__(self) -> Self:
        """Validate and send the request (see the class docstring for what it raises).

        Raises:
            InvalidRequestError, DuplicateRequestIdError: nothing was sent.
            ClientUnhealthyError: the client's sticky health error.
            RuntimeError: the stream was entered before.
        """
        if self._entered:
            raise RuntimeError("a GenerateStream can be entered only once")
        self._entered = True
        await anyio.lowlevel.checkpoint_if_cancelled()
        try:
            engine = self._engine
            aborted = self._aborted
            if aborted is not None:
                aborted.check(self._engine_request.request_id)
            raw = engine.open_stream(self._engine_request)
            self._raw = raw
            request = self._engine_request = raw.request
            if aborted is not None:
                self._number = aborted.opened(raw.engine_index, engine.abort_queued)
            self._tracker = self._metrics.tracker(
                engine_index=raw.engine_index,
                arrival_time=request.arrival_time,
                prompt_len=len(request.prompt_token_ids),
                max_tokens=raw.max_tokens,
            )
            self._guard = self._inflight.track(self._external_id, request.request_id)
            self._max_tokens = raw.max_tokens
            if self._migration_limit and can_migrate(request):
                self._delivered = []
        except BaseException:
            self._release()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self._release()

    def _release(self, cause: AbortCause | None = None) -> None:
        """Close the request (abort it if live), record an early exit, release tracking.

        A terminal output not yet recorded is recorded now, under ``cause``'s finished reason
        if one was given (a layer above matched a stop string in it), else its own."""
        if self._finish_pending is not None:
            self._record_finish(None if cause is None else cause.finished_reason)
        raw = self._raw
        if raw is not None and not self._done:
            self._done = True
            if not raw.terminated:
                if cause is None:
                    cause = AbortCause.current()
                tracker = self._tracker
                if tracker is not None and not tracker.finished:
                    tracker.record_finished(time.time(), cause.finished_reason)
                if cause is AbortCause.DROPPED_STREAM:
                    logger.info("aborting request %s: its scope was left early",
                                raw.request_id)
                else:
                    logger.debug("aborting request %s: %s", raw.request_id, cause.value)
                if self._aborted is not None:
                    self._aborted.aborted(raw.request_id, raw.engine_index)
            raw.close()
        if self._guard is not None:
            self._guard.release()
            self._guard = None

    def _record_finish(self, label: str | None) -> None:
        pending = self._finish_pending
        assert pending is not None and self._tracker is not None
        self._finish_pending = None
        self._tracker.record_finished(pending[0], pending[1] if label is None else label)

    def close(self, cause: AbortCause | None = None) -> None:
        """Finish with this request now: abort it in the engine if it is still running.

        ``cause`` overrides :meth:`AbortCause.current` (read in the calling task) for the
        metrics (e.g. ``stream.close(AbortCause.STOP_STRING_MATCHED)`` when a layer above
        matched a stop condition); called right after the terminal output, before the next
        iteration step, ``cause`` also re-labels that output's finished reason in the metrics
        (a stop string matched in the engine's last output counts as "stop"). Synchronous
        and idempotent; leaving the ``async with`` block afterwards does nothing more. The
        iteration ends: the next ``async for`` step stops, and one that waits for an output
        in another task wakes up and stops.
        """
        self._release(cause)

    def cancel(self) -> None:
        """The same as :meth:`close` (kept by that name for callers in other tasks).

        The request is aborted at once and ``async for`` ends, so the ``async with`` block
        ends without an exception once its body is done; other awaits in the body are not
        interrupted. To interrupt the whole body, cancel a cancel scope of your own around
        the block."""
        self._release()

    # ------------------------------------------------------------------ accessors

    @property
    def request_id(self) -> str:
        """The internal id the engine knows this request by (the first engine's: it stays
        the stream's id, and its outputs', after a migration; see
        :attr:`engine_request_id`)."""
        return self._engine_request.request_id

    @property
    def engine_request_id(self) -> str:
        """The id of the engine request running now: :attr:`request_id`, or after a
        migration its continuation's, ``"{request_id}-m{n}-{8 hex}"``.

        Raises:
            RuntimeError: the stream has not been entered.
        """
        if self._raw is None:
            raise RuntimeError("the stream has not been entered")
        return self._raw.request_id

    @property
    def migrations(self) -> int:
        """How many times the request moved to another engine (its engine died)."""
        return self._migrations

    @property
    def external_request_id(self) -> str:
        return self._external_id

    @property
    def engine_index(self) -> int:
        """The data-parallel rank of the engine running the request.

        Raises:
            RuntimeError: the stream has not been entered.
        """
        if self._raw is None:
            raise RuntimeError("the stream has not been entered")
        return self._raw.engine_index

    # ------------------------------------------------------------------ iteration

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> GenerateOutput:
        """The next output; after the terminal one (or after an error), StopAsyncIteration.

        Raises:
            ClientUnhealthyError: once, when the client became unhealthy mid-stream.
            RequestFailedError: once, when only this request failed (e.g.
                :class:`SamplingMaskMismatchError`, :class:`RequestStreamClosedError`).
            anyio.BusyResourceError: another task is waiting on this stream.
            RuntimeError: the stream has not been entered.
        """
        raw = self._raw
        if raw is None:
            raise RuntimeError("use `async with client.generate(...) as stream` first")
        if self._finish_pending is not None:
            self._record_finish(None)
        if self._done and not raw.terminated:
            await anyio.lowlevel.checkpoint()
            raise StopAsyncIteration
        # A buffered output without a coroutine round trip (once per token); else await it.
        # The checkpoint rule is the engine stream's either way.
        try:
            output = raw.receive_buffered_output()
            if output is None:
                output = await raw.receive_output()
        except EngineDeadError as error:
            if not self._can_migrate(raw, error):
                raise
            raw, output = await self._migrate_and_receive(raw, error)
        return self._deliver(raw, output)

    def receive_buffered(self) -> list[int] | GenerateOutput | None:
        """The next output without a coroutine, when one is buffered and :meth:`__anext__`
        would not suspend, as :meth:`receive` gives it; None when it must be awaited (nothing
        buffered, its checkpoint due, the stream ended or not entered).

        Raises:
            what :meth:`__anext__` raises, except BusyResourceError and RuntimeError.
        """
        raw = self._raw
        if raw is None or self._done or self._finish_pending is not None:
            return None
        try:
            output = raw.receive_buffered_output()
        except EngineDeadError as error:
            if not self._can_migrate(raw, error):
                raise
            self._migrate(raw, error)
            return None  # the continuation's outputs are awaited (receive())
        if output is None:
            return None
        return self._plain_or_output(raw, output)

    async def receive(self) -> list[int] | GenerateOutput:
        """:meth:`__anext__` for a layer above that builds its own output per token (the text
        layer): a plain step comes as its new token ids alone, no :class:`GenerateOutput`
        built; any other output as the ``GenerateOutput`` ``__anext__`` gives. A plain step
        is neither the first output nor the terminal one, and has tokens only: no logprobs,
        prefill stats, transfer params, sampling mask or speculative-decoding metrics, and
        no stop token sequences to match. The metrics see the same as with ``__anext__``.
        Try :meth:`receive_buffered` first: this always costs a coroutine.

        Raises:
            StopAsyncIteration: after the terminal output (or after an error, or close()).
            what :meth:`__anext__` raises.
        """
        raw = self._raw
        if raw is None:
            raise RuntimeError("use `async with client.generate(...) as stream` first")
        if self._finish_pending is not None:
            self._record_finish(None)
        if self._done and not raw.terminated:
            await anyio.lowlevel.checkpoint()
            raise StopAsyncIteration
        # Callers try receive_buffered() first: no second try here (the checkpoint rule is
        # the engine stream's either way).
        try:
            output = await raw.receive_output()
        except EngineDeadError as error:
            if not self._can_migrate(raw, error):
                raise
            raw, output = await self._migrate_and_receive(raw, error)
        return self._plain_or_output(raw, output)

    def _plain_or_output(self, raw: EngineCoreOutputStream, output: EngineCoreOutput
                         ) -> list[int] | GenerateOutput:
        """``output``'s token ids if it is a plain step (see :meth:`receive`), else its
        :class:`GenerateOutput`; just received (the metrics are updated)."""
        (_rid, tokens, logprobs, _prompt_logprobs, _pooling, finish_reason, _stop_reason,
         _events, kv_params, ec_params, _trace, prefill, _routed, _nans, _mm, mask,
         spec_metrics, _prompt_token_id_logprobs, _error) = output
        if (finish_reason is None and logprobs is None and prefill is None and mask is None
                and kv_params is None and ec_params is None and spec_metrics is None
                and not self._first_pending and self._matcher is None):
            tracker = self._tracker
            assert tracker is not None
            tracker.observe_output(raw.timestamp, time.time() if tracker.is_prefilling else 0.0,
                                   output)
            delivered = self._delivered
            if delivered is not None:
                delivered.extend(tokens)
            return tokens
        return self._deliver(raw, output)

    def _deliver(self, raw: EngineCoreOutputStream, output: EngineCoreOutput
                 ) -> GenerateOutput:
        """The :class:`GenerateOutput` of ``output``, just received (the metrics updated)."""
        tracker = self._tracker
        assert tracker is not None
        # One unpacking instead of a field lookup per use (this runs once per token).
        (rid, tokens, logprobs, prompt_logprobs, _pooling, finish_reason, stop_reason, _events,
         kv_params, ec_params, _trace, prefill, _routed, _nans, _mm, mask, spec_metrics,
         prompt_token_id_logprobs, _error) = output
        # The wall clock matters only for time to first token and end-to-end latency.
        received_at = (time.time() if tracker.is_prefilling or finish_reason is not None
                       else 0.0)
        tracker.observe_output(raw.timestamp, received_at, output)
        prompt_info = None
        if self._first_pending:
            self._first_pending = False
            if self._aborted is not None:
                self._aborted.witnessed(raw.engine_index, self._number)
            if self._prompt_pending:
                self._prompt_pending = False
                # The original prompt's, also when a continuation brings it.
                prompt_info = GeneratePromptInfo(self._engine_request.prompt_token_ids,
                                                 prompt_logprobs, prompt_token_id_logprobs)
        if mask is not None and len(mask) != len(tokens):
            raise SamplingMaskMismatchError(
                f"request {rid}: sampling mask has {len(mask)} rows for "
                f"{len(tokens)} new tokens")
        finish = None
        matched = self._matcher.feed(tokens) if self._matcher is not None else None
        if matched is not None:
            keep, sequence = matched
            if keep < len(tokens):
                tokens = tokens[:keep]
                if logprobs is not None:
                    logprobs = Logprobs(logprobs.token_ids[:keep], logprobs.logprobs[:keep],
                                        logprobs.ranks[:keep])
                if mask is not None and mask.offsets is not None:
                    # Rows stay aligned with the kept tokens (a one-row mask is never cut:
                    # a match keeps at least one token).
                    mask = SamplingMask(mask.token_ids[:int(mask.offsets[keep])],
                                        mask.offsets[:keep + 1])
            finish = FinishReason.stop(sequence)
        elif finish_reason is not None:
            finish = FinishReason.from_engine(finish_reason, stop_reason)
        delivered = self._delivered
        if delivered is not None:
            delivered.extend(tokens)
            if self._migrations:
                rid = self._engine_request.request_id  # the stream's id, not the continuation's
        result = GenerateOutput(
            rid,
            tokens,
            prompt_info,
            logprobs,
            finish,
            # A continuation's prefill is of prompt + delivered tokens: not the prompt's.
            prefill.num_cached_tokens if prefill is not None and not self._continued else 0,
            kv_params,
            ec_params,
            mask,
            spec_metrics,
        )
        if finish is not None:
            self._finish_pending = (received_at, finish.as_str())
            if finish_reason is EngineCoreFinishReason.ABORT and self._aborted is not None:
                # client.abort(): the engine may have made outputs before it read the ABORT.
                self._aborted.aborted(rid, raw.engine_index)
            if matched is not None and not raw.terminated:
                # The client matched a stop sequence: free the engine's request, on purpose.
                self._release(AbortCause.STOP_STRING_MATCHED)
        return result

    async def collect_output(self) -> CollectedGenerateOutput:
        """Gather the rest of this stream (see :func:`collect_output`).

        Raises:
            IncompleteStreamError: the outputs ended without a terminal one.
            OperationalError: what :meth:`__anext__` raises.
        """
        return await collect_output(self)


def new_generate_stream(engine: EngineCoreClient, metrics: Metrics, inflight: InflightRequests,
                        engine_request: EngineCoreRequest, *,
                        callers_ids: bool, migration_limit: int = 0) -> GenerateStream:
    """:meth:`Client.generate`'s way to make a stream (package-internal)."""
    return GenerateStream(engine, metrics, inflight, engine_request, callers_ids=callers_ids,
                          migration_limit=migration_limit, _made_by=_MADE_HERE)
