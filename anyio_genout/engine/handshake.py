"""Start-up: bind the sockets and wait until every engine is ready (the I/O half).

The message formats are in :mod:`anyio_genout.protocol.handshake`; this module runs the
exchange over ZeroMQ and enforces the timeout and the stages:
HELLO -> INIT -> (registration on the input socket, READY on the handshake socket).
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import attrs
import zmq

from ..errors import GenoutError, HandshakeError, HandshakeTimeoutError, ProtocolError
from ..protocol import (
    EngineCoreReadyResponse,
    EngineStatus,
    HandshakeAddresses,
    check_version,
    decode_ready_response,
    decode_status,
    encode_init,
    engine_identity,
)
from ..transport import ZmqSocket, bind_address
from .config import EngineCoreClientConfig

__all__ = ["BoundSockets", "bind_sockets", "run_handshake"]

logger = logging.getLogger("anyio_genout.engine")


@attrs.define
class BoundSockets:
    input: ZmqSocket
    output: ZmqSocket
    handshake: ZmqSocket | None
    input_address: str
    output_address: str

    def close(self) -> None:
        for sock in (self.handshake, self.input, self.output):
            if sock is not None:
                sock.close()


def bind_sockets(context: zmq.Context[Any], config: EngineCoreClientConfig) -> BoundSockets:
    """Bind the input ROUTER, the output PULL and (unless bootstrapped) the handshake ROUTER."""
    sockets: list[ZmqSocket] = []
    try:
        inp = ZmqSocket(context, zmq.ROUTER, max_message_size=config.max_message_size)
        sockets.append(inp)
        out = ZmqSocket(context, zmq.PULL, max_message_size=config.max_message_size)
        sockets.append(out)
        input_address = inp.bind(config.input_address or bind_address(config.advertised_host))
        output_address = out.bind(config.output_address or bind_address(config.advertised_host))
        handshake = None
        if not config.bootstrapped:
            handshake = ZmqSocket(context, zmq.ROUTER, max_message_size=1 << 20)
            sockets.append(handshake)
            handshake.bind(config.handshake_address)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return BoundSockets(inp, out, handshake, input_address, output_address)


async def run_handshake(sockets: BoundSockets, config: EngineCoreClientConfig
                        ) -> dict[int, EngineCoreReadyResponse]:
    """Complete the handshake with every engine; returns their ready responses by rank.

    Raises :class:`HandshakeTimeoutError` naming the stage and the engines still missing
    after ``config.ready_timeout`` seconds, or :class:`HandshakeError` on a bad message.
    """
    expected = {engine_identity(rank): rank for rank in config.engine_ranks}
    hello: set[int] = set()
    ready: set[int] = set()
    registered: dict[int, EngineCoreReadyResponse] = {}
    init = encode_init(HandshakeAddresses([sockets.input_address], [sockets.output_address]))

    def rank_of(identity: bytes, what: str) -> int:
        rank = expected.get(identity)
        if rank is None:
            raise HandshakeError(
                f"received {what} for unexpected engine id {identity!r} (expected ranks "
                f"{list(config.engine_ranks)})"
            )
        return rank

    async def handshake_loop(sock: ZmqSocket) -> None:
        while len(ready) < len(expected):
            frames = await sock.receive()
            if len(frames) != 2:
                raise HandshakeError(f"handshake: expected [identity, message], got "
                                     f"{len(frames)} frames")
            identity = bytes(frames[0].buffer)
            message = decode_status(bytes(frames[1].buffer))
            rank = rank_of(identity, message.status.value)
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

    async def registration_loop(sock: ZmqSocket) -> None:
        while len(registered) < len(expected):
            frames = await sock.receive()
            if len(frames) != 2:
                raise HandshakeError(f"input registration: expected [identity, message], got "
                                     f"{len(frames)} frames")
            identity = bytes(frames[0].buffer)
            rank = rank_of(identity, "input registration")
            if rank in registered:
                raise HandshakeError(f"duplicate input registration from engine {rank}")
            try:
                response = decode_ready_response(bytes(frames[1].buffer))
            except ProtocolError as exc:
                raise HandshakeError(f"engine {rank}: {exc}") from None
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

    failure: list[GenoutError] = []

    async def guarded(fn: Any, sock: ZmqSocket, scope: anyio.CancelScope) -> None:
        try:
            await fn(sock)
        except GenoutError as exc:
            failure.append(exc)
            scope.cancel()

    with anyio.move_on_after(config.ready_timeout) as timeout_scope:
        async with anyio.create_task_group() as tg:
            if sockets.handshake is not None:
                tg.start_soon(guarded, handshake_loop, sockets.handshake, tg.cancel_scope)
            tg.start_soon(guarded, registration_loop, sockets.input, tg.cancel_scope)
    if failure:
        raise failure[0]
    if timeout_scope.cancelled_caught:
        stage, absent = missing()
        raise HandshakeTimeoutError(stage, absent, config.ready_timeout)
    return registered
