"""ENGINE_CORE_DEAD at every point: start-up, mid-stream, during a utility call.

Every open stream ends with exactly one EngineDeadError and then StopAsyncIteration; nothing
hangs; every later call fails at once with the sticky error.
"""

from __future__ import annotations

import anyio
import pytest

from anyio_genout import (
    EngineCoreClient,
    EngineCoreClientConfig,
    EngineDeadError,
    HandshakeTimeoutError,
    HandshakeTransport,
)
from anyio_genout.cli.engines import ClientSession
from anyio_genout.cli.main import build_parser
from anyio_genout.mock import MockEngine, MockEngineConfig, MockFaults
from anyio_genout.protocol import ENGINE_CORE_DEAD
from tests.cluster import generate_client, mock_cluster
from tests.engine.fake import FakeEngine, free_port
from tests.support import wait_until

from .support import drain, engine_request, generate_request

pytestmark = pytest.mark.anyio


async def assert_fails_at_once(client: EngineCoreClient) -> None:
    """Every entry point raises the sticky EngineDeadError without waiting."""
    with anyio.fail_after(1):
        with pytest.raises(EngineDeadError):
            async with client.call(engine_request("after-death")):
                pytest.fail("entered a request on a dead client")  # pragma: no cover
        with pytest.raises(EngineDeadError):
            await client.is_sleeping()
        with pytest.raises(EngineDeadError):
            await client.call_utility("get_supported_tasks")
        with pytest.raises(EngineDeadError):
            await client.abort(["after-death"])
    assert client.in_flight == 0
    assert client.pending_utility_calls == 0
    assert isinstance(client.health_error, EngineDeadError)


# ---------------------------------------------------------------- start-up


async def test_dead_before_ready_fails_connect_at_once() -> None:
    """An engine that registers, connects its output socket and sends ENGINE_CORE_DEAD
    instead of READY: connect raises EngineDeadError now, not after ready_timeout."""
    address = f"tcp://127.0.0.1:{free_port()}"
    engine = FakeEngine()
    config = EngineCoreClientConfig(transport=HandshakeTransport(address), ready_timeout=30)

    async def die_during_handshake() -> None:
        await engine.handshake(address, send_ready=False)
        await engine.send_raw([ENGINE_CORE_DEAD])

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(die_during_handshake)
            with anyio.fail_after(5), pytest.raises(EngineDeadError, match="before READY"):
                async with EngineCoreClient.connect(config):
                    pytest.fail("connected to a dead engine")  # pragma: no cover
            tg.cancel_scope.cancel()
    finally:
        engine.close()


async def test_one_of_two_engines_dead_before_ready_fails_connect() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    good, bad = FakeEngine(0), FakeEngine(1)
    config = EngineCoreClientConfig(transport=HandshakeTransport(address), engine_count=2,
                                    ready_timeout=30)

    async def die() -> None:
        await bad.handshake(address, send_ready=False)
        await bad.send_raw([ENGINE_CORE_DEAD])

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(good.handshake, address)
            tg.start_soon(die)
            with anyio.fail_after(5), pytest.raises(EngineDeadError):
                async with EngineCoreClient.connect(config):
                    pytest.fail("connected with a dead engine")  # pragma: no cover
            tg.cancel_scope.cancel()
    finally:
        good.close()
        bad.close()


async def test_engine_vanishing_after_hello_times_out_naming_the_stage() -> None:
    """No sentinel at all (the process died while loading): bounded by ready_timeout, and
    the error says which stage and which engine."""
    address = f"tcp://127.0.0.1:{free_port()}"
    engine = FakeEngine()
    config = EngineCoreClientConfig(transport=HandshakeTransport(address), ready_timeout=0.5)

    async def vanish() -> None:
        await engine.handshake(address, send_ready=False, register=False)
        engine.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(vanish)
        with anyio.fail_after(5), pytest.raises(HandshakeTimeoutError) as info:
            async with EngineCoreClient.connect(config):
                pytest.fail("connected to a vanished engine")  # pragma: no cover
    assert info.value.stage == "input registration" and info.value.missing == [0]


async def test_mock_dying_right_after_ready() -> None:
    """dead_after_steps=0: READY, then ENGINE_CORE_DEAD at once. Connect may succeed; the
    client is unhealthy moments later and refuses everything."""
    address = f"tcp://127.0.0.1:{free_port()}"
    mock = MockEngine(MockEngineConfig(handshake_address=address, linger=0.5,
                                       faults=MockFaults(dead_after_steps=0)))
    config = EngineCoreClientConfig(transport=HandshakeTransport(address), ready_timeout=10)
    async with anyio.create_task_group() as tg:
        tg.start_soon(mock.serve)
        with anyio.fail_after(5):
            try:
                async with EngineCoreClient.connect(config) as client:
                    await wait_until(lambda: not client.is_healthy)
                    await assert_fails_at_once(client)
            except EngineDeadError:
                pass  # the sentinel beat READY: connect itself failed, also correct
        assert mock.dead
        tg.cancel_scope.cancel()


async def test_ready_delay_then_death_while_connecting_is_not_a_hang() -> None:
    """A slow-loading engine (ready_delay) that is cancelled by its caller: connect ends
    with the caller's timeout, cleanly (sockets closed, no stray task)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    mock = MockEngine(MockEngineConfig(handshake_address=address, linger=0.5,
                                       faults=MockFaults(ready_delay=30)))
    config = EngineCoreClientConfig(transport=HandshakeTransport(address), ready_timeout=30)
    async with anyio.create_task_group() as tg:
        tg.start_soon(mock.serve)
        with anyio.move_on_after(0.3) as scope:
            async with EngineCoreClient.connect(config):
                pytest.fail("connected before READY")  # pragma: no cover
        assert scope.cancelled_caught
        tg.cancel_scope.cancel()


# ---------------------------------------------------------------- mid-stream


async def test_death_mid_stream_ends_every_stream_with_exactly_one_error() -> None:
    async with mock_cluster(faults=MockFaults(dead_after_steps=5)) as cluster:
        client = cluster.client
        results: dict[str, tuple[int, BaseException | None]] = {}

        async def one(i: int) -> None:
            async with client.call(engine_request(f"r{i}", max_tokens=1000)) as stream:
                items, error = await drain(stream)
                results[f"r{i}"] = (len(items), error)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for i in range(50):
                    tg.start_soon(one, i)
        assert cluster.engine.dead
        assert len(results) == 50
        for rid, (count, error) in results.items():
            assert isinstance(error, EngineDeadError), (rid, error)
            assert count <= 5
        await assert_fails_at_once(client)
        # Nothing is aborted on a dead engine.
        assert client.aborts_sent == 0


async def test_death_mid_stream_on_two_engines_fails_streams_on_both() -> None:
    faults = MockFaults(dead_after_steps=4)
    async with mock_cluster(2, faults=faults) as cluster:
        client = cluster.client
        errors: list[BaseException | None] = []
        engines: set[int] = set()

        async def one(i: int) -> None:
            async with client.call(engine_request(f"r{i}", max_tokens=1000)) as stream:
                engines.add(stream.engine_index)
                errors.append((await drain(stream))[1])

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(one, i)
        assert engines == {0, 1}
        assert len(errors) == 20 and all(isinstance(e, EngineDeadError) for e in errors)
        await assert_fails_at_once(client)


async def test_death_mid_stream_through_the_generate_layer() -> None:
    async with generate_client(faults=MockFaults(dead_after_steps=3)) as (client, cluster):
        errors: list[BaseException | None] = []

        async def one(i: int) -> None:
            async with client.generate(generate_request(f"g{i}", max_tokens=1000)) as stream:
                errors.append((await drain(stream))[1])

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for i in range(30):
                    tg.start_soon(one, i)
        assert len(errors) == 30 and all(isinstance(e, EngineDeadError) for e in errors)
        assert len(client.inflight) == 0 and cluster.client.in_flight == 0
        with anyio.fail_after(1), pytest.raises(EngineDeadError):
            async with client.generate(generate_request("after")):
                pytest.fail("entered after death")  # pragma: no cover
        assert len(client.inflight) == 0


async def test_consumer_blocked_in_anext_is_woken_by_death() -> None:
    """A stream waiting for its next output (the engine has it queued) wakes on death."""
    async with mock_cluster(mock={"max_num_seqs": 1},
                            faults=MockFaults(dead_after_steps=3)) as cluster:
        client = cluster.client
        with anyio.fail_after(5):
            async with client.call(engine_request("runs", max_tokens=1000)) as runs, \
                    client.call(engine_request("waits", max_tokens=10)) as waits:
                _, error = await drain(waits)  # queued behind "runs": never scheduled
                assert isinstance(error, EngineDeadError)
                _, error = await drain(runs)
                assert isinstance(error, EngineDeadError)


# ---------------------------------------------------------------- utility calls


async def test_death_during_a_utility_call_fails_the_call() -> None:
    """pause_scheduler(mode="wait") is answered only once running requests drain; the
    engine dies first, so the waiting call must end with EngineDeadError."""
    async with mock_cluster(faults=MockFaults(dead_after_steps=6),
                            mock={"step_time": 0.01}) as cluster:
        client = cluster.client
        async with client.call(engine_request("long", max_tokens=1000)) as stream:
            await wait_until(lambda: cluster.engine.running_ids == ["long"])
            async with anyio.create_task_group() as tg:
                async def pause() -> None:
                    with anyio.fail_after(5), pytest.raises(EngineDeadError):
                        await client.pause_scheduler(mode="wait")
                tg.start_soon(pause)
                await wait_until(lambda: client.pending_utility_calls == 1)
            _, error = await drain(stream)
            assert isinstance(error, EngineDeadError)
        assert cluster.engine.dead
        await assert_fails_at_once(client)


async def test_death_with_utility_calls_on_two_engines_pending() -> None:
    """A fan-out call waits for two engines; one dies: the call fails, no waiter is left."""
    async with mock_cluster(2, faults=MockFaults(dead_after_steps=6),
                            mock={"step_time": 0.01}) as cluster:
        client = cluster.client
        async with client.call(engine_request("a", max_tokens=1000, data_parallel_rank=0)), \
                client.call(engine_request("b", max_tokens=1000, data_parallel_rank=1)):
            await wait_until(lambda: all(e.running_ids for e in cluster.engines))
            with anyio.fail_after(5), pytest.raises(EngineDeadError):
                await client.pause_scheduler(mode="wait")
        assert client.pending_utility_calls == 0


# ---------------------------------------------------------------- why it died


async def test_engine_core_dead_says_why_when_the_engines_owner_knows() -> None:
    """The sentinel names neither engine nor cause; whoever owns the engines can tell, and
    every stream and call gets the error with that text (and nothing changes without one)."""
    async with mock_cluster(faults=MockFaults(dead_after_steps=4)) as cluster:
        client = cluster.client
        engine = cluster.engine
        client.add_death_explainer(lambda: None)  # knows nothing: adds nothing
        client.add_death_explainer(
            lambda: f"engine 0 (mock): {engine.death_reason}" if engine.dead else None)
        unregistered = client.add_death_explainer(lambda: "never asked")
        unregistered()
        async with client.call(engine_request("r", max_tokens=1000)) as stream:
            with anyio.fail_after(5):
                _, error = await drain(stream)
        expected = ("an engine core sent ENGINE_CORE_DEAD: engine 0 (mock): fault injection: "
                    "dead after 4 steps")
        assert isinstance(error, EngineDeadError) and str(error) == expected
        with pytest.raises(EngineDeadError, match="dead after 4 steps"):
            await client.is_sleeping()


async def test_the_command_lines_embedded_mock_says_why_it_died() -> None:
    """``anyio-genout generate`` with its embedded mock: the error names the engine and the
    mock's own reason (here a fatal error injected into the running mock)."""
    args = build_parser().parse_args(["generate", "--prompt-token-ids", "1,2,3"])
    session = ClientSession(args, quiet=True)
    async with session as client, \
            client.generate(generate_request("g", max_tokens=4_000)) as stream:
        session.mock_engines[0].die("AssertionError: the disk is on fire")
        with anyio.fail_after(5):
            _, error = await drain(stream)
    assert isinstance(error, EngineDeadError)
    assert str(error) == ("an engine core sent ENGINE_CORE_DEAD: engine 0 (mock): "
                          "AssertionError: the disk is on fire")
