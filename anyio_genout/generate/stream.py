"""``GenerateStream``: one request's scope and its outputs.

``async with client.generate(request) as stream:`` sends the request; ``async for out in
stream`` yields :class:`GenerateOutput` deltas. Leaving the block before the terminal output
(or :meth:`GenerateStream.close`) aborts the request once, recorded with the current
:class:`AbortCause`. The scope opens no cancel scope or task group and leaving it never
awaits (so it may hold an async generator's ``yield``: docs/concepts.md).
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import TYPE_CHECKING, Final, cast, final

import anyio

from ..engine import EngineCoreClient, EngineCoreOutputStream
from ..engine.stream import PlainStep
from ..errors import EngineDeadError, SamplingMaskMismatchError
from ..metrics import Metrics, RequestTracker
from ..protocol import (
    EngineCoreFinishReason,
    EngineCoreOutput,
    EngineCoreRequest,
)
from ..protocol.outputs import STREAM_FIELDS, StreamFields, stream_fields
from .abort_cause import AbortCause, record_abort
from .coalesce import Merge, gather
from .inflight import AbortedIds, InflightGuard, InflightRequests
from .migration import Migration, can_migrate
from .output import (
    CollectedGenerateOutput,
    FinishReason,
    GenerateOutput,
    GeneratePromptInfo,
    collect_output,
)
from .state import TRANSITIONS, Event, Phase, StreamStateError
from .stop_sequences import StopSequenceMatcher, cut_at_stop

if TYPE_CHECKING:
    from typing import Self

__all__ = ["GenerateStream", "new_generate_stream"]

#: Passed by :func:`new_generate_stream` only: the class has no public constructor.
_MADE_HERE: Final = object()


_RECEIVE: Final = Event.RECEIVE
_STREAMING: Final = Phase.STREAMING
_FINISHED: Final = Phase.FINISHED
_ENDED: Final = Phase.ENDED
_NO_FIELDS: Final = (None,) * (len(STREAM_FIELDS) - 2)  # a plain step's after its tokens


@final
class GenerateStream:
    """A request in flight: an async context manager and an async iterator of outputs.

    Entering sends the request; it raises, with nothing sent,
    :class:`~anyio_genout.InvalidRequestError` (a bad field),
    :class:`~anyio_genout.DuplicateRequestIdError` (a live request has the id, or, with
    ``randomize_request_ids=False``, an aborted one whose late outputs may still come) or
    the client's sticky health error. Iterate it from one task: a second task that waits for
    an output while another one does gets :class:`anyio.BusyResourceError` at once.

    Its life is one :class:`.state.Phase`, changed only through :mod:`.state`'s table; a
    misuse (reading before entering, entering twice) raises :class:`.state.StreamStateError`
    (a RuntimeError) naming the phase. With ``ClientConfig(migration_limit=N)`` a request
    whose engine dies moves to a live one, up to N times, without a gap
    (:class:`.migration.Migration`, docs/reliability.md). Outputs that wait while the
    consumer is busy come merged into one (:mod:`.coalesce`, docs/lifecycle.md
    "Coalescing"); ``client.generate(request, per_step=True)``: one output per step.
    """

    __slots__ = ("_aborted", "_coalesce", "_engine", "_engine_request", "_external_id",
                 "_finish_pending", "_guard", "_inflight", "_matcher", "_metrics", "_migration",
                 "_migration_limit", "_number", "_raw", "_state", "_tracker")

    def __init__(self, engine: EngineCoreClient, metrics: Metrics, inflight: InflightRequests,
                 engine_request: EngineCoreRequest, *, callers_ids: bool,
                 migration_limit: int = 0, per_step: bool = False,
                 _made_by: object = None) -> None:
        """Made by :meth:`Client.generate` only. ``callers_ids``: the engine knows the
        request by the caller's id, so an aborted id is refused a while (:class:`AbortedIds`);
        ``migration_limit``: how many times the request may move when its engine dies;
        ``per_step``: one output per engine step (no :mod:`.coalesce`)."""
        if _made_by is not _MADE_HERE:
            raise TypeError("GenerateStream has no public constructor: use "
                            "`async with client.generate(request) as stream`")
        self._engine = engine
        self._metrics = metrics
        self._inflight = inflight
        self._engine_request = engine_request
        self._external_id = engine_request.external_req_id or engine_request.request_id
        self._coalesce = not per_step
        self._state = Phase.IDLE
        self._raw: EngineCoreOutputStream | None = None
        self._tracker: RequestTracker | None = None
        self._guard: InflightGuard | None = None
        # Ids the caller chose are refused for reuse while late outputs may come (see there).
        self._aborted: AbortedIds | None = inflight.aborted if callers_ids else None
        self._number = 0
        sequences = engine_request.sampling_params.stop_token_sequences
        self._matcher = (StopSequenceMatcher(
            sequences, engine_request.sampling_params.min_tokens) if sequences else None)
        self._migration_limit = migration_limit
        self._migration: Migration | None = None  # made on entry if the request may move
        # In FINISHED: the terminal output's (received_at, label), recorded when the caller
        # next touches the stream (a layer above may re-label it: close(cause)).
        self._finish_pending: tuple[float, str] | None = None

    def _step(self, event: Event) -> None:
        """Move to the phase ``event`` leads to (raises StreamStateError if illegal)."""
        new = TRANSITIONS[self._state][event]
        if new is None:
            raise StreamStateError(self._state, event)
        self._state = new

    phase = property(lambda self: self._state, doc="Where the stream is in its life "
                     "(:mod:`anyio_genout.generate.state`).")

    # ------------------------------------------------------------------ scope

    async def __aenter__(self) -> Self:
        """Validate and send the request (ENTER).

        Raises:
            InvalidRequestError, DuplicateRequestIdError: nothing was sent.
            ClientUnhealthyError: the client's sticky health error.
            StreamStateError: the stream was entered before (a RuntimeError).
        """
        self._step(Event.ENTER)
        try:
            await anyio.lowlevel.checkpoint_if_cancelled()
            engine = self._engine
            aborted = self._aborted
            if aborted is not None:
                aborted.check(self._engine_request.request_id)
            raw = engine.open_stream(self._engine_request)
            self._raw = raw
            request = self._engine_request = raw.request
            if aborted is not None:
                self._number = aborted.opened(raw.engine_index, engine.abort_queued)
            tracker = self._tracker = self._metrics.tracker(
                engine_index=raw.engine_index,
                arrival_time=request.arrival_time,
                prompt_len=len(request.prompt_token_ids),
                max_tokens=raw.max_tokens,
            )
            self._guard = self._inflight.track(self._external_id, request.request_id)
            if self._migration_limit and can_migrate(request):
                self._migration = Migration(engine, self._metrics, tracker, request,
                                            raw.max_tokens, self._migration_limit)
        except BaseException:
            self._release()
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        self._release()

    def _release(self, cause: AbortCause | None = None) -> None:
        """CLOSE: abort the request if live (recording the early exit), release tracking; a
        terminal output not yet recorded is, under ``cause``'s finished reason if given."""
        state = self._state
        if state is Phase.CLOSED or state is Phase.IDLE:
            return
        if state is _FINISHED:
            self._record_finish(None if cause is None else cause.finished_reason)
        self._step(Event.CLOSE)
        raw = self._raw
        if raw is not None:
            if not raw.terminated:
                record_abort(raw, self._tracker, self._aborted, cause)
            raw.close()
        if self._guard is not None:
            self._guard.release()
            self._guard = None

    def _record_finish(self, label: str | None) -> None:
        """RECORD: the terminal output's metrics, under ``label`` if given."""
        pending, self._finish_pending = self._finish_pending, None
        assert pending is not None and self._tracker is not None
        self._step(Event.RECORD)
        self._tracker.record_finished(pending[0], pending[1] if label is None else label)

    def close(self, cause: AbortCause | None = None) -> None:
        """Finish with this request now (CLOSE): abort it in the engine if still running.

        ``cause`` overrides :meth:`AbortCause.current` for the metrics (e.g.
        ``AbortCause.STOP_STRING_MATCHED``: a layer above matched a stop string); right after
        the terminal output it re-labels that output's finished reason. Synchronous and
        idempotent; the iteration ends (a wait in another task wakes and stops). Raises
        nothing."""
        self._release(cause)

    def cancel(self) -> None:
        """:meth:`close`: ``async for`` ends; other awaits in the body go on."""
        self._release()

    # ------------------------------------------------------------------ accessors

    @property
    def request_id(self) -> str:
        """The internal id the engine knows this request by (the first engine's, also after
        a migration: see :attr:`engine_request_id`)."""
        return self._engine_request.request_id

    @property
    def engine_request_id(self) -> str:
        """The id of the engine request running now: :attr:`request_id`, or after a
        migration its continuation's, ``"{request_id}-m{n}-{8 hex}"``. Raises RuntimeError
        before the stream is entered."""
        if self._raw is None:
            raise RuntimeError("the stream has not been entered")
        return self._raw.request_id

    @property
    def migrations(self) -> int:
        """How many times the request moved to another engine (its engine died)."""
        return 0 if self._migration is None else self._migration.moves

    @property
    def external_request_id(self) -> str:
        return self._external_id

    @property
    def engine_index(self) -> int:
        """The data-parallel rank of the engine running the request. Raises RuntimeError
        before the stream is entered."""
        if self._raw is None:
            raise RuntimeError("the stream has not been entered")
        return self._raw.engine_index

    # ------------------------------------------------------------------ iteration
    # __anext__, receive and receive_buffered share one core: _poll (the RECEIVE transition,
    # a buffered output without a coroutine), then _wait (the end, or the wait).

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> GenerateOutput:
        """The next output; after the terminal one (or after an error), StopAsyncIteration.

        Raises:
            ClientUnhealthyError: once, when the client became unhealthy mid-stream.
            RequestFailedError: once, when only this request failed (e.g.
                :class:`SamplingMaskMismatchError`, :class:`RequestStreamClosedError`).
            anyio.BusyResourceError: another task is waiting on this stream.
            StreamStateError: the stream has not been entered (a RuntimeError).
        """
        got = self._poll(False)
        if got is None:
            got = await self._wait(False)
        return got  # type: ignore[return-value]

    def receive_buffered(self, *, nowait: bool = False) -> list[int] | GenerateOutput | None:
        """The next output without a coroutine, when one is buffered and :meth:`__anext__`
        would not suspend, as :meth:`receive` gives it; None when it must be awaited (nothing
        buffered, its checkpoint due, the stream ended). ``nowait``: a drain of what arrived
        (``receive_nowait``), so the turn's time limit does not apply, only its 64 outputs.

        Raises:
            what :meth:`__anext__` raises, except BusyResourceError.
        """
        return self._poll(True, not nowait)

    async def receive(self) -> list[int] | GenerateOutput:
        """:meth:`__anext__` for a layer above that builds its own output per token (the text
        layer): a plain step, or plain steps merged (coalescing: neither the first output nor
        the terminal one; tokens only, no logprobs, prefill stats, transfer params, sampling
        mask, speculative-decoding metrics or stop token sequences) comes as its new token
        ids alone; any other as the ``GenerateOutput`` of ``__anext__``. The metrics see the
        same either way.

        Raises:
            StopAsyncIteration: after the terminal output (or after an error, or close()).
            what :meth:`__anext__` raises.
        """
        got = self._poll(True)
        if got is None:
            got = await self._wait(True)
        return got

    def _poll(self, plain: bool, timed: bool = True) -> list[int] | GenerateOutput | None:
        """RECEIVE (recording a terminal output on the way), then the next buffered output
        if the engine stream gives one without suspending (its checkpoint rule), else None."""
        state = TRANSITIONS[self._state][_RECEIVE]
        if state is None:
            raise StreamStateError(self._state, _RECEIVE)
        if state is not _STREAMING:
            if state is _FINISHED:
                self._record_finish(None)
                return None
            if state >= _ENDED:
                return None
        raw = self._raw
        assert raw is not None
        try:
            output = raw.receive_buffered_step(timed)
        except EngineDeadError as error:
            self._move_or_raise(raw, error)
            return None  # the continuation's outputs are awaited (_wait)
        except Exception:
            self._failed(raw)
            raise
        if output is None:
            return None
        return self._deliver(raw, output, plain)

    async def _wait(self, plain: bool) -> list[int] | GenerateOutput:
        """What :meth:`_poll` could not serve: the end (a cancellation point), or the wait
        for the next output (moving to another engine while the request may)."""
        state = self._state
        if state >= _ENDED:
            if state is Phase.CLOSED:
                await anyio.lowlevel.checkpoint()
            else:
                await anyio.lowlevel.checkpoint_if_cancelled()
            raise StopAsyncIteration
        raw = self._raw
        assert raw is not None
        while True:
            try:
                output = await raw.receive_step()
            except EngineDeadError as error:
                raw = self._move_or_raise(raw, error)
                continue
            except Exception:
                self._failed(raw)
                raise
            return self._deliver(raw, output, plain)

    def _failed(self, raw: EngineCoreOutputStream) -> None:
        """ERROR, if what ``raw`` raised ends it (not a BusyResourceError, nor close())."""
        if raw.terminated:
            self._step(Event.ERROR)

    def _move_or_raise(self, raw: EngineCoreOutputStream, error: EngineDeadError
                       ) -> EngineCoreOutputStream:
        """MOVE the request off ``raw``'s dead engine, returning the continuation's stream.

        Raises:
            EngineDeadError: ``error`` (ERROR): migration off or not allowed, no moves left,
                or no engine took the continuation.
        """
        migration = self._migration
        if migration is None or not migration.may_move(raw, error):
            self._failed(raw)
            raise error
        try:
            new = migration.move(raw, error, prompt_pending=self._state is Phase.FIRST)
        except BaseException:
            self._failed(raw)
            raise
        self._step(Event.MOVE)
        self._raw = new
        # The continuation's id is random: never refused for reuse, never a caller's.
        self._aborted = None
        if self._guard is not None:
            self._guard.release()
        self._guard = self._inflight.track(self._external_id, new.request_id)
        return new

    def _deliver(self, raw: EngineCoreOutputStream, output: EngineCoreOutput | PlainStep,
                 plain: bool) -> list[int] | GenerateOutput:
        """OUTPUT or TERMINAL: the :class:`GenerateOutput` of ``output`` and what waits behind
        it (:mod:`.coalesce`), metrics updated; ``plain`` (:meth:`receive`): a plain one as ids."""
        tracker = self._tracker
        assert tracker is not None
        # One C call instead of a field lookup per use (this runs once per delivery); a plain
        # step (a list) is its token ids and nothing else.
        (rid, tokens, logprobs, prompt_logprobs, finish_reason, stop_reason, kv_params, ec_params,
         prefill, mask, spec_metrics, prompt_token_id_logprobs) = (
            stream_fields(output) if type(output) is not list
            else cast("StreamFields", (raw.request_id, output, *_NO_FIELDS)))
        # The wall clock matters only for time to first token and end-to-end latency.
        received_at = (time.time() if tracker.is_prefilling or finish_reason is not None
                       else 0.0)
        tracker.observe_output(raw.timestamp, received_at, output)
        state = self._state
        prompt_info = None
        if state is not _STREAMING:  # FIRST or CONTINUING: the engine request's first
            if self._aborted is not None:
                self._aborted.witnessed(raw.engine_index, self._number)
            if state is Phase.FIRST:
                # The original prompt's, also when a continuation brings it.
                prompt_info = GeneratePromptInfo(self._engine_request.prompt_token_ids,
                                                 prompt_logprobs, prompt_token_id_logprobs)
        if mask is not None and len(mask) != len(tokens):
            self._step(Event.ERROR)
            raise SamplingMaskMismatchError(
                f"request {rid}: sampling mask has {len(mask)} rows for "
                f"{len(tokens)} new tokens")
        matcher = self._matcher
        matched = matcher.feed(tokens) if matcher is not None else None
        plain = (plain and state is _STREAMING and matcher is None and logprobs is None
                 and prefill is None and mask is None and kv_params is None
                 and ec_params is None and spec_metrics is None)
        migration = self._migration
        cached = 0
        # A continuation's prefill is of prompt + delivered tokens: not the prompt's.
        if prefill is not None and not (migration is not None and migration.continued):
            cached = prefill.num_cached_tokens
        if matched is None and finish_reason is None:
            if self._coalesce and raw.output_waiting():  # more waiting: merged
                merge = gather(raw, tracker, matcher,
                               migration is not None and migration.continued, Merge.start(
                                   tokens, logprobs, mask, cached, kv_params, ec_params,
                                   spec_metrics, plain))
                plain = merge.plain
                (tokens, logprobs, mask, cached, kv_params, ec_params, spec_metrics,
                 finish_reason, stop_reason, matched, received_at) = merge.result(received_at)
            if plain:  # OUTPUT in STREAMING stays STREAMING (TRANSITIONS): nothing to store
                if migration is not None:
                    migration.delivered.extend(tokens)
                return tokens
        elif matched is not None and not received_at:
            received_at = time.time()  # the finish's time (e2e), as for a terminal output
        finish = FinishReason.STOP if matched is not None else None  # the match's: below
        if matched is None and finish_reason is not None:
            finish = FinishReason.from_engine(finish_reason, stop_reason)
        if finish is None:
            self._step(Event.OUTPUT)
        else:
            self._step(Event.TERMINAL)
            self._finish_pending = (received_at, finish.as_str())
            if finish_reason is EngineCoreFinishReason.ABORT and self._aborted is not None:
                # client.abort(): the engine may have made outputs before it read the ABORT.
                self._aborted.aborted(rid, raw.engine_index)
            if matched is not None:
                # The client matched a stop sequence: the stop cut (frees a live request).
                tokens, logprobs, mask, finish = cut_at_stop(self, matched[0], matched[1],
                                                             tokens, logprobs, mask)
        if migration is not None:
            migration.delivered.extend(tokens)
            if migration.moves:
                rid = self._engine_request.request_id  # the stream's id, not the continuation's
        return GenerateOutput(rid, tokens, prompt_info, logprobs, finish, cached, kv_params,
                              ec_params, mask, spec_metrics)

    async def collect_output(self) -> CollectedGenerateOutput:
        """Gather the rest of this stream (:func:`collect_output`: it raises
        IncompleteStreamError if the outputs end without a terminal one, and what
        :meth:`__anext__` raises)."""
        return await collect_output(self)


def new_generate_stream(engine: EngineCoreClient, metrics: Metrics, inflight: InflightRequests,
                        engine_request: EngineCoreRequest, *,
                        callers_ids: bool, migration_limit: int = 0,
                        per_step: bool = False) -> GenerateStream:
    """:meth:`Client.generate`'s way to make a stream (package-internal)."""
    return GenerateStream(engine, metrics, inflight, engine_request, callers_ids=callers_ids,
                          migration_limit=migration_limit, per_step=per_step,
                          _made_by=_MADE_HERE)
