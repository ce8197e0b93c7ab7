"""A mock vLLM engine core speaking the real wire protocol over real ZeroMQ sockets.

:class:`MockEngine` behaves like ``vllm serve --headless`` (or a bootstrapped engine core)
as a client sees it: the start-up handshake, continuous batching with a waiting queue, one
``EngineCoreOutputs`` message per client per step, the stop rules of vLLM's ``check_stop``,
logprobs with aux frames, utility calls, scheduler stats, silent idempotent aborts, and the
real engine's failure modes (``ENGINE_CORE_DEAD`` on a duplicate in-flight id or an
out-of-vocabulary token, a deaf input thread after a malformed message). Tokens come from
:mod:`.tokens`, so the output is deterministic.

It runs as one task (no threads): drain all queued input, run one step, yield to the event
loop, repeat (as its own process, with no step time, it takes ``steps_per_checkpoint``
steps per yield and input read). With ``until_client_leaves`` a second task watches the
input socket's connection (a ZeroMQ socket monitor) and ends :meth:`MockEngine.serve` when
the front end goes away. Plain decode rows (no logprobs, events or finish) are
packed straight into msgpack bytes from per-request prefixes, so the mock is never the
bottleneck of a client.

The engine is composed of parts, one module each, that call each other's public methods
only (none imports the engine):

* :mod:`.wire`: ``OutputWriter``, the output sockets and ``EngineCoreOutputs`` assembled
  from pre-packed row bytes, utility replies, ``ENGINE_CORE_DEAD``; it keeps ``errors``;
* :mod:`.scheduler`: ``Scheduler``, the waiting queue and running batch (admission,
  preemption, aborts, pauses, KV and prefix-cache accounting), of :mod:`.request` records;
  it sends through the writer;
* :mod:`.step`: ``Stepper``, one step over the scheduler's batch: the token hot loop and the
  scheduler stats, sent through the writer;
* :mod:`.utility`: ``UtilityCalls``, utility calls on its ``EngineCoreProc`` facade, over
  the scheduler and the writer;
* :mod:`.dial`: the handshake-mode start (HELLO, INIT; a bounded wait for a front end);
* this module: ``MockEngine``, which builds the parts and owns start-up (handshake or
  bootstrap), the serve loop, input decoding and fault injection.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Final

import anyio
import anyio.abc
import anyio.lowlevel
import zmq

from ..errors import OperationalError, ProtocolError
from ..protocol import (
    AbortRequest,
    AddRequest,
    EngineStatus,
    SchedulerStats,
    StatusMessage,
    UtilityRequest,
    decode_request,
    encode_status,
)
from ..transport import MonitorEvent, ZmqSocket, new_context
from .config import MockEngineConfig
from .dial import dial_front_end
from .ready import ready_payload
from .request import Request
from .scheduler import Pause, Scheduler
from .step import Stepper
from .utility import UtilityCalls
from .waves import WaveGroup, WaveMember
from .wire import OutputWriter, wait_any_readable

__all__ = ["MockEngine"]

Received = AddRequest | AbortRequest | UtilityRequest

_GARBAGE: Final = b"\xc1"  # the one byte msgpack never uses
#: Seconds READY may take to leave once the handshake socket is closed after it (only a
#: peer that is gone takes longer; closing the engine's context waits that long for it).
_READY_LINGER: Final = 0.5
#: Input-socket events that tell the front end is gone (until_client_leaves).
#: Seconds between looks at the group while an engine waits in the collective (waves).
_COLLECTIVE_POLL: Final = 0.002
_CLIENT_EVENTS: Final = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
                         | zmq.EVENT_CONNECT_RETRIED)


class MockEngine:
    """A mock engine core; :meth:`serve` runs it until cancelled (or until it dies).

    Observable state for tests (read it from the test's task, between awaits):

    * ``received``: decoded requests in arrival order (ADD, ABORT, UTILITY);
    * ``added_ids``; ``aborted_ids`` (every ABORT's ids in order, duplicates kept);
      ``abort_frames`` (ABORT messages received);
    * ``running_ids``, ``waiting_ids``; ``steps`` (steps that generated tokens);
    * ``errors``: protocol violations and fatal conditions it detected;
    * ``last_stats``: the last ``SchedulerStats`` sent (log stats on);
    * ``dead`` (sent ``ENGINE_CORE_DEAD``; ``death_reason`` says why), ``deaf`` (stopped
      reading input), ``silent``;
    * ``client_left``: with ``until_client_leaves``, the front end went away and
      :meth:`serve` returned.
    """

    def __init__(self, config: MockEngineConfig, *, waves: WaveGroup | None = None) -> None:
        """``waves``: this engine is one of a data-parallel group in lockstep waves
        (:mod:`.waves`; every engine of the group gets the same group)."""
        self.config = config
        self.received: list[Received] = []
        self.deaf = False
        self.silent = False
        self.ready = False
        self.client_left = False
        writer = self._writer = OutputWriter(config)
        scheduler = self._scheduler = Scheduler(config, writer)
        self._stepper = Stepper(config, scheduler, writer)
        self._utility = UtilityCalls(scheduler, writer)
        self._garbage_sent = False
        self._served = False
        self._context: zmq.Context[Any] | None = None
        self._handshake: ZmqSocket | None = None
        #: One DEALER per front end (INIT may name several: vLLM's ``--api-server-count``).
        self._inputs: list[ZmqSocket] = []
        self._input_monitor: ZmqSocket | None = None
        #: This engine's wave state (``waves`` given), else None.
        self.wave: WaveMember | None = None if waves is None else waves.join(
            config.rank, lambda: bool(scheduler.running or scheduler.waiting),
            writer.send_to_all)

    # ------------------------------------------------------------------ observable state

    @property
    def running_ids(self) -> list[str]:
        return _alive(self._scheduler.running)

    @property
    def waiting_ids(self) -> list[str]:
        return _alive(self._scheduler.waiting)

    @property
    def paused(self) -> bool:
        return self._scheduler.pause is not Pause.UNPAUSED

    @property
    def weight_version(self) -> str:
        return self._writer.weight_version

    @property
    def added_ids(self) -> list[str]:
        return self._scheduler.added_ids

    @property
    def aborted_ids(self) -> list[str]:
        return self._scheduler.aborted_ids

    @property
    def abort_frames(self) -> int:
        return self._scheduler.abort_frames

    @property
    def steps(self) -> int:
        return self._stepper.steps

    @property
    def last_stats(self) -> SchedulerStats | None:
        return self._stepper.last_stats

    @property
    def errors(self) -> list[str]:
        return self._writer.errors

    @property
    def dead(self) -> bool:
        return self._writer.dead

    @property
    def death_reason(self) -> str | None:
        return self._writer.death_reason

    def die(self, reason: str) -> None:
        """Send ``ENGINE_CORE_DEAD`` now (``death_reason`` is ``reason``), as an engine whose
        busy loop raised; the serve loop then returns. Raises nothing."""
        self._writer.die(reason)

    # ------------------------------------------------------------------ lifecycle

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                    ) -> None:
        """Connect (handshake or bootstrap), then serve until cancelled or dead.

        ``task_status.started()`` fires once READY was sent: in handshake mode that takes a
        front end answering HELLO with INIT, that is a client connecting (``Client.connect``)
        at the same time, so ``await tg.start(engine.serve)`` before the client connects
        cannot return; it fails after ``front_end_timeout`` when nobody listens at the
        handshake address. Bootstrapped, it fires once the registration was queued on the
        input socket (at once: ZeroMQ delivers it when the front end binds).
        Returns after sending ``ENGINE_CORE_DEAD``, or (``until_client_leaves``) once the
        front end went away, with ``client_left`` set. Sockets are closed on every exit path.

        Raises :class:`~anyio_genout.errors.HandshakeTimeoutError` when nothing listens at
        the handshake address within ``front_end_timeout`` (the message says how to start
        the engine), or no INIT arrives within ``handshake_timeout``,
        :class:`~anyio_genout.errors.HandshakeError` (or
        :class:`~anyio_genout.errors.ProtocolError`) on an undecodable INIT, and
        :class:`~anyio_genout.errors.TransportError` on an address ZeroMQ refuses, and
        :class:`RuntimeError` when called a second time (an engine serves once).
        """
        if self._served:
            raise RuntimeError("MockEngine.serve() can run only once")
        self._served = True
        self._context = new_context()
        try:
            await self._connect()
            self.ready = True
            task_status.started()
            monitor = self._input_monitor
            if monitor is None:
                await self._run()
            else:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._watch_client, monitor, tg.cancel_scope)
                    await self._run()
                    tg.cancel_scope.cancel()  # dead: stop watching
        finally:
            with anyio.CancelScope(shield=True):
                if not self.client_left:  # else nobody is there to receive them
                    await self._writer.flush_tracked()
            self._close()

    async def _run(self) -> None:
        try:
            await self._loop()
        except anyio.get_cancelled_exc_class():
            if (self.config.faults.abort_on_shutdown and not self.dead
                    and not self.client_left):
                self._scheduler.abort_everything(shutdown=True)
            raise

    async def _watch_client(self, monitor: ZmqSocket, scope: anyio.CancelScope) -> None:
        """Cancel ``scope`` (the serve loop) once the front end's input socket is gone.

        Gone is a disconnect (the front end closed its sockets or its process died), or,
        in dial mode, a refused connection before the first ZeroMQ handshake: the front end
        bound its input socket before it sent INIT, so it left before the engine connected.
        """
        handshaken = False
        while True:
            try:
                frames = await monitor.receive()
            except (anyio.ClosedResourceError, OperationalError):
                return
            event = MonitorEvent.parse(frames)
            if event is None:
                continue
            if event.event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                handshaken = True
            elif event.event == zmq.EVENT_DISCONNECTED:
                break
            elif not handshaken and self.config.handshake_address is not None:
                break  # EVENT_CONNECT_RETRIED: refused
        self.client_left = True
        scope.cancel()

    def _close(self) -> None:
        if self._input_monitor is not None:
            self._input_monitor.close()  # before the socket it watches
        for sock in (self._handshake, *self._inputs):
            if sock is not None:
                sock.close()
        self._writer.close()
        if self._context is not None:
            self._context.term()
            self._context = None

    async def _connect(self) -> None:
        cfg = self.config
        assert self._context is not None
        ctx = self._context
        identity = cfg.identity
        if cfg.handshake_address is not None:
            hs = self._handshake = ZmqSocket(ctx, zmq.DEALER, identity=identity)
            addresses = await dial_front_end(hs, cfg)
            input_addresses = list(addresses.inputs)
            output_addresses = list(addresses.outputs)
        else:
            assert cfg.input_address is not None
            input_addresses = [cfg.input_address]
            output_addresses = list(cfg.output_addresses)
        if cfg.faults.ready_delay:
            await anyio.sleep(cfg.faults.ready_delay)  # "loading the model"
        # As vLLM's engine does: one input socket per front end, each registered with the
        # ready response; the front end of client_index i is output_addresses[i]. With
        # until_client_leaves, the first front end's departure ends the engine.
        for n, address in enumerate(input_addresses):
            inp = ZmqSocket(ctx, zmq.DEALER, identity=identity)
            self._inputs.append(inp)
            if cfg.until_client_leaves and n == 0:
                self._input_monitor = inp.monitor(_CLIENT_EVENTS)
            inp.connect(address)
            await inp.send([ready_payload(cfg)])
        for address in output_addresses:
            out = ZmqSocket(ctx, zmq.PUSH)
            self._writer.add_output(out)
            out.connect(address)
        if self._handshake is not None:
            await self._handshake.send([encode_status(
                StatusMessage(EngineStatus.READY, local=False, headless=True))])
            if cfg.until_client_leaves:
                # Done with, as a real engine is after READY. Left open, the socket would
                # reconnect to the next front end that binds the address while this one is
                # served: when this engine closes and the next one dials in with the same
                # identity, that front end's ROUTER can take the next HELLO for the routing
                # id of the clash and never see it.
                self._handshake.close(linger=_READY_LINGER)

    # ------------------------------------------------------------------ main loop

    async def _loop(self) -> None:
        sched = self._scheduler
        writer = self._writer
        step = self._stepper.step
        resolve_pauses = self._utility.resolve_pauses
        step_time = self.config.step_time
        steps_per_checkpoint = self.config.steps_per_checkpoint
        next_step = anyio.current_time()
        # With no step time the engine steps back to back, yielding to the event loop and
        # reading input every steps_per_checkpoint steps (checking for input costs a poll
        # system call, as much as a third of a step).
        unpaced_steps = 0
        while True:
            if not self.deaf and unpaced_steps == 0:
                self._drain_input()
            if sched.dirty:
                sched.purge()
            if self._check_faults():
                return
            if self.silent:
                await anyio.sleep_forever()
            work = sched.has_step_work()
            wave = self.wave
            if wave is not None and wave.wants_step(work):
                if not wave.may_step():  # waiting in the collective for the group to run
                    unpaced_steps = 0
                    await self._wait_input(_COLLECTIVE_POLL)
                    continue
                work = True
            if work:
                paced = step_time > 0
                now = anyio.current_time() if paced else 0.0
                if not paced or now >= next_step:
                    if wave is not None and not sched.has_step_work():
                        wave.dummy_step()
                    else:
                        step()
                    if writer.blocked:
                        await writer.send_blocked()
                    if self._check_faults():
                        return
                    resolve_pauses()
                    next_step = now + step_time + sched.take_prefill_time()
                    if wave is not None:
                        if sched.dirty:
                            sched.purge()
                        wave.after_step()
                if not paced:
                    unpaced_steps += 1
                    if unpaced_steps >= steps_per_checkpoint:
                        unpaced_steps = 0
                        await anyio.lowlevel.checkpoint()
                    continue
                timeout = next_step - anyio.current_time()
            else:
                self._idle_duties()
                if writer.blocked:
                    await writer.send_blocked()
                timeout = math.inf
            unpaced_steps = 0
            await self._wait_input(timeout)

    async def _wait_input(self, seconds: float) -> None:
        """Wait until input may be queued, for at most ``seconds``."""
        if seconds <= 0:
            await anyio.lowlevel.checkpoint()
        elif self.deaf:
            await anyio.sleep(seconds)
        else:
            with anyio.move_on_after(seconds):
                await wait_any_readable(self._inputs)

    def _check_faults(self) -> bool:
        """Apply the step-count faults; True when the engine is dead and must stop."""
        faults = self.config.faults
        steps = self._stepper.steps
        writer = self._writer
        if faults.dead_after_steps is not None and steps >= faults.dead_after_steps:
            writer.die(f"fault injection: dead after {faults.dead_after_steps} steps")
        if writer.dead:
            return True
        if (faults.garbage_after_steps is not None and not self._garbage_sent
                and steps >= faults.garbage_after_steps):
            self._garbage_sent = True
            writer.send_to_all([_GARBAGE])
        if faults.silent_after_steps is not None and steps >= faults.silent_after_steps:
            self.silent = True  # the loop stops reading input and stepping
        return False

    def _idle_duties(self) -> None:
        self._utility.resolve_pauses()
        sched = self._scheduler
        if sched.owes_stats:
            # After a finish (or an abort) a real engine steps once more with nothing
            # scheduled, sending scheduler stats alone.
            sched.owes_stats = False
            writer = self._writer
            if self.config.log_stats and writer.num_clients:
                writer.send_message(0, [], self._stepper.stats_bytes(), weight_version=True)

    # ------------------------------------------------------------------ input

    def _drain_input(self) -> None:
        writer = self._writer
        for inp in self._inputs:
            while not self.deaf and not writer.dead and inp.readable():
                frames = inp.receive_nowait()
                if frames is not None:
                    self._handle([f.bytes for f in frames])

    def _handle(self, frames: list[bytes]) -> None:
        kind = bytes(frames[0]) if frames else b""
        if kind == b"\x05":  # WAKEUP: internal, ignored
            return
        if kind == b"\x04":  # EXECUTOR_FAILED: the busy loop raises
            self._writer.die("EXECUTOR_FAILED request received: Executor failed.")
            return
        if kind == b"\x02":
            if self.wave is None:
                self.errors.append("Unrecognized input request type encountered: "
                                   "START_DP_WAVE")
            elif (error := self.wave.start_dp_wave(frames[1] if len(frames) > 1 else b"")):
                self.errors.append(error)
            return
        try:
            request = decode_request(frames)  # as strict as vLLM's msgspec decoder
        except ProtocolError as exc:
            # vLLM decodes in its input thread outside any try: the thread dies and the
            # engine never reads input again, without telling anyone.
            self.errors.append(f"input thread died: {exc}")
            self.deaf = True
            return
        if self.config.keep_history:
            self.received.append(request)
        if isinstance(request, AddRequest):
            if self.wave is not None:
                self.wave.add(request.request.current_wave)
            self._scheduler.add(request)
        elif isinstance(request, AbortRequest):
            self._scheduler.abort(request.request_ids)
        else:
            self._utility.call(request)


def _alive(requests: Iterable[Request]) -> list[str]:
    return [r.rid for r in requests if r.alive]
