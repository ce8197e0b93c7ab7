"""Third parties on the handshake (and input) socket before the real engine arrives.

The choice made (docs/security.md): junk from a peer that is not one of the expected engine
identities is logged and ignored, so a port scanner or a stray tool cannot break start-up;
a malformed message from an expected engine identity, or a well-formed HELLO from an
unexpected engine rank (a misconfigured engine), is a HandshakeError at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from anyio_genout import (
    BootstrappedTransport,
    EngineCoreClient,
    EngineCoreClientConfig,
    HandshakeError,
    HandshakeTimeoutError,
    HandshakeTransport,
)
from anyio_genout.protocol import EngineStatus, StatusMessage, encode_status
from tests.engine.fake import FakeEngine, free_port
from tests.support import wait_until

from .support import RawPeer

pytestmark = pytest.mark.anyio

JUNK = settings(max_examples=8, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])


async def connect_after(junk: list[list[bytes]], *, identity: bytes | None = None,
                        ready_timeout: float = 5,
                        until: Callable[[], bool] | None = None,
                        real_engine: bool = True) -> EngineCoreClientConfig:
    """Send ``junk`` from a third-party DEALER once the client is bound, wait ``until`` the
    client has read it (or a moment), then let the real engine connect. Without
    ``real_engine`` none ever does: the client can only end on the junk (or time out)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    config = EngineCoreClientConfig(transport=HandshakeTransport(address),
                                    ready_timeout=ready_timeout)
    intruder = RawPeer(zmq.DEALER, identity=identity)
    engine = FakeEngine()
    failed: HandshakeError | None = None
    try:
        async with anyio.create_task_group() as tg:
            async def junk_then_engine() -> None:
                intruder.connect(address)  # the client is bound by now
                for frames in junk:
                    await intruder.send(frames)
                if not real_engine:
                    return
                if until is None:
                    await anyio.sleep(0.1)
                else:
                    await wait_until(until)
                await engine.handshake(address)

            tg.start_soon(junk_then_engine)
            try:
                with anyio.fail_after(10):
                    async with EngineCoreClient.connect(config) as client:
                        assert client.is_healthy and client.engine_ranks == [0]
            except HandshakeError as exc:
                failed = exc
            tg.cancel_scope.cancel()
    finally:
        intruder.close()
        engine.close()
    if failed is not None:
        raise failed
    return config


async def test_junk_from_a_stranger_is_ignored_and_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    def ignored() -> int:
        return len([r for r in caplog.records if "ignoring a message" in r.getMessage()])

    with caplog.at_level(logging.WARNING, logger="anyio_genout.engine"):
        await connect_after([[b"GET / HTTP/1.1\r\n\r\n"], [b"a", b"b", b"c"], [b"\xc1"]],
                            until=lambda: ignored() == 3)
    assert ignored() == 3


async def test_a_junk_flood_is_logged_a_bounded_number_of_times(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="anyio_genout.engine"):
        await connect_after([[b"junk %d" % i] for i in range(200)],
                            until=lambda: any("without logging" in r.getMessage()
                                              for r in caplog.records))
    assert len(caplog.records) <= 12


async def test_raw_tcp_garbage_never_reaches_the_client() -> None:
    """Not even ZMTP: ZeroMQ drops the connection before the client sees anything."""
    address = f"tcp://127.0.0.1:{free_port()}"
    config = EngineCoreClientConfig(transport=HandshakeTransport(address), ready_timeout=5)
    engine = FakeEngine()
    port = int(address.rsplit(":", 1)[1])
    try:
        async with anyio.create_task_group() as tg:
            async def garbage_then_engine() -> None:
                for _ in range(50):
                    try:
                        stream = await anyio.connect_tcp("127.0.0.1", port)
                        break
                    except OSError:
                        await anyio.sleep(0.02)
                async with stream:
                    await stream.send(b"\xff" * 64 + b"\x00" * 4096)
                    await engine.handshake(address)

            tg.start_soon(garbage_then_engine)
            with anyio.fail_after(10):
                async with EngineCoreClient.connect(config) as client:
                    assert client.is_healthy
    finally:
        engine.close()


# The error cases let no real engine connect: its HELLO, read before the junk (a loaded
# machine may move the intruder's connection last), would complete the handshake first.
# Nothing else can end the start-up then, so the junk is certainly what fails it, and not
# a timeout (whose message names no "engine 0" either).


async def test_junk_under_an_expected_engine_identity_is_a_handshake_error() -> None:
    with pytest.raises(HandshakeError, match="engine 0") as info:
        await connect_after([[b"\xc1"]], identity=b"\x00\x00", real_engine=False)
    assert not isinstance(info.value, HandshakeTimeoutError)


async def test_hello_from_an_unexpected_rank_is_a_handshake_error() -> None:
    hello = encode_status(StatusMessage(EngineStatus.HELLO))
    with pytest.raises(HandshakeError, match="unexpected engine id") as info:
        await connect_after([[hello]], identity=b"\x07\x00", real_engine=False)
    assert not isinstance(info.value, HandshakeTimeoutError)


async def test_junk_on_the_input_socket_during_registration_is_ignored() -> None:
    """Bootstrapped mode: the input socket's port is known; a stranger writes to it first."""
    inp, outp = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = EngineCoreClientConfig(
        transport=BootstrappedTransport(input_address=inp, output_address=outp), ready_timeout=5)
    intruder = RawPeer(zmq.DEALER).connect(inp)
    engine = FakeEngine()
    try:
        async with anyio.create_task_group() as tg:
            async def junk_then_engine() -> None:
                await intruder.send([b"\x00junk"])
                await intruder.send([b"a", b"b"])
                await anyio.sleep(0.05)
                await engine.register(inp, outp)

            tg.start_soon(junk_then_engine)
            with anyio.fail_after(10):
                async with EngineCoreClient.connect(config) as client:
                    assert client.is_healthy
    finally:
        intruder.close()
        engine.close()


@JUNK
@given(junk=st.lists(st.lists(st.binary(max_size=48), min_size=1, max_size=4),
                     min_size=1, max_size=4))
async def test_any_junk_from_strangers_is_survived(junk: list[list[bytes]]) -> None:
    await connect_after(junk)
