"""A scripted fake engine made of raw ZeroMQ sockets, for driving the client step by step.

Unlike the mock engine (which runs a scheduler), this one does exactly what a test tells it:
handshake stages, which frames to push, and it records every request frame it receives.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import zmq

from anyio_genout import (
    EngineCoreClient,
    EngineCoreClientConfig,
    HandshakeTransport,
    HealthConfig,
)
from anyio_genout.protocol import (
    AbortRequest,
    AddRequest,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreReadyResponse,
    EngineStatus,
    StatusMessage,
    UtilityOutput,
    UtilityRequest,
    decode_init,
    decode_request,
    encode_outputs,
    encode_ready_response,
    encode_status,
    engine_identity,
)
from anyio_genout.transport import ZmqSocket, free_tcp_port, new_context

free_port = free_tcp_port

Request = AddRequest | AbortRequest | UtilityRequest




def ready_response(rank: int, *, version: str = "0.32.0",
                   max_model_len: int = 4096) -> EngineCoreReadyResponse:
    return EngineCoreReadyResponse(
        max_model_len=max_model_len, num_gpu_blocks=1024, block_size=16, dtype="float32",
        vllm_version=version, data_parallel_rank=rank, max_num_seqs=256,
        max_num_batched_tokens=2048, instance_id=f"fake-{rank}",
    )


class FakeEngine:
    """One engine: DEALER on the handshake socket, DEALER on input, PUSH on output."""

    def __init__(self, rank: int = 0, *, version: str = "0.32.0") -> None:
        self.rank = rank
        self.version = version
        self.identity = engine_identity(rank)
        self._ctx = new_context()
        self._sockets: list[ZmqSocket] = []
        self.input: ZmqSocket | None = None
        self.output: ZmqSocket | None = None

    def _socket(self, kind: int) -> ZmqSocket:
        sock = ZmqSocket(self._ctx, kind, identity=self.identity if kind == zmq.DEALER else None)
        self._sockets.append(sock)
        return sock

    async def handshake(self, address: str, *, send_ready: bool = True,
                        register: bool = True) -> None:
        """Dial the client's handshake socket like ``vllm serve --headless`` does."""
        hs = self._socket(zmq.DEALER)
        hs.connect(address)
        await hs.send([encode_status(StatusMessage(EngineStatus.HELLO))])
        frames = await hs.receive()
        init = decode_init(bytes(frames[0].buffer))
        if register:
            await self.register(init.inputs[0], init.outputs[0])
        if send_ready:
            await hs.send([encode_status(StatusMessage(EngineStatus.READY))])

    async def register(self, input_address: str, output_address: str) -> None:
        """Connect input/output and send the ready response (bootstrapped mode uses this alone)."""
        self.input = self._socket(zmq.DEALER)
        self.input.connect(input_address)
        await self.input.send([encode_ready_response(ready_response(self.rank,
                                                                    version=self.version))])
        self.output = self._socket(zmq.PUSH)
        self.output.connect(output_address)

    async def receive(self) -> Request:
        assert self.input is not None
        frames = await self.input.receive()
        return decode_request([bytes(f.buffer) for f in frames])

    async def receive_add(self) -> AddRequest:
        request = await self.receive()
        assert isinstance(request, AddRequest), request
        return request

    async def receive_abort(self) -> AbortRequest:
        request = await self.receive()
        assert isinstance(request, AbortRequest), request
        return request

    async def receive_utility(self) -> UtilityRequest:
        request = await self.receive()
        assert isinstance(request, UtilityRequest), request
        return request

    async def expect_nothing(self, seconds: float) -> None:
        with anyio.move_on_after(seconds):
            request = await self.receive()
            raise AssertionError(f"unexpected request {request!r}")

    async def send_raw(self, frames: Sequence[bytes | memoryview]) -> None:
        assert self.output is not None
        await self.output.send(frames)

    async def send(self, outputs: Sequence[EngineCoreOutput] = (), **fields: Any) -> None:
        message = EngineCoreOutputs(engine_index=self.rank, outputs=list(outputs), **fields)
        await self.send_raw(encode_outputs(message))

    async def reply(self, call: UtilityRequest, result: Any = None,
                    failure: str | None = None) -> None:
        util = UtilityOutput(call.call_id, failure, result, failure is None)
        await self.send(utility_output=util)

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()
        self._ctx.term()


class Cluster:
    """Fake engines plus a connected client: ``async with Cluster(2) as (client, engines)``."""

    def __init__(self, engines: int = 1, **config: Any) -> None:
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.engines = [FakeEngine(rank) for rank in range(engines)]
        # Scripted fakes answer nothing unasked: no liveness check, unless a test asks for one
        # (a slow machine once put its is_sleeping where a test read the next ABORT).
        config.setdefault("health", HealthConfig(liveness_interval=None))
        self.config = EngineCoreClientConfig(transport=HandshakeTransport(self.address),
                                             engine_count=engines, ready_timeout=10, **config)
        self._tg: anyio.abc.TaskGroup | None = None
        self._connection: Any = None

    async def __aenter__(self) -> tuple[EngineCoreClient, list[FakeEngine]]:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        for engine in self.engines:
            self._tg.start_soon(engine.handshake, self.address)
        self._connection = EngineCoreClient.connect(self.config)
        client = await self._connection.__aenter__()
        return client, self.engines

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        assert self._tg is not None
        try:
            await self._connection.__aexit__(exc_type, exc, tb)
        finally:
            self._tg.cancel_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            for engine in self.engines:
                engine.close()
