"""Start-up: bind the sockets and wait until every engine is ready (the I/O half).

The message formats are in :mod:`anyio_genout.protocol.handshake`; this module runs the
exchange over ZeroMQ and enforces the timeout and the stages:
HELLO -> INIT -> (registration on the input socket, READY on the handshake socket).

While it waits, the output socket is watched too: an engine that dies after connecting it
(``ENGINE_CORE_DEAD``) fails the start-up at once instead of after ``ready_timeout``. Junk
from a peer that is not one of the expected engines (a port scanner, a stray tool) is
logged and ignored, so it cannot break the start-up; a malformed message from an expected
engine identity, or a well-formed one from an unexpected engine, is a :class:`HandshakeError`.

The wait is logged on the ``anyio_genout.engine`` logger: what it waits for and where, at
INFO when it starts; then, while it lasts, a reminder after ``WAITING_NOTICE_AFTER`` seconds
and every ``WAITING_LOG_INTERVAL`` seconds after that, at WARNING while an engine has not
been heard from at all (so a plain script, whose logging shows warnings, tells its user what
it waits for), at INFO once every missing engine has dialled in and is loading its model.

A Ctrl-C during the wait comes out as a plain :class:`KeyboardInterrupt`: the waiting task
waits in the body of its task group, never in the group's exit (where trio would wrap it in
an exception group), and one that hits a background task is unwrapped.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, TypeVar

import anyio
import anyio.abc
import attrs
import zmq

from ..errors import (
    EngineDeadError,
    GenoutError,
    HandshakeError,
    HandshakeTimeoutError,
    ProtocolError,
    keyboard_interrupt_in,
)
from ..protocol import (
    ENGINE_CORE_DEAD,
    EngineCoreReadyResponse,
    EngineStatus,
    HandshakeAddresses,
    check_version,
    decode_ready_response,
    decode_status,
    encode_init,
    engine_identity,
)
from ..transport import ZmqSocket, bind_address, new_context
from .config import BootstrappedTransport, EngineCoreClientConfig, HandshakeTransport

__all__ = ["BoundSockets", "JunkLog", "bind_sockets", "run_handshake", "serve_handshake"]

logger = logging.getLogger("anyio_genout.engine")
T = TypeVar("T")

#: Output messages kept from before every engine was READY (an engine sends none then).
MAX_EARLY_OUTPUTS: Final = 1024
#: Seconds of waiting for engines after which the start-up says what it waits for, at
#: WARNING if an engine was not heard from (engines already running answer well within it).
WAITING_NOTICE_AFTER: Final = 1.0
#: Seconds between the later reminders.
WAITING_LOG_INTERVAL: Final = 15.0
#: Ignored junk messages logged one by one; later ones are only counted.
MAX_JUNK_LOGGED: Final = 10
#: Receive high-water mark of the output socket, in messages per connected peer: a peer
#: that sends faster than the reader decodes is held back (its sends block or queue on its
#: side) instead of growing this process's memory without bound.
OUTPUT_RCVHWM: Final = 10_000
#: What the client watches on the output socket: which peers connect, finish the ZeroMQ
#: handshake, and disconnect (ZeroMQ reports nothing else about a dropped message).
OUTPUT_MONITOR_EVENTS: Final = (zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_DISCONNECTED)


@attrs.define
class BoundSockets:
    input: ZmqSocket
    output: ZmqSocket
    handshake: ZmqSocket | None
    input_address: str
    output_address: str
    #: Connection events of the output socket (peers connecting and disconnecting).
    output_monitor: ZmqSocket | None = None
    #: The same for the input socket.
    input_monitor: ZmqSocket | None = None
    #: Output messages that arrived during the handshake, for the reader to dispatch first.
    early_outputs: list[list[zmq.Frame]] = attrs.field(factory=list)

    def close(self, input_linger: float = 0.0) -> None:
        """Close every socket; ``input_linger`` lets queued requests (final ABORTs) leave."""
        # The monitor first: it must not outlive the socket it watches.
        for sock in (self.output_monitor, self.input_monitor, self.handshake, self.output):
            if sock is not None:
                sock.close()
        self.input.close(input_linger)


def bind_sockets(context: zmq.Context[Any], config: EngineCoreClientConfig) -> BoundSockets:
    """Bind the input ROUTER, the output PULL and (handshake owner) the handshake ROUTER."""
    transport, health = config.transport, config.health
    sockets: list[ZmqSocket] = []
    try:
        inp = ZmqSocket(context, zmq.ROUTER, max_message_size=config.max_message_size)
        sockets.append(inp)
        out = ZmqSocket(context, zmq.PULL, max_message_size=config.max_message_size)
        sockets.append(out)
        out.raw.setsockopt(zmq.RCVHWM, OUTPUT_RCVHWM)
        if health.heartbeat_interval is not None:  # before binding: engines connect next
            # Not on the output socket: a connection whose receive queue is full (the reader
            # behind by OUTPUT_RCVHWM messages) is not read, so its heartbeats would time out.
            inp.set_heartbeat(health.heartbeat_interval, health.heartbeat_timeout)
        monitor = out.monitor(OUTPUT_MONITOR_EVENTS)
        sockets.insert(0, monitor)
        input_monitor = inp.monitor(OUTPUT_MONITOR_EVENTS)
        sockets.insert(0, input_monitor)
        # No handover during start-up: no peer may take an engine's identity (after it,
        # .rejoin.Rejoins.engines_down says when a new connection may).
        inp.raw.setsockopt(zmq.ROUTER_HANDOVER, 0)
        handshake = None
        if isinstance(transport, BootstrappedTransport):
            input_address = inp.bind(transport.input_address,
                                     listener_fd=transport.input_listener_fd)
            output_address = out.bind(transport.output_address,
                                      listener_fd=transport.output_listener_fd)
        else:
            host = transport.advertised_host
            input_address = inp.bind(transport.input_address or bind_address(host))
            output_address = out.bind(transport.output_address or bind_address(host))
            handshake = ZmqSocket(context, zmq.ROUTER, max_message_size=1 << 20)
            sockets.append(handshake)
            # A restarted engine dials in under its predecessor's identity, whose connection
            # may still be open (a hung engine's): the new peer takes the identity over.
            handshake.raw.setsockopt(zmq.ROUTER_HANDOVER, 1)
            handshake.bind(transport.address)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return BoundSockets(inp, out, handshake, input_address, output_address, monitor,
                        input_monitor)


@attrs.define
class JunkLog:
    """Junk ignored on the handshake sockets, logged boundedly: the first
    :data:`MAX_JUNK_LOGGED` messages one by one (``from <identity><whose>: <why>``), then
    one line saying that more is not logged (``on the <sockets>``), then only counted."""

    whose: str
    sockets: str
    count: int = 0

    def ignore(self, identity: bytes, where: str, why: str) -> None:
        self.count += 1
        if self.count <= MAX_JUNK_LOGGED:
            logger.warning("ignoring a message on the %s socket from %r%s: %s", where,
                           identity[:16], self.whose, why)
        elif self.count == MAX_JUNK_LOGGED + 1:
            logger.warning("ignoring more junk on the %s without logging it", self.sockets)


class _Engines:
    """The engines a start-up expects (by ZeroMQ identity) and how far each has got; reads
    the handshake stages from them, skipping (and logging) junk from strangers."""

    def __init__(self, config: EngineCoreClientConfig) -> None:
        self.config = config
        self.expected = {engine_identity(rank): rank for rank in config.engine_ranks}
        self.hello: set[int] = set()
        self.ready: set[int] = set()
        self.ignore = JunkLog(", which is not an expected engine", "handshake sockets").ignore

    def rank_of(self, identity: bytes, what: str) -> int:
        rank = self.expected.get(identity)
        if rank is None:
            raise HandshakeError(
                f"received {what} for unexpected engine id {identity!r} (expected ranks "
                f"{list(self.config.engine_ranks)})"
            )
        return rank

    async def receive_decoded(self, sock: ZmqSocket, where: str, what: str,
                              decode: Callable[[bytes], T]) -> tuple[bytes, T]:
        """The next ``[identity, message]`` that decodes; junk from strangers is skipped."""
        expected = self.expected
        while True:
            frames = await sock.receive()
            identity = bytes(frames[0].buffer)
            if len(frames) != 2:
                if identity not in expected:
                    self.ignore(identity, where, f"{len(frames)} frames")
                    continue
                raise HandshakeError(f"{what}: expected [identity, message] from engine "
                                     f"{expected[identity]}, got {len(frames)} frames")
            try:
                return identity, decode(bytes(frames[1].buffer))
            except GenoutError as exc:
                if identity not in expected:
                    self.ignore(identity, where, str(exc))
                    continue
                raise HandshakeError(f"engine {expected[identity]}: {exc}") from None

    async def handshake_loop(self, sock: ZmqSocket, init: bytes) -> None:
        """Answer each engine's HELLO with ``init``; return once every one said READY."""
        hello, ready = self.hello, self.ready
        while len(ready) < len(self.expected):
            identity, message = await self.receive_decoded(sock, "handshake", "handshake",
                                                           decode_status)
            rank = self.rank_of(identity, message.status.value)
            if message.status is EngineStatus.HELLO:
                if rank in hello:
                    raise HandshakeError(f"duplicate HELLO from engine {rank}")
                hello.add(rank)
                logger.info("engine %d said HELLO (local=%s, headless=%s)", rank,
                            message.local, message.headless)
                sock.send_nowait([identity, init])
            else:
                if rank not in hello:
                    raise HandshakeError(f"engine {rank} sent READY before HELLO")
                if rank in ready:
                    raise HandshakeError(f"duplicate READY from engine {rank}")
                ready.add(rank)
                logger.info("engine %d is READY", rank)


async def run_handshake(sockets: BoundSockets, config: EngineCoreClientConfig
                        ) -> dict[int, EngineCoreReadyResponse]:
    """Complete the handshake with every engine; returns their ready responses by rank.

    Raises :class:`HandshakeTimeoutError` naming the stage and the engines still missing
    after ``config.ready_timeout`` seconds, :class:`HandshakeError` on a bad message from an
    engine, or :class:`EngineDeadError` if an engine sends ``ENGINE_CORE_DEAD`` first.
    """
    peers = _Engines(config)
    expected, hello, ready = peers.expected, peers.hello, peers.ready
    registered: dict[int, EngineCoreReadyResponse] = {}
    init = encode_init(HandshakeAddresses([sockets.input_address], [sockets.output_address]))
    rank_of, receive_decoded = peers.rank_of, peers.receive_decoded

    async def handshake_loop(sock: ZmqSocket) -> None:
        await peers.handshake_loop(sock, init)

    async def registration_loop(sock: ZmqSocket) -> None:
        while len(registered) < len(expected):
            identity, response = await receive_decoded(sock, "input", "input registration",
                                                       decode_ready_response)
            rank = rank_of(identity, "input registration")
            if rank in registered:
                raise HandshakeError(f"duplicate input registration from engine {rank}")
            if config.check_version:
                check_version(response.vllm_version)
            registered[rank] = response
            logger.info("engine %d registered: vLLM %s, max_model_len %d", rank,
                        response.vllm_version, response.max_model_len)

    def missing() -> tuple[str, list[int]]:
        ranks = list(config.engine_ranks)
        if sockets.handshake is not None and len(hello) < len(ranks):
            return "HELLO", [r for r in ranks if r not in hello]
        if len(registered) < len(ranks):
            return "input registration", [r for r in ranks if r not in registered]
        return "READY", [r for r in ranks if r not in ready]

    async def watch_outputs(sock: ZmqSocket) -> None:
        """Fail at once on ENGINE_CORE_DEAD; keep anything else for the reader."""
        while True:
            frames = sock.receive_nowait()
            if frames is None:
                await sock.wait_readable()
                continue
            if len(frames) == 1 and bytes(frames[0].buffer) == ENGINE_CORE_DEAD:
                stage, absent = missing()
                raise EngineDeadError(
                    f"an engine core sent ENGINE_CORE_DEAD during start-up, before READY "
                    f"(waiting for {stage} from engine(s) "
                    f"{', '.join(map(str, absent)) or 'none'})")
            if len(sockets.early_outputs) >= MAX_EARLY_OUTPUTS:
                raise ProtocolError(f"more than {MAX_EARLY_OUTPUTS} output messages arrived "
                                    f"before every engine was READY")
            sockets.early_outputs.append(frames)

    def waiting_for() -> tuple[int, str, str]:
        """A reminder's log level, what is awaited from whom and where, and a hint."""
        stage, absent = missing()
        who = _engines(absent)
        unheard = any(rank not in hello and rank not in registered for rank in absent)
        transport = config.transport
        if stage == "HELLO" and isinstance(transport, HandshakeTransport):
            return (logging.WARNING,
                    f"{who} to say HELLO on the handshake socket {transport.address}",
                    _vllm_hint(transport.address, config))
        if stage == "input registration" and sockets.handshake is None:
            return (logging.WARNING if unheard else logging.INFO,
                    f"{who} to register on the input socket {sockets.input_address}",
                    "; in bootstrapped mode engines connect there directly")
        return (logging.WARNING if unheard else logging.INFO,
                f"{who} to finish starting ({stage} is missing)",
                f"; after HELLO an engine loads its model, then registers on the input socket "
                f"{sockets.input_address} and says READY")

    async def report_waiting() -> None:
        """Say what the start-up waits for: at once, then every so often while it lasts."""
        _, what, hint = waiting_for()
        logger.info("connecting: waiting for %s, up to %g s (ready_timeout)%s", what,
                    config.ready_timeout, hint)
        started = anyio.current_time()
        await anyio.sleep(WAITING_NOTICE_AFTER)
        while True:
            level, what, hint = waiting_for()
            logger.log(level, "still waiting after %.0f s for %s, up to %g s (ready_timeout)%s",
                       anyio.current_time() - started, what, config.ready_timeout, hint)
            await anyio.sleep(WAITING_LOG_INTERVAL)

    failure: list[GenoutError] = []
    done = anyio.Event()
    stages_left = 1 if sockets.handshake is None else 2

    async def guarded(fn: Any, sock: ZmqSocket, stage: bool) -> None:
        nonlocal stages_left
        try:
            await fn(sock)
        except GenoutError as exc:
            failure.append(exc)
            done.set()
            return
        if stage:
            stages_left -= 1
            if not stages_left:
                done.set()

    # This task waits in the task group's body, not in its exit: on trio, an exception
    # raised in a task group's exit (a Ctrl-C delivered while it waits for its tasks) comes
    # out wrapped in an exception group, and the user would see that instead of a plain
    # KeyboardInterrupt.
    tg = anyio.create_task_group()
    await tg.__aenter__()
    try:
        tg.start_soon(guarded, watch_outputs, sockets.output, False)
        if sockets.handshake is not None:
            tg.start_soon(guarded, handshake_loop, sockets.handshake, True)
        tg.start_soon(guarded, registration_loop, sockets.input, True)
        tg.start_soon(report_waiting)
        with anyio.move_on_after(config.ready_timeout) as timeout_scope:
            await done.wait()
    except BaseException:
        await _leave(tg)
        raise
    await _leave(tg)  # every engine is ready (or one failed): stop the other tasks
    if failure:
        raise failure[0]
    if timeout_scope.cancelled_caught:
        stage, absent = missing()
        raise HandshakeTimeoutError(stage, absent, config.ready_timeout)
    return registered


async def serve_handshake(config: EngineCoreClientConfig, inputs: Sequence[str],
                          outputs: Sequence[str], *,
                          after_start: Callable[[ZmqSocket, bytes], Awaitable[None]] | None
                          = None,
                          task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                          ) -> None:
    """Be the handshake owner for front ends that run in other processes.

    Binds the handshake address of ``config`` (whose transport is a
    :class:`.config.HandshakeTransport`), answers every engine's HELLO with an INIT naming
    all of ``inputs`` and ``outputs`` (one pair per front-end process; the position is that
    process's ``client_index``), and returns once every engine of ``config.engine_ranks``
    said READY. Each front end meanwhile waits, bootstrapped, for the engines to register
    on its own input socket. This is how vLLM's ``--api-server-count`` supervisor starts
    its API servers. With ``after_start``, it reports the start-up done through
    ``task_status`` and then awaits ``after_start(socket, init)`` with the socket still
    open (:func:`.rejoin.answer_restarted_engines` keeps answering the HELLOs of restarted
    engines with the same INIT until cancelled).

    Raises :class:`HandshakeTimeoutError` (the stage and the engines missing) after
    ``config.ready_timeout`` seconds, :class:`HandshakeError` on a bad message from an
    expected engine, and :class:`TransportError` if the address cannot be bound.
    """
    if not inputs or len(inputs) != len(outputs):
        raise ValueError(f"one input and one output address per front end, got "
                         f"{len(inputs)} and {len(outputs)}")
    transport = config.transport
    if not isinstance(transport, HandshakeTransport):
        raise ValueError(f"serving the handshake needs a HandshakeTransport, got "
                         f"{type(transport).__name__}")
    peers = _Engines(config)
    init = encode_init(HandshakeAddresses(list(inputs), list(outputs)))
    context = new_context()
    sock = ZmqSocket(context, zmq.ROUTER, max_message_size=1 << 20)
    try:
        sock.raw.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted engine, as bind_sockets
        sock.bind(transport.address)
        logger.info("waiting for %s to say HELLO on %s, up to %g s (ready_timeout)%s",
                    _engines(list(config.engine_ranks)), transport.address,
                    config.ready_timeout, _vllm_hint(transport.address, config))
        with anyio.move_on_after(config.ready_timeout) as scope:
            await peers.handshake_loop(sock, init)
        if scope.cancelled_caught:
            ranks = list(config.engine_ranks)
            if len(peers.hello) < len(ranks):
                stage, absent = "HELLO", [r for r in ranks if r not in peers.hello]
            else:
                stage, absent = "READY", [r for r in ranks if r not in peers.ready]
            raise HandshakeTimeoutError(stage, absent, config.ready_timeout)
        task_status.started()
        if after_start is not None:
            await after_start(sock, init)
    finally:
        sock.close(linger=1.0)  # the last INIT is long gone: READY came after it
        context.term()


async def _leave(tg: anyio.abc.TaskGroup) -> None:
    """Cancel ``tg``'s tasks and wait for them; a Ctrl-C that hit one of them (trio raises
    it in whichever task runs) comes out as the plain :class:`KeyboardInterrupt`."""
    tg.cancel_scope.cancel()
    try:
        await tg.__aexit__(None, None, None)
    except BaseExceptionGroup as group:
        interrupt = keyboard_interrupt_in(group)
        if interrupt is None:
            raise
        raise interrupt from None


def _engines(ranks: list[int]) -> str:
    return (f"engine {ranks[0]}" if len(ranks) == 1
            else f"engines {', '.join(map(str, ranks))}")


def _vllm_hint(address: str, config: EngineCoreClientConfig) -> str:
    """How engines are pointed at a ``tcp://`` handshake address (vLLM takes no other: its
    engines dial ``tcp://`` + ``--data-parallel-address`` + ``--data-parallel-rpc-port``)."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not port.isdigit():
        return ("; vLLM engines dial only a tcp:// handshake address (--data-parallel-address "
                "and --data-parallel-rpc-port), engines that take a ZeroMQ address (the mock "
                "engine's --handshake-address) dial this one")
    host = host.strip("[]")
    if host in ("*", "0.0.0.0", "::"):
        host = "<this host's address>"
    extra = ""
    if config.engine_start_index:
        extra = (f" --data-parallel-start-rank {config.engine_start_index}"
                 f" --data-parallel-size-local {config.engine_count} ...")
    elif config.engine_count > 1:
        extra = f" --data-parallel-size {config.engine_count}"
    return (f"; engines dial it when started with `vllm serve <model> --headless "
            f"--data-parallel-address {host} --data-parallel-rpc-port {port}{extra}`")
