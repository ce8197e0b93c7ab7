"""Start-up: the dial-mode handshake against golden vLLM 0.32 frames, and bootstrapped mode."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
import zmq

from anyio_genout import Client, ClientConfig, EngineCoreClientConfig, HandshakeTransport
from anyio_genout.errors import HandshakeTimeoutError
from anyio_genout.mock import MockEngine, MockEngineConfig, MockFaults, free_tcp_address
from anyio_genout.protocol import RequestBatch, decode_ready_response
from anyio_genout.transport import ZmqSocket, new_context

from .frontend import running_engine, unpack

pytestmark = pytest.mark.anyio

WIRE = Path(__file__).resolve().parent.parent / "data" / "vllm-wire"


def golden(name: str, frame: int = 0) -> bytes:
    return (WIRE / f"{name}.frame{frame}.bin").read_bytes()


async def test_handshake_frames_match_vllm() -> None:
    async with running_engine() as (engine, front):
        assert front.hello == [golden("h1_handshake_HELLO_engine_to_frontend", 0),
                               golden("h1_handshake_HELLO_engine_to_frontend", 1)]
        assert front.ready == [golden("h3_handshake_READY_engine_to_frontend", 0),
                               golden("h3_handshake_READY_engine_to_frontend", 1)]
        assert front.registration[0] == b"\x00\x00"
        ours = unpack(front.registration[1])
        theirs = unpack(golden("h4_input_socket_registration_EngineCoreReadyResponse", 1))
        assert list(ours) == list(theirs)  # same keys, same order
        assert front.registration[1][:3] == b"\xde\x00\x19"  # map16, 25 keys
        for key, value in theirs.items():
            if value is not None:
                assert type(ours[key]) is type(value), key
        ready = decode_ready_response(front.registration[1])
        assert ready.vllm_version == "0.32.0"
        assert ready.max_model_len == 4096 and ready.max_num_seqs == 256
        assert ready.data_parallel_rank == 0 and ready.block_size == 16
        assert engine.ready and not engine.dead


async def test_vllm_033_layout() -> None:
    async with running_engine(vllm_version="0.33.1", output_fields=19) as (_, front):
        ready = unpack(front.registration[1])
        assert len(ready) == 28
        assert list(ready)[-3:] == ["coord_store_port", "coordinator_input_address",
                                    "coordinator_output_address"]
        await front.add("a", [1, 2, 3], {"temperature": 0.0, "max_tokens": 2})
        message = unpack((await front.receive_raw())[0])
        assert len(message) == 9 and len(message[1][0]) == 19


async def test_bootstrapped_mode_rank_3() -> None:
    async with running_engine(rank=3, bootstrapped=True) as (engine, front):
        assert int(front.handshake_socket.raw.getsockopt(zmq.EVENTS)) & zmq.POLLIN == 0
        assert front.registration[0] == b"\x03\x00"
        assert decode_ready_response(front.registration[1]).data_parallel_rank == 3
        await front.add("r3", [4, 5, 6], {"temperature": 0.0, "max_tokens": 3})
        message = await front.receive()
        assert isinstance(message, RequestBatch)
        assert message.message.engine_index == 3
        tokens, last = await front.tokens("r3")
        assert len(tokens) == 2 and last.finished
        assert engine.added_ids == ["r3"]


async def test_ready_delay() -> None:
    started = time.monotonic()
    async with running_engine(faults=MockFaults(ready_delay=0.3)) as (_, front):
        assert time.monotonic() - started >= 0.3
        assert front.ready


async def test_handshake_timeout_without_init() -> None:
    """A front end that listens but never answers: the wait for INIT is the handshake
    timeout's, not the shorter one for a front end that is not there."""
    context = new_context()
    router = ZmqSocket(context, zmq.ROUTER)
    try:
        address = router.bind("tcp://127.0.0.1:*")
        engine = MockEngine(MockEngineConfig(handshake_address=address,
                                             handshake_timeout=0.6, front_end_timeout=0.1))
        started = time.monotonic()
        with pytest.raises(HandshakeTimeoutError, match="waiting for INIT") as info:
            await engine.serve()
        assert time.monotonic() - started >= 0.6
        assert info.value.stage == "INIT" and info.value.timeout == 0.6
        hello = await router.receive()
        assert hello[1].bytes == golden("h1_handshake_HELLO_engine_to_frontend", 1)
        with pytest.raises(RuntimeError, match="only once"):
            await engine.serve()
    finally:
        router.close()
        context.term()


@pytest.mark.parametrize("address", ["tcp", "ipc"])
async def test_waiting_for_a_front_end_that_is_not_there_fails_fast(
        address: str, tmp_path: Path) -> None:
    """``await tg.start(engine.serve)`` before the client connects cannot return (started
    means READY was sent, which needs the client's INIT): with nobody listening at the
    handshake address it fails after ``front_end_timeout`` (5 s by default), not after the
    300 s handshake timeout, and says what to do."""
    assert MockEngineConfig(handshake_address="tcp://127.0.0.1:1").front_end_timeout == 5.0
    where = free_tcp_address() if address == "tcp" else f"ipc://{tmp_path}/nobody"
    engine = MockEngine(MockEngineConfig(handshake_address=where, front_end_timeout=0.3))
    started = time.monotonic()
    with pytest.RaisesGroup(HandshakeTimeoutError, flatten_subgroups=True) as info:
        async with anyio.create_task_group() as tg:
            await tg.start(engine.serve)
            pytest.fail("started without a front end")
    error = info.value.exceptions[0]
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, HandshakeTimeoutError)
    elapsed = time.monotonic() - started
    assert 0.3 <= elapsed < 3, elapsed
    assert str(error).startswith(f"no front end is listening at {where} after 0.3 s "
                                 "(MockEngineConfig.front_end_timeout)")
    assert "start serve with start_soon, or connect the client first" in str(error)
    assert error.stage == "a front end" and error.timeout == 0.3 and error.missing == [0]
    assert not engine.ready


async def test_started_in_handshake_mode_waits_for_a_client_connecting_meanwhile() -> None:
    """The way ``await tg.start(engine.serve)`` works in handshake mode: the client connects
    in another task first; started then means the engine is registered (READY sent)."""
    address = free_tcp_address()
    connected = anyio.Event()
    engine = MockEngine(MockEngineConfig(handshake_address=address, linger=0))

    async def client() -> None:
        async with Client.connect(ClientConfig(engine=EngineCoreClientConfig(
                transport=HandshakeTransport(address)))):
            connected.set()
            await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(client)
        with anyio.fail_after(10):
            await tg.start(engine.serve)
            assert engine.ready
            await connected.wait()
        tg.cancel_scope.cancel()


async def test_engine_first_start(tmp_path: Path) -> None:
    """The engine may dial before the front end binds: ZeroMQ queues the HELLO."""
    address = f"ipc://{tmp_path}/handshake"  # no ephemeral TCP port to lose in between
    context = new_context()
    engine = MockEngine(MockEngineConfig(handshake_address=address))
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.serve)
            await anyio.sleep(0.1)
            router = ZmqSocket(context, zmq.ROUTER)
            try:
                router.bind(address)
                with anyio.fail_after(5):
                    hello = await router.receive()
                assert hello[0].bytes == b"\x00\x00"
            finally:
                router.close()
            tg.cancel_scope.cancel()
    finally:
        context.term()
