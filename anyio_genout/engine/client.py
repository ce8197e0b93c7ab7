"""``EngineCoreClient``: the raw engine-core client (requests, the reader, health).

Task layout (one client-level task group, run by :mod:`.connection`, started by
:meth:`EngineCoreClient.run_tasks`):

* the **engine-reader** task, the only task that waits on the output socket: it drains every
  queued message, decodes it with the protocol core and appends each output to its
  request's mailbox (never waiting on a consumer);
* the **sender**, which sends the input outbox once per event-loop pass (:mod:`.outbox`);
* the **abort worker** (:mod:`.aborts`);
* the **input drain**, which reads and discards anything sent *to* the input socket after
  the handshake (engines never send there again; without it a peer could fill this
  process's memory with messages nobody reads);
* the **connection watchers**, the **prober** and the **liveness** task, which find an
  engine that vanished or hung (:mod:`.watchers`);
* the **handshake reader** (handshake owner only), which answers restarted engines that
  dial the handshake socket again (:class:`~.rejoin.Rejoins`; a registration on the
  input socket reaches it through the input drain).

Sends on the input ROUTER are queued (``NOBLOCK`` with an unbounded high-water mark never
blocks towards a connected engine), so request scopes never await while sending and the
order of ADD and ABORT frames is exactly program order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import anyio
import anyio.abc
import attrs

from ..errors import (
    ClientClosedError,
    ClientUnhealthyError,
)
from ..protocol import (
    EngineCoreFinishReason,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineCoreRequest,
    encode_add,
    engine_identity,
)
from ..protocol.validation import resolve_max_tokens
from .aborts import AbortQueue
from .config import EngineCoreClientConfig
from .connection import Connection
from .handshake import BoundSockets
from .health import EngineHealth, HealthListener
from .input import EngineInput
from .reader import BatchListener, DeathExplainer, OutputReader, StatsListener
from .registry import RequestRegistry
from .rejoin import Rejoins
from .routing import Router, make_router
from .stream import CallScope, EngineCoreOutputStream, new_output_stream
from .utility import UtilityCalls
from .utility_calls import PendingCalls
from .watchers import EngineWatch
from .waves import WaveControl

__all__ = ["EngineCoreClient", "HealthListener"]

#: Called with ``(rank, up)`` when an engine goes down (``up`` False) or comes back.

logger = logging.getLogger("anyio_genout.engine")

#: Seconds the input socket may keep the final ABORT frames queued after the client closes.
CLOSE_LINGER: Final = 0.5


class EngineCoreClient(EngineHealth, UtilityCalls):
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
        self._ready = dict(sorted(ready.items()))
        self._ranks = list(self._ready)
        self._identities = {rank: engine_identity(rank) for rank in self._ranks}
        self._rejoins = Rejoins(config, sockets, self._rejoin_refusal, self._rejoin)
        self._input = EngineInput(sockets.input, self._identities, self.fail,
                                  self._rejoins.on_input)
        self._send_input = self._input.send
        self._registry = RequestRegistry(self._ranks, make_router(
            config.routing, {r: ready[r].block_size for r in self._ranks},
            {r: ready[r].num_gpu_blocks for r in self._ranks},
            imbalance_threshold=config.prefix_imbalance_threshold,
            memory_blocks=config.prefix_memory_blocks))
        self._error: ClientUnhealthyError | None = None
        self._health_listeners: list[HealthListener] = []
        self._sleep_listeners: list[Callable[[int, int], None]] = []  # UtilityCalls
        self._calls = PendingCalls(config.client_index, self._send_input,
                                   self._raise_if_unhealthy, self._down_error)
        self._aborts = AbortQueue(self._send_input, lambda: self._error is None)
        self._max_model_len = min(r.max_model_len for r in self._ready.values())
        monitors = {"output": sockets.output_monitor, "input": sockets.input_monitor}
        self._watch = EngineWatch(
            config, self._registry.live,
            {name: monitor for name, monitor in monitors.items() if monitor is not None},
            self._calls, self.fail, lambda: self._error is None,
            lambda: len(self._registry.requests), self.fail_engines)
        self._reader = OutputReader(sockets.output, self._registry, self._calls, self._watch,
                                    self.fail)
        self._waves: WaveControl | None = None
        if config.data_parallel_waves:  # a lockstep MoE group (waves.py)
            engines = self._registry.engines
            self._waves = WaveControl(self._send_input, lambda: self._registry.live,
                                      lambda e: engines[e].in_flight if e in engines else 0)
            self._reader.wave_control = self._wave_control

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def connect(cls, config: EngineCoreClientConfig) -> Connection[EngineCoreClient]:
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
        return Connection(config, cls)

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
    def in_flight(self) -> int:
        """Requests registered and not yet finished, aborted or failed."""
        return len(self._registry.requests)

    @property
    def wave_state(self) -> tuple[int, bool] | None:
        """``(current_wave, engines_running)`` of the data-parallel group as this client
        knows it; None unless ``data_parallel_waves``."""
        state = None if self._waves is None else self._waves.state
        return None if state is None else (state.current_wave, state.engines_running)

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
        return self._aborts.sent

    def engine_load(self) -> dict[int, float]:
        """Routing score of each engine: max(in-flight, running + waiting), plus vLLM's
        KV-usage penalty on waiting requests (docs/routing.md)."""
        return {rank: load.score for rank, load in self._registry.engines.items()}

    @property
    def router(self) -> Router:
        """The router choosing each request's engine (``config.routing``); its ``stats``
        count its decisions."""
        return self._registry.router

    def add_stats_listener(self, listener: StatsListener) -> None:
        """Call ``listener(engine_rank, stats)`` for every scheduler-stats update."""
        self._reader.stats_listeners.append(listener)

    def add_batch_listener(self, listener: BatchListener) -> None:
        """Call ``listener(engine_rank, tokens)`` for every batch of outputs (``tokens``: the
        prompt tokens computed for the open requests prefilled in it plus those generated)."""
        self._reader.batch_listeners.append(listener)

    def add_death_explainer(self, explain: DeathExplainer) -> Callable[[], None]:
        """Let whoever owns engines say why one died; returns a function that unregisters.

        ``ENGINE_CORE_DEAD`` is a bare sentinel that names neither the engine nor the cause.
        When one arrives, ``explain()`` is called (synchronously, from the reader) and the
        text it returns, e.g. ``"engine 0 (mock): duplicate request id 'a'"``, is appended
        to the :class:`~anyio_genout.EngineDeadError` every stream and call then gets; None
        or ``""`` adds nothing. An exception from ``explain`` is logged and ignored.
        """
        explainers = self._reader.death_explainers
        explainers.append(explain)

        def unregister() -> None:
            if explain in explainers:
                explainers.remove(explain)

        return unregister

    # ------------------------------------------------------------------ in-process engines

    def capture_input(self, sink: Callable[[list[Any]], None]) -> None:
        """From now on hand every input message (``[identity, *frames]``) to ``sink``
        instead of sending it. For benchmarks and tests that play the engine in the
        client's own event loop, with :meth:`deliver_output`."""
        self._input.capture(sink)

    def deliver_output(self, frames: list[Any]) -> None:
        """Handle one output message as the reader does after receiving it (decode,
        dispatch); for benchmarks and tests that play the engine in-process."""
        self._reader.dispatch(frames)

    # ------------------------------------------------------------------ requests

    def call(self, request: EngineCoreRequest) -> CallScope:
        """Send ``request`` and stream its outputs: ``async with engine.call(req) as s:``.

        Entering does what :meth:`open_stream` does (and raises what it raises); leaving the
        block before the terminal output aborts the request in the engine exactly once.
        """
        return CallScope(lambda: self.open_stream(request))

    def open_stream(self, request: EngineCoreRequest) -> EngineCoreOutputStream:
        """Validate ``request``, resolve its defaults, pick its engine, register and queue
        it; returns its stream (the synchronous half of :meth:`call`, for a layer that
        builds its own scope: it must :meth:`~EngineCoreOutputStream.close` the stream).

        This is where every decision about a new request is made, once: the one validation
        (:meth:`EngineCoreRequest.validate` with this client's ``vocab_size``,
        ``max_model_len`` and ``max_logprobs``), this client's ``client_index``, the
        ``max_tokens`` cap (:meth:`EngineCoreRequest.resolved_max_tokens`, vLLM's rule: above
        ``max_model_len`` refused, None the rest of the context, beyond the prompt's room cut
        to it), the duplicate-id check, and the engine (``data_parallel_rank``, else
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
        # The one rule (protocol.validation.resolve_max_tokens, which validate applied):
        # None fills in the rest of the context, a cap beyond the prompt's room is cut to it.
        requested = request.max_tokens
        if requested is None:
            requested = request.sampling_params.max_tokens
        max_tokens = resolve_max_tokens(requested, len(request.prompt_token_ids),
                                        self._max_model_len)
        if max_tokens != requested:
            request = attrs.evolve(request, max_tokens=max_tokens)
        registry = self._registry
        engine, ticket = registry.choose_engine(request)
        waves = self._waves
        if waves is not None and request.current_wave != waves.current_wave:
            request = attrs.evolve(request, current_wave=waves.current_wave)
        frames = encode_add(request)
        entry = registry.register(request.request_id, engine, ticket)  # DuplicateRequestIdError
        try:
            # An abort of an earlier request with this id may still be queued: send it
            # first, or the engine would see a duplicate id and die.
            self._aborts.send_pending_now(request.request_id)
            if waves is not None:
                waves.request(engine)  # START_DP_WAVE first if the group is paused
            self._send_input(engine, frames)
        except BaseException:
            registry.remove(request.request_id)
            entry.box.discard()
            raise
        return new_output_stream(request, max_tokens, engine, entry.box, self._on_stream_close)

    def abort_queued(self, request_id: str) -> bool:
        """Whether the ABORT of a stream closed early with this id waits in the abort queue
        (not yet queued for the engine's input, so a request queued now would reach the
        engine before it; :meth:`open_stream` with that id sends the ABORT first)."""
        return self._aborts.is_pending(request_id)

    def _on_stream_close(self, stream: EngineCoreOutputStream, was_running: bool) -> None:
        entry = self._registry.requests.get(stream.request_id)
        if entry is None or not was_running:
            return
        # Left before the terminal output while the engine still runs it: abort, once.
        self._registry.remove(stream.request_id)
        if self._error is None:
            self._aborts.queue(stream.request_id, entry.engine)

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
        aborts = self._aborts
        for rid in dict.fromkeys(request_ids):
            entry = self._registry.remove(rid)
            if entry is None:
                engine = aborts.take(rid)
                if engine is not None:  # left early, its ABORT not sent yet: send it now
                    by_engine.setdefault(engine, []).append(rid)
                continue
            by_engine.setdefault(entry.engine, []).append(rid)
            terminal = EngineCoreOutput(rid, [], finish_reason=EngineCoreFinishReason.ABORT)
            entry.box.put_output(now, terminal)
            entry.box.close()
        if by_engine:
            for engine, ids in by_engine.items():
                aborts.send_now(engine, ids)
            self._input.hand_over()
        await anyio.lowlevel.cancel_shielded_checkpoint()

    # ------------------------------------------------------------------ run and close

    async def run_tasks(self, task_group: anyio.abc.TaskGroup) -> None:
        """Start the client's background tasks in ``task_group`` (package-internal: the
        connection's task group); returns once the reader runs."""
        await task_group.start(self._reader.run)
        task_group.start_soon(self._input.run_sender)
        task_group.start_soon(self._aborts.run)
        task_group.start_soon(self._input.drain)
        if self._sockets.handshake is not None:
            task_group.start_soon(self._rejoins.run)
        if self._sockets.output_monitor is not None:
            task_group.start_soon(self._watch.watch_connections)
        if self._config.liveness_interval is not None:
            task_group.start_soon(self._watch.liveness, self._config.liveness_interval,
                                  self._config.liveness_timeout)

    def close_now(self) -> None:
        """Close the client, synchronously (package-internal: the connection's exit, before
        it cancels the tasks).

        First ABORT everything the engines may still be running, one frame per engine: the
        ids whose scopes were left with their ABORT still queued (e.g. on Ctrl-C), and every
        request still registered (streams open in other tasks, which then end with
        :class:`~anyio_genout.ClientClosedError`; closing removes them, so nothing aborts
        them again); an unhealthy client sends none. Then hand every queued message to
        ZeroMQ, make the client closed, and close the sockets (the input socket lingers
        ``CLOSE_LINGER`` seconds for the last frames).
        """
        self._aborts.abort_all((rid, entry.engine)
                               for rid, entry in self._registry.requests.items())
        self._input.hand_over_logged()
        self.fail(ClientClosedError("engine-core client is closed"))
        self._aborts.close()
        self._sockets.close(input_linger=CLOSE_LINGER)

    def _wave_control(self, message: EngineCoreOutputs) -> None:
        assert self._waves is not None
        try:
            self._waves.control(message)
        except ClientUnhealthyError:  # sending failed: the client is failed already
            pass

    # ------------------------------------------------------------------ utility calls

    async def call_utility(self, method: str, *args: Any) -> list[Any]:
        """Call ``method(*args)`` on every engine up (:attr:`live_engines`, all of them
        unless one died); returns their results in engine order.

        Waits for every engine's reply. Cancelling the caller unregisters its waiters.

        Raises:
            UtilityCallError: an engine's method failed, or one of the engines died while
                the call waited (raised after all the others have answered; its
                ``failures`` maps each failed engine's rank to why, ``results`` each other
                engine's rank to its result).
            ClientUnhealthyError: the client's sticky health error, at once or when it
                turns unhealthy while the call waits (:class:`EngineDeadError`,
                :class:`ClientClosedError`, ...); :class:`EngineDeadError` naming every
                engine and why, at once, while none is up (``last_engine_death="wait"``).
        """
        live = self.live_engines
        if not live and self._error is None:
            await anyio.lowlevel.checkpoint()
            raise self._registry.none_up_error()
        return await self._calls.call(live, method, args)
