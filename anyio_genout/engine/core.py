"""The parts of one engine-core client, composed: what :class:`~.client.EngineCoreClient`
delegates to and what :class:`~.connection.Connection` runs and closes (package-internal).

:class:`ClientCore` builds every part once, each with the parts it uses passed in by name:

* ``reports`` (:class:`~.reports.HealthReports`): the sticky error, and where the parts
  that find a failure (input, reader, watchers) or an engine come back (rejoins) report;
  ``health`` (:class:`~.health.Health`) handles the reports;
* ``input`` (:class:`~.input.EngineInput`): every message for an engine, in order;
* ``registry`` (:class:`~.registry.RequestRegistry`): live requests, engine loads, routing;
* ``pending`` (:class:`~.utility_calls.PendingCalls`) and ``calls``
  (:class:`~.utility.UtilityCalls`): utility calls in flight, and the typed calls;
* ``aborts`` (:class:`~.aborts.AbortQueue`), ``watch`` (:class:`~.watchers.EngineWatch`),
  ``reader`` (:class:`~.reader.OutputReader`), ``rejoins`` (:class:`~.rejoin.Rejoins`) and
  ``waves`` (:class:`~.waves.WaveControl`, data-parallel waves only).

Task layout (one client-level task group, run by :mod:`.connection`, started by
:meth:`ClientCore.run_tasks`):

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

import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import anyio
import anyio.abc
import anyio.lowlevel
import attrs

from ..errors import ClientClosedError, ClientUnhealthyError
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
from .handshake import BoundSockets
from .health import Health
from .input import EngineInput
from .pace import ReaderPace
from .reader import OutputReader
from .registry import RequestRegistry
from .rejoin import Rejoins
from .reports import HealthReports
from .routing import make_router
from .stream import EngineCoreOutputStream, new_output_stream
from .utility import UtilityCalls
from .utility_calls import PendingCalls
from .watchers import EngineWatch
from .waves import WaveControl

__all__ = ["CLOSE_LINGER", "ClientCore"]

#: Seconds the input socket may keep the final ABORT frames queued after the client closes.
CLOSE_LINGER: Final = 0.5


class ClientCore:
    """One engine client's parts and the decisions that span them (package-internal)."""

    def __init__(self, config: EngineCoreClientConfig, sockets: BoundSockets,
                 ready: dict[int, EngineCoreReadyResponse]) -> None:
        self.config = config
        self.sockets = sockets
        self.ready = dict(sorted(ready.items()))
        self.ranks = list(self.ready)
        self.identities = {rank: engine_identity(rank) for rank in self.ranks}
        self.max_model_len = min(r.max_model_len for r in self.ready.values())
        self.reports = reports = HealthReports()
        self.registry = registry = RequestRegistry(self.ranks, make_router(
            config.routing.mode, {r: ready[r].block_size for r in self.ranks},
            {r: ready[r].num_gpu_blocks for r in self.ranks},
            imbalance_threshold=config.routing.prefix_imbalance_threshold,
            memory_blocks=config.routing.prefix_memory_blocks))
        self.rejoins = Rejoins(config, sockets, registry.live, reports)
        self.input = EngineInput(sockets.input, self.identities, reports,
                                 self.rejoins.on_input)
        send = self.input.send
        self.pending = PendingCalls(config.client_index, send, reports, registry)
        self.aborts = AbortQueue(send, reports)
        monitors = {"output": sockets.output_monitor, "input": sockets.input_monitor}
        self.watch = EngineWatch(
            config, registry,
            {name: monitor for name, monitor in monitors.items() if monitor is not None},
            self.pending, reports)
        self.pace = ReaderPace()
        self.reader = OutputReader(sockets.output, registry, self.pending, self.watch, reports,
                                   self.pace)
        self.health = Health(config, self.ready, self.max_model_len, reports, registry,
                             self.aborts, self.pending, self.reader, self.rejoins, self.watch)
        self.calls = UtilityCalls(self.pending, self.health, registry)
        self.waves: WaveControl | None = None
        if config.data_parallel_waves:  # a lockstep MoE group (waves.py)
            self.waves = WaveControl(send, registry.live, registry.in_flight_on)
            self.reader.wave_control = self._wave_control

    # ------------------------------------------------------------------ requests

    def open_stream(self, request: EngineCoreRequest) -> EngineCoreOutputStream:
        """:meth:`EngineCoreClient.open_stream <.client.EngineCoreClient.open_stream>`."""
        self.reports.raise_if_unhealthy()
        config = self.config
        if request.client_index != config.client_index:
            request = attrs.evolve(request, client_index=config.client_index)
        request.validate(vocab_size=config.vocab_size, max_model_len=self.max_model_len,
                         max_logprobs=config.max_logprobs)
        # The one rule (protocol.validation.resolve_max_tokens, which validate applied):
        # None fills in the rest of the context, a cap beyond the prompt's room is cut to it.
        requested = request.max_tokens
        if requested is None:
            requested = request.sampling_params.max_tokens
        max_tokens = resolve_max_tokens(requested, len(request.prompt_token_ids),
                                        self.max_model_len)
        if max_tokens != requested:
            request = attrs.evolve(request, max_tokens=max_tokens)
        registry = self.registry
        engine, ticket = registry.choose_engine(request)
        waves = self.waves
        if waves is not None and request.current_wave != waves.current_wave:
            request = attrs.evolve(request, current_wave=waves.current_wave)
        frames = encode_add(request)
        entry = registry.register(request.request_id, engine, ticket)  # DuplicateRequestIdError
        try:
            # An abort of an earlier request with this id may still be queued: send it
            # first, or the engine would see a duplicate id and die.
            self.aborts.send_pending_now(request.request_id)
            if waves is not None:
                waves.request(engine)  # START_DP_WAVE first if the group is paused
            self.input.send(engine, frames)
        except BaseException:
            registry.remove(request.request_id)
            entry.box.discard()
            raise
        return new_output_stream(request, max_tokens, engine, entry.box, self._on_stream_close,
                                 self.pace)

    def _on_stream_close(self, stream: EngineCoreOutputStream, was_running: bool) -> None:
        entry = self.registry.requests.get(stream.request_id)
        if entry is None or not was_running:
            return
        # Left before the terminal output while the engine still runs it: abort, once.
        self.registry.remove(stream.request_id)
        if self.reports.healthy:
            self.aborts.queue(stream.request_id, entry.engine)

    async def abort(self, request_ids: Sequence[str]) -> None:
        """:meth:`EngineCoreClient.abort <.client.EngineCoreClient.abort>`."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        self.reports.raise_if_unhealthy()
        by_engine: dict[int, list[str]] = {}
        now = time.time()
        aborts = self.aborts
        for rid in dict.fromkeys(request_ids):
            entry = self.registry.remove(rid)
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
            self.input.hand_over()
        await anyio.lowlevel.cancel_shielded_checkpoint()

    def _wave_control(self, message: EngineCoreOutputs) -> None:
        assert self.waves is not None
        try:
            self.waves.control(message)
        except ClientUnhealthyError:  # sending failed: the client is failed already
            pass

    # ------------------------------------------------------------------ in-process engines

    def capture_input(self, sink: Callable[[list[Any]], None]) -> None:
        """From now on hand every input message (``[identity, *frames]``) to ``sink``
        instead of sending it (:func:`anyio_genout.testing.capture_input`)."""
        self.input.capture(sink)

    def deliver_output(self, frames: list[Any]) -> None:
        """Handle one output message as the reader does after receiving it (decode,
        dispatch): the connection's outputs that came before READY, and
        :func:`anyio_genout.testing.deliver_output`."""
        self.reader.dispatch(frames)

    # ------------------------------------------------------------------ run and close

    async def run_tasks(self, task_group: anyio.abc.TaskGroup) -> None:
        """Start the client's background tasks in ``task_group`` (the connection's task
        group); returns once the reader runs."""
        await task_group.start(self.reader.run)
        task_group.start_soon(self.input.run_sender)
        task_group.start_soon(self.aborts.run)
        task_group.start_soon(self.input.drain)
        if self.sockets.handshake is not None:
            task_group.start_soon(self.rejoins.run)
        if self.sockets.output_monitor is not None:
            task_group.start_soon(self.watch.watch_connections)
        health = self.config.health
        if health.liveness_interval is not None:
            task_group.start_soon(self.watch.liveness, health.liveness_interval,
                                  health.liveness_timeout)

    def close_now(self) -> None:
        """Close the client, synchronously (the connection's exit, before it cancels the
        tasks).

        First ABORT everything the engines may still be running, one frame per engine: the
        ids whose scopes were left with their ABORT still queued (e.g. on Ctrl-C), and every
        request still registered (streams open in other tasks, which then end with
        :class:`~anyio_genout.ClientClosedError`; closing removes them, so nothing aborts
        them again); an unhealthy client sends none. Then hand every queued message to
        ZeroMQ, make the client closed, and close the sockets (the input socket lingers
        ``CLOSE_LINGER`` seconds for the last frames).
        """
        self.aborts.abort_all((rid, entry.engine)
                              for rid, entry in self.registry.requests.items())
        self.input.hand_over_logged()
        self.health.fail(ClientClosedError("engine-core client is closed"))
        self.aborts.close()
        self.sockets.close(input_linger=CLOSE_LINGER)
