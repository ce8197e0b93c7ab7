"""``EngineCoreClient``: the raw engine-core client (sockets, reader, registry, aborts).

Task layout (one client-level task group, started in :meth:`EngineCoreClient.connect`):

* the **engine-reader** task, the only task that waits on the output socket: it drains every
  queued message, decodes it with the protocol core and hands each output to its request's
  memory-object channel with ``send_nowait`` (never waiting on a consumer);
* the **abort worker**, which batches the ids of requests whose scopes were left early into
  one ABORT frame per engine (up to 1024 ids a frame);
* the **input drain**, which reads and discards anything sent *to* the input socket after
  the handshake (engines never send there again; without it a peer could fill this
  process's memory with messages nobody reads);
* the **connection watchers**, the **prober** and the **liveness** task, which find an
  engine that vanished or hung (:mod:`.watchers`).

Sends on the input ROUTER are synchronous (``NOBLOCK`` with an unbounded high-water mark
never blocks towards a connected engine), so request scopes never await while sending and
the order of ADD and ABORT frames is exactly program order.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Final, TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import attrs
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import (
    ClientClosedError,
    EngineDeadError,
    GenoutError,
    OperationalError,
    ProtocolError,
)
from ..protocol import (
    DpControl,
    EngineCoreFinishReason,
    EngineCoreOutput,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    EngineDead,
    RequestBatch,
    SchedulerStats,
    UtilityReply,
    decode_batch_or_other,
    encode_abort,
    encode_add,
    engine_identity,
)
from ..transport import TransportError, ZmqSocket, new_context
from .config import EngineCoreClientConfig
from .handshake import BoundSockets, bind_sockets, keyboard_interrupt_in, run_handshake
from .outbox import Outbox
from .registry import RequestRegistry
from .stream import EngineCoreOutputStream, _CallScope
from .utility import UtilityCalls
from .utility_calls import PendingCalls, copy_error
from .watchers import EngineWatch

__all__ = ["EngineCoreClient"]

logger = logging.getLogger("anyio_genout.engine")

#: At most this many ids in one ABORT frame.
MAX_ABORT_BATCH: Final = 1024
#: Seconds the input socket may keep the final ABORT frames queued after the client closes.
CLOSE_LINGER: Final = 0.5
#: Messages handled per reader pass before yielding to other tasks. Each pass ends with the
#: consumers draining what it buffered; a longer pass wakes them less often but keeps more
#: outputs alive at once, which costs more in garbage-collector passes (16 measured best).
MAX_READ_BATCH: Final = 16
#: Messages received in a row after which the reader stops asking ZMQ_EVENTS first.
_BURST: Final = 2
#: Unexpected input-socket messages logged one by one; later ones are only counted.
MAX_INPUT_JUNK_LOGGED: Final = 10

T = TypeVar("T")
StatsListener = Callable[[int, SchedulerStats], None]
#: Returns what its owner knows about an engine's death (or None); see add_death_explainer.
DeathExplainer = Callable[[], "str | None"]


class EngineCoreClient(UtilityCalls):
    """A connection to one or more vLLM engine cores.

    Create it with ``async with EngineCoreClient.connect(config) as engine:``. Leaving the
    block shuts everything down: every request the engines still run (streams still open in
    other tasks, scopes just left) is aborted, one ABORT frame per engine, before the sockets
    close; tasks are cancelled, and every open stream and waiting call ends with
    :class:`~anyio_genout.ClientClosedError`.
    """

    def __init__(self, config: EngineCoreClientConfig, sockets: BoundSockets,
                 ready: dict[int, EngineCoreReadyResponse]) -> None:
        self._config = config
        self._sockets = sockets
        self._input: ZmqSocket = sockets.input
        self._outbox = Outbox(sockets.input)  # what _sender sends there, in order
        self._output: ZmqSocket = sockets.output
        self._ready = dict(sorted(ready.items()))
        self._ranks = list(self._ready)
        self._identities = {rank: engine_identity(rank) for rank in self._ranks}
        self._registry = RequestRegistry(self._ranks)
        self._error: OperationalError | None = None
        self._calls = PendingCalls(config.client_index, self._send_input,
                                   self._raise_if_unhealthy)
        self._abort_send: MemoryObjectSendStream[tuple[str, int]]
        self._abort_receive: MemoryObjectReceiveStream[tuple[str, int]]
        self._abort_send, self._abort_receive = anyio.create_memory_object_stream[
            tuple[str, int]](math.inf)
        self._pending_aborts: dict[str, int] = {}
        self._stats_listeners: list[StatsListener] = []
        self._max_model_len = min(r.max_model_len for r in self._ready.values())
        self._aborts_sent = 0
        self._input_junk = 0
        monitors = {"output": sockets.output_monitor, "input": sockets.input_monitor}
        self._watch = EngineWatch(
            config, self._ranks,
            {name: monitor for name, monitor in monitors.items() if monitor is not None},
            self._calls, self.fail, lambda: self._error is None,
            lambda: len(self._registry.requests))
        self._death_explainers: list[DeathExplainer] = []

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def connect(cls, config: EngineCoreClientConfig) -> _Connection:
        """Bind, complete the handshake with every engine, and run the client.

        ``async with EngineCoreClient.connect(config) as engine:`` returns once every
        engine is ready; see :class:`EngineCoreClientConfig` for the two connection modes.
        While it waits it logs what it waits for and where (``anyio_genout.engine``; a
        warning after a second if an engine was not heard from).

        Entering raises :class:`~anyio_genout.HandshakeTimeoutError` after
        ``ready_timeout``, :class:`~anyio_genout.HandshakeError` on a bad start-up
        message, :class:`~anyio_genout.EngineDeadError` if an engine dies while starting,
        :class:`~anyio_genout.TransportError` if an address cannot be bound; Ctrl-C while
        waiting raises a plain :class:`KeyboardInterrupt`.
        """
        return _Connection(config)

    # ------------------------------------------------------------------ accessors

    @property
    def config(self) -> EngineCoreClientConfig:
        return self._config

    @property
    def engine_ranks(self) -> list[int]:
        """Data-parallel ranks of the connected engines, in engine order."""
        return list(self._ranks)

    @property
    def engine_identities(self) -> list[bytes]:
        return [self._identities[r] for r in self._ranks]

    @property
    def engine_count(self) -> int:
        return len(self._ranks)

    @property
    def ready_responses(self) -> dict[int, EngineCoreReadyResponse]:
        return dict(self._ready)

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vllm_version(self) -> str:
        return self._ready[self._ranks[0]].vllm_version

    @property
    def input_address(self) -> str:
        return self._sockets.input_address

    @property
    def output_address(self) -> str:
        return self._sockets.output_address

    @property
    def is_healthy(self) -> bool:
        return self._error is None

    @property
    def health_error(self) -> OperationalError | None:
        """The first error that made the client unhealthy (sticky), or None."""
        return self._error

    @property
    def in_flight(self) -> int:
        """Requests registered and not yet finished, aborted or failed."""
        return len(self._registry.requests)

    @property
    def pending_utility_calls(self) -> int:
        return len(self._calls)

    @property
    def output_disconnects(self) -> int:
        """Peers (engines, normally) whose connection to the output socket closed after a
        completed ZeroMQ handshake, since the client started binding."""
        return self._watch.output_disconnects

    @property
    def aborts_sent(self) -> int:
        """Request ids sent in ABORT frames so far (for tests and soak checks)."""
        return self._aborts_sent

    def engine_load(self) -> dict[int, int]:
        """Routing score of each engine: max(in-flight, running + waiting)."""
        return {rank: load.score for rank, load in self._registry.engines.items()}

    def add_stats_listener(self, listener: StatsListener) -> None:
        """Call ``listener(engine_rank, stats)`` for every scheduler-stats update."""
        self._stats_listeners.append(listener)

    def add_death_explainer(self, explain: DeathExplainer) -> Callable[[], None]:
        """Let whoever owns engines say why one died; returns a function that unregisters.

        ``ENGINE_CORE_DEAD`` is a bare sentinel that names neither the engine nor the cause.
        When one arrives, ``explain()`` is called (synchronously, from the reader) and the
        text it returns, e.g. ``"engine 0 (mock): duplicate request id 'a'"``, is appended
        to the :class:`~anyio_genout.EngineDeadError` every stream and call then gets; None
        or ``""`` adds nothing. An exception from ``explain`` is logged and ignored.
        """
        self._death_explainers.append(explain)

        def unregister() -> None:
            if explain in self._death_explainers:
                self._death_explainers.remove(explain)

        return unregister

    # ------------------------------------------------------------------ in-process engines

    def capture_input(self, sink: Callable[[list[Any]], None]) -> None:
        """From now on hand every input message (``[identity, *frames]``) to ``sink``
        instead of sending it. For benchmarks and tests that play the engine in the
        client's own event loop, with :meth:`deliver_output`."""
        self._outbox = _Capture(sink)  # type: ignore[assignment]

    def deliver_output(self, frames: list[Any]) -> None:
        """Handle one output message as the reader does after receiving it (decode,
        dispatch); for benchmarks and tests that play the engine in-process."""
        self._dispatch(frames)

    # ------------------------------------------------------------------ requests

    def call(self, request: EngineCoreRequest) -> _CallScope:
        """Send ``request`` and stream its outputs: ``async with engine.call(req) as s:``.

        Entering does what :meth:`open_stream` does (and raises what it raises); leaving the
        block before the terminal output aborts the request in the engine exactly once.
        """
        return _CallScope(lambda: self.open_stream(request))

    def open_stream(self, request: EngineCoreRequest) -> EngineCoreOutputStream:
        """Validate ``request``, resolve its defaults, pick its engine, register and queue
        it; returns its stream (the synchronous half of :meth:`call`, for a layer that
        builds its own scope: it must :meth:`~EngineCoreOutputStream.close` the stream).

        This is where every decision about a new request is made, once: the one validation
        (:meth:`EngineCoreRequest.validate` with this client's ``vocab_size``,
        ``max_model_len`` and ``max_logprobs``), this client's ``client_index``, the
        ``max_tokens`` default (``max_model_len`` minus the prompt, as vLLM's front end
        fills it in), the duplicate-id check, and the engine (``data_parallel_rank``, else
        the least loaded). :attr:`EngineCoreOutputStream.request` is the request as sent and
        :attr:`EngineCoreOutputStream.max_tokens` its resolved cap.

        Raises, with nothing sent: :class:`~anyio_genout.InvalidRequestError` naming the
        bad field, :class:`~anyio_genout.DuplicateRequestIdError` if a live request has the
        id, the client's sticky health error if it is unhealthy
        (:class:`~anyio_genout.ClientClosedError` once closed); and
        :class:`~anyio_genout.TransportError` if sending the input queue failed (which makes
        the client unhealthy).
        """
        self._raise_if_unhealthy()
        if request.client_index != self._config.client_index:
            request = attrs.evolve(request, client_index=self._config.client_index)
        request.validate(vocab_size=self._config.vocab_size, max_model_len=self._max_model_len,
                         max_logprobs=self._config.max_logprobs)
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is None:
                max_tokens = self._max_model_len - len(request.prompt_token_ids)
                request = attrs.evolve(request, max_tokens=max_tokens)
        registry = self._registry
        engine = registry.choose_engine(request.data_parallel_rank)
        frames = encode_add(request)
        entry = registry.register(request.request_id, engine)  # DuplicateRequestIdError
        try:
            # An abort of an earlier request with this id may still be queued: send it
            # first, or the engine would see a duplicate id and die.
            pending = self._pending_aborts.pop(request.request_id, None)
            if pending is not None:
                self._send_abort_now(pending, [request.request_id])
            self._send_input(engine, frames)
        except BaseException:
            registry.remove(request.request_id)
            entry.box.discard()
            raise
        return EngineCoreOutputStream(request, max_tokens, engine, entry.box,
                                      self._on_stream_close)

    def abort_queued(self, request_id: str) -> bool:
        """Whether the ABORT of a stream closed early with this id waits in the abort queue
        (not yet queued for the engine's input, so a request queued now would reach the
        engine before it; :meth:`open_stream` with that id sends the ABORT first)."""
        return request_id in self._pending_aborts

    def _on_stream_close(self, stream: EngineCoreOutputStream, was_running: bool) -> None:
        entry = self._registry.requests.get(stream.request_id)
        if entry is None or not was_running:
            return
        # Left before the terminal output while the engine still runs it: abort, once.
        self._registry.remove(stream.request_id)
        if self._error is None:
            self._pending_aborts[stream.request_id] = entry.engine
            self._abort_send.send_nowait((stream.request_id, entry.engine))

    async def abort(self, request_ids: Sequence[str]) -> None:
        """Abort requests by id (unknown ids are ignored).

        Each aborted stream first receives a synthesized terminal output with finish reason
        ABORT and no tokens; then one ABORT frame per engine (up to 1024 ids each) is handed
        to ZeroMQ, before this returns. An id whose scope was left and whose ABORT is still
        queued for the abort worker goes in that frame too (and only there).

        Cancellation-safe: a cancelled caller gets the cancellation before anything is
        done; otherwise everything is done and handed over. Raises the client's sticky error
        if it is unhealthy (:class:`~anyio_genout.ClientClosedError` once it is closed), or
        :class:`~anyio_genout.TransportError` if the input socket failed (which makes the
        client unhealthy).
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        self._raise_if_unhealthy()
        by_engine: dict[int, list[str]] = {}
        now = time.time()
        pending = self._pending_aborts
        for rid in dict.fromkeys(request_ids):
            entry = self._registry.remove(rid)
            if entry is None:
                engine = pending.pop(rid, None)
                if engine is not None:  # left early, its ABORT not sent yet: send it now
                    by_engine.setdefault(engine, []).append(rid)
                continue
            by_engine.setdefault(entry.engine, []).append(rid)
            terminal = EngineCoreOutput(rid, [], finish_reason=EngineCoreFinishReason.ABORT)
            entry.box.put_output(now, terminal)
            entry.box.close()
        if by_engine:
            for engine, ids in by_engine.items():
                self._send_abort_now(engine, ids)
            self._hand_over_input()
        await anyio.lowlevel.cancel_shielded_checkpoint()

    def _send_abort_now(self, engine: int, ids: list[str]) -> None:
        for start in range(0, len(ids), MAX_ABORT_BATCH):
            chunk = ids[start:start + MAX_ABORT_BATCH]
            self._send_input(engine, encode_abort(chunk))
            self._aborts_sent += len(chunk)

    def _send_input(self, engine: int, frames: list[bytes]) -> None:
        """Queue a message for ``engine``'s input (sent by :meth:`_sender`, in order)."""
        try:
            self._outbox.put([self._identities[engine], *frames])
        except anyio.ClosedResourceError:
            raise ClientClosedError("engine-core client is closed") from None
        except TransportError as exc:  # a full queue was being sent, and a send failed
            self.fail(exc)
            raise

    def _hand_over_input(self) -> None:
        """Hand every queued input message to ZeroMQ now, in order (not at the end of the
        event-loop pass, as :meth:`_sender` would)."""
        try:
            self._outbox.flush()
        except anyio.ClosedResourceError:
            raise ClientClosedError("engine-core client is closed") from None
        except TransportError as exc:
            self.fail(exc)
            raise

    async def _sender(self) -> None:
        try:
            await self._outbox.run()
        except anyio.ClosedResourceError:
            return
        except TransportError as exc:
            self.fail(exc)

    async def _abort_worker(self) -> None:
        receive = self._abort_receive
        async for first in receive:
            batch = [first]
            while len(batch) < MAX_ABORT_BATCH:
                try:
                    batch.append(receive.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
            self._flush_aborts(batch)

    def _flush_aborts(self, batch: Sequence[tuple[str, int]]) -> None:
        """Send the pending aborts among ``batch``: one ABORT frame per engine."""
        if self._error is not None:
            self._pending_aborts.clear()
            return
        by_engine: dict[int, list[str]] = {}
        for rid, engine in batch:
            # Skip ids already sent (a new request with the same id flushed it).
            if self._pending_aborts.get(rid) == engine:
                del self._pending_aborts[rid]
                by_engine.setdefault(engine, []).append(rid)
        self._send_aborts(by_engine)

    def _send_aborts(self, by_engine: dict[int, list[str]]) -> None:
        """One ABORT frame per engine (more past 1024 ids); a failure is logged."""
        for engine, ids in by_engine.items():
            logger.debug("aborting %d request(s) on engine %d", len(ids), engine)
            try:
                self._send_abort_now(engine, ids)
            except GenoutError as exc:
                logger.warning("could not send ABORT to engine %d: %s", engine, exc)

    def _abort_all_on_close(self) -> None:
        """Closing: ABORT everything the engines may still be running, then hand every
        queued message to ZeroMQ (before the sockets close).

        That is the ids whose scopes were left with their ABORT still queued (e.g. on
        Ctrl-C), and every request still registered: streams open in other tasks, which
        then end with :class:`~anyio_genout.ClientClosedError` (closing removes them, so
        nothing aborts them again). One frame per engine. An unhealthy client sends none:
        it no longer tracks any request.
        """
        if self._error is None:
            by_engine: dict[int, list[str]] = {}
            for rid, engine in self._pending_aborts.items():
                by_engine.setdefault(engine, []).append(rid)
            self._pending_aborts.clear()
            for rid, entry in self._registry.requests.items():
                by_engine.setdefault(entry.engine, []).append(rid)
            if by_engine:
                logger.info("closing: aborting %d request(s) still in flight",
                            sum(map(len, by_engine.values())))
            self._send_aborts(by_engine)
        try:
            self._outbox.flush()
        except (anyio.ClosedResourceError, TransportError) as exc:
            logger.warning("could not send the last queued messages: %s", exc)

    # ------------------------------------------------------------------ the reader

    async def _reader(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        sock = self._output
        task_status.started()
        try:
            # Is a message queued? Outside a burst, ask ZMQ_EVENTS (1.2 us) before receiving:
            # a receive that finds nothing costs more (pyzmq raises zmq.Again inside, 2.7 us).
            # In a burst (two messages in a row) just receive, until one finds nothing.
            count = 0
            streak = 0
            while True:
                if streak < _BURST and not sock.readable():
                    await sock.wait_signalled()
                    continue
                frames = sock.receive_nowait()
                if frames is None:
                    streak = 0
                    continue
                streak += 1
                self._dispatch(frames)
                if self._error is not None:
                    return
                count += 1
                if count == MAX_READ_BATCH:
                    count = 0
                    await anyio.lowlevel.checkpoint()
        except anyio.ClosedResourceError:
            return
        except TransportError as exc:
            self.fail(exc)

    async def _drain_input(self) -> None:
        """Discard messages sent to the input ROUTER after the handshake (none expected)."""
        sock = self._input
        try:
            while True:
                frames = sock.receive_nowait()
                if frames is None:
                    await sock.wait_readable()
                    continue
                self._input_junk += 1
                if self._input_junk <= MAX_INPUT_JUNK_LOGGED:
                    logger.warning("discarding an unexpected %d-frame message sent to the "
                                   "input socket by %r", len(frames),
                                   bytes(frames[0].buffer)[:16])
                if self._input_junk % MAX_READ_BATCH == 0:
                    await anyio.lowlevel.checkpoint()
        except anyio.ClosedResourceError:
            return
        except TransportError as exc:
            self.fail(exc)

    def _dispatch(self, frames: list[Any]) -> None:
        try:
            # zmq.Frame has the buffer protocol: the decoder reads the frames in place.
            message = decode_batch_or_other(frames)
        except ProtocolError as exc:
            self.fail(exc)
            return
        if type(message) is tuple:
            self._dispatch_batch(*message)
        elif type(message) is RequestBatch:  # outputs that carry wave fields as well
            m = message.message
            self._dispatch_batch(m.engine_index, m.outputs, m.scheduler_stats, m.timestamp,
                                 m.finished_requests)
        elif type(message) is UtilityReply:
            calls = self._calls
            probed = calls.probe_engine(message.reply.call_id)
            if probed is not None:
                self._watch.note_answer(probed, frames[0])
            calls.resolve(message.reply)
        elif type(message) is EngineDead:
            self.fail(EngineDeadError(self._engine_core_dead_message()))
        else:
            assert isinstance(message, DpControl)
            self.fail(ProtocolError(
                "EngineCoreOutputs: data-parallel wave control arrived on the main output "
                "socket (this client runs no DP coordinator)"))

    def _engine_core_dead_message(self) -> str:
        """"an engine core sent ENGINE_CORE_DEAD", with what the explainers know."""
        reasons: list[str] = []
        for explain in list(self._death_explainers):
            try:
                text = explain()
            except Exception:
                logger.exception("death explainer %r failed", explain)
                continue
            if text:
                reasons.append(text)
        message = "an engine core sent ENGINE_CORE_DEAD"
        return f"{message}: {'; '.join(reasons)}" if reasons else message

    def _dispatch_batch(self, engine: int, outputs: list[EngineCoreOutput],
                        stats: SchedulerStats | None, timestamp: float,
                        finished: frozenset[str] | None) -> None:
        requests = self._registry.requests
        for output in outputs:
            entry = requests.get(output.request_id)
            if entry is None:
                continue  # finished, aborted or unknown: dropped
            # OutputMailbox.put_output, inlined: this loop runs once per delivered token.
            box = entry.box
            items = box.items
            items.append(timestamp)
            items.append(output)
            if output.finish_reason is not None:
                self._registry.remove(output.request_id)
                box.closed = True
            if box.waiter is not None:
                box.wake()
        if finished:
            for rid in finished:
                entry = self._registry.remove(rid)
                if entry is not None:  # finished without a final output
                    entry.box.close()
        if stats is not None:
            self._registry.update_stats(engine, stats)
            for listener in self._stats_listeners:
                listener(engine, stats)

    # ------------------------------------------------------------------ health

    def fail(self, error: OperationalError) -> None:
        """Mark the client unhealthy with ``error`` (the first error sticks).

        Every open stream receives the error once, every waiting utility call fails with it,
        and every later call fails with it at once. Used by the reader and by process
        watchers (e.g. the managed vLLM engine); synchronous and idempotent.
        """
        if self._error is not None:
            return
        self._error = error
        if isinstance(error, ClientClosedError):
            logger.debug("engine-core client closed")
        else:
            logger.error("engine-core client is unhealthy: %s", error)
        requests = self._registry.requests
        for entry in list(requests.values()):
            entry.box.put_error(copy_error(error))
            entry.box.close()
        for rid in list(requests):
            self._registry.remove(rid)
        self._calls.fail(error)
        self._pending_aborts.clear()

    def _raise_if_unhealthy(self) -> None:
        if self._error is not None:
            raise copy_error(self._error)

    # ------------------------------------------------------------------ utility calls

    async def call_utility(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every engine; returns the results in engine order.

        Waits for every engine's reply; if any engine failed, raises
        :class:`~anyio_genout.UtilityCallError` after all have answered. Cancelling the
        caller unregisters its waiters.
        """
        return await self._calls.call(self._ranks, method, args)



class _Capture:
    """An outbox that hands each message to a function (see ``capture_input``)."""

    def __init__(self, sink: Callable[[list[Any]], None]) -> None:
        self.put = sink

    def flush(self) -> None:
        pass

    async def run(self) -> None:
        await anyio.sleep_forever()


class _Connection:
    """``async with EngineCoreClient.connect(config)``: the client's lifetime."""

    def __init__(self, config: EngineCoreClientConfig) -> None:
        self._config = config
        self._client: EngineCoreClient | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._context: Any = None

    async def __aenter__(self) -> EngineCoreClient:
        self._context = new_context()
        sockets: BoundSockets | None = None
        try:
            sockets = bind_sockets(self._context, self._config)
            ready = await run_handshake(sockets, self._config)
            if sockets.handshake is not None:
                sockets.handshake.close()
                sockets.handshake = None
            client = EngineCoreClient(self._config, sockets, ready)
            early, sockets.early_outputs = sockets.early_outputs, []
            for frames in early:  # arrived before READY: dispatched before anything newer
                client._dispatch(frames)
            tg = anyio.create_task_group()
            await tg.__aenter__()
            try:
                await tg.start(client._reader)
                tg.start_soon(client._sender)
                tg.start_soon(client._abort_worker)
                tg.start_soon(client._drain_input)
                if sockets.output_monitor is not None:
                    tg.start_soon(client._watch.watch_connections)
                if self._config.liveness_interval is not None:
                    tg.start_soon(client._watch.liveness, self._config.liveness_interval,
                                  self._config.liveness_timeout)
            except BaseException:
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)
                raise
        except BaseException:
            if sockets is not None:
                sockets.close()
            self._context.term()
            raise
        self._client = client
        self._tg = tg
        return client

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        client, tg = self._client, self._tg
        assert client is not None and tg is not None
        # Every request the engines still run gets its ABORT before the sockets close: those
        # whose scopes were left just now (e.g. on Ctrl-C) and those still open elsewhere.
        client._abort_all_on_close()
        client.fail(ClientClosedError("engine-core client is closed"))
        client._abort_send.close()
        client._sockets.close(input_linger=CLOSE_LINGER)
        tg.cancel_scope.cancel()
        # The body's exception (if any) propagates unchanged: it never enters the task group.
        try:
            await tg.__aexit__(None, None, None)
        except BaseExceptionGroup as group:
            # On trio a Ctrl-C lands in whichever task runs, often the reader: it is the
            # user's KeyboardInterrupt all the same, not a failure of ours.
            interrupt = keyboard_interrupt_in(group)
            if interrupt is not None:
                raise interrupt from None
            raise RuntimeError("anyio-genout background task failed") from group  # a bug
        finally:
            client._abort_receive.close()
            # term() waits (at most CLOSE_LINGER) for the last ABORTs to leave; in a worker
            # thread, shielded, so the event loop never blocks on it and it always completes.
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._context.term)

