"""Closing the client aborts what the engines still run; ``abort()`` hands its frames over.

Real mock engines, default client configuration, both backends: what the engine received is
read from the mock (``aborted_ids``, ``abort_frames``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import pytest

from anyio_genout import (
    Client,
    ClientClosedError,
    ClientConfig,
    EngineCoreClient,
    EngineCoreClientConfig,
    FinishReason,
    HandshakeTransport,
)
from anyio_genout.mock import MockEngine, MockEngineConfig
from anyio_genout.testing import input_queued
from anyio_genout.transport import free_tcp_address
from tests.faults.support import engine_request, generate_request
from tests.support import wait_until

pytestmark = pytest.mark.anyio

#: Long enough (4000 tokens at 10 ms a step) that nothing finishes during a test.
LONG = 4000


@asynccontextmanager
async def mock_engines(count: int = 1) -> AsyncIterator[tuple[str, list[MockEngine]]]:
    """``count`` mock engines dialing a free handshake address; they outlive the client
    (so the test can read what reached them after it closed) and stop at the end."""
    address = free_tcp_address()
    engines = [MockEngine(MockEngineConfig(handshake_address=address, rank=rank,
                                           step_time=0.01, linger=0.0))
               for rank in range(count)]
    async with anyio.create_task_group() as tg:
        for engine in engines:
            tg.start_soon(engine.serve)
        yield address, engines
        tg.cancel_scope.cancel()


def in_engine(engines: list[MockEngine]) -> int:
    return sum(len(e.running_ids) + len(e.waiting_ids) for e in engines)


async def aborted(engine: MockEngine, count: int) -> None:
    await wait_until(lambda: len(engine.aborted_ids) == count, 1)


async def test_leaving_the_client_aborts_every_open_stream_once_in_one_frame() -> None:
    errors: list[BaseException] = []

    async def consume(client: Client, i: int) -> None:
        async with client.generate(generate_request(f"r{i}", max_tokens=LONG)) as stream:
            try:
                async for _ in stream:
                    pass
            except ClientClosedError as exc:
                errors.append(exc)

    async with mock_engines() as (address, (engine,)):
        config = ClientConfig(engine=EngineCoreClientConfig(transport=HandshakeTransport(address)))
        async with anyio.create_task_group() as users, Client.connect(config) as client:
            for i in range(100):
                users.start_soon(consume, client, i)
            await wait_until(lambda: in_engine([engine]) == 100)
            # Left with 100 streams open in the other tasks.
        await wait_until(lambda: engine.abort_frames > 0, 2)
        await anyio.sleep(0.05)  # anything more would have arrived by now
        assert engine.abort_frames == 1
        assert len(engine.aborted_ids) == 100
        assert Counter(engine.aborted_ids) == Counter(engine.added_ids)  # each once
        assert in_engine([engine]) == 0  # the engine stopped generating for nobody
        assert engine.errors == []
    assert len(errors) == 100  # the open streams still end with ClientClosedError


async def test_closing_aborts_open_and_just_left_requests_in_one_frame_per_engine() -> None:
    errors: list[BaseException] = []

    async def consume(client: EngineCoreClient, i: int) -> None:
        async with client.call(engine_request(f"open{i}", max_tokens=LONG)) as stream:
            try:
                async for _ in stream:
                    pass
            except ClientClosedError as exc:
                errors.append(exc)

    async with mock_engines(2) as (address, engines):
        config = EngineCoreClientConfig(transport=HandshakeTransport(address), engine_count=2)
        async with anyio.create_task_group() as users, \
                EngineCoreClient.connect(config) as client:
            for i in range(60):
                users.start_soon(consume, client, i)
            await wait_until(lambda: in_engine(engines) == 60)
            # And 40 scopes left just now: their ABORTs are still queued (nothing here
            # awaits, so the abort worker has not run).
            for i in range(40):
                async with client.call(engine_request(f"left{i}", max_tokens=LONG)):
                    pass
            assert client.in_flight == 60
        await wait_until(lambda: all(e.abort_frames for e in engines), 2)
        await anyio.sleep(0.05)
        assert [e.abort_frames for e in engines] == [1, 1]
        aborted = [rid for e in engines for rid in e.aborted_ids]
        assert sorted(aborted) == sorted([f"open{i}" for i in range(60)]
                                         + [f"left{i}" for i in range(40)])
        for engine in engines:
            assert Counter(engine.aborted_ids) == Counter(engine.added_ids)
            assert engine.errors == []
        assert in_engine(engines) == 0
    assert len(errors) == 60


async def test_abort_returns_after_handing_its_frame_to_zeromq() -> None:
    async with mock_engines() as (address, (engine,)):
        config = ClientConfig(engine=EngineCoreClientConfig(transport=HandshakeTransport(address)))
        async with Client.connect(config) as client:
            for i in range(16):  # the sender task may or may not run first: never rely on it
                async with client.generate(generate_request(f"r{i}", max_tokens=LONG)) as stream:
                    await client.abort([f"r{i}"])
                    assert input_queued(client.engine) == 0, \
                        "abort() returned with its ABORT still queued"
                    await aborted(engine, i + 1)  # it reaches the engine promptly
                    outputs = [out async for out in stream]
                    assert [o.finish_reason for o in outputs] == [FinishReason.ABORT]
            # A scope just left has its ABORT queued for the abort worker: abort() of its
            # (internal) id sends it now, once.
            async with client.generate(generate_request("left", max_tokens=LONG)) as stream:
                internal = stream.request_id
            await client.engine.abort([internal])
            assert input_queued(client.engine) == 0
            # Cancelled before it starts, abort() does nothing.
            async with client.generate(generate_request("kept", max_tokens=LONG)) as stream:
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    await client.abort(["kept"])
                assert client.engine.in_flight == 1
            await anyio.sleep(0.05)
        assert engine.abort_frames == 16 + 1 + 1  # the last one: "kept", at its scope's end
        assert Counter(engine.aborted_ids) == Counter(engine.added_ids)
        assert engine.errors == []



# On asyncio a KeyboardInterrupt raised in a task leaves the event loop at once (asyncio's
# own rule), so only trio, which raises Ctrl-C in whichever task runs, can end a task of
# the client's with it.
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_ctrl_c_landing_in_the_reader_task_is_a_plain_keyboard_interrupt(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def ctrl_c(frames: object) -> None:
        raise KeyboardInterrupt

    async with mock_engines() as (address, (engine,)):
        config = EngineCoreClientConfig(transport=HandshakeTransport(address))
        with pytest.raises(KeyboardInterrupt):  # not an exception group, not a RuntimeError
            async with EngineCoreClient.connect(config) as client:
                monkeypatch.setattr(client._reader, "dispatch", ctrl_c)  # the next output
                async with client.call(engine_request("r", max_tokens=LONG)) as stream:
                    async for _ in stream:
                        pass
        await wait_until(lambda: engine.aborted_ids == ["r"], 2)  # aborted on the way out
