"""A raw ZeroMQ front end for driving the mock engine in tests.

It binds what vLLM's front end binds (handshake ROUTER, input ROUTER, output PULLs) on
127.0.0.1 with ephemeral ports, performs the handshake by hand and sends hand-built msgpack
requests, so the tests check the mock against the wire protocol, not against our client.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import attrs
import msgpack
import zmq

from anyio_genout.mock import MockEngine, MockEngineConfig
from anyio_genout.mock.waves import WaveGroup
from anyio_genout.protocol import (
    Classified,
    EngineCoreOutput,
    EngineDead,
    HandshakeAddresses,
    RequestBatch,
    UtilityReply,
    decode_outputs,
    encode_init,
)
from anyio_genout.transport import ZmqSocket, new_context

ADD, ABORT, UTILITY = b"\x00", b"\x01", b"\x03"
LOCAL = "tcp://127.0.0.1:*"


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def add_payload(request_id: str, prompt: Sequence[Any], sampling: dict[str, Any] | None = None,
                *, client_index: int = 0, trace_headers: dict[str, str] | None = None,
                cache_salt: str | None = None, fields: int = 22) -> bytes:
    """An EngineCoreRequest array as vLLM's front end writes it (22 fields)."""
    sampling = {"temperature": 0.0, "max_tokens": 8} if sampling is None else sampling
    array = [request_id, list(prompt), None, sampling, None, time.time(), None, cache_salt,
             None, None, None, client_index, 0, 0, trace_headers, False, None, None, None,
             False, None, None]
    return pack(array[:fields])


class FrontEnd:
    """Handshake ROUTER, input ROUTER and ``n_outputs`` output PULL sockets."""

    def __init__(self, context: zmq.Context[Any], n_outputs: int = 1) -> None:
        self.handshake_socket = ZmqSocket(context, zmq.ROUTER)
        self.input = ZmqSocket(context, zmq.ROUTER)
        self.outputs = [ZmqSocket(context, zmq.PULL) for _ in range(n_outputs)]
        self.handshake_address = self.handshake_socket.bind(LOCAL)
        self.input_address = self.input.bind(LOCAL)
        self.output_addresses = [out.bind(LOCAL) for out in self.outputs]
        self.identity = b"\x00\x00"
        self.hello: list[bytes] = []
        self.ready: list[bytes] = []
        self.registration: list[bytes] = []
        self.registered = anyio.Event()
        self._call_ids = itertools.count(0xD641856EC0E11F1)
        self.stop_engine: Callable[[], None] = lambda: None

    def close(self) -> None:
        for sock in (self.handshake_socket, self.input, *self.outputs):
            sock.close()

    async def handshake(self) -> None:
        """HELLO -> INIT -> READY, plus the registration on the input socket."""
        self.hello = [f.bytes for f in await self.handshake_socket.receive()]
        self.identity = self.hello[0]
        init = encode_init(HandshakeAddresses(inputs=[self.input_address],
                                              outputs=self.output_addresses))
        await self.handshake_socket.send([self.identity, init])
        self.ready = [f.bytes for f in await self.handshake_socket.receive()]
        await self.register()

    async def register(self) -> None:
        self.registration = [f.bytes for f in await self.input.receive()]
        self.identity = self.registration[0]
        self.registered.set()

    # ------------------------------------------------------------------ requests

    async def send(self, kind: bytes, payload: bytes) -> None:
        await self.input.send([self.identity, kind, payload])

    async def add(self, request_id: str, prompt: Sequence[Any],
                  sampling: dict[str, Any] | None = None, **kwargs: Any) -> None:
        await self.send(ADD, add_payload(request_id, prompt, sampling, **kwargs))

    async def abort(self, *request_ids: str) -> None:
        await self.send(ABORT, pack(list(request_ids)))

    async def call(self, method: str, *args: Any, client_index: int = 0) -> int:
        call_id = next(self._call_ids)
        await self.send(UTILITY, pack([client_index, call_id, method, list(args)]))
        return call_id

    # ------------------------------------------------------------------ outputs

    async def receive_raw(self, client: int = 0, seconds: float = 5.0) -> list[bytes]:
        with anyio.fail_after(seconds):
            return [f.bytes for f in await self.outputs[client].receive()]

    async def receive_rows_raw(self, client: int = 0, seconds: float = 5.0) -> list[bytes]:
        """The next message that carries outputs (skipping stats-only ones)."""
        with anyio.fail_after(seconds):
            while True:
                frames = await self.receive_raw(client, seconds)
                if len(frames) > 1 or len(frames[0]) < 2 or frames[0][2] != 0x90:
                    return frames

    async def receive(self, client: int = 0, seconds: float = 5.0) -> Classified:
        return decode_outputs(await self.receive_raw(client, seconds))

    async def utility(self, method: str, *args: Any, client_index: int = 0,
                      seconds: float = 5.0) -> Any:
        """Call ``method`` and return the decoded UtilityOutput (skipping other messages)."""
        call_id = await self.call(method, *args, client_index=client_index)
        with anyio.fail_after(seconds):
            while True:
                message = await self.receive(client_index)
                if isinstance(message, UtilityReply) and message.reply.call_id == call_id:
                    return message.reply

    async def collect(self, *request_ids: str, client: int = 0, seconds: float = 5.0,
                      ) -> dict[str, list[EngineCoreOutput]]:
        """Outputs per request until every one of ``request_ids`` finished."""
        results: dict[str, list[EngineCoreOutput]] = {rid: [] for rid in request_ids}
        pending = set(request_ids)
        with anyio.fail_after(seconds):
            while pending:
                message = await self.receive(client)
                assert not isinstance(message, EngineDead), "engine died"
                if not isinstance(message, RequestBatch):
                    continue
                for out in message.message.outputs:
                    if out.request_id in results:
                        results[out.request_id].append(out)
                        if out.finished:
                            pending.discard(out.request_id)
        return results

    async def tokens(self, request_id: str, client: int = 0) -> tuple[list[int], EngineCoreOutput]:
        """All tokens of one request and its final output."""
        outs = (await self.collect(request_id, client=client))[request_id]
        return [t for o in outs for t in o.new_token_ids], outs[-1]

    async def quiet(self, client: int = 0, seconds: float = 0.2) -> list[list[bytes]]:
        """Every message that arrives within ``seconds``."""
        messages = []
        with anyio.move_on_after(seconds):
            while True:
                messages.append(await self.receive_raw(client, seconds + 1))
        return messages


@asynccontextmanager
async def running_engine(config: MockEngineConfig | None = None, *, n_outputs: int = 1,
                         bootstrapped: bool = False, waves: WaveGroup | None = None,
                         **overrides: Any) -> AsyncIterator[tuple[MockEngine, FrontEnd]]:
    """Bind a front end, start a mock engine against it and complete the handshake
    (``waves``: the engine joins that data-parallel wave group)."""
    context = new_context()
    front = FrontEnd(context, n_outputs)
    try:
        base = config or MockEngineConfig(handshake_address="tcp://127.0.0.1:1")
        if bootstrapped:
            cfg = attrs.evolve(base, handshake_address=None, input_address=front.input_address,
                               output_addresses=tuple(front.output_addresses), **overrides)
        else:
            cfg = attrs.evolve(base, handshake_address=front.handshake_address, **overrides)
        engine = MockEngine(cfg, waves=waves)
        engine_scope = anyio.CancelScope()
        front.stop_engine = engine_scope.cancel

        async def serve(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            with engine_scope:
                await engine.serve(task_status=task_status)

        async with anyio.create_task_group() as tg:
            tg.start_soon(front.register if bootstrapped else front.handshake)
            await tg.start(serve)
            with anyio.fail_after(5):
                await front.registered.wait()
            yield engine, front
            tg.cancel_scope.cancel()
    finally:
        front.close()
        context.term()
