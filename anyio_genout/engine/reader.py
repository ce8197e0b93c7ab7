"""The engine reader: the one task that waits on the output socket, and its dispatch.

It drains every queued message (passes of ``READ_BATCH`` messages, more while a pass is
shorter than ``READ_PASS``), decodes it with the protocol core, and hands each part over
without ever waiting: a request's output to its mailbox (the consumer drains it at its own
pace), a utility reply to its caller, scheduler statistics to the listeners, data-parallel
wave control to ``wave_control`` (if the client follows waves). ``ENGINE_CORE_DEAD``, an
undecodable message or other data-parallel control fails the client (reported to its
:class:`~.reports.HealthReports`), whose failure path calls :meth:`OutputReader.stop`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import anyio
import anyio.abc
import anyio.lowlevel

from ..errors import (
    EngineDeadError,
    ProtocolError,
    TransportError,
)
from ..protocol import (
    DpControl,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineDead,
    PlainRow,
    RequestBatch,
    SchedulerStats,
    UtilityReply,
    decode_batch_or_other,
)
from ..transport import ZmqSocket
from .pace import ReaderPace
from .registry import RequestRegistry
from .reports import HealthReports
from .utility_calls import PendingCalls
from .watchers import EngineWatch

__all__ = ["READ_BATCH", "READ_PASS", "BatchListener", "DeathExplainer", "OutputReader",
           "StatsListener"]

logger = logging.getLogger("anyio_genout.engine")

#: Messages a reader pass handles before it yields to other tasks, at the least. Each pass
#: ends with the consumers draining what it buffered (coalesced: one delivery each); a
#: longer pass wakes them less often but keeps more outputs alive at once, which costs
#: more in garbage-collector passes. 16 measured best when every buffered output was an
#: object; since a plain one is an int in its mailbox, 32 costs about 10 % less a token at
#: 256 streams on asyncio and uvloop, 0-8 % on trio (docs/performance.md, the reader's
#: batch). While consumers leave, one (engine/pace.py).
READ_BATCH: Final = 32
#: Seconds a pass may go on past ``READ_BATCH`` messages while more are queued. Small
#: messages come in long runs when the reader is behind (an engine that finishes requests
#: faster than they are read sends a row or two a message): a pass of 16 of them took about
#: 0.1 ms, so every few rows cost a loop pass and a wake-up per consumer. Big messages reach
#: this before their READ_BATCH, so the loop's pass stays as long as it was for them.
READ_PASS: Final = 0.001
#: Messages received in a row after which the reader stops asking ZMQ_EVENTS first.
_BURST: Final = 2

_clock: Final = time.perf_counter

StatsListener = Callable[[int, SchedulerStats], None]
#: Called with ``(engine_rank, tokens)`` per batch of outputs: the prompt tokens computed for
#: the requests prefilled in it plus the tokens generated, of the requests still open.
BatchListener = Callable[[int, int], None]
#: Returns what its owner knows about an engine's death (or None); see add_death_explainer.
DeathExplainer = Callable[[], "str | None"]


class OutputReader:
    """The output socket's reader and what it hands outputs, replies and statistics to."""

    def __init__(self, socket: ZmqSocket, registry: RequestRegistry, calls: PendingCalls,
                 watch: EngineWatch, reports: HealthReports, pace: ReaderPace) -> None:
        """``reports``: where a failure of the socket, an undecodable message, an
        ``ENGINE_CORE_DEAD`` or unexpected control is reported; ``pace``: whether
        consumers are leaving (then one message a pass)."""
        self._socket = socket
        self._pace = pace
        self._registry = registry
        self._calls = calls
        self._watch = watch
        self._reports = reports
        self._stopped = False
        self.stats_listeners: list[StatsListener] = []
        self.batch_listeners: list[BatchListener] = []
        self.death_explainers: list[DeathExplainer] = []
        #: Takes data-parallel wave control (``data_parallel_waves``); None: it is fatal.
        self.wave_control: Callable[[EngineCoreOutputs], None] | None = None

    def stop(self) -> None:
        """The client failed: the reader returns after the message it handles (if any)."""
        self._stopped = True

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """The reader task: receive and dispatch until the socket closes or the client
        fails (:meth:`stop`)."""
        sock = self._socket
        pace = self._pace
        task_status.started()
        try:
            # Is a message queued? Outside a burst, ask ZMQ_EVENTS (1.2 us) before receiving:
            # a receive that finds nothing costs more (pyzmq raises zmq.Again inside, 2.7 us).
            # In a burst (two messages in a row) just receive, until one finds nothing.
            count = 0  # messages in this pass
            start = 0.0  # when the pass began
            streak = 0
            while True:
                if streak < _BURST and not sock.readable():
                    count = 0
                    await sock.wait_signalled()
                    continue
                frames = sock.receive_nowait()
                if frames is None:
                    streak = 0
                    continue
                streak += 1
                if not count:
                    start = _clock()
                self.dispatch(frames)
                if self._stopped:
                    return
                count += 1
                now = _clock()
                if now < pace.until or (count >= READ_BATCH and now - start >= READ_PASS):
                    count = 0
                    await anyio.lowlevel.checkpoint()
        except anyio.ClosedResourceError:
            return
        except TransportError as exc:
            self._reports.fail(exc)

    def dispatch(self, frames: list[Any]) -> None:
        """Decode one output message and hand its contents over (never waits); an
        undecodable message, ``ENGINE_CORE_DEAD`` or data-parallel control fails the
        client."""
        try:
            # zmq.Frame has the buffer protocol: the decoder reads the frames in place.
            message = decode_batch_or_other(frames)
        except ProtocolError as exc:
            self._reports.fail(exc)
            return
        watch = self._watch
        if type(message) is tuple:
            watch.heard[message[0]] += 1  # any message proves its engine alive
            if watch.learning:  # which connection this engine's messages come on
                watch.learn(message[0], frames[0])
            self._dispatch_batch(*message)
        elif type(message) is RequestBatch:  # outputs that carry wave fields as well
            m = message.message
            watch.heard[m.engine_index] += 1
            if watch.learning:
                watch.learn(m.engine_index, frames[0])
            self._dispatch_batch(m.engine_index, m.outputs, m.scheduler_stats, m.timestamp,
                                 m.finished_requests)
            if self.wave_control is not None and (m.wave_complete is not None
                                                  or m.start_wave is not None):
                self.wave_control(m)
        elif type(message) is UtilityReply:
            watch.heard[message.message.engine_index] += 1
            calls = self._calls
            call_id = message.reply.call_id
            probed = calls.probe_engine(call_id)
            if probed is not None:
                watch.note_answer(probed, frames[0])
            if watch.learning:
                engine = calls.engine_of(call_id)
                if engine is not None:
                    watch.learn(engine, frames[0])
            calls.resolve(message.reply)
        elif type(message) is EngineDead:
            # The sentinel names no engine: the connection it came on does.
            rank = watch.engine_of(frames[0])
            self._reports.fail(EngineDeadError(self._engine_core_dead_message(rank),
                                       ranks=None if rank is None else (rank,)))
        elif self.wave_control is not None:
            assert isinstance(message, DpControl)
            watch.heard[message.message.engine_index] += 1
            self.wave_control(message.message)
        else:
            assert isinstance(message, DpControl)
            self._reports.fail(ProtocolError(
                "EngineCoreOutputs: data-parallel wave control arrived on the main output "
                "socket (this client runs no DP coordinator)"))

    def _engine_core_dead_message(self, rank: int | None) -> str:
        """"an engine core sent ENGINE_CORE_DEAD", naming the engine (``rank``, if known),
        with what the explainers know."""
        reasons: list[str] = []
        for explain in list(self.death_explainers):
            try:
                text = explain()
            except Exception:
                logger.exception("death explainer %r failed", explain)
                continue
            if text:
                reasons.append(text)
        message = "an engine core sent ENGINE_CORE_DEAD"
        if rank is not None and not any(f"engine {rank} (" in text for text in reasons):
            message = f"{message} (engine {rank})"  # unless an explainer names it already
        return f"{message}: {'; '.join(reasons)}" if reasons else message

    def _dispatch_batch(self, engine: int, outputs: Sequence[EngineCoreOutput | PlainRow],
                        stats: SchedulerStats | None, timestamp: float,
                        finished: frozenset[str] | None) -> None:
        registry = self._registry
        requests = registry.requests
        learns = registry.learns  # the router wants the engines' cached-token counts
        tokens = 0  # for the batch listeners (vllm:iteration_tokens_total)
        for output in outputs:
            # output[0]: the request id, also of a plain row (protocol.PlainRow), which is a
            # list of the same fields with no prefill stats and no finish.
            entry = requests.get(output[0])
            if entry is None:
                continue  # finished, aborted or unknown: dropped
            # OutputMailbox.put_output, inlined: this loop runs once per delivered token.
            # It skips put_output's `closed` check because of an invariant: a mailbox still
            # in the registry is never closed. Every path that closes one (the terminal
            # output and the finished set below, EngineCoreClient.fail and .abort, a stream's
            # close() through _on_stream_close, a failed open_stream) removes the request
            # from the registry in the same synchronous step, so the reader, which runs
            # between such steps, only ever finds open mailboxes here.
            box = entry.box
            items = box.items
            items.append(timestamp)
            if type(output) is list:
                # A plain row: its token count, its tokens onto the mailbox's (see there);
                # the row and its token list are freed with the message, once dispatched.
                new = output[1]
                n = len(new)
                tokens += n
                items.append(n)
                box.tokens.extend(new)
            else:
                # (mypy does not narrow the union on the `type() is` test above)
                prefill = output.prefill_stats  # type: ignore[union-attr]
                if prefill is not None:
                    tokens += prefill.num_computed_tokens
                    if learns:
                        registry.note_prefill(entry, prefill)
                tokens += len(output.new_token_ids)  # type: ignore[union-attr]
                items.append(output)  # type: ignore[arg-type]
                if output.finish_reason is not None:  # type: ignore[union-attr]
                    self._registry.remove(output[0])
                    box.closed = True
            if box.waiter is not None:
                box.wake()
        if outputs:
            for batch_listener in self.batch_listeners:
                batch_listener(engine, tokens)
        if finished:
            for rid in finished:
                entry = self._registry.remove(rid)
                if entry is not None:  # finished without a final output
                    entry.box.close()
        if stats is not None:
            self._registry.update_stats(engine, stats)
            for listener in self.stats_listeners:
                listener(engine, stats)
