"""One request's outputs as an async iterator, and the scope whose exit aborts it."""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, NoReturn, final

import anyio
import anyio.lowlevel

from ..errors import RequestStreamClosedError
from ..protocol import EngineCoreOutput, EngineCoreRequest, plain_output
from .mailbox import EngineCoreStreamOutput, OutputMailbox
from .pace import ReaderPace

if TYPE_CHECKING:
    from typing import Self

__all__ = ["CallScope", "EngineCoreOutputStream", "PlainStep", "StreamState",
           "new_output_stream"]

# The checkpoint policy (docs/lifecycle.md, "Checkpoints"). A consumer that finds outputs
# buffered takes them without yielding for one *turn*, which ends (a full checkpoint: a
# chance for cancellation and for other tasks to run) at the first of:
#: seconds of the consumer's wall time since it last yielded (its own work included), so a
#: busy consumer holds the loop about this long at most, however many streams are ready;
TIME_SLICE: Final = 0.001
#: outputs taken in the turn;
CHECKPOINT_EVERY: Final = 64
# and the effective deadline of the consumer's cancel scopes: a timeout around a stream is
# taken within one output of its deadline, not a whole loop pass of every ready stream's
# turns later. The lookup costs microseconds, so it is made only when it matters: when the
# consumer waited at least CONGESTED seconds for its turn (a long loop pass), and at most
# every DEADLINE_REFRESH seconds per stream. A consumer resumed past that deadline (from
# its checkpoint, or woken by an output) yields again (EXTRA_YIELDS times, counted once the
# loop's clock has reached the deadline too, for at most LOOP_CLOCK_LAG) so that the
# loop delivers the cancellation before it takes another output: in a long loop pass every
# consumer already past its deadline then leaves the pass without doing its work.
CONGESTED: Final = 0.01
DEADLINE_REFRESH: Final = 0.1
EXTRA_YIELDS: Final = 2
#: Seconds a consumer past its deadline by this clock keeps yielding while the event loop's
#: clock has not reached that deadline yet (uvloop's trails by up to a millisecond).
LOOP_CLOCK_LAG: Final = 0.01

_clock: Final = time.perf_counter

#: A plain step as the generate layer takes it (:meth:`EngineCoreOutputStream.receive_step`):
#: the list of its new token ids.
PlainStep = list[int]
_INF: Final = math.inf

_tuple_new: Final = tuple.__new__  # EngineCoreStreamOutput(...) without its Python __new__


class StreamState(enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"
    CLOSED_WITH_ERROR = "closed with error"
    UNEXPECTED_CLOSE = "unexpected close"
    CLOSED = "closed"  # left early by the consumer


#: Passed by :func:`new_output_stream` only: the class has no public constructor.
_MADE_HERE: Final = object()


@final
class EngineCoreOutputStream:
    """The outputs of one request, in order, ending after its terminal output.

    Iterate with ``async for``. The stream ends after an output with a finish reason, or by
    raising exactly one error: the client's sticky health error (e.g.
    :class:`~anyio_genout.EngineDeadError`) or :class:`~anyio_genout.RequestStreamClosedError` when
    the engine dropped the request without a final output.

    Checkpoints: when an output is already buffered it is returned at once, with a full
    checkpoint (a chance for cancellation and for other tasks to run) when the consumer's
    turn is used up: ``TIME_SLICE`` (1 ms) of wall time since it last yielded,
    ``CHECKPOINT_EVERY`` (64) outputs, or the effective deadline of its cancel scopes,
    whichever comes first; when none is buffered the stream waits, which is a checkpoint.
    The end of the stream is a cancellation point.

    Iterate a stream from one task: a second task that waits for an output while another
    one does gets :class:`anyio.BusyResourceError` at once (the first keeps its place).
    :meth:`close` from another task ends the iteration of a waiting consumer.
    """

    __slots__ = ("_box", "_closed", "_deadline", "_deadline_fresh", "_engine_index",
                 "_max_tokens", "_on_close", "_pace", "_request", "_request_id",
                 "_since_checkpoint", "_state", "_turn_end", "_yielded", "timestamp")

    def __init__(self, request: EngineCoreRequest, max_tokens: int, engine_index: int,
                 box: OutputMailbox,
                 on_close: Callable[[EngineCoreOutputStream, bool], None],
                 pace: ReaderPace, *, _made_by: object = None) -> None:
        if _made_by is not _MADE_HERE:
            raise TypeError("EngineCoreOutputStream has no public constructor: streams are "
                            "opened by EngineCoreClient.call() or open_stream()")
        self._request = request
        self._request_id = request.request_id
        self._max_tokens = max_tokens
        self._engine_index = engine_index
        self._box = box
        self._on_close = on_close
        self._pace = pace
        self._state = StreamState.RUNNING
        self._since_checkpoint = 0
        # The current turn's end, the cached effective deadline and until when it is
        # trusted, all on the perf_counter clock.
        # The first turn starts now: a consumer that finds its outputs buffered at its first
        # read (the reader got there first) still yields after 1 ms, not after 64 outputs.
        now = _clock()
        self._turn_end = now + TIME_SLICE
        self._deadline = _INF
        self._deadline_fresh = 0.0
        # When the consumer last yielded: for its first turn, when the stream was made (its
        # first wait counts as congested only if it lasted CONGESTED or more).
        self._yielded = now
        self._closed = False
        #: The engine batch timestamp of the output read last (0.0 before the first).
        self.timestamp = 0.0

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def request(self) -> EngineCoreRequest:
        """The request as it was sent (validated, its defaults resolved)."""
        return self._request

    @property
    def max_tokens(self) -> int:
        """The output-token cap the engine applies: the request's ``max_tokens``, else its
        sampling parameters', at most the room the prompt leaves in the context (None: all of
        it), as :meth:`~anyio_genout.protocol.EngineCoreRequest.resolved_max_tokens`
        resolves it (vLLM's rule)."""
        return self._max_tokens

    @property
    def engine_index(self) -> int:
        """The data-parallel rank of the engine running this request."""
        return self._engine_index

    @property
    def state(self) -> StreamState:
        return self._state

    @property
    def terminated(self) -> bool:
        """True once the terminal output or the error was delivered (leaving won't abort)."""
        return self._state is not StreamState.RUNNING and self._state is not StreamState.CLOSED

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> EngineCoreStreamOutput:
        """The next output with its engine and batch timestamp.

        Raises :class:`StopAsyncIteration` after the terminal output (or once the stream
        was closed), the client's sticky health error (e.g.
        :class:`~anyio_genout.EngineDeadError`, :class:`~anyio_genout.ClientClosedError`),
        :class:`~anyio_genout.RequestStreamClosedError` if the engine dropped the request without
        a terminal output, and :class:`anyio.BusyResourceError` if another task is waiting
        on this stream.
        """
        output = await self.receive_output()
        return _tuple_new(EngineCoreStreamOutput, (self._engine_index, self.timestamp, output))

    async def receive_output(self) -> EngineCoreOutput:
        """Like ``__anext__``, but the output alone; its engine batch timestamp is then
        :attr:`timestamp`. Raises what ``__anext__`` raises.

        The stream's one checkpoint rule: an output already buffered is returned at once
        while the consumer's turn lasts (see the class docstring); at its end, a full
        checkpoint first; with none buffered it waits, which is a checkpoint.
        """
        return self._output(await self.receive_step())

    async def receive_step(self) -> EngineCoreOutput | PlainStep:
        """:meth:`receive_output` for the generate layer: a plain output (new token ids and
        nothing else, as the reader buffers it: see engine/mailbox.py) comes as the list
        of its token ids, saving the output object. Raises what ``__anext__`` raises."""
        if self._state is not StreamState.RUNNING:
            # Only a cancellation point: every stream has waited for the engine at least
            # once, so a loop over short requests cannot starve the event loop.
            await anyio.lowlevel.checkpoint_if_cancelled()
            raise StopAsyncIteration
        box = self._box
        items = box.items
        if items:
            count = self._since_checkpoint + 1
            if count >= CHECKPOINT_EVERY or _clock() >= self._turn_end:
                self._yielded = _clock()
                await anyio.lowlevel.checkpoint()
                self._new_turn()
                if _clock() >= self._deadline:
                    await self._yield_past_deadline()
            else:
                self._since_checkpoint = count
        else:
            self._yielded = _clock()
            try:
                while not items and not box.closed:
                    await box.wait()
            except anyio.BusyResourceError:
                raise self._busy() from None
            self._new_turn()
            if _clock() >= self._deadline:
                await self._yield_past_deadline()
        try:
            output = self._take()
        except anyio.EndOfStream:  # ended meanwhile: close() from another task
            raise StopAsyncIteration from None
        assert output is not None  # the wait ended with an output, the error or the end
        return output

    async def _yield_past_deadline(self) -> None:
        """The consumer resumed past its scopes' deadline, before the loop delivered the
        cancellation (asyncio runs due timers after the tasks already queued; any loop wakes
        a task whose output arrived first): yield again, EXTRA_YIELDS times once the loop's
        clock has reached the deadline too, so that the cancellation comes before another
        output does. Every consumer in a long loop pass that is past its deadline then
        leaves the pass at once, not after its work."""
        self._pace.leaving()  # and the reader, one message a pass (pace.py)
        extra = 0
        give_up = _clock() + LOOP_CLOCK_LAG
        while _clock() >= self._deadline and extra < EXTRA_YIELDS:
            self._yielded = self._deadline_fresh = 0.0  # look again: it may be gone
            await anyio.lowlevel.checkpoint()
            # A yield counts once the loop's own clock has reached the deadline too: it may
            # trail this one (uvloop's moves in whole milliseconds), and until it does, the
            # scope's timer finds its deadline not reached and waits for the next tick.
            if (anyio.current_time() >= anyio.current_effective_deadline()
                    or _clock() >= give_up):
                extra += 1
            self._new_turn()

    def _new_turn(self) -> None:
        """The consumer just resumed: its turn starts now."""
        now = _clock()
        self._since_checkpoint = 0
        if now - self._yielded >= CONGESTED and now >= self._deadline_fresh:
            self._deadline_fresh = now + DEADLINE_REFRESH
            deadline = anyio.current_effective_deadline()
            if deadline != _INF and deadline != -_INF:
                deadline += now - anyio.current_time()  # on the perf_counter clock
            self._deadline = deadline
        end = now + TIME_SLICE
        self._turn_end = end if end < self._deadline else self._deadline

    def receive_buffered_output(self, timed: bool = True) -> EngineCoreOutput | None:
        """:meth:`receive_output` without the coroutine, when it would not suspend: the next
        buffered output, or None when :meth:`receive_output` must be awaited instead
        (nothing buffered, the stream ended, or the consumer's turn is over; without
        ``timed``, only its 64 outputs count, for a drain of what arrived). The checkpoint
        rule stays :meth:`receive_output`'s; the generate layer's one-token fast path is
        :meth:`receive_buffered_step`."""
        output = self.receive_buffered_step(timed)
        return None if output is None else self._output(output)

    def receive_buffered_step(self, timed: bool = True) -> EngineCoreOutput | PlainStep | None:
        """:meth:`receive_buffered_output` as :meth:`receive_step` gives outputs (a plain
        one as its token ids): the generate layer's per-token fast path."""
        if self._state is not StreamState.RUNNING or not self._box.items:
            return None
        count = self._since_checkpoint + 1
        if count >= CHECKPOINT_EVERY or (timed and _clock() >= self._turn_end):
            return None
        self._since_checkpoint = count
        return self._take()

    def output_waiting(self) -> bool:
        """Whether an output is buffered next (not an error, not the end): what
        :meth:`peek_output` tells by not returning None, without making a plain one an
        output object (the generate layer asks it once per delivery)."""
        items = self._box.items
        return len(items) > 1 and self._state is StreamState.RUNNING and type(items[0]) is float

    def peek_output(self) -> EngineCoreOutput | None:
        """The next buffered output without taking it: None when nothing is buffered, when
        an error or the end comes next, or once the stream ended. The generate layer's
        coalescing looks ahead with it; :meth:`receive_output_nowait` then takes the output
        (outside the turn's count: a merged delivery is one take)."""
        box = self._box
        items = box.items
        if len(items) > 1 and self._state is StreamState.RUNNING and type(items[0]) is float:
            output = items[1]
            if type(output) is int:  # a plain one is made the output it stands for, once
                output = items[1] = plain_output(self._request_id, box.take_tokens(output))
            return output  # type: ignore[return-value]
        return None

    def take_plain(self, limit: int) -> tuple[list[Any], list[int]] | None:
        """Take the *plain* outputs buffered at the head, at most ``limit``: those that bring
        tokens alone (no finish, logprobs, prefill stats, events, mask, transfer parameters
        or anything else), as ``(steps, tokens)``: ``steps`` a flat list of each one's batch
        timestamp and number of new tokens (``[ts, n, ts, n, ...]``), ``tokens`` all their
        new token ids in order (:meth:`.OutputMailbox.take_plain`). :attr:`timestamp` is
        then the last one's. None if there is none (or the stream ended). The generate
        layer's coalescing takes a run of plain steps with one call, where
        :meth:`peek_output` and :meth:`receive_output_nowait` would cost two per step and an
        output object each (outside the turn's count, as they are). A plain output never
        ends the stream, so the state stays RUNNING."""
        if self._state is not StreamState.RUNNING:
            return None
        run = self._box.take_plain(limit)
        if run is not None:
            self.timestamp = run[0][-2]
        return run

    def _busy(self) -> anyio.BusyResourceError:
        error = anyio.BusyResourceError("iterating")
        error.args = (f"another task is already iterating the stream of request "
                      f"{self._request_id!r} (read each stream from one task only)",)
        return error

    def receive_nowait(self) -> EngineCoreStreamOutput | None:
        """The next buffered output, or None if none is buffered yet.

        The package's ``_nowait`` convention: None means only "nothing yet, wait and try
        again"; a stream that ended (after its terminal output, its error, or :meth:`close`)
        raises :class:`anyio.EndOfStream` instead, so ended never looks like empty. It also
        raises the error that ends the stream, like ``__anext__``.
        """
        output = self.receive_output_nowait()
        if output is None:
            return None
        return _tuple_new(EngineCoreStreamOutput, (self._engine_index, self.timestamp, output))

    def receive_output_nowait(self) -> EngineCoreOutput | None:
        """Like :meth:`receive_nowait`, but the output alone: its engine batch timestamp is
        then :attr:`timestamp` (the generate layer reads outputs this way, saving an object
        per output). None only while none is buffered; raises :class:`anyio.EndOfStream`
        once the stream ended, and what ``__anext__`` raises."""
        output = self._take()
        return None if output is None else self._output(output)

    def _output(self, output: EngineCoreOutput | PlainStep) -> EngineCoreOutput:
        """The output a taken one stands for (a plain step's is made)."""
        if type(output) is list:
            return plain_output(self._request_id, output)
        return output  # type: ignore[return-value]

    def _take(self) -> EngineCoreOutput | PlainStep | None:
        """:meth:`receive_output_nowait`, a plain output as its token ids."""
        if self._state is not StreamState.RUNNING:
            raise anyio.EndOfStream
        box = self._box
        items = box.items
        if items:  # an output is two entries: its batch timestamp, then the output
            item = items.popleft()
            if type(item) is float:
                self.timestamp = item
                output = items.popleft()
                if type(output) is int:  # plain: its tokens lead the mailbox's
                    return box.take_tokens(output)
                if output.finish_reason is not None:  # type: ignore[union-attr]
                    self._state = StreamState.FINISHED
                return output  # type: ignore[return-value]
            self._fail(item)
        if self._box.closed:
            self._fail(RequestStreamClosedError(self._request_id))
        return None

    def _fail(self, item: object) -> NoReturn:
        assert isinstance(item, BaseException)
        self._state = (StreamState.UNEXPECTED_CLOSE if isinstance(item, RequestStreamClosedError)
                       else StreamState.CLOSED_WITH_ERROR)
        raise item

    def close(self) -> None:
        """Leave the stream; aborts the request in the engine if it is still running.

        Synchronous and idempotent, so it is safe in a cancelled scope and in ``finally``.
        """
        if self._closed:
            return
        self._closed = True
        was_running = self._state is StreamState.RUNNING
        if was_running:
            self._state = StreamState.CLOSED
            self._pace.leaving()
        self._box.discard()
        self._on_close(self, was_running)

    async def aclose(self) -> None:
        self.close()
        await anyio.lowlevel.checkpoint()


def new_output_stream(request: EngineCoreRequest, max_tokens: int, engine_index: int,
                      box: OutputMailbox,
                      on_close: Callable[[EngineCoreOutputStream, bool], None],
                      pace: ReaderPace) -> EngineCoreOutputStream:
    """The engine client's way to make a stream (package-internal): ``request`` as sent,
    its resolved ``max_tokens``, its engine, its mailbox, the client's close hook and its
    reader's pace (told when the consumer leaves early)."""
    return EngineCoreOutputStream(request, max_tokens, engine_index, box, on_close, pace,
                                  _made_by=_MADE_HERE)


@final
class CallScope:
    """``async with engine.call(request) as stream``: send on entry, abort on early exit."""

    __slots__ = ("_open", "_stream")

    def __init__(self, open_stream: Callable[[], EngineCoreOutputStream]) -> None:
        self._open = open_stream
        self._stream: EngineCoreOutputStream | None = None

    async def __aenter__(self) -> EngineCoreOutputStream:
        await anyio.lowlevel.checkpoint_if_cancelled()
        self._stream = self._open()
        return self._stream

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._stream is not None:
            self._stream.close()
